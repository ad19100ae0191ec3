"""lpoptim.prepare on the models users bring: HF families built from tiny configs (no downloads), a plain torch
model, the HF Trainer. The stack of blocks is found, the FP8 pieces keep the gradients, the chunked loss is HF's
loss, the step in backward is the usual step (and refuses accumulation), the memory budget picks by its
estimates, and bad options are refused before the model changes."""
from __future__ import annotations

import copy
import math
import os
import re
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lpoptim
from lpoptim.memory import estimate_peak_bytes
from lpoptim.memory import state_bytes as estimated_state_bytes
from lpoptim.nn import LowBitLinear
from lpoptim.nn.causal_lm_loss import why_not
from lpoptim.planner import find_blocks, plan, prepare

transformers = pytest.importorskip("transformers")

from hf_families import MOE, CAUSAL, FAMILIES  # noqa: E402  (tests/: tiny HF models)
from hf_families import hf_model as _hf  # noqa: E402


def _batch(name: str, seq: int = 32) -> dict:
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return dict(pixel_values=torch.randn(4, 3, 32, 32, generator=g), labels=torch.randint(0, 10, (4,), generator=g))
    ids = torch.randint(0, 128, (2, seq), generator=g)
    return dict(input_ids=ids, labels=ids)


def _run(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grads(model, batch):
    return _run(model, **batch)[1]


def _fidelity(ref: dict, got: dict):
    """(smallest cosine over parameters, its name, mean cosine over parameters, the worst norm ratio
    |got| / |ref| - 1), in float64. Gradients that are zero in exact arithmetic are left out: a key projection's
    bias cancels in softmax, so its gradient is rounding noise (1e-8 against 1e-2) and its cosine means nothing."""
    assert set(got) == set(ref), set(got) ^ set(ref)
    norms = {k: ref[k].double().norm().item() for k in ref}
    typical = sorted(norms.values())[len(norms) // 2]
    kept = [k for k in ref if norms[k] > 1e-4 * typical]
    assert len(kept) >= len(ref) - 4, sorted(set(ref) - set(kept))  # only the key biases (2 layers x 2 at most)
    cos = {k: F.cosine_similarity(ref[k].double().flatten(), got[k].double().flatten(), 0).item() for k in kept}
    worst = min(cos, key=cos.get)
    ratio = max(abs(got[k].double().norm().item() / norms[k] - 1) for k in kept)
    return cos[worst], worst, sum(cos.values()) / len(cos), ratio


# ---- 1. every family: the stack found, FP8 linears + FP8 activations / recompute keep the gradients ----------

# Thresholds: (smallest cosine over parameters, mean cosine over parameters, largest | |got| / |ref| - 1 |).
# Measured here (CPU, torch 2.13, transformers 5.24; batch 2 x 32, fp32 params), the worst over the 16 families
# and over batch seeds 1, 5, 6:
# - FP8 linears (fp8_delayed) with FP8 activations or recompute: smallest 0.959 (norm weights: their gradient
#   sums every token's FP8 error; Gemma3's q_norm, OPT's final_layer_norm), most families 0.98-0.995; mean
#   >= 0.983 (OPT); norms within 15% (Gemma3's q_norm), most within 5%. The FP8 GEMMs make almost all of it:
#   FP8 activations alone give >= 0.998 smallest.
# - recompute alone (linears unchanged), the most intricate piece (FP8 block input, replay): smallest 0.981,
#   mean 0.9926, norms within 5% on OPT (its ReLU: the replay from the FP8-rounded input flips some near-zero
#   units; with GELU OPT gives 0.999), >= 0.996 / 0.9987 / 2.5% on every other family.
# The thresholds leave room for other builds and seeds and still catch a broken piece: a lost or doubled scale
# moves a norm by 2x, a wrong or missing gradient term takes its parameter's cosine far below 0.9 (a dropout
# mask drawn differently in the two runs gave 0.6).
THRESHOLDS = {("fp8_delayed", "fp8"): (0.93, 0.975, 0.3), ("fp8_delayed", "fp8_attention"): (0.93, 0.975, 0.3),
              ("fp8_delayed", "recompute"): (0.93, 0.975, 0.3), (None, "recompute"): (0.97, 0.99, 0.1)}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_blocks_found_and_fp8_gradients_close(name):
    model = _hf(name)
    _, _, _, stack_names, block_class = FAMILIES[name]
    found, stack = find_blocks(model)
    assert found in stack_names, found
    assert stack is model.get_submodule(found) and len(stack) == 2
    assert {type(b).__name__ for b in stack} == {block_class}
    batch = _batch(name)
    ref = _grads(model, batch)
    eligible = sum(type(m) is nn.Linear and m.in_features % 16 == 0 and m.out_features % 16 == 0
                   for m in stack.modules())
    for (linears, activations), (min_cos, min_mean, max_ratio) in THRESHOLDS.items():
        prepared = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "kept in high precision": Qwen2-MoE's 64 -> 1 shared-expert gate
            opt = prepare(prepared, lr=1e-3, linears=linears, activations=activations, compile=False,
                          step_in_backward=False)
        p = opt.plan
        has_linear = any(type(m) is nn.Linear for m in stack.modules())  # GPT-2's blocks hold Conv1D only
        assert (p.blocks, p.linears, p.activations, p.compile, p.step_in_backward) == (
            found, linears if has_linear else None, activations, False, False)
        if linears and not has_linear:
            assert p.reasons["linears"] == "the blocks hold no nn.Linear"
        assert p.chunked_loss == (why_not(model) is None)
        # every nn.Linear of the blocks whose dims allow it became a LowBitLinear (GPT-2's Conv1D and Falcon's
        # FalconLinear subclass are not nn.Linear: convert_linears leaves them, so those two run FP8 activations
        # only); nothing outside the blocks was converted
        converted = sum(isinstance(m, LowBitLinear) for m in prepared.modules())
        assert converted == sum(isinstance(m, LowBitLinear) for m in prepared.get_submodule(found).modules())
        assert converted == (eligible if linears else 0)
        if getattr(model.config, "use_cache", None) is not None:
            assert prepared.config.use_cache is False  # (the original keeps its own config)
        with p.handles[0].record() as stats:  # the activations' handle: what the blocks saved, and how
            got = _grads(prepared, batch)
        kinds = stats.summary()
        if activations == "recompute":  # only each block's input, in FP8
            assert kinds["recompute_input"]["count"] == 2, kinds
            assert kinds["recompute_input"]["stored"] < 0.3 * kinds["recompute_input"]["original"], kinds
        else:
            fp8 = {k: v for k, v in kinds.items() if k.startswith("fp8")}  # 1 byte + scales against fp32's 4
            assert fp8 and all(v["stored"] < 0.35 * v["original"] for v in fp8.values()), kinds
            if activations == "fp8_attention":  # attention's saved tensors packed like the rest: none kept as is
                assert "attention" not in kinds, kinds
        worst_cos, worst, mean_cos, ratio = _fidelity(ref, got)
        where = (linears, activations, worst, worst_cos, mean_cos, ratio)
        assert worst_cos < 1 - 1e-6, ("the FP8 pieces changed nothing", where)
        assert worst_cos > min_cos and mean_cos > min_mean and ratio < max_ratio, where
        opt.step()  # and the optimizer steps what it was given
        assert all(torch.isfinite(q).all() for q in prepared.parameters())


# ---- 2. the chunked loss: HF's loss, without whole logits ----------------------------------------------------

def _assert_same_grads(ref: dict, got: dict):
    """fp32 against fp32: the loss is the same sum in other chunks. Tolerance relative to the largest gradient
    (a key bias's gradient is rounding noise around 0 on both sides: relative to itself it is anything)."""
    assert set(got) == set(ref)
    top = max(g.abs().max().item() for g in ref.values())
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5 * top, msg=k)


@pytest.mark.parametrize("name", CAUSAL)
def test_chunked_loss_is_hf_loss(name):
    model = _hf(name)
    if name == "gemma2":  # its final_logit_softcapping taken into the chunked loss: a cap that bites (30 would not)
        model.config.final_logit_softcapping = 0.5
    assert why_not(model) is None
    prepared = copy.deepcopy(model)
    opt = prepare(prepared, lr=1e-3, compile=False, step_in_backward=False)  # CPU: linears and activations as they are
    assert opt.plan.chunked_loss and (opt.plan.linears, opt.plan.activations) == (None, None)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt not trained on
    labels[1, -3:] = -100  # padding
    counted = int((labels[:, 1:] != -100).sum())
    cases = {"labels with -100": dict(labels=labels),
             # the Trainer under accumulation: the sum over this micro-batch / the items of the whole batch
             "num_items_in_batch": dict(labels=labels, num_items_in_batch=torch.tensor(2 * counted + 3)),
             "shift_labels": dict(labels=labels, shift_labels=torch.roll(labels, 1, dims=1))}
    if name in MOE:
        cases["output_router_logits"] = dict(labels=labels, output_router_logits=True)
    losses = {}
    for case, kw in cases.items():
        out_ref, ref = _run(model, input_ids=ids, **kw)
        out, got = _run(prepared, input_ids=ids, **kw)
        assert out.logits is None, case  # never made
        torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-6, atol=1e-6, msg=case)
        _assert_same_grads(ref, got)
        losses[case] = out_ref.loss.item()
    assert len(set(losses.values())) == len(losses)  # each case is a different loss: each option was honoured
    if name in MOE:  # the router's load-balancing loss is in it (and in the original's)
        assert out.aux_loss is not None and losses["output_router_logits"] > losses["labels with -100"]
    # evaluation and no_grad: the model's own forward, whole logits, the same as the original's
    with torch.no_grad():
        for m in (model, prepared):
            m.train()
        ref_out, out = model(input_ids=ids, labels=labels), prepared(input_ids=ids, labels=labels)
        assert out.logits is not None and torch.equal(out.logits, ref_out.logits)
        torch.testing.assert_close(out.loss, ref_out.loss)
        model.eval()
        prepared.eval()
        ref_out, out = model(input_ids=ids, labels=labels), prepared(input_ids=ids, labels=labels)
        assert torch.equal(out.logits, ref_out.logits)
    prepared.train()
    assert prepared(input_ids=ids).logits.shape == (2, 24, 128)  # no labels: logits as usual
    opt.plan.remove()
    assert "forward" not in prepared.__dict__  # the class's forward again
    assert prepared(input_ids=ids, labels=labels).logits is not None


