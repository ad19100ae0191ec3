"""A leaner way to launch lpoptim's Triton kernels from eager code.

``kernel[grid](*args, **constexprs)`` binds every argument, works out Triton's specialization and looks the compiled
kernel up on each call: about 29 us of host time on an H100 host (triton 3.6), where the compiled kernel's own
launcher takes about 7 (benchmarks/host_costs.py). An eager low-bit linear step makes seven such launches, and at
4096 x 4096 its host work was most of the step. ``launcher(kernel)`` keeps, per specialization key of its own, the
compiled kernel that the first ordinary launch returned, and calls its launcher directly afterwards.

The key is at least as fine as Triton's own: per tensor its dtype and whether its address is 16-byte aligned, per
integer whether it is 1, divisible by 16 and which width it needs, and the constexprs, warps and device; so a
cached kernel never runs with arguments its compilation assumed otherwise. The interpreter, Triton's launch hooks
(profilers) and anything this Triton's launcher does not take go through the ordinary launch.
"""
from __future__ import annotations

import torch

from .grid import interpreted


def _spec(args) -> tuple | None:
    """What Triton specializes the runtime arguments on (or finer): per tensor its dtype and 16-byte alignment, per
    integer whether it is 1, divisible by 16, and which of int32 / int64 / uint64 it needs; bools and None as they
    are; floats by type. None for any other argument (a tuple, a tensor descriptor): Triton's own launch then."""
    spec = []
    for a in args:
        t = type(a)  # exact types first: isinstance chains were most of this function's time
        if t is int:
            spec.append((a == 1, not a & 15, -(1 << 31) <= a < (1 << 31), a < (1 << 63)))
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            spec.append((a.dtype, not a.data_ptr() & 15))
        elif a is None or t is bool:
            spec.append(a)
        elif t is float:
            spec.append(float)
        elif isinstance(a, int):  # an int subclass (bool is handled above)
            spec.append((a == 1, not a & 15, -(1 << 31) <= a < (1 << 31), a < (1 << 63)))
        elif isinstance(a, float):
            spec.append(float)
        else:
            return None
    return tuple(spec)


class _Launcher:
    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)  # the interpreter's kernels have none: ordinary launches
        self.n_runtime = sum(not p.is_constexpr for p in params or ())
        # the fast path passes runtime arguments, then constexprs: they must come in that order in the signature
        self.fast = bool(params) and all(p.is_constexpr for p in params[self.n_runtime:])
        self.const_names = [p.name for p in params[self.n_runtime:]] if self.fast else []
        self.defaults = {p.name: p._param.default for p in params[self.n_runtime:]} if self.fast else {}
        self.cache: dict = {}

    def __call__(self, grid, *args, num_warps: int = 4, **constexprs):
        spec = _spec(args) if self.fast and not interpreted() and len(args) == self.n_runtime else None
        if spec is None or _triton_path_needed(self.kernel):
            return self.kernel[grid](*args, num_warps=num_warps, **constexprs)
        device = torch._C._cuda_getDevice()  # torch.cuda.current_device() without its Python checks
        key = (device, num_warps, tuple(constexprs.items()), spec)
        hit = self.cache.get(key)
        if hit is None:
            return self._first(key, grid, args, num_warps, constexprs)
        return _run(hit, grid, device, args)

    def bind(self, num_warps: int = 4, **constexprs) -> "_Bound":
        """This launcher with its constexprs and warps fixed: ``bind(...)(grid, *args)`` launches as
        ``self(grid, *args, num_warps=..., **constexprs)`` does, without hashing the constexprs on every call (for a
        caller that keeps the bound launcher, one per configuration)."""
        return _Bound(self, num_warps, constexprs)

    def _first(self, key, grid, args, num_warps, constexprs):
        ck = self.kernel[grid](*args, num_warps=num_warps, **constexprs)
        if ck is not None and getattr(ck, "function", None) is not None:
            consts = tuple(constexprs.get(n, self.defaults[n]) for n in self.const_names)
            self.cache[key] = (ck, consts)
        return ck


