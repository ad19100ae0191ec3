"""Blocks and gradient helpers shared by the wrapper's tests (test_activations.py, test_graph_hooks.py,
test_fused_replay.py)."""
import torch
import torch.nn.functional as F


def _grads(block, x, kwargs, params_of=None):
    """Input and parameter gradients (fp32) of a fixed loss on ``block(x, **kwargs)``."""
    x = x.detach().requires_grad_(True)
    params_of = params_of or block
    params_of.zero_grad(set_to_none=True)
    y = block(x, **kwargs)
    y = y[0] if isinstance(y, tuple) else y
    w = torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype, device=y.device)
    (y.float() * w.float()).pow(2).sum().backward()
    return {"input": x.grad.float()} | {n: p.grad.float() for n, p in params_of.named_parameters()}


def _min_cos(a, b):
    """The smallest cosine similarity over the gradients of two ``_grads`` results."""
    return min(F.cosine_similarity(a[k].flatten(), b[k].flatten(), dim=0).item() for k in a)


def _tiny_llama(dtype=torch.float32, device="cpu"):
    """A one-layer lpoptim Llama block (d 128, 4 heads, 2 KV heads) and its rotary tables for 32 positions."""
    from lpoptim.train.llama import Block, LlamaConfig, rotary_tables

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, n_layer=1, d_model=128, ffn_dim=352, n_head=4, n_kv_head=2)
    cos, sin = rotary_tables(cfg, 32, device)
    return Block(cfg).to(device=device, dtype=dtype), (cos, sin)
