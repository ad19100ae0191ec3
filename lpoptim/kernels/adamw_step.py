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

import os

import torch

try:
    import triton
    import triton.language as tl

    from .grid import fast_div, fast_exp2, fast_log2, fp8_bits, fp8_value, grid_magnitude, store_as, with_sign_of
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
            and param.dtype in (torch.float32, torch.bfloat16, torch.float16) and param.numel() < 2**31)


if HAVE_TRITON:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _root_2k(t, log2k, ON_GPU: tl.constexpr):
        """t ** (1 / 2**log2k): one lg2 and one ex2 instead of up to three IEEE square roots (the reference's);
        they agree to a few fp32 ulps, far inside an FP8 step."""
        inv_k = tl.where(log2k == 1, 0.5, tl.where(log2k == 2, 0.25, 0.125))
        return tl.where(log2k > 0, fast_exp2(fast_log2(t, ON_GPU) * inv_k, ON_GPU), t)

    @triton.jit
    def _pow_2k(t, log2k, ON_GPU: tl.constexpr):
        k = tl.where(log2k == 1, 2.0, tl.where(log2k == 2, 4.0, 8.0))
        return tl.where(log2k > 0, fast_exp2(fast_log2(t, ON_GPU) * k, ON_GPU), t)

    @triton.jit
    def _decode(codes_ptr, scale_ptr, offs, mask, gid, gmask, IS_E4M3: tl.constexpr, INV_MAX: tl.constexpr,
                QUANT: tl.constexpr, ON_GPU: tl.constexpr):
        """Moment values of a [BLOCK_G, G] tile; gid/gmask are [BLOCK_G, 1] (one scale per row of the tile)."""
        if not QUANT:  # small tensors keep plain fp32 moments
            return tl.load(codes_ptr.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
        q = fp8_value(tl.load(codes_ptr + offs, mask=mask, other=0), IS_E4M3)
        c = tl.load(scale_ptr + gid, mask=gmask, other=0.0)
        t = _root_2k(tl.abs(q) * INV_MAX, c.to(tl.int32, bitcast=True) & 3, ON_GPU)
        return with_sign_of(t * c, q)

    @triton.jit
    def _encode(x, codes_ptr, scale_ptr, offs, mask, gid, gmask, EXPANSION: tl.constexpr, IS_E4M3: tl.constexpr,
                MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr, FMIN_NORMAL: tl.constexpr,
                QUANT: tl.constexpr, ON_GPU: tl.constexpr):
        if not QUANT:
            tl.store(codes_ptr.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)
            return
        a = tl.abs(x)
        finite = (a < float("inf")) & mask  # NaN compares false
        amax = tl.max(tl.where(finite, a, 0.0), axis=1, keep_dims=True)
        amin = tl.min(tl.where(finite & (a > 0), a, float("inf")), axis=1, keep_dims=True)
        log2k = tl.zeros_like(amax).to(tl.int32)
        if EXPANSION:
            ratio = tl.where((amax > 0) & (amin < float("inf")), tl.div_rn(amin, tl.where(amax > 0, amax, 1.0)), 0.0)
            t = ratio * ratio
            log2k = tl.where(t * FMAX >= FMIN_NORMAL, 1, log2k)
            t = t * t
            log2k = tl.where(t * FMAX >= FMIN_NORMAL, 2, log2k)
            t = t * t
            log2k = tl.where(t * FMAX >= FMIN_NORMAL, 3, log2k)
        c = ((amax.to(tl.int32, bitcast=True) & -4) | log2k).to(tl.float32, bitcast=True)
        c = tl.where(amax > 0, c, 0.0)
        tl.store(scale_ptr + gid, c, mask=gmask)
        inv_c = tl.div_rn(1.0, tl.where(c > 0, c, 1.0))  # once per group, as the reference
        f = _pow_2k(tl.minimum(a * inv_c, 1.0), log2k, ON_GPU) * FMAX
        f = tl.where(finite, f, 0.0)
        if ON_GPU:  # the GPU's cvt.rn.satfinite rounds to nearest even onto the grid: the same as grid_magnitude
            mag = fp8_bits(f, IS_E4M3)
        else:
            mag = fp8_bits(grid_magnitude(f, MAN_BITS, MIN_EXP, FMAX), IS_E4M3)
        sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
        nan_code: tl.constexpr = 0x7F if IS_E4M3 else 0x7E
        codes = tl.where(finite | (mask == 0), mag | sign, nan_code)
        tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=mask)

    @triton.jit
    def _adamw_kernel(
        ptrs, dims, blocks, step_size_ptr, bc2_sqrt_ptr, decay_ptr, grad_scale_ptr, found_inf_ptr,
        decay, one_minus_beta1, beta2, one_minus_beta2, eps,
        PARAM_DTYPE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
        M_E4M3: tl.constexpr, M_MAN: tl.constexpr, M_MINEXP: tl.constexpr, M_MAX: tl.constexpr, M_MINN: tl.constexpr,
        M_INV: tl.constexpr,
        V_E4M3: tl.constexpr, V_MAN: tl.constexpr, V_MINEXP: tl.constexpr, V_MAX: tl.constexpr, V_MINN: tl.constexpr,
        V_INV: tl.constexpr,
        QUANT: tl.constexpr, EXPANSION: tl.constexpr, SQRT_V: tl.constexpr, AMSGRAD: tl.constexpr,
        MAXIMIZE: tl.constexpr, DECAY_IS_PTR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr, EVEN_ROWS: tl.constexpr, ON_GPU: tl.constexpr, LOOP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if HAS_FOUND_INF:
            if tl.load(found_inf_ptr) != 0:
                return
        tensor = tl.load(blocks + 2 * pid)
        first_group = tl.load(blocks + 2 * pid + 1)
        n = tl.load(dims + 3 * tensor)  # row length
        groups_per_row = tl.load(dims + 3 * tensor + 1)
        total_groups = tl.load(dims + 3 * tensor + 2)
        row_ptrs = ptrs + N_PTRS_C * tensor
        p_ptr = tl.load(row_ptrs + 0).to(tl.pointer_type(PARAM_DTYPE))
        g_ptr = tl.load(row_ptrs + 1).to(tl.pointer_type(PARAM_DTYPE))
        m_ptr = tl.load(row_ptrs + 2).to(tl.pointer_type(tl.uint8))
        ms_ptr = tl.load(row_ptrs + 3).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row_ptrs + 4).to(tl.pointer_type(tl.uint8))
        vs_ptr = tl.load(row_ptrs + 5).to(tl.pointer_type(tl.float32))

        step_size = tl.load(step_size_ptr + tensor)  # lr / (1 - beta1^t), computed on the device
        bc2_sqrt = tl.load(bc2_sqrt_ptr + tensor)
        if DECAY_IS_PTR:  # 1 - lr * weight_decay, computed on the device for a Tensor lr
            decay = tl.load(decay_ptr)
        if AMSGRAD:
            vm_ptr = tl.load(row_ptrs + 6).to(tl.pointer_type(tl.uint8))
            vms_ptr = tl.load(row_ptrs + 7).to(tl.pointer_type(tl.float32))
        else:
            vm_ptr = m_ptr
            vms_ptr = ms_ptr
        for j in tl.range(0, LOOP):  # LOOP tiles of BLOCK_G groups per program
            # a [BLOCK_G, G] tile: one quantization group per row; per-group values are [BLOCK_G, 1]
            gid = first_group + j * BLOCK_G + tl.arange(0, BLOCK_G)[:, None]
            gmask = gid < total_groups
            lane = tl.arange(0, G)[None, :]
            if EVEN_ROWS:  # rows are whole groups: the groups lie end to end
                offs = gid * G + lane
                mask = gmask & (lane < G)
            else:  # the last group of each row is short
                row = gid // groups_per_row
                col = (gid - row * groups_per_row) * G + lane
                offs = row * n + col
                mask = gmask & (col < n)

            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_GRAD_SCALE:
                g = fast_div(g, tl.load(grad_scale_ptr))
            if MAXIMIZE:
                g = -g

            m = _decode(m_ptr, ms_ptr, offs, mask, gid, gmask, M_E4M3, M_INV, QUANT, ON_GPU)
            v = _decode(v_ptr, vs_ptr, offs, mask, gid, gmask, V_E4M3, V_INV, QUANT, ON_GPU)
            if SQRT_V and QUANT:
                v = v * v
            m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights below 0.5
            v = v * beta2 + one_minus_beta2 * g * g
            sqrt_v = tl.sqrt(v)
            sqrt_v_used = sqrt_v
            if AMSGRAD:
                v_max = _decode(vm_ptr, vms_ptr, offs, mask, gid, gmask, V_E4M3, V_INV, QUANT, ON_GPU)
                if SQRT_V and QUANT:
                    sqrt_v_used = tl.maximum(v_max, sqrt_v)
                    v_max = sqrt_v_used
                else:
                    v_max = tl.maximum(v_max, v)
                    sqrt_v_used = tl.sqrt(v_max)
            denom = fast_div(sqrt_v_used, bc2_sqrt) + eps
            p = p * decay - step_size * fast_div(m, denom)
            store_as(p_ptr + offs, p, mask, PARAM_DTYPE)

            _encode(m, m_ptr, ms_ptr, offs, mask, gid, gmask, EXPANSION, M_E4M3, M_MAN, M_MINEXP, M_MAX, M_MINN, QUANT,
                    ON_GPU)
            if SQRT_V and QUANT:
                v = sqrt_v
            _encode(v, v_ptr, vs_ptr, offs, mask, gid, gmask, EXPANSION, V_E4M3, V_MAN, V_MINEXP, V_MAX, V_MINN, QUANT,
                    ON_GPU)
            if AMSGRAD:
                _encode(v_max, vm_ptr, vms_ptr, offs, mask, gid, gmask, EXPANSION, V_E4M3, V_MAN, V_MINEXP, V_MAX, V_MINN,
                        QUANT, ON_GPU)

    N_PTRS_C = tl.constexpr(N_PTRS)


