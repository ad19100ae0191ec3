"""torchtitan's own trainer run side by side: its AdamW, its float8 + AdamW, and lpoptim (converter + lpoptim.AdamW).

    python -m pip install torchtitan==0.2.2 torchao==0.18.0    # torch 2.11: torchtitan 0.3 needs a newer torch
    python benchmarks/torchtitan_bench.py --gpus 2 --out results/torchtitan_llama2_7b_2gpu.json

Each run (--variants) is its own ``torchrun`` (fresh processes and caches) of torchtitan's ``Trainer``, with the
installed torchtitan's configuration: 0.2 (JobConfig; torchtitan 0.3 needs a torch newer than 2.11) or 0.3
(Configurable configs). Common to all runs: AdamW hyperparameters of torchtitan's llama3 8B recipe (lr 3e-4,
betas (0.9, 0.95), weight decay 0.1), gradient clipping at 1.0, FSDP2 over all GPUs with bf16 compute and fp32
gradient reduction, batch 1 x ``--seq-len`` 2048 per GPU, each block compiled (``compile.enable``; the loss
too), selective activation checkpointing (``--ac``) for the torchtitan runs, synthetic tokens (a pool of 8
fixed batches per rank, cycled; nothing downloaded; torchtitan imports ``datasets`` for its HF dataloader, unused
here: where it is not installed a stand-in module takes its place), no checkpoints, profiler, tensorboard or
validation.

- torchtitan 0.2: torchtitan's llama3 train spec with the synthetic dataloader, no tokenizer (its SDPA attention
  needs none) and one more flavor, ``llama2_7b`` (Llama-2-7B's shape: 32 layers, d 4096, ffn 11008, 32 heads,
  vocab 32000), the default ``--flavor``; torchtitan's flags are recorded in the JSON.
- torchtitan 0.3: the Trainer of its ``llama3_8b`` config (chunked cross-entropy, CUDA graphs for forward and
  backward unless ``--no-cuda-graphs``), flavor 8B by default, a stand-in tokenizer.
- ``--layers N`` keeps the first N blocks (quick checks).

Variants:
- ``adamw``: torchtitan as above.
- ``float8``: plus torchtitan's float8 converter (torchao, rowwise recipe, the output head kept in bf16, as in
  torchtitan's 405B recipe).
- ``lpoptim``: lpoptim's converter (fp8_delayed linears, the head kept; FP8 saved activations instead of
  activation checkpointing) and lpoptim.AdamW (FP8 states); fp32 masters as torchtitan.
- ``lpoptim_bf16``: ``lpoptim`` with torchtitan's ``training.dtype=bfloat16`` (bf16 parameters and gradients, no
  fp32 copy) and lpoptim's bf16_stochastic_round.
- ``lpoptim_noact``, ``lpoptim_bf16_noact``: without FP8 activations, torchtitan's activation checkpointing kept.

Timing: every train step between device synchronizations (the slowest rank's time); tokens/s per GPU is the
tokens of one GPU's batch over the median step after ``--warmup`` steps (compilation happens in the first).
Peak memory: torch.cuda.max_memory_allocated and max_memory_reserved over the whole run (model, gradients,
optimizer states, activations, communication buffers), the maximum over ranks. Ratios are against
``--baseline`` (float8) from the same invocation. The JSON records versions and the device.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, before any process group exists

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("float8", "adamw", "lpoptim", "lpoptim_bf16")  # lpoptim ones also with a "_noact" suffix
POOL = 8  # synthetic batches per rank


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS + ("lpoptim_bf16_noact",)))
    p.add_argument("--baseline", default="float8")
    p.add_argument("--gpus", type=int, default=2, help="processes, one per GPU (torchrun --nproc_per_node)")
    p.add_argument("--flavor", default=None, help="torchtitan llama3 flavor (8B, debugmodel, ...) or llama2_7b "
                   "(torchtitan 0.2 only; its default there; 8B with 0.3)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N blocks (quick checks)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1, help="local batch size (per GPU)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15, help="timed steps after the warmup")
    p.add_argument("--ac", choices=("selective", "full", "none"), default="selective",
                   help="activation checkpointing of the torchtitan runs (lpoptim's use FP8 activations)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="training.disable_cuda_graphs for every run")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--spmd-backend", default=None, help="parallelism.spmd_backend (default: torchtitan's)")
    p.add_argument("--lp-recipe", default="fp8_delayed")
    p.add_argument("--lp-state-bits", type=int, default=8)
    p.add_argument("--lp-recompute", action="store_true", help="FP8 activations with recompute (FP8 full AC)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--variant", help=argparse.SUPPRESS)  # worker mode (under torchrun)
    p.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


WORKER_ARGS = "LPOPTIM_TT_BENCH_ARGS"  # the worker's argv, as JSON: kept off torchrun's own command line


def stand_in_datasets():
    """torchtitan.trainer imports ``datasets`` (for its HF text dataloader) at module level; this benchmark feeds
    synthetic tokens, so where the package is missing an empty stand-in lets the import succeed."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        def unavailable(*a, **k):
            raise RuntimeError("the `datasets` package is not installed (stand-in from benchmarks/torchtitan_bench.py)")
        d, dd = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        d.Dataset, d.load_dataset, dd.split_dataset_by_node, d.distributed = object, unavailable, unavailable, dd
        sys.modules.update({"datasets": d, "datasets.distributed": dd})


