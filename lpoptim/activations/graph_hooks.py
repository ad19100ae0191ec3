"""Saved-tensor hooks that torch.compile inlines: FP8 packing inside a compiled block's own graphs.

Plain Python hooks (``saved_tensors_hooks(pack, unpack)``) see a compiled block only from outside: its graph
returns every tensor it saves at the end of the forward, the hooks pack them then (one more read and write of
each, after the fact), and backward unpacks them all before the backward graph starts. AOTAutograd inlines hooks
that are ``torch.fx.GraphModule``s instead (torch >= 2.8): it traces the pack hook once per saved tensor into the
forward graph's epilogue and the unpack hook into the backward graph's prologue, so Inductor schedules the
packing right after the kernel that produces the tensor (the original is freed inside the forward like any
intermediate) and the decoding where backward reads it, with no Python per tensor at run time.

``GraphHooks`` holds such a pair for one handle (Dynamo guards on the hooks' identity, so each handle's policy gets
graphs of its own). ``PackContext`` installs them around every forward of a wrapped block. Each dispatches on
where it is called from:

- by AOTAutograd while it compiles (``graph_compile._get_saved_tensor_hook_context()`` names the saved node in
  the forward graph and the backward graph that reads it): ``pack_in_graph`` decides from the graphs and emits
  torch ops (quant.py's reference arithmetic, which Inductor compiles) or, for groups on CUDA, our Triton kernels
  (kernels/act_quant.py, the same bits);
- by autograd in eager mode (no such context): the innermost active ``PackContext``'s ``pack`` (hooks.py), and
  its ``unpack``, exactly as before.

The graph rules follow hooks.py's, read off the graphs instead of a TorchFunctionMode:
- only the graph's intermediates are offered (torch's ``saved_tensors_hooks_filtering_mode="donated"``): never
  parameters or inputs; a tensor the graph saves once is packed once;
- non-float or fp8 tensors, and tensors below ``policy.min_numel`` elements, are kept;
- a tensor read in backward by an attention kernel follows ``policy.attention``, except attention's own output
  (the output projection's input too), packed per row under ``policy.attention_output="gemm"`` (kept under
  "replay": a graph's saved tensors cannot be recomputed from a hook);
- a tensor read in backward only by GEMMs (through views) gets ``policy.gemm_granularity``; everything else
  groups of ``policy.group_size`` along the last dimension (rows where the last dim is not a multiple of it);
- every scale is a power of two held as one byte (E8M0's biased exponent).
Replays (hooks.py rule 6) are Inductor's own business here: its partitioner recomputes cheap element-wise ops
instead of saving them.

Each decision is recorded once, when the graph is compiled, into the handle's ``graph_records``
(``ActivationHandle.graph_stats()``); the compiled graphs then run without calling Python per tensor.
"""
from __future__ import annotations

import threading

import torch

from .codec import decode_pow2, encode_pow2, storage_rows
from .policy import GEMM_OPS
from .stats import SavedRecord

_LOCAL = threading.local()  # the PackContexts entered on this thread, innermost last


def push(ctx) -> None:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(ctx)


def pop(ctx) -> None:
    stack = _LOCAL.stack
    if stack and stack[-1] is ctx:
        stack.pop()
    else:  # exited out of order (an exception unwinding several): drop it wherever it is
        stack.remove(ctx)


def current():
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None  # (no stack yet on this thread: never entered here)


def _no_context():
    return None


def _context_getter():
    """AOTAutograd's ``_get_saved_tensor_hook_context``: what it tells a hook it is tracing (the saved node, both
    graphs), None when autograd calls the hook in eager mode. torch's private API: a torch without it never
    inlines hooks, so every call is eager there."""
    try:
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
    except ImportError:
        return _no_context
    return _get_saved_tensor_hook_context


_hook_context = _context_getter()  # looked up once: the eager hooks run for every saved tensor

try:  # Dynamo's frame callback, set while compiled code (or code Dynamo may compile) runs; private torch API
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _frame_callback
except ImportError:  # pragma: no cover  (every call then takes the disabled wrapper)
    def _frame_callback():
        return True


# ---- what a saved node is, from the graphs ----------------------------------------------------------------------

_VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze",
                       "unsqueeze", "alias", "slice", "select", "as_strided", "clone", "contiguous"})
_ATTENTION_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "flex_attention")


def _op_name(target) -> str:
    """aten.mm.default -> "mm"; a Python callable -> its __name__."""
    name = getattr(target, "__name__", str(target))
    overload = getattr(target, "_overloadpacket", None)
    return getattr(overload, "__name__", name.split(".")[0])


