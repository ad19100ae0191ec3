"""Fused replays (activations/fused_replay.py): a chain of replays and the decoding of the packed tensors it starts
from, compiled as one function, gives autograd the same values as replaying op by op, hands each value to its
other readers once, and falls back to op by op where a structure does not compile."""
import warnings

import pytest
import torch

from lpoptim.activations import compress_activations, fused_replay
from lpoptim.activations.codec import PackedActivation
from lpoptim.activations.derive import Derived

from block_grads import _tiny_llama


def _grads(block, cos, sin, x, retain=False, **options):
    handle = compress_activations(block, **options)
    xx = x.detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    y = block(xx, cos, sin)
    loss = (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).pow(2).sum()
    loss.backward(retain_graph=retain)
    handle.remove()
    grads = {"input": xx.grad.clone()} | {n: p.grad.clone() for n, p in block.named_parameters()}
    return (grads, loss, xx) if retain else grads


def _spy(monkeypatch):
    """Counts: fused runs that computed, decodes and replays done outside a fused function."""
    counts = {"fused": 0, "decode": 0, "replay": 0}
    real_run, real_decode, real_replay = fused_replay.run, PackedActivation.decode, Derived.replay

    def run(root):
        out = real_run(root)
        counts["fused"] += out is not None
        return out

    def decode(self):
        counts["decode"] += 1
        return real_decode(self)

    def replay(self):
        counts["replay"] += 1
        return real_replay(self)

    monkeypatch.setattr(fused_replay, "run", run)
    monkeypatch.setattr(PackedActivation, "decode", decode)
    monkeypatch.setattr(Derived, "replay", replay)
    return counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_replays_give_the_op_by_op_gradients(monkeypatch, dtype):
    """The same graph traced without code generation (aot_eager): the same ops, so the same bits; fewer decodes
    and replays outside; a retained graph's second backward gets them again (every memo let go of)."""
    monkeypatch.setattr(fused_replay, "BACKEND", "aot_eager")
    fused_replay.reset()
    block, (cos, sin) = _tiny_llama(dtype)
    x = torch.randn(2, 32, 128, dtype=dtype)
    ref = _grads(block, cos, sin, x, fuse_replays=False)
    counts = _spy(monkeypatch)
    _grads(block, cos, sin, x, fuse_replays=False)
    unfused = dict(counts)
    counts.update(fused=0, decode=0, replay=0)
    got, loss, xx = _grads(block, cos, sin, x, retain=True, fuse_replays=True)
    # the two norms' chains (decode x32, x32 * r, its bf16 cast, times the weight) and SwiGLU's product (from
    # packed gate and up): three fused functions, two structures (the norms share theirs)
    assert counts["fused"] == 3 and len(fused_replay._COMPILED) == 2
    assert all(f is not None for f in fused_replay._COMPILED.values())  # compiled, not fallen back
    assert counts["decode"] < unfused["decode"] and counts["replay"] < unfused["replay"]
    assert all(torch.equal(ref[k], got[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], got[k])]
    block.zero_grad(set_to_none=True)
    xx.grad = None
    loss.backward()
    assert torch.equal(xx.grad, ref["input"]) and counts["fused"] == 6


def test_inductor_fuses_with_eager_rounding():
    """Inductor (on the CPU here) with emulate_precision_casts: the values autograd gets are eager's, bit for bit,
    on a bf16 block."""
    fused_replay.reset()
    block, (cos, sin) = _tiny_llama(torch.bfloat16)
    x = torch.randn(2, 32, 128, dtype=torch.bfloat16)
    ref = _grads(block, cos, sin, x, fuse_replays=False)
    got = _grads(block, cos, sin, x, fuse_replays=True)
    assert fused_replay._COMPILED and all(f is not None for f in fused_replay._COMPILED.values())
    assert all(torch.equal(ref[k], got[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], got[k])]


def test_a_structure_that_does_not_compile_falls_back_once(monkeypatch):
    monkeypatch.setattr(fused_replay, "BACKEND", "no_such_backend")
    fused_replay.reset()
    block, (cos, sin) = _tiny_llama(torch.float32)
    x = torch.randn(2, 32, 128)
    ref = _grads(block, cos, sin, x, fuse_replays=False)
    with pytest.warns(RuntimeWarning, match="did not compile"):
        got = _grads(block, cos, sin, x, fuse_replays=True)
    assert fused_replay._COMPILED and all(f is None for f in fused_replay._COMPILED.values())
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    made = []
    real_function = fused_replay._Plan.function
    monkeypatch.setattr(fused_replay._Plan, "function", lambda self, *a, **k: made.append(1) or real_function(
        self, *a, **k))
    with warnings.catch_warnings():  # remembered: the next backward neither tries again nor warns, and runs the
        warnings.simplefilter("error")  # uncompiled functions made the first time
        again = _grads(block, cos, sin, x, fuse_replays=True)
    assert not made
    assert all(torch.equal(ref[k], again[k]) for k in ref)
    fused_replay.reset()


