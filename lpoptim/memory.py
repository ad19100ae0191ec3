"""An estimate of a training step's peak memory, for ``lpoptim.prepare``'s budget (``max_memory_gib``).

The static part is exact arithmetic: parameters, lpoptim's states (1 byte per moment and element plus one fp32
scale per 128 along the last dimension; fp32 moments for tensors under 4096 elements; the step count) and
gradients (all of them, or with the step in backward one 256 MiB bucket and the largest gradient). The
activations are a model: per token and block, a multiple of the bytes of the inputs of the block's linear layers
(what those layers save), calibrated on HF's Llama-2-7B shape at 1 x 2048 tokens, bf16, one H100, torch 2.11
(``lpoptim bench --hf-config llama2-7b``, eager and ``--compile``): 2.6 of them eager, 1.75 compiled; then x 0.32
with FP8 activations eager, x 0.5 with FP8 activations and FP8 linears eager; compiled, x 0.62 with FP8
activations, x 0.75 with FP8 linears, x 0.55 with both (FP8 linears' factors for the share of the linear inputs
that low-bit layers take: those a width threshold converts, none under a token threshold); attention's q, k, v
and output packed too (FP8 per row: half their bf16 bytes) save half of those; with recompute, one FP8 block input
per block and one block's activations while it is replayed; with k of n blocks offloaded to host memory,
(n - k + 1) / n of them (one block fetched back ahead). The LM head and loss: about 10 bytes per logit (the
logits, their fp32 copy and softmax's gradient; 4 more with Gemma 2's logit softcap), or with the chunked loss the
hidden states' gradient, the head's weight gradient, the smaller of the logits' gradient and an fp32 sum of the
weight's, and a chunk's logits beyond those of 64 MiB chunks (the 256-token floor of large vocabularies).
Then 1.2% for the allocator. On HF Llama shapes of 7B, 13B and 26B (1 x 1024 to 4 x 2048, 34 stacks, eager and
compiled, FP8 and 4-bit states: docs/results/hf_llama2*.json, hf_llama_26b*.json) the estimate lay 0.03-0.93 GiB
above the measured peak, never below it; on grouped-query shapes it was not calibrated on (Llama-3-8B,
Qwen2.5-7B, Gemma-2-9B: 16 stacks) 0.60-2.03 GiB above. On other shapes treat it as an estimate: ``lpoptim bench
--hf-config`` measures the real peak.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .nn.convert import wide_linears
from .nn.linear_cross_entropy import default_chunk, keeps_logits_grad, logits_chunk
from .quant import num_groups, packed_shape

BUCKET_BYTES = 256 * 2**20  # step_in_backward's default bucket
# the caching allocator's block rounding and fragmentation: the measured peaks of HF Llama-2-7B and 13B (1 x 2048,
# 4 x 2048; eager and compiled; nine stacks) exceeded the sum of the parts by 0.5-1.3% (a lab tally, not kept; the
# docs/results/hf_* peaks bound the whole estimate: docs/prepare.md)
ALLOCATOR_OVERHEAD = 1.012
ALPHA = {False: 2.6, True: 1.75}  # saved bytes per token / (linear inputs x element size): eager, compiled
# (compiled, FP8 linears, FP8 activations) -> the fraction of ALPHA's bytes that is saved
FACTOR = {(True, False, False): 1.0, (True, False, True): 0.62, (True, True, False): 0.75, (True, True, True): 0.55,
          (False, False, False): 1.0, (False, False, True): 0.32, (False, True, False): 1.0, (False, True, True): 0.5}


def state_bytes(shape, min_quant_numel: int = 4096, group_size: int = 128, state_bits: int = 8) -> float:
    """lpoptim.AdamW's state bytes for one parameter of this shape (a tensor, its shape, or a number of elements
    for a 1-D one): two moments and the fp32 step count. Quantized moments have one fp32 scale per group of
    ``group_size`` along the last dimension (a row shorter than a group has one of its own), as
    lpoptim.state_bytes(opt) counts them after a step."""
    if isinstance(shape, torch.Tensor):
        shape = shape.shape
    shape = torch.Size([shape] if isinstance(shape, int) else shape)
    numel = shape.numel()
    if numel < min_quant_numel:
        return 8.0 * numel + 4
    rows, groups = num_groups(shape, group_size)
    codes = numel if state_bits == 8 else torch.Size(packed_shape(shape)).numel()  # 4 bits: two codes a byte
    return 2 * (codes + 4 * rows * groups) + 4


def linear_input_features(block: nn.Module) -> int:
    """The sum of the in-features of a block's linear layers (what the calibration counts)."""
    return sum(m.in_features for m in block.modules() if isinstance(m, nn.Linear))


