"""Under an outer differentiation, autocast's program is replayed through cached one-op inline jits
(jamp.casting.replay): the traced program, its values and its source information are the ones
``eval_jaxpr`` gives, and the layers of a deep model share one cached op per distinct op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import eqns
from jax._src import source_info_util

import jamp
from jamp.casting import replay

LAYERS = 6


def deep_mlp(params, x):
    for w, b in params:
        x = jnp.tanh(x @ w + b) * 2.0 + x  # the same ops, shapes and literals in every layer
    return jnp.mean((x - 1) ** 2)


def make_params(layers: int = LAYERS):
    keys = jax.random.split(jax.random.key(0), layers)
    return [(jax.random.normal(k, (16, 16)) / 4, jnp.zeros(16)) for k in keys]


X = jax.random.normal(jax.random.key(1), (8, 16))


def _step_jaxpr():
    return jax.make_jaxpr(jax.value_and_grad(jamp.autocast(deep_mlp, device_type="gpu")))(make_params(), X)


def _described(closed):
    return [(str(e), str(e.source_info.name_stack), source_info_util.summarize(e.source_info)) for e in eqns(closed)]


def test_the_differentiated_program_is_the_one_eval_jaxpr_gives():
    cached = _step_jaxpr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay.jc, "is_differentiated", lambda x: False)
        plain = _step_jaxpr()
    assert str(cached) == str(plain)
    assert _described(cached) == _described(plain)  # equations, name stacks and user source lines


def _ops(layers: int) -> set:
    """The one-op jits the replay of a ``layers``-deep model binds."""
    closed, _ = jamp.autocast(deep_mlp, device_type="gpu").rewrite(make_params(layers), X)
    return {op for op in replay._plan(closed) if op is not None}


def test_layers_share_cached_ops_and_values_match():
    # each layer binds the first layer's ops: a deeper model binds no other op
    assert _ops(2) and _ops(LAYERS) == _ops(2)
    loss, grads = jax.value_and_grad(jamp.autocast(deep_mlp, device_type="gpu"))(make_params(), X)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay.jc, "is_differentiated", lambda x: False)
        loss_ref, grads_ref = jax.value_and_grad(jamp.autocast(deep_mlp, device_type="gpu"))(make_params(), X)
    assert loss == loss_ref
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_array_equal(g, r)


def test_literals_of_different_types_are_different_ops():
    """``x * 2``, ``x * 2.0`` and ``x * True`` bind different literals: no cached op stands for another."""

    def f(x):
        i = (x > 0).astype(jnp.int32)
        return jnp.sum(x * 2.0) + jnp.sum(i * 2).astype(jnp.float32) + jnp.sum(jnp.logical_and(x > 0, True))

    x = jnp.linspace(-1.0, 1.0, 8)
    value, grad = jax.value_and_grad(jamp.autocast(f, device_type="gpu"))(x)
    assert float(value) == float(jax.value_and_grad(f)(x)[0])
    np.testing.assert_array_equal(grad, jnp.full(8, 2.0))


def test_no_cached_ops_without_differentiation(monkeypatch):
    """A plain trace (jit, vmap) binds the program's equations directly: a jit binds more slowly."""
    monkeypatch.setattr(replay, "_plan", lambda closed: pytest.fail("a one-op jit for a plain trace"))
    f = jamp.autocast(deep_mlp, device_type="gpu")
    batched = jax.make_jaxpr(jax.vmap(f, in_axes=(None, 0)))(make_params(), jnp.stack([X, X]))
    plain = jax.make_jaxpr(f)(make_params(), X)
    assert batched.out_avals[0].shape == (2,) and plain.out_avals[0].shape == ()
