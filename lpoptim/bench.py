"""``lpoptim bench``: one training step of a Llama-shaped model under each stack; memory and tokens/s.

Every stack trains the same randomly initialised model (lpoptim/train/llama.py) on the same random tokens with
bf16 autocast; a step is zero_grad, forward, backward, optimizer step (no clipping). Master weights are fp32
(the model's parameters; autocast computes in bf16) or, for the ``+bf16`` stacks, bf16 (the parameters
themselves; torch AdamW then keeps bf16 states and rounds to nearest, lpoptim rounds stochastically).

Stacks are named as lpoptim/stack.py parses them: an optimizer (torch, lpoptim, bnb, torchao) followed by parts
(+bf16, +act, +rec, +bwd, +ce, a linear recipe such as +fp8_delayed, +sacNN, +cg); ``lpoptim bench --help`` lists
them. bnb and torchao run on CUDA only; +sacNN and +cg need --compile.

Memory, per stack: parameters, gradients and optimizer states are sums of their tensors' bytes. On CUDA
``peak`` is torch.cuda.max_memory_allocated over the timed steps and ``activations`` is what the forward pass
left allocated (memory_allocated after the loss minus before the forward). On the CPU there is no allocator
peak: ``activations`` is the bytes of the tensors autograd saved, and ``peak`` is the sum of the four parts
(an estimate, labelled as such). Speed: median over ``steps`` timed steps after ``warmup`` (CUDA events on a
GPU, wall clock on the CPU).
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .device import has_fp8_conversions
from .nn.recipes import DEFAULT_RECIPE
from .stack import Stack, parse_stack
from .train.llama import PRESETS, Llama, LlamaConfig
from .memory import estimate_peak_bytes
from .step_profile import ALL_KINDS, profile_step
from .train.loop import RunConfig, build_optimizer


# what `lpoptim bench` runs without --recipes: each optimizer alone, then lpoptim's memory features added up
DEFAULT_RECIPES = ("torch", "torch+bf16", "lpoptim", "lpoptim+bf16", "lpoptim+act", "lpoptim+bf16+act+bwd+ce",
                   "lpoptim+bf16+rec+bwd+ce", f"lpoptim+bf16+{DEFAULT_RECIPE}+bwd+ce", "lpoptim+fp8+act",
                   "lpoptim+fp4+act", "lpoptim+int4+act", "bnb", "torchao")


# what `lpoptim bench --hf-config` runs without --recipes: what a torch user runs, the competitors, then lpoptim
HF_DEFAULT_RECIPES = ("torch+bf16", "torch+bf16+ckpt", "bnb+bf16+ckpt", "prepare+bf16", "lpoptim+bf16+bwd+ce+ckpt",
                      "lpoptim+bf16+act+bwd+ce", f"lpoptim+bf16+{DEFAULT_RECIPE}+bwd+ce")
HF_DEFAULT_SHAPE = {"cuda": (1, 2048), "cpu": (2, 64)}

# (batch, seq) when not given on the command line
DEFAULT_SHAPE = {"tiny": (2, 64), "tinyllama-1.1b": (4, 2048), "llama2-7b": (1, 2048), "llama2-13b": (1, 2048),
                 "llama-30b": (1, 2048)}

PARTS = ("params", "grads", "states", "activations")


def unavailable(stack: Stack, device: str, compile_blocks: bool = False, hf: bool = False) -> str | None:
    """Why ``stack`` cannot run here (None: it can); ``hf``: on a Hugging Face model (--hf-config)."""
    if stack.hf_checkpointing and not hf:
        return "+ckpt is the HF model's own gradient checkpointing: it needs --hf-config"
    if stack.optimizer == "prepare" and not hf:
        return "prepare is lpoptim.prepare on a Hugging Face model: it needs --hf-config"
    if stack.offload and not (hf and device == "cuda"):
        return "+offNN moves a GPU's saved activations to host memory through lpoptim.prepare: it needs --hf-config and CUDA"
    if stack.activation_budget is not None and not compile_blocks:
        return "+sacNN is a budget for Inductor's partitioner: it needs --compile"
    if stack.cuda_graphs and not (compile_blocks and device == "cuda"):
        return "+cg replays the compiled blocks as CUDA graphs: it needs --compile and CUDA"
    if stack.cuda_graphs and stack.hf_checkpointing:
        return "+cg with +ckpt: HF gradient checkpointing runs the blocks again inside backward (not supported)"
    if stack.cuda_graphs and stack.recompute:
        return "+cg with +rec: the FP8 recompute runs the blocks again inside backward (not supported)"
    if stack.optimizer == "bnb":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001  (ImportError, or a broken CUDA setup)
            return f"bitsandbytes not importable ({type(e).__name__}: {e})"
        return None if device == "cuda" else "bitsandbytes AdamW8bit needs CUDA"
    if stack.optimizer == "torchao":
        try:
            from torchao.float8 import convert_to_float8_training  # noqa: F401
            from torchao.optim import AdamWFp8  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"torchao not importable ({type(e).__name__}: {e})"
        if device != "cuda":
            return "torchao float8 needs CUDA"
        if not has_fp8_conversions(torch.device("cuda")):
            return "torchao float8 needs compute capability >= 8.9"
    return None


def is_causal_lm(hf_config) -> bool:
    """Whether transformers' AutoModelForCausalLM builds this config's model (what --hf-config runs)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(hf_config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by a tensor; a tensor subclass (torchao's quantized states) counts its inner tensors."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    from .optim import AdamW, state_bytes

    if isinstance(opt, AdamW):
        return int(state_bytes(opt)["total_bytes"])
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and id(v) not in seen:  # bitsandbytes shares its quantization maps
                seen.add(id(v))
                total += tensor_bytes(v)
    return total


def torchao_float8(model) -> None:
    """torchao's float8 training on every linear layer but the LM head."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)


def competitor_optimizer(name: str, params, lr: float, betas, weight_decay: float):
    """bitsandbytes AdamW8bit ("bnb") or torchao AdamWFp8 ("torchao") over ``params`` (tensors or groups)."""
    if name == "bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "torchao":
        from torchao.optim import AdamWFp8

        return AdamWFp8(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


def build(stack: Stack, cfg: LlamaConfig, device: str, compile_blocks: bool):
    """The model and optimizer of one stack, on ``device``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    if stack.master == "bf16":
        model.to(torch.bfloat16)
    model.chunked_loss = stack.chunked_loss
    if stack.linears == "torchao":
        torchao_float8(model)
    elif stack.linears:
        from .nn import convert_linears
        from .nn.weight_scale import previous_scale_pays

        # as prepare (planner._previous_weight_scale): the weight scale kept on the device where it pays
        as_saved = not stack.compress and stack.activation_budget in (None, 1)
        previous_weight_scale = (stack.linears == "fp8_delayed" and compile_blocks and device == "cuda"
                                 and not stack.recompute and previous_scale_pays(stack.cuda_graphs, as_saved))
        convert_linears(model, stack.linears, previous_weight_scale=previous_weight_scale)
    # FP8 activations on compiled blocks: the wrapper calls each block's compiled forward (no graph break per call)
    wrapper_compiles = stack.compress and compile_blocks
    if compile_blocks and not wrapper_compiles:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, mode="reduce-overhead" if stack.cuda_graphs else None)
    handle = None
    if stack.compress:
        from .activations import compress_activations

        graphs = wrapper_compiles and stack.cuda_graphs
        handle = compress_activations(model.layers, recompute=stack.recompute,
                                      compile={"mode": "reduce-overhead"} if graphs else wrapper_compiles,
                                      attention="fp8" if stack.attention else "keep")
    groups, lr, betas = model.param_groups(0.1), 1e-4, (0.9, 0.95)
    if stack.optimizer in ("torch", "lpoptim"):
        options = dict(fused=True) if stack.optimizer == "torch" and device == "cuda" else {}
        if stack.state_bits == 4:
            options["state_bits"] = 4
        opt = build_optimizer(RunConfig(optimizer=stack.optimizer, lr=lr, betas=betas, weight_decay=0.1, master=stack.master,
                                        optimizer_options=options), model)
    else:
        opt = competitor_optimizer(stack.optimizer, groups, lr, betas, weight_decay=0.1)
    if stack.in_backward:  # opt.step() then finds no gradients and does nothing
        from .optim import step_in_backward

        step_in_backward(opt)
    return model, opt, handle, {}


def hf_config_file(path: str) -> Path:
    """The config.json that ``path`` names: the file itself, the one in a folder, or one bundled with lpoptim
    (lpoptim/data/hf_configs: tinyllama-1.1b, llama3.2-3b, llama2-7b, llama3-8b, qwen2.5-7b, gemma2-9b,
    llama2-13b, llama-26b). ValueError, in one line, if there is none."""
    p = Path(path)
    if not p.exists() and (HF_CONFIGS / f"{path}.json").is_file():
        p = HF_CONFIGS / f"{path}.json"
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        bundled = ", ".join(sorted(q.stem for q in HF_CONFIGS.glob("*.json")))
        raise ValueError(f"no config.json at {path} (bundled: {bundled})")
    return p


def load_hf_config(path: str):
    """A transformers config (use_cache off) from what ``hf_config_file`` finds; ValueError for a config.json
    without a model_type."""
    from transformers import AutoConfig

    p = hf_config_file(path)
    fields = json.loads(p.read_text())
    if "model_type" not in fields:
        raise ValueError(f"{p} has no model_type")
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg.use_cache = False
    return cfg


HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"


def build_hf(stack: Stack, hf_config, device: str, compile_blocks: bool, tokens: int, budget: dict | None = None):
    """An HF causal LM built from ``hf_config`` (random init, no download) and its optimizer, for one stack:
    lpoptim stacks through lpoptim.prepare with the stack's parts as its options; the others as a torch user
    would run them (the decoder layers compiled in place, torch AdamW fused)."""
    from transformers import AutoModelForCausalLM

    from .planner import find_blocks, prepare

    torch.manual_seed(0)
    dtype = torch.bfloat16 if stack.master == "bf16" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).train()
    model.config.use_cache = False
    if stack.hf_checkpointing:
        model.gradient_checkpointing_enable()
    lr, betas = 1e-4, (0.9, 0.95)
    info = {}
    if stack.optimizer in ("lpoptim", "prepare"):
        if stack.optimizer == "prepare":
            options = dict(budget or {}, tokens=tokens)  # the tokens a step: what pays depends on them
            options["cuda_graphs"] = stack.cuda_graphs
            if stack.offload:
                options["offload"] = stack.offload
        else:
            options = dict(linears=stack.linears, compile=compile_blocks, step_in_backward=stack.in_backward,
                           chunked_loss=stack.chunked_loss,
                           activations="recompute" if stack.recompute else
                           ("fp8_attention" if stack.attention else "fp8") if stack.compress else
                           # +sac100 keeps every activation: Inductor's default, no budget for prepare (in (0, 1))
                           stack.activation_budget if stack.activation_budget != 1 else None,
                           cuda_graphs=stack.cuda_graphs, offload=stack.offload or False)
        opt = prepare(model, lr, betas=betas, weight_decay=0.1, state_bits=stack.state_bits, **options)
        chosen = opt.plan
        info["plan"] = chosen.summary()
        info["plan_options"] = chosen.options()
        info["estimated_peak_bytes"] = estimate_peak_bytes(model, model.get_submodule(chosen.blocks), chosen, tokens)
        info["budget"] = budget
        return model, opt, None, info
    if stack.linears == "torchao":
        torchao_float8(model)
    elif stack.linears:
        from .nn import convert_linears

        for block in find_blocks(model)[1]:
            convert_linears(block, stack.linears)
    if compile_blocks:
        for block in find_blocks(model)[1]:
            block.compile(mode="reduce-overhead" if stack.cuda_graphs else None)
    params = [p for p in model.parameters() if p.requires_grad]
    if stack.optimizer == "torch":
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=0.1, fused=device == "cuda")
    else:
        opt = competitor_optimizer(stack.optimizer, params, lr, betas, weight_decay=0.1)
    return model, opt, None, info


