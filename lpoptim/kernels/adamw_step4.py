"""The fused AdamW step for 4-bit states (state_bits=4): adamw_step.py's kernel with quant.encode4_groups /
decode4_groups in place of the FP8 codec.

The batch tables, launch settings and the update are adamw_step.py's (that module launches this kernel for a
4-bit layout). A [BLOCK_G, G] tile of elements reads its codes as [BLOCK_G, G/2] bytes and splits each byte into
its two nibbles (element 2i low, 2i + 1 high: tl.join then a reshape), and packs them back the same way. The
codec is integer rounding onto 0..7 (m, with a sign) or 1..16 (v): f = |x| · top/c with top/c one correctly
rounded division per group (div_rn, as the reference's float64 quotient), rounded to nearest even by the 1.5·2^23
trick (v: floor(f + u), u from the hash, and the bound's ceil: one add toward zero or +inf at 2^23 on the GPU),
so kernel and reference agree exactly given the same fp32 moment. Each code is the low bits of such a sum, not
a float-to-int conversion (those, and floor and ceil, issue at a quarter of an add's rate; the kernel is bound
by issue with bf16 parameters), and m's signed nibbles are read by shifts. The decode is (q · fp32(1/7)) · c or
j · (c/16), in the reference's order. The update arithmetic is adamw_step.py's,
so fp32 moments may differ from the reference's by an ulp, which can move a code on a rounding tie-break.
Each group's ratio bound (quant.quantize_state4_moments) is applied at encode, from the fresh fp32 moments: r2 =
the group's largest (m·m)·rcp(v) (an integer maximum on the bits, the values being >= +0), one division per group
(u = ((a · 16/c) · a) · slack / r2, a = fp32(1/7) · m's scale: quant.encode4_v_floor) and per element a multiply,
a ceil and a maximum raising v's code to q_m^2 · u; on the GPU rcp.approx, so r2 may differ from the reference's
by an ulp or two and move a code that lands on an integer (under the interpreter it is exact). Nothing is stored
for it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..quant import FP32_MIN_NORMAL, M4_INV, M4_NAN, M4_TOP, RATIO_SLACK, V4_TOP
from .adamw_step import _address, _program_tensor, _step_scalars, _tile
from .grid import (RNE_MAGIC, TWO_23, fast_rcp, finite_abs, hash32, integer_at_2_23, round_bf16_with_bits,
                   round_half_even, store_as, with_sign_of)

M4_TOP_C = tl.constexpr(M4_TOP)
V4_TOP_C = tl.constexpr(V4_TOP)
M4_NAN_C = tl.constexpr(M4_NAN)
MIN_NORMAL_C = tl.constexpr(FP32_MIN_NORMAL)
M4_INV_C = tl.constexpr(M4_INV)
RATIO_SLACK_C = tl.constexpr(RATIO_SLACK)


@triton.jit
def _unpack(codes_ptr, boffs, bmask, SIGNED: tl.constexpr, BLOCK_G: tl.constexpr, G: tl.constexpr):
    """[BLOCK_G, G/2] bytes -> [BLOCK_G, G] int32 nibbles, element 2i the low nibble of byte i; SIGNED: as the
    int4 they hold (-8..7), by two shifts each (the arithmetic one extends the sign), not compare-and-select."""
    b = tl.load(codes_ptr + boffs, mask=bmask, other=0).to(tl.int32)
    if SIGNED:
        lo, hi = (b << 28) >> 28, (b << 24) >> 28
    else:
        lo, hi = b & 15, b >> 4
    return tl.reshape(tl.join(lo, hi), (BLOCK_G, G))


@triton.jit
def _pack_store(nib, codes_ptr, boffs, bmask, BLOCK_G: tl.constexpr, G: tl.constexpr):
    lo, hi = tl.split(tl.reshape(nib, (BLOCK_G, G // 2, 2)))
    tl.store(codes_ptr + boffs, (lo | (hi << 4)).to(tl.uint8), mask=bmask)


@triton.jit
def _decode4(codes_ptr, scale_ptr, boffs, bmask, mask, gid, gmask, SECOND: tl.constexpr, BLOCK_G: tl.constexpr,
             G: tl.constexpr, EVEN_ROWS: tl.constexpr):
    """quant.decode4_groups of a tile; masked-out lanes are 0 (whole groups masked out read scale 0 and codes 0,
    which decode to 0: only an odd row's padding nibble needs the mask)."""
    nib = _unpack(codes_ptr, boffs, bmask, not SECOND, BLOCK_G, G)
    c = tl.load(scale_ptr + gid, mask=gmask, other=0.0)
    if SECOND:
        y = (nib + 1).to(tl.float32) * (c * (1.0 / V4_TOP_C))
    else:
        y = (nib.to(tl.float32) * M4_INV_C) * c
        y = tl.where(nib == M4_NAN_C - 16, float("nan"), y)  # NaN's code, read as an int4
    if not EVEN_ROWS:
        y = tl.where(mask, y, 0.0)
    return y


@triton.jit
def _encode4(x, codes_ptr, scale_ptr, boffs, bmask, mask, gid, gmask, noise, q2, a, r2, SECOND: tl.constexpr,
             BLOCK_G: tl.constexpr, G: tl.constexpr, SR: tl.constexpr, BOUND: tl.constexpr,
             EVEN_ROWS: tl.constexpr, ON_GPU: tl.constexpr):
    """quant.encode4_groups of a tile (masked-out lanes hold 0) and the store of its codes and scales; SR: rounded
    as floor(f + noise). BOUND (v): the code raised to ceil(q2 · u), u from m's a = fp32(1/7) · its scale and the
    group's r2 ([BLOCK_G, 1]; quant.encode4_v_floor), capped at 16 (fmax / fmin: a NaN product raises nothing).
    Returns m's q² (q its rounded magnitude, 0..7; 7 where x is NaN) and the scales. The integers come out of
    fp32 adds at 2^23 (the nibble is the sum's low bits), not conversions, which run at a quarter of their rate."""
    finite = finite_abs(x)
    amax = tl.max(finite.to(tl.int32, bitcast=True), axis=1, keep_dims=True).to(tl.float32, bitcast=True)
    c = tl.where(amax >= MIN_NORMAL_C, amax, 0.0)
    tl.store(scale_ptr + gid, c, mask=gmask)
    if SECOND:
        top = V4_TOP_C
    else:
        top = M4_TOP_C
    inv = tl.where(c > 0, tl.div_rn(top + tl.zeros_like(c), tl.where(c > 0, c, 1.0)), 0.0)  # once per group
    f = tl.minimum(tl.abs(x) * inv, top)  # min first: the rounding below needs f < 2^22 (inf, NaN: the top)
    if SECOND:  # j held as 2^23 + j, whose low bits are j: max and min order them as j
        if SR:  # f + noise floors onto the top + 1 at most (16 + a noise within 2^-20 of 1 rounds up): capped below
            j = integer_at_2_23(f + noise, False, ON_GPU)
            if not BOUND:
                j = tl.minimum(j, TWO_23 + top)
        else:
            j = round_half_even(f) + TWO_23
        if BOUND:  # once per group: u; per element a multiply, a ceil, a max and the cap
            w = ((a * inv) * a) * RATIO_SLACK_C
            u = tl.where(r2 > 0, tl.div_rn(w, tl.where(r2 > 0, r2, 1.0)), 0.0)
            j = tl.minimum(tl.maximum(j, integer_at_2_23(q2 * u, True, ON_GPU)), TWO_23 + top)
        nib = (tl.maximum(j, TWO_23 + 1.0).to(tl.int32, bitcast=True) - 1) & 15  # j - 1, for j in 1..16
        nib = tl.where(x != x, 15, nib)
        q2_out = q2
    else:
        # round(f) with x's sign, ties to even: its two's complement nibble is the sum's low four bits
        r = with_sign_of(f, x) + RNE_MAGIC
        nib = r.to(tl.int32, bitcast=True) & 15
        q = r - RNE_MAGIC
        q2_out = q * q
        nib = tl.where(x != x, M4_NAN_C, nib)
    if not EVEN_ROWS:
        nib = tl.where(mask, nib, 0)  # an odd row's last high nibble, and lanes past the tensor: 0
    _pack_store(nib, codes_ptr, boffs, bmask, BLOCK_G, G)
    return q2_out, c


@triton.jit
def _ratio_bound(m, v, ON_GPU: tl.constexpr):
    """quant.state4_ratio_bound of the tile's fresh fp32 moments ([BLOCK_G, 1]): each group's largest (m·m)·(1/v),
    NaN left out (m = v = 0, masked-out lanes included, gives NaN: 0)."""
    e = (m * m) * fast_rcp(v, ON_GPU)
    # >= +0 (v >= +0): its bits order as its values, an integer maximum (as amax). NaN to 0: on the GPU the
    # maximum with 0 drops it (one instruction, not a compare and a select)
    if ON_GPU:
        e = tl.maximum(e, 0.0)
    else:
        e = tl.where(e == e, e, 0.0)
    return tl.max(e.to(tl.int32, bitcast=True), axis=1, keep_dims=True).to(tl.float32, bitcast=True)


@triton.jit
def adamw4_kernel(
    ptrs, dims, blocks, lr_ptr, decay_ptr, grad_scale_ptr, found_inf_ptr, salt_ptr,
    lr, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, bound_ratio, bound_log2_ratio, bound_numer,
    PARAM_DTYPE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, LR_IS_TENSOR: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, EVEN_ROWS: tl.constexpr, ON_GPU: tl.constexpr, LOOP: tl.constexpr,
    STAGES: tl.constexpr,
    STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    (tensor, first_group, n, groups_per_row, total_groups, row_ptrs, p_ptr, g_ptr, m_ptr, ms_ptr, v_ptr,
     vs_ptr) = _program_tensor(pid, ptrs, dims, blocks, PARAM_DTYPE, ALIGNED)
    n_bytes = (n + 1) // 2  # a row's packed codes

    # adamw_step._adamw_kernel's step-count arithmetic
    step, inv_bc2_sqrt, inv_bound, step_size, decay = _step_scalars(
        row_ptrs, lr_ptr, decay_ptr, lr, decay, beta1, beta2, bound_ratio, bound_log2_ratio, bound_numer,
        LR_IS_TENSOR, ON_GPU)
    if HAS_GRAD_SCALE:
        inv_grad_scale = 1.0 / tl.load(grad_scale_ptr)
    # the tensor's key for this step (stochastic_round.sr_key): one hash of it per element gives the bf16
    # rounding's bits (STOCHASTIC, the low 16) and v's, which every 4-bit state takes (the top 16)
    # the salt table holds (salt, element offset) per tensor: the offset of an FSDP2 shard's first element
    key = hash32(hash32(step.to(tl.uint32)) + tl.load(salt_ptr + 2 * tensor).to(tl.uint32) * 0x9E3779B9)
    index_offset = tl.load(salt_ptr + 2 * tensor + 1).to(tl.uint32)
    if AMSGRAD:
        vm_ptr = _address(row_ptrs, 6, tl.uint8, ALIGNED)
        vms_ptr = _address(row_ptrs, 7, tl.float32, ALIGNED)
    else:
        vm_ptr = m_ptr
        vms_ptr = ms_ptr
    for j in tl.range(0, LOOP, num_stages=STAGES):
        gid, gmask, offs, mask = _tile(first_group, j, n, groups_per_row, total_groups, BLOCK_G, G, EVEN_ROWS)
        blane = tl.arange(0, G // 2)[None, :]  # the tile's packed codes: [BLOCK_G, G/2] bytes
        if EVEN_ROWS:
            boffs = gid * (G // 2) + blane
            bmask = tl.broadcast_to(gmask, (BLOCK_G, G // 2))
        else:
            row = gid // groups_per_row
            bcol = (gid - row * groups_per_row) * (G // 2) + blane
            boffs = row * n_bytes + bcol
            bmask = gmask & (bcol < n_bytes)

        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GRAD_SCALE:
            g = g * inv_grad_scale
        if MAXIMIZE:
            g = -g

        m = _decode4(m_ptr, ms_ptr, boffs, bmask, mask, gid, gmask, False, BLOCK_G, G, EVEN_ROWS)
        v = _decode4(v_ptr, vs_ptr, boffs, bmask, mask, gid, gmask, True, BLOCK_G, G, EVEN_ROWS)
        v = tl.maximum(v, m * m * inv_bound)  # Adam's own bound at decode
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        sqrt_v_used = tl.sqrt(v)
        if AMSGRAD:
            v_max = _decode4(vm_ptr, vms_ptr, boffs, bmask, mask, gid, gmask, True, BLOCK_G, G, EVEN_ROWS)
            v_max = tl.maximum(v_max, v, propagate_nan=tl.PropagateNan.ALL)  # NaN kept, as torch.maximum
            sqrt_v_used = tl.sqrt(v_max)
        denom = sqrt_v_used * inv_bc2_sqrt + eps
        p = p * decay - step_size * (m * fast_rcp(denom, ON_GPU))
        bits = hash32((offs.to(tl.uint32) + index_offset) ^ key)
        if STOCHASTIC:
            p = round_bf16_with_bits(p, bits)
        store_as(p_ptr + offs, p, mask, PARAM_DTYPE, ON_GPU)

        r2 = _ratio_bound(m, v, ON_GPU)  # from the exact moments, before they are rounded
        q2_m, c_m = _encode4(m, m_ptr, ms_ptr, boffs, bmask, mask, gid, gmask, 0.0, 0.0, 0.0, 0.0, False, BLOCK_G,
                             G, False, False, EVEN_ROWS, ON_GPU)
        # v rounded stochastically: uniforms from the top 16 bits of the same hash (stochastic_round.uniform_noise),
        # its code then raised to the group's ratio bound
        noise = (bits >> 16).to(tl.float32) * 1.52587890625e-05
        _encode4(v, v_ptr, vs_ptr, boffs, bmask, mask, gid, gmask, noise, q2_m, M4_INV_C * c_m, r2, True,
                 BLOCK_G, G, True, True, EVEN_ROWS, ON_GPU)
        if AMSGRAD:  # the running maximum: to nearest
            _encode4(v_max, vm_ptr, vms_ptr, boffs, bmask, mask, gid, gmask, 0.0, 0.0, 0.0, 0.0, True, BLOCK_G, G,
                     False, False, EVEN_ROWS, ON_GPU)
