"""The autograd Functions, one per recipe. Each forward saves only low-bit tensors (plus the weight parameter,
which exists anyway) and each backward runs its two GEMMs low-bit:

    forward  y  = x Wᵀ     x quantized per token, W per output channel (or per tensor)
    backward dx = dy W     dy per token (E5M2), W re-quantized per *input* channel: read as Wᵀ (K, N)
             dW = dyᵀ x    dyᵀ per output channel over tokens, x per input channel over tokens: that copy of x
                           is what forward saves, already transposed (K, tokens) and in FP8

Tokens are padded with zeros to a multiple of 16 where they are contracted (dW). Feature dims must be
multiples of 16 (checked by the module). Biases are added in the output dtype; db = Σ_tokens dy.
"""
from __future__ import annotations

import contextlib

import torch

from ..formats import E2M1
from ..quant import absmax_scale
from .fp4 import dge_derivative, occ_split, residual_matmul
from .gathered_weight import gathered_dx, gathered_operand
from .operands import Operand, gemm, padded, quantize, quantize_pair, tensor_amax, use_kernels
from .recipes import Recipe
from .weight_scale import quantize_weight_prev


def _autocast_off(device_type: str):
    """torch.autocast(device_type, enabled=False) where autocast is on; where it is off, nothing to enter (the
    context costs microseconds of host time, and an eager layer's host time is its step's limit)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _save_x_for_dw(x2: torch.Tensor, r: Recipe, hx=None) -> Operand:
    """x (M, K) -> xᵀ (K, M padded) quantized along tokens: the dW GEMM's second operand. ``hx``: x's amax
    history (delayed scaling, per tensor)."""
    return quantize(x2.t(), r.specs.xt, history=hx)


def _quantize_wt(w, r: Recipe, w_stat, hw=None) -> Operand:
    """Wᵀ (K, N) for dx = dy W, W per input channel (or per tensor), in one pass where the forward left ``w_stat``:
    per row, W's column maxima; per tensor, W's absmax (the same scale again). Without it (int4's forward, or a
    frozen weight's forward, which quantizes W without a statistic), per tensor with ``hw`` (W's amax history:
    delayed scaling) one pass that records W's absmax."""
    spec = r.specs.wt
    if w_stat is None:
        return quantize(w.t(), spec, history=hw)
    per_tensor = w_stat.dim() == 0  # what the forward left: one absmax, or one maximum per column
    if per_tensor != (spec.granularity == "tensor"):
        raise ValueError(f"W's statistic from the forward ({'absmax' if per_tensor else 'column maxima'}) does not "
                         f"fit a backward per {spec.granularity}")
    return quantize(w.t(), spec, amax=w_stat)


def _fp4_forward_and_xt(x2, w, r: Recipe, out_dtype):
    """The E2M1 forward GEMM (x and W per row; fp4) and, for an fp8 backward per tensor, the saved xᵀ and
    W's absmax (the backward's Wᵀ scale): both maxima taken by the row quantizers' first passes, so neither xᵀ nor
    Wᵀ needs an absmax pass of its own. (None, None, None) for other backwards."""
    if r.backward_granularity != "tensor":
        return None, None, None
    # the order the GPU gets them: the small weight first, then x, then the GEMM before xᵀ (which only the
    # backward reads), so the GEMM waits on no host work that it does not need
    s = r.specs
    wq = quantize(w, s.w_kept)
    xq = quantize(x2, s.x_kept)
    y = gemm(xq, wq, out_dtype)
    return y, quantize(x2.t(), s.xt, amax=xq.amax), wq.amax


def _fp8_backward(g2, w, xt: Operand, r: Recipe, need_dx: bool, need_dw: bool, dx_dtype, dw_dtype, w_stat=None,
                  hg=None, hw=None):
    """``hg``: dy's amax history (delayed scaling, per tensor), taken once: by whichever quantization comes first;
    ``hw``: W's, for a Wᵀ the forward left no statistic for."""
    dx = dw = None
    gq = gt = None
    spec = r.specs.dy
    if need_dx and need_dw:  # dy and dyᵀ: two passes over dy, not three (or four, per tensor); one with hg
        gq, gt = quantize_pair(g2, spec, spec, history=hg)
    if need_dw:  # first: its operands are ready, so the GPU starts a GEMM while the host prepares Wᵀ
        gt = gt or quantize(g2.t(), spec, history=hg)  # (N, M padded like xt)
        dw = gemm(gt, xt, dw_dtype)
        gt = None  # freed before Wᵀ and dx are made: the peak stays below what it was with dx first
    if need_dx:
        gq = gq or quantize(g2, spec, history=None if need_dw else hg)    # (M, N)
        dx = gathered_dx(gq, w, dx_dtype)  # W arrived in FP8 (an FP8 all-gather): Wᵀ from its values
        if dx is None:
            dx = gemm(gq, _quantize_wt(w, r, w_stat, hw), dx_dtype)
    return dx, dw


