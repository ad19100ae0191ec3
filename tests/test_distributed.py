"""lpoptim.AdamW under DDP and FSDP2, and distributed checkpoints (DCP), on the CPU: gloo, 2 processes.

One pipeline runs once per test module (a module fixture) and the tests check its parts:

1. In this process, no process group: a single-process reference run of STEPS steps that computes each step's
   gradient as DDP/FSDP2 do over 2 ranks (the two half batches backpropagated separately, each loss halved,
   the gradients summed), DCP-saved after SAVE_AT steps. Measured: its states differ from the 2 ranks' by a
   few ulps (the collectives' reductions), its losses by < 1e-7. A plain full-batch run too.
2. Two spawned ranks: DDP; FSDP2 fp32 (DCP save after SAVE_AT steps); FSDP2 with bf16 MixedPrecisionPolicy;
   FSDP2 loading the 1-process checkpoint (1 -> 2 resharding) and continuing.
3. Back here: the 2-rank checkpoint loaded into a plain model (2 -> 1) and continued.

The toy model has every awkward case: a 3-D parameter, uneven dim-0 shards (77 rows over 2 ranks), a
(1, 256) weight whose second shard has no rows, a 1-D parameter large enough to be quantized (its shards start
on group boundaries), row lengths that are not multiples of the group size, and fp32-state small tensors.
"""
from __future__ import annotations

import os
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lpoptim
from lpoptim.optim import distributed as lpdist

STEPS, SAVE_AT, WORLD, BATCH = 13, 3, 2, 16  # 10 steps after the save
# LPOPTIM_TEST_STATE_BITS=4 runs the whole pipeline with 4-bit states
OPT = dict(lr=1e-2, weight_decay=0.1, min_quant_numel=200, group_size=32,
           state_bits=int(os.environ.get("LPOPTIM_TEST_STATE_BITS", "8")))
C = "_codes4" if OPT["state_bits"] == 4 else "_codes"  # the codes' key suffix


def W(n: int) -> int:
    """The codes' last dim for a row of n: halved for 4-bit states."""
    return (n + 1) // 2 if OPT["state_bits"] == 4 else n


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(48)                        # fp32 states (small)
        self.w3 = torch.nn.Parameter(torch.randn(4, 3, 48) * 0.1)  # 3-D, scale rows 12 sharded 6/6
        self.fc1 = torch.nn.Linear(48, 77)                        # (77, 48): 39/38 rows; 2 groups/row, one short
        self.fc2 = torch.nn.Linear(77, 256)                       # bias (256,): 1-D quantized, shards 128/128
        self.head = torch.nn.Linear(256, 1)                       # (1, 256): rank 1 holds 0 rows

    def forward(self, x):
        gate = torch.tanh(torch.einsum("bd,hkd->b", x, self.w3) / 8).unsqueeze(-1)
        h = torch.nn.functional.gelu(self.fc1(self.norm(x) * (1 + gate)))
        return self.head(torch.nn.functional.gelu(self.fc2(h))).squeeze(-1)


def make_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 48, generator=g)
    return x, torch.sin(x[:, :4].sum(-1))


def halves(step: int, rank: int | None = None):
    x, y = batch(step)
    n = BATCH // WORLD
    parts = [(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n]) for i in range(WORLD)]
    return parts if rank is None else parts[rank]


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def single_step(model, opt, step: int, full_batch: bool = False) -> float:
    """One step in one process; the returned loss is the global batch's (mean of the halves' losses)."""
    opt.zero_grad(set_to_none=True)
    if full_batch:
        loss = loss_fn(model, *batch(step))
        loss.backward()
        value = loss.item()
    else:
        value = 0.0
        for x, y in halves(step):
            loss = loss_fn(model, x, y)
            (loss / WORLD).backward()
            value += loss.item() / WORLD
    opt.step()
    return value


def dist_step(model, opt, step: int, rank: int) -> float:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, *halves(step, rank))
    loss.backward()
    opt.step()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / WORLD


