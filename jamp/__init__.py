"""jamp: automatic mixed precision for JAX (torch.amp's autocast and GradScaler, the JAX way)."""

from jamp.autocast import autocast, custom_fwd
from jamp.explain import Report, explain
from jamp.find_overflow import Finding, find_overflow
from jamp.policy import Policy, get_policy

# --- scaler (jamp/scaler.py) ---
from jamp.scaler import scaler
from jamp.scaler_helpers import found_inf, get_scale, scale, set_scale, value_and_grad
from jamp.scaler_state import DisabledScalerState, ScalerState
from jamp.state_dict import load_state_dict, state_dict
# --- end scaler ---

__all__ = [
    "Finding",
    "Policy",
    "Report",
    "autocast",
    "custom_fwd",
    "explain",
    "find_overflow",
    "get_policy",
    # --- scaler names ---
    "DisabledScalerState",
    "ScalerState",
    "found_inf",
    "get_scale",
    "load_state_dict",
    "scale",
    "scaler",
    "set_scale",
    "state_dict",
    "value_and_grad",
    # --- end scaler names ---
]
