"""jamp.scaler: API, validation, skip invariant, helpers, state round-trips, backends."""

from __future__ import annotations

import collections
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from compile_flags import as_users
from helpers import lower_for_cuda, run_subprocess

import jamp
import jamp_kernels

PARAMS = {"w": jnp.arange(6.0).reshape(2, 3) / 7, "b": jnp.ones(3)}


def loss_fn(p, x=1.0):
    return jnp.sum(jnp.tanh(p["w"] * x)) + jnp.sum(p["b"] ** 2)


def grads_with(opt_state, poison=None, params=PARAMS):
    g = jax.grad(lambda p: jamp.scale(loss_fn(p), opt_state))(params)
    return g if poison is None else {**g, "w": g["w"].at[1, 2].set(poison)}


# ---------------------------------------------------------------- construction and validation


def test_public_names():
    for name in (
        "scaler",
        "ScalerState",
        "scale",
        "get_scale",
        "found_inf",
        "set_scale",
        "state_dict",
        "load_state_dict",
        "value_and_grad",
        "from_restored",
    ):
        assert name in jamp.__all__ and hasattr(jamp, name)


def test_returns_extra_args_transformation_and_state():
    tx = jamp.scaler(optax.adam(1e-3))
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    st = tx.init(PARAMS)
    assert isinstance(st, jamp.ScalerState)
    fields = {k: (v.dtype, v.shape) for k, v in st._asdict().items() if k != "inner_state"}
    assert fields == {
        "scale": (jnp.float32, ()),
        "growth_tracker": (jnp.int32, ()),
        "growth_factor": (jnp.uint32, (2,)),
        "backoff_factor": (jnp.uint32, (2,)),
        "growth_interval": (jnp.int32, ()),
        "min_scale": (jnp.float32, ()),
        "max_scale": (jnp.float32, ()),
        "found_inf": (jnp.bool_, ()),
        "warn_after_skips": (jnp.int32, ()),
        "warn_below_scale": (jnp.float32, ()),
        "consecutive_skips": (jnp.int32, ()),
        "warned": (jnp.bool_, ()),
        "skip_episodes": (jnp.int32, ()),
    }
    assert (float(st.scale), int(st.growth_interval), bool(st.found_inf)) == (65536.0, 2000, False)
    assert (int(st.consecutive_skips), bool(st.warned), int(st.skip_episodes)) == (0, False, 0)
    assert (int(st.warn_after_skips), float(st.warn_below_scale)) == (32, 1.0)


def test_nothing_to_wrap_explains_the_wrapping_form():
    with pytest.raises(TypeError, match=r"jamp\.scaler\(optax\.adam.*optax\.chain\(jamp\.scaler\(\)"):
        jamp.scaler()
    with pytest.raises(TypeError, match="needs the optimizer"):
        jamp.scaler(init_scale=4.0)


@pytest.mark.parametrize("bad", [optax.adam, 3.0, (optax.sgd(1.0),)])
def test_inner_must_be_a_gradient_transformation(bad):
    with pytest.raises(TypeError, match="argument 0 must be an optax.GradientTransformation"):
        jamp.scaler(bad)
    with pytest.raises(TypeError, match="argument 1 must be"):
        jamp.scaler(optax.sgd(1.0), bad, enabled=False)


