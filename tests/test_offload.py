"""Saved activations moved to host memory (lpoptim/activations/offload.py): the same gradients, the bookkeeping
(what moves, when it comes back, a second backward, removal), the refusals; on a GPU the same gradients bit for
bit and the peak lowered."""
import pytest
import torch
import torch.nn as nn

from lpoptim.activations import compress_activations
from lpoptim.activations.offload import OffloadHandle, offload_activations

transformers = pytest.importorskip("transformers")


def _llama(layers=4, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def _grads(model, x):
    model.zero_grad()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("n_blocks", [1, 2, 4])
def test_gradients_unchanged_on_cpu(n_blocks):
    """The CPU bookkeeping path (plain copies): the same loss and gradients, bit for bit, with 1, 2 or all 4 blocks
    offloaded; tensors of the offloaded blocks moved, nothing else; the hooks gone after remove()."""
    model = _llama()
    x = torch.randint(0, 128, (2, 16))
    want_loss, want = _grads(model, x)
    handle = OffloadHandle(model.model.layers, n_blocks, min_bytes=0)
    loss, got = _grads(model, x)
    assert handle.offloaded_bytes > 0
    assert torch.equal(loss, want_loss)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    moved = handle.offloaded_bytes
    handle.remove()
    assert not any("_lpoptim_offload" in b.__dict__ for b in model.model.layers)
    _grads(model, x)
    assert handle.offloaded_bytes == moved  # no hook ran after remove()


def test_moves_only_large_activations_not_parameters():
    """Parameters (a linear layer's saved weight) stay; tensors below min_bytes stay; the blocks past n_blocks keep
    theirs; what moved is counted."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3))
    x = torch.randn(8, 32, requires_grad=True)
    handle = OffloadHandle(blocks, 2, min_bytes=0)
    packed = []
    pack = handle._pack
    handle._pack = lambda block, params, t: packed.append((block, tuple(t.shape), pack(block, params, t))) or packed[-1][2]
    y = x
    for b in blocks:
        y = b(y)
    y.sum().backward()
    offloaded = [(block, shape) for block, shape, out in packed if not isinstance(out, torch.Tensor)]
    kept = [(block, shape) for block, shape, out in packed if isinstance(out, torch.Tensor)]
    assert len({id(block) for block, _ in offloaded}) == 2  # the first two blocks'
    assert all(shape != (32, 32) for _, shape in offloaded)  # no weight moved
    assert any(block is None for block, _ in kept)  # the third block's tensors stay
    assert handle.offloaded_bytes == sum(torch.Size(s).numel() * 4 for _, s in offloaded)
    big = OffloadHandle(nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)), 3,
                        min_bytes=10**9)
    z = torch.randn(8, 32, requires_grad=True)
    for b in big.blocks:
        z = b(z)
    z.sum().backward()
    assert big.offloaded_bytes == 0


def test_dense_tensors_only():
    """Dense tensors (any order of their strides) move, copied with their strides; others (an expanded view, a
    slice with gaps) stay where they are."""
    from lpoptim.activations.offload import _dense

    assert _dense(torch.randn(3, 5)) and _dense(torch.randn(4, 6).t()) and _dense(torch.randn(2, 1, 7))
    assert _dense(torch.randn(2, 3, 4).permute(2, 0, 1)) and _dense(torch.tensor(1.0))
    assert not _dense(torch.randn(3, 1).expand(3, 4)) and not _dense(torch.randn(4, 6)[:, :3])
    t = torch.randn(4, 6).t()
    assert torch.empty_like(t, device="cpu").stride() == t.stride()  # what the host copy keeps


def test_fetch_ahead_is_memory_neutral():
    """With n blocks and k offloaded, block i's backward begins with the offloaded blocks from k-1 down to
    i - (n - k) + 1 fetched (one per block whose backward is done); every offloaded block is fetched before its own
    backward, once, in one copy."""
    torch.manual_seed(0)
    n, k = 6, 3
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(n))
    handle = OffloadHandle(blocks, k, min_bytes=0)
    fetched, begun = [], []
    fetch = handle._fetch

    def spy(block):
        fetched.append(handle._pass.blocks.index(block))
        begun.append(min(handle._pass.begun))
        fetch(block)

    handle._fetch = spy
    x = torch.randn(4, 16, requires_grad=True)
    y = x
    for b in blocks:
        y = b(y)
    y.sum().backward()
    assert fetched == [2, 1, 0]  # last first, each once
    # block 2 fetched when block 4's backward began (n - k - 1 = 2 blocks ahead), block 0 when block 2's did
    assert begun == [4, 3, 2]


def _through(blocks, x):
    for b in blocks:
        x = b(x)
    return x


def test_second_backward_reads_the_same_copies():
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
    x = torch.randn(4, 16, requires_grad=True)
    _through(blocks, x).sum().backward(retain_graph=True)
    want = x.grad.clone()
    x.grad = None
    with OffloadHandle(blocks, 2, min_bytes=0):
        y = _through(blocks, x)
        y.sum().backward(retain_graph=True)
        first = x.grad.clone()
        x.grad = None
        y.sum().backward()
    assert torch.equal(first, want) and torch.equal(x.grad, want)
    assert not any("_lpoptim_offload" in b.__dict__ for b in blocks)  # the context removed it


def test_forwards_before_a_backward_keep_their_own_bookkeeping():
    """Two forwards, then the first's backward: it fetches its own blocks ahead, not the second's; the second's
    backward then fetches its own. Gradients as without offloading."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
    xa, xb = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    _through(blocks, xa).sum().backward()
    _through(blocks, xb).sum().backward()
    want = xa.grad.clone(), xb.grad.clone()
    xa.grad = xb.grad = None
    handle = OffloadHandle(blocks, 2, min_bytes=0)
    fetched = []
    fetch = handle._fetch
    handle._fetch = lambda block: fetched.append(block) or fetch(block)
    ya = _through(blocks, xa)
    pass_a = handle._pass
    yb = _through(blocks, xb)
    pass_b = handle._pass
    assert pass_a is not pass_b
    ya.sum().backward()
    assert fetched == [pass_a.blocks[1], pass_a.blocks[0]]
    yb.sum().backward()
    assert fetched[2:] == [pass_b.blocks[1], pass_b.blocks[0]]
    assert torch.equal(xa.grad, want[0]) and torch.equal(xb.grad, want[1])


def test_arguments_stay_and_in_place_changes_raise():
    """A block's tensor arguments without grad (rotary tables, masks: shared by the blocks) outlive it: not moved.
    A saved tensor changed in place after the block's forward raises at backward, as autograd does without
    offloading."""
    torch.manual_seed(0)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, table):
            self.last = torch.tanh(self.lin(x))  # saved by tanh; kept here: the test changes it in place
            return self.last * table  # saves table (an argument without grad)

    blocks = nn.ModuleList(Scale() for _ in range(2))
    table = torch.randn(4, 16)
    handle = OffloadHandle(blocks, 2, min_bytes=0)
    packed = []
    pack = handle._pack
    handle._pack = lambda block, params, t: packed.append((t, pack(block, params, t))) or packed[-1][1]
    x = torch.randn(4, 16, requires_grad=True)
    y = blocks[1](blocks[0](x, table), table)
    assert [out is t for t, out in packed if t is table] == [True, True]  # kept as it is, by both blocks
    assert any(t is x and out is not t for t, out in packed)  # the input, which requires grad, moved
    y.sum().backward()
    handle._pack = pack
    out = blocks[1](blocks[0](x, table), table)
    moved = [s for s in (r() for r in handle._pass.blocks[1].saved) if s is not None]
    assert any(s.source() is blocks[1].last for s in moved)
    with torch.no_grad():
        blocks[1].last.add_(1.0)  # block 1's tanh output, changed in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_recompute_inside_backward_is_left_alone():
    """A block checkpointed inside (torch.utils.checkpoint runs it again in backward): the recompute neither moves
    tensors nor starts a new forward's bookkeeping; gradients as without offloading."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False) * 2.0

    blocks = nn.ModuleList(Checkpointed() for _ in range(3))
    x = torch.randn(4, 16, requires_grad=True)
    _through(blocks, x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    handle = OffloadHandle(blocks, 3, min_bytes=0)
    y = _through(blocks, x)
    current = handle._pass
    y.sum().backward()
    assert handle._pass is current and torch.equal(x.grad, want)


def test_compress_activations_refuses_offloaded_blocks():
    blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
    handle = OffloadHandle(blocks, 1)
    with pytest.raises(ValueError, match="offloaded"):
        compress_activations(blocks)
    handle.remove()
    compress_activations(blocks).remove()


def test_parameter_storages_follow_a_cast():
    """The parameters' storages (never moved) are taken again when the model is cast or moved as a whole."""
    blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
    handle = OffloadHandle(blocks, 2, min_bytes=0)
    before = handle._param_storages()
    assert before == {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    assert handle._param_storages() is before  # unchanged: not taken again
    blocks.double()
    assert handle._param_storages() == {p.untyped_storage().data_ptr() for p in blocks.parameters()} != before


def test_no_grad_forward_saves_nothing():
    blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
    handle = OffloadHandle(blocks, 2, min_bytes=0)
    with torch.no_grad():
        blocks[1](blocks[0](torch.randn(4, 16)))
    assert handle.offloaded_bytes == 0


def test_refusals():
    blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
    with pytest.raises(ValueError, match="GPU to host memory"):
        offload_activations(blocks, 1)  # CPU parameters
    for bad in (0, 4, True, 1.5, "2"):
        with pytest.raises(ValueError, match="n_blocks is an int in 1..3"):
            OffloadHandle(blocks, bad)
    with pytest.raises(ValueError, match="min_bytes"):
        OffloadHandle(blocks, 1, min_bytes=-1)
    with pytest.raises(ValueError, match="no parameters"):
        OffloadHandle(nn.ModuleList([nn.GELU()]), 1)
    handle = OffloadHandle(blocks, 1)
    with pytest.raises(ValueError, match="offloaded already"):
        OffloadHandle(blocks, 1)
    handle.remove()
    compressed = compress_activations(blocks)
    with pytest.raises(ValueError, match="compress_activations"):
        OffloadHandle(blocks, 1)
    compressed.remove()
    with pytest.raises(TypeError):
        OffloadHandle(42, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_same_gradients_lower_peak(compiled):
    """On a GPU, eager and compiled blocks: the same loss and gradients bit for bit (HF's eager attention: no
    atomics), through pinned memory and the two copy streams; after the forward, less held (compiled: about what
    moved; eager, where a saved tensor may also be a block's output or input, less)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    if compiled:
        for b in model.model.layers:
            b.compile()
    x = torch.randint(0, 128, (4, 512), device="cuda")
    want_loss, want = _grads(model, x)

    def held_after_forward():
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=x, labels=x).loss
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # an allocation: the allocator frees what waited for the copy stream
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        return held

    plain = held_after_forward()
    handle = offload_activations(model.model.layers, 4, min_bytes=0)
    loss, got = _grads(model, x)
    assert torch.equal(loss, want_loss)
    for (name, _), a, b in zip(model.named_parameters(), want, got):
        assert torch.equal(a, b), name
    moved = handle.offloaded_bytes
    held = held_after_forward()
    assert moved > 0 and held < plain - (0.8 if compiled else 0.1) * moved, (plain, held, moved)
    handle.remove()
    assert torch.equal(_grads(model, x)[0], want_loss)
