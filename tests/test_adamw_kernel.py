"""The fused Triton step against the pure-torch reference: under the interpreter on the CPU, compiled on a GPU.

Both compute the same fp32 operations in the same order, and the kernel rounds onto the FP8 grid itself, so
under the interpreter they agree closely: the bias corrections differ by a few ulps (the kernel takes beta^t as
exp2(t log2 beta) there, the interpreter having no libdevice; on the GPU it is CUDA's powf, as torch's), and where
fp32 results differ in the last bit a group scale or a code moves by one step. On the GPU the compiler may also
fuse multiply-adds; the bound below allows a few codes to move one grid step, nothing more.
"""
import pytest
import torch
import triton
import triton.language as tl

from lpoptim.kernels import adamw_step as kernel
from lpoptim.kernels.grid import fp8_bits, fp8_value
from lpoptim.optim.reference import load_moment, reference_adamw_step
from lpoptim.optim.state import StateLayout, init_state, stored_moment
from lpoptim.quant import to_groups

from kernel_steps import kernel_and_reference, non_finite_grad

SHAPES = [(48, 256), (5, 200), (1000,), (3, 7, 130), (16, 128)]


@pytest.fixture(autouse=True)
def _tiles(interpreter_friendly_tiles):  # conftest.py
    yield


TUNED = kernel.TUNING  # the module's own launch settings, before a fixture swaps in the interpreter's


def _run(device, dtype, steps=3, amsgrad=False, maximize=False, lr=1e-2, layout=None, grad_scale=None, found_inf=None):
    layout = layout or StateLayout(quantized=True)
    return (*kernel_and_reference(device, dtype, layout, SHAPES, steps, amsgrad, maximize, lr, grad_scale, found_inf),
            layout)


def _compare(params, ref_p, states, ref_s, layout, code_tol=0.002, scale_tol=0.02):
    """Kernel and reference agree: step counts exactly; group scales in all but a few groups (the kernel's
    approximate lg2 can put k on the other side of a grid boundary, a different but equally valid encoding);
    codes within groups of equal scales but for a few ulp-level ties; decoded moments closely; parameters to a
    few ulps of the parameter plus 2^-13 of the update."""
    groups = diff_groups = far = elements = 0
    for p, rp, s, rs in zip(params, ref_p, states, ref_s):
        assert torch.equal(s["step"], rs["step"])
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            stored, ref_stored = stored_moment(s, name), stored_moment(rs, name)
            if stored is None:
                continue
            a, b = load_moment(s, name, layout), load_moment(rs, name, layout)
            assert torch.equal(a.isnan(), b.isnan()), f"{name} {tuple(p.shape)}: NaNs differ"
            a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
            rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            # a group whose k landed on the other side of a grid boundary is encoded differently (each encoding
            # within ~1.5% of the value): a tensor of ten groups may then differ by ~0.5%
            assert rel < 1e-2, f"{name} {tuple(p.shape)}: relative difference {rel}"
            if not layout.quantized:
                continue
            same = s[name + "_scale"] == rs[name + "_scale"]
            groups += same.numel()
            diff_groups += int((~same).sum())
            codes_a = to_groups(stored.view(torch.int8).float(), layout.group_size)[same]
            codes_b = to_groups(ref_stored.view(torch.int8).float(), layout.group_size)[same]
            moved = (codes_a != codes_b).float().mean().item() if codes_a.numel() else 0.0
            assert moved <= code_tol, f"{name} {tuple(p.shape)}: {moved:.4%} of codes differ in equal-scale groups"
        # a few ulps of the parameter, and 2^-13 of the update (~lr = 1e-2): the kernel takes its powers in the
        # log domain with approximate lg2/ex2/rcp, so a group absmax may move by an ulp, and when that crosses
        # the scale's code bits (its low mantissa byte) the group's scale, and so its moments, move by 2^-15
        eps = torch.finfo(p.dtype).eps
        assert torch.equal(p.isnan(), rp.isnan()), f"{tuple(p.shape)}: NaN parameters differ"
        tol = 4 * eps * rp.float().abs() + max(4 * eps, 2.0 ** -13) * 1e-2
        far += int(((p.float() - rp.float()).abs() > tol).sum())  # a code that moved one grid step
        elements += p.numel()
    assert far <= max(2, 1e-3 * elements), f"{far} of {elements} parameters differ by more than a few ulps"
    assert diff_groups <= max(2, scale_tol * groups), f"{diff_groups} of {groups} group scales differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference_interpreter(dtype):
    params, ref_p, states, ref_s, layout = _run("cpu", dtype)
    _compare(params, ref_p, states, ref_s, layout)
    if dtype == torch.bfloat16:  # a last-bit fp32 difference almost never survives rounding to bf16
        assert sum(int((p != rp).sum()) for p, rp in zip(params, ref_p)) <= 2


