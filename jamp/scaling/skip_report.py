"""The skipped-steps report, on explicit reads: ``jamp.report_skipped_steps``, ``jamp.scaler_summary`` and
``jamp.get_scale`` on a concrete state, as checkify's ``err.throw()``.

The step only counts episodes (:mod:`jamp.scaling.skip_episodes`): no callback, no conditional, nothing on
the host. The state stays an inert NamedTuple (flattening, ``tree_map``, ``eval_shape``, pickling and
checkpointing do nothing else), and what a read says is a function of the state it reads: no record on the
host, no scaler identity. A loop that logs the scale (torch users log ``scaler.get_scale()``) or a summary is
told while an episode is under way, at its own logging line; :func:`report_skipped_steps` also reports the
episodes that have ended (at the end of a run, or before deciding to stop one). The same state read twice
says the same words, which Python's default warnings filter shows once per line.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp.scaling import state as scaler_state
from jamp.scaling.state import ScalerState


class SkippedStepsWarning(UserWarning):
    """``jamp.scaler`` skipped many updates in a row, or its scale fell below ``warn_below_scale``.

    Given by the reads a training loop makes, never by the step: :func:`jamp.get_scale` and
    :func:`jamp.scaler_summary` on a concrete state warn while an episode is under way (a run of skips that
    reached ``warn_after_skips`` or took the scale below ``warn_below_scale``); :func:`jamp.report_skipped_steps`
    warns for every state that has had an episode. The message says where in the optimizer state the scaler
    sits, the counts, the likely causes and how to find the op (:func:`jamp.find_overflow`). A ``-W error``
    filter raises it at that read, so ``except jamp.SkippedStepsWarning:`` can stop a run.

    Silence it with ``jamp.scaler(..., warn_after_skips=None, warn_below_scale=None)`` (the state then counts
    no episode) or ``warnings.filterwarnings("ignore", category=jamp.SkippedStepsWarning)``.

    Examples:
        >>> import warnings, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.sgd(0.1), warn_after_skips=1)
        >>> opt_state = tx.init(params)
        >>> _, opt_state = tx.update({"w": jnp.full(3, jnp.inf)}, opt_state, params)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always", jamp.SkippedStepsWarning)
        ...     scale = float(jamp.get_scale(opt_state))  # the read a loop logs
        >>> [w.category.__name__ for w in caught]
        ['SkippedStepsWarning']
    """


def _array(x: Any) -> Any:
    """``x`` as an array: a framework's box of one (an ``nnx.Optimizer``'s state variables) through the
    ``__jax_array__`` protocol that ``jnp.asarray`` follows; arrays as they are."""
    return x if isinstance(x, (jax.Array, np.ndarray, np.generic)) else jnp.asarray(x)


def is_concrete(x: Any) -> bool:
    """An array whose values the host can read: a JAX array outside a trace, or a NumPy one (or a box of one)."""
    x = _array(x)
    return isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


_FIELDS = ("scale", "found_inf", "consecutive_skips", "warned", "skip_episodes", "warn_after_skips", "warn_below_scale")


def _values(x: Any) -> np.ndarray:
    """``x`` on the host, flat; of an array spread over processes, the shards this process holds."""
    x = _array(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.concatenate([np.ravel(np.asarray(s.data)) for s in x.addressable_shards])
    return np.ravel(np.asarray(x))


def _host(state: ScalerState) -> dict[str, np.ndarray]:
    """The report's fields of a concrete state on the host, each flat (one element per replica)."""
    return {name: _values(getattr(state, name)) for name in _FIELDS}


def _states_with_paths(opt_state: Any) -> list[tuple[str, ScalerState]]:
    flat = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=scaler_state.is_scaler_state)[0]
    return [(f"opt_state{jax.tree_util.keystr(p)}", s) for p, s in flat if isinstance(s, ScalerState)]


def _refuse_traced(call: str, states: list[tuple[str, ScalerState]]) -> None:
    for where, state in states:
        if not all(is_concrete(getattr(state, name)) for name in _FIELDS):
            raise TypeError(
                f"{call} reads the scaler state at {where} to the host: call it outside jax.jit, on the state a "
                "jitted step returned (or its host copy)"
            )


def warn_if_in_episode(opt_state: Any, state: ScalerState, stacklevel: int) -> None:
    """Warn when ``state``, the scaler state found in ``opt_state``, is concrete and in an episode now; a traced
    state is never read."""
    if all(is_concrete(getattr(state, name)) for name in _FIELDS):
        fields = _host(state)
        if fields["warned"].any():
            (where,) = [w for w, s in _states_with_paths(opt_state) if s is state]
            _warn(message(where, fields), stacklevel + 1)