def saved_bytes(model, handle, fwd) -> tuple[object, int]:
    """Run ``fwd()`` and count the bytes autograd saved for backward (the CPU's activation figure)."""
    from .activations import record_saved

    if handle is None:
        with record_saved(model) as stats:
            out = fwd()
        return out, stats.stored_bytes
    with record_saved(model) as outer, handle.record() as inner:  # inside wrapped blocks, their hooks win
        out = fwd()
    return out, outer.stored_bytes + inner.stored_bytes


@contextlib.contextmanager
def stack_context(stack: Stack, compile_blocks: bool, hf: bool = False):
    """What a stack's run needs around it: a fresh Dynamo (graphs, and the budget's partition, are not shared
    between stacks) and the stack's activation budget for Inductor's partitioner (but where lpoptim.prepare sets
    it on the blocks itself: an HF model's lpoptim stack without +act/+rec)."""
    if compile_blocks:
        torch._dynamo.reset()
    if stack.activation_budget is None or (hf and budget_by_prepare(stack)):
        yield
        return
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=stack.activation_budget):
        yield


def is_hf(cfg) -> bool:
    """Whether ``cfg`` is a transformers config (the --hf-config path) rather than lpoptim's LlamaConfig."""
    return hasattr(cfg, "model_type")


def budget_by_prepare(stack: Stack) -> bool:
    return stack.optimizer == "lpoptim" and stack.activation_budget is not None and not stack.compress


