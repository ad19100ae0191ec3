"""lpoptim bench on the CPU (tiny preset) and the Llama model it times."""
import json

import torch

from lpoptim.__main__ import main
from lpoptim.bench import DEFAULT_RECIPES
from lpoptim.stack import parse_stack
from lpoptim.train.llama import PRESETS, Llama


def test_bench_tiny_cpu(tmp_path, capsys):
    assert main(["bench", "--preset", "tiny", "--steps", "1", "--warmup", "1", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["recipe"]: r for r in report["results"]}
    assert list(rows) == list(DEFAULT_RECIPES)  # every recipe is in the JSON, run or skipped with a reason
    for name in ("torch", "lpoptim", "lpoptim+act", "lpoptim+fp8+act", "lpoptim+fp4+act", "lpoptim+int4+act",
                 "lpoptim+bf16+fp8_delayed+bwd+ce"):
        r = rows[name]
        assert "error" not in r, r
        for key in ("peak_bytes", "params_bytes", "grads_bytes", "states_bytes", "activations_bytes", "tokens_per_s"):
            if key == "grads_bytes" and "+bwd" in name:  # stepped and freed inside backward
                assert r[key] == 0
                continue
            assert r[key] > 0, (name, key)
        assert len(r["step_seconds_each"]) == 1 and r["step_seconds"] == r["step_seconds_each"][0] > 0
    for name in ("bnb", "torchao"):  # CUDA-only competitors: skipped on the CPU, with the reason
        assert rows[name].get("skipped") or rows[name].get("tokens_per_s", 0) > 0
    ratio = rows["lpoptim"]["states_bytes"] / rows["torch"]["states_bytes"]
    assert 0.22 < ratio < 0.30, ratio  # 2.06 bytes per parameter instead of 8
    assert rows["lpoptim+act"]["activations_bytes"] < 0.7 * rows["lpoptim"]["activations_bytes"]
    out = capsys.readouterr().out
    assert "| lpoptim+act |" in out and "command: python -m lpoptim bench --preset tiny" in out
    n = sum(p.numel() for p in Llama(PRESETS["tiny"]).parameters())
    assert rows["torch"]["params"] == n and f"parameters: {n / 1e6:.2f} M" in out  # not "0.00 B"
    assert (tmp_path / "bench.png").exists()


def test_llama_loss_decreases():
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=3e-3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(8):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.3  # starts near uniform
    assert losses[-1] < losses[0] - 0.5, losses


def test_llama_gqa_shapes():
    cfg = PRESETS["tiny"]
    model = Llama(cfg)
    assert cfg.n_kv_head < cfg.n_head and model.layers[0].attn.k_proj.out_features == cfg.n_kv_head * cfg.head_dim
    logits, loss = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, cfg.vocab_size) and loss is None


def test_sac_suffix_sets_inductors_budget(monkeypatch, tmp_path):
    import pytest
    import torch._functorch.config as functorch_config

    from lpoptim import bench

    stack = parse_stack("lpoptim+bf16+bwd+ce+sac65")
    assert stack.activation_budget == 0.65 and stack.chunked_loss and stack.in_backward
    assert parse_stack("torch").activation_budget is None
    for bad in ("torch+sac0", "torch+sac101", "torch+sacx", "nope+sac50"):
        with pytest.raises(ValueError):
            parse_stack(bad)
    # eager: skipped with the reason, not run without its budget
    assert "--compile" in bench.unavailable(parse_stack("torch+sac50"), "cpu", compile_blocks=False)
    assert bench.unavailable(parse_stack("torch+sac50"), "cpu", compile_blocks=True) is None
    seen = []
    monkeypatch.setattr(bench, "_run_stack", lambda *a: seen.append(functorch_config.activation_memory_budget) or {})
    default = functorch_config.activation_memory_budget
    bench.run_stack(stack, None, 1, 1, 1, 1, "cpu", compile_blocks=False)
    bench.run_stack(parse_stack("torch"), None, 1, 1, 1, 1, "cpu", compile_blocks=False)
    assert seen == [0.65, default] and functorch_config.activation_memory_budget == default
    # asked for by name without --compile: refused before any work (tests/test_cli.py); in bench.run, skipped
    report = bench.run("tiny", ["torch+sac50"], 1, 8, 1, 1, "cpu", log=lambda *a: None)
    row = report["results"][0]
    assert "--compile" in row["skipped"] and row["activation_budget"] == 0.5


def test_sac_suffix_takes_ascii_digits_only():
    import pytest

    with pytest.raises(ValueError):
        parse_stack("torch+sac\u00b2")  # '²'.isdigit() is True, int('²') is not
    assert "70%" in parse_stack("torch+sac070").label


