"""One Llama-7B block, compiled fp8_tensor_fast linears, with and without compress_activations, timed back to back (no sync
between steps: the steady state of a model whose host runs ahead) and synchronized per step (benchmarks/activations.py's
timer), twice each. `PYTHONPATH=$PWD python3 benchmarks/activations_b2b.py` (one H100: ~1.5 minutes)."""
import copy, sys, time, torch
sys.path.insert(0, '.')
from benchmarks.activations import make_block
from benchmarks.timing import timer
from lpoptim.activations import compress_activations
from lpoptim.nn import convert_linears
b, t, d, ff, h = 4, 2048, 4096, 11008, 32
block, extra = make_block("plain", d, ff, h, t, "cuda", torch.bfloat16)
g = torch.Generator(device="cuda").manual_seed(1)
xs = [torch.randn(b, t, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True) for _ in range(2)]
dy = torch.randn(b, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
for wrap in (False, True, False, True):
    torch._dynamo.reset()
    m = copy.deepcopy(block); convert_linears(m, recipe="fp8_tensor_fast")
    run = torch.compile(m)
    hd = compress_activations(run) if wrap else None
    def step(i):
        for p in m.parameters(): p.grad = None
        run(xs[i % 2], **extra).backward(dy)
    for i in range(5): step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(30): step(i)
    host = (time.perf_counter() - t0) / 30 * 1e3
    torch.cuda.synchronize()
    b2b = (time.perf_counter() - t0) / 30 * 1e3
    turn = iter(range(100))
    synced = timer(lambda: step(next(turn)), 0, 30, True)
    print(f"wrapped={wrap}: back to back {b2b:.2f} ms/step (host enqueue {host:.2f}), synchronized per step {synced:.2f} ms", flush=True)
    if hd: hd.remove()
