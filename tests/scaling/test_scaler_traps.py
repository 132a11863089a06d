"""Traps that change the numbers without a word (issue 36, point 4), and the weak errors beside them.

* gradients unscaled outside the scaler (torch's ``unscale_`` habit) and then handed to ``tx.update``, which
  divides them again: ``jamp.unscale`` is for logging, and the lint ``jamp.check_step`` says so (the traps
  below are its findings: a default trace of the step says nothing);
* transformations chained before or after ``jamp.scaler`` in ``optax.chain`` (a clip of the scaled gradients);
* ``optax.MultiSteps(jamp.scaler(...), k)``, whose accumulator an overflow poisons on optax 0.2.8;
* errors that said what went wrong in JAX's or Python's words instead of what to write.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
import jamp_kernels
from jamp.scaling import nesting

TARGET = jnp.array([0.27, 0.0, 0.0], jnp.float32)
PARAMS = {"w": jnp.zeros(3, jnp.float32)}  # the gradient is w - TARGET: norm 0.27, under a clip of 1.0


def loss_fn(p):
    return 0.5 * jnp.sum((p["w"] - TARGET) ** 2)


def scaled_grads(p, opt_state):
    return jax.grad(lambda q: jamp.scale(loss_fn(q), opt_state))(p)


def caught_while_tracing(step, *args) -> list[warnings.WarningMessage]:
    """What the lint says of ``step``, after checking that a default trace of it says nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(step).trace(*args)
        assert caught == []
        found = jamp.check_step(step, *args)
    assert [str(w.message) for w in caught] == found
    return caught


def moved(tx, step_grads) -> float:
    """How far one jitted step of ``tx`` moves the parameters, given how it makes the gradients from the state."""

    @jax.jit
    def step(p, s):
        updates, s = tx.update(step_grads(p, s), s, p)
        return optax.apply_updates(p, updates)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(optax.tree.norm(jax.tree.map(jnp.subtract, step(PARAMS, tx.init(PARAMS)), PARAMS)))


# ---------------------------------------------------------------- unscaled gradients outside the scaler


@pytest.mark.parametrize("scale", [2.0**16, 3.0, 2.0**127, 2.0**-130])
def test_unscale_divides_as_the_scaler_does(scale):
    """Bit for bit what sgd(1.0) inside the scaler steps with, at scales whose inverse needs the pair form."""
    tx = jamp.scaler(optax.sgd(1.0))
    state = jamp.set_scale(tx.init(PARAMS), scale)
    grads = {
        "f32": jnp.array([1.5, -1.0, 7e-3]) * scale,
        "f16": jnp.array([2.0, 0.5], jnp.float16),
        "bf16": jnp.array([3.0], jnp.bfloat16),
        "steps": jnp.arange(2),
    }
    unscaled = jamp.unscale(grads, state)
    updates, _ = tx.update(grads, state)
    for name in ("f32", "f16", "bf16"):
        assert unscaled[name].dtype == grads[name].dtype
        np.testing.assert_array_equal(np.asarray(unscaled[name]), -np.asarray(updates[name]))
    assert unscaled["steps"] is grads["steps"]
    assert "unscale" in jamp.__all__


def test_unscale_is_the_identity_when_disabled_and_refuses_what_it_cannot_do():
    grads = {"w": jnp.ones(3)}
    assert jamp.unscale(grads, jamp.scaler(optax.sgd(1.0), enabled=False).init(PARAMS)) is grads
    state = jamp.scaler(optax.sgd(1.0)).init(PARAMS)
    with pytest.raises(TypeError, match=r"write jamp\.unscale\(grads, opt_state\)"):
        jamp.unscale(state, grads)
    replicated = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    with pytest.raises(ValueError, match=r"replicated .*inside the pmap or shard_map"):
        jamp.unscale(grads, replicated)


def test_logging_the_unscaled_norm_leaves_the_step_as_it_was():
    """The documented form: log the norm of jamp.unscale's gradients, hand tx.update the scaled ones."""
    tx = jamp.scaler(optax.sgd(1.0))

    @jax.jit
    def step(p, s):
        grads = scaled_grads(p, s)
        norm = optax.tree.norm(jamp.unscale(grads, s))
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, norm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params, _, norm = step(PARAMS, tx.init(PARAMS))
    assert caught == []
    assert float(norm) == pytest.approx(0.27) and float(optax.tree.norm(params["w"])) == pytest.approx(0.27)


