"""The chunked LM head + cross-entropy against nn.Linear + F.cross_entropy: same loss, same gradients."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from lpoptim.nn.linear_cross_entropy import linear_cross_entropy


def _reference(h, w, t, ignore_index=-100):
    logits = h @ w.t()
    return F.cross_entropy(logits.float().view(-1, w.shape[0]), t.view(-1), ignore_index=ignore_index)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_matches_unfused_head_and_loss_fp32(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 20, 32, generator=g, requires_grad=True)
    w = torch.randn(50, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (3, 20), generator=g)
    t[0, :4] = -100  # ignored positions count neither in the mean nor in the gradients
    ref = _reference(h, w, t)
    gh, gw = torch.autograd.grad(ref * 2.5, (h, w))
    out = linear_cross_entropy(h, w, t, chunk=chunk)
    fh, fw = torch.autograd.grad(out * 2.5, (h, w))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fh, gh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fw, gw, rtol=1e-4, atol=1e-6)


def test_under_bf16_autocast_with_fp32_weight():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, 32, generator=g, requires_grad=True)
    w = torch.randn(40, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.t()).float(), t)  # bf16 GEMM, as nn.Linear under autocast
    gh, gw = torch.autograd.grad(ref, (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, t, chunk=16)
    fh, fw = torch.autograd.grad(out, (h, w))
    assert fw.dtype == torch.float32 and fh.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    assert F.cosine_similarity(fh.flatten(), gh.flatten(), dim=0) > 0.999
    assert F.cosine_similarity(fw.flatten(), gw.flatten(), dim=0) > 0.999


def test_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_cuda_bf16_accumulates_the_head_gradient_in_fp32(weight_dtype):
    """On CUDA the head's gradient is summed over chunks by one GEMM adding into fp32 (addmm with out_dtype): it
    must equal the fp32 sum of the chunks' bf16 GEMMs, and the returned gradient is in the weight's dtype."""
    lce = importlib.import_module("lpoptim.nn.linear_cross_entropy")
    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(4, 300, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(1000, 256, device="cuda", generator=g) * 0.05).to(weight_dtype).requires_grad_()
    t = torch.randint(0, 1000, (4, 300), device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.t().to(torch.bfloat16)).float().view(-1, 1000), t.view(-1))
        out = linear_cross_entropy(h, w, t, chunk=128)
    gh, gw = torch.autograd.grad(ref, (h, w))
    fh, fw = torch.autograd.grad(out, (h, w))
    if torch.__version__ >= "2.9":  # the H100's torch 2.11 has it: a fallback there would cost peak memory
        assert lce.addmm_accumulates_in_fp32(h.device, torch.bfloat16), "addmm(out_dtype=float32) fell back"
    assert fw.dtype == weight_dtype
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    assert F.cosine_similarity(fh.float().flatten(), gh.float().flatten(), dim=0) > 0.999
    assert F.cosine_similarity(fw.float().flatten(), gw.float().flatten(), dim=0) > 0.9999
    # the fp32 accumulation itself, against the chunks' products summed in float64
    acc = torch.zeros(1000, 256, device="cuda")
    a, b = torch.randn(3, 1000, 64, device="cuda").bfloat16(), torch.randn(3, 64, 256, device="cuda").bfloat16()
    for i in range(3):
        lce._accumulate(acc, a[i], b[i])
    exact = sum(a[i].double() @ b[i].double() for i in range(3))
    torch.testing.assert_close(acc.double(), exact, rtol=1e-5, atol=1e-4)


def test_backward_with_a_differentiable_incoming_gradient():
    """create_graph with an incoming gradient that needs grad: the scaled gradients stay differentiable in it."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(10, 8, generator=g, requires_grad=True)
    w = torch.randn(12, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 12, (10,), generator=g)
    go = torch.tensor(2.0, requires_grad=True)
    _, gw = torch.autograd.grad(linear_cross_entropy(h, w, t, chunk=3), (h, w), grad_outputs=go, create_graph=True)
    _, rw = torch.autograd.grad(_reference(h, w, t), (h, w), grad_outputs=go, create_graph=True)
    (d,) = torch.autograd.grad(gw.sum(), go)
    (rd,) = torch.autograd.grad(rw.sum(), go)
    torch.testing.assert_close(d, rd, rtol=1e-4, atol=1e-6)
