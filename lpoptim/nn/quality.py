"""Training-quality check: the small GPT on char-level tinyshakespeare, with every eligible linear converted to a
recipe, against the same model in high precision (same seed, data order and steps). Used by the CPU test (a
short run) and by benchmarks/linear.py (a longer run on the GPU)."""
from __future__ import annotations

import math

import torch

from ..train.data import CharData
from ..train.gpt import GPT, GPTConfig
from .convert import convert_linears


def train_char_gpt(recipe: str | None, steps: int = 200, *, n_layer: int = 2, n_head: int = 2, n_embd: int = 64,
                   block_size: int = 64, batch_size: int = 16, lr: float = 3e-3, seed: int = 0, eval_batches: int = 8,
                   device: str = "cpu", autocast_dtype: torch.dtype | None = None, data: CharData | None = None):
    """Train for ``steps`` and return {"train": mean loss of the last 10% of steps, "val": val loss at the end}.

    recipe None is the high-precision baseline (fp32 on CPU; bf16 autocast when autocast_dtype is given).
    """
    data = data or CharData(device=device)
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd)
    model = GPT(cfg).to(device)
    if recipe is not None:
        convert_linears(model, recipe)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=lr, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20)
    tail = []
    for it in range(steps):
        for group in opt.param_groups:  # linear warm-up, cosine to lr/10
            p = min(1.0, (it + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * it / steps)))
            group["lr"] = lr * p
        x, y = data.batch("train", batch_size, block_size, gen)
        with torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if it >= steps - max(1, steps // 10):
            tail.append(loss.item())
    model.eval()
    egen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad(), torch.autocast(device, dtype=autocast_dtype or torch.bfloat16,
                                         enabled=autocast_dtype is not None):
        val = sum(model(*data.batch("val", batch_size, block_size, egen))[1].item() for _ in range(eval_batches))
    return {"train": sum(tail) / len(tail), "val": val / eval_batches}