def _readers(node: torch.fx.Node, depth: int = 0) -> list[str]:
    """The ops that read ``node``'s value in its graph, looking through views and copies."""
    names = []
    for user in node.users:
        name = _op_name(user.target) if user.op == "call_function" else user.op
        if name in _VIEW_OPS and depth < 8:
            names.extend(_readers(user, depth + 1))
        else:
            names.append(name)
    return names


def classify(info: dict) -> tuple[str, str]:
    """("attention" | "gemm" | "nonlinear", the producing op's name) for the saved node ``info`` describes."""
    node = info["_node"]
    producer = _op_name(node.target) if node.op == "call_function" else node.op
    if producer == "getitem" and node.args:  # an output of a multi-output op (attention's out and logsumexp)
        parent = node.args[0]
        producer = _op_name(parent.target) if getattr(parent, "op", None) == "call_function" else producer
    readers = []
    bw = info.get("_bw_graph")
    if bw is not None:
        for ph in bw.find_nodes(op="placeholder"):
            if ph.name == node.name:
                readers = _readers(ph)
                break
    if any(w in r for r in (*readers, producer) for w in _ATTENTION_WORDS):
        return "attention", producer
    if readers and all(r in GEMM_OPS for r in readers):  # the eager rules' names
        return "gemm", producer
    return "nonlinear", producer


def _attention_output(node: torch.fx.Node, producer: str) -> bool:
    """The node is an attention op's first output (its out; the logsumexp and the rest come after)."""
    return (node.op == "call_function" and _op_name(node.target) == "getitem" and len(node.args) > 1
            and node.args[1] == 0 and any(w in producer for w in _ATTENTION_WORDS))


def _hint(v) -> int | None:
    """A concrete value for a size (its hint when symbolic), or None."""
    if isinstance(v, int):
        return v
    try:
        return int(v.node.hint)
    except (AttributeError, TypeError):
        return None


# ---- the traced pack and unpack ---------------------------------------------------------------------------------

def pack_in_graph(t: torch.Tensor, info: dict, policy, records: dict | None):
    """What the compiled forward saves instead of ``t``: ``t`` itself (kept), or a tuple (codes, biased exponents
    of the power-of-two scales (uint8), granularity, dtype, (shape, strides) of a permuted ``t`` or None) that
    unpack_in_graph decodes."""
    dtype = t.dtype
    if info["_node"].op == "placeholder":  # a graph input (parameter, block input): held by its owner anyway
        return _kept(t, info, "parameter", "input", records)  # (torch offers none by default: "donated" only)
    if not dtype.is_floating_point or dtype.itemsize < 2 or dtype == torch.float64:
        kind = "lowbit" if dtype.itemsize < 2 or not dtype.is_floating_point else "other"
        return _kept(t, info, kind, _op_name(info["_node"].target), records)
    kind, producer = classify(info)
    numel, n = _hint(t.numel()), _hint(t.shape[-1]) if t.dim() else 1
    # a size known only as a symbol (dynamic shapes: the tokens) is decided as large: the graph serves every size,
    # and the hint of the one it was compiled for must not decide for the others
    if numel is None or n is None or (numel < policy.min_numel and not isinstance(t.numel(), torch.SymInt)):
        return _kept(t, info, "small", producer, records)
    gran = policy.granularity_of(kind, producer)
    if gran is None and policy.attention_output == "gemm" and _attention_output(info["_node"], producer):
        gran = policy.gemm_granularity  # also the output projection's input (as the eager rule, hooks.py)
    if gran is None:
        return _kept(t, info, "attention", producer, records)
    if gran == "group" and (n % policy.group_size or isinstance(t.shape[-1], torch.SymInt)):
        gran = "row"  # groups must tile the last dim exactly here (no padding inside a graph)
    fmt = policy.fmt
    # one power-of-two scale per group, row or tensor, held as a byte (codec.encode_pow2); groups on CUDA through
    # our kernel: Inductor's kernel for the same torch ops took twice as long (H100, docs/activations.md)
    group = policy.group_size if gran == "group" else t.shape[-1] if gran == "row" and t.dim() else None
    layout, src = None, t
    if not t.is_contiguous():
        # the backward graph was compiled for t's strides (Inductor reinterprets saved buffers by them): a
        # permutation of contiguous memory (attention's q, k, v and out) is packed in memory order and decoded
        # back onto its strides (codec.storage_rows, as eager packing does); any other layout is kept
        src = storage_rows(t)
        if src is None:
            return _kept(t, info, "other", producer, records)
        layout = (tuple(t.shape), tuple(t.stride()))
    codes, scale = encode_pow2(src, group, fmt, kernel="op" if gran == "group" and t.is_cuda else False)
    _record(records, info, f"fp8_{gran}", producer, t, numel * dtype.itemsize,
            numel + _hint(scale.numel()) * scale.element_size())
    return codes, scale, gran, dtype, layout


