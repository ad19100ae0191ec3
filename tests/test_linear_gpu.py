"""GPU checks of the low-bit linear layers (skipped without CUDA): the Triton quantizer against the reference,
torch._scaled_mm against the emulated GEMM, and the layers against the CPU reference path."""
import pytest
import torch
import triton
import triton.language as tl

from lpoptim.kernels.grid import div_rn_by
from lpoptim.nn import LowBitLinear
from lpoptim.nn.operands import QuantSpec, gemm, quantize, quantize_operand_ref, quantize_pair
from test_linear import variant  # the recipe names with options ("fp4/paper", "int4/bwd_row") as there

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "int4_sym"])
@pytest.mark.parametrize("gran", ["row", "tensor"])
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_matches_reference_on_gpu(fmt, gran, transposed):
    x = torch.randn(300, 512, device="cuda") * 3
    x = x.t() if transposed else x
    op = quantize(x, QuantSpec(fmt, gran))
    ref = quantize_operand_ref(x.cpu(), fmt, gran, None, op.values.shape[1])
    diff = (op.values.cpu().float() != ref.values.float())
    assert diff.float().mean() <= 1e-4, (f"{int(diff.sum())} values differ, e.g. "
                                         f"{op.values.cpu().float()[diff][:4].tolist()} vs {ref.values.float()[diff][:4].tolist()}")
    assert torch.allclose(op.scale.cpu(), ref.scale, rtol=2e-7, atol=0)  # amax / max: one fp32 rounding


