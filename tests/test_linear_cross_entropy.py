"""The chunked LM head + cross-entropy against nn.Linear + F.cross_entropy: same loss, same gradients."""
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


@pytest.mark.parametrize("chunk", [7, None])
def test_softcap_matches_unfused(chunk):
    """Gemma 2's final_logit_softcapping: the loss of c * tanh(logits / c), as HF computes it (divided, tanh,
    multiplied), and its gradients through the cap; a cap that bites (logits up to ~4 c) changes the loss."""
    g = torch.Generator().manual_seed(3)
    h = (4 * torch.randn(2, 20, 32, generator=g)).requires_grad_()
    w = torch.randn(50, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (2, 20), generator=g)
    t[1, -3:] = -100
    logits = h @ w.t()
    cap = 30.0
    ref = F.cross_entropy((torch.tanh(logits / cap) * cap).view(-1, 50), t.view(-1))
    gh, gw = torch.autograd.grad(ref, (h, w))
    out = linear_cross_entropy(h, w, t, chunk=chunk, softcap=cap)
    fh, fw = torch.autograd.grad(out, (h, w))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fh, gh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fw, gw, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(out, linear_cross_entropy(h, w, t, chunk=chunk), rtol=1e-2)
    for bad in (-1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(ValueError, match="softcap"):
            linear_cross_entropy(h, w, t, softcap=bad)


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


@pytest.mark.parametrize("ignore_index", [-100, 0, 50])
def test_ignore_index_anywhere(ignore_index):
    """ignore_index may be a class (0) or past the vocabulary (50 of 50), as F.cross_entropy allows: those targets
    count nowhere and index nothing."""
    g = torch.Generator().manual_seed(6)
    h = torch.randn(30, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (30,), generator=g)
    t[::4] = ignore_index
    ref = _reference(h, w, t, ignore_index=ignore_index)
    out = linear_cross_entropy(h, w, t, chunk=7, ignore_index=ignore_index)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [64, 300])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_cuda_bf16_head_gradient(weight_dtype, tokens):
    """On CUDA under bf16 autocast: the head's gradient in the weight's dtype, from one GEMM over every token's kept
    logits gradient (bf16 head, 4 x 64 tokens at width 256) or the chunks' bf16 GEMMs added into fp32 (an fp32 head,
    or 4 x 300 tokens: addmm with out_dtype, checked exactly)."""
    lce = importlib.import_module("lpoptim.nn.linear_cross_entropy")
    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(4, tokens, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(1000, 256, device="cuda", generator=g) * 0.05).to(weight_dtype).requires_grad_()
    t = torch.randint(0, 1000, (4, tokens), device="cuda", generator=g)
    keeps = lce.keeps_logits_grad(4 * tokens, 256, 2, weight_dtype == torch.bfloat16)
    assert keeps == (tokens == 64 and weight_dtype == torch.bfloat16)  # both of the forward's paths are run
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.t().to(torch.bfloat16)).float().view(-1, 1000), t.view(-1))
        out = linear_cross_entropy(h, w, t, chunk=128)
    gh, gw = torch.autograd.grad(ref, (h, w))
    fh, fw = torch.autograd.grad(out, (h, w))
    if torch.__version__ >= "2.9" and weight_dtype == torch.float32:  # torch 2.11 has it: no fallback there
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


class NewOutputs(TorchDispatchMode):
    """The tensors the ops under it make in new memory (not a view of, nor written into, an input's storage)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.made.append((o.dtype, o.numel()))
        return out


def test_no_fp32_copy_of_a_bf16_head_gradient():
    """The forward, the step's memory peak, makes no fp32 tensor of the head's size for a bf16 head and few tokens:
    its gradient is one GEMM over the kept bf16 logits' gradient (an fp32 sum and its bf16 copy were 1.5x the head's
    bytes on top of the peak)."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(400, 32, generator=g).bfloat16().requires_grad_()
    t = torch.randint(0, 400, (64,), generator=g)
    t[:5] = -100
    with NewOutputs() as seen:
        out = linear_cross_entropy(h, w, t, chunk=8)
    largest_fp32 = max(n for dtype, n in seen.made if dtype == torch.float32)
    assert largest_fp32 < w.numel(), largest_fp32  # the logits of one chunk (8 x 400)
    fh, fw = torch.autograd.grad(out, (h, w))
    assert fw.dtype == torch.bfloat16
    ref = _reference(h.float(), w.float(), t)
    rh, rw = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert F.cosine_similarity(fw.float().flatten(), rw.float().flatten(), dim=0) > 0.999
    assert F.cosine_similarity(fh.float().flatten(), rh.float().flatten(), dim=0) > 0.999