def test_off_part_offloads_through_prepare():
    """+offNN: prepare's offload=NN (lpoptim and prepare stacks), its spelling and label; refused with parts that
    pack or keep the same activations and for other optimizers; skipped, with its reason, off CUDA or without
    --hf-config."""
    import pytest

    from lpoptim import bench

    stack = parse_stack("lpoptim+bf16+fp8_delayed+bwd+ce+off12")
    assert stack.offload == 12 and stack.name == "lpoptim+bf16+fp8_delayed+bwd+ce+off12"
    assert "12 blocks' activations offloaded" in stack.label
    assert parse_stack("prepare+bf16+s4+off8").offload == 8 and parse_stack("prepare").offload == 0
    for bad in ("lpoptim+off0", "lpoptim+offx", "lpoptim+off\u00b2", "torch+off4", "lpoptim+act+off4",
                "lpoptim+ckpt+off4", "prepare+cg+off4"):
        with pytest.raises(ValueError):
            parse_stack(bad)
    assert "--hf-config and CUDA" in bench.unavailable(stack, "cpu", hf=True)
    assert "--hf-config and CUDA" in bench.unavailable(stack, "cuda", hf=False)
    assert bench.unavailable(stack, "cuda", hf=True) is None


def test_cg_part_replays_compiled_blocks_as_cuda_graphs():
    import pytest

    from lpoptim import bench

    stack = parse_stack("lpoptim+bf16+fp8_tensor_fast+bwd+ce+sac55+cg")
    assert stack.cuda_graphs and stack.activation_budget == 0.55 and stack.linears == "fp8_tensor_fast"
    assert not parse_stack("lpoptim+bf16+bwd+ce+sac55").cuda_graphs
    for bad in ("nope+cg", "+cg", "torch+cg+cg"):
        with pytest.raises(ValueError):
            parse_stack(bad)
    assert "--compile and CUDA" in bench.unavailable(parse_stack("torch+cg"), "cpu", compile_blocks=True)
    assert "--compile and CUDA" in bench.unavailable(parse_stack("torch+cg"), "cuda", compile_blocks=False)
    assert bench.unavailable(parse_stack("torch+cg"), "cuda", compile_blocks=True) is None
    hf = dict(compile_blocks=True, hf=True)
    assert bench.unavailable(parse_stack("prepare+bf16+cg"), "cuda", **hf) is None
    assert "+ckpt" in bench.unavailable(parse_stack("torch+bf16+ckpt+cg"), "cuda", **hf)
    assert bench.unavailable(parse_stack("lpoptim+bf16+act+bwd+cg"), "cuda", **hf) is None
    assert "+rec" in bench.unavailable(parse_stack("lpoptim+bf16+rec+bwd+cg"), "cuda", **hf)


def test_table_compares_a_reserved_peak_with_a_reserved_peak():
    from lpoptim import bench

    gib = 2**30
    base = dict(recipe="torch-bf16", peak_bytes=50 * gib, peak_reserved_bytes=52 * gib, peak_kind="allocated",
                params_bytes=gib, grads_bytes=gib, states_bytes=gib, activations_bytes=gib, state_bytes_per_param=4.0,
                tokens_per_s=100.0)
    cg = dict(base, recipe="x+cg", peak_bytes=26 * gib, peak_reserved_bytes=26 * gib, peak_kind="reserved",
              activations_bytes=None, tokens_per_s=110.0)
    report = dict(env=dict(gpu="GPU", torch="t", triton="t"), preset="tiny",
                  model=dict(n_layer=1, d_model=8, ffn_dim=8, n_head=1, n_kv_head=1, vocab_size=8), batch=1, seq=8,
                  compile=True, steps=1, warmup=1, peak_measured=True, results=[base, cg])
    row = bench.table(report).splitlines()[-1]
    assert "26.00 (reserved)" in row and "n/a" in row and "0.50x mem" in row  # 26 / 52, not 26 / 50


