"""FP8 all-gathers under FSDP2 (lpoptim.nn.fp8_all_gather), on the CPU: the gathered weight type, the many-tensor
kernels against the reference (Triton's interpreter), a compiled block taking it as a graph input, and three gloo
ranks training a toy model of low-bit layers with and without FP8 gathers: the same losses and parameters bit for
bit."""
from __future__ import annotations

import gc
import io
import sys
import tempfile
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lpoptim
from lpoptim.device import has_fp8_conversions
from lpoptim.kernels.multi_cast import CastPlan, TensorTable, absmax_many
from lpoptim.nn.fp8_all_gather import fp8_all_gather, gathers_in_fp8
from lpoptim.nn.gathered_weight import GatheredFp8Weight, gathered_dx, gathered_operand
from lpoptim.nn.operands import gemm, quantize, quantize_operand_ref
from lpoptim.nn.recipes import RECIPES
from lpoptim.quant import finite_absmax

from gloo_ranks import spawn_ranks

WORLD, STEPS = 3, 3


def _fully_shard(module, **kw):
    """FSDP2 on a CPU mesh of the gloo ranks: without one, FSDP2 would place the parameters on a CUDA device
    wherever there is one, while the batches here are on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    return fully_shard(module, mesh=init_device_mesh("cpu", (WORLD,)), **kw)


def _gathered(w: torch.Tensor) -> GatheredFp8Weight:
    op = quantize(w, RECIPES["fp8_tensor"].specs.w_kept)
    return GatheredFp8Weight(op.values, op.scale, w.dtype)


def test_gathered_weight_is_the_weight_in_fp8():
    torch.manual_seed(0)
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    g = _gathered(w)
    assert g.dtype == torch.bfloat16 and g.shape == w.shape and not g.requires_grad
    # the views FSDP2 and nn.Parameter make keep the FP8 values
    for view in (g.detach(), torch.as_strided(g, (48, 32), (32, 1), 0), g.view(48, 32), torch.nn.Parameter(g)):
        assert isinstance(view, GatheredFp8Weight) and view._values.dtype == torch.float8_e4m3fn
    # anything else runs on the dequantized weight
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    deq = (g._values.float() * g._scale).bfloat16()
    assert torch.equal(F.linear(x, g), F.linear(x, deq))
    assert type(g + 0) is torch.Tensor
    with pytest.raises(RuntimeError, match="read-only"):  # a write would land in a dequantized copy
        g.add_(1)
    out = torch.empty(48, 32, dtype=torch.bfloat16)
    out.copy_(g)  # reading it into a plain tensor is not a write into it
    assert torch.equal(out, deq)
    # its operands: W's values and scale; dx = dy W with Wᵀ as quantizing Wᵀ by W's absmax gives, in eager mode
    # and as the op a compiled graph calls
    op = gathered_operand(g)
    assert op.values is g._values and op.scale is g._scale
    ref_t = quantize(w.t(), RECIPES["fp8_tensor"].specs.wt, amax=finite_absmax(w.float()))
    gq = quantize(torch.randn(5, 48, dtype=torch.bfloat16), RECIPES["fp8_tensor"].specs.dy)
    ref_dx = gemm(gq, ref_t, torch.bfloat16)
    assert torch.equal(gathered_dx(gq, g, torch.bfloat16), ref_dx)
    assert torch.equal(torch.compile(lambda a, b: gathered_dx(a, b, torch.bfloat16), backend="aot_eager",
                                     fullgraph=True)(gq, g), ref_dx)
    assert gathered_operand(w) is None and gathered_dx(gq, w, torch.bfloat16) is None


@pytest.mark.parametrize("recipe", ["fp8_tensor", "fp8_delayed"])
def test_layer_takes_a_gathered_weight_as_its_own(recipe):
    """A low-bit layer whose weight arrives in FP8 computes what it computes with the bf16 weight (current
    scaling: the first call of a delayed recipe takes its own absmax too)."""
    torch.manual_seed(1)
    layer = lpoptim.nn.LowBitLinear(32, 48, bias=False, dtype=torch.bfloat16, recipe=recipe)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(2, 7, 48, dtype=torch.bfloat16)
    y = layer(x)
    (dx, dw) = torch.autograd.grad(y, (x, layer.weight), gy)
    layer.reset_amax_history()
    layer._parameters["weight"] = torch.nn.Parameter(_gathered(layer.weight.detach()))
    y2 = layer(x)
    (dx2, dw2) = torch.autograd.grad(y2, (x, layer.weight), gy)
    assert type(dw2) is torch.Tensor and dw2.dtype == torch.bfloat16
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)


def test_compiled_block_takes_gathered_weights():
    """torch.compile takes the subclass as a graph input (its inner tensors): the block's output and gradients are
    those of the same block with bf16 weights. Its dx GEMMs run as an op of their own (gathered_dx), whose fp32
    emulation on the CPU sums in another order than Inductor's compiled one (on CUDA both are torch._scaled_mm):
    what comes after the last layer's dx is compared in norm (a dy one bf16 ulp off rounds to the next FP8 code in
    the layer before, and on: as compiled and eager runs of it differ too), and one layer's dx bit for bit."""
    out = []
    for gathered in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(3)
        block = Block().to(torch.bfloat16)
        lpoptim.nn.convert_linears(block, "fp8_tensor", skip=())
        if gathered:
            for layer in (block.up, block.down):
                layer._parameters["weight"] = torch.nn.Parameter(_gathered(layer.weight.detach()))
        block.compile(fullgraph=True)
        x = torch.randn(24, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4), requires_grad=True)
        y = block(x)
        y.float().square().sum().backward()
        out.append((y, x.grad, block.up.weight.grad, block.down.weight.grad, block.down.bias.grad))
    for i, (a, b) in enumerate(zip(*out)):
        assert type(b) is torch.Tensor
        if i in (1, 2):  # x.grad, up.weight.grad: after down's dx
            assert ((a - b).float().norm() / a.float().norm()).item() < 2 ** -4
        else:
            assert torch.equal(a, b)
    grads = []
    for gathered in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(5)
        layer = lpoptim.nn.LowBitLinear(64, 80, bias=False, dtype=torch.bfloat16, recipe="fp8_tensor")
        if gathered:
            layer._parameters["weight"] = torch.nn.Parameter(_gathered(layer.weight.detach()))
        x = torch.randn(24, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6), requires_grad=True)
        y = torch.compile(layer, fullgraph=True)(x)
        y.float().square().sum().backward()
        grads.append((y, x.grad, layer.weight.grad))
    for a, b in zip(*grads):
        assert type(b) is torch.Tensor and torch.equal(a, b)


