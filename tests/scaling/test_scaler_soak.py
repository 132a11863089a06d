"""10^5-step soak of jamp.scaler under lax.scan: no drift, no NaN, no zero or infinite scale, and the
skip invariant on every skipped step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp

STEPS = 100_000
TRUE_GRAD = jnp.array([0.5, -0.25, 1.0, 2.0**-10], jnp.float32)


def overflow_pattern(key):
    """Bursts of overflows on top of rare isolated ones, so the scale both climbs and falls a lot."""
    isolated = jax.random.bernoulli(key, 0.002, (STEPS,))
    burst = (jnp.arange(STEPS) % 9973) < 25
    return isolated | burst


def python_scale_model(flags, scale=2.0**16, interval=50):
    tracker, scales = 0, []
    for found in flags:
        if found:
            scale, tracker = scale * 0.5, 0
        elif tracker + 1 == interval:
            scale = scale * 2 if np.isfinite(np.float32(scale * 2)) else scale
            tracker = 0
        else:
            tracker += 1
        scales.append(scale)
    return np.array(scales, np.float64), tracker


def test_soak_hundred_thousand_steps():
    tx = jamp.scaler(optax.sgd(0.01, momentum=0.9), growth_interval=50)
    params = jnp.zeros(4, jnp.float32)
    flags = overflow_pattern(jax.random.key(0))

    def step(carry, found):
        params, state = carry
        grads = TRUE_GRAD * jamp.get_scale(state)  # what jax.grad of jamp.scale(loss) would give
        grads = jnp.where(found, grads.at[0].set(jnp.inf), grads)
        updates, new_state = tx.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        kept = jnp.all(new_params == params) & jax.tree.reduce(
            jnp.logical_and, jax.tree.map(lambda a, b: jnp.all(a == b), new_state.inner_state, state.inner_state)
        )
        invariant_ok = jnp.where(found, kept & jamp.found_inf(new_state), ~jamp.found_inf(new_state))
        return (new_params, new_state), (jamp.get_scale(new_state), invariant_ok)

    (final_params, final_state), (scales, invariant_ok) = jax.jit(lambda p, s, f: jax.lax.scan(step, (p, s), f))(
        params, tx.init(params), flags
    )

    assert bool(jnp.all(invariant_ok))
    scales = np.asarray(scales, np.float64)
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)
    expected_scales, expected_tracker = python_scale_model(np.asarray(flags))
    np.testing.assert_array_equal(scales, expected_scales)
    assert int(final_state.growth_tracker) == expected_tracker

    # No drift: the parameters equal plain SGD-with-momentum run on the clean steps only (the scales
    # are powers of two, so unscaling is exact and the results are bit-identical).
    reference = optax.sgd(0.01, momentum=0.9)

    def clean_step(carry, found):
        p, s = carry
        u, s2 = reference.update(TRUE_GRAD, s, p)
        return jax.tree.map(lambda new, old: jnp.where(found, old, new), (optax.apply_updates(p, u), s2), (p, s)), None

    (ref_params, _), _ = jax.jit(lambda p, f: jax.lax.scan(clean_step, (p, reference.init(p)), f))(params, flags)
    np.testing.assert_array_equal(np.asarray(final_params), np.asarray(ref_params))
    assert np.all(np.isfinite(np.asarray(final_params)))
