"""HF's packed-sequence check answered without a host sync where the model makes its own positions
(nn/packed_check.py): the same outputs as HF's own check, which still runs wherever positions are passed."""
import copy

import pytest
import torch
import torch.nn as nn

import lpoptim
from lpoptim.nn import packed_check

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")
if not callable(getattr(masking_utils, "find_packed_sequence_indices", None)):
    pytest.skip("this transformers has no find_packed_sequence_indices", allow_module_level=True)


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture
def spy(monkeypatch):
    """HF's function, counting its calls (skip_packed_check then wraps the spy)."""
    calls = []
    hf_own = getattr(masking_utils.find_packed_sequence_indices, "_lpoptim_original",
                     masking_utils.find_packed_sequence_indices)

    def counted(position_ids, *args, **kwargs):
        calls.append(position_ids)
        return hf_own(position_ids, *args, **kwargs)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    return calls


def test_own_positions_skip_the_check_with_the_same_outputs(spy):
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 12))
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


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_given_positions_keep_hf_check(spy, how):
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 96, (1, 12))
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])  # three sequences in one row
    with torch.no_grad():
        want = reference(input_ids=ids, position_ids=packed).logits
        plain = reference(input_ids=ids).logits
    # the check matters here: answering None would attend across the packed sequences
    assert not torch.allclose(want[:, 5:], plain[:, 5:])
    packed_check.skip_packed_check(model)
    spy.clear()
    with torch.no_grad():
        got = (model(input_ids=ids, position_ids=packed) if how == "keyword" else model(ids, None, packed)).logits
    assert len(spy) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_training_step_gradients_match(spy):
    model = _llama().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 10))
    packed_check.skip_packed_check(model)
    for m in (model, reference):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_a_raising_forward_leaves_no_answer_behind(spy):
    model = _llama()
    packed_check.skip_packed_check(model)
    with pytest.raises(Exception):
        model(input_ids=torch.full((1, 4), 10_000))  # past the embedding
    assert packed_check._OWN_POSITIONS.get() is False
    # HF's check answers a later call made outside the model
    positions = torch.tensor([[0, 1, 0, 1]])
    assert masking_utils.find_packed_sequence_indices(positions) is not None


def test_refuses_what_is_not_a_causal_lm():
    assert "not a Hugging Face causal LM" in packed_check.why_not(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="skip_packed_check"):
        packed_check.skip_packed_check(nn.Linear(2, 2))


def test_prepare_applies_it_and_plan_remove_undoes_it(spy):
    model = _llama().train()
    opt = lpoptim.prepare(model, 1e-3, compile=False, linears=None, activations=None)
    assert opt.plan.packed_check_skipped
    assert "no host sync" in opt.plan.summary()
    ids = torch.randint(0, 96, (1, 8))
    spy.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    assert spy == []
    opt.plan.remove()
    model(input_ids=ids, labels=ids)
    assert len(spy) == 1
