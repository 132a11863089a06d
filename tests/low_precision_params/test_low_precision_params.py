"""jamp.kahan_summation and jamp.stochastic_rounding: exact landing, the arithmetic, and their contracts.

The numerics are checked against independent references: numpy's casts for the rounding, a numpy
float32 reimplementation of the Kahan recurrence, a float32 running sum for what Kahan must recover,
and the binomial spread of a fair coin for stochastic rounding's mean.
"""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import eqns
from jax.extend import core as jcore

import jamp
from jamp.low_precision_params import grid, leaves

LOW = [jnp.bfloat16, jnp.float16]
TRANSFORMS = {"kahan": jamp.kahan_summation, "stochastic": jamp.stochastic_rounding}


def as_f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def same_bits(a, b) -> np.ndarray:
    """Elementwise: equal values of equal sign, or both NaN."""
    a, b = as_f32(a), as_f32(b)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def normal_f32(x, smallest: float = float(np.finfo(np.float32).tiny)) -> np.ndarray:
    """Elementwise: 0 or at least ``smallest`` (XLA:CPU flushes float32 subnormals in arithmetic, so there no
    float32 computation, apply_updates' add included, produces or reads one)."""
    return (as_f32(x) == 0) | (np.abs(as_f32(x)) >= smallest)


# Parameters at least this large: their spacing, so their updates, are normal float32 numbers.
SMALLEST_PARAMETER = 2.0**-100


def spacing(x: np.ndarray, dtype) -> np.ndarray:
    """The distance from x (values of ``dtype``) to the next larger value of ``dtype``, in float32."""
    x = np.asarray(x, dtype)
    return as_f32(np.nextafter(x, np.asarray(np.inf, dtype))) - as_f32(x)


