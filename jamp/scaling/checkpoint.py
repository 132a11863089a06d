"""torch GradScaler's ``state_dict``/``load_state_dict``: five keys with Python values, in torch's order.

A torch checkpoint's ``scaler.state_dict()`` loads into a jamp opt_state and vice versa. Only the five
keys travel; ``min_scale``/``max_scale`` (jamp extras) stay as the opt_state has them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jamp.scaling import exact_mul
from jamp.scaling import state as scaler_state
from jamp.scaling.state import DisabledScalerState

KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def state_dict(opt_state: Any) -> dict[str, float | int]:
    """The scaler's five torch keys as Python numbers (``{}`` when disabled). Call it outside ``jit``."""
    st = scaler_state.find(opt_state)
    if isinstance(st, DisabledScalerState):
        return {}
    return {
        "scale": float(st.scale),
        "growth_factor": exact_mul.from_words(st.growth_factor),
        "backoff_factor": exact_mul.from_words(st.backoff_factor),
        "growth_interval": int(st.growth_interval),
        "_growth_tracker": int(st.growth_tracker),
    }


def load_state_dict(opt_state: Any, sd: dict[str, Any]) -> Any:
    """A new opt_state whose scaler takes ``sd``'s values (a no-op when disabled, as torch).

    The factors and interval are validated as the constructor validates them; the scale is loaded as
    torch's ``fill_`` does, rounded to float32 and not range-checked. Extra keys are ignored.
    """
    st = scaler_state.find(opt_state)
    if isinstance(st, DisabledScalerState):
        return opt_state
    if not sd:
        raise ValueError(
            "the state dict is empty; it was probably saved from a disabled scaler "
            "(torch.amp.GradScaler(enabled=False) and jamp.scaler(enabled=False) save {})"
        )
    missing = [k for k in KEYS if k not in sd]
    if missing:
        raise ValueError(f"the state dict has no key {missing[0]!r} (GradScaler state dicts have keys {KEYS})")
    fields = scaler_state.torch_hyperparams(
        growth_factor=sd["growth_factor"],
        backoff_factor=sd["backoff_factor"],
        growth_interval=sd["growth_interval"],
    )
    fields["scale"] = scaler_state.f32(scaler_state.real("scale", sd["scale"]))
    fields["growth_tracker"] = np.int32(scaler_state.checked_int("_growth_tracker", sd["_growth_tracker"], 0))
    return scaler_state.replace(opt_state, st._replace(**scaler_state.as_arrays(fields)))