BAD = [
    ("growth_factor", 1.0, ValueError, "> 1.0"),
    ("growth_factor", 0.5, ValueError, "> 1.0"),
    ("growth_factor", math.inf, ValueError, "finite"),
    ("growth_factor", math.nan, ValueError, "> 1.0"),
    ("growth_factor", "2", TypeError, "real number"),
    ("growth_factor", True, TypeError, "real number"),
    ("backoff_factor", 0.0, ValueError, r"\(0, 1\)"),
    ("backoff_factor", 1.0, ValueError, r"\(0, 1\)"),
    ("backoff_factor", -0.5, ValueError, r"\(0, 1\)"),
    ("backoff_factor", math.nan, ValueError, r"\(0, 1\)"),
    ("init_scale", 0.0, ValueError, "> 0"),
    ("init_scale", -1.0, ValueError, "> 0"),
    ("init_scale", math.inf, ValueError, "finite"),
    ("init_scale", math.nan, ValueError, "finite"),
    ("init_scale", 1e39, ValueError, "in float32"),
    ("init_scale", 1e-50, ValueError, "in float32"),
    ("init_scale", None, TypeError, "real number"),
    ("growth_interval", 0, ValueError, r"\[1, 2147483647\]"),
    ("growth_interval", -3, ValueError, ">= 1|\\[1,"),
    ("growth_interval", 2**31, ValueError, r"\[1, 2147483647\]"),
    ("growth_interval", 2.0, TypeError, "an int"),
    ("growth_interval", True, TypeError, "an int"),
    ("min_scale", 0.0, ValueError, "> 0"),
    ("min_scale", math.inf, ValueError, "finite"),
    ("max_scale", -2.0, ValueError, "> 0"),
    ("backend", "cuda", ValueError, "auto.*xla.*pallas.*interpret"),
]


@pytest.mark.parametrize("name,value,error,allowed", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_hyperparameter_names_argument_and_allowed_values(name, value, error, allowed):
    with pytest.raises(error, match=name) as info:
        jamp.scaler(optax.sgd(1.0), **{name: value})
    assert info.match(allowed)
    jamp.scaler(optax.sgd(1.0), enabled=False, **{name: value})  # torch: a disabled scaler validates nothing


def test_bounds_must_be_ordered_and_hold_init_scale():
    with pytest.raises(ValueError, match="min_scale must be <= max_scale"):
        jamp.scaler(optax.sgd(1.0), min_scale=4.0, max_scale=2.0)
    with pytest.raises(ValueError, match=r"init_scale must lie in \[min_scale, max_scale\]"):
        jamp.scaler(optax.sgd(1.0), init_scale=2.0**16, max_scale=2.0**10)


def test_import_creates_no_jax_array():
    out = run_subprocess(
        """
        import jamp
        from jax._src import xla_bridge
        print(xla_bridge.backends_are_initialized())
    """,
        devices=1,
    )
    assert out.strip() == "False"


# ---------------------------------------------------------------- the step


def test_skip_leaves_params_and_adam_state_bit_identical():
    tx = jamp.scaler(optax.adam(1e-2), init_scale=2.0**10, growth_interval=3)
    params = {**PARAMS, "z": jnp.array([-0.0, 0.0])}
    state = tx.init(params)

    @jax.jit
    def step(p, s, bad):
        u, s = tx.update(jax.tree.map(lambda g: g + bad, grads_with(s, params=p)), s, p)
        return optax.apply_updates(p, u), s, u

    for _ in range(2):
        params, state, _ = step(params, state, 0.0)
    for poison in (jnp.inf, -jnp.inf, jnp.nan):
        new_params, new_state, updates = step(params, state, poison)
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
        chex.assert_trees_all_equal(new_params, params)
        assert np.asarray(new_params["z"]).view(np.uint32).tolist() == [0x80000000, 0]  # even -0.0 survives
        chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)  # Adam's count, mu, nu
        assert bool(new_state.found_inf) and int(new_state.growth_tracker) == 0
        assert float(new_state.scale) == float(state.scale) / 2
        state = new_state
    params2, state2, _ = step(params, state, 0.0)
    assert int(state2.inner_state[0].count) == 3 and not bool(state2.found_inf)
    assert not np.array_equal(params2["w"], params["w"])


