"""FSDP2 all-gathers of low-bit linears' weights in FP8: half the bytes of bf16 on the wire, and no cast after.

FSDP2 gathers each unit's weights before its forward and again before its backward, in the parameters' dtype (2
bytes an element for bf16). A low-bit linear whose forward is E4M3 per tensor (fp8_tensor, fp8_tensor_fast,
fp8_delayed) then casts the whole gathered weight to E4M3 by its absmax, and again, transposed, for the backward.
With ``fp8_all_gather(model)`` each rank casts its own shard instead, by the absmax of the whole weight (the shards'
maxima, all-reduced at the start of the model's forward), and the all-gather carries the E4M3 values.
The layer takes them as they are (nn/gathered_weight.py): the values it would have cast from the gathered weight.

Where that differs from gathering bf16:
- eager layers with delayed scaling (fp8_delayed) scale such a W by its own absmax (current scaling; compiled
  layers always do), and ``previous_weight_scale`` is not used for it;
- code other than the layer's forward that reads the gathered weight (a layer under its ``min_tokens``, running
  nn.Linear's forward) gets the dequantized E4M3 weight, not the bf16 one.

The absmaxes are taken by ``model``'s forward pre-hook: a unit gathered outside the model's forward and backward
after an optimizer step (an explicit ``unit.unshard()``) takes the last forward's, where a weight grown past it
saturates at E4M3's largest value.

Only weights held by one layer (not tied), sharded on dim 0 (FSDP2's default), on the ranks' devices (no CPU
offload) and resharded after forward with the whole mesh (``reshard_after_forward`` True or False) are gathered in
FP8; the others as before. FSDP2's extension hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, which
torchao's float8 all-gather uses on a weight subclass) are set on each weight's local shard, a plain tensor: the
optimizer, checkpoints and everything else see the parameters unchanged. FSDP2 replaces a local shard only when
a parameter is reassigned (``load_state_dict(assign=True)``, ``to_empty``); the model's forward pre-hook sets the
hooks again there.
"""
from __future__ import annotations

import inspect
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from ..formats import E4M3
from ..kernels.grid import interpreted
from ..quant import absmax_scale
from .convert import is_fsdp_unit
from .gathered_weight import GatheredFp8Weight
from .linear import LowBitLinear
from .operands import quantize, tensor_amax
from .recipes import Recipe


def gathers_in_fp8(recipe: Recipe) -> bool:
    """Whether a layer of this recipe can take its weight gathered in FP8: E4M3 per tensor, forward and backward
    (so that one scale serves W and Wᵀ)."""
    return (recipe.fwd_fmt == "e4m3" and recipe.bwd_fmt == "e4m3" and recipe.granularity == "tensor"
            and recipe.backward_granularity == "tensor")


def _why_not(fp) -> str | None:
    """Why FSDP2's parameter ``fp`` is not gathered in FP8, or None where it is."""
    info = fp._module_info
    layer = info.module
    if not (isinstance(layer, LowBitLinear) and info.param_name == "weight"):
        return "not a low-bit linear's weight"
    if not gathers_in_fp8(layer.recipe):
        return f"recipe {layer.recipe.name} is not E4M3 per tensor"
    if info.shared_modules:
        return "shared with another module"
    if fp.is_dtensor:  # a DTensor parameter (tensor parallelism under FSDP2): its gathered weight is a DTensor too
        return "a DTensor parameter"
    post_forward = fp.post_forward_mesh_info  # the mesh itself, or None: resharded with the whole mesh, or kept
    if fp.fsdp_placement.dim != 0 or fp.offload_to_cpu or post_forward not in (None, fp.mesh_info):
        return "sharded other than FSDP2's default (dim 0, on the device, resharded with the whole mesh)"
    return None


_SCALE_STRIDE = 32  # fp32 elements: 128 bytes


