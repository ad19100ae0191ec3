"""lpoptim: low-bit full-parameter transformer training.

    opt = lpoptim.prepare(model, lr=3e-4, weight_decay=0.1)              # all of it, chosen for this device
    # or piece by piece:
    opt = lpoptim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)   # FP8 moments, replaces torch.optim.AdamW
    lpoptim.compress_activations(model.layers)                          # saved activations in FP8
    lpoptim.offload_activations(model.layers, 12)                       # or in host memory (the first 12 blocks')
    lpoptim.convert_linears(model, recipe="fp8")                        # or "fp4", "int4": low-bit GEMMs
"""
from .activations import compress_activations, offload_activations, restore_activations
from .nn import LowBitLinear, convert_linears
from .optim import AdamW, state_bytes, step_in_backward
from .planner import prepare

__all__ = ["prepare", "AdamW", "state_bytes", "step_in_backward", "compress_activations", "restore_activations", "offload_activations", "convert_linears", "LowBitLinear"]
__version__ = "0.1.0"
