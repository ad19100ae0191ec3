"""A leaner way to launch lpoptim's Triton kernels from eager code.

``kernel[grid](*args, **constexprs)`` binds every argument, works out Triton's specialization and looks the compiled
kernel up on each call: 28-49 us of host time on H100 hosts (triton 3.6; 200 calls queued without a synchronize;
benchmarks/host_costs.py and its files, in git history at commit 038516f), where the compiled kernel's own
launcher takes 7-11. An eager low-bit linear step makes seven such launches, and
at 4096 x 4096 its host work was most of the step. ``launcher(kernel)`` keeps, per specialization key of its own, the
compiled kernel that the first ordinary launch returned, and calls its launcher directly afterwards.

The key is at least as fine as Triton's own: per tensor its dtype and whether its address is 16-byte aligned, per
integer whether it is 1, divisible by 16 and which width it needs, and the constexprs, warps and device; so a
cached kernel never runs with arguments its compilation assumed otherwise. The interpreter, Triton's launch hooks
(profilers) and anything this Triton's launcher does not take go through the ordinary launch.
"""
from __future__ import annotations

import torch

from ..device import no_fp8_message
from .grid import interpreted


def _int_spec(a: int) -> tuple:
    return (a == 1, not a & 15, -(1 << 31) <= a < (1 << 31), a < (1 << 63))


_INT_SPECS: dict = {}  # the spec of each integer seen (shapes, strides, offsets: a few hundred in a model)


def _spec(args) -> tuple | None:
    """What Triton specializes the runtime arguments on (or finer): per tensor its dtype and 16-byte alignment, per
    integer whether it is 1, divisible by 16, and which of int32 / int64 / uint64 it needs; bools and None as they
    are; floats by type. None for any other argument (a tuple, a tensor descriptor): Triton's own launch then.
    Dispatched on the exact type first: this runs on every launch (a few microseconds of an eager layer's host time)."""
    spec = []
    for a in args:
        t = type(a)
        if t is int:
            s = _INT_SPECS.get(a)
            if s is None:
                s = _int_spec(a)
                if len(_INT_SPECS) < 65536:  # bounded: a stream of distinct integers recomputes instead
                    _INT_SPECS[a] = s
            spec.append(s)
        elif a is None or t is bool:
            spec.append(a)
        elif isinstance(a, torch.Tensor):
            spec.append((a.dtype, not a.data_ptr() & 15))
        elif t is float:
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
        return self._launch(grid, args, num_warps, constexprs, (num_warps, tuple(constexprs.items())))

    def _launch(self, grid, args, num_warps: int, constexprs: dict, const_key: tuple, local: dict | None = None):
        """The launch: the cached kernel for (device, ``const_key``, the arguments' spec), else Triton's own.
        ``local``: a bound launcher's own cache by (device, spec), which spares hashing ``const_key``."""
        spec = _spec(args) if self.fast and not interpreted() and len(args) == self.n_runtime else None
        if spec is None or _triton_path_needed(self.kernel):
            return _ordinary(self.kernel, grid, args, num_warps, constexprs)
        device = torch._C._cuda_getDevice()  # torch.cuda.current_device() without its Python checks
        hit = local.get((device, spec)) if local is not None else None
        if hit is None:
            key = (device, *const_key, spec)
            hit = self.cache.get(key)
            if hit is None:
                return self._first(key, grid, args, num_warps, constexprs)
            if local is not None:
                local[(device, spec)] = hit
        return _run(hit, grid, device, args)

    def bind(self, num_warps: int = 4, **constexprs) -> "_Bound":
        """This kernel with its constexprs and warps fixed: ``bind(...)(grid, *args)`` launches as
        ``self(grid, *args, num_warps=..., **constexprs)`` does, without building their part of the key per call
        (for a caller that keeps the bound launcher, one per configuration)."""
        return _Bound(self, num_warps, constexprs)

    def _first(self, key, grid, args, num_warps, constexprs):
        ck = _ordinary(self.kernel, grid, args, num_warps, constexprs)
        if ck is not None and getattr(ck, "function", None) is not None:
            consts = tuple(constexprs.get(n, self.defaults[n]) for n in self.const_names)
            self.cache[key] = (ck, consts)
        return ck


class _Bound:
    __slots__ = ("launcher", "num_warps", "constexprs", "const_key", "cache")

    def __init__(self, launcher: _Launcher, num_warps: int, constexprs: dict):
        self.launcher, self.num_warps, self.constexprs = launcher, num_warps, constexprs
        self.const_key = (num_warps, tuple(constexprs.items()))
        self.cache: dict = {}  # (device, spec) -> the launcher's cache entry

    def __call__(self, grid, *args):
        return self.launcher._launch(grid, args, self.num_warps, self.constexprs, self.const_key, self.cache)


def _ordinary(kernel, grid, args, num_warps: int, constexprs: dict):
    """Triton's own launch (which compiles on first use). A kernel with FP8 types compiled for a GPU without FP8
    conversions (a layer moved there after lpoptim's checks) fails with Triton's terse error: said plainly here."""
    try:
        return kernel[grid](*args, num_warps=num_warps, **constexprs)
    except Exception as e:
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        if "fp8e4nv not supported in this architecture" not in str(cause):
            raise
        device = torch.device("cuda", torch.cuda.current_device())
        raise RuntimeError(f"lpoptim: {no_fp8_message(device, 'FP8 activations and low-bit linear layers')}") from e


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


_LAUNCHERS: dict = {}


def launcher(kernel) -> _Launcher:
    """The cached launcher of a ``@triton.jit`` kernel: ``launcher(k)(grid, *runtime_args, num_warps=, **constexprs)``
    does what ``k[grid](*runtime_args, num_warps=, **constexprs)`` does."""
    found = _LAUNCHERS.get(kernel)
    if found is None:
        found = _LAUNCHERS[kernel] = _Launcher(kernel)
    return found
