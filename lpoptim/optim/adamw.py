"""lpoptim.AdamW: torch.optim.AdamW with its moments in FP8 (per-group scales, dynamic range expansion)."""
from __future__ import annotations

import copy
import dataclasses
import numbers
import warnings
from collections import defaultdict
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer

from ..formats import FloatFormat, get_format
from ..quant import num_groups
from . import distributed as _dist
from .reference import MOMENTS, load_moment, reference_adamw_step
from .state import CODES, StateLayout, init_state, moment_dtype, state_bits_of, stored_moment

LPOPTIM_DEFAULTS = dict(
    exp_avg_format="e4m3",
    exp_avg_sq_format="e4m3",
    group_size=128,
    min_quant_numel=4096,
    expansion=True,
    sqrt_exp_avg_sq=False,
    bf16_stochastic_round=False,
    state_bits=8,
)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself: states always follow the local shard."""
    return _dist.local(t)


class AdamW(Optimizer):
    """Drop-in for ``torch.optim.AdamW`` whose m and v live in FP8 (about 2.06 bytes per parameter instead of 8), or
    in 4 bits with ``state_bits=4`` (1.0625).

    Signature, defaults and argument checks are torch.optim.AdamW's (with its messages); arguments torch would
    only trip over inside a step (``betas=(0.9,)``, ``lr='1e-3'``) and lpoptim's options are refused up front, the
    options also by add_param_group and load_state_dict. lpoptim's own keyword options, settable per parameter
    group:

    - ``exp_avg_format`` / ``exp_avg_sq_format``: "e4m3" (default) or "e5m2".
    - ``group_size`` (128): elements per scale, along the last dimension (so FSDP2 shards keep whole groups).
    - ``min_quant_numel`` (4096): smaller tensors (norms, biases) keep fp32 moments.
    - ``expansion`` (True): COAT's dynamic range expansion (per-group k, halves the rounding error).
    - ``sqrt_exp_avg_sq`` (False): store sqrt(v) rather than v (measured: no better; benchmarks/state_quant_error.py).
    - ``bf16_stochastic_round`` (False): round bf16 parameters' updates stochastically (unbiased), so bf16 master
      weights without an fp32 copy lose nothing to rounding (stochastic_round.py; torchao's option of that name).
      Deterministic: the same steps give the same bits, on resume and on every data-parallel replica.
    - ``state_bits`` (8): 4 stores m and v in 4 bits, two codes per byte (1.0625 bytes per parameter of state at
      group_size 128, scales included, against 2.06 for FP8): m as INT4 with zero (q/7 of the group's absmax,
      q = -7..7, to nearest), v on a linear grid without zero (j/16 of its absmax, j = 1..16, rounded
      stochastically: deterministic, from the step and the parameter's index, then raised where needed so that no
      element's decoded m^2 / v exceeds the largest m^2 / v of its group's exact moments: the groups' ratio bound,
      applied at encode, nothing stored), Adam's bound at decode. Measured on real gradient streams
      (docs/optimizer.md, "4-bit states"): the largest step up to 1.41x torch's (FP8: at most 2x) and a mean
      update error of 0.366-0.417 (FP8: 0.05); a memory-for-accuracy trade. exp_avg_format,
      exp_avg_sq_format and expansion do not apply; sqrt_exp_avg_sq is refused. A state saved with the other
      state_bits is converted when loaded (decoded and encoded again).

    ``foreach`` is accepted and has no effect. ``fused``: None picks the fused Triton kernel for CUDA tensors
    and the pure-torch reference elsewhere; True demands the kernel; False always uses the reference.
    ``capturable`` is accepted: step counts always live on the parameter's device and the fused step makes no
    host sync (Tensor betas are read once a step with float()). A captured step reads the parameters' address
    table at replay: keep the gradients' buffers fixed between replays (as CUDA graphs require); an eager step on
    gradients at a few new addresses rewrites that table in place. ``differentiable=True``, sparse gradients and complex parameters are refused.
    """

    _step_supports_amp_scaling = True  # GradScaler passes grad_scale / found_inf as it does to torch's fused AdamW

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, **lpoptim_options: Any):
        # torch.optim.Adam's checks, in its order and with its messages; then what torch leaves to the first step
        if isinstance(lr, torch.Tensor):
            if foreach and not capturable:
                raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        else:
            _check_real("lr", lr)
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        _check_real("eps", eps)
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if isinstance(betas, (str, bytes, torch.Tensor)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor) and b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
            if _is_real(b) or isinstance(b, torch.Tensor):  # other types: torch's message below
                if not 0.0 <= b < 1.0:
                    raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        _check_real("weight_decay", weight_decay)
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, torch.Tensor) for b in betas)):
            raise ValueError("betas must be either both floats or both Tensors")
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor) and not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
        betas = tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() != 0 else b for b in betas)
        if fused:
            if differentiable:
                raise RuntimeError("`fused` does not support `differentiable`")
            if foreach:
                raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        if differentiable:
            raise ValueError("lpoptim.AdamW does not support differentiable=True (its states are quantized)")
        unknown = set(lpoptim_options) - set(LPOPTIM_DEFAULTS)
        if unknown:
            raise TypeError(f"lpoptim.AdamW got unexpected keyword arguments {sorted(unknown)}; "
                            f"lpoptim's own options are {sorted(LPOPTIM_DEFAULTS)}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=False, fused=fused,
                        decoupled_weight_decay=True, **{**LPOPTIM_DEFAULTS, **lpoptim_options})
        _check_group(defaults)  # the options' errors before any parameter is looked at
        super().__init__(params, defaults)

    # ---- parameter groups --------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._salt_cache = None
        group = self.param_groups[-1]
        try:
            _check_group(group)
            _check_params(group)
        except Exception:
            self.param_groups.pop()  # a refused group is not half-added
            raise

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            _fill_group(group, self.defaults)
            for p in group["params"]:  # a step saved as a number (older state dicts), as torch's Adam converts it
                p_state = self.state.get(p, {})
                if len(p_state) != 0 and not torch.is_tensor(p_state.get("step", 0.0)):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32, device=_local(p).device)

    # ---- the step ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            self._step_group(group, group["params"], grad_scale, found_inf)
        return loss

    @torch.no_grad()
    def step_params(self, params, group: dict | None = None) -> None:
        """Update these parameters of one group now (those with a gradient), with the group's options: what
        lpoptim.step_in_backward calls as gradients are accumulated (``group`` saves the search)."""
        params = list(params)
        if group is None:
            group = next(g for g in self.param_groups if any(q is params[0] for q in g["params"]))
        self._step_group(group, params, getattr(self, "grad_scale", None), getattr(self, "found_inf", None))

    def _step_group(self, group: dict, params, grad_scale, found_inf) -> None:
        from ..kernels import adamw_step as kernel  # imported lazily: triton is optional on the CPU

        beta1, beta2 = (float(b) for b in group["betas"])
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], amsgrad=group["amsgrad"], maximize=group["maximize"])
        bf16_sr = group["bf16_stochastic_round"]
        four = group["state_bits"] == 4  # 4-bit states round v stochastically, salted by the parameter's index too
        salts = self._salts() if bf16_sr or four else None
        options = tuple(group[k] for k in _PREPARED_BY)
        prepared = self._prepared_cache()
        fused_batch, fused_salts, fused_offsets = [], [], []
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("lpoptim.AdamW does not support sparse gradients")
            prep = prepared.get(p)
            # what a parameter needs besides its gradient, worked out once: a step's host time is per parameter
            # (under FSDP2 a fresh preparation cost ~0.1 ms of Python a parameter, DTensor views and offsets: a lab
            # profile of Llama-2-7B on 2 H100s, torch 2.11, not kept; docs/distributed.md has the step times)
            if (prep is None or prep.options != options or prep.state is not self.state.get(p) or not prep.state
                    or prep.tensor_key != (p.shape, p.dtype, p.device)  # p.data reassigned
                    or (prep.dtensor and not prep.same_locals(p))):
                prep = prepared[p] = self._prepare(p, group, options)
            if prep.empty_shard:  # an empty shard (uneven FSDP2 sharding): only the step count moves
                prep.local_state["step"].add_(1.0 if found_inf is None else (found_inf.to(prep.param.device) == 0).float())
                continue
            if prep.dtensor:
                grad = _local(grad)
            param, state, layout = prep.param, prep.local_state, prep.layout
            if prep.fusable and grad.dtype == param.dtype and grad.is_contiguous() and param.is_contiguous():
                fused_batch.append((param, grad, state, layout))
                fused_salts.append(salts[p] if salts else 0)
                fused_offsets.append(prep.offset)
            elif group["fused"]:
                raise RuntimeError(f"fused=True but the Triton kernel cannot step this parameter "
                                   f"({tuple(param.shape)}, {param.dtype}, {param.device}); use fused=None")
            else:
                reference_adamw_step(param, grad, state, layout, grad_scale=grad_scale, found_inf=found_inf,
                                     sr_salt=salts[p] if bf16_sr else None, state_salt=salts[p] if four else 0,
                                     offset=prep.offset, **hyper)
        if fused_batch:
            kernel.fused_adamw_step(fused_batch, grad_scale=grad_scale, found_inf=found_inf,
                                    sr_salts=fused_salts if bf16_sr else None,
                                    **(dict(state_salts=fused_salts) if four else {}), offsets=fused_offsets,
                                    **hyper)

    # calls between sweeps at least (a sweep is ~0.1 us a parameter); at least as many as the cache holds, so that
    # stepping in backward one parameter per call still sweeps O(1) per call on average
    _SWEEP_EVERY = 64

    def _prepared_cache(self) -> dict:
        """The per-parameter preparations; entries whose state was dropped or replaced are swept out when the
        state dict shrank or was replaced (load_state_dict), and every max(_SWEEP_EVERY, cache size) calls (a state deleted and
        re-created empty by a read of ``opt.state[p]`` leaves the size unchanged), so the old state of a parameter
        that is not stepped again is not held."""
        prepared = self.__dict__.setdefault("_prepared", {})
        calls = self.__dict__["_prepared_calls"] = self.__dict__.get("_prepared_calls", 0) + 1
        due = calls >= max(self._SWEEP_EVERY, len(prepared))
        if prepared and (due or len(prepared) > len(self.state) or self.__dict__.get("_prepared_for") != id(self.state)):
            for p in [p for p, prep in prepared.items() if self.state.get(p) is not prep.state]:
                del prepared[p]
            self._prepared_calls = 0
        self._prepared_for = id(self.state)
        return prepared

    def _prepare(self, p, group: dict, options: tuple) -> _Prepared:
        """Layout, state (made on first use, checked against the group's options), local views and whether the
        kernel can step it. Redone when the group's options or the state object change (load_state_dict), and
        for DTensors when their local tensor or a state tensor is another object."""
        from ..kernels import adamw_step as kernel

        param = _local(p)
        layout = StateLayout.for_param(p, group)  # the global shape decides, whatever the sharding
        state = self.state[p]
        if len(state) == 0:
            state.update(self._new_state(p, param, layout, group["amsgrad"]))
        elif group["amsgrad"] and stored_moment(state, "max_exp_avg_sq") is None:
            new = self._new_state(p, param, layout, True)
            state.update({k: v for k, v in new.items() if k.startswith("max_")})
        dtensor = _dist.is_dtensor(p)
        local_state = {k: _local(v) for k, v in state.items()} if dtensor else state
        empty = dtensor and param.numel() == 0
        if not empty:
            _check_state(local_state, param, layout)
        # the gradient's own checks (dtype, contiguity) are made every step
        fusable = (group["fused"] is not False and param.device.type == "cuda"
                   and kernel.supports(param, param, layout))
        return _Prepared(options, state, param, local_state, layout, dtensor, empty, fusable,
                         (p.shape, p.dtype, p.device), _dist.element_offset(p), tuple(state.items()))

    def _salts(self) -> dict:
        """Each parameter's index over all groups: its stochastic-rounding salt (stable across save and load)."""
        salts = getattr(self, "_salt_cache", None)
        if salts is None:  # built once; add_param_group drops it
            salts = self._salt_cache = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return salts

    @staticmethod
    def _new_state(p, param, layout: StateLayout, amsgrad: bool) -> dict:
        state = init_state(param, layout, amsgrad)
        return _dist.wrap_state(p, state, layout) if _dist.is_dtensor(p) else state

    # ---- state dicts ---------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads lpoptim's own state dicts exactly and torch.optim.AdamW's by quantizing them (and an FP8 state into a
        group with state_bits=4, or a 4-bit one into state_bits=8, by decoding and encoding it again).

        torch.optim.Optimizer.load_state_dict's steps and hook semantics: the pre-hooks run first and what they
        return is what gets loaded; the post-hooks run last and see the final state. Unlike torch's base class,
        every state tensor keeps its saved dtype (scales and fp32 moments must never pass through bf16), and a
        group keeps this optimizer's lpoptim options where the saved one has none (a torch AdamW state dict)."""
        state_dict = state_dict.copy()  # shallow, as torch's
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        state, param_groups = self._loaded_state(state_dict)
        self.__setstate__({"state": state, "param_groups": param_groups})
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _loaded_state(self, state_dict: dict) -> tuple[defaultdict, list[dict]]:
        """The state and groups a state dict loads as; nothing of this optimizer changes (a refused state dict
        leaves it as it was)."""
        groups = self.param_groups
        saved_groups = copy.deepcopy(state_dict["param_groups"])  # written into below
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups, strict=True)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups), strict=True))
        param_groups = []
        for index, (group, new_group) in enumerate(zip(groups, saved_groups, strict=True)):
            new_group["params"] = group["params"]
            if new_group.get("state_bits", group["state_bits"]) != group["state_bits"]:
                # torch's rule (a loaded group's options win) keeps the saved bits; a user who built this
                # optimizer with other bits to convert the states would otherwise get no conversion, unnoticed
                warnings.warn(f"lpoptim.AdamW.load_state_dict: param group {index} was saved with state_bits="
                              f"{new_group['state_bits']} and keeps it (this optimizer was built with "
                              f"{group['state_bits']}); to convert the states, set param_groups[{index}]"
                              f"['state_bits'] in the state dict before loading it", stacklevel=3)
            if "param_names" in group and "param_names" not in new_group:
                new_group["param_names"] = group["param_names"]
            for k in LPOPTIM_DEFAULTS:  # a torch AdamW state dict has none of lpoptim's options: this group's stay
                if k not in new_group:
                    new_group[k] = group[k]
            _fill_group(new_group, self.defaults)
            _check_group(new_group)
            _check_params(new_group)  # a saved fused=True meets this optimizer's parameters
            param_groups.append(new_group)
        owner = {id(p): g for g in param_groups for p in g["params"]}
        # torch's base class casts each saved tensor to a copy; here the given tensors are only read (a deep copy
        # of the whole checkpoint would double it in memory)
        state: defaultdict = defaultdict(dict)
        for pid, src in state_dict["state"].items():
            if pid not in id_map:  # state not assigned to a parameter is kept as is, as torch keeps it
                state[pid] = src
                continue
            p = id_map[pid]
            local = _local(p)
            layout = StateLayout.for_param(p, owner[id(p)])
            if _dist.is_dtensor(p):  # DTensor states (DCP) or a plain checkpoint's global tensors -> local
                src = _dist.localize_state(p, src, layout)
            # copies: the loaded state must not share tensors with the given dict (another optimizer's live state)
            # contiguous: the fused kernel indexes states as dense arrays, whatever strides the checkpoint had
            loaded = {k: (v.to(device=local.device, copy=True).contiguous() if torch.is_tensor(v) else v)
                      for k, v in src.items()}
            loaded = _convert_state(loaded, local, layout)
            state[p] = _dist.wrap_state(p, loaded, layout) if _dist.is_dtensor(p) else loaded
        return state, param_groups

    def torch_state_dict(self) -> dict:
        """This optimizer's state as torch.optim.AdamW would hold it (fp32 moments, dequantized)."""
        sd = self.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        owner = {id(p): g for g in self.param_groups for p in g["params"]}
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        out_state = {}
        for pid, p in zip(ids, params, strict=True):
            if pid not in sd["state"]:
                continue
            st = {k: _local(v) for k, v in sd["state"][pid].items()}
            layout = StateLayout.for_param(p, owner[id(p)])
            out = {"step": st["step"].detach().clone().to("cpu")}
            for name in MOMENTS:
                stored = stored_moment(st, name)
                if stored is not None and stored.numel() == 0:  # an empty shard (uneven FSDP2 sharding)
                    out[name] = torch.zeros(stored.shape, dtype=torch.float32, device=stored.device)
                elif stored is not None:
                    out[name] = (load_moment(st, name, layout, _local(p).shape) if "exp_avg_scale" in st
                                 else stored.to(torch.promote_types(stored.dtype, torch.float32), copy=True))
            if _dist.is_dtensor(p):  # torch's AdamW holds a DTensor parameter's moments as DTensors
                out = _dist.wrap_state(p, out, dataclasses.replace(layout, quantized=False))
            out_state[pid] = out
        groups = [{k: v for k, v in g.items() if k not in LPOPTIM_DEFAULTS} for g in sd["param_groups"]]
        for g in groups:
            g["decoupled_weight_decay"] = True
        return {"state": out_state, "param_groups": groups}


