"""Two nestings of ``jamp.scaler`` in optax that train wrong without an error, and what :func:`jamp.check_step`
says of them (the lint reads optax's frames and runs optax: nothing here runs in a default path).

* ``optax.chain(optax.clip_by_global_norm(1.0), jamp.scaler(opt))``: what is chained *before* the scaler sees
  the scaled gradients (the clip bounds 65536 times the true norm, so every step is clipped to almost
  nothing; weight decay is divided by the scale; ``zero_nans`` hides the overflow the scaler skips on), and
  what is chained *after* it with a state (Adam, a schedule's count) advances on the steps the scaler skips, and
  a stateless one that does not map a zero update to zero (``add_decayed_weights``) moves the parameters on
  them.
  ``tx.update`` sees only its own state, so it recognises the chain by its caller: optax.chain's update
  function (by its code object, as ``transform._IDENTITY_UPDATE``), whose frame holds the chain's state tuple.
  A user's own tuple of states is never mistaken for a chain; a chain that optax builds some other way
  (``named_chain``) is not recognised.
* ``optax.MultiSteps(jamp.scaler(opt), k)``: MultiSteps accumulates the scaled gradients and, on optax 0.2.8,
  resets its accumulator with ``(1 - emit) * acc``: after a window whose gradients overflowed (expected
  while the scale calibrates) ``0 * inf`` leaves NaN there, every later window is skipped, and the
  parameters never move again. ``jamp.scale`` sees the whole opt_state, so it finds the scaler's state
  inside a ``MultiStepsState.inner_opt_state``; whether the installed optax still has the bug is decided by
  running it once (:func:`multisteps_keeps_an_overflow`), so the warning goes away with an optax that fixes it.

Each check returns the message (None when the nesting is right); :mod:`jamp.scaling.lint` warns with it.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jamp.scaling import state as scaler_state
from jamp.scaling.state import ScalerState

_CHAIN_UPDATE = optax.chain(optax.identity()).update.__code__  # every optax.chain's update shares this code
_WRAPPER = "with_extra_args_support"  # optax.chain wraps transformations without extra args in this


def _name(update: Any) -> str:
    """``clip_by_global_norm`` for the update function of ``optax.clip_by_global_norm(1.0)``; '...' if unknown."""
    qualname = getattr(update, "__qualname__", "")
    if qualname.startswith(_WRAPPER) and inspect.isfunction(update):
        tx = inspect.getclosurevars(update).nonlocals.get("tx")
        qualname = getattr(getattr(tx, "update", None), "__qualname__", "")
    name = qualname.split(".<locals>")[0].split(".")[0]
    return f"optax.{name}(...)" if name.isidentifier() and name not in (_WRAPPER, "chain") else "..."


def _moves_a_zero_update(update: Any, state: Any, updates: Any, params: Any) -> bool:
    """Whether a stateless transformation's ``update`` turns zero updates into nonzero ones (weight decay), on
    concrete zeros and ones of the gradients' shapes (params given: ``add_decayed_weights`` needs them)."""
    with jax.ensure_compile_time_eval():
        zeros = jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype), updates)
        ones = None if params is None else jax.tree.map(lambda p: jnp.ones(p.shape, p.dtype), params)
        try:
            out, _ = update(zeros, state, ones)
        except Exception:  # noqa: BLE001 (a transformation this probe cannot run is not judged)
            return False
        return any(bool(jnp.any(jnp.asarray(x) != 0)) for x in jax.tree.leaves(out))


def _chain_around(state: ScalerState, caller: types.FrameType | None, updates: Any) -> tuple[list, list] | None:
    """The names of what is chained before the scaler whose ``update`` got ``state`` from ``caller``, and after it
    with a state or moving a zero update, when ``caller`` is optax.chain's update; None otherwise."""
    if caller is None or caller.f_code is not _CHAIN_UPDATE:
        return None
    local = caller.f_locals
    chain_state = local.get(caller.f_code.co_varnames[1])  # update_fn(updates, state, params, ...)
    at = [i for i, s in enumerate(chain_state or ()) if s is state]
    if len(at) != 1:
        return None
    fns = local.get("update_fns")
    known = fns is not None and len(fns) == len(chain_state)
    names = [_name(f) for f in fns] if known else ["..."] * len(chain_state)
    (i,) = at
    after = [
        n
        for j, (n, s) in enumerate(zip(names[i + 1 :], chain_state[i + 1 :]), start=i + 1)
        if jax.tree.leaves(s) or (known and _moves_a_zero_update(fns[j], s, updates, local.get("params")))
    ]
    return names[:i], after