def state_summary(opt, model) -> dict:
    """Per parameter name: {state key: (type, dtype, global shape, local shape)}."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        out[names[id(p)]] = {k: (type(v).__name__, str(v.dtype), tuple(v.shape), tuple(lpdist.local(v).shape))
                             for k, v in st.items()}
    return out


def state_snapshot(opt, model) -> dict:
    """Every state tensor, whole (DTensors gathered: a collective), keyed 'param name.state key'."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}.{k}": (v.full_tensor() if lpdist.is_dtensor(v) else v).detach().clone()
            for p, st in opt.state.items() for k, v in st.items()}


def same_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def dcp_save(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def dcp_load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


# ---- the 2-rank part ------------------------------------------------------------------------------------------


def _fsdp(model, mesh, mp_policy=None):
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # older torch
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {"mesh": mesh}
    if mp_policy is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in (model.fc1, model.fc2, model.head):
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def _worker(rank: int, init_file: str, out_dir: str, ckpt_1proc: str, snapshot_1proc: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (WORLD,))
    res = {}

    # DDP: plain parameters, averaged gradients
    ddp = DDP(make_model())
    opt = lpoptim.AdamW(ddp.parameters(), **OPT)
    res["ddp"] = [dist_step(ddp, opt, s, rank) for s in range(STEPS)]

    # FSDP2 fp32, DCP save after SAVE_AT steps, then on
    model = _fsdp(make_model(), mesh)
    opt = lpoptim.AdamW(model.parameters(), **OPT)
    losses = []
    for s in range(STEPS):
        if s == SAVE_AT:
            dcp_save(model, opt, Path(out_dir) / "ckpt_2ranks")
            res["fsdp_snapshot"] = state_snapshot(opt, model)
        losses.append(dist_step(model, opt, s, rank))
    res["fsdp"] = losses
    res["fsdp_states"] = state_summary(opt, model)
    # lpoptim's own load_state_dict on DTensor states: a round trip changes nothing
    before = {k: lpdist.local(v).clone() for st in opt.state.values() for k, v in st.items()}
    opt.load_state_dict(opt.state_dict())
    after = {k: lpdist.local(v) for st in opt.state.values() for k, v in st.items()}
    res["roundtrip_equal"] = all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k])
                                 for k in before)
    res["roundtrip_dtensor"] = all(lpdist.is_dtensor(v) for st in opt.state.values()
                                   for k, v in st.items() if k != "step")
    tsd = opt.torch_state_dict()  # torch AdamW's layout: fp32 moments, DTensors like the parameters
    res["torch_sd"] = {i: {k: (type(v).__name__, str(v.dtype), tuple(v.shape)) for k, v in st.items()}
                       for i, st in tsd["state"].items()}
    opt_t = lpoptim.AdamW(model.parameters(), **OPT)  # torch's layout back in: quantized on load
    for g in tsd["param_groups"]:  # torch's groups replace lpoptim's, whose options fall back to the defaults
        g.update(min_quant_numel=OPT["min_quant_numel"], group_size=OPT["group_size"])
    opt_t.load_state_dict(tsd)
    res["torch_sd_reloaded"] = state_summary(opt_t, model)
    del opt_t
    # full (gathered, plain-tensor) optimizer state dicts: out of FSDP2 and back into a fresh optimizer
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    full_opts = StateDictOptions(full_state_dict=True)
    full = get_optimizer_state_dict(model, opt, options=full_opts)
    res["full_sd_plain"] = all(torch.is_tensor(v) and not lpdist.is_dtensor(v)
                               for st in full["state"].values() for v in st.values())
    res["full_sd"] = {f"{n}.{k}": v.clone() for n, st in full["state"].items() for k, v in st.items()}
    snap = state_snapshot(opt, model)
    opt2 = lpoptim.AdamW(model.parameters(), **OPT)
    model.zero_grad(set_to_none=True)  # else torch's _init_optim_state leaves the fresh optimizer stateless
    set_optimizer_state_dict(model, opt2, full, options=full_opts)
    res["full_sd_reloaded_exact"] = same_states(state_snapshot(opt2, model), snap)
    del opt2

    # FSDP2 with bf16 compute over fp32 sharded masters
    model = _fsdp(make_model(), mesh, mp_policy=True)
    opt = lpoptim.AdamW(model.parameters(), **OPT)
    res["fsdp_bf16"] = [dist_step(model, opt, s, rank) for s in range(STEPS)]
    res["fsdp_bf16_param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})

    # 1 -> 2: the 1-process checkpoint into 2 ranks, continued
    model = _fsdp(make_model(), mesh)
    opt = lpoptim.AdamW(model.parameters(), **OPT)
    dcp_load(model, opt, ckpt_1proc)
    res["resumed_1to2_states"] = state_summary(opt, model)
    res["resumed_1to2_exact"] = same_states(state_snapshot(opt, model), torch.load(snapshot_1proc))
    res["resumed_1to2"] = [dist_step(model, opt, s, rank) for s in range(SAVE_AT, STEPS)]

    # a plain, non-distributed opt.state_dict() (global tensors) straight into lpoptim's load_state_dict
    model = _fsdp(make_model(), mesh)
    opt = lpoptim.AdamW(model.parameters(), **OPT)
    opt.load_state_dict(torch.load(Path(out_dir) / "plain_state_dict.pt", weights_only=True))
    res["plain_sd_exact"] = same_states(state_snapshot(opt, model), torch.load(snapshot_1proc))
    res["plain_sd_dtensor"] = all(lpdist.is_dtensor(v) for st in opt.state.values()
                                  for k, v in st.items() if k != "step")
    # DTensor states placed otherwise (replicated) are redistributed to the parameter's placements
    from torch.distributed.tensor import Replicate

    sd = opt.state_dict()
    sd["state"] = {i: {k: (v.redistribute(mesh, [Replicate()]) if lpdist.is_dtensor(v) else v)
                       for k, v in st.items()} for i, st in sd["state"].items()}
    opt = lpoptim.AdamW(model.parameters(), **OPT)
    opt.load_state_dict(sd)
    res["replicated_sd_exact"] = same_states(state_snapshot(opt, model), torch.load(snapshot_1proc))

    # groups that would straddle a shard boundary are refused
    from torch.distributed.tensor import Shard, distribute_tensor

    refused = []
    for shape in [(3, 2, 40), (300,)]:
        p = distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])
        layout = lpoptim.optim.state.StateLayout.for_param(p, dict(lpoptim.optim.adamw.LPOPTIM_DEFAULTS,
                                                                   min_quant_numel=1))
        try:
            lpdist.scale_spec(p, layout)
        except ValueError:
            refused.append(shape)
    res["refused"] = refused

    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# ---- the pipeline ------------------------------------------------------------------------------------------