class _Weights:
    """Every FP8-gathered weight of the model, by unit. Their absmaxes (and E4M3 scales) are taken at the start of
    each forward of the model, before any unit is gathered, with one all-reduce for them all: the weights change
    only between forwards (an optimizer step), and a collective per unit would queue on the communicator's stream
    behind the all-gathers and reduce-scatters in flight, holding each all-gather until they end. A unit's shards are cast together when FSDP2 asks for its first weight's all-gather
    input (on CUDA one launch: kernels/multi_cast.py); the hooks then return views. FSDP2 calls its hooks once per
    weight and gather, on the host (224 weights and 16 gathers a step for a 7B model): each must cost little."""

    def __init__(self, units: list[list], group):
        self.units, self.group = units, group
        self.fsdp_params = [fp for unit in units for fp in unit]
        # by place in the model's list: (its unit's index, its place in the unit)
        self.where = [(u, i) for u, unit in enumerate(units) for i in range(len(unit))]
        # None: not yet worked out (first, or after _attach: the shards' dtypes and addresses are read again); []:
        # the shards are cast one at a time; else one CastPlan per unit
        self.plans = self.amax = self.scale = self.ready = None
        self.cast = [None] * len(units)

    def _plan(self) -> None:
        """Whether the many-tensor kernels take the shards (on CUDA, and under Triton's interpreter, which tests them
        on the CPU; one dtype, one rounding, one the kernels make), and their tables where they do."""
        shards = [fp._sharded_local_tensor for fp in self.fsdp_params]
        # what FSDP2 gathers: the shard cast to the mixed-precision policy's param_dtype (None: as it is)
        roundings = {_param_dtype(fp) for fp in self.fsdp_params}
        self.round_to = next(iter(roundings)) if len(roundings) == 1 else None
        self.plans = []
        if ((shards[0].is_cuda or interpreted()) and len(roundings) == 1 and self.round_to in (None, torch.bfloat16)
                and len({t.dtype for t in shards}) == 1):
            from ..kernels.multi_cast import CastPlan, TensorTable
            self.table = TensorTable(shards)
            self.plans = [CastPlan(TensorTable([fp._sharded_local_tensor for fp in unit]),
                                   [fp.padded_sharded_param_size.numel() for fp in unit]) for unit in self.units]

    def take_all(self) -> None:
        if self.plans is None:
            self._plan()
        if self.plans:
            from ..kernels.multi_cast import absmax_many
            amax = absmax_many(self.table, self.round_to)
        else:
            amax = torch.stack([tensor_amax(_as_gathered(fp)) if fp._sharded_local_tensor.numel() else
                                torch.zeros((), dtype=torch.float32, device=fp._sharded_local_tensor.device)
                                for fp in self.fsdp_params])
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        # new tensors every forward (never written in place): a backward may still hold the last ones. Each scale
        # 128 bytes from the next: cuBLASLt refuses a scale pointer that is not aligned (NOT_SUPPORTED)
        scale = amax.new_zeros((len(self.fsdp_params), _SCALE_STRIDE))
        scale[:, 0] = absmax_scale(amax, E4M3)
        self.amax, self.scale = amax, scale[:, 0].unbind()
        self.cast = [None] * len(self.units)
        self.ready = torch.cuda.Event() if amax.is_cuda else None
        if self.ready is not None:
            self.ready.record()

    def input_of(self, k: int):
        """(The ``k``-th weight's all-gather input: its shard in E4M3, padded to FSDP2's padded shard rows; its
        scale)."""
        if self.amax is None:  # a unit run without the model's forward first
            self.take_all()
        (u, i), fp = self.where[k], self.fsdp_params[k]
        unit = self.units[u]
        if i == 0 or self.cast[u] is None:  # the unit's first weight: all of its shards cast now
            if self.ready is not None:  # (on the stream FSDP2 prepares the all-gather on)
                torch.cuda.current_stream().wait_event(self.ready)
            if self.plans:
                self.cast[u] = self.plans[u].cast(self.amax[k - i:k - i + len(unit)], self.round_to)
            else:
                self.cast[u] = [_cast_ref(f, self.amax[k - i + j]) for j, f in enumerate(unit)]
        if self.plans:
            plan = self.plans[u]
            values = self.cast[u][plan.starts[i]:plan.starts[i + 1]].view(fp.padded_sharded_param_size)
        else:
            values = self.cast[u][i]
        if i == len(unit) - 1:  # the last view taken: the buffer lives as long as FSDP2 holds the views
            self.cast[u] = None
        return values, self.scale[k]


