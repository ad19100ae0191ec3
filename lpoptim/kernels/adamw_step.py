"""The fused multi-tensor AdamW step: one pass over memory for every quantized parameter of a batch.

Each program takes BLOCK_G consecutive quantization groups of one tensor. It reads the parameter, the gradient,
the FP8 codes and group scales of m and v once, dequantizes (undoing the range expansion), applies the AdamW
update in fp32, finds the new group statistics, re-expands, rounds onto the FP8 grid and writes parameter,
codes and scales once. Tensors are reached through a table of addresses, so a whole batch (all parameters of
one dtype and layout) is one launch; the table and the program->tensor map are cached and rebuilt only when
an address or a shape changes. Step counts and bias corrections stay on the device: no host sync, and the
step can be captured in a CUDA graph.

The arithmetic is the reference's (optim/reference.py, quant.encode_groups/decode_groups) operation for
operation; tests hold the two together.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from .grid import div, fp8_bits, fp8_value, grid_magnitude, sqrt, store_as, with_sign_of
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency, but keep the reference usable without it
    HAVE_TRITON = False

from ..formats import get_format
from ..quant import inv_max

# columns of the address table
P_PARAM, P_GRAD, P_M, P_MS, P_V, P_VS, P_VMAX, P_VMAXS = range(8)
N_PTRS = 8
_TL_DTYPES = {}


def supports(param: torch.Tensor, grad: torch.Tensor, layout) -> bool:
    """Whether the kernel can step this tensor (else the reference does). lpoptim.AdamW also asks for CUDA;
    under TRITON_INTERPRET=1 the tests run the kernel on CPU tensors."""
    g = layout.group_size
    return (HAVE_TRITON and g >= 16 and g & (g - 1) == 0
            and param.is_contiguous() and grad.is_contiguous() and grad.dtype == param.dtype
            and param.dtype in (torch.float32, torch.bfloat16, torch.float16))


if HAVE_TRITON:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _decode(codes_ptr, scale_ptr, offs, gidx, mask, gmask, IS_E4M3: tl.constexpr, INV_MAX: tl.constexpr,
                QUANT: tl.constexpr, EXACT: tl.constexpr):
        if not QUANT:  # small tensors keep plain fp32 moments
            return tl.load(codes_ptr.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
        q = fp8_value(tl.load(codes_ptr + offs, mask=mask, other=0), IS_E4M3)
        c = tl.load(scale_ptr + gidx, mask=gmask, other=0.0)
        log2k = c.to(tl.int32, bitcast=True) & 3
        t = tl.abs(q) * INV_MAX
        lk = log2k[:, None]
        t = tl.where(lk > 0, sqrt(t, EXACT), t)
        t = tl.where(lk > 1, sqrt(t, EXACT), t)
        t = tl.where(lk > 2, sqrt(t, EXACT), t)
        return with_sign_of(t * c[:, None], q)

    @triton.jit
    def _encode(x, codes_ptr, scale_ptr, offs, gidx, mask, gmask, EXPANSION: tl.constexpr, IS_E4M3: tl.constexpr,
                MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr, FMIN_NORMAL: tl.constexpr,
                QUANT: tl.constexpr, EXACT: tl.constexpr):
        if not QUANT:
            tl.store(codes_ptr.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)
            return
        a = tl.abs(x)
        finite = (x == x) & (a != float("inf")) & mask
        amax = tl.max(tl.where(finite, a, 0.0), axis=1)
        amin = tl.min(tl.where(finite & (a > 0), a, float("inf")), axis=1)
        log2k = tl.zeros_like(amax).to(tl.int32)
        if EXPANSION:
            ratio = tl.where((amax > 0) & (amin != float("inf")), div(amin, tl.where(amax > 0, amax, 1.0), EXACT), 0.0)
            t = ratio * ratio
            log2k = tl.where(t * FMAX >= FMIN_NORMAL, 1, log2k)
            t = t * t
            log2k = tl.where(t * FMAX >= FMIN_NORMAL, 2, log2k)
            t = t * t
            log2k = tl.where(t * FMAX >= FMIN_NORMAL, 3, log2k)
        c = ((amax.to(tl.int32, bitcast=True) & -4) | log2k).to(tl.float32, bitcast=True)
        c = tl.where(amax > 0, c, 0.0)
        tl.store(scale_ptr + gidx, c, mask=gmask)
        safe_c = tl.where(c > 0, c, 1.0)
        t = tl.minimum(div(a, safe_c[:, None], EXACT), 1.0)
        lk = log2k[:, None]
        t = tl.where(lk > 0, t * t, t)
        t = tl.where(lk > 1, t * t, t)
        t = tl.where(lk > 2, t * t, t)
        f = t * FMAX
        q = with_sign_of(grid_magnitude(tl.where(finite, f, 0.0), MAN_BITS, MIN_EXP, FMAX), x)
        q = tl.where(finite | (mask == 0), q, float("nan"))
        tl.store(codes_ptr + offs, fp8_bits(q, IS_E4M3), mask=mask)

    @triton.jit
    def _adamw_kernel(
        ptrs, dims, blocks, step_size_ptr, bc2_sqrt_ptr, decay_ptr, grad_scale_ptr, found_inf_ptr,
        decay, one_minus_beta1, beta2, one_minus_beta2, eps,
        PARAM_DTYPE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
        M_E4M3: tl.constexpr, M_MAN: tl.constexpr, M_MINEXP: tl.constexpr, M_MAX: tl.constexpr, M_MINN: tl.constexpr,
        M_INV: tl.constexpr,
        V_E4M3: tl.constexpr, V_MAN: tl.constexpr, V_MINEXP: tl.constexpr, V_MAX: tl.constexpr, V_MINN: tl.constexpr,
        V_INV: tl.constexpr,
        QUANT: tl.constexpr, EXPANSION: tl.constexpr, SQRT_V: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
        DECAY_IS_PTR: tl.constexpr, EXACT: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if HAS_FOUND_INF:
            if tl.load(found_inf_ptr) != 0:
                return
        tensor = tl.load(blocks + 2 * pid)
        first_group = tl.load(blocks + 2 * pid + 1).to(tl.int64)
        n = tl.load(dims + 3 * tensor).to(tl.int64)  # row length
        groups_per_row = tl.load(dims + 3 * tensor + 1).to(tl.int64)
        total_groups = tl.load(dims + 3 * tensor + 2).to(tl.int64)
        row_ptrs = ptrs + N_PTRS_C * tensor
        p_ptr = tl.load(row_ptrs + 0).to(tl.pointer_type(PARAM_DTYPE))
        g_ptr = tl.load(row_ptrs + 1).to(tl.pointer_type(PARAM_DTYPE))
        m_ptr = tl.load(row_ptrs + 2).to(tl.pointer_type(tl.uint8))
        ms_ptr = tl.load(row_ptrs + 3).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row_ptrs + 4).to(tl.pointer_type(tl.uint8))
        vs_ptr = tl.load(row_ptrs + 5).to(tl.pointer_type(tl.float32))

        gidx = first_group + tl.arange(0, BLOCK_G)  # (BLOCK_G,) group numbers within the tensor
        gmask = gidx < total_groups
        row = gidx // groups_per_row
        col = (gidx % groups_per_row)[:, None] * G + tl.arange(0, G)[None, :]
        mask = gmask[:, None] & (col < n)
        offs = row[:, None] * n + col

        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GRAD_SCALE:
            g = div(g, tl.load(grad_scale_ptr), EXACT)
        if MAXIMIZE:
            g = -g
        if DECAY_IS_PTR:  # 1 - lr * weight_decay, computed on the device for a Tensor lr
            decay = tl.load(decay_ptr)
        step_size = tl.load(step_size_ptr + tensor)  # lr / (1 - beta1^t), computed on the device
        bc2_sqrt = tl.load(bc2_sqrt_ptr + tensor)

        m = _decode(m_ptr, ms_ptr, offs, gidx, mask, gmask, M_E4M3, M_INV, QUANT, EXACT)
        v = _decode(v_ptr, vs_ptr, offs, gidx, mask, gmask, V_E4M3, V_INV, QUANT, EXACT)
        if SQRT_V and QUANT:
            v = v * v
        m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights below 0.5
        v = v * beta2 + one_minus_beta2 * g * g
        v_used = v
        if AMSGRAD:
            vm_ptr = tl.load(row_ptrs + 6).to(tl.pointer_type(tl.uint8))
            vms_ptr = tl.load(row_ptrs + 7).to(tl.pointer_type(tl.float32))
            v_max = _decode(vm_ptr, vms_ptr, offs, gidx, mask, gmask, V_E4M3, V_INV, QUANT, EXACT)
            if SQRT_V and QUANT:
                v_max = v_max * v_max
            v_used = tl.maximum(v_max, v)
        denom = div(sqrt(v_used, EXACT), bc2_sqrt, EXACT) + eps
        p = p * decay - step_size * div(m, denom, EXACT)
        store_as(p_ptr + offs, p, mask, PARAM_DTYPE)

        _encode(m, m_ptr, ms_ptr, offs, gidx, mask, gmask, EXPANSION, M_E4M3, M_MAN, M_MINEXP, M_MAX, M_MINN, QUANT, EXACT)
        if SQRT_V and QUANT:
            v = sqrt(v, EXACT)
        _encode(v, v_ptr, vs_ptr, offs, gidx, mask, gmask, EXPANSION, V_E4M3, V_MAN, V_MINEXP, V_MAX, V_MINN, QUANT, EXACT)
        if AMSGRAD:
            if SQRT_V and QUANT:
                v_used = sqrt(v_used, EXACT)
            _encode(v_used, vm_ptr, vms_ptr, offs, gidx, mask, gmask, EXPANSION, V_E4M3, V_MAN, V_MINEXP, V_MAX, V_MINN, QUANT, EXACT)

    N_PTRS_C = tl.constexpr(N_PTRS)


class _Plan:
    """The cached tables of one batch: addresses (rebuilt when one changes) and the program->tensor map."""

    def __init__(self):
        self.key = None
        self.addr_key = None
        self.ptrs = self.dims = self.blocks = None


_plans: dict = {}


# Launch settings, measured on an H200 with benchmarks/optim_kernel.py. ``exact`` selects IEEE division and
# square root (what torch computes) over the faster approximate ones.
TUNING = dict(block_elems=2048, num_warps=8, exact=True)


def _block_groups(group_size: int) -> int:
    return max(1, TUNING["block_elems"] // group_size)


def _tables(batch, layout, block_g: int):
    dev = batch[0][0].device
    key = (dev, layout, block_g, tuple(p.shape for p, *_ in batch))
    plan = _plans.setdefault(key, _Plan())
    if plan.dims is None:
        dims, blocks = [], []
        for t, (p, _g, _s, _l) in enumerate(batch):
            n = p.shape[-1] if p.dim() else 1
            rows = p.numel() // n
            gpr = -(-n // layout.group_size)
            dims.append((n, gpr, rows * gpr))
            blocks += [(t, b) for b in range(0, rows * gpr, block_g)]
        plan.dims = torch.tensor(dims, dtype=torch.int64).to(dev)
        plan.blocks = torch.tensor(blocks, dtype=torch.int32).to(dev)
        plan.n_blocks = len(blocks)
    addrs = []
    for p, g, s, _l in batch:
        row = [p.data_ptr(), g.data_ptr()]
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            row += [s[name].data_ptr() if name in s else 0,
                    s[name + "_scale"].data_ptr() if name + "_scale" in s else 0]
        addrs.append(row)
    addr_key = tuple(map(tuple, addrs))
    if addr_key != plan.addr_key:
        plan.ptrs = torch.tensor(addrs, dtype=torch.int64).to(dev)
        plan.addr_key = addr_key
    return plan


def _format_args(name: str, prefix: str) -> dict:
    fmt = get_format(name)
    return {f"{prefix}_E4M3": fmt.name == "e4m3", f"{prefix}_MAN": fmt.man_bits, f"{prefix}_MINEXP": fmt.min_normal_exp,
            f"{prefix}_MAX": fmt.max, f"{prefix}_MINN": fmt.min_normal, f"{prefix}_INV": inv_max(fmt)}


def fused_adamw_step(batch, *, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale=None, found_inf=None):
    """Steps every (param, grad, state, layout) of ``batch``: one launch per (device, dtype, layout) subset."""
    subsets: dict = {}
    for item in batch:
        p, _g, _s, layout = item
        subsets.setdefault((p.device, p.dtype, layout), []).append(item)
    for (dev, dtype, layout), items in subsets.items():
        _launch(items, dev, dtype, layout, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)


def _launch(items, dev, dtype, layout, *, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale, found_inf):
    block_g = _block_groups(layout.group_size)
    plan = _tables(items, layout, block_g)
    steps = [s["step"] for _p, _g, s, _l in items]
    # step counts and bias corrections on the device, with the reference's torch arithmetic (no host sync)
    torch._foreach_add_(steps, 1)
    if found_inf is not None:
        found_inf = found_inf.to(dev, torch.float32)
        torch._foreach_sub_(steps, [found_inf] * len(steps))
    step_t = torch.stack(steps)
    lr_is_tensor = isinstance(lr, torch.Tensor)
    lr_t = lr.to(dev, torch.float32) if lr_is_tensor else lr
    step_size = (lr_t / (1 - beta1 ** step_t)).float().contiguous()
    bc2_sqrt = (1 - beta2 ** step_t).sqrt().contiguous()
    decay = (1 - lr_t * weight_decay).reshape(1).contiguous() if lr_is_tensor else 1 - lr * weight_decay
    dummy = step_t
    _adamw_kernel[(plan.n_blocks,)](
        plan.ptrs, plan.dims, plan.blocks, step_size, bc2_sqrt, decay if lr_is_tensor else dummy,
        grad_scale.to(dev, torch.float32) if grad_scale is not None else dummy,
        found_inf if found_inf is not None else dummy,
        0.0 if lr_is_tensor else decay, 1 - beta1, beta2, 1 - beta2, eps,
        PARAM_DTYPE=_TL_DTYPES[dtype], G=layout.group_size, BLOCK_G=block_g,
        **_format_args(layout.exp_avg_format, "M"), **_format_args(layout.exp_avg_sq_format, "V"),
        QUANT=layout.quantized, EXPANSION=layout.expansion, SQRT_V=layout.sqrt_v, AMSGRAD=amsgrad, MAXIMIZE=maximize,
        DECAY_IS_PTR=lr_is_tensor, EXACT=TUNING["exact"], HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        num_warps=TUNING["num_warps"], enable_fp_fusion=False,  # no fused multiply-adds: round as the reference does
    )
