from .adamw import AdamW
from .state import state_bytes

__all__ = ["AdamW", "state_bytes"]
