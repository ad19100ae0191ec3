"""lpoptim.AdamW as a drop-in for torch.optim.AdamW: API, options, state dicts, trajectories (CPU reference path)."""
import copy
import math
import inspect
import io
import subprocess
import sys

import pytest
import torch

import lpoptim
from lpoptim.optim.reference import load_moment
from lpoptim.optim.state import StateLayout, stored_moment


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dtype)


def batches(n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 64, generator=g)
    for _ in range(n):
        x = torch.randn(32, 64, generator=g)
        yield x.to(dtype), (x @ w).to(dtype)


def train(model, opt, n, seed=1, sched=None):
    losses = []
    for x, y in batches(n, seed, next(model.parameters()).dtype):
        loss = (model(x).float() - y.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def test_signature_and_defaults_match_torch():
    ours = inspect.signature(lpoptim.AdamW.__init__).parameters
    theirs = inspect.signature(torch.optim.AdamW.__init__).parameters
    for name, p in theirs.items():
        assert name in ours, name
        assert ours[name].default == p.default, name
        assert ours[name].kind == p.kind, name


def test_trajectory_tracks_torch_adamw():
    """FP8 moments round m and v with at most 2^-4 relative error (about 1.5% RMS with expansion, measured in
    benchmarks/state_quant_error.py), so each update differs from torch's by a few percent RMS and the
    parameter displacement after 100 steps by about as much: 10% is a bound with margin; loss within 2%."""
    m1, m2 = make_model(), make_model()
    p0 = [p.detach().clone() for p in m1.parameters()]
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    o2 = lpoptim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, min_quant_numel=1024)
    l1, l2 = train(m1, o1, 100), train(m2, o2, 100)
    for a, b, c in zip(m1.parameters(), m2.parameters(), p0):
        assert (a - b).norm() / (a - c).norm() < 0.10
    assert abs(l2[-1] - l1[-1]) / l1[-1] < 0.02
    assert all("exp_avg_scale" in o2.state[p] for p in m2.parameters() if p.numel() >= 1024)


def test_small_tensors_keep_fp32_states_and_match_torch_closely():
    m1, m2 = make_model(), make_model()
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    o2 = lpoptim.AdamW(m2.parameters(), lr=1e-2, min_quant_numel=10**9)  # nothing quantized
    train(m1, o1, 20), train(m2, o2, 20)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # fp32 rounding order only
    assert all(o2.state[p]["exp_avg"].dtype == torch.float32 for p in m2.parameters())


def test_state_bytes_within_budget():
    model = torch.nn.Linear(1024, 1024, bias=True)
    opt = lpoptim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    sb = lpoptim.state_bytes(opt)
    assert sb["quantized_bytes_per_param"] <= 2.07
    assert sb["quantized_params"] == 1024 * 1024
    assert opt.state[model.bias]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("opts", [dict(amsgrad=True), dict(maximize=True), dict(lr=torch.tensor(1e-2)),
                                  dict(exp_avg_sq_format="e5m2"), dict(expansion=False), dict(sqrt_exp_avg_sq=True),
                                  dict(group_size=32), dict(foreach=True), dict(capturable=True)])
def test_options_train(opts):
    model = make_model()
    opt = lpoptim.AdamW(model.parameters(), **{"lr": 1e-2, "min_quant_numel": 1024, **opts})
    losses = train(model, opt, 30)
    if opts.get("maximize"):
        assert losses[-1] > losses[0]
    else:
        assert losses[-1] < 0.75 * losses[0]  # torch AdamW: 0.52 after 30 steps
    if opts.get("amsgrad"):
        assert all(stored_moment(opt.state[p], "max_exp_avg_sq") is not None for p in model.parameters())


