import os

import pytest
import torch

# Triton kernels run under the interpreter where there is no GPU. It must be set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def interpreter_friendly_tiles(monkeypatch):
    """The fused AdamW kernel's launch settings for the interpreter, which pays per program: on the CPU a few
    large tiles (the GPU keeps its tuned ones); the module's own settings are left as they are."""
    from lpoptim.kernels import adamw_step as kernel

    if not torch.cuda.is_available():
        friendly = dict(block_groups=16, num_warps=4, loop=1, stages=1)
        monkeypatch.setattr(kernel, "TUNING", {k: friendly for k in kernel.TUNING})
