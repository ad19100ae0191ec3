"""GPUs without FP8 conversions (compute capability 8.0-8.6: A100, A10, RTX 30xx): lpoptim.AdamW runs there
(its kernel converts codes by integer arithmetic, tests/test_adamw_kernel.py); FP8 activations and low-bit linear
layers are refused with a clear error before anything changes. No such GPU is needed: the capability is patched."""
from types import SimpleNamespace

import pytest
import torch

import lpoptim
from lpoptim import device as dev
from lpoptim.kernels import grid


def _on(index=0):
    return SimpleNamespace(device=torch.device("cuda", index))


@pytest.mark.parametrize("cap, refused", [((8, 0), True), ((8, 6), True), ((7, 0), True), ((8, 9), False),
                                          ((9, 0), False), ((10, 0), False)])
def test_fp8_conversions_by_compute_capability(monkeypatch, cap, refused):
    monkeypatch.setattr(dev, "capability", lambda index: cap)
    assert dev.has_fp8_conversions(torch.device("cuda", 0)) is not refused
    problem = dev.fp8_device_problem([torch.zeros(1), _on()], "FP8 activations")
    assert (problem is not None) is refused
    if refused:
        assert f"cuda:0 has {cap[0]}.{cap[1]}" in problem and "8.9" in problem and "lpoptim.AdamW" in problem


def test_cpu_tensors_have_no_problem():
    assert dev.has_fp8_conversions(torch.device("cpu"))
    assert dev.fp8_device_problem([torch.zeros(1)], "x") is None


def test_the_interpreter_keeps_the_hardware_path(monkeypatch):
    monkeypatch.setattr(dev, "capability", lambda index: (8, 0))
    assert grid.hardware_fp8(torch.device("cuda", 0)) == grid.interpreted()


def _refusing(monkeypatch, module):
    monkeypatch.setattr(module, "fp8_device_problem", lambda tensors, what: f"{what} need FP8 (patched)")


def test_convert_linears_refuses_before_any_change(monkeypatch):
    import lpoptim.nn.convert as convert

    _refusing(monkeypatch, convert)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match="convert_linears: low-bit linear layers need FP8"):
        lpoptim.convert_linears(model, "fp8_tensor")
    assert all(type(m) is torch.nn.Linear for m in model)


def test_compress_activations_refuses_before_any_change(monkeypatch):
    import lpoptim.activations.wrap as wrap

    _refusing(monkeypatch, wrap)
    blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)])
    forwards = [b.forward for b in blocks]
    with pytest.raises(ValueError, match="compress_activations: FP8 activations need FP8"):
        lpoptim.compress_activations(blocks)
    assert not any(wrap.is_wrapped(b) for b in blocks) and [b.forward for b in blocks] == forwards


def test_convert_linears_refuses_only_what_it_would_convert(monkeypatch):
    import lpoptim.nn.convert as convert

    seen = []
    monkeypatch.setattr(convert, "fp8_device_problem", lambda tensors, what: seen.extend(tensors) or None)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 30), torch.nn.Embedding(4, 32))
    lpoptim.convert_linears(model, "fp8_tensor", filter_fn=lambda m, fqn: fqn == "0")
    assert len(seen) == 1 and seen[0] is model[0].weight  # the one layer converted, not the others


def test_e5m2_activations_are_not_refused(monkeypatch):
    """E5M2 codes are written by torch ops, which older GPUs run: only E4M3 (lpoptim's kernels) is refused."""
    import lpoptim.activations.wrap as wrap

    _refusing(monkeypatch, wrap)
    blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32)])
    handle = lpoptim.compress_activations(blocks, fmt="e5m2")
    handle.remove()


def test_a_kernel_compiled_for_a_gpu_without_fp8_says_so(monkeypatch):
    """A layer moved to such a GPU after the checks: Triton's compile error becomes lpoptim's plain one."""
    from lpoptim.kernels import launch

    class Kernel:  # what Triton raises there: a compile error caused by the dtype's ValueError
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                try:
                    raise ValueError("type fp8e4nv not supported in this architecture. The supported fp8 dtypes "
                                     "are ('fp8e4b15', 'fp8e5')")
                except ValueError as e:
                    raise RuntimeError("at 12:4: compilation failed") from e
            return run

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dev, "capability", lambda index: (8, 0))
    with pytest.raises(RuntimeError, match="lpoptim: FP8 activations and low-bit linear layers need a GPU with FP8 "
                                           "conversions.*cuda:0 has 8.0"):
        launch._ordinary(Kernel(), (1,), (), 4, {})

    class Other(Kernel):
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise RuntimeError("something else")
            return run

    with pytest.raises(RuntimeError, match="^something else$"):
        launch._ordinary(Other(), (1,), (), 4, {})


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                          for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.gpu
def test_prepare_and_the_step_on_a_gpu_reported_as_sm80(monkeypatch):
    """prepare on a GPU that reports 8.0: no FP8 activations or linears, and FP8 ones asked for are refused before
    any change; lpoptim.AdamW's integer conversions give the hardware path's bits."""
    torch.manual_seed(0)
    model = _Stack().cuda().to(torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def run(cap):
        monkeypatch.setattr(dev, "capability", lambda index: cap)
        m = _Stack().cuda().to(torch.bfloat16)
        m.load_state_dict(model.state_dict())
        opt = lpoptim.AdamW(m.parameters(), lr=1e-3, min_quant_numel=1024)
        for _ in range(4):
            m(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in m.parameters()]

    hw = run((9, 0))
    integer = run((8, 0))  # the capability stays patched for the rest of the test
    assert all(torch.equal(a, b) for a, b in zip(hw, integer))
    with pytest.raises(ValueError, match="activations='fp8'.*8.0"):
        lpoptim.prepare(model, lr=1e-3, activations="fp8", compile=False)
    with pytest.raises(ValueError, match="linears='fp8_tensor'.*8.0"):
        lpoptim.prepare(model, lr=1e-3, linears="fp8_tensor", compile=False)
    assert all(type(layer[0]) is torch.nn.Linear for layer in model.layers)
    opt = lpoptim.prepare(model, lr=1e-3, compile=False)
    assert opt.plan.linears is None and opt.plan.activations is None
    model(x).float().square().mean().backward()
    opt.step()
    opt.plan.remove()