def test_bench_hf_config_cpu(tmp_path, capsys):
    """--hf-config: the user's architecture from a config.json (random init, no download), torch as a torch user
    runs it and lpoptim through prepare, with prepare's plan and peak estimate in the JSON."""
    import pytest

    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                                   intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=128)))
    recipes = "torch+bf16,torch+bf16+ckpt,prepare+bf16,lpoptim+bf16+act+bwd+ce,lpoptim+rec+bwd"
    assert main(["bench", "--hf-config", str(cfg), "--steps", "1", "--warmup", "1", "--device", "cpu",
                 "--recipes", recipes, "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["hf"] and report["model"]["architecture"] == "LlamaForCausalLM" and report["model"]["n_layer"] == 2
    rows = {r["recipe"]: r for r in report["results"]}
    assert list(rows) == recipes.split(",")
    for name, r in rows.items():
        assert "error" not in r and r["tokens_per_s"] > 0, r
        assert r["params"] == rows["torch+bf16"]["params"]  # the same model under every stack
    assert rows["torch+bf16+ckpt"]["activations_bytes"] < 0.5 * rows["torch+bf16"]["activations_bytes"]
    assert rows["lpoptim+bf16+act+bwd+ce"]["activations_bytes"] < 0.6 * rows["torch+bf16"]["activations_bytes"]
    assert rows["lpoptim+bf16+act+bwd+ce"]["grads_bytes"] == 0  # stepped inside backward
    assert rows["lpoptim+bf16+act+bwd+ce"]["states_bytes"] < 0.8 * rows["torch+bf16"]["states_bytes"]
    assert "lpoptim.prepare:" in rows["prepare+bf16"]["plan"] and rows["prepare+bf16"]["estimated_peak_bytes"] > 0
    assert rows["prepare+bf16"]["plan_options"]["blocks"] == "model.layers"  # what makes the plan again
    assert "torch+bf16" in rows and "plan" not in rows["torch+bf16"]
    out = capsys.readouterr().out
    assert "HF LlamaForCausalLM: 2 layers" in out and (tmp_path / "out" / "bench.png").exists()


def test_hf_only_parts_are_skipped_on_lpoptims_own_model():
    from lpoptim import bench

    for name in ("torch+ckpt", "prepare"):
        assert "--hf-config" in bench.unavailable(parse_stack(name), "cpu")
    assert bench.unavailable(parse_stack("torch+ckpt"), "cpu", hf=True) is None


def test_hf_sac100_builds_through_prepare():
    """+sac100 (Inductor keeps every activation, its default) is a valid part; with --hf-config the lpoptim stack
    goes through prepare, whose budgets are in (0, 1): it gets no budget instead of failing with ValueError."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from lpoptim import bench

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    model, opt, _, info = bench.build_hf(parse_stack("lpoptim+bf16+sac100"), cfg, "cpu", True, tokens=64)
    assert opt.plan.activations is None and opt.plan.compile
    model, opt, _, info = bench.build_hf(parse_stack("lpoptim+bf16+sac50"), cfg, "cpu", True, tokens=64)
    assert opt.plan.activations == 0.5


def test_bundled_hf_configs_load():
    import pytest

    pytest.importorskip("transformers")
    from lpoptim import bench

    for name, kind, layers, width in (("tinyllama-1.1b", "llama", 22, 2048), ("llama3.2-3b", "llama", 28, 3072),
                                      ("llama2-7b", "llama", 32, 4096), ("llama3-8b", "llama", 32, 4096),
                                      ("qwen2.5-7b", "qwen2", 28, 3584), ("gemma2-9b", "gemma2", 42, 3584),
                                      ("llama2-13b", "llama", 40, 5120), ("llama-26b", "llama", 48, 6656)):
        cfg = bench.load_hf_config(name)
        assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.use_cache) == (kind, layers, width, False)


def test_auto_linears_width_on_the_bundled_configs():
    """Which layers of a block prepare's auto width threshold converts, on the shapes it was measured on
    (docs/prepare.md): none at 2048 and 3072 wide, all from 3584 (grouped-query attention's k and v, 512 and 1024
    wide out, included: they read q's input), and neither a mixture-of-experts router (8 out) nor a narrow model's
    down projection (wide in, narrow out, reading no wide layer's input)."""
    import pytest

    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from lpoptim import bench, planner
    from lpoptim.nn.convert import wide_linears

    def taken(module):
        names = {id(m): n.rsplit(".", 1)[-1] for n, m in module.named_modules()}
        return {names[id(m)] for m in wide_linears(module, planner.LINEARS_MIN_FEATURES)}

    every = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    expected = {"tinyllama-1.1b": set(), "llama3.2-3b": set(), "qwen2.5-7b": every, "gemma2-9b": every,
                "llama3-8b": every, "llama2-7b": every}
    for name, wide in expected.items():
        cfg = bench.load_hf_config(name)
        cfg.num_hidden_layers = 1
        with torch.device("meta"):
            block = AutoModelForCausalLM.from_config(cfg).model.layers[0]
        assert taken(block) == wide, name
    with torch.device("meta"):  # Mixtral's router reads q's input: 4096 in, 8 experts out
        mixed = torch.nn.ModuleDict(dict(q=torch.nn.Linear(4096, 4096), k=torch.nn.Linear(4096, 1024),
                                         router=torch.nn.Linear(4096, 8), down=torch.nn.Linear(5632, 2048)))
    assert taken(mixed) == {"q", "k"}


def test_four_bit_states_part():
    for name in ("lpoptim+bf16+s4+bwd", "prepare+bf16+s4"):
        stack = parse_stack(name)
        assert stack.state_bits == 4 and parse_stack(stack.name) == stack and "4-bit states" in stack.label
    assert parse_stack("lpoptim").state_bits == 8


def test_hf_depth_override_keeps_per_layer_lists_consistent():
    import pytest

    transformers = pytest.importorskip("transformers")
    from lpoptim.bench import set_depth

    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=128, head_dim=16)
    assert len(cfg.layer_types) == 2
    for depth in (1, 5):
        set_depth(cfg, depth)
        assert cfg.num_hidden_layers == depth and len(cfg.layer_types) == depth
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert len(model.model.layers) == depth
        ids = torch.randint(0, 128, (1, 8))
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