def autocast_loss(model, x, y, device: str) -> torch.Tensor:
    """The loss of one forward under bf16 autocast, as every stack runs it. Without autocast's cast cache: it
    would keep a bf16 copy of every fp32 weight until the forward ends; without it a copy lives only as long as
    autograd needs it (compress_activations replays it from the weight instead)."""
    with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
        return model(x, y)[1]


def run_stack(stack: Stack, cfg, batch: int, seq: int, steps: int, warmup: int, device: str,
              compile_blocks: bool, budget: dict | None = None, profile: bool = False) -> dict:
    """One stack's figures; ``cfg`` is a LlamaConfig (lpoptim's own model) or a transformers config; ``profile``:
    one more step, profiled (step_profile.py), its GPU time by kind under ``time_breakdown``."""
    with stack_context(stack, compile_blocks, hf=is_hf(cfg)):
        return _run_stack(stack, cfg, batch, seq, steps, warmup, device, compile_blocks, budget, profile)


def _run_stack(stack: Stack, cfg, batch: int, seq: int, steps: int, warmup: int, device: str,
               compile_blocks: bool, budget: dict | None = None, profile: bool = False) -> dict:
    cuda = device == "cuda"
    hf = is_hf(cfg)
    if hf:
        model, opt, handle, info = build_hf(stack, cfg, device, compile_blocks, batch * seq, budget)
    else:
        model, opt, handle, info = build(stack, cfg, device, compile_blocks)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device, generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    mem = {}

    def forward():
        if hf:  # HF shifts the labels itself
            with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
                return model(input_ids=x, labels=x).loss
        return autocast_loss(model, x, y, device)

    def step(measure: bool):
        opt.zero_grad(set_to_none=True)
        if measure and not cuda:
            loss, mem["activations"] = saved_bytes(model, handle, forward)
        elif measure:
            before = torch.cuda.memory_allocated()
            loss = forward()
            # replayed CUDA graphs keep their outputs in a pool the allocator's figure does not count: no figure
            mem["activations"] = None if stack.cuda_graphs else torch.cuda.memory_allocated() - before
        else:
            loss = forward()
        loss.backward()
        if measure:
            mem["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        opt.step()
        return loss

    for i in range(warmup):
        t0 = time.perf_counter()
        step(measure=i == warmup - 1)
        if i == 0:  # the first step, compilation and state allocation included
            if cuda:
                torch.cuda.synchronize()
            first_step = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step(False).detach())
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            losses.append(step(False).detach())
            times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in times]
    seconds = statistics.median(times)
    if profile:  # after the timed steps, so that the profiler's own cost is in none of them
        try:
            info["time_breakdown"] = profile_step(lambda: step(False), seconds)
        except RuntimeError as e:  # the figures above stand without it
            info["time_breakdown"] = {"error": str(e).splitlines()[0][:300]}
    mem["params"] = sum(p.numel() * p.element_size() for p in model.parameters())
    mem["states"] = optimizer_state_bytes(opt)
    n_params = sum(p.numel() for p in model.parameters())
    if cuda:
        peak = torch.cuda.max_memory_reserved() if stack.cuda_graphs else torch.cuda.max_memory_allocated()
        mem["reserved"] = torch.cuda.max_memory_reserved()
    else:
        peak = sum(mem[k] for k in PARTS)
    return dict(peak_bytes=int(peak), peak_reserved_bytes=int(mem.get("reserved", peak)),
                peak_kind="reserved" if stack.cuda_graphs else "allocated" if cuda else "estimate",
                **{f"{k}_bytes": None if mem[k] is None else int(mem[k]) for k in PARTS}, params=n_params,
                state_bytes_per_param=mem["states"] / n_params, step_seconds=seconds,
                step_seconds_each=times,  # the spread the median hides
                tokens_per_s=batch * seq / seconds, loss=float(losses[-1]), first_step_seconds=first_step, **info)