class _Plan:
    """The cached tables of one batch: addresses (rebuilt when one changes) and the program->tensor map."""

    def __init__(self):
        self.addr_key = None
        self.ptrs = self.dims = self.blocks = None
        self.n_blocks = 0


_plans: dict = {}

# Launch settings, measured on an H200 with benchmarks/optim_kernel.py: groups per program and warps.
TUNING = dict(block_groups=1, num_warps=1, loop=8)


def _tables(batch, layout, block_g: int) -> _Plan:
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
        plan.dims = torch.tensor(dims, dtype=torch.int32).to(dev)
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
    if addr_key != plan.addr_key:  # only when an address changed (set_to_none grads usually come back in place)
        plan.ptrs = torch.tensor(addrs, dtype=torch.int64).to(dev)
        plan.addr_key = addr_key
    return plan


def _format_args(name: str, prefix: str) -> dict:
    fmt = get_format(name)
    return {f"{prefix}_E4M3": fmt.name == "e4m3", f"{prefix}_MAN": fmt.man_bits, f"{prefix}_MINEXP": fmt.min_normal_exp,
            f"{prefix}_MAX": fmt.max, f"{prefix}_MINN": fmt.min_normal, f"{prefix}_INV": inv_max(fmt)}


def fused_adamw_step(batch, *, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale=None, found_inf=None):
    """Steps every (param, grad, state, layout) of ``batch``: one launch per (device, dtype, layout, rows) subset."""
    subsets: dict = {}
    for item in batch:
        p, _g, _s, layout = item
        even = (p.shape[-1] if p.dim() else 1) % layout.group_size == 0
        subsets.setdefault((p.device, p.dtype, layout, even), []).append(item)
    for (dev, dtype, layout, even), items in subsets.items():
        _launch(items, dev, dtype, layout, even, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)


def _launch(items, dev, dtype, layout, even, *, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale,
            found_inf):
    block_g, loop = TUNING["block_groups"], TUNING["loop"]
    plan = _tables(items, layout, block_g * loop)
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
        DECAY_IS_PTR=lr_is_tensor, HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        LOOP=loop, EVEN_ROWS=even, ON_GPU=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=TUNING["num_warps"], enable_fp_fusion=False,  # no fused multiply-adds: round as the reference does
    )
