"""One training run of the small GPT on character-level text, with any lpoptim feature switched on.

Every quality check in the project (tests, benchmarks, ``lpoptim train``) runs this loop, so "the same seed, data
and schedule" holds by construction: the model's init, the batch order and the validation batches depend on the
seed alone, never on the optimizer or recipe under test.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from .data import CharData
from .gpt import GPT, GPTConfig


@dataclass
class RunConfig:
    optimizer: str = "torch"  # "torch" (torch.optim.AdamW) or "lpoptim" (lpoptim.AdamW)
    recipe: str | None = None  # convert_linears recipe: None, "fp8", "fp4", "int4"
    compress: bool = False  # compress_activations on every block
    attention: bool = False  # with compress: attention's saved tensors in FP8 too (attention="fp8")
    master: str = "fp32"  # "bf16": the parameters are bf16 (no fp32 copy); lpoptim then rounds stochastically
    steps: int = 200
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 64
    batch_size: int = 16
    dropout: float = 0.0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None  # default: 5% of the steps
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    device: str = "cpu"
    autocast_dtype: torch.dtype | None = None  # bf16 autocast on the GPU; None: full fp32
    compile: bool = False  # each block compiled (torch.compile): the same arithmetic, fewer launches
    optimizer_options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        parts = ["lpoptim.AdamW" if self.optimizer == "lpoptim" else "torch AdamW"]
        if self.optimizer_options.get("state_bits") == 4:
            parts[0] += " 4-bit states"
        if self.recipe:
            parts.append(f"{self.recipe} linears")
        if self.compress:
            parts.append("FP8 activations" + (" (attention's too)" if self.attention else ""))
        if self.master == "bf16":
            parts.append("bf16 params" + (" (SR)" if self.optimizer == "lpoptim" else ""))
        return " + ".join(parts)


def lr_at(cfg: RunConfig, it: int) -> float:
    """Linear warm-up, then cosine from lr to lr * min_lr_ratio (nanoGPT's schedule)."""
    warmup = cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 20)
    if it < warmup:
        return cfg.lr * (it + 1) / warmup
    progress = (it - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(cfg: RunConfig, model: GPT) -> torch.optim.Optimizer:
    groups = model.param_groups(cfg.weight_decay)
    if cfg.optimizer == "lpoptim":
        from ..optim import AdamW

        options = dict(cfg.optimizer_options)
        if cfg.master == "bf16":
            options.setdefault("bf16_stochastic_round", True)
        return AdamW(groups, lr=cfg.lr, betas=cfg.betas, **options)
    if cfg.optimizer == "torch":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, **cfg.optimizer_options)
    raise ValueError(f"optimizer must be 'torch' or 'lpoptim', got {cfg.optimizer!r}")


@torch.no_grad()
def evaluate(model: GPT, data: CharData, cfg: RunConfig) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # the same validation batches for every run
    total = 0.0
    for _ in range(cfg.eval_batches):
        x, y = data.batch("val", cfg.batch_size, cfg.block_size, gen)
        with torch.autocast(x.device.type, dtype=cfg.autocast_dtype or torch.bfloat16, enabled=cfg.autocast_dtype is not None):
            total += model(x, y)[1].item()
    model.train()
    return total / cfg.eval_batches


def train(cfg: RunConfig, data: CharData | None = None, progress=None) -> dict:
    """Train and return losses: 'train' (mean of the last 10% of steps), 'val' (at the end), 'curve' (per step),
    'val_curve' [(step, val)], 'state_bytes' (lpoptim.state_bytes of the optimizer), 'seconds'."""
    from ..optim import state_bytes

    data = data or CharData(device=cfg.device)
    torch.manual_seed(cfg.seed)
    model_cfg = GPTConfig(vocab_size=data.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout)
    model = GPT(model_cfg).to(cfg.device)
    if cfg.master == "bf16":
        model.to(torch.bfloat16)
    elif cfg.master != "fp32":
        raise ValueError(f"master must be 'fp32' or 'bf16', got {cfg.master!r}")
    if cfg.recipe:
        from ..nn import convert_linears

        convert_linears(model, cfg.recipe)
    if cfg.compress:  # compiled, the wrapper calls each block's compiled forward (no graph break per call)
        from ..activations import compress_activations

        compress_activations(model.layers, compile=cfg.compile, attention="fp8" if cfg.attention else "keep")
    elif cfg.compile:
        for block in model.layers:
            block.compile()
    opt = build_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(cfg.seed)
    curve, val_curve = [], []
    start = time.perf_counter()
    for it in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, it)
        x, y = data.batch("train", cfg.batch_size, cfg.block_size, gen)
        with torch.autocast(x.device.type, dtype=cfg.autocast_dtype or torch.bfloat16, enabled=cfg.autocast_dtype is not None):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        curve.append(loss.detach())  # read back once at the end: no host sync per step
        if cfg.eval_every and (it + 1) % cfg.eval_every == 0 and it + 1 < cfg.steps:
            val_curve.append((it + 1, evaluate(model, data, cfg)))
        if progress is not None and ((it + 1) % max(1, cfg.steps // 50) == 0 or it + 1 == cfg.steps):
            progress(it + 1, cfg.steps, curve[-1].item())
    curve = torch.stack(curve).float().tolist()
    val = evaluate(model, data, cfg)
    val_curve.append((cfg.steps, val))
    tail = curve[-max(1, cfg.steps // 10):]
    return dict(label=cfg.label, config={k: v for k, v in asdict(cfg).items() if k != "autocast_dtype"},
                train=sum(tail) / len(tail), val=val, curve=curve, val_curve=val_curve,
                state_bytes=state_bytes(opt), seconds=time.perf_counter() - start)