UNSCALED_TWICE = {
    "jamp.unscale": lambda g, s: jamp.unscale(g, s),
    "unscale_and_check, 1/get_scale (docs/torch-amp.md's unscale_ row)": lambda g, s: jamp_kernels.unscale_and_check(
        g, 1 / jamp.get_scale(s)
    )[0],
    "unscale_and_check, inverse": lambda g, s: jamp_kernels.unscale_and_check(
        g, jamp_kernels.inverse(jamp.get_scale(s))
    )[0],
    "divided by get_scale": lambda g, s: jax.tree.map(lambda x: x / jamp.get_scale(s), g),
    "times 1/get_scale": lambda g, s: jax.tree.map(lambda x: x * (1.0 / jamp.get_scale(s)), g),
    "times reciprocal": lambda g, s: jax.tree.map(lambda x: x * jnp.reciprocal(jamp.get_scale(s)), g),
}


@pytest.mark.parametrize("unscaled", UNSCALED_TWICE)
def test_the_lint_finds_gradients_unscaled_before_tx_update(unscaled):
    """torch's unscale_ then step: here tx.update divides them again, every step 65536 times too small."""
    tx = jamp.scaler(optax.sgd(1.0))
    unscale = UNSCALED_TWICE[unscaled]
    assert moved(tx, lambda p, s: unscale(scaled_grads(p, s), s)) == pytest.approx(0.27 / 2**16)

    def step(p, s):
        return tx.update(unscale(scaled_grads(p, s), s), s, p)

    caught = caught_while_tracing(step, PARAMS, tx.init(PARAMS))
    assert [w.category for w in caught] == [jamp.UnscaledGradientsWarning]
    message = str(caught[0].message)
    assert "already divided by the loss scale" in message and "65536 times" in message
    assert "norm = optax.tree.norm(jamp.unscale(grads, opt_state)); updates, opt_state = tx.update(grads" in message
    assert caught[0].filename == __file__


def clipped_by_the_true_norm(grads, s, max_norm=0.1):
    """The scaled gradients times min(1, max_norm / the true norm): still scaled (issue 43, point 4d)."""
    norm = optax.tree.norm(jamp.unscale(grads, s))
    return jax.tree.map(lambda g: g * jnp.minimum(1.0, max_norm / norm), grads)


def test_scaled_gradients_that_meet_the_scale_after_the_backward_pass_do_not_warn():
    """Multiplied by the scale, clipped by their own norm, or a gradient penalty computed from unscaled inner
    gradients: nothing divides the gradients tx.update gets by the scale."""
    tx = jamp.scaler(optax.sgd(1.0))

    def penalized(p, s):
        inner = jax.tree.map(lambda g: g / jamp.get_scale(s), scaled_grads(p, s))
        return jamp.scale(loss_fn(p) + optax.tree.norm(inner), s)

    forms = {
        "scaled": scaled_grads,
        "unscaled loss times the scale": lambda p, s: jax.tree.map(
            lambda g: g * jamp.get_scale(s), jax.grad(loss_fn)(p)
        ),
        "clipped outside": lambda p, s: optax.clip_by_global_norm(1.0).update(scaled_grads(p, s), None)[0],
        "gradient penalty": lambda p, s: jax.grad(penalized)(p, s),
        "accumulated": lambda p, s: jax.tree.map(lambda a, b: (a + b) / 2, scaled_grads(p, s), scaled_grads(p, s)),
        "clipped by the true norm": lambda p, s: clipped_by_the_true_norm(scaled_grads(p, s), s),
        "gated by the true norm": lambda p, s: jax.tree.map(
            lambda g: g * (optax.tree.norm(jamp.unscale(scaled_grads(p, s), s)) < 10.0), scaled_grads(p, s)
        ),
    }
    for name, grads in forms.items():
        caught = caught_while_tracing(lambda p, s, grads=grads: tx.update(grads(p, s), s, p), PARAMS, tx.init(PARAMS))
        assert caught == [], name


# ---------------------------------------------------------------- chained beside the scaler


