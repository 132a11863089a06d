"""The scaler says so when it is misused or stuck: runs of skipped steps (jamp.SkippedStepsWarning), gradients of
the unscaled loss (jamp.UnscaledGradientsWarning), a scaler around nothing, jamp.scale's arguments swapped."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import count

import jamp

K1, K2 = jax.random.split(jax.random.key(0))
PARAMS = {"w1": jax.random.normal(K1, (8, 16)) / 3, "w2": jax.random.normal(K2, (16, 1)) / 4}
X = jax.random.normal(jax.random.key(1), (16, 8))
Y = jnp.sin(X.sum(-1, keepdims=True))
X_NAN = X.at[3, 5].set(jnp.nan)  # one NaN in the data


def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


amp_loss = jamp.autocast(loss_fn, device_type="gpu")  # float16 matmuls


def train_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jamp.scale(amp_loss(p, x, y), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def train(step, params, opt_state, batches):
    """Runs the steps; returns the final params and state and, per step, how many warnings had come by then."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = []
        for x in batches:
            params, opt_state = jax.block_until_ready(step(params, opt_state, x, Y))  # the host warns as it runs
            seen.append(len([w for w in caught if w.category is jamp.SkippedStepsWarning]))
    return params, opt_state, seen, [str(w.message) for w in caught if w.category is jamp.SkippedStepsWarning]


# ---------------------------------------------------------------- runs of skipped steps


def test_nan_in_the_data_warns_once_per_episode_and_rearms_after_a_step_taken():
    tx = jamp.scaler(optax.adam(1e-3))
    step, state = train_step(tx), tx.init(PARAMS)
    params, state, seen, messages = train(step, PARAMS, state, [X_NAN] * 40)
    # the 17th backoff takes 2**16 below 1 (warn_below_scale); the other 23 skips say nothing more
    assert seen == [0] * 16 + [1] * 24 and len(messages) == 1
    assert messages[0].startswith(
        "jamp.scaler: the loss scale fell below 1 (warn_below_scale) to 0.5, 17 update(s) "
        "skipped in a row because the scaled gradients held inf/NaN. "
    )
    assert (int(state.consecutive_skips), bool(state.warned)) == (40, True)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(PARAMS)))
    for cause in (
        "NaN/inf in the input data",
        "overflows even in float32",
        "learning rate",
        "jamp.find_overflow(loss_fn)(params, batch)",
        "warn_after_skips=None, warn_below_scale=None",
        "category=jamp.SkippedStepsWarning",
    ):
        assert cause in messages[0]

    params, state, seen, messages = train(step, params, state, [X] * 3)  # steps taken: the warning re-arms
    assert messages == [] and (int(state.consecutive_skips), bool(state.warned)) == (0, False)

    # the scale is below 1 already, so this time the run of warn_after_skips=32 skips is what warns
    _, state, seen, messages = train(step, params, state, [X_NAN] * 40)
    assert seen == [0] * 31 + [1] * 9
    assert messages[0].startswith(
        "jamp.scaler: 32 updates in a row were skipped because the scaled gradients held "
        "inf/NaN; the parameters and the optimizer state have not changed since"
    )


def test_warn_after_skips_alone_warns_at_exactly_that_many_skips():
    tx = jamp.scaler(optax.sgd(0.1), init_scale=2.0**4, warn_after_skips=3, warn_below_scale=None)
    _, state, seen, messages = train(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN] * 6)
    assert seen == [0, 0, 1, 1, 1, 1] and int(state.consecutive_skips) == 6
    assert "3 updates in a row" in messages[0] and "scale is down to 2" in messages[0]


def test_sparse_skips_warn_once_when_the_scale_falls_below_the_floor():
    """Skips too far apart to make a run still halve the scale (growth needs 2000 clean steps in a row)."""
    tx = jamp.scaler(optax.sgd(0.1), init_scale=4.0)
    _, _, seen, messages = train(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN, X, X] * 4)
    assert seen == [0] * 6 + [1] * 6 and "fell below 1 (warn_below_scale) to 0.5, 1 update(s)" in messages[0]


def test_silenced_by_the_keywords_and_then_absent_from_the_step():
    quiet = jamp.scaler(optax.adam(1e-3), warn_after_skips=None, warn_below_scale=None)
    _, state, seen, _ = train(train_step(quiet), PARAMS, quiet.init(PARAMS), [X_NAN] * 20)
    assert seen == [0] * 20 and int(state.consecutive_skips) == 20
    grads, loud = jax.tree.map(jnp.ones_like, PARAMS), jamp.scaler(optax.adam(1e-3))
    callbacks, conds = (
        [count(tx.update, grads, tx.init(PARAMS), PARAMS, primitive=p) for tx in (quiet, loud)]
        for p in ("pure_callback", "cond")
    )
    assert callbacks == [0, 1] and conds[1] == conds[0] + 1  # (the other conds pick the platform's skip form)
    # no effect either: an effect (jax.debug.callback) sends every call of a jitted step through Python dispatch
    assert not jax.make_jaxpr(loud.update)(grads, loud.init(PARAMS), PARAMS).effects