def low_bit_share(block: nn.Module, plan, tokens: int) -> float:
    """The share of a block's linear-layer inputs (in features) that the plan's low-bit layers take at ``tokens``
    tokens a call: those of the layers its width threshold converts, none under its token threshold (where the
    layers run as nn.Linear)."""
    if not plan.linears or tokens < plan.linears_min_tokens:
        return 0.0
    layers = [m for m in block.modules() if isinstance(m, nn.Linear)]
    total = sum(m.in_features for m in layers)
    wide = sum(m.in_features for m in wide_linears(block, plan.linears_min_features))
    return wide / total if total else 0.0


def attention_saved_features(model: nn.Module, width: int) -> int:
    """Features per token of what a block's attention saves for backward: q, k, v and its output (from an HF
    config's heads; else 4 x the block's width)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 0:
        head_dim = getattr(config, "head_dim", None) or width // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return 2 * (heads + kv_heads) * head_dim
    return 4 * width


def estimate_peak_bytes(model: nn.Module, blocks: nn.ModuleList, plan, tokens: int) -> float:
    """Estimated peak bytes of one training step of ``model`` under ``plan`` (a planner.Plan) at ``tokens`` tokens."""
    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(state_bytes(p, plan.min_quant_numel, plan.group_size, plan.state_bits) for p in params)
    grads = [p.numel() * p.element_size() for p in params]
    elem = min(p.element_size() for p in blocks.parameters())
    per_block_token = ALPHA[plan.compile] * linear_input_features(blocks[0]) * elem
    # the block input's features (what recompute keeps, one per block): an HF config's hidden_size, else the
    # narrowest linear input (q/k/v and gate/up read the block's input; the MLP's down projection is wider)
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    if not isinstance(width, int):
        width = min((m.in_features for m in blocks[0].modules() if isinstance(m, nn.Linear)), default=0)
    share = low_bit_share(blocks[0], plan, tokens)

    def factor_of(activations_fp8: bool) -> float:  # FP8 linears' factor for their share of the linear inputs
        return (share * FACTOR[plan.compile, True, activations_fp8]
                + (1 - share) * FACTOR[plan.compile, False, activations_fp8])
    if plan.hf_checkpointing:  # the model's own recompute: each block's input in its dtype, one block replayed
        activations = tokens * (len(blocks) * width * elem + per_block_token)
    elif plan.activations == "recompute":  # the FP8 inputs, and one block's activations as the replay saves them
        replayed = per_block_token * factor_of(False)
        activations = tokens * (len(blocks) * width + replayed)
    else:
        factor = factor_of(plan.activations in ("fp8", "fp8_attention"))
        if isinstance(plan.activations, float):  # Inductor's budget: that fraction of what the block would save
            factor *= plan.activations
        activations = tokens * len(blocks) * per_block_token * factor
        if plan.activations == "fp8_attention":  # FP8 per row: half of attention's bf16 bytes
            activations -= tokens * len(blocks) * attention_saved_features(model, width) * elem / 2
        if plan.offload_blocks:  # those blocks' share in host memory, but one block's (fetched back ahead)
            activations *= (len(blocks) - plan.offload_blocks + 1) / len(blocks)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_bytes = 0
    if isinstance(head, nn.Linear):
        vocab, d = head.weight.shape
        w_elem = head.weight.element_size()
        if plan.chunked_loss:  # the hidden states' and the weight's gradients, and the logits' gradient kept whole
            # or an fp32 sum of the weight's (nn/linear_cross_entropy.py; an fp32 head's sum is its gradient)
            kept = keeps_logits_grad(tokens, d, elem, w_elem == elem)
            head_bytes = (tokens * d * elem + vocab * d * w_elem
                          + (tokens * vocab * elem if kept else vocab * d * 4 if w_elem < 4 else 0))
            # a chunk's logits in the GEMM's dtype, which CUDA's loss kernel turns into their gradient in place
            # (none where the logits' gradient is kept: written there): those of 64 MiB chunks are in the
            # calibration (made with the torch ops' fp32 temporaries too), the 256-token floor's more not
            extra = min(tokens, default_chunk(vocab)) - min(tokens, logits_chunk(vocab))
            head_bytes += 0 if kept else extra * vocab * elem
        else:  # a softcap (Gemma 2's final_logit_softcapping) keeps tanh's output and a temporary of it too
            softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
            head_bytes = tokens * vocab * (elem + 8 + (2 * elem if softcap else 0))
    if plan.step_in_backward:
        transient = activations + head_bytes + min(BUCKET_BYTES, sum(grads)) + max(grads)
    else:
        transient = max(activations + head_bytes, sum(grads))
    return (param_bytes + states + transient) * ALLOCATOR_OVERHEAD