def test_backward_scales_the_head_gradient_in_place():
    """Backward returns the forward's head gradient scaled in place (no second head-sized tensor at the step's
    peak) and AccumulateGrad keeps that tensor as .grad; under retain_graph every backward gives the reference (to
    a rounding of the head's dtype), a double backward after it too, and a first scale of 0 is refused later."""
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(16, 8, generator=g).to(dtype).requires_grad_()
        w = torch.randn(12, 8, generator=g).to(dtype).requires_grad_()
        t = torch.randint(0, 12, (16,), generator=g)
        loss = linear_cross_entropy(h, w, t, chunk=5)
        with NewOutputs() as seen:
            (loss * 3.0).backward()
        assert not [n for _, n in seen.made if n == w.numel()], seen.made
        wf = w.detach().float().requires_grad_()
        (rw,) = torch.autograd.grad(_reference(h.detach().float(), wf, t) * 3.0, wf)
        tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(w.grad.float(), rw, **tol)

        w.grad = None
        loss = linear_cross_entropy(h, w, t, chunk=5)
        for k in range(3):  # a retained graph: each backward adds one reference gradient (scaled by 0.5 here)
            (loss * 0.5).backward(retain_graph=True)
            torch.testing.assert_close(w.grad.float(), rw / 6 * (k + 1), **tol)

        go = torch.tensor(2.0, requires_grad=True)  # a double backward after the in-place one
        (_, gw2) = torch.autograd.grad(loss, (h, w), grad_outputs=go, create_graph=True)
        torch.testing.assert_close(gw2.float(), rw / 3 * 2, **tol)

    w = torch.randn(12, 8, generator=g, requires_grad=True)
    loss = linear_cross_entropy(torch.randn(16, 8, generator=g), w, torch.randint(0, 12, (16,), generator=g))
    (loss * 0.0).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot be undone"):
        loss.backward()