@pytest.mark.parametrize("opts", [dict(amsgrad=True), dict(maximize=True), dict(lr=torch.tensor(3e-3)),
                                  dict(layout=StateLayout(True, "e4m3", "e5m2", 64, False, False)),
                                  dict(layout=StateLayout(True, group_size=32, sqrt_v=False)),
                                  dict(layout=StateLayout(False), amsgrad=True)])
def test_kernel_options_interpreter(opts):
    _compare(*_run("cpu", torch.float32, steps=2, **opts))


def test_kernel_grad_scale_and_found_inf_interpreter():
    _compare(*_run("cpu", torch.float32, steps=2, grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0)))
    params, ref_p, states, ref_s, layout = _run("cpu", torch.float32, steps=2, found_inf=torch.tensor(1.0))
    assert all(float(s["step"]) == 0 for s in states)
    assert all(int(s["exp_avg_codes"].count_nonzero()) == 0 for s in states)
    _compare(params, ref_p, states, ref_s, layout)


def test_kernel_nan_gradient_stays_in_its_element():
    layout = StateLayout(quantized=True)
    p = torch.randn(4, 256)
    s = init_state(p, layout, False)
    g = torch.randn(4, 256) * 1e-3
    g[1, 5] = float("nan")
    g[2, 9] = float("inf")
    before = p.clone()
    kernel.fused_adamw_step([(p, g, s, layout)], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                            amsgrad=False, maximize=False)
    bad = ~torch.isfinite(p)
    assert bad.sum() == 2 and bad[1, 5] and bad[2, 9]
    m = load_moment(s, "exp_avg", layout)
    assert torch.isnan(m).sum() == 1 and torch.isnan(m[1, 5])  # the NaN stays NaN; the inf saturates
    assert torch.isfinite(m[2, 9]) and m[2, 9] > 0
    assert ((p - before).abs()[torch.isfinite(p)] > 0).all()  # every other element still moved


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_kernel_matches_reference_gpu(dtype, amsgrad):
    _compare(*_run("cuda", dtype, steps=4, amsgrad=amsgrad), code_tol=0.01)


@pytest.mark.gpu
def test_fused_optimizer_on_gpu_uses_kernel_and_tracks_torch():
    import lpoptim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    ref.load_state_dict(model.state_dict())
    opt = lpoptim.AdamW(model.parameters(), lr=1e-3, fused=True, min_quant_numel=4096)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device="cuda")
    p0 = [p.detach().clone() for p in ref.parameters()]
    for _ in range(20):
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    # E4M3 rounds m and sqrt(v) with at most 2^-4 relative error (about 3% RMS): the displacement may differ by
    # that much, not more; the CPU reference gives 4.5% on this problem.
    for a, b, c in zip(model.parameters(), ref.parameters(), p0):
        assert (a - b).norm() / (b - c).norm() < 0.1


@pytest.mark.parametrize("n_tensors", [2, 12])  # few moved addresses are patched in place, many rebuild the table
def test_kernel_follows_gradients_to_new_addresses(n_tensors):
    layout = StateLayout(quantized=True)
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(4, 128, generator=gen) for _ in range(n_tensors)]
    ref_p = [p.clone() for p in params]
    states = [init_state(p, layout, False) for p in params]
    ref_s = [init_state(p, layout, False) for p in params]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    for _ in range(3):  # fresh gradient tensors every step, as zero_grad(set_to_none=True) gives
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        kernel.fused_adamw_step([(p, g, s, layout) for p, g, s in zip(params, grads, states)], **hyper)
        for p, g, s in zip(ref_p, grads, ref_s):
            reference_adamw_step(p, g, s, layout, **hyper)
    _compare(params, ref_p, states, ref_s, layout)


