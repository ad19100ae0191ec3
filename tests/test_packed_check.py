"""HF's packed-sequence check answered without a host sync where the model makes its own positions
(nn/packed_check.py): the same outputs as HF's own check, which still runs wherever positions are given."""
import copy
import threading

import pytest
import torch
import torch.nn as nn

import lpoptim
from lpoptim.nn import packed_check

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")
if not callable(getattr(masking_utils, "find_packed_sequence_indices", None)):
    pytest.skip("this transformers has no find_packed_sequence_indices", allow_module_level=True)

from hf_families import CAUSAL, hf_model  # noqa: E402  (tests/: tiny HF models)

PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])  # three sequences in one row


def _llama(cls=None):
    """The tiny Llama without a KV cache (with one, HF skips the check itself); ``cls``: a subclass of the model."""
    model = hf_model("llama", use_cache=False)
    if cls is not None:
        torch.manual_seed(0)
        model = cls(model.config).train()
    return model


def _hf_own():
    f = masking_utils.find_packed_sequence_indices
    return getattr(f, "_lpoptim_original", f)


@pytest.fixture
def spy(monkeypatch):
    """HF's function, counting its calls (skip_packed_check then wraps the spy)."""
    calls = []
    hf_own = _hf_own()

    def counted(position_ids, *args, **kwargs):
        calls.append(position_ids)
        return hf_own(position_ids, *args, **kwargs)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    return calls


def test_own_positions_skip_the_check_with_the_same_outputs(spy):
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    assert len(spy) == 1  # HF's own forward asks (the test's premise)
    handle = packed_check.skip_packed_check(model)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert len(spy) == 1, "the check ran although the model made the positions"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    handle.remove()
    with torch.no_grad():
        model(input_ids=ids)
    assert len(spy) == 2  # removed: HF's check again


