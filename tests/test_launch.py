"""kernels/launch.py: the cached launcher gives what an ordinary Triton launch gives, and never reuses a kernel
compiled for other argument properties (alignment, integer divisibility, dtypes, constexprs)."""
import pytest
import torch

from lpoptim.kernels import launch
from lpoptim.kernels.linear_quant import finite_absmax
from lpoptim.nn.operands import quantize_operand_ref
from lpoptim.quant import finite_absmax as reference_absmax


def test_spec_separates_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.float32)

    def spec(a):
        return launch._spec((a,))

    assert spec(x) != spec(x[1:])            # 16-byte aligned or not
    assert spec(x) != spec(x.to(torch.bfloat16))
    assert spec(x) == spec(x[4:])            # 16 bytes further: aligned too
    assert spec(torch.nn.Parameter(x)) == spec(x)
    assert spec(1) != spec(17)               # equal to one
    assert spec(16) != spec(17)              # divisible by 16
    assert spec(16) != spec(16 << 32)        # 32 or 64 bits
    assert spec(True) != spec(False) and spec(True) != spec(1)
    assert spec(2.0) == spec(3.0)            # floats are not specialized


def test_spec_is_at_least_as_fine_as_triton():
    """Two arguments with one key of ours get one specialization from Triton (its native classifier), so a kernel
    cached under a key never runs with arguments it was compiled for otherwise."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this Triton has no native_specialize_impl")
    big = torch.zeros(64)
    values = [0, 1, 2, 15, 16, 17, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, 2**32, 2**63 - 1, 2**63, -2**31,
              -2**31 - 1, -2**31 - 16, True, False, None, 0.5, 2.0,
              big, big[1:], big[4:], big.to(torch.bfloat16), big.to(torch.bfloat16)[8:], torch.zeros(())]
    for a in values:
        for b in values:
            if type(a) is type(b) and launch._spec((a,)) == launch._spec((b,)):
                ta = native_specialize_impl(BaseBackend, a, False, True, True)
                tb = native_specialize_impl(BaseBackend, b, False, True, True)
                assert ta == tb, (a, b, ta, tb)
    assert launch._spec(((1, 2),)) is None  # a tuple: Triton's own launch


def test_absmax_through_the_launcher():
    x = torch.randn(40, 72, device="cuda" if torch.cuda.is_available() else "cpu")  # the interpreter on the CPU
    x[3, 5] = -7.5
    x[4, 6] = float("inf")  # not finite: ignored
    for t in (x, x[1:, 1:], x.t(), x.to(torch.bfloat16)):  # aligned and not, strided, another dtype
        for _ in range(2):  # the second launch takes the cached kernel on a GPU
            assert finite_absmax(t).item() == reference_absmax(t.float()).item()


def test_bound_launch_is_the_ordinary_launch():
    """launcher(k).bind(warps, **constexprs)(grid, *args) computes what k[grid](*args, ...) does, on aligned and
    unaligned views and other strides (on a GPU through the cache it shares with the unbound launcher)."""
    from lpoptim.kernels.linear_quant import _finite_absmax_kernel
    run = launch.launcher(_finite_absmax_kernel)
    bound = run.bind(4, BLOCK_R=16, BLOCK_C=128)
    x = torch.randn(40, 72, device="cuda" if torch.cuda.is_available() else "cpu")
    x[3, 5] = -7.5
    for t in (x, x[1:, 1:], x.t(), x.to(torch.bfloat16)):
        for launch_ in (bound, lambda grid, *a: run(grid, *a, num_warps=4, BLOCK_R=16, BLOCK_C=128)):
            for _ in range(2):
                bits = torch.zeros((), device=x.device, dtype=torch.int32)
                R, C = t.shape
                launch_((launch.cdiv(R, 16),), t, bits, R, C, t.stride(0), t.stride(1))
                assert bits.view(torch.float32).item() == reference_absmax(t.float()).item()


def test_cache_keys_of_bound_and_unbound_launches(monkeypatch):
    """The cached path's bookkeeping, on any machine (Triton's launch and the compiled kernel's stubbed): a bound
    launcher and the unbound call with the same warps and constexprs share one entry; other warps, or an argument
    of other alignment, take keys of their own; every launch after a key's first runs the cached kernel."""
    from types import SimpleNamespace

    def param(name, constexpr):
        return SimpleNamespace(name=name, is_constexpr=constexpr, _param=SimpleNamespace(default=None))

    # what the launcher reads of a jit kernel: its parameters, runtime ones first (the absmax kernel's signature)
    kernel = SimpleNamespace(params=[*(param(n, False) for n in ("x", "out", "R", "C", "stride_r", "stride_c")),
                                     param("BLOCK_R", True), param("BLOCK_C", True)])
    firsts, runs = [], []

    def first(self, key, grid, args, num_warps, constexprs):
        firsts.append(key)
        self.cache[key] = ("compiled", ())

    monkeypatch.setattr(launch, "interpreted", lambda: False)
    monkeypatch.setattr(launch, "_triton_path_needed", lambda kernel: False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(launch._Launcher, "_first", first)
    monkeypatch.setattr(launch, "_run", lambda hit, grid, device, args: runs.append(hit))
    run = launch._Launcher(kernel)
    assert run.fast
    x, bits = torch.zeros(32, 64), torch.zeros((), dtype=torch.int32)
    args = (x, bits, 32, 64, 64, 1)
    bound = run.bind(4, BLOCK_R=16, BLOCK_C=128)
    for _ in range(2):
        run((2,), *args, num_warps=4, BLOCK_R=16, BLOCK_C=128)
        bound((2,), *args)
    assert len(firsts) == 1 and len(runs) == 3
    unaligned = torch.zeros(32 * 64 + 1)[1:].view(32, 64)  # 4 bytes in
    for _ in range(2):
        bound((2,), unaligned, *args[1:])
    run.bind(8, BLOCK_R=16, BLOCK_C=128)((2,), *args)
    assert len(firsts) == len(set(firsts)) == 3 and len(runs) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_launch_matches_ordinary_launch_on_gpu():
    from lpoptim.kernels.linear_quant import _finite_absmax_kernel
    run = launch.launcher(_finite_absmax_kernel)
    assert run.fast, "the absmax kernel's constexprs follow its runtime arguments"
    x = torch.randn(300, 520, device="cuda", dtype=torch.bfloat16)
    run.cache.clear()
    firsts = []
    first = run._first
    run._first = lambda *a: (firsts.append(a[0]), first(*a))[1]  # Triton's own launch, recorded
    try:
        for view in (x, x[:, 3:], x[7:]):
            for _ in range(3):
                assert finite_absmax(view).item() == view.abs().max().float().item()
    finally:
        del run._first
    # x[:, 3:] starts 6 bytes in: a key of its own; x[7:] starts 7 * 1040 bytes in, 16-byte aligned, but 293 rows
    # make another grid, not another key; every other launch took the cached kernel
    assert len(firsts) == len(set(firsts)) == 2, firsts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_tensor_quantizer_through_the_cached_launch_on_gpu():
    """The per-tensor quantizer (rows and columns) through the cached launcher: the reference's results on aligned
    and unaligned views, one cached kernel per argument key."""
    import lpoptim.kernels.linear_quant as lq
    x = torch.randn(300, 528, device="cuda", dtype=torch.bfloat16)
    amaxes = [lq.finite_absmax(view) for view in (x, x[:, 8:], x[:, 3:])]
    run = launch.launcher(lq._quant_tensor_kernel)
    run.cache.clear()
    firsts = []
    first = run._first
    run._first = lambda *a: (firsts.append(a[0]), first(*a))[1]  # Triton's own launch, recorded
    try:
        for view, amax in zip((x, x[:, 8:], x[:, 3:]), amaxes):
            for _ in range(2):
                rows, cols = lq.quantize_tensor_rows_cols(view, "e4m3", "e5m2", 528, 304, amax)
                ref_r, ref_c = (quantize_operand_ref(v, f, "tensor", None, w, amax)
                                for v, f, w in ((view, "e4m3", 528), (view.t(), "e5m2", 304)))
                assert torch.equal(rows[0].float(), ref_r.values.float()) and torch.equal(rows[1], ref_r.scale)
                assert torch.equal(cols[0].float(), ref_c.values.float()) and torch.equal(cols[1], ref_c.scale)
    finally:
        del run._first
    # one key per view: x[:, 8:] is 16-byte aligned but 520 wide (not a multiple of 16), x[:, 3:] starts 6 bytes in;
    # the second call of each took the cached kernel (Triton's own launch three times, not six)
    assert len(run.cache) == 3 and len(firsts) == len(set(firsts)) == 3, firsts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_absmax_scalars_are_distinct_and_zeroed_inside_graph_capture():
    dev = torch.device("cuda")
    # each call takes its own zero scalar: distinct results stay distinct
    x, y = torch.randn(64, 256, device=dev), torch.randn(64, 256, device=dev) * 3
    assert finite_absmax(x).item() == x.abs().max().item() and finite_absmax(y).item() == y.abs().max().item()
    # a captured graph zeroes its own scalar on every replay
    static = torch.randn(64, 256, device=dev)
    finite_absmax(static)  # compiled before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        out = finite_absmax(static)
    torch.cuda.current_stream().wait_stream(stream)
    for scale in (5.0, 1.0, 0.5):  # shrinking: a scalar left unzeroed would keep the larger maximum
        static.copy_(torch.randn(64, 256, device=dev) * scale)
        g.replay()
        torch.cuda.synchronize()
        assert out.item() == static.abs().max().item()
