"""The fused multi-tensor AdamW step: one pass over memory for every quantized parameter of a batch.

Each program walks LOOP tiles of BLOCK_G quantization groups of one tensor, the next tiles' loads issued while
one is computed (software pipelining; the settings per case, measured on an H100: TUNING). It reads the
parameter, the gradient, the FP8 codes and group scales of m and v once, dequantizes (undoing the range
expansion), applies the AdamW update in fp32, finds the new group statistics, re-expands, rounds onto the FP8 grid
and writes parameter, codes and scales once. Small tensors with fp32 moments take the same kernel with QUANT off.
Tensors are reached through a table of addresses, so a whole batch (all parameters of one dtype and layout) is
one launch; the table and the program->tensor map are cached and rebuilt only when an address or a shape changes.
Step counts and bias corrections stay on the device: no host sync, and the step can be captured in a CUDA graph.

The arithmetic follows the reference (optim/reference.py, quant.encode_groups/decode_groups) in the same order,
with the GPU's one-instruction approximations where speed asked for them: lg2/ex2 for the expansion's powers
(decode: t ** (1/k); encode: 2^(k log2(|x|/c) + log2 FMAX), one fma), rcp for per-group reciprocals and in the
update, fused multiply-adds. Group min/max are integer reductions on the bits (|x| orders as its bits do).
Under the interpreter the rounding onto the grid is done by hand; on the GPU the hardware fp8 cast does the same
round-to-nearest-even; on GPUs without FP8 conversions (HW_FP8=False: A100 and older) the rounding is done by hand
as under the interpreter and the bits are assembled and read by integer arithmetic (grid.fp8_cast_bits,
grid.fp8_value): the same bits. tests/test_adamw_kernel.py states and checks the bound between the two.
"""
from __future__ import annotations

import collections
import functools
import math
from types import MappingProxyType

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .grid import (fast_exp2, fast_log2, fast_rcp, finite_abs, fp8_bits, fp8_cast_bits, fp8_value, grid_magnitude,
                       hardware_fp8, hash32, interpreted, round_bf16_stochastic, store_as, with_sign_of)
    from .launch import launcher
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency, but keep the reference usable without it
    HAVE_TRITON = False

from ..formats import get_format
from ..quant import (K_MANT_BITS, K_MASK, K_MAX_EXP, K_MIN_EXP, K_ONE, K_SLACK_BITS, adam_bound_args,
                     expansion_floor, inv_max, log2_max)

# the address table's columns: param, grad, then (codes, scale) of exp_avg, exp_avg_sq, max_exp_avg_sq, then the
# step count (fp32, 0-dim; the kernel works out the bias corrections from it)
N_PTRS = 9
STEP_COLUMN = 8
_TL_DTYPES = {}


def supports(param: torch.Tensor, grad: torch.Tensor, layout) -> bool:
    """Whether the kernel can step this tensor (else the reference does). lpoptim.AdamW also asks for CUDA;
    under TRITON_INTERPRET=1 the tests run the kernel on CPU tensors."""
    g = layout.group_size
    return (HAVE_TRITON and g >= 16 and g & (g - 1) == 0
            and param.is_contiguous() and grad.is_contiguous() and grad.dtype == param.dtype
            and param.dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < param.numel() < 2**31)


