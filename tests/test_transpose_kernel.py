"""kernels/transpose.py against torch's transposed copy (Triton's interpreter on the CPU, the kernel on CUDA)."""
import pytest
import torch

from lpoptim.kernels.transpose import transpose_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(5, 7), (128, 128), (130, 300), (1, 1), (0, 5), (300, 2)])
def test_transpose_bytes_is_torchs_transposed_copy(shape):
    x = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEVICE)
    for t in (x, x.view(torch.float8_e4m3fn)):
        y = transpose_bytes(t)
        assert y.dtype == t.dtype and y.is_contiguous()
        assert torch.equal(y.view(torch.uint8), x.t().contiguous())


def test_transpose_bytes_refuses_what_it_does_not_take():
    for bad in (torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.uint8).t(), torch.zeros(2, 2, 2, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="transpose_bytes"):
            transpose_bytes(bad)