def _partitioned(layer, x) -> tuple[list, list]:
    """What the compiled forward of ``layer`` saves for the backward (the values of the forward graph's outputs
    past the first) and the ops of the backward graph, as Inductor's partitioner (min-cut) splits them."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    saved, backward_ops = [], []

    def forward_compiler(gm, inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.extend(a.meta.get("val") for a in out[1:] if isinstance(a, torch.fx.Node))
        return make_boxed_func(gm.forward)

    def backward_compiler(gm, inputs):
        backward_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                           partition_fn=min_cut_rematerialization_partition)
    torch.compile(layer, backend=backend, fullgraph=True)(x).float().sum().backward()
    return saved, backward_ops


def test_compiled_forward_saves_no_transposed_weight():
    """The gathered weight's transposed codes are made inside the backward's dx op, not saved from the forward.
    (As a node of its own, Inductor's partitioner computed that copy in the forward of compiled 7B blocks under
    FSDP2 on GPUs and saved it; a lone layer like this one, on the CPU or a GPU, has it recomputed anyway, so here
    the op's place in the backward is what can fail.)"""
    device = "cuda" if torch.cuda.is_available() and has_fp8_conversions(torch.device("cuda")) else "cpu"
    torch.manual_seed(7)
    layer = lpoptim.nn.LowBitLinear(64, 80, bias=False, dtype=torch.bfloat16, recipe="fp8_tensor", device=device)
    layer._parameters["weight"] = torch.nn.Parameter(_gathered(layer.weight.detach()))
    x = torch.randn(32, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    saved, ops = _partitioned(layer, x)
    assert "lpoptim.gemm_by_transposed.default" in ops
    assert not [t for t in saved if t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (64, 80)]


def test_delayed_layer_scales_a_gathered_weight_by_its_own_absmax():
    """Eager fp8_delayed scales W by the largest absmax of its recent calls; a gathered W comes scaled by its own
    (current scaling): the two differ once W shrinks, and the gathered one is what fp8_tensor computes."""
    torch.manual_seed(5)
    x = torch.randn(7, 32, dtype=torch.bfloat16, requires_grad=True)
    outs = {}
    for name, recipe, gathered in (("delayed", "fp8_delayed", False), ("gathered", "fp8_delayed", True),
                                   ("current", "fp8_tensor", False)):
        torch.manual_seed(6)
        layer = lpoptim.nn.LowBitLinear(32, 48, bias=False, dtype=torch.bfloat16, recipe=recipe)
        layer(x).sum().backward()  # a first training call records W's absmax
        with torch.no_grad():
            layer.weight.mul_(0.3)  # W shrinks (not by a power of two, which E4M3 would absorb exactly)
        if gathered:
            layer._parameters["weight"] = torch.nn.Parameter(_gathered(layer.weight.detach()))
        outs[name] = layer(x)
    assert torch.equal(outs["gathered"], outs["current"])
    assert not torch.equal(outs["gathered"], outs["delayed"])


def test_which_recipes_gather_in_fp8():
    assert {name for name, r in RECIPES.items() if gathers_in_fp8(r)} == {"fp8_tensor", "fp8_tensor_fast",
                                                                         "fp8_delayed"}


# fp32 bit patterns the rounding to bf16 must take as torch does: ties to even (up and down), values that round to
# +-inf, subnormals, -0, a negative NaN
EDGES = [0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00018000, 0x80008000, 0x80000000,
         0xFFC00001, 0x7F800001]


@pytest.mark.parametrize("dtype, round_to", [(torch.bfloat16, None), (torch.float32, None),
                                             (torch.float32, torch.bfloat16)])
def test_many_tensor_kernels_match_the_reference(dtype, round_to):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter on the CPU)
    torch.manual_seed(2)
    ts = [torch.randn(r, 32, dtype=dtype) * s for r, s in ((5, 1.0), (64, 0.02), (3, 300.0), (0, 1.0))]
    ts[1][3, 4], ts[1][2, 2], ts[2][0, 0] = float("inf"), float("nan"), -float("inf")
    rows = [8, 64, 3, 2]  # slots of 8 and 2 rows: zero padding after the codes
    if dtype == torch.float32:
        edges = torch.tensor(EDGES, dtype=torch.int64).to(torch.int32).view(torch.float32)
        ts[0].view(-1)[:len(EDGES)] = edges
        for e in edges[:3]:  # each tie alone as its tensor's absmax: its rounding moves the scale, every code
            t = torch.full((1, 32), 0.01)
            t[0, 0], t[0, 1] = e, -e / 3
            ts.append(t)
            rows.append(1)
    ts = [t.to(device) for t in ts]
    seen = [t if round_to is None else t.to(round_to) for t in ts]  # what the kernels must read
    table = TensorTable(ts)
    amax = absmax_many(table, round_to)
    assert torch.equal(amax, torch.stack([finite_absmax(t.float()) for t in seen]))
    plan = CastPlan(table, [r * 32 for r in rows])
    out = plan.cast(amax, round_to)
    for i, t in enumerate(seen):
        ref = quantize_operand_ref(t.cpu(), "e4m3", "tensor", None, 32, amax[i].cpu()).values.flatten()
        got = out[plan.starts[i]:plan.starts[i + 1]].cpu()
        nan = ref.float().isnan()  # the same NaNs; every other code the same bits (a zero's sign too)
        assert torch.equal(got[:t.numel()].float().isnan(), nan), i
        assert torch.equal(got[:t.numel()].view(torch.uint8)[~nan], ref.view(torch.uint8)[~nan]), i
        assert not got[t.numel():].view(torch.uint8).any(), i
    with pytest.raises(ValueError, match="contiguous"):
        TensorTable([ts[0].t()])


# ---- three gloo ranks -----------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, d=64, f=80):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, f, bias=False)  # 80 rows over 3 ranks: 27, 27, 26 (uneven)
        self.down = torch.nn.Linear(f, d, bias=True)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(64, 16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(rank: int, recipe: str, fp8: bool, break_shard: bool = False, fp32_masters: bool = False) -> dict:
    """``fp32_masters``: fp32 parameters gathered in bf16 (MixedPrecisionPolicy), else bf16 parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = Toy() if fp32_masters else Toy().to(torch.bfloat16)
    for i, b in enumerate(model.blocks):  # the last block in int4: gathered in bf16, as before
        lpoptim.nn.convert_linears(b, recipe if i < 3 else "int4", skip=())
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) if fp32_masters else {}
    _fully_shard([model.blocks[0], model.blocks[1]], **kw)
    _fully_shard([model.blocks[2], model.blocks[3]], **kw)
    _fully_shard(model, **kw)
    names = fp8_all_gather(model) if fp8 else []
    seen = []  # the weights' types in forward: the one whose hooks break_shard takes off, and another
    for layer in (model.blocks[0].up, model.blocks[1].up):
        layer.register_forward_pre_hook(lambda m, a: seen.append(type(m.weight).__name__))
    opt = lpoptim.AdamW(model.parameters(), lr=1e-2, bf16_stochastic_round=not fp32_masters)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(STEPS):
        if break_shard and step == 1:  # as if FSDP2 had replaced a local shard: the hooks are set again
            shard = model.blocks[0].up.weight._local_tensor
            del shard.fsdp_pre_all_gather, shard.fsdp_post_all_gather
        x = torch.randn(24, 64, generator=gen).to(torch.float32 if fp32_masters else torch.bfloat16)
        y = torch.randint(0, 16, (24,), generator=gen)
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor().float() for n, p in model.named_parameters()}
    pickled = None
    if fp8:  # a shard carries the hooks: saving it itself is refused with a message (a copy saves)
        torch.save(model.blocks[0].up.weight.to_local().clone(), io.BytesIO())
        try:
            torch.save(model.blocks[0].up.weight, io.BytesIO())
        except Exception as e:
            pickled = str(e)
    # nothing keeps the model once the loop lets it go: the hooks set on its shards hold it weakly (the garbage
    # collector does not look inside a tensor C++ holds too, so a cycle through one would never be freed)
    alive = weakref.ref(model)
    del model, opt, layer, loss, b
    gc.collect()
    return dict(names=names, losses=losses, params=params, seen=seen, freed=alive() is None, pickled=pickled)


def _worker(rank: int, init_file: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    res = {}
    for recipe in ("fp8_tensor", "fp8_delayed"):
        for fp8 in (False, True):
            res[recipe, fp8] = _train(rank, recipe, fp8)
    for fp8 in (False, True):
        res["fp32_masters", fp8] = _train(rank, "fp8_tensor", fp8, fp32_masters=True)
    # the casts by quantize(), one shard at a time (where the many-tensor kernel does not run), fp32 masters under
    # a bf16 policy, and a shard that lost its hooks after the first step
    module = sys.modules["lpoptim.nn.fp8_all_gather"]  # (lpoptim.nn.fp8_all_gather is the function)
    kernels = module.interpreted
    module.interpreted = lambda: False
    try:
        res["one_at_a_time"] = _train(rank, "fp8_tensor", True, break_shard=True, fp32_masters=True)
    finally:
        module.interpreted = kernels
    # refused while a unit holds its gathered weights, and a second time
    model = Toy().to(torch.bfloat16)
    lpoptim.nn.convert_linears(model.blocks[0], "fp8_tensor", skip=())
    _fully_shard(model.blocks[0])
    _fully_shard(model)
    model.blocks[0].unshard()
    res["refused"] = []
    try:
        fp8_all_gather(model.blocks)  # not a unit
    except ValueError as e:
        res["refused"].append(str(e))
    for _ in range(3):  # with a unit gathered; resharded (applied); applied again
        try:
            fp8_all_gather(model)
            res["refused"].append(None)
        except ValueError as e:
            res["refused"].append(str(e))
        model.blocks[0].reshard()
    # applied to a unit that is not the root: refused at its forward, which runs after the root's has told FSDP2
    # which is the root
    model = Toy().to(torch.bfloat16)
    lpoptim.nn.convert_linears(model.blocks[0], "fp8_tensor", skip=())
    _fully_shard(model.blocks[0])
    _fully_shard(model)
    fp8_all_gather(model.blocks[0])
    try:
        model(torch.randn(4, 64).bfloat16())
        res["not_root"] = None
    except RuntimeError as e:
        res["not_root"] = str(e)
    if rank == 0:
        torch.save(res, Path(out_dir) / "fp8_all_gather.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_worker, WORLD, Path(tmp), (tmp,), [__name__])
        return torch.load(Path(tmp) / "fp8_all_gather.pt", weights_only=False)


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


@pytest.mark.parametrize("recipe", ["fp8_tensor", "fp8_delayed"])
def test_fsdp2_fp8_gathers_train_bit_for_bit_as_bf16_gathers(ranks, recipe):
    off, on = ranks[recipe, False], ranks[recipe, True]
    assert on["names"] == [f"blocks.{b}.{n}" for b in range(3) for n in ("up", "down")]  # not int4's block
    assert set(on["seen"]) == {"GatheredFp8Weight"} and set(off["seen"]) == {"Parameter"}
    assert _same(off, on)
    assert off["freed"] and on["freed"]
    assert "do not pickle" in on["pickled"]


def test_fp32_masters_under_a_bf16_policy(ranks):
    """The shards are rounded to bf16 before their absmax and cast, as FSDP2's bf16 gather rounds them."""
    off, on = ranks["fp32_masters", False], ranks["fp32_masters", True]
    assert set(on["seen"]) == {"GatheredFp8Weight"}
    assert _same(off, on)


def test_casts_one_shard_at_a_time_as_together_and_hooks_set_again(ranks):
    assert set(ranks["one_at_a_time"]["seen"]) == {"GatheredFp8Weight"}
    assert _same(ranks["one_at_a_time"], ranks["fp32_masters", False])


def test_refused_while_a_unit_is_gathered_twice_and_off_the_root(ranks):
    not_unit, first, applied, again = ranks["refused"]
    assert "not an FSDP2 unit" in not_unit and "resharded" in first and applied is None and "already" in again
    assert "not the root" in ranks["not_root"]
