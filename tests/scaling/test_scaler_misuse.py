"""The scaler says so when it is misused: gradients of the unscaled loss (jamp.UnscaledGradientsWarning, found by the
lint jamp.check_step, never by a default path), a scaler around nothing, jamp.scale's arguments swapped. Runs of
skipped steps: tests/scaling/test_skip_report.py."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jamp

K1, K2 = jax.random.split(jax.random.key(0))
PARAMS = {"w1": jax.random.normal(K1, (8, 16)) / 3, "w2": jax.random.normal(K2, (16, 1)) / 4}
X = jax.random.normal(jax.random.key(1), (16, 8))
Y = jnp.sin(X.sum(-1, keepdims=True))


def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


amp_loss = jamp.autocast(loss_fn, device_type="gpu")  # float16 matmuls


# ---------------------------------------------------------------- gradients of the unscaled loss


def _unscaled_warnings(step, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(step).trace(*args)  # a default trace says nothing
        assert caught == []
        jamp.check_step(jax.jit(step), *args)
    return [str(w.message) for w in caught if w.category is jamp.UnscaledGradientsWarning]


TX = jamp.scaler(optax.adam(1e-3))
STATE = TX.init(PARAMS)


def test_the_lint_finds_gradients_of_the_unscaled_loss():
    def forgot_scale(params, opt_state, x, y):
        grads = jax.grad(amp_loss)(params, x, y)
        return TX.update(grads, opt_state, params)

    messages = _unscaled_warnings(forgot_scale, PARAMS, STATE, X, Y)
    assert len(messages) == 1 and "UnscaledGradientsWarning" in jamp.__all__
    assert "without jamp.scale" in messages[0] and "65536 times" in messages[0]
    assert "jax.grad(lambda p: jamp.scale(loss_fn(p, batch), opt_state))(params)" in messages[0]
    with warnings.catch_warnings(record=True) as caught:  # the warning points at the lint's call
        warnings.simplefilter("always")
        found = jamp.check_step(lambda p, s: TX.update(jax.grad(amp_loss)(p, X, Y), s, p), PARAMS, STATE)
    assert caught[0].filename == __file__ and [str(w.message) for w in caught] == found


def test_the_lint_finds_unscaled_gradients_accumulated_in_a_scan_or_taken_in_a_nested_jit():
    grad_fn = jax.jit(jax.grad(amp_loss))

    def nested(params, opt_state, x, y):
        return TX.update(grad_fn(params, x, y), opt_state, params)

    def accumulated(params, opt_state, xs, y):
        def micro(acc, x):
            return jax.tree.map(jnp.add, acc, jax.grad(amp_loss)(params, x, y)), None

        grads, _ = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), xs)
        return TX.update(grads, opt_state, params)

    def ensemble(params, opt_state, x, y):  # tx.update under vmap: its arguments are vmap's tracers
        return TX.update(jax.grad(amp_loss)(params, x, y), opt_state, params)

    assert len(_unscaled_warnings(nested, PARAMS, STATE, X, Y)) == 1
    assert len(_unscaled_warnings(accumulated, PARAMS, STATE, jnp.stack([X, X]), Y)) == 1
    two = jax.tree.map(lambda a: jnp.stack([a, a]), PARAMS)
    assert (
        len(_unscaled_warnings(jax.vmap(ensemble, in_axes=(0, 0, None, None)), two, jax.vmap(TX.init)(two), X, Y)) == 1
    )


def test_scaled_gradients_do_not_warn():
    def scaled(params, opt_state, x, y):
        return TX.update(jax.grad(lambda p: jamp.scale(amp_loss(p, x, y), opt_state))(params), opt_state, params)

    def value_and_grad(params, opt_state, x, y):
        return TX.update(jamp.value_and_grad(amp_loss)(opt_state, params, x, y)[1], opt_state, params)

    def by_hand(params, opt_state, x, y):  # the scale read with get_scale; update reads a scale computed from it
        grads = jax.grad(lambda p: amp_loss(p, x, y) * jamp.get_scale(opt_state))(params)
        return TX.update(grads, opt_state._replace(scale=opt_state.scale + 0), params)

    def accumulated(params, opt_state, xs, y):
        def micro(acc, x):
            g = jax.grad(lambda p: jamp.scale(amp_loss(p, x, y), opt_state))(params)
            return jax.tree.map(jnp.add, acc, g), None

        grads, _ = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), xs)
        return TX.update(grads, opt_state, params)

    def computed_elsewhere(grads, opt_state, params):  # gradients are inputs of this trace: nothing is claimed
        return TX.update(jax.tree.map(lambda g: g * 1.0, grads), opt_state, params)

    def ensemble(params, opt_state, x, y):
        return TX.update(jax.grad(lambda p: jamp.scale(amp_loss(p, x, y), opt_state))(params), opt_state, params)

    for step in (scaled, value_and_grad, by_hand):
        assert _unscaled_warnings(step, PARAMS, STATE, X, Y) == []
    two = jax.tree.map(lambda a: jnp.stack([a, a]), PARAMS)
    assert _unscaled_warnings(jax.vmap(ensemble, in_axes=(0, 0, None, None)), two, jax.vmap(TX.init)(two), X, Y) == []
    assert _unscaled_warnings(accumulated, PARAMS, STATE, jnp.stack([X, X]), Y) == []
    assert _unscaled_warnings(computed_elsewhere, PARAMS, STATE, PARAMS) == []


def test_correct_steps_whose_gradients_partly_ignore_the_scale_do_not_warn():
    """A frozen part's gradients (stop_gradient, set_to_zero), a vjp given the scale as cotangent, a remat'd
    loss, a custom_vjp layer: one gradient that depends on the scale is enough."""

    @jax.custom_vjp
    def clipped_grad(w):
        return w

    clipped_grad.defvjp(lambda w: (w, None), lambda _, g: (jnp.clip(g, -1, 1),))
    frozen_w1 = lambda p, x, y: amp_loss({**p, "w1": jax.lax.stop_gradient(p["w1"])}, x, y)
    custom = lambda p, x, y: amp_loss({**p, "w1": clipped_grad(p["w1"])}, x, y)
    groups = jamp.scaler(
        optax.multi_transform(
            {"train": optax.adam(1e-3), "freeze": optax.set_to_zero()}, {"w1": "freeze", "w2": "train"}
        )
    )

    def scaled_step(loss, tx=TX):
        def step(params, opt_state, x, y):
            grads = jax.grad(lambda p: jamp.scale(loss(p, x, y), opt_state))(params)
            return tx.update(grads, opt_state, params)

        return step

    def vjp_of_the_scale(params, opt_state, x, y):
        loss, pullback = jax.vjp(lambda p: amp_loss(p, x, y), params)
        return TX.update(pullback(jamp.get_scale(opt_state).astype(loss.dtype))[0], opt_state, params)

    for step, state in [
        (scaled_step(frozen_w1), STATE),
        (scaled_step(amp_loss, groups), groups.init(PARAMS)),
        (scaled_step(jax.checkpoint(amp_loss)), STATE),
        (scaled_step(custom), STATE),
        (vjp_of_the_scale, STATE),
    ]:
        assert _unscaled_warnings(step, PARAMS, state, X, Y) == []


# ---------------------------------------------------------------- a scaler around nothing; swapped arguments


def test_a_scaler_around_optax_identity_shows_the_wrapping_form():
    for inner in ((optax.identity(),), (optax.identity(), optax.identity())):
        with pytest.warns(
            UserWarning,
            match=r"guards no optimizer.*Write jamp\.scaler\(optax\.adam\(1e-3\)\).*not "
            r"optax\.chain\(jamp\.scaler\(optax\.identity\(\)\), optax\.adam",
        ):
            jamp.scaler(*inner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jamp.scaler(optax.identity())
        jamp.scaler(optax.identity(), optax.adam(1e-3))
        jamp.scaler(optax.adam(1e-3))
    assert len(caught) == 1 and caught[0].filename == __file__


def test_swapped_arguments_are_named_with_the_right_order():
    loss = jnp.float32(2.0)
    with pytest.raises(
        TypeError,
        match=r"jamp\.scale\(opt_state, loss\): the arguments are swapped; write "
        r"jamp\.scale\(loss, opt_state\)",
    ):
        jamp.scale(STATE, loss)
    with pytest.raises(TypeError, match=r"write jamp\.set_scale\(opt_state, new_scale\)"):
        jamp.set_scale(8.0, STATE)
    with pytest.raises(TypeError, match=r"write jamp\.load_state_dict\(opt_state, sd\)"):
        jamp.load_state_dict(jamp.state_dict(STATE), STATE)
    with pytest.raises(ValueError, match="found no jamp.scaler state"):  # no state anywhere: the old message
        jamp.scale(loss, {"not": "a state"})
    assert float(jamp.scale(loss, STATE)) == 2.0 * 65536