def low_precision_values(dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random finite values of ``dtype`` from every binade down to SMALLEST_PARAMETER (both signs, zeros), plus
    values one step from powers of two."""
    bits = rng.integers(0, 2**16, n, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.finfo(dtype).dtype)
    values = bits[np.isfinite(as_f32(bits)) & normal_f32(bits, SMALLEST_PARAMETER)]
    powers = np.asarray(2.0 ** rng.integers(-12, 12, 256), dtype)
    near = np.concatenate(
        [np.nextafter(powers, np.asarray(0, dtype)), powers, np.nextafter(powers, np.asarray(np.inf, dtype))]
    )
    return np.concatenate([values, near, -near]).astype(dtype)


def test_public_names():
    for name in ("kahan_summation", "stochastic_rounding"):
        assert name in jamp.__all__ and hasattr(jamp, name)


# -- rounding onto the grid ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_nearest_is_the_cast_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[normal_f32(x)]
    specials = [np.inf, -np.inf, np.nan, 0.0, -0.0, 65504, 65519.99, 65520, -65520, 3.3895e38, 3.3961e38]
    x = np.concatenate([x, np.asarray(specials, np.float32)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns on the overflowing casts
        expected = x.astype(dtype)
    assert same_bits(jax.jit(grid.nearest, static_argnums=1)(x, dtype), expected).all()


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_stochastic_rounding_is_unbiased_and_stays_on_the_two_neighbours(dtype):
    """x between two neighbours (below and above powers of two, near zero, negative, float16 subnormals):
    the mean of n roundings differs from x by less than 5 standard errors of a coin with P(up) = fraction."""
    lows = np.asarray([1.0, -1.0, 1.0 - 2**-8, 2.0 - 2**-7, -(2.0 - 2**-7), 2**-20, -(2**-20), 3.0, 1e-3], np.float32)
    if dtype == jnp.float16:  # a subnormal, and the step from the smallest negative subnormal up to zero
        lows = np.append(lows, np.float32([2**-24 * 5, -(2**-24)]))
    lows = as_f32(np.asarray(lows, dtype))
    fractions = np.asarray([0.5, 0.3, 0.01, 0.9, 0.77, 0.123, 0.5, 0.999, 0.25, 0.6, 0.4], np.float32)[: len(lows)]
    step = spacing(lows, dtype)
    x = lows + fractions * step
    n = 20_000
    uniform = jax.random.uniform(jax.random.key(1), (n, len(x)))
    rounded = as_f32(jax.jit(grid.stochastic, static_argnums=1)(jnp.broadcast_to(x, (n, len(x))), dtype, uniform))
    assert ((rounded == lows) | (rounded == lows + step)).all()
    p = (x - lows) / step
    standard_error = step * np.sqrt(p * (1 - p) / n)
    np.testing.assert_array_less(np.abs(rounded.astype(np.float64).mean(0) - x), 5 * standard_error)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_stochastic_rounding_keeps_values_of_the_format_and_passes_inf_and_nan(dtype):
    nan_payload = np.asarray(0x7F800001, np.uint32).view(np.float32)  # truncating its low bits would give inf
    x = np.concatenate(
        [
            as_f32(low_precision_values(dtype, 2000, np.random.default_rng(2))),
            np.asarray([np.inf, -np.inf, np.nan, nan_payload, 0.0, -0.0], np.float32),
        ]
    )
    out = jax.jit(grid.stochastic, static_argnums=1)(x, dtype, jax.random.uniform(jax.random.key(0), x.shape))
    assert same_bits(out, x).all()


def test_no_rounded_value_feeds_more_arithmetic_through_a_cast():
    """XLA may drop ``convert(convert(x, bf16), f32)`` (xla_allow_excess_precision), which would empty the
    Kahan buffer; so the only narrowing casts in an update are those of its stored outputs."""
    tx = jamp.kahan_summation(optax.sgd(1e-3))
    params = {"w": jnp.ones(8, jnp.bfloat16), "h": jnp.ones(8, jnp.float16)}
    closed = jax.make_jaxpr(tx.update)(params, tx.init(params), params)
    narrowing = {
        e.outvars[0]
        for e in eqns(closed)
        if e.primitive.name == "convert_element_type"
        and e.params["new_dtype"] in (jnp.bfloat16, jnp.float16)
        and e.invars[0].aval.dtype == jnp.float32
    }
    assert len(narrowing) == 2  # the two buffers
    assert not narrowing & {v for e in eqns(closed) for v in e.invars if isinstance(v, jcore.Var)}


# -- landing exactly through optax.apply_updates --------------------------------------------------


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_apply_updates_lands_exactly_on_the_new_value(dtype):
    """optax.apply_updates adds a bfloat16 parameter and a float32 update in float32 and rounds once; the
    update ``new - old`` lands on ``new`` for any step that does not shrink a parameter by more than 2**15
    (bfloat16) or 2**12 (float16) without reaching zero, including sign changes, zeros and inf. Landing on a
    zero from a nonzero value gives +0.0 (``x + -x`` is +0.0 whatever the update); ``new - old`` must not
    overflow float32 (a bfloat16 parameter beyond 1.7e38 changing sign)."""
    rng = np.random.default_rng(3)
    old = low_precision_values(dtype, 50_000, rng)
    max_shrink = 15 if dtype == jnp.bfloat16 else 12
    factor = rng.choice([-1, 1], old.size) * 2.0 ** rng.uniform(-max_shrink, 8, old.size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflowing casts and sums
        new = (as_f32(old) * factor).astype(dtype)
        new = np.concatenate([new, np.nextafter(old, np.asarray(np.inf, dtype)), old, np.zeros_like(old), -old])
        old = np.concatenate([old] * 5)
        no_overflow = np.isinf(as_f32(new)) | (np.abs(as_f32(new)) + np.abs(as_f32(old)) < np.finfo(np.float32).max)
    keep = normal_f32(new, SMALLEST_PARAMETER) & no_overflow
    old, new = old[keep], new[keep]
    assert np.isinf(as_f32(new)).any() and (as_f32(new) == 0).any()
    updates = jax.jit(leaves.landing_update)(as_f32(new), as_f32(old))
    assert updates.dtype == jnp.float32
    landed = jax.jit(optax.apply_updates)(jnp.asarray(old), updates)
    assert landed.dtype == dtype
    inexact = ~(same_bits(landed, new) | ((as_f32(landed) == 0) & (as_f32(new) == 0)))
    assert not inexact.any(), (old[inexact][:5], new[inexact][:5], np.asarray(landed)[inexact][:5])


def test_a_larger_shrink_misses_by_at_most_a_float32_ulp_of_the_old_value():
    old = np.full(1000, 1.0, jnp.bfloat16)
    new = np.asarray(np.random.default_rng(4).uniform(2**-24, 2**-17, 1000), jnp.bfloat16)
    landed = as_f32(optax.apply_updates(jnp.asarray(old), leaves.landing_update(as_f32(new), as_f32(old))))
    assert (landed != as_f32(new)).any()  # the documented limit exists
    assert np.abs(landed - as_f32(new)).max() <= np.spacing(np.float32(1.0))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_kahan_update_is_the_recurrence_and_lands_exactly(dtype):
    """One step from random parameters, buffers and updates (near ulp boundaries, negative) against a numpy
    float32 reimplementation: total = p + (u + c); p' = total as dtype; c' = (total - p') as dtype."""
    rng = np.random.default_rng(5)
    p = low_precision_values(dtype, 4000, rng)
    p = p[(np.abs(as_f32(p)) < 1e4) & (np.abs(as_f32(p)) > 2.0**-90)]  # the buffers' spacing stays normal
    u = (as_f32(p) * rng.normal(0, 1, p.size) * 2.0 ** rng.integers(-14, 0, p.size)).astype(np.float32)
    u[::7] = 0.0
    c = (spacing(np.abs(p), dtype) * rng.uniform(-0.5, 0.5, p.size)).astype(dtype)
    tx = jamp.kahan_summation(optax.identity())
    state = tx.init({"p": jnp.asarray(p)})._replace(compensation={"p": jnp.asarray(c)})
    updates, state = jax.jit(tx.update)({"p": jnp.asarray(u)}, state, {"p": jnp.asarray(p)})
    landed = optax.apply_updates({"p": jnp.asarray(p)}, updates)["p"]
    total = as_f32(p) + (u + as_f32(c))
    expected_p = total.astype(dtype)
    expected_c = (total - as_f32(expected_p)).astype(dtype)
    moved = u != 0
    assert same_bits(landed[moved], expected_p[moved]).all()
    assert same_bits(state.compensation["p"][moved], expected_c[moved]).all()
    assert same_bits(landed[~moved], p[~moved]).all() and same_bits(state.compensation["p"][~moved], c[~moved]).all()
    assert state.compensation["p"].dtype == dtype


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_kahan_tracks_a_float32_running_sum(dtype):
    """3000 steps of updates far below half a spacing: round-to-nearest loses them all; Kahan keeps the sum
    (parameter plus buffer) as well as its buffer's precision allows. A buffer value below half the spacing
    at [0.5, 1) is stored with an error of at most 2**-(2 * nmant + 3), so the error of the sum is a random
    walk of such steps: bfloat16 about 1e-4 (16 significant bits), float16 about 2e-6."""
    n, steps = 512, 3000
    rng = np.random.default_rng(6)
    p0 = rng.uniform(0.5, 1.0, n).astype(dtype)
    u = rng.normal(1e-4, 2e-4, (steps, n)).astype(np.float32)
    tx = jamp.kahan_summation(optax.identity())

    def body(carry, u_t):
        p, s = carry
        updates, s = tx.update(u_t, s, p)
        return (optax.apply_updates(p, updates), s), None

    p = jnp.asarray(p0)
    (p, state), _ = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), u))(p, tx.init(p))
    reference = as_f32(p0) + u.sum(0, dtype=np.float64)
    kahan = as_f32(p).astype(np.float64) + as_f32(state.compensation)
    assert np.abs(as_f32(p0) - reference).mean() > 0.25  # round-to-nearest would stay at p0
    assert np.abs(kahan - reference).mean() < np.sqrt(steps) * 2.0 ** -(2 * jnp.finfo(dtype).nmant + 3)
    assert (np.abs(as_f32(p) - reference) <= spacing(p, dtype)).all()