def free_memory(compiled: bool = False):
    if compiled:  # the compiled graphs, and the CUDA-graph pools they hold (a +cg stack's), are released
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_depth(cfg, n_layer: int) -> None:
    """A transformers config with ``n_layer`` layers; a per-layer list (``layer_types``: sliding or full attention)
    is cut, or continued with its own pattern, to that length."""
    types = getattr(cfg, "layer_types", None)
    if types:
        cfg.layer_types = [types[i % len(types)] for i in range(n_layer)]
    cfg.num_hidden_layers = n_layer


def hf_summary(cfg) -> dict:
    """The fields of a transformers config that the table's title shows."""
    get = lambda *names: next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), None)  # noqa: E731
    return dict(architecture=(cfg.architectures or [cfg.model_type])[0], model_type=cfg.model_type,
                n_layer=get("num_hidden_layers", "n_layer"), d_model=get("hidden_size", "n_embd"),
                ffn_dim=get("intermediate_size", "n_inner"), n_head=get("num_attention_heads", "n_head"),
                n_kv_head=get("num_key_value_heads", "num_attention_heads", "n_head"), vocab_size=cfg.vocab_size)


def cap_cuda_memory(gib: float, device=None) -> None:
    """Allow this process's CUDA allocator ``gib`` GiB of ``device`` (default: the current one): a smaller GPU's
    memory on a larger one (``--memory-cap-gib``)."""
    device = torch.cuda.current_device() if device is None else device
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), device)


