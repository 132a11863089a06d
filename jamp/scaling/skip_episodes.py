"""Skip episodes, counted on the device: the part of ``jamp.SkippedStepsWarning`` that runs in the step.

torch's GradScaler says nothing when every step overflows: one NaN in the data, and each step is skipped,
the scale halves down to 1.4e-45 and the parameters never move. A scale that keeps backing off cannot cure
an inf/NaN that does not come from the scale, so jamp counts *episodes* and the host reports each one
(:mod:`jamp.scaling.skip_report`). An episode starts with whichever comes first:

* a *run of skips*: ``warn_after_skips`` updates skipped in a row (default 32: twice the 16 halvings that
  take torch's initial 2**16 to 1, more than any calibration of the scale needs), or
* a *fall*: a backoff that takes the scale below ``warn_below_scale`` (default 1.0, DeepSpeed's and Megatron's
  default floor: below it the scale shrinks the gradients instead of keeping them from underflowing). It
  catches skips too sparse to make a run (a NaN in one batch of fifty halves the scale every fifty steps:
  growth needs 2000 clean steps in a row).

It ends at the next update that is taken. Three state fields carry it: ``consecutive_skips``, ``warned`` (this
run of skips already started an episode) and ``skip_episodes`` (episodes so far, never reset, so a host that
looks at the state only now and then still sees each one). All of it is a few elementwise scalar operations:
no conditional, no callback, so the step stays one program on JAX's fast dispatch path and a GPU never waits
for the host; it works the same under ``jit``, ``vmap``, ``scan``, ``pmap`` and ``shard_map`` (per-device
state included) and across checkpoints.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jamp.scaling import state as scaler_state
from jamp.scaling.state import ScalerState

_INT32_MAX = np.int32(2**31 - 1)


class Thresholds(NamedTuple):
    """When an episode starts; None turns that condition off. Static: changing them recompiles the step."""

    after_skips: int | None  # updates skipped in a row
    below_scale: np.float32 | None  # a backoff that takes the scale below this

    @property
    def enabled(self) -> bool:
        return self.after_skips is not None or self.below_scale is not None


def thresholds(warn_after_skips: Any, warn_below_scale: Any) -> Thresholds:
    """The validated keywords of :func:`jamp.scaler` (TypeError/ValueError naming the argument)."""
    after = None if warn_after_skips is None else scaler_state.checked_int("warn_after_skips", warn_after_skips, 1)
    below = (
        None
        if warn_below_scale is None
        else np.float32(scaler_state.checked_float("warn_below_scale", warn_below_scale))
    )
    return Thresholds(after, below)


def initial_fields() -> dict:
    """The episode fields of a fresh state: no skips yet, no episode."""
    return {
        "consecutive_skips": jnp.zeros((), jnp.int32),
        "warned": jnp.zeros((), jnp.bool_),
        "skip_episodes": jnp.zeros((), jnp.int32),
    }


def _bits(x: Any) -> jax.Array:
    """float32 bits as int32: for the positive scales they order as the floats do, subnormals included."""
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def _saturating_increment(count: jax.Array, by: jax.Array) -> jax.Array:
    return count + (by & (count < _INT32_MAX)).astype(count.dtype)


def track(limits: Thresholds, state: ScalerState, found_inf: jax.Array, new_scale: jax.Array) -> dict:
    """The new ``consecutive_skips``, ``warned`` and ``skip_episodes`` after an update that saw ``found_inf``
    and moved the scale to ``new_scale``."""
    skips = jnp.where(found_inf, _saturating_increment(state.consecutive_skips, found_inf), 0)
    if not limits.enabled:
        return {
            "consecutive_skips": skips,
            "warned": jnp.zeros_like(state.warned),
            "skip_episodes": state.skip_episodes,
        }
    long_run = jnp.bool_(False) if limits.after_skips is None else skips >= limits.after_skips
    if limits.below_scale is None:
        fell = jnp.bool_(False)
    else:
        floor = _bits(limits.below_scale)
        fell = (_bits(state.scale) >= floor) & (_bits(new_scale) < floor)
    starts = found_inf & ~state.warned & (long_run | fell)
    return {
        "consecutive_skips": skips,
        "warned": found_inf & (state.warned | starts),
        "skip_episodes": _saturating_increment(state.skip_episodes, starts),
    }
