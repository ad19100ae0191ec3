"""FP8 precision flow for activations: keep what autograd saves inside decoder blocks in FP8.

    handle = compress_activations(model.layers)              # saved tensors in FP8 (COAT's mixed granularity)
    handle = compress_activations(model.layers, recompute=True)  # only block inputs, in FP8; recompute in backward
    with handle.record() as stats: ...                       # what was saved, bytes by kind
    handle.remove()                                          # or restore_activations(model.layers)
    offload_activations(model.layers, 12)                    # the first 12 blocks' saved tensors in host memory

See docs/activations.md.
"""
from .codec import PackedActivation, pack, packed_nbytes
from .hooks import OpTracker, PackContext
from .offload import OffloadHandle, offload_activations
from .policy import ATTENTION_OPS, GEMM_OPS, ActivationPolicy
from .recompute import fp8_checkpoint
from .stats import SavedRecord, SavedStats, record_saved
from .wrap import ActivationHandle, compress_activations, is_wrapped, restore_activations

__all__ = [
    "compress_activations", "restore_activations", "offload_activations", "OffloadHandle", "is_wrapped", "ActivationHandle", "ActivationPolicy",
    "SavedStats", "SavedRecord", "record_saved", "PackedActivation", "pack", "packed_nbytes", "PackContext",
    "OpTracker", "fp8_checkpoint", "GEMM_OPS", "ATTENTION_OPS",
]
