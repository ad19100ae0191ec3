"""A Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention, untied LM head).

Random init, no downloads: ``lpoptim bench`` builds it at the shapes of real models to measure memory and speed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .param_groups import decay_groups


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    n_layer: int = 22
    d_model: int = 2048
    ffn_dim: int = 5632
    n_head: int = 32
    n_kv_head: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


PRESETS = {
    "tiny": LlamaConfig(vocab_size=512, n_layer=2, d_model=128, ffn_dim=384, n_head=4, n_kv_head=2),
    "tinyllama-1.1b": LlamaConfig(vocab_size=32000, n_layer=22, d_model=2048, ffn_dim=5632, n_head=32, n_kv_head=4),
    "llama2-7b": LlamaConfig(vocab_size=32000, n_layer=32, d_model=4096, ffn_dim=11008, n_head=32, n_kv_head=32),
    "llama2-13b": LlamaConfig(vocab_size=32000, n_layer=40, d_model=5120, ffn_dim=13824, n_head=40, n_kv_head=40),
    # LLaMA-1 30B's widths (32.5 B parameters at 60 layers); `lpoptim bench --n-layer` trims it to what fits
    "llama-30b": LlamaConfig(vocab_size=32000, n_layer=60, d_model=6656, ffn_dim=17920, n_head=52, n_kv_head=52),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight.type_as(x)


def rotary_tables(cfg: LlamaConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim // 2): constants, computed once per forward outside the blocks."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate pairs (first half, second half) of each head's features; x is (batch, heads, seq, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied, as Llama
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        # True: head and loss computed chunk by chunk (lpoptim.nn.linear_cross_entropy), logits never whole
        self.chunked_loss = False

    def forward(self, idx, targets=None):
        cos, sin = rotary_tables(self.cfg, idx.shape[1], idx.device)
        x = self.embed(idx)
        for block in self.layers:
            x = block(x, cos, sin)
        if targets is not None and self.chunked_loss and type(self.lm_head) is nn.Linear:
            from ..nn.linear_cross_entropy import linear_cross_entropy

            return None, linear_cross_entropy(self.norm(x), self.lm_head.weight, targets)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def param_groups(self, weight_decay: float):
        return decay_groups(self, weight_decay)