@pytest.mark.gpu
def test_step_captured_in_a_cuda_graph_replays_as_eager_steps():
    """capturable: step counts and bias corrections on the device, no host sync, so one step can be captured in
    a CUDA graph and replayed; each replay must equal an eager step on the same gradients, bit for bit."""
    import lpoptim

    torch.manual_seed(0)
    pa = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in [(256, 512), (1000,), (130, 256)]]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    for p, q in zip(pa, pb):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    oa = lpoptim.AdamW(pa, lr=1e-2, weight_decay=0.1, capturable=True)
    ob = lpoptim.AdamW(pb, lr=1e-2, weight_decay=0.1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (states, tables, compiled kernels) off the capture
        for _ in range(2):
            oa.step()
            ob.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oa.step()
    for _ in range(4):
        for p, q in zip(pa, pb):
            p.grad.copy_(torch.randn_like(p))  # new gradients into the captured buffers
            q.grad.copy_(p.grad)
        graph.replay()
        ob.step()
    torch.cuda.synchronize()
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        sa, sb = oa.state[p], ob.state[q]
        assert float(sa["step"]) == float(sb["step"]) == 6  # 2 warm-up steps, 4 replays (the capture does not step)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_kernel_decodes_by_the_stored_code_whatever_the_layout_says():
    """A state saved with expansion on, stepped with it off (a checkpoint loaded into another setting): the
    scales carry k codes, and decoding must use them, as the reference does."""
    from lpoptim.optim.reference import encode_moment

    gen = torch.Generator().manual_seed(0)
    p = torch.randn(8, 256, generator=gen)
    m = torch.randn(8, 256, generator=gen) * torch.logspace(-4, 0, 256)
    saved = StateLayout(True, expansion=True)
    st = {"step": torch.tensor(5.0), **encode_moment("exp_avg", m, saved), **encode_moment("exp_avg_sq", m * m, saved)}
    assert int(((st["exp_avg_scale"].view(torch.int32) & 255) > 0).sum()) > 0
    layout = StateLayout(True, expansion=False)
    g = torch.randn(8, 256, generator=gen) * 1e-3
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    pk, sk = p.clone(), {k: v.clone() for k, v in st.items()}
    pr, sr = p.clone(), {k: v.clone() for k, v in st.items()}
    kernel.fused_adamw_step([(pk, g, sk, layout)], **hyper)
    reference_adamw_step(pr, g, sr, layout, **hyper)
    _compare([pk], [pr], [sk], [sr], layout)


def test_nan_moment_stays_nan_on_the_next_step():
    """A NaN code written at one step is read back as NaN at the next (the interpreter's fp8 cast reads E4M3's
    NaN code as 480: decoded by hand there), as the reference does."""
    layout = StateLayout(quantized=True)
    p = torch.randn(4, 256)
    pr, s, sr = p.clone(), init_state(p, layout, False), init_state(p, layout, False)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)
    for step in range(2):
        g = torch.randn(4, 256) * 1e-3
        if step == 0:
            g[1, 5] = float("nan")
        kernel.fused_adamw_step([(p, g, s, layout)], **hyper)
        reference_adamw_step(pr, g, sr, layout, **hyper)
    m, mr = load_moment(s, "exp_avg", layout), load_moment(sr, "exp_avg", layout)
    assert torch.isnan(mr[1, 5]) and torch.isnan(m[1, 5])
    assert torch.equal(torch.isnan(m), torch.isnan(mr))


@pytest.mark.parametrize("layout", [StateLayout(quantized=True), StateLayout(True, expansion=False),
                                    StateLayout(True, sqrt_v=True), StateLayout(quantized=False)])
