"""jamp.scaler against torch.amp.GradScaler, number for number.

The goldens in tests/data/torch_grad_scaler_goldens.json were produced by torch 2.13.0+cpu with
tests/data/make_torch_goldens.py (torch is not a test dependency). Scales, found_inf, trackers and
state_dicts must match bit for bit; unscaled gradients too wherever torch's float32 1/scale is a normal
float. Where it is not (scales above 2**126: a subnormal with fewer bits; below about 2**-128: inf, which
makes torch's parameters inf/NaN), jamp unscales by the reciprocal rounded to 24 bits, and the gradients
must equal that product. Scaled gradients that are float32 subnormals are not compared: XLA:CPU flushes
subnormal arithmetic to zero on every host. Nothing compared depends on the host: no unscaled golden is
subnormal, so a bfloat16 result never meets the AVX512-BF16 convert that flushes subnormals on some CPUs.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
import jamp_kernels
from jamp.scaling import exact_mul, scale_update

GOLDENS = json.loads(
    (pathlib.Path(__file__).resolve().parents[1] / "data" / "torch_grad_scaler_goldens.json").read_text()
)
SHAPES = {"w": ((2, 3), jnp.float32), "b": ((3,), jnp.bfloat16), "d": ((2,), jnp.float64)}
NORMAL = (2.0**-126, 2.0**126)  # scales whose reciprocal is a normal float32


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def exact_inverse(scale) -> float:
    """1/scale rounded to float32's 24 bits with an unbounded exponent, as a Python float: torch's
    float32(1/float64(scale)) wherever that is a normal float32."""
    mantissa, exponent = math.frexp(1.0 / float(np.float32(scale)))
    return math.ldexp(float(np.float32(mantissa)), exponent)


def torch_inverse_is_normal(scale) -> bool:
    return NORMAL[0] <= exact_inverse(scale) <= float(np.finfo(np.float32).max)


def dtype_of(key):
    """torch's dtype; without x64 the float64 leaf is fed as float32 (same inf/NaN pattern, values not compared)."""
    dtype = SHAPES[key][1]
    return jnp.float32 if dtype == jnp.float64 and not jax.config.jax_enable_x64 else dtype


def as_array(values, key) -> np.ndarray:
    return np.asarray(values, np.float64).reshape(SHAPES[key][0]).astype(dtype_of(key))


def replay(traj, update, base_state):
    """Feed torch's scaled grads through one jitted jamp.scaler(sgd(1)).update; compare every step.

    Unscaled values are compared for the leaves that kept torch's dtype (all three under x64); returns
    the (leaf, what it was compared against) pairs seen.
    """
    state = jamp.load_state_dict(
        base_state,
        {
            "scale": traj["init_scale"],
            "growth_factor": traj["growth_factor"],
            "backoff_factor": traj["backoff_factor"],
            "growth_interval": traj["growth_interval"],
            "_growth_tracker": 0,
        },
    )
    params = {k: jnp.zeros(SHAPES[k][0], dtype_of(k)) for k in SHAPES}
    exact = [k for k in SHAPES if dtype_of(k) == SHAPES[k][1]]
    compared = set()
    for i, st in enumerate(traj["steps"]):
        where = f"{traj['name']} step {i}"
        assert bits(jamp.get_scale(state)) == bits(st["scale_used"]), where
        updates, state = update({k: jnp.asarray(as_array(st["grads"][k], k)) for k in SHAPES}, state, params)
        assert bool(jamp.found_inf(state)) == bool(st["found_inf"]) == (not st["stepped"]), where
        if st["scale_after"] == 0:  # torch backs off to 0 (then NaN updates); jamp stops at 2**-149
            assert bits(jamp.get_scale(state)) == bits(np.float32(2.0**-149)), where
            return compared
        assert int(state.growth_tracker) == st["tracker_after"], where
        for k in exact:
            fed = as_array(st["grads"][k], k)
            if st["found_inf"]:
                expected, against = np.zeros(SHAPES[k][0]), "skip"
            elif np.any((fed != 0) & (np.abs(fed.astype(np.float64)) < jnp.finfo(fed.dtype).tiny)):
                continue  # a subnormal scaled gradient: XLA flushes it to zero
            elif torch_inverse_is_normal(st["scale_used"]):
                expected, against = -as_array(st["unscaled"][k], k).astype(np.float64), "torch"
            else:  # torch's 1/scale is subnormal or inf; jamp's keeps 24 bits
                inv = exact_inverse(st["scale_used"])
                expected = -(fed.astype(np.float64) * inv).astype(np.float32).astype(fed.dtype).astype(np.float64)
                against = "exact inverse"
            np.testing.assert_array_equal(np.asarray(updates[k], np.float64), expected, err_msg=f"{where} {k}")
            compared.add((k, against))
    assert jamp.state_dict(state) == traj["state_dict"]
    return compared