if HAVE_TRITON:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _address(row_ptrs, column, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
        """A tensor's address from the table. ALIGNED: the host checked that every address of the batch is a
        multiple of 16 bytes; saying so lets the compiler load 4 elements per instruction, not 1."""
        ptr = tl.load(row_ptrs + column).to(tl.pointer_type(DTYPE))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def _program_tensor(pid, ptrs, dims, blocks, PARAM_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
        """This program's tensor (from the batch tables), its first group, row length, groups per row, groups,
        its row of the address table, and the addresses of the parameter, gradient and m's and v's codes and
        scales; both kernels' first lines."""
        tensor = tl.load(blocks + 2 * pid)
        first_group = tl.load(blocks + 2 * pid + 1)
        n = tl.load(dims + 3 * tensor)  # row length
        groups_per_row = tl.load(dims + 3 * tensor + 1)
        total_groups = tl.load(dims + 3 * tensor + 2)
        row_ptrs = ptrs + N_PTRS_C * tensor
        p_ptr = _address(row_ptrs, 0, PARAM_DTYPE, ALIGNED)
        g_ptr = _address(row_ptrs, 1, PARAM_DTYPE, ALIGNED)
        m_ptr = _address(row_ptrs, 2, tl.uint8, ALIGNED)
        ms_ptr = _address(row_ptrs, 3, tl.float32, ALIGNED)
        v_ptr = _address(row_ptrs, 4, tl.uint8, ALIGNED)
        vs_ptr = _address(row_ptrs, 5, tl.float32, ALIGNED)
        return tensor, first_group, n, groups_per_row, total_groups, row_ptrs, p_ptr, g_ptr, m_ptr, ms_ptr, v_ptr, vs_ptr

    @triton.jit
    def _tile(first_group, j, n, groups_per_row, total_groups, BLOCK_G: tl.constexpr, G: tl.constexpr,
              EVEN_ROWS: tl.constexpr):
        """The j-th [BLOCK_G, G] tile of a program: one quantization group per row (gid, gmask: [BLOCK_G, 1]),
        its elements' offsets in the tensor and their mask."""
        gid = first_group + j * BLOCK_G + tl.arange(0, BLOCK_G)[:, None]
        gmask = gid < total_groups
        lane = tl.arange(0, G)[None, :]
        if EVEN_ROWS:  # rows are whole groups: the groups lie end to end
            offs = gid * G + lane
            mask = tl.broadcast_to(gmask, (BLOCK_G, G))  # whole groups: one mask bit per group
        else:  # the last group of each row is short
            row = gid // groups_per_row
            col = (gid - row * groups_per_row) * G + lane
            offs = row * n + col
            mask = gmask & (col < n)
        return gid, gmask, offs, mask

    @triton.jit
    def _step_scalars(row_ptrs, lr_ptr, decay_ptr, lr, decay, beta1, beta2, bound_ratio, bound_log2_ratio,
                      bound_numer, LR_IS_TENSOR: tl.constexpr, ON_GPU: tl.constexpr):
        """A tensor's step count and what it gives this step: (step, 1 / sqrt(1 - beta2^t), 1 / K of Adam's
        bound, lr / bc1, 1 - lr * weight_decay); both kernels' prologue."""
        # the bias corrections from the step count (already advanced by the host's one _foreach_add_), with the
        # torch ops the reference's host code used (powf, 1 / x, rsqrtf): here they cost nothing, there they were
        # seven tiny launches per batch, which stepping in backward (a batch every few parameters) paid ~100 times
        step = tl.load(_address(row_ptrs, STEP_COLUMN_C, tl.float32, False))
        bias_correction1 = 1.0 - _pow(beta1, step, ON_GPU)
        inv_bc2_sqrt = tl.rsqrt(1.0 - _pow(beta2, step, ON_GPU))  # 1 / sqrt(1 - beta2^t)
        # 1 / K of Adam's own bound m^2 <= K v after step - 1 steps (quant.adam_bound_inv; unused by fp32 moments)
        steps_before = step - 1.0  # r^n as 2^(n log2 r): one ex2 and one rcp, no powf, no division
        bound_denom = tl.where(bound_ratio == 1.0, steps_before, 1.0 - fast_exp2(steps_before * bound_log2_ratio, ON_GPU))
        inv_bound = bound_numer * fast_rcp(bound_denom, ON_GPU)
        inv_bound = tl.where((inv_bound > 0) & (inv_bound < float("inf")), inv_bound, 0.0)  # no step yet: 0
        if LR_IS_TENSOR:  # lr and 1 - lr * weight_decay on the device: lr / bc1
            step_size = tl.math.div_rn(tl.load(lr_ptr), bias_correction1)
            decay = tl.load(decay_ptr)
        else:  # a float lr: torch's float / tensor is reciprocal() * lr
            step_size = lr * tl.math.div_rn(1.0, bias_correction1)
        return step, inv_bc2_sqrt, inv_bound, step_size, decay

    @triton.jit
    def _pow(base, exponent, ON_GPU: tl.constexpr):
        """base ** exponent in fp32: CUDA's powf, as torch's pow on the GPU (the interpreter has no libdevice)."""
        if ON_GPU:
            return libdevice.pow(base + tl.zeros_like(exponent), exponent)
        else:
            return tl.exp2(exponent * tl.log2(base + tl.zeros_like(exponent)))

    @triton.jit
    def _k_of(code):
        """k from its code, exactly (quant.k_of): exponent (code >> 5) - 4, mantissa's top bits code & 31."""
        bits = (((code >> K_MANT_BITS_C) + K_EXP_BIAS_C) << 23) | ((code & K_MANT_MASK_C) << K_MANT_SHIFT_C)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _decode(codes_ptr, scale_ptr, offs, mask, gid, gmask, IS_E4M3: tl.constexpr, INV_MAX: tl.constexpr,
                QUANT: tl.constexpr, ON_GPU: tl.constexpr, HW_FP8: tl.constexpr):
        """Moment values of a [BLOCK_G, G] tile; gid/gmask are [BLOCK_G, 1] (one scale per row of the tile)."""
        if not QUANT:  # small tensors keep plain fp32 moments
            return tl.load(codes_ptr.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
        q = fp8_value(tl.load(codes_ptr + offs, mask=mask, other=0), IS_E4M3, ON_GPU, HW_FP8)
        c = tl.load(scale_ptr + gid, mask=gmask, other=0.0)
        # t ** (1/k) by the code the scale holds, whatever the layout says now (a state saved with expansion on
        # may be loaded or stepped with it off); t = 1 (the group's absmax) stays exactly 1: the scale cannot drift
        t = tl.abs(q) * INV_MAX
        code = c.to(tl.int32, bitcast=True) & K_MASK_C
        inv_k = fast_rcp(_k_of(code), ON_GPU)  # once per group
        t = tl.where(code != K_ONE_C, fast_exp2(fast_log2(t, ON_GPU) * inv_k, ON_GPU), t)
        return with_sign_of(t * c, q)

    @triton.jit
    def _encode(x, codes_ptr, scale_ptr, offs, mask, gid, gmask, EXPANSION: tl.constexpr, IS_E4M3: tl.constexpr,
                MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr, SPAN_LOG2: tl.constexpr,
                LOG2_MAX: tl.constexpr, QUANT: tl.constexpr, ON_GPU: tl.constexpr, HW_FP8: tl.constexpr):
        if not QUANT:
            tl.store(codes_ptr.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)
            return
        # masked-out lanes hold 0 (their loads' `other`), which neither statistic counts
        a = tl.abs(x)
        finite = finite_abs(x)
        # magnitudes order as their bits do: integer reductions (one redux.sync per warp on the GPU, not shuffles)
        amax = tl.max(finite.to(tl.int32, bitcast=True), axis=1, keep_dims=True).to(tl.float32, bitcast=True)
        code = tl.zeros_like(amax).to(tl.int32) + K_ONE_C
        if EXPANSION:  # k = log2(FMAX / floor) / log2(amax / amin), rounded down onto k's grid (quant.choose_k_code)
            # the smallest nonzero finite magnitude: bits - 1 as unsigned sends 0 to the top
            below = tl.min(finite.to(tl.uint32, bitcast=True) - 1, axis=1, keep_dims=True)
            amin = (below + 1).to(tl.float32, bitcast=True)  # 0 when the group has no nonzero finite value
            valid = (amax > 0) & (amin > 0)
            span = fast_log2(tl.where(valid, amax, 1.0), ON_GPU) - fast_log2(tl.where(valid, amin, 1.0), ON_GPU)
            k = SPAN_LOG2 / tl.maximum(span, 1e-6)
            bits = k.to(tl.int32, bitcast=True) + K_SLACK_BITS_C
            e = (bits >> 23) - 127
            code = ((e - K_MIN_EXP_C) << K_MANT_BITS_C) | ((bits >> K_MANT_SHIFT_C) & K_MANT_MASK_C)
            code = tl.where(e < K_MIN_EXP_C, 0, tl.where(e > K_MAX_EXP_C, K_MASK_C, code))
            code = tl.where(valid, code, K_ONE_C)
        c = ((amax.to(tl.int32, bitcast=True) & ~K_MASK_C) | code).to(tl.float32, bitcast=True)
        c = tl.where(amax >= 1.1754943508222875e-38, c, 0.0)  # fp32 subnormal absmax: flushed, as quant.pack_scale
        tl.store(scale_ptr + gid, c, mask=gmask)
        if EXPANSION:
            # FMAX * min(|x| / c, 1) ** k as 2^(k log2(|x| / c) + log2 FMAX): one fma, no clamp, no k = 1 case.
            # |x| / c is at most a hair above 1 (c's low bits hold the code): log2 of it stays small, so the fp32
            # exponent keeps its precision; values a hair above FMAX, and +-inf, saturate in the cast below
            inv_c = fast_rcp(tl.where(c > 0, c, 1.0), ON_GPU)  # once per group
            f = fast_exp2(tl.fma(fast_log2(a * inv_c, ON_GPU), _k_of(code), LOG2_MAX), ON_GPU)
            f = tl.where((c > 0) | (x != x), f, 0.0)  # scale 0: everything but NaN encodes as 0; NaN stays NaN
        else:
            inv_c = tl.div_rn(1.0, tl.where(c > 0, c, 1.0))  # once per group, as the reference
            f = tl.where(c > 0, tl.minimum(a * inv_c, 1.0), 0.0) * FMAX
            f = tl.where(x == x, f, float("nan"))  # the GPU's min drops NaN
        if ON_GPU and HW_FP8:  # cvt.rn.satfinite rounds to nearest even onto the grid (as grid_magnitude does), saturates
            codes = fp8_cast_bits(with_sign_of(f, x), IS_E4M3)
        else:  # the interpreter, and GPUs without FP8 conversions: rounded here, the bits assembled by fp8_bits
            q = with_sign_of(grid_magnitude(tl.where(f == f, f, 0.0), MAN_BITS, MIN_EXP, FMAX), x)
            codes = fp8_bits(tl.where((f == f) | (mask == 0), q, float("nan")), IS_E4M3, HW_FP8)
        tl.store(codes_ptr + offs, codes, mask=mask)

    @triton.jit
    def _adamw_kernel(
        ptrs, dims, blocks, lr_ptr, decay_ptr, grad_scale_ptr, found_inf_ptr, salt_ptr,
        lr, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, bound_ratio, bound_log2_ratio, bound_numer,
        PARAM_DTYPE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
        M_E4M3: tl.constexpr, M_MAN: tl.constexpr, M_MINEXP: tl.constexpr, M_MAX: tl.constexpr, M_SPAN: tl.constexpr,
        M_INV: tl.constexpr, M_LOG2: tl.constexpr,
        V_E4M3: tl.constexpr, V_MAN: tl.constexpr, V_MINEXP: tl.constexpr, V_MAX: tl.constexpr, V_SPAN: tl.constexpr,
        V_INV: tl.constexpr, V_LOG2: tl.constexpr,
        QUANT: tl.constexpr, EXPANSION: tl.constexpr, SQRT_V: tl.constexpr, AMSGRAD: tl.constexpr,
        MAXIMIZE: tl.constexpr, LR_IS_TENSOR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr, EVEN_ROWS: tl.constexpr, ON_GPU: tl.constexpr, LOOP: tl.constexpr,
        STAGES: tl.constexpr,
        STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr, HW_FP8: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if HAS_FOUND_INF:
            if tl.load(found_inf_ptr) != 0:
                return
        (tensor, first_group, n, groups_per_row, total_groups, row_ptrs, p_ptr, g_ptr, m_ptr, ms_ptr, v_ptr,
         vs_ptr) = _program_tensor(pid, ptrs, dims, blocks, PARAM_DTYPE, ALIGNED)

        step, inv_bc2_sqrt, inv_bound, step_size, decay = _step_scalars(
            row_ptrs, lr_ptr, decay_ptr, lr, decay, beta1, beta2, bound_ratio, bound_log2_ratio, bound_numer,
            LR_IS_TENSOR, ON_GPU)
        if HAS_GRAD_SCALE:
            inv_grad_scale = 1.0 / tl.load(grad_scale_ptr)
        if STOCHASTIC:  # the tensor's key for this step: stochastic_round.sr_key, here to save ~25 tiny launches
            # the salt table holds (salt, element offset) per tensor: the offset of an FSDP2 shard's first element
            key = hash32(hash32(step.to(tl.uint32)) + tl.load(salt_ptr + 2 * tensor).to(tl.uint32) * 0x9E3779B9)
            index_offset = tl.load(salt_ptr + 2 * tensor + 1).to(tl.uint32)
        if AMSGRAD:
            vm_ptr = _address(row_ptrs, 6, tl.uint8, ALIGNED)
            vms_ptr = _address(row_ptrs, 7, tl.float32, ALIGNED)
        else:
            vm_ptr = m_ptr
            vms_ptr = ms_ptr
        for j in tl.range(0, LOOP, num_stages=STAGES):  # LOOP tiles of BLOCK_G groups per program
            gid, gmask, offs, mask = _tile(first_group, j, n, groups_per_row, total_groups, BLOCK_G, G, EVEN_ROWS)

            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_GRAD_SCALE:
                g = g * inv_grad_scale
            if MAXIMIZE:
                g = -g

            m = _decode(m_ptr, ms_ptr, offs, mask, gid, gmask, M_E4M3, M_INV, QUANT, ON_GPU, HW_FP8)
            v = _decode(v_ptr, vs_ptr, offs, mask, gid, gmask, V_E4M3, V_INV, QUANT, ON_GPU, HW_FP8)
            if SQRT_V and QUANT:
                v = v * v
            if QUANT:  # a decoded v is never below what Adam's own recursion allows beside the decoded m
                v = tl.maximum(v, m * m * inv_bound)
            m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights below 0.5
            v = v * beta2 + one_minus_beta2 * g * g
            sqrt_v = tl.sqrt(v)
            sqrt_v_used = sqrt_v
            if AMSGRAD:
                v_max = _decode(vm_ptr, vms_ptr, offs, mask, gid, gmask, V_E4M3, V_INV, QUANT, ON_GPU, HW_FP8)
                # NaN propagates, as torch.maximum does (the GPU's plain max would keep the other value)
                if SQRT_V and QUANT:
                    sqrt_v_used = tl.maximum(v_max, sqrt_v, propagate_nan=tl.PropagateNan.ALL)
                    v_max = sqrt_v_used
                else:
                    v_max = tl.maximum(v_max, v, propagate_nan=tl.PropagateNan.ALL)
                    sqrt_v_used = tl.sqrt(v_max)
            denom = sqrt_v_used * inv_bc2_sqrt + eps
            p = p * decay - step_size * (m * fast_rcp(denom, ON_GPU))
            if STOCHASTIC:  # onto the bf16 grid at random; the store below is then exact
                p = round_bf16_stochastic(p, offs.to(tl.uint32) + index_offset, key)
            store_as(p_ptr + offs, p, mask, PARAM_DTYPE, ON_GPU)

            _encode(m, m_ptr, ms_ptr, offs, mask, gid, gmask, EXPANSION, M_E4M3, M_MAN, M_MINEXP, M_MAX, M_SPAN, M_LOG2,
                    QUANT, ON_GPU, HW_FP8)
            if SQRT_V and QUANT:
                v = sqrt_v
            _encode(v, v_ptr, vs_ptr, offs, mask, gid, gmask, EXPANSION, V_E4M3, V_MAN, V_MINEXP, V_MAX, V_SPAN, V_LOG2,
                    QUANT, ON_GPU, HW_FP8)
            if AMSGRAD:
                _encode(v_max, vm_ptr, vms_ptr, offs, mask, gid, gmask, EXPANSION, V_E4M3, V_MAN, V_MINEXP, V_MAX, V_SPAN,
                        V_LOG2, QUANT, ON_GPU, HW_FP8)

    N_PTRS_C = tl.constexpr(N_PTRS)
    STEP_COLUMN_C = tl.constexpr(STEP_COLUMN)
    K_MANT_BITS_C = tl.constexpr(K_MANT_BITS)
    K_MANT_MASK_C = tl.constexpr((1 << K_MANT_BITS) - 1)
    K_MANT_SHIFT_C = tl.constexpr(23 - K_MANT_BITS)
    K_EXP_BIAS_C = tl.constexpr(K_MIN_EXP + 127)
    K_MIN_EXP_C = tl.constexpr(K_MIN_EXP)
    K_MAX_EXP_C = tl.constexpr(K_MAX_EXP)
    K_ONE_C = tl.constexpr(K_ONE)
    K_SLACK_BITS_C = tl.constexpr(K_SLACK_BITS)
    K_MASK_C = tl.constexpr(K_MASK)


class _Plan:
    """The cached tables of one batch: addresses (rebuilt when one changes) and the program->tensor map."""

    def __init__(self):
        self.addr_key = None
        self.ptrs = self.dims = self.blocks = None
        self.n_blocks = 0
        self.salts = self.salts_key = None  # stochastic rounding's per-tensor salts, on the device
        self.aligned = False  # every address a multiple of 16 bytes (vector loads)
        self.tables = collections.OrderedDict()  # address tuple -> (device table, aligned), a few, most recent last


_plans: collections.OrderedDict = collections.OrderedDict()  # least recently used first
MAX_PLANS = 4096
MAX_TABLES = 4  # address tables kept per plan: gradients that alternate between buffers find theirs again
# the state's columns of the address table: codes and scales of quantized moments, or fp32 moments (no scales)
_STATE_KEYS = {True: ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes", "exp_avg_sq_scale", "max_exp_avg_sq_codes",
                      "max_exp_avg_sq_scale", "step"),
               False: ("exp_avg", None, "exp_avg_sq", None, "max_exp_avg_sq", None, "step")}
_STATE_KEYS4 = ("exp_avg_codes4", "exp_avg_scale", "exp_avg_sq_codes4", "exp_avg_sq_scale", "max_exp_avg_sq_codes4",
                "max_exp_avg_sq_scale", "step")  # state_bits=4: packed codes (kernels/adamw_step4.py)

# Launch settings: groups per tile, warps per program, tiles per program, and the loop's software pipelining
# (num_stages: the next tiles' loads issued while one is computed). Read-only: tests swap in their own. Each case
# its own, the best of sweeps on an H100 (torch 2.11, triton 3.6; lab scripts not kept), 1.24 B parameters back to
# back (the sweeps' times): FP8 states (and fp32 moments) with fp16/bf16 parameters, with or without stochastic
# rounding, 4 groups, 1 warp, 8 tiles, 3 stages (rounding 4.49 ms where the unpipelined (2, 1, 8) took 5.13;
# without 4.30 against 4.63), with fp32 parameters (2, 1, 2, 3 stages) 6.58 against 6.84 (a 27-setting sweep around
# each: groups 2-8, tiles 2-8, stages 2-4). 4-bit states: fp32 (4, 4, 8) and bf16 without rounding (2, 1, 16) gain
# nothing from stages (5.96 and 4.23 ms; bf16 pipelined 4.28-4.95); bf16 with rounding (4, 1, 32, 3 stages) 4.19
# against 4.43 (groups 2-4, tiles 16-64, stages 3-4). docs/results/optim_step_h100.json holds
# benchmarks/optim_step.py's times with these, alternating with the unpipelined settings (FP8 with rounding there:
# 4.58-4.65 ms).
_SETTINGS = ("block_groups", "num_warps", "loop", "stages")
TUNING = MappingProxyType({k: MappingProxyType(dict(zip(_SETTINGS, v))) for k, v in {
    "half": (4, 1, 8, 3), "fp32": (2, 1, 2, 3),  # FP8 states, or fp32 moments
    "state4_half": (2, 1, 16, 1), "state4_half_sr": (4, 1, 32, 3), "state4_fp32": (4, 4, 8, 1)}.items()})


def _tuning(layout, dtype, stochastic: bool = False) -> dict:
    """The launch settings for this state layout, parameter dtype and bf16 stochastic rounding."""
    if layout.quantized and layout.state_bits == 4:
        return TUNING["state4_fp32" if dtype == torch.float32 else "state4_half_sr" if stochastic else "state4_half"]
    return TUNING["fp32" if dtype == torch.float32 else "half"]


def _tables(batch, layout, block_g: int) -> _Plan:
    dev = batch[0][0].device
    # keyed by the parameters' addresses (which do not move): two groups or optimizers with the same shapes
    # must not share, and so rebuild, one table every step
    key = (dev, layout, block_g, tuple((p.data_ptr(), p.shape) for p, *_ in batch))
    plan = _plans.pop(key, None) or _Plan()
    _plans[key] = plan  # most recently used last
    if len(_plans) > MAX_PLANS:  # optimizers come and go (tests, restarts): drop the least recently used
        del _plans[next(iter(_plans))]
    if plan.dims is None:
        dims, blocks = [], []
        for t, (p, _g, _s, _l) in enumerate(batch):
            n = p.shape[-1] if p.dim() else 1
            rows = p.numel() // n
            gpr = -(-n // layout.group_size)
            dims.append((n, gpr, rows * gpr))
            # (tensor, first group) of each program, built on the device: a 7B model has millions of programs
            firsts = torch.arange(0, rows * gpr, block_g, dtype=torch.int32, device=dev)
            blocks.append(torch.stack((torch.full_like(firsts, t), firsts), dim=1))
        plan.dims = _to_device(torch.tensor(dims, dtype=torch.int32), dev)
        plan.blocks = torch.cat(blocks).contiguous()
        plan.n_blocks = plan.blocks.shape[0]
    keys = _STATE_KEYS4 if layout.quantized and layout.state_bits == 4 else _STATE_KEYS[layout.quantized]
    addrs = tuple((p.data_ptr(), g.data_ptr(), *[0 if t is None else t.data_ptr() for t in map(s.get, keys)])
                  for p, g, s, _l in batch)
    if addrs == plan.addr_key:
        return plan
    # gradients often come back to addresses seen a step or two ago (that table's step counts were checked then)
    table = plan.tables.pop(addrs, None)
    if table is None and plan.addr_key is not None:
        # usually only gradients moved (set_to_none, or a step per parameter in backward)
        changed = [(t, c, v) for t, (new, old) in enumerate(zip(addrs, plan.addr_key)) for c, (v, o) in
                   enumerate(zip(new, old)) if v != o]
        if len(changed) <= 8:  # the current table written in place by the device, in stream order: no host memory
            _check_steps([batch[t] for t, c, _v in changed if c == STEP_COLUMN])  # usually none: gradients moved
            table = plan.tables.pop(plan.addr_key)
            for t, c, v in changed:
                table[0][t, c].fill_(v)
            # aligned only if it was and the new addresses are (conservative: an old unaligned one may have gone)
            table = (table[0], table[1] and all(v % 16 == 0 for _, c, v in changed if c != STEP_COLUMN))
    if table is None:  # a new table through pinned memory, copied asynchronously
        _check_steps(batch)
        # the step count (4-byte scalar) is not loaded as a vector: its alignment does not matter
        table = (_to_device(torch.tensor(addrs, dtype=torch.int64), dev),
                 all(a % 16 == 0 for row in addrs for a in row[:STEP_COLUMN]))
    plan.tables[addrs] = table  # most recently used last
    if len(plan.tables) > MAX_TABLES:
        del plan.tables[next(iter(plan.tables))]
    plan.addr_key = addrs
    plan.ptrs, plan.aligned = table
    return plan


def _check_steps(batch) -> None:
    """Each state's "step" is one fp32 value on its parameter's device (as lpoptim makes it, and load_state_dict
    converts it): a step put there by hand as fp64, an integer or on the CPU would be read as garbage or from an
    address the GPU cannot reach, so it is refused where a table is built, or patched with a new step address
    (not on the usual path, where only gradients moved: no loop over the parameters there)."""
    for p, _g, s, _l in batch:
        step = s["step"]
        if step.dtype != torch.float32 or step.device != p.device or step.numel() != 1:
            raise ValueError(f"lpoptim.AdamW: a state's 'step' must be one float32 value on the parameter's device "
                             f"({p.device}), got {step.dtype} {tuple(step.shape)} on {step.device}; load states "
                             "with optimizer.load_state_dict, which converts them")


def _to_device(table: torch.Tensor, dev) -> torch.Tensor:
    """A small host table on ``dev``: through pinned memory and asynchronously on CUDA (no host sync)."""
    return table.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else table.to(dev)


@functools.cache
def _format_args(name: str, prefix: str) -> dict:
    fmt = get_format(name)
    return {f"{prefix}_E4M3": fmt.name == "e4m3", f"{prefix}_MAN": fmt.man_bits, f"{prefix}_MINEXP": fmt.min_normal_exp,
            f"{prefix}_MAX": fmt.max, f"{prefix}_SPAN": math.log2(fmt.max / expansion_floor(fmt)),
            f"{prefix}_INV": inv_max(fmt), f"{prefix}_LOG2": log2_max(fmt)}


def fused_adamw_step(batch, *, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale=None, found_inf=None,
                     sr_salts=None, state_salts=None, offsets=None):
    """Steps every (param, grad, state, layout) of ``batch``: one launch per (device, dtype, layout, rows) subset.

    ``sr_salts``: one int per item; bf16 parameters are then rounded stochastically (reference_adamw_step's
    ``sr_salt``). ``state_salts``: one int per item, the salts of 4-bit states' stochastic rounding of v
    (reference_adamw_step's ``state_salt``; 0 where None); where both are given they must agree (one table).
    ``offsets``: one int per item, reference_adamw_step's ``offset``: where an FSDP2 shard's first element lies in
    its tensor, which both stochastic roundings draw by (0 where None)."""
    subsets: dict = {}
    for i, item in enumerate(batch):
        p, _g, _s, layout = item
        even = (p.shape[-1] if p.dim() else 1) % layout.group_size == 0
        subsets.setdefault((p.device, p.dtype, layout, even), []).append(
            (item, None if sr_salts is None else sr_salts[i],
             (0 if state_salts is None else state_salts[i], 0 if offsets is None else offsets[i])))
    for (dev, dtype, layout, even), entries in subsets.items():
        items = [item for item, *_ in entries]
        salts = [salt for _, salt, _ in entries] if sr_salts is not None and dtype == torch.bfloat16 else None
        stochastic = salts is not None
        if layout.quantized and layout.state_bits == 4:  # one salt table: v's rounding needs it always
            state = [salt for *_, (salt, _o) in entries]
            if salts is not None and salts != state:
                raise ValueError("fused_adamw_step: sr_salts and state_salts differ for 4-bit states")
            salts = state
        if salts is not None:  # (salt, element offset mod 2^32 as int32) per tensor
            offs = [off for *_, (_salt, off) in entries]
            salts = [x for salt, off in zip(salts, offs) for x in (salt, ((off + 2**31) % 2**32) - 2**31)]
        _launch(items, dev, dtype, layout, even, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf, salts=salts,
                stochastic=stochastic)


def _launch(items, dev, dtype, layout, even, *, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale,
            found_inf, salts, stochastic=None):
    tune = _tuning(layout, dtype, bool(stochastic))
    block_g, loop = tune["block_groups"], tune["loop"]
    plan = _tables(items, layout, block_g * loop)
    steps = [s["step"] for _p, _g, s, _l in items]
    # step counts on the device (no host sync), one launch; the kernel reads them for the bias corrections
    torch._foreach_add_(steps, 1)
    if found_inf is not None:
        found_inf = found_inf.to(dev, torch.float32)
        torch._foreach_sub_(steps, [found_inf] * len(steps))
    lr_is_tensor = isinstance(lr, torch.Tensor)
    lr_t = lr.to(dev, torch.float32, non_blocking=True).reshape(1) if lr_is_tensor else None  # no host block
    decay = (1 - lr_t * weight_decay).contiguous() if lr_is_tensor else 1 - lr * weight_decay
    dummy = plan.dims
    if salts is not None and plan.salts_key != salts:  # copied once per batch of parameters, not every step
        plan.salts = _to_device(torch.tensor(salts, dtype=torch.int32), dev)
        plan.salts_key = salts
    args = (plan.ptrs, plan.dims, plan.blocks, lr_t if lr_is_tensor else dummy, decay if lr_is_tensor else dummy,
            grad_scale.to(dev, torch.float32) if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy, plan.salts if salts is not None else dummy,
            0.0 if lr_is_tensor else float(lr), 0.0 if lr_is_tensor else float(decay),
            beta1, 1 - beta1, beta2, 1 - beta2, eps, *adam_bound_args(beta1, beta2))
    # what both kernels take: the tile, the flags, and fused multiply-adds on (Triton 3.9 warns that its default
    # will change): ~4% fewer instructions, within the ulp-level bound the GPU tests allow
    common = dict(PARAM_DTYPE=_TL_DTYPES[dtype], G=layout.group_size, BLOCK_G=block_g, AMSGRAD=amsgrad,
                  MAXIMIZE=maximize, LR_IS_TENSOR=lr_is_tensor, HAS_GRAD_SCALE=grad_scale is not None,
                  HAS_FOUND_INF=found_inf is not None, LOOP=loop, STAGES=tune["stages"], EVEN_ROWS=even,
                  ON_GPU=not interpreted(), ALIGNED=plan.aligned, num_warps=tune["num_warps"], enable_fp_fusion=True)
    # through the cached launcher (launch.py): Triton's own launch binds and specializes all of these arguments on
    # every call, and stepping in backward launches once per bucket, ~40 times a step at 7B
    if layout.quantized and layout.state_bits == 4:  # the 4-bit codec's kernel: the same tables and arguments
        from .adamw_step4 import adamw4_kernel

        launcher(adamw4_kernel)((plan.n_blocks,), *args, STOCHASTIC=stochastic, **common)
        return
    launcher(_adamw_kernel)(
        (plan.n_blocks,), *args, **_format_args(layout.exp_avg_format, "M"),
        **_format_args(layout.exp_avg_sq_format, "V"), QUANT=layout.quantized, EXPANSION=layout.expansion,
        SQRT_V=layout.sqrt_v, STOCHASTIC=salts is not None, HW_FP8=hardware_fp8(dev), **common)