# -- float32 parameters, the key, errors ---------------------------------------------------------------


@pytest.mark.parametrize("name", TRANSFORMS)
def test_float32_parameters_get_the_inner_updates_unchanged(name):
    params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16)}
    grads = jax.tree.map(lambda p: jnp.cos(p * 3).astype(p.dtype), params)
    inner = optax.adamw(1e-3)
    tx = TRANSFORMS[name](inner)
    state, inner_state = tx.init(params), inner.init(params)
    update, inner_update = jax.jit(tx.update), jax.jit(inner.update)
    for _ in range(3):
        updates, state = update(grads, state, params)
        inner_updates, inner_state = inner_update(grads, inner_state, params)
        chex.assert_trees_all_equal(updates["w"], inner_updates["w"])
        assert updates["b"].dtype == jnp.float32
        params = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal(state.inner_state, inner_state)
    if name == "kahan":
        assert state.compensation["w"] is None and state.compensation["b"].dtype == jnp.bfloat16


def _rounding_run(seed, steps=2, n=4096):
    """Stochastic rounding of 1 + 0.3 spacing in two identical leaves, ``steps`` times from the same start."""
    tx = jamp.stochastic_rounding(optax.identity(), seed=seed)
    params = {"a": jnp.ones(n, jnp.bfloat16), "b": jnp.ones(n, jnp.bfloat16)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3 * 2**-7, jnp.float32), params)
    state, out = tx.init(params), []
    for _ in range(steps):
        updates, state = jax.jit(tx.update)(grads, state, params)
        out.append(optax.apply_updates(params, updates))
    return out, state