def test_chunked_loss_falls_back_where_the_base_model_cuts_its_output():
    """Gemma 4 with KV caches shared across layers cuts its base model's output to logits_to_keep: the chunked loss
    then runs the model's own forward and loss for that call (the same loss and gradients), not a mismatch error."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma 4")
    from lpoptim.nn.causal_lm_loss import chunk_causal_lm_loss

    cfg = transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
        vocab_size=128, max_position_embeddings=128, head_dim=16, num_kv_shared_layers=2, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    out_ref, ref = _run(model, input_ids=ids, labels=ids)
    chunked = chunk_causal_lm_loss(copy.deepcopy(model))
    runs = []
    chunked.model.register_forward_hook(lambda *_: runs.append(1))
    with pytest.warns(UserWarning, match="cuts its output"):
        out, got = _run(chunked, input_ids=ids, labels=ids)
    assert torch.equal(out.loss, out_ref.loss) and len(runs) == 2  # the chunked attempt, then its own forward
    _assert_same_grads(ref, got)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, got = _run(chunked, input_ids=ids, labels=ids)  # remembered: one forward, no second warning
    assert torch.equal(out.loss, out_ref.loss) and len(runs) == 3


def test_chunked_loss_refused_for_transformed_logits():
    """A model that scales its logits after the head (Cohere's logit_scale, here set on a Llama): the loss is not a
    cross-entropy of the head's GEMM. why_not names why; prepare leaves the loss alone; chunked_loss=True is refused
    before anything changes."""
    model = _tiny_llama()
    model.config.logit_scale = 0.0625
    reason = why_not(model)
    assert reason and "logit_scale" in reason
    with pytest.raises(ValueError, match="logit_scale"):
        prepare(model, lr=1e-3, chunked_loss=True, compile=False)
    assert model.config.use_cache is True and "forward" not in model.__dict__  # refused before the change
    prepared = copy.deepcopy(model)
    opt = prepare(prepared, lr=1e-3, compile=False, step_in_backward=False)
    assert opt.plan.chunked_loss is False and "logit_scale" in opt.plan.reasons["chunked_loss"]
    assert "forward" not in prepared.__dict__
    batch = _batch("llama", 16)
    out_ref, ref = _run(model, **batch)
    out, got = _run(prepared, **batch)
    assert out.logits is not None and torch.equal(out.loss, out_ref.loss)
    _assert_same_grads(ref, got)
    for name in ("bert", "vit"):
        assert "not a Hugging Face causal LM" in why_not(_hf(name))


def test_chunked_loss_in_several_chunks():
    """prepare's chunk is about 64 MiB of logits: one chunk at these sizes. Uneven chunks of 7 tokens give the
    same loss and gradients."""
    from lpoptim.nn.causal_lm_loss import chunk_causal_lm_loss

    model = _hf("llama")
    chunked = chunk_causal_lm_loss(copy.deepcopy(model), chunk=7)
    batch = _batch("llama", 24)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][:, :4] = -100
    out_ref, ref = _run(model, **batch)
    out, got = _run(chunked, **batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-6, atol=1e-6)
    _assert_same_grads(ref, got)


def test_chunked_loss_keeps_tuple_outputs():
    """return_dict=False asks HF for a tuple: the model's own forward runs, so the call works and gives HF's
    (loss, logits) (the chunked path sets attributes on an output object: AttributeError on a tuple)."""
    from lpoptim.nn.causal_lm_loss import chunk_causal_lm_loss

    model = _hf("llama")
    chunked = chunk_causal_lm_loss(copy.deepcopy(model))
    batch = _batch("llama", 16)
    ref = model(**batch, return_dict=False)
    got = chunked(**batch, return_dict=False)
    assert isinstance(got, tuple) and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


# ---- 3. step_in_backward through prepare ---------------------------------------------------------------------

def _tiny_llama(**overrides):
    return _hf("llama", **overrides)


def test_step_in_backward_trains_as_the_usual_step():
    """The usual loop (backward, step, zero_grad) with the step fused into backward (and FP8 linears and
    activations, deterministic both): the same losses and the same parameters as step_in_backward=False, bit for
    bit: the update is per parameter and element-wise (the CPU's reference step, as the GPU's fused kernel), from
    the same gradient, so the bucket it is stepped in cannot change a bit. And it trains: the loss falls."""
    base = _tiny_llama()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (4, 32), generator=g)
    runs = {}
    for fused in (True, False):
        model = copy.deepcopy(base)
        opt = prepare(model, lr=1e-2, weight_decay=0.1, linears="fp8_delayed", activations="fp8", compile=False,
                      step_in_backward=fused)
        assert opt.plan.step_in_backward is fused
        losses = []
        for _ in range(10):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if fused:
                assert all(p.grad is None for p in model.parameters())  # stepped and freed in backward
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[fused] = model, losses
    assert runs[True][1] == runs[False][1]
    assert runs[True][1][-1] < 0.7 * runs[True][1][0], runs[True][1]  # 4.87 -> 2.1 measured
    for a, b in zip(runs[True][0].parameters(), runs[False][0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_second_backward_without_step_raises_before_any_update():
    model = _tiny_llama()
    opt = prepare(model, lr=1e-2, compile=False)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    before = [p.detach().clone() for p in model.parameters()]
    model(input_ids=ids, labels=ids).loss.backward()  # the step, in backward
    stepped = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, stepped))
    with pytest.raises(RuntimeError, match=r"step_in_backward=False"):
        model(input_ids=ids, labels=ids).loss.backward()  # accumulating: refused
    assert all(torch.equal(a, b) for a, b in zip(stepped, model.parameters()))  # nothing was updated
    opt.zero_grad()  # what the refused backward left
    opt.step()  # claims the backward: training goes on
    model(input_ids=ids, labels=ids).loss.backward()
    assert any(not torch.equal(a, b) for a, b in zip(stepped, model.parameters()))


def test_require_step_with_one_parameter_buckets():
    """bucket_mb=0 steps every parameter in its own bucket: the second backward is still refused (the end of
    backward was only marked when a gradient waited for it: with every bucket full, never)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = lpoptim.AdamW(m.parameters(), lr=1e-2)
    lpoptim.step_in_backward(opt, bucket_mb=0, require_step=True)
    x = torch.randn(4, 8)
    m(x).sum().backward()
    with pytest.raises(RuntimeError, match="step_in_backward=False"):
        m(x).sum().backward()
    opt.zero_grad()
    opt.step()
    m(x).sum().backward()


# ---- 4. a plain torch model ----------------------------------------------------------------------------------

class MLPBlock(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class GatedBlock(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.norm, self.gate, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Net(nn.Module):
    """A stack of alternating block classes: not one class, so not found; named with blocks="layers"."""

    def __init__(self, mixed=True):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.layers = nn.ModuleList([GatedBlock() if mixed and i % 2 else MLPBlock() for i in range(4)])
        self.adapters = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])  # a smaller stack of one class
        self.out = nn.Linear(64, 16)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h + sum(a(h) for a in self.adapters))


