"""Delayed per-tensor scaling (nn/delayed.py): the history's semantics in torch, the one-pass Triton quantizer
against it (interpreter on the CPU, compiled on the GPU), and the layer's state as a drop-in nn.Linear keeps it."""
import pytest
import torch
import torch.nn as nn

from lpoptim.nn.delayed import GRAD, WEIGHT, X, AmaxHistory, new_history
from lpoptim.nn.functional import lowbit_linear
from lpoptim.nn.linear import LowBitLinear
from lpoptim.nn.operands import QuantSpec, quantize, quantize_operand_ref
from lpoptim.nn.recipes import get_recipe
from lpoptim.quant import finite_absmax

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _history(length=2, device="cpu"):
    return AmaxHistory(new_history(length, device), [0, 0, 0], X)


def test_reference_window_is_the_last_length_quantizations():
    h = _history(length=2)
    amaxes = [1.0, 5.0, 2.0, 3.0, 0.5, 0.25]
    used = []
    for a in amaxes:
        x = torch.full((3, 4), -a)
        x[0, 0] = float("nan")  # non-finite values never set a scale
        used.append(h.take_ref(x).item())
    # the largest of its own and the (up to) two before it
    assert used == [1.0, 5.0, 5.0, 5.0, 3.0, 3.0]
    assert h.calls == [6, 0, 0]
    dy = AmaxHistory(h.bits, h.calls, GRAD)  # the other row is untouched by x's quantizations
    assert dy.take_ref(torch.full((2, 2), 7.0)).item() == 7.0 and h.calls == [6, 1, 0]


def test_a_smaller_tensor_takes_the_history_scale_a_larger_its_own():
    h = _history(length=4)
    h.take_ref(torch.full((4, 8), 2.0))  # the history says amax 2
    x = torch.linspace(-1, 1, 32).reshape(4, 8)
    q = quantize_operand_ref(x, "e4m3", "tensor", amax=h.take_ref(x))
    assert q.scale.item() == pytest.approx(2 / 448)  # the history's range: x uses half of E4M3's
    assert q.values.float().abs().max().item() == 224
    x = x * 3  # beyond the history: never saturated, its own scale
    q = quantize_operand_ref(x, "e4m3", "tensor", amax=h.take_ref(x))
    assert q.scale.item() == pytest.approx(3 / 448) and q.values.float().abs().max().item() == 448


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", None), (None, "e4m3")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_kernel_matches_the_reference_over_calls(device, fmts, dtype):
    """The kernel (interpreted on the CPU) scales from the history and records x's absmax in the same pass:
    codes, scales and the history itself equal the reference's, call after call, the ring wrapping around."""
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU runs the compiled kernel")
    import lpoptim.kernels.linear_quant as lq

    row_fmt, col_fmt = fmts
    hk, hr = _history(3, device), _history(3, "cpu")
    g = torch.Generator().manual_seed(0)
    for step, mult in enumerate([1.0, 4.0, 0.5, 2.0, 8.0, 0.25, 1.0]):
        x = (torch.randn(37, 70, generator=g) * mult).to(dtype)
        x[3, 5] = float("inf") if step == 2 else x[3, 5]
        rows, cols = lq.quantize_tensor_rows_cols(x.to(device), row_fmt, col_fmt, 80 if row_fmt else None,
                                                  48 if col_fmt else None, history=hk)
        amax = hr.take_ref(x)
        for got, fmt, src, width in ((rows, row_fmt, x, 80), (cols, col_fmt, x.t(), 48)):
            if fmt is None:
                assert got is None
                continue
            ref = quantize_operand_ref(src, fmt, "tensor", None, width, amax)
            assert torch.equal(got[0].float().cpu(), ref.values.float()), (step, fmt)
            assert torch.equal(got[1].cpu(), ref.scale), step
        assert torch.equal(hk.bits.cpu(), hr.bits), step
    assert hk.calls == hr.calls == [7, 0, 0]