def pipeline() -> dict:
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # 1. single process, no process group
        model = make_model()
        opt = lpoptim.AdamW(model.parameters(), **OPT)
        ref = []
        for s in range(STEPS):
            if s == SAVE_AT:
                dcp_save(model, opt, tmp / "ckpt_1proc")
                snapshot = state_snapshot(opt, model)
                torch.save(snapshot, tmp / "snapshot_1proc.pt")
                torch.save(opt.state_dict(), tmp / "plain_state_dict.pt")
            ref.append(single_step(model, opt, s))
        model = make_model()
        opt = lpoptim.AdamW(model.parameters(), **OPT)
        full = [single_step(model, opt, s, full_batch=True) for s in range(STEPS)]

        # 2. two ranks
        _spawn_ranks(tmp)
        ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

        # 3. the 2-rank checkpoint into one plain process, continued
        model = make_model()
        opt = lpoptim.AdamW(model.parameters(), **OPT)
        dcp_load(model, opt, tmp / "ckpt_2ranks")
        states_2to1 = state_summary(opt, model)
        exact_2to1 = same_states(state_snapshot(opt, model), ranks[0]["fsdp_snapshot"])
        resumed_2to1 = [single_step(model, opt, s) for s in range(SAVE_AT, STEPS)]

        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(tmp / "ckpt_2ranks")).read_metadata().state_dict_metadata
        saved_dtypes = {k: meta[k].properties.dtype for k in meta if hasattr(meta[k], "properties")}
    return dict(ref=ref, full=full, snapshot=snapshot, exact_2to1=exact_2to1, ranks=ranks, resumed_2to1=resumed_2to1, states_2to1=states_2to1,
                saved_dtypes=saved_dtypes, seconds=time.time() - t0)


