"""lpoptim in torchtitan >= 0.3 (its ``Configurable`` configs); imported by ``lpoptim.integrations.torchtitan``.

- ``LpoptimConverter`` is a torchtitan model converter, applied where torchtitan applies float8: to the model
  config, before the model is built, so parallelism, torch.compile and FSDP2 see lpoptim's modules as they
  see Float8Linear. It swaps ``Linear`` configs for ``LpoptimLinear`` (lpoptim's LowBitLinear, recipe
  ``fp8_delayed`` by default; the LM head stays in high precision) and wraps the decoder blocks with
  ``compress_activations`` (what autograd saves in them kept in FP8), one handle over all blocks.
- ``LpoptimOptimizersContainer`` is torchtitan's OptimizersContainer that also knows the optimizer name
  ``"lpoptim.AdamW"``; ``lpoptim_adamw()`` is its config with torchtitan's default_adamw hyperparameters.
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module
from torchtitan.tools.logging import logger

from ..activations import ActivationPolicy, compress_activations
from ..activations.wrap import _ATTR as _WRAPPED_FORWARD
from ..nn.linear import LowBitLinear, check_dims
from ..nn.recipes import DEFAULT_RECIPE, get_recipe
from ..optim import AdamW

__all__ = ["LpoptimConverter", "LpoptimLinear", "LpoptimOptimizersContainer", "lpoptim_adamw", "use_lpoptim",
           "llama3_8b_lpoptim", "llama3_debugmodel_lpoptim"]

OPTIMIZER_NAME = "lpoptim.AdamW"


class LpoptimLinear(LowBitLinear, Module):
    """lpoptim's LowBitLinear as a torchtitan Module: built from a ``Linear.Config``-compatible config (so
    torchtitan's sharding and parameter initialization treat it as a Linear), same ``weight`` / ``bias``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: str = DEFAULT_RECIPE
        """A name of lpoptim.nn.RECIPES."""

    def __init__(self, config: Config):
        LowBitLinear.__init__(self, config.in_features, config.out_features, bias=config.bias, recipe=config.recipe)


class LpoptimConverter(QuantizationConverter):
    """Low-bit linears and FP8 saved activations, as a torchtitan model converter (the model config tree)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str | None = DEFAULT_RECIPE
        """lpoptim linear recipe (lpoptim.nn.RECIPES: fp8_delayed, fp8, fp8_tensor, fp4, int4, ...); None keeps
        the linears as they are (FP8 activations only)."""

        filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
        """Linears whose FQN contains one of these stay in high precision (by default the LM head: its logits
        feed a softmax over the vocabulary). Layers with a dim not divisible by 16 always do."""

        activations: bool = True
        """Keep what autograd saves inside each decoder block in FP8 (lpoptim.compress_activations). Replaces
        activation checkpointing: set the trainer's ``activation_checkpoint`` to None."""

        activation_options: dict[str, Any] = field(default_factory=dict)
        """lpoptim.activations.ActivationPolicy fields, e.g. ``{"recompute": True}`` (only block inputs saved,
        in FP8; the block recomputed in backward: FP8 full activation checkpointing)."""

    def __init__(self, config: Config):
        self.config = config
        if config.recipe is not None:
            get_recipe(config.recipe)  # an unknown recipe fails here, not when the model is built
        ActivationPolicy(**config.activation_options)  # likewise for unknown activation options
        logger.info(f"lpoptim: linears {config.recipe or 'unchanged'}, FP8 activations {config.activations}")

    def convert(self, model_config):
        cfg = self.config
        if cfg.recipe is not None:
            tied = getattr(model_config, "enable_weight_tying", False)
            kept = []
            for fqn, lin, parent, attr in list(model_config.traverse(Linear.Config)):
                # exact type: subclasses (ScaledBiasRowwiseLinear, ...) have forwards of their own
                if type(lin) is not Linear.Config or any(f in fqn for f in cfg.filter_fqns):
                    continue
                if tied and fqn.rsplit(".", 1)[-1] == "lm_head":
                    continue  # shares its weight with the embedding
                try:
                    check_dims(lin.in_features, lin.out_features)
                except ValueError:
                    kept.append(fqn)
                    continue
                # every field of Linear.Config carried over (param_init, sharding_config, and any torchtitan adds)
                new = LpoptimLinear.Config(**_init_fields(lin), recipe=cfg.recipe)
                if parent is None:
                    model_config = new
                elif isinstance(parent, list):
                    parent[attr] = new
                else:
                    setattr(parent, attr, new)
            if kept:
                logger.warning("lpoptim: kept in high precision, dims not divisible by 16: " + ", ".join(kept))
        if cfg.activations:
            model_config = _fp8_activations_config(model_config, cfg.activation_options)
        return model_config