def test_parameter_groups_schedulers_and_add_param_group():
    model = make_model()
    a, b = model[0], model[2]
    opt = lpoptim.AdamW([{"params": a.parameters(), "lr": 1e-2, "group_size": 64},
                         {"params": b.weight, "weight_decay": 0.0}], lr=5e-3, min_quant_numel=1024)
    opt.add_param_group({"params": [b.bias], "lr": 1e-3, "expansion": False})
    assert opt.param_groups[2]["expansion"] is False and opt.param_groups[1]["group_size"] == 128
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 5e-3, 1e-3], total_steps=20)
    losses = train(model, opt, 20, sched=sched)
    assert losses[-1] < losses[0]
    assert opt.state[a.weight]["exp_avg_scale"].shape == (128, 1)  # 64-wide rows: one group of 64
    for cls, kw in [(torch.optim.lr_scheduler.StepLR, dict(step_size=2)),
                    (torch.optim.lr_scheduler.CosineAnnealingLR, dict(T_max=5)),
                    (torch.optim.lr_scheduler.LinearLR, {}), (torch.optim.lr_scheduler.ReduceLROnPlateau, {})]:
        o = lpoptim.AdamW(make_model().parameters())
        s = cls(o, **kw)
        o.step()
        s.step(1.0) if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) else s.step()


def test_closure_and_zero_grad():
    model = make_model()
    opt = lpoptim.AdamW(model.parameters(), lr=1e-2)
    x, y = next(batches(1))

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    l0 = opt.step(closure)
    for _ in range(5):
        l1 = opt.step(closure)
    assert l1 < l0
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # no gradients: nothing happens, nothing fails


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters(dtype):
    model = make_model(dtype=dtype)
    opt = lpoptim.AdamW(model.parameters(), lr=1e-2, min_quant_numel=1024)
    losses = train(model, opt, 30)
    assert losses[-1] < 0.75 * losses[0]
    assert all(p.dtype == dtype for p in model.parameters())
    assert opt.state[model[0].weight]["exp_avg_scale"].dtype == torch.float32


def test_refusals_name_the_option():
    p = [torch.nn.Parameter(torch.randn(4))]
    with pytest.raises(ValueError, match="differentiable"):
        lpoptim.AdamW(p, differentiable=True)
    with pytest.raises(ValueError, match="complex"):
        lpoptim.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="group_sz"):
        lpoptim.AdamW(p, group_sz=3)
    with pytest.raises(ValueError, match="learning rate"):
        lpoptim.AdamW(p, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        lpoptim.AdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="exp_avg_format"):
        lpoptim.AdamW(p, exp_avg_format="e2m1")
    with pytest.raises(ValueError, match="fused=True"):
        lpoptim.AdamW(p, fused=True)  # CPU parameters: the Triton kernel is CUDA-only
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = lpoptim.AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("shape", [(), (1,), (5000,), (3, 1000), (70, 130), (2, 3, 4, 700)])
def test_edge_shapes_zero_gradients_and_constant_groups(shape):
    p = torch.nn.Parameter(torch.randn(shape))
    opt = lpoptim.AdamW([p], lr=1e-2, min_quant_numel=1)
    p.grad = torch.zeros(shape)
    before = p.detach().clone()
    opt.step()
    torch.testing.assert_close(p.detach(), before * (1 - 1e-2 * 1e-2))  # only the weight decay moved it
    p.grad = torch.full(shape, 0.5)  # every group constant
    opt.step()
    st = opt.state[p]
    assert torch.isfinite(st["exp_avg_scale"]).all() and torch.isfinite(p).all()
    torch.testing.assert_close(load_moment(st, "exp_avg", StateLayout.for_param(p, opt.param_groups[0])),
                               torch.full(shape, 0.5 * 0.1), rtol=2e-3, atol=0)


def test_non_contiguous_parameter():
    base = torch.randn(256, 64)
    p = torch.nn.Parameter(base.t())  # non-contiguous view
    ref = torch.nn.Parameter(base.t().contiguous())
    o1, o2 = lpoptim.AdamW([p], lr=1e-2, min_quant_numel=1), lpoptim.AdamW([ref], lr=1e-2, min_quant_numel=1)
    g = torch.randn(64, 256)
    p.grad, ref.grad = g.clone(), g.clone()
    o1.step(), o2.step()
    assert torch.equal(p.detach(), ref.detach())