def _net(mixed=True):
    torch.manual_seed(0)
    return Net(mixed)


def _net_grads(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_plain_model_blocks_named():
    model = _net()
    assert find_blocks(model)[0] == "adapters"  # the only stack of one class: the wrong one, so the user names it
    assert find_blocks(_net(mixed=False))[0] == "layers"  # the largest stack of one class
    x = torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(5))
    ref = _net_grads(model, x)
    for blocks in ("layers", model.layers):
        for activations in ("fp8", "recompute"):
            prepared = copy.deepcopy(model)
            stack = prepared.layers if isinstance(blocks, nn.ModuleList) else blocks
            opt = prepare(prepared, lr=1e-3, blocks=stack, linears="fp8_delayed", activations=activations,
                          compile=False, step_in_backward=False)
            assert (opt.plan.blocks, opt.plan.n_blocks, opt.plan.chunked_loss) == ("layers", 4, False)
            assert opt.plan.use_cache_off is False
            assert sum(isinstance(m, LowBitLinear) for m in prepared.modules()) == 10  # the blocks' linears only
            worst_cos, worst, mean_cos, ratio = _fidelity(ref, _net_grads(prepared, x))
            min_cos, min_mean, max_ratio = THRESHOLDS["fp8_delayed", activations]  # measured: 0.997, 0.9989, 3%
            assert worst_cos > min_cos and mean_cos > min_mean and ratio < max_ratio, (
                activations, worst, worst_cos, mean_cos, ratio)


def test_model_without_a_stack_is_told_to_name_it():
    seq = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    for call in (lambda: find_blocks(seq), lambda: prepare(seq, lr=1e-3), lambda: plan(seq)):
        with pytest.raises(ValueError, match=r"blocks='path\.to\.layers'"):
            call()
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([MLPBlock(), GatedBlock()])  # two classes: not a stack of one class
    with pytest.raises(ValueError, match="blocks="):
        find_blocks(mixed)


def _fingerprint(model: nn.Module):
    """What prepare could change: module classes, instance attributes (a wrapped forward), hooks, parameters and
    their gradient hooks, the HF config's use_cache."""
    mods = [(n, type(m), sorted(k for k in m.__dict__ if not k.startswith("_")),
             len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__)
            for n, m in model.named_modules()]
    params = [(n, p.requires_grad, bool(getattr(p, "_post_accumulate_grad_hooks", None)))
              for n, p in model.named_parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return mods, params, state, getattr(getattr(model, "config", None), "use_cache", None)


def _assert_unchanged(model, fingerprint, forward):
    mods, params, state, use_cache = _fingerprint(model)
    assert mods == fingerprint[0] and params == fingerprint[1] and use_cache == fingerprint[3]
    assert state.keys() == fingerprint[2].keys() and all(torch.equal(state[k], fingerprint[2][k]) for k in state)
    forward()


BAD_OPTIONS = [
    (dict(linears="fp9"), ValueError, "linears='fp9'"),
    (dict(linears=True), ValueError, "linears=True"),
    (dict(activations="bf8"), ValueError, "activations='bf8'"),
    (dict(activations=1.5), ValueError, "in \\(0, 1\\)"),
    (dict(activations=0.5), ValueError, "needs compile=True"),  # the budget is Inductor's: compiled blocks only
    (dict(compile="yes"), ValueError, "compile='yes'"),
    (dict(cuda_graphs="yes"), ValueError, "cuda_graphs is True or False"),
    (dict(previous_weight_scale="yes"), ValueError, "previous_weight_scale='yes'"),
    (dict(previous_weight_scale=True), ValueError, "previous_weight_scale=True: it needs compiled blocks"),
    (dict(cuda_graphs=True), ValueError, "cuda_graphs=True needs the model on CUDA"),
    (dict(step_in_backward="sometimes"), ValueError, "step_in_backward"),
    (dict(offload=2, activations=None), ValueError, "offload=2: not here \\(not on CUDA\\)"),
    (dict(offload="all"), ValueError, "offload is 'auto', False or a number of blocks in 1..4"),
    (dict(offload=5), ValueError, "in 1..4, got 5"),
    (dict(max_memory_gib=-1, tokens=1024), ValueError, "positive"),
    (dict(max_memory_gib=0, tokens=1024), ValueError, "positive"),
    (dict(max_memory_gib=8), ValueError, "tokens="),
    (dict(max_memory_gib=8, tokens=0), ValueError, "tokens="),
    (dict(max_memory_gib=True, tokens=1024), ValueError, "positive"),
    (dict(max_memory_fraction=0.9), ValueError, "max_memory_fraction needs tokens="),
    (dict(max_memory_fraction=1.5, tokens=1024), ValueError, "in \\(0, 1\\]"),
    (dict(max_memory_fraction=0, tokens=1024), ValueError, "in \\(0, 1\\]"),
    (dict(max_memory_fraction="90%", tokens=1024), ValueError, "in \\(0, 1\\]"),
    (dict(max_memory_fraction=0.9, max_memory_gib=8, tokens=1024), ValueError, "not both"),
    (dict(max_memory_fraction=0.9, tokens=1024), ValueError, "fraction of a GPU's memory.*on cpu"),
    (dict(blocks="out"), ValueError, "not an nn.ModuleList"),
    (dict(blocks="no.such.layers"), ValueError, "no.such.layers"),
    (dict(blocks=3), TypeError, "name, an nn.ModuleList or an nn.Sequential"),
    (dict(blocks=nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])), ValueError, "not part of the model"),
    (dict(lr=-1.0), ValueError, "learning rate"),  # the optimizer's own check, before the model changes
    (dict(betas=(0.9,)), ValueError, "betas"),
    (dict(no_such_option=1), TypeError, "no_such_option"),
    # a misspelt option of prepare's own is named as prepare's, with its own options listed
    (dict(step_in_backwards=False), TypeError, r"prepare\(\) got unexpected keyword arguments \['step_in_backwards'\]: "
                                               r"its own options are \[.*'step_in_backward'"),
    (dict(max_memory_gib=8, tokens=-5), ValueError, "a positive int .*got -5"),
]


@pytest.mark.parametrize("options,error,match", BAD_OPTIONS, ids=[str(o) for o, _, _ in BAD_OPTIONS])
def test_bad_options_refused_before_the_model_changes(options, error, match):
    model = _net(mixed=False)
    x = torch.randn(2, 8, 16)
    before, y = _fingerprint(model), model(x)
    options = {"lr": 1e-3, "linears": "fp8_delayed", "activations": "fp8", "compile": False, **options}
    with pytest.raises(error, match=match):
        prepare(model, **options)
    _assert_unchanged(model, before, lambda: torch.testing.assert_close(model(x), y, rtol=0, atol=0))


def test_bad_options_leave_an_hf_model_as_it_was():
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    before, logits = _fingerprint(model), model(input_ids=ids).logits
    assert before[3] is True
    for options in (dict(linears="fp9"), dict(activations="bf8"), dict(max_memory_gib=1.0), dict(lr=-1.0),
                    dict(blocks="model.norm")):
        with pytest.raises((ValueError, TypeError)):
            prepare(model, **options)
        _assert_unchanged(model, before, lambda: torch.testing.assert_close(model(input_ids=ids).logits, logits,
                                                                            rtol=0, atol=0))


# ---- 5. the memory budget ------------------------------------------------------------------------------------

