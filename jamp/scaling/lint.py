"""``jamp.check_step``: the explicit lint for the traps only other libraries' internals reveal.

Three misuses train wrong without an error, and only optax's frames or JAX's tracers show them: gradients of
the unscaled loss, or gradients already divided by the scale, handed to ``tx.update``
(:mod:`jamp.scaling.unscaled_grads` walks the tracers); the scaler chained beside other transformations in
``optax.chain`` (:mod:`jamp.scaling.nesting` reads the chain's frame); and ``optax.MultiSteps`` around the
scaler on an optax whose accumulator an overflow poisons (decided by running optax once). A default path reads
none of that: a user runs the lint once, in a test or at start-up, as checkify's checks are asked for. It
traces the step (compiling nothing); while it does, ``tx.update`` notes what it got (:func:`note_update`,
which does nothing outside the lint).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jamp.scaling import nesting, unscaled_grads
from jamp.scaling.state import ScalerState
from jamp.scaling.unscaled_grads import UnscaledGradientsWarning

# The findings of the check_step under way (category, message), in this thread or task; None outside one.
_FINDINGS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jamp_check_step", default=None)


@contextlib.contextmanager
def _collecting() -> Iterator[list]:
    found: list = []
    token = _FINDINGS.set(found)
    try:
        yield found
    finally:
        _FINDINGS.reset(token)


def note_update(state: ScalerState, grads: Any) -> None:
    """Called by ``tx.update`` as it starts: under :func:`check_step`, what its caller and its gradients show;
    elsewhere nothing (one context-variable read)."""
    found = _FINDINGS.get()
    if found is None:
        return
    caller = sys._getframe(2)  # the frame that called tx.update (optax.chain's update, or the user's step)
    chain = nesting.chain_message(state, caller, grads)
    if chain:
        found.append((UserWarning, chain))
    unscaled = unscaled_grads.message(grads, state.scale)
    if unscaled:
        found.append((UnscaledGradientsWarning, unscaled))


def _fresh(step: Callable) -> Callable:
    """The Python function under ``jax.jit`` wrappers, in a new function object: JAX caches traces by function,
    and a step traced before would hit its cache, so that ``tx.update`` would not run for the lint."""
    while hasattr(step, "__wrapped__") and hasattr(step, "lower"):
        step = step.__wrapped__
    return lambda *args, **kwargs: step(*args, **kwargs)


def check_step(step: Callable, *args: Any, **kwargs: Any) -> list[str]:
    """Traces a training step once and says whether it uses the scaler in a way that trains wrong in silence.

    A lint to run once, in a test or at start-up, as checkify's checks are asked for: it reads optax's frames
    and JAX's tracers, which no default path of jamp does, and compiles nothing. It finds

    * gradients of a loss ``jamp.scale`` did not multiply, or gradients already divided by the scale
      (``jamp.unscale`` before ``tx.update``): :class:`jamp.UnscaledGradientsWarning`;
    * the scaler chained beside other transformations in ``optax.chain``: before it (a clip sees the scaled
      gradients), or after it with a state or moving a zero update (Adam's count, weight decay: they act on
      skipped steps); wrap them instead, ``jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3))``;
    * ``optax.MultiSteps(jamp.scaler(...), k)`` on an optax whose accumulator an overflow poisons.

    Each finding is warned (``UnscaledGradientsWarning`` or ``UserWarning``) and returned. The step is traced
    afresh (a jitted step traced before is unwrapped), but a ``tx.update`` inside another ``jax.jit`` that has
    been traced with the same arguments before hits JAX's cache and is not seen: run the lint first.

    Args:
        step: the training step, jitted or not: a function that calls ``tx.update`` of a ``jamp.scaler``.
        *args: its arguments (arrays, or ``jax.ShapeDtypeStruct`` leaves: nothing runs).
        **kwargs: its keyword arguments.

    Returns:
        The findings' messages; an empty list when the step uses the scaler as it should.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, jamp
        >>> params = {"w": jnp.ones(3)}
        >>> tx = jamp.scaler(optax.adam(1e-3))
        >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
        >>> def step(params, opt_state):
        ...     grads = jax.grad(lambda p: jamp.scale(loss_fn(p), opt_state))(params)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state
        >>> jamp.check_step(step, params, tx.init(params))
        []
    """
    with _collecting() as found:
        jax.make_jaxpr(_fresh(step))(*args, **kwargs)
    multisteps = nesting.multisteps_message((args, kwargs))
    if multisteps:
        found.append((UserWarning, multisteps))
    messages = list(dict.fromkeys(message for _, message in found))
    for category, message in dict.fromkeys(found):
        warnings.warn(message, category, stacklevel=2)
    return messages