def test_a_transformation_chained_before_the_scaler_warns_with_the_wrapping_form():
    """optax.chain(clip, jamp.scaler(opt)) clips the scaled gradients: a 0.27 step becomes 1/65536."""
    chained = optax.chain(optax.clip_by_global_norm(1.0), jamp.scaler(optax.sgd(1.0)))
    wrapped = jamp.scaler(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    assert moved(chained, scaled_grads) == pytest.approx(2.0**-16)
    assert moved(wrapped, scaled_grads) == pytest.approx(0.27)

    def step(p, s):
        return chained.update(scaled_grads(p, s), s, p)

    caught = caught_while_tracing(step, PARAMS, chained.init(PARAMS))
    assert [w.category for w in caught] == [UserWarning] and caught[0].filename == __file__
    message = str(caught[0].message)
    assert "optax.clip_by_global_norm(...) chained before it sees the scaled gradients" in message
    assert "jamp.scaler(optax.clip_by_global_norm(...), opt), where opt is what the scaler wraps now" in message
    assert (
        caught_while_tracing(lambda p, s: wrapped.update(scaled_grads(p, s), s, p), PARAMS, wrapped.init(PARAMS)) == []
    )


def test_a_transformation_with_a_state_or_moving_a_zero_update_chained_after_the_scaler_warns():
    """Adam after the scaler counts the skipped steps and decays its moments on them, weight decay moves the
    parameters on them; a stateless scale does not care, and a user's own tuple of two optimizers' states is no
    chain."""
    after = optax.chain(jamp.scaler(optax.clip_by_global_norm(1.0)), optax.adam(1e-3))
    caught = caught_while_tracing(lambda p, s: after.update(scaled_grads(p, s), s, p), PARAMS, after.init(PARAMS))
    assert len(caught) == 1 and "chained after it runs on the steps the scaler skips" in str(caught[0].message)
    decayed = optax.chain(jamp.scaler(optax.sgd(1.0)), optax.add_decayed_weights(0.1))
    params = {"w": jnp.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skipped, _ = decayed.update({"w": jnp.full(3, jnp.inf)}, decayed.init(params), params)
    assert float(jnp.abs(skipped["w"]).max()) == pytest.approx(0.1)  # a skipped step moves the parameters
    caught = caught_while_tracing(lambda p, s: decayed.update(scaled_grads(p, s), s, p), params, decayed.init(params))
    assert len(caught) == 1 and "optax.add_decayed_weights(...) chained after it runs on the steps" in str(
        caught[0].message
    )
    stateless = optax.chain(jamp.scaler(optax.scale_by_adam()), optax.scale(-1e-3))
    assert (
        caught_while_tracing(lambda p, s: stateless.update(scaled_grads(p, s), s, p), PARAMS, stateless.init(PARAMS))
        == []
    )

    tx_a, tx_b = jamp.scaler(optax.adam(1e-3)), optax.adam(1e-3)

    def two_optimizers(p, states):
        grads = jax.grad(lambda q: jamp.scale(loss_fn(q), states))(p)
        return tx_a.update(grads, states[0], p), tx_b.update(grads, states[1], p)

    assert caught_while_tracing(two_optimizers, PARAMS, (tx_a.init(PARAMS), tx_b.init(PARAMS))) == []


# ---------------------------------------------------------------- optax.MultiSteps around the scaler


def _multisteps_step(tx):
    @jax.jit
    def step(p, s, poison):
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), scaled_grads(p, s))
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    return step


def test_multisteps_around_the_scaler_warns_naming_the_nesting():
    outer = optax.MultiSteps(jamp.scaler(optax.adam(1e-3)), every_k_schedule=2)
    state = outer.init(PARAMS)
    with_scale = caught_while_tracing(scaled_grads, PARAMS, state)
    with_value_and_grad = caught_while_tracing(lambda p, s: jamp.value_and_grad(loss_fn)(s, p), PARAMS, state)
    for caught in (with_scale, with_value_and_grad):
        assert [w.category for w in caught] == [UserWarning]
        message = str(caught[0].message)
        assert message.startswith("optax.MultiSteps(jamp.scaler(...), k): MultiSteps accumulates the scaled")
        assert "jamp.scaler(optax.MultiSteps(opt, every_k_schedule=k))" in message and "0 * inf" in message
    assert with_scale[0].filename.endswith("test_scaler_traps.py")
    assert with_value_and_grad[0].filename == __file__
    for fine in (
        jamp.scaler(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)),
        optax.MultiSteps(jamp.scaler(optax.adam(1e-3), enabled=False), every_k_schedule=2),
    ):
        assert caught_while_tracing(scaled_grads, PARAMS, fine.init(PARAMS)) == []


