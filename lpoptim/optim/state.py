"""How lpoptim.AdamW lays out a parameter's state, and what it costs in memory.

Per parameter with at least ``min_quant_numel`` elements:
  exp_avg_codes      uint8 codes, the parameter's shape (E4M3 bit patterns of the expanded, scaled m); not torch's
                     name, so torch.optim.AdamW refuses such a state (KeyError 'exp_avg') rather than train on codes
  exp_avg_scale      fp32 (rows, ceil(N / G)): one number per group of G along the last dimension, the group's
                     absmax with k's 8-bit code in its low mantissa byte (quant.pack_scale)
  exp_avg_sq_codes, exp_avg_sq_scale   the same for the second moment (v; sqrt(v) with sqrt_exp_avg_sq=True)
  max_exp_avg_sq_codes, max_exp_avg_sq_scale   with amsgrad
  step               fp32 0-dim tensor on the parameter's device
With state_bits=4 each moment's codes are held under ``<name>_codes4`` instead: uint8 of packed_shape(param.shape)
(the last dimension halved, two 4-bit codes per byte, quant.quantize_state4), beside the same fp32 ``<name>_scale``
(the group's plain absmax); 1.0625 bytes per parameter for m and v at G=128. (The groups' ratio bound is applied
when v is encoded, quant.quantize_state4_moments: nothing is stored for it.)
Smaller parameters (norms, biases) keep plain fp32 moments under the same names, as torch.optim.AdamW does.
Everything is a plain tensor: a checkpoint loads with torch.load(weights_only=True) without lpoptim.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..formats import FloatFormat, get_format
from ..quant import num_groups, packed_shape


CODES = "_codes"  # a quantized moment's codes are held under its name with this suffix
CODES4 = "_codes4"  # ... and 4-bit packed codes (state_bits=4) with this one


def moment_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of unquantized moments and of the update's arithmetic: fp32, float64 for float64 parameters (as
    torch.optim.AdamW keeps them)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def stored_moment(state: dict, name: str) -> torch.Tensor | None:
    """The tensor holding moment ``name`` (its codes, or its fp32 values; codes saved by lpoptim 0.1 under the
    moment's own name too), or None if the state has none."""
    for key in (name + CODES, name + CODES4, name):
        if key in state:
            return state[key]
    return None


def state_bits_of(state: dict) -> int:
    """The bits per code of a quantized state (4 where it holds packed 4-bit codes, else 8)."""
    return 4 if "exp_avg" + CODES4 in state else 8


@dataclass(frozen=True)
class StateLayout:
    quantized: bool
    exp_avg_format: str = "e4m3"
    exp_avg_sq_format: str = "e4m3"
    group_size: int = 128
    expansion: bool = True
    sqrt_v: bool = False
    state_bits: int = 8

    @property
    def codes_suffix(self) -> str:
        return CODES4 if self.state_bits == 4 else CODES

    def format_of(self, name: str) -> FloatFormat:
        return get_format(self.exp_avg_format if name == "exp_avg" else self.exp_avg_sq_format)

    def __post_init__(self):  # hashed once: the fused step groups its batch by layout every step
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self):
        return self._hash

    def __reduce__(self):  # string hashes differ between processes: a pickled layout hashes itself anew
        return StateLayout, dataclasses.astuple(self)

    @staticmethod
    def for_param(param: torch.Tensor, group: dict) -> "StateLayout":
        return _layout(param.numel() >= group["min_quant_numel"], group["exp_avg_format"], group["exp_avg_sq_format"],
                       group["group_size"], group["expansion"], group["sqrt_exp_avg_sq"], group["state_bits"])


@functools.lru_cache(maxsize=256)
def _layout(*fields) -> StateLayout:
    """One StateLayout object per distinct layout: dict lookups by it then stop at identity."""
    return StateLayout(*fields)


def init_state(param: torch.Tensor, layout: StateLayout, amsgrad: bool) -> dict[str, torch.Tensor]:
    dev = param.device
    names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    state = {"step": torch.zeros((), dtype=torch.float32, device=dev)}
    for name in names:
        if layout.quantized:
            # zero codes with zero scales decode to exactly 0
            shape = packed_shape(param.shape) if layout.state_bits == 4 else param.shape
            state[name + layout.codes_suffix] = torch.zeros(shape, dtype=torch.uint8, device=dev)
            state[name + "_scale"] = torch.zeros(num_groups(param.shape, layout.group_size), dtype=torch.float32, device=dev)
        else:
            state[name] = torch.zeros(param.shape, dtype=moment_dtype(param), device=dev)
    return state


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Optimizer-state memory: total bytes, and bytes per parameter overall and over quantized tensors.

    ``quantized_bytes_per_param`` is the figure to compare with torch AdamW's 8 (bitsandbytes and torchao
    2.03, COAT 2.19); ``bytes_per_param`` includes the small tensors kept in fp32 and the step counters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):  # a model passed by mistake fails here, not deep inside
        raise TypeError(f"state_bytes takes an optimizer (e.g. lpoptim.AdamW), got {type(optimizer).__name__}")
    total = quant_bytes = quant_params = params = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            params += p.numel()
            st = optimizer.state.get(p, {})
            b = sum(t.numel() * t.element_size() for k, t in st.items() if torch.is_tensor(t) and k != "step")
            total += b + sum(t.numel() * t.element_size() for k, t in st.items() if k == "step" and torch.is_tensor(t))
            if "exp_avg_scale" in st:
                quant_bytes += b
                quant_params += p.numel()
    return {
        "total_bytes": float(total),
        "params": float(params),
        "bytes_per_param": total / max(params, 1),
        "quantized_params": float(quant_params),
        "quantized_bytes_per_param": quant_bytes / max(quant_params, 1),
    }
