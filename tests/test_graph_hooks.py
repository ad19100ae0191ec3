"""Packing inside compiled graphs (lpoptim/activations/graph_hooks.py): the rules read off the graphs, the
power-of-two group scales against their reference, the Triton kernel against the torch ops (interpreter on the
CPU, compiled on a GPU), and gradients of compiled wrapped blocks against the unwrapped block."""
from __future__ import annotations

import pytest
import torch

from benchmarks.activations import make_block
from lpoptim.activations import compress_activations
from lpoptim.activations.graph_hooks import pack_in_graph, unpack_in_graph
from lpoptim.activations.policy import ActivationPolicy
from lpoptim.formats import E4M3, round_to_grid
from lpoptim.quant import finite_absmax, pow2_block_exponent, to_groups
from block_grads import _grads, _min_cos


def _pow2(e):
    return torch.ldexp(torch.ones(e.shape), e.float())


def test_pow2_exponent_is_the_smallest_that_fits():
    """quant.pow2_block_exponent (integer ops on amax's bits) against its definition computed in float64: the
    smallest e in [emin, emax] with amax / 2^e <= fmax (emin for zero and for amax / fmax below 2^-126)."""
    g = torch.Generator().manual_seed(0)
    a = torch.rand(100_000, generator=g) * 10.0 ** torch.randint(-40, 38, (100_000,), generator=g).float()
    a = torch.cat([a, torch.tensor([0.0, 448.0, 448.00003, 224.0, 1e-45, 3e38, 448 * 2.0**-126])])
    for fmax in (448.0, 57344.0, 6.0):
        mant, ex = torch.frexp(a.double() / fmax)  # exact enough: a float64 quotient of fp32 numbers
        ref = torch.where(mant > 0.5, ex, ex - 1).clamp(-126, 126)
        ref = torch.where(a > 0, ref, torch.full_like(ref, -126))
        assert torch.equal(pow2_block_exponent(a, fmax, -126, 126), ref.int())
    e = pow2_block_exponent(a, 448.0, -126, 126)
    assert (a / _pow2(e) <= 448.0).all()  # the scale never overflows the format
    assert (e[a / 448.0 < 2.0**-126] == -126).all()


def _hard(shape, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-5, 5, (shape[0], 1), generator=g).float()
    x[0, :16] = 0.0
    x[1, 3], x[2, 5], x[2, 6] = float("nan"), float("inf"), -float("inf")
    x[3, :16] = 1e-42  # an fp32 subnormal group
    x[4, :4] = torch.tensor([447.9, 448.0, -0.0, 127.9])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_kernel_matches_reference(dtype):
    """kernels/act_quant.quantize_groups_pow2 (interpreter here, compiled on a GPU) gives the torch ops' bits."""
    pytest.importorskip("triton")
    from lpoptim.kernels.act_quant import quantize_groups_pow2

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = _hard((40, 64), dtype).to(dev)
    codes, exps = quantize_groups_pow2(x, 16)
    g = to_groups(x.float().cpu(), 16)
    amax = finite_absmax(g, dim=-1)
    e = torch.where(amax > 0, pow2_block_exponent(amax, 448.0, -126, 126), 0)  # nothing finite: scale 1
    ref = round_to_grid(g * _pow2(-e).unsqueeze(-1), E4M3).to(torch.float8_e4m3fn)
    assert torch.equal(exps.cpu().int() - 127, e)
    assert e[0, 0] == 0  # the zero group: scale 1
    assert e[3, 0] == (-126 if dtype == torch.float32 else 0)  # fp32 subnormals: the clamp; in bf16 they are 0
    got, want = codes.cpu().view(torch.uint8), ref.reshape(x.shape).view(torch.uint8)
    nan = (want & 0x7F) == 0x7F  # E4M3's NaN is 0x7F or 0xFF: its sign is not a value (bf16's NaN sign differs)
    assert torch.equal((got & 0x7F) == 0x7F, nan) and torch.equal(got[~nan], want[~nan])
    with pytest.raises(ValueError, match="group"):
        quantize_groups_pow2(x[:, :40], 16)  # not a multiple of the group
    from lpoptim.kernels.act_quant import dequantize_groups_pow2
    for out_dtype in (torch.float32, torch.bfloat16):  # the decoding kernel: unpack_in_graph's torch ops, bit for bit
        want = unpack_in_graph((codes.cpu(), exps.cpu(), "group", out_dtype, None))
        got = dequantize_groups_pow2(codes, exps, out_dtype).cpu()
        assert got.dtype == out_dtype and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def _info(kind_reader):
    """A saved node and a backward graph in which ``kind_reader`` reads it."""
    fw = torch.fx.Graph()
    fw.placeholder("a")
    node = fw.call_function(torch.ops.aten.relu.default, (fw.find_nodes(op="placeholder")[0],))
    node.name = "saved"
    bw = torch.fx.Graph()
    ph = bw.placeholder("saved")
    bw.call_function(kind_reader, (bw.call_function(torch.ops.aten.t.default, (ph,)), ph))
    return {"_fw_graph": fw, "_bw_graph": bw, "_node": node}