@pytest.mark.parametrize("transposed", [False, True])
def test_hadamard_kernel_bf16_on_gpu(transposed):
    x = (torch.randn(256, 1024, device="cuda") * 3).to(torch.bfloat16)
    x = x.t() if transposed else x
    op = quantize(x, QuantSpec("int4_sym", "row", hadamard_block=128))
    ref = quantize_operand_ref(x.cpu(), "int4_sym", "row", 128, op.values.shape[1])
    assert torch.allclose(op.scale.cpu(), ref.scale, rtol=1e-6)
    diff = (op.values.cpu().float() - ref.values.float()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # only the summation order differs


@pytest.mark.filterwarnings("error:torch._scaled_mm failed")  # no silent fallback to the fp32 emulation
@pytest.mark.parametrize("fmt", ["e2m1", "int4_sym"])
def test_scaled_mm_4bit_is_exact(fmt):
    a = quantize(torch.randn(256, 4096, device="cuda"), QuantSpec(fmt, "tensor"))
    b = quantize(torch.randn(512, 4096, device="cuda"), QuantSpec(fmt, "tensor"))
    out = gemm(a, b, torch.float32)
    ref = (a.values.double() * a.scale.double()) @ (b.values.double() * b.scale.double()).t()
    # The products of 4-bit values are exact and so is their accumulation ; the fp32 scales and
    # the fp32 result round, so where terms cancel the error is relative to the sum of |products|, not to the
    # result: measured on an H200 (torch 2.11) 6.4e-9 (e2m1) and 7.1e-9 (int4) of it, about 2^-27.
    mag = (a.values.double().abs() * a.scale.double()) @ (b.values.double().abs() * b.scale.double()).t()
    err = ((out.double() - ref).abs() / mag.clamp_min(1e-30)).max().item()
    print(f"scaled_mm {fmt}: max |error| / sum|products| = {err:.3g}")
    assert err < 2.0 ** -18


@pytest.mark.filterwarnings("error:torch._scaled_mm failed")
@pytest.mark.parametrize("recipe", ["fp8", "fp8_tensor", "fp4", "fp4/paper", "int4", "int4/bwd_row"])
def test_layer_on_gpu_matches_cpu_reference(recipe):
    torch.manual_seed(0)
    recipe, overrides = variant(recipe)  # paper: Wang et al.'s fp4 (outlier clamping, DGE, the backward per row)
    lin = torch.nn.Linear(256, 512).cuda()
    m = LowBitLinear.from_linear(lin, recipe, **overrides)
    x = torch.randn(2, 100, 256, device="cuda", requires_grad=True)
    gy = torch.randn(2, 100, 512, device="cuda")
    y = m(x.to(torch.bfloat16))
    y.backward(gy.to(torch.bfloat16))
    dx, dw = x.grad.clone(), lin.weight.grad.clone()
    xc = x.detach().to(torch.bfloat16).float().cpu().requires_grad_()  # the same values the GPU layer saw
    mc = LowBitLinear.from_linear(torch.nn.Linear(256, 512), recipe, **overrides)
    mc.load_state_dict({k: v.cpu() for k, v in lin.state_dict().items()})
    yc = mc(xc)
    yc.backward(gy.to(torch.bfloat16).float().cpu())

    def rel(a, b):
        return ((a.float().cpu() - b).norm() / b.norm()).item()

    # same grid values on both sides; bf16 outputs and (int4) the Hadamard's summation order differ
    assert rel(y, yc.detach()) < 0.02 and rel(dx, xc.grad) < 0.02 and rel(dw, mc.weight.grad) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_and_cols_together_on_gpu(dtype):
    """The two-pass x / xᵀ quantizer (column maxima by atomics, hardware fp8 cast) gives the reference's bits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1000, 700, device="cuda", generator=g) * 3).to(dtype)
    x[:, 5] = 0.0
    x[9, 11], x[20, 3], x[30, 4] = float("inf"), float("nan"), 1e4
    for fr, fc in (("e4m3", "e4m3"), ("e5m2", "e5m2")):
        a, b = quantize_pair(x, QuantSpec(fr), QuantSpec(fc))
        for op, ref in ((a, quantize_operand_ref(x, fr, "row", None, 704)),
                        (b, quantize_operand_ref(x.t(), fc, "row", None, 1008))):
            assert torch.equal(op.values.float().nan_to_num(7.0), ref.values.float().nan_to_num(7.0))
            assert torch.equal(op.scale, ref.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_tensor_rows_and_cols_on_gpu(dtype):
    """The per-tensor x / xᵀ quantizer (one absmax pass, one pass writing both copies) gives the reference's bits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1000, 700, device="cuda", generator=g) * 3).to(dtype)
    x[9, 11], x[20, 3], x[30, 4] = float("inf"), float("nan"), 1e4
    for fr, fc in (("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", "e5m2")):
        a, b = quantize_pair(x, QuantSpec(fr, "tensor"), QuantSpec(fc, "tensor"))
        for name, op, ref in (("x", a, quantize_operand_ref(x, fr, "tensor", None, 704)),
                              ("xt", b, quantize_operand_ref(x.t(), fc, "tensor", None, 1008))):
            got, want = op.values.float().nan_to_num(7.0), ref.values.float().nan_to_num(7.0)
            bad = (got != want).nonzero()
            assert len(bad) == 0, (f"{fr}/{fc} {name}: {len(bad)} differ, first at {bad[:3].tolist()}: "
                                   f"{got[tuple(bad[:3].t())].tolist()} vs {want[tuple(bad[:3].t())].tolist()}, "
                                   f"scales {op.scale.item()} vs {ref.scale.item()}")
            assert torch.equal(op.scale, ref.scale)


def test_fast_accum_forward_is_close_to_exact_accumulation():
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 512, bias=False).cuda().to(torch.bfloat16)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    y = LowBitLinear.from_linear(lin, "fp8_tensor")(x).float()
    y_fast = LowBitLinear.from_linear(lin, "fp8_tensor", fast_accum=True)(x).float()
    assert ((y_fast - y).norm() / y.norm()).item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_carried_absmax_matches_a_fresh_one_on_gpu(dtype):
    """The per-tensor kernel with W's absmax given (fp8_tensor's backward) writes the codes it writes without."""
    from lpoptim.nn.operands import tensor_amax
    w = (torch.randn(512, 384, device="cuda") * 0.05).to(dtype)
    fresh = quantize(w.t(), QuantSpec("e4m3", "tensor"))
    carried = quantize(w.t(), QuantSpec("e4m3", "tensor"), amax=tensor_amax(w))
    assert torch.equal(carried.values.view(torch.uint8), fresh.values.view(torch.uint8))
    assert torch.equal(carried.scale, fresh.scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transposed_copy_alone_and_fused_maxima_match_the_reference_on_gpu(dtype):
    """The per-tensor transposed copy alone (xᵀ, Wᵀ: its own tile) and the row pass's tensor maximum (fp4's
    saved xᵀ and W statistic) give the reference's bits, with rows not a multiple of any tile and inf / NaN in x."""
    from lpoptim.quant import finite_absmax

    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(1000, 700, device="cuda", generator=g) * 3).to(dtype)
    x[9, 11], x[20, 3], x[30, 4] = float("inf"), float("nan"), -1e4
    for fmt in ("e4m3", "e5m2"):
        got, want = quantize(x.t(), QuantSpec(fmt, "tensor")), quantize_operand_ref(x.t(), fmt, "tensor", None, 1008)
        assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8)) and torch.equal(got.scale, want.scale)
    op = quantize(x, QuantSpec("e2m1", keep="amax"))
    amax = op.amax
    ref = quantize_operand_ref(x, "e2m1", "row", None, 704)
    assert torch.equal(op.values.view(torch.uint8), ref.values.view(torch.uint8)) and torch.equal(op.scale, ref.scale)
    assert amax.item() == finite_absmax(x.float()).item() == abs(x[30, 4].item())  # -1e4 as the dtype holds it


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "int4_sym"])
@pytest.mark.parametrize("cols", [4096, 11008, 20000])
def test_whole_rows_kernel_matches_the_two_pass_kernel_on_gpu(monkeypatch, fmt, cols):
    """The one-read row kernel (forced on at every width here) against the two-pass one on bf16 at the 7B widths
    (20000: wider than the largest tile, the two-pass kernel either way)."""
    import lpoptim.kernels.linear_quant as lq
    x = (torch.randn(64, cols, device="cuda") * 3).to(torch.bfloat16)
    x[3, 5] = 200.0
    width = -(-cols // 128) * 128
    bits = [torch.zeros((), device="cuda", dtype=torch.int32) for _ in range(2)]
    monkeypatch.setattr(lq, "TUNING", {**lq.TUNING, "whole_rows": {**lq.TUNING["whole_rows"], "max_width": 16384}})  # TUNING is read-only
    whole = lq.quantize_rows(x, fmt, "row", None, width, tensor_max=bits[0])
    monkeypatch.setattr(lq, "TUNING", {**lq.TUNING, "whole_rows": {**lq.TUNING["whole_rows"], "enabled": False}})  # TUNING is read-only
    two = lq.quantize_rows(x, fmt, "row", None, width, tensor_max=bits[1])
    assert torch.equal(bits[0], bits[1]) and bits[0].view(torch.float32) == 200.0
    assert torch.equal(whole[0].view(torch.uint8), two[0].view(torch.uint8)) and torch.equal(whole[1], two[1])


@triton.jit
def _division_kernel(t_ptr, s_ptr, fast_ptr, ref_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1)
    t = tl.load(t_ptr + offs, mask=offs < N)
    s = tl.load(s_ptr + row)
    tl.store(fast_ptr + row * N + offs, div_rn_by(t, s), mask=offs < N)
    tl.store(ref_ptr + row * N + offs, tl.math.div_rn(t, tl.broadcast_to(s, t.shape)), mask=offs < N)


def test_division_by_scale_is_div_rn_bit_for_bit():
    """grid.div_rn_by, what the quantizers divide by their scale with, against the GPU's correctly rounded division:
    every bf16 value and a million fp32 ones of all magnitudes, over scales from subnormal to huge."""
    g = torch.Generator().manual_seed(0)
    bf16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    wide = torch.randn(1 << 20, generator=g) * torch.exp2(torch.randint(-140, 120, (1 << 20,), generator=g).float())
    t = torch.cat([bf16, wide, torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-45, -1e-45])])
    amax = torch.rand(40, generator=g) * torch.exp2(torch.randint(-130, 120, (40,), generator=g).float())
    scales = torch.cat([amax / 448, amax / 6, amax / 7, torch.tensor([1.0, 0.5, 3.0, 1e-40, 1.4e-45, 1e-36, 3e37,
                                                                       7.888609052210118e-31, 7.8886e-31])])
    t, scales = t.cuda(), scales.cuda()
    fast = torch.empty(len(scales), len(t), device="cuda")
    ref = torch.empty_like(fast)
    _division_kernel[(triton.cdiv(len(t), 1024), len(scales))](t, scales, fast, ref, len(t), BLOCK=1024)
    same = (fast.view(torch.int32) == ref.view(torch.int32)) | (fast.isnan() & ref.isnan())
    # below 2^-40 (no format has a code within 2^20 of it) only the magnitude and the sign are promised
    tiny = (ref.abs() < 2 ** -40) & (fast.abs() < 2 ** -39) & (fast.signbit() == ref.signbit())
    # a quantizer's quotients: |t| <= FMAX * s (its scale comes from an absmax at least |t|), or t not finite
    tt, ss = t.expand_as(fast), scales[:, None].expand_as(fast)
    domain = (ref.abs() <= 2 ** 24) | ~tt.isfinite()
    bad = domain & ~(same | tiny)
    assert not bad.any(), (tt[bad][:5], ss[bad][:5], fast[bad][:5], ref[bad][:5])
    assert same[domain & (ref.abs() >= 2 ** -40)].all() and domain.float().mean() > 0.3
