"""kernels/launch.py: the cached launcher gives what an ordinary Triton launch gives, and never reuses a kernel
compiled for other argument properties (alignment, integer divisibility, dtypes, constexprs)."""
import pytest
import torch

from lpoptim.kernels import launch
from lpoptim.kernels.linear_quant import finite_absmax
from lpoptim.quant import finite_absmax as reference_absmax


def test_spec_separates_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.float32)

    def spec(a):
        return launch._spec((a,))

    assert spec(x) != spec(x[1:])            # 16-byte aligned or not
    assert spec(x) != spec(x.to(torch.bfloat16))
    assert spec(x) == spec(x[4:])            # 16 bytes further: aligned too
    assert spec(torch.nn.Parameter(x)) == spec(x)
    assert spec(1) != spec(17)               # equal to one
    assert spec(16) != spec(17)              # divisible by 16
    assert spec(16) != spec(16 << 32)        # 32 or 64 bits
    assert spec(True) != spec(False) and spec(True) != spec(1)
    assert spec(2.0) == spec(3.0)            # floats are not specialized


def test_absmax_through_the_launcher():
    x = torch.randn(40, 72, device="cuda" if torch.cuda.is_available() else "cpu")  # the interpreter on the CPU
    x[3, 5] = -7.5
    x[4, 6] = float("inf")  # not finite: ignored
    for t in (x, x[1:, 1:], x.t(), x.to(torch.bfloat16)):  # aligned and not, strided, another dtype
        for _ in range(2):  # the second launch takes the cached kernel on a GPU
            assert finite_absmax(t).item() == reference_absmax(t.float()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_launch_matches_ordinary_launch_on_gpu():
    from lpoptim.kernels.linear_quant import _finite_absmax_kernel
    run = launch.launcher(_finite_absmax_kernel)
    assert run.fast, "the absmax kernel's constexprs follow its runtime arguments"
    x = torch.randn(300, 520, device="cuda", dtype=torch.bfloat16)
    before = len(run.cache)
    for view, want in ((x, x.abs().max()), (x[:, 3:], x[:, 3:].abs().max()), (x[7:], x[7:].abs().max())):
        for _ in range(3):
            got = finite_absmax(view)
            assert got.item() == want.float().item()
    assert len(run.cache) > before  # the cached path was taken (and keyed apart for the unaligned views)