class _LowBitLinearFunction(torch.autograd.Function):
    """The eager path: forward and backward of one recipe (subclasses define the forward GEMM)."""

    @staticmethod
    def forward_gemm(x2, w, r: Recipe, out_dtype: torch.dtype, hx=None) -> torch.Tensor:
        """y = x2 Wᵀ; ``hx``: x's amax history, for a forward that quantizes x per tensor (fp8)."""
        raise NotImplementedError

    @staticmethod
    def weight_grad_factor(w, r: Recipe) -> torch.Tensor | None:
        """The factor the recipe multiplies the weight gradient by (reference, torch), or None."""
        return None

    @staticmethod
    def has_weight_grad_factor(r: Recipe) -> bool:
        return False

    @classmethod
    def finish_weight_grad(cls, dw, w, r: Recipe) -> torch.Tensor:
        """dW as the GEMM gave it (fp32 where weight_grad_factor is not None) -> dW in the weight's dtype."""
        factor = cls.weight_grad_factor(w, r)
        return (dw if factor is None else dw * factor).to(w.dtype)

    @staticmethod
    def forward_gemm_and_xt(x2, w, r: Recipe, out_dtype: torch.dtype, hx=None, hw=None, w_state=None):
        """(y, xᵀ operand, W's statistic or None) where computing them together pays; (None, None, None) leaves
        xᵀ to _save_x_for_dw. The statistic lets the backward quantize Wᵀ in one pass (_quantize_wt). ``hx``,
        ``hw``: x's and W's amax histories (delayed scaling); ``w_state``: W's previous-absmax state (compiled
        delayed scaling, nn/weight_scale.py)."""
        return None, None, None

    @staticmethod
    def forward(ctx, x, w, bias, r: Recipe, out_dtype: torch.dtype, grad_enabled: bool, histories=None,
                w_state=None):
        # grad mode is off inside forward: the caller says whether a backward can follow (no xᵀ under no_grad)
        want_xt = grad_enabled and w.requires_grad
        y, xt, w_stat = lowbit_forward(_flat(x), w, bias, r, out_dtype, want_xt, histories, w_state)
        # no x.shape on ctx: a symbolic shape there breaks torch 2.11's Dynamo (gy has x's leading dims)
        ctx.recipe, ctx.x_dtype, ctx.has_bias, ctx.histories = r, x.dtype, bias is not None, histories
        ctx.has_xt, ctx.has_w_stat = xt is not None, w_stat is not None
        ctx.save_for_backward(w, *((xt.values, xt.scale) if xt is not None else ()),
                              *((w_stat,) if w_stat is not None else ()))
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        w, *saved = ctx.saved_tensors
        xt = Operand(saved[0], saved[1]) if ctx.has_xt else None
        w_stat = saved[-1] if ctx.has_w_stat else None
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = lowbit_backward(_flat(gy), w, xt, w_stat, ctx.recipe, need_dx, need_dw,
                                     need_db and ctx.has_bias, ctx.x_dtype, ctx.histories)
        return None if dx is None else dx.reshape(*gy.shape[:-1], w.shape[1]), dw, db, None, None, None, None, None


def lowbit_forward(x2, w, bias, r: Recipe, out_dtype: torch.dtype, want_xt: bool, histories=None, w_state=None):
    """y = x2 Wᵀ + b in ``out_dtype`` with the recipe's forward GEMM, and (when ``want_xt``) the saved xᵀ operand
    for dW and W's statistic for the backward's Wᵀ (fp8: per row on CUDA its column maxima, per tensor its absmax;
    fp4: its absmax; else None). ``histories``: (x's, dy's, W's) nn.delayed.AmaxHistory for delayed
    scaling; x's is taken once, by the per-tensor quantization of x (fp8 per tensor: x and xᵀ together; per-row
    forwards: the saved xᵀ), except fp4's, whose xᵀ comes with x's absmax from the row quantizer (only dy is
    delayed); W's by an fp8 forward per tensor (its scale also Wᵀ's in backward). ``w_state``: instead of W's
    history, its previous-absmax state (nn/weight_scale.py), used by that same forward."""
    fn = FUNCTIONS[r.fwd_fmt]
    hx, hw = (histories[0], histories[2]) if histories is not None else (None, None)
    y = xt = w_stat = None
    if want_xt:
        y, xt, w_stat = fn.forward_gemm_and_xt(x2, w, r, out_dtype, hx, hw, w_state)
    if y is None:
        y = fn.forward_gemm(x2, w, r, out_dtype, hx)
    if bias is not None:
        y = y + bias.to(y.dtype)
    if want_xt and xt is None:  # (a delayed fp8 forward per tensor has its backward per tensor: xt came with it)
        xt = _save_x_for_dw(x2, r, hx)
    return y.to(out_dtype), xt, w_stat