# FP8 activations. compress_activations wraps modules that exist, so it runs when the model is built: the root
# config is replaced by a subclass whose build() builds the model and then wraps its blocks (LoRA's converter
# replaces configs the same way). One handle over all blocks: Dynamo guards on a handle's hooks, so one handle
# per block would recompile each block and pass Dynamo's recompile limit.

_activation_classes: dict[tuple, type] = {}


def _fp8_activations_config(model_config, options: dict[str, Any]):
    base = type(model_config)
    key = (base, tuple(sorted(options.items())))
    cls = _activation_classes.get(key)
    if cls is None:
        def build(self, **kwargs):
            model = base.build(self, **kwargs)
            _wrap_blocks(model, dict(key[1]))
            return model

        # no new fields: the subclass only overrides build(); the options live on the class, so that
        # dataclasses.replace() (which Configurable.build uses) keeps them
        cls = type(f"Fp8Activations{base.__name__}", (base,), {"build": build, "__qualname__":
                                                                 f"Fp8Activations{base.__qualname__}"})
        _activation_classes[key] = cls
    return cls(**_init_fields(model_config))


def _init_fields(config) -> dict[str, Any]:
    """A config dataclass's constructor arguments, to build another config class from it."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def _wrap_blocks(model: nn.Module, options: dict[str, Any]) -> None:
    layers = model.layers
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    model.lpoptim_activations = compress_activations(blocks, **options)  # the handle: .record(), .remove()
    for b in blocks:
        b.compile = types.MethodType(_compile_inside_wrapper, b)
    model.register_forward_pre_hook(_refuse_checkpoint_wrappers)


def _compile_inside_wrapper(block: nn.Module, *args, **kwargs) -> None:
    """torchtitan compiles each block with ``block.compile(fullgraph=True)``, which compiles the module's call and
    would meet the wrapper (run eagerly by design: it enters the saved-tensor hooks) as a graph break, an error
    under fullgraph. Compile what the wrapper calls instead, with the same arguments: what
    ``compress_activations(..., compile=True)`` does (activations/wrap.py)."""
    wrapper = block.__dict__.get(_WRAPPED_FORWARD)
    if wrapper is None:  # no longer wrapped (handle.remove()): compile as torch would
        return nn.Module.compile(block, *args, **kwargs)
    wrapper.run = torch.compile(wrapper.original, *args, **kwargs)
    wrapper.compile = True


def _refuse_checkpoint_wrappers(model: nn.Module, args) -> None:
    # torchtitan wraps blocks for activation checkpointing after they are built; checkpointing's saved-tensor
    # hooks and the FP8 ones would nest (and compile would meet a graph break). Checked at every forward (a wrapper
    # added later is caught too): a type check per block, microseconds against a training step.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    if any(isinstance(m, CheckpointWrapper) for m in model.layers.children()):
        raise RuntimeError("lpoptim's FP8 activations replace activation checkpointing: set the trainer's "
                           "activation_checkpoint to None (--activation_checkpoint none); for FP8 recompute (only block "
                           "inputs kept, in FP8) also LpoptimConverter.Config(activation_options={'recompute': True})")


# The optimizer. torchtitan resolves ParamGroupConfig.optimizer_name in OptimizersContainer's
# _resolve_optimizer_factory; the subclass adds one name and defers to it for the others, so lpoptim.AdamW and
# torch's optimizers can share one container (e.g. some groups in torch's AdamW).

def _build_lpoptim_adamw(param_groups: list[dict[str, Any]], **kwargs) -> AdamW:
    # torchtitan writes its `implementation` (fused / foreach) into every group; those are torch.optim's
    # kernels. lpoptim.AdamW picks its own (the fused Triton step for CUDA tensors, fused=None): drop them.
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in param_groups]
    return AdamW(groups, **kwargs)


class LpoptimOptimizersContainer(OptimizersContainer):
    """torchtitan's OptimizersContainer, with ``optimizer_name="lpoptim.AdamW"`` also available."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == OPTIMIZER_NAME:
            return _build_lpoptim_adamw
        return OptimizersContainer._resolve_optimizer_factory(name)


