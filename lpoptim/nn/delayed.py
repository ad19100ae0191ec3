"""Delayed per-tensor scaling: x's, dy's and W's scales from the absmax of their last quantizations.

A per-tensor scale taken from the tensor itself ("current" scaling) needs the absmax before any value can be
quantized: a pass over the tensor of its own. On a 16384 × 4096 activation that pass is ~45 µs of the ~1.5 ms an
FP8 layer step takes on an H100, once for x and once for dy (and ~27 µs for a 4096 × 4096 weight). Delayed scaling (Transformer Engine's default
DelayedScaling) takes the scale from the largest absmax of the last ``length`` quantizations of the same operand
instead, so one pass quantizes and records the new absmax on the way. Where the tensor's own absmax exceeds
the history's (the first call; a jump, such as a gradient spike), Transformer Engine saturates the values beyond
the range; here a second pass quantizes the tensor again with its own scale, so nothing saturates: the scale is
max(history, own absmax), never smaller than current scaling's. (Saturating made the CPU quality run's loss 1.3%
worse than fp32, over the 1% the fp8 recipes must hold: tests/test_linear_quality.py.)

The history of one layer is a (3, length + 2) int32 tensor (LowBitLinear.amax_history), x's ring in row 0, dy's
in row 1 and W's in row 2 (a per-tensor fp8 forward: its scale also scales Wᵀ in backward), holding absmax values
as fp32 bits (|x| orders as its bits, so integer atomics take the maximum).
Quantization number n of an operand writes slot n % (length + 2) and zeroes slot (n + 1) % (length + 2); its scale
comes from the other ``length`` slots, the absmax of quantizations n - 1 ... n - length (zeros where fewer happened).

Limits. A forward recomputed under activation checkpointing records again: a step then takes two of x's slots (the
window spans half as many steps), and the recomputed xᵀ may take a larger scale than the first forward's x did
(both cover x; neither saturates); the same holds for W. LowBitLinear's forwards without grad (evaluation) use
current scaling and record nothing (the functional form records whatever histories it is given). The
slots are chosen on the host, so a layer must not quantize on two streams at once; LowBitLinear uses current
scaling while a CUDA graph is captured (a replay would reuse the captured slots). Compiled, the histories are not
used: x and dy take current scaling, W its previous absmax kept on the device (nn/weight_scale.py).
"""
from __future__ import annotations

import torch

from ..quant import finite_absmax

X, GRAD, WEIGHT = 0, 1, 2  # rows of the history buffer: the layer's input, its output's gradient, its weight
ROLES = (X, GRAD, WEIGHT)


def new_history(length: int, device=None) -> torch.Tensor:
    """The (3, length + 2) int32 history of one layer (zeros: no quantization yet)."""
    if length < 1:
        raise ValueError(f"amax_history must be at least 1, got {length}")
    return torch.zeros(len(ROLES), length + 2, dtype=torch.int32, device=device)


class AmaxHistory:
    """One operand's ring in a layer's history buffer, and how many quantizations it has seen.

    ``calls`` is a list shared with the layer (the count lives on the host: reading it from the GPU would
    synchronize every step)."""

    __slots__ = ("bits", "calls", "role")

    def __init__(self, bits: torch.Tensor, calls: list, role: int):
        if bits.dim() != 2 or bits.shape[0] != len(ROLES) or bits.dtype != torch.int32:
            raise ValueError(f"the history buffer is ({len(ROLES)}, length + 2) int32, got {tuple(bits.shape)} "
                             f"{bits.dtype}")
        self.bits, self.calls, self.role = bits, calls, role

    @property
    def slots(self) -> int:
        return self.bits.shape[1]

    def advance(self) -> tuple[int, int, int]:
        """(offset of this ring in the flat buffer, slot to write, slot to zero), and count this quantization."""
        n = self.calls[self.role]
        self.calls[self.role] = n + 1
        s = self.slots
        return self.role * s, n % s, (n + 1) % s

    def take_ref(self, x: torch.Tensor) -> torch.Tensor:
        """Reference (torch ops): the absmax to scale this quantization of ``x`` with (0-dim fp32), recording x's
        own finite absmax: the history's largest, or x's own where that is larger (always on the first call).
        What kernels/linear_quant.py's delayed quantizer computes, in one pass where the history covers x."""
        offset, write, zero = self.advance()
        current = finite_absmax(x.float()).reshape(())
        used = torch.maximum(self.window_amax(write, zero), current)
        ring = self.bits.view(-1)[offset: offset + self.slots]
        ring[write] = current.view(torch.int32)
        ring[zero] = 0
        return used

    def window_amax(self, write: int, zero: int) -> torch.Tensor:
        """The largest absmax in the ring but slots ``write`` and ``zero`` (0-dim fp32; 0 when none recorded)."""
        ring = self.bits[self.role].clone()
        ring[write] = 0  # integer indices: no index tensor copied to the device (a list index would be, and wait)
        ring[zero] = 0
        return ring.amax().view(torch.float32)
