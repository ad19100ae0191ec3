"""The optimizer step fused into backward gives the same parameters as the usual step, with gradients freed."""
import pytest
import torch

import lpoptim


def model_and_data(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)) for _ in range(8)]
    return m, data


@pytest.mark.parametrize("bucket_mb", [0, 0.02, 128])  # one at a time, a few buckets, everything at the end
def test_step_in_backward_matches_usual_step_exactly(bucket_mb):
    m1, data = model_and_data()
    m2, _ = model_and_data()
    o1 = lpoptim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1, min_quant_numel=1024)
    o2 = lpoptim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, min_quant_numel=1024)
    sched = torch.optim.lr_scheduler.StepLR(o2, step_size=3, gamma=0.5)
    sched1 = torch.optim.lr_scheduler.StepLR(o1, step_size=3, gamma=0.5)
    handle = lpoptim.step_in_backward(o2, bucket_mb=bucket_mb)
    for x, y in data:
        o1.zero_grad()
        (m1(x) - y).pow(2).mean().backward()
        o1.step()
        sched1.step()
        (m2(x) - y).pow(2).mean().backward()  # updates every parameter during backward
        assert all(p.grad is None for p in m2.parameters())  # the gradients were freed as they were used
        sched.step()
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)  # the same per-parameter arithmetic, only earlier
    handle.remove()
    (m2(data[0][0]) - data[0][1]).pow(2).mean().backward()
    assert all(p.grad is not None for p in m2.parameters())  # removed: back to the usual step


def test_step_in_backward_refuses_other_optimizers():
    m, _ = model_and_data()
    with pytest.raises(TypeError, match="step_param"):
        lpoptim.step_in_backward(torch.optim.AdamW(m.parameters()))


def test_dropping_model_and_optimizer_frees_them():
    """The hooks live on the parameters, where the garbage collector cannot see them: they must not keep the
    optimizer (and through it every parameter) alive, or each model built in a process leaks (seen in lpoptim
    bench: one 13B model's memory per recipe)."""
    import gc
    import weakref

    m, data = model_and_data()
    opt = lpoptim.AdamW(m.parameters(), lr=1e-2)
    lpoptim.step_in_backward(opt)
    x, y = data[0]
    (m(x) - y).pow(2).mean().backward()
    alive = weakref.ref(next(m.parameters())), weakref.ref(opt)
    del m, opt
    gc.collect()
    assert [r() for r in alive] == [None, None]


def test_optimizer_dropped_while_hooked_raises_not_silently_stops():
    """The hooks hold the optimizer weakly (above); the handle holds it strongly. With neither kept, backward
    must say so instead of leaving the weights untouched."""
    import gc

    m, data = model_and_data()
    handle = lpoptim.step_in_backward(lpoptim.AdamW(m.parameters(), lr=1e-2))
    x, y = data[0]
    before = [p.detach().clone() for p in m.parameters()]
    (m(x) - y).pow(2).mean().backward()  # the handle keeps the optimizer: a step
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))
    del handle
    gc.collect()
    with pytest.raises(RuntimeError, match="garbage-collected"):
        (m(x) - y).pow(2).mean().backward()


def test_frozen_parameters_take_no_hook():
    """Fine-tuning freezes layers; torch.optim.AdamW (and lpoptim.AdamW) accept them and skip them: so does the
    step in backward (torch refuses a hook on a tensor that needs no gradient)."""
    m, data = model_and_data()
    m[0].weight.requires_grad_(False)
    frozen = m[0].weight.detach().clone()
    opt = lpoptim.AdamW(m.parameters(), lr=1e-2)
    handle = lpoptim.step_in_backward(opt)
    x, y = data[0]
    before = m[2].weight.detach().clone()
    (m(x) - y).pow(2).mean().backward()
    assert torch.equal(m[0].weight, frozen) and not torch.equal(m[2].weight, before)
    handle.remove()


def test_parameters_stepped_by_a_live_handle_are_refused_and_a_dropped_ones_hooks_replaced():
    """Two optimizers stepping the same parameters in backward would both update them (and the first frees the
    gradient the second needs): refused while the first handle is active, allowed once it is removed. A handle
    dropped without remove() leaves hooks that raise at the next backward; registering anew replaces them."""
    import gc

    m, data = model_and_data()
    x, y = data[0]
    first = lpoptim.step_in_backward(lpoptim.AdamW(m.parameters(), lr=1e-2))
    with pytest.raises(RuntimeError, match="already stepped inside backward by another optimizer"):
        lpoptim.step_in_backward(lpoptim.AdamW(m.parameters(), lr=1e-2))
    first.remove()
    second = lpoptim.step_in_backward(lpoptim.AdamW(m.parameters(), lr=0.0, weight_decay=0.0))
    before = [p.detach().clone() for p in m.parameters()]
    (m(x) - y).pow(2).mean().backward()  # only the second optimizer steps: lr 0 moves nothing
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    del second
    gc.collect()
    third = lpoptim.step_in_backward(lpoptim.AdamW(m.parameters(), lr=1e-2))
    (m(x) - y).pow(2).mean().backward()  # the dropped handle's hooks are gone: no "garbage-collected" error
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in m.parameters())
    third.remove()
