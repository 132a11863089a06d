"""Skip-or-step without ``lax.cond``: select each new state leaf where the inner optimizer produces it.

The obvious forms are several times slower than the optimizer itself on XLA:CPU (50M params, Adam,
donated state; benchmarks/scaler_overhead.py):

* ``lax.cond(found_inf, skip, step)``: a conditional's outputs get buffers of their own, so every
  parameter and moment is copied back into the donated buffers, and the branch runs slower (6-8x).
* ``inner.update`` then ``select(found_inf, old, new)`` per state leaf: the caller's
  ``apply_updates`` recomputes Adam's new moments from the *old* ones, which the select overwrites
  in place, so XLA first copies every moment (4x; jmp's and flax's patterns pay the same).

Here ``inner.update`` is traced to a jaxpr and evaluated again with one change: as soon as a state
output is computed, every later use (the updates included) reads ``select(found_inf, old, new)``
instead. Where no overflow happened that is the very value ``inner`` computed, so steps are
bit-identical to ``inner``'s; on a skipped step the updates are zeroed anyway. The updates now read the
selected moments, one fused loop reads and writes each moment in place, and nothing is copied. An
``inner`` that computes its state inside a nested call gets the same results, only without the speed-up.

Scalar state leaves (a step count) are the exception: later uses read them as computed, and only the
returned leaf is selected. A selected count would make Adam's bias correction, and with it every
parameter's loop, wait for the finite check; XLA:CPU then ran all moment loops before any parameter
loop, and each parameter loop read its moments back from memory instead of cache (seen once, on 50
vectors of 1M with cold caches; tests/scaling/test_scaler_skip.py pins the structure, not the time). What the
computed count feeds is an update, zeroed on a skipped step, or a state leaf, selected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _jax_compat as jc
from jamp_kernels import leafwise
from jamp_kernels.platforms import per_platform


def _select(skip: jax.Array, old: Any, new: Any) -> jax.Array:
    old, new = jnp.asarray(old), jnp.asarray(new)
    if (old.shape, old.dtype) != (new.shape, new.dtype):
        raise TypeError(
            f"jamp.scaler: the wrapped transformation changed a state leaf from {old.dtype}{list(old.shape)} "
            f"to {new.dtype}{list(new.shape)}; a skipped step must be able to keep the old state"
        )
    return jax.lax.select(skip, old, new)


class Traced(NamedTuple):
    """The wrapped optimizer's ``update``, traced once: a closed jaxpr over the flat (grads, state, params, array
    extras), the flat arguments, the output tree and how many of the outputs are updates."""

    closed: Any
    args: list
    out_tree: Any
    n_updates: int


def trace(update: Callable, grads: Any, state: Any, params: Any, extra: dict) -> Traced:
    """``update(grads, state, params, **extra)`` as a :class:`Traced`; extras that are not arrays are static."""
    dynamic = {k: v for k, v in extra.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in extra.items() if k not in dynamic}
    args = (grads, state, params, dynamic)
    closed, out_shape = jax.make_jaxpr(lambda g, s, p, d: update(g, s, p, **static, **d), return_shape=True)(*args)
    if jax.tree.structure(out_shape[1]) != jax.tree.structure(state):
        raise TypeError("jamp.scaler: the wrapped transformation returned a state of another structure")
    return Traced(closed, jax.tree.leaves(args), jax.tree.structure(out_shape), len(jax.tree.leaves(out_shape[0])))


def zero_where(skip: jax.Array, x: jax.Array, zeros: leafwise.Spread) -> jax.Array:
    """``x``, or -0.0 where ``skip`` is True (``p + -0.0`` is ``p``, even ``p = -0.0``); leaves that are not
    floating (the float0 gradients of integer parameters, integer updates) pass as they are."""
    return jax.lax.select(skip, zeros("-0", -0.0, x), x) if jnp.issubdtype(x.dtype, jnp.floating) else x


def select_where_produced(selected: jax.Array, computed: jax.Array) -> jax.Array:
    """The form off CUDA: later equations read the state leaf selected as soon as it is produced (the module
    docstring says why)."""
    return selected


def select_after(selected: jax.Array, computed: jax.Array) -> jax.Array:
    """The form on CUDA: later equations read the leaf as computed, and only the returned leaf is selected, a
    select that XLA:GPU fuses into the kernel that produces the leaf."""
    return computed


# Which form each platform runs (benchmarks/scaler_overhead.py measures both): on XLA:CPU a select after
# the update makes XLA copy every moment first (see above); XLA:GPU fuses it (1.09x bare Adam against 1.16x
# on an H100, docs/performance.md). The forms differ only in what the equations after a state leaf read.
FORM_OF_PLATFORM = {"cuda": select_after, "default": select_where_produced}


def _form_index() -> Any:
    """The index in :data:`FORM_OF_PLATFORM` of the platform the program is lowered for: one scalar for the whole
    update (a bool for two forms), a constant once lowered, so that XLA folds away every ``select_n`` on it."""
    if len(FORM_OF_PLATFORM) == 1:
        return None
    index = per_platform({p: functools.partial(np.int32, i) for i, p in enumerate(FORM_OF_PLATFORM)})
    return index.astype(jnp.bool_) if len(FORM_OF_PLATFORM) == 2 else index


def step_or_skip(traced: Traced, skip: jax.Array, state: Any, spread: leafwise.Spread):
    """The traced update's ``(updates, state)``, or ``(zeros, state)`` bit for bit where ``skip`` is True.

    The update's equations are bound once. Each state leaf is selected against the old one as soon as it is
    produced; later equations read what :data:`FORM_OF_PLATFORM`'s form for the lowered platform says, except
    scalar leaves (a step count), read as computed (the module docstring says why). ``spread`` holds the scalars
    the caller already broadcast (the -0.0 of zeroed gradients, one per shape and dtype).
    """
    jaxpr, olds = traced.closed.jaxpr, jax.tree.leaves(state)
    state_vars = jaxpr.outvars[traced.n_updates :]
    old_of: dict = {}  # state output computed by an equation -> the old leaf it replaces (first occurrence)
    for v, old in zip(state_vars, olds):
        if isinstance(v, jc.Var) and v not in jaxpr.invars and v not in old_of:
            old_of[v] = old
    selected: dict = {}  # such a state output, selected: the leaf returned for it
    forms, which = list(FORM_OF_PLATFORM.values()), _form_index()

    def select_as_produced(eqn, invals: list) -> list:
        outs = jc.bind(eqn, invals)
        for i, (v, out) in enumerate(zip(eqn.outvars, outs)):
            if v in old_of:
                selected[v] = _select(skip, old_of[v], out)
                if jnp.ndim(out):  # each leaf's select reads the index broadcast once per shape
                    reads = [form(selected[v], out) for form in forms]
                    outs[i] = (
                        reads[0] if which is None else jax.lax.select_n(spread("form", which, out, which.dtype), *reads)
                    )
        return outs

    env: dict = {}
    jc.evaluate(jaxpr, traced.closed.consts, traced.args, select_as_produced, env)

    def new_leaf(v, old):
        if isinstance(v, jc.Var) and old_of.get(v) is old:
            return selected[v]
        return _select(skip, old, jc.read(env, v))

    updates = [zero_where(skip, jnp.asarray(jc.read(env, v)), spread) for v in jaxpr.outvars[: traced.n_updates]]
    return jax.tree.unflatten(traced.out_tree, updates + [new_leaf(v, old) for v, old in zip(state_vars, olds)])
