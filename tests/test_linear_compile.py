"""Low-bit linears under torch.compile: the custom ops (lpoptim/nn/compiled.py) against the eager Function."""
import pytest
import torch

from lpoptim.nn import LowBitLinear, get_recipe
from lpoptim.nn.compiled import _forward_op, lowbit_linear_op

# and Wang et al.'s fp4: outlier clamping, DGE, the backward per row
RECIPES = ["fp8", "fp8_tensor", "fp4", "int4",
           pytest.param(get_recipe("fp4", occ_alpha=0.99, dge_k=5.0, bwd_granularity="row"), id="fp4-paper")]


def _grads(run, lin, x):
    for t in (x, lin.weight, lin.bias):
        t.grad = None
    y = run(x)
    y.square().sum().backward()
    return y.detach(), x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()


def _layer(recipe, device="cpu", seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 32, device=device)
    x = torch.randn(2, 20, 64, device=device, requires_grad=True)
    return lin, LowBitLinear.from_linear(lin, recipe), x


@pytest.mark.parametrize("recipe", RECIPES)
def test_custom_ops_compute_what_the_eager_function_does(recipe):
    lin, m, x = _layer(recipe)
    eager = _grads(m, lin, x)
    ops = _grads(lambda t: lowbit_linear_op(t, lin.weight, lin.bias, m.recipe, torch.float32), lin, x)
    assert all(torch.equal(a, b) for a, b in zip(eager, ops, strict=True))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fake_implementations_match_the_real_ops(recipe):
    lin, m, _ = _layer(recipe)
    for want_xt in (True, False):
        args = (torch.randn(37, 64), lin.weight.detach().requires_grad_(), lin.bias.detach(), m.recipe.key,
                torch.bfloat16, want_xt)
        # the schema and AOT tests sum and compare outputs, which torch cannot do for fp8 tensors on the CPU
        torch.library.opcheck(_forward_op, args, test_utils=("test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("recipe", ["fp8", "fp8_tensor", "int4"])
def test_compiled_layer_matches_eager_without_graph_breaks(recipe):
    torch._dynamo.reset()
    lin, m, x = _layer(recipe)
    eager = _grads(m, lin, x)
    compiled = _grads(torch.compile(m, backend="aot_eager", fullgraph=True), lin, x)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


def test_inference_under_compile_saves_nothing():
    torch._dynamo.reset()
    lin, m, x = _layer("fp8")
    with torch.no_grad():
        y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(y, m(x).detach())


def _mlp(recipe, device):
    torch.manual_seed(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64)).to(device)
    for i in (0, 2):
        mlp[i] = LowBitLinear.from_linear(mlp[i], recipe)
    return mlp


def _mlp_grads(run, mlp, x):
    mlp.zero_grad(set_to_none=True)
    run(x).float().square().mean().backward()
    return [p.grad.clone() for p in mlp.parameters()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inductor_compiles_a_block_with_lowbit_linears(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    mlp = _mlp("fp8_tensor", device)
    x = torch.randn(48, 64, device=device)
    with torch.autocast(device, torch.bfloat16):
        eager = _mlp_grads(mlp, mlp, x)
        compiled = _mlp_grads(torch.compile(mlp, fullgraph=True), mlp, x)
    # Inductor keeps the SiLU between the GEMMs in fp32 where eager rounds it to bf16, so some FP8 codes move:
    # close, not equal (measured 0.9985 at worst on the CPU)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0) > 0.995


def test_recipes_reach_the_ops_after_pickling_and_copying():
    import copy
    import pickle

    from lpoptim.nn.recipes import BY_KEY, get_recipe

    r = get_recipe("fp8_tensor", fast_accum=True)
    BY_KEY.pop(r.key)  # as in a fresh process that unpickles a converted model
    for again in (pickle.loads(pickle.dumps(r)), copy.deepcopy(r)):
        assert again == r and again.key == r.key and BY_KEY[r.key] == r


OLD_DYNAMO = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_tensor", "int4"])
def test_compiled_layer_takes_new_shapes(recipe):
    """Dynamo recompiles with symbolic shapes for a third token count or feature width."""
    if OLD_DYNAMO and recipe.startswith("fp8"):
        pytest.xfail("torch < 2.13: Dynamo asserts retracing the traced fp8 Function with symbolic feature dims")
    torch._dynamo.reset()
    for k, n, tokens in ((64, 64, 32), (64, 128, 48), (128, 64, 80), (128, 64, 96)):
        lin = torch.nn.Linear(k, n, bias=False)
        m = LowBitLinear.from_linear(lin, recipe)
        x = torch.randn(2, tokens, k, requires_grad=True)
        y = torch.compile(m)(x)
        y.sum().backward()
        assert y.shape == (2, tokens, n) and x.grad.shape == x.shape


def test_min_tokens_under_compile():
    """min_tokens is a test of the input's shape: compiled without a graph break, a call of fewer tokens computes
    what nn.Linear does and a call of that many what the low-bit layer does, each as eager; with token counts
    that Dynamo makes symbolic (a third shape), the branch follows each call's count."""
    torch._dynamo.reset()
    lin, m, x = _layer("fp8_tensor")  # 40 tokens
    m.min_tokens = 41
    assert all(torch.equal(a, b) for a, b in zip(_grads(lin, lin, x), _grads(
        torch.compile(m, backend="aot_eager", fullgraph=True), lin, x), strict=True))
    torch._dynamo.reset()
    m.min_tokens = 40
    low = LowBitLinear.from_linear(lin, "fp8_tensor")
    assert all(torch.equal(a, b) for a, b in zip(_grads(low, lin, x), _grads(
        torch.compile(m, backend="aot_eager", fullgraph=True), lin, x), strict=True))
    torch._dynamo.reset()
    run = torch.compile(m, backend="aot_eager")
    for tokens in (16, 24, 32, 48, 64):
        x = torch.randn(1, tokens, 64, requires_grad=True)
        like = lin if tokens < 40 else low
        assert torch.equal(run(x), like(x)), tokens
    # prepare's default recipe with the weight scale kept on the device (where it pays): a small call leaves the state
    torch._dynamo.reset()
    delayed = LowBitLinear.from_linear(lin, "fp8_delayed")
    delayed.previous_weight_scale, delayed.min_tokens = True, 40
    run = torch.compile(delayed, backend="aot_eager")
    run(torch.randn(1, 16, 64)).sum().backward()
    assert not delayed.weight_amax_state.any()
    run(torch.randn(1, 48, 64)).sum().backward()
    assert delayed.weight_amax_state[0] != 0  # the low-bit call recorded W's absmax
