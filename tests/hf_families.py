"""Tiny Hugging Face models of the families lpoptim is tested on, built from small configs (no downloads)."""
from __future__ import annotations

import torch
import transformers

_DECODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=128, max_position_embeddings=128)
MOE = ("mixtral", "qwen2_moe", "olmoe")  # mixture-of-experts families
# name -> (config class, model class, config kwargs, the stack's names (this transformers' first; older spellings
# accepted), the block class). Dropout off everywhere: the prepared copy and the original draw other masks.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER, ("model.layers",), "LlamaDecoderLayer"),
    "mistral": ("MistralConfig", "MistralForCausalLM", _DECODER, ("model.layers",), "MistralDecoderLayer"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER, ("model.layers",), "Qwen2DecoderLayer"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 16}, ("model.layers",),
              "Qwen3DecoderLayer"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_DECODER, "head_dim": 16}, ("model.layers",),
               "Gemma2DecoderLayer"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**_DECODER, "head_dim": 16}, ("model.layers",),
               "Gemma3DecoderLayer"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_DECODER, "pad_token_id": 0, "eos_token_id": 1,
                                               "bos_token_id": 1}, ("model.layers",), "Phi3DecoderLayer"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=128,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                                   eos_token_id=0), ("transformer.h",), "GPT2Block"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {k: v for k, v in _DECODER.items()
                                                          if k != "num_key_value_heads"},
                 ("gpt_neox.layers",), "GPTNeoXLayer"),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=64, ffn_dim=128, num_attention_heads=4,
                                                num_hidden_layers=2, vocab_size=128, max_position_embeddings=128,
                                                word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
                                                activation_dropout=0.0),
            ("model.decoder.layers",), "OPTDecoderLayer"),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                                         vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0),
               ("transformer.h",), "FalconDecoderLayer"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
                ("model.layers",), "MixtralDecoderLayer"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64}, ("model.layers",), "Qwen2MoeDecoderLayer"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2},
              ("model.layers",), "OlmoeDecoderLayer"),
    "bert": ("BertConfig", "BertForMaskedLM", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                   num_hidden_layers=2, vocab_size=128, max_position_embeddings=64,
                                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
             ("bert.encoder.layer",), "BertLayer"),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(hidden_size=64, intermediate_size=128,
                                                           num_attention_heads=4, num_hidden_layers=2, image_size=32,
                                                           patch_size=8, num_labels=10),
            ("vit.layers", "vit.encoder.layer"), "ViTLayer"),
}
CAUSAL = [n for n in FAMILIES if n not in ("bert", "vit")]
EAGER_ONLY = {"gemma2"}  # transformers refuses sdpa for Gemma2 ("does not support ... sdpa yet")


def hf_model(name: str, **overrides) -> torch.nn.Module:
    """The family's tiny model in training mode, seed 0; ``overrides`` go to its config."""
    config_name, model_name, kwargs, _, _ = FAMILIES[name]
    cfg = getattr(transformers, config_name)(**{**kwargs, **overrides})
    cfg._attn_implementation = "eager" if name in EAGER_ONLY else "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(cfg).train()