def synthetic_components(vocab: int):
    """A stand-in tokenizer and a dataloader of synthetic tokens, as torchtitan Configurables."""
    from dataclasses import dataclass

    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class SyntheticTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = vocab

        def __init__(self, config, *, tokenizer_path=None):
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, text, *a, **k):
            return [min(ord(c), self.vocab_size - 1) for c in text]

        def decode(self, ids, *a, **k):
            return "".join(chr(i) for i in ids)

        def get_vocab_size(self):
            return self.vocab_size

    class SyntheticDataLoader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = vocab

        def __init__(self, config, *, dp_rank, local_batch_size, seq_len, **_):
            g = torch.Generator().manual_seed(1234 + dp_rank)
            self.pool = torch.randint(0, config.vocab_size, (POOL, local_batch_size, seq_len + 1), generator=g)
            self.positions = torch.arange(seq_len).expand(local_batch_size, seq_len).contiguous()
            self.i = 0

        def __iter__(self):
            while True:
                t = self.pool[self.i % POOL]
                self.i += 1
                yield {"input": t[:, :-1].clone(), "positions": self.positions.clone()}, t[:, 1:].clone()

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, sd):
            self.i = sd["i"]

    return SyntheticTokenizer.Config(), SyntheticDataLoader.Config()


def lpoptim_variant(variant: str) -> tuple[bool, bool] | None:
    """None for torchtitan's own variants (float8, adamw); for lpoptim's, (bf16 parameters, FP8 activations).
    SystemExit for any other name: main() checks every --variants name before the first run starts."""
    if variant in ("float8", "adamw"):
        return None
    if variant.removesuffix("_noact") not in ("lpoptim", "lpoptim_bf16"):
        raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)} (lpoptim ones also "
                         f"with _noact)")
    return "_bf16" in variant, not variant.endswith("_noact")


def CONFIGURABLE() -> bool:
    """torchtitan >= 0.3 (Configurable configs) rather than 0.2 (JobConfig)."""
    import importlib.util
    return importlib.util.find_spec("torchtitan.config.configurable") is not None


def make_trainer(args, variant: str):
    """torchtitan >= 0.3: the Trainer of llama3_8b's config, changed as the module docstring says."""
    config = make_config(args, variant)
    info = {"activation_checkpoint": type(config.activation_checkpoint).__qualname__
            if config.activation_checkpoint is not None else None,
            "training_dtype": config.training.dtype, "cuda_graphs": not config.training.disable_cuda_graphs,
            "spmd_backend": config.parallelism.spmd_backend, "torchtitan_api": "configurable"}
    return config.build(), info


def make_config(args, variant: str):
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_8b

    config = llama3_8b()
    compile_on = not args.no_compile
    config.compile = CompileConfig(enable=compile_on)
    converters = None
    if variant == "float8":
        from torchtitan.components.quantization import Float8LinearConverter
        converters = [Float8LinearConverter.Config(filter_fqns=["lm_head"], model_compile_enabled=compile_on)]
    if args.flavor == "llama2_7b":
        raise SystemExit("--flavor llama2_7b is provided on torchtitan 0.2 only; use 8B")
    config.model_spec = model_registry(args.flavor or "8B", converters=converters)
    if args.layers:
        config.model_spec.model.layers = config.model_spec.model.layers[:args.layers]
    vocab = decoder_vocab_size(config.model_spec)
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab))
    config.tokenizer, config.dataloader = synthetic_components(vocab)
    config.training.local_batch_size = args.batch
    config.training.seq_len = args.seq_len
    config.training.steps = args.warmup + args.steps
    config.training.disable_cuda_graphs = args.no_cuda_graphs
    if args.spmd_backend:
        config.parallelism.spmd_backend = args.spmd_backend
    config.activation_checkpoint = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[args.ac]
    config.profiler.enable_profiling = False
    config.metrics.enable_tensorboard = False
    config.checkpoint.enable = False
    config.validator.enable = False
    config.dump_folder = tempfile.mkdtemp(prefix="tt_bench_")
    lp = lpoptim_variant(variant)
    if lp is not None:
        sys.path.insert(0, str(ROOT))
        from lpoptim.integrations.torchtitan import use_lpoptim
        bf16, act = lp
        if bf16:
            config.training.dtype = "bfloat16"
        use_lpoptim(config, recipe=args.lp_recipe, activations=act,
                    activation_options={"recompute": args.lp_recompute} if act else None,
                    state_bits=args.lp_state_bits, bf16_stochastic_round=bf16)
    return config


