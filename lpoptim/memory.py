"""An estimate of a training step's peak memory, for ``lpoptim.prepare``'s budget (``max_memory_gib``).

The static part is exact arithmetic: parameters, lpoptim's states (1 byte per moment and element plus one fp32
scale per 128; fp32 moments for tensors under 4096 elements) and gradients (all of them, or with the step in
backward one 256 MiB bucket and the largest gradient). The activations are a model: per token and block, a
multiple of the bytes of the inputs of the block's linear layers (what those layers save), calibrated on a
Llama-2-7B decoder layer, batch 4 x 2048, one H100 (docs/results/activations_block_h200.json): 2.6 of them eager,
1.75 compiled, x 0.32 with FP8 activations eager and x 0.5 compiled, x 0.7 with FP8 linears compiled; with
recompute, one FP8 block input per block and one block's activations while it is recomputed. The LM head and
loss: about 10 bytes per logit (the logits, their fp32 copy and softmax's gradient), or with the chunked loss the
hidden states' gradient and the head's fp32 weight gradient. Treat it as an estimate within some 10-20%:
``lpoptim bench --hf-config`` measures the real peak.
"""
from __future__ import annotations

import torch.nn as nn

BUCKET_BYTES = 256 * 2**20  # step_in_backward's default bucket
ALPHA = {False: 2.6, True: 1.75}  # saved bytes per token / (linear inputs x element size): eager, compiled
FP8_ACTIVATIONS = {False: 0.32, True: 0.5}
FP8_LINEARS_COMPILED = 0.7


def state_bytes(numel: int, min_quant_numel: int = 4096, group_size: int = 128) -> float:
    """lpoptim.AdamW's state bytes for one parameter of ``numel`` elements (two moments)."""
    if numel < min_quant_numel:
        return 8.0 * numel
    return 2 * (numel + 4 * -(-numel // group_size))


def linear_input_features(block: nn.Module) -> int:
    """The features of the inputs a block's linear layers save, each input once (q, k and v read one tensor)."""
    total, seen_inputs = 0, set()
    for name, mod in block.named_modules():
        if isinstance(mod, nn.Linear):
            parent = name.rpartition(".")[0]
            key = (parent, mod.in_features)  # siblings of one width read the same input (q/k/v, gate/up)
            if key not in seen_inputs:
                seen_inputs.add(key)
                total += mod.in_features
    return total


def estimate_peak_bytes(model: nn.Module, blocks: nn.ModuleList, plan, tokens: int) -> float:
    """Estimated peak bytes of one training step of ``model`` under ``plan`` (a prepare.Plan) at ``tokens`` tokens."""
    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(state_bytes(p.numel()) for p in params)
    grads = [p.numel() * p.element_size() for p in params]
    elem = min(p.element_size() for p in blocks.parameters())
    per_block_token = ALPHA[plan.compile] * linear_input_features(blocks[0]) * elem
    if plan.linears and plan.compile:
        per_block_token *= FP8_LINEARS_COMPILED
    width = max((m.in_features for m in blocks[0].modules() if isinstance(m, nn.Linear)), default=0)
    if plan.activations == "recompute":
        activations = tokens * (len(blocks) * width + per_block_token)
    else:
        factor = FP8_ACTIVATIONS[plan.compile] if plan.activations == "fp8" else 1.0
        activations = tokens * len(blocks) * per_block_token * factor
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_bytes = 0
    if isinstance(head, nn.Linear):
        vocab, d = head.weight.shape
        head_bytes = tokens * d * elem + vocab * d * 4 if plan.chunked_loss else tokens * vocab * (elem + 8)
    if plan.step_in_backward:
        transient = activations + head_bytes + min(BUCKET_BYTES, sum(grads)) + max(grads)
    else:
        transient = max(activations + head_bytes, sum(grads))
    return param_bytes + states + transient