def test_budget_picks_by_the_estimates(monkeypatch):
    """Eight blocks: recompute (one FP8 block input per block) then costs less than FP8 activations with attention's
    (every block's saved tensors, in FP8), less than FP8 activations keeping attention's, less than none. The
    budgets are placed between the first call's estimates."""
    model = _tiny_llama(num_hidden_layers=8)
    tokens = 1 << 20
    first = plan(model, max_memory_gib=1e9, tokens=tokens, compile=False)
    assert first.activations is None
    est = first.estimate_gib
    assert len(est) == 4
    e_none, e_fp8, e_att, e_rec = est.values()  # fastest first: as autograd saves them, FP8, attention's too, recompute
    assert e_none > e_fp8 > e_att > e_rec > 0, est
    assert math.isclose(plan(model, max_memory_gib=e_none, tokens=tokens).estimate_gib[next(iter(est))], e_none)
    assert plan(model, max_memory_gib=e_none, tokens=tokens).activations is None  # an estimate fits itself
    assert plan(model, max_memory_gib=(e_none + e_fp8) / 2, tokens=tokens).activations == "fp8"
    assert plan(model, max_memory_gib=(e_fp8 + e_att) / 2, tokens=tokens).activations == "fp8_attention"
    assert plan(model, max_memory_gib=(e_att + e_rec) / 2, tokens=tokens).activations == "recompute"
    with pytest.raises(ValueError, match="nothing fits") as err:
        plan(model, max_memory_gib=0.9 * e_rec, tokens=tokens)
    for name, gib in est.items():
        assert f"{name}: {gib:.3g} GiB" in str(err.value)
    # more tokens, more activations; the same candidates
    assert all(a < b for a, b in zip(plan(model, max_memory_gib=1e9, tokens=tokens // 2).estimate_gib.values(),
                                     est.values()))
    # an explicit choice is the only candidate
    only = plan(model, max_memory_gib=1e9, tokens=tokens, activations="fp8")
    assert list(only.estimate_gib.values()) == [e_fp8]
    # compiled blocks and FP8 linears (the GPU's choice; plan only decides, so the CPU can ask): three candidates,
    # cheaper in the same order, and the FP8 GEMMs' smaller saved inputs cost less than without them
    compiled = plan(model, max_memory_gib=1e9, tokens=tokens, compile=True, linears="fp8_delayed").estimate_gib
    plain = plan(model, max_memory_gib=1e9, tokens=tokens, compile=True, linears=None).estimate_gib
    # (none, FP8 activations, attention's too, Inductor budgets 0.5, 0.3, recompute): each rung is slower and saves
    # more
    assert len(compiled) == 6 and all("fp8_delayed linears" in k for k in compiled)
    rungs = list(compiled.values())
    assert all(a > b > 0 for a, b in zip(rungs, rungs[1:])), compiled
    assert "FP8 activations" in list(compiled)[1] and "attention's too" in list(compiled)[2]
    assert "Inductor keeps 50%" in list(compiled)[3]
    assert all(a <= b for a, b in zip(compiled.values(), plain.values())), (compiled, plain)
    # as CUDA graphs (its device check stubbed: plan only decides) recompute is left out: it runs the blocks
    # again inside backward, outside their graphs
    monkeypatch.setattr("lpoptim.planner._check_cuda_graphs", lambda *a: None)
    graphs = plan(model, max_memory_gib=1e9, tokens=tokens, compile=True, linears="fp8_delayed", cuda_graphs=True)
    assert list(graphs.estimate_gib.values()) == rungs[:5] and graphs.cuda_graphs
    # prepare applies the choice the budget made
    opt = prepare(model, lr=1e-3, max_memory_gib=(e_none + e_fp8) / 2, tokens=tokens, compile=False,
                  step_in_backward=False)
    assert opt.plan.activations == "fp8" and opt.plan.handles


def test_offload_choices():
    """Which offloaded block counts a plan may take: none off CUDA, under CUDA graphs, FSDP2, HF checkpointing or
    packing activations (a reason given; refused where asked for); on CUDA 1 .. MAX_OFFLOAD_FRACTION of the
    blocks for a budget."""
    from lpoptim.planner import MAX_OFFLOAD_FRACTION, _offload_choices

    params = [nn.Parameter(torch.zeros(2))]
    reasons = {}
    assert _offload_choices("auto", 10, False, False, "auto", params, False, reasons) == [0]
    assert reasons["offload"] == "not on CUDA"
    most = int(MAX_OFFLOAD_FRACTION * 10)
    assert 1 <= most < 10
    assert _offload_choices("auto", 10, True, False, "auto", params, False, {}) == [0, *range(2, most + 1)]
    assert _offload_choices(4, 10, True, False, "auto", params, False, {}) == [4]
    assert _offload_choices(False, 10, True, False, "auto", params, False, {}) == [0]
    for args, why in [((True, True, None, False), "CUDA graphs"), ((True, False, "fp8", False), "packs the saved"),
                      ((True, False, "recompute", False), "packs the saved"),
                      ((True, False, None, True), "HF gradient checkpointing")]:
        cuda, graphs, acts, ckpt = args
        reasons = {}
        assert _offload_choices("auto", 10, cuda, graphs, acts, params, ckpt, reasons) == [0]
        assert why in reasons["offload"]
        with pytest.raises(ValueError, match=f"offload=3: not here.*{why}"):
            _offload_choices(3, 10, cuda, graphs, acts, params, ckpt, {})


def test_budget_offloads_the_fewest_blocks_that_fit(monkeypatch):
    """With offloading possible (the CUDA answer, stubbed: plan only decides): the fewest offloaded blocks whose
    estimate fits, on the rung after FP8 activations (attention's too) and before recompute; an explicit count is
    on every rung."""
    import lpoptim.planner as planner

    model = _tiny_llama(num_hidden_layers=10)
    tokens = 1 << 20
    real = planner._offload_choices
    monkeypatch.setattr(planner, "_offload_choices", lambda offload, n, *a: real(offload, n, True, *a[1:]))
    most = int(planner.MAX_OFFLOAD_FRACTION * 10)
    e_none = next(iter(plan(model, max_memory_gib=1e9, tokens=tokens, compile=False).estimate_gib.values()))
    by_k = [next(iter(plan(model, max_memory_gib=1e9, tokens=tokens, compile=False, offload=k).estimate_gib.values()))
            for k in range(1, most + 1)]
    # one block's share stays in the estimate (fetched back ahead): each block offloaded past the first saves
    assert math.isclose(by_k[0], e_none) and all(a > b for a, b in zip(by_k, by_k[1:])), by_k
    budget = (by_k[2] + by_k[3]) / 2  # between 3 and 4 blocks
    chosen = plan(model, max_memory_gib=budget, tokens=tokens, compile=False, activations=None)
    assert (chosen.activations, chosen.offload_blocks) == (None, 4), chosen.estimate_gib
    assert list(chosen.estimate_gib) == ["unchanged linears, activations unchanged",
                                         "unchanged linears, activations unchanged, 4 blocks' offloaded"]
    assert "the first 4 blocks" in chosen.summary() and chosen.options()["offload"] == 4
    # the whole ladder: as saved, FP8, attention's too, offloaded (the most, where none fits), recompute
    ladder = plan(model, max_memory_gib=1e-9 + min(by_k[-1], 1e9), tokens=tokens, compile=False)
    names = list(ladder.estimate_gib)
    assert [n.split(", ", 1)[1] for n in names] == [
        "activations unchanged", "FP8 activations", "FP8 activations, attention's too",
        f"activations unchanged, {most} blocks' offloaded", "FP8 block inputs + recompute"], names
    e_att, e_off = ladder.estimate_gib[names[2]], ladder.estimate_gib[names[3]]
    if e_off < e_att:  # the budget between them takes the offload rung
        got = plan(model, max_memory_gib=(e_off + e_att) / 2, tokens=tokens, compile=False)
        assert got.activations is None and got.offload_blocks > 0
    # an explicit activations choice stays on the offload rungs (here Inductor's budget, on compiled blocks)
    budgeted = plan(model, max_memory_gib=1e9, tokens=tokens, compile=True, linears=None, activations=0.5)
    e_half = next(iter(budgeted.estimate_gib.values()))
    kept = plan(model, max_memory_gib=0.97 * e_half, tokens=tokens, compile=True, linears=None, activations=0.5)
    assert kept.activations == 0.5 and kept.offload_blocks > 0, kept.estimate_gib
    assert all("Inductor keeps 50%" in name for name in kept.estimate_gib)
    # an explicit count: only the rungs that take it (as saved; Inductor's budgets where compiled)
    only = plan(model, max_memory_gib=1e9, tokens=tokens, compile=False, offload=2)
    assert list(only.estimate_gib) == ["unchanged linears, activations unchanged, 2 blocks' offloaded"]
    with pytest.raises(ValueError, match="nothing fits"):
        plan(model, max_memory_gib=by_k[1] * 0.999, tokens=tokens, compile=False, offload=2)


def _summary_options(summary: str) -> dict:
    """plan()'s options back from a Plan.summary() (what a bench file records of what prepare applied)."""
    from types import SimpleNamespace

    from lpoptim.planner import ACTIVATIONS, Plan

    rows = {}
    for line in summary.splitlines()[1:]:
        key, _, rest = line.strip().partition(" ")
        rows[key] = rest.strip().split("  (")[0]
    labels = {Plan.activations_label.fget(SimpleNamespace(activations=a)): a for a in ACTIVATIONS}
    pct = re.match(r"Inductor keeps (\d+)% of the activations", rows["activations"])
    return dict(linears=None if rows["linears"] == "unchanged" else rows["linears"],
                activations=int(pct.group(1)) / 100 if pct else labels[rows["activations"]],
                compile=rows["compile"] == "each block", step_in_backward=rows["step_in_backward"] == "yes",
                chunked_loss=rows["chunked_loss"] == "yes", state_bits=int(rows["state_bits"]))


def test_estimates_stay_above_the_measured_peaks():
    """The budget relies on the estimate not falling below the real peak. Every lpoptim stack of the HF bench files
    (docs/results/hf_*.json: Llama-2 7B and 13B shapes, a 26.1 B Llama's, Llama-3-8B's, Qwen2.5-7B's and
    Gemma-2-9B's, on an H100, 1 x 1024 to 4 x 2048, eager and compiled, FP8 and 4-bit states) is estimated again by
    this code from the plan the file records, on a model built on the meta device: at or above its measured peak,
    and within 1 GiB of it on the shapes its activation model was calibrated on (multi-head attention), 2.25 GiB on
    the grouped-query ones (their smaller k and v, and Qwen's wider MLP, save less than the model counts; at most
    2.03 measured)."""
    import glob
    import json

    from transformers import AutoModelForCausalLM

    from lpoptim.bench import load_hf_config
    from lpoptim.planner import plan

    files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "results", "hf_*.json")))
    checked = 0
    for path in files:
        data = json.load(open(path))
        # the estimate is of the allocator's allocated peak; a +cg row's peak is the reserved one (its graphs'
        # pool is not "allocated" while they replay), and the meta device has no graphs to plan
        rows = [r for r in data["results"] if r.get("plan") and r.get("peak_bytes") and r.get("peak_kind") != "reserved"]
        if not rows:
            continue
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_hf_config(data["preset"]), dtype=torch.bfloat16)
        model.config.use_cache = False
        tokens = data["batch"] * data["seq"]
        for r in rows:  # files written before bench recorded plan_options carry the summary alone
            options = dict(r.get("plan_options") or _summary_options(r["plan"]))
            offload = options.pop("offload", 0)  # (a CUDA part: plan refuses it here, on the CPU)
            p = replace(plan(model, **options), offload_blocks=offload or 0)
            est = estimate_peak_bytes(model, model.get_submodule(p.blocks), p, tokens)
            where = (os.path.basename(path), r["recipe"], est / 2**30, r["peak_bytes"] / 2**30)
            slack = 2**30 if os.path.basename(path).startswith(("hf_llama2", "hf_llama_26b")) else 2.25 * 2**30
            assert r["peak_bytes"] <= est <= r["peak_bytes"] + slack, where
            checked += 1
    assert checked >= 50, checked