def lowbit_backward(g2, w, xt: Operand | None, w_stat, r: Recipe, need_dx: bool, need_dw: bool, need_db: bool,
                    x_dtype: torch.dtype, histories=None):
    """(dx2, dW, db), None where not needed: the backward GEMMs of the recipe; dW needs the saved xᵀ.
    ``histories``: as lowbit_forward's (dy's is taken here, and W's where the forward left no statistic)."""
    need_dw = need_dw and xt is not None
    with _autocast_off(g2.device.type):
        fn = FUNCTIONS[r.fwd_fmt]
        dw_dtype = w.dtype
        # a factor follows (the DGE): dW in fp32, except from the row-wise CUDA GEMM, which writes bf16 whatever
        # it is asked for (operands.gemm), so asking for fp32 would only add a cast and twice the bytes to read
        if fn.has_weight_grad_factor(r) and not (use_kernels(g2) and r.backward_granularity == "row"):
            dw_dtype = torch.float32
        dx, dw = _fp8_backward(g2, w, xt, r, need_dx, need_dw, x_dtype, dw_dtype, w_stat,
                     *(histories[1:] if histories is not None else (None, None)))
        if dw is not None:
            dw = fn.finish_weight_grad(dw, w, r)
        if dx is not None:
            dx = dx.to(x_dtype)
        db = g2.sum(0, dtype=torch.float32).to(w.dtype) if need_db else None
    return dx, dw, db


class Fp8LinearFunction(_LowBitLinearFunction):
    @staticmethod
    def forward_gemm(x2, w, r, out_dtype, hx=None):
        wq = gathered_operand(w)
        wq = quantize(w, r.specs.w) if wq is None else wq
        return gemm(quantize(x2, r.specs.x, history=hx), wq, out_dtype, r.fast_accum)

    @staticmethod
    def forward_gemm_and_xt(x2, w, r, out_dtype, hx=None, hw=None, w_state=None):
        if r.backward_granularity != r.granularity:
            return None, None, None
        # the small weight first (its kernels are short: the host issues x's behind them), keeping what its
        # transposed copy in backward takes its scales from (per row the column maxima: one pass; per tensor the
        # absmax its scale came from, delayed or current: no absmax pass), then x for the forward and xᵀ for dW,
        # in two passes over x
        s = r.specs
        wq = gathered_operand(w)  # arrived in FP8, scaled by its own absmax (nn/fp8_all_gather.py)
        if wq is None and w_state is not None and s.w_kept.scaling == "delayed":
            wq = quantize_weight_prev(w, s.w_kept.fmt, padded(w.shape[1], s.w_kept.pad_to), w_state)
        elif wq is None:
            wq = quantize(w, s.w_kept, history=hw)
        xq, xt = quantize_pair(x2, s.x, s.xt, history=hx)
        return gemm(xq, wq, out_dtype, r.fast_accum), xt, wq.amax


