"""Skip episodes, counted on the device: the part of ``jamp.SkippedStepsWarning`` that runs in the step.

torch's GradScaler says nothing when every step overflows: one NaN in the data, and each step is skipped,
the scale halves down to 1.4e-45 and the parameters never move. A scale that keeps backing off cannot cure
an inf/NaN that does not come from the scale, so jamp counts *episodes*, and the reads a training loop makes
(:func:`jamp.report_skipped_steps`, :func:`jamp.get_scale`, :func:`jamp.scaler_summary`: :mod:`jamp.scaling.skip_report`)
say so. An episode starts with whichever comes first:

* a *run of skips*: ``warn_after_skips`` updates skipped in a row (default 32: twice the 16 halvings that
  take torch's initial 2**16 to 1, more than any calibration of the scale needs), or
* a *fall*: a backoff that takes the scale below ``warn_below_scale`` (default 1.0, DeepSpeed's and Megatron's
  default floor: below it the scale shrinks the gradients instead of keeping them from underflowing). It
  catches skips too sparse to make a run (a NaN in one batch of fifty halves the scale every fifty steps:
  growth needs 2000 clean steps in a row).

It ends at the next update that is taken. The thresholds are state fields, as every other hyperparameter
(``warn_after_skips``, ``warn_below_scale``; 0 turns one off), and three more carry the count:
``consecutive_skips``, ``warned`` (this run of skips started an episode) and ``skip_episodes`` (episodes so
far, never reset, so a read now and then still sees each one). All of it is a few elementwise scalar operations:
no conditional, no callback, so the step stays one program on JAX's fast dispatch path and a GPU never waits
for the host; it works the same under ``jit``, ``vmap``, ``scan``, ``pmap`` and ``shard_map`` (per-device
state included) and across checkpoints.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp.scaling import state as scaler_state
from jamp.scaling.state import ScalerState

_INT32_MAX = np.int32(2**31 - 1)


def thresholds(warn_after_skips: Any, warn_below_scale: Any) -> dict:
    """The validated keywords of :func:`jamp.scaler` as the numpy values of their state fields (None: 0, off);
    TypeError/ValueError naming the argument."""
    after = 0 if warn_after_skips is None else scaler_state.checked_int("warn_after_skips", warn_after_skips, 1)
    below = 0.0 if warn_below_scale is None else scaler_state.checked_float("warn_below_scale", warn_below_scale)
    return {"warn_after_skips": np.int32(after), "warn_below_scale": np.float32(below)}


def initial_fields() -> dict:
    """The episode counters of a fresh state: no skips yet, no episode."""
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


def track(state: ScalerState, found_inf: jax.Array, new_scale: jax.Array) -> dict:
    """The new ``consecutive_skips``, ``warned`` and ``skip_episodes`` after an update that saw ``found_inf``
    and moved the scale to ``new_scale``, under the state's thresholds."""
    counted = _saturating_increment(state.consecutive_skips, found_inf)
    skips = jax.lax.select(found_inf, counted, jnp.zeros_like(counted))
    long_run = (state.warn_after_skips > 0) & (skips >= state.warn_after_skips)
    # a floor of 0 (off) has the bits 0, below which no positive scale falls
    floor = _bits(state.warn_below_scale)
    fell = (_bits(state.scale) >= floor) & (_bits(new_scale) < floor)
    starts = found_inf & ~state.warned & (long_run | fell)
    return {
        "consecutive_skips": skips,
        "warned": found_inf & (state.warned | starts),
        "skip_episodes": _saturating_increment(state.skip_episodes, starts),
    }