@pytest.fixture(scope="module")
def one_compiled_update():
    """One scaler, one compilation: every torch config is loaded into it with load_state_dict."""
    tx = jamp.scaler(optax.sgd(1.0))
    traces = []

    def update(g, s, p):
        traces.append(1)
        return tx.update(g, s, p)

    return tx.init({k: jnp.zeros(SHAPES[k][0], dtype_of(k)) for k in SHAPES}), jax.jit(update), traces


@pytest.mark.parametrize("traj", GOLDENS["trajectories"], ids=lambda t: t["name"])
def test_trajectory_matches_torch(traj, one_compiled_update):
    state, update, traces = one_compiled_update
    assert {k for k, _ in replay(traj, update, state)} == {"w", "b"}
    assert len(traces) == 1  # hyperparameters are arrays: loading another config never retraced


def test_no_unscaled_golden_is_subnormal():
    """What keeps the replay independent of the host (module docstring): a subnormal bfloat16 result would
    be flushed by AVX512-BF16's convert on some CPUs and kept on others."""
    values = np.array(
        [v for t in GOLDENS["trajectories"] for st in t["steps"] for k in ("w", "b") for v in st["unscaled"][k]],
        np.float64,
    )
    assert values.size > 1000 and not np.any((values != 0) & (np.abs(values) < np.finfo(np.float32).tiny))


@pytest.mark.parametrize("traj", GOLDENS["trajectories"][:4], ids=lambda t: t["name"])
def test_trajectory_matches_torch_with_float64_leaves(traj):
    with jax.enable_x64(True):
        tx = jamp.scaler(optax.sgd(1.0))
        compared = replay(traj, jax.jit(tx.update), tx.init({k: jnp.zeros(*SHAPES[k]) for k in SHAPES}))
        assert {k for k, _ in compared} == set(SHAPES)


# torch_amp_behavior.md section 1.10, verbatim: it, grad, scale used, found_inf, skipped, scale after, tracker after
DOC_TABLE = """
0 F 16 0 no 16 1 | 1 F 16 0 no 16 2 | 2 F 16 0 no 32 0 | 3 F 32 0 no 32 1 | 4 F 32 0 no 32 2 | 5 F 32 0 no 64 0
6 I 64 1 yes 32 0 | 7 F 32 0 no 32 1 | 8 F 32 0 no 32 2 | 9 F 32 0 no 64 0 | 10 I 64 1 yes 32 0 | 11 I 32 1 yes 16 0
12 F 16 0 no 16 1 | 13 F 16 0 no 16 2 | 14 F 16 0 no 32 0 | 15 F 32 0 no 32 1 | 16 N 32 1 yes 16 0
17 F 16 0 no 16 1 | 18 F 16 0 no 16 2
"""


