"""LowBitLinear: an nn.Linear whose three GEMMs run in FP8, FP4 or INT4 according to a recipe.

It is an nn.Linear subclass holding the very same ``weight`` and ``bias`` parameters (same dtype, same
state_dict keys), so optimizers, checkpoints, weight tying and isinstance checks keep working; only the
arithmetic of forward and backward changes. Its one buffer, ``weight_amax_state`` (three int32, not in the
state_dict), is what a compiled layer with delayed scaling scales W by where ``previous_weight_scale`` is set
(nn/weight_scale.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .delayed import ROLES, AmaxHistory, new_history
from .functional import lowbit_linear
from .recipes import DEFAULT_RECIPE, Recipe, get_recipe
from .weight_scale import new_state


def check_dims(in_features: int, out_features: int) -> None:
    """The FP8 GEMM (torch._scaled_mm) needs both feature dims to be multiples of 16; tokens are padded."""
    bad = [f"{n}={v}" for n, v in (("in_features", in_features), ("out_features", out_features)) if v % 16]
    if bad:
        raise ValueError(f"low-bit linear layers need feature dims divisible by 16 ({', '.join(bad)}); "
                         "keep this layer in high precision (convert_linears skips it by default)")


class LowBitLinear(nn.Linear):
    # Compiled, with delayed scaling: W scaled by its previous absmax kept on the device (nn/weight_scale.py), one
    # read of W in forward instead of two. Off by default: it pays as CUDA graphs, or with the activations as saved
    # where Inductor launches its kernels by its static launcher (weight_scale.previous_scale_pays; through
    # Triton's own launcher their host time cost more than the pass saves); prepare(previous_weight_scale="auto")
    # sets it there. Not with recompute (activation checkpointing): the recomputed forward would take the scale
    # the first one left, not the one it took.
    previous_weight_scale = False
    # Inputs of fewer tokens (rows) than this run nn.Linear's own forward (bf16 GEMMs under autocast; W cast to x's
    # dtype without autocast, as the low-bit path takes mixed dtypes where nn.Linear raises): W is quantized
    # (read, cast, and cast again transposed for backward) once per call whatever the number of tokens, while the
    # GEMMs' savings grow with it, so a small batch pays more than it saves. 0: every call low-bit (convert_linears'
    # default); lpoptim.prepare sets its linears_min_tokens (by default where it chose the layers itself:
    # planner.py says what was measured).
    min_tokens = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: str | Recipe = DEFAULT_RECIPE, **recipe_overrides):
        check_dims(in_features, out_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._become_low_bit(get_recipe(recipe, **recipe_overrides))

    def _become_low_bit(self, recipe: Recipe) -> None:
        """What a low-bit layer holds beside nn.Linear's: its recipe, the compiled weight scale's state and fresh
        amax histories (__init__, from_linear and adopt all end here). The state is a buffer on the weight's device
        (a DTensor's: its own shard's), so that it follows the layer (.to, FSDP2, to_empty: _apply zeroes it)."""
        self.recipe = recipe
        weight = self.weight
        device = (weight.to_local() if hasattr(weight, "to_local") else weight).device
        self.register_buffer("weight_amax_state", new_state(device), persistent=False)
        self.reset_amax_history()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str | Recipe = DEFAULT_RECIPE, **recipe_overrides) -> "LowBitLinear":
        """Wrap an existing nn.Linear, sharing its parameter objects (no copy)."""
        check_dims(linear.in_features, linear.out_features)
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                recipe=recipe, **recipe_overrides)
        m.weight = linear.weight
        m.bias = linear.bias
        m._become_low_bit(m.recipe)  # the state on the shared weight's device, not "meta"
        m.train(linear.training)
        return m

    @classmethod
    def adopt(cls, linear: nn.Linear, recipe: str | Recipe = DEFAULT_RECIPE, **recipe_overrides) -> "LowBitLinear":
        """Turn ``linear`` itself (a plain nn.Linear) into one of this class, in place: the same module object,
        parameters, hooks and place in the model. What convert_linears does where a wrapper holds the module
        (FSDP2's fully_shard keeps each layer it shards and swaps its weight for the gathered one around forward
        and backward: a new module in its place would see the sharded weight)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"adopt takes a plain nn.Linear, got {type(linear).__name__}")
        check_dims(linear.in_features, linear.out_features)
        recipe = get_recipe(recipe, **recipe_overrides)  # errors before the layer changes
        linear.__class__ = cls
        linear._become_low_bit(recipe)
        return linear

    def reset_amax_history(self) -> None:
        """Delayed scaling (recipe.scaling == "delayed"): forget the recorded absmax values, so that the next
        quantization of x, dy and W scales by its own.

        The history (``amax_history``, (3, amax_history + 2) int32, or None before the first training step) is made
        on the weight's device by the first forward that records, not a buffer: the state_dict stays nn.Linear's,
        data-parallel wrappers do not broadcast it, and a layer built on "meta" and materialized (``to_empty``,
        ``load_state_dict(..., assign=True)``) never runs on uninitialized slots. Loading weights, moving the layer
        to another device and ``reset_parameters`` start it afresh."""
        self.amax_history = None
        state = self._buffers.get("weight_amax_state")
        if state is not None and state.device.type != "meta":
            state.zero_()  # compiled: the next W takes its own absmax
        self._amax_calls = [0] * len(ROLES)  # quantizations of x, dy, W so far (on the host: no synchronization)
        self._amax_rings = None  # the AmaxHistory of each role over amax_history, made with it

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        state = self._buffers.get("weight_amax_state")
        if state is not None and state.device.type != "meta":
            with torch.no_grad():
                state.zero_()  # moved, cast or materialized (to_empty: uninitialized): the next W takes its own
        return self

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "recipe"):  # nn.Linear.__init__ calls this before the recipe is set
            self.reset_amax_history()

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.reset_amax_history()  # recorded for other weights

    def _histories(self):
        """(x's, dy's, W's) AmaxHistory for a training step with delayed scaling; None for current scaling, which
        compiled layers, forwards without grad (evaluation, inference) and CUDA-graph captures use: they record
        nothing."""
        if self.recipe.scaling != "delayed" or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return None
        if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # a captured graph would replay this call's slots: current scaling there
        h = self.amax_history
        if h is None or h.device != self.weight.device or h.shape[1] != self.recipe.amax_history + 2:
            self.reset_amax_history()  # first use, a moved layer, or a recipe changed after construction
            self.amax_history = h = new_history(self.recipe.amax_history, self.weight.device)
        if self._amax_rings is None or self._amax_rings[0].bits is not h:  # made once, not every forward
            self._amax_rings = tuple(AmaxHistory(h, self._amax_calls, role) for role in ROLES)
        return self._amax_rings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.min_tokens and x.numel() < self.min_tokens * self.in_features:  # a shape test: no guard on values
            w, b = self.weight, self.bias
            if w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):  # as the low-bit path takes it:
                w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)  # out in x's dtype (nn.Linear raises)
            return F.linear(x, w, b)
        return lowbit_linear(x, self.weight, self.bias, self.recipe, histories=self._histories(),
                             weight_state=self.weight_amax_state if self.training and self.previous_weight_scale
                             else None)

    def extra_repr(self) -> str:
        below = f", min_tokens={self.min_tokens}" if self.min_tokens else ""
        return f"{super().extra_repr()}, recipe={self.recipe.name}{below}"


# Named per recipe for readable reprs and isinstance checks; the arithmetic is all in the recipe.
class Fp8Linear(LowBitLinear):
    def __init__(self, *a, recipe=DEFAULT_RECIPE, **kw):
        super().__init__(*a, recipe=recipe, **kw)


class Fp4Linear(LowBitLinear):
    def __init__(self, *a, recipe="fp4", **kw):
        super().__init__(*a, recipe=recipe, **kw)


class Int4Linear(LowBitLinear):
    def __init__(self, *a, recipe="int4", **kw):
        super().__init__(*a, recipe=recipe, **kw)


def module_class(recipe: Recipe) -> type[LowBitLinear]:
    return {"e4m3": Fp8Linear, "e2m1": Fp4Linear}.get(recipe.fwd_fmt, Int4Linear)
