"""The fused DGE weight-gradient kernel (kernels/dge.py) against the torch reference (nn/fp4.dge_derivative)."""
import pytest
import torch

from lpoptim.nn.fp4 import dge_derivative
from lpoptim.nn.operands import quantize_operand_ref

# on the CPU conftest.py runs Triton's interpreter; with CUDA the same test runs the compiled kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
from lpoptim.kernels.dge import dge_scale_grad  # noqa: E402


def _reference(dw, w, scale, k, cap, dtype):
    return (dw * dge_derivative(w.float() / scale, k, cap)).to(dtype)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gran", ["row", "tensor"])
def test_matches_reference(wdtype, gran):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 80, generator=g) * 0.05).to(wdtype)
    w[3, :6] = 0.0  # zero weights: t = 1 at the grid point 0
    dw = torch.randn(48, 80, generator=g)
    scale = quantize_operand_ref(w, "e2m1", gran).scale
    # weights exactly on grid points and on rounding thresholds (t = 0: the derivative is capped)
    s0 = float(scale.reshape(-1)[0])
    w[0, :8] = (torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]) * s0).to(wdtype)
    w[0, 8:14] = (torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 5.0]) * s0).to(wdtype)
    w, dw, scale = w.to(DEVICE), dw.to(DEVICE), scale.to(DEVICE)
    out = dge_scale_grad(dw, w, scale, 5.0, 3.0, wdtype)
    ref = _reference(dw, w, scale, 5.0, 3.0, wdtype)
    assert out.dtype == wdtype and out.shape == w.shape
    # exp2(log2 t · e) against torch.pow: an ulp or two in fp32, at most one bf16 rounding step apart
    rtol = 1e-5 if wdtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=0)
    # the capped entries (thresholds) are exact: dw * 3
    torch.testing.assert_close(out[0, 8:14].float(), (dw[0, 8:14] * 3.0).to(wdtype).float(), rtol=0, atol=0)


def test_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="one 2-D shape"):
        dge_scale_grad(torch.zeros(4, 8), torch.zeros(8, 4), torch.ones(()), 5.0, 3.0, torch.float32)


def test_non_finite_weights_give_nan_as_the_reference():
    """A diverged weight (inf, NaN) must show in its gradient as it does in the reference, not be capped."""
    w = torch.tensor([[0.01, float("inf"), float("nan"), -0.02]]).to(DEVICE)
    dw = torch.ones(1, 4, device=DEVICE)
    scale = torch.tensor([[0.02 / 6]], device=DEVICE)
    out = dge_scale_grad(dw, w, scale, 5.0, 3.0, torch.float32)
    ref = _reference(dw, w, scale, 5.0, 3.0, torch.float32)
    assert ref[0, 1:3].isnan().all()
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-5, atol=0)


def test_strided_inputs_and_a_single_row():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(80, 48, generator=g) * 0.05).t()  # not contiguous
    dw = torch.randn(80, 48, generator=g).t()
    scale = quantize_operand_ref(w, "e2m1", "row").scale
    out = dge_scale_grad(dw.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), 5.0, 3.0, torch.float32)
    torch.testing.assert_close(out.cpu(), _reference(dw, w, scale, 5.0, 3.0, torch.float32), rtol=1e-5, atol=0)
    w1, dw1 = w[:1].contiguous(), dw[:1].contiguous()
    s1 = quantize_operand_ref(w1, "e2m1", "row").scale
    out1 = dge_scale_grad(dw1.to(DEVICE), w1.to(DEVICE), s1.to(DEVICE), 5.0, 3.0, torch.float32)
    torch.testing.assert_close(out1.cpu(), _reference(dw1, w1, s1, 5.0, 3.0, torch.float32), rtol=1e-5, atol=0)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_row_scale_taken_from_w_in_the_kernel(wdtype):
    """scale=None: the kernel takes each row's E2M1 scale from W itself (quant.quantize's per-row scale), so no
    quantization of W runs just for its scale; rows wider than the kernel's column tile, an outlier, a zero row,
    a non-finite element (it never sets a scale) and a partial last row block."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(13, 1100, generator=g) * 0.05).to(wdtype)
    w[2, 700] = 3.0
    w[5] = 0.0
    w[7, 3] = float("inf")
    dw = torch.randn(13, 1100, generator=g)
    scale = quantize_operand_ref(w, "e2m1", "row").scale
    out = dge_scale_grad(dw.to(DEVICE), w.to(DEVICE), None, 5.0, 3.0, wdtype)
    ref = _reference(dw, w, scale, 5.0, 3.0, wdtype)
    rtol = 1e-5 if wdtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=rtol, atol=0, equal_nan=True)