def _kept(t, info, kind, producer, records):
    size = (_hint(t.numel()) or 0) * t.dtype.itemsize
    _record(records, info, kind, producer, t, size, size)
    return t


def _record(records: dict | None, info, kind, producer, t, original, stored):
    """One record per saved node of a graph (AOTAutograd calls the hook twice per node: once to run it, once
    to trace it)."""
    if records is not None:
        records[(id(info["_fw_graph"]), info["_node"].name)] = SavedRecord(
            kind, producer, tuple(_hint(s) for s in t.shape), str(t.dtype).replace("torch.", ""), original, stored)


def unpack_in_graph(packed) -> torch.Tensor:
    codes, scale, gran, dtype, layout = packed
    # groups through our kernel; Inductor's consumers then read the decoded tensor: the decoding fused into them
    # made their reductions 2.4x slower (per-element exponent gathers with div/mod index arithmetic; a Llama block
    # on an H100, docs/activations.md)
    out = decode_pow2(codes, scale, dtype, kernel="op" if gran == "group" and codes.is_cuda else False)
    return out if layout is None else out.as_strided(*layout)


# ---- the hooks ---------------------------------------------------------------------------------------------------

@torch.fx.wrap
def _pack(t):
    """The hooks' graph: GraphHooks' pack for the innermost PackContext (the GraphModules' own call goes to
    their GraphHooks directly)."""
    return current().hooks._pack(t)


@torch.fx.wrap
def _unpack(packed):
    if isinstance(packed, torch.Tensor):  # kept (PackContext.pack returns parameters as they are)
        return packed
    if isinstance(packed, tuple):  # pack_in_graph's, being traced into a backward graph
        return unpack_in_graph(packed)
    # Kept, packed or derived (hooks.py): kept tensors come back detached (returning a saved output itself from
    # pack would make a reference cycle through its grad_fn); autograd only needs their values
    return packed.unpack()


def _pack_hook(t):
    return _pack(t)


def _unpack_hook(packed):
    return _unpack(packed)


def _hook_module(fn, dispatch):
    """A GraphModule (AOTAutograd inlines only GraphModule hooks) whose call goes to ``dispatch`` directly:
    autograd calls a hook once per saved tensor in eager mode, where nn.Module's call path would add a few
    microseconds each; AOTAutograd traces through the call either way. (Its graph, a call of an ``fx.wrap``-ed
    function, also keeps AOTAutograd's compile cache off for these graphs, whose plan a cache hit would skip.)"""
    gm = torch.fx.symbolic_trace(fn)
    # Autograd also calls the hooks from eager code inside a compiled region (between graph breaks), where Dynamo
    # would try to compile their Python frames (and recompile them per tensor up to its cache limit): the call frame
    # is skipped and ``dispatch`` runs with Dynamo off. (AOTAutograd traces through it all the same.)
    run = torch.compiler.disable(dispatch)

    def call(self, x):
        # eager mode (no frame callback set): ``dispatch`` itself; the disabled wrapper costs a few microseconds a
        # call, and autograd calls a hook for every tensor saved or read (CPU micro-runs, not kept)
        return dispatch(x) if _frame_callback() is None else run(x)

    _skip_frame(call)
    type(gm).__call__ = call  # GraphModule gives every instance a class of its own
    return gm


def _skip_frame(fn):
    """Mark ``fn``'s code for Dynamo to leave alone (torch._dynamo.decorators.skip; private: absent, nothing)."""
    try:
        from torch._dynamo.decorators import skip
    except ImportError:  # pragma: no cover
        return fn
    return skip(fn)


class GraphHooks:
    """The saved-tensor hooks of one handle (or one policy): ``pack`` and ``unpack``, GraphModules of their own.

    Dynamo guards on the identity of the active saved-tensor hooks, so blocks under different handles (different
    policies) get graphs of their own, and a graph compiled under one handle's hooks records into that handle;
    after ``remove()`` (no hooks) the block compiles again, unwrapped."""

    def __init__(self, policy, records: dict | None = None):
        self.policy, self.records = policy, records
        self.pack = _hook_module(_pack_hook, self._pack)
        self.unpack = _hook_module(_unpack_hook, _unpack)
        self.pack._lpoptim = True  # lpoptim's own (hooks.py's warning about outer hooks skips them: nested blocks)

    def _pack(self, t):
        info = _hook_context()
        if info is None:  # eager: autograd saving a tensor inside a wrapped block's forward
            return current().pack(t)
        return pack_in_graph(t, info, self.policy, self.records)


_BY_POLICY: dict = {}


def hooks_for(policy) -> GraphHooks:
    """One GraphHooks per policy, for PackContexts made without a handle (nothing records their graphs)."""
    hooks = _BY_POLICY.get(policy)
    if hooks is None:
        hooks = _BY_POLICY[policy] = GraphHooks(policy)
    return hooks