def test_second_launch_loops_over_tiles(monkeypatch):
    """The second launch's programs stride over the tiles: with one program it must redo every tile."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    import lpoptim.kernels.linear_quant as lq
    monkeypatch.setattr(lq, "_redo_programs", lambda device: 1)
    hk, hr = _history(2), _history(2)
    g = torch.Generator().manual_seed(5)
    for mult in (1.0, 4.0, 0.5):
        x = torch.randn(70, 300, generator=g) * mult  # 3 x 3 tiles of TUNING['delayed']'s 32 x 128
        rows, cols = lq.quantize_tensor_rows_cols(x, "e4m3", "e4m3", 304, 80, history=hk)
        amax = hr.take_ref(x)
        assert torch.equal(rows[0].float(), quantize_operand_ref(x, "e4m3", "tensor", None, 304, amax).values.float())
        assert torch.equal(cols[0].float(), quantize_operand_ref(x.t(), "e4m3", "tensor", None, 80, amax).values.float())
        assert torch.equal(hk.bits, hr.bits)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_input_keeps_the_history_consistent(device):
    import lpoptim.kernels.linear_quant as lq
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter test")
    hk, hr = _history(2, device), _history(2, "cpu")
    for x in (torch.randn(8, 16) * 3, torch.zeros(0, 16), torch.randn(8, 16), torch.zeros(0, 16)):
        rows, cols = lq.quantize_tensor_rows_cols(x.to(device), "e4m3", "e4m3", 16, 16 * (x.shape[0] > 0),
                                                  history=hk)
        amax = hr.take_ref(x)
        assert torch.equal(rows[1].cpu(), quantize_operand_ref(x, "e4m3", "tensor", amax=amax).scale)
        assert torch.equal(hk.bits.cpu(), hr.bits)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_quantizer_returns_the_absmax_it_scaled_by(device):
    """W's delayed quantization (rows only) gives the absmax its scale came from, max(history, own), for Wᵀ in
    backward: equal to the reference's, whether the history covers W or W outgrew it, codes and history too."""
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU runs the compiled kernel")
    import lpoptim.kernels.linear_quant as lq
    hk, hr = AmaxHistory(new_history(2, device), [0, 0, 0], WEIGHT), AmaxHistory(new_history(2), [0, 0, 0], WEIGHT)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 70, generator=g).to(torch.bfloat16)
    for step, mult in enumerate([1.0, 0.5, 0.5, 0.5, 3.0, 1.0]):  # shrinks below its history, then outgrows it
        wk = (w.float() * mult).to(torch.bfloat16)
        used = torch.full((), -1.0, device=device)
        got = lq.quantize_tensor_rows_cols(wk.to(device), "e4m3", None, 80, None, history=hk, used_amax=used)[0]
        amax = hr.take_ref(wk)
        ref = quantize_operand_ref(wk, "e4m3", "tensor", None, 80, amax)
        assert used.item() == amax.item() == hr.bits[WEIGHT].view(torch.float32).max().item(), step
        assert torch.equal(got[0].float().cpu(), ref.values.float()) and torch.equal(got[1].cpu(), ref.scale)
        assert torch.equal(hk.bits.cpu(), hr.bits), step
    assert hk.calls == [0, 0, 6]
    op = quantize(w.to(device), QuantSpec("e4m3", "tensor", "delayed", keep="amax"), history=hk)  # the operand form
    used = op.amax  # the same
    assert used.item() == hr.take_ref(w).item() and torch.equal(op.scale.cpu(), quantize_operand_ref(
        w, "e4m3", "tensor", amax=used.cpu()).scale)
    with pytest.raises(ValueError, match="used_amax"):
        lq.quantize_tensor_rows_cols(w.to(device), "e4m3", None, 80, None, used_amax=used)