def test_non_finite_gradients_with_amsgrad_match_the_reference(layout):
    """Infinities and NaNs in the gradients: scales from the finite values, NaN kept (also in a group with no other
    nonzero value), and the running maximum keeps a NaN as torch.maximum does: the kernel as the reference, over
    steps that decode the NaN codes."""
    _non_finite_gradients_with_amsgrad("cpu", layout)


@pytest.mark.gpu
def test_non_finite_gradients_with_amsgrad_match_the_reference_gpu():
    _non_finite_gradients_with_amsgrad("cuda", StateLayout(quantized=True))


def _non_finite_gradients_with_amsgrad(device, layout):
    gen = torch.Generator().manual_seed(6)
    p = torch.randn(8, 256, generator=gen).to(device)
    pr, s, sr = p.clone(), init_state(p, layout, True), init_state(p, layout, True)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=False)
    for step in range(3):
        g = non_finite_grad(step, device, gen)
        kernel.fused_adamw_step([(p, g, s, layout)], **hyper)
        reference_adamw_step(pr, g, sr, layout, **hyper)
        _compare([p], [pr], [s], [sr], layout)  # NaN masks of the moments and parameters included
    assert torch.isnan(load_moment(s, "max_exp_avg_sq", layout)[1, 5])


@pytest.mark.parametrize("bad", ["float64", "int64", "cpu"])
def test_a_step_the_kernel_cannot_read_is_refused(bad):
    """The kernel reads each step count through its address as one fp32 value on the parameter's device: a step
    set by hand as another dtype (or, on a GPU, on the CPU) is refused with a clear error, not read as garbage."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if bad == "cpu" and dev == "cpu":
        pytest.skip("needs a parameter on a GPU")
    layout = StateLayout(quantized=True)
    p = torch.randn(16, 128, device=dev)
    state = init_state(p, layout, False)
    state["step"] = {"float64": state["step"].double(), "int64": state["step"].long(), "cpu": state["step"].cpu()}[bad]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False)
    with pytest.raises(ValueError, match="'step' must be one float32 value"):
        kernel.fused_adamw_step([(p, torch.randn_like(p), state, layout)], **hyper)


# ---- GPUs without FP8 conversions (compute capability 8.0-8.6: A100, A10, RTX 30xx) ---------------------------------
# Triton refuses its fp8e4nv type there, so the kernel converts codes by integer arithmetic instead (HW_FP8=False,
# grid.hardware_fp8). Both paths must write and read the same bits.

@triton.jit
def _integer_roundtrip(codes_ptr, values_ptr, recoded_ptr, IS_E4M3: tl.constexpr):
    offs = tl.arange(0, 256)
    v = fp8_value(tl.load(codes_ptr + offs), IS_E4M3, False, False)
    tl.store(values_ptr + offs, v)
    tl.store(recoded_ptr + offs, fp8_bits(v, IS_E4M3, False))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_integer_fp8_conversions_match_torch_on_every_code(fmt, device):
    """Under the interpreter on the CPU, compiled on a GPU."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    values = torch.empty(256, device=device)
    recoded = torch.empty(256, dtype=torch.uint8, device=device)
    _integer_roundtrip[(1,)](codes, values, recoded, IS_E4M3=fmt == torch.float8_e4m3fn)
    codes, values, recoded = codes.cpu(), values.cpu(), recoded.cpu()
    want = codes.view(fmt).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(values), nan)
    assert torch.equal(values[~nan].view(torch.int32), want[~nan].view(torch.int32))  # -0.0 and subnormals too
    finite = torch.isfinite(want)
    assert torch.equal(recoded[finite], codes[finite])  # every finite code written back as itself
    # NaN written back as a NaN code (its sign is not kept, as on the hardware path); E5M2's infinities saturate to
    # the largest finite code, as cvt.rn.satfinite does
    assert ((recoded[nan] & 0x7F) == (0x7F if fmt == torch.float8_e4m3fn else 0x7E)).all()
    if fmt == torch.float8_e5m2:
        assert recoded[0x7C] == 0x7B and recoded[0xFC] == 0xFB


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("v_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_kernel_without_fp8_conversions_writes_the_same_bits(monkeypatch, v_format, amsgrad, device):
    """Under the interpreter on the CPU, compiled on a GPU (where the hardware path rounds by cvt.rn.satfinite)."""
    layout = StateLayout(quantized=True, exp_avg_sq_format=v_format)
    runs = []
    for hardware in (True, False):
        monkeypatch.setattr(kernel, "hardware_fp8", lambda device, hardware=hardware: hardware)
        params, _rp, states, _rs = kernel_and_reference(device, torch.bfloat16, layout, SHAPES, steps=3,
                                                        amsgrad=amsgrad, sr_salts=list(range(len(SHAPES))))
        runs.append((params, states))
    (p_hw, s_hw), (p_int, s_int) = runs
    for a, b in zip(p_hw, p_int):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(s_hw, s_int):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


_COMPILE_FOR_SM80 = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lpoptim.kernels import adamw_step as kernel
from lpoptim.optim.adamw import LPOPTIM_DEFAULTS

fn = kernel._adamw_kernel
consts = dict(PARAM_DTYPE=kernel._TL_DTYPES[torch.bfloat16], G=LPOPTIM_DEFAULTS["group_size"], BLOCK_G=2, LOOP=8,
              AMSGRAD=True, MAXIMIZE=False, LR_IS_TENSOR=False, HAS_GRAD_SCALE=False, HAS_FOUND_INF=False,
              EVEN_ROWS=True, ON_GPU=True, STOCHASTIC=True, ALIGNED=True, QUANT=True, EXPANSION=True, SQRT_V=False,
              STAGES=kernel.TUNING["half"]["stages"],
              HW_FP8=False, **kernel._format_args("e4m3", "M"), **kernel._format_args("e4m3", "V"))
pointers = {"ptrs": "*i64", "dims": "*i32", "blocks": "*i32", "salt_ptr": "*i32"}
sig = {n: "constexpr" if n in consts else pointers.get(n, "*fp32") if n in pointers or n.endswith("_ptr") else "fp32"
       for n in fn.arg_names}
try:
    for cap in (80, 86):
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", cap, 32), options=dict(num_warps=1))
except RuntimeError as e:
    if "ptxas" in str(e).lower():
        print("no-toolchain", e)
        raise SystemExit(0)
    raise
print("compiled", "f8E" in compiled.asm["ttgir"])  # an FP8 type (f8E4M3FN, f8E5M2) left in the kernel
"""


def test_kernel_compiles_for_gpus_without_fp8_conversions():
    """Compiled (not run) for an A100 (sm_80) and an RTX 30xx (sm_86), as a launch there asks: Triton's compiler needs no GPU, but it
    does need to be out of the interpreter, hence a process of its own."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM80], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("no-toolchain"):
        pytest.skip(out.stdout)
    assert out.stdout.split()[-2:] == ["compiled", "False"]  # and no FP8 type left for sm_80 to refuse


def test_launch_settings_by_states_dtype_and_rounding(monkeypatch):
    """Each case takes its own tuned settings: FP8 states (and fp32 moments) by the parameters' width, 4-bit states
    by it and by the stochastic rounding (the module's own table: the fixture swapped in one setting for all)."""
    monkeypatch.setattr(kernel, "TUNING", TUNED)
    four, eight, plain = (StateLayout(quantized=True, state_bits=4), StateLayout(quantized=True),
                          StateLayout(quantized=False))
    t = TUNED
    assert kernel._tuning(four, torch.float32) is t["state4_fp32"]
    for layout in (eight, plain):
        assert kernel._tuning(layout, torch.float32) is t["fp32"]
    for dtype in (torch.bfloat16, torch.float16):
        assert kernel._tuning(four, dtype, False) is t["state4_half"]
        assert kernel._tuning(four, dtype, True) is t["state4_half_sr"]
        assert kernel._tuning(eight, dtype, True) is kernel._tuning(eight, dtype, False) is t["half"]
    assert len({id(v) for v in t.values()}) == len(t) == 5  # five entries, each its own
    assert all(set(v) == {"block_groups", "num_warps", "loop", "stages"} for v in t.values())
