"""lpoptim.AdamW on DTensor parameters (FSDP2's ``fully_shard``, HSDP): states live with the local shard.

A DTensor parameter's state tensors are DTensors on the parameter's mesh, so that torch.distributed.checkpoint
(DCP) saves each rank's piece and reshards on load, as it does for torch.optim.AdamW (whose
``torch.zeros_like(p)`` states are DTensors). The step itself only ever sees the local tensors.

- codes and fp32 moments: the parameter's global shape and placements.
- scales, global shape (rows, ceil(N/G)) with rows = prod(shape[:-1]): groups run along the last dimension, so
  a Shard(0) parameter (R, ..., N) has its scale rows sharded exactly like its dim 0: placement Shard(0).
  For 3-D and wider parameters that holds when dim-0 chunks times prod(shape[1:-1]) are the row chunks
  (always when the shard count divides shape[0]). A 1-D parameter (scale (1, ceil(N/G))) is sharded along
  its only, grouped, dimension: placement Shard(1), exact when every shard starts on a group boundary
  (ceil(N/W) a multiple of G). Layouts where a group would straddle two shards are refused, with the fix.
- step: a plain 0-dim tensor (the same on every rank), as torch's AdamW keeps it.

Only Shard(0) (one mesh dimension) and Replicate placements are handled; tensor parallelism (Shard(1),
_StridedShard) is refused. Whether a tensor is quantized depends on its global shape only, so a checkpoint
holds the same entries whatever the number of ranks that wrote or reads it.
"""
from __future__ import annotations

import math

import torch

from ..quant import num_groups, packed_shape
from .state import CODES4, StateLayout


def is_dtensor(t) -> bool:
    return torch.is_tensor(t) and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local(t):
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def element_offset(p) -> int:
    """The index, in the whole tensor (row-major), of the local shard's first element: 0 unless ``p`` is a DTensor
    sharded along dim 0 (what the stochastic roundings, bf16 parameters' and 4-bit v's, draw their bits by, so
    shards round as the whole)."""
    if not is_dtensor(p) or p.dim() == 0:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) * math.prod(p.shape[1:])


def _chunks(n: int, w: int) -> list[tuple[int, int]]:
    """(offset, size) of torch.chunk's pieces of n over w shards, empty trailing pieces included (DTensor's
    and FSDP2's Shard semantics)."""
    c = -(-n // w) if n else 0
    return [(min(i * c, n), max(0, min(c, n - i * c))) for i in range(w)]


def _shard_dims(p) -> list[int]:
    from torch.distributed.tensor import Replicate, Shard

    dims = []
    for i, pl in enumerate(p.placements):
        if type(pl) is Shard and pl.dim == 0:
            dims.append(i)
        elif not isinstance(pl, Replicate):
            raise NotImplementedError(f"lpoptim.AdamW handles DTensor parameters placed Shard(0) or Replicate "
                                      f"(FSDP2, HSDP, replicate); got {p.placements}")
    if len(dims) > 1:
        raise NotImplementedError(f"lpoptim.AdamW: dim 0 sharded over several mesh dimensions ({p.placements})")
    return dims


def scale_spec(p, layout: StateLayout):
    """(global shape, placements) of the scale DTensors of the quantized DTensor parameter ``p``; raises if
    a quantization group would straddle a shard boundary."""
    from torch.distributed.tensor import Replicate, Shard

    shape = tuple(p.shape)
    gshape = num_groups(shape, layout.group_size)
    dims = _shard_dims(p)
    if not dims:
        return gshape, tuple(Replicate() for _ in p.placements)
    w = p.device_mesh.size(dims[0])
    G = layout.group_size
    if len(shape) >= 2:
        inner = math.prod(shape[1:-1])
        ok = [(o * inner, s * inner) for o, s in _chunks(shape[0], w)] == _chunks(gshape[0], w)
        scale_pl = Shard(0)
        hint = f"shape[0]={shape[0]} divisible by the {w} shards"
    else:
        ok = all((s == 0 and gs == 0) or (o == go * G and gs == -(-s // G))
                 for (o, s), (go, gs) in zip(_chunks(shape[0], w), _chunks(gshape[1], w)))
        scale_pl = Shard(1)
        hint = f"ceil({shape[0]}/{w}) a multiple of group_size={G}"
    if not ok:
        raise ValueError(
            f"lpoptim.AdamW: a parameter of shape {shape} sharded {p.placements} over {w} ranks would split a "
            f"quantization group between two shards (needs {hint}); give it fp32 moments with a parameter "
            f"group whose min_quant_numel exceeds {p.numel()}, or change group_size / the number of shards")
    placements = tuple(scale_pl if i == dims[0] else Replicate() for i in range(len(p.placements)))
    return gshape, placements


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def spec_of(p, name: str, layout: StateLayout):
    """(global shape, placements) of state entry ``name`` of DTensor parameter ``p``; None for 'step'."""
    if name == "step":
        return None
    if name.endswith("_scale"):
        return scale_spec(p, layout)
    if name.endswith(CODES4):  # 4-bit codes: the last dim halved; a shard's groups are whole, so its bytes too
        return packed_shape(p.shape), tuple(p.placements)
    return tuple(p.shape), tuple(p.placements)


def wrap_state(p, state: dict, layout: StateLayout) -> dict:
    """Local state tensors of DTensor parameter ``p`` -> DTensors on its mesh (step stays a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if layout.quantized:
        scale_spec(p, layout)  # refuse straddling groups before anything is built
    out = {}
    for name, t in state.items():
        spec = spec_of(p, name, layout) if torch.is_tensor(t) and not is_dtensor(t) else None
        if spec is None:
            out[name] = t
            continue
        shape, placements = spec
        out[name] = DTensor.from_local(t, p.device_mesh, placements, run_check=False,
                                       shape=torch.Size(shape), stride=_contiguous_stride(shape))
    return out


def localize_state(p, state: dict, layout: StateLayout) -> dict:
    """A loaded state of DTensor parameter ``p`` as local tensors. Its entries may be DTensors (placed like
    ``p``'s states, or otherwise: redistributed) or plain tensors of the global shape (a non-distributed
    checkpoint: each rank keeps its own piece, no communication) or of the local shape (kept)."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for name, v in state.items():
        if not torch.is_tensor(v):
            out[name] = v
            continue
        # codes and moments are placed like p whatever the layout (a torch AdamW state's fp32 moments too)
        spec = None if name == "step" else spec_of(p, name, layout)
        if is_dtensor(v):
            if spec is not None and (v.device_mesh != p.device_mesh or tuple(v.placements) != spec[1]):
                v = v.redistribute(p.device_mesh, spec[1])
            out[name] = v.to_local()
        elif spec is not None and tuple(v.shape) == tuple(spec[0]) and any(pl.is_shard() for pl in spec[1]):
            out[name] = distribute_tensor(v.to(local(p).device), p.device_mesh, spec[1], src_data_rank=None).to_local()
        else:
            out[name] = v
    return out
