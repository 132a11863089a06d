"""jamp: automatic mixed precision for JAX (torch.amp's autocast and GradScaler, the JAX way)."""

from jamp.autocast import autocast, custom_fwd
from jamp.policy import Policy, get_policy

# --- scaler (jamp/scaler.py) ---
# --- end scaler ---

__all__ = [
    "Policy",
    "autocast",
    "custom_fwd",
    "get_policy",
    # --- scaler names ---
    # --- end scaler names ---
]