def _param_dtype(fp) -> torch.dtype | None:
    """The dtype FSDP2 casts ``fp``'s shard to before gathering it (its policy's param_dtype), where that rounds;
    None where it gathers the shard's values as they are (FSDP2 sets its own attribute for this at its first
    forward, after the model's forward pre-hook has run)."""
    dtype, own = fp.mp_policy.param_dtype, fp.sharded_param.dtype
    if dtype is None or dtype == own or (dtype == torch.float32 and own in (torch.bfloat16, torch.float16)):
        return None  # no cast, or an exact one
    return dtype


def _as_gathered(fp) -> torch.Tensor:
    """The shard as FSDP2 would gather it: cast to the mixed-precision policy's param_dtype where it has one."""
    shard, dtype = fp._sharded_local_tensor, _param_dtype(fp)
    return shard if dtype is None else shard.to(dtype)


def _cast_ref(fp, amax) -> torch.Tensor:
    """One shard in E4M3 by ``amax``, zero-padded to FSDP2's padded shard rows, by quantize() (where the
    many-tensor kernel does not run: off CUDA, or shards of several dtypes or roundings)."""
    shard = fp._sharded_local_tensor
    values = shard.new_zeros(fp.padded_sharded_param_size, dtype=torch.float8_e4m3fn)
    if shard.numel():
        values[:shard.shape[0]] = quantize(_as_gathered(fp), fp._module_info.module.recipe.specs.w, amax=amax).values
    return values


class _PreAllGather:
    """The shard, cast to E4M3 by the whole weight's absmax: the all-gather's input (padded to FSDP2's padded
    shard rows); the scale travels as metadata."""
    # FSDP2 reads the hook's signature at every gather: given, not inspected
    __signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in
                                       ("mesh", "outer_size", "outer_stride", "module", "mp_policy")])

    def __init__(self, k: int, weights: _Weights):
        # held weakly: this hook is an attribute of the shard, which the model holds, and the garbage collector
        # does not look inside a tensor that C++ holds too, so a strong reference back to the model (through the
        # weights and their FSDPParams) would keep the whole model alive after the user let it go
        self.k, self.weights = k, weakref.ref(weights)

    def __call__(self, mesh, outer_size, outer_stride, module, mp_policy):
        weights = self.weights()
        if weights is None:
            raise RuntimeError("fp8_all_gather: the model whose forward takes these weights' absmaxes is gone; a unit "
                               "of it gathers in FP8 only while that model lives")
        values, scale = weights.input_of(self.k)
        # as bytes: a unit of E4M3 weights alone would otherwise be gathered in float8, which not every
        # communication backend takes (with other dtypes FSDP2 gathers bytes anyway)
        return (values.view(torch.uint8),), scale


    def __reduce__(self):
        # pickled as a tensor attribute when a local shard itself is saved (torch.save of a sharded state dict)
        raise TypeError("fp8_all_gather: this weight shard carries FSDP2 all-gather hooks, which do not pickle; "
                        "save a copy (t.clone()) or through torch.distributed.checkpoint")