@pytest.mark.parametrize("how", ["keyword", "positional", "cache_position"])
def test_given_positions_keep_hf_check(spy, how):
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 12))
    kwargs = {"cache_position": torch.arange(12)} if how == "cache_position" else {}
    with torch.no_grad():
        want = reference(input_ids=ids, position_ids=PACKED).logits
        plain = reference(input_ids=ids).logits
    # the check matters here: answering None would attend across the packed sequences
    assert not torch.allclose(want[:, 5:], plain[:, 5:])
    packed_check.skip_packed_check(model)
    spy.clear()
    with torch.no_grad():
        if how == "positional":
            got = model(ids, None, PACKED).logits
        elif how == "keyword":
            got = model(input_ids=ids, position_ids=PACKED).logits
        else:  # the caller's cache_position: the model's positions come from it, so HF's check stays
            got = model(input_ids=ids, **kwargs).logits
            want = plain
    assert len(spy) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_subclass_making_positions_keeps_hf_check(spy):
    """A causal LM whose own forward makes packed positions and passes them down: the base model sees them."""

    class SegmentedLlamaForCausalLM(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):
            return super().forward(input_ids=input_ids, position_ids=PACKED, **kwargs)

    model = _llama(cls=SegmentedLlamaForCausalLM)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    packed_check.skip_packed_check(model)
    spy.clear()
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert len(spy) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_refuses_a_base_model_of_the_users_own():
    class MyBase(transformers.LlamaModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = _llama()
    model.model = MyBase(model.config)
    assert "MyBase.forward is not transformers' own" in packed_check.why_not(model)


def test_training_step_gradients_match(spy):
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 10))
    packed_check.skip_packed_check(model)
    spy.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    assert spy == []
    reference(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_a_raising_forward_leaves_no_answer_behind(spy):
    model = _llama()
    packed_check.skip_packed_check(model)
    with pytest.raises(Exception):
        model(input_ids=torch.full((1, 4), 10_000))  # past the embedding
    assert packed_check._OWN_POSITIONS.get() is False
    # HF's check answers a later call made outside the model
    assert masking_utils.find_packed_sequence_indices(torch.tensor([[0, 1, 0, 1]])) is not None


def test_concurrent_forwards_answer_each_their_own(spy):
    """Two threads in one model at once (nn.DataParallel's replicas share it): the one that passes packed positions
    keeps HF's check while the other, which leaves them to the model, is inside its forward; neither raises."""
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        want_plain = reference(input_ids=ids).logits
        want_packed = reference(input_ids=ids, position_ids=PACKED).logits
    packed_check.skip_packed_check(model)
    inside, other_done = threading.Event(), threading.Event()

    def hold(_module, _args):  # the first decoder layer of the plain call waits for the packed call to finish
        if threading.current_thread().name == "plain":
            inside.set()
            assert other_done.wait(30)

    hook = model.model.layers[0].register_forward_pre_hook(hold)
    results, errors = {}, []

    def run(name, **kwargs):
        try:
            with torch.no_grad():
                results[name] = model(input_ids=ids, **kwargs).logits
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            if name == "packed":
                other_done.set()

    spy.clear()
    plain = threading.Thread(target=run, args=("plain",), name="plain")
    plain.start()
    assert inside.wait(30)
    packed = threading.Thread(target=run, args=("packed",), kwargs={"position_ids": PACKED}, name="packed")
    packed.start()
    packed.join(60)
    plain.join(60)
    hook.remove()
    assert not errors, errors
    assert len(spy) == 1  # the packed call's, and only it
    torch.testing.assert_close(results["plain"], want_plain, rtol=0, atol=0)
    torch.testing.assert_close(results["packed"], want_packed, rtol=0, atol=0)


def test_the_whole_model_compiled(spy):
    """torch.compile over the prepared model: Dynamo traces the wrapper without a break (it sets nothing there:
    HF reads nothing on the host when traced) and gives the same logits."""
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 12))
    packed_check.skip_packed_check(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
        want = reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", CAUSAL)
def test_families_answer_as_hf_would(monkeypatch, name):
    """The premise, family by family: wherever the answer is given without looking, HF's own check, run anyway,
    answers the same (None: one sequence a row)."""
    model = hf_model(name, use_cache=False)
    assert packed_check.why_not(model) is None
    packed_check.skip_packed_check(model)
    hf_own, seen = _hf_own(), []

    def checked(position_ids, *args, **kwargs):  # in place of the wrapper: both answers, the wrapper's returned
        flagged = packed_check._OWN_POSITIONS.get()
        answer = hf_own(position_ids, *args, **kwargs)
        seen.append((flagged, answer is None))
        return None if flagged else answer

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", checked)
    ids = torch.randint(3, 100, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    if not seen:  # (OPT's mask never asks; nor Falcon's in transformers 5.17)
        pytest.skip(f"{name}'s mask does not run HF's packed-sequence check in transformers {transformers.__version__}")
    assert all(flagged for flagged, _ in seen), seen
    assert all(hf_none for _, hf_none in seen), seen


def test_refuses_what_is_not_a_causal_lm():
    assert "not a Hugging Face causal LM" in packed_check.why_not(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="skip_packed_check"):
        packed_check.skip_packed_check(nn.Linear(2, 2))


def test_prepare_applies_it_and_plan_remove_undoes_it(spy):
    model = _llama()
    opt = lpoptim.prepare(model, 1e-3, compile=False, linears=None, activations=None)
    assert opt.plan.packed_check and opt.plan.options()["packed_check"]
    assert "no host sync" in opt.plan.summary()
    ids = torch.randint(0, 128, (1, 8))
    spy.clear()
    for call in (lambda: model(input_ids=ids, labels=ids),
                 lambda: model(ids, None, PACKED[:, :8], labels=ids)):  # positional, through the chunked loss's forward
        call().loss.backward()
        opt.step()
        opt.zero_grad()
    assert len(spy) == 1  # the second call's, which gave positions
    opt.plan.remove()
    model(input_ids=ids, labels=ids)
    assert len(spy) == 2


def test_prepare_option():
    refused = lpoptim.prepare(_llama(), 1e-3, compile=False, linears=None, activations=None,
                              packed_check=False)
    assert not refused.plan.packed_check and "unchanged" in refused.plan.summary()
    with pytest.raises(ValueError, match="packed_check=True, but"):
        lpoptim.prepare(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), 1e-3, blocks="", compile=False,
                        packed_check=True)
    with pytest.raises(ValueError, match="packed_check"):
        lpoptim.prepare(_llama(), 1e-3, packed_check="yes")
