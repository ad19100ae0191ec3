"""lpoptim inside torchtitan (lpoptim/integrations/torchtitan.py), on the CPU: skipped without torchtitan.

torchtitan >= 0.3 (Configurable configs): its llama3 debug model is built from its config registry with the
converter; its FlexAttention has no CPU backward, so the tests swap the inner attention for torchtitan's SDPA
module (causal) and call the model without masks. The two-rank test runs torchtitan's parallelize_llama (FSDP2) on
gloo. torchtitan 0.2 (JobConfig): its config manager, converter and train-spec registries, in a subprocess (its
train-spec module imports ``datasets``, given a stand-in there where it is not installed).
"""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed")
CONFIGURABLE = importlib.util.find_spec("torchtitan.config.configurable") is not None  # torchtitan >= 0.3
needs_configurable = pytest.mark.skipif(not CONFIGURABLE, reason="torchtitan < 0.3 (JobConfig)")
needs_jobconfig = pytest.mark.skipif(CONFIGURABLE, reason="torchtitan >= 0.3 (Configurable configs)")

if CONFIGURABLE:
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.models.common.attention import GQAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    from lpoptim.integrations.torchtitan import (LpoptimConverter, LpoptimLinear, LpoptimOptimizersContainer,
                                                 lpoptim_adamw)

import lpoptim  # noqa: E402
from lpoptim.activations import is_wrapped  # noqa: E402

# torchtitan's trainer and train-spec modules import `datasets` (for its HF dataloader); subprocesses get this
# stand-in where it is not installed, which nothing in them calls
STAND_IN = textwrap.dedent("""
    import sys, types
    try:
        import datasets
    except ImportError:
        d, dd = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        d.Dataset, d.load_dataset, dd.split_dataset_by_node, d.distributed = object, None, None, dd
        sys.modules.update({"datasets": d, "datasets.distributed": dd})
""")


def run_python(code: str):
    out = subprocess.run([sys.executable, "-c", STAND_IN + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


VOCAB = 2048  # the debug model's


def cpu_model_config(converters=None):
    cfg = model_registry("debugmodel", converters=converters).model
    for _, att, _, _ in cfg.traverse(GQAttention.Config):
        att.inner_attention = ScaledDotProductAttention.Config()  # FlexAttention: no backward on the CPU
    return cfg


def build(cfg, seed=0):
    """As torchtitan's trainer does: built on meta, materialized, initialized by init_weights."""
    with torch.device("meta"):
        model = cfg.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def loss_of(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 33), generator=g)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@needs_configurable
def test_converter_converts_layer_linears_and_trains():
    model = build(cpu_model_config([LpoptimConverter.Config()]))
    conv = lpoptim.nn.converted(model)
    # every linear of the decoder blocks (fused qkv, wo, w1..w3 of 6 layers), the LM head kept
    assert len(conv) == 6 * 5 and set(conv.values()) == {"fp8_delayed"}
    assert all(isinstance(model.get_submodule(n), LpoptimLinear) for n in conv)
    assert type(model.lm_head).__name__ == "Linear" and "lm_head" not in conv
    # FP8 activations: all blocks wrapped, by one handle
    blocks = list(model.layers.values())
    assert all(is_wrapped(b) for b in blocks) and model.lpoptim_activations.blocks == blocks
    with model.lpoptim_activations.record() as stats:
        loss = loss_of(model)
    assert stats.records  # saved tensors went through the FP8 packing
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    # same weights unconverted: the FP8 forward is an approximation of it
    ref = build(cpu_model_config())
    ref.load_state_dict(model.state_dict())
    assert loss.item() == pytest.approx(loss_of(ref).item(), rel=0.02)


@needs_configurable
def test_converter_options():
    plain = lpoptim.nn.converted(build(cpu_model_config([LpoptimConverter.Config(recipe=None)])))
    assert plain == {}
    m = build(cpu_model_config([LpoptimConverter.Config(recipe="fp8", activations=False,
                                                        filter_fqns=["lm_head", "feed_forward.w2"])]))
    conv = lpoptim.nn.converted(m)
    assert len(conv) == 6 * 4 and set(conv.values()) == {"fp8"} and not any("w2" in n for n in conv)
    assert not any(is_wrapped(b) for b in m.layers.values())
    with pytest.raises(ValueError, match="unknown recipe"):
        LpoptimConverter.Config(recipe="nope").build()
    with pytest.raises(TypeError):
        LpoptimConverter.Config(activation_options={"no_such_option": 1}).build()


@needs_configurable
def test_activation_checkpointing_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    model = build(cpu_model_config([LpoptimConverter.Config(recipe=None)]))
    model.layers["0"] = checkpoint_wrapper(model.layers["0"])
    with pytest.raises(RuntimeError, match="activation_checkpoint"):
        loss_of(model)


@needs_configurable
def test_optimizer_selected_from_config_steps_and_round_trips():
    # recipe fp8 (current scaling): fp8_delayed's absmax history is not in any state dict, so a resumed model
    # would scale its first steps differently
    conv = [LpoptimConverter.Config(recipe="fp8")]
    model = build(cpu_model_config(conv))
    # norms in torch's AdamW, the rest in lpoptim's (4-bit states): one container, two optimizers
    cfg = LpoptimOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
        *lpoptim_adamw(lr=1e-3, state_bits=4).param_groups])
    cfg.implementation = "for-loop"  # torch's AdamW on the CPU; lpoptim's groups drop torchtitan's kernel flags
    opt = cfg.build(model_parts=[model])
    assert isinstance(opt, OptimizersContainer)
    kinds = sorted(type(o).__module__ + "." + type(o).__name__ for o in opt.optimizers)
    assert kinds == ["lpoptim.optim.adamw.AdamW", "torch.optim.adamw.AdamW"]
    lp = next(o for o in opt.optimizers if isinstance(o, lpoptim.AdamW))
    assert lp.param_groups[0]["state_bits"] == 4 and lp.param_groups[0]["fused"] is None

    before = model.layers["0"].feed_forward.w1.weight.detach().clone()
    loss_of(model).backward()
    opt.step()
    opt.zero_grad()
    assert not torch.equal(before, model.layers["0"].feed_forward.w1.weight)

    # torchtitan's flat, FQN-keyed optimizer state dict (what its checkpointer saves) into a fresh container
    sd = opt.state_dict()
    assert "state.layers.0.feed_forward.w1.weight.exp_avg_codes4" in sd
    model2 = build(cpu_model_config(conv), seed=3)
    model2.load_state_dict(model.state_dict())
    opt2 = cfg.build(model_parts=[model2])
    # copies, as a checkpoint loads them (torch's AdamW would keep the very tensors and share them with `opt`)
    opt2.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()})
    sd2 = opt2.state_dict()
    assert sd2.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(v, sd2[k]) if isinstance(v, torch.Tensor) else v == sd2[k], k
    for m, o in ((model, opt), (model2, opt2)):  # and the next step is the same
        loss_of(m, seed=2).backward()
        o.step()
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), n


