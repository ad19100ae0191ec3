"""Cross-entropy and its gradient from a chunk of logits, in place: one kernel, two reads of the logits, one write.

Reference (nn/linear_cross_entropy.py's torch path), per row of logits x (the head's GEMM output, any float dtype)
and its target t, in fp32: with a softcap c, x <- c · tanh(x / c); lse = logsumexp(x); the row's loss is lse - x[t]
and its gradient softmax(x) - onehot(t), times (1 - tanh²(x / c)) with a cap; both zero where the target is
ignored. In torch that is about a dozen passes over the chunk's logits, most of them over an fp32 copy. Here a
program takes a row: a first sweep keeps the running maximum and the sum of exponentials (the online softmax, one
rescale per block), a second writes the gradient over the logits in their own dtype (rounded to nearest even, as
the reference's cast). The sums run in another order than torch's and exp/tanh are the GPU's, so values differ
from the reference by about 1e-5 relative (the tested tolerance). tanh(y) is taken as sign(y) (1 - e) / (1 + e),
e = exp(-2|y|): no overflow, and no libdevice, so the interpreter runs it too; its slope 1 - tanh² as
4e / (1 + e)², which the reference's 1 - tanh² loses to cancellation where the cap saturates (gradients there
~1e-7 of the others).

Non-finite logits: a NaN makes its row's loss and whole gradient NaN, as the reference's; so does +inf (the
reference's loss is inf there, its gradient NaN where the logit is); -inf logits count as zero probability.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .grid import interpreted, store_as
from .launch import launcher, next_power_of_2

BLOCK = 4096  # logits a program reads per iteration (8 warps: 16 a thread)


@triton.jit
def _capped(x, CAP: tl.constexpr):
    """(CAP · tanh(x / CAP), 1 - tanh²(x / CAP)): one exponential and one division an element."""
    y = x * (1.0 / CAP)
    e = tl.exp(-2.0 * tl.abs(y))
    r = 1.0 / (1.0 + e)
    t = (1.0 - e) * r
    return CAP * tl.where(y < 0, -t, t), 4.0 * e * r * r


@triton.jit
def _logits_block(base, v0, offs, V, CAP: tl.constexpr, HAS_CAP: tl.constexpr):
    """Columns v0 + offs of a row: (the columns, which lie in the row, the logits in fp32 and capped where HAS_CAP,
    the cap's slope there: 1 without a cap)."""
    cols = v0 + offs
    inside = cols < V
    x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
    slope = tl.full(x.shape, 1.0, tl.float32)
    if HAS_CAP:
        x, slope = _capped(x, CAP)
    return cols, inside, x, slope


@triton.jit
def _ce_rows_kernel(logits_ptr, targets_ptr, loss_ptr, V, stride, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
                    WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(targets_ptr + row)  # < 0: ignored
    valid = t >= 0
    known = t < V  # a target past the vocabulary makes the row's loss and gradient NaN (torch raises there)
    ti = tl.minimum(tl.maximum(t, 0), V - 1)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)  # the running maximum and the sum of exp(x - m) so far
    s = tl.full((), 0.0, tl.float32)
    for v0 in range(0, V, BLOCK):
        _, inside, x, _ = _logits_block(base, v0, offs, V, CAP, HAS_CAP)
        x = tl.where(inside, x, float("-inf"))  # past the row's end: nothing to the sum
        # (the maximum passes a NaN over; exp(NaN - m) then makes the sum NaN for good, as the reference's)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        seen = m_new != float("-inf")  # else only -inf so far: the sum stays 0 (not exp(-inf + inf))
        s = tl.where(seen, s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0), s)
        m = m_new
    lse = m + tl.log(s)
    picked = tl.load(base + ti).to(tl.float32)
    if HAS_CAP:
        picked, _ = _capped(picked, CAP)
    tl.store(loss_ptr + row, tl.where(valid, tl.where(known, lse - picked, float("nan")), 0.0))
    if WANT_GRAD:
        # multiplied, as the reference does (a NaN row stays NaN)
        keep = tl.where(valid, tl.where(known, 1.0, float("nan")), 0.0)
        for v0 in range(0, V, BLOCK):
            cols, inside, x, slope = _logits_block(base, v0, offs, V, CAP, HAS_CAP)
            g = (tl.exp(x - lse) - tl.where(cols == ti, 1.0, 0.0)) * keep
            if HAS_CAP:
                g = g * slope
            store_as(base + cols, g, inside, logits_ptr.dtype.element_ty, ON_GPU)


def cross_entropy_rows_(logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, softcap: float = 0.0,
                        want_grad: bool = True) -> None:
    """Row i of 2-D ``logits`` (rows contiguous) against ``targets[i]`` (int64, < 0: ignored): its loss into
    ``loss[i]`` (fp32) and, with ``want_grad``, d(its loss)/d(logits) over the logits themselves, in their dtype.
    A target at or past the vocabulary gives its row a NaN loss and gradient (checking on the host would wait for
    the GPU; torch's cross-entropy stops the device there)."""
    rows, vocab = logits.shape
    if (logits.stride(1) != 1 or targets.shape != (rows,) or targets.dtype != torch.int64 or targets.stride(0) != 1
            or loss.shape != (rows,) or loss.dtype != torch.float32 or loss.stride(0) != 1):
        raise ValueError(f"logits {tuple(logits.shape)} (rows contiguous), contiguous int64 targets and fp32 loss of "
                         f"{rows} rows expected; got targets {tuple(targets.shape)} {targets.dtype} stride "
                         f"{targets.stride()}, loss {tuple(loss.shape)} {loss.dtype} stride {loss.stride()}")
    if targets.device != logits.device or loss.device != logits.device:
        raise ValueError(f"logits, targets and loss on one device; got {logits.device}, {targets.device}, "
                         f"{loss.device}")
    if rows and vocab:
        block = min(BLOCK, next_power_of_2(vocab))
        # the launcher takes the current device's stream: the logits' device made current (a head on another GPU)
        with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():
            launcher(_ce_rows_kernel)((rows,), logits, targets, loss, vocab, logits.stride(0), CAP=float(softcap),
                                      HAS_CAP=bool(softcap), WANT_GRAD=bool(want_grad), BLOCK=block,
                                      ON_GPU=not interpreted(), num_warps=max(1, min(8, block // 512)))
