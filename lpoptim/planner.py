"""``lpoptim.prepare(model)``: what pays on this device, applied to the user's model in one call.

    opt = lpoptim.prepare(model, lr=1e-4, weight_decay=0.1)   # model changed in place; an lpoptim.AdamW back
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

The parts, each chosen automatically ("auto") or by the caller (a value, or False/None to refuse it):

- the optimizer: lpoptim.AdamW over the parameters that require gradients (keyword arguments pass through);
  bf16 parameters are updated with stochastic rounding (no fp32 master copy, no lost updates).
- ``blocks``: the stack of repeated blocks (an ``nn.ModuleList`` or ``nn.Sequential``, or the name of one, e.g.
  "model.layers"; "" for a model that is itself a Sequential of blocks); found automatically as the largest
  ModuleList of one module class (HF transformers decoders and encoders).
- ``linears``: the blocks' nn.Linear layers run their GEMMs in FP8 (a ``convert_linears`` recipe). Auto: the
  default recipe where the blocks are compiled on a GPU with FP8 tensor cores (compute capability >= 8.9), none
  elsewhere: eager FP8 linears spend more host time quantizing than their GEMMs save. ``linears_min_features``:
  only layers that wide (nn.convert.wide_linears: in and out, or 512 out beside such a layer, as GQA's k and v) are
  converted; ``linears_min_tokens``: a call of fewer tokens (one
  forward's batch x sequence length on this device) runs nn.Linear's own forward (``LowBitLinear.min_tokens``): a
  weight's quantization costs the same at any batch, the GEMMs' savings shrink with it and with the width. Auto
  uses ``LINEARS_MIN_FEATURES`` and ``LINEARS_MIN_TOKENS`` (measured: below), and converts none with ``tokens``
  under the latter; a recipe named uses 0 and 0 (every layer of the blocks, low-bit at any batch) unless given.
  On a GPU without FP8 conversions (compute capability below 8.9: lpoptim/device.py) FP8 activations and low-bit
  linears are left out, and refused (ValueError, before any change) where asked for.
- ``activations``: "fp8" (what the blocks save for backward kept in FP8, attention's q, k, v and output as they
  are), "fp8_attention" (those in FP8 too: ``compress_activations(attention="fp8")``), "recompute" (only each
  block's input kept, in FP8; blocks recomputed in backward), a number in (0, 1) (compiled blocks only: Inductor
  keeps that fraction of what the block would save and recomputes the rest, ``activation_memory_budget``, set for
  these blocks alone) or None. Auto: None unless the memory budget needs it; then FP8 activations, FP8 with
  attention's, then (``offload``, below) the activations kept with blocks offloaded, then (compiled) budgets of
  0.5 and 0.3, then recompute: fastest first (docs/prepare.md has their costs on HF Llama shapes).
- ``offload``: what the first that many blocks save for backward is moved to pinned host memory during the forward
  and back ahead of their backward (``offload_activations``, activations/offload.py), with the activations kept as
  they are (or Inductor's budget); CUDA, one device, not with CUDA graphs, FSDP2 or HF gradient checkpointing.
  Auto: none unless the memory budget needs it; then a rung of the ladder after FP8 activations with attention's
  and before Inductor's budgets: the fewest blocks whose estimate fits, up to ``MAX_OFFLOAD_FRACTION`` of them.
- ``compile``: each block compiled in place (``block.compile()``; with FP8 activations or recompute, the block's
  forward, which their wrapper calls: parameter names and state_dict unchanged).
  Auto: on CUDA.
- ``previous_weight_scale``: fp8_delayed linears in compiled blocks on one CUDA device scale W by its previous
  absmax, kept on the device (nn/weight_scale.py: one read of W in forward instead of two). Each block must run
  once a step: not with recompute, HF gradient checkpointing or checkpoint-wrapped modules (a block that calls
  torch.utils.checkpoint itself is not seen: pass False); not under FSDP2 (not measured there). Auto: where
  nn.weight_scale.previous_scale_pays (as CUDA graphs; without them, with the activations as saved where
  Inductor's compile workers launch user Triton kernels statically).
- ``cuda_graphs``: the compiled blocks replayed as CUDA graphs (``torch.compile``'s mode "reduce-overhead"): the
  host launches a block's kernels in one call instead of one by one. Off unless asked: a block's outputs are
  overwritten by its next call (torch raises where a kept one is read afterwards), each new input shape records
  a graph of its own, and the graphs' memory is a pool of their own, gradients included: each step's gradients
  must be used before the next forward (the step in backward, or one backward per ``opt.step()``; not gradient
  accumulation). Needs compiled blocks on one CUDA device (not FSDP2, no HF gradient checkpointing or
  checkpoint-wrapped modules) and activations other than "recompute" (which runs the blocks again inside
  backward, outside their graphs).
- ``step_in_backward``: each parameter updated during backward and its gradient freed at once, so the whole
  set of gradients never exists. ``opt.step()`` and ``opt.zero_grad()`` stay in the loop (they find nothing left
  to do); a loop that needs every gradient at once cannot have it: a second backward before ``opt.step()``
  (gradient accumulation) raises, and clipping by the global norm finds no gradients. Pass
  ``step_in_backward=False`` for those (and for GradScaler). Auto: on.
- ``chunked_loss``: an HF causal LM's training loss computed without its whole logits (nn/causal_lm_loss.py).
  Auto: where the model allows it.
- HF models: ``config.use_cache`` is turned off (a KV cache built in training costs memory, breaks recompute
  and makes compiled blocks recompile).
- ``packed_check``: an HF causal LM's packed-sequence check, a host sync at the start of every forward, answered
  without one in calls that leave the positions to the model (nn/packed_check.py), so that the host can queue the
  next step while the GPU finishes this one. Auto: where the model allows it.
- ``max_memory_gib``: a budget for the training step's peak (or ``max_memory_fraction``: that fraction of the
  GPU's total memory, as ``torch.cuda.get_device_properties`` gives it). With ``tokens`` (batch x sequence length
  per step) the plan takes the fastest candidate whose estimated peak fits (lpoptim/memory.py) and raises,
  naming the estimates, if none does.
- FSDP2 (``fully_shard`` applied before ``prepare``; DTensor parameters): the optimizer steps each rank's shards,
  the step in backward runs on the reduce-scattered shard, the chunked loss and FP8 activations work as without
  it; linears are converted in place (fully_shard holds the modules it shards: convert_linears turns each into
  a low-bit layer itself; a tensor-parallel weight is refused), or kept as converted before ``fully_shard``;
  units holding gathered weights are resharded first (the optimizer takes the shards). ``max_memory_gib`` is
  refused before anything changes (the estimate counts whole parameters in one process).
- DistributedDataParallel (the model wrapped before ``prepare``): the chunked loss goes on the model DDP wraps;
  no step in backward (DDP averages the gradients as backward ends; each rank would otherwise step its own);
  ``step_in_backward=True`` is refused.
  Wrapping with DDP *after* ``prepare`` cannot be seen here: prepare first with ``step_in_backward=False``.

The choices and their reasons are in ``opt.plan`` (printed with ``verbose=True``); ``opt.plan.remove()`` undoes
the wrapping parts (activations, chunked loss, in-backward stepping; converted linears and compiled blocks stay).
"""
from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from .activations import compress_activations
from .activations.offload import offload_activations
from .device import fp8_device_problem
from .memory import estimate_peak_bytes
from .nn import LowBitLinear, convert_linears
from .nn.convert import conversion_targets, has_wide_linear, is_fsdp_unit, wide_linears, width_label
from .nn.causal_lm_loss import chunk_causal_lm_loss, restore_causal_lm_loss, why_not
from .nn.packed_check import skip_packed_check
from .nn.packed_check import why_not as why_not_packed
from .nn.recipes import DEFAULT_RECIPE, RECIPES
from .nn.weight_scale import previous_scale_pays
from .optim import AdamW
from .optim.adamw import LPOPTIM_DEFAULTS, _is_real
from .optim import step_in_backward as fuse_step_into_backward
from .optim.in_backward import check_not_hooked

