"""Training-quality check: the small GPT on char-level tinyshakespeare with every eligible linear converted to a
recipe, against the same model in high precision (same seed, data order and steps). Used by the CPU test (a
short run) and by benchmarks/linear.py (a longer run on the GPU). The loop itself is lpoptim.train.loop."""
from __future__ import annotations

import torch

from ..train.data import CharData
from ..train.loop import RunConfig, train


def train_char_gpt(recipe: str | None, steps: int = 200, *, n_layer: int = 2, n_head: int = 2, n_embd: int = 64,
                   block_size: int = 64, batch_size: int = 16, lr: float = 3e-3, seed: int = 0, eval_batches: int = 8,
                   device: str = "cpu", autocast_dtype: torch.dtype | None = None, data: CharData | None = None):
    """Train for ``steps`` and return {"train": mean loss of the last 10% of steps, "val": val loss at the end}.

    recipe None is the high-precision baseline (fp32 on CPU; bf16 autocast when autocast_dtype is given).
    """
    cfg = RunConfig(recipe=recipe, steps=steps, n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                    batch_size=batch_size, lr=lr, seed=seed, eval_batches=eval_batches, device=device,
                    autocast_dtype=autocast_dtype)
    out = train(cfg, data)
    return {"train": out["train"], "val": out["val"]}
