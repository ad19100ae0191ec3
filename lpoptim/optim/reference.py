"""The reference AdamW update for one tensor, in pure torch (CPU and CUDA): what lpoptim.AdamW computes.

The math is torch.optim.AdamW's, in fp32 (decoupled weight decay, bias correction, eps outside the square
root). The moments are dequantized before the update and quantized after it (quant.quantize_state); the
update itself uses the fresh fp32 moments, not their rounded copies. The second moment may be stored as
sqrt(v), which halves its dynamic range in log space. The Triton kernel in kernels/adamw_step.py computes the
same thing in one pass; tests hold it to this function.
"""
from __future__ import annotations

import torch

from ..quant import (adam_bound_inv, dequantize_state, dequantize_state4, quantize_state, quantize_state4,
                     quantize_state4_moments)
from .state import CODES, CODES4, StateLayout, moment_dtype
from .stochastic_round import round_bf16_stochastic, sr_key, uniform_noise

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def load_moment(state: dict, name: str, layout: StateLayout, shape=None) -> torch.Tensor:
    """The moment as fp32 (float64 if so held): for exp_avg_sq and max_exp_avg_sq this is v (squared back if stored
    as sqrt v). 4-bit codes (``<name>_codes4``, whatever the layout says) decode to ``shape`` (the parameter's;
    None: the packed last dim doubled).
    Also reads states saved by lpoptim 0.1 (codes under the moment's own name, the older k grid)."""
    if layout.quantized and name + CODES4 in state:
        codes = state[name + CODES4]
        if shape is None:
            shape = (*codes.shape[:-1], 2 * codes.shape[-1])
        return dequantize_state4(codes, state[name + "_scale"], shape, name != "exp_avg", layout.group_size)
    if layout.quantized:
        legacy = name + CODES not in state
        x = dequantize_state(state[name if legacy else name + CODES], state[name + "_scale"], layout.format_of(name),
                             layout.group_size, legacy=legacy)
    else:
        x = state[name]
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if layout.quantized and name != "exp_avg" and layout.sqrt_v:
        x = x * x
    return x