class Fp4LinearFunction(_LowBitLinearFunction):
    """E2M1 forward with outlier clamping (OCC), DGE on the weight gradient; backward GEMMs in FP8."""

    @staticmethod
    def forward_gemm(x2, w, r, out_dtype, hx=None):
        resid = None
        if r.occ_alpha is not None:
            x2, resid = occ_split(x2, r.occ_alpha, r.occ_sample)
        xq, wq = quantize(x2, r.specs.x), quantize(w, r.specs.w)
        if resid is None:
            return gemm(xq, wq, out_dtype)
        # the clamped-off outliers, in fp32 against the unquantized weight
        return (gemm(xq, wq) + residual_matmul(resid, w)).to(out_dtype)

    @staticmethod
    def forward_gemm_and_xt(x2, w, r, out_dtype, hx=None, hw=None, w_state=None):
        # per-row E2M1 without outlier clamping (fp4): the fused 4-bit path
        if r.occ_alpha is not None or r.granularity != "row":
            return None, None, None
        return _fp4_forward_and_xt(x2, w, r, out_dtype)

    @staticmethod
    def has_weight_grad_factor(r):
        return r.dge_k is not None

    @classmethod
    def finish_weight_grad(cls, dw, w, r):
        """On CUDA (per-row or per-tensor scales) one fused pass: kernels/dge.py; the torch reference otherwise."""
        if r.dge_k is not None and use_kernels(w) and w.dim() == 2:
            from ..kernels.dge import dge_scale_grad
            # the forward's scale of W: per row the kernel takes it from W's rows itself; per tensor its absmax
            scale = None if r.granularity == "row" else absmax_scale(tensor_amax(w), E2M1)
            return dge_scale_grad(dw, w, scale, r.dge_k, r.dge_cap, w.dtype)
        return super().finish_weight_grad(dw, w, r)

    @staticmethod
    def weight_grad_factor(w, r):
        if r.dge_k is None:
            return None
        q = quantize(w, r.specs.w)  # only for its scale: v = w / scale, as quantized
        v = w.float() / q.scale
        return dge_derivative(v, r.dge_k, r.dge_cap)


class Int4LinearFunction(_LowBitLinearFunction):
    """INT4 (-7..7) after a block-diagonal Hadamard along in-features; it cancels in the product."""

    @staticmethod
    def forward_gemm(x2, w, r, out_dtype, hx=None):
        wq = quantize(w, r.specs.w)  # the small weight first: the host issues x's behind it
        return gemm(quantize(x2, r.specs.x), wq, out_dtype)


FUNCTIONS = {"e4m3": Fp8LinearFunction, "e2m1": Fp4LinearFunction, "int4_sym": Int4LinearFunction,
             "int4": Int4LinearFunction}


def lowbit_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
                  out_dtype: torch.dtype | None = None, histories=None,
                  weight_state: torch.Tensor | None = None) -> torch.Tensor:
    """The functional form: y = x Wᵀ + b with the recipe's low-bit GEMMs, forward and backward.

    ``histories``: (x's, dy's, W's) nn.delayed.AmaxHistory, which a recipe with scaling="delayed" needs to train
    (LowBitLinear keeps them); ignored by other recipes. Without grad (evaluation) a delayed recipe without
    histories scales as current scaling does. Under torch.compile the histories are not used: x's and dy's
    scales are current (Inductor fuses the absmax into the ops around it), and W's comes from ``weight_state``
    (nn/weight_scale.py: its previous absmax, kept on the device; LowBitLinear passes it where its
    previous_weight_scale is set) where one is given, else from its own absmax.

    Eager: an autograd Function with lpoptim's Triton quantizers. Under torch.compile the fp8 recipes trace the
    same Function through the reference's torch ops (Inductor generates and fuses the quantizers; its fp32
    division may differ from the correctly rounded one by an ulp, moving a code at a rounding boundary), the
    others call the custom ops of nn/compiled.py, which Dynamo and Inductor treat as opaque."""
    if out_dtype is None:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    # compiled: the fp8 recipes are traced (reference torch ops that Inductor fuses with their neighbours, no
    # Python launches); the others run as opaque custom ops. torch 2.11's Dynamo fails an assertion when it
    # retraces the Function with feature dims made symbolic (one compiled function seeing several layer widths);
    # torch 2.13 does not (tests/test_linear_compile.py)
    if recipe.scaling != "delayed":
        histories = weight_state = None
    if torch.compiler.is_compiling():
        histories = None  # current scaling (see above)
        if recipe.fwd_fmt != "e4m3":
            from .compiled import lowbit_linear_op
            return lowbit_linear_op(x, weight, bias, recipe, out_dtype)
    elif recipe.scaling == "delayed" and histories is None and torch.is_grad_enabled():
        raise ValueError(f"recipe {recipe.name!r} uses delayed scaling, which keeps per-layer state: use "
                         "LowBitLinear (or convert_linears), or pass histories=")
    else:
        weight_state = None  # eager: W's history
    if histories is not None and len(histories) != 3:
        raise ValueError(f"histories: (x's, dy's, W's) AmaxHistory, got {len(histories)}")
    fn = FUNCTIONS[recipe.fwd_fmt]
    with _autocast_off(x.device.type):
        return fn.apply(x, weight, bias, recipe, out_dtype, torch.is_grad_enabled(), histories, weight_state)