def _pair(recipe_a, recipe_b, device="cpu", seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(64, 48, device=device)
    a = LowBitLinear.from_linear(lin, recipe_a)
    lin_b = nn.Linear(64, 48, device=device)
    lin_b.load_state_dict(lin.state_dict())
    return a, LowBitLinear.from_linear(lin_b, recipe_b)


def _step(m, x, gy):
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(gy)
    grads = x.grad, m.weight.grad.clone(), m.bias.grad.clone()
    m.weight.grad = m.bias.grad = None
    return y.detach(), grads


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_layer_first_step_is_current_scaling_then_as_accurate():
    """Against fp32: delayed scaling's errors stay within fp8_tensor's bounds (tests/test_linear.py) and near
    current scaling's own (the two round independently, so they are compared with fp32, not with each other)."""
    delayed, current = _pair("fp8_delayed", "fp8_tensor")
    exact = nn.Linear(64, 48)
    exact.load_state_dict(current.state_dict())
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, gy = torch.randn(2, 30, 64, generator=g), torch.randn(2, 30, 48, generator=g)
        yd, gd = _step(delayed, x, gy)
        yc, gc = _step(current, x, gy)
        y0, g0 = _step(exact, x, gy)
        if step == 0:  # no history yet: each tensor's own absmax, exactly fp8_tensor
            assert torch.equal(yd, yc) and all(torch.equal(a, b) for a, b in zip(gd, gc))
        for bound, d, c, e in zip((0.05, 0.08, 0.09, 1e-5), (yd, *gd), (yc, *gc), (y0, *g0)):
            assert _rel(d, e) < bound and _rel(d, e) < 1.3 * _rel(c, e) + 1e-6, (step, _rel(d, e), _rel(c, e))
    assert delayed._amax_calls == [4, 4, 4]
    assert delayed.amax_history.view(torch.float32)[:, :4].gt(0).all()


def test_layer_meets_a_jump_with_its_own_scale():
    m, current = _pair("fp8_delayed", "fp8_tensor")
    x = torch.randn(30, 64)
    _step(m, x, torch.randn(30, 48))
    y, _ = _step(m, x * 100, torch.randn(30, 48))  # x jumps beyond its history: quantized with its own scale,
    yc, _ = _step(current, x * 100, torch.randn(30, 48))  # as current scaling does (W is per tensor in both)
    assert torch.equal(y, yc)
    y, _ = _step(m, x, torch.randn(30, 48))  # and back: the history's larger scale, a little coarser
    yc, _ = _step(current, x, torch.randn(30, 48))
    assert not torch.equal(y, yc) and _cos(y, yc) > 0.99
    x_amax = m.amax_history[X].view(torch.float32)
    assert x_amax.max().item() == pytest.approx(finite_absmax(x * 100).item())
    assert m.amax_history[GRAD].view(torch.float32)[:3].gt(0).all()


def test_layer_scales_a_shrunken_weight_by_its_history_and_wt_alike(monkeypatch):
    """W (fp8 per tensor) takes its scale from its history: after the weight shrinks, the forward keeps the
    larger recorded absmax, and the backward's Wᵀ is quantized with that same absmax (no absmax pass)."""
    import lpoptim.nn.functional as fn
    m, current = _pair("fp8_delayed", "fp8_tensor")
    seen = []
    real = fn._quantize_wt
    monkeypatch.setattr(fn, "_quantize_wt", lambda w, r, w_stat, hw=None: seen.append(w_stat) or real(w, r, w_stat, hw))
    x, gy = torch.randn(30, 64), torch.randn(30, 48)
    _step(m, x, gy)
    big = finite_absmax(m.weight.detach()).item()
    with torch.no_grad():
        m.weight.mul_(0.5)
        current.weight.mul_(0.5)
    y, _ = _step(m, x, gy)
    yc, _ = _step(current, x, gy)
    assert seen[0].item() == big and seen[1].item() == big  # the history's absmax, both steps
    assert _cos(y, yc) > 0.99 and _rel(y, yc) < 0.05
    w_amax = m.amax_history[WEIGHT].view(torch.float32)
    assert sorted(w_amax[w_amax > 0].tolist()) == pytest.approx([big / 2, big])
    assert m._amax_calls == [2, 2, 2]


def test_layer_state_outside_the_state_dict():
    m, _ = _pair("fp8_delayed", "fp8_tensor")
    assert list(m.state_dict()) == list(nn.Linear(64, 48).state_dict()) == ["weight", "bias"]
    assert m.amax_history is None  # made by the first training step, on the weight's device
    _step(m, torch.randn(5, 64), torch.randn(5, 48))
    assert m.amax_history.shape == (3, 18) and m.amax_history.dtype == torch.int32 and m.amax_history.any()
    m.reset_amax_history()
    assert m.amax_history is None and m._amax_calls == [0, 0, 0]
    _step(m, torch.randn(5, 64), torch.randn(5, 48))
    m2 = LowBitLinear(64, 48, recipe="fp8_delayed", amax_history=4)
    _step(m2, torch.randn(5, 64), torch.randn(5, 48))
    assert m2.amax_history.shape == (3, 6)
    m2.load_state_dict(m.state_dict())  # loads like an nn.Linear; the history was of other weights
    assert m2.amax_history is None and m2._amax_calls == [0, 0, 0]
    m2.recipe = get_recipe("fp8_delayed", amax_history=8)  # a changed recipe gets a history of its length
    _step(m2, torch.randn(5, 64), torch.randn(5, 48))
    assert m2.amax_history.shape == (3, 10) and m2._amax_calls == [1, 1, 1]


@pytest.mark.parametrize("how", ["to_empty", "assign"])
def test_layer_built_on_meta_starts_a_clean_history(how):
    """A model made on "meta" and materialized never runs on uninitialized history slots."""
    src = nn.Linear(64, 48)
    m = LowBitLinear(64, 48, recipe="fp8_delayed", device="meta")
    if how == "to_empty":
        m.to_empty(device="cpu")
        m.load_state_dict(src.state_dict())
    else:
        m.load_state_dict(src.state_dict(), assign=True)
    x = torch.randn(5, 64)
    _step(m, x, torch.randn(5, 48))
    assert m._amax_calls == [1, 1, 1] and m.amax_history.device == m.weight.device
    assert m.amax_history[X].view(torch.float32).max().item() == finite_absmax(x).item()


def test_no_grad_forward_scales_currently_and_records_nothing():
    m, current = _pair("fp8_delayed", "fp8_tensor")
    x = torch.randn(5, 64)
    _step(m, x * 10, torch.randn(5, 48))  # a history larger than x
    with torch.no_grad():
        y, yc = m(x), current(x)
    assert torch.equal(y, yc) and m._amax_calls == [1, 1, 1]  # evaluation: current scaling, nothing recorded


def test_functional_form_ignores_histories_for_other_recipes():
    m, _ = _pair("fp8_delayed", "fp8_tensor")
    _step(m, torch.randn(5, 64), torch.randn(5, 48))
    hist = m._histories()
    x = torch.randn(5, 64, requires_grad=True)
    lowbit_linear(x, m.weight, m.bias, get_recipe("fp8"), histories=hist).sum().backward()  # per row: no history
    assert m._amax_calls == [1, 1, 1]


def test_int4_takes_the_history_for_its_saved_x_and_dy():
    m, ref = _pair("int4", "int4", seed=2)
    m.recipe = get_recipe("int4", scaling="delayed")
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x, gy = torch.randn(40, 64, generator=g), torch.randn(40, 48, generator=g)
        yd, gd = _step(m, x, gy)
        yc, gc = _step(ref, x, gy)
        assert torch.equal(yd, yc)  # the forward is per row: no history
        if step == 0:
            assert all(torch.equal(a, b) for a, b in zip(gd, gc))
        assert all(_cos(a, b) > 0.99 for a, b in zip(gd, gc))  # both a few % from fp32, independently
    assert m._amax_calls == [3, 3, 3]  # W: the forward per row (its own scales), the backward's Wᵀ delayed
    assert m.amax_history[WEIGHT].view(torch.float32).max().item() == finite_absmax(m.weight.detach()).item()


def test_clear_errors():
    with pytest.raises(ValueError, match="delayed scaling, which keeps per-layer state"):
        lowbit_linear(torch.randn(4, 16), torch.randn(16, 16), None, get_recipe("fp8_delayed"))
    with pytest.raises(ValueError, match="bwd_granularity='tensor'"):
        get_recipe("fp8", scaling="delayed")
    with pytest.raises(ValueError, match="scaling must be"):
        get_recipe("fp8_tensor", scaling="later")
    with pytest.raises(ValueError, match="amax_history"):
        get_recipe("fp8_delayed", amax_history=0)


def test_compiled_layer_uses_current_scaling_and_leaves_the_history():
    """Under torch.compile the fp8 recipes are traced into Inductor's kernels, which fuse the absmax into the ops
    around it: the compiled layer computes fp8_tensor's result and does not touch the history (nor, unless
    previous_weight_scale is set, W's device-side state: tests/test_weight_scale.py)."""
    torch._dynamo.reset()
    delayed, current = _pair("fp8_delayed", "fp8_tensor")
    x, gy = torch.randn(2, 20, 64), torch.randn(2, 20, 48)
    y, grads = _step(torch.compile(delayed, backend="aot_eager", fullgraph=True), x, gy)
    yc, gc = _step(current, x, gy)
    assert torch.equal(y, yc) and all(torch.equal(a, b) for a, b in zip(grads, gc))
    assert delayed._amax_calls == [0, 0, 0] and delayed.amax_history is None
    assert delayed.weight_amax_state.eq(0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layer_on_gpu_keeps_the_cpu_reference_history():
    """Several bf16 steps on the GPU (Triton quantizer, _scaled_mm) against the CPU reference fed the same values:
    the same recorded absmax values, bit for bit, and results within bf16 rounding."""
    gpu, _ = _pair("fp8_delayed", "fp8_tensor", device="cuda")
    cpu = LowBitLinear.from_linear(nn.Linear(64, 48), "fp8_delayed")
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    g = torch.Generator().manual_seed(4)
    for mult in (1.0, 3.0, 0.5, 1.0):
        x = (torch.randn(2, 40, 64, generator=g) * mult).to(torch.bfloat16)
        gy = torch.randn(2, 40, 48, generator=g).to(torch.bfloat16)
        y, grads = _step(gpu, x.cuda(), gy.cuda())
        yc, gc = _step(cpu, x.float(), gy.float())
        assert _rel(y.float().cpu(), yc) < 0.02 and all(_rel(a.float().cpu(), b) < 0.02 for a, b in zip(grads, gc))
        assert torch.equal(gpu.amax_history.cpu(), cpu.amax_history)
