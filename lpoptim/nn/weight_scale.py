"""A compiled layer's weight scale from its previous absmax: no absmax pass over W, nothing decided on the host.

Per-tensor current scaling reads W twice in forward: once for its absmax, once to quantize it (a 7B model's
weights are 13 GB of bf16: each read takes milliseconds of an H100 step). Under torch.compile the eager delayed
scaling (nn/delayed.py) does not apply: its ring slots are chosen on the host, which a compiled graph, and a CUDA
graph above all, would replay unchanged. A weight changes only by an optimizer step between two forwards, so its
previous absmax is a close guess, kept on the device in three int32 slots (fp32 bits): the previous absmax, this
quantization's own (an atomic maximum taken by the quantizing pass), and a ticket.

The scale's absmax is HEADROOM × the previous absmax where W's own lies in [that / 2, that], else HEADROOM ×
W's own (a second pass quantizes W again). So W never saturates and its scale is never more than twice its own
absmax (one binade of E4M3's range at most); a first call (previous 0), weights loaded or edited in place, and
uninitialized slots (a layer made on "meta", then ``to_empty``: not finite or negative counts as 0) all take W's
own. HEADROOM: a weight's absmax grows a little most steps (an Adam step moves every element by up to a few lr);
1/16 over the previous absmax covers that without a second pass, and costs 1/16 of E4M3's range at the top (its
relative precision is the same over its normal range). The second pass takes it too, so the scale does not jump
by 1/16 between a step that redid W and the next (a jump decorrelates W's rounding errors from one step to the
next, which moved an H100 7B run's loss after its first step far more than the step's own update did).

Used where LowBitLinear.previous_weight_scale is set (prepare sets it where previous_scale_pays), not with
recompute: a recomputed forward would find the state moved by the first one.

``quantize_weight_prev`` is a torch ``triton_op`` that mutates the state: on CUDA the Triton kernels
(kernels/linear_quant.py, the rule above in two launches, the second doing nothing where the guess holds), which
Inductor launches from its own code rather than through a Python custom op (whose launches ran on the host on
every call); ``take_prev_ref`` elsewhere. Inductor launches a user's Triton kernels through Triton's own Python
launcher unless its static launcher is allowed them (static_user_launches): without CUDA graphs, that launcher's
host time made a compiled 7B step slower than the absmax pass saves.
"""
from __future__ import annotations

import os

import torch

from ..formats import get_format
from ..quant import PREV_ABSMAX_HEADROOM as HEADROOM
from ..quant import PREV_SLOTS as SLOTS  # previous absmax, this call's own, the second launch's ticket
from ..quant import finite_absmax
from .operands import Operand, quantize_operand_ref


# Inductor's switch for launching user-defined Triton kernels by its static launcher. Only its environment
# variable reaches the compile workers (they read it when they start; a torch.compile option or a config patch
# stays in the parent process, while the worker that compiles a kernel chooses its launcher), so it must be set
# before Python starts.
STATIC_USER_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def static_user_launches() -> bool:
    """Whether Inductor launches user-defined Triton kernels (quantize_weight_prev's) by its static launcher, in
    this process and its compile workers: STATIC_USER_LAUNCH_ENV=1 in the environment, the static launcher on, on
    CUDA (not measured on ROCm)."""
    import torch._inductor.config as config

    return (os.environ.get(STATIC_USER_LAUNCH_ENV) == "1" and torch.version.hip is None
            and bool(getattr(config, "use_static_cuda_launcher", False))
            and bool(getattr(config, "static_launch_user_defined_triton_kernels", False)))


def previous_scale_pays(cuda_graphs: bool, activations_as_saved: bool) -> bool:
    """For compiled blocks on one CUDA device, each run once a step (not recomputed: a second forward would find
    the state moved by the first), with an fp8_delayed recipe: whether their layers should take W's previous
    absmax. As CUDA graphs (the launches off the host), or with the activations as saved (no FP8 activations,
    Inductor budget or offloading: not measured without graphs) where static_user_launches()."""
    return cuda_graphs or (activations_as_saved and static_user_launches())


def new_state(device=None) -> torch.Tensor:
    """A weight's state before its first quantization (previous absmax 0: the first takes its own)."""
    return torch.zeros(SLOTS, dtype=torch.int32, device=device)


def take_prev_ref(state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: the absmax to scale this quantization of ``w`` by (0-dim fp32; the rule in the module
    docstring), moving w's own finite absmax into the state's first slot."""
    prev = state[0].view(torch.float32)
    prev = torch.where((prev >= 0) & (prev <= torch.finfo(torch.float32).max), prev, 0.0) * HEADROOM
    own = finite_absmax(w.float()).reshape(())
    used = torch.where((own > prev) | (prev > 2 * own), own * HEADROOM, prev)
    state.copy_(torch.stack([own.view(torch.int32), *state.new_zeros(2)]))
    return used


@torch.library.triton_op("lpoptim::quantize_weight_prev", mutates_args=("state",))
def _quantize_weight_prev(w: torch.Tensor, state: torch.Tensor, fmt: str,
                          cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if w.is_cuda and w.numel():
        from ..kernels.linear_quant import quantize_weight_prev as kernels
        return kernels(w, fmt, cols, state, torch.library.wrap_triton)
    used = take_prev_ref(state, w)
    op = quantize_operand_ref(w, fmt, "tensor", None, cols, used)
    return op.values, op.scale.reshape(()), used


def quantize_weight_prev(w: torch.Tensor, fmt, cols: int, state: torch.Tensor) -> Operand:
    """W (N, K) quantized per tensor into rows of ``cols`` with the scale the state's rule gives; the Operand's
    ``amax`` is the absmax that scale came from (what the backward's Wᵀ takes)."""
    if state.shape != (SLOTS,) or state.dtype != torch.int32 or state.device != w.device:
        raise ValueError(f"the weight's scale state is ({SLOTS},) int32 on {w.device}, got {tuple(state.shape)} "
                         f"{state.dtype} on {state.device}")
    values, scale, used = _quantize_weight_prev(w, state, get_format(fmt).name, cols)
    return Operand(values, scale, used)