def test_unscales_with_the_scale_that_scaled_the_loss():
    """mpx unscaled with the post-growth scale, halving grads on growth steps; here growth happens every step."""
    tx = jamp.scaler(optax.sgd(1.0), init_scale=8.0, growth_interval=1)
    state, update = tx.init(PARAMS), jax.jit(tx.update)
    true = jax.grad(loss_fn)(PARAMS)
    for expected_scale in (16.0, 32.0, 64.0):
        updates, state = update(grads_with(state), state, PARAMS)
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.negative, true))  # power-of-2 scale: exact
        assert float(state.scale) == expected_scale


def test_found_inf_is_taken_from_the_scaled_grads():
    """torch checks the values it was given: with a scale below 1, unscaling a finite grad can overflow."""
    tx = jamp.scaler(optax.sgd(1.0), init_scale=0.25)
    updates, state = jax.jit(tx.update)({"w": jnp.array([1e38, 1.0])}, tx.init({"w": jnp.zeros(2)}))
    assert not bool(state.found_inf)
    assert np.isinf(updates["w"][0]) and updates["w"][1] == -4.0


def test_half_and_double_grads_unscale_in_torchs_opmath():
    """torch_amp_behavior.md 1.4: fp16 65504 * (1/3) -> 21840; fp64 3 * float32(1/3) = 1.0000000298023224."""
    tx = jamp.scaler(optax.sgd(-1.0), init_scale=3.0)
    grads = {"h": jnp.array([65504.0], jnp.float16), "b": jnp.array([3.0], jnp.bfloat16)}
    updates, _ = jax.jit(tx.update)(grads, tx.init(grads))
    assert updates["h"].dtype == jnp.float16 and float(updates["h"][0]) == 21840.0
    assert updates["b"].dtype == jnp.bfloat16 and float(updates["b"][0]) == 1.0
    with jax.enable_x64(True):
        d = {"d": jnp.array([3.0], jnp.float64)}
        updates, _ = jax.jit(tx.update)(d, tx.init(d))
        assert updates["d"].dtype == jnp.float64 and float(updates["d"][0]) == 1.0000000298023224


def test_several_transformations_are_chained_and_clip_sees_unscaled_grads():
    clip_then_sgd = (optax.clip_by_global_norm(0.5), optax.sgd(1.0))
    tx = jamp.scaler(*clip_then_sgd, init_scale=2.0**12)
    state = tx.init(PARAMS)
    updates, state = jax.jit(tx.update)(grads_with(state), state, PARAMS)
    ctrl = optax.chain(*clip_then_sgd)
    control, _ = ctrl.update(jax.grad(loss_fn)(PARAMS), ctrl.init(PARAMS))
    chex.assert_trees_all_equal(updates, control)
    assert isinstance(state.inner_state, tuple) and len(state.inner_state) == 2


def test_extra_args_reach_inner():
    def update(u, s, params=None, *, temperature):
        return jax.tree.map(lambda g: g * temperature, u), s

    tx = jamp.scaler(optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update), init_scale=4.0)
    updates, _ = jax.jit(tx.update)({"w": jnp.array([4.0])}, tx.init({"w": jnp.zeros(1)}), None, temperature=3.0)
    assert float(updates["w"][0]) == 3.0


def test_growth_never_into_inf_and_optional_bounds():
    tx = jamp.scaler(optax.sgd(1.0), init_scale=1e38, growth_factor=16.0, growth_interval=1)
    _, state = tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))
    assert float(state.scale) == float(np.float32(1e38)) and int(state.growth_tracker) == 0
    tx = jamp.scaler(optax.sgd(1.0), init_scale=8.0, growth_interval=1, min_scale=2.0, max_scale=20.0)
    state, update, seen = tx.init({"w": jnp.ones(1)}), jax.jit(tx.update), []
    for g in (1.0, 1.0, jnp.inf, jnp.inf, jnp.inf, jnp.inf):
        _, state = update({"w": jnp.array([g])}, state)
        seen.append(float(state.scale))
    assert seen == [16.0, 20.0, 10.0, 5.0, 2.5, 2.0]


