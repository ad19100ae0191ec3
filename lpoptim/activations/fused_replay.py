"""Replaying derived tensors, and decoding the packed ones they start from, in one compiled kernel (eager, CUDA).

In eager mode every replay (derive.py) and every decode (codec.py) is a pass over memory of its own. A Llama
block's RMSNorm output, saved by the q, k and v projections, is ``weight * (x32 * r).to(bf16)`` with ``x32``
packed: decoding ``x32`` writes it in fp32, the product reads it and writes another fp32 tensor, the cast reads
that and writes bf16, the weight's product reads and writes again: ~0.8 GB of traffic at 4 × 2048 × 4096, where
one kernel reading the codes and writing the three values autograd reads (``x32`` for pow and mul, the cast for
the weight's gradient, the output for the projections) moves ~0.3 GB. The SwiGLU product's replay from the packed
gate and up projections is the same story.

When a Derived is first read, ``run`` collects what it needs that nothing has computed yet: the Deriveds below it
and the packed tensors with one-byte power-of-two group scales (the common case; other packed tensors and plain
tensors are inputs, read as before). It generates a function of those inputs that computes every one of them in
order, torch op by torch op, and returns each value still waited for by another reader (``uses`` beyond the
readers inside this function), and compiles it with Inductor, which fuses the lot. The values are handed to their
readers as ``ComputedOnce`` memos, exactly as separate unpacks would have left them.

The function's source is generated per structure (ops, constants, which value feeds which, the inputs' ranks and
dtypes), so each structure has a code object, and compiled graphs, of its own: Dynamo keeps a few compiled
variants per code object and would fall back to running the ops one by one past that. Structures are few per model
(the norms, the MLP's product); each compiles on the first backward, and once more, with dynamic shapes, if another
shape comes (variable sequence lengths). A structure that fails to compile is remembered and replayed op by op
from then on, with a warning. Inductor keeps intermediate bf16 values in fp32 unless
told otherwise; ``emulate_precision_casts`` makes it round where eager rounds, so values equal the op-by-op replay's
up to the fused kernels' own arithmetic (the same ops in fp32; the tests compare within an ulp).
"""
from __future__ import annotations

import warnings

import torch

from ..formats import E4M3
from .codec import PackedActivation, _use_triton, decode_pow2
from .derive import Derived, _view_of, call_without_grad

# Inductor on CUDA; tests may set "aot_eager" (the same graph without code generation) to check the plumbing fast
BACKEND = "inductor"
_COMPILED: dict = {}  # structure key -> compiled function, or None when it failed to compile
_UNCOMPILED: dict = {}  # structure key -> its function uncompiled, for a structure that failed to compile
# replays that only view or cast a tensor (a weight's bf16 copy, seen transposed) gain nothing from a kernel
_VIEWS = frozenset({"_view_of", "_cast", "view", "reshape", "transpose", "permute", "flatten", "unflatten",
                    "squeeze", "unsqueeze", "contiguous"})


def fusable_packed(p) -> bool:
    """A packed tensor whose decoding the fused function can do: one-byte power-of-two group scales, stored in
    index order with contiguous strides (codec.decode_pow2's torch form), not decoded yet."""
    return (type(p) is PackedActivation and p.scale.dtype == torch.uint8 and p._memo is None
            and not p.storage_order and p.codes.is_contiguous() and tuple(p.codes.shape) == p.shape
            and p.stride == tuple(p.codes.stride()))


def _inside(v) -> bool:
    """Whether an argument object is computed inside the fused function (else it is read as an input). A view
    replayed on its base (``_view_of``: as_strided at the base's storage offset, which Dynamo cannot trace) is
    read as an input: unpacking it computes its base (fused in turn) and views it."""
    return (type(v) is Derived and v._memo is None and v.func is not _view_of) or fusable_packed(v)


def _freeze(v):
    """A hashable form of a non-tensor argument that tells apart what ``==`` does not (0.0 and -0.0, 1 and 1.0 and
    True) and matches NaN with itself; lists become tuples; TypeError if there is none."""
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_freeze(x) for x in v))
    if isinstance(v, float):
        return ("float", repr(v))
    hash(v)
    return (type(v), v)


def _below(objs) -> set[int]:
    """ids of the objects (Deriveds, packed tensors) not computed yet that computing ``objs`` would compute."""
    seen, stack = set(), list(objs)
    while stack:
        v = stack.pop()
        if id(v) in seen or isinstance(v, torch.Tensor) or getattr(v, "_memo", None) is not None:
            continue
        seen.add(id(v))
        if type(v) is Derived:
            stack.extend(a for is_t, a in v.args if is_t)
    return seen


