"""benchmarks/fsdp.py runs end to end on the CPU (gloo, 2 ranks), so the multi-GPU commands docs/distributed.md
gives are one call when GPUs come; the largest shapes' sizes are what their names say."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _fsdp_main(*args, ranks: int = 0):
    """benchmarks/fsdp.py with ``args``: in this process's Python, or under torch.distributed.run with ``ranks``."""
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks)] if ranks else []
    return subprocess.run([sys.executable, *launch, str(ROOT / "benchmarks" / "fsdp.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, env=ENV, timeout=300)


def test_largest_shapes_have_their_published_sizes():
    sys.path.insert(0, str(ROOT))
    from benchmarks.fsdp import CONFIGS
    from lpoptim.train.llama import Llama

    for key, billions in (("codellama34b", 33.74), ("llama70b", 68.98)):
        with torch.device("meta"):
            n = sum(p.numel() for p in Llama(CONFIGS[key][1]).parameters())
        assert abs(n / 1e9 - billions) < 0.01, (key, n)


def test_unknown_model_and_bad_layers_are_refused_before_any_work(capsys):
    """In this process (main(argv) exits with status 2, as the command line does): one interpreter, not seven."""
    import pytest

    sys.path.insert(0, str(ROOT))
    from benchmarks.fsdp import main

    for args, msg in ((["--models", "llama7b,nope"], "unknown models"), (["--layers", "0"], "--layers"),
                      (["--optimizers", "torch,lpoptim+fp8"], "unknown optimizer run"),
                      (["--optimizers", "torch+s4"], "4-bit states"), (["--small", "--memory-cap-gib", "79"], "CUDA"),
                      (["--blocks-per-shard", "2,0"], "--blocks-per-shard"),
                      (["--blocks-per-shard", "4,1,4"], "each size once")):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and msg in err, err


def test_small_run_with_fewer_layers_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "fsdp.json"
    r = _fsdp_main("--small", "--layers", "3", "--torch-impl", "fused", "--optimizers",
                   "torch+bf16,prepare+bf16,prepare+bf16+s4",
                   "--prepare-activations", "recompute", "--bf16-reduce", "--out", str(out), ranks=2)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["prepare_activations"] == "recompute" and "bf16 reduce" in result["meta"]["mixed_precision"]
    entry = result["results"][0]
    assert entry["model"]["n_layer"] == 3 and "3 layers" in entry["model"]["name"]
    runs = entry["runs"]
    assert list(runs) == ["torch+bf16", "prepare+bf16", "prepare+bf16+s4"] and all(r["finite"] for r in runs.values())
    assert entry["baseline"] == "torch+bf16" and "tokens_ratio" in runs["prepare+bf16"]  # against the first run
    assert runs["prepare+bf16"]["state_gib_per_gpu"] < runs["torch+bf16"]["state_gib_per_gpu"]
    assert "FP8 block inputs + recompute" in runs["prepare+bf16"]["plan"]
    # 4-bit moments: about half the FP8 states' bytes on each rank (the plan says so too)
    assert runs["prepare+bf16+s4"]["state_gib_per_gpu"] < 0.7 * runs["prepare+bf16"]["state_gib_per_gpu"]
    assert "state_bits             4" in runs["prepare+bf16+s4"]["plan"]


def test_blocks_sharded_in_groups_train_as_one_by_one(tmp_path):
    """--blocks-per-shard 1,2 on 3 blocks (groups of 2 and 1): each size is a run of its own, named by it, against
    the first; grouping changes the collectives, not the arithmetic (the same shards, the same sums)."""
    out = tmp_path / "fsdp.json"
    r = _fsdp_main("--small", "--layers", "3", "--optimizers", "torch+bf16,prepare+bf16", "--bf16-reduce",
                   "--blocks-per-shard", "1,2", "--out", str(out), ranks=2)
    assert r.returncode == 0, r.stderr[-3000:]
    entry = json.loads(out.read_text())["results"][0]
    runs = entry["runs"]
    assert list(runs) == ["torch+bf16@1", "prepare+bf16@1", "torch+bf16@2", "prepare+bf16@2"]
    assert entry["baseline"] == "torch+bf16@1" and "tokens_ratio" in runs["prepare+bf16@2"]
    assert [x["blocks_per_shard"] for x in runs.values()] == [1, 1, 2, 2]
    assert [x["fsdp_units"] for x in runs.values()] == [4, 4, 3, 3]  # the root and each block; the root, (0, 1), 2
    for name in ("torch+bf16", "prepare+bf16"):  # prepare: the step in backward, as each unit's gradients arrive
        one, two = runs[f"{name}@1"]["losses"], runs[f"{name}@2"]["losses"]
        assert len(one) == len(two) == 4 and max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (name, one, two)
