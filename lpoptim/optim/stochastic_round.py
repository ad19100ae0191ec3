"""Stochastic rounding of fp32 to bf16 with counter-based random bits: the reference of the kernel's rounding.

Why: a bf16 parameter updated with round-to-nearest loses every update smaller than half its ulp (|p| / 256):
late in training, with a small learning rate, most updates vanish. Rounding up with probability equal to the
distance to the lower neighbour makes the stored value exact in expectation, so bf16 master weights (no fp32
copy: 2 bytes per parameter instead of 4) track fp32 training (tests/test_stochastic_round.py).

How: add 16 random bits to the fp32 bit pattern and truncate the low 16 bits. The random bits are a hash of
(element index, key), key = hash of (step, tensor salt): no generator state, so the kernel and this reference
draw the same bits, a resumed run draws what an uninterrupted one would, and data-parallel replicas, which
hold equal parameters and gradients, stay equal. The hash is Chris Wellons' "lowbias32" (a bijection on 32
bits); everything is done in int64 with 32-bit masks so that no product overflows.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # spreads consecutive salts over the 32-bit space


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32, in two 16-bit halves of c so that int64 never overflows."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_key(step: torch.Tensor, salt: torch.Tensor | int) -> torch.Tensor:
    """The per-(step, tensor) key, int64 in [0, 2^32), computed on the step's device (no host sync).

    ``step`` is the optimizer's fp32 step count after the increment (exact up to 2^24 steps); ``salt`` the
    parameter's index in the optimizer, so tensors of one shape do not round alike."""
    s = hash32(step.to(torch.int64) & MASK32)
    return hash32((s + _mul32(torch.as_tensor(salt, dtype=torch.int64, device=step.device), GOLDEN)) & MASK32)


def as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the int32 tensor with the same bits (what the kernel loads)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def round_bf16_stochastic(x: torch.Tensor, key: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """fp32 ``x`` -> bf16, rounded up or down at random in proportion to the distance (unbiased).

    Element i (row-major index) uses the random bits hash32(j ^ key), j = (i + offset) mod 2^32. ``offset``: where
    a shard's first element lies in the whole tensor, so a shard draws the whole tensor's bits (an FSDP2 run
    rounds as a single-process one, and shards of one tensor never share bits). Non-finite values round to
    nearest."""
    idx = (torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape) + offset) & MASK32
    noise = hash32(idx ^ key) & 0xFFFF
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & MASK32
    rounded = as_int32((bits + noise) & 0xFFFF0000).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)  # exact: the low 16 bits are zero


# 4-bit states (state_bits=4) round v stochastically onto its grid: floor(f + u), u uniform in [0, 1) from the top
# 16 bits of the hash whose low 16 round the parameter to bf16 in the same step (round_bf16_stochastic), so one hash
# per element serves both: u has steps of 2^-16 (a bias below 2^-16 of v's grid step), and the two halves of
# lowbias32's output are uncorrelated and jointly uniform over their top bits (tests/test_stochastic_round.py,
# 2^20 draws).


def uniform_noise(shape, key: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """fp32 uniforms in [0, 1) (multiples of 2^-16) of ``shape``: element i (row-major) from the top 16 bits of
    hash32(j ^ key), j = (i + offset) mod 2^32 (key: sr_key). ``offset``: where a shard's first element lies in the
    whole tensor, so a shard draws the whole tensor's bits (an FSDP2 run rounds as a single-process one)."""
    numel = 1
    for s in shape:
        numel *= s
    idx = (torch.arange(numel, device=key.device, dtype=torch.int64).view(shape) + offset) & MASK32
    return (hash32(idx ^ key) >> 16).float() * 2.0 ** -16