def test_doc_trajectory_table_1_10():
    rows = [r.split() for r in DOC_TABLE.replace("\n", "|").split("|") if r.strip()]
    tx = jamp.scaler(optax.sgd(0.1), init_scale=2.0**4, growth_factor=2, backoff_factor=0.5, growth_interval=3)
    params = {"w": jnp.ones((1, 4)), "b": jnp.zeros((1,))}
    state = tx.init(params)

    @jax.jit
    def step(params, state, bad):
        def loss(p):
            return jnp.sum(p["w"] * jnp.arange(4.0)) + p["b"][0]

        g = jax.grad(lambda p: jamp.scale(loss(p), state))(params)
        g["w"] = g["w"].at[0, 0].add(bad)  # + inf or + nan, as torch's test writes into the grad
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for it, grad, used, found, skipped, after, tracker in rows:
        assert float(jamp.get_scale(state)) == float(used), it
        before = params
        params, state = step(params, state, {"F": 0.0, "I": np.inf, "N": np.nan}[grad])
        assert bool(jamp.found_inf(state)) == (found == "1"), it
        assert all(np.array_equal(params[k], before[k]) for k in params) == (skipped == "yes"), it
        assert (float(jamp.get_scale(state)), int(state.growth_tracker)) == (float(after), int(tracker)), it
    assert jamp.state_dict(state) == {
        "scale": 16.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": 2,
    }


def test_doc_growth_interval_1_doubles_every_step():
    tx = jamp.scaler(optax.sgd(0.1), init_scale=16.0, growth_interval=1)
    state, seen, update = tx.init({"w": jnp.ones(2)}), [], jax.jit(tx.update)
    for _ in range(5):
        _, state = update({"w": jnp.ones(2)}, state)
        seen.append((float(jamp.get_scale(state)), int(state.growth_tracker)))
    assert seen == [(32.0, 0), (64.0, 0), (128.0, 0), (256.0, 0), (512.0, 0)]


def test_update_kernel_matches_torch_amp_update_scale():
    cases = GOLDENS["update_kernel"]

    def col(k, dt):
        return jnp.asarray(np.array([c[k] for c in cases], dt))

    def words(k):
        return jnp.asarray(np.stack([exact_mul.to_words(c[k]) for c in cases]))

    n = len(cases)
    state = jamp.ScalerState(
        scale=col("scale", np.float32),
        growth_tracker=col("tracker", np.int32),
        growth_factor=words("growth_factor"),
        backoff_factor=words("backoff_factor"),
        growth_interval=col("growth_interval", np.int32),
        min_scale=jnp.zeros(n),
        max_scale=jnp.full(n, jnp.inf),
        found_inf=col("found_inf", np.float32) != 0,
        consecutive_skips=jnp.zeros(n, jnp.int32),
        warned=jnp.zeros(n, jnp.bool_),
        skip_episodes=jnp.zeros(n, jnp.int32),
        warn_after_skips=jnp.zeros(n, jnp.int32),
        warn_below_scale=jnp.zeros(n, jnp.float32),
        inner_state=None,
    )
    scale, tracker = jax.jit(scale_update.next_scale)(state, state.found_inf)
    np.testing.assert_array_equal(bits(scale), bits([c["new_scale"] for c in cases]))
    np.testing.assert_array_equal(np.asarray(tracker), [c["new_tracker"] for c in cases])
    assert {c["growth_interval"] <= c["tracker"] for c in cases} == {True, False}  # both kinds were covered


def test_inv_scale_is_torchs_double_reciprocal():
    """float32 division is correctly rounded, and rounding 1/s to double first cannot move it (see note)."""
    cases = [c for c in GOLDENS["inv_scale"] if NORMAL[0] <= c["scale"] <= NORMAL[1]]
    assert len(cases) > 200 and {65536.0, 3.0, 7.0, 10.0} <= {c["scale"] for c in cases}
    scales = jnp.asarray(np.array([c["scale"] for c in cases], np.float32))
    np.testing.assert_array_equal(
        bits(jax.jit(lambda s: jnp.float32(1.0) / s)(scales)), bits([c["inv"] for c in cases])
    )
    # Why no double is needed: for a float32 s and a 25-bit (midpoint) m, |1 - s*m| is 0 or >= 2**-49,
    # so 1/s never lies within a double's rounding error (2**-53) of a float32 midpoint.