# the group options a parameter's preparation depends on (a change re-prepares it)
_PREPARED_BY = ("min_quant_numel", "exp_avg_format", "exp_avg_sq_format", "group_size", "expansion", "sqrt_exp_avg_sq",
                "amsgrad", "fused", "state_bits")


@dataclasses.dataclass
class _Prepared:
    options: tuple
    state: dict  # the optimizer's state object for the parameter (identity: a new one re-prepares)
    param: torch.Tensor  # the local tensor the kernel steps
    local_state: dict
    layout: StateLayout
    dtensor: bool
    empty_shard: bool
    fusable: bool  # the kernel can step it, given a gradient of its dtype and contiguous
    tensor_key: tuple  # the parameter's (shape, dtype, device) when prepared: a p.data with others re-prepares
    offset: int = 0  # the local shard's first element in the whole tensor: stochastic roundings draw by it
    state_items: tuple = ()  # the state's (name, tensor) pairs when prepared (DTensors: local_state holds views)

    def same_locals(self, p) -> bool:
        """A DTensor parameter's local tensor and state tensors are those prepared (FSDP2 keeps them across
        steps; re-sharding, ``load_state_dict(assign=True)`` or a state entry replaced makes new ones). The
        local tensor is compared by address: ``self.param`` holds its memory, so another tensor cannot be there."""
        local = getattr(p, "_local_tensor", None)  # to_local() may return a fresh view of it each call
        local = _local(p) if local is None else local
        return (local.data_ptr() == self.param.data_ptr() and local.shape == self.param.shape
                and local.stride() == self.param.stride() and len(self.state) == len(self.state_items)
                and all(self.state.get(k) is v for k, v in self.state_items))