def _spawn_ranks(tmp: Path) -> None:
    """The two gloo ranks. A worker killed by a signal (seen once in a CI run: SIGABRT, "terminate called without
    an active exception", after the single-process checkpoint was written; not reproduced in 14 reruns) is retried
    once with a fresh rendezvous file; an exception raised in a worker fails the tests as it is."""
    for attempt in range(2):
        try:
            mp.spawn(_worker, args=(str(tmp / f"init{attempt}"), str(tmp), str(tmp / "ckpt_1proc"),
                                    str(tmp / "snapshot_1proc.pt")), nprocs=WORLD, join=True)
            return
        except mp.ProcessExitedException as e:
            if attempt or e.signal_name is None:
                raise
            warnings.warn(f"a gloo worker died ({e}); running the two ranks again")


@pytest.fixture(scope="module")
def run():
    return pipeline()


def test_ddp_matches_single_process(run):
    # DDP averages the two ranks' gradients; the reference computes the same average from the same half
    # batches: only the reductions' rounding differs (ulps). That moves the loss by far less than 1e-6, unless a
    # moment sits at an FP8 rounding boundary and takes the neighbouring code (one element's update moves by up to
    # 2^-3 of itself, more in a compressed group: seen 1e-6 and once 1.4e-5 of the loss in 13 steps); a wrong
    # average would move it by 1e-2
    for r in run["ranks"]:
        assert r["ddp"] == pytest.approx(run["ref"], rel=1e-4, abs=1e-7)


def test_fsdp2_matches_single_process(run):
    for r in run["ranks"]:
        # against the reference that reduces gradients as the ranks do: the same numbers to ulps (the step works
        # row by row and FSDP2's dim-0 shards hold whole rows, so the sharded step rounds as the whole one), or
        # one FP8 boundary apart, as for DDP above
        assert r["fsdp"] == pytest.approx(run["ref"], rel=1e-4, abs=1e-7)
        assert r["fsdp"] == r["ddp"]  # the same reductions: bit for bit
        # against a plain full-batch run: its gradient sums the batch in another order (ulp-level differences)
        # and a moment that sits at an FP8 rounding boundary may then round to the neighbouring code (a relative
        # step of 2^-3 for E4M3 in one element): the trajectories agree to FP8 precision times lr, not bitwise
        assert r["fsdp"] == pytest.approx(run["full"], rel=2e-3)
    assert run["ranks"][0]["fsdp"] == run["ranks"][1]["fsdp"]


def test_fsdp2_bf16_mixed_precision(run):
    for r in run["ranks"]:
        assert r["fsdp_bf16_param_dtypes"] == ["torch.float32"]  # sharded masters stay fp32
        # bf16 compute (8 mantissa bits) moves the trajectory by about 1e-2 relative, not more
        assert r["fsdp_bf16"] == pytest.approx(run["ref"], rel=3e-2)
        assert r["fsdp_bf16"][-1] < r["fsdp_bf16"][0]