@needs_configurable
def test_config_registry_entry():
    """``--module lpoptim.integrations.torchtitan --config llama3_debugmodel_lpoptim`` through torchtitan's
    ConfigManager (in a subprocess: its trainer module imports ``datasets``)."""
    run_python("""
        from torchtitan.config import ConfigManager
        from lpoptim.integrations.torchtitan import LpoptimLinear, LpoptimOptimizersContainer
        cfg = ConfigManager().parse_args(["--module", "lpoptim.integrations.torchtitan", "--config",
                                          "llama3_debugmodel_lpoptim", "--optimizer.implementation", "foreach"])
        assert type(cfg.optimizer) is LpoptimOptimizersContainer.Config, type(cfg.optimizer)
        assert cfg.optimizer.implementation == "foreach"
        (g,) = cfg.optimizer.param_groups
        assert g.optimizer_name == "lpoptim.AdamW" and g.optimizer_kwargs["lr"] == 8e-4, g
        assert cfg.activation_checkpoint is None
        assert type(cfg.model_spec.model.layers[0].feed_forward.w1) is LpoptimLinear.Config
        from lpoptim.integrations.torchtitan import use_lpoptim
        try:  # a second call would convert the blocks twice
            use_lpoptim(cfg)
        except ValueError as e:
            assert "already" in str(e), e
        else:
            raise AssertionError("use_lpoptim accepted a config that is lpoptim's already")
        print("ok")
    """)


