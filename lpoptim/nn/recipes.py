"""Recipes: which number format and scaling each GEMM of a linear layer uses, forward and backward.

A linear layer y = x Wᵀ (x: tokens × in, W: out × in) runs three GEMMs:

    forward      y  = x  Wᵀ     contraction over in-features
    grad input   dx = dy W      contraction over out-features
    grad weight  dW = dyᵀ x     contraction over tokens

A scale can only be factored out of a GEMM along a dimension that is *not* contracted, so every operand is
quantized along its contraction dimension (one scale per row of the operand as the GEMM reads it), or per
tensor. That is why x is quantized twice: per token for the forward, per in-feature (over tokens) for dW; the
second copy is what the layer saves for backward, in FP8 (1 byte per element instead of bf16's 2).

A Recipe's fields say this per format and scaling; ``Recipe.specs`` turns them into one QuantSpec per operand of
each GEMM (what nn/functional.py quantizes each operand with). The FP4 paper's knobs (DGE, OCC) are not part of
an operand's quantization: nn/functional.py applies them around the GEMMs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .operands import QuantSpec


@dataclass(frozen=True)
class OperandSpecs:
    """Which QuantSpec each operand of the three GEMMs gets (Recipe.specs):

        forward      y  = x  Wᵀ     x, w
        grad input   dx = dy W      dy, wt (W read as Wᵀ)
        grad weight  dW = dyᵀ x     dy (read as dyᵀ), xt (the copy of x the forward saves)

    ``w_kept`` / ``x_kept``: the forward's W / x where a backward follows and the recipe has them keep what Wᵀ
    / xᵀ then take their scales from (QuantSpec.keep); None where it keeps nothing."""
    x: QuantSpec
    w: QuantSpec
    dy: QuantSpec
    wt: QuantSpec
    xt: QuantSpec
    w_kept: QuantSpec | None = None
    x_kept: QuantSpec | None = None


def _operand_specs(r: "Recipe") -> OperandSpecs:
    bwd = r.backward_granularity
    scaling = "delayed" if r.scaling == "delayed" else "current"
    back = {fmt: QuantSpec(fmt, bwd, scaling if bwd == "tensor" else "current") for fmt in (r.grad_fmt, r.bwd_fmt)}
    w_kept = x_kept = None
    if r.fwd_fmt == "int4_sym":  # per row (whatever ``granularity`` says), after the block Hadamard
        x = w = QuantSpec(r.fwd_fmt, "row", hadamard_block=r.hadamard_block)
    elif r.fwd_fmt == "e2m1":  # never delayed: fp4's x and W keep their absmax from the row pass instead
        x = w = QuantSpec(r.fwd_fmt, r.granularity)
        x_kept = w_kept = QuantSpec(r.fwd_fmt, r.granularity, keep="amax")
    else:
        fwd_scaling = scaling if r.granularity == "tensor" else "current"
        x = QuantSpec(r.fwd_fmt, r.granularity, fwd_scaling)
        # W's history records once a step: by w_kept in the forward that saves xᵀ, else by the backward's Wᵀ
        w = QuantSpec(r.fwd_fmt, r.granularity)
        w_kept = QuantSpec(r.fwd_fmt, r.granularity, fwd_scaling,
                           keep="col_max" if r.granularity == "row" else "amax")
    return OperandSpecs(x, w, back[r.grad_fmt], back[r.bwd_fmt], back[r.bwd_fmt], w_kept, x_kept)


@dataclass(frozen=True)
class Recipe:
    name: str
    # forward operands
    fwd_fmt: str = "e4m3"          # format of x and W in the forward GEMM: e4m3, e2m1 or int4 (INT4_SYM, -7..7)
    granularity: str = "row"       # "row" (per token / per output channel) or "tensor"
    hadamard_block: int | None = None  # int4: block-diagonal Hadamard along the contraction dim, before quantizing
    # backward operands
    grad_fmt: str = "e5m2"         # output gradient dy
    bwd_fmt: str = "e4m3"          # W in the dx GEMM and the saved x in the dW GEMM
    # scaling of the fp8 backward's operands (dy, W, the saved x); None: as ``granularity``. "tensor" sends both
    # backward GEMMs to the tensor-wise FP8 kernel, faster on Hopper than the row-wise one
    bwd_granularity: str | None = None
    fast_accum: bool = False       # fp8 forward GEMM with Hopper's fast accumulation (torchao's default there)
    # per-tensor scales of x, dy and W: "current" (each tensor's own absmax, a pass of its own) or "delayed" (the
    # largest absmax of the operand's last ``amax_history`` quantizations, recorded by the quantizing pass itself:
    # Transformer Engine's DelayedScaling, without its saturation; nn/delayed.py). Delayed applies to the per-tensor
    # quantizations of x (the fp8 forward, the saved xᵀ; not fp4's, whose absmax comes free), of dy, and of
    # W (an fp8 forward's, whose scale then serves Wᵀ in backward; int4's backward Wᵀ; not fp4's, whose Wᵀ
    # takes the absmax its forward's row pass leaves). Needs the layer's state: LowBitLinear keeps it
    scaling: str = "current"
    amax_history: int = 16
    # fp4 (Wang et al. 2025, arXiv 2501.17116)
    dge_k: float | None = None     # differentiable gradient estimator exponent (None: straight-through)
    dge_cap: float = 3.0           # cap on the DGE derivative
    occ_alpha: float | None = None  # outlier clamping quantile of |x| (None: off)
    occ_sample: int = 1 << 20      # the quantile is estimated on at most this many evenly strided elements

    def __post_init__(self):
        self._validate()  # before the operands' specs are made from the fields
        self._register()

    def _validate(self):
        if self.fwd_fmt not in ("e4m3", "e2m1", "int4_sym"):  # the formats nn/functional.py has a Function for
            raise ValueError(f"fwd_fmt must be 'e4m3', 'e2m1' or 'int4_sym', got {self.fwd_fmt!r}")
        if self.granularity not in ("row", "tensor"):
            raise ValueError(f"granularity must be 'row' or 'tensor', got {self.granularity!r}")
        if self.bwd_granularity not in (None, "row", "tensor"):
            raise ValueError(f"bwd_granularity must be None, 'row' or 'tensor', got {self.bwd_granularity!r}")
        if self.fast_accum and self.fwd_fmt != "e4m3":
            raise ValueError("fast_accum is for the fp8 recipes: it drops accumulator bits, so 4-bit GEMMs would no "
                             "longer be exact")
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"scaling must be 'current' or 'delayed', got {self.scaling!r}")
        if self.scaling == "delayed" and self.backward_granularity != "tensor":
            raise ValueError("scaling='delayed' scales x, dy and W per tensor: it needs bwd_granularity='tensor' (or "
                             "granularity='tensor')")
        if self.amax_history < 1:
            raise ValueError(f"amax_history must be at least 1, got {self.amax_history}")
        block = self.hadamard_block
        if block is not None and (block < 1 or block & (block - 1)):
            raise ValueError(f"hadamard_block must be a power of two, got {self.hadamard_block}")

    def __setstate__(self, state):  # unpickled and deep-copied recipes are registered too
        self.__dict__.update(state)
        self._register()

    def _register(self):
        """``key``: the recipe as a string, what the compiled path's custom ops take (nn/compiled.py); ``specs``:
        each operand's QuantSpec (OperandSpecs), made here once rather than on every call."""
        object.__setattr__(self, "key", repr(self))
        object.__setattr__(self, "specs", _operand_specs(self))
        BY_KEY.setdefault(self.key, self)

    @property
    def backward_granularity(self) -> str:
        return self.bwd_granularity or self.granularity

    def with_(self, **kw) -> "Recipe":
        return replace(self, **kw)