LLAMA2_7B = dict(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256, rope_theta=10000)


def make_trainer_jobconfig(args, variant: str):
    from torchtitan.train import Trainer
    job_config, info = jobconfig_for(args, variant)
    trainer = Trainer(job_config)
    # as built: lpoptim's converter compiles the blocks itself, inside its FP8 wrapper, and takes "model" out
    info["compile_components"] = list(job_config.compile.components) if job_config.compile.enable else []
    return trainer, info


def jobconfig_for(args, variant: str):
    """torchtitan 0.2: torchtitan's Trainer from its JobConfig flags (its llama3 8B recipe's values: AdamW lr 3e-4,
    selective activation checkpointing, FSDP2 with bf16 compute and fp32 reduction), on a train spec that is
    torchtitan's llama3 with synthetic data, no tokenizer (its SDPA attention needs none) and the flavor
    llama2_7b (Llama-2-7B's shape: 32 layers, d 4096, ffn 11008, 32 heads, vocab 32000)."""
    import dataclasses
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.protocols.train_spec import _extra_train_specs, get_train_spec, register_train_spec

    class SyntheticDataLoader(BaseDataLoader):
        def __init__(self, vocab, dp_rank, batch, seq_len):
            g = torch.Generator().manual_seed(1234 + dp_rank)
            self.pool = torch.randint(0, vocab, (POOL, batch, seq_len + 1), generator=g)
            self.i = 0

        def __iter__(self):
            while True:
                t = self.pool[self.i % POOL]
                self.i += 1
                yield {"input": t[:, :-1].clone()}, t[:, 1:].clone()

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, sd):
            self.i = sd["i"]

    flavor = args.flavor or "llama2_7b"
    base = get_train_spec("llama3")
    flavors = dict(base.model_args)
    flavors["llama2_7b"] = TransformerModelArgs(**LLAMA2_7B)
    if args.layers:
        flavors[flavor] = dataclasses.replace(flavors[flavor], n_layers=args.layers)
    vocab = flavors[flavor].vocab_size

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **_):
        return SyntheticDataLoader(vocab, dp_rank, job_config.training.local_batch_size, job_config.training.seq_len)

    if "llama3_bench" not in _extra_train_specs:
        register_train_spec("llama3_bench", dataclasses.replace(
            base, model_args=flavors, build_dataloader_fn=build_dataloader, build_tokenizer_fn=None,
            build_validator_fn=None, state_dict_adapter=None))
    cli = ["--model.name", "llama3_bench", "--model.flavor", flavor,
           "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq_len),
           "--training.steps", str(args.warmup + args.steps), "--optimizer.lr", "3e-4",
           "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", args.ac,
           "--job.dump_folder", tempfile.mkdtemp(prefix="tt_bench_")]
    if not args.no_compile:
        cli.append("--compile.enable")
    if variant == "float8":
        cli += ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise",
                "--quantize.linear.float8.filter_fqns", "output"]
    elif lpoptim_variant(variant) is not None:
        sys.path.insert(0, str(ROOT))
        from lpoptim.integrations.torchtitan import register_lpoptim_train_spec
        bf16, act = lpoptim_variant(variant)
        m = "lpoptim.integrations.torchtitan"
        cli += ["--job.custom_config_module", m, "--experimental.custom_import", m,
                "--model.name", register_lpoptim_train_spec("llama3_bench"), "--model.converters", "lpoptim",
                "--optimizer.name", "lpoptim.AdamW", "--optimizer.state_bits", str(args.lp_state_bits),
                "--lpoptim.recipe", args.lp_recipe]
        if act:
            cli += ["--activation_checkpoint.mode", "none"] + (["--lpoptim.recompute"] if args.lp_recompute else [])
        else:
            cli += ["--lpoptim.no-activations"]
        if bf16:
            cli += ["--training.dtype", "bfloat16", "--optimizer.bf16_stochastic_round"]
    job_config = ConfigManager().parse_args(cli)
    info = {"activation_checkpoint": job_config.activation_checkpoint.mode, "training_dtype": job_config.training.dtype,
            "compile_components": list(job_config.compile.components) if job_config.compile.enable else [],
            "flavor": flavor, "torchtitan_api": "jobconfig", "torchtitan_flags": cli}
    return job_config, info


