"""Where one training step's GPU time goes: its kernels, by kind, and the time the GPU ran none.

``profile_step(step)`` runs ``step()`` once under torch.profiler (CUDA activity only: no CPU op tracing, which
would slow the host that launches the kernels) between two CUDA events, and sums each kernel's time into the
first kind (``KINDS``) whose name patterns it matches. Kinds are told apart by kernel name alone, so the split
is approximate where names are ambiguous (torch's foreach kernels, used by torch.optim.AdamW's foreach step and
by FSDP2's copies alike, count as "other"; Inductor kernels that fuse a quantization with other element-wise ops
count as "fp8 casts"). Kernels of several streams (communication beside compute) overlap, so the kinds may sum
to more than the step. ``idle`` is the step's time when neither a kernel nor a copy ran: the profiler adds host
work to every launch, so a profiled step whose host sets the pace is slower than an unprofiled one; given the
unprofiled step's time (``step_seconds``), idle is that time less the profiled step's busy time.
"""
from __future__ import annotations

import torch

# (kind, patterns): a kernel is of the first kind one of whose patterns its lower-case name matches; a pattern is a
# substring, or a tuple of substrings that must all be there. The order matters: Inductor names a GEMM template
# triton_tem_... and a fused quantization after the GEMM it feeds (triton_poi_fused__scaled_mm_...), and cuDNN's
# attention kernels carry "sm90" and "wgmma" as GEMMs do.
KINDS = (
    ("communication", ("nccl",)),
    ("optimizer", ("adamw", "fusedadam", "koptimizer")),  # lpoptim's, torch's fused, bitsandbytes'
    ("attention", ("sdpa", "flash", "fmha", "attention", "attn", "dot_do_o", "convert_dq")),
    ("gemm", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "triton_tem_")),
    ("fp8 casts", ("quant", "absmax", ("abs", "amax"), "scaled_mm", "float8", "fp8", "dge_grad")),
    ("copies", ("memcpy", "memset")),
)
OTHER = "other"  # norms, activation functions, rotary embeddings, the loss, element-wise ops
ALL_KINDS = tuple(kind for kind, _ in KINDS) + (OTHER,)


def _matches(name: str, pattern) -> bool:
    return pattern in name if isinstance(pattern, str) else all(p in name for p in pattern)


def kernel_kind(name: str) -> str:
    """The kind of a kernel, from its name."""
    lower = name.lower()
    for kind, patterns in KINDS:
        if any(_matches(lower, p) for p in patterns):
            return kind
    return OTHER


TOP_KERNELS = 30  # the kernels summarize() names, longest first: what a reader (or a later classification) needs


def summarize(kernels: list[tuple[str, float, float]], step_seconds: float) -> dict:
    """``kernels``: (name, start, end) in seconds, of one step that took ``step_seconds``. Returns the step,
    each kind's summed kernel seconds (every kind, 0 where none ran), the seconds some kernel ran (their union),
    the rest of the step (idle, at least 0) and the TOP_KERNELS names that took the most time, with their time."""
    by_kind = dict.fromkeys(ALL_KINDS, 0.0)
    by_name: dict[str, float] = {}
    for name, start, end in kernels:
        by_kind[kernel_kind(name)] += end - start
        by_name[name] = by_name.get(name, 0.0) + end - start
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
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return dict(step_seconds=step_seconds, kernel_seconds=by_kind, busy_seconds=busy,
                idle_seconds=max(0.0, step_seconds - busy), top_kernels=dict(top))


def gpu_events(events) -> list[tuple[str, float, float]]:
    """(name, start, end) in seconds of the profiler's GPU events: kernels, copies and fills, not the ranges
    that record_function marks on the GPU's timeline."""
    return [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and e.time_range.end > e.time_range.start]


def profile_step(step, step_seconds: float | None = None) -> dict:
    """Run ``step()`` once on the current CUDA device, profiled: summarize() of its GPU events against
    ``step_seconds`` (an unprofiled step's time; default: the profiled step's), and the profiled step's time
    (``profiled_step_seconds``). RuntimeError where the profiler saw no GPU event (another tool holding the
    GPU's profiling interface, such as Nsight Systems, leaves it none): an all-idle step would be wrong."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("profile_step times GPU kernels: it needs CUDA")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    kernels = gpu_events(prof.events())
    if not kernels:
        raise RuntimeError("torch.profiler recorded no GPU event in the step (is another profiler attached?)")
    profiled = start.elapsed_time(end) / 1e3
    return dict(summarize(kernels, profiled if step_seconds is None else step_seconds),
                profiled_step_seconds=profiled)