AUTO = "auto"
ACTIVATIONS = (None, "fp8", "fp8_attention", "recompute")
AUTO_BUDGETS = (0.5, 0.3)  # the activation budgets the auto ladder tries on compiled blocks, fastest first
# the most blocks the budget ladder offloads. On an H100, Llama-2-13B's shape at 1 x 2048 tokens with
# max_memory_gib=54: 28 of 40 blocks, 6.2 GiB a step each way, 6,693 tokens/s
# (docs/results/hf_llama2_13b_budget54_h100.json) against 7,200 without (hf_llama2_13b_h100.json, an older run)
MAX_OFFLOAD_FRACTION = 0.7
# The auto choice of linears converts the blocks' layers at least LINEARS_MIN_FEATURES wide (nn.convert.wide_linears:
# in and out, or 512 out beside such a layer), and runs them low-bit from LINEARS_MIN_TOKENS tokens a call
# (LowBitLinear.min_tokens): a weight is quantized once a call whatever the tokens, and narrow GEMMs gain little from
# FP8. HF shapes, compiled blocks, step in backward, one H100, tokens/s of FP8 linears (every layer of the blocks)
# against the same step's bf16 GEMMs (docs/prepare.md): width 4096 (Llama-2-7B) 0.91x at 1 x 1024 tokens, 1.03x at
# 1 x 1536, 1.13x at 1 x 2048; 4096 (Llama-3-8B) 1.06x at 1 x 1536, 1.14x at 1 x 2048; 3584 (Qwen2.5-7B) 1.01x at
# 1 x 1536, 1.15x at 1 x 2048; 3584 (Gemma-2-9B) 1.05x at 1 x 2048, 3.5 GiB lighter; 3072 (Llama-3.2-3B)
# 0.99-1.02x at 1 x 2048; 2048 (TinyLlama-1.1B) 0.65x at 1 x 2048, 0.69x at 1 x 4096. On one H200 Llama-2-7B's
# break-even lies a little later (0.95-0.98x at 1 x 1536, 1.12-1.14x at 1 x 2048): the same rule there.
LINEARS_MIN_FEATURES = 3584
LINEARS_MIN_TOKENS = 1536


