"""A compiled layer's W scale from its previous absmax (nn/weight_scale.py): the rule in torch, the Triton kernels
against it (interpreter on the CPU, compiled on the GPU), and LowBitLinear under torch.compile keeping it."""
import pytest
import torch

from lpoptim.nn import LowBitLinear
from lpoptim.nn.operands import Operand, quantize_operand_ref
from lpoptim.nn.weight_scale import HEADROOM, new_state, quantize_weight_prev, take_prev_ref
from lpoptim.quant import finite_absmax

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _prev(state):
    return state[0].view(torch.float32).item()


def test_reference_rule():
    """17/16 × its own absmax first; 17/16 × the previous while W's own lies within [half of that, that]; 17/16 ×
    its own beyond either end; slots that are not a finite non-negative absmax count as none."""
    state = new_state()
    w = torch.full((4, 4), 2.0)
    w[0, 0] = float("nan")  # non-finite elements never set a scale
    assert take_prev_ref(state, w).item() == 2.0 * HEADROOM and _prev(state) == 2.0
    assert take_prev_ref(state, w * 1.05).item() == 2.0 * HEADROOM  # grew within the headroom
    assert _prev(state) == pytest.approx(2.1)
    assert take_prev_ref(state, w * 1.2).item() == pytest.approx(2.4 * HEADROOM)  # beyond 2.1 * 17/16: its own
    assert take_prev_ref(state, w * 0.7).item() == pytest.approx(2.4 * HEADROOM)  # shrank, within half
    assert take_prev_ref(state, w * 0.3).item() == pytest.approx(0.6 * HEADROOM)  # 1.4 * 17/16 > 2 * 0.6
    for bits in (torch.tensor(float("nan")), torch.tensor(-3.0), torch.tensor(float("inf"))):
        state[0] = bits.view(torch.int32)
        assert take_prev_ref(state, w).item() == 2.0 * HEADROOM
    state.zero_()
    assert take_prev_ref(state, torch.zeros(3, 3)).item() == 0.0  # an all-zero W: the scale of zeros
    assert state.tolist()[1:] == [0, 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference_over_calls(device, dtype, monkeypatch):
    """The two launches (quantize with the guess, recording W's own absmax; quantize again where the rule says)
    give the reference's codes, scale, absmax and state, call after call, the second launch's programs looping
    over the tiles (one program: it must redo every tile)."""
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU runs the compiled kernel")
    import lpoptim.kernels.linear_quant as lq
    if device == "cpu":
        monkeypatch.setattr(lq, "_redo_programs", lambda device: 1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 300, generator=g)  # 3 x 3 tiles of TUNING['delayed']'s 32 x 128
    sk, sr = new_state(device), new_state()
    sk[0] = torch.tensor(float("nan")).view(torch.int32)  # uninitialized slots (to_empty) count as none
    sr.copy_(sk.cpu())
    for step, mult in enumerate([1.0, 1.04, 1.5, 0.9, 0.3, 0.3]):
        wk = (w * mult).to(dtype)
        if device == "cpu":  # the kernels themselves, interpreted (the op takes the reference off CUDA)
            got = Operand(*lq.quantize_weight_prev(wk, "e4m3", 304, sk))
        else:  # the op: Triton launched through wrap_triton
            got = quantize_weight_prev(wk.to(device), "e4m3", 304, sk)
        used = take_prev_ref(sr, wk)
        ref = quantize_operand_ref(wk, "e4m3", "tensor", None, 304, used)
        assert got.amax.item() == used.item(), step
        assert torch.equal(got.values.float().cpu(), ref.values.float()), step
        assert torch.equal(got.scale.cpu(), ref.scale.reshape(())), step
        assert torch.equal(sk.cpu(), sr), step


def test_state_is_checked():
    with pytest.raises(ValueError, match="three|int32"):
        quantize_weight_prev(torch.ones(4, 16), "e4m3", 16, torch.zeros(3))


def test_compiled_layer_keeps_the_state():
    """Under torch.compile, LowBitLinear (fp8_delayed) scales W by the state and moves W's absmax into it every
    training forward, in one graph, no break; its gradients stay as close to fp32 as current scaling's; the
    state is no part of the state_dict, and loading weights clears it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = LowBitLinear(64, 48, recipe="fp8_delayed")
    m.previous_weight_scale = True
    exact = torch.nn.Linear(64, 48)
    exact.load_state_dict(m.state_dict())
    run = torch.compile(m)
    x = torch.randn(2, 32, 64)
    for step in range(3):
        y = run(x)
        y.square().sum().backward()
        assert _prev(m.weight_amax_state) == finite_absmax(m.weight.detach()).item()
        y0 = exact(x)
        y0.square().sum().backward()
        assert ((y - y0).norm() / y0.norm()).item() < 0.05, step
        assert ((m.weight.grad - exact.weight.grad).norm() / exact.weight.grad.norm()).item() < 0.09, step
        with torch.no_grad():
            for p in (m.weight, exact.weight):
                p.mul_(1.02)
                p.grad = None
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert list(m.state_dict()) == ["weight", "bias"]
    m.load_state_dict(exact.state_dict())
    assert m.weight_amax_state.eq(0).all()
    torch._dynamo.reset()


def test_convert_linears_sets_it_where_asked():
    """convert_linears(..., previous_weight_scale=True) sets the flag on the layers it converts (what prepare asks
    where it pays: tests/test_prepare.py); off by default."""
    from lpoptim.nn import LowBitLinear, convert_linears

    for on in (False, True):
        model = convert_linears(torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 32)), "fp8_delayed",
                                previous_weight_scale=on)
        layers = [m for m in model if isinstance(m, LowBitLinear)]
        assert len(layers) == 2 and all(m.previous_weight_scale is on for m in layers)


def test_state_is_zeroed_when_moved_or_materialized():
    """to_empty leaves uninitialized memory: the first launch's atomic maximum would start from it (slot 1), so
    every _apply (to_empty, .to, casts) zeroes the state: the next W takes its own absmax."""
    with torch.device("meta"):
        m = LowBitLinear(64, 48, recipe="fp8_delayed")
    m.to_empty(device="cpu")
    assert m.weight_amax_state.eq(0).all()
    m.weight_amax_state.fill_(12345)
    m.to(torch.bfloat16)
    assert m.weight_amax_state.eq(0).all() and m.weight_amax_state.dtype == torch.int32
    assert not LowBitLinear.previous_weight_scale  # off unless asked (prepare sets it where it pays)