# the group keys torch.optim.Adam's __setstate__ fills in for state dicts saved before they existed
_TORCH_GROUP_DEFAULTS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                             fused=None)


def _fill_group(group: dict, defaults: dict) -> None:
    """A group from an older state dict (or pickle) completed as torch.optim.AdamW completes it, and with
    lpoptim's options (this optimizer's defaults) where it has none."""
    for k, v in _TORCH_GROUP_DEFAULTS.items():
        group.setdefault(k, v)
    group["decoupled_weight_decay"] = True  # as torch.optim.AdamW: an Adam state dict loads as AdamW
    for k, v in LPOPTIM_DEFAULTS.items():
        group.setdefault(k, defaults.get(k, v))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_real(name: str, value) -> None:
    if not _is_real(value):
        kind = "a float or a 1-element Tensor" if name == "lr" else "a float"
        raise TypeError(f"{name} must be {kind}, got {value!r}")


def _check_group(group: dict) -> None:
    """lpoptim's own options of a parameter group (and the torch options it cannot honour): at construction,
    add_param_group and load_state_dict, so a bad value fails there and not inside a step."""
    for name in ("exp_avg_format", "exp_avg_sq_format"):
        try:
            fmt = get_format(group[name])
        except (ValueError, TypeError):
            fmt = None
        if not isinstance(fmt, FloatFormat) or fmt.dtype is None:
            raise ValueError(f"{name} must be 'e4m3' or 'e5m2', got {group[name]!r}")
    size = group["group_size"]
    if not isinstance(size, int) or isinstance(size, bool):
        raise TypeError(f"group_size must be a positive int, got {size!r}")
    if size < 1:
        raise ValueError(f"group_size must be a positive int, got {size!r}")
    numel = group["min_quant_numel"]
    if not _is_real(numel):
        raise TypeError(f"min_quant_numel must be a non-negative int (or float('inf')), got {numel!r}")
    if not numel >= 0:
        raise ValueError(f"min_quant_numel must be a non-negative int (or float('inf')), got {numel!r}")
    for name in ("expansion", "sqrt_exp_avg_sq", "bf16_stochastic_round"):
        if not isinstance(group[name], bool):
            raise TypeError(f"{name} must be True or False, got {group[name]!r}")
    bits = group["state_bits"]
    if isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"state_bits must be 8 (FP8 states) or 4 (4-bit states), got {bits!r}")
    if bits == 4 and group["sqrt_exp_avg_sq"]:
        raise ValueError("sqrt_exp_avg_sq=True is not supported with state_bits=4 (its v grid is linear)")
    if group.get("differentiable"):
        raise ValueError("lpoptim.AdamW does not support differentiable=True")
    if not group.get("decoupled_weight_decay", True):
        raise ValueError("lpoptim.AdamW always decouples weight decay: decoupled_weight_decay=False "
                         "(torch.optim.Adam's L2 penalty) is not supported")


