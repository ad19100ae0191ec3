"""The fused operand quantizer (Triton) against the pure-torch reference, on CPU with TRITON_INTERPRET=1."""

import pytest
import torch

# conftest.py sets TRITON_INTERPRET=1 on machines without CUDA before anything is imported. On a GPU machine
# these CPU-tensor tests are skipped (the compiled kernels are tested in test_linear_gpu.py): setting the
# variable here would leave interpreted kernels behind for every later test.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; see test_linear_gpu.py")
import lpoptim.kernels.linear_quant as lq  # noqa: E402

from lpoptim.nn.operands import quantize_operand_ref  # noqa: E402

FORMATS = ["e4m3", "e5m2", "e2m1", "int4_sym"]


def _x(r, c, transposed, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((c, r) if transposed else (r, c), generator=g) * 3
    x = x.t() if transposed else x
    x[1, 2] = 150.0  # an outlier sets one row's scale
    x[4] = 0.0  # an all-zero row gets scale 1
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gran,had", [("row", None), ("tensor", None), ("row", 32)])
@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_matches_reference_bitwise(fmt, gran, had, transposed):
    x = _x(37, 70, transposed)
    cols = 96  # padded: a multiple of 16 and of the Hadamard block
    v, s = lq.quantize_rows(x, fmt, gran, had, cols)
    ref = quantize_operand_ref(x, fmt, gran, had, cols)
    assert v.dtype == ref.values.dtype and v.shape == (37, 96) and v.is_contiguous()
    assert torch.equal(v.float(), ref.values.float())
    assert torch.equal(s, ref.scale)
    assert (v.float()[:, 70:] == 0).all() or had  # padding quantizes to zero (mixed in by the Hadamard)


@pytest.mark.parametrize("had", [None, 64])
def test_kernel_bf16_input(had):
    x = _x(20, 128, True, torch.bfloat16, seed=1)
    v, s = lq.quantize_rows(x, "int4_sym", "row", had, 128)
    ref = quantize_operand_ref(x, "int4_sym", "row", had, 128)
    assert torch.equal(v.float(), ref.values.float()) and torch.equal(s, ref.scale)


def test_kernel_ignores_nonfinite_in_scale():
    x = _x(16, 32, False)
    x[0, 0], x[2, 3] = float("inf"), float("nan")
    v, s = lq.quantize_rows(x, "e4m3", "row", None, 32)
    ref = quantize_operand_ref(x, "e4m3", "row", None, 32)
    assert torch.equal(s, ref.scale)
    assert torch.isfinite(s).all()
    assert v.float()[0, 0] == 448.0  # inf saturates
    assert torch.equal(v.float()[3:], ref.values.float()[3:])


def test_kernel_rejects_bad_padding():
    with pytest.raises(ValueError, match="Hadamard block"):
        lq.quantize_rows(_x(8, 40, False), "int4_sym", "row", 32, 48)


@pytest.mark.parametrize("row_fmt,col_fmt", [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_and_cols_together_match_two_references(row_fmt, col_fmt, dtype):
    """One row pass leaves the column maxima (atomics), one column pass uses them: the same bits as quantizing
    x and x.t() on their own, non-finite values, zero rows and columns and padding included."""
    x = _x(600, 37, False, dtype)  # 600 tokens: the column pass splits them over two programs
    x[:, 5] = 0.0  # an all-zero column gets scale 1
    x[9, 11], x[20, 3] = float("inf"), float("nan")  # set no scale; saturate / stay NaN
    (rv, rs), (cv, cs) = lq.quantize_rows_and_cols(x, lq.get_format(row_fmt), lq.get_format(col_fmt), 48, 608)
    for (v, s), ref in (((rv, rs), quantize_operand_ref(x, row_fmt, "row", None, 48)),
                        ((cv, cs), quantize_operand_ref(x.t(), col_fmt, "row", None, 608))):
        assert v.dtype == ref.values.dtype and v.shape == ref.values.shape and v.is_contiguous()
        assert torch.equal(v.float().nan_to_num(7.0), ref.values.float().nan_to_num(7.0))
        assert torch.equal(s, ref.scale)
    assert cv.shape == (37, 608) and (cv.float()[:, 600:] == 0).all()


def test_operand_and_transpose_falls_back_to_the_reference_on_cpu():
    from lpoptim.nn.operands import QuantSpec, quantize_pair

    x = _x(20, 33, False)
    a, b = quantize_pair(x, QuantSpec("e4m3"), QuantSpec("e5m2"))
    ra, rb = quantize_operand_ref(x, "e4m3", "row", None, 48), quantize_operand_ref(x.t(), "e5m2", "row", None, 32)
    assert torch.equal(a.values.float(), ra.values.float()) and torch.equal(b.values.float(), rb.values.float())
    assert torch.equal(a.scale, ra.scale) and torch.equal(b.scale, rb.scale)


def test_rows_and_cols_with_no_tokens_still_write_column_scales():
    """An input with zero rows (an MoE expert that got no tokens): the column pass has zero columns to write but
    must still set its scales (1, as for an all-zero row), not leave the empty allocation's garbage to dW."""
    x = torch.zeros(0, 37)
    (rv, rs), (cv, cs) = lq.quantize_rows_and_cols(x, lq.get_format("e4m3"), lq.get_format("e4m3"), 48, 0)
    assert rv.shape == (0, 48) and cv.shape == (37, 0)
    assert torch.equal(cs, torch.ones(37, 1))


@pytest.mark.parametrize("transposed", [False, True])
def test_finite_absmax_kernel_matches_torch(transposed):
    x = _x(37, 70, transposed)
    x[3, 4], x[5, 6], x[7, 8] = float("inf"), float("nan"), -float("inf")
    assert torch.equal(lq.finite_absmax(x), torch.tensor(150.0))  # _x's outlier; non-finite values set nothing
    assert lq.finite_absmax(torch.zeros(0, 5)).item() == 0.0


@pytest.mark.parametrize("row_fmt,col_fmt", [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", "e5m2"),
                                             ("e2m1", "int4_sym"), ("e4m3", None), (None, "e5m2")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_per_tensor_rows_and_cols_match_the_references(row_fmt, col_fmt, dtype, transposed):
    """One per-tensor pass writes x and xᵀ (each padded with zeros, each with its own format's scale) with the
    bits of quantizing x and x.t() on their own; non-finite values set no scale; any strides."""
    x = _x(150, 37, transposed, dtype)  # 150 tokens: row tiles of 32 (of 128 for the transposed copy alone), the last partial
    x[9, 11], x[20, 3] = float("inf"), float("nan")
    rows, cols = lq.quantize_tensor_rows_cols(x, row_fmt, col_fmt, 48 if row_fmt else None, 160 if col_fmt else None)
    assert (rows is None) == (row_fmt is None) and (cols is None) == (col_fmt is None)
    for out, src, fmt, width in ((rows, x, row_fmt, 48), (cols, x.t(), col_fmt, 160)):
        if fmt is None:
            continue
        ref = quantize_operand_ref(src, fmt, "tensor", None, width)
        v, s = out
        assert v.dtype == ref.values.dtype and v.shape == ref.values.shape and v.is_contiguous()
        assert torch.equal(v.float().nan_to_num(7.0), ref.values.float().nan_to_num(7.0))
        assert torch.equal(s, ref.scale) and s.shape == ()
    if cols is not None:
        assert (cols[0].float()[:, 150:] == 0).all()  # padded tokens are zeros
    if row_fmt is not None and row_fmt == col_fmt:  # one scale: one tensor for both copies (one allocation less)
        assert rows[1] is cols[1]


def test_per_tensor_quantize_rows_is_the_rows_half():
    x = _x(40, 33, True)
    v, s = lq.quantize_rows(x, "e5m2", "tensor", None, 48)
    ref = quantize_operand_ref(x, "e5m2", "tensor", None, 48)
    assert torch.equal(v.float(), ref.values.float()) and torch.equal(s, ref.scale)


def test_per_tensor_with_nothing_to_read_sets_scale_one():
    rows, cols = lq.quantize_tensor_rows_cols(torch.zeros(0, 37), "e4m3", "e5m2", 48, 0)
    assert rows[0].shape == (0, 48) and cols[0].shape == (37, 0)
    assert rows[1].item() == 1.0 and cols[1].item() == 1.0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_pair_reference_rounds_once_with_the_same_bits(fmt):
    """The reference path (CPU, and what torch.compile traces) of x and xᵀ per tensor in one format takes xᵀ's
    codes from x's: the same bits as quantizing x.t() on its own."""
    from lpoptim.nn.operands import QuantSpec, quantize_pair

    x = _x(37, 50, False)
    x[3, 4], x[5, 6] = float("inf"), float("nan")
    a, b = quantize_pair(x, QuantSpec(fmt, "tensor"), QuantSpec(fmt, "tensor"))
    for op, ref in ((a, quantize_operand_ref(x, fmt, "tensor", None, 64)),
                    (b, quantize_operand_ref(x.t(), fmt, "tensor", None, 48))):
        assert op.values.shape == ref.values.shape and op.values.is_contiguous()
        assert torch.equal(op.values.float().nan_to_num(7.0), ref.values.float().nan_to_num(7.0))
        assert torch.equal(op.scale, ref.scale)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("transposed", [False, True])
def test_row_pass_leaves_the_tensor_absmax(fmt, transposed):
    """tensor_max: the row kernel's first pass also leaves x's finite absmax (what a per-tensor copy of x needs),
    ignoring inf and NaN; the codes are the same as without it."""
    x = _x(37, 70, transposed)
    x[5, 6], x[7, 8] = float("inf"), float("nan")
    bits = torch.zeros((), dtype=torch.int32)
    v, s = lq.quantize_rows(x, fmt, "row", None, 96, tensor_max=bits)
    assert bits.view(torch.float32) == 150.0  # the outlier _x plants
    v0, s0 = lq.quantize_rows(x, fmt, "row", None, 96)
    assert torch.equal(v.view(torch.uint8), v0.view(torch.uint8)) and torch.equal(s, s0)  # bits: NaN codes too
    for bad in (dict(granularity="tensor"), dict(hadamard_block=32)):
        with pytest.raises(ValueError, match="tensor_max"):
            lq.quantize_rows(x, **{"fmt": fmt, "granularity": "row", "hadamard_block": None, "cols": 96, **bad},
                             tensor_max=bits)


@pytest.mark.parametrize("case", ["fp32", "bf16", "view", "nonfinite", "no_tokens"])
def test_fp4_saves_the_same_operands_with_the_fused_maxima(monkeypatch, case):
    """fp4's forward, with x's and W's absmax taken in its row passes (the kernels forced on, run by the
    interpreter), saves the xᵀ operand and W's statistic that the separate passes give, and the same y."""
    from lpoptim.nn import functional, operands
    from lpoptim.nn.functional import FUNCTIONS, _quantize_wt, _save_x_for_dw
    from lpoptim.nn.recipes import get_recipe

    r = get_recipe("fp4")
    x, w = _x(40, 64, False), _x(32, 64, True, seed=2)
    if case == "bf16":
        x = x.to(torch.bfloat16)
    elif case == "view":
        x = _x(40, 128, False)[:, 32:96]  # rows of a wider tensor: strided
    elif case == "nonfinite":
        x[3, 5], x[6, 7], w[2, 2] = float("nan"), float("-inf"), float("inf")
    elif case == "no_tokens":
        x = x[:0]
    fn = FUNCTIONS[r.fwd_fmt]
    ref_y, ref_xt, ref_wt = fn.forward_gemm(x, w, r, torch.float32), _save_x_for_dw(x, r), _quantize_wt(w, r, None)
    for module in (functional, operands):
        monkeypatch.setattr(module, "use_kernels", lambda t: True)
    y, xt, w_stat = fn.forward_gemm_and_xt(x, w, r, torch.float32)
    wt = _quantize_wt(w, r, w_stat)
    for got, want in ((xt, ref_xt), (wt, ref_wt)):
        assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
    assert torch.equal(y.nan_to_num(7.0), ref_y.nan_to_num(7.0))


def _launched(monkeypatch) -> list:
    """The kernels linear_quant launches from now on (its launcher, spied on)."""
    used, real = [], lq.launcher
    monkeypatch.setattr(lq, "launcher", lambda kernel: (used.append(kernel), real(kernel))[1])
    return used


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "int4_sym"])
@pytest.mark.parametrize("shape", [(37, 70), (5, 300), (50, 1000)])
def test_whole_rows_kernel_matches_the_two_pass_kernel(monkeypatch, fmt, shape):
    """Rows read once and held whole (_quant_whole_rows_kernel) give the two-pass kernel's codes, scales and
    tensor maximum, for widths that are not powers of two (padded)."""
    x = _x(*shape, False)
    cols = -(-shape[1] // 16) * 16
    bits = [torch.zeros((), dtype=torch.int32) for _ in range(2)]
    used = _launched(monkeypatch)
    whole = lq.quantize_rows(x, fmt, "row", None, cols, tensor_max=bits[0])
    assert used == [lq._quant_whole_rows_kernel]
    monkeypatch.setattr(lq, "TUNING", {**lq.TUNING, "whole_rows": {**lq.TUNING["whole_rows"], "enabled": False}})  # TUNING is read-only
    two = lq.quantize_rows(x, fmt, "row", None, cols, tensor_max=bits[1])
    assert used[1:] == [lq._quant_rows_kernel]
    assert torch.equal(whole[0].view(torch.uint8), two[0].view(torch.uint8)) and torch.equal(whole[1], two[1])
    assert torch.equal(bits[0], bits[1]) and bits[0].view(torch.float32) == 150.0  # the planted outlier


def test_hadamard_rows_keep_the_two_pass_kernel(monkeypatch):
    """With a block Hadamard the rows take the two-pass kernel (a one-read version was no faster, and removed)."""
    used = _launched(monkeypatch)
    lq.quantize_rows(_x(8, 64, False), "int4_sym", "row", 32, 64)
    assert used == [lq._quant_rows_kernel]


def test_whole_rows_kernel_on_row_strided_bf16_views(monkeypatch):
    """A view whose rows are not packed (stride(0) > width) and that starts off 16-byte alignment, in bf16."""
    big = _x(24, 200, False, torch.bfloat16)
    x = big[:, 3:131]
    assert x.stride() == (200, 1)
    whole = lq.quantize_rows(x, "e2m1", "row", None, 128)
    monkeypatch.setattr(lq, "TUNING", {**lq.TUNING, "whole_rows": {**lq.TUNING["whole_rows"], "enabled": False}})  # TUNING is read-only
    two = lq.quantize_rows(x, "e2m1", "row", None, 128)
    assert torch.equal(whole[0].view(torch.uint8), two[0].view(torch.uint8)) and torch.equal(whole[1], two[1])
    ref = quantize_operand_ref(x, "e2m1", "row", None, 128)
    assert torch.equal(whole[0].float(), ref.values.float()) and torch.equal(whole[1], ref.scale)


@pytest.mark.parametrize("width,whole", [(4096, True), (4097, False)])
def test_whole_rows_kernel_is_taken_up_to_its_width(monkeypatch, width, whole):
    """TUNING's max_width (4096 padded columns) decides; cols is checked against x's width."""
    used = _launched(monkeypatch)
    x = torch.randn(2, width - 16 if whole else width)
    lq.quantize_rows(x, "e4m3", "row", None, -(-x.shape[1] // 16) * 16)
    assert used == [lq._quant_whole_rows_kernel if whole else lq._quant_rows_kernel]
    with pytest.raises(ValueError, match="padded, never dropped"):
        lq.quantize_rows(x, "e4m3", "row", None, 16)