def lpoptim_adamw(lr: float = 8e-4, **kwargs: Any) -> LpoptimOptimizersContainer.Config:
    """torchtitan's ``default_adamw`` with lpoptim.AdamW: one group over all parameters, betas (0.9, 0.95),
    eps 1e-8, weight decay 0.1; ``kwargs`` override those and take lpoptim's options (``state_bits=4``,
    ``bf16_stochastic_round=True`` for bf16 parameters, ``group_size``, ...)."""
    return LpoptimOptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name=OPTIMIZER_NAME,
        optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **kwargs})])


def use_lpoptim(config, *, recipe: str | None = DEFAULT_RECIPE, activations: bool = True,
                activation_options: dict[str, Any] | None = None, **adamw: Any):
    """A torchtitan ``Trainer.Config`` turned to lpoptim, in place (and returned): the converter on its model
    config, activation checkpointing off when FP8 activations are on, and lpoptim.AdamW with the
    hyperparameters of the config's AdamW groups (``adamw`` overrides them and takes lpoptim's options).
    ValueError, before anything changes, for a config that is lpoptim's already or has no AdamW group."""
    names = [g.optimizer_name for g in config.optimizer.param_groups]
    if OPTIMIZER_NAME in names or isinstance(config.optimizer, LpoptimOptimizersContainer.Config):
        raise ValueError("use_lpoptim: this config uses lpoptim.AdamW already (use_lpoptim would convert its blocks "
                         "a second time)")
    if "AdamW" not in names:
        raise ValueError(f"use_lpoptim: the config's optimizer has no AdamW parameter group to replace (its groups: "
                         f"{names}); set config.optimizer = lpoptim_adamw(...) and the converter yourself")
    spec = config.model_spec
    converter = LpoptimConverter.Config(recipe=recipe, activations=activations,
                                        activation_options=dict(activation_options or {}),
                                        model_compile_enabled=config.compile.enable
                                        and "model" in config.compile.components)
    spec.model = converter.build().convert(spec.model)
    if activations:
        config.activation_checkpoint = None
    groups = []
    for g in config.optimizer.param_groups:
        if g.optimizer_name == "AdamW":  # (a config with lpoptim's already was refused above)
            g = ParamGroupConfig(pattern=g.pattern, optimizer_name=OPTIMIZER_NAME,
                                 optimizer_kwargs={**g.optimizer_kwargs, **adamw})
        groups.append(g)
    old = config.optimizer
    config.optimizer = LpoptimOptimizersContainer.Config(
        param_groups=groups, implementation=old.implementation,
        optimizer_factory_kwargs_by_name=old.optimizer_factory_kwargs_by_name)
    return config


# Config registry entries: `--module lpoptim.integrations.torchtitan --config <name>` (torchtitan's ConfigManager
# imports the module and calls the function). torchtitan's own configs are imported here, when called.

def llama3_8b_lpoptim():
    """torchtitan's llama3_8b with fp8_delayed linears, FP8 activations (no activation checkpointing) and
    lpoptim.AdamW (FP8 states)."""
    from torchtitan.models.llama3.config_registry import llama3_8b
    return use_lpoptim(llama3_8b())


def llama3_debugmodel_lpoptim():
    """torchtitan's llama3_debugmodel, with lpoptim as in llama3_8b_lpoptim."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    return use_lpoptim(llama3_debugmodel())