def _check_params(group: dict) -> None:
    for p in group["params"]:
        if p.is_complex():
            raise ValueError("lpoptim.AdamW does not support complex parameters (view them as real pairs)")
        if group["fused"] and _local(p).device.type != "cuda":
            raise ValueError(f"fused=True needs CUDA parameters (the Triton kernel); got one on {p.device}")


def _check_state(state: dict, param: torch.Tensor, layout: StateLayout) -> None:
    """The state was made for this layout: a group's lpoptim options changed after its first step (group_size,
    min_quant_numel) would otherwise make the kernel read and write past the scales it has."""
    scale = state.get("exp_avg_scale")
    if (scale is not None) != layout.quantized or (
            scale is not None and tuple(scale.shape) != num_groups(param.shape, layout.group_size)):
        raise ValueError("lpoptim.AdamW: this parameter's state was built with other group options (group_size, "
                         "min_quant_numel), which cannot change after its first step, or for another shape "
                         "(p.data replaced by a tensor of another shape)")
    if scale is not None and state_bits_of(state) != layout.state_bits:
        raise ValueError(f"lpoptim.AdamW: this parameter's state was built with state_bits={state_bits_of(state)}, "
                         f"its group now asks for {layout.state_bits}: state_bits cannot change after the first step. "
                         "To convert, set state_bits in the param_groups of its state_dict() and load that: the "
                         "loaded states are converted (a loaded group's options replace the optimizer's, as in torch)")