@dataclass
class Plan:
    """What ``prepare`` chose, why, and the handles of what it applied."""
    blocks: str  # the blocks' name in the model, e.g. "model.layers"
    n_blocks: int
    linears: str | None
    activations: str | float | None  # "fp8", "fp8_attention", "recompute", an Inductor activation budget, or None
    compile: bool
    step_in_backward: bool
    chunked_loss: bool
    bf16_stochastic_round: bool
    use_cache_off: bool
    packed_check: bool = False  # HF's packed-sequence check answered without a host sync (nn/packed_check.py)
    state_bits: int = 8  # the optimizer's (an optimizer argument; the estimate counts its states)
    cuda_graphs: bool = False  # the compiled blocks as CUDA graphs (mode "reduce-overhead")
    previous_weight_scale: bool = False  # fp8_delayed linears scale W by its previous absmax (nn/weight_scale.py)
    min_quant_numel: int = 4096  # the optimizer's too
    offload_blocks: int = 0  # the first that many blocks' saved activations in host memory (offload_activations)
    group_size: int = 128
    hf_checkpointing: bool = False  # the model's own gradient checkpointing is on (the estimate counts it)
    # linears chosen by prepare (0 where named): only layers this wide (wide_linears), in bf16 under these tokens a call
    linears_min_features: int = 0
    linears_min_tokens: int = 0
    reasons: dict = field(default_factory=dict)  # part -> why it is what it is
    estimate_gib: dict | None = None  # the budget's estimates, candidate name -> GiB (None: no budget given)
    handles: list = field(default_factory=list, repr=False)
    model: nn.Module | None = field(default=None, repr=False)

    def candidate(self) -> str:
        offload = f", {self.offload_blocks} blocks' offloaded" if self.offload_blocks else ""
        return f"{self.linears or 'unchanged'} linears, {self.activations_label}{offload}"

    def options(self) -> dict:
        """The ``plan()`` / ``prepare()`` keyword arguments that choose what this plan chose (no budget needed):
        what ``lpoptim bench`` records beside the summary, so that a file's plan can be made again (an auto choice of
        linears as its recipe named with the thresholds it took)."""
        return dict(blocks=self.blocks, linears=self.linears, linears_min_features=self.linears_min_features,
                    linears_min_tokens=self.linears_min_tokens, activations=self.activations, compile=self.compile,
                    cuda_graphs=self.cuda_graphs, previous_weight_scale=self.previous_weight_scale,
                    step_in_backward=self.step_in_backward, chunked_loss=self.chunked_loss,
                    offload=self.offload_blocks, packed_check=self.packed_check, state_bits=self.state_bits,
                    min_quant_numel=self.min_quant_numel,
                    group_size=self.group_size)

    @property
    def linears_label(self) -> str:
        where = [f"where {width_label(self.linears_min_features)}"] if self.linears_min_features else []
        if self.linears_min_tokens:
            where.append(f"nn.Linear under {self.linears_min_tokens:,} tokens a call")
        if self.previous_weight_scale:
            where.append("W scaled by its previous absmax")
        return ", ".join([self.linears, *where]) if self.linears else "unchanged"

    @property
    def activations_label(self) -> str:
        if isinstance(self.activations, float):
            return f"Inductor keeps {self.activations:.0%} of the activations"
        return {None: "activations unchanged", "fp8": "FP8 activations",
                "fp8_attention": "FP8 activations, attention's too",
                "recompute": "FP8 block inputs + recompute"}[self.activations]

    def summary(self) -> str:
        rows = [("blocks", f"{self.blocks} ({self.n_blocks} x {self.block_class})"),
                ("linears", self.linears_label),
                ("activations", self.activations_label),
                ("offload", f"the first {self.offload_blocks} blocks' saved activations in host memory"
                 if self.offload_blocks else "no"),
                ("compile", ("each block, as CUDA graphs" if self.cuda_graphs else "each block") if self.compile
                 else "no"),
                ("step_in_backward", "yes" if self.step_in_backward else "no"),
                ("chunked_loss", "yes" if self.chunked_loss else "no"),
                ("bf16_stochastic_round", "yes" if self.bf16_stochastic_round else "no"),
                ("state_bits", str(self.state_bits)),
                ("use_cache", "turned off" if self.use_cache_off else "unchanged"),
                ("packed_check", "no host sync where the model makes the positions" if self.packed_check
                 else "unchanged")]
        lines = ["lpoptim.prepare:"]
        for key, value in rows:
            why = self.reasons.get(key)
            lines.append(f"  {key:22s} {value}" + (f"  ({why})" if why else ""))
        if self.estimate_gib:
            lines.append("  estimated peak, GiB:   " + "; ".join(f"{k} {v:.3g}" for k, v in self.estimate_gib.items()))
        return "\n".join(lines)

    @property
    def block_class(self) -> str:
        blocks = self.model.get_submodule(self.blocks) if self.model is not None else None
        return _module_class(blocks[0]).__name__ if blocks is not None and len(blocks) else "?"

    def remove(self) -> None:
        """Undo the wrapping parts (FP8 activations, the chunked loss, the step in backward)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.model is not None:
            restore_causal_lm_loss(_unwrapped(self.model))


class _WithActivationBudget:
    """A compiled block's call with Inductor's activation_memory_budget set around it: the partitioner reads the
    budget when the block's graph is compiled (its first call), so this block gets it and nothing else does."""

    def __init__(self, compiled, budget: float):
        self.compiled, self.budget = compiled, budget

    def __call__(self, *args, **kwargs):
        import torch._functorch.config as functorch_config

        # a plain attribute swap: config.patch cost ~20 us a call on a CPU (not kept), and this runs on every
        # call of every block
        previous = functorch_config.activation_memory_budget
        functorch_config.activation_memory_budget = self.budget
        try:
            return self.compiled(*args, **kwargs)
        finally:
            functorch_config.activation_memory_budget = previous


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of blocks: the ModuleList of two or more modules of one class holding the most parameters
    (``model.layers`` of HF Llama, ``transformer.h`` of GPT-2, ``encoder.layer`` of BERT)."""
    best, best_size = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({_module_class(m) for m in mod}) == 1:
            size = sum(p.numel() for p in mod.parameters())
            if size > best_size:
                best, best_size = (name, mod), size
    if best is None:
        raise ValueError(f"lpoptim.prepare: no stack of blocks found in {type(model).__name__} (an nn.ModuleList of "
                         f"two or more modules of one class); name it: prepare(model, blocks='path.to.layers')")
    return best


def _blocks(model: nn.Module, blocks) -> tuple[str, nn.ModuleList]:
    if blocks is None:
        return find_blocks(model)
    if isinstance(blocks, str):
        try:
            mod = model.get_submodule(blocks)
        except AttributeError as e:
            raise ValueError(f"lpoptim.prepare: blocks={blocks!r}: {e}") from None
        if not isinstance(mod, _STACKS):
            raise ValueError(f"lpoptim.prepare: blocks={blocks!r} is a {type(mod).__name__}, not an nn.ModuleList "
                             "or nn.Sequential")
        return blocks, mod
    if isinstance(blocks, _STACKS):
        name = next((n for n, m in model.named_modules() if m is blocks), None)
        if name is None:
            raise ValueError("lpoptim.prepare: the blocks given are not part of the model")
        return name, blocks
    raise TypeError(f"lpoptim.prepare: blocks is a name, an nn.ModuleList or an nn.Sequential, got "
                    f"{type(blocks).__name__}")


# what a named stack of blocks may be: a ModuleList (what HF models hold), or a Sequential that calls its blocks
# in turn ("" names the model itself, a plain torch model that is one)
_STACKS = (nn.ModuleList, nn.Sequential)


def _ddp(model: nn.Module) -> nn.Module | None:
    """The DistributedDataParallel that ``model`` is or holds (whose gradient all-reduce a step in backward would
    run ahead of), or None."""
    from torch.nn.parallel import DistributedDataParallel

    return next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model a DistributedDataParallel ``model`` wraps, else ``model``: where the HF parts are (its config,
    its gradient checkpointing, its loss, which the chunked loss replaces)."""
    ddp = _ddp(model)
    return ddp.module if ddp is model else model


