"""Fused multi-tensor AdamW step (placeholder until the kernel lands)."""
def supports(param, grad, layout) -> bool:
    return False


def fused_adamw_step(batch, **kw):
    raise NotImplementedError
