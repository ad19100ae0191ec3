"""Low-bit linear layers on CPU: exact emulated GEMMs, the pieces of each recipe, gradient error bounds per
recipe against an fp32 nn.Linear, the module and convert_linears."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lpoptim.formats import E2M1
from lpoptim.nn import LowBitLinear, convert_linears, converted, get_recipe, lowbit_linear
from lpoptim.nn.fp4 import dge_derivative, occ_split, occ_threshold
from lpoptim.nn.functional import Fp4LinearFunction
from lpoptim.hadamard import block_hadamard, hadamard_pm1, pick_block
from lpoptim.nn.operands import Operand, QuantSpec, gemm, quantize
from lpoptim.train.gpt import GPT, GPTConfig


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- exact 4-bit GEMMs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e2m1", "int4_sym"])
def test_4bit_gemm_equals_float64_gemm(fmt):
    g = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(33, 4096, generator=g), QuantSpec(fmt))
    b = quantize(torch.randn(48, 4096, generator=g), QuantSpec(fmt))
    # unit scales: the fp32 accumulation of 4-bit products (multiples of 1/4) is exact
    a1, b1 = Operand(a.values, torch.ones_like(a.scale)), Operand(b.values, torch.ones_like(b.scale))
    exact = a.values.double() @ b.values.double().t()
    assert torch.equal(gemm(a1, b1).double(), exact)
    # with scales: equal to float64 up to the two fp32 roundings of the scale multiplications
    # (the exact product scaled in float64: scaling the operands first would leave rounding residue where the
    # exact product is 0, which no relative tolerance admits)
    ref = exact * a.scale.double() * b.scale.double().t()
    assert torch.allclose(gemm(a, b).double(), ref, rtol=3e-7, atol=0)
    # the same operands through torch._scaled_mm (it runs on the CPU in torch >= 2.13): the GPU code path
    if hasattr(torch, "_scaled_mm"):
        try:
            out = torch._scaled_mm(a1.values, b1.values.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0),
                                   out_dtype=torch.float32, use_fast_accum=False)
        except (RuntimeError, NotImplementedError):
            pytest.skip("torch._scaled_mm does not run on this CPU build")
        assert torch.equal(out.double(), exact)


def test_4bit_values_are_exact_in_e4m3():
    for v in list(E2M1.grid()) + list(range(-8, 8)):
        assert torch.tensor(float(v)).to(torch.float8_e4m3fn).float().item() == v


# ---- Hadamard, DGE, OCC ------------------------------------------------------------------------------------


def test_block_hadamard_is_orthogonal_and_cancels_in_gemm():
    h = hadamard_pm1(64)
    assert torch.equal(h @ h.t(), 64 * torch.eye(64))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 256, generator=g), torch.randn(7, 256, generator=g)
    assert torch.allclose(block_hadamard(block_hadamard(x, 64), 64), x, atol=1e-5)
    assert torch.allclose(block_hadamard(x, 64) @ block_hadamard(w, 64).t(), x @ w.t(), atol=1e-4)
    assert pick_block(96, 128) == 32 and pick_block(11008, 128) == 128 and pick_block(64, 128) == 64
    with pytest.raises(ValueError):
        pick_block(40, 128)


def test_hadamard_spreads_outliers_for_int4():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 256, generator=g)
    x[:, 3] *= 50
    plain = quantize(x, QuantSpec("int4_sym")).dequantize()
    had = block_hadamard(quantize(x, QuantSpec("int4_sym", hadamard_block=128)).dequantize(), 128)
    assert rel(had, x) < 0.5 * rel(plain, x)


def test_dge_derivative():
    k, cap = 5.0, 3.0
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0])
    assert torch.allclose(dge_derivative(grid, k, cap), torch.full((8,), 1 / k))  # flat at grid points
    mids = torch.tensor([0.25, 1.25, 2.5, 3.5, 5.0, -0.75])
    assert torch.equal(dge_derivative(mids, k, cap), torch.full((6,), cap))  # steepest at thresholds, capped

    # against a finite difference of f(u) = δ/2 (1 + sign(2u/δ-1)|2u/δ-1|^(1/k)) between 2 and 3 (δ = 1)
    def f(v):
        t = 2 * (v - 2.0) - 1
        return 0.5 * (1 + torch.sign(t) * t.abs() ** (1 / k))

    v = torch.tensor([2.05, 2.2, 2.4, 2.7, 2.93], dtype=torch.float64)
    fd = (f(v + 1e-6) - f(v - 1e-6)) / 2e-6
    assert torch.allclose(dge_derivative(v, k, cap).double(), fd.clamp(max=cap), rtol=1e-4)
    # mean over a step: 1 uncapped; the cap removes 1 - c^(1/k) + cap·c with c = (k·cap)^(-k/(k-1)) (0.59 here)
    c = (k * cap) ** (-k / (k - 1))
    u = torch.linspace(0, 6, 600001)[:-1]
    assert abs(dge_derivative(u, k, cap).mean().item() - (1 - c ** (1 / k) + cap * c)) < 2e-3


def test_occ_clamps_the_top_quantile():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100, 100, generator=g)
    xc, r = occ_split(x, 0.99)
    assert torch.equal(xc + r, x)
    assert 90 <= (r != 0).sum().item() <= 110  # ~1% are outliers
    assert xc.abs().max() == occ_threshold(x, 0.99)
    # a strided sample gives nearly the same threshold
    assert abs(occ_threshold(x, 0.99, max_samples=2500) - occ_threshold(x, 0.99)) < 0.15


def test_fp4_forward_is_clamped_gemm_plus_residual():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g) * 0.1
    x[0, 0] = 40.0
    y = lowbit_linear(x, w, None, get_recipe("fp4", occ_alpha=0.99))
    xc, r = occ_split(x, 0.99)
    expect = gemm(quantize(xc, QuantSpec("e2m1")), quantize(w, QuantSpec("e2m1"))) + r @ w.t()
    assert torch.allclose(y, expect, atol=1e-5)


# ---- gradients vs fp32 nn.Linear, per recipe --------------------------------------------------------------

# Relative (Frobenius) error bounds on this case: fp32 input of 120 tokens × 128 with one outlier channel (×20),
# W ~ N(0, 0.05²), 96 outputs. Measured (3 seeds): fp8 y .027-.031 dx .056 dW .052-.064; fp4 y .25 (.071 with the
# paper's OCC); int4 y .14-.15 (.30-.33 without the Hadamard). dx and dW are dominated by E5M2's 2 mantissa bits.
# With the DGE (the paper's fp4) the weight gradient is compared with the fp32 gradient times f'(W).
BOUNDS = {  # recipe: (y, dx, dW)
    "fp8": (0.045, 0.075, 0.085),
    "fp8_tensor": (0.05, 0.08, 0.09),
    "fp8_delayed": (0.05, 0.08, 0.09),  # one step: no history yet, fp8_tensor's numbers (test_delayed_scaling.py)
    "fp4": (0.30, 0.08, 0.09),  # no OCC: the outlier channel costs the forward (.25 measured)
    "fp4/paper": (0.10, 0.075, 0.09),  # Wang et al.'s recipe: OCC, DGE, the backward per row
    "fp4/paper/bwd_tensor": (0.10, 0.08, 0.09),
    "int4": (0.20, 0.08, 0.09),  # its fp8 backward is per tensor, as fp8_tensor's
    "int4/bwd_row": (0.20, 0.075, 0.085),
}
PAPER_FP4 = dict(occ_alpha=0.99, dge_k=5.0, bwd_granularity="row")


def variant(name: str) -> tuple[str, dict]:
    """'fp4/paper/bwd_tensor' -> ('fp4', overrides): a recipe name, then options, each after a '/'."""
    base, *options = name.split("/")
    overrides = {}
    for option in options:
        overrides.update(PAPER_FP4 if option == "paper" else {"bwd_granularity": option.removeprefix("bwd_")})
    return base, overrides


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_gradients_vs_fp32_linear(name):
    torch.manual_seed(0)
    x = torch.randn(3, 40, 128)
    x[..., 7] *= 20
    ref = nn.Linear(128, 96)
    nn.init.normal_(ref.weight, std=0.05)
    gy = torch.randn(3, 40, 96)
    xr = x.clone().requires_grad_()
    ref(xr).backward(gy)
    dx0, dw0, db0 = xr.grad, ref.weight.grad.clone(), ref.bias.grad.clone()
    ref.weight.grad = ref.bias.grad = None

    base, overrides = variant(name)
    m = LowBitLinear.from_linear(ref, base, **overrides)
    xl = x.clone().requires_grad_()
    y = m(xl)
    y.backward(gy)
    recipe = get_recipe(base, **overrides)
    if recipe.dge_k:
        dw0 = dw0 * Fp4LinearFunction.weight_grad_factor(ref.weight.detach(), recipe)
    by, bdx, bdw = BOUNDS[name]
    assert rel(y, ref(x)) < by
    assert rel(xl.grad, dx0) < bdx
    assert rel(ref.weight.grad, dw0) < bdw
    assert torch.allclose(ref.bias.grad, db0, rtol=1e-5, atol=1e-5)  # the bias gradient is exact
    assert y.shape == (3, 40, 96) and y.dtype == torch.float32


def test_fp4_dge_changes_weight_grad_only():
    torch.manual_seed(1)
    x, gy = torch.randn(64, 64), torch.randn(64, 32)
    w = (torch.randn(32, 64) * 0.05).requires_grad_()
    grads = {}
    for k in (5.0, None):
        w.grad = None
        xx = x.clone().requires_grad_()
        lowbit_linear(xx, w, None, get_recipe("fp4", dge_k=k)).backward(gy)
        grads[k] = (w.grad.clone(), xx.grad.clone())
    assert torch.equal(grads[5.0][1], grads[None][1])
    factor = grads[5.0][0] / grads[None][0]
    assert torch.allclose(factor, Fp4LinearFunction.weight_grad_factor(w.detach(), get_recipe("fp4", dge_k=5.0)),
                          rtol=1e-5)


def test_tokens_not_multiple_of_16_and_no_bias():
    m = LowBitLinear(32, 48, bias=False, recipe="int4")
    x = torch.randn(7, 32, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert x.grad.shape == (7, 32) and m.weight.grad.shape == (48, 32) and m.bias is None
    assert rel(y, x.detach() @ m.weight.detach().t()) < 0.3


def test_frozen_weight_and_no_input_grad():
    m = LowBitLinear(32, 32, recipe="fp8")
    m.weight.requires_grad_(False)
    x = torch.randn(4, 32, requires_grad=True)
    m(x).sum().backward()
    assert m.weight.grad is None and x.grad is not None
    m.weight.requires_grad_(True)
    m(torch.randn(4, 32)).sum().backward()
    assert m.weight.grad is not None


# ---- the module and convert_linears ------------------------------------------------------------------------


def test_module_is_a_linear_sharing_parameters():
    lin = nn.Linear(64, 32)
    sd = {k: v.clone() for k, v in lin.state_dict().items()}
    m = LowBitLinear.from_linear(lin, "fp4")
    assert isinstance(m, nn.Linear) and m.weight is lin.weight and m.bias is lin.bias
    assert m.state_dict().keys() == sd.keys()
    m.load_state_dict(sd)
    assert "recipe=fp4" in repr(m)
    with pytest.raises(ValueError, match="divisible by 16"):
        LowBitLinear(40, 32)
    with pytest.raises(ValueError, match="unknown recipe"):
        LowBitLinear(32, 32, recipe="fp2")


def test_adopt_turns_the_linear_itself_low_bit():
    """In place (what FSDP2's sharded layers get): the same module object, parameters and hooks, computing as a
    layer made by from_linear; anything but a plain nn.Linear, or a bad recipe or dims, refused untouched."""
    torch.manual_seed(0)
    lin, twin = nn.Linear(64, 32), nn.Linear(64, 32)
    twin.load_state_dict(lin.state_dict())
    calls = []
    lin.register_forward_hook(lambda *a: calls.append(1))
    weight, keys = lin.weight, lin.state_dict().keys()
    m = LowBitLinear.adopt(lin, "fp8_delayed")
    assert m is lin and type(m) is not nn.Linear and isinstance(m, LowBitLinear) and m.weight is weight
    assert m.state_dict().keys() == keys and "recipe=fp8_delayed" in repr(m)
    x = torch.randn(8, 64)
    ref = LowBitLinear.from_linear(twin, "fp8_delayed")
    for _ in range(3):  # delayed scaling: the histories as from_linear's, forward and backward
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = m(xa), ref(xb)
        assert torch.equal(ya, yb)
        (ya * ya).sum().backward()
        (yb * yb).sum().backward()
        assert torch.equal(xa.grad, xb.grad) and torch.equal(m.weight.grad, ref.weight.grad)
        m.weight.grad = ref.weight.grad = None
    assert calls == [1, 1, 1]
    with pytest.raises(TypeError, match="plain nn.Linear"):
        LowBitLinear.adopt(m)
    for bad, match, err in ((nn.Linear(40, 32), "divisible by 16", ValueError),
                            (nn.Linear(32, 32), "unknown recipe", ValueError)):
        with pytest.raises(err, match=match):
            LowBitLinear.adopt(bad, "fp2" if match == "unknown recipe" else "fp8_delayed")
        assert type(bad) is nn.Linear


def test_autocast_output_dtype():
    m = LowBitLinear(32, 32, recipe="fp8")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(torch.randn(4, 32))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32


def test_convert_linears_on_gpt():
    model = GPT(GPTConfig(vocab_size=65, n_embd=64, n_layer=2))
    before = {n: p for n, p in model.named_parameters()}
    convert_linears(model, "int4", hadamard_block=64)
    conv = converted(model)
    assert len(conv) == 8 and "lm_head" not in conv and all(v == "int4" for v in conv.values())
    assert type(model.lm_head) is nn.Linear and model.wte.weight is model.lm_head.weight
    assert model.layers[0].mlp.fc.recipe.hadamard_block == 64
    assert dict(model.named_parameters()) == before  # same parameter objects
    logits, loss = model(torch.randint(0, 65, (2, 16)), torch.randint(0, 65, (2, 16)))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())

    model = GPT(GPTConfig(vocab_size=65, n_embd=64, n_layer=2))
    convert_linears(model, "fp8", filter_fn=lambda mod, fqn: "mlp" in fqn, skip=())
    conv = converted(model)
    assert set(conv) == {f"layers.{i}.mlp.{p}" for i in range(2) for p in ("fc", "proj")}

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 40), nn.Linear(40, 10))
    with pytest.warns(UserWarning, match="not divisible by 16"):
        convert_linears(model, "fp8")
    assert list(converted(model)) == ["0"]
    with pytest.warns(UserWarning):
        convert_linears(model, "fp4")  # already converted layers are left alone
    assert converted(model) == {"0": "fp8"}


def test_no_grad_forward_saves_no_transposed_copy(monkeypatch):
    from lpoptim.nn import functional

    calls = []
    real, real_both = functional._save_x_for_dw, functional.quantize_pair
    real_4bit = functional._fp4_forward_and_xt
    monkeypatch.setattr(functional, "_save_x_for_dw", lambda *a: calls.append("xt") or real(*a))
    monkeypatch.setattr(functional, "quantize_pair", lambda *a, **k: calls.append("x+xt") or real_both(*a, **k))
    monkeypatch.setattr(functional, "_fp4_forward_and_xt", lambda *a: calls.append("4bit+xt") or real_4bit(*a))
    # fp8: x and xᵀ together; fp4 (fp8 backward per tensor): xᵀ's absmax from x's row pass; int4 (Hadamard):
    # xᵀ on its own
    for recipe, made in (("fp8", ["x+xt"]), ("fp8_tensor", ["x+xt"]), ("int4", ["xt"]), ("fp4", ["4bit+xt"])):
        layer = convert_linears(torch.nn.Sequential(torch.nn.Linear(32, 16)), recipe)
        x = torch.randn(8, 32)
        with torch.no_grad():
            layer(x)
        assert calls == []  # inference: nothing for a backward that cannot come
        y = layer(x)
        assert calls == made
        y.sum().backward()
        calls.clear()


def test_recipe_refuses_unknown_forward_format():
    from lpoptim.nn import get_recipe

    with pytest.raises(ValueError, match="fwd_fmt"):
        get_recipe("fp8", fwd_fmt="e5m2")


def test_fast_accum_is_refused_for_4bit_recipes():
    from lpoptim.nn import get_recipe

    assert get_recipe("fp8_tensor", fast_accum=True).fast_accum
    with pytest.raises(ValueError, match="fast_accum"):
        get_recipe("fp4", fast_accum=True)


def test_backward_granularity_is_validated_and_defaults_to_the_forward_one():
    from lpoptim.nn import get_recipe

    assert get_recipe("fp8").backward_granularity == "row"
    assert get_recipe("fp8_tensor").backward_granularity == "tensor"
    assert get_recipe("int4").backward_granularity == "tensor"
    assert get_recipe("int4", bwd_granularity="row").backward_granularity == "row"
    with pytest.raises(ValueError, match="bwd_granularity"):
        get_recipe("int4", bwd_granularity="group")


def test_weight_absmax_carried_to_the_backward_gives_the_same_operand():
    """fp8_tensor keeps W's absmax from the forward for the backward's Wᵀ (one pass fewer over W): the operand
    must be bit-equal to quantizing Wᵀ afresh, and a wrong absmax must show."""
    from lpoptim.nn.functional import _quantize_wt
    from lpoptim.nn.operands import tensor_amax
    torch.manual_seed(0)
    w = torch.randn(48, 80) * 0.05
    w[3, 7] = float("inf")  # not finite: never sets the scale
    r = get_recipe("fp8_tensor")
    fresh = quantize(w.t(), QuantSpec(r.bwd_fmt, "tensor"))
    carried = _quantize_wt(w, r, tensor_amax(w))
    assert torch.equal(carried.values.view(torch.uint8), fresh.values.view(torch.uint8))
    assert torch.equal(carried.scale, fresh.scale)
    wrong = _quantize_wt(w, r, tensor_amax(w) * 2)
    assert not torch.equal(wrong.scale, fresh.scale)
    with pytest.raises(ValueError, match="amax"):
        quantize(w, QuantSpec("e4m3", "row"), amax=tensor_amax(w))
    with pytest.raises(ValueError, match="amax must be one fp32"):
        quantize(w, QuantSpec("e4m3", "tensor"), amax=tensor_amax(w).double())
    with pytest.raises(ValueError, match="does not fit"):  # an absmax where column maxima are expected
        _quantize_wt(w, get_recipe("fp8"), tensor_amax(w))


@pytest.mark.parametrize("recipe", sorted(__import__("lpoptim.nn.recipes", fromlist=["RECIPES"]).RECIPES))
def test_no_tokens_gives_empty_output_and_zero_weight_grad(recipe):
    """A batch with no tokens (an empty shard, a filtered batch): every recipe returns an empty output and a zero
    weight gradient instead of failing in an absmax or quantile over nothing."""
    layer = LowBitLinear(32, 16, recipe=recipe)
    x = torch.randn(0, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 32)
    assert layer.weight.grad is not None and not layer.weight.grad.any()


def test_specs_and_recipes_check_their_fields_when_made():
    """A QuantSpec or Recipe with a field no backend handles is refused where it is made, not at its first call
    (where the reference and the kernel backend would disagree about it)."""
    from lpoptim.nn.recipes import Recipe

    for kw, msg in ((dict(fmt="e3m3"), "format"), (dict(granularity="group"), "granularity"),
                    (dict(scaling="delay"), "scaling"), (dict(keep="max"), "keep"), (dict(pad_to=0), "pad_to"),
                    (dict(hadamard_block=48), "power of two"), (dict(hadamard_block=64, keep="amax"), "Hadamard"),
                    (dict(hadamard_block=64, granularity="tensor"), "Hadamard"),
                    (dict(keep="col_max", granularity="tensor"), "col_max")):
        with pytest.raises(ValueError, match=msg):
            QuantSpec(**{"fmt": "int4_sym", **kw})
    with pytest.raises(ValueError, match="bwd_granularity"):
        Recipe("mine", bwd_granularity="group")
    with pytest.raises(ValueError, match="fwd_fmt"):
        Recipe("mine", fwd_fmt="e5m2")


def test_min_tokens_runs_small_calls_as_nn_linear():
    """A layer with min_tokens runs a call of fewer tokens (all leading dims together) as nn.Linear does, output
    and gradients bit for bit, and a call of that many or more low-bit, as without it; convert_linears sets it on
    every layer it converts and refuses a bad value before any layer changes."""
    torch.manual_seed(0)
    base = nn.Linear(64, 32)
    low = LowBitLinear.from_linear(copy.deepcopy(base), "fp8_tensor")
    gated = LowBitLinear.from_linear(copy.deepcopy(base), "fp8_tensor")
    gated.min_tokens = 12
    for shape, like in (((1, 11, 64), base), ((3, 4, 64), low), ((2, 6, 64), low), ((16, 64), low)):
        x = torch.randn(shape)
        outs = []
        for layer in (like, gated):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.pow(2).sum().backward()
            outs.append((y, xi.grad, layer.weight.grad, layer.bias.grad))
            layer.zero_grad(set_to_none=True)
        for a, b in zip(*outs):
            assert torch.equal(a, b), shape
    x = torch.randn(2, 6, 64)
    assert not torch.equal(base(x), gated(x))  # 12 tokens: low-bit, which rounds

    # an fp32 layer, a bf16 input, no autocast: the low-bit path takes it (out in x's dtype), and so does the
    # nn.Linear path, which torch's own would refuse
    for tokens in (8, 16):
        x = torch.randn(tokens, 64, dtype=torch.bfloat16)
        y = gated(x)
        assert y.dtype == torch.bfloat16
        if tokens < gated.min_tokens:
            assert torch.equal(y, F.linear(x, base.weight.bfloat16(), base.bias.bfloat16()))

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 48))
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="min_tokens"):
            convert_linears(model, "fp8", min_tokens=bad)
        assert converted(model) == {}
    convert_linears(model, "fp8", min_tokens=256)
    assert [m.min_tokens for m in model] == [256, 256] and "min_tokens=256" in repr(model[0])
