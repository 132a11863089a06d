"""Every documented bad input raises the documented error, and the message names the argument; inputs
at the edge of what is allowed (subnormal scales, replicated states, threads) work."""

from __future__ import annotations

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
import jamp_kernels
from jamp.casting import transformation as autocast_transformation

IDENTITY = lambda x: x
GRADS = {"w": jnp.ones(3)}
SD = {"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 1}
REPLICAS = 4


def _state():
    return jamp.scaler(optax.sgd(0.1)).init(GRADS)


def _replicated(tx=None):
    """One state per replica, stacked on a leading axis, as ``jax.pmap(tx.init)`` makes them
    (docs/distributed.md); vmap makes the same stack on one device."""
    tx = tx or jamp.scaler(optax.sgd(0.1), init_scale=8.0)
    return jax.vmap(tx.init)({"w": jnp.ones((REPLICAS, 3))})


def _replicas_disagree():
    state = _replicated()
    return state._replace(scale=state.scale.at[1].set(16.0))


def _top_level_with():
    with jamp.autocast(device_type="gpu"):
        pass


def _with_static_argnums():
    def f(x):
        with jamp.autocast(enabled=False, static_argnums=0):
            return x

    jamp.autocast(f)(GRADS["w"])


def _restored_without_target():
    """What orbax's restore(path) gives for {"opt_state": _state()} without a target: NamedTuples become dicts."""
    return {"opt_state": _state()._asdict()}


# (description, thunk, exception type, regex the message must match)
BAD_INPUTS = [
    # autocast
    ("autocast dtype float32", lambda: jamp.autocast(IDENTITY, dtype=jnp.float32), ValueError, r"dtype=.*allowed"),
    ("autocast dtype float64", lambda: jamp.autocast(IDENTITY, dtype="float64"), ValueError, r"dtype=.*allowed"),
    ("autocast dtype int", lambda: jamp.autocast(IDENTITY, dtype=jnp.int8), ValueError, r"dtype=.*allowed"),
    ("autocast dtype typo", lambda: jamp.autocast(IDENTITY, dtype="bfloat"), ValueError, r"dtype='bfloat'"),
    ("autocast device_type", lambda: jamp.autocast(IDENTITY, device_type="xpu"), ValueError, r"device_type='xpu'"),
    ("autocast device_type not str", lambda: jamp.autocast(IDENTITY, device_type=0), ValueError, r"device_type=0"),
    ("autocast non-callable", lambda: jamp.autocast(3), TypeError, r"requires a callable, but got int"),
    ("autocast policy type", lambda: jamp.autocast(IDENTITY, policy=3.5), TypeError, r"policy must be"),
    (
        "static_argnums str",
        lambda: jamp.autocast(IDENTITY, static_argnums="x"),
        TypeError,
        r"static_argnums must be an int or a sequence of ints, got 'x'",
    ),
    (
        "static_argnums float",
        lambda: jamp.autocast(IDENTITY, static_argnums=(0, 1.0)),
        TypeError,
        r"static_argnums.*1\.0",
    ),
    (
        "static_argnames int",
        lambda: jamp.autocast(IDENTITY, static_argnames=3),
        TypeError,
        r"static_argnames must be a str or a sequence of strs, got 3",
    ),
    (
        "static_argnames list of int",
        lambda: jamp.autocast(IDENTITY, static_argnames=["n", 0]),
        TypeError,
        r"static_argnames",
    ),
    (
        "autocast policy name",
        lambda: jamp.autocast(IDENTITY, policy="gpuu"),
        ValueError,
        (
            r"'gpuu' is not a policy name.*device name \('cpu', 'cuda', 'gpu', 'tpu'\).*'mixed_float16'.*'bf16'.*"
            r"p=f32,c=bf16,o=f32.*Did you mean 'gpu'\?"
        ),
    ),
    (
        "autocast enabled not a bool",
        lambda: jamp.autocast(IDENTITY, enabled="no"),
        TypeError,
        r"enabled must be a bool.*'no' of type str",
    ),
    (
        "autocast cache_enabled not a bool",
        lambda: jamp.autocast(IDENTITY, cache_enabled=None),
        TypeError,
        r"cache_enabled must be a bool",
    ),
    ("autocast decorator enabled not a bool", lambda: jamp.autocast(enabled=1), TypeError, r"enabled must be a bool"),
    (
        "autocast str output",
        lambda: jamp.autocast(lambda x: {"y": x, "name": "run"})(GRADS["w"]),
        TypeError,
        r"<lambda> returned str 'run' as output\['name'\].*pytree of arrays and Python numbers",
    ),
    (
        "autocast with at top level",
        _top_level_with,
        RuntimeError,
        r"outside any function that jamp.autocast transforms.*jamp.autocast\(fn, device_type='gpu'\)\(\*args\)",
    ),
    ("autocast with static_argnums", _with_static_argnums, TypeError, r"static_argnums .* a `with"),
    ("custom_fwd cast_inputs", lambda: jamp.custom_fwd(IDENTITY, cast_inputs="int8"), ValueError, r"cast_inputs"),
    ("custom_fwd non-callable", lambda: jamp.custom_fwd(3), TypeError, r"custom_fwd requires a callable"),
    # policies
    ("policy key", lambda: jamp.get_policy("q=f32"), ValueError, r"cannot parse 'q=f32'"),
    ("policy compute float32", lambda: jamp.get_policy("c=f32"), ValueError, r"compute dtype float32"),
    ("policy output dtype", lambda: jamp.get_policy("c=bf16,o=f64"), ValueError, r"output_dtype"),
    ("policy device", lambda: jamp.get_policy("c=bf16,d=npu"), ValueError, r"device_type='npu'"),
    ("policy type", lambda: jamp.get_policy(None), TypeError, r"policy must be"),
    ("policy key twice", lambda: jamp.get_policy("c=bf16,c=f16"), ValueError, r"'c=bf16,c=f16'.*'compute' given twice"),
    ("policy alias twice", lambda: jamp.get_policy("c=bf16,compute=bf16"), ValueError, r"compute.*twice"),
    (
        "autocast policy key twice",
        lambda: jamp.autocast(IDENTITY, policy="o=f32,output=f16"),
        ValueError,
        r"output.*twice",
    ),
    ("region mode", lambda: jamp.get_policy("gpu").with_rules({"x": "fp32"}), ValueError, r"region mode 'fp32'"),
    ("category", lambda: jamp.get_policy("gpu").with_categories({"exp": "low"}), ValueError, r"categories\['exp'\]"),
    ("find_overflow threshold", lambda: jamp.find_overflow(IDENTITY, min_underflow=-1), ValueError, r"min_underflow"),
    # kernels
    ("kernel backend", lambda: jamp_kernels.unscale_and_check(GRADS, 1.0, backend="cuda"), ValueError, r"backend"),
    ("kernel non-array leaf", lambda: jamp_kernels.unscale_and_check({"w": 1.0}, 1.0), TypeError, r"grads\['w'\]"),
    (
        "kernel complex leaf",
        lambda: jamp_kernels.unscale_and_check({"w": jnp.ones(2, jnp.complex64)}, 1.0),
        TypeError,
        r"grads\['w'\].*complex",
    ),
    ("kernel inv_scale shape", lambda: jamp_kernels.unscale_and_check(GRADS, jnp.ones(3)), ValueError, r"inv_scale"),
    *[
        (
            f"kernel inv_scale {v!r}",
            (lambda v=v: jamp_kernels.unscale_and_check(GRADS, v)),
            TypeError,
            r"inv_scale must be a real number or a real array",
        )
        for v in (None, 1j, {}, "0.5", True, jnp.ones(1, complex))
    ],
    *[
        (
            f"kernel inv_scale {v!r}",
            (lambda v=v: jamp_kernels.unscale_and_check(GRADS, v)),
            ValueError,
            r"inv_scale must be finite and > 0",
        )
        for v in (
            np.nan,
            np.inf,
            -np.inf,
            -0.5,
            0.0,
            jnp.array([0.5, np.nan]),
            np.float32(-2.0),
            jnp.array([-1.0, 1.0]),
        )
    ],
    ("unscale inv_scale nan", lambda: jamp_kernels.unscale(GRADS, np.nan), ValueError, r"inv_scale must be finite"),
    # scaler hyperparameters
    ("growth_factor <= 1", lambda: jamp.scaler(optax.sgd(0.1), growth_factor=1.0), ValueError, r"growth_factor"),
    ("backoff_factor >= 1", lambda: jamp.scaler(optax.sgd(0.1), backoff_factor=1.0), ValueError, r"backoff_factor"),
    ("backoff_factor <= 0", lambda: jamp.scaler(optax.sgd(0.1), backoff_factor=0.0), ValueError, r"backoff_factor"),
    ("init_scale inf", lambda: jamp.scaler(optax.sgd(0.1), init_scale=float("inf")), ValueError, r"init_scale"),
    ("init_scale <= 0", lambda: jamp.scaler(optax.sgd(0.1), init_scale=-1.0), ValueError, r"init_scale"),
    (
        "init_scale 10**400",
        lambda: jamp.scaler(optax.sgd(0.1), init_scale=10**400),
        ValueError,
        r"init_scale must be a finite float > 0",
    ),
    (
        "growth_factor 10**400",
        lambda: jamp.scaler(optax.sgd(0.1), growth_factor=10**400),
        ValueError,
        r"growth_factor must be a finite float > 1",
    ),
    (
        "backoff_factor -10**400",
        lambda: jamp.scaler(optax.sgd(0.1), backoff_factor=-(10**400)),
        ValueError,
        r"backoff_factor must be a float in \(0, 1\)",
    ),
    ("growth_interval < 1", lambda: jamp.scaler(optax.sgd(0.1), growth_interval=0), ValueError, r"growth_interval"),
    ("scaler backend", lambda: jamp.scaler(optax.sgd(0.1), backend="gpu"), ValueError, r"backend"),
    ("scaler without inner", lambda: jamp.scaler(), TypeError, r"jamp.scaler\(optax.adam"),
    ("scaler inner type", lambda: jamp.scaler(lambda g: g), TypeError, r"argument 0 must be an optax"),
    (
        "scaler enabled not a bool",
        lambda: jamp.scaler(optax.sgd(0.1), enabled="no"),
        TypeError,
        r"enabled must be a bool",
    ),
    (
        "scaler under inject_hyperparams",
        lambda: optax.inject_hyperparams(jamp.scaler)(optax.sgd(0.1), init_scale=4.0).init(GRADS),
        TypeError,
        (
            r"optax.inject_hyperparams\(jamp.scaler\) passes arrays.*"
            r"jamp.scaler\(optax.inject_hyperparams\(optax.adam\)\(learning_rate=1e-3\)\)"
        ),
    ),
    (
        "value_and_grad without opt_state",
        lambda: jamp.value_and_grad(lambda p: p["w"].sum())(GRADS),
        TypeError,
        r"first argument must be the optimizer state.*jamp.value_and_grad\(loss_fn\)\(opt_state, params, batch\)",
    ),
    # state dicts
    ("load empty state_dict", lambda: jamp.load_state_dict(_state(), {}), ValueError, r"disabled"),
    (
        "load state_dict missing key",
        lambda: jamp.load_state_dict(_state(), {"scale": 2.0}),
        ValueError,
        r"growth_factor",
    ),
    *[
        (
            f"load scale {v!r}"[:40],
            (lambda v=v: jamp.load_state_dict(_state(), {**SD, "scale": v})),
            ValueError,
            r"^scale must be a finite float > 0 \(in float32\)",
        )
        for v in (np.nan, np.inf, -np.inf, -2.0, 0.0, -0.0, 1e39, 10**400, np.float64(3.5e38))
    ],
    (
        "load scale str",
        lambda: jamp.load_state_dict(_state(), {**SD, "scale": "2.0"}),
        TypeError,
        r"^scale must be a real number",
    ),
    (
        "load growth_factor 10**400",
        lambda: jamp.load_state_dict(_state(), {**SD, "growth_factor": 10**400}),
        ValueError,
        r"growth_factor must be",
    ),
    (
        "load state_dict int",
        lambda: jamp.load_state_dict(_state(), 42),
        TypeError,
        r"state dict must be a mapping.*got int",
    ),
    (
        "load state_dict str",
        lambda: jamp.load_state_dict(_state(), "scale"),
        TypeError,
        r"state dict must be a mapping.*got str",
    ),
    (
        "load state_dict list",
        lambda: jamp.load_state_dict(_state(), [("scale", 2.0)]),
        TypeError,
        r"state dict must be a mapping.*got list",
    ),
    (
        "state_dict replicas disagree",
        lambda: jamp.state_dict(_replicas_disagree()),
        ValueError,
        r"replicas hold different values of 'scale'.*x\[0\]",
    ),
    (
        "set_scale shape",
        lambda: jamp.set_scale(_state(), jnp.ones(3)),
        ValueError,
        r"new_scale must be a scalar or a one-element array, got shape \(3,\)",
    ),
    (
        "helpers without a scaler",
        lambda: jamp.get_scale(optax.sgd(0.1).init(GRADS)),
        ValueError,
        r"opt_state.*no jamp.scaler state",
    ),
    (
        "helpers on a checkpoint restored without a target",
        lambda: jamp.get_scale(_restored_without_target()),
        ValueError,
        (
            r"ScalerState's fields at \['opt_state'\].*restored without a target.*tx.init\(params\).*"
            r"jax.eval_shape\(tx.init, params\)"
        ),
    ),
    (
        "value_and_grad on a checkpoint restored without a target",
        lambda: jamp.value_and_grad(lambda p: p["w"].sum())(_restored_without_target(), GRADS),
        ValueError,
        r"restored without a target",
    ),
]


@pytest.mark.parametrize("description,thunk,error,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(description, thunk, error, match):
    with pytest.raises(error, match=match):
        thunk()


def test_failed_load_leaves_the_state_as_it_was():
    state = jamp.load_state_dict(_state(), SD)
    for bad in ({**SD, "scale": -1.0}, {**SD, "_growth_tracker": -1}, {**SD, "growth_interval": 0}):
        with pytest.raises(ValueError):
            jamp.load_state_dict(state, bad)
        assert jamp.state_dict(state) == SD


# ------------------------------------------------- subnormal scales (issue 16, defect 1)


def test_subnormal_scale_never_gives_nan_updates():
    """XLA flushes a subnormal scale: 1/scale was inf and 0 * inf made NaN updates with found_inf False."""
    tx = jamp.scaler(optax.sgd(0.1), init_scale=2.0**-127)
    params = {"w": jnp.array([1.0, -2.0])}
    state = tx.init(params)
    grads = jax.grad(lambda q: jamp.scale(jnp.sum(q["w"] ** 2), state))(params)
    updates, state = tx.update(grads, state, params)
    assert updates["w"].dtype == jnp.float32 and np.all(np.isfinite(updates["w"])) and not bool(state.found_inf)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("scale", [2.0**-127, 3.0e-39, 1e-40, 2.0**-149])
def test_subnormal_scale_unscales_exactly(backend, scale):
    """Gradients large enough to be normal after scaling come back exact: torch (where its 1/scale is
    finite) trains on at such scales."""
    tx = jamp.scaler(optax.sgd(1.0), init_scale=scale, backend=backend)
    params = {"w": jnp.array([1.0, -2.0, 0.0])}
    state = tx.init(params)
    big = jnp.float32(2.0**100)  # the loss is huge, so the scaled loss and grads are normal floats
    grads = jax.jit(jax.grad(lambda q: jamp.scale(big * jnp.sum(q["w"] ** 2), state)))(params)
    assert np.all(np.abs(np.asarray(grads["w"])[:2]) >= 2.0**-126)
    updates, new = jax.jit(tx.update)(grads, state, params)
    expected = -(np.asarray(grads["w"], np.float64) / np.float64(np.float32(scale))).astype(np.float32)
    assert updates["w"].dtype == jnp.float32 and not bool(new.found_inf)
    np.testing.assert_array_equal(np.asarray(updates["w"]), expected)


# ------------------------------------------------- replicated states (issue 16, defect 3)


def test_state_dict_and_load_state_dict_on_replicated_states():
    tx = jamp.scaler(optax.sgd(0.1), init_scale=8.0)
    stacked = _replicated(tx)
    assert jamp.state_dict(stacked) == {
        "scale": 8.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
    }
    loaded = jamp.load_state_dict(stacked, {**SD, "growth_factor": 1.5, "_growth_tracker": 2})
    assert jax.tree.map(lambda x: (x.shape, x.dtype), loaded) == jax.tree.map(lambda x: (x.shape, x.dtype), stacked)
    _, after = jax.vmap(tx.update)({"w": jnp.ones((REPLICAS, 3))}, loaded)  # tracker 2 + 1 == interval 3: grow
    assert jamp.state_dict(after) == {**SD, "growth_factor": 1.5, "scale": 6.0, "_growth_tracker": 0}
    assert np.asarray(after.scale).tolist() == [6.0] * REPLICAS
    reset = jamp.set_scale(stacked, 2.0)
    assert reset.scale.shape == (REPLICAS,) and jamp.state_dict(reset)["scale"] == 2.0


# ------------------------------------------------- autocast (issue 16, defects 4 and 5)


def test_autocast_cache_lookup_and_eviction_race(monkeypatch):
    """One thread's cache hit must survive another thread evicting that entry meanwhile (a KeyError
    escaped from move_to_end). The lookup is slowed down so that the eviction lands inside it."""
    monkeypatch.setattr(autocast_transformation, "CACHE_SIZE", 1)
    f = jamp.autocast(lambda x: x * 2)
    a, b = jnp.ones(2), jnp.ones(3)
    f(a)
    looking_up = threading.Event()

    class SlowLookups(collections.OrderedDict):
        def get(self, key, default=None):
            entry = super().get(key, default)
            if entry is not None:
                looking_up.set()
                time.sleep(0.5)
            return entry

    f._cache = SlowLookups(f._cache)
    results, errors = [], []

    def call(x):
        try:
            results.append(f(x))
        except Exception as e:  # reported by the assert below
            errors.append(e)

    hit = threading.Thread(target=call, args=(a,))
    hit.start()
    assert looking_up.wait(10)
    call(b)  # a miss: traces and evicts a's entry (cache size 1)
    hit.join()
    assert errors == [] and sorted(r.shape for r in results) == [(2,), (3,)]
    assert all(r.dtype == jnp.float32 and np.all(np.asarray(r) == 2.0) for r in results)


def test_autocast_negative_static_argnums_count_from_the_end():
    """As jax.jit: -1 is the last positional argument of each call."""
    f = jamp.autocast(lambda x, n: x * 2 if n > 2 else x, static_argnums=-1)  # `if` fails on a tracer
    out = f(jnp.ones(2), np.int32(3))
    assert out.dtype == jnp.float32 and np.asarray(out).tolist() == [2.0, 2.0]
    g = jamp.autocast(lambda x, n, m=1: x * n * m, static_argnums=(-2, -1))
    assert np.asarray(g(jnp.ones(2), np.int32(2), np.int32(3))).tolist() == [6.0, 6.0]