def run(preset: str, recipes: list[str], batch: int, seq: int, steps: int, warmup: int, device: str,
        compile_blocks: bool = False, log=print, n_layer: int | None = None, memory_cap_gib: float | None = None,
        hf_config=None, budget: dict | None = None, profile: bool = False) -> dict:
    """Benchmark each recipe in turn; returns the dict written to bench.json.

    ``hf_config``: a transformers config (load_hf_config) to build instead of the preset (``preset`` then names
    it); ``n_layer`` overrides the depth; ``memory_cap_gib`` caps the CUDA allocator (an 80 GB GPU's budget on a
    larger one: torch.cuda.set_per_process_memory_fraction); ``budget``: the prepare recipe's budget, as prepare's
    keyword (``{"max_memory_gib": 30}`` or ``{"max_memory_fraction": 0.9}``, a fraction of the capped memory);
    ``profile`` (CUDA): each recipe's GPU time by kind, from one more step (step_profile.py)."""
    if profile and device != "cuda":
        raise ValueError("profile: the breakdown is of GPU kernels' time: it needs CUDA")
    if hf_config is not None:
        cfg = hf_config
        if n_layer is not None:
            set_depth(cfg, n_layer)
    else:
        cfg = PRESETS[preset] if n_layer is None else replace(PRESETS[preset], n_layer=n_layer)
    if memory_cap_gib is not None:
        if device != "cuda":
            raise ValueError("--memory-cap-gib needs CUDA")
        cap_cuda_memory(memory_cap_gib)
    steps, warmup = max(1, steps), max(1, warmup)  # the last warm-up step is the one that measures memory
    results = []
    for name in recipes:
        stack = parse_stack(name)
        row = dict(recipe=stack.name, label=stack.label, master=stack.master, activation_budget=stack.activation_budget)
        why = unavailable(stack, device, compile_blocks, hf=hf_config is not None)
        if why:
            log(f"  {name}: skipped, {why}")
            results.append(dict(row, skipped=why))
            continue
        log(f"  {name}: {stack.label} ...")
        free_memory(compile_blocks or stack.optimizer == "prepare")  # prepare compiles on CUDA by itself
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device == "cuda" else 0
        base_reserved = torch.cuda.memory_reserved() if device == "cuda" else 0
        try:
            out = run_stack(stack, cfg, batch, seq, steps, warmup, device, compile_blocks, budget, profile)
            out["peak_bytes"] -= base_reserved if stack.cuda_graphs else base
            out["peak_reserved_bytes"] -= base_reserved
            row.update(out)
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as e:  # noqa: BLE001  (one broken stack must not lose the others' figures)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        if "error" in row:
            log(f"  {name}: {row['error']}")
        free_memory(compile_blocks or stack.optimizer == "prepare")  # prepare compiles on CUDA by itself
        results.append(row)
    env = dict(environment(), device=device, memory_cap_gib=memory_cap_gib)
    model = hf_summary(cfg) if hf_config is not None else asdict(cfg)
    return dict(env=env, preset=preset, hf=hf_config is not None, model=model, batch=batch, seq=seq, steps=steps,
                warmup=warmup, compile=compile_blocks, peak_measured=device == "cuda", results=results)


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001  (not installed, or installed without metadata: pytorch-triton, say)
        try:
            return __import__(package).__version__
        except Exception:  # noqa: BLE001
            return None