def test_scale_update_rule_uses_exact_equality_with_the_interval():
    """A tracker already past the interval (loaded) counts on without growing, until a backoff (torch)."""
    tx = jamp.scaler(optax.sgd(1.0), init_scale=4.0, growth_interval=2)
    state = jamp.load_state_dict(
        tx.init({"w": jnp.ones(1)}),
        {"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2, "_growth_tracker": 5},
    )
    update, seen = jax.jit(tx.update), []
    for g in (1.0, 1.0, jnp.nan, 1.0, 1.0):
        _, state = update({"w": jnp.array([g])}, state)
        seen.append((float(state.scale), int(state.growth_tracker)))
    assert seen == [(4.0, 6), (4.0, 7), (2.0, 0), (2.0, 1), (4.0, 0)]


def test_axis_name_makes_every_replica_skip():
    tx = jamp.scaler(optax.sgd(1.0), axis_name="batch", init_scale=2.0)
    state = tx.init({"w": jnp.zeros(2)})
    grads = {"w": jnp.array([[2.0, 2.0], [2.0, 2.0], [jnp.inf, 2.0]])}
    updates, new = jax.jit(jax.vmap(tx.update, in_axes=(0, None), out_axes=(0, None), axis_name="batch"))(grads, state)
    assert bool(new.found_inf) and float(new.scale) == 1.0
    np.testing.assert_array_equal(updates["w"], np.zeros((3, 2)))
    alone = jamp.scaler(optax.sgd(1.0), init_scale=2.0)
    updates, new = jax.jit(jax.vmap(alone.update, in_axes=(0, None)))(grads, state)
    np.testing.assert_array_equal(updates["w"], [[-1, -1], [-1, -1], [0, 0]])  # without it, only row 2 skips
    np.testing.assert_array_equal(new.scale, [2.0, 2.0, 1.0])


# ---------------------------------------------------------------- backends


def _spy(monkeypatch):
    calls = []
    for name in ("unscale_and_check", "has_nonfinite", "unscale"):
        real = getattr(jamp_kernels, name)
        monkeypatch.setattr(
            jamp_kernels, name, lambda *a, _n=name, _r=real, **k: calls.append((_n, k.get("backend"))) or _r(*a, **k)
        )
    return calls


@pytest.mark.parametrize("backend", ["auto", "xla", "pallas", "interpret"])
def test_backend_picks_the_check_and_the_unscale_stays_fusable_jnp(monkeypatch, backend):
    calls = _spy(monkeypatch)
    tx = jamp.scaler(optax.sgd(1.0), backend=backend)
    jax.make_jaxpr(tx.update)(PARAMS, tx.init(PARAMS))
    assert sorted(set(calls)) == [("has_nonfinite", backend), ("unscale", None)]


@pytest.mark.parametrize("platform,kernel_launches", [("cpu", 0), ("cuda", 1)])
def test_auto_backend_checks_with_one_kernel_launch_on_cuda_only(platform, kernel_launches):
    params = {f"w{i}": jnp.ones((16, 8)) for i in range(5)}
    # The skipped-steps warning's host callback lowers only for this machine's platform (docs/gradient-scaling.md)
    tx = jamp.scaler(optax.adam(1e-3), warn_after_skips=None, warn_below_scale=None)

    def step(p, s):
        return tx.update(p, s, p)

    lowered = (
        lower_for_cuda(step, params, tx.init(params))
        if platform == "cuda"
        else jax.jit(step).lower(params, tx.init(params))
    )
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == kernel_launches


def _compiled_step(update, params, state):
    def step(p, s, g):
        u, s = update(g, s, p)
        return optax.apply_updates(p, u), s

    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile(as_users()).as_text()
    return hlo, len(re.findall(r"= f32\[64,32\]\{1,0\} fusion\(", hlo))


def test_xla_backend_compiles_to_adam_plus_a_check():
    """Performance contract (jamp/scaling/skip.py, jamp_kernels/xla.py): no conditional at all (the skipped-steps
    report counts with selects, jamp/scaling/skip_episodes.py; on a GPU a conditional is a host read), no copy of any parameter-sized buffer, Adam's own loops (the unscale
    and the selects fused in) and nothing else that writes a parameter-sized array, and on a CPU a check without
    floating-point reductions."""
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones(32)}
    tx, adam = jamp.scaler(optax.adam(1e-3), backend="xla"), optax.adam(1e-3)
    hlo, loops = _compiled_step(tx.update, params, tx.init(params))
    _, bare_loops = _compiled_step(
        lambda g, s, p: adam.update(jax.tree.map(lambda x: x / 4, g), s, p), params, adam.init(params)
    )
    assert " conditional(" not in hlo
    assert not re.search(r"\] copy\(", hlo.replace("[] copy(", ""))
    assert bare_loops == 3 and loops == bare_loops
    assert not re.search(r"= f32\[[0-9,]*\]\S* (reduce|reduce-window)\(", hlo)  # fused bodies are in the text


