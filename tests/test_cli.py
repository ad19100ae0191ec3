"""The command line and the public API refuse bad input up front, in one line; one recipe vocabulary."""
import json
import subprocess
import sys

import pytest
import torch

import lpoptim
from lpoptim import __main__ as cli
from lpoptim.stack import parse_stack

BAD_ARGS = [
    ["train", "--steps", "0"],
    ["train", "--steps", "-5"],
    ["train", "--steps", "x"],
    ["train", "--runs", "torch,adam"],
    ["train", "--runs", "lpoptim+bwd"],  # a bench-only part
    ["train", "--text", "/missing"],
    ["train", "--device", "tpu"],
    ["bench", "--batch", "0"],
    ["bench", "--seq", "-1"],
    ["bench", "--steps", "0"],
    ["bench", "--warmup", "0"],
    ["bench", "--n-layer", "0"],
    ["bench", "--memory-cap-gib", "-1"],
    ["bench", "--recipes", "lpoptim+nope"],
    ["bench", "--recipes", "torch+bwd"],  # step_in_backward needs lpoptim.AdamW
    ["bench", "--recipes", "lpoptim+fp8+int4"],
    ["bench", "--device", "tpu"],
    ["bench", "--hf-config", "/missing/config.json"],
    ["bench", "--hf-config", "no-such-bundled-name"],
    ["bench", "--hf-config", "llama2-7b", "--preset", "tiny"],
    ["bench", "--recipes", "prepare+act"],  # prepare makes its own choices
    ["bench", "--recipes", "lpoptim+act+ckpt"],  # HF checkpointing and FP8 activations exclude each other
    ["bench", "--recipes", "torch+s4"],  # 4-bit states are lpoptim's
    ["bench", "--recipes", "prepare"],  # prepare and +ckpt run on an HF model: --hf-config
    ["bench", "--recipes", "torch+ckpt"],
    ["bench", "--budget-gib", "30"],  # prepare's budget: with --hf-config only
    ["bench", "--hf-config", "llama2-7b", "--budget-gib", "30", "--recipes", "torch+bf16"],  # and a prepare recipe
    ["bench", "--hf-config", "llama2-7b", "--budget-fraction", "1.5"],  # a fraction is in (0, 1]
    ["bench", "--hf-config", "llama2-7b", "--budget-fraction", "0.9", "--budget-gib", "30"],  # one budget
    ["bench", "--budget-fraction", "0.9"],  # with --hf-config only
    ["bench", "--hf-config", "llama2-7b", "--budget-fraction", "0.9", "--device", "cpu"],  # a GPU's fraction
    # recipes asked for by name that cannot run with these arguments (the default list skips such recipes)
    ["bench", "--recipes", "torch,lpoptim+sac50", "--device", "cpu"],  # Inductor's budget: --compile
    ["bench", "--recipes", "lpoptim+cg", "--device", "cpu", "--compile"],  # CUDA graphs: CUDA
    ["bench", "--recipes", "lpoptim+off2"],  # offloading goes through prepare: --hf-config (and CUDA)
    ["bench", "--hf-config", "llama2-7b", "--n-layer", "1"],  # prepare's stack is two blocks or more
    ["bench", "--hf-config", "llama2-7b", "--budget-gib", "inf"],
    ["train", "--runs", "lpoptim+off2"],  # bench-only parts
    ["train", "--runs", "lpoptim+ckpt"],
]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if any training or benchmarking starts."""
    from lpoptim import bench
    from lpoptim.train import loop

    def started(*a, **k):
        raise AssertionError("work started before the arguments were checked")
    monkeypatch.setattr(loop, "train", started)
    monkeypatch.setattr(bench, "run", started)


@pytest.mark.parametrize("argv", BAD_ARGS, ids=" ".join)
def test_bad_argument_is_refused_in_one_line_before_any_work(argv, no_work, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: argument" in err, err


def test_cuda_refused_without_a_gpu(no_work, capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    for cmd in ("train", "bench"):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "--device", "cuda", "--out", str(tmp_path)])
        assert e.value.code == 2 and "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--memory-cap-gib", "79.6", "--out", str(tmp_path)])
    assert e.value.code == 2


def test_version_and_exit_status_through_the_interpreter():
    out = subprocess.run([sys.executable, "-m", "lpoptim", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"lpoptim {lpoptim.__version__}"
    out = subprocess.run([sys.executable, "-m", "lpoptim", "train", "--steps", "0"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "lpoptim train: error: argument --steps: expected a positive integer, got 0"]


def test_help_lists_the_recipe_parts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for part in ("lpoptim", "bnb", "bf16", "act", "rec", "bwd", "ce", "sacNN", "cg", "fp8_delayed", "int4"):
        assert part in out, part


def test_one_vocabulary_for_train_bench_and_convert_linears():
    s = parse_stack("lpoptim+bf16+fp8_delayed+act+bwd+ce+sac55")
    assert (s.optimizer, s.master, s.linears, s.compress, s.in_backward, s.chunked_loss, s.activation_budget) == \
        ("lpoptim", "bf16", "fp8_delayed", True, True, True, 0.55)
    assert s.name == "lpoptim+bf16+fp8_delayed+act+bwd+ce+sac55"
    assert parse_stack("lpoptim+ce+bwd+bf16").name == "lpoptim+bf16+bwd+ce"  # any order, one spelling
    # published commands' names still parse, to the same stacks
    assert parse_stack("lpoptim-bf16+fp8tf+bwd+ce+sac55") == parse_stack("lpoptim+bf16+fp8_tensor_fast+bwd+ce+sac55")
    assert parse_stack("bf16") == parse_stack("torch") and parse_stack("torch-bf16") == parse_stack("torch+bf16")
    assert cli.train_run(parse_stack("lpoptim+fp8d+act")) == dict(optimizer="lpoptim", recipe="fp8_delayed",
                                                                 compress=True, attention=False, master="fp32",
                                                                 optimizer_options={})
    assert cli.train_run(parse_stack("lpoptim+attn+act"))["attention"] is True
    assert parse_stack("lpoptim+attn+act").name == "lpoptim+act+attn"
    for lone in ("lpoptim+attn", "lpoptim+rec+attn"):  # attention's tensors in FP8 come with FP8 activations
        with pytest.raises(ValueError, match="attn .* comes with act"):
            parse_stack(lone)
    m = lpoptim.convert_linears(torch.nn.Sequential(torch.nn.Linear(32, 32)))
    assert m[0].recipe.name == "fp8_delayed" == lpoptim.nn.recipes.DEFAULT_RECIPE
    assert lpoptim.convert_linears(torch.nn.Sequential(torch.nn.Linear(32, 32)), "fp8d")[0].recipe.name == "fp8_delayed"


def test_api_refuses_wrong_types_up_front():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(TypeError, match="recipe must be a recipe name"):
        lpoptim.convert_linears(model, recipe=8)
    with pytest.raises(ValueError, match="unknown recipe 'fp9'.*fp8_delayed"):
        lpoptim.convert_linears(model, recipe="fp9")
    with pytest.raises(TypeError, match="takes an nn.Module"):
        lpoptim.convert_linears("model")
    assert type(model[0]) is torch.nn.Linear  # nothing converted by the failed calls
    with pytest.raises(TypeError, match="takes an optimizer"):
        lpoptim.state_bytes(model)


def test_train_writes_json_and_png_titled_with_its_data(tmp_path, monkeypatch, capsys):
    text = tmp_path / "poems.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    titles = []
    plot = cli.plot_curves
    monkeypatch.setattr(cli, "plot_curves", lambda results, title, path: titles.append(title) or plot(results, title, path))
    out = tmp_path / "out"
    assert cli.main(["train", "--steps", "2", "--runs", "torch", "--text", str(text), "--device", "cpu",
                     "--out", str(out)]) == 0
    assert (out / "train_loss.png").stat().st_size > 0
    report = json.loads((out / "train.json").read_text())
    assert report["text"] == str(text) and report["results"][0]["run"] == "torch"
    assert titles and "poems.txt" in titles[0] and "tinyshakespeare" not in titles[0]
    assert "poems.txt" in capsys.readouterr().out


def test_train_refuses_a_text_too_short(tmp_path, no_work, capsys):
    text = tmp_path / "short.txt"
    text.write_text("hello")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--text", str(text), "--device", "cpu", "--out", str(tmp_path)])
    assert e.value.code == 2 and "too short" in capsys.readouterr().err


def test_a_broken_bench_stack_fails_the_command(tmp_path, monkeypatch, capsys):
    from lpoptim import bench

    def broken(stack, *a, **k):
        if stack.compress:
            raise RuntimeError("kernel exploded")
        return dict(peak_bytes=0, peak_reserved_bytes=0)
    monkeypatch.setattr(bench, "run_stack", broken)
    monkeypatch.setattr(bench, "write", lambda report, out: [])
    monkeypatch.setattr(bench, "table", lambda report: "\n".join(
        f"| {r['recipe']} | FAILED: {r['error']} |" for r in report["results"] if "error" in r))
    code = cli.main(["bench", "--recipes", "lpoptim,lpoptim+act", "--device", "cpu", "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert code == 1
    assert "FAILED: RuntimeError: kernel exploded" in cap.out and "1 recipe(s) failed: lpoptim+act" in cap.err


def test_failed_row_is_marked_in_the_table():
    from lpoptim import bench

    report = dict(env=dict(gpu=None, torch="t", triton="t"), preset="tiny",
                  model=dict(n_layer=1, d_model=8, ffn_dim=8, n_head=1, n_kv_head=1, vocab_size=8), batch=1, seq=8,
                  compile=False, steps=1, warmup=1, peak_measured=False,
                  results=[dict(recipe="lpoptim+act", error="RuntimeError: boom")])
    assert "| lpoptim+act | FAILED: RuntimeError: boom |" in bench.table(report)


def test_train_presets_build_the_models_they_name():
    """gpt2-113m is the quality preset beyond the toy: at least 100 M parameters with a character vocabulary,
    context >= 512 (built on the meta device: no memory, no time)."""
    from lpoptim.__main__ import PRESETS
    from lpoptim.train.gpt import GPT, GPTConfig
    from lpoptim.train.loop import RunConfig

    fields = {"n_layer", "n_head", "n_embd", "block_size", "dropout"}
    for name, preset in PRESETS.items():
        RunConfig(**preset)  # every key is a run setting
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=100, **{k: v for k, v in preset.items() if k in fields}))
        params = sum(p.numel() for p in model.parameters())
        if name == "gpt2-113m":
            assert params >= 100e6 and preset["block_size"] >= 512 and preset["steps"] >= 2000


def test_train_runs_take_four_bit_states():
    (name, run), = cli.train_runs("lpoptim+s4")
    assert name == "lpoptim+s4" and run["optimizer_options"] == {"state_bits": 4}
    assert cli.train_runs("lpoptim")[0][1]["optimizer_options"] == {}


def test_train_compile_runs_the_same_arithmetic(tmp_path, capsys):
    """``lpoptim train --compile``: each block compiled; the fp32 run's losses equal the eager run's to fp32
    rounding (Inductor's fused kernels reorder a few sums: 2.4e-6 measured over 12 steps), and the report says
    it was compiled."""
    from lpoptim.train.loop import RunConfig, train

    eager = train(RunConfig(steps=6))
    torch._dynamo.reset()
    compiled = train(RunConfig(steps=6, compile=True))
    torch._dynamo.reset()
    assert max(abs(a - b) for a, b in zip(eager["curve"], compiled["curve"])) < 1e-4
    assert compiled["config"]["compile"] and not eager["config"]["compile"]
    assert cli.parser().parse_args(["train", "--compile"]).compile


def test_stdlib_text_grows_for_the_quality_preset_and_keeps_its_start(tmp_path):
    """--text python-stdlib: the small presets' 1.5 M characters are the start of the quality preset's larger text
    (which holds the packages' modules too), so the small presets' figures stay reproducible."""
    from lpoptim.__main__ import STDLIB_CHARS_BY_PRESET
    from lpoptim.train.data import STDLIB_CHARS, python_stdlib_text

    small = python_stdlib_text(tmp_path / "small.txt").read_text(encoding="utf-8")
    large = python_stdlib_text(tmp_path / "large.txt", 3 * STDLIB_CHARS).read_text(encoding="utf-8")
    assert len(small) == STDLIB_CHARS and len(large) == 3 * STDLIB_CHARS and large.startswith(small)
    assert STDLIB_CHARS_BY_PRESET["gpt2-113m"] > STDLIB_CHARS  # the quality preset asks for the whole library


def test_glob_text_concatenates_the_matching_files_in_path_order(tmp_path, no_work, capsys):
    """--text 'DIR/**/*.h': any corpus on the machine as one text, files in path order, undecodable bytes
    replaced, cut at the limit; a glob that matches nothing is refused before any work."""
    from lpoptim.train.data import files_text

    root = tmp_path / "inc"
    (root / "sys").mkdir(parents=True)
    (root / "b.h").write_text("bbb")
    (root / "a.h").write_text("aaa")
    (root / "sys" / "c.h").write_bytes(b"c\xffc")
    (root / "skip.txt").write_text("not a header")
    text = files_text(f"{root}/**/*.h", tmp_path / "t.txt", 100).read_text(encoding="utf-8")
    assert text == "aaabbbc\ufffdc"
    assert files_text(f"{root}/**/*.h", tmp_path / "t.txt", 5).read_text(encoding="utf-8") == "aaabb"
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--text", f"{root}/**/*.nothing", "--device", "cpu", "--out", str(tmp_path)])
    assert e.value.code == 2 and "no file matches" in capsys.readouterr().err
    named = tmp_path / "notes[1].txt"  # a file whose name reads as a glob is the file
    named.write_text("x")
    assert cli.existing_file(str(named)) == named


def test_hf_config_that_is_no_causal_lm_is_refused_and_a_config_json_named_by_its_folder(tmp_path, capsys, no_work):
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "intermediate_size": 128}))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--hf-config", str(vit / "config.json"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "ViTConfig is not a causal LM" in err and err.count("\n") == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--hf-config", str(bad), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and str(bad) in capsys.readouterr().err  # which file
    (vit / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--hf-config", str(vit), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no-such-model" in err and len(err) < 400  # not every model type transformers has


def test_train_checks_out_before_it_builds_a_text_there(tmp_path, capsys, no_work):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as e:  # --out is a file: refused in one line, no traceback from the text builder
        cli.main(["train", "--text", "python-stdlib", "--steps", "3", "--out", str(tmp_path / "file")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


def test_recorded_command_reruns_as_written(monkeypatch):
    from lpoptim.bench import environment

    monkeypatch.setattr(sys, "argv", ["/somewhere/lpoptim/__main__.py", "bench", "--steps", "3"])
    assert environment()["command"].endswith("-m lpoptim bench --steps 3")
    monkeypatch.setattr(sys, "argv", ["benchmarks/fsdp.py", "--small"])
    assert environment()["command"].endswith("benchmarks/fsdp.py --small")