BY_KEY: dict[str, Recipe] = {}  # Recipe.key -> recipe


FP8 = Recipe("fp8")
FP8_TENSOR = Recipe("fp8_tensor", granularity="tensor")
FP8_TENSOR_FAST = Recipe("fp8_tensor_fast", granularity="tensor", fast_accum=True)  # torchao's tensorwise default
# fp8_tensor with delayed scaling: no absmax pass over x or dy (docs/linear.md)
FP8_DELAYED = Recipe("fp8_delayed", granularity="tensor", scaling="delayed")
# E2M1 forward per row, the fp8 backward per tensor (as int4's: faster than per row on an H100,
# docs/results/linear_h100_bwd_granularity.json), straight-through gradients. The paper's other two parts
# stay options: its DGE (dge_k=5.0) weights dW by a derivative whose mean is 0.59 (at 113 M parameters the best
# validation loss came out 2.3% above torch AdamW's with it, 1.1% without, one H100;
# docs/results/train_gpt2_113m_python_stdlib_h100.json); its outlier clamping (occ_alpha=0.99) adds a sparse
# residual GEMM that is not fused (0.10-0.15x compiled bf16 per layer on an H100, docs/results/linear_h100.json)
FP4 = Recipe("fp4", fwd_fmt="e2m1", bwd_granularity="tensor")
INT4 = Recipe("int4", fwd_fmt="int4_sym", hadamard_block=128, bwd_granularity="tensor")

RECIPES = {r.name: r for r in (FP8, FP8_TENSOR, FP8_TENSOR_FAST, FP8_DELAYED, FP4, INT4)}
# the short names published benchmark commands used; accepted everywhere a recipe name is
ALIASES = {"fp8t": "fp8_tensor", "fp8tf": "fp8_tensor_fast", "fp8d": "fp8_delayed"}
# the default of convert_linears, LowBitLinear and the docs: the fastest fp8 recipe measured (1.53-1.58x compiled
# bf16 per layer on an H100, docs/results/linear_h100.json) at torch AdamW's quality (README's results table)
DEFAULT_RECIPE = "fp8_delayed"


def get_recipe(recipe: str | Recipe, **overrides) -> Recipe:
    if isinstance(recipe, str):
        try:
            recipe = RECIPES[ALIASES.get(recipe, recipe)]
        except KeyError:
            raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}") from None
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a recipe name ({', '.join(RECIPES)}) or a Recipe, "
                        f"got {type(recipe).__name__} {recipe!r}")
    if overrides:  # a Recipe checks its fields when it is made (Recipe._validate)
        recipe = recipe.with_(**overrides)
    return recipe
