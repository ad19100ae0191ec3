"""The LM head and the cross-entropy loss in one step, chunk by chunk: the fp32 logits never exist whole.

Why: at batch 4 x 2048 with a 32000-token vocabulary the logits are 262 M numbers; autocast's bf16 logits, the
fp32 copy the loss is computed in and what cross_entropy saves for backward come to about 2.6 GB (arithmetic:
262 M x (2 + 4 + 4) bytes), more than a TinyLlama's lpoptim states (2.3 GB). Here each chunk of tokens gets its
logits, loss and gradients (with respect to the hidden states and, through the logits' gradient, the head's
weight) at once, in forward, and the logits are dropped; backward only scales the stored gradients by the
incoming one. What stays is one gradient of the hidden states (tokens x d, the compute dtype) and one of the weight
(the weight's dtype) — the approach of Liger-Kernel's fused linear cross-entropy. On CUDA a chunk's loss and
logits gradient come from one Triton kernel (kernels/cross_entropy.py), which turns the logits into their gradient
in place; on the CPU and under torch.compile, from torch ops (``_torch_chunk``, the kernel's reference). The
logits' gradient is kept whole, in the compute dtype, only where that is smaller than an fp32 sum of the weight's
gradient (few tokens), and only until the weight's gradient is taken from it.

Numerics are F.cross_entropy's on fp32 logits (mean over targets that are not ``ignore_index``); the logits are
computed in the hidden states' dtype, as autocast would. A ``softcap`` c (Gemma 2's final_logit_softcapping) takes
the loss of c · tanh(logits / c), in fp32 (HF rounds each of those steps in the model's dtype: in bf16 the losses
differ by more than without a cap), and its chain rule (1 - tanh²) in each chunk. Tested against the unfused
head and loss.
"""
from __future__ import annotations

import warnings

import torch


# Tokens per chunk: about 64 MiB of fp32 logits, but at least MIN_CHUNK_TOKENS. With a large vocabulary 64 MiB is
# a few dozen tokens, GEMMs too thin to run well: 2048 tokens, bf16, one H100 (benchmarks/loss_chunks.py), a
# 128k x 4096 head took 18.4 ms forward and backward in chunks of 130 tokens and 12.5 ms in chunks of 256 (whole
# logits: 13.4); 152k x 3584: 22.0 against 13.4 ms; Gemma 2's 256k x 3584 with its softcap: 57.2 against 22.6.
MIN_CHUNK_TOKENS = 256
CHUNK_LOGITS_BYTES = 64 << 20
# Where the kernel writes each chunk's logits into the kept logits gradient (keeps_logits_grad, on CUDA) a chunk
# makes no temporaries, so its size costs no memory: chunks of 1024 tokens ran 5-9% faster than 256 on the heads
# above (benchmarks/loss_chunks.py; 21.4 against 22.6 ms on Gemma 2's), 2048 within 2% of 1024.
IN_PLACE_CHUNK_TOKENS = 1024


def logits_chunk(vocab: int) -> int:
    """Tokens whose fp32 logits take CHUNK_LOGITS_BYTES for a head of ``vocab`` outputs (at least 1)."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab))


def default_chunk(vocab: int, in_place: bool = False) -> int:
    """Tokens per chunk for a head of ``vocab`` outputs: logits_chunk, but at least MIN_CHUNK_TOKENS (it says why),
    or IN_PLACE_CHUNK_TOKENS where the chunks' logits are written in place (``in_place``)."""
    return max(IN_PLACE_CHUNK_TOKENS if in_place else MIN_CHUNK_TOKENS, logits_chunk(vocab))