class _Plan:
    """What a root Derived needs that nothing has computed yet, as one generated function.

    ``nodes``: Deriveds and packed tensors, each after what it reads; ``inputs``: what the function takes, one per
    occurrence (tensors, and argument objects computed elsewhere: their ``unpack`` counts one reader each);
    ``reads``: readers of each node inside the function; ``lines``, ``consts``: the function's body and names;
    ``key``: the structure (with the inputs' layouts added by ``run``)."""

    def __init__(self, root: Derived):
        self.nodes, self.index = [], {}
        self._collect(root)
        self.inputs, self.reads, self.lines, self.consts, key = [], {}, [], {}, []
        for i, node in enumerate(self.nodes):
            if type(node) is PackedActivation:
                refs = [self._ref(True, node.codes, key), self._ref(True, node.scale, key),
                        self._ref(False, node.dtype, key)]
                self.lines.append(f"    v{i} = decode({', '.join(refs)})")
                continue
            self.consts[f"f{i}"] = node.func
            key.append(("op", node.func, len(node.args), tuple(node.kwargs)))
            refs = [self._ref(is_t, v, key) for is_t, v in node.args]
            refs += [f"{k}={self._ref(False, v, key)}" for k, v in node.kwargs.items()]
            self.lines.append(f"    v{i} = f{i}({', '.join(refs)})")
        self.key = tuple(key)
        self.work = sum(type(n) is PackedActivation or getattr(n.func, "__name__", None) not in _VIEWS
                        for n in self.nodes)

    def _collect(self, node) -> None:
        if id(node) in self.index:
            return
        if type(node) is Derived:
            for is_t, v in node.args:
                if is_t and not isinstance(v, torch.Tensor) and _inside(v):
                    self._collect(v)
        self.index[id(node)] = len(self.nodes)
        self.nodes.append(node)

    def _ref(self, is_t: bool, v, key: list) -> str:
        if not is_t:
            name = f"c{len(self.consts)}"
            self.consts[name] = v
            key.append(("const", _freeze(v)))
            return name
        i = self.index.get(id(v)) if not isinstance(v, torch.Tensor) else None
        if i is not None:
            self.reads[id(v)] = self.reads.get(id(v), 0) + 1
            key.append(("node", i))
            return f"v{i}"
        self.inputs.append(v)
        key.append(("input",))
        return f"a{len(self.inputs) - 1}"

    def outputs(self, root) -> list[int]:
        """The nodes whose values leave the function: the root, and each node a reader outside the function still
        waits for (``uses`` beyond its readers inside)."""
        return [i for i, n in enumerate(self.nodes) if n is root or n.uses > self.reads.get(id(n), 0)]

    def function(self, outs: list[int], eager: bool = False):
        """The generated Python function (a code object of its own: Dynamo caches compiled graphs per code).
        ``eager``: to run uncompiled, decoding with codec's kernel on CUDA (compiled, the torch form is traced)."""
        src = (f"def fused_replay({', '.join(f'a{i}' for i in range(len(self.inputs)))}):\n"
               + "\n".join(self.lines) + f"\n    return ({''.join(f'v{i}, ' for i in outs)})\n")
        scope = dict(self.consts, decode=_decode_eager if eager else decode_pow2)
        exec(compile(src, f"<lpoptim fused replay {len(_COMPILED)}>", "exec"), scope)
        return scope["fused_replay"]


def reset() -> None:
    """Forget every structure (compiled, failed or uncompiled): the next backward compiles afresh."""
    _COMPILED.clear()
    _UNCOMPILED.clear()


def _decode_eager(codes, exps, dtype):
    return decode_pow2(codes, exps, dtype, kernel=_use_triton(codes, E4M3))


def _compile(fn):
    options = {"emulate_precision_casts": True} if BACKEND == "inductor" else None
    return torch.compile(fn, backend=BACKEND, fullgraph=True, options=options)


def run(root: Derived) -> torch.Tensor | None:
    """``root``'s value, with what it needs computed by one compiled function and handed to their other readers
    as memos; None where fusion does not apply (the caller replays op by op: a view unpacks its base, fused)."""
    if root.func is _view_of or torch.compiler.is_compiling():  # (compiled autograd traces the ops themselves)
        return None
    try:
        plan = _Plan(root)
    except TypeError:  # a constant with no hashable form: no key for the structure
        return None
    if plan.work < 2:
        return None
    # a view read as an input computes its base when unpacked: where that base (or anything below it) is also
    # computed inside the function, it would be computed twice and its memo miscounted: op by op instead
    views = [v for v in plan.inputs if type(v) is Derived and v.func is _view_of and v._memo is None]
    if views and not _below(views).isdisjoint(map(id, plan.nodes)):
        return None
    values = [v if isinstance(v, torch.Tensor) else v.unpack() for v in plan.inputs]
    outs = plan.outputs(root)
    # shapes are Dynamo's to guard: a second shape recompiles the same code with dynamic shapes (torch.compile's
    # default), so variable sequence lengths cost two compiles per structure, not one per length
    key = (plan.key, tuple(outs), tuple((v.dim(), v.dtype, v.device.type) for v in values))
    fn = _COMPILED.get(key, False)
    result = None
    if fn is not None:
        try:
            if fn is False:
                fn = _COMPILED[key] = _compile(plan.function(outs))
            result = call_without_grad(fn, values)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001  a structure that does not compile: op by op from now on
            _COMPILED[key] = None
            warnings.warn(f"lpoptim: a fused replay did not compile ({type(e).__name__}: {str(e)[:200]}); "
                          "replaying its ops one by one", RuntimeWarning, stacklevel=2)
    if result is None:  # the same function, uncompiled (decoding with the Triton kernel on CUDA), made once
        eager = _UNCOMPILED.get(key)
        if eager is None:
            eager = _UNCOMPILED[key] = plan.function(outs, eager=True)
        result = call_without_grad(eager, values)
    out = None
    for i, value in zip(outs, result):
        node = plan.nodes[i]
        if node is root:
            out = value
        else:
            node._memo, node._left = value, node.uses - plan.reads.get(id(node), 0)
    return out
