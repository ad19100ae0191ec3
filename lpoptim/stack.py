"""Training stacks named by parts: one vocabulary for ``lpoptim train --runs`` and ``lpoptim bench --recipes``.

A name is an optimizer followed by any of the parts below, joined by ``+`` in any order, each at most once:

    lpoptim+bf16+fp8_delayed+bwd+ce+sac55

The linear-layer parts are exactly the recipe names ``lpoptim.convert_linears`` takes (lpoptim/nn/recipes.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from .nn.recipes import ALIASES, DEFAULT_RECIPE, RECIPES

OPTIMIZERS = {
    "torch": "torch AdamW",
    "lpoptim": "lpoptim.AdamW",
    "bnb": "bitsandbytes AdamW8bit",
    "torchao": "torchao AdamWFp8 + float8 linears",
    "prepare": "lpoptim.prepare(model) with its own choices (alone, or with +bf16)",
}

PARTS = {
    "bf16": "bf16 parameters, no fp32 master (lpoptim rounds stochastically)",
    "act": "saved activations in FP8 (compress_activations)",
    "attn": "with act: attention's saved q, k, v and output in FP8 too (attention=\"fp8\")",
    "rec": "only each block's input saved, in FP8; blocks recomputed in backward",
    "bwd": "optimizer step inside backward (step_in_backward; lpoptim only)",
    "ce": "LM head and loss chunk by chunk, no whole logits (linear_cross_entropy)",
    "sacNN": "with --compile: Inductor keeps NN% of the activations (1-100), recomputes the rest",
    "cg": "with --compile on CUDA: compiled blocks replayed as CUDA graphs",
    "ckpt": "with --hf-config: the model's own (HF) gradient checkpointing",
    "s4": "lpoptim's moments in 4 bits (state_bits=4; lpoptim and prepare only)",
    "offNN": "with --hf-config on CUDA: the first NN blocks' saved activations in host memory (offload=NN)",
    "<linear recipe>": ", ".join(RECIPES) + f" (convert_linears; default {DEFAULT_RECIPE})",
}

# the names published results were run under; they keep working
LEGACY_OPTIMIZERS = {"bf16": "torch", "torch-bf16": "torch+bf16", "lpoptim-bf16": "lpoptim+bf16"}


@dataclass(frozen=True)
class Stack:
    optimizer: str  # a key of OPTIMIZERS
    linears: str | None = None  # convert_linears recipe, or "torchao" (torchao float8 training)
    compress: bool = False  # compress_activations on every block
    recompute: bool = False  # compress_activations(recompute=True)
    attention: bool = False  # with compress: compress_activations(attention="fp8")
    in_backward: bool = False  # lpoptim.step_in_backward
    master: str = "fp32"  # the parameters' dtype: "fp32" or "bf16"
    chunked_loss: bool = False  # LM head + loss chunk by chunk
    # compiled blocks only: Inductor's activation_memory_budget (the fraction of what a compiled block would save)
    activation_budget: float | None = None
    # compiled blocks only: torch.compile mode "reduce-overhead". Their intermediates live in a private pool that
    # the allocator's "allocated" figure does not see during replays, so bench reports the reserved peak.
    cuda_graphs: bool = False
    hf_checkpointing: bool = False  # HF models: gradient_checkpointing_enable()
    state_bits: int = 8  # lpoptim.AdamW's state_bits
    offload: int = 0  # blocks whose saved activations go to host memory (prepare's offload=)

    @property
    def name(self) -> str:
        """The canonical spelling: optimizer, then the parts in a fixed order."""
        parts = [self.optimizer]
        parts += ["bf16"] if self.master == "bf16" else []
        parts += ["s4"] if self.state_bits == 4 else []
        parts += [self.linears] if self.linears and self.optimizer != "torchao" else []
        parts += ["rec"] if self.recompute else ["act"] if self.compress else []
        parts += ["attn"] if self.attention else []
        parts += ["bwd"] if self.in_backward else []
        parts += ["ce"] if self.chunked_loss else []
        parts += [f"sac{round(self.activation_budget * 100)}"] if self.activation_budget is not None else []
        parts += [f"off{self.offload}"] if self.offload else []
        parts += ["cg"] if self.cuda_graphs else []
        parts += ["ckpt"] if self.hf_checkpointing else []
        return "+".join(parts)

    @property
    def label(self) -> str:
        words = [OPTIMIZERS[self.optimizer] + (" with 4-bit states" if self.state_bits == 4 else "")]
        if self.master == "bf16":
            words.append("bf16 params" + (" (stochastic rounding)" if self.optimizer == "lpoptim" else ""))
        if self.linears and self.optimizer != "torchao":
            words.append(f"{self.linears} linears")
        if self.recompute:
            words.append("FP8 block inputs + recompute")
        elif self.compress:
            words.append("FP8 activations" + (" (attention's too)" if self.attention else ""))
        if self.in_backward:
            words.append("step in backward")
        if self.chunked_loss:
            words.append("chunked head+loss")
        if self.activation_budget is not None:
            words.append(f"Inductor keeps {round(self.activation_budget * 100)}% of activations")
        if self.offload:
            words.append(f"{self.offload} blocks' activations offloaded")
        if self.cuda_graphs:
            words.append("CUDA graphs")
        if self.hf_checkpointing:
            words.append("HF gradient checkpointing")
        return ", ".join(words)


def vocabulary() -> str:
    """The parts, one per line, for --help and error messages."""
    lines = ["optimizer: " + ", ".join(OPTIMIZERS), "then any of, joined by '+':"]
    lines += [f"  {k:16s} {v}" for k, v in PARTS.items()]
    return "\n".join(lines)


def parse_stack(name: str) -> Stack:
    """The Stack a name spells; ValueError (naming the valid parts) for anything else."""
    def bad(why: str) -> ValueError:
        return ValueError(f"recipe {name!r}: {why}; a recipe is an optimizer ({', '.join(OPTIMIZERS)}) followed by "
                          f"+parts: bf16, s4, act, attn, rec, bwd, ce, sacNN, offNN, cg, ckpt, or a linear recipe ({', '.join(RECIPES)})")

    if not isinstance(name, str):
        raise TypeError(f"a recipe name is a string, got {type(name).__name__}")
    head, _, rest = name.partition("+")
    head = LEGACY_OPTIMIZERS.get(head, head)
    parts = head.split("+") + (rest.split("+") if rest else [])
    optimizer, parts = parts[0], parts[1:]
    if optimizer not in OPTIMIZERS:
        raise bad(f"unknown optimizer {optimizer!r}")
    if len(set(parts)) != len(parts):
        raise bad("a part appears twice")
    kw: dict = dict(optimizer=optimizer, linears="torchao" if optimizer == "torchao" else None)
    for p in parts:
        if p == "bf16":
            kw["master"] = "bf16"
        elif p in ("act", "rec"):
            if kw.get("compress"):
                raise bad("act and rec exclude each other")
            kw.update(compress=True, recompute=p == "rec")
        elif p == "attn":
            kw["attention"] = True
        elif p == "bwd":
            kw["in_backward"] = True
        elif p == "ce":
            kw["chunked_loss"] = True
        elif p == "cg":
            kw["cuda_graphs"] = True
        elif p == "ckpt":
            kw["hf_checkpointing"] = True
        elif p == "s4":
            kw["state_bits"] = 4
        elif p.startswith("sac"):
            pct = p[3:]
            if not (pct.isascii() and pct.isdigit() and 0 < int(pct) <= 100):
                raise bad(f"{p!r}: sacNN takes NN in 1..100")
            kw["activation_budget"] = int(pct) / 100
        elif p.startswith("off"):
            count = p[3:]
            if not (count.isascii() and count.isdigit() and int(count) > 0):
                raise bad(f"{p!r}: offNN takes a number of blocks NN >= 1")
            kw["offload"] = int(count)
        elif p in RECIPES or p in ALIASES:
            if kw["linears"]:
                raise bad("one linear recipe at most (torchao brings its own)")
            kw["linears"] = ALIASES.get(p, p)
        else:
            raise bad(f"unknown part {p!r}")
    if kw.get("in_backward") and optimizer != "lpoptim":
        raise bad("bwd (step_in_backward) needs the lpoptim optimizer")
    if optimizer == "prepare" and {p for p in parts if not p.startswith("off")} - {"bf16", "s4", "cg"}:
        raise bad("prepare makes its own choices: it takes +bf16, +s4, +offNN and +cg only")
    if kw.get("offload") and optimizer not in ("lpoptim", "prepare"):
        raise bad("offNN (offloaded activations) goes through lpoptim.prepare: lpoptim or prepare only")
    if kw.get("offload") and (kw.get("compress") or kw.get("hf_checkpointing") or kw.get("cuda_graphs")):
        raise bad("offNN excludes act, rec, ckpt and cg (they keep or pack the same activations)")
    if kw.get("state_bits") == 4 and optimizer not in ("lpoptim", "prepare"):
        raise bad("s4 (4-bit states) needs the lpoptim optimizer")
    if kw.get("attention") and (not kw.get("compress") or kw.get("recompute")):
        raise bad("attn (attention's saved tensors in FP8) comes with act")
    if kw.get("hf_checkpointing") and kw.get("compress"):
        raise bad("ckpt (HF gradient checkpointing) and act/rec exclude each other")
    return Stack(**kw)