@pytest.mark.parametrize("reader,gran", [(torch.ops.aten.mm.default, "row"), (torch.ops.aten.mul.Tensor, "group"),
                                         (torch.ops.aten.mm.default, "tensor")])
def test_pack_in_graph_round_trip(reader, gran):
    """GEMM readers get a scale per row, others per group of 16 (one-byte powers of two); both decode within
    E4M3's half-ulp of the input, and the record counts codes and scales."""
    x = torch.randn(64, 48) * torch.logspace(-3, 3, 48)
    records = {}
    policy = ActivationPolicy(min_numel=16, gemm_granularity="tensor" if gran == "tensor" else "row")
    packed = pack_in_graph(x, _info(reader), policy, records)
    assert isinstance(packed, tuple) and packed[2] == gran
    assert packed[0].dtype == torch.float8_e4m3fn
    y = unpack_in_graph(packed)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert packed[1].dtype == torch.uint8  # one-byte power-of-two scales, per row or per group
    scale = _pow2(packed[1].int() - 127)
    spacing = (scale.repeat_interleave(16, -1) if gran == "group" else scale) * 2.0**-9  # E4M3's subnormal step
    assert ((y - x).abs() <= torch.maximum(x.abs() * 2.0**-4, spacing) * 1.0001).all()
    (rec,) = records.values()
    assert rec.kind == f"fp8_{gran}" and rec.original == x.numel() * 4
    assert rec.stored == x.numel() + {"row": 64, "group": 64 * 3, "tensor": 1}[gran]


@pytest.mark.parametrize("reader", [torch.ops.aten.mm.default, torch.ops.aten.mul.Tensor])
def test_pack_in_graph_restores_a_permuted_layout(reader):
    """A saved tensor laid out as a permutation of contiguous memory (attention's q, k, v and out) comes back with
    its strides (a compiled backward reinterprets saved buffers by them), packed in memory order: the same codes
    as the contiguous copy's rows; a layout that is no permutation (a strided slice) is kept."""
    base = torch.randn(2, 16, 4, 32)  # (b, t, h, d) in memory
    x = base.transpose(1, 2)  # (b, h, t, d) with t and h swapped in memory
    policy = ActivationPolicy(min_numel=16)
    packed = pack_in_graph(x, _info(reader), policy, None)
    y = unpack_in_graph(packed)
    assert y.shape == x.shape and y.stride() == x.stride()
    direct = unpack_in_graph(pack_in_graph(base, _info(reader), policy, None))
    assert torch.equal(y, direct.transpose(1, 2))
    sliced = torch.randn(64, 96)[:, ::2]
    assert pack_in_graph(sliced, _info(reader), policy, None) is sliced


