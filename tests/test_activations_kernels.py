"""The Triton pack/unpack kernels compute the pure-torch reference's bits (CPU, TRITON_INTERPRET=1).

conftest.py switches Triton to its interpreter on machines without CUDA, before any kernel is defined; on a GPU
machine the CPU-tensor tests here are skipped and test_gpu_kernels_match_reference runs the compiled kernels.
"""
from __future__ import annotations

import pytest
import torch

from lpoptim.quant import quantize

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def K():
    if torch.cuda.is_available():
        pytest.skip("interpreter test: the compiled kernels are checked by test_gpu_kernels_match_reference")
    from lpoptim.kernels import act_quant

    return act_quant


def _hard_input(shape, dtype, seed=0):
    """Wide dynamic range, ties and binade carries (127.9 -> 128), zeros, -0, inf, NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    x[0, :6] = torch.tensor([127.9, 447.9, -1e-7, 0.0, -0.0, 15.5])
    x[1, 3] = float("inf")
    x[1, 5] = float("nan")
    x[2, 7] = -float("nan")
    x[3] = 0.0
    return x.to(dtype)


def _same(a, b):
    """Equal values, NaN where NaN, signed zeros alike."""
    return (torch.equal(a.isnan(), b.isnan())
            and torch.equal(torch.signbit(a) & ~a.isnan(), torch.signbit(b) & ~b.isnan())
            and torch.equal(a.float().nan_to_num(0.0), b.float().nan_to_num(0.0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [37, 48, 130])
@pytest.mark.parametrize("group_size", [16, 32])
def test_group_kernels_match_reference(K, dtype, n, group_size):
    x = _hard_input((5, n), dtype)
    codes, scales = K.quantize_groups(x, group_size)
    ref = quantize(x, "e4m3", "group", group_size, to_dtype=True)
    assert torch.equal(codes, ref.values.view(torch.uint8))
    assert torch.equal(scales, ref.scale)
    out = K.dequantize(codes, scales, "group", group_size, dtype)
    assert out.dtype == dtype
    assert _same(out, ref.dequantize().to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [37, 64, 2500])  # 2500 > one block: the row loops run twice
def test_row_kernels_match_reference(K, dtype, n):
    x = _hard_input((4, n), dtype, seed=n)
    codes, scales = K.quantize_rows(x)
    ref = quantize(x, "e4m3", "row", to_dtype=True)
    assert torch.equal(codes, ref.values.view(torch.uint8))
    assert torch.equal(scales, ref.scale.flatten())
    assert _same(K.dequantize(codes, scales, "row", 16, dtype), ref.dequantize().to(dtype))


def test_tensor_scale_matches_reference(K):
    x = torch.randn(6, 50, dtype=torch.bfloat16) * 30
    ref = quantize(x, "e4m3", "tensor", to_dtype=True)
    codes, scales = K.quantize_rows(x, ref.scale)
    assert torch.equal(codes, ref.values.view(torch.uint8))
    assert _same(K.dequantize(codes, scales, "tensor", 16, torch.bfloat16), ref.dequantize().bfloat16())


def test_rounding_carries_into_next_binade(K):
    """127.9 rounds to 128 (the interpreter's own fp8 cast gives 64): scale 1 so the value is quantized as is."""
    x = torch.tensor([[127.9, 448.0, 3.0, -0.0]])
    codes, scales = K.quantize_rows(x, torch.tensor([1.0]))
    assert codes.view(torch.float8_e4m3fn).float().tolist() == [[128.0, 448.0, 3.0, -0.0]]
    assert codes[0, 3].item() == 0x80  # -0 keeps its sign bit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernels_match_reference():
    from lpoptim.kernels import act_quant

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _hard_input((64, 4096 + 16), dtype).cuda()
        for gran in ("group", "row"):
            ref = quantize(x, "e4m3", gran, 16, to_dtype=True)
            if gran == "group":
                codes, scales = act_quant.quantize_groups(x, 16)
                want = ref.scale
            else:
                codes, scales = act_quant.quantize_rows(x)
                want = ref.scale.flatten()
            bad = (scales != want).nonzero()
            assert len(bad) == 0, (f"{dtype} {gran}: {len(bad)} scales differ, e.g. at {bad[:3].tolist()}: "
                                   f"{scales[tuple(bad[0])].item()!r} vs {want[tuple(bad[0])].item()!r}")
            bad = (codes != ref.values.view(torch.uint8)).nonzero()
            assert len(bad) == 0, (f"{dtype} {gran}: {len(bad)} codes differ, e.g. at {bad[:3].tolist()}: "
                                   f"x={x[tuple(bad[0])].item()!r} {codes[tuple(bad[0])].item()} vs "
                                   f"{ref.values.view(torch.uint8)[tuple(bad[0])].item()}")
            assert _same(act_quant.dequantize(codes, scales, gran, 16, dtype), ref.dequantize().to(dtype))


def test_codec_kernel_path_matches_reference_path(K, monkeypatch):
    """The glue in activations/codec.py (scale shapes, fp8 views, strides) gives the same tensors either way."""
    import sys

    from lpoptim.activations import codec

    x = _hard_input((6, 40), torch.bfloat16).nan_to_num(0.0, 1e4, -1e4)
    xt = torch.randn(40, 6).t()
    refs = {(g, i): codec.pack(t, g, 16) for g in ("group", "row", "tensor") for i, t in enumerate((x, xt))}
    monkeypatch.setitem(sys.modules, "lpoptim.kernels.act_quant", K)
    monkeypatch.setattr("lpoptim.kernels.act_quant", K, raising=False)
    monkeypatch.setattr(codec, "_use_triton", lambda t, fmt: fmt.dtype is torch.float8_e4m3fn)  # "on CUDA"
    for (g, i), ref in refs.items():
        got = codec.pack((x, xt)[i], g, 16)
        assert torch.equal(got.codes.view(torch.uint8), ref.codes.view(torch.uint8)), g
        assert torch.equal(got.scale, ref.scale), g
        assert got.nbytes == ref.nbytes
        assert torch.equal(got.unpack(), ref.unpack()) and got.unpack().stride() == ref.unpack().stride()
    # other formats take the reference both ways (the kernels are E4M3's): packed and unpacked alike
    from lpoptim.formats import E5M2

    ref5 = codec.quantize(x, E5M2, "group", 16).dequantize().to(x.dtype)
    assert torch.equal(codec.pack(x, "group", 16, E5M2).unpack(), ref5)


def test_codec_power_of_two_groups_kernel_path_matches_reference_path(K, monkeypatch):
    """Groups that tile the rows (one-byte power-of-two scales): the kernels (interpreter) against the torch
    reference through codec.pack, for a contiguous tensor with inf/NaN/ties and for attention's transposed q/k/v
    layout (packed in memory order); codes, exponent bytes, bytes and the decoded tensor alike."""
    from lpoptim.activations import codec

    x = _hard_input((6, 64), torch.bfloat16)
    q = torch.randn(2, 24, 3, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).transpose(1, 2)
    refs = [codec.pack(t, "group", 16) for t in (x, q)]
    assert all(r.scale.dtype == torch.uint8 for r in refs) and refs[1].storage_order
    decoded = [r.decode() for r in refs]  # the reference's decoding, before the kernels are switched on
    monkeypatch.setattr(codec, "_use_triton", lambda t, fmt: fmt.dtype is torch.float8_e4m3fn)  # "on CUDA"
    for t, ref, b in zip((x, q), refs, decoded):
        got = codec.pack(t, "group", 16)
        nan = (ref.codes.view(torch.uint8) & 0x7F) == 0x7F  # E4M3 NaN: its sign bit is not a value
        g8 = got.codes.view(torch.uint8)
        assert torch.equal((g8 & 0x7F) == 0x7F, nan) and torch.equal(g8[~nan], ref.codes.view(torch.uint8)[~nan])
        assert torch.equal(got.scale, ref.scale) and got.nbytes == ref.nbytes
        a = got.unpack()
        assert a.stride() == b.stride() == t.stride()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])
    assert decoded[0][1, 3] == 448 * 2.0 ** (refs[0].scale[1, 0].item() - 127)  # inf saturates