def encode_moment(name: str, value: torch.Tensor, layout: StateLayout,
                  noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """An fp32 moment (v for the second moments) -> the state entries that hold it (``noise``: 4-bit stochastic
    rounding's uniforms, quant.encode4_groups)."""
    if not layout.quantized:
        return {name: value}
    if layout.state_bits == 4:
        codes, scale = quantize_state4(value, name != "exp_avg", layout.group_size, noise)
        return {name + CODES4: codes, name + "_scale": scale}
    if name != "exp_avg" and layout.sqrt_v:
        value = value.sqrt()
    codes, scale = quantize_state(value, layout.format_of(name), layout.group_size, layout.expansion)
    return {name + CODES: codes, name + "_scale": scale}


def encode_moments(m: torch.Tensor, v: torch.Tensor, layout: StateLayout,
                   noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """fp32 m and v -> the state entries that hold them: encode_moment's, and with 4-bit states v's codes raised
    to the groups' ratio bound of these exact moments (quant.quantize_state4_moments; ``noise``: v's)."""
    if not (layout.quantized and layout.state_bits == 4):
        return {**encode_moment("exp_avg", m, layout), **encode_moment("exp_avg_sq", v, layout)}
    m_codes, m_scale, v_codes, v_scale = quantize_state4_moments(m, v, layout.group_size, noise)
    return {"exp_avg" + CODES4: m_codes, "exp_avg_scale": m_scale,
            "exp_avg_sq" + CODES4: v_codes, "exp_avg_sq_scale": v_scale}


# The most elements the reference steps at once: a larger tensor is stepped a block of whole rows at a time (its
# groups lie along the rows: the same result, bit for bit). Its temporaries take about 60 bytes an element
# (dequantized moments, their groups, float64 quotients), so a 128k-vocabulary embedding of 3072 columns stepped
# whole needed about 24 GB on the CPU; a block of 2^22 elements about 250 MB.
ROWS_BLOCK_ELEMENTS = 1 << 22


def reference_adamw_step(param: torch.Tensor, grad: torch.Tensor, state: dict, layout: StateLayout, *,
                         lr, beta1: float, beta2: float, eps: float, weight_decay: float, amsgrad: bool,
                         maximize: bool, grad_scale: torch.Tensor | None = None,
                         found_inf: torch.Tensor | None = None, sr_salt: int | None = None,
                         state_salt: int = 0, offset: int = 0) -> None:
    """One AdamW step of ``param`` in place (_step_rows, a block of rows at a time where it is large: the state's
    tensors, codes and scales alike, are one row per row of the parameter, so a block's are views of theirs, and
    its element offset draws the roundings' noise as the whole tensor would)."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                 maximize=maximize, grad_scale=grad_scale, found_inf=found_inf, sr_salt=sr_salt,
                 state_salt=state_salt)
    n = param.shape[-1] if param.dim() else 1
    rows = param.numel() // max(n, 1)
    block = max(1, ROWS_BLOCK_ELEMENTS // max(n, 1))
    tensors = [t for k, t in state.items() if k != "step"]
    if (rows <= block or not all(t.is_contiguous() for t in (param, grad, *tensors))
            or any(t.numel() % rows for t in tensors)):
        return _step_rows(param, grad, state, layout, offset=offset, **hyper)
    flat = {k: t.view(rows, -1) for k, t in state.items() if k != "step"}
    step = state["step"]
    for first in range(0, rows, block):
        last = min(first + block, rows)
        part = {k: t[first:last] for k, t in flat.items()}
        part["step"] = step.clone()  # each block advances its own copy from the same count
        _step_rows(param.view(rows, n)[first:last], grad.view(rows, n)[first:last], part, layout,
                   offset=offset + first * n, **hyper)
    step.copy_(part["step"])


def _step_rows(param: torch.Tensor, grad: torch.Tensor, state: dict, layout: StateLayout, *,
               lr, beta1: float, beta2: float, eps: float, weight_decay: float, amsgrad: bool,
               maximize: bool, grad_scale: torch.Tensor | None = None,
               found_inf: torch.Tensor | None = None, sr_salt: int | None = None,
               state_salt: int = 0, offset: int = 0) -> None:
    """One AdamW step of ``param`` in place. ``state`` holds 'step' (fp32, on the device) and the moments.

    ``sr_salt``: round a bf16 parameter stochastically (stochastic_round.py), with this salt in its key.
    ``state_salt``: 4-bit states (layout.state_bits == 4) round v stochastically with this salt in its key
    (stochastic_round.uniform_noise: the top bits of the hash whose low bits round p where sr_salt is the same;
    lpoptim.AdamW passes the parameter's index for both). ``offset``: the
    index of ``param``'s first element in the whole tensor (an FSDP2 shard's), which both roundings' noise is
    drawn by.

    ``grad_scale``/``found_inf`` follow torch's fused AdamW: gradients are divided by grad_scale, and when
    found_inf is non-zero nothing changes, the step count included. No host synchronisation happens here.
    """
    dev = param.device
    acc = moment_dtype(param)
    g = grad.to(acc)
    if grad_scale is not None:
        g = g / grad_scale.to(dev)
    if maximize:
        g = -g
    step = state["step"] + 1
    if isinstance(lr, torch.Tensor):
        # non-blocking only host -> device: a device -> host copy could be read before it lands
        lr = lr.to(device=dev, dtype=acc, non_blocking=dev.type == "cuda")

    p = param.to(acc)
    m = load_moment(state, "exp_avg", layout, param.shape).to(acc)
    v = load_moment(state, "exp_avg_sq", layout, param.shape).to(acc)
    if layout.quantized:  # a decoded v is never below what Adam's own recursion allows beside the decoded m
        # fmax, as the GPU's max: a NaN bound (a NaN m) leaves v as it is
        v = torch.fmax(v, m * m * adam_bound_inv(state["step"], beta1, beta2))
    m = m + (1 - beta1) * (g - m)  # torch's lerp, written out so every backend rounds alike
    v = v * beta2 + (1 - beta2) * g * g
    v_used = v
    if amsgrad:
        v_used = torch.maximum(load_moment(state, "max_exp_avg_sq", layout, param.shape).to(acc), v)
    step_acc = step.to(acc)  # float64 parameters get float64 bias corrections, as torch's Python-float ones
    bias_correction1 = 1 - beta1 ** step_acc
    bias_correction2_sqrt = (1 - beta2 ** step_acc).sqrt()
    denom = v_used.sqrt() / bias_correction2_sqrt + eps
    p_new = p * (1 - lr * weight_decay) - (lr / bias_correction1) * (m / denom)

    noise = None
    if layout.quantized and layout.state_bits == 4:  # v rounded stochastically
        noise = uniform_noise(param.shape, sr_key(step, state_salt), offset)
    entries = {"step": step, **encode_moments(m, v, layout, noise)}  # 4 bits: with the groups' ratio bound
    if amsgrad:  # the running maximum: to nearest
        entries.update(encode_moment("max_exp_avg_sq", v_used, layout))
    if sr_salt is not None and param.dtype == torch.bfloat16:
        p_new = round_bf16_stochastic(p_new, sr_key(step, sr_salt), offset)
    p_new = p_new.to(param.dtype)
    if found_inf is not None:  # skip the whole step without asking the host: keep every old value
        skip = found_inf.to(dev) != 0
        p_new = torch.where(skip, param, p_new)
        entries = {k: torch.where(skip, state[k], e) for k, e in entries.items()}
    param.copy_(p_new)
    for k, e in entries.items():
        state[k].copy_(e)