def chain_message(state: ScalerState, caller: types.FrameType | None, updates: Any) -> str | None:
    """What is wrong when ``tx.update`` was called by ``optax.chain`` with transformations before it, or after it
    with a state or one that moves a zero update (the module docstring says why); None otherwise."""
    around = _chain_around(state, caller, updates)
    if not around or not any(around):
        return None
    before, after = around
    said = []
    if before:
        said.append(
            f"{', '.join(before)} chained before it {'sees' if len(before) == 1 else 'see'} the scaled gradients (65536 times the true ones at the "
            "default init_scale): a clip_by_global_norm(1.0) there clips every step to almost nothing, weight decay "
            "is divided by the scale, zero_nans hides the overflow the scaler skips on"
        )
    if after:
        said.append(
            f"{', '.join(after)} chained after it {'runs' if len(after) == 1 else 'run'} on the steps the scaler skips "
            "(Adam's count and moments, a schedule's step advance; weight decay moves the parameters): only "
            "transformations that map a zero update to zero, with no state, may follow it"
        )
    inside = ", ".join([*before, "opt", *after])
    return (
        f"jamp.scaler is chained beside other transformations in optax.chain: {'; '.join(said)}. Put them inside "
        f"the scaler, in the same order: jamp.scaler({inside}), where opt is what the scaler wraps now. It runs "
        "what it wraps on the unscaled gradients, and not at all on a skipped step (for a clip, torch's unscale_ "
        "before clip_grad_norm_): jamp.scaler(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), not "
        "optax.chain(optax.clip_by_global_norm(1.0), jamp.scaler(optax.adam(1e-3)))."
    )


@functools.cache
def multisteps_keeps_an_overflow() -> bool:
    """Whether the installed optax's ``MultiSteps`` leaves inf/NaN in its accumulator after a window whose
    gradients held an inf (optax 0.2.8 does: ``0 * inf``). Run once, eagerly (also while a step is traced), on
    two scalar micro-batches of ``MultiSteps(sgd, 2)``; the accumulator must be finite after the window."""
    with jax.ensure_compile_time_eval():
        tx = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
        params = jnp.zeros((), jnp.float32)
        state = tx.init(params)
        for gradient in (jnp.inf, 1.0):
            _, state = tx.update(jnp.asarray(gradient, jnp.float32), state, params)
        return not bool(jnp.isfinite(state.acc_grads))


def _is_multisteps(x: Any) -> bool:
    return isinstance(x, optax.MultiStepsState)


def multisteps_message(opt_state: Any) -> str | None:
    """What is wrong when an enabled scaler's state sits inside ``optax.MultiSteps`` and the installed optax
    loses the accumulator to an overflow (the module docstring says why); None otherwise."""
    outer = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_multisteps) if _is_multisteps(x)]
    inside = [s for m in outer for s in scaler_state.all_states(m.inner_opt_state) if isinstance(s, ScalerState)]
    if not inside or not multisteps_keeps_an_overflow():
        return None
    return (
        "optax.MultiSteps(jamp.scaler(...), k): MultiSteps accumulates the scaled gradients, and the installed "
        f"optax {optax.__version__} resets its accumulator as (1 - emit) * acc, so after a window whose scaled "
        "gradients overflowed (expected in the first steps, while the scale calibrates) 0 * inf leaves NaN in the "
        "accumulator: every later window is skipped and the parameters never move again. Nest them the other way, "
        "jamp.scaler(optax.MultiSteps(opt, every_k_schedule=k)), which unscales and checks each micro-batch, or "
        "accumulate the scaled gradients yourself and call tx.update once per window (docs/gradient-scaling.md, "
        "Gradient accumulation)."
    )