def environment() -> dict:
    """What every results JSON records beside its figures: GPU, versions (competitors included), command line, and
    whether Inductor launched user Triton kernels statically (where it did, compiled blocks without CUDA graphs
    scale fp8_delayed weights by their previous absmax: nn/weight_scale.py)."""
    import shlex
    import sys

    from .nn.weight_scale import static_user_launches

    # `python -m lpoptim ...` leaves lpoptim's __main__.py in sys.argv[0]: recorded as the command that reruns it
    argv = ["-m", "lpoptim", *sys.argv[1:]] if Path(sys.argv[0]).parts[-2:] == ("lpoptim", "__main__.py") else sys.argv
    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None, torch=torch.__version__,
                triton=_version("triton"), transformers=_version("transformers"),
                bitsandbytes=_version("bitsandbytes"), torchao=_version("torchao"),
                command=shlex.join([sys.executable.rsplit("/", 1)[-1], *argv]),
                static_user_launches=static_user_launches())


def parameter_count(report: dict) -> str:
    """"parameters: 6.74 B" (or "0.26 M" for a small model), from the first recipe that ran; "" if none did."""
    n = next((r["params"] for r in report["results"] if r.get("params")), 0)
    if not n:
        return ""
    return f"parameters: {n / 1e9:.2f} B" if n >= 1e8 else f"parameters: {n / 1e6:.2f} M"


