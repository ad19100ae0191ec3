"""What a wrapped block saved for backward, and how large it is: bytes by kind.

Kinds of saved tensors (one record per tensor autograd asked to save):

- ``fp8_row``, ``fp8_tensor``, ``fp8_group``: compressed; ``stored`` counts codes plus scales.
- ``attention``: saved by fused attention and kept as it is (``attention="keep"``).
- ``lowbit``: already low-bit (uint8/int8/fp8 codes a low-bit linear saved) or another non-float dtype: kept.
- ``small``: fewer than ``min_numel`` elements, or not smaller once packed: kept.
- ``other``: a float dtype lpoptim does not pack (float64), a tensor subclass or a sparse tensor: kept.
- ``constant``: passed to the block without needing grad (rotary tables, masks), or a view of it: kept by
  reference (the caller holds it).
- ``parameter``: a parameter or buffer (or a view of one): held by the module anyway, costs nothing here.
- ``duplicate``: the same tensor saved again by another op: shares the first copy, costs nothing.
- ``derived``: replayed in backward from tensors already held (a cheap element-wise op): costs nothing.
- ``recompute_input``: a block input held in FP8 by ``recompute=True``.
- ``decision``: the indices of a discrete decision (a MoE router's topk) that ``recompute=True`` replays.
- ``mask``: saved by dropout (a float mask on the CPU): kept exactly.

``original`` is what autograd would have held without the wrapper for that record (0 for parameters and
duplicates, which would not have cost memory either). A kept tensor costs its whole storage, counted once per
forward: q, k and v viewed out of one projection cost the projection once, as in ``record_saved``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class SavedRecord:
    kind: str
    op: str | None  # the torch function that saved it, when known
    shape: tuple[int, ...]
    dtype: str
    original: int  # bytes autograd would have held
    stored: int  # bytes held now


@dataclass
class SavedStats:
    """Records of every tensor saved by wrapped blocks since the last ``reset()``."""

    records: list[SavedRecord] = field(default_factory=list)

    def add(self, kind, op, t, original, stored):
        self.records.append(SavedRecord(kind, op, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                        int(original), int(stored)))

    def reset(self):
        self.records.clear()

    def bytes_by_kind(self) -> dict[str, int]:
        """Stored bytes by kind."""
        out: dict[str, int] = defaultdict(int)
        for r in self.records:
            out[r.kind] += r.stored
        return dict(out)

    def summary(self) -> dict[str, dict[str, int]]:
        """{kind: {"count", "original", "stored"}} plus a "total" entry."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            for key in (r.kind, "total"):
                d = out.setdefault(key, {"count": 0, "original": 0, "stored": 0})
                d["count"] += 1
                d["original"] += r.original
                d["stored"] += r.stored
        return out

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored for r in self.records)

    @property
    def original_bytes(self) -> int:
        return sum(r.original for r in self.records)

    def table(self) -> str:
        """A small text table (MiB by kind) for logs and the benchmark."""
        lines = [f"{'kind':<16}{'count':>6}{'original MiB':>14}{'stored MiB':>12}"]
        for k, d in sorted(self.summary().items(), key=lambda kv: kv[0] == "total"):
            lines.append(f"{k:<16}{d['count']:>6}{d['original'] / 2**20:>14.2f}{d['stored'] / 2**20:>12.2f}")
        return "\n".join(lines)


class record_saved:
    """Record what autograd saves inside the context without changing it (for an unwrapped baseline)::

        with record_saved(block) as stats:
            y = block(x)
        stats.stored_bytes   # bytes autograd holds for backward, each storage counted once

    Views of one storage (q, k, v split from one projection) cost the storage once: later views are recorded as
    ``shared``. Parameters and buffers of ``modules`` (and nn.Parameters anywhere) are recorded as ``parameter``.
    """

    def __init__(self, *modules):
        import torch

        from .hooks import _storage_ptr  # here, not per saved tensor (hooks imports this module)

        self._torch, self._storage_ptr = torch, _storage_ptr
        self.modules = modules
        self.stats = SavedStats()
        self._seen: dict[int, object] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        nbytes = t.numel() * t.element_size()
        ptr = self._storage_ptr(t)
        if isinstance(t, self._torch.nn.Parameter) or ptr in self._params:
            self.stats.add("parameter", None, t, 0, 0)
        elif ptr is not None and ptr in self._seen:
            self.stats.add("shared", None, t, 0, 0)
        else:
            size = t.untyped_storage().nbytes() if ptr is not None else nbytes
            self._seen[ptr] = t  # held until the context closes, so the address cannot be reused meanwhile
            self.stats.add("activation", None, t, size, size)
        return t

    def __enter__(self) -> SavedStats:
        from .hooks import module_storage_ptrs

        self._params = set().union(*[module_storage_ptrs(m) for m in self.modules]) if self.modules else set()
        self._hooks.__enter__()
        return self.stats

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._seen.clear()
        return False
