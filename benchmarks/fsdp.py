"""lpoptim.AdamW vs torch.optim.AdamW under FSDP2 with bf16 mixed precision: per-GPU peak memory and tokens/s.

    torchrun --nproc_per_node 2 benchmarks/fsdp.py --out results/fsdp.json          # 2 GPUs (NCCL)
    torchrun --nproc_per_node 2 benchmarks/fsdp.py --small                          # CPU smoke run (gloo)
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/fsdp.py --small   # the same without torchrun

A Llama-style decoder in pure torch (RMSNorm, RoPE, grouped-query attention through scaled_dot_product_attention,
SwiGLU; untied embedding and head; random init, nothing downloaded), built on the meta device and sharded with
``fully_shard`` per block and at the root: fp32 sharded masters, bf16 compute (MixedPrecisionPolicy, gradients
reduced in fp32). Shapes: TinyLlama-1.1B (22 layers, d 2048, ffn 5632, 32 heads, 4 kv heads), Llama-2-7B
(32 layers, d 4096, ffn 11008, 32 heads), CodeLlama-34B's widths (48 layers, d 8192, ffn 22016, 64 heads, 8 kv
heads) and Llama-2-70B's (80 layers, d 8192, ffn 28672, 64 heads, 8 kv heads), vocab 32000, batch 1 x 2048 tokens per GPU. Each optimizer gets a
fresh model; after --warmup steps (Triton compilation included there), --steps steps are timed with the
device synchronized around them. Peak memory is torch.cuda.max_memory_allocated over the whole run of that
optimizer (model, gradients, states, activations, all-gather buffers), the maximum over ranks; tokens/s is per
GPU (tokens per GPU per step over the mean step time of the slowest rank). --ac checkpoints each block's
activations. Targets: 7B per-GPU peak <= 0.55x torch AdamW's, tokens/s >= 0.95x.

Optimizer runs (--optimizers, lpoptim's recipe names): ``torch`` and ``lpoptim`` as above; ``+bf16`` shards bf16
parameters instead of fp32 masters (no fp32 copy anywhere; gradients reduced in fp32, or with ``--bf16-reduce``
in bf16, their own dtype; lpoptim rounds the update stochastically);
``+act`` adds compress_activations on every block; ``+s4`` keeps lpoptim's moments in 4 bits (state_bits=4).
``prepare`` (``+bf16``: bf16 parameters) converts the blocks' linears to FP8 before sharding (on GPUs with FP8 tensor
cores) and calls ``lpoptim.prepare`` after ``fully_shard``: blocks compiled, the step in backward, the head and loss
chunked. ``--compile`` compiles the blocks of the torch and lpoptim runs too. ``--all-gathers fp8,bf16`` runs each
``prepare`` run with its low-bit layers' weights gathered in FP8 (``lpoptim.nn.fp8_all_gather``) and in their own
dtype (FSDP2's gather, the default), named ``run/fp8-gather``, ``run/bf16-gather`` where there are several.
``--blocks-per-shard 1,4`` shards consecutive blocks in groups of that size (one ``fully_shard`` call on the list: one
all-gather and one reduce-scatter per group), every run once per size (named ``torch@4`` and so on where there are
several). Each run is compared with the first that ran (``torch`` by default; a run out of memory is recorded as such).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, before any process group exists

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lpoptim  # noqa: E402
from lpoptim.__main__ import positive_float, positive_int  # noqa: E402
from lpoptim.bench import cap_cuda_memory  # noqa: E402
from lpoptim.device import has_fp8_conversions  # noqa: E402
from lpoptim.optim import distributed as lpdist  # noqa: E402
from lpoptim.planner import ACTIVATIONS  # noqa: E402
from lpoptim.stack import Stack, parse_stack  # noqa: E402
from lpoptim.train.llama import PRESETS, Llama, LlamaConfig  # noqa: E402

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

TARGETS = {"peak_ratio_max": 0.55, "tokens_ratio_min": 0.95}


def positive_int_list(text: str) -> list[int]:
    sizes = [positive_int(x) for x in text.split(",")]
    if len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(f"each size once, got {text!r}")
    return sizes


def gather_list(text: str) -> list[str]:
    kinds = text.split(",")
    if not kinds or any(k not in ("fp8", "bf16") for k in kinds) or len(set(kinds)) < len(kinds):
        raise argparse.ArgumentTypeError(f"a comma list of fp8 and bf16, each once, got {text!r}")
    return kinds


# the model is lpoptim.train.llama's (what `lpoptim bench` times); "small" is a CPU smoke test
CONFIGS = {
    "tinyllama": ("TinyLlama-1.1B", PRESETS["tinyllama-1.1b"]),
    "llama7b": ("Llama-2-7B", PRESETS["llama2-7b"]),
    # the largest shapes: CodeLlama-34B's widths (33.7 B parameters) for 4 GPUs, Llama-2-70B's (69.0 B) for 8;
    # --layers trims either to what fewer GPUs hold, at the same widths
    "codellama34b": ("CodeLlama-34B", LlamaConfig(vocab_size=32000, n_layer=48, d_model=8192, ffn_dim=22016,
                                                  n_head=64, n_kv_head=8)),
    "llama70b": ("Llama-2-70B", LlamaConfig(vocab_size=32000, n_layer=80, d_model=8192, ffn_dim=28672, n_head=64,
                                            n_kv_head=8)),
    "small": ("small", LlamaConfig(vocab_size=512, n_layer=2, d_model=128, ffn_dim=352, n_head=4, n_kv_head=2)),
}


def build(c: LlamaConfig, device: torch.device, mesh, ac: bool, master: str = "fp32", linears: str | None = None,
          bf16_reduce: bool = False, blocks_per_shard: int = 1) -> Llama:
    """The model on ``mesh``: consecutive blocks sharded ``blocks_per_shard`` at a time (one ``fully_shard`` call on
    the list: one all-gather and one reduce-scatter for them all, their hooks run once), then the root."""
    with torch.device("meta"):
        model = Llama(c)
    if master == "bf16":
        model.to(torch.bfloat16)
    if linears:  # low-bit linears are converted before fully_shard (docs/distributed.md)
        for layer in model.layers:
            lpoptim.nn.convert_linears(layer, linears)
    if ac:  # as torchtitan: the checkpoint inside each block, FSDP2's hooks outside it
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        model.layers = nn.ModuleList(checkpoint_wrapper(b) for b in model.layers)
    # bf16 parameters have bf16 gradients whatever the reduction's dtype: an fp32 reduce-scatter casts them up and
    # back (twice the bytes on the wire); --bf16-reduce reduces them as they are
    reduce = None if bf16_reduce and master == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if master == "fp32" else None, reduce_dtype=reduce)
    layers = list(model.layers)
    for i in range(0, len(layers), blocks_per_shard):
        group = layers[i:i + blocks_per_shard]
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    with torch.no_grad():  # random init of each local shard: no full tensor ever exists
        for name, p in model.named_parameters():
            t = lpdist.local(p)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
        for name, b in model.named_buffers():  # to_empty left them unset: the low-bit layers' amax histories
            b.zero_()
    return model


# ---- one optimizer's run -----------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_run(opt_name: str) -> Stack:
    """lpoptim's one recipe vocabulary; this benchmark takes its first parts only. ValueError for the rest."""
    stack = parse_stack(opt_name)
    if stack.optimizer not in ("torch", "lpoptim", "prepare") or stack != Stack(
            stack.optimizer, compress=stack.compress, master=stack.master, state_bits=stack.state_bits):
        raise ValueError(f"unknown optimizer run {opt_name!r}: torch, lpoptim or prepare, then +bf16, +act and/or "
                         "+s4 (lpoptim's moments in 4 bits)")
    return stack


