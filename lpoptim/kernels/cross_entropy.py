"""Cross-entropy and its gradient from a chunk of logits, in place: one kernel, two reads of the logits, one write.

Reference (nn/linear_cross_entropy.py's torch path), per row of logits x (the head's GEMM output, any float dtype)
and its target t, in fp32: with a softcap c, x <- c · tanh(x / c); lse = logsumexp(x); the row's loss is lse - x[t]
and its gradient softmax(x) - onehot(t), times (1 - tanh²(x / c)) with a cap; both zero where the target is
ignored. In torch that is about a dozen passes over the chunk's logits, most of them over an fp32 copy. Here a
program takes a row: a first sweep keeps the running maximum and the sum of exponentials (the online softmax), a
second writes the gradient over the logits in their own dtype (rounded to nearest even, as the reference's cast).
The sums run in another order than torch's and exp/tanh are the GPU's, so values differ from the reference by a
few fp32 ulps (tested with a tolerance). tanh(y) is taken as sign(y) (1 - e) / (1 + e), e = exp(-2|y|): no
overflow, and no libdevice, so the interpreter runs it too; its slope 1 - tanh² as 4e / (1 + e)², which the
reference's 1 - tanh² loses to cancellation where the cap saturates (gradients there ~1e-7 of the others).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import interpreted, store_as
from .launch import launcher, next_power_of_2

BLOCK = 4096  # logits a program reads per iteration (8 warps: 16 a thread)


@triton.jit
def _tanh(y):
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def _tanh_slope(y):
    """1 - tanh²(y) as 4e / (1 + e)², e = exp(-2|y|): no cancellation where tanh nears ±1."""
    e = tl.exp(-2.0 * tl.abs(y))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


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
    # the running maximum and sum, per lane (one reduction at the end): exp(-inf - m) = 0 starts them
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        inside = cols < V
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_CAP:
            x = CAP * _tanh(x / CAP)
        x = tl.where(inside, x, float("-inf"))  # past the row's end: nothing to the sum
        m_new = tl.maximum(m, x)  # (a NaN x is passed over: the sum below takes it)
        # a lane that has only seen -inf keeps 0 (not exp(nan)); a NaN logit makes the lane's sum NaN for good,
        # so the row's loss and gradient are NaN, as torch's
        empty = (m_new == float("-inf")) & (s == 0)
        s = tl.where(empty, 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
        s = tl.where(x != x, x, s)  # (x is that NaN)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(tl.where((m == float("-inf")) & (s == 0), 0.0, s * tl.exp(m - row_max)), axis=0)
    lse = row_max + tl.log(total)
    picked = tl.load(base + ti).to(tl.float32)
    if HAS_CAP:
        picked = CAP * _tanh(picked / CAP)
    tl.store(loss_ptr + row, tl.where(valid, tl.where(known, lse - picked, float("nan")), 0.0))
    if WANT_GRAD:
        # multiplied, as the reference does (a NaN row stays NaN)
        keep = tl.where(valid, tl.where(known, 1.0, float("nan")), 0.0)
        for v0 in range(0, V, BLOCK):
            cols = v0 + offs
            inside = cols < V
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            if HAS_CAP:
                slope = _tanh_slope(x / CAP)
                x = CAP * _tanh(x / CAP)
            g = tl.exp(x - lse) - tl.where(cols == ti, 1.0, 0.0)
            g = g * keep
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
    if logits.stride(1) != 1 or targets.shape != (rows,) or loss.shape != (rows,) or loss.dtype != torch.float32:
        raise ValueError(f"logits {tuple(logits.shape)} (rows contiguous), targets and fp32 loss of {rows} rows "
                         f"expected; got targets {tuple(targets.shape)}, loss {tuple(loss.shape)} {loss.dtype}")
    if targets.device != logits.device or loss.device != logits.device:
        raise ValueError(f"logits, targets and loss on one device; got {logits.device}, {targets.device}, "
                         f"{loss.device}")
    if rows and vocab:
        block = min(BLOCK, next_power_of_2(vocab))
        launcher(_ce_rows_kernel)((rows,), logits, targets, loss, vocab, logits.stride(0), CAP=float(softcap),
                                  HAS_CAP=bool(softcap), WANT_GRAD=bool(want_grad), BLOCK=block,
                                  ON_GPU=not interpreted(), num_warps=max(1, min(8, block // 512)))
