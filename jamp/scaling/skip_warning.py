"""``jamp.SkippedStepsWarning``: the scaler says so when steps keep being skipped, from inside the jitted step.

torch's GradScaler says nothing when every step overflows: one NaN in the data, and each step is skipped,
the scale halves down to 1.4e-45 and the parameters never move. A scale that keeps backing off cannot cure
an inf/NaN that does not come from the scale, so jamp tells the user, once per episode:

* a *run of skips*: ``warn_after_skips`` updates skipped in a row (default 32: twice the 16 halvings that
  take torch's initial 2**16 to 1, more than any calibration of the scale needs), or
* a *fall*: a backoff that takes the scale below ``warn_below_scale`` (default 1.0, DeepSpeed's and Megatron's
  default floor: below it the scale shrinks the gradients instead of keeping them from underflowing). It
  catches skips too sparse to make a run (a NaN in one batch of fifty halves the scale every fifty steps:
  growth needs 2000 clean steps in a row).

The episode ends, and the warning re-arms, at the next update that is taken. Two state fields carry it
(``consecutive_skips``, ``warned``), so it works under ``jit``, ``vmap``, in loops and across checkpoints.

The host is called only when the warning fires: a ``jax.pure_callback`` under ``lax.cond``, whose result the
state keeps (so it is never dropped), and not ``jax.debug.callback``, whose effect sends every call of the
jitted step through Python dispatch instead of jit's C++ path (which made an Adam step on 50 leaves of
100,000 1.1-1.5 times slower on XLA:CPU). A finite step pays a few scalar operations and a conditional over
scalars (benchmarks/scaler_overhead.py times the step with and without the warning). Replicas (pmap,
shard_map) take the same decision and call the host with the same numbers; the host side of each scaler
does not repeat the warning it gave last, so they warn once.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jamp.scaling import state as scaler_state
from jamp.scaling.state import ScalerState

_INT32_MAX = np.int32(2**31 - 1)


class SkippedStepsWarning(UserWarning):
    """``jamp.scaler`` skipped many updates in a row, or its scale fell below ``warn_below_scale``.

    Silence it with ``jamp.scaler(..., warn_after_skips=None, warn_below_scale=None)`` (nothing left in the
    compiled step) or ``warnings.filterwarnings("ignore", category=jamp.SkippedStepsWarning)``.
    """


class Thresholds(NamedTuple):
    """When to warn; None turns that condition off. Static: changing them recompiles the step."""

    after_skips: int | None  # updates skipped in a row
    below_scale: np.float32 | None  # a backoff that takes the scale below this

    @property
    def enabled(self) -> bool:
        return self.after_skips is not None or self.below_scale is not None


def initial_fields() -> dict:
    """The fields of a fresh state: no skips yet, nothing reported."""
    return {"consecutive_skips": jnp.zeros((), jnp.int32), "warned": jnp.zeros((), jnp.bool_)}


def _bits(x: Any) -> jax.Array:
    """float32 bits as int32: for the positive scales they order as the floats do, subnormals included."""
    return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


class SkipWarning:
    """One scaler's skipped-steps warning: :meth:`track` on the device, :meth:`on_host` when it fires."""

    def __init__(self, warn_after_skips: Any, warn_below_scale: Any):
        """Validates the keywords of :func:`jamp.scaler` (TypeError/ValueError naming the argument)."""
        after = None if warn_after_skips is None else scaler_state.checked_int("warn_after_skips", warn_after_skips, 1)
        below = (
            None
            if warn_below_scale is None
            else np.float32(scaler_state.checked_float("warn_below_scale", warn_below_scale))
        )
        self.limits = Thresholds(after, below)
        self._last: str | None = None  # what the host said last
        self._lock = threading.Lock()  # replicas call from several threads

    def track(self, state: ScalerState, found_inf: jax.Array, new_scale: jax.Array) -> dict:
        """The new ``consecutive_skips`` and ``warned``; the host warns when an episode starts."""
        skips = jnp.where(found_inf, state.consecutive_skips + (state.consecutive_skips < _INT32_MAX), 0)
        limits = self.limits
        if not limits.enabled:
            return {"consecutive_skips": skips, "warned": jnp.zeros_like(state.warned)}
        long_run = jnp.bool_(False) if limits.after_skips is None else skips >= limits.after_skips
        if limits.below_scale is None:
            fell = jnp.bool_(False)
        else:
            floor = _bits(limits.below_scale)
            fell = (_bits(state.scale) >= floor) & (_bits(new_scale) < floor)
        warn = found_inf & ~state.warned & (long_run | fell)
        told = jax.lax.cond(warn, self._call_host, lambda w, *_: w, warn, skips, new_scale, fell)
        return {"consecutive_skips": skips, "warned": found_inf & (state.warned | told)}

    def _call_host(self, warn: jax.Array, skips: jax.Array, scale: jax.Array, fell: jax.Array) -> jax.Array:
        return jax.pure_callback(
            self.on_host, jax.ShapeDtypeStruct((), jnp.bool_), warn, skips, scale, fell, vmap_method="sequential"
        )

    def on_host(self, warn: np.ndarray, skips: np.ndarray, scale: np.ndarray, fell: np.ndarray) -> np.ndarray:
        """Warns unless this is what the host said last (another replica's call); returns ``warn``. Under
        ``vmap`` the conditional runs both branches, so ``warn`` is checked here too."""
        if warn:
            said = message(int(skips), float(scale), bool(fell), self.limits)
            with self._lock:
                repeat, self._last = said == self._last, said
            if not repeat:
                warnings.warn(said, SkippedStepsWarning, stacklevel=1)
        return np.asarray(warn, np.bool_)


def message(skips: int, scale: float, fell: bool, limits: Thresholds) -> str:
    """What the warning says: what happened, the likely causes, where to look, how to silence it."""
    if fell:
        what = (
            f"the loss scale fell below {float(limits.below_scale):g} (warn_below_scale) to {scale:g}, "
            f"{skips} update(s) skipped in a row because the scaled gradients held inf/NaN"
        )
    else:
        what = (
            f"{skips} updates in a row were skipped because the scaled gradients held inf/NaN; the parameters "
            f"and the optimizer state have not changed since, and the loss scale is down to {scale:g}"
        )
    return (
        f"jamp.scaler: {what}. Backing off further does not help when the inf/NaN does not come from the scale. "
        "Likely causes: a NaN/inf in the input data or in the loss, an op that overflows even in float32 (exp, a "
        "sum of squares, a division by ~0), or parameters blown up by too large a learning rate. "
        "jamp.find_overflow(loss_fn)(params, batch) names the first op that overflows in float16 where float32 "
        "stays finite; if it returns None, float32 overflows too: check jnp.isfinite on the batch, the loss and "
        "the parameters. Warned once per run of skips; silence it with jamp.scaler(..., warn_after_skips=None, "
        "warn_below_scale=None) or warnings.filterwarnings('ignore', category=jamp.SkippedStepsWarning)."
    )