def test_an_error_filter_raises_inside_the_step_with_the_warning_text():
    """What docs/gradient-scaling.md says of `-W error`: JAX raises its own runtime error holding the text,
    and the state's consecutive_skips is what a loop can check instead."""
    tx = jamp.scaler(optax.sgd(0.1), warn_after_skips=2, warn_below_scale=None)
    step, state = train_step(tx), tx.init(PARAMS)
    _, state = jax.block_until_ready(step(PARAMS, state, X_NAN, Y))
    assert int(state.consecutive_skips) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.SkippedStepsWarning)
        with pytest.raises(Exception, match="2 updates in a row were skipped") as raised:
            jax.block_until_ready(step(PARAMS, state, X_NAN, Y))
    assert not isinstance(raised.value, jamp.SkippedStepsWarning)  # JAX's runtime error (a ValueError on 0.10)


def test_silenced_by_a_warnings_filter():
    tx = jamp.scaler(optax.adam(1e-3), warn_after_skips=2)
    step, state = train_step(tx), tx.init(PARAMS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=jamp.SkippedStepsWarning)
        for _ in range(4):
            _, state = jax.block_until_ready(step(PARAMS, state, X_NAN, Y))
    assert caught == [] and bool(state.warned)
    assert issubclass(jamp.SkippedStepsWarning, UserWarning) and "SkippedStepsWarning" in jamp.__all__


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"warn_after_skips": 0}, ValueError, r"warn_after_skips must be an int in \[1, "),
        ({"warn_after_skips": 2.5}, TypeError, "warn_after_skips must be an int"),
        ({"warn_after_skips": True}, TypeError, "warn_after_skips must be an int"),
        ({"warn_below_scale": 0.0}, ValueError, "warn_below_scale must be None or a finite float > 0"),
        ({"warn_below_scale": float("inf")}, ValueError, "warn_below_scale must be None or a finite float > 0"),
        ({"warn_below_scale": "1"}, TypeError, "warn_below_scale must be a real number"),
    ],
)
def test_bad_thresholds_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        jamp.scaler(optax.adam(1e-3), **kwargs)


def test_disabled_scaler_says_nothing():
    tx = jamp.scaler(optax.adam(1e-3), enabled=False, warn_after_skips=1)
    _, state, seen, _ = train(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN] * 3)
    assert isinstance(state, jamp.DisabledScalerState) and seen == [0, 0, 0]


def test_inside_and_around_multisteps():
    """jamp.scaler(MultiSteps(...)) steps the scaler per micro-batch. MultiSteps(jamp.scaler(...)) runs the scaler's
    update on every micro-batch and keeps its state only at the window's end, so the host is called from each
    micro-batch of the window that starts an episode, with the same numbers: it warns once."""
    inner = jamp.scaler(
        optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2), warn_after_skips=3, warn_below_scale=None
    )
    _, state, seen, messages = train(train_step(inner), PARAMS, inner.init(PARAMS), [X_NAN] * 5)
    assert seen == [0, 0, 1, 1, 1] and int(state.consecutive_skips) == 5

    outer = optax.MultiSteps(
        jamp.scaler(optax.adam(1e-3), warn_after_skips=2, warn_below_scale=None), every_k_schedule=2
    )
    step, state = train_step(outer), outer.init(PARAMS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            _, state = jax.block_until_ready(step(PARAMS, state, X_NAN, Y))
    skipped = [str(w.message)[:45] for w in caught if w.category is jamp.SkippedStepsWarning]
    assert skipped == ["jamp.scaler: 2 updates in a row were skipped "]  # (and the nesting's own warning, see
    assert int(state.inner_opt_state.consecutive_skips) == 4  # tests/test_scaler_traps.py)


def test_in_a_scan_over_steps_and_under_vmap():
    tx = jamp.scaler(optax.sgd(0.1), init_scale=4.0, warn_after_skips=2, warn_below_scale=None)
    grads = {"w": jnp.ones((3, 2)).at[1, 0].set(jnp.nan)}  # model 1 of 3 overflows
    params = {"w": jnp.ones((3, 2))}

    @jax.jit
    def five_steps(state):
        def body(s, _):
            return jax.vmap(tx.update)(grads, s, params)[1], None

        return jax.lax.scan(body, state, None, length=5)[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = jax.block_until_ready(five_steps(jax.vmap(tx.init)(params)))
    assert [int(n) for n in state.consecutive_skips] == [0, 5, 0]
    assert [str(w.message)[:40] for w in caught] == ["jamp.scaler: 2 updates in a row were ski"]


# ---------------------------------------------------------------- gradients of the unscaled loss


def _unscaled_warnings(step, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(step).trace(*args)
    return [str(w.message) for w in caught if w.category is jamp.UnscaledGradientsWarning]


TX = jamp.scaler(optax.adam(1e-3))
STATE = TX.init(PARAMS)


def test_gradients_of_the_unscaled_loss_warn_while_tracing():
    def forgot_scale(params, opt_state, x, y):
        grads = jax.grad(amp_loss)(params, x, y)
        return TX.update(grads, opt_state, params)

    messages = _unscaled_warnings(forgot_scale, PARAMS, STATE, X, Y)
    assert len(messages) == 1 and "UnscaledGradientsWarning" in jamp.__all__
    assert "without jamp.scale" in messages[0] and "65536 times" in messages[0]
    assert "jax.grad(lambda p: jamp.scale(loss_fn(p, batch), opt_state))(params)" in messages[0]
    with warnings.catch_warnings(record=True) as caught:  # the warning points at the caller of tx.update
        warnings.simplefilter("always")
        jax.jit(lambda p, s: TX.update(jax.grad(amp_loss)(p, X, Y), s, p)).trace(PARAMS, STATE)
    assert caught[0].filename == __file__


def test_unscaled_gradients_accumulated_in_a_scan_or_taken_in_a_nested_jit_warn():
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