def test_interpret_backend_matches_xla_backend():
    """Same unscaled grads bit for bit (sgd(1) exposes them), same decisions and scales."""
    results = []
    for backend in ("xla", "interpret"):
        tx = jamp.scaler(optax.sgd(1.0), init_scale=3.0, growth_interval=1, backend=backend)
        state = tx.init(PARAMS)
        out = []
        for poison in (None, jnp.nan, None):
            updates, state = tx.update(grads_with(state, poison), state, PARAMS)
            out.append((updates, state))
        results.append(out)
    chex.assert_trees_all_equal(*results)


# ---------------------------------------------------------------- helpers


def test_scale_follows_torch_promotion_and_maps_pytrees():
    state = jamp.scaler(optax.sgd(1.0), init_scale=4.0).init({})
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        out = jamp.scale(jnp.asarray(1.5, dtype), state)
        assert out.dtype == jnp.float32 and float(out) == 6.0
    assert jamp.scale(jnp.full(3, 1.5, jnp.float16), state).dtype == jnp.float16
    assert jamp.scale(jnp.asarray(3, jnp.int32), state).dtype == jnp.float32
    assert float(jamp.scale(2.0, state)) == 8.0
    tree = jamp.scale({"a": 1.0, "b": [jnp.asarray(2.0, jnp.bfloat16), None]}, state)
    assert float(tree["a"]) == 4.0 and tree["b"][0].dtype == jnp.float32 and tree["b"][1] is None


@pytest.mark.filterwarnings(r"ignore:optax\.MultiSteps\(jamp\.scaler\(\.\.\.\), k\)")  # the nesting under test
def test_helpers_find_the_state_inside_wrappers():
    inner = jamp.scaler(optax.adam(1e-3), init_scale=8.0)
    wrapped = {
        "multisteps": optax.MultiSteps(inner, 2),
        "inject": optax.inject_hyperparams(lambda lr: jamp.scaler(optax.adam(lr), init_scale=8.0))(lr=1e-3),
        "multi_transform": optax.multi_transform({"a": inner, "b": optax.sgd(1.0)}, {"w": "a", "b": "b"}),
        "chain": optax.chain(optax.add_decayed_weights(1e-4), inner),
    }
    for name, tx in wrapped.items():
        opt_state = tx.init(PARAMS)
        assert float(jamp.get_scale(opt_state)) == 8.0, name
        new = jamp.set_scale(opt_state, 3.0)
        assert float(jamp.get_scale(new)) == 3.0 and float(jamp.get_scale(opt_state)) == 8.0, name
        assert jax.tree.structure(new) == jax.tree.structure(opt_state), name
        assert float(jamp.scale(1.0, new)) == 3.0 and not bool(jamp.found_inf(new)), name
        assert jamp.state_dict(jamp.load_state_dict(opt_state, jamp.state_dict(new))) == jamp.state_dict(new)