def keeps_logits_grad(tokens: int, width: int, elem: int, same_dtype: bool) -> bool:
    """Whether the forward keeps every token's logits gradient (``elem`` bytes each) rather than an fp32 sum of the
    head's gradient: a 2-byte head computed in its own dtype, with no more bytes of gradient than of sum."""
    return same_dtype and elem == 2 and tokens * elem <= 4 * width


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b. For bf16/fp16 a, b on CUDA one GEMM that adds into fp32 (``addmm`` with ``out_dtype``,
    torch >= 2.9, where this torch has it): no bf16 product and fp32 copy of acc's size at the forward's end, where
    every activation is saved."""
    if a.dtype == acc.dtype:  # fp32 products: added in place, no temporary of acc's size
        acc.addmm_(a, b)
    elif acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and addmm_accumulates_in_fp32(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += (a @ b).float()


_ADDMM_FP32: dict = {}  # (device, dtype) -> whether addmm(out_dtype=float32, out=acc) adds into an fp32 acc


def addmm_accumulates_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch adds a ``dtype`` GEMM into an fp32 tensor in place on ``device``: probed once, on small
    tensors, against the two-step sum (some versions lack the overload, or want acc in the inputs' dtype)."""
    key = (device, dtype)
    if key not in _ADDMM_FP32:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(32, 16, device=device, generator=g).to(dtype)
        b = torch.randn(16, 32, device=device, generator=g).to(dtype)
        acc = torch.ones(32, 32, device=device)
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = torch.allclose(acc, 1 + a.float() @ b.float(), rtol=1e-5, atol=1e-5)
        except (TypeError, RuntimeError, NotImplementedError):  # no such overload here
            ok = False
        if not ok:
            warnings.warn("torch.addmm(out_dtype=float32) cannot accumulate into fp32 here: the chunked head sums "
                          "its weight gradient in two steps (more memory at the peak)", stacklevel=3)
        _ADDMM_FP32[key] = ok
    return _ADDMM_FP32[key]


def use_kernel(h: torch.Tensor) -> bool:
    """The chunks' loss and logits gradient by kernels/cross_entropy.py (CUDA, eager); the torch ops otherwise
    (under torch.compile Inductor fuses them)."""
    return h.is_cuda and not torch.compiler.is_compiling()


def _torch_chunk(logits, picks, valid, softcap: float, loss, want_grad: bool):
    """A chunk's fp32 ``logits`` (overwritten): its loss added into ``loss``; returns d(its loss)/d(logits) in fp32
    (where ``want_grad``, else None). The reference of kernels/cross_entropy.py."""
    if softcap:  # as HF's Gemma 2: divided, tanh, multiplied (kept: tanh's derivative below)
        capped = torch.tanh(logits.div_(softcap))
        logits = capped * softcap
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, picks[:, None]).squeeze(1)
    loss += torch.where(valid, lse - picked, 0.0).sum()
    if not want_grad:
        return None
    # d(loss)/d(logits) = softmax - onehot, for the sum over this chunk (scaled by 1/count in backward)
    g = logits.sub_(lse[:, None]).exp_()
    g.scatter_add_(1, picks[:, None], torch.full_like(picked, -1.0)[:, None])
    g.mul_(valid[:, None])
    if softcap:  # d(c tanh(x / c))/dx = 1 - tanh^2
        g.mul_(capped.mul_(capped).neg_().add_(1.0))
    return g