# The fused kernel (kernels/cross_entropy.py) that CUDA uses for each chunk: under Triton's interpreter on the CPU,
# with CUDA the compiled kernel; against the torch path it replaces and the unfused head and loss.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_kernel_rows_match_the_torch_chunk(dtype, softcap):
    """Each row's loss and logits gradient against the torch path's, with ignored rows, a row of large logits, a
    vocabulary that is not a multiple of the kernel's block, and a row holding a NaN (NaN loss, as the torch path)."""
    from lpoptim.kernels import cross_entropy as kce

    lce = importlib.import_module("lpoptim.nn.linear_cross_entropy")
    g = torch.Generator().manual_seed(7)
    rows, vocab = 9, kce.BLOCK + 37
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    logits[2] *= 30  # a cap that bites, and exp(x - max) far below 1 for most of the row
    logits[5, 11] = float("nan")
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[1], t[8] = vocab - 1, 0  # the block's tail and the first column
    valid = torch.ones(rows, dtype=torch.bool)
    valid[[3, 7]] = False
    capped = torch.tanh(logits.float() / softcap) * softcap if softcap else logits.float()
    per_row = F.cross_entropy(capped, torch.where(valid, t, -100), reduction="none")  # 0 where ignored
    ref_loss = torch.zeros(())
    ref_grad = lce._torch_chunk(logits.float().clone(), torch.where(valid, t, 0), valid, softcap, ref_loss, True)
    assert ref_loss.isnan()  # the NaN row's
    got, loss = logits.clone().to(KERNEL_DEVICE), torch.full((rows,), -1.0, device=KERNEL_DEVICE)
    kce.cross_entropy_rows_(got, torch.where(valid, t, -1).to(KERNEL_DEVICE), loss, softcap)
    got, loss = got.cpu(), loss.cpu()
    assert loss[5].isnan() and per_row[5].isnan()
    ok = torch.arange(rows) != 5
    torch.testing.assert_close(loss[ok], per_row[ok], rtol=1e-5, atol=1e-5)
    assert (loss[~valid] == 0).all()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    # bf16: the reference's gradient rounded to nearest even; the kernel's fp32 differs by ulps, so a rounding step
    want = ref_grad.to(dtype)
    if dtype == torch.bfloat16:
        diff = (got[ok].float() - want[ok].float()).abs()
        # (+1e-9: with a cap, the reference's 1 - tanh² cancels where the cap saturates; gradients there are tiny)
        assert (diff <= want[ok].float().abs() * 2 ** -7 + (1e-9 if softcap else 1e-30)).all(), diff.max()
    else:
        torch.testing.assert_close(got[ok], want[ok], **tol)
    assert (got[~valid] == 0).all() and got[5].isnan().all()
    # loss only: the logits are left as they were
    kept = logits.clone().to(KERNEL_DEVICE)
    again = torch.full((rows,), -1.0, device=KERNEL_DEVICE)
    kce.cross_entropy_rows_(kept, torch.where(valid, t, -1).to(KERNEL_DEVICE), again, softcap, want_grad=False)
    assert torch.equal(again.cpu().isnan(), loss.isnan()) and torch.equal(again.cpu()[ok], loss[ok])
    assert torch.equal(kept.cpu().view(torch.uint8), logits.view(torch.uint8))  # bit for bit (a NaN too)


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_matches_the_torch_path(monkeypatch, dtype, softcap):
    """linear_cross_entropy through the kernel (forced on the CPU) against its torch path and, in fp32, the unfused
    head and loss: both of the forward's ways to the head's gradient (every token's logits gradient kept: bf16, few
    tokens; an fp32 sum), ignored targets, chunks that do not divide the tokens, and a frozen head."""
    lce = importlib.import_module("lpoptim.nn.linear_cross_entropy")
    g = torch.Generator().manual_seed(8)
    for tokens, chunk in ((24, 7), (100, 16)):  # kept logits gradients; an fp32 sum
        h = (3 * torch.randn(tokens, 32, generator=g)).to(dtype).to(KERNEL_DEVICE).requires_grad_()
        w = (0.3 * torch.randn(70, 32, generator=g)).to(dtype).to(KERNEL_DEVICE).requires_grad_()
        t = torch.randint(0, 70, (tokens,), generator=g).to(KERNEL_DEVICE)
        t[::5] = -100
        if dtype == torch.float32:
            logits = h @ w.t()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            ref = F.cross_entropy(logits, t)
        else:  # the same bf16 logits, the torch ops
            monkeypatch.setattr(lce, "use_kernel", lambda h: False)
            ref = linear_cross_entropy(h, w, t, chunk=chunk, softcap=softcap)
        rh, rw = torch.autograd.grad(ref, (h, w))
        monkeypatch.setattr(lce, "use_kernel", lambda h: True)
        out = linear_cross_entropy(h, w, t, chunk=chunk, softcap=softcap)
        fh, fw = torch.autograd.grad(out, (h, w))
        assert fw.dtype == dtype
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # bf16: the gradients the two paths round to bf16 differ by fp32 ulps, which flips a rounding here and there
        tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-4)
        torch.testing.assert_close(fh.float(), rh.float(), **tol)
        torch.testing.assert_close(fw.float(), rw.float(), **tol)
        frozen = w.detach()  # a frozen head: the hidden states' gradient alone
        (fh2,) = torch.autograd.grad(linear_cross_entropy(h, frozen, t, chunk=chunk, softcap=softcap), (h,))
        torch.testing.assert_close(fh2, fh, rtol=0, atol=0)


def test_kernel_path_targets_out_of_range_give_nan(monkeypatch):
    """A target past the vocabulary, or negative but not ignore_index, makes the loss NaN through the kernel
    (the torch path raises on the CPU, and torch's cross-entropy stops a CUDA device): never another row's logit
    or a silently ignored token; the other rows' gradients stay finite."""
    from lpoptim.kernels import cross_entropy as kce

    lce = importlib.import_module("lpoptim.nn.linear_cross_entropy")
    monkeypatch.setattr(lce, "use_kernel", lambda h: True)
    g = torch.Generator().manual_seed(9)
    h = torch.randn(6, 16, generator=g).to(KERNEL_DEVICE).requires_grad_()
    w = torch.randn(40, 16, generator=g).to(KERNEL_DEVICE).requires_grad_()
    for bad in (40, 1000, -5):
        t = torch.randint(0, 40, (6,), generator=g).to(KERNEL_DEVICE)
        t[2] = bad
        out = linear_cross_entropy(h, w, t, chunk=4)
        assert out.isnan(), bad
        (gh,) = torch.autograd.grad(out, (h,))
        assert gh[2].isnan().all() and gh[[0, 1, 3, 4, 5]].isfinite().all()
    logits = torch.randn(2, 40, generator=g).to(KERNEL_DEVICE)
    loss = torch.zeros(2, device=KERNEL_DEVICE)
    kce.cross_entropy_rows_(logits, torch.tensor([3, 40], device=KERNEL_DEVICE), loss)
    assert loss[0].isfinite() and loss[1].isnan() and logits[1].isnan().all() and logits[0].isfinite().all()


