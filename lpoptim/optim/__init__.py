from .adamw import AdamW
from .in_backward import step_in_backward
from .state import state_bytes

__all__ = ["AdamW", "state_bytes", "step_in_backward"]