def test_inverse_pair_is_torchs_reciprocal_subnormal_scales_included():
    """jamp_kernels.inverse never computes on a subnormal scale (XLA would flush it and return inf)."""
    cases = GOLDENS["inv_scale"]
    scales = np.array([c["scale"] for c in cases], np.float32)
    assert np.sum(scales < NORMAL[0]) >= 10
    pair = np.asarray(jax.jit(jamp_kernels.inverse)(jnp.asarray(scales)), np.float64)
    for c, product in zip(cases, pair[0] * pair[1]):
        want = float(np.float32(c["inv"])) if torch_inverse_is_normal(c["scale"]) else exact_inverse(c["scale"])
        assert product == want, c


def test_subnormal_scale_trajectory_compares_with_torch_and_past_torchs_inf(one_compiled_update):
    """Every clean step runs at a subnormal scale; some where torch's 1/scale is finite (compared with
    torch's gradients), some where it is inf (compared with the exact reciprocal)."""
    (traj,) = [t for t in GOLDENS["trajectories"] if t["name"] == "subnormal_scale"]
    assert all(st["scale_used"] < NORMAL[0] for st in traj["steps"] if not st["found_inf"])
    state, update, _ = one_compiled_update
    assert replay(traj, update, state) >= {(k, how) for k in ("w", "b") for how in ("torch", "exact inverse")}


def test_mul_3_times_1_1_is_torchs_double_product():
    assert float(jax.jit(exact_mul.mul_f32_f64)(jnp.float32(3.0), exact_mul.to_words(1.1))) == 3.299999952316284
    assert float(jnp.float32(3.0) * jnp.float32(1.1)) == 3.3000001907348633  # what a float32 multiply gives


@pytest.mark.parametrize("case", GOLDENS["scale_outputs"], ids=lambda c: f"{c['dtype']}{c['shape']}-{c['value']}")
def test_scale_output_dtype_and_value_match_torch(case):
    with jax.enable_x64(case["dtype"] == "float64"):
        state = jamp.scaler(optax.sgd(1.0), init_scale=65536.0).init({})
        out = jamp.scale(jnp.full(case["shape"], case["value"], jnp.dtype(case["dtype"])), state)
        assert out.dtype == jnp.dtype(case["out_dtype"])
        np.testing.assert_array_equal(np.asarray(out, np.float64).ravel(), case["out"])


def test_run_scaling_case_sgd_end_to_end_against_torch():
    """test_cuda.py's _run_scaling_case: growth_interval=1, 4 iterations, inf at iteration 2 -> scale 512."""
    case = GOLDENS["scaling_case"]
    shapes = [(8, 8), (8,), (8, 8), (8,)]
    params = [jnp.asarray(np.reshape(v, s), jnp.float32) for v, s in zip(case["init"], shapes)]

    def loss(p, x, y):
        h = x @ p[0].T + p[1]
        return jnp.mean((h @ p[2].T + p[3] - y) ** 2)

    tx = jamp.scaler(optax.sgd(1.0), init_scale=128.0, growth_factor=2.0, growth_interval=1)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y, inject):
        _, grads = jamp.value_and_grad(loss)(state, params, x, y)
        grads[2] = jnp.where(inject, jnp.inf, grads[2])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i, (x, y) in enumerate(case["data"]):
        x, y = (jnp.asarray(np.reshape(v, (8, 8)), jnp.float32) for v in (x, y))
        params, state = step(params, state, x, y, i == 2)
    assert float(jamp.get_scale(state)) == case["scale"] == 128.0 * 2**3 * 0.5
    for got, want in zip(params, case["final"]):
        np.testing.assert_allclose(np.ravel(got), want, rtol=1e-5, atol=1e-6)