def _fsdp_worker(rank, init_file, out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FSDPModule
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    torch.set_num_threads(1)
    parallel_dims.device_type = "cpu"  # torchtitan falls back to "cuda" for its meshes where there is no GPU
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # FSDP2 only (partial_dtensor: no TP, so no sharding configs needed); parameters bf16 in compute, as torchtitan
    par, tr = ParallelismConfig(spmd_backend="partial_dtensor"), TrainingConfig(local_batch_size=2, seq_len=32)
    with torch.device("meta"):
        model = cpu_model_config([LpoptimConverter.Config()]).build()
    model = parallelize_llama(model, parallel_dims=ParallelDims.from_config(par, 2), training=tr, parallelism=par,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=out_dir)
    for m in model.modules():  # torchtitan divides gradients itself (factor 1: PREMUL_SUM, which gloo lacks)
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    opt = lpoptim_adamw(lr=1e-3).build(model_parts=[model])
    losses = []
    for step in range(2):
        loss = loss_of(model, seed=10 * step + rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    w = model.layers["0"].feed_forward.w1.weight
    sd = opt.state_dict()
    assert type(w).__name__ == "DTensor" and type(sd["state.layers.0.feed_forward.w1.weight.exp_avg_codes"]) is type(w)
    dcp.save({"optim": sd}, checkpoint_id=os.path.join(out_dir, "ckpt"))
    opt2 = lpoptim_adamw(lr=1e-3).build(model_parts=[model])
    sd2 = opt2.state_dict()
    dcp.load({"optim": sd2}, checkpoint_id=os.path.join(out_dir, "ckpt"))
    opt2.load_state_dict(sd2)
    for k, v in opt2.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v,
                               sd[k].full_tensor() if hasattr(sd[k], "full_tensor") else sd[k]), k
    torch.save(losses, os.path.join(out_dir, f"losses{rank}.pt"))
    dist.destroy_process_group()


@needs_configurable
@pytest.mark.slow
def test_fsdp2_two_ranks_gloo(tmp_path):
    import torch.multiprocessing as mp
    mp.start_processes(_fsdp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    l0, l1 = (torch.load(tmp_path / f"losses{r}.pt") for r in (0, 1))
    assert len(l0) == 2 and all(torch.isfinite(torch.tensor(l0 + l1)))


@needs_jobconfig
def test_jobconfig_converter_optimizer_and_state_dict():
    """torchtitan 0.2: flags through its ConfigManager (with lpoptim's custom config module), the converter from
    its registry on the llama3 debug model of the registered train spec, lpoptim.AdamW from that spec's optimizer
    builder; a step, and the container's state dict (torch's flattened DCP form) into a fresh one."""
    run_python("""
        import importlib, torch
        from torchtitan.config import ConfigManager
        M = "lpoptim.integrations.torchtitan"
        jc = ConfigManager().parse_args([
            "--job.custom_config_module", M, "--experimental.custom_import", M, "--model.name", "llama3_lpoptim",
            "--model.converters", "lpoptim", "--optimizer.name", "lpoptim.AdamW", "--optimizer.state_bits", "4",
            "--activation_checkpoint.mode", "none", "--lpoptim.recipe", "fp8", "--compile.enable"])
        assert jc.optimizer.state_bits == 4 and jc.optimizer.lr == 8e-4 and jc.lpoptim.recipe == "fp8"
        importlib.import_module(jc.experimental.custom_import)  # what torchtitan's Trainer does first
        import lpoptim
        from lpoptim.activations import is_wrapped
        from torchtitan.protocols.model_converter import build_model_converters
        from torchtitan.protocols.train_spec import get_train_spec
        spec = get_train_spec(jc.model.name)

        def build(seed):
            with torch.device("meta"):
                model = spec.model_cls(spec.model_args["debugmodel"])
            build_model_converters(jc, None).convert(model)
            model.to_empty(device="cpu")
            torch.manual_seed(seed)
            with torch.no_grad():
                model.init_weights(buffer_device=None)
            return model

        model = build(0)
        # the blocks are compiled inside the FP8 wrapper, so torchtitan's own block compile is taken out
        assert jc.compile.components == ["loss"]
        conv = lpoptim.nn.converted(model)
        assert len(conv) == 6 * 7 and set(conv.values()) == {"fp8"} and "output" not in conv
        assert all(is_wrapped(b) for b in model.layers.values())
        for b in model.layers.values():  # eager here: compiling on the CPU takes long, and is not what is tested
            b.forward.run, b.forward.compile = b.forward.original, False
        opt = spec.build_optimizers_fn([model], jc.optimizer, None)
        (o,) = opt.optimizers
        assert isinstance(o, lpoptim.AdamW) and o.defaults["state_bits"] == 4

        def step(m, optim, seed):
            tok = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(seed))
            out = m(tok[:, :-1])
            torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), tok[:, 1:].flatten()).backward()
            optim.step()
            optim.zero_grad()

        step(model, opt, 1)
        sd = opt.state_dict()
        assert any(k.endswith("exp_avg_codes4") for k in sd)
        model2 = build(3)
        model2.load_state_dict(model.state_dict())
        for b in model2.layers.values():
            b.forward.run, b.forward.compile = b.forward.original, False
        opt2 = spec.build_optimizers_fn([model2], jc.optimizer, None)
        opt2.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()})
        for m, optim in ((model, opt), (model2, opt2)):
            step(m, optim, 2)
        for (n, p), p2 in zip(model.named_parameters(), model2.parameters()):
            assert torch.equal(p, p2), n

        # FP8 activations with activation checkpointing on: refused when the converter is built
        jc.activation_checkpoint.mode = "selective"
        try:
            build_model_converters(jc, None)
        except ValueError as e:
            assert "activation_checkpoint" in str(e)
        else:
            raise AssertionError("not refused")
        print("ok")
    """)