def test_the_multisteps_warning_follows_what_the_installed_optax_does(monkeypatch):
    """The probe says whether an overflowing window poisons MultiSteps' accumulator; a run of the nesting says
    the same (optax 0.2.8: the parameters never move again). Where the probe finds it fixed, nothing is said."""
    outer = optax.MultiSteps(jamp.scaler(optax.sgd(1.0)), every_k_schedule=2)
    step, params, state = _multisteps_step(outer), PARAMS, outer.init(PARAMS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(8):  # the first micro-batch overflows (a calibration), then three clean windows
            params, state = step(params, state, i == 0)
    recovered = float(optax.tree.norm(params["w"])) > 0
    assert recovered is not nesting.multisteps_keeps_an_overflow()

    monkeypatch.setattr(nesting, "multisteps_keeps_an_overflow", lambda: False)
    assert caught_while_tracing(scaled_grads, PARAMS, outer.init(PARAMS)) == []


# ---------------------------------------------------------------- weak errors that now say what to write

TX = jamp.scaler(optax.adam(1e-3))
STATE = TX.init(PARAMS)
GRADS = {"w": jnp.ones(3)}
OFF = jamp.scaler(optax.adam(1e-3), enabled=False)

ERRORS = {
    "update, params and opt_state swapped": (
        lambda: TX.update(GRADS, PARAMS, STATE),
        TypeError,
        r"^tx\.update\(grads, params, opt_state\): the arguments are swapped; write tx\.update\(grads, opt_state, "
        r"params\)$",
    ),
    "update of a disabled scaler, swapped": (
        lambda: OFF.update(GRADS, PARAMS, OFF.init(PARAMS)),
        TypeError,
        r"write tx\.update\(grads, opt_state, params\)",
    ),
    "update given None": (
        lambda: TX.update(GRADS, None, PARAMS),
        TypeError,
        r"opt_state must be the ScalerState that tx\.init\(params\) returned.*got None$",
    ),
    "update given the inner state": (lambda: TX.update(GRADS, STATE.inner_state, PARAMS), TypeError, r"got a tuple$"),
    "update given an outer state": (
        lambda: TX.update(GRADS, {"opt": STATE}, PARAMS),
        TypeError,
        r"got a dict; it holds one at opt_state\['opt'\]: pass that",
    ),
    "update given a state restored without a target": (
        lambda: TX.update(GRADS, STATE._asdict(), PARAMS),
        ValueError,
        r"checkpoint restored without a target",
    ),
    "init given the opt_state": (
        lambda: TX.init(STATE),
        TypeError,
        r"tx\.init\(params\) got a tree that holds a jamp\.scaler state: it takes the parameters",
    ),
    "autocast(loss_fn, jnp.float16)": (
        lambda: jamp.autocast(loss_fn, jnp.float16),
        TypeError,
        r"^jamp\.autocast\(loss_fn, jnp\.float16\): dtype is a keyword argument; .*Write jamp\.autocast\(loss_fn, "
        r"dtype=jnp\.float16\)\(\*args\), or decorate loss_fn with @jamp\.autocast\(dtype=jnp\.float16\)",
    ),
    "autocast(loss_fn, 'gpu')": (
        lambda: jamp.autocast(loss_fn, "gpu"),
        TypeError,
        r"device_type is a keyword argument; .*Write jamp\.autocast\(loss_fn, device_type='gpu'\)\(\*args\)",
    ),
    "autocast('cuda', torch's positional dtype)": (
        lambda: jamp.autocast("cuda", jnp.float16),
        TypeError,
        r"device_type, dtype are keywords; .*Write jamp\.autocast\(fn, device_type='cuda', dtype=jnp\.float16\)",
    ),
    "@autocast(jnp.bfloat16)": (
        lambda: jamp.autocast(jnp.bfloat16),
        TypeError,
        r"^jamp\.autocast\(jnp\.bfloat16\): dtype is a keyword argument; .*@jamp\.autocast\(dtype=jnp\.bfloat16\)",
    ),
    "autocast with an unknown second positional": (
        lambda: jamp.autocast(loss_fn, 3),
        TypeError,
        r"takes one positional argument, the function to transform, and keywords",
    ),
    "state_dict inside jit": (
        lambda: jax.jit(jamp.state_dict)(STATE),
        TypeError,
        r"jamp\.state_dict\(opt_state\) was called inside jax\.jit .*returns Python numbers.*on the opt_state the "
        r"jitted step returned.*jamp\.get_scale\(opt_state\)",
    ),
    "load_state_dict of a state dict passed to jit": (
        lambda: jax.jit(jamp.load_state_dict)(STATE, jamp.state_dict(STATE)),
        TypeError,
        r"growth_factor is a traced value \(f(loat)?32\[\]\).*opt_state = jamp\.set_scale\(opt_state, new_scale\)",
    ),
    "scale given None": (
        lambda: jamp.scale(1.0, None),
        ValueError,
        r"found no jamp\.scaler state \(opt_state is None\)",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_weak_errors_say_what_to_write(case):
    call, error, match = ERRORS[case]
    with pytest.raises(error, match=match):
        call()


def test_what_still_works_beside_the_new_errors():
    """load_state_dict inside jit with a state dict it closes over, autocast given a function alone."""
    sd = {**jamp.state_dict(STATE), "scale": 8.0}
    assert float(jax.jit(lambda s: jamp.get_scale(jamp.load_state_dict(s, sd)))(STATE)) == 8.0
    amp = jamp.autocast(loss_fn, dtype=jnp.float16)
    assert float(amp(PARAMS)) == pytest.approx(float(loss_fn(PARAMS)), rel=1e-3)
    assert jamp.state_dict(OFF.init(PARAMS)) == {} and jax.jit(jamp.state_dict)(OFF.init(PARAMS)) == {}
