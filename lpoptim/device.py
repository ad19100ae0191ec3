"""What a GPU can do that lpoptim's kernels depend on: FP8 conversions.

Triton compiles its fp8e4nv type (E4M3, the format of FP8 activations, linear layers and optimizer states) only
for NVIDIA GPUs of compute capability 8.9 or more (Ada, Hopper, Blackwell). On older ones (A100, A10,
RTX 30xx: 8.0-8.6) lpoptim.AdamW's kernel converts its codes by integer arithmetic instead; FP8 activations and low-bit
linear layers are refused there: before anything changes where lpoptim sees the GPU (convert_linears,
compress_activations, prepare), and at the first launch (kernels/launch.py) for a layer moved there afterwards.
"""
from __future__ import annotations

import functools

import torch

FP8_CAPABILITY = (8, 9)


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index`` ((9, 0) under ROCm, whose Triton backend has FP8 types)."""
    if torch.version.hip:
        return (9, 0)
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def has_fp8_conversions(device: torch.device) -> bool:
    """Whether Triton compiles FP8 conversions for ``device`` (any device that is not CUDA: True)."""
    return device.type != "cuda" or capability(_index(device)) >= FP8_CAPABILITY


def fp8_device_problem(tensors, what: str) -> str | None:
    """Why ``what`` cannot run on these tensors' devices (the first CUDA device among them without FP8
    conversions), or None."""
    for t in tensors:
        if not has_fp8_conversions(t.device):
            return no_fp8_message(t.device, what)
    return None


def no_fp8_message(device: torch.device, what: str) -> str:
    major, minor = capability(_index(device))
    return (f"{what} need a GPU with FP8 conversions (compute capability 8.9 or more: Ada, Hopper, Blackwell); "
            f"{device} has {major}.{minor}. lpoptim.AdamW (FP8 or 4-bit states) runs there; on the CPU {what} run "
            f"emulated")
