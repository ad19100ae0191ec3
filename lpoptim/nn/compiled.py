"""The low-bit linear layer as two torch custom ops, for torch.compile.

Dynamo cannot trace the eager autograd Function's Python (Triton launches, operand dataclasses, fallbacks), so
under compilation lowbit_linear calls ``lpoptim::lowbit_linear`` (forward: y and the saved xᵀ operand) and its
registered backward ``lpoptim::lowbit_linear_backward``: opaque ops with fake (meta) implementations giving
their outputs' shapes, so Inductor compiles and schedules everything around them. The arithmetic is the eager
path's (functional.lowbit_forward / lowbit_backward); only the 4-bit recipes come here (the fp8 ones are traced),
and the ops do not carry W's statistic (fp4's absmax) to the backward, which takes it again.

Recipes are frozen dataclasses, which custom ops cannot take: they travel as ``Recipe.key`` (their repr), read
back from recipes.BY_KEY.
"""
from typing import Optional

import torch

from ..formats import container_dtype
from .functional import _flat, lowbit_backward, lowbit_forward
from .operands import Operand, padded
from .recipes import BY_KEY, Recipe

def xt_layout(tokens, in_features, r: Recipe) -> tuple:
    """(values shape, values dtype, scale shape) of the xᵀ operand the forward saves for dW."""
    spec = r.specs.xt
    scale = (in_features, 1) if spec.granularity == "row" else ()
    return (in_features, padded(tokens, spec.pad_to)), container_dtype(spec.fmt), scale


@torch.library.custom_op("lpoptim::lowbit_linear", mutates_args=())
def _forward_op(x2: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], recipe: str, out_dtype: torch.dtype,
                want_xt: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, xt, _w_stat = lowbit_forward(x2, w, bias, BY_KEY[recipe], out_dtype, want_xt)
    if xt is None:
        return y, x2.new_empty(0, dtype=torch.float8_e4m3fn), x2.new_empty(0, dtype=torch.float32)
    return y, xt.values, xt.scale


@_forward_op.register_fake
def _(x2, w, bias, recipe, out_dtype, want_xt):
    y = x2.new_empty((x2.shape[0], w.shape[0]), dtype=out_dtype)
    if not want_xt:
        return y, x2.new_empty(0, dtype=torch.float8_e4m3fn), x2.new_empty(0, dtype=torch.float32)
    shape, dtype, scale = xt_layout(x2.shape[0], x2.shape[1], BY_KEY[recipe])
    return y, x2.new_empty(shape, dtype=dtype), x2.new_empty(scale, dtype=torch.float32)


@torch.library.custom_op("lpoptim::lowbit_linear_backward", mutates_args=())
def _backward_op(g2: torch.Tensor, w: torch.Tensor, xt_values: torch.Tensor, xt_scale: torch.Tensor, recipe: str,
                 need_dx: bool, need_dw: bool, need_db: bool, x_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xt = Operand(xt_values, xt_scale) if need_dw else None
    dx, dw, db = lowbit_backward(g2, w, xt, None, BY_KEY[recipe], need_dx, need_dw, need_db, x_dtype)
    empty = g2.new_empty(0)
    return (empty if dx is None else dx), (empty if dw is None else dw), (empty if db is None else db)


@_backward_op.register_fake
def _(g2, w, xt_values, xt_scale, recipe, need_dx, need_dw, need_db, x_dtype):
    empty = g2.new_empty(0)
    return (g2.new_empty((g2.shape[0], w.shape[1]), dtype=x_dtype) if need_dx else empty,
            w.new_empty(w.shape) if need_dw else empty,
            w.new_empty(w.shape[0]) if need_db else empty)


def _setup_context(ctx, inputs, output):
    x2, w, bias, recipe, _out_dtype, want_xt = inputs
    _y, xt_values, xt_scale = output
    ctx.save_for_backward(w, xt_values, xt_scale)
    ctx.recipe, ctx.x_dtype, ctx.has_bias, ctx.want_xt = recipe, x2.dtype, bias is not None, want_xt


def _backward(ctx, gy, _g_values, _g_scale):
    w, xt_values, xt_scale = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    need_dw, need_db = need_dw and ctx.want_xt, need_db and ctx.has_bias
    dx, dw, db = torch.ops.lpoptim.lowbit_linear_backward(gy, w, xt_values, xt_scale, ctx.recipe, need_dx, need_dw,
                                                          need_db, ctx.x_dtype)
    return (dx if need_dx else None), (dw if need_dw else None), (db if need_db else None), None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def lowbit_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: Recipe,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """functional.lowbit_linear through the custom ops (what it calls under torch.compile)."""
    want_xt = torch.is_grad_enabled() and weight.requires_grad
    with torch.autocast(x.device.type, enabled=False):
        y, _values, _scale = _forward_op(_flat(x), weight, bias, recipe.key, out_dtype, want_xt)
    return y.reshape(*x.shape[:-1], weight.shape[0])