def test_stochastic_rounding_key_streams():
    (first, second), state = _rounding_run(seed=0)
    again, _ = _rounding_run(seed=0)
    other, _ = _rounding_run(seed=1)
    chex.assert_trees_all_equal(first, again[0])  # deterministic for a seed
    ups = {k: as_f32(v) > 1.0 for k, v in first.items()}
    n = ups["a"].size
    assert abs(ups["a"].mean() - 0.3) < 5 * np.sqrt(0.21 / n)  # P(up) = 0.3 per element
    # independent leaves, steps and seeds: agreement of two independent P=0.3 coins is 0.58
    for a, b in ((ups["a"], ups["b"]), (ups["a"], as_f32(second["a"]) > 1.0), (ups["a"], as_f32(other[0]["a"]) > 1)):
        assert abs((a == b).mean() - 0.58) < 5 * np.sqrt(0.58 * 0.42 / n)
    assert state.key.dtype == jnp.uint32 and not np.array_equal(state.key, jax.random.key_data(jax.random.key(0)))


@pytest.mark.parametrize("name", TRANSFORMS)
def test_inf_and_nan_propagate(name):
    params = {"p": jnp.asarray([jnp.inf, -jnp.inf, 1.0, 1.0, 2.0], jnp.bfloat16)}
    grads = {"p": jnp.asarray([1e-3, 1e-3, jnp.nan, jnp.inf, -1e-3], jnp.bfloat16)}
    tx = TRANSFORMS[name](optax.sgd(1.0))
    state = tx.init(params)
    for _ in range(2):
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
    out = as_f32(params["p"])
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and out[3] == -np.inf
    assert np.isfinite(out[4])
    if name == "kahan":  # an overflowed parameter carries no compensation into later steps
        assert as_f32(state.compensation["p"])[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", TRANSFORMS)
def test_bad_arguments_name_themselves(name):
    make = TRANSFORMS[name]
    with pytest.raises(TypeError, match=r"argument inner must be an optax.GradientTransformation.*got 'adam'"):
        make("adam")
    with pytest.raises(ValueError, match="state_dtype must be None .* or float32, got 'float16'"):
        make(optax.adam(1e-3), state_dtype="float16")
    with pytest.raises(ValueError, match="state_dtype must be"):
        make(optax.adam(1e-3), state_dtype="nonsense")
    tx = make(optax.adam(1e-3))
    for bad, shown in (
        ({"w": jnp.ones(2, jnp.int32)}, r"params\['w'\] is int32"),
        ({"w": jnp.ones(2, jnp.float8_e4m3fn)}, r"params\['w'\] is float8_e4m3fn"),
        ({"w": [1.0]}, r"params\['w'\]\[0\] is 1.0"),
    ):
        with pytest.raises(TypeError, match=shown + ".*must be float16 or bfloat16"):
            tx.init(bad)
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="tx.update needs params"):
        tx.update(params, tx.init(params))


@pytest.mark.parametrize(
    "seed,error,shown",
    [
        (0.5, TypeError, "0.5"),
        (True, TypeError, "True"),
        ("0", TypeError, "'0'"),
        (jnp.int32(3), TypeError, "Array"),
        (-1, ValueError, "-1"),
        (2**32, ValueError, "4294967296"),
    ],
)
def test_seed_must_be_a_small_int(seed, error, shown):
    with pytest.raises(error, match=f"seed must be an int.*got {shown}"):
        jamp.stochastic_rounding(optax.adam(1e-3), seed=seed)
