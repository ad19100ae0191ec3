"""Block-diagonal Hadamard transform (the reference; the Triton quantizer fuses the same arithmetic).

H_b is the b×b Sylvester Hadamard matrix of ±1 (b a power of two); H_b·H_bᵀ = b·I, so H_b/√b is orthogonal
and symmetric. A block-diagonal transform applies it to every run of b consecutive elements of the last
dimension. Because it is orthogonal, (x Hᵀ... ) cancels inside a GEMM: (x Ĥ)(W Ĥ)ᵀ = x Wᵀ, and spreading each
block's outliers over the whole block makes INT4 absmax scaling lose far less (Xi et al. 2023).

Arithmetic (shared with the kernel so both round the same): multiply by the ±1 matrix with fp32 accumulation,
then by the fp32 constant 1/√b.
"""
from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def _hadamard_pm1_cpu(b: int) -> torch.Tensor:
    if b < 1 or b & (b - 1):
        raise ValueError(f"Hadamard block must be a power of two, got {b}")
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@functools.lru_cache(maxsize=64)
def _hadamard_pm1_on(b: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _hadamard_pm1_cpu(b).to(device=device, dtype=dtype)


def hadamard_pm1(b: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """The b×b Sylvester Hadamard matrix of ±1 (symmetric), cached per device: no copy to the GPU per call."""
    return _hadamard_pm1_on(b, torch.device(device), dtype)


@functools.cache  # asked on every Hadamard launch
def inv_sqrt(b: int) -> float:
    """1/√b as the fp32 number both reference and kernel multiply by."""
    return torch.tensor(1.0 / math.sqrt(b), dtype=torch.float32).item()


def block_hadamard(x: torch.Tensor, b: int) -> torch.Tensor:
    """Orthonormal block-diagonal Hadamard along the last dimension (its length must be a multiple of b), fp32."""
    n = x.shape[-1]
    if n % b:
        raise ValueError(f"last dimension {n} is not a multiple of the Hadamard block {b}")
    xb = x.float().reshape(*x.shape[:-1], n // b, b)
    y = torch.matmul(xb, hadamard_pm1(b, x.device))
    return (y * inv_sqrt(b)).reshape(x.shape)


def pick_block(n: int, block: int | None, minimum: int = 16) -> int | None:
    """The largest power of two <= ``block`` that divides ``n`` (>= ``minimum``), so small layers still work.
    None (no Hadamard transform) stays None."""
    if block is None:
        return None
    b = block
    while b >= minimum and n % b:
        b //= 2
    if b < minimum:
        raise ValueError(f"dimension {n} has no power-of-two Hadamard block between {minimum} and {block}")
    return b