def _convert_state(state: dict, param: torch.Tensor, layout: StateLayout) -> dict:
    """A loaded state in lpoptim's layout: kept as saved if it already is, quantized if it is torch's."""
    from .reference import encode_moment, encode_moments

    step = state.get("step", torch.zeros(()))
    step = torch.as_tensor(step, dtype=torch.float32).reshape(()).to(param.device)
    quantized_in = "exp_avg_scale" in state
    bits_in = state_bits_of(state)
    # lpoptim 0.1 kept codes under torch's names (torch's AdamW then loaded them as moments) with another k grid
    legacy = quantized_in and "exp_avg" + CODES not in state and bits_in == 8
    if quantized_in == layout.quantized and not legacy and (not quantized_in or bits_in == layout.state_bits):
        out = dict(state)
        out["step"] = step
        if not layout.quantized:  # fp32 moments stay fp32 whatever the parameter's dtype (float64 for float64)
            out.update({k: state[k].to(moment_dtype(param)) for k in MOMENTS if k in state})
        return out
    out = {"step": step}
    values = {}
    for name in MOMENTS:
        present = stored_moment(state, name) is not None
        if present and param.numel() == 0:  # an empty shard (uneven FSDP2 sharding): nothing to convert
            out.update({k: v for k, v in init_state(param, layout, True).items()
                        if k in (name, name + layout.codes_suffix, name + "_scale")})
        elif present:
            # a 4-bit state (codes4) decodes as such whatever this layout says; an FP8 one by the saved codes
            source = dataclasses.replace(layout, quantized=quantized_in, state_bits=bits_in,
                                         sqrt_v=layout.sqrt_v and bits_in == 8)
            values[name] = load_moment(state, name, source, param.shape).to(param.device)
    if "exp_avg" in values and "exp_avg_sq" in values:
        # 4 bits: v's codes raised to the groups' ratio bound of the moments loaded (torch's exact ones, or the
        # other codec's decoded ones)
        out.update(encode_moments(values.pop("exp_avg"), values.pop("exp_avg_sq"), layout))
    for name, value in values.items():
        out.update(encode_moment(name, value, layout))
    return out
