"""The LM head and the cross-entropy loss in one step, chunk by chunk: the logits never exist whole.

Why: at batch 4 x 2048 with a 32000-token vocabulary the logits are 262 M numbers; autocast's bf16 logits, the
fp32 copy the loss is computed in and what cross_entropy saves for backward come to about 2.6 GB (arithmetic:
262 M x (2 + 4 + 4) bytes), more than a TinyLlama's lpoptim states (2.3 GB). Here, in forward, each chunk of
tokens gets its logits, loss and the gradient with respect to the hidden states, then each slice of the
vocabulary gets its logits again, over all tokens, and the head's weight gradient; the logits are dropped.
Backward only scales the stored gradients by the incoming one. What stays is one gradient of the hidden states
(tokens x d, the compute dtype) and one of the weight (the weight's dtype) — Liger-Kernel's fused linear
cross-entropy in plain torch ops, with the weight's gradient taken by vocabulary slices so that no fp32 sum of
it exists.

Numerics are F.cross_entropy's on fp32 logits (mean over targets that are not ``ignore_index``); the logits are
computed in the hidden states' dtype, as autocast would. Tested against the unfused head and loss.
"""
from __future__ import annotations

import warnings

import torch


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b for bf16/fp16 a, b (an fp32 head under autocast). On CUDA one GEMM that adds into fp32
    (``addmm`` with ``out_dtype``, torch >= 2.9, where this torch has it): no bf16 product and fp32 copy of acc's
    size at the forward's end, where every activation is saved."""
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and addmm_accumulates_in_fp32(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += (a @ b).float()


def _logits_grad(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                 first: int) -> torch.Tensor:
    """d(summed loss)/d(logits) = softmax - onehot, in place of ``logits`` (fp32; tokens x a slice of the vocabulary
    starting at ``first``), zero for ignored tokens; ``lse``: each token's logsumexp over the whole vocabulary."""
    g = logits.sub_(lse[:, None]).exp_()
    col = targets - first
    inside = (col >= 0) & (col < g.shape[1])
    g.scatter_add_(1, col.clamp(0, g.shape[1] - 1)[:, None], -inside.to(g.dtype)[:, None])
    return g.mul_(valid[:, None])


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


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, ignore_index: int):
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        w = weight.to(h.dtype)  # the compute dtype: bf16 under autocast, as nn.Linear would run
        valid = t != ignore_index
        picks = t.clamp_min(0)
        count = valid.sum().clamp_min(1).float()  # a device tensor: no host sync
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if hidden.requires_grad else None
        lse_all = torch.empty(h.shape[0], dtype=torch.float32, device=h.device) if weight.requires_grad else None
        # pass 1, chunks of tokens: the loss, each token's logsumexp and the hidden states' gradient
        for s in range(0, h.shape[0], chunk):
            hs, ts, vs = h[s:s + chunk], picks[s:s + chunk], valid[s:s + chunk]
            logits = (hs @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, ts[:, None]).squeeze(1)
            loss += torch.where(vs, lse - picked, 0.0).sum()
            if lse_all is not None:
                lse_all[s:s + chunk] = lse
            if grad_h is not None:
                torch.matmul(_logits_grad(logits, lse, ts, vs, 0).to(h.dtype), w, out=grad_h[s:s + chunk])
        # pass 2, slices of the vocabulary over all tokens: the head's gradient, one GEMM per slice written in the
        # weight's dtype. Summing it over chunks of tokens instead needs an fp32 accumulator of the head's size (and
        # its bf16 copy at the end) alive at the forward's end, the step's peak: 0.73 GiB at a 32 k x 4096 head.
        # The price is the logits computed once more (a third more of the head's GEMM time).
        grad_w = None
        if lse_all is not None:
            fp32_sum = weight.dtype != h.dtype  # an fp32 weight under autocast: bf16 products added into fp32
            grad_w = (torch.zeros if fp32_sum else torch.empty)(weight.shape, dtype=weight.dtype, device=h.device)
            rows = max(1, chunk * w.shape[0] // max(1, h.shape[0]))  # as many logits as a chunk of pass 1
            for v in range(0, w.shape[0], rows):
                logits = (h @ w[v:v + rows].t()).float()
                g = _logits_grad(logits, lse_all, picks, valid, v).to(h.dtype)
                if fp32_sum:
                    _accumulate(grad_w[v:v + rows], g.t(), h)
                else:
                    torch.matmul(g.t(), h, out=grad_w[v:v + rows])
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.shapes = (hidden.shape, weight.dtype)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, count = ctx.saved_tensors
        hidden_shape, weight_dtype = ctx.shapes
        scale = grad_loss / count
        gh = (grad_h * scale.to(grad_h.dtype)).reshape(hidden_shape) if grad_h is not None else None
        gw = None
        if grad_w is not None and torch.is_grad_enabled() and grad_loss.requires_grad:  # a double backward
            gw = (grad_w * scale).to(weight_dtype)
        elif grad_w is not None and grad_w.dtype == weight_dtype:  # not in place: backward may run again
            gw = grad_w * scale.to(grad_w.dtype)
        elif grad_w is not None:  # written in the weight's dtype: no fp32 temporary of the head's size
            gw = torch.mul(grad_w, scale, out=torch.empty(grad_w.shape, dtype=weight_dtype, device=grad_w.device))
        return gh, gw, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk: int | None = None, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float().view(-1, V), targets.view(-1))`` without the logits.

    ``chunk``: tokens per chunk (default: about 64 MiB of fp32 logits per chunk)."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != weight's in-features {weight.shape[1]}")
    if torch.is_autocast_enabled(hidden.device.type):  # the head's GEMM in autocast's dtype, as nn.Linear
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    chunk = chunk or max(1, (64 << 20) // (4 * weight.shape[0]))
    with torch.autocast(hidden.device.type, enabled=False):
        return LinearCrossEntropyFunction.apply(hidden, weight, targets, chunk, ignore_index)
