"""Property tests: the scale rule against a pure-Python model of torch's kernel, exact_mul against numpy.

numpy's ``float32(float64(s) * f)`` is the very computation torch's ``_amp_update_scale_`` performs, so
it is an oracle for jamp.exact_mul (which has no float64). Each property is checked on batches with one
compiled function, so hypothesis explores many cases without recompiling.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import jamp
from jamp.scaling import exact_mul, scale_update

BATCH = 64
STEPS = 24
f32_bits = st.integers(0, 0xFFFFFFFF)
factors = st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False, exclude_min=True)


@jax.jit
def _mul(s, words):
    return exact_mul.mul_f32_f64(s, words)


def _reference_mul(s: np.float32, f: float) -> np.float32:
    with np.errstate(all="ignore"):
        return np.float32(np.float64(s) * f)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(f32_bits, factors), min_size=BATCH, max_size=BATCH))
def test_exact_mul_is_numpys_double_multiply(pairs):
    s = np.array([b for b, _ in pairs], np.uint32).view(np.float32)
    words = np.stack([exact_mul.to_words(f) for _, f in pairs])
    got = np.asarray(_mul(s, words)).view(np.uint32)
    want = np.array([_reference_mul(x, f) for x, (_, f) in zip(s, pairs)], np.float32).view(np.uint32)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 2**24 - 1), st.integers(-140, 120)), min_size=BATCH, max_size=BATCH), st.data()
)
def test_exact_mul_double_rounding_cases(targets, data):
    """Factors chosen so the double product lands on (or next to) a float32 rounding midpoint."""
    s = np.array([data.draw(st.floats(1.0, 2.0**20, width=32)) for _ in targets], np.float32)
    mid = np.array([(2 * m + 1) * 2.0**e for m, e in targets])  # odd multiples of half an ulp
    f = mid / s.astype(np.float64)
    f = np.where(np.isfinite(f) & (f > 0), f, 1.5)
    got = np.asarray(_mul(s, np.stack([exact_mul.to_words(x) for x in f]))).view(np.uint32)
    want = np.array([_reference_mul(a, b) for a, b in zip(s, f)], np.float32).view(np.uint32)
    np.testing.assert_array_equal(got, want)


def _tie_cases():
    """(3.0, factor) pairs whose exact product sits on a 53-bit tie right at a float32 midpoint.

    With s = 3 (significand 3 * 2**22) the product's low 24 bits can be chosen: we build products
    t24 * 2**53 + r29 * 2**24 + low with r29 at the float32 midpoint 2**28 (or one off) and low at the
    double's half-ulp 2**23 (or one off), keep those divisible by 3 and read the factor off. Only
    round-to-nearest-even at both roundings gets all of them right.
    """
    cases = []
    for t24 in range(2**23, 2**23 + 60):
        for r29 in (2**28 - 1, 2**28, 2**28 + 1):
            for low in (2**23 - 2**22, 2**23, 2**23 + 2**22):
                p = (t24 << 53) | (r29 << 24) | low
                if p % (3 << 22) == 0 and 2**52 <= p // (3 << 22) < 2**53:
                    cases.append((np.float32(3.0), (p // (3 << 22)) * 2.0**-52))
    return cases


def test_exact_mul_rounds_ties_to_even_twice_like_the_double_path():
    cases = _tie_cases()
    assert len(cases) >= 20
    s = np.array([c[0] for c in cases], np.float32)
    got = np.asarray(_mul(s, np.stack([exact_mul.to_words(f) for _, f in cases]))).view(np.uint32)
    want = np.array([_reference_mul(a, f) for a, f in cases], np.float32).view(np.uint32)
    np.testing.assert_array_equal(got, want)


def test_words_round_trip_every_double():
    for x in (1.1, 0.3, 2.0**-1074, 1e300, 12345.678, math.pi, 1.0000001):
        assert exact_mul.from_words(exact_mul.to_words(x)) == x


def reference_rule(scale, tracker, found, growth, backoff, interval, lo=0.0, hi=math.inf):
    """torch's _amp_update_scale_ (torch_amp_behavior.md 1.6) plus jamp's optional bounds, in Python; a
    backoff stops at the smallest positive float32 where torch's reaches 0."""
    if found:
        return max(_reference_mul(scale, backoff), np.float32(lo), np.float32(2.0**-149)), 0
    if tracker + 1 == interval:
        grown = _reference_mul(scale, growth)
        return (min(grown, np.float32(hi)) if math.isfinite(grown) else scale), 0
    return scale, tracker + 1


@jax.jit
def _run(state, flags):
    """Apply the rule over a sequence of found_inf flags (scan), returning every (scale, tracker)."""

    def body(s, found):
        scale, tracker = scale_update.next_scale(s, found)
        return s._replace(scale=scale, growth_tracker=tracker), (scale, tracker)

    return jax.lax.scan(body, state, flags)[1]


scales = st.floats(min_value=2.0**-100, max_value=2.0**100, width=32)
hyper = st.tuples(
    scales,
    st.floats(1.0, 16.0, exclude_min=True),
    st.floats(0.0, 1.0, exclude_min=True, exclude_max=True),
    st.integers(1, 6),
    st.integers(0, 8),
    st.lists(st.booleans(), min_size=STEPS, max_size=STEPS),
)


@settings(max_examples=150, deadline=None)
@given(hyper, st.one_of(st.none(), st.tuples(st.floats(2.0**-100, 1.0, width=32), st.floats(1.0, 2.0**100, width=32))))
def test_scale_rule_matches_python_model(h, bounds):
    scale, growth, backoff, interval, tracker, flags = h
    lo, hi = bounds or (0.0, math.inf)
    state = jamp.ScalerState(
        scale=jnp.float32(scale),
        growth_tracker=jnp.int32(tracker),
        growth_factor=exact_mul.to_words(growth),
        backoff_factor=exact_mul.to_words(backoff),
        growth_interval=jnp.int32(interval),
        min_scale=jnp.float32(lo),
        max_scale=jnp.float32(hi),
        found_inf=jnp.bool_(False),
        consecutive_skips=jnp.int32(0),
        warned=jnp.bool_(False),
        skip_episodes=jnp.int32(0),
        warn_after_skips=jnp.int32(0),
        warn_below_scale=jnp.float32(0),
        inner_state=(),
    )
    got_scales, got_trackers = _run(state, jnp.array(flags))
    s, t = np.float32(scale), tracker
    for i, found in enumerate(flags):
        s, t = reference_rule(s, t, found, growth, backoff, interval, lo, hi)
        assert np.float32(got_scales[i]).view(np.uint32) == np.float32(s).view(np.uint32), (i, s, got_scales[i])
        assert int(got_trackers[i]) == t, i
