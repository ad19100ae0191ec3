"""A Hugging Face causal LM's training loss without its whole logits.

``model(input_ids, labels=labels)`` in an HF ``...ForCausalLM`` computes the LM head over every position (tokens x
vocabulary, then an fp32 copy and what cross_entropy saves: about 10 bytes per logit, 1.3 GB at 2048 tokens and
a 64 k vocabulary), only to reduce it to one number. ``chunk_causal_lm_loss(model)`` replaces the model's
``forward`` (an instance attribute, as ``compress_activations`` does for blocks) by one that, when it is given
labels with gradients on in training mode, runs the model with ``logits_to_keep=1`` (the head over the last
position only), takes the decoder's last hidden state from a forward hook, and computes the loss with
``linear_cross_entropy`` chunk by chunk. The loss is HF's ``ForCausalLMLoss``: labels shifted left by one (or
``shift_labels`` as given), ``ignore_index`` (-100), the mean over counted targets or the sum over
``num_items_in_batch`` (what the Trainer passes under gradient accumulation); an MoE model's router loss is added
as its own forward adds it. The output's ``logits`` are None in that case (they were never made); evaluation,
``no_grad``, calls without labels and calls for a tuple (``return_dict=False``, or ``config.return_dict`` off)
run the model's own forward unchanged.

Gemma 2's final soft-capping is computed in each chunk (linear_cross_entropy's ``softcap``). Models whose logits
are otherwise more than the head's GEMM (Cohere's logit scale, Granite's logit scaling), heads with a bias and
forwards without ``logits_to_keep`` are refused by ``why_not``: their loss is left as it is.
"""
from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..instance_forward import had_own_forward, install_forward, remove_forward
from .linear_cross_entropy import linear_cross_entropy

_ATTR = "_lpoptim_chunked_loss"
# config attributes that put more than the head's GEMM between the hidden states and the logits (Gemma 2's
# final_logit_softcapping is taken into the chunked loss: linear_cross_entropy's softcap)
_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is, by its class name, a Hugging Face causal LM (``...ForCausalLM``, ``...LMHeadModel``)."""
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def _decoder(model: nn.Module) -> nn.Module | None:
    prefix = getattr(model, "base_model_prefix", "")
    decoder = getattr(model, prefix, None) if prefix else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def base_models(model: nn.Module) -> list[nn.Module]:
    """The modules of an HF model that make its positions and mask and return its last hidden state: the base
    model under ``base_model_prefix`` and, where it has one, its ``decoder`` (OPTForCausalLM calls
    ``self.model.decoder`` directly, so the base model's own forward never runs); [] where there is none."""
    decoder = _decoder(model)
    if decoder is None:
        return []
    inner = getattr(decoder, "decoder", None)
    return [decoder] + ([inner] if isinstance(inner, nn.Module) else [])


def why_not(model: nn.Module) -> str | None:
    """Why the loss of ``model`` cannot be computed chunk by chunk (None: it can)."""
    if not is_causal_lm(model):
        return f"{type(model).__name__} is not a Hugging Face causal LM"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"its output head is a {type(head).__name__}, not an nn.Linear"
    if head.bias is not None:
        return "its output head has a bias"
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            return f"its logits are transformed after the head (config.{name}={value})"
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        return f"{type(model).__name__}.forward takes no logits_to_keep"
    if _decoder(model) is None:
        return "no decoder found under base_model_prefix"
    return None


class _ChunkedLossForward:
    """The instance ``forward`` of a model whose training loss is computed chunk by chunk (a class, not a
    closure, so that it is what ``remove`` recognises)."""

    def __init__(self, model: nn.Module, original, had_forward: bool, chunk: int | None):
        self.model, self.original, self.had_forward, self.chunk = model, original, had_forward, chunk
        self.whole_logits = False  # set where the base model cut its output: the model's own loss from then on
        # what inspect.signature(model.forward) reports: the HF Trainer keeps only the dataset columns the forward
        # names (remove_unused_columns), and would drop input_ids against (*args, labels=None, **kwargs)
        self.__signature__ = inspect.signature(original)

    def __call__(self, *args, labels=None, **kwargs):
        model = self.model
        keep = kwargs.get("logits_to_keep")
        return_dict = kwargs.get("return_dict")
        if return_dict is None:  # as HF's can_return_tuple decides it: the config's, unless passed
            return_dict = getattr(getattr(model, "config", None), "return_dict", True)
        if (labels is None or not model.training or not torch.is_grad_enabled() or not return_dict or self.whole_logits
                or not (keep is None or (isinstance(keep, int) and keep == 0))):
            return self.original(*args, labels=labels, **kwargs)
        captured = []
        hooks = [m.register_forward_hook(lambda _m, _a, out: captured.append(
            out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]))
            for m in base_models(model)]
        try:
            out = self.original(*args, labels=None, **{**kwargs, "logits_to_keep": 1})
        finally:
            for h in hooks:
                h.remove()
        if not captured:
            raise RuntimeError(f"lpoptim chunked loss: {type(model).__name__}.forward did not run its base model "
                               "(no last hidden state seen); restore_causal_lm_loss(model) or prepare(..., "
                               "chunked_loss=False)")
        hidden = captured[-1]
        ignore_index = kwargs.get("ignore_index", -100)
        targets = kwargs.get("shift_labels")
        if targets is None:
            targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        if hidden.shape[:-1] != targets.shape:  # the base model cut its output to logits_to_keep (Gemma 4's shared
            # KV caches, say): the model's own forward and loss, whole logits, for this and every later call (a
            # second forward only this once)
            self.whole_logits = True
            warnings.warn(f"lpoptim chunked loss: {type(model).__name__}'s base model cuts its output to "
                          "logits_to_keep; its own loss (whole logits) is used from now on", stacklevel=2)
            return self.original(*args, labels=labels, **kwargs)
        targets = targets.to(hidden.device)
        head = model.get_output_embeddings()
        softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        loss = linear_cross_entropy(hidden, head.weight, targets, chunk=self.chunk, ignore_index=ignore_index,
                                    softcap=softcap)
        items = kwargs.get("num_items_in_batch")
        if items is not None:  # HF's reduction="sum" over the items of the whole accumulated batch
            loss = loss * (targets != ignore_index).sum() / torch.as_tensor(items, device=loss.device)
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            coef = getattr(model, "router_aux_loss_coef", getattr(model.config, "router_aux_loss_coef", 0.0))
            loss = loss + coef * aux.to(loss.device)
        out.loss = loss
        out.logits = None
        return out


def chunk_causal_lm_loss(model: nn.Module, chunk: int | None = None) -> nn.Module:
    """Compute the training loss of HF causal LM ``model`` without its whole logits (module docstring); in place,
    returns ``model``. ValueError, naming why, for a model this cannot serve (``why_not``)."""
    why = why_not(model)
    if why:
        raise ValueError(f"chunk_causal_lm_loss: {why}")
    if _ATTR in model.__dict__:
        return model
    install_forward(model, _ATTR, _ChunkedLossForward(model, model.forward, had_own_forward(model), chunk))
    return model


def restore_causal_lm_loss(model: nn.Module) -> None:
    """Undo ``chunk_causal_lm_loss``."""
    remove_forward(model, _ATTR)