def test_helpers_need_exactly_one_scaler_state():
    with pytest.raises(ValueError, match="found no jamp.scaler state"):
        jamp.get_scale(optax.adam(1.0).init(PARAMS))
    two = optax.multi_transform(
        {"a": jamp.scaler(optax.sgd(1.0)), "b": jamp.scaler(optax.sgd(1.0))}, {"w": "a", "b": "b"}
    ).init(PARAMS)
    with pytest.raises(ValueError, match="found 2 jamp.scaler states"):
        jamp.scale(1.0, two)
    assert float(jamp.get_scale(two.inner_states["a"])) == 65536.0


def test_set_scale_keeps_the_tracker_and_rounds_to_float32():
    tx = jamp.scaler(optax.sgd(1.0), growth_interval=5)
    _, state = tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))
    new = jamp.set_scale(state, 0.1)
    assert float(new.scale) == float(np.float32(0.1)) and int(new.growth_tracker) == 1
    traced = jax.jit(jamp.set_scale)(state, jnp.float32(7.0))
    assert float(traced.scale) == 7.0


def test_value_and_grad_returns_unscaled_loss_and_scaled_grads():
    tx = jamp.scaler(optax.sgd(1.0), init_scale=2.0**10)
    state = tx.init(PARAMS)
    loss, grads = jamp.value_and_grad(loss_fn)(state, PARAMS, 2.0)
    assert float(loss) == float(loss_fn(PARAMS, 2.0))
    chex.assert_trees_all_equal(grads, jax.tree.map(lambda g: g * 2.0**10, jax.grad(loss_fn)(PARAMS, 2.0)))

    def aux_fn(x, p):
        return jnp.asarray(loss_fn(p, x), jnp.bfloat16), {"x": x}

    (loss, aux), grads = jamp.value_and_grad(aux_fn, argnums=1, has_aux=True)(state, 2.0, PARAMS)
    assert loss.dtype == jnp.bfloat16 and aux == {"x": 2.0} and set(grads) == {"w", "b"}
    updates, _ = tx.update(grads, state, PARAMS)
    chex.assert_trees_all_close(updates, jax.tree.map(jnp.negative, jax.grad(loss_fn)(PARAMS, 2.0)), rtol=1e-2)


# ---------------------------------------------------------------- disabled


def test_disabled_is_torchs_disabled_gradscaler():
    tx = jamp.scaler(optax.sgd(1.0), enabled=False, growth_factor=0.5)
    state = tx.init(PARAMS)
    assert isinstance(state, jamp.DisabledScalerState)
    loss = jnp.asarray(2.0, jnp.float16)
    assert jamp.scale(loss, state) is loss
    assert float(jamp.get_scale(state)) == 1.0 and not bool(jamp.found_inf(state))
    assert jamp.state_dict(state) == {}
    assert jamp.load_state_dict(state, {"scale": 3.0}) is state and jamp.set_scale(state, 5.0) is state
    updates, state = tx.update({"w": jnp.array([jnp.inf]), "b": jnp.ones(3)}, state)
    assert np.isinf(updates["w"][0]) and float(updates["b"][0]) == -1.0  # no skip: inner always applied


# ---------------------------------------------------------------- state_dict


def test_state_dict_has_torchs_five_keys_in_order_with_python_types():
    tx = jamp.scaler(optax.sgd(1.0), init_scale=12345.678, growth_factor=1.1, backoff_factor=0.3, growth_interval=7)
    sd = jamp.state_dict(tx.init(PARAMS))
    assert list(sd) == ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]
    assert sd == {
        "scale": float(np.float32(12345.678)),
        "growth_factor": 1.1,
        "backoff_factor": 0.3,
        "growth_interval": 7,
        "_growth_tracker": 0,
    }
    assert [type(v) for v in sd.values()] == [float, float, float, int, int]


