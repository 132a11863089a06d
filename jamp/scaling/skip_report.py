"""``jamp.SkippedStepsWarning``: the host reports the skip episodes it reads off the scaler's state.

The step only counts episodes (:mod:`jamp.scaling.skip_episodes`); nothing in it calls the host. A host
callback in a jitted step takes every call of it off JAX's C++ dispatch path (an AOT-compiled small Adam step
ran 4.9x slower with one), and the ``lax.cond`` around it made a GPU read its predicate on the host every
step. Instead the host looks at the state when JAX flattens it, which it does each time the state is passed
to the next step, and as a jitted step's first call (its cache miss) returns it (``ScalerState`` is registered
as a pytree node whose flatten does that look, see :func:`observe`):

* it never waits: it reads only arrays the device has finished, and an array donated meanwhile is skipped;
* it stays cheap: a read is a few scalars, and after a read the host waits 100 times that read's duration
  before the next (:data:`READ_BUDGET`), so it spends at most about 1% of a run reading, on any step size;
* it misses nothing: ``skip_episodes`` only grows, so a state read later still shows an earlier episode.

So the warning comes from the host a step or a few after the episode starts, in the thread that dispatches
the next step (a ``-W error`` filter raises it there, as a ``jamp.SkippedStepsWarning`` an ``except`` can
catch). A loop that never lets the host catch up with the device (pure run-ahead on a GPU) is reported the
next time it reads anything back, or by :func:`report_skipped_steps`.

Each ``jamp.scaler(...)`` gets a number in creation order (``ScalerState.scaler_id``), by which the host
finds its thresholds and what it already reported; a checkpoint restored into a process that creates its
scalers in the same order keeps its scaler's number. ``tx.init`` starts the record afresh.
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np

from jamp.scaling.skip_episodes import Thresholds
from jamp.scaling.state import ScalerState, all_states

# After a read of duration d the host waits d / READ_BUDGET before the next one.
READ_BUDGET = 0.01

_NUMBERS = itertools.count(1)
_REPORTERS: dict[int, Reporter] = {}  # kept for the process: a state may outlive its scaler (a few bytes each)
_LOCK = threading.Lock()  # states are flattened from several threads (pmap replicas, data loaders)
_PENDING: collections.deque = collections.deque(maxlen=8)  # (when, fields) of states seen since the last read
_next_read = 0.0  # time.perf_counter() before which the host does not read
# Packages whose frames a warning skips, so that it points at the user's line that dispatched the step.
_LIBRARIES = ("jamp", "jax", "jaxlib", "flax", "equinox", "optax", "orbax", "chex")


class SkippedStepsWarning(UserWarning):
    """``jamp.scaler`` skipped many updates in a row, or its scale fell below ``warn_below_scale``.

    The host warns once per episode (a run of skips that reached ``warn_after_skips`` or took the scale
    below ``warn_below_scale``), a step or a few after it starts, from the call that dispatches the next
    step, or at once from :func:`jamp.report_skipped_steps`. The message says what happened, the likely
    causes and how to find the op (:func:`jamp.find_overflow`). A ``-W error`` filter raises it there, so
    ``except jamp.SkippedStepsWarning:`` can stop a run.

    Silence it with ``jamp.scaler(..., warn_after_skips=None, warn_below_scale=None)`` or
    ``warnings.filterwarnings("ignore", category=jamp.SkippedStepsWarning)``.

    Examples:
        >>> import warnings, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1), warn_after_skips=1)
        >>> opt_state = tx.init(params)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always", jamp.SkippedStepsWarning)
        ...     _, opt_state = tx.update({"w": jnp.full(3, jnp.inf)}, opt_state, params)
        ...     jamp.report_skipped_steps(opt_state)
        >>> kind = jamp.SkippedStepsWarning
        >>> [w.category.__name__ for w in caught if issubclass(w.category, kind)]
        ['SkippedStepsWarning']
    """


class Reporter:
    """The host side of one ``jamp.scaler``: its number, its thresholds and the episodes it has reported."""

    def __init__(self, limits: Thresholds | None, number: int):
        self.limits, self.number = limits, number
        self.reported: dict[int, int] = {}  # element of the state (vmap/pmap/per-device) -> episodes reported
        self.started = 0.0  # when tx.init started the run: states seen before belong to an earlier one
        _REPORTERS[number] = self

    @classmethod
    def new(cls, limits: Thresholds) -> Reporter:
        """The reporter of a new ``jamp.scaler``, with the next number."""
        with _LOCK:
            return cls(limits, next(_NUMBERS))

    def start(self) -> np.int32:
        """Called by ``tx.init``: a new run, nothing reported yet. Returns the number for ``scaler_id``."""
        self.reported, self.started = {}, time.perf_counter()
        return np.int32(self.number)


def _reporter(number: int) -> Reporter:
    """The reporter of scaler ``number``; one without thresholds for a state made by no scaler of this process."""
    found = _REPORTERS.get(number)
    return found if found is not None else Reporter(None, number)


def _concrete(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _readable(x: jax.Array) -> bool:
    return not x.is_deleted() and x.is_ready()


def _host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.ravel(np.asarray(x))
    return np.concatenate([np.ravel(np.asarray(s.data)) for s in x.addressable_shards])


def _fields(state: ScalerState) -> tuple:
    return state.scaler_id, state.skip_episodes, state.consecutive_skips, state.scale


def observe(state: ScalerState) -> None:
    """The host's look at a state JAX flattens: remember it if it is concrete, and read what is ready if the
    read budget allows. Never blocks on the device."""
    global _next_read
    fields = _fields(state)
    if not all(map(_concrete, fields)):
        return
    with _LOCK:
        start = time.perf_counter()
        _PENDING.append((start, fields))
        if start < _next_read:
            return
        ready = [(seen, f) for seen, f in _PENDING if all(map(_readable, f))]
        if not ready:
            return
        _PENDING.clear()
        values = [(seen, *map(_host, f)) for seen, f in ready]
        _next_read = start + (time.perf_counter() - start) / READ_BUDGET
    _report(values)


def report_skipped_steps(opt_state: Any) -> None:
    """Reads every scaler state in ``opt_state`` now and warns for episodes not reported yet.

    The host reports skip episodes by itself when it passes the state to a later step; this does it at once,
    waiting for the device (a host sync): at the end of a run, or before deciding to stop one.

    Args:
        opt_state: an optimizer state holding ``jamp.scaler`` states anywhere inside (concrete arrays, not
            inside ``jax.jit``).

    Returns:
        None. Warns :class:`jamp.SkippedStepsWarning` once for each episode not reported yet.

    Examples:
        >>> import jax.numpy as jnp, optax, jamp
        >>> tx = jamp.scaler(optax.adam(1e-3))
        >>> opt_state = tx.init({"w": jnp.ones(3)})
        >>> jamp.report_skipped_steps(opt_state)  # nothing skipped: no warning
    """
    states = [s for s in all_states(opt_state) if isinstance(s, ScalerState)]
    for state in states:
        if not all(map(_concrete, _fields(state))):
            raise TypeError(
                "jamp.report_skipped_steps reads the state to the host: call it outside jax.jit, on the state "
                "a jitted step returned"
            )
    now = time.perf_counter()
    _report([(now, *map(_host, _fields(s))) for s in states])


def _report(values: list[tuple]) -> None:
    said = []
    for seen, numbers, episodes, skips, scales in values:
        for i, (number, count, skipped, scale) in enumerate(zip(numbers, episodes, skips, scales)):
            reporter = _reporter(int(number))
            if seen < reporter.started:
                continue
            if count > reporter.reported.get(i, 0):
                said.append(
                    message(int(skipped), float(scale), reporter.limits, int(count) - reporter.reported.get(i, 0))
                )
            reporter.reported[i] = max(int(count), reporter.reported.get(i, 0))
    for text in dict.fromkeys(said):  # replicas of one decision say the same
        warnings.warn(text, SkippedStepsWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside jamp and the libraries that dispatch a step."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    return level


def message(skips: int, scale: float, limits: Thresholds | None, episodes: int = 1) -> str:
    """What the warning says: what happened, the likely causes, where to look, how to silence it."""
    after, below = "warn_after_skips", "warn_below_scale"
    if limits is not None:
        after += "" if limits.after_skips is None else f"={limits.after_skips}"
        below += "" if limits.below_scale is None else f"={float(limits.below_scale):g}"
    fell = limits is not None and limits.below_scale is not None and scale < limits.below_scale
    if skips:
        what = (
            f"{skips} update(s) in a row were skipped because the scaled gradients held inf/NaN; the parameters "
            f"and the optimizer state have not changed since, and the loss scale is down to {scale:g}"
        )
        what += f", below {below}" if fell else ""
    else:
        what = (
            f"a run of updates skipped because the scaled gradients held inf/NaN reached {after} or took the "
            f"loss scale below {below}; it has ended (the last update was taken) and the scale is {scale:g}"
        )
    if episodes > 1:
        what += f" ({episodes} such episodes since the last report)"
    return (
        f"jamp.scaler: {what}. Backing off further does not help when the inf/NaN does not come from the scale. "
        "Likely causes: a NaN/inf in the input data or in the loss, an op that overflows even in float32 (exp, a "
        "sum of squares, a division by ~0), or parameters blown up by too large a learning rate. "
        "jamp.find_overflow(jax.value_and_grad(loss_fn), device_type=..., dtype=...)(params, batch), given the "
        "policy arguments your jamp.autocast has, names the first op, forward or backward, whose low-precision "
        "result is inf/NaN where float32's is finite. If it returns None, that policy does not overflow where "
        "float32 does not: evaluate loss_fn without jamp.autocast and check jnp.isfinite on the batch, the loss "
        "and the parameters. Warned once per episode; silence it with jamp.scaler(..., warn_after_skips=None, "
        "warn_below_scale=None) or warnings.filterwarnings('ignore', category=jamp.SkippedStepsWarning)."
    )


_KEYS = tuple(jax.tree_util.GetAttrKey(name) for name in ScalerState._fields)


def _flatten(state: ScalerState) -> tuple[tuple, None]:
    observe(state)
    return tuple(state), None


def _flatten_with_keys(state: ScalerState) -> tuple[tuple, None]:
    observe(state)
    return tuple(zip(_KEYS, state)), None


# ScalerState stays a NamedTuple (same fields, key paths and equality); its flatten also does the host's look.
jax.tree_util.register_pytree_with_keys(
    ScalerState, _flatten_with_keys, lambda _, children: ScalerState(*children), _flatten
)