def test_kernel_path_edges(monkeypatch):
    """Through the kernel (forced on the CPU) as through the torch ops: hidden states without gradient and a
    trainable head, a forward without grad, fp16, and an all -inf row (zero probability where the others are -inf);
    targets that are strided or not int64 are refused by the kernel's wrapper."""
    from lpoptim.kernels import cross_entropy as kce

    lce = importlib.import_module("lpoptim.nn.linear_cross_entropy")
    g = torch.Generator().manual_seed(10)
    h = torch.randn(12, 16, generator=g).to(KERNEL_DEVICE)
    w = torch.randn(40, 16, generator=g).to(KERNEL_DEVICE).requires_grad_()
    t = torch.randint(0, 40, (12,), generator=g).to(KERNEL_DEVICE)
    results = {}
    for kernel in (False, True):
        monkeypatch.setattr(lce, "use_kernel", lambda x, k=kernel: k)
        out = linear_cross_entropy(h, w, t, chunk=5)
        (gw,) = torch.autograd.grad(out, (w,))
        with torch.no_grad():
            frozen = linear_cross_entropy(h, w, t, chunk=5)
        half = linear_cross_entropy(h.half(), w.detach().half(), t, chunk=5) if KERNEL_DEVICE == "cuda" else None
        results[kernel] = (out, gw, frozen, half)
    for a, b in zip(results[False], results[True]):
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-5)
    logits = torch.full((2, 40), float("-inf"))
    logits[0, 3] = 1.0  # a row with one finite logit: all its probability there
    logits[1, ::2] = torch.randn(20, generator=g)  # half of a row -inf
    ref_loss = torch.zeros(())
    ref = lce._torch_chunk(logits.clone(), torch.tensor([3, 4]), torch.tensor([True, True]), 0.0, ref_loss, True)
    got, loss = logits.to(KERNEL_DEVICE), torch.zeros(2, device=KERNEL_DEVICE)
    kce.cross_entropy_rows_(got, torch.tensor([3, 4], device=KERNEL_DEVICE), loss)
    assert loss[0] == 0 and (got[0] == 0).all()
    torch.testing.assert_close(loss.sum().cpu(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-6)
    rows = torch.zeros(2, 40, device=KERNEL_DEVICE)
    for bad in (torch.tensor([[1, 2], [3, 4]], device=KERNEL_DEVICE)[:, 0], torch.tensor([1, 2], device=KERNEL_DEVICE,
                                                                                          dtype=torch.int32)):
        with pytest.raises(ValueError, match="contiguous int64 targets"):
            kce.cross_entropy_rows_(rows, bad, torch.zeros(2, device=KERNEL_DEVICE))


def test_default_chunk_in_place(monkeypatch):
    """The default chunk: 64 MiB of fp32 logits and at least 256 tokens, or at least 1024 where CUDA's kernel writes
    each chunk's logits into the kept logits gradient (a bf16 head with few tokens), which makes no temporaries;
    the torch path and the fp32 sum of the head's gradient keep the 256-token floor."""
    lce = importlib.import_module("lpoptim.nn.linear_cross_entropy")
    assert lce.default_chunk(128256) == 256 and lce.default_chunk(128256, in_place=True) == 1024
    assert lce.default_chunk(1000, in_place=True) == lce.default_chunk(1000) == lce.logits_chunk(1000)
    asked = []
    real = lce.default_chunk
    monkeypatch.setattr(lce, "default_chunk", lambda vocab, in_place=False: asked.append(in_place) or real(vocab))
    g = torch.Generator().manual_seed(11)
    for kernel, dtype, want in ((True, torch.bfloat16, True), (True, torch.float32, False),
                                (False, torch.bfloat16, False)):
        monkeypatch.setattr(lce, "use_kernel", lambda x, k=kernel: k)
        h = torch.randn(8, 16, generator=g).to(dtype).to(KERNEL_DEVICE).requires_grad_()
        w = torch.randn(40, 16, generator=g).to(dtype).to(KERNEL_DEVICE).requires_grad_()
        linear_cross_entropy(h, w, torch.randint(0, 40, (8,), generator=g).to(KERNEL_DEVICE))
        assert asked.pop() is want, (kernel, dtype)
