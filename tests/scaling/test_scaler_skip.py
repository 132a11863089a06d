"""jamp.scaling.skip: each skip form steps exactly as ``inner`` and skips bit for bit, for any inner."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp.scaling import skip
from jamp_kernels.leafwise import Spread

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.arange(4.0)}
GRADS = {"w": jnp.cos(jnp.arange(12.0)).reshape(3, 4), "b": jnp.ones(4)}
BAD = {**GRADS, "b": GRADS["b"].at[2].set(jnp.nan)}


def odd_state_inner():
    """State outputs that are duplicated, passed through, constant, and computed in a nested jit."""

    def init(p):
        return (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.ones(()), jnp.zeros(()), jnp.zeros(()))

    @jax.jit
    def nested(g, n):
        return jax.tree.map(lambda x: x * n, g), n + 1.0

    def update(g, s, p=None):
        n = s[0] + 1
        u, acc = nested(g, s[3])
        return u, (n, n, s[2], acc, jnp.zeros(()))

    return optax.GradientTransformation(init, update)


def jitted_adam():
    adam = optax.adam(1e-2)
    return optax.GradientTransformation(adam.init, jax.jit(adam.update))


INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "jitted_update": jitted_adam,
    "inner_with_cond": lambda: optax.apply_if_finite(optax.adamw(1e-2), 3),
    "inner_with_scan": lambda: optax.chain(optax.scale_by_lbfgs(memory_size=3), optax.scale(-1e-2)),
    "odd_state": odd_state_inner,
}


@pytest.mark.parametrize("name", INNERS)
def test_step_equals_inner_and_skip_keeps_everything(name):
    inner, tx = INNERS[name](), jamp.scaler(INNERS[name](), init_scale=4.0)
    update, inner_update = jax.jit(tx.update), jax.jit(inner.update)
    state, inner_state = tx.init(PARAMS), inner.init(PARAMS)
    for grads in (GRADS, BAD, GRADS, BAD, BAD, GRADS):
        scaled = jax.tree.map(lambda g, s=state.scale: g * s, grads)  # the scale halves on each skip: exact
        updates, new_state = update(scaled, state, PARAMS)
        if grads is BAD:
            chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
            chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
        else:
            expected, inner_state = inner_update(grads, inner_state, PARAMS)
            chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=0)
            chex.assert_trees_all_close(new_state.inner_state, inner_state, rtol=1e-6, atol=0)
        state = new_state


def test_array_and_static_extra_args():
    def update(u, s, params=None, *, factor, sign):
        return jax.tree.map(lambda g: sign * factor * g, u), s

    tx = jamp.scaler(optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update), init_scale=1.0)
    updates, _ = jax.jit(tx.update, static_argnames="sign")(
        GRADS, tx.init(PARAMS), None, factor=jnp.float32(2.0), sign=-1
    )
    np.testing.assert_array_equal(updates["b"], -2.0 * np.ones(4))


def test_inner_that_changes_its_state_dtype_is_rejected():
    changes = optax.GradientTransformation(
        lambda p: jnp.zeros((), jnp.int32), lambda u, s, p=None: (u, jnp.zeros((), jnp.float32))
    )
    with pytest.raises(TypeError, match="changed a state leaf from int32"):
        jamp.scaler(changes).update(GRADS, jamp.scaler(changes).init(PARAMS))


@pytest.mark.parametrize("name", INNERS)
def test_both_skip_forms_step_as_inner_and_skip_bit_identically(skip_form, name):
    test_step_equals_inner_and_skip_keeps_everything(name)


def test_the_discarded_update_never_sees_inf_or_nan(skip_form):
    """Issue 16 #8: a skipped step still runs inner's update (a select keeps the old state), so what inner
    reads must be finite: an SVD of a matrix holding an inf may spin forever."""
    seen = []

    def update(u, s, p=None):
        jax.debug.callback(
            lambda ok: seen.append(bool(ok)), jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(u)]))
        )
        return u, s

    tx = jamp.scaler(optax.GradientTransformation(lambda p: optax.EmptyState(), update), init_scale=2.0)
    state = tx.init(PARAMS)
    for grads in (GRADS, BAD, jax.tree.map(lambda g: g * jnp.inf, GRADS)):
        jax.block_until_ready(jax.jit(tx.update)(grads, state, PARAMS))
    assert seen == [True, True, True]


def _reached_from(jaxpr, invar) -> set:
    """Variables of ``jaxpr`` that ``invar`` reaches (a nested call counts as one node: JAX releases differ
    in what they wrap in one)."""
    reached = {invar}
    for eqn in jaxpr.eqns:
        if any(v in reached for v in eqn.invars if not hasattr(v, "val")):
            reached.update(eqn.outvars)
    return reached


def test_moments_are_read_selected_and_the_step_count_as_computed(monkeypatch):
    """select_where_produced: the parameter update reads Adam's moments selected (each moment loop writes in
    place, nothing is copied), and the bias correction reads the count as computed, so it does not wait
    for the finite check (jamp/scaling/skip.py says what that wait cost on XLA:CPU)."""
    adam = optax.adam(1e-2)
    state = adam.init(PARAMS)
    monkeypatch.setattr(skip, "FORM_OF_PLATFORM", {"default": skip.select_where_produced})
    closed = jax.make_jaxpr(
        lambda found_inf, g, s, p: skip.step_or_skip(skip.trace(adam.update, g, s, p, {}), found_inf, s, Spread())
    )(True, GRADS, state, PARAMS)
    jaxpr = closed.jaxpr
    count = jaxpr.invars[1 + len(GRADS)]  # found_inf, the grads, then the state: Adam's count first
    assert count.aval.shape == () and jnp.issubdtype(count.aval.dtype, jnp.integer)
    waits = _reached_from(jaxpr, jaxpr.invars[0])
    from_count = _reached_from(jaxpr, count)
    selects = [e for e in jaxpr.eqns if e.primitive.name == "select_n"]
    waiting_scalars = [e for e in jaxpr.eqns if e.outvars[0] in from_count & waits and not e.outvars[0].aval.ndim]
    assert [e.primitive.name for e in waiting_scalars] == ["select_n"]  # only the count that is returned
    assert waiting_scalars[0].outvars[0] in jaxpr.outvars
    read_later = {v for e in jaxpr.eqns for v in e.invars if not hasattr(v, "val")}
    returned_and_read = [
        e for e in selects if e.outvars[0].aval.ndim and e.outvars[0] in jaxpr.outvars and e.outvars[0] in read_later
    ]
    assert len(returned_and_read) == 2 * len(GRADS)  # mu and nu of each leaf: one buffer, written in place


DECOMPOSING = {
    "galore": lambda: optax.contrib.galore(1e-2, rank=2, update_proj_gap=1),
    **{
        f"muon_{p}": lambda p=p: optax.contrib.muon(1e-2, preconditioning=p)
        for p in ("frobenius", "spectral", "aol", "schatten")
    },
}


@pytest.mark.parametrize("name", DECOMPOSING)
def test_matrix_decomposing_optimizers_skip_an_overflowing_step(skip_form, name):
    params = {"w": jnp.linspace(-1.0, 1.0, 48).reshape(6, 8), "b": jnp.ones(8)}
    grads = {"w": jnp.cos(jnp.arange(48.0)).reshape(6, 8), "b": jnp.sin(jnp.arange(8.0))}
    tx = jamp.scaler(DECOMPOSING[name](), init_scale=4.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for poison in (None, jnp.inf, jnp.nan, None):
        scaled = jax.tree.map(lambda g: g * state.scale, grads)
        if poison is not None:
            scaled["w"] = scaled["w"].at[2, 3].set(poison)
        updates, new_state = update(scaled, state, params)
        if poison is None:
            assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))
        else:
            chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
            chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
        state = new_state