def test_nan_gradient_element_stays_in_its_element():
    p = torch.nn.Parameter(torch.randn(8, 256))
    opt = lpoptim.AdamW([p], lr=1e-2, min_quant_numel=1)
    ref = torch.nn.Parameter(p.detach().clone())
    ropt = torch.optim.AdamW([ref], lr=1e-2)
    g = torch.randn(8, 256) * 1e-3
    g[3, 17] = float("nan")
    g[5, 200] = float("inf")
    p.grad, ref.grad = g.clone(), g.clone()
    opt.step(), ropt.step()
    assert torch.equal(torch.isfinite(p), torch.isfinite(ref))  # exactly the elements torch corrupts
    g2 = torch.randn(8, 256) * 1e-3
    p.grad = g2
    opt.step()
    bad = ~torch.isfinite(p)
    assert bad.sum() == 2
    layout = StateLayout.for_param(p, opt.param_groups[0])
    m = load_moment(opt.state[p], "exp_avg", layout)
    assert torch.isnan(m).sum() == 1 and torch.isnan(m[3, 17])  # the NaN stays; the inf saturated, finite


def test_gradient_whose_square_overflows_keeps_the_parameter_finite():
    """g = 1e30: v = g^2 overflows fp32 to inf. torch AdamW then updates by m / inf = 0 and stays finite;
    lpoptim stores inf as its group's largest code (never NaN) and stays finite too."""
    p = torch.nn.Parameter(torch.randn(8, 256))
    ref = torch.nn.Parameter(p.detach().clone())
    opt, ropt = lpoptim.AdamW([p], lr=1e-2, min_quant_numel=1), torch.optim.AdamW([ref], lr=1e-2)
    for step in range(3):
        g = torch.randn(8, 256) * 1e-3
        if step == 0:
            g[2, 100] = 1e30
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step(), ropt.step()
    assert torch.isfinite(ref).all() and torch.isfinite(p).all()


def test_grad_scaler_protocol_skips_and_unscales():
    model = make_model()
    ref = copy.deepcopy(model)
    opt = lpoptim.AdamW(model.parameters(), lr=1e-2, min_quant_numel=1024)
    ropt = lpoptim.AdamW(ref.parameters(), lr=1e-2, min_quant_numel=1024)
    x, y = next(batches(1))
    for m, o, scale in ((model, opt, 1024.0), (ref, ropt, None)):
        o.zero_grad()
        loss = (m(x) - y).pow(2).mean()
        (loss * (scale or 1.0)).backward()
        if scale:
            o.grad_scale, o.found_inf = torch.tensor(scale), torch.tensor(0.0)
        o.step()
        if scale:
            del o.grad_scale, o.found_inf
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    before = [p.detach().clone() for p in model.parameters()]
    states = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, states["state"][pid][k]), k


