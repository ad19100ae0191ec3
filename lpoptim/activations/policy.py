"""What to do with each tensor autograd saves inside a wrapped block: the policy and the op classification.

Granularity follows COAT's mixed scheme. A saved tensor is classified by the torch function that saved it
(tracked by ``OpTracker`` in hooks.py; the outermost torch-level call, e.g. ``linear``, ``layer_norm``, ``mul``):

- ``gemm``: saved by a matmul-like op (``linear``, ``matmul``, ``bmm``, ...). Its backward is a GEMM, which is
  insensitive to a coarse scale, so one scale per row (or per tensor) is enough and costs nothing.
- ``attention``: saved by fused attention (``scaled_dot_product_attention``, ``multi_head_attention_forward``).
  COAT keeps these in bf16; ``attention="keep"`` does that, ``"fp8"`` quantizes them per row like a GEMM input.
- ``mask``: saved by dropout (``dropout``, ``native_dropout``, ``bernoulli``, ...): on the CPU a float mask of 0
  and 1/(1-p), which FP8 would change (1.1111 -> 1.125, gradients off by several percent): kept exactly. (CUDA's
  dropout saves a bool mask, kept as every non-float tensor is.)
- ``nonlinear``: everything else (norms, GELU/SiLU, products, ...): groups of 16 along the last dimension, because
  the backward of a non-linear op multiplies element by element and one outlier must not flatten its whole row.
  This is also the fallback when the saving op is unknown (eager code between a compiled block's graph breaks;
  the compiled graphs themselves are classified from the graphs, graph_hooks.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..formats import E4M3, FloatFormat, get_format

# Names as torch reports them to a TorchFunctionMode (``func.__name__``), Tensor methods included.
GEMM_OPS = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv",
    "bilinear", "_scaled_mm",
})
ATTENTION_OPS = frozenset({
    "scaled_dot_product_attention", "multi_head_attention_forward", "flex_attention",
    "flash_attn_func", "flash_attn_varlen_func",
})
# Ops whose saved tensors are masks (values FP8 would change): kept exactly.
MASK_OPS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "bernoulli", "dropout_", "alpha_dropout_", "feature_dropout", "feature_alpha_dropout_", "rrelu",
})



@dataclass(frozen=True)
class ActivationPolicy:
    """How a wrapped block stores what autograd saves.

    fmt: the FP8 format of the codes (E4M3: forward tensors).
    gemm_granularity: "row" (one fp32 scale per row of the last dimension, one pass) or "tensor" (one scale;
        needs a reduction pass before quantizing).
    group_size: group length along the last dimension for tensors that feed non-linear ops (COAT: 16).
    attention: "keep" leaves attention's saved tensors as they are (COAT's choice), "fp8" compresses them.
    attention_output: attention's output, where ``attention="keep"`` keeps q, k and v. "replay" (eager) runs the
        attention forward again in backward from the kept q, k and v (no memory, the same bits; falls back to
        "gemm" where the inputs are not all held, e.g. attention with dropout); in compiled graphs it is kept.
        Packing it (attention's backward reads it for rowsum(dO * O)) moved q's and k's gradients to cosine
        0.995 (OPT, BERT blocks, head dim 64, bf16). "gemm" packs it as a GEMM input (``gemm_granularity``), as
        COAT stores the output projection's input; "keep" keeps it. With ``attention="fp8"`` all are packed.
    min_numel: tensors with fewer elements are left alone (norm statistics, biases: not worth a launch).
    recompute: save only the block's inputs (in FP8, groups of ``group_size``) and run the block again in
        backward: an FP8 activation checkpoint.
    unknown: granularity for tensors saved by an op the tracker cannot name ("group" or "row").
    derive: replay cheap element-wise results (SiLU's output, a norm's output, dtype casts, views) in backward
        from tensors already held, instead of saving them (derive.py).
    fuse_replays: run each chain of replays, with the decoding of the packed tensors it starts from, as one
        compiled kernel (fused_replay.py: Inductor, compiled once per structure on the first backward). None:
        on CUDA tensors; True / False: always / never (the CPU's compile is slow and gains little).
    """

    fmt: FloatFormat | str = E4M3
    gemm_granularity: str = "row"
    group_size: int = 16
    attention: str = "keep"
    attention_output: str = "replay"
    min_numel: int = 4096
    recompute: bool = False
    unknown: str = "group"
    derive: bool = True
    fuse_replays: bool | None = None

    def __post_init__(self):
        fmt = get_format(self.fmt)
        if not isinstance(fmt, FloatFormat) or fmt.dtype is None:
            raise ValueError(f"activations need an fp8 format with a torch dtype, got {fmt.name}")
        object.__setattr__(self, "fmt", fmt)
        if self.gemm_granularity not in ("row", "tensor"):
            raise ValueError(f"gemm_granularity must be 'row' or 'tensor', got {self.gemm_granularity!r}")
        if self.attention not in ("keep", "fp8"):
            raise ValueError(f"attention must be 'keep' or 'fp8', got {self.attention!r}")
        if self.attention_output not in ("replay", "gemm", "keep"):
            raise ValueError(f"attention_output must be 'replay', 'gemm' or 'keep', got {self.attention_output!r}")
        if self.unknown not in ("group", "row"):
            raise ValueError(f"unknown must be 'group' or 'row', got {self.unknown!r}")
        if self.group_size < 1:
            raise ValueError("group_size must be positive")
        # granularity_for's memo (not a field: equality, hashing and repr ignore it)
        object.__setattr__(self, "_by_op", {})

    def kind_of(self, op: str | None) -> str:
        if op in GEMM_OPS:
            return "gemm"
        if op in ATTENTION_OPS:
            return "attention"
        if op in MASK_OPS:
            return "mask"
        return "nonlinear"

    def granularity_of(self, kind: str, op: str | None = None) -> str | None:
        """The quantizer granularity for a tensor of this kind; None means keep it as it is."""
        if kind == "gemm":
            return self.gemm_granularity
        if kind == "attention":
            return None if self.attention == "keep" else "row"
        if kind == "mask":
            return None
        if op is None:
            return self.unknown
        return "group"

    def granularity_for(self, op: str | None) -> str | None:
        """``granularity_of(kind_of(op), op)``, memoized by op name: pack asks it for every saved tensor, and a
        model saves through a few dozen distinct ops."""
        gran = self._by_op.get(op, _MISSING)
        if gran is _MISSING:
            gran = self._by_op[op] = self.granularity_of(self.kind_of(op), op)
        return gran


_MISSING = object()
