"""lpoptim: low-bit full-parameter transformer training (FP8 optimizer states, FP8 activations, low-bit GEMMs)."""
from .optim import AdamW, state_bytes

__all__ = ["AdamW", "state_bytes"]
__version__ = "0.1.0"