def _low_bit_layers(model) -> dict:
    """The first block's low-bit layers, by name within the block, with their min_tokens."""
    return {n.split("layers.0.")[1]: m.min_tokens for n, m in model.named_modules()
            if isinstance(m, LowBitLinear) and "layers.0." in n}


def test_auto_linears_by_width_and_tokens(monkeypatch):
    """The auto choice of linears, where it converts (compiled blocks on FP8 tensor cores: pretended here, on the
    CPU, with the thresholds scaled to a tiny model): only the blocks' layers at least linears_min_features wide in
    and out, each running a call of fewer than linears_min_tokens tokens as nn.Linear does (the same loss and
    gradients as the unconverted model, bit for bit) and a larger call low-bit; none with tokens= under the
    threshold or where no layer is that wide, nor eager or without FP8 cores. Plan.options() makes the same plan
    again with the recipe named; the estimate counts the layers as nn.Linear below the threshold, and the
    narrow ones left out as nn.Linear always."""
    import json

    import lpoptim.planner as planner

    real = planner.auto_linears
    base = _tiny_llama()
    stack = base.model.layers
    assert real(False, True, None, stack, 64, 40)[0] is None and real(True, False, None, stack, 64, 40)[0] is None
    assert real(True, True, 39, stack, 64, 40) == (None, "39 tokens a step: under 40, quantizing the weights costs "
                                                         "more than the FP8 GEMMs save")
    assert real(True, True, 40, stack, 64, 40)[0] == real(True, True, None, stack, 64, 40)[0] == "fp8_delayed"
    assert "no layer of the blocks is 256 wide" in real(True, True, None, stack, 256, 40)[1]

    # the defaults, scaled down; auto as on an H100
    monkeypatch.setattr(planner, "LINEARS_MIN_FEATURES", 64)
    monkeypatch.setattr(planner, "LINEARS_MIN_TOKENS", 40)
    monkeypatch.setattr(planner, "auto_linears", lambda compiled, fp8_cores, *a: real(True, True, *a))
    model = copy.deepcopy(base)
    opt = prepare(model, lr=1e-3, compile=False, step_in_backward=False, chunked_loss=False)
    p = opt.plan
    assert (p.linears, p.linears_min_features, p.linears_min_tokens) == ("fp8_delayed", 64, 40)
    assert "fp8_delayed, where 64 wide in and out, nn.Linear under 40 tokens a call" in p.summary()
    wide = {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}  # k, v: 32 out

    assert _low_bit_layers(model) == dict.fromkeys(wide, 40)
    small, large = _batch("llama", 16), _batch("llama", 24)  # 32 and 48 tokens a step
    for batch, same in ((small, True), (large, False)):
        ref, got = _run(base, **batch), _run(model, **batch)
        assert torch.equal(ref[0].loss, got[0].loss) == same
        assert all(torch.equal(ref[1][n], got[1][n]) for n in ref[1]) == same

    options = json.loads(json.dumps(p.options()))
    assert options["linears"] == "fp8_delayed"
    again = prepare(copy.deepcopy(base), lr=1e-3, **options)
    assert again.plan.options() == p.options() and _low_bit_layers(again.plan.model) == _low_bit_layers(model)
    narrower = prepare(copy.deepcopy(base), lr=1e-3, compile=False, linears_min_features=0, linears_min_tokens=0)
    assert _low_bit_layers(narrower.plan.model) == dict.fromkeys(wide | {"self_attn.k_proj", "self_attn.v_proj"}, 0)
    named = plan(base, linears="fp8_delayed", compile=False, step_in_backward=False, chunked_loss=False)
    assert (named.linears_min_features, named.linears_min_tokens) == (0, 0)
    too_wide = plan(base, linears="fp8_delayed", compile=False, linears_min_features=256)
    assert too_wide.linears is None and "linears_min_features=256" in too_wide.reasons["linears"]
    assert plan(base, compile=False, tokens=32).linears is None  # under the threshold: nothing converted
    for bad in (0, -5, True, 2.0):
        with pytest.raises(ValueError, match="tokens"):
            plan(base, compile=False, tokens=bad)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="linears_min_tokens"):
            plan(base, compile=False, linears_min_tokens=bad)

    # the estimate, compiled and with the step in backward (eager FP8 linears save what nn.Linear saves; without
    # the step in backward this model's gradients outweigh its activations)
    auto, named = (replace(c, compile=True, step_in_backward=True) for c in (p, named))
    unconverted = replace(named, linears=None)
    for t in (32, 48):
        low, high = (estimate_peak_bytes(base, stack, c, t) for c in (named, unconverted))
        est = estimate_peak_bytes(base, stack, auto, t)
        assert low < high and (est == high if t < 40 else low < est < high)  # k, v: nn.Linear