def run_one(opt_name: str, c: LlamaConfig, args, device, mesh, blocks_per_shard: int = 1,
            all_gather: str = "bf16") -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # what earlier runs left allocated, part of this run's peak: tens of MiB after the first run in the results
    # files; gigabytes would be a run's model or state outliving it
    left = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    stack = optimizer_run(opt_name)
    base = stack.optimizer
    # prepare: FP8 linears (converted before sharding, where the GPU has FP8 tensor cores), then lpoptim.prepare
    # after fully_shard with its own choices (blocks compiled on CUDA, the step in backward)
    fp8 = device.type == "cuda" and has_fp8_conversions(device)
    model = build(c, device, mesh, args.ac, stack.master, "fp8_delayed" if base == "prepare" and fp8 else None,
                  args.bf16_reduce, blocks_per_shard)
    if stack.compress:  # compiled: the wrapper calls each block's compiled forward
        lpoptim.compress_activations(model.layers, compile=args.compile)
    params = list(model.parameters())
    plan = None
    if base == "prepare":
        model.chunked_loss = True  # the head and loss chunk by chunk (prepare's chunked loss is HF's hook)
        activations = {"auto": "auto", "none": None}.get(args.prepare_activations, args.prepare_activations)
        opt = lpoptim.prepare(model, lr=1e-4, weight_decay=0.1, activations=activations, state_bits=stack.state_bits)
        if all_gather == "fp8":
            lpoptim.nn.fp8_all_gather(model)
        plan = opt.plan.summary()
    elif args.compile and not stack.compress:  # torch and lpoptim runs: each block compiled in place, as prepare does
        for layer in model.layers:
            layer.compile()
    if base == "lpoptim":
        opt = lpoptim.AdamW(params, lr=1e-4, weight_decay=0.1, bf16_stochastic_round=stack.master == "bf16",
                            state_bits=stack.state_bits)
    elif base == "torch":
        impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.torch_impl]
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **impl)
    gen = torch.Generator(device=device).manual_seed(99 + dist.get_rank())
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, c.vocab_size, (args.batch, args.seq + 1), device=device, generator=gen)
        sync(device)
        t0 = time.perf_counter()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    n_params = sum(p.numel() for p in params)
    # fully_shard units (the root's included): a list sharded in one call is one unit, its modules share a state
    units = len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})
    state_local = sum(lpdist.local(t).numel() * t.element_size() for st in opt.state.values()
                      for t in st.values() if torch.is_tensor(t))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    step_s = sum(times) / len(times)
    stats = torch.tensor([peak, step_s, state_local, left], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the worst rank: memory and time
    del model, opt, params
    gc.collect()
    return {
        "optimizer": opt_name,
        "blocks_per_shard": blocks_per_shard,
        "all_gather": all_gather if base == "prepare" else None,
        "fsdp_units": units,
        "params": n_params,
        "peak_gib_per_gpu": stats[0].item() / 2**30 if device.type == "cuda" else None,
        "state_gib_per_gpu": stats[2].item() / 2**30,
        "left_by_earlier_runs_gib": stats[3].item() / 2**30 if device.type == "cuda" else None,
        "step_s": stats[1].item(),
        "tokens_per_s_per_gpu": args.batch * args.seq / stats[1].item(),
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        **({"plan": plan} if plan else {}),
    }


def compared(name: str, c: LlamaConfig, runs: dict) -> dict:
    """One model's entry: its runs, each compared with the first that ran (torch AdamW by default; one out of
    memory is no baseline)."""
    entry = {"model": {"name": name, **asdict(c)}, "runs": runs}
    key, t = next(((k, r) for k, r in runs.items() if "error" not in r), (None, {}))
    entry["baseline"] = key
    for r in runs.values():
        if r is not t and t.get("peak_gib_per_gpu") and r.get("peak_gib_per_gpu"):
            r["peak_ratio"] = r["peak_gib_per_gpu"] / t["peak_gib_per_gpu"]
        if r is not t and t.get("tokens_per_s_per_gpu") and r.get("tokens_per_s_per_gpu"):
            r["tokens_ratio"] = r["tokens_per_s_per_gpu"] / t["tokens_per_s_per_gpu"]
    return entry


# ---- main --------------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tinyllama,llama7b", help="comma list of: " + ",".join(CONFIGS))
    ap.add_argument("--optimizers", default="torch,lpoptim,lpoptim+act,lpoptim+bf16,lpoptim+bf16+act")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--torch-impl", choices=["default", "foreach", "fused"], default="default",
                    help="torch AdamW's implementation (default: torch's choice, foreach on CUDA; its step holds "
                         "fp32 temporaries the size of the parameter shard, fused does not)")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--blocks-per-shard", type=positive_int_list, default=[1],
                    help="comma list: consecutive blocks per fully_shard call, every run once per size, named "
                         "run@size where there are several (one all-gather and one reduce-scatter per group: fewer "
                         "collectives and hooks on the host, a larger gathered group in memory)")
    ap.add_argument("--prepare-activations", choices=["auto", "none", *ACTIVATIONS[1:]], default="auto",
                    help="prepare runs: what the blocks save (prepare's activations=; auto: nothing changed, as "
                         "prepare takes no memory budget under FSDP2). recompute: each block's input in FP8 only")
    ap.add_argument("--all-gathers", type=gather_list, default=["bf16"],
                    help="comma list of fp8, bf16: how prepare runs gather their low-bit layers' weights "
                         "(lpoptim.nn.fp8_all_gather or FSDP2's own), each run once per choice (named "
                         "run/fp8-gather, run/bf16-gather where there are several)")
    ap.add_argument("--bf16-reduce", action="store_true",
                    help="runs with bf16 parameters (+bf16) reduce-scatter their gradients in bf16 rather than fp32")
    ap.add_argument("--compile", action="store_true",
                    help="compile each block of the torch and lpoptim runs (prepare compiles on CUDA by itself)")
    ap.add_argument("--layers", type=positive_int, default=None,
                    help="every model with this many blocks, its widths unchanged (e.g. llama70b on fewer GPUs)")
    ap.add_argument("--small", action="store_true", help="CPU smoke run: gloo, a tiny model, 64 tokens")
    ap.add_argument("--memory-cap-gib", type=positive_float, default=None,
                    help="allow each process's CUDA allocator this many GiB (e.g. 79.1, below an H100 80GB's 79.6 "
                         "GiB, on H200s)")
    ap.add_argument("--timeout-min", type=positive_int, default=5,
                    help="minutes a collective may wait before the run ends (a rank out of memory leaves the others "
                         "waiting); raise it where a first step compiles longer than that")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    unknown = [k for k in args.models.split(",") if k not in CONFIGS]
    if unknown:
        ap.error(f"unknown models {unknown} (choose from {', '.join(CONFIGS)})")
    for opt_name in args.optimizers.split(","):  # all refused before any run (a 70 B run takes a while)
        try:
            optimizer_run(opt_name)
        except ValueError as e:
            ap.error(str(e))
    if args.small:
        args.models, args.seq, args.steps, args.warmup = "small", 64, 3, 1
    if args.memory_cap_gib is not None and (args.small or not torch.cuda.is_available()):
        ap.error("--memory-cap-gib caps the CUDA allocator: it needs CUDA (not --small)")

    use_cuda = torch.cuda.is_available() and not args.small
    # a collective that waits --timeout-min minutes ends the run (a rank out of memory leaves the others waiting);
    # the runs before it are on disk (save below)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=args.timeout_min))
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        if args.memory_cap_gib is not None:
            cap_cuda_memory(args.memory_cap_gib, device)
    else:
        device = torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world,))

    meta = {"command": " ".join(["torchrun", f"--nproc_per_node {world}", *sys.argv]),
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "world_size": world,
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "batch_per_gpu": args.batch,
            "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "activation_checkpointing": args.ac,
            "compile": args.compile, "torch_impl": args.torch_impl,
            "mixed_precision": "bf16 / fp32 reduce" + (" (bf16 parameters: bf16 reduce)" if args.bf16_reduce else ""),
            "prepare_activations": args.prepare_activations, "memory_cap_gib": args.memory_cap_gib,
            "targets": TARGETS}
    if rank == 0:
        from lpoptim.bench import environment

        meta = {**environment(), **meta}

    def save(results) -> None:
        """Written after every run, so that a later run that never returns (a rank out of memory while the others
        wait in a collective) leaves the runs before it on disk."""
        if rank == 0 and args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))

    results = []
    for key in args.models.split(","):
        name, c = CONFIGS[key]
        if args.layers:
            name, c = f"{name} widths, {args.layers} layers", replace(c, n_layer=args.layers)
        runs = {}
        gathers = args.all_gathers
        for group, opt_name, gather in [(g, o, a) for g in args.blocks_per_shard for o in args.optimizers.split(",")
                                        for a in (gathers if o.startswith("prepare") else gathers[:1])]:
            # one size keeps the runs' plain names; several tell them apart by their size (torch@1, torch@4)
            run_key = opt_name if len(args.blocks_per_shard) == 1 else f"{opt_name}@{group}"
            if len(gathers) > 1 and opt_name.startswith("prepare"):
                run_key += f"/{gather}-gather"
            try:
                runs[run_key] = run_one(opt_name, c, args, device, mesh, group, gather)
            except torch.cuda.OutOfMemoryError as e:  # report, go on with the next
                runs[run_key] = {"optimizer": opt_name, "blocks_per_shard": group,
                                 "all_gather": gather if opt_name.startswith("prepare") else None,
                                 "error": f"OOM: {str(e).splitlines()[0]}"}
                gc.collect()
                torch.cuda.empty_cache()
            save(results + [compared(name, c, runs)])
        results.append(compared(name, c, runs))

    if rank == 0:
        print(f"\nFSDP2 x{world} ({meta['device']}), bf16 compute, batch {args.batch} x {args.seq} per GPU, "
              f"AC {'on' if args.ac else 'off'}, torch AdamW {args.torch_impl}")
        print(f"targets vs the first run: peak <= {TARGETS['peak_ratio_max']}x, tokens/s >= {TARGETS['tokens_ratio_min']}x")
        print(f"{'model':16s} {'optimizer':18s} {'peak GiB/GPU':>12s} {'states MiB/GPU':>14s} {'tok/s/GPU':>10s} "
              f"{'step ms':>8s} {'peak/first':>10s} {'tok/first':>9s}")
        for e in results:
            for key, r in e["runs"].items():
                if "error" in r:
                    print(f"{e['model']['name']:16s} {key:18s} {r['error']}")
                    continue
                peak = f"{r['peak_gib_per_gpu']:.2f}" if r["peak_gib_per_gpu"] is not None else "n/a"
                pr, tr = r.get("peak_ratio"), r.get("tokens_ratio")
                print(f"{e['model']['name']:16s} {key:18s} {peak:>12s} {1024 * r['state_gib_per_gpu']:14.2f} "
                      f"{r['tokens_per_s_per_gpu']:10.0f} {1e3 * r['step_s']:8.1f} "
                      f"{'-' if pr is None else f'{pr:.3f}':>10s} {'-' if tr is None else f'{tr:.3f}':>9s}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
