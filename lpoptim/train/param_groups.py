"""nanoGPT's split of parameters for AdamW: weight decay on matrices (dim >= 2), none on norms and biases."""
from __future__ import annotations

import torch


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