def worker(args):
    import torch
    import torch.distributed as dist

    stand_in_datasets()
    from torchtitan.tools.logging import init_logger
    init_logger()
    trainer, info = (make_trainer if CONFIGURABLE() else make_trainer_jobconfig)(args, args.variant)
    times, losses = [], []
    train_step, fwd_bwd = trainer.train_step, trainer.forward_backward_step

    def forward_backward_step(**kw):
        loss = fwd_bwd(**kw)
        losses.append(loss.detach().clone())  # a CUDA graph's output is overwritten by its next replay
        return loss

    def timed_train_step(data_iterator):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(data_iterator)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    trainer.forward_backward_step, trainer.train_step = forward_backward_step, timed_train_step
    try:
        trainer.train()
    finally:
        trainer.close()
    mine = {"times": times, "losses": [float(x) for x in losses],
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        step = [max(r["times"][i] for r in ranks) for i in range(len(times))]
        timed = step[args.warmup:]
        tokens = args.batch * args.seq_len
        nparams = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        out = {"variant": args.variant,
               "tokens_per_s_per_gpu": tokens / statistics.median(timed),
               "step_s_median": statistics.median(timed), "step_s_mean": statistics.mean(timed),
               "step_s": step,
               "peak_allocated_gib": max(r["peak_allocated_gib"] for r in ranks),
               "peak_reserved_gib": max(r["peak_reserved_gib"] for r in ranks),
               "loss_first": ranks[0]["losses"][0], "loss_last": ranks[0]["losses"][-1],
               "losses_rank0": ranks[0]["losses"], "params": nparams,
               "optimizers": sorted({type(o).__module__ + "." + type(o).__name__ for o in trainer.optimizers}),
               **info}
        args.part.write_text(json.dumps(out, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def versions():
    """What every results JSON of lpoptim records (lpoptim.bench.environment: GPU, torch, triton, torchao, ...,
    the command line), with CUDA's version and torchtitan's packages."""
    import torch
    sys.path.insert(0, str(ROOT))
    from lpoptim.bench import _version, environment
    return {**environment(), "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torchtitan": _version("torchtitan"), "spmd_types": _version("spmd_types")}


def main(argv=None):
    if WORKER_ARGS in os.environ:
        return worker(parse(json.loads(os.environ[WORKER_ARGS])))
    args = parse(argv)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:  # a misspelt name refused before the first run (each takes minutes)
        lpoptim_variant(v)
    results, failed = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            part = Path(tmp) / f"{v}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
                   __file__]
            wargs = [*(argv if argv is not None else sys.argv[1:]), "--variant", v, "--part", str(part)]
            print(f"== {v}: {' '.join(cmd)} ({WORKER_ARGS}: {' '.join(wargs)})", flush=True)
            t0 = time.time()
            rc = subprocess.run(cmd, env={**os.environ, WORKER_ARGS: json.dumps(wargs)}).returncode
            if rc == 0 and part.exists():
                results[v] = json.loads(part.read_text()) | {"wall_s": time.time() - t0}
                r = results[v]
                print(f"== {v}: {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, peak {r['peak_allocated_gib']:.1f} GiB "
                      f"allocated ({r['peak_reserved_gib']:.1f} reserved), loss {r['loss_first']:.3f} -> "
                      f"{r['loss_last']:.3f}", flush=True)
            else:
                failed[v] = rc
                print(f"== {v}: FAILED (exit {rc})", flush=True)
    base = results.get(args.baseline)
    if base:
        for r in results.values():
            r["vs_baseline"] = {"tokens_per_s": r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"],
                                "peak_allocated": r["peak_allocated_gib"] / base["peak_allocated_gib"],
                                "peak_reserved": r["peak_reserved_gib"] / base["peak_reserved_gib"]}
            print(f"{r['variant']:>13}: {r['vs_baseline']['tokens_per_s']:.3f}x tokens/s, "
                  f"{r['vs_baseline']['peak_allocated']:.3f}x peak allocated vs {args.baseline}")
    meta = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("variant", "part")},
            "versions": versions(), "gpus": args.gpus, "baseline": args.baseline, "failed": failed,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