def test_every_value_is_let_go_of_after_backward(monkeypatch):
    """After backward no Derived or packed tensor still holds a value (a miscounted memo would keep one alive as
    long as the graph)."""
    monkeypatch.setattr(fused_replay, "BACKEND", "aot_eager")
    made = []
    real_init = Derived.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(Derived, "__init__", init)
    block, (cos, sin) = _tiny_llama(torch.float32)
    grads, loss, xx = _grads(block, cos, sin, torch.randn(2, 32, 128), retain=True, fuse_replays=True)
    held = made + [a for d in made for is_t, a in d.args if is_t and isinstance(a, PackedActivation)]
    assert made and all(o._memo is None for o in held), [type(o).__name__ for o in held if o._memo is not None]


def test_a_view_of_a_value_computed_inside_is_not_computed_twice(monkeypatch):
    """R = A + V with A = B + 1 and V a view of B: fusing R would compute B inside and again when V is unpacked;
    R is replayed op by op instead (A fused with B), and B's value is handed out exactly twice."""
    monkeypatch.setattr(fused_replay, "BACKEND", "aot_eager")
    from lpoptim.activations.derive import _view_of, count_use
    p = torch.randn(4, 8, requires_grad=True)  # replays run without grad, fused or not (as Derived.replay)
    b = Derived(torch.mul, [(True, p), (False, 2.0)], {}, True)
    v = Derived(_view_of, [(True, b), (False, (4, 8)), (False, (8, 1)), (False, 0)], {}, True)
    a = Derived(torch.add, [(True, b), (False, 1.0)], {}, True)
    r = Derived(torch.add, [(True, a), (True, v)], {}, True)
    count_use(r)
    assert b.uses == 2
    calls = []
    real_run = fused_replay.run
    monkeypatch.setattr(fused_replay, "run", lambda root: calls.append(root) or real_run(root))
    out = r.unpack()
    assert torch.equal(out, (p * 2 + 1) + p * 2) and not out.requires_grad
    assert calls[0] is r and a in calls  # r declined, a fused (with b inside)
    assert all(o._memo is None for o in (a, b, v, r))


def test_default_fuses_on_cuda_only():
    from lpoptim.activations import ActivationPolicy
    assert ActivationPolicy().fuse_replays is None
    fused_replay.reset()
    block, (cos, sin) = _tiny_llama(torch.float32)
    _grads(block, cos, sin, torch.randn(2, 32, 128))  # CPU tensors: op by op, nothing compiled
    assert not fused_replay._COMPILED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_replays_on_gpu_match_op_by_op(monkeypatch):
    """On CUDA (the default there): Inductor's kernels give the op-by-op replays' gradients (the decodes are the
    Triton kernel's against Inductor's, the same arithmetic), and fewer kernels run outside."""
    fused_replay.reset()
    block, (cos, sin) = _tiny_llama(torch.bfloat16, "cuda")
    x = torch.randn(2, 32, 128, dtype=torch.bfloat16, device="cuda")
    ref = _grads(block, cos, sin, x, fuse_replays=False)
    counts = _spy(monkeypatch)
    got = _grads(block, cos, sin, x)
    assert counts["fused"] == 3 and all(f is not None for f in fused_replay._COMPILED.values())
    assert all(torch.equal(ref[k], got[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], got[k])]


def test_a_new_sequence_length_reuses_the_structure(monkeypatch):
    """Shapes are not part of the structure: another sequence length runs the same compiled code (Dynamo
    recompiles it once with dynamic shapes), and the gradients stay the op-by-op ones."""
    monkeypatch.setattr(fused_replay, "BACKEND", "aot_eager")
    fused_replay.reset()
    block, (cos, sin) = _tiny_llama(torch.float32)
    for t in (32, 24, 16):
        x = torch.randn(2, t, 128)
        ref = _grads(block, cos[:t], sin[:t], x, fuse_replays=False)
        got = _grads(block, cos[:t], sin[:t], x, fuse_replays=True)
        assert all(torch.equal(ref[k], got[k]) for k in ref), t
    assert len(fused_replay._COMPILED) == 2 and all(f is not None for f in fused_replay._COMPILED.values())
