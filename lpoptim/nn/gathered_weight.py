"""A weight that arrives already in FP8: what an FP8 all-gather (nn/fp8_all_gather.py) gives a low-bit linear.

``GatheredFp8Weight`` is a tensor subclass with the parameter's shape and dtype (bf16, say) holding E4M3 values and
their per-tensor scale. The low-bit layer reads it as its W operand (no cast) and, transposed, as the backward's Wᵀ
(the same scale: per tensor, Wᵀ's absmax is W's), so its arithmetic is what it would have done with the bf16
weight. Everything else that reads it (a layer below ``min_tokens`` running nn.Linear's forward, a print) sees the
dequantized weight: each op other than the views FSDP2 makes runs on ``values * scale`` in the reported dtype; an op
that would write into it raises.
Traceable (``__tensor_flatten__``): torch.compile takes it as a graph input made of its inner tensors.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ..kernels.grid import interpreted
from ..kernels.transpose import transpose_bytes
from .operands import Operand, gemm

aten = torch.ops.aten
# the ops that keep it FP8: FSDP2 makes the unsharded parameter with as_strided, nn.Parameter detaches it
_VIEWS = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default}


class GatheredFp8Weight(torch.Tensor):
    """``values`` (N, K) float8_e4m3fn, contiguous; ``scale`` 0-dim fp32 (values * scale is the weight);
    ``dtype``: the dtype it reports (the parameter's)."""

    @staticmethod
    def __new__(cls, values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, values.shape, strides=values.stride(),
                                                   storage_offset=values.storage_offset(), dtype=dtype,
                                                   device=values.device, requires_grad=False)

    def __init__(self, values, scale, dtype):
        self._values, self._scale = values, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self):
        return ["_values", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return GatheredFp8Weight(inner["_values"], inner["_scale"], dtype)

    def __repr__(self):
        return f"GatheredFp8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self._scale})"

    def dequantize(self) -> torch.Tensor:
        return (self._values.float() * self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:
            w = args[0]
            return GatheredFp8Weight(func(w._values, *args[1:], **kwargs), w._scale, w.dtype)
        if _writes_into_it(func, args, kwargs):  # into a dequantized copy: the write would be lost
            raise RuntimeError(f"{func} writes into a weight gathered in FP8, which is read-only "
                               "(lpoptim.nn.fp8_all_gather)")
        args, kwargs = tree_map_only(GatheredFp8Weight, GatheredFp8Weight.dequantize, (args, kwargs))
        return func(*args, **kwargs)


def _writes_into_it(func, args, kwargs) -> bool:
    """Whether ``func`` writes into an argument that is a GatheredFp8Weight (reading one into a plain tensor,
    ``out.copy_(w)``, is fine)."""
    if not func._schema.is_mutable:
        return False
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, GatheredFp8Weight) and arg.alias_info is not None and arg.alias_info.is_write:
            return True
    return False


def gathered_operand(w) -> Operand | None:
    """W's forward operand where ``w`` arrived in FP8 (its values and scale; no absmax: the backward takes Wᵀ
    from the same values, gathered_dx); None for any other weight."""
    if not isinstance(w, GatheredFp8Weight):
        return None
    return Operand(w._values, w._scale)


def gathered_dx(gq: Operand, w, out_dtype: torch.dtype) -> torch.Tensor | None:
    """dx = dy W for the backward where ``w`` arrived in FP8, from dy's operand ``gq``: one GEMM with Wᵀ, W's values
    transposed under the same scale (what quantizing Wᵀ per tensor with W's absmax gives). None where ``w`` is any
    other weight. Compiled, it is one op of the graph: as a node of its own, the transposed copy (consumed by a
    GEMM) was computed in the forward and saved for the backward by Inductor's partitioner, a second FP8 copy of
    each gathered weight held from forward to backward, where FSDP2 frees the gathered W and gathers it again."""
    if not isinstance(w, GatheredFp8Weight):
        return None
    # (eager: the function itself, without the dispatcher's cost)
    op = torch.ops.lpoptim.gemm_by_transposed.default if torch.compiler.is_compiling() else _gemm_by_transposed
    return op(gq.values, gq.scale, w._values, w._scale, out_dtype)


def _gemm_by_transposed(a_values, a_scale, b_values, b_scale, out_dtype):
    """a (M, N) @ b (N, K): gemm's a against bᵀ, transposed here (gemm takes both with the contraction dim last;
    on CUDA by a tiled kernel: torch's strided copy of one-byte elements is uncoalesced on one side)."""
    bt = transpose_bytes(b_values.contiguous()) if b_values.is_cuda or interpreted() else b_values.t().contiguous()
    return gemm(Operand(a_values, a_scale), Operand(bt, b_scale), out_dtype)


# defined through torch.library.Library rather than custom_op: a compiled backward calls it once per weight, and
# custom_op's Python wrapper costs the host several times what this does per call
_LIB = torch.library.Library("lpoptim", "FRAGMENT")
_LIB.define("gemm_by_transposed(Tensor a_values, Tensor a_scale, Tensor b_values, Tensor b_scale, "
            "ScalarType out_dtype) -> Tensor")
_LIB.impl("gemm_by_transposed", _gemm_by_transposed, "CompositeExplicitAutograd")


@torch.library.register_fake("lpoptim::gemm_by_transposed")
def _(a_values, a_scale, b_values, b_scale, out_dtype):
    return a_values.new_empty((a_values.shape[0], b_values.shape[1]), dtype=out_dtype)