def test_pack_in_graph_keeps_what_it_should():
    policy = ActivationPolicy(min_numel=4096)
    assert pack_in_graph(torch.randn(8, 16), _info(torch.ops.aten.mul.Tensor), policy, None).shape == (8, 16)  # small
    codes = torch.randn(128, 64).to(torch.float8_e4m3fn)
    assert pack_in_graph(codes, _info(torch.ops.aten.mm.default), policy, None) is codes  # already low-bit
    attn = torch.randn(128, 64)
    info = _info(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert pack_in_graph(attn, info, policy, None) is attn  # attention="keep"
    assert isinstance(pack_in_graph(attn, info, ActivationPolicy(attention="fp8"), None), tuple)


@pytest.mark.parametrize("attention", ["keep", "fp8"])
def test_compiled_llama_block_packs_in_graph(attention):
    """A compiled Llama block under the wrapper: GEMM inputs per row, SwiGLU's gate and up in groups of 16,
    attention as asked, gradients within the required bound of the unwrapped block."""
    torch._dynamo.reset()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block, extra = make_block("plain", 128, 352, 4, 64, dev, torch.float32)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(2, 64, 128, device=dev, generator=g)
    ref = _grads(block, x, extra)
    run = torch.compile(block)
    handle = compress_activations(run, attention=attention)
    got = _grads(run, x, extra, params_of=block)
    kinds = handle.graph_stats().summary()
    cos = _min_cos(ref, got)
    assert cos >= (0.999 if attention == "keep" else 0.995), (cos, kinds)  # q, k, v in FP8 cost a little more
    assert kinds["fp8_group"]["count"] >= 2 and kinds["fp8_row"]["count"] >= 2
    assert ("attention" in kinds) == (attention == "keep"), kinds
    by_shape = {(r.kind, r.shape) for r in handle.graph_stats().records}
    assert ("fp8_group", (128, 352)) in by_shape  # gate and up, read by SiLU's backward
    handle.remove()
    torch._dynamo.reset()


def test_compile_option_packs_the_same_without_a_graph_break():
    """compress_activations(..., compile=True): the wrapper calls each block's compiled forward. Its graphs pack
    what a block compiled and then wrapped packs, with the same gradients, and the blocks (two of one class)
    share one graph with no graph break (wrapping a compiled block breaks the graph at the wrapper)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    blocks = [make_block("plain", 128, 352, 4, 64, "cpu", torch.float32) for _ in range(2)]
    extra = blocks[0][1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 128, generator=g)
    # the established path: each block compiled, then wrapped
    runs = [torch.compile(b) for b, _ in blocks]
    handle = compress_activations(runs)
    want = [_grads(r, x, extra, params_of=b) for r, (b, _) in zip(runs, blocks)]
    want_kinds = handle.graph_stats().summary()
    handle.remove()
    torch._dynamo.reset()
    counters.clear()
    handle = compress_activations([b for b, _ in blocks], compile=True)
    got = [_grads(b, x, extra) for b, _ in blocks]
    assert handle.graph_stats().summary() == want_kinds
    for w, gr in zip(want, got):
        torch.testing.assert_close(gr, w, rtol=0, atol=0)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    handle.remove()
    assert not any(isinstance(getattr(b, "forward", None), torch.nn.Module) for b, _ in blocks)
    torch._dynamo.reset()


def test_compile_option_takes_torch_compile_arguments(monkeypatch):
    """compile={...}: the wrapper's torch.compile gets these keyword arguments (how prepare asks for CUDA graphs:
    {"mode": "reduce-overhead"}); anything but a bool or a dict is refused before any block is wrapped."""
    seen = []
    real = torch.compile

    def spy(fn, **kw):
        seen.append(kw)
        return real(fn, backend="eager")

    monkeypatch.setattr(torch, "compile", spy)
    blocks = [make_block("plain", 64, 176, 4, 32, "cpu", torch.float32)[0] for _ in range(2)]
    handle = compress_activations(blocks, compile={"mode": "reduce-overhead"})
    assert seen == [{"mode": "reduce-overhead"}] * 2
    handle.remove()
    handle = compress_activations(blocks, compile=True)
    assert seen[2:] == [{}] * 2
    handle.remove()
    with pytest.raises(TypeError, match="dict of torch.compile arguments"):
        compress_activations(blocks, compile="reduce-overhead")
    with pytest.raises(ValueError, match="outside the CUDA graphs"):
        compress_activations(blocks, compile={"mode": "reduce-overhead"}, recompute=True)
    assert not any("forward" in vars(b) for b in blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["keep", "fp8"])
def test_compiled_block_bf16_on_gpu(attention):
    """The GPU path (the Triton group kernel inside the compiled graph), bf16, against the unwrapped block, with
    attention's saved tensors (cuDNN / flash layouts, permuted) kept or packed as asked and attention's output
    packed as the o-projection's input."""
    torch._dynamo.reset()
    block, extra = make_block("plain", 256, 688, 4, 128, "cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = _grads(block, x, extra)
    run = torch.compile(block)
    handle = compress_activations(run, attention=attention)
    got = _grads(run, x, extra, params_of=block)
    assert _min_cos(ref, got) >= (0.999 if attention == "keep" else 0.995)
    assert handle.graph_stats().summary()["fp8_group"]["count"] >= 2
    handle.remove()
    torch._dynamo.reset()


def _small_llama(dev="cpu"):
    block, extra = make_block("plain", 64, 176, 4, 32, dev, torch.float32)
    return block, extra


def test_handles_with_different_policies_get_graphs_of_their_own():
    """Dynamo guards on the hooks' identity: a second handle's policy is honoured and recorded in that handle."""
    import copy

    torch._dynamo.reset()
    b1, extra = _small_llama()
    b2 = copy.deepcopy(b1)
    x = torch.randn(2, 32, 64)
    h1 = compress_activations(b1)
    h2 = compress_activations(b2, min_numel=10**9)  # keeps everything
    r1, r2 = torch.compile(b1), torch.compile(b2)
    for r in (r1, r2):
        r(x, **extra).sum().backward()
    assert h1.graph_stats().summary().get("fp8_group", {}).get("count", 0) > 0
    kinds2 = h2.graph_stats().bytes_by_kind()
    assert kinds2 and not any(k.startswith("fp8") for k in kinds2)
    ref = _grads(b2, x, extra)
    h2.remove()
    got = _grads(r2, x, extra, params_of=b2)  # unwrapped: compiled again, without packing
    assert _min_cos(ref, got) > 0.99999
    h1.remove()
    torch._dynamo.reset()


def test_dynamic_shapes_pack_every_size():
    """A size known only as a symbol is packed: the dynamic graph Dynamo compiles when the length changes (here
    to one whose tensors are under min_numel) serves every length, so its hint must not decide."""
    torch._dynamo.reset()
    block, _ = _small_llama()
    h = compress_activations(block)
    run = torch.compile(block)
    counts = []
    for t in (32, 8, 32):
        _, extra = make_block("plain", 64, 176, 4, t, "cpu", torch.float32)
        run(torch.randn(2, t, 64), **extra).sum().backward()
        counts.append(h.graph_stats().summary().get("fp8_group", {}).get("count", 0))
    assert counts[0] > 0 and counts[1] == 2 * counts[0] and counts[2] == counts[1]  # the second graph packs as much
    h.remove()
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_stays_inside_the_dtype(dtype):
    """A power-of-two scale can round a group's largest value past the dtype's maximum: decoded, it is clamped."""
    top = torch.finfo(dtype).max
    x = torch.full((4, 16), top, dtype=dtype)
    x[1] = -top
    x[2, 0] = torch.finfo(dtype).max * 0.98
    packed = pack_in_graph(x, _info(torch.ops.aten.mul.Tensor), ActivationPolicy(min_numel=16), None)
    y = unpack_in_graph(packed)
    assert torch.isfinite(y).all() and (y[0] == top).all() and (y[1] == -top).all()
    pytest.importorskip("triton")
    from lpoptim.kernels.act_quant import dequantize_groups_pow2

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.equal(dequantize_groups_pow2(packed[0].to(dev), packed[1].to(dev), dtype).cpu(), y)


def test_context_stack_clean_after_a_refused_enter():
    """Under torch.func transforms saved-tensor hooks refuse to be entered: the wrapped call raises as before and
    leaves no context behind."""
    from lpoptim.activations import graph_hooks

    block, extra = _small_llama()
    h = compress_activations(block)
    x = torch.randn(2, 32, 64)
    with pytest.raises(Exception):
        torch.func.grad(lambda v: block(v, **extra).sum())(x)
    assert graph_hooks.current() is None
    h.remove()
