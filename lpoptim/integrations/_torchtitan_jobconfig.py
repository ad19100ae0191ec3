"""lpoptim in torchtitan 0.2 (its ``JobConfig``); imported by ``lpoptim.integrations.torchtitan``.

Importing this module (``--experimental.custom_import``) registers, in torchtitan's own registries:

- the model converter ``"lpoptim"`` (``--model.converters lpoptim``), applied where torchtitan applies float8:
  to the model built on the meta device, before activation checkpointing, compile and FSDP2. It swaps the
  ``nn.Linear`` layers for lpoptim's LowBitLinear (``--lpoptim.recipe``, default fp8_delayed; the output head
  stays in high precision) and wraps the decoder blocks with ``compress_activations`` (``--lpoptim.activations``);
- the train spec ``"llama3_lpoptim"`` (``--model.name llama3_lpoptim``): torchtitan's llama3 whose optimizer
  builder also knows ``--optimizer.name lpoptim.AdamW`` (torchtitan 0.2 picks optimizers by name in a fixed
  table; a train spec's ``build_optimizers_fn`` is its place for others). ``register_lpoptim_train_spec("qwen3")``
  does the same for another model.

``JobConfig`` here (``--job.custom_config_module``) adds the ``[lpoptim]`` section and ``optimizer.state_bits``,
``optimizer.bf16_stochastic_round`` to torchtitan's config.
"""

import dataclasses
from dataclasses import dataclass, field

import torch.nn as nn

from torchtitan.components.optimizer import OptimizersContainer, build_optimizers
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter
from torchtitan.protocols.train_spec import _extra_train_specs, get_train_spec, register_train_spec
from torchtitan.tools.logging import logger

from ..activations import ActivationPolicy, compress_activations
from ..nn.convert import convert_linears
from ..nn.recipes import DEFAULT_RECIPE, get_recipe
from ..optim import AdamW

__all__ = ["JobConfig", "LpoptimConverter", "build_lpoptim_optimizers", "register_lpoptim_train_spec"]

OPTIMIZER_NAME = "lpoptim.AdamW"


@dataclass
class Lpoptim:
    recipe: str = DEFAULT_RECIPE
    """lpoptim linear recipe (lpoptim.nn.RECIPES: fp8_delayed, fp8, fp8_tensor, fp4, int4, ...); "none" keeps the
    linears as they are."""

    filter_fqns: list[str] = field(default_factory=list)
    """Linears whose FQN contains one of these stay in high precision (the output head always does)."""

    activations: bool = True
    """Keep what autograd saves inside each decoder block in FP8 (lpoptim.compress_activations); replaces
    activation checkpointing (--activation_checkpoint.mode none)."""

    recompute: bool = False
    """FP8 activations with recompute: only block inputs saved, in FP8 (FP8 full activation checkpointing)."""


@dataclass
class Optimizer:  # merged into torchtitan's [optimizer] section
    state_bits: int = 8
    """lpoptim.AdamW: 8 (FP8 moments) or 4."""

    bf16_stochastic_round: bool = False
    """lpoptim.AdamW: round bf16 parameters' updates stochastically (for --training.dtype bfloat16)."""


@dataclass
class JobConfig:
    lpoptim: Lpoptim = field(default_factory=Lpoptim)
    optimizer: Optimizer = field(default_factory=Optimizer)


class LpoptimConverter:
    """torchtitan 0.2's ModelConverter protocol: ``__init__(job_config, parallel_dims)``, ``convert(model)``."""

    def __init__(self, job_config, parallel_dims):
        cfg = getattr(job_config, "lpoptim", None) or Lpoptim()  # defaults without the custom config module
        self.recipe = None if cfg.recipe in (None, "", "none") else cfg.recipe
        if self.recipe is not None:
            get_recipe(self.recipe)  # unknown recipes fail here
        self.filter_fqns = list(cfg.filter_fqns)
        self.activations = cfg.activations
        self.options = {"recompute": cfg.recompute}
        ActivationPolicy(**self.options)
        self.compile = False
        if self.activations:
            if job_config.activation_checkpoint.mode != "none":
                raise ValueError("lpoptim's FP8 activations replace activation checkpointing: "
                                 "set --activation_checkpoint.mode none (and --lpoptim.recompute for FP8 recompute: "
                                 "only block inputs kept, in FP8)")
            if job_config.compile.enable and "model" in job_config.compile.components:
                # torchtitan would wrap each block in torch.compile(fullgraph=True), which meets the FP8 wrapper
                # (run eagerly by design: it enters the saved-tensor hooks) as a graph break, an error under
                # fullgraph. The blocks are compiled inside the wrapper instead (compress_activations(compile=
                # True)), so torchtitan's block compile is taken out of compile.components; the loss keeps its.
                job_config.compile.components = [c for c in job_config.compile.components if c != "model"]
                self.compile = True
        logger.info(f"lpoptim: linears {self.recipe or 'unchanged'}, FP8 activations {self.activations}"
                    + (" (blocks compiled inside the wrapper)" if self.compile else ""))

    def convert(self, model: nn.Module) -> None:
        if self.recipe is not None:
            # convert_linears keeps the head ("output", "lm_head", ...), tied layers and dims not divisible by 16
            convert_linears(model, self.recipe, filter_fn=lambda m, fqn: not any(f in fqn for f in self.filter_fqns))
        if self.activations:
            layers = model.layers
            blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
            # one handle over all blocks: Dynamo guards on a handle's hooks (one per block would recompile each)
            model.lpoptim_activations = compress_activations(blocks, compile=self.compile, **self.options)

    def post_optimizer_hook(self, model) -> None:
        pass


def build_lpoptim_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    """torchtitan's ``build_optimizers``, with ``optimizer.name == "lpoptim.AdamW"`` also available."""
    if optimizer_config.name != OPTIMIZER_NAME:
        return build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    if optimizer_config.early_step_in_backward or (ft_manager is not None and ft_manager.enabled):
        raise NotImplementedError("lpoptim.AdamW in torchtitan: no early_step_in_backward or TorchFT container")
    # torchtitan's `implementation` (fused / foreach) names torch.optim's kernels; lpoptim.AdamW picks its own
    kwargs = {"lr": optimizer_config.lr, "betas": (optimizer_config.beta1, optimizer_config.beta2),
              "eps": optimizer_config.eps, "weight_decay": optimizer_config.weight_decay,
              "state_bits": getattr(optimizer_config, "state_bits", 8),
              "bf16_stochastic_round": getattr(optimizer_config, "bf16_stochastic_round", False)}
    return OptimizersContainer(model_parts, AdamW, kwargs)


def register_lpoptim_train_spec(model_name: str = "llama3") -> str:
    """Register ``<model_name>_lpoptim``: torchtitan's train spec of that model with lpoptim.AdamW available."""
    name = f"{model_name}_lpoptim"
    if name not in _extra_train_specs:
        register_train_spec(name, dataclasses.replace(get_train_spec(model_name),
                                                      build_optimizers_fn=build_lpoptim_optimizers))
    return name


if "lpoptim" not in _registry_model_converter_cls:  # registered once, whoever imports first
    register_model_converter(LpoptimConverter, "lpoptim")
register_lpoptim_train_spec("llama3")