def _unscaled(ctx, grad_w: torch.Tensor) -> torch.Tensor:
    """The head gradient as the forward left it, for a retained graph's later backward: the first one scaled it in
    place (by ctx.applied), so it is divided out, which a zero or non-finite first scale made impossible (checked
    here, a host sync that only a retained graph's second backward pays)."""
    if ctx.applied is None:
        return grad_w
    if not bool(torch.isfinite(ctx.applied) & (ctx.applied != 0)):
        raise RuntimeError("linear_cross_entropy: a retained graph's first backward scaled the head's gradient by "
                           f"{ctx.applied.item()}, which cannot be undone for this backward; give the first backward "
                           "a finite, non-zero incoming gradient (or run the forward again)")
    return grad_w / ctx.applied


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, ignore_index: int, softcap: float | None):
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        w = weight.to(h.dtype)  # the compute dtype: bf16 under autocast, as nn.Linear would run
        valid = t != ignore_index
        count = valid.sum().clamp_min(1).float()  # a device tensor: no host sync
        grad_h = torch.empty_like(h) if hidden.requires_grad else None
        # The head's gradient is sum_chunks g^T h. For a bf16/fp16 head computed in its own dtype, every token's
        # logits gradient kept whole takes one GEMM at the end, rounded once, where that is smaller than the fp32
        # sum of the chunks' products (and its copy in the weight's dtype at the end): this is the forward's end,
        # every activation saved, the step's peak. (At 1 x 2048 tokens and a 32 k x 4096 head: 0.12 GiB of
        # gradients against 0.49 GiB of fp32 sum and its 0.24 GiB bf16 copy.) An fp32 head's sum is its gradient.
        grads = acc = None
        if weight.requires_grad:
            if keeps_logits_grad(h.shape[0], h.shape[1], h.element_size(), h.dtype == weight.dtype):
                grads = torch.empty(h.shape[0], w.shape[0], dtype=h.dtype, device=h.device)
            else:
                acc = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        want_grad = grad_h is not None or weight.requires_grad
        kernel = use_kernel(h)
        chunk = chunk or default_chunk(w.shape[0], in_place=kernel and grads is not None)
        if kernel:  # every row's loss, summed once at the end; an ignored target as -1, a negative one that is
            # not ignored as the vocabulary's size (out of range: its row's loss is NaN)
            from ..kernels.cross_entropy import cross_entropy_rows_
            row_losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            kernel_targets = torch.where(valid, torch.where(t < 0, w.shape[0], t), -1)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            picks = torch.where(valid, t, 0)  # an ignored target indexes nothing (ignore_index may be >= 0)
        for s in range(0, h.shape[0], chunk):
            hs = h[s:s + chunk]
            if kernel:  # the logits in the compute dtype (where kept, in place), turned into their gradient
                g = torch.matmul(hs, w.t(), out=grads[s:s + chunk]) if grads is not None else hs @ w.t()
                cross_entropy_rows_(g, kernel_targets[s:s + chunk], row_losses[s:s + chunk], softcap, want_grad)
            else:
                g = _torch_chunk((hs @ w.t()).float(), picks[s:s + chunk], valid[s:s + chunk], softcap, loss,
                                 want_grad)
                if g is not None:
                    g = grads[s:s + chunk].copy_(g) if grads is not None else g.to(h.dtype)
            if grad_h is not None:
                torch.matmul(g, w, out=grad_h[s:s + chunk])
            if acc is not None:
                _accumulate(acc, g.t(), hs)
        if kernel:
            loss = row_losses.sum()
        grad_w = None
        if grads is not None:
            grad_w = grads.t() @ h
        elif acc is not None:
            # kept until backward in the weight's dtype, which is what backward returns anyway: half the bytes of
            # the fp32 sum, held through the whole backward's peak
            grad_w = acc.to(weight.dtype)
        del grads, acc
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.shapes = (hidden.shape, weight.dtype)
        ctx.applied = None  # the scale backward multiplied the saved head gradient by, in place
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, count = ctx.saved_tensors
        hidden_shape, weight_dtype = ctx.shapes
        scale = grad_loss / count
        gh = (grad_h * scale.to(grad_h.dtype)).reshape(hidden_shape) if grad_h is not None else None
        gw = None
        if grad_w is not None and torch.is_grad_enabled() and grad_loss.requires_grad:  # a double backward
            gw = (_unscaled(ctx, grad_w) * scale).to(weight_dtype)
        elif grad_w is not None and grad_w.dtype == weight_dtype:
            # scaled in place: a second copy of the head's gradient would sit at the step's peak (backward's
            # start, every activation saved). Autograd releases the saved tensor after this call unless the graph
            # is retained, so AccumulateGrad takes this very tensor; under retain_graph it copies what the graph
            # still holds, whose next backward scales from the first one's result (ctx.applied; within a rounding
            # of the weight's dtype). Through .data: the saved tensor's version stays, so that next backward may
            # unpack it. (A head weight reached through a view gets this tensor's storage as .grad even then:
            # editing that .grad in place between retained backwards makes the next one raise, as torch does for
            # a saved tensor modified in place.)
            s = scale.to(grad_w.dtype)
            if ctx.applied is None:
                grad_w.data.mul_(s)
                gw, ctx.applied = grad_w, s
            else:
                gw = _unscaled(ctx, grad_w) * s
        elif grad_w is not None:  # written in the weight's dtype: no fp32 temporary of the head's size
            gw = torch.mul(grad_w, scale, out=torch.empty(grad_w.shape, dtype=weight_dtype, device=grad_w.device))
        return gh, gw, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk: int | None = None, ignore_index: int = -100,
                         softcap: float | None = None) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float().view(-1, V), targets.view(-1))`` without the logits.

    ``chunk``: tokens per chunk (default: ``default_chunk``, about 64 MiB of fp32 logits and at least 256 tokens;
    1024 where CUDA's kernel writes the logits into their kept gradient).
    ``softcap``: the loss of ``softcap * tanh(logits / softcap)`` (Gemma 2's final_logit_softcapping); None or 0:
    none."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != weight's in-features {weight.shape[1]}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and (softcap == 0 or 0 < softcap < float("inf"))):
        raise ValueError(f"softcap must be a positive finite number, 0 or None, got {softcap!r}")
    if torch.is_autocast_enabled(hidden.device.type):  # the head's GEMM in autocast's dtype, as nn.Linear
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    with torch.autocast(hidden.device.type, enabled=False):
        return LinearCrossEntropyFunction.apply(hidden, weight, targets, chunk or 0, ignore_index, float(softcap or 0))