def _hf_checkpointing(model: nn.Module) -> bool:
    """Whether HF gradient checkpointing is on (``is_activation_checkpointing`` in newer transformers)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


def _check_choice(name: str, value, allowed) -> None:
    if value != AUTO and value not in allowed:
        raise ValueError(f"lpoptim.prepare: {name}={value!r}; expected 'auto' or one of {list(allowed)}")


def _module_class(module: nn.Module) -> type:
    """A module's own class: FSDP2's fully_shard swaps it for a subclass, FSDP<Class>(FSDPModule, Class)."""
    cls = type(module)
    return cls.__bases__[-1] if is_fsdp_unit(module) and len(cls.__bases__) == 2 else cls


def _in_blocks(model: nn.Module, stack_name: str, min_features: int):
    """convert_linears' filter for the layers inside the blocks (``stack_name``: their ModuleList in the model) that
    the width threshold ``min_features`` takes (wide_linears)."""
    prefix = stack_name + "." if stack_name else ""  # "": the model is the stack
    taken = {id(m) for m in wide_linears(model.get_submodule(stack_name), min_features, unconverted=True)}
    return lambda module, fqn: fqn.startswith(prefix) and id(module) in taken


def _sharded_parts(model: nn.Module, stack_name: str, params, linears, min_features: int, has_budget: bool,
                   reasons: dict):
    """What differs when the parameters are DTensors (FSDP2's fully_shard, applied before prepare); returns the
    linears choice. The budget is refused (the estimate counts one process holding whole parameters, states and
    gradients, not a rank's shards and the blocks FSDP2 gathers). Linears are converted as without FSDP2, in place
    (convert_linears: fully_shard keeps the modules it shards), but not a weight FSDP2 does not gather whole (tensor
    parallelism: refused, or none under auto); blocks already holding low-bit layers are kept as they are."""
    from .optim.distributed import is_dtensor

    if not any(is_dtensor(p) for p in params):
        return linears
    if has_budget:
        raise ValueError("lpoptim.prepare: a memory budget (max_memory_gib, max_memory_fraction) on a model whose "
                         "parameters are DTensors (FSDP2's fully_shard): the peak estimate counts one process holding "
                         "whole parameters, states and gradients, not one rank's shards; pass no budget and choose "
                         "activations=")
    if linears not in (None, False):
        try:  # the layers prepare would convert (as it converts them)
            conversion_targets(model, _in_blocks(model, stack_name, min_features))
        except ValueError as e:
            if linears != AUTO:
                raise ValueError(f"lpoptim.prepare: linears={linears!r}: {e}") from None
            reasons["linears"] = str(e)
            return None
    low = sum(isinstance(m, LowBitLinear) for m in model.get_submodule(stack_name).modules())
    if linears == AUTO and low:
        reasons["linears"] = f"FSDP2: {low} low-bit layers already"
        linears = None
    return linears


def _offload_choices(offload, n_blocks: int, cuda: bool, cuda_graphs: bool, activations, params,
                     hf_checkpointing: bool, reasons: dict) -> list[int]:
    """The offloaded block counts the plan may take, its first choice first: [k] where the caller chose, else [0]
    and (where a budget may need them, and offloading can run) 2 .. MAX_OFFLOAD_FRACTION of the blocks."""
    from .optim.distributed import is_dtensor

    why_not = ("not on CUDA" if not cuda else "CUDA graphs keep their own memory" if cuda_graphs else
               "FSDP2 saves its gathered weights as activations" if any(is_dtensor(p) for p in params) else
               "HF gradient checkpointing already recomputes the blocks" if hf_checkpointing else
               f"activations={activations!r} packs the saved tensors itself"
               if activations in ACTIVATIONS[1:] else None)
    if offload == AUTO:
        if why_not:
            reasons["offload"] = why_not
            return [0]
        # from 2: the estimate keeps one block's share back (fetched ahead), so one block alone would save nothing
        return [0, *range(2, int(MAX_OFFLOAD_FRACTION * n_blocks) + 1)]
    if offload in (None, False, 0):
        return [0]
    if not (isinstance(offload, int) and not isinstance(offload, bool) and 1 <= offload <= n_blocks):
        raise ValueError(f"lpoptim.prepare: offload is 'auto', False or a number of blocks in 1..{n_blocks}, got "
                         f"{offload!r}")
    if why_not:
        raise ValueError(f"lpoptim.prepare: offload={offload}: not here ({why_not})")
    return [offload]


def device_memory_gib(device: torch.device) -> float:
    """What this process may allocate on a CUDA device, in GiB (what ``max_memory_fraction`` is a fraction of):
    its total memory, times the cap ``torch.cuda.set_per_process_memory_fraction`` set, if any."""
    if device.type != "cuda":
        raise ValueError(f"lpoptim.prepare: max_memory_fraction is a fraction of a GPU's memory, and the parameters "
                         f"are on {device}; pass max_memory_gib instead")
    cap = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(device)
    return torch.cuda.get_device_properties(device).total_memory * cap / 2**30


def auto_linears(compiled: bool, fp8_cores: bool, tokens: int | None, stack: nn.Module, min_features: int,
                 min_tokens: int) -> tuple[str | None, str]:
    """The auto choice of linears, for the layers ``min_features`` takes (nn.convert.wide_linears) from ``min_tokens``
    tokens a call: (recipe or None, why)."""
    if not fp8_cores:
        return None, "no FP8 tensor cores"
    if not compiled:
        return None, "eager: quantizing costs more host time than the FP8 GEMMs save"
    if tokens is not None and tokens < min_tokens:
        return None, (f"{tokens:,} tokens a step: under {min_tokens:,}, quantizing the weights costs more than the FP8 "
                      "GEMMs save")
    if not has_wide_linear(stack, min_features):
        if any(isinstance(m, LowBitLinear) for m in stack.modules()):
            return None, "the blocks' layers are low-bit already"
        return None, (f"no layer of the blocks is {width_label(min_features)} (narrower ones were slower in FP8 "
                      "where measured: docs/prepare.md)")
    return DEFAULT_RECIPE, "compiled blocks on FP8 tensor cores"


def _thresholds(linears, min_features, min_tokens) -> tuple[int, int]:
    """The linears' (min_features, min_tokens): as given, else the auto choice's for linears="auto", 0 for a
    recipe named (every layer of the blocks, low-bit at any batch). ValueError on a bad value."""
    out = []
    for name, value, auto_default in (("linears_min_features", min_features, LINEARS_MIN_FEATURES),
                                      ("linears_min_tokens", min_tokens, LINEARS_MIN_TOKENS)):
        if value is None:
            value = auto_default if linears == AUTO else 0
        elif isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"lpoptim.prepare: {name} is an int >= 0, got {value!r}")
        out.append(int(value))
    return out[0], out[1]


def _checkpoint_wrapped(stack: nn.Module) -> bool:
    """Whether a module of the blocks is checkpoint-wrapped (torch.distributed's checkpoint_wrapper): its forward
    runs again inside backward."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # a torch built without torch.distributed has no such wrapper
        return False
    return any(isinstance(m, CheckpointWrapper) for m in stack.modules())


def _check_cuda_graphs(compile, cuda: bool, activations, params, hf_checkpointing: bool,
                       wrapped: bool = False) -> None:
    """cuda_graphs=True's conditions, checked before anything changes (plan's docstring says why)."""
    if not cuda:
        raise ValueError("lpoptim.prepare: cuda_graphs=True needs the model on CUDA")
    if not compile:
        raise ValueError("lpoptim.prepare: cuda_graphs=True replays the compiled blocks: it needs compile=True")
    if activations == "recompute":
        raise ValueError("lpoptim.prepare: cuda_graphs=True with activations='recompute': not supported (the "
                         "recompute runs each block again inside backward); pass another activations choice")
    if hf_checkpointing:
        raise ValueError("lpoptim.prepare: cuda_graphs=True with HF gradient checkpointing on: not supported (its "
                         "recompute runs the blocks again inside backward); call "
                         "model.gradient_checkpointing_disable() first")
    if wrapped:
        raise ValueError("lpoptim.prepare: cuda_graphs=True with checkpoint-wrapped modules in the blocks: not "
                         "supported (their recompute runs inside backward, outside the blocks' graphs)")
    if len({p.device for p in params}) > 1:
        raise ValueError("lpoptim.prepare: cuda_graphs=True on a model spread over several devices: the blocks' "
                         "graphs are recorded for one")
    from .optim.distributed import is_dtensor

    if any(is_dtensor(p) for p in params):
        raise ValueError("lpoptim.prepare: cuda_graphs=True on an FSDP2 model: its all-gathers run outside the "
                         "blocks' graphs; pass cuda_graphs=False")


def plan(model: nn.Module, *, blocks=None, linears=AUTO, activations=AUTO, compile=AUTO, cuda_graphs=False,
         previous_weight_scale=AUTO, step_in_backward=AUTO, chunked_loss=AUTO, offload=AUTO, packed_check=AUTO,
         max_memory_gib: float | None = None, max_memory_fraction: float | None = None, tokens: int | None = None,
         linears_min_features: int | None = None, linears_min_tokens: int | None = None,
         state_bits: int = 8, min_quant_numel: int = 4096, group_size: int = 128) -> Plan:
    """What ``prepare`` would do to ``model`` with these options, and why; changes nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"lpoptim.prepare takes an nn.Module, got {type(model).__name__}")
    _check_choice("linears", linears, (None, False, *RECIPES))
    budget = isinstance(activations, float) and not isinstance(activations, bool)
    if budget and not 0 < activations < 1:
        raise ValueError(f"lpoptim.prepare: activations={activations!r}; an activation budget is in (0, 1)")
    if not budget:
        _check_choice("activations", activations, (*ACTIVATIONS, False))
    for name, value in (("compile", compile), ("step_in_backward", step_in_backward), ("chunked_loss", chunked_loss),
                        ("packed_check", packed_check), ("previous_weight_scale", previous_weight_scale)):
        _check_choice(name, value, (True, False))
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"lpoptim.prepare: cuda_graphs is True or False, got {cuda_graphs!r}")
    if max_memory_fraction is not None:
        if max_memory_gib is not None:
            raise ValueError("lpoptim.prepare: a budget is max_memory_gib or max_memory_fraction, not both")
        if not (_is_real(max_memory_fraction) and 0 < max_memory_fraction <= 1):
            raise ValueError(f"lpoptim.prepare: max_memory_fraction is in (0, 1], got {max_memory_fraction!r}")
    if max_memory_gib is not None and not (_is_real(max_memory_gib) and max_memory_gib > 0):
        raise ValueError(f"lpoptim.prepare: max_memory_gib must be a positive number, got {max_memory_gib!r}")
    budget_name = "max_memory_gib" if max_memory_fraction is None else "max_memory_fraction"
    good_tokens = isinstance(tokens, numbers.Integral) and not isinstance(tokens, bool) and tokens > 0
    if (max_memory_gib is not None or max_memory_fraction is not None) and not good_tokens:
        got = "" if tokens is None else f", got {tokens!r}"
        raise ValueError(f"lpoptim.prepare: {budget_name} needs tokens=, a positive int (batch x sequence length of "
                         f"one step), to estimate the activations{got}")
    if tokens is not None and not good_tokens:
        raise ValueError(f"lpoptim.prepare: tokens is a positive int (batch x sequence length of one step), got "
                         f"{tokens!r}")
    name, stack = _blocks(model, blocks)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("lpoptim.prepare: the model has no parameters that require gradients")
    device = params[0].device
    cuda = device.type == "cuda"
    # FP8 activations (recompute's FP8 block inputs too) and low-bit linears need FP8 conversions: refused before
    # any change on a GPU without them (lpoptim.AdamW's states do not need them)
    no_fp8 = fp8_device_problem(params[:1], "FP8 activations and low-bit linear layers")
    fp8_cores = cuda and not no_fp8
    if no_fp8 and activations in ACTIVATIONS[1:]:
        raise ValueError(f"lpoptim.prepare: activations={activations!r}: {no_fp8}")
    reasons = {}
    # FSDP2 first: it refuses any budget, before a fraction is asked of the device
    min_features, min_tokens = _thresholds(linears, linears_min_features, linears_min_tokens)
    linears = _sharded_parts(model, name, params, linears, min_features,
                             max_memory_gib is not None or max_memory_fraction is not None, reasons)
    budget_of = ""  # what the budget is, where it is a fraction of the device
    if max_memory_fraction is not None:
        total = device_memory_gib(device)
        max_memory_gib = max_memory_fraction * total
        budget_of = f" ({max_memory_fraction:g} of {device}'s {total:.3g} GiB)"

    if compile == AUTO:
        compile = cuda
        reasons["compile"] = "CUDA" if cuda else "not on CUDA"
    if budget and not compile:
        raise ValueError(f"lpoptim.prepare: activations={activations} is a budget for Inductor: it needs compile=True")
    hf = _unwrapped(model)
    if cuda_graphs:
        _check_cuda_graphs(compile, cuda, activations, params, _hf_checkpointing(hf), _checkpoint_wrapped(stack))
    if linears == AUTO:
        linears, reasons["linears"] = auto_linears(bool(compile), fp8_cores, tokens, stack, min_features, min_tokens)
    else:
        linears = linears or None
    if linears and not has_wide_linear(stack, 0):  # GPT-2's Conv1D, say
        linears = None
        reasons["linears"] = "the blocks hold no nn.Linear"
    elif linears and not has_wide_linear(stack, min_features):
        linears = None
        reasons["linears"] = (f"no nn.Linear of the blocks is linears_min_features={min_features:,} wide "
                             f"({width_label(min_features)})")
    if linears and no_fp8:
        raise ValueError(f"lpoptim.prepare: linears={linears!r}: {no_fp8}")
    if _ddp(model) is not None:  # DDP all-reduces the gradients while backward ends: a step inside it would come first
        if step_in_backward not in (AUTO, False):
            raise ValueError("lpoptim.prepare: step_in_backward=True on a DistributedDataParallel model: each rank "
                             "would step its own gradient before DDP averages it (the ranks would drift apart); "
                             "pass step_in_backward=False (or shard with FSDP2, whose reduced shards it steps)")
        step_in_backward, reasons["step_in_backward"] = False, "DDP averages gradients as backward ends: after it"
    elif step_in_backward == AUTO and any(p.dtype == torch.float16 for p in params):
        # fp16 trains with GradScaler, which unscales and checks every gradient before the step
        step_in_backward, reasons["step_in_backward"] = False, "fp16 parameters: GradScaler needs all gradients"
    elif step_in_backward == AUTO:
        step_in_backward = True
        reasons["step_in_backward"] = "no whole set of gradients; pass False for clipping or accumulation"
    if chunked_loss == AUTO:
        why = why_not(hf)
        chunked_loss = why is None
        reasons["chunked_loss"] = "no whole logits" if why is None else why
    elif chunked_loss:
        why = why_not(hf)
        if why:
            raise ValueError(f"lpoptim.prepare: chunked_loss=True, but {why}")
    why = why_not_packed(hf) if packed_check in (AUTO, True) else None
    if packed_check is True and why:
        raise ValueError(f"lpoptim.prepare: packed_check=True, but {why}")
    if packed_check == AUTO:
        packed_check = why is None
        reasons["packed_check"] = "no host sync at each forward" if why is None else why
    if _hf_checkpointing(hf) and activations in (AUTO, *ACTIVATIONS[1:]):
        if activations != AUTO:
            what = "FP8 recompute replaces" if activations == "recompute" else "FP8 activations replace"
            raise ValueError(f"lpoptim.prepare: activations={activations!r}, but the model has HF gradient "
                             f"checkpointing on; {what} it: call model.gradient_checkpointing_disable() first, or "
                             "pass activations=None to keep HF's")
        activations, reasons["activations"] = None, "HF gradient checkpointing already recomputes the blocks"
    offload_choices = _offload_choices(offload, len(stack), cuda, cuda_graphs, activations, params,
                                       _hf_checkpointing(hf), reasons)
    if activations == AUTO:
        # fastest first: as saved, FP8, FP8 with attention's, Inductor's budgets (compiled), recompute
        activation_choices = [*ACTIVATIONS[:-1], *(AUTO_BUDGETS if compile else ()), ACTIVATIONS[-1]]
        if cuda_graphs:  # recompute runs blocks inside backward, outside their graphs
            activation_choices = [*ACTIVATIONS[:-1], *AUTO_BUDGETS]
        if no_fp8 or offload_choices[0]:  # as saved, or Inductor's budgets (offloading takes what they save)
            activation_choices = [c for c in activation_choices if c not in ACTIVATIONS[1:]]
    else:
        activation_choices = [activations or None]

    config = getattr(hf, "config", None)
    use_cache_off = bool(getattr(config, "use_cache", False))
    bf16 = any(p.dtype == torch.bfloat16 for p in params)
    result = Plan(blocks=name, n_blocks=len(stack), linears=linears, activations=activation_choices[0],
                  offload_blocks=offload_choices[0],
                  compile=bool(compile), cuda_graphs=cuda_graphs, step_in_backward=bool(step_in_backward),
                  chunked_loss=bool(chunked_loss),
                  bf16_stochastic_round=bf16, use_cache_off=use_cache_off,
                  packed_check=bool(packed_check), state_bits=state_bits,
                  min_quant_numel=min_quant_numel, group_size=group_size, hf_checkpointing=_hf_checkpointing(hf),
                  linears_min_features=min_features if linears else 0,
                  linears_min_tokens=min_tokens if linears else 0, reasons=reasons, model=model)
    if bf16:
        reasons["bf16_stochastic_round"] = "bf16 parameters: no fp32 master copy"
    if max_memory_gib is None:
        if activations == AUTO:
            reasons["activations"] = "no memory budget given: the fastest"
        if offload == AUTO:
            reasons["offload"] = "no memory budget given"
        result.previous_weight_scale = _previous_weight_scale(result, params, stack, previous_weight_scale)
        return result
    # the candidates, fastest first: the budget takes the first that fits. Offloading comes after FP8 activations
    # with attention's (faster at 7B on an H100, 1.14x torch's against 1.03x with 13 of 32 blocks offloaded, same
    # run: docs/results/hf_llama2_7b_s4_offload_h100.json) and before Inductor's budgets and recompute (at 13B it
    # fits 54 GiB at 6.7 k tokens/s: hf_llama2_13b_budget54_h100.json), with the fewest blocks that fit (estimated
    # once a count, which is arithmetic)
    rungs = [(act, offload_choices[0]) for act in activation_choices]  # an explicit count: on every rung
    if len(offload_choices) > 1:  # auto
        packing = [i for i, (act, _) in enumerate(rungs) if act in (None, *ACTIVATIONS[1:3])] or [0]
        at = packing[-1] + 1
        kept = None if activations == AUTO else activation_choices[0]  # an explicit choice stays on every rung
        rungs = rungs[:at] + [(kept, k) for k in offload_choices[1:]] + rungs[at:]
    candidates, estimates = [], {}
    most = max(k for _, k in rungs)
    for act, k in rungs:
        if k and candidates and candidates[-1].offload_blocks and estimates[candidates[-1].candidate()] <= max_memory_gib:
            continue  # fewer blocks already fit
        c = replace(result, activations=act, offload_blocks=k)
        estimate = estimate_peak_bytes(hf, stack, c, tokens) / 2**30
        if k and k != most and estimate > max_memory_gib:
            continue  # only the fewest that fit, or the most, is named among the estimates
        candidates.append(c)
        estimates[c.candidate()] = estimate
    result.estimate_gib = estimates
    for c in candidates:
        if estimates[c.candidate()] <= max_memory_gib:
            result.activations, result.offload_blocks = c.activations, c.offload_blocks
            reasons["activations"] = f"the fastest whose estimated peak fits {max_memory_gib:.4g} GiB{budget_of}"
            if offload == AUTO:
                reasons["offload"] = "the fewest blocks that fit" if c.offload_blocks else "not needed to fit"
            result.previous_weight_scale = _previous_weight_scale(result, params, stack, previous_weight_scale)
            return result
    raise ValueError(f"lpoptim.prepare: nothing fits {max_memory_gib:.4g} GiB{budget_of} at {tokens} tokens a step; "
                     "estimated peaks: " + "; ".join(f"{k}: {v:.3g} GiB" for k, v in estimates.items()))


class _CompileOnRemove:
    """Plan.remove()'s last word on blocks whose compiled forward the FP8-activation wrapper held: compile them
    as prepare compiles unwrapped blocks, so removing the wrapper leaves them compiled."""

    def __init__(self, blocks, mode=None):
        self.blocks, self.mode = list(blocks), mode

    def remove(self) -> None:
        for block in self.blocks:
            block.compile(mode=self.mode)
        self.blocks = []


def _previous_weight_scale(result: Plan, params, stack, choice) -> bool:
    """``choice`` ("auto", True or False) for the plan (the module docstring's ``previous_weight_scale``): False
    where the plan cannot take it (True is refused there, with the reason), else the rule or the caller's word."""
    from .optim.distributed import is_dtensor

    devices = {p.device for p in params}
    why_not = ("it needs fp8_delayed linears" if result.linears != "fp8_delayed" else
               "it needs compiled blocks" if not result.compile else
               "it needs one CUDA device" if len(devices) != 1 or next(iter(devices)).type != "cuda" else
               "not under FSDP2" if any(is_dtensor(p) for p in params) else
               "a recomputed forward would find the state moved by the first" if (
                   result.activations == "recompute" or result.hf_checkpointing or _checkpoint_wrapped(stack))
               else None)
    if why_not:
        if choice != AUTO and choice:  # True (or 1)
            raise ValueError(f"lpoptim.prepare: previous_weight_scale=True: {why_not}")
        return False
    if choice != AUTO:
        return bool(choice)
    return previous_scale_pays(result.cuda_graphs, result.activations is None and not result.offload_blocks)


def _keywords(fn, *leave_out: str) -> frozenset:
    return frozenset(name for name, p in inspect.signature(fn).parameters.items()
                     if p.kind is not p.VAR_KEYWORD and name not in leave_out)


# what prepare's **optimizer_kwargs may hold: lpoptim.AdamW's arguments (lr is prepare's own)
_ADAMW_OPTIONS = _keywords(AdamW.__init__, "self", "params", "lr") | frozenset(LPOPTIM_DEFAULTS)


def prepare(model: nn.Module, lr: float | torch.Tensor = 1e-3, *, blocks=None, linears=AUTO, activations=AUTO,
            compile=AUTO, cuda_graphs: bool = False, previous_weight_scale=AUTO, step_in_backward=AUTO,
            chunked_loss=AUTO, offload=AUTO,
            packed_check=AUTO, max_memory_gib: float | None = None,
            max_memory_fraction: float | None = None, tokens: int | None = None,
            linears_min_features: int | None = None, linears_min_tokens: int | None = None, verbose: bool = False,
            **optimizer_kwargs) -> AdamW:
    """Apply what pays to ``model`` (in place) and return its lpoptim.AdamW; the module docstring says what.

    Every argument is checked, and the plan made, before the model is touched (but for FSDP2 units that hold
    gathered weights, resharded first: FSDP2's own resting state, which the optimizer must see)."""
    unknown = sorted(set(optimizer_kwargs) - _ADAMW_OPTIONS)
    if unknown:  # a misspelt option of prepare's own lands here too: name both lists, not only AdamW's
        raise TypeError(f"lpoptim.prepare() got unexpected keyword arguments {unknown}: its own options are "
                        f"{sorted(_PREPARE_OPTIONS)}, the rest go to lpoptim.AdamW, whose options are "
                        f"{sorted(_ADAMW_OPTIONS)}")
    # prepared before and not removed: the first optimizer would go on stepping the parameters inside backward
    check_not_hooked((p for p in model.parameters() if p.requires_grad), "lpoptim.prepare")
    for module in model.modules():  # FSDP2 units gathered now (reshard_after_forward=False after a forward) hold
        if is_fsdp_unit(module):  # the gathered tensors in place of their parameters: the optimizer takes the shards
            module.reshard()
    result = plan(model, blocks=blocks, linears=linears, activations=activations, compile=compile,
                  cuda_graphs=cuda_graphs, previous_weight_scale=previous_weight_scale,
                  step_in_backward=step_in_backward, chunked_loss=chunked_loss, offload=offload,
                  packed_check=packed_check,
                  max_memory_gib=max_memory_gib,
                  max_memory_fraction=max_memory_fraction, tokens=tokens,
                  linears_min_features=linears_min_features, linears_min_tokens=linears_min_tokens,
                  state_bits=optimizer_kwargs.get("state_bits", 8),
                  min_quant_numel=optimizer_kwargs.get("min_quant_numel", 4096),
                  group_size=optimizer_kwargs.get("group_size", 128))
    if result.bf16_stochastic_round:
        optimizer_kwargs.setdefault("bf16_stochastic_round", True)
        result.bf16_stochastic_round = bool(optimizer_kwargs["bf16_stochastic_round"])  # the caller's word wins
    params = [p for p in model.parameters() if p.requires_grad]
    opt = AdamW(params, lr=lr, **optimizer_kwargs)  # its argument errors before the model changes
    stack = list(model.get_submodule(result.blocks))  # its blocks (a Sequential is one module: its elements are)
    if result.use_cache_off:
        _unwrapped(model).config.use_cache = False
    mode = "reduce-overhead" if result.cuda_graphs else None  # torch.compile's, for CUDA graphs
    if result.linears:  # the blocks' layers, seen from the model (under FSDP2, which units hold them)
        convert_linears(model, result.linears, previous_weight_scale=result.previous_weight_scale,
                        min_tokens=result.linears_min_tokens,
                        filter_fn=_in_blocks(model, result.blocks, result.linears_min_features))
    wrapped = result.activations in ACTIVATIONS[1:]
    if wrapped:  # compiled, the wrapper calls each block's compiled forward (wrap.py: no graph break per call)
        result.handles.append(compress_activations(
            stack, recompute=result.activations == "recompute",
            compile={"mode": mode} if result.cuda_graphs else result.compile,
            attention="fp8" if result.activations == "fp8_attention" else "keep"))
        if result.compile:
            result.handles.append(_CompileOnRemove(stack, mode))  # the blocks stay compiled without the wrapper
    elif result.compile:
        for block in stack:
            block.compile(mode=mode)
            if isinstance(result.activations, float):
                block._compiled_call_impl = _WithActivationBudget(block._compiled_call_impl, result.activations)
    if result.offload_blocks:  # around the compiled calls (or eager forwards)
        result.handles.append(offload_activations(stack, result.offload_blocks))
    if result.chunked_loss:
        chunk_causal_lm_loss(_unwrapped(model))
    if result.packed_check:
        result.handles.append(skip_packed_check(_unwrapped(model)))
    if result.step_in_backward:
        result.handles.append(fuse_step_into_backward(opt, require_step=True))
    opt.plan = result
    if verbose:
        print(result.summary())
    return opt


_PREPARE_OPTIONS = _keywords(prepare, "model", "optimizer_kwargs")