class _Bound:
    def __init__(self, launcher: _Launcher, num_warps: int, constexprs: dict):
        self.launcher, self.num_warps, self.constexprs = launcher, num_warps, constexprs
        self.const_key = (num_warps, tuple(constexprs.items()))
        self.cache: dict = {}  # (device, spec) -> (compiled kernel, constexpr values)

    def __call__(self, grid, *args):
        lau = self.launcher
        spec = _spec(args) if lau.fast and not interpreted() and len(args) == lau.n_runtime else None
        if spec is None or _triton_path_needed(lau.kernel):
            return lau.kernel[grid](*args, num_warps=self.num_warps, **self.constexprs)
        device = torch._C._cuda_getDevice()
        hit = self.cache.get((device, spec))
        if hit is None:
            ck = lau._first((device, *self.const_key, spec), grid, args, self.num_warps, self.constexprs)
            hit = lau.cache.get((device, *self.const_key, spec))
            if hit is not None:
                self.cache[(device, spec)] = hit
            return ck
        return _run(hit, grid, device, args)


def _run(hit, grid, device: int, args):
    """Launch a cached (compiled kernel, constexpr values) through the compiled kernel's own launcher."""
    ck, consts = hit
    ck.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
           torch._C._cuda_getCurrentRawStream(device), ck.function, ck.packed_metadata, None, None, None,
           *args, *consts)
    return ck


def _knobs():
    """Triton's runtime and compilation settings; (None, None) for a Triton without knobs (before 3.3), whose
    launchers also take the runtime arguments alone, not every parameter as here: its own path always then."""
    try:
        from triton import knobs
        return knobs.runtime, getattr(knobs, "compilation", None)
    except (ImportError, AttributeError):
        return None, None


_RUNTIME, _COMPILATION = _knobs()


def _triton_path_needed(kernel) -> bool:
    """Whether this launch must go through Triton's own path: a launch hook is installed (a profiler such as proton;
    an empty HookChain, triton >= 3.5, is none), or something Triton reads per launch and this cache's key does not
    hold is set (debug mode, instrumentation, a stage-inspection hook, the kernel's pre-run hooks). Read per launch:
    any of them can be set at any time."""
    if _RUNTIME is None:
        return True
    for hook in (_RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    if getattr(_RUNTIME, "debug", False) or getattr(kernel, "debug", False) or getattr(kernel, "pre_run_hooks", None):
        return True
    if getattr(_RUNTIME, "add_stages_inspection_hook", None) is not None:
        return True
    return bool(getattr(_COMPILATION, "instrumentation_mode", None))


def cdiv(a: int, b: int) -> int:
    """triton.cdiv without its cost: there it is a jit function, a few microseconds a call from Python."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 (n >= 1), likewise a plain function."""
    return 1 << (n - 1).bit_length()


class _ZeroScalars:
    """int32 zeros (+0.0 as fp32 bits) for the atomic maxima of the absmax passes, without a ``torch.zeros`` (an
    allocation and a fill launch, 15-40 us of host time) each: views into blocks of ``BLOCK`` zeros, one
    ``torch.zeros`` a block, per device and stream (the block's fill is ordered before every use on its stream).
    A block is never zeroed again: a new one follows when it is used up, and the old one's memory goes back to
    the allocator with the last view. Every fourth element is handed out, so that each scalar is 16-byte aligned
    like a fresh allocation (the kernels' launch keys, and Triton's specializations, stay the same). While a CUDA
    graph is being captured, plain ``torch.zeros`` (the replays must zero the scalar each time)."""

    BLOCK = 4096  # int32 elements: 1024 scalars a block

    def __init__(self):
        self.blocks: dict = {}  # (device index, stream) -> [block, next index]

    def take(self, device: torch.device) -> torch.Tensor:
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return torch.zeros((), device=device, dtype=torch.int32)
        index = device.index if device.index is not None else torch._C._cuda_getDevice()
        key = (index, torch._C._cuda_getCurrentRawStream(index))
        entry = self.blocks.get(key)
        if entry is None or entry[1] == self.BLOCK:
            entry = self.blocks[key] = [torch.zeros(self.BLOCK, device=device, dtype=torch.int32), 0]
        entry[1] += 4
        return entry[0][entry[1] - 4]


zero_scalar = _ZeroScalars().take

_LAUNCHERS: dict = {}


def launcher(kernel) -> _Launcher:
    """The cached launcher of a ``@triton.jit`` kernel: ``launcher(k)(grid, *runtime_args, num_warps=, **constexprs)``
    does what ``k[grid](*runtime_args, num_warps=, **constexprs)`` does."""
    found = _LAUNCHERS.get(kernel)
    if found is None:
        found = _LAUNCHERS[kernel] = _Launcher(kernel)
    return found