class _PostAllGather:
    """The gathered E4M3 values as the unsharded parameter: a GatheredFp8Weight of the parameter's dtype."""

    def __call__(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (values,), scale = all_gather_outputs, metadata
        values = values.view(torch.float8_e4m3fn)
        if out is not None:  # FSDP2 refilled the storage of the values it holds; the scale is this gather's
            out._scale = scale
            return None
        return GatheredFp8Weight(values, scale, param_dtype), (values,)


_POST_ALL_GATHER = _PostAllGather()  # (it holds nothing: one for all)


def _attach(k: int, weights: _Weights) -> None:
    fp = weights.fsdp_params[k]
    shard = fp._sharded_local_tensor
    shard.fsdp_pre_all_gather = _PreAllGather(k, weights)
    shard.fsdp_post_all_gather = _POST_ALL_GATHER
    fp._init_extensions()
    fp.all_gather_outputs = []  # made again, in E4M3, by the next all-gather
    if hasattr(fp, "_unsharded_param"):  # a bf16 one from an earlier gather: the next is made from E4M3 values
        del fp._unsharded_param
    weights.plans = None  # the shards' addresses are read again


def fp8_all_gather(model: nn.Module) -> list[str]:
    """Have FSDP2 gather the weights of ``model``'s low-bit linears in FP8 (the module docstring says which and
    what changes). ``model``: the module whose forward each step runs (FSDP2's root), after ``fully_shard``, with
    every unit resharded (as after construction or a training step). Returns the qualified names of those layers."""
    if not is_fsdp_unit(model):
        raise ValueError("fp8_all_gather: call it on the model FSDP2's fully_shard was applied to last (the root, "
                         f"whose forward runs each step and takes the weights' absmaxes); {type(model).__name__} is "
                         "not an FSDP2 unit")
    names = {id(m): n for n, m in model.named_modules()}
    units, seen = [], set()
    for unit in model.modules():
        if not is_fsdp_unit(unit):
            continue
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; 2.11: one group a state
        for group in groups if groups is not None else [state._fsdp_param_group]:
            if group is None or id(group) in seen:
                continue
            seen.add(id(group))
            fps = [fp for fp in group.fsdp_params if _why_not(fp) is None]
            if fps:
                units.append(fps)
    fps = [fp for unit in units for fp in unit]
    if not fps:
        return []
    if any(isinstance(getattr(fp._sharded_local_tensor, "fsdp_pre_all_gather", None), _PreAllGather) for fp in fps):
        raise ValueError("fp8_all_gather: this model's weights are gathered in FP8 already")
    if any(fp.sharded_state.name != "SHARDED" for fp in fps):
        raise ValueError("fp8_all_gather: an FSDP2 unit holds its gathered weights now; call it with every unit "
                         "resharded (unit.reshard())")
    groups = {tuple(dist.get_process_group_ranks(fp.mesh_info.shard_process_group)) for fp in fps}
    if len(groups) > 1:
        raise ValueError("fp8_all_gather: the model's units shard over different meshes")
    weights = _Weights(units, fps[0].mesh_info.shard_process_group)
    for k in range(len(fps)):
        _attach(k, weights)
    model.register_forward_pre_hook(_BeforeForward(weights), prepend=True)
    return [names.get(id(fp._module_info.module), "?") for fp in fps]


class _BeforeForward:
    """The model's forward pre-hook, before FSDP2's own: the weights' absmaxes for this forward's gathers, and the
    hooks set again on a local shard FSDP2 replaced."""

    def __init__(self, weights: _Weights):
        self.weights = weights

    @torch.compiler.disable
    def __call__(self, module, args):
        # FSDP2 knows its root from the root's first forward, which runs before any other unit's
        if getattr(module._get_fsdp_state(), "_is_root", None) is False:
            raise RuntimeError("fp8_all_gather: applied to an FSDP2 unit that is not the root; apply it to the "
                               "root, whose forward runs first each step (units gathered before this one's forward "
                               "would take the last step's absmaxes)")
        for k, fp in enumerate(self.weights.fsdp_params):
            if not isinstance(getattr(fp._sharded_local_tensor, "fsdp_pre_all_gather", None), _PreAllGather):
                _attach(k, self.weights)
        self.weights.take_all()
