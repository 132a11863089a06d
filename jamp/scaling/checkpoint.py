"""torch GradScaler's ``state_dict``/``load_state_dict``: five keys with Python values, in torch's order.

A torch checkpoint's ``scaler.state_dict()`` loads into a jamp opt_state and vice versa. Only the five
keys travel; ``min_scale``/``max_scale`` (jamp extras) stay as the opt_state has them.

A replicated state (one per ``pmap`` replica, stacked on leading axes as ``jax.pmap(tx.init)`` makes it)
is one torch scaler per process: its state dict is the value every replica holds, and a loaded state
dict goes to every replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp.scaling import exact_mul
from jamp.scaling import state as scaler_state
from jamp.scaling.state import DisabledScalerState, ScalerState

KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_FIELDS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "growth_tracker")  # KEYS' fields


def _one_value(st: ScalerState, key: str, field: str) -> np.ndarray:
    """``field`` of a single state, or the value all replicas of a replicated state agree on."""
    replicas = np.shape(st.scale)
    value = np.asarray(getattr(st, field))
    if value.shape[: len(replicas)] != replicas:
        raise ValueError(
            f"the scaler state's {field} has shape {value.shape}, but its scale has shape {replicas}; "
            "a replicated state has the same leading replica axes on every field"
        )
    rows = value.reshape(-1, *value.shape[len(replicas) :])
    as_bytes = rows.reshape(len(rows), -1).view(np.uint8)  # bits, so that a NaN scale equals itself
    if not (as_bytes == as_bytes[0]).all():
        raise ValueError(
            f"the replicas hold different values of {key!r}, and a state dict holds one; pass "
            "one replica's state: jamp.state_dict(jax.tree.map(lambda x: x[0], opt_state))"
        )
    return rows[0]


def state_dict(opt_state: Any) -> dict[str, float | int]:
    """The scaler's five torch keys as Python numbers (``{}`` when disabled). Call it outside ``jit``.

    torch's ``scaler.state_dict()``: ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``
    and ``_growth_tracker``, in torch's order, so that it loads into a torch ``GradScaler`` and a torch
    checkpoint's scaler loads into jamp (:func:`load_state_dict`). ``min_scale``/``max_scale`` (jamp
    extras) are not in it. A replicated state gives the values every replica holds.

    Args:
        opt_state: the optimizer state that holds the ``jamp.scaler`` state, anywhere inside it, with
            concrete values (not inside ``jax.jit``).

    Returns:
        A dict of the five keys: floats for ``scale``, ``growth_factor`` and ``backoff_factor``, ints for
        ``growth_interval`` and ``_growth_tracker``; ``{}`` when the scaler is disabled.

    Raises:
        TypeError: inside ``jax.jit`` (or another transformation), where the values are traced.
        ValueError: when the replicas of a replicated state hold different values, or ``opt_state`` holds no
            scaler state or more than one.

    Examples:
        >>> import pprint, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> pprint.pp(jamp.state_dict(opt_state))  # one key a line, in order
        {'scale': 65536.0,
         'growth_factor': 2.0,
         'backoff_factor': 0.5,
         'growth_interval': 2000,
         '_growth_tracker': 0}
    """
    st = scaler_state.find(opt_state)
    if isinstance(st, DisabledScalerState):
        return {}
    if any(isinstance(getattr(st, field), jax.core.Tracer) for field in _FIELDS):
        raise TypeError(
            "jamp.state_dict(opt_state) was called inside jax.jit (or another JAX transformation): it reads the "
            "scaler's values to the host and returns Python numbers, as torch's scaler.state_dict() does, and a "
            "traced value has none yet. Call it outside, on the opt_state the jitted step returned: "
            "sd = jamp.state_dict(opt_state). Inside the step, jamp.get_scale(opt_state) and "
            "jamp.found_inf(opt_state) give the scale and the skip flag as traced arrays"
        )
    v = {key: _one_value(st, key, field) for key, field in zip(KEYS, _FIELDS)}
    return {
        "scale": float(v["scale"]),
        "growth_factor": exact_mul.from_words(v["growth_factor"]),
        "backoff_factor": exact_mul.from_words(v["backoff_factor"]),
        "growth_interval": int(v["growth_interval"]),
        "_growth_tracker": int(v["_growth_tracker"]),
    }


def load_state_dict(opt_state: Any, sd: Mapping[str, Any]) -> Any:
    """A new opt_state whose scaler takes ``sd``'s values (a no-op when disabled, as torch).

    torch's ``scaler.load_state_dict(sd)``, returning the new state instead of mutating. Every value is
    validated as the constructor validates it (``scale`` as ``init_scale``) before anything is built, so a
    refused state dict changes nothing. The scale is rounded to float32 as torch's ``fill_`` does. Extra
    keys are ignored. A replicated state gets the values on every replica. The values are arrays in the
    state, so a jitted step that takes the new state does not recompile.

    Args:
        opt_state: the optimizer state that holds the ``jamp.scaler`` state, anywhere inside it.
        sd: a mapping with torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, ``_growth_tracker``) holding Python numbers: what :func:`state_dict` or
            torch's ``scaler.state_dict()`` returned.

    Returns:
        A new ``opt_state`` (``opt_state`` itself when the scaler is disabled).

    Raises:
        TypeError: when ``sd`` is not a mapping, a value is not a number or is traced (inside ``jax.jit``),
            or the arguments are swapped.
        ValueError: when ``sd`` is empty (saved from a disabled scaler) or lacks a key, a value is out of
            range, or ``opt_state`` holds no scaler state or more than one.

    Examples:
        >>> import jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1))
        >>> opt_state = tx.init(params)
        >>> sd = {**jamp.state_dict(opt_state), "scale": 1024.0}
        >>> opt_state = jamp.load_state_dict(opt_state, sd)
        >>> jamp.get_scale(opt_state)
        Array(1024., dtype=float32)
    """
    scaler_state.refuse_swapped(
        opt_state, sd, "jamp.load_state_dict(sd, opt_state)", "jamp.load_state_dict(opt_state, sd)"
    )
    st = scaler_state.find(opt_state)
    if isinstance(st, DisabledScalerState):
        return opt_state
    if not isinstance(sd, Mapping):
        raise TypeError(f"the state dict must be a mapping (dict) with the keys {KEYS}, got {type(sd).__name__}")
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
    fields["scale"] = scaler_state.f32(scaler_state.checked_float("scale", sd["scale"]))
    fields["growth_tracker"] = np.int32(scaler_state.checked_int("_growth_tracker", sd["_growth_tracker"], 0))
    replicated = {k: jnp.broadcast_to(v, jnp.shape(getattr(st, k))) for k, v in scaler_state.as_arrays(fields).items()}
    return scaler_state.replace(opt_state, st._replace(**replicated))
