"""Timing helpers the benchmark scripts share: a median timer (CUDA events on a GPU) and a profiled run that
separates wall time from GPU kernel time (their gap is host work the GPU waits on)."""
from __future__ import annotations

import statistics
import time

import torch


def timer(fn, warmup: int, iters: int, cuda: bool) -> float:
    """Median milliseconds of fn(), each call timed alone (after a synchronize on CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def back_to_back_ms(fn, iters: int) -> float:
    """Milliseconds per call of ``iters`` calls of fn() queued back to back between two CUDA events (after one
    warm-up call): the host's work overlaps the GPU's, as in a training loop, unless it is the slower."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def profile_steps(step, steps: int = 1):
    """Run ``step(i)`` for i < ``steps`` under torch.profiler (CPU and CUDA). Returns (wall ms per step, GPU kernel
    ms per step, the profiler's key_averages()); the wall time includes the profiler's own host cost."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for i in range(steps):
            step(i)
        sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in kernel_events(events)) / 1e3 / steps
    return wall_ms, gpu_ms, events


def kernel_events(events):
    """The GPU kernels among a profile's key_averages(). "Command Buffer Full" is the host waiting on a full launch
    queue, listed as a device event: not a kernel."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total
            and "command buffer full" not in e.key.lower()]
