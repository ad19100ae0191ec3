"""convert_linears: swap a model's nn.Linear modules for low-bit ones, in place."""
from __future__ import annotations

import numbers
import warnings
from typing import Callable

import torch.nn as nn

from ..device import fp8_device_problem
from .linear import LowBitLinear, module_class
from .recipes import DEFAULT_RECIPE, Recipe, get_recipe

# Output heads stay in high precision by default: their logits feed a softmax over the vocabulary, and 4-bit
# logits cost far more quality than the one GEMM saves (the usual practice in FP8/FP4 training recipes).
DEFAULT_SKIP = ("lm_head", "output", "head", "classifier", "score")


def _embedding_weights(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


# The narrowest output a layer lpoptim.prepare converts beside a wide one: grouped-query attention's k and v
# projections (512 or 1024 out) read the input that q reads. Converted with it they ran 1.05x the bf16 GEMMs against
# 1.01x left in bf16 (HF Llama-3-8B's shape, compiled, 1 x 1536 tokens, one H100: one run, a gain near the 2-4%
# run-to-run spread), and 0.6 GiB lighter (docs/prepare.md). A mixture-of-experts router (a few outputs) stays.
MIN_OUT_FEATURES = 512


def wide_linears(module: nn.Module, features: int, unconverted: bool = False) -> list[nn.Linear]:
    """The nn.Linear layers of ``module`` that lpoptim.prepare's width threshold ``features`` takes (0: all), and its
    memory estimate counts as low-bit: those at least that wide in and out, and those beside one of these (the same
    parent module, an input as wide) with at least min(features, MIN_OUT_FEATURES) outputs: k and v beside q. An
    MLP's down projection in a narrow model (wide in, narrow out) is not taken. ``unconverted``: exactly nn.Linear
    layers only, and only those decide what is beside (a q converted by hand does not take k and v with it)."""
    named = [(n.rpartition(".")[0], m) for n, m in module.named_modules()
             if (type(m) is nn.Linear if unconverted else isinstance(m, nn.Linear))]
    wide = {id(m) for _, m in named if min(m.in_features, m.out_features) >= features}
    inputs = {(parent, m.in_features) for parent, m in named if id(m) in wide}
    out = min(features, MIN_OUT_FEATURES)
    return [m for parent, m in named
            if id(m) in wide or ((parent, m.in_features) in inputs and m.out_features >= out)]


def width_label(features: int) -> str:
    """wide_linears' threshold in words."""
    out = min(features, MIN_OUT_FEATURES)
    beside = f" (or {out:,} out beside such a layer)" if out < features else ""  # else nothing more is taken
    return f"{features:,} wide in and out{beside}"


def has_wide_linear(module: nn.Module, features: int) -> bool:
    """Whether ``module`` holds an nn.Linear not yet converted (exactly that type) that wide_linears takes."""
    return bool(wide_linears(module, features, unconverted=True))


def is_fsdp_unit(module: nn.Module) -> bool:
    """FSDP2's fully_shard made this module one of its units (its class became FSDP<Class>(FSDPModule, Class))."""
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


def fsdp_held(model: nn.Module) -> set[str]:
    """The qualified names (in ``model``) of the modules an FSDP2 unit holds: the units and everything below them.
    fully_shard keeps these module objects and swaps their parameters (sharded DTensors, gathered tensors around
    forward and backward), so they are converted in place, never replaced."""
    units = [name for name, m in model.named_modules() if is_fsdp_unit(m)]
    return {name for name, _ in model.named_modules()
            if any(u == "" or name == u or name.startswith(u + ".") for u in units)}


def _dtensor_problem(fqn: str, linear: nn.Linear, held: set[str]) -> str | None:
    """Why a layer with a DTensor weight cannot be low-bit, or None: only FSDP2's (and HSDP's) shards can, which
    fully_shard gathers whole around forward and backward (one Shard(0) placement, the others Replicate); a
    tensor-parallel weight would reach the FP8 GEMM as a DTensor."""
    w = linear.weight
    if not hasattr(w, "device_mesh"):
        return None
    shards = [p for p in w.placements if not p.is_replicate()]
    if fqn not in held or len(shards) > 1 or (shards and not shards[0].is_shard(dim=0)):
        return (f"{fqn or 'the module'}: its weight is a DTensor placed {tuple(w.placements)}, not a shard that an "
                "FSDP2 unit within the module given gathers whole (tensor parallelism?); only layers that fully_shard "
                "holds, sharded along dim 0, can be low-bit (convert the module fully_shard was applied to, or "
                "convert before sharding)")
    return None


def conversion_targets(model: nn.Module, filter_fn: Callable[[nn.Module, str], bool] | None = None,
                       skip: tuple[str, ...] = DEFAULT_SKIP, skip_tied: bool = True):
    """The layers convert_linears would convert (its docstring says which): (their qualified names, those kept for
    their odd dims, the names an FSDP2 unit holds). ValueError where a DTensor weight cannot be low-bit."""
    tied = _embedding_weights(model) if skip_tied else set()
    todo, odd, held = [], [], fsdp_held(model)
    for fqn, mod in model.named_modules():
        if type(mod) is not nn.Linear:  # exact type: already converted layers and other subclasses are left
            continue
        if fqn.rsplit(".", 1)[-1] in skip or id(mod.weight) in tied:
            continue
        if filter_fn is not None and not filter_fn(mod, fqn):
            continue
        if mod.in_features % 16 or mod.out_features % 16:
            odd.append(f"{fqn} ({mod.in_features}->{mod.out_features})")
            continue
        problem = _dtensor_problem(fqn, mod, held)
        if problem:
            raise ValueError(problem)
        todo.append(fqn)
    return todo, odd, held


def convert_linears(model: nn.Module, recipe: str | Recipe = DEFAULT_RECIPE, *,
                    filter_fn: Callable[[nn.Module, str], bool] | None = None,
                    skip: tuple[str, ...] = DEFAULT_SKIP, skip_tied: bool = True, previous_weight_scale: bool = False,
                    min_tokens: int = 0, **recipe_overrides) -> nn.Module:
    """Replace every nn.Linear of ``model`` (in place) by a LowBitLinear running ``recipe``; returns ``model``.

    recipe: a name of lpoptim.nn.RECIPES (default "fp8_delayed": fp8 scaled per tensor from recent absmax values)
      or a Recipe; keyword overrides change its fields (e.g. ``hadamard_block=64``, ``occ_alpha=None``).
    Kept in high precision: layers whose last name component is in ``skip`` (the LM head), layers whose weight
      is shared with an nn.Embedding when ``skip_tied`` (a tied head), and layers with a feature dim not divisible
      by 16 (with a warning). Embeddings are not Linear and are never touched.
    filter_fn(module, fqn) -> bool: when given, a layer is converted only if it also returns True.
    previous_weight_scale: set on the converted layers (LowBitLinear says what it does, and where it pays).
    min_tokens: an input of fewer tokens (rows, all leading dims together) runs nn.Linear's own forward instead
      (LowBitLinear.min_tokens says why); 0, the default: every call low-bit.
    Parameters are shared, not copied: an optimizer built before the conversion still holds the right tensors.
    A layer that FSDP2's fully_shard holds (it keeps the module and swaps its weight, a sharded DTensor, for the
    gathered one around forward and backward) is converted in place (LowBitLinear.adopt): the same module object,
    now of the low-bit class. A DTensor weight that FSDP2 does not gather whole (tensor parallelism) is refused
    (ValueError) before any layer changes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_linears takes an nn.Module, got {type(model).__name__}")
    recipe = get_recipe(recipe, **recipe_overrides)  # TypeError / ValueError before anything is touched
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, numbers.Integral) or min_tokens < 0:
        raise ValueError(f"convert_linears: min_tokens is an int >= 0, got {min_tokens!r}")
    cls = module_class(recipe)
    try:  # every layer checked before any changes
        todo, odd, held = conversion_targets(model, filter_fn, skip, skip_tied)
    except ValueError as e:
        raise ValueError(f"convert_linears: {e}") from None
    problem = fp8_device_problem((model.get_submodule(fqn).weight for fqn in todo), "low-bit linear layers")
    if problem:
        raise ValueError(f"convert_linears: {problem}")
    if odd:
        warnings.warn("kept in high precision, feature dims not divisible by 16: " + ", ".join(odd), stacklevel=2)
    for fqn in todo:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if fqn in held:  # fully_shard holds this very module (its weight sharded, or gathered right now)
            layer = cls.adopt(linear, recipe)
        else:
            layer = cls.from_linear(linear, recipe)
            setattr(parent, child, layer)
        layer.previous_weight_scale = previous_weight_scale
        layer.min_tokens = int(min_tokens)
    return model


def converted(model: nn.Module) -> dict[str, str]:
    """{fqn: recipe name} of the low-bit layers in ``model``."""
    return {n: m.recipe.name for n, m in model.named_modules() if isinstance(m, LowBitLinear)}