def test_auto_linears_take_k_and_v_beside_q(monkeypatch):
    """The width rule's second part through prepare (nn.convert.wide_linears, its output floor scaled to the tiny
    model): grouped-query attention's k and v, narrow out, are converted with the wide layers beside them and named
    in the plan; layers converted by hand do not take them along (nothing wide is left unconverted: the blocks are
    low-bit already)."""
    import lpoptim.nn.convert as convert
    import lpoptim.planner as planner
    from lpoptim.nn import convert_linears

    real = planner.auto_linears
    monkeypatch.setattr(planner, "auto_linears", lambda compiled, fp8_cores, *a: real(True, True, *a))
    monkeypatch.setattr(convert, "MIN_OUT_FEATURES", 32)
    base = _tiny_llama()

    every = {f"self_attn.{x}_proj" for x in "qkvo"} | {f"mlp.{x}_proj" for x in ("gate", "up", "down")}
    opt = prepare(copy.deepcopy(base), lr=1e-3, compile=False, step_in_backward=False, chunked_loss=False,
                  linears_min_features=64, linears_min_tokens=0)
    assert set(_low_bit_layers(opt.plan.model)) == every
    assert "where 64 wide in and out (or 32 out beside such a layer)" in opt.plan.summary()
    hand = copy.deepcopy(base)
    convert_linears(hand, filter_fn=lambda m, fqn: ".layers." in fqn and not fqn.endswith(("k_proj", "v_proj")))
    p = plan(hand, compile=False, step_in_backward=False, chunked_loss=False, linears_min_features=64)
    assert p.linears is None and p.reasons["linears"] == "the blocks' layers are low-bit already"


def test_plan_options_make_the_same_plan_again():
    """Plan.options() (what lpoptim bench records as plan_options) gives plan() what makes the same choices, without
    the budget that made them; prepare takes them as they are."""
    import json

    model = _tiny_llama(num_hidden_layers=4)
    tokens = 1 << 20
    est = list(plan(model, max_memory_gib=1e9, tokens=tokens, compile=False).estimate_gib.values())
    for kw in (dict(max_memory_gib=(est[1] + est[2]) / 2, tokens=tokens, compile=False),  # a budget's choice
               dict(linears="fp8_delayed", activations="recompute", compile=False, step_in_backward=False),
               dict(state_bits=4, min_quant_numel=1024, group_size=64, chunked_loss=False, compile=False)):
        first = plan(model, **kw)
        options = json.loads(json.dumps(first.options()))  # as a bench file holds them
        again = plan(model, **options)
        fields = ("blocks", "linears", "activations", "compile", "cuda_graphs", "previous_weight_scale",
                  "step_in_backward", "chunked_loss", "state_bits", "min_quant_numel", "group_size")
        assert [getattr(again, f) for f in fields] == [getattr(first, f) for f in fields], kw
    opt = prepare(_tiny_llama(num_hidden_layers=4), lr=1e-3, **options)
    assert opt.plan.options() == options and opt.param_groups[0]["state_bits"] == 4


def test_budget_as_a_fraction_of_the_device(monkeypatch):
    """max_memory_fraction=f is max_memory_gib=f x the device's total memory: the same choice, the fraction named in
    the reason (the CPU has no device total: it is refused there, test_bad_options; here a 64 GiB one stands in)."""
    import lpoptim.planner as planner

    monkeypatch.setattr(planner, "device_memory_gib", lambda device: 64.0)
    model = _tiny_llama(num_hidden_layers=8)
    tokens = 1 << 20
    est = list(plan(model, max_memory_gib=1e9, tokens=tokens, compile=False).estimate_gib.values())
    fraction = (est[1] + est[2]) / 2 / 64.0  # between FP8 activations and FP8 with attention's
    by_fraction = plan(model, max_memory_fraction=fraction, tokens=tokens, compile=False)
    by_gib = plan(model, max_memory_gib=fraction * 64.0, tokens=tokens, compile=False)
    assert by_fraction.activations == by_gib.activations == "fp8_attention"
    assert f"{fraction:g} of cpu's 64 GiB" in by_fraction.reasons["activations"]
    with pytest.raises(ValueError, match="nothing fits .* of cpu's 64 GiB"):
        plan(model, max_memory_fraction=est[-1] / 64.0 * 0.9, tokens=tokens, compile=False)


def test_estimated_attention_bytes_follow_the_heads():
    """What "fp8_attention" saves in the estimate: half of q, k, v and the output per token and block, from an HF
    config's heads (grouped k/v heads count their own width), else 4 x the block's width; the budget's saving is
    exactly that."""
    from lpoptim.memory import ALLOCATOR_OVERHEAD, attention_saved_features
    from lpoptim.planner import plan

    model = _tiny_llama(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)
    assert attention_saved_features(model, 64) == 2 * (4 + 2) * 16
    assert attention_saved_features(_net(), 16) == 4 * 16  # no config: a plain torch model
    tokens = 1 << 16
    est = list(plan(model, max_memory_gib=1e9, tokens=tokens, compile=False).estimate_gib.values())
    n_blocks = len(model.model.layers)
    saved = tokens * n_blocks * 2 * (4 + 2) * 16 * 4 / 2  # fp32 parameters: 4 bytes, half of them saved
    assert math.isclose((est[1] - est[2]) * 2**30, saved * ALLOCATOR_OVERHEAD, rel_tol=1e-9)


@pytest.mark.parametrize("state_bits", [8, 4])
def test_estimated_state_bytes_are_lpoptims(state_bits):
    """The static part of the estimate: lpoptim.memory.state_bytes per parameter against what lpoptim.state_bytes
    counts after a real step (exact), FP8 and 4-bit states, and the estimate at 0 tokens is parameters + states +
    gradients, with the allocator's margin."""
    from lpoptim.memory import ALLOCATOR_OVERHEAD

    model = _tiny_llama(intermediate_size=160)  # rows of 64 and of 160: one scale per row, two per row
    opt = prepare(model, lr=1e-3, compile=False, step_in_backward=False, state_bits=state_bits)
    assert opt.plan.state_bits == state_bits and opt.param_groups[0]["state_bits"] == state_bits
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(opt.state[p] for p in params)
    assert any(p.numel() >= 4096 and p.shape[-1] < 128 for p in params)  # groups per row, not per 128 elements
    assert any(p.numel() < 4096 for p in params)  # fp32 moments
    exact = lpoptim.state_bytes(opt)["total_bytes"]
    assert sum(estimated_state_bytes(p, state_bits=state_bits) for p in params) == exact
    for p in params:  # per parameter too
        single = lpoptim.AdamW([nn.Parameter(p.detach().clone())], state_bits=state_bits)
        single.param_groups[0]["params"][0].grad = torch.ones_like(p)
        single.step()
        assert estimated_state_bytes(p, state_bits=state_bits) == lpoptim.state_bytes(single)["total_bytes"], \
            tuple(p.shape)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    static = estimate_peak_bytes(model, model.model.layers, opt.plan, 0)
    # parameters, states, all gradients (no step in backward), and the allocator's margin
    assert static == pytest.approx((nbytes + exact + nbytes) * ALLOCATOR_OVERHEAD, rel=1e-12)


# ---- 6. bf16 parameters ----------------------------------------------------------------------------------------