def report_skipped_steps(opt_state: Any) -> None:
    """Warns for every scaler state in ``opt_state`` that has had a skip episode, naming where it sits.

    An explicit read, as checkify's ``err.throw()``: it waits for the device and reads a few scalars of each
    state. Call it at the end of a run, or every few hundred steps before deciding to stop one. Episodes that
    have ended are reported too (``jamp.get_scale`` and ``jamp.scaler_summary`` warn only while one is under
    way). A silenced scaler (``warn_after_skips=None, warn_below_scale=None``) counts no episode, so it says
    nothing. Works on host copies of the state (NumPy leaves) and on several states of one ``tx`` in a tree.

    Args:
        opt_state: an optimizer state holding ``jamp.scaler`` states anywhere inside (concrete arrays, not
            inside ``jax.jit``).

    Returns:
        None. Warns :class:`jamp.SkippedStepsWarning` once for each state that has had an episode.

    Raises:
        TypeError: inside ``jax.jit`` (the state is traced there).

    Examples:
        >>> import jax.numpy as jnp, optax, jamp
        >>> tx = jamp.scaler(optax.adam(1e-3))
        >>> opt_state = tx.init({"w": jnp.ones(3)})
        >>> jamp.report_skipped_steps(opt_state)  # nothing skipped: no warning
    """
    states = _states_with_paths(opt_state)
    _refuse_traced("jamp.report_skipped_steps", states)
    for where, state in states:
        fields = _host(state)
        if fields["skip_episodes"].any():
            _warn(message(where, fields), stacklevel=2)


def _warn(text: str, stacklevel: int) -> None:
    warnings.warn(text, SkippedStepsWarning, stacklevel=stacklevel + 1)


def _count(values: np.ndarray, kind: type) -> str:
    """One replica's value, or every replica's when they differ (an ensemble under vmap or pmap)."""
    shown = [kind(v) for v in values]
    if len(set(shown)) == 1:
        return f"{shown[0]:g}" if kind is float else str(shown[0])
    return "[" + ", ".join(f"{v:g}" if kind is float else str(v) for v in shown) + "]"


def _thresholds(fields: dict) -> str:
    after, below = int(fields["warn_after_skips"][0]), float(fields["warn_below_scale"][0])
    return f"warn_after_skips={after if after else None}, warn_below_scale={f'{below:g}' if below else None}"


def message(where: str, fields: dict) -> str:
    """What the warning says about one state's report fields (as :func:`_host` reads them)."""
    skips, scale = fields["consecutive_skips"], fields["scale"]
    episodes = _count(fields["skip_episodes"], int)
    if fields["warned"].any():
        what = (
            f"{_count(skips, int)} update(s) in a row were skipped because the scaled gradients held inf/NaN; the "
            f"parameters and the optimizer state have not changed since, and the loss scale is down to "
            f"{_count(scale, float)} ({_thresholds(fields)}; skip episode(s) so far: {episodes})"
        )
    else:
        what = (
            f"{episodes} skip episode(s) so far (runs of updates skipped because the scaled gradients held "
            f"inf/NaN that reached {_thresholds(fields)}); none is under way now (the last update was taken) "
            f"and the loss scale is {_count(scale, float)}"
        )
    return (
        f"jamp.scaler at {where}: {what}. Backing off further does not help when the inf/NaN does not come from "
        "the scale. Likely causes: a NaN/inf in the input data or in the loss, an op that overflows even in "
        "float32 (exp, a sum of squares, a division by ~0), or parameters blown up by too large a learning rate. "
        "jamp.find_overflow(jax.value_and_grad(loss_fn), device_type=..., dtype=...)(params, batch), given the "
        "policy arguments your jamp.autocast has, names the first op, forward or backward, whose low-precision "
        "result is inf/NaN where float32's is finite. If it returns None, that policy does not overflow where "
        "float32 does not: evaluate loss_fn without jamp.autocast and check jnp.isfinite on the batch, the loss "
        "and the parameters. Silence it with jamp.scaler(..., warn_after_skips=None, warn_below_scale=None) or "
        "warnings.filterwarnings('ignore', category=jamp.SkippedStepsWarning)."
    )


def summary(opt_state: Any, stacklevel: int) -> dict[str, Any]:
    """:func:`jamp.scaler_summary`'s values (the one scaler state in ``opt_state``); warns while in an episode."""
    st = scaler_state.find(opt_state)
    if not isinstance(st, ScalerState):
        return {"scale": 1.0, "found_inf": False, "skipped_steps": 0, "skip_episodes": 0, "in_episode": False}
    _refuse_traced("jamp.scaler_summary", [(w, s) for w, s in _states_with_paths(opt_state) if s is st])
    warn_if_in_episode(opt_state, st, stacklevel + 1)
    fields = _host(st)
    one = np.ndim(_array(st.scale)) == 0

    def value(name: str, kind: type) -> Any:
        values = [kind(v) for v in fields[name]]
        return values[0] if one else values

    return {
        "scale": value("scale", float),
        "found_inf": value("found_inf", bool),
        "skipped_steps": value("consecutive_skips", int),
        "skip_episodes": value("skip_episodes", int),
        "in_episode": value("warned", bool),
    }
