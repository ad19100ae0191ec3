"""Where one training step's GPU time goes: its kernels, by kind, and the time the GPU had none to run.

``profile_step(step)`` runs ``step()`` once under torch.profiler (CUDA activity only: no CPU op tracing, which
would slow the host that launches the kernels) between two CUDA events, and sums each kernel's time into the
first kind (``KINDS``) whose name patterns it matches. Kinds are told apart by kernel name alone, so the split
is approximate where names are ambiguous (torch's foreach kernels, used by torch.optim.AdamW and by FSDP2's
copies alike, count as "other"). Kernels of several streams (communication beside compute) overlap, so the
kinds may sum to more than the step. ``idle`` is the step's time when no kernel ran: the profiler adds host
work to every launch, so a profiled step whose host sets the pace is slower than an unprofiled one; given the
unprofiled step's time (``step_seconds``), idle is that time less the profiled step's busy time.
"""
from __future__ import annotations

import torch

# (kind, substrings of a kernel's name, lower case); the first kind that matches wins, so the order matters:
# Inductor names a fused quantization kernel after the GEMM it feeds (triton_poi_fused__scaled_mm_...), and
# cuDNN's attention kernels carry "sm90" and "wgmma" as GEMMs do
KINDS = (
    ("communication", ("nccl",)),
    ("optimizer", ("adam",)),
    ("attention", ("sdpa", "flash", "fmha", "attention", "cudnn")),
    ("fp8 casts", ("quant", "amax", "scaled_mm", "float8", "fp8", "dge_grad")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "cublas")),
    ("copies", ("memcpy", "memset")),
)
OTHER = "other"  # norms, activation functions, rotary embeddings, the loss, element-wise ops
ALL_KINDS = tuple(kind for kind, _ in KINDS) + (OTHER,)


def kernel_kind(name: str) -> str:
    """The kind of a kernel, from its name."""
    lower = name.lower()
    for kind, patterns in KINDS:
        if any(p in lower for p in patterns):
            return kind
    return OTHER


def summarize(kernels: list[tuple[str, float, float]], step_seconds: float) -> dict:
    """``kernels``: (name, start, end) in seconds, of one step that took ``step_seconds``. Returns the step,
    each kind's summed kernel seconds (every kind, 0 where none ran), the seconds some kernel ran (their union)
    and the rest of the step (idle, at least 0)."""
    by_kind = dict.fromkeys(ALL_KINDS, 0.0)
    for name, start, end in kernels:
        by_kind[kernel_kind(name)] += end - start
    busy, run_start, run_end = 0.0, None, None
    for _, start, end in sorted(kernels, key=lambda k: k[1]):  # the union of the intervals
        if run_end is None or start > run_end:
            if run_end is not None:
                busy += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    if run_end is not None:
        busy += run_end - run_start
    return dict(step_seconds=step_seconds, kernel_seconds=by_kind, busy_seconds=busy,
                idle_seconds=max(0.0, step_seconds - busy))


def profile_step(step, step_seconds: float | None = None, device=None) -> dict:
    """Run ``step()`` once on the current CUDA device, profiled: summarize() of its kernels against
    ``step_seconds`` (an unprofiled step's time; default: the profiled step's), and the profiled step's time
    (``profiled_step_seconds``)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("profile_step times GPU kernels: it needs CUDA")
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
    # the GPU's events: kernels, copies and fills, not the ranges record_function marks on the GPU's timeline
    kernels = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
               and e.time_range.end > e.time_range.start]
    profiled = start.elapsed_time(end) / 1e3
    return dict(summarize(kernels, profiled if step_seconds is None else step_seconds),
                profiled_step_seconds=profiled)