def test_with_torch_grad_scaler_on_cpu():
    model = make_model()
    opt = lpoptim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for x, y in batches(10):
        opt.zero_grad()
        scaler.scale((model(x) - y).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    assert all(float(opt.state[p]["step"]) == 10 for p in model.parameters())


def test_state_dict_round_trip_is_exact_and_plain(tmp_path):
    m1 = make_model()
    o1 = lpoptim.AdamW(m1.parameters(), lr=1e-2, min_quant_numel=1024, amsgrad=True)
    train(m1, o1, 10)
    m2 = copy.deepcopy(m1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": m1.state_dict(), "opt": o1.state_dict()}, path)
    l_cont = train(m1, o1, 10, seed=7)
    o2 = lpoptim.AdamW(m2.parameters(), lr=1e-2, min_quant_numel=1024, amsgrad=True)
    o2.load_state_dict(torch.load(path, weights_only=True)["opt"])
    l_res = train(m2, o2, 10, seed=7)
    assert l_cont == l_res
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    for k, v in o1.state[m1[0].weight].items():
        assert torch.equal(v, o2.state[m2[0].weight][k]), k
    # a process that never imports lpoptim reads the checkpoint with weights_only=True
    code = (f"import torch, sys; sd = torch.load({str(path)!r}, weights_only=True)['opt']; "
            "assert 'lpoptim' not in sys.modules; st = sd['state'][0]; "
            "assert st['exp_avg_codes'].dtype == torch.uint8 and st['exp_avg_scale'].dtype == torch.float32; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_load_state_dict_keeps_dtypes_with_bf16_params():
    m = make_model(dtype=torch.bfloat16)
    o = lpoptim.AdamW(m.parameters(), lr=1e-2, min_quant_numel=1024)
    train(m, o, 3)
    sd = o.state_dict()
    o2 = lpoptim.AdamW(m.parameters(), lr=1e-2, min_quant_numel=1024)
    o2.load_state_dict(sd)
    for p in m.parameters():
        for k, v in o.state[p].items():
            assert o2.state[p][k].dtype == v.dtype, k  # torch's base class would cast scales to bf16
            assert torch.equal(o2.state[p][k], v), k


def test_switch_from_and_to_torch_adamw():
    m1, m2 = make_model(), make_model()
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    train(m1, o1, 10)
    m2.load_state_dict(m1.state_dict())
    o2 = lpoptim.AdamW(m2.parameters(), lr=1e-2, min_quant_numel=1024, group_size=64)
    o2.load_state_dict(o1.state_dict())  # quantizes torch's fp32 moments
    assert o2.param_groups[0]["min_quant_numel"] == 1024 and o2.param_groups[0]["group_size"] == 64
    st = o2.state[m2[0].weight]
    assert st["exp_avg_codes"].dtype == torch.uint8
    layout = StateLayout.for_param(m2[0].weight, o2.param_groups[0])
    ref_m = o1.state[m1[0].weight]["exp_avg"]
    assert (load_moment(st, "exp_avg", layout) - ref_m).norm() / ref_m.norm() < 0.03
    l1, l2 = train(m1, o1, 10, seed=3), train(m2, o2, 10, seed=3)
    assert abs(l1[-1] - l2[-1]) / l1[-1] < 0.05
    # and back: lpoptim's state as torch.optim.AdamW's, loaded by torch
    o3 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    o3.load_state_dict(o2.torch_state_dict())
    got = o3.state[m2[0].weight]
    assert got["exp_avg"].dtype == torch.float32 and got["exp_avg"].shape == m2[0].weight.shape
    torch.testing.assert_close(got["exp_avg"], load_moment(st, "exp_avg", layout))
    assert float(got["step"]) == 20
    train(m2, o3, 2)


def test_state_dict_saved_and_loaded_across_devices_is_plain_cpu_friendly():
    m = make_model()
    o = lpoptim.AdamW(m.parameters(), lr=1e-2)
    train(m, o, 2)
    buf = io.BytesIO()
    torch.save(o.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True, map_location="cpu")
    o2 = lpoptim.AdamW(m.parameters(), lr=1e-2)
    o2.load_state_dict(sd)
    assert o2.state[m[0].weight]["step"].device == m[0].weight.device


def test_parameters_on_different_devices_in_one_optimizer_meta():
    """Parameters may live on several devices; states follow each parameter (meta stands in for a second one)."""
    p_cpu = torch.nn.Parameter(torch.randn(64, 128))
    p_meta = torch.nn.Parameter(torch.empty(64, 128, device="meta"))
    opt = lpoptim.AdamW([p_cpu, p_meta], lr=1e-2, min_quant_numel=1)
    p_cpu.grad = torch.randn(64, 128)
    p_meta.grad = torch.empty(64, 128, device="meta")
    opt.step()
    assert opt.state[p_cpu]["exp_avg_codes"].device.type == "cpu"
    assert opt.state[p_meta]["exp_avg_codes"].device.type == "meta"
    assert opt.state[p_meta]["step"].device.type == "meta"


@pytest.mark.gpu
def test_state_moves_between_cuda_and_cpu():
    m = make_model().cuda()
    o = lpoptim.AdamW(m.parameters(), lr=1e-2)
    for x, y in batches(3):
        o.zero_grad()
        (m(x.cuda()) - y.cuda()).pow(2).mean().backward()
        o.step()
    sd = o.state_dict()
    m_cpu = copy.deepcopy(m).cpu()
    o_cpu = lpoptim.AdamW(m_cpu.parameters(), lr=1e-2)
    o_cpu.load_state_dict(sd)
    st = o_cpu.state[m_cpu[0].weight]
    assert st["exp_avg_codes"].device.type == "cpu" and st["exp_avg_scale"].dtype == torch.float32
    o_back = lpoptim.AdamW(m.parameters(), lr=1e-2)
    o_back.load_state_dict(o_cpu.state_dict())
    for k, v in o.state[m[0].weight].items():
        assert torch.equal(o_back.state[m[0].weight][k], v), k


def test_changing_group_options_after_the_first_step_is_refused():
    w = torch.nn.Parameter(torch.randn(8, 512))
    opt = lpoptim.AdamW([w], min_quant_numel=1024)
    w.grad = torch.randn_like(w)
    opt.step()
    opt.param_groups[0]["group_size"] = 64  # the kernel would index scales that do not exist
    with pytest.raises(ValueError, match="group_size"):
        opt.step()


def test_loaded_states_are_contiguous():
    w = torch.nn.Parameter(torch.randn(8, 512))
    opt = lpoptim.AdamW([w], min_quant_numel=1024)
    w.grad = torch.randn_like(w)
    opt.step()
    sd = opt.state_dict()
    st = sd["state"][0]
    st["exp_avg_codes"] = st["exp_avg_codes"].t().contiguous().t()  # same values, transposed strides
    opt.load_state_dict(sd)
    assert opt.state[w]["exp_avg_codes"].is_contiguous()
    assert torch.equal(opt.state[w]["exp_avg_codes"], st["exp_avg_codes"])


def test_kernel_declines_empty_tensors():
    from lpoptim.kernels import adamw_step
    from lpoptim.optim.state import StateLayout

    p = torch.zeros(4, 0)
    assert not adamw_step.supports(p, p, StateLayout(quantized=False))


def test_cached_preparation_follows_reassigned_data_and_dropped_state():
    """lpoptim.AdamW caches each parameter's layout and checks: a p.data of another shape must be caught as
    before (not stepped against the old state), and a state dropped by the user must not be held by the cache."""
    import gc
    import weakref

    a, b = torch.nn.Parameter(torch.randn(64, 256)), torch.nn.Parameter(torch.randn(64, 256))
    opt = lpoptim.AdamW([a, b], lr=1e-3, min_quant_numel=1024)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    a.data = torch.randn(64, 512)
    a.grad = torch.randn_like(a)
    with pytest.raises(ValueError, match="other group options"):
        opt.step()
    a.data = torch.randn(64, 256)
    a.grad = torch.randn_like(a)
    old = weakref.ref(opt.state[b]["exp_avg_codes"])
    del opt.state[b]  # b is frozen from now on: its state must be freed
    b.grad = None
    opt.step()
    gc.collect()
    assert old() is None


def test_dropped_state_recreated_empty_is_not_held_for_long():
    """A state deleted and then re-created empty by a read of ``opt.state[p]`` (a defaultdict) leaves the state
    dict's size unchanged; the cache must still let the old state go (within AdamW._SWEEP_EVERY steps)."""
    import gc
    import weakref

    a, b = torch.nn.Parameter(torch.randn(64, 256)), torch.nn.Parameter(torch.randn(64, 256))
    opt = lpoptim.AdamW([a, b], lr=1e-3, min_quant_numel=1024)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    old = weakref.ref(opt.state[b]["exp_avg_codes"])
    del opt.state[b]
    assert opt.state[b] == {}  # the read re-creates an empty state: same size as before
    b.grad = None  # frozen from now on
    for _ in range(type(opt)._SWEEP_EVERY):
        a.grad = torch.randn_like(a)
        opt.step()
    gc.collect()
    assert old() is None


def test_torch_adamw_refuses_an_lpoptim_state_dict():
    """Quantized moments are held as codes under names torch does not use: torch.optim.AdamW fails at its first
    step (KeyError 'exp_avg') instead of training on uint8 codes as moments. torch_state_dict() is the way."""
    model = torch.nn.Linear(128, 64)
    opt = lpoptim.AdamW(model.parameters(), lr=1e-2, min_quant_numel=1024)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    t = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t.load_state_dict(opt.state_dict())
    with pytest.raises(KeyError, match="exp_avg"):
        t.step()
    t = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t.load_state_dict(opt.torch_state_dict())
    t.step()  # the documented export works
    assert t.state[model.weight]["exp_avg"].abs().max() < 10  # codes read as moments would reach 254


def test_loads_states_saved_with_the_older_layout():
    """States saved by lpoptim 0.1 (codes under torch's names, k = 1 + code / 16) load with the same values."""
    from lpoptim.quant import legacy_k_of

    w = torch.nn.Parameter(torch.randn(16, 256))
    opt = lpoptim.AdamW([w], lr=1e-2, min_quant_numel=1024)
    gen = torch.Generator().manual_seed(0)
    m, v = torch.randn(16, 256, generator=gen) * 1e-3, torch.rand(16, 256, generator=gen) * 1e-6
    old = {"step": torch.tensor(7.0)}
    for name, value in (("exp_avg", m), ("exp_avg_sq", v)):
        # the older encoder, written out: k = 1 + code / 16 >= 1, smallest magnitude onto E4M3's subnormal floor
        g = value.reshape(16, 2, 128)
        amax, amin = g.abs().amax(-1), g.abs().amin(-1)
        code = torch.floor((math.log2(448 / 2 ** -9) / torch.log2(amax / amin) - 1) * 16 + 1 / 64).clamp(0, 255)
        code = code.to(torch.int32)
        c = ((amax.view(torch.int32) & ~255) | code).view(torch.float32)
        f = 448 * (g.abs() / c[..., None]).clamp(max=1) ** legacy_k_of(code)[..., None]
        q = torch.copysign(f, g).reshape(16, 256).to(torch.float8_e4m3fn)
        old[name], old[name + "_scale"] = q.view(torch.uint8), c
        want = torch.copysign((q.float().abs().reshape(16, 2, 128) / 448) ** (1 / legacy_k_of(code)[..., None])
                              * c[..., None], q.float().reshape(16, 2, 128)).reshape(16, 256)
        old["want_" + name] = want
    sd = opt.state_dict()
    sd["state"] = {0: {k: v for k, v in old.items() if not k.startswith("want_")}}
    opt.load_state_dict(sd)
    st = opt.state[w]
    assert "exp_avg_codes" in st and "exp_avg" not in st  # re-encoded in the current layout
    layout = StateLayout.for_param(w, opt.param_groups[0])
    for name in ("exp_avg", "exp_avg_sq"):
        got, want = load_moment(st, name, layout), old["want_" + name]
        assert ((got - want).abs() <= 0.07 * want.abs()).all()  # one more E4M3 rounding, nothing lost
    w.grad = torch.randn_like(w)
    opt.step()
    assert torch.isfinite(w).all() and st["step"] == 8


@pytest.mark.parametrize("opts", [dict(), dict(state_bits=4), dict(amsgrad=True), dict(dtype=torch.bfloat16, sr=3),
                                  dict(state_bits=4, dtype=torch.bfloat16, sr=3), dict(quantized=False),
                                  dict(found_inf=True)])
def test_reference_steps_a_large_tensor_a_block_of_rows_at_a_time(monkeypatch, opts):
    """A tensor above ROWS_BLOCK_ELEMENTS is stepped a block of whole rows at a time (the CPU's temporaries stay
    bounded; stepped whole, a 128k x 3072 embedding needed about 24 GB): parameter, codes, scales and step count
    bit for bit those of stepping it whole, with the roundings' noise drawn by each element's place in the tensor
    (bf16 stochastic rounding, 4-bit v) and an odd last block of rows and of columns."""
    from lpoptim.optim import reference
    from lpoptim.optim.reference import reference_adamw_step
    from lpoptim.optim.state import StateLayout, init_state

    dtype = opts.get("dtype", torch.float32)
    layout = StateLayout(opts.get("quantized", True), state_bits=opts.get("state_bits", 8))
    amsgrad = opts.get("amsgrad", False)
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(3, 13, 300, generator=gen).to(dtype)  # 39 rows of 300: 3 groups a row, the last short
    runs = []
    for block in (1 << 30, 5 * 300):  # whole; blocks of 5 rows (the last of 4)
        monkeypatch.setattr(reference, "ROWS_BLOCK_ELEMENTS", block)
        p = p0.clone()
        state = init_state(p, layout, amsgrad)
        for step in range(3):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
            found_inf = torch.tensor(float(step == 1)) if opts.get("found_inf") else None
            reference_adamw_step(p, g, state, layout, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                                 amsgrad=amsgrad, maximize=False, found_inf=found_inf, sr_salt=opts.get("sr"),
                                 state_salt=7, offset=11)
        runs.append((p, state))
    (p_whole, s_whole), (p_rows, s_rows) = runs
    assert torch.equal(p_whole, p_rows) and s_whole.keys() == s_rows.keys()
    assert all(torch.equal(s_whole[k], s_rows[k]) for k in s_whole), [k for k in s_whole
                                                                       if not torch.equal(s_whole[k], s_rows[k])]
    assert float(s_rows["step"]) == (2 if opts.get("found_inf") else 3)