def test_load_state_dict_like_torchs_test_grad_scaling_state_dict():
    s0 = jamp.scaler(optax.sgd(1.0), init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = jamp.scaler(optax.sgd(1.0), init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    st1 = jamp.set_scale(s1.init(PARAMS), 6.0)
    loaded = jamp.load_state_dict(st1, jamp.state_dict(s0.init(PARAMS)))
    assert jamp.state_dict(loaded) == {
        "scale": 3.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.5,
        "growth_interval": 2,
        "_growth_tracker": 0,
    }
    assert float(jamp.scale(jnp.array([4.0]), loaded)[0]) == 12.0
    assert jamp.state_dict(st1)["scale"] == 6.0  # the input opt_state is untouched


def test_load_state_dict_errors():
    st = jamp.scaler(optax.sgd(1.0)).init(PARAMS)
    with pytest.raises(ValueError, match="empty.*disabled"):
        jamp.load_state_dict(st, {})
    full = jamp.state_dict(st)
    for key in full:
        with pytest.raises(ValueError, match=repr(key)):
            jamp.load_state_dict(st, {k: v for k, v in full.items() if k != key})
    with pytest.raises(ValueError, match="growth_factor"):
        jamp.load_state_dict(st, {**full, "growth_factor": 0.9})
    with pytest.raises(TypeError, match="_growth_tracker"):
        jamp.load_state_dict(st, {**full, "_growth_tracker": 1.5})
    assert jamp.state_dict(jamp.load_state_dict(st, {**full, "extra": 1})) == full


# ---------------------------------------------------------------- state round-trips


def _trained_state():
    tx = jamp.scaler(
        optax.adam(1e-2),
        init_scale=3.0,
        growth_factor=1.1,
        backoff_factor=0.3,
        growth_interval=2,
        min_scale=0.5,
        max_scale=1e6,
        warn_below_scale=None,
    )  # the scale falls below 1 on purpose
    state, update = tx.init(PARAMS), jax.jit(tx.update)
    for poison in (None, None, jnp.inf, None):
        _, state = update(grads_with(state, poison), state, PARAMS)
    return tx, state


def test_state_survives_jit_and_tree_map():
    _, state = _trained_state()
    for copy in (
        jax.jit(lambda s: s)(state),
        jax.tree.map(lambda x: x, state),
        jax.tree.unflatten(*reversed(jax.tree.flatten(state))),
    ):
        assert isinstance(copy, jamp.ScalerState)
        chex.assert_trees_all_equal(copy, state)
        assert jamp.state_dict(copy) == jamp.state_dict(state)


def test_state_survives_orbax(tmp_path):
    tx, state = _trained_state()
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert isinstance(restored, jamp.ScalerState)
    chex.assert_trees_all_equal(restored, state)
    a = tx.update(grads_with(state, jnp.nan), state, PARAMS)
    b = tx.update(grads_with(restored, jnp.nan), restored, PARAMS)
    chex.assert_trees_all_equal(a, b)
    assert jamp.state_dict(restored)["growth_factor"] == 1.1 and float(restored.min_scale) == 0.5


def test_orbax_restore_without_a_target_says_to_give_one(tmp_path):
    tx, state = _trained_state()
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", {"opt_state": state})
    ckpt.wait_until_finished()
    untargeted = ckpt.restore(tmp_path / "state")
    with pytest.raises(
        ValueError,
        match=r"ScalerState's fields at \['opt_state'\].*restored without a target.*"
        r"jax.eval_shape\(tx.init, params\)",
    ):
        jamp.get_scale(untargeted)
    restored = ckpt.restore(tmp_path / "state", {"opt_state": jax.eval_shape(tx.init, PARAMS)})
    assert float(jamp.get_scale(restored)) == float(jamp.get_scale(state))


EPISODE_FIELDS = ("warn_after_skips", "warn_below_scale", "consecutive_skips", "warned", "skip_episodes")


def _as_saved_before_the_episode_fields(state: jamp.ScalerState):
    """The state as a jamp without the skipped-steps fields saved it: a NamedTuple of the other fields, and the
    creation-order number (``scaler_id``) the release before this one saved."""
    fields = [f for f in jamp.ScalerState._fields if f not in EPISODE_FIELDS]
    old = collections.namedtuple("ScalerState", [*fields, "scaler_id"])
    return old(**{f: getattr(state, f) for f in fields}, scaler_id=np.int32(7))


def test_a_checkpoint_saved_before_the_episode_fields_restores_with_from_restored(tmp_path):
    tx, state = _trained_state()
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "old", {"params": PARAMS, "opt_state": _as_saved_before_the_episode_fields(state)})
    ckpt.wait_until_finished()
    target = {"params": PARAMS, "opt_state": jax.eval_shape(tx.init, PARAMS)}
    with pytest.raises(ValueError, match="warn_after_skips"):  # orbax refuses the new structure as target
        ckpt.restore(tmp_path / "old", target)
    untargeted = ckpt.restore(tmp_path / "old")
    with pytest.raises(
        ValueError,
        match=r"jamp\.from_restored\(target, restored\).*without "
        r"ScalerState\.warn_after_skips",
    ):
        jamp.get_scale(untargeted["opt_state"])
    restored = jamp.from_restored(target, untargeted)
    fresh = tx.init(PARAMS)
    assert isinstance(restored["opt_state"], jamp.ScalerState) and "from_restored" in jamp.__all__
    chex.assert_trees_all_equal(
        restored["opt_state"], state._replace(**{f: getattr(fresh, f) * 0 for f in EPISODE_FIELDS})
    )  # the target is an eval_shape: the missing fields start at zero
    chex.assert_trees_all_equal(restored["params"], PARAMS)
    a = tx.update(grads_with(state, jnp.nan), state, PARAMS)
    b = tx.update(grads_with(restored["opt_state"], jnp.nan), restored["opt_state"], PARAMS)
    chex.assert_trees_all_equal(a[0], b[0])
    chex.assert_trees_all_equal(
        a[1]._replace(**dict.fromkeys(EPISODE_FIELDS, 0)), b[1]._replace(**dict.fromkeys(EPISODE_FIELDS, 0))
    )


def test_from_restored_names_what_does_not_fit(tmp_path):
    tx, state = _trained_state()
    target = {"opt_state": tx.init(PARAMS)}
    untargeted = jax.tree.map(np.asarray, {"opt_state": state._asdict()})
    chex.assert_trees_all_equal(jamp.from_restored(target, untargeted), {"opt_state": state})
    del untargeted["opt_state"]["growth_tracker"]  # only the two episode fields may be missing
    with pytest.raises(ValueError, match=r"nothing at \['opt_state'\]\.growth_tracker"):
        jamp.from_restored(target, untargeted)
    with pytest.raises(ValueError, match=r"at \['params'\]\['w'\] is float32\[3\], the target's is float32\[2, 3\]"):
        jamp.from_restored({"params": PARAMS}, {"params": {"w": np.ones(3, np.float32), "b": np.ones(3, np.float32)}})


def test_changing_hyperparameters_never_recompiles():
    tx = jamp.scaler(optax.adam(1e-3), init_scale=4.0, growth_interval=1)
    traces = []

    @jax.jit
    def step(state):
        traces.append(1)
        return tx.update(grads_with(state), state, PARAMS)[1]

    state = step(tx.init(PARAMS))
    assert float(state.scale) == 8.0
    state = jamp.load_state_dict(
        state, {"scale": 3.0, "growth_factor": 1.1, "backoff_factor": 0.3, "growth_interval": 2, "_growth_tracker": 1}
    )
    state = step(jamp.set_scale(state, 3.0))
    assert float(state.scale) == 3.299999952316284 and int(state.growth_tracker) == 0
    assert len(traces) == 1