def test_bf16_parameters_round_stochastically():
    model = _tiny_llama().to(torch.bfloat16)
    opt = prepare(copy.deepcopy(model), lr=1e-3, compile=False, step_in_backward=False)
    assert opt.plan.bf16_stochastic_round and opt.param_groups[0]["bf16_stochastic_round"] is True
    opt = prepare(copy.deepcopy(model), lr=1e-3, compile=False, bf16_stochastic_round=False)
    assert opt.param_groups[0]["bf16_stochastic_round"] is False  # the user's choice wins
    fp32 = prepare(_tiny_llama(), lr=1e-3, compile=False)
    assert not fp32.plan.bf16_stochastic_round and fp32.param_groups[0]["bf16_stochastic_round"] is False
    # and the bf16 model trains through it (stochastic rounding, step in backward)
    prepared = copy.deepcopy(model)
    opt = prepare(prepared, lr=1e-2, compile=False)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    before = [p.detach().clone() for p in prepared.parameters()]
    prepared(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(p.dtype == torch.bfloat16 for p in prepared.parameters())
    assert sum(not torch.equal(a, b) for a, b in zip(before, prepared.parameters())) == len(before)


# ---- 7. the HF Trainer ----------------------------------------------------------------------------------------

class _CharBlocks(torch.utils.data.Dataset):
    def __init__(self, block=32, n=160):
        from lpoptim.train.data import CharData

        self.x, _ = CharData().batch("train", n, block, torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer(out, *, fused, accumulation, max_grad_norm, steps, save_steps=None):
    pytest.importorskip("accelerate")
    model = _hf("llama", vocab_size=80, max_position_embeddings=64)
    options = {} if fused else {"step_in_backward": False}
    opt = prepare(model, lr=1e-2, weight_decay=0.1, compile=False, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 100)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, gradient_accumulation_steps=accumulation,
        max_grad_norm=max_grad_norm, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_CharBlocks(), optimizers=(opt, scheduler))
    return trainer, model, opt


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_prepare_accumulates_and_clips(tmp_path):
    """The recipe for the Trainer's accumulation and clipping: step_in_backward=False. It also keeps the Trainer's
    dataset columns (it reads model.forward's signature: the chunked loss's forward must report the model's)."""
    trainer, model, opt = _trainer(tmp_path, fused=False, accumulation=2, max_grad_norm=1.0, steps=10)
    trainer.train()
    losses = _losses(trainer)
    # ln(80) = 4.4 towards the characters' statistics (measured: 4.37 -> 3.29-3.40 in the last three steps)
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < 0.85 * losses[0], losses
    assert opt.plan.chunked_loss and any("exp_avg_scale" in s for s in opt.state.values())


def test_trainer_with_the_step_in_backward(tmp_path):
    trainer, model, opt = _trainer(tmp_path / "a", fused=True, accumulation=1, max_grad_norm=0, steps=10)
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < 0.85 * losses[0], losses  # measured 4.38 -> 3.36-3.62
    trainer, _, _ = _trainer(tmp_path / "b", fused=True, accumulation=2, max_grad_norm=0, steps=2)
    with pytest.raises(RuntimeError, match="step_in_backward=False"):  # accumulation is refused, not wrong
        trainer.train()


def test_trainer_resume_is_exact(tmp_path):
    """Six steps straight, against three, a checkpoint, and three more resumed from it in a fresh process's
    objects: the same parameters, bit for bit (lpoptim's states, the scheduler and the data order restored)."""
    straight, model_a, _ = _trainer(tmp_path / "a", fused=False, accumulation=2, max_grad_norm=1.0, steps=6,
                                    save_steps=3)
    straight.train()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert checkpoint.is_dir()
    resumed, model_b, opt_b = _trainer(tmp_path / "b", fused=False, accumulation=2, max_grad_norm=1.0, steps=6,
                                       save_steps=3)
    init = [p.detach().clone() for p in model_b.parameters()]
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    assert _losses(resumed)[-3:] == _losses(straight)[-3:]
    moved = 0
    for a, b, c in zip(model_a.parameters(), model_b.parameters(), init, strict=True):
        assert torch.equal(a, b)
        moved += not torch.equal(b, c)
    assert moved == len(init)


def test_activation_budget_is_set_for_the_compiled_blocks_alone(monkeypatch):
    """activations=0.5 on compiled blocks: Inductor's partitioner gets the budget while each block's graph is
    compiled (its first call), the process-wide setting is untouched, and the gradients are the uncompiled
    model's (recomputing in backward is the same arithmetic)."""
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    model = _tiny_llama()
    batch = _batch("llama")
    ref = _grads(model, batch)
    prepared = copy.deepcopy(model)
    default = functorch_config.activation_memory_budget
    seen = []
    import torch._inductor.compile_fx as compile_fx  # Inductor calls the partitioner by the name it imported

    original = compile_fx.min_cut_rematerialization_partition

    def spy(*args, **kwargs):
        seen.append(functorch_config.activation_memory_budget)
        return original(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "min_cut_rematerialization_partition", spy)
    # no compiled-graph caches: a cached graph is not partitioned again
    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        opt = prepare(prepared, lr=1e-3, compile=True, activations=0.5, linears=None, step_in_backward=False)
        got = _grads(prepared, batch)
    assert opt.plan.activations == 0.5 and "50%" in opt.plan.summary()
    assert seen and set(seen) == {0.5}, seen
    assert functorch_config.activation_memory_budget == default
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_fp16_parameters_keep_the_usual_step_and_the_callers_rounding_word_is_reported():
    """fp16 trains with GradScaler (all gradients unscaled and checked before the step): prepare does not fuse
    the step for fp16 parameters. A bf16 model's plan reports the rounding the optimizer really got."""
    model = _tiny_llama().half()
    assert not plan(model, compile=False).step_in_backward
    assert "GradScaler" in plan(model, compile=False).reasons["step_in_backward"]
    bf16 = _tiny_llama().to(torch.bfloat16)
    opt = prepare(bf16, lr=1e-3, compile=False, bf16_stochastic_round=False)
    assert opt.plan.bf16_stochastic_round is False and "bf16_stochastic_round  no" in opt.plan.summary()


def test_estimate_counts_the_optimizers_layout_and_hf_checkpointing():
    """The estimate follows the optimizer's min_quant_numel and group_size (exactly: against lpoptim.state_bytes
    after a step), and counts HF gradient checkpointing's recompute (each block's input kept, one block replayed)
    instead of every block's activations."""
    from lpoptim.memory import ALLOCATOR_OVERHEAD

    model = _tiny_llama(intermediate_size=160)
    opt = prepare(model, lr=1e-3, compile=False, step_in_backward=False, min_quant_numel=1024, group_size=32)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = [p for p in model.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    exact = lpoptim.state_bytes(opt)["total_bytes"]
    assert (opt.plan.min_quant_numel, opt.plan.group_size) == (1024, 32)
    assert estimate_peak_bytes(model, model.model.layers, opt.plan, 0) == pytest.approx(
        (2 * nbytes + exact) * ALLOCATOR_OVERHEAD, rel=1e-12)

    deep = _tiny_llama(num_hidden_layers=8)
    tokens = 1 << 20
    plain = plan(deep, compile=False, activations=None)
    deep.gradient_checkpointing_enable()
    ckpt = plan(deep, compile=False)
    assert ckpt.hf_checkpointing and not plain.hf_checkpointing and ckpt.activations is None
    assert "HF gradient checkpointing already" in ckpt.reasons["activations"]
    for asked, what in (("fp8", "FP8 activations replace it"), ("recompute", "FP8 recompute replaces it")):
        with pytest.raises(ValueError, match=f"activations='{asked}', but the model has HF gradient checkpointing "
                                             f"on; {what}"):
            plan(deep, compile=False, activations=asked)
    static = estimate_peak_bytes(deep, deep.model.layers, ckpt, 0)
    with_ckpt = estimate_peak_bytes(deep, deep.model.layers, ckpt, tokens)
    without = estimate_peak_bytes(deep, deep.model.layers, plain, tokens)
    assert static < with_ckpt < 0.5 * without


def test_ddp_model_steps_after_backward(tmp_path, monkeypatch):
    """DistributedDataParallel averages gradients as backward ends, so a step inside backward would step each
    rank's own gradient (two gloo ranks drifted apart by 0.09 in three steps before this rule): on a DDP model
    the plan takes the usual step and refuses step_in_backward=True; the hooks warn where plain parameters train
    in a process group of several ranks (how DDP wrapped after prepare looks from there)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        hf = _tiny_llama()
        ddp = DistributedDataParallel(hf)
        chosen = plan(ddp, compile=False)
        assert not chosen.step_in_backward and "DDP" in chosen.reasons["step_in_backward"]
        assert chosen.chunked_loss and chosen.use_cache_off  # the HF model's parts, inside DDP
        ids = torch.randint(0, 128, (2, 16))
        want = hf(input_ids=ids, labels=ids).loss
        opt = prepare(ddp, lr=1e-3, compile=False)
        assert hf.config.use_cache is False
        torch.testing.assert_close(ddp(input_ids=ids, labels=ids).loss, want, rtol=1e-5, atol=1e-6)
        assert "_lpoptim_chunked_loss" in hf.__dict__  # the chunked loss, on the HF model inside DDP
        opt.plan.remove()
        assert "_lpoptim_chunked_loss" not in hf.__dict__
        with pytest.raises(ValueError, match="step_in_backward=True on a DistributedDataParallel model"):
            plan(ddp, compile=False, step_in_backward=True)
        model = _tiny_llama()
        opt = prepare(model, lr=1e-3, compile=False)
        assert opt.plan.step_in_backward
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        ids = torch.randint(0, 128, (2, 16))
        with pytest.warns(UserWarning, match="drift apart"):
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("activations", [None, "fp8", "fp8_attention"])
def test_cuda_graphs_train_as_the_compiled_blocks(activations):
    """prepare(cuda_graphs=True): every compiled block is captured (Inductor skips none) and the usual loop
    trains as with the compiled blocks alone: the same losses and parameters, bf16 with stochastic rounding;
    with FP8 activations too (their wrapper compiles the blocks, packing inside the graphs). Graphs also set the
    FP8 layers' previous_weight_scale, which the run without them is given by hand where the plan did not set it
    (nn.weight_scale.previous_scale_pays). (The linears are named: this small model is narrower than the
    automatic choice converts.)"""
    from lpoptim.nn.weight_scale import previous_scale_pays

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._dynamo.utils import counters

    runs = []
    for graphs in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = _tiny_llama(num_hidden_layers=3).to("cuda", torch.bfloat16)
        opt = prepare(model, lr=1e-3, cuda_graphs=graphs, activations=activations, linears="fp8_delayed")
        assert opt.plan.cuda_graphs is graphs and ("as CUDA graphs" in opt.plan.summary()) is graphs
        lowbit = [m for m in model.modules() if isinstance(m, LowBitLinear)]
        expected = previous_scale_pays(graphs, activations is None)
        assert opt.plan.previous_weight_scale is expected
        assert lowbit and all(m.previous_weight_scale is expected for m in lowbit)
        for m in lowbit:  # what graphs set, without them too: the same numerics, so the same bits
            m.previous_weight_scale = True
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(5):
            ids = torch.randint(0, 128, (2, 32), device="cuda", generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if graphs:
            assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        opt.plan.remove()
    (l0, p0), (l1, p1) = runs
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))


def test_cuda_graphs_conditions():
    """cuda_graphs=True's refusals, each with its reason (the device check first; the others asked of a model
    that is on CUDA as far as the check knows)."""
    from lpoptim.planner import _check_cuda_graphs

    p = [torch.zeros(1)]
    for args, match in (((False, None, p, False), "replays the compiled blocks"),
                        ((True, "recompute", p, False), "runs each block again inside backward"),
                        ((True, None, p, True), "HF gradient checkpointing"),
                        ((True, None, [torch.zeros(1), torch.zeros(1, device="meta")], False), "several devices"),
                        ((True, None, p, False, True), "checkpoint-wrapped")):
        with pytest.raises(ValueError, match=match):
            _check_cuda_graphs(args[0], True, *args[1:])
    _check_cuda_graphs(True, True, None, p, False)
    for activations in (None, "fp8", "fp8_attention", 0.5):
        _check_cuda_graphs(True, True, activations, p, False)


def test_previous_weight_scale_where_it_pays(monkeypatch):
    """fp8_delayed linears scale W by its previous absmax (one read of W in forward, not two) in compiled blocks
    on one CUDA device, each run once a step. Auto: as CUDA graphs, or with the activations as saved where
    Inductor's compile workers launch user Triton kernels statically (its environment variable); never with another
    recipe, recompute, HF gradient checkpointing, a checkpoint-wrapped module, uncompiled blocks or several devices,
    where True is refused with the reason; False is kept. plan() and prepare() agree (both of plan's returns),
    options() records the choice, and prepare sets the layers' flag from the plan."""
    from types import SimpleNamespace

    import torch._inductor.config as inductor_config
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from lpoptim.nn import weight_scale
    from lpoptim.planner import AUTO, _previous_weight_scale

    model = _tiny_llama()
    stack = model.model.layers
    base = plan(model, compile=True, linears="fp8_delayed")
    cuda = [SimpleNamespace(device=torch.device("cuda", 0))] * 2  # parameters on one CUDA device, as far as it asks
    graphs = replace(base, cuda_graphs=True)
    monkeypatch.delenv(weight_scale.STATIC_USER_LAUNCH_ENV, raising=False)
    assert not weight_scale.static_user_launches() and not _previous_weight_scale(base, cuda, stack, AUTO)
    assert _previous_weight_scale(graphs, cuda, stack, AUTO) and _previous_weight_scale(base, cuda, stack, True)
    assert not _previous_weight_scale(graphs, cuda, stack, False)
    wrapped = _tiny_llama().model.layers
    wrapped[1].mlp = checkpoint_wrapper(wrapped[1].mlp)  # one module inside a block is enough to run it twice
    two = [SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cuda", 1))]
    for result, params, blocks, why in (
            (replace(graphs, linears="fp8_tensor"), cuda, stack, "fp8_delayed"),
            (replace(graphs, linears=None), cuda, stack, "fp8_delayed"),
            (replace(graphs, compile=False), cuda, stack, "compiled"),
            (graphs, two, stack, "one CUDA device"), (graphs, list(model.parameters()), stack, "one CUDA device"),
            (replace(graphs, activations="recompute"), cuda, stack, "recomputed"),
            (replace(graphs, hf_checkpointing=True), cuda, stack, "recomputed"),
            (graphs, cuda, wrapped, "recomputed")):
        assert not _previous_weight_scale(result, params, blocks, AUTO), why
        with pytest.raises(ValueError, match=why):
            _previous_weight_scale(result, params, blocks, True)
    # without graphs, auto: where the workers launch statically, with the activations as saved only (measured there)
    monkeypatch.setenv(weight_scale.STATIC_USER_LAUNCH_ENV, "1")
    with inductor_config.patch(static_launch_user_defined_triton_kernels=True, use_static_cuda_launcher=True):
        assert weight_scale.static_user_launches() is (torch.version.hip is None)
    with inductor_config.patch(static_launch_user_defined_triton_kernels=True, use_static_cuda_launcher=False):
        assert not weight_scale.static_user_launches()
    monkeypatch.setattr(weight_scale, "static_user_launches", lambda: True)
    assert _previous_weight_scale(base, cuda, stack, AUTO)
    for changed in (dict(activations="fp8"), dict(activations="fp8_attention"), dict(activations=0.5),
                    dict(offload_blocks=1)):
        assert not _previous_weight_scale(replace(base, **changed), cuda, stack, AUTO), changed
        assert _previous_weight_scale(replace(graphs, **changed), cuda, stack, AUTO), changed
    # plan's two returns ask with its parameters and blocks, and the caller's choice
    calls = []

    def recorder(result, params, blocks, choice):
        calls.append((params, blocks, choice))
        return True

    monkeypatch.setattr("lpoptim.planner._previous_weight_scale", recorder)
    model = _tiny_llama()
    params = [p for p in model.parameters() if p.requires_grad]
    chosen = [plan(model, linears="fp8_delayed", compile=False),
              plan(model, linears="fp8_delayed", compile=False, max_memory_gib=1e9, tokens=64,
                   previous_weight_scale=False)]
    assert [(p == params, b is model.model.layers, c) for p, b, c in calls] == [(True, True, AUTO),
                                                                                (True, True, False)]
    opt = prepare(model, linears="fp8_delayed", compile=False)
    layers = [m for m in model.modules() if isinstance(m, LowBitLinear)]
    assert layers and all(m.previous_weight_scale for m in layers)
    for p in (*chosen, opt.plan):
        assert p.previous_weight_scale and "W scaled by its previous absmax" in p.summary()
        assert p.options()["previous_weight_scale"] is True


def test_preparing_a_prepared_model_again_is_refused_until_its_plan_is_removed():
    """The first optimizer's hooks would go on stepping the parameters inside backward (with its own lr) and free
    the gradients the second one needs: refused, the model as it was; after plan.remove(), prepare works again and
    only the new optimizer steps."""
    model = _tiny_llama()
    first = prepare(model, lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    before, logits = _fingerprint(model), model(input_ids=ids).logits
    with pytest.raises(RuntimeError, match="prepare: these parameters are already stepped inside backward"):
        prepare(model, lr=0.0, step_in_backward=False)
    _assert_unchanged(model, before, lambda: torch.testing.assert_close(model(input_ids=ids).logits, logits,
                                                                        rtol=0, atol=0))
    first.plan.remove()
    second = prepare(model, lr=0.0, weight_decay=0.0)
    weights = [p.detach().clone() for p in model.parameters()]
    model(input_ids=ids, labels=ids).loss.backward()
    second.step()
    second.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # lr 0: the old lr steps nothing


def test_a_sequential_of_blocks_is_a_stack():
    """A plain torch model that is an nn.Sequential of blocks: blocks="" names the model itself (the error for a
    model without a ModuleList says to name the blocks); FP8 activations wrap each block, not the whole."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)])
    with pytest.raises(ValueError, match="name it"):
        prepare(model, lr=1e-3)
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)])
    ref.load_state_dict(model.state_dict())
    opt = prepare(model, lr=1e-3, blocks="", activations="fp8", min_quant_numel=64)
    assert opt.plan.blocks == "" and opt.plan.n_blocks == 3
    ref_opt = lpoptim.AdamW(ref.parameters(), lr=1e-3, min_quant_numel=64)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3)  # FP8 activations against exact ones
    assert all("forward" in block.__dict__ for block in model) and "forward" not in model.__dict__