def test_states_follow_local_shards(run):
    s0, s1 = (r["fsdp_states"] for r in run["ranks"])
    # codes: DTensors with the parameter's global shape, uint8, local shard rows
    assert s0["fc1.weight"][f"exp_avg{C}"] == ("DTensor", "torch.uint8", (77, W(48)), (39, W(48)))
    assert s1["fc1.weight"][f"exp_avg{C}"] == ("DTensor", "torch.uint8", (77, W(48)), (38, W(48)))
    assert s0["fc1.weight"]["exp_avg_scale"] == ("DTensor", "torch.float32", (77, 2), (39, 2))
    assert s1["fc1.weight"]["exp_avg_scale"] == ("DTensor", "torch.float32", (77, 2), (38, 2))
    assert s0["head.weight"]["exp_avg_sq_scale"] == ("DTensor", "torch.float32", (1, 8), (1, 8))
    assert s1["head.weight"][f"exp_avg_sq{C}"] == ("DTensor", "torch.uint8", (1, W(256)), (0, W(256)))  # empty shard
    assert s1["head.weight"]["exp_avg_sq_scale"] == ("DTensor", "torch.float32", (1, 8), (0, 8))
    assert s0["w3"]["exp_avg_scale"] == ("DTensor", "torch.float32", (12, 2), (6, 2))
    assert s1["fc2.bias"]["exp_avg_scale"] == ("DTensor", "torch.float32", (1, 8), (1, 4))  # 1-D: Shard(1)
    assert s0["fc1.bias"]["exp_avg"] == ("DTensor", "torch.float32", (77,), (39,))  # small: fp32
    assert s0["fc1.weight"]["step"][0] == "Tensor"
    for r in run["ranks"]:
        assert r["roundtrip_equal"] and r["roundtrip_dtensor"]
        assert r["full_sd_plain"] and r["full_sd_reloaded_exact"]
        assert r["torch_sd"][3]["exp_avg"] == ("DTensor", "torch.float32", (77, 48))  # fc1.weight
        assert r["torch_sd"][3]["step"][0] == "Tensor"
        assert r["torch_sd_reloaded"] == r["fsdp_states"]  # same types, dtypes, global and local shapes
        assert r["full_sd"][f"fc1.weight.exp_avg{C}"].dtype == torch.uint8
        assert r["full_sd"]["fc1.weight.exp_avg_scale"].shape == (77, 2)
        assert r["refused"] == [(3, 2, 40), (300,)]


def test_dcp_2_ranks_to_1_process_continues(run):
    assert run["exact_2to1"]  # the 1 process holds the 2 ranks' states at the save, bit for bit
    ref = run["ref"][SAVE_AT:]
    # the resumed process reduces gradients in another order: ulps, or one FP8 boundary apart (about 1e-6 of the
    # loss, see test_ddp_matches_single_process); a state lost or misplaced in the resume moves it by 1e-2
    assert run["resumed_2to1"] == pytest.approx(run["ranks"][0]["fsdp"][SAVE_AT:], rel=0, abs=1e-5)
    assert run["resumed_2to1"] == pytest.approx(ref, rel=0, abs=1e-5)


def test_dcp_1_process_to_2_ranks_continues(run):
    for r in run["ranks"]:
        assert r["resumed_1to2_exact"]  # each rank's shards gathered: the saved states, bit for bit
        assert r["plain_sd_exact"] and r["plain_sd_dtensor"]  # a plain state dict, each rank takes its piece
        assert r["replicated_sd_exact"]
        assert r["resumed_1to2"] == pytest.approx(run["ref"][SAVE_AT:], rel=0, abs=1e-5)  # as above


def test_dcp_keeps_codes_and_scales_dtypes(run):
    saved = run["saved_dtypes"]
    codes = [k for k in saved if k.endswith((f"exp_avg{C}", f"exp_avg_sq{C}")) and "fc1.weight" in k]
    scales = [k for k in saved if k.endswith("_scale")]
    assert codes and scales
    assert all(saved[k] == torch.uint8 for k in codes)
    assert all(saved[k] == torch.float32 for k in scales)
    for states in (run["states_2to1"], *(r["resumed_1to2_states"] for r in run["ranks"])):
        for name in ("fc1.weight", "fc2.weight", "head.weight", "w3", "fc2.bias"):
            assert states[name][f"exp_avg{C}"][1] == "torch.uint8"
            assert states[name][f"exp_avg_sq{C}"][1] == "torch.uint8"
            assert states[name]["exp_avg_scale"][1] == "torch.float32"
        assert states["fc1.bias"]["exp_avg"][1] == "torch.float32"
    assert run["states_2to1"]["fc1.weight"]["exp_avg_scale"][0] == "Tensor"  # plain tensors in one process
    assert run["ranks"][1]["resumed_1to2_states"]["fc1.weight"]["exp_avg_scale"][3] == (38, 2)


def test_pipeline_runtime(run):
    assert run["seconds"] < 90


def test_chunks_match_torch_chunk():
    for n in (0, 1, 5, 77, 256):
        for w in (1, 2, 3, 4):
            sizes = [c.shape[0] for c in torch.arange(n).chunk(w)] if n else []
            got = lpdist._chunks(n, w)
            assert [s for _, s in got if s] == [s for s in sizes if s]
            assert sum(s for _, s in got) == n and len(got) == w