def table(report: dict) -> str:
    """The markdown table printed last."""
    cuda = report["peak_measured"]
    unit, div = ("GiB", 2**30) if cuda else ("MiB", 2**20)
    peak_name = f"peak {unit}" if cuda else f"peak {unit} (est.)"
    env, m = report["env"], report["model"]
    base = next((r for r in report["results"] if "tokens_per_s" in r), None)
    kind = f"HF {m['architecture']}" if report.get("hf") else "Llama-style"
    lines = [
        f"{report['preset']} ({kind}: {m['n_layer']} layers, d {m['d_model']}, ffn {m['ffn_dim']}, "
        f"{m['n_head']}/{m['n_kv_head']} heads, vocab {m['vocab_size']}), batch {report['batch']} x {report['seq']}, "
        f"bf16 autocast, fp32 master (bf16 for +bf16 recipes), {'blocks compiled' if report['compile'] else 'eager'}; "
        f"median of {report['steps']} steps after {report['warmup']} warm-up",
        f"device: {env['gpu'] or 'CPU'}, torch {env['torch']}, triton {env['triton']}"
        + (f", allocator capped at {env['memory_cap_gib']} GiB" if env.get("memory_cap_gib") else ""),
        parameter_count(report),
        f"command: {report.get('command', '')}",
    ]
    if any(r.get("peak_kind") == "reserved" for r in report["results"]):
        lines.append("+cg recipes: blocks replayed as CUDA graphs; their peak is the allocator's reserved peak (the "
                     "graphs' private pool is not in its allocated figure during replays), an upper bound")
    if not cuda:
        lines.append("CPU: no allocator peak; every figure is a sum of tensor bytes, activations = bytes autograd "
                     "saved, peak (est.) = params + grads + states + activations")
    cols = ["recipe", peak_name, "params", "grads", "opt states", "activations", "state B/param", "tokens/s",
            f"vs {base['recipe'] if base else 'first'}"]
    lines += ["", "| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in report["results"]:
        if "tokens_per_s" not in r:
            note = f"skipped: {r['skipped']}" if r.get("skipped") else f"FAILED: {r.get('error')}"
            lines.append(f"| {r['recipe']} | {note} |" + " |" * (len(cols) - 2))
            continue
        cells = ["n/a" if r[k + "_bytes"] is None else f"{r[k + '_bytes'] / div:.2f}" for k in ("peak", *PARTS)]
        # like with like: a reserved peak against the first recipe's reserved peak
        key = "peak_reserved_bytes" if r.get("peak_kind") == "reserved" else "peak_bytes"
        if key != "peak_bytes":
            cells[0] += " (reserved)"
        if r.get("estimated_peak_bytes") and cuda:  # prepare's estimate beside the measured peak
            cells[0] += f" (est. {r['estimated_peak_bytes'] / div:.2f})"  # two decimals, as the peak
        rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x tok/s, {r[key] / base[key]:.2f}x mem"
        lines.append(f"| {r['recipe']} | " + " | ".join(cells) +
                     f" | {r['state_bytes_per_param']:.2f} | {r['tokens_per_s']:,.0f} | {rel} |")
    return "\n".join(lines + breakdown_table(report["results"]))


# --profile's kinds in fixed colours, apart from the memory panel's (params, grads, states, activations)
KIND_COLORS = {"communication": "tab:cyan", "optimizer": "tab:purple", "attention": "tab:olive", "gemm": "tab:brown",
               "fp8 casts": "tab:pink", "copies": "gold", "other": "tab:gray", "idle": "lightgray"}


def breakdown_table(results: list[dict]) -> list[str]:
    """--profile: one profiled step's GPU time by kind, ms (kinds that took no time in any recipe left out)."""
    rows = [r for r in results if r.get("time_breakdown")]
    if not rows:
        return []
    kinds = [k for k in ALL_KINDS if any(r["time_breakdown"].get("kernel_seconds", {}).get(k, 0) > 0 for r in rows)]
    lines = ["", "GPU time of one profiled step by kind, ms (kinds by kernel name; kernels of several streams may "
             "overlap; step: the timed median; idle: that less the time some kernel or copy ran)", "",
             "| recipe | step | " + " | ".join(kinds) + " | idle |", "|---|" + "---:|" * (len(kinds) + 2)]
    for r in rows:
        t = r["time_breakdown"]
        if "error" in t:
            lines.append(f"| {r['recipe']} | not profiled: {t['error']} |" + " |" * (len(kinds) + 1))
            continue
        cells = [t["step_seconds"], *(t["kernel_seconds"][k] for k in kinds), t["idle_seconds"]]
        lines.append(f"| {r['recipe']} | " + " | ".join(f"{1e3 * c:.1f}" for c in cells) + " |")
    return lines


def plot(report: dict, path: Path) -> bool:
    """bench.png: memory stacked by component (peak marked) and tokens/s, one horizontal bar per recipe that ran
    (horizontal, and as tall as the list, so that long recipe names stay readable however many there are)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import transforms

    rows = [r for r in report["results"] if "tokens_per_s" in r]
    if not rows:
        return False
    cuda = report["peak_measured"]
    unit, div = ("GiB", 2**30) if cuda else ("MiB", 2**20)
    names = [r["recipe"] for r in rows]
    y = list(range(len(rows)))
    breakdowns = [r.get("time_breakdown") or {} for r in rows]
    profiled = any("kernel_seconds" in t for t in breakdowns)
    height = 2.4 + 0.4 * len(rows)
    fig, axes = plt.subplots(1, 3 if profiled else 2, figsize=(21 if profiled else 14, height), sharey=True)
    ax1, ax2 = axes[:2]
    left = [0.0] * len(rows)
    for part in PARTS:
        vals = [(r[f"{part}_bytes"] or 0) / div for r in rows]  # None: not measured (+cg activations)
        ax1.barh(y, vals, left=left, label=part)
        left = [a + v for a, v in zip(left, vals)]
    if cuda:
        ax1.scatter([r["peak_bytes"] / div for r in rows], y, marker="|", s=300, color="black", zorder=3,
                    label="measured peak (max_memory_allocated; reserved for +cg)")
    ax1.set_yticks(y, names, fontsize=9)
    ax1.invert_yaxis()  # the first recipe (the baseline) on top
    ax1.set_xlabel(unit)
    ax1.set_title("memory by component" + ("" if cuda else " (CPU: tensor bytes, estimate)"))
    legends = [(ax1, 3)]
    ax2.barh(y, [r["tokens_per_s"] for r in rows], color="tab:gray")
    ax2.set_xlabel("tokens/s")
    ax2.set_title(f"training throughput ({report['env']['gpu'] or 'CPU'})")
    if profiled:  # --profile: a profiled step's GPU time by kind, idle last, each kind in its own colour
        ax3, left = axes[2], [0.0] * len(rows)
        for kind in (*ALL_KINDS, "idle"):
            vals = [0.0 if "kernel_seconds" not in t else  # not profiled, or the profiler failed
                    1e3 * (t["idle_seconds"] if kind == "idle" else t["kernel_seconds"][kind]) for t in breakdowns]
            if any(vals):
                ax3.barh(y, vals, left=left, label=kind, color=KIND_COLORS[kind])
                left = [a + v for a, v in zip(left, vals)]
        ax3.set_xlabel("ms (kernels of several streams may overlap)")
        ax3.set_title("GPU time of one step by kind")
        legends.append((ax3, 4))
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{report['preset']}, batch {report['batch']} x {report['seq']}, torch {report['env']['torch']}")
    # the legends in a band of their own below the panels, whatever the number of recipes (over the bars, or
    # under the axes' own height, they covered bars or labels)
    band = 0.65 / height  # inches: two rows of legend
    for ax, ncol in legends:
        where = transforms.blended_transform_factory(ax.transAxes, fig.transFigure)
        ax.legend(fontsize=8, loc="lower center", ncol=ncol, bbox_to_anchor=(0.5, 0.02),
                  bbox_transform=where).set_in_layout(False)
    fig.tight_layout(rect=(0, band, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(report: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json"]
    paths[0].write_text(json.dumps(report, indent=1))
    if plot(report, out_dir / "bench.png"):
        paths.append(out_dir / "bench.png")
    return paths
