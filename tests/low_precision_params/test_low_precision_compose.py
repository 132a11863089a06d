"""jamp.kahan_summation and jamp.stochastic_rounding with the rest of optax, jamp and JAX.

optax.chain, jamp.scaler (a skipped step keeps params, buffer, key and inner state bit for bit),
inject_hyperparams, MultiSteps in both nestings, jit with donation, orbax, autocast in the forward, and
(in a subprocess with 8 host devices) pmap, jit over a mesh and shard_map with the buffer sharded like
the parameters. Plus the regression of issue 22, where round-to-nearest stalls and Kahan does not.
"""

from __future__ import annotations

import json
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import once_per_run, run_subprocess

import jamp

TRANSFORMS = {"kahan": jamp.kahan_summation, "stochastic": jamp.stochastic_rounding}


def regression(n=64, out=8, rows=128, seed=0):
    """Issue 22's regression at a chosen size: X @ W_true targets, W from N(0, 1), mean squared error."""
    kx, kw, k0 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, n))
    y = x @ jax.random.normal(kw, (n, out))

    def loss(w):
        return jnp.mean(((x.astype(w.dtype) @ w).astype(jnp.float32) - y) ** 2)

    return jax.random.normal(k0, (n, out)), loss


def train(tx, params, loss, steps, donate=False):
    """``steps`` jitted steps of ``tx`` on ``loss``; the final params and opt_state."""

    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params, state


def test_issue_22_regression_kahan_recovers_float32_where_nearest_stalls():
    """X 512x64, W 64x16 from N(0, 1), MSE, adam(1e-3), 400 steps (issue 22: float32 91.65, bfloat16 with
    round-to-nearest 133.1 from 143.3, bfloat16 with a bfloat16 Kahan buffer 91.64)."""
    w0, loss = regression(n=64, out=16, rows=512)
    final = {}
    for name, dtype, tx in (
        ("float32", jnp.float32, optax.adam(1e-3)),
        ("nearest", jnp.bfloat16, optax.adam(1e-3)),
        ("kahan", jnp.bfloat16, jamp.kahan_summation(optax.adam(1e-3))),
        ("kahan_f32_state", jnp.bfloat16, jamp.kahan_summation(optax.adam(1e-3), state_dtype=jnp.float32)),
        ("stochastic", jnp.bfloat16, jamp.stochastic_rounding(optax.adam(1e-3))),
        ("stochastic_f32_state", jnp.bfloat16, jamp.stochastic_rounding(optax.adam(1e-3), state_dtype=jnp.float32)),
    ):
        params, _ = train(tx, w0.astype(dtype), loss, 400)
        assert params.dtype == dtype
        final[name] = float(loss(params))
    assert float(loss(w0)) == pytest.approx(143.3, abs=0.1)
    assert final["float32"] == pytest.approx(91.65, abs=0.01)
    assert final["nearest"] > 130  # stalled
    # Adam's float32 moments: Kahan and stochastic rounding reach float32's loss
    assert final["kahan_f32_state"] == pytest.approx(final["float32"], rel=1e-3)
    assert final["stochastic_f32_state"] == pytest.approx(final["float32"], rel=2e-3)
    # bfloat16 moments (optax's own choice for bfloat16 params) cost about 2%: the second moment's decay
    # by 0.999 is below half a bfloat16 spacing, so it cannot shrink
    assert final["kahan"] < final["float32"] * 1.03 and final["stochastic"] < final["float32"] * 1.03


@pytest.mark.parametrize("name", TRANSFORMS)
def test_chain_inside_or_outside(name):
    """``wrap(chain(clip, adam))`` and ``chain(clip, wrap(adam))`` are the same optimizer (the wrapper must be
    the last element: it returns updates that land exactly, which nothing may change afterwards)."""
    w0, loss = regression()
    wrap = TRANSFORMS[name]
    outside, _ = train(
        wrap(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))), w0.astype(jnp.bfloat16), loss, 5
    )
    inside, _ = train(
        optax.chain(optax.clip_by_global_norm(1.0), wrap(optax.adam(1e-2))), w0.astype(jnp.bfloat16), loss, 5
    )
    chex.assert_trees_all_equal(outside, inside)
    assert not np.array_equal(outside, w0.astype(jnp.bfloat16))


@pytest.mark.parametrize("name", TRANSFORMS)
def test_scaler_skips_bit_identically_with_float16_params(skip_form, name):
    w0, loss = regression()
    params = {"w": w0.astype(jnp.float16), "b": jnp.zeros(8, jnp.float16)}
    full_loss = lambda p: loss(p["w"]) + jnp.sum(p["b"].astype(jnp.float32) ** 2)
    tx = jamp.scaler(TRANSFORMS[name](optax.adam(1e-3), state_dtype=jnp.float32), init_scale=2.0**10)

    @jax.jit
    def step(params, state, poison):
        grads = jax.grad(lambda p: jamp.scale(full_loss(p), state))(params)
        grads = {**grads, "w": grads["w"].at[0, 0].add(poison)}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for _ in range(3):
        params, state = step(params, state, 0.0)
    before = (params, state.inner_state)
    for poison in (jnp.inf, jnp.nan):
        params, state = step(params, state, poison)
        assert bool(jamp.found_inf(state))
        chex.assert_trees_all_equal((params, state.inner_state), before)  # params, buffer/key, Adam: bit for bit
    params, state = step(params, state, 0.0)
    assert not bool(jamp.found_inf(state)) and not np.array_equal(params["w"], before[0]["w"])
    assert params["w"].dtype == jnp.float16 and float(jamp.get_scale(state)) == 2.0**8


def test_kahan_around_the_scaler_keeps_its_buffer_on_a_skipped_step():
    """The other nesting: the scaler's zero updates of a skipped step are zero updates to Kahan, which keeps
    parameter and buffer as they are."""
    w0, loss = regression()
    tx = jamp.kahan_summation(jamp.scaler(optax.adam(1e-3), init_scale=2.0**10), state_dtype=jnp.float32)

    def scaled_grads(params, state, poison=0.0):
        grads = jax.grad(lambda w: jamp.scale(loss(w), state.inner_state))(params)
        return grads.at[0, 0].add(poison)

    @jax.jit
    def step(params, state, poison):
        updates, state = tx.update(scaled_grads(params, state, poison), state, params)
        return optax.apply_updates(params, updates), state

    params, state = w0.astype(jnp.float16), tx.init(w0.astype(jnp.float16))
    for _ in range(3):
        params, state = step(params, state, 0.0)
    # a live state to keep: finite steps were taken, and the buffer holds what float16 lost
    assert not bool(jamp.found_inf(state.inner_state)) and bool(jnp.isfinite(params).all())
    assert not np.array_equal(params, w0.astype(jnp.float16)) and np.any(np.asarray(state.compensation) != 0)
    new_params, new_state = step(params, state, jnp.inf)
    assert bool(jamp.found_inf(new_state.inner_state))
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.compensation, state.compensation)


def test_inject_hyperparams_inside_and_around():
    w0, loss = regression()
    tx = jamp.kahan_summation(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), state_dtype=jnp.float32)
    params, state = train(tx, w0.astype(jnp.bfloat16), loss, 2)
    assert state.inner_state.hyperparams["learning_rate"].dtype == jnp.float32  # it sees float32 params
    frozen = state._replace(
        inner_state=state.inner_state._replace(
            hyperparams={**state.inner_state.hyperparams, "learning_rate": jnp.zeros((), jnp.float32)}
        )
    )
    updates, _ = jax.jit(tx.update)(jax.grad(loss)(params), frozen, params)
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)

    factory = optax.inject_hyperparams(jamp.stochastic_rounding, static_args=("seed",))
    tx = factory(optax.adam(1e-2), seed=3)
    params, state = train(tx, w0.astype(jnp.bfloat16), loss, 2)
    assert float(loss(params)) < float(loss(w0.astype(jnp.bfloat16)))
    with pytest.raises(TypeError, match=r"seed must be an int.*static_args=\('seed',\)"):
        optax.inject_hyperparams(jamp.stochastic_rounding)(optax.adam(1e-2), seed=3).init(params)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_multisteps_in_both_nestings(name):
    """Parameters move only on every second step, and with the same values either way round."""
    w0, loss = regression()
    wrap = TRANSFORMS[name]
    for tx in (optax.MultiSteps(wrap(optax.adam(1e-2)), 2), wrap(optax.MultiSteps(optax.adam(1e-2), 2))):
        params, state = w0.astype(jnp.bfloat16), tx.init(w0.astype(jnp.bfloat16))
        trail, update = [], jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
        for _ in range(4):
            updates, state = update(params, state)
            params = optax.apply_updates(params, updates)
            trail.append(params)
        moved = [not np.array_equal(a, b) for a, b in zip([w0.astype(jnp.bfloat16)] + trail, trail)]
        assert moved == [False, True, False, True]
        if name == "kahan":
            buffer = state.inner_opt_state.compensation if isinstance(tx, optax.MultiSteps) else state.compensation
            assert buffer.dtype == jnp.bfloat16 and np.any(np.asarray(buffer) != 0)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_jit_with_donation_matches_and_reuses_the_buffers(name):
    w0, loss = regression()
    params = {"w": w0.astype(jnp.bfloat16), "b": jnp.zeros(8)}
    full_loss = lambda p: loss(p["w"]) + jnp.sum(p["b"] ** 2)
    tx = TRANSFORMS[name](optax.adamw(1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would fail the test
        donated = train(tx, jax.tree.map(jnp.copy, params), full_loss, 3, donate=True)
    chex.assert_trees_all_equal(donated, train(tx, params, full_loss, 3))


def test_orbax_restores_states_that_continue_identically(tmp_path):
    """One checkpoint holding a Kahan and a stochastic-rounding run (the float32 leaf's buffer is None)."""
    w0, loss = regression()
    params = {"w": w0.astype(jnp.bfloat16), "b": jnp.zeros(8)}
    full_loss = lambda p: loss(p["w"]) + jnp.sum(p["b"] ** 2)
    txs = {name: wrap(optax.adam(1e-2)) for name, wrap in TRANSFORMS.items()}
    runs = {name: dict(zip(("params", "opt_state"), train(tx, params, full_loss, 3))) for name, tx in txs.items()}
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "runs", runs)
    ckpt.wait_until_finished()
    target = jax.eval_shape(
        lambda: {name: {"params": params, "opt_state": tx.init(params)} for name, tx in txs.items()}
    )
    restored = ckpt.restore(tmp_path / "runs", target)
    chex.assert_trees_all_equal(restored, runs)
    for name, tx in txs.items():
        assert type(restored[name]["opt_state"]) is type(runs[name]["opt_state"])
        step = jax.jit(lambda p, s, tx=tx: tx.update(jax.grad(full_loss)(p), s, p))
        again, before = restored[name], runs[name]
        chex.assert_trees_all_equal(
            step(again["params"], again["opt_state"]), step(before["params"], before["opt_state"])
        )


@pytest.mark.parametrize("name", TRANSFORMS)
def test_autocast_forward_with_bfloat16_params(name):
    """bfloat16 parameters through an autocast forward: grads come back bfloat16, the loss falls."""
    w0, loss = regression()
    params = w0.astype(jnp.bfloat16)
    amp_loss = jamp.autocast(loss, device_type="gpu", dtype=jnp.bfloat16)
    assert jax.grad(amp_loss)(params).dtype == jnp.bfloat16
    trained, _ = train(TRANSFORMS[name](optax.adam(1e-2)), params, amp_loss, 20)
    assert trained.dtype == jnp.bfloat16 and float(amp_loss(trained)) < 0.9 * float(amp_loss(params))


DEVICES = """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jamp

    out = {}
    params = {"w": jnp.linspace(-1.0, 1.0, 256, dtype=jnp.float32).reshape(32, 8).astype(jnp.bfloat16),
              "b": jnp.zeros(8)}
    grads = {"w": jnp.cos(jnp.arange(256.0)).reshape(32, 8).astype(jnp.bfloat16) * 1e-4, "b": jnp.ones(8)}
    for name, wrap in (("kahan", jamp.kahan_summation), ("stochastic", jamp.stochastic_rounding)):
        # sgd(1.0) negates, exactly: XLA rounds bfloat16 products differently with and without SPMD
        # partitioning (excess precision), which would make the inner update itself differ
        tx = wrap(optax.sgd(1.0))

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        single = jax.jit(step)(params, tx.init(params), grads)
        # pmap: each replica gets other grads, averaged: replicas stay identical
        stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * 8), t)
        per_device = jax.tree.map(lambda g: g * jnp.arange(1, 9).reshape(8, *[1] * g.ndim).astype(g.dtype), stack(grads))
        pstep = jax.pmap(lambda p, s, g: step(p, s, jax.lax.pmean(g, "i")), axis_name="i")
        p_out, s_out = pstep(stack(params), stack(tx.init(params)), per_device)
        out[name + "_pmap_replicas_equal"] = all(bool(jnp.all(x == x[0])) for x in jax.tree.leaves((p_out, s_out)))
        # jit over a mesh: the buffer is sharded like the parameter, results as on one device
        for axis_type in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
            shard = lambda t: {"w": jax.device_put(jnp.array(t["w"], copy=True), NamedSharding(mesh, P("d"))),
                               "b": jax.device_put(jnp.array(t["b"], copy=True), NamedSharding(mesh, P()))}
            with jax.set_mesh(mesh):
                sp, sg = shard(params), shard(grads)
                state = jax.jit(tx.init)(sp) if axis_type == AxisType.Explicit else tx.init(sp)
                compiled = jax.jit(step, donate_argnums=(0, 1)).lower(sp, state, sg).compile()
                hlo = compiled.as_text()
                new_p, new_s = compiled(sp, state, sg)
            key = f"{name}_{axis_type.name}"
            out[key + "_same_as_single_device"] = all(
                bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves((new_p, new_s)), jax.tree.leaves(single)))
            out[key + "_param_spec"] = str(new_p["w"].sharding.spec)
            if name == "kahan":
                out[key + "_buffer_specs"] = [str(state.compensation["w"].sharding.spec),
                                              str(new_s.compensation["w"].sharding.spec)]
            out[key + "_collectives"] = sum(hlo.count(c) for c in ("all-gather", "all-reduce", "all-to-all"))
    # shard_map: shards draw different random numbers, replicas the same
    tx = jamp.stochastic_rounding(optax.sgd(1.0))
    mesh = jax.make_mesh((4, 2), ("d", "r"), axis_types=(AxisType.Auto,) * 2)
    p = {"w": jnp.ones((64, 4), jnp.bfloat16)}
    g = {"w": jnp.full((64, 4), -0.5 * 2**-7, jnp.bfloat16)}
    smap = jax.shard_map(lambda p, s, g: (lambda u, s: optax.apply_updates(p, u))(*tx.update(g, s, p)), mesh=mesh,
                         in_specs=(P("d"), P(), P("d")), out_specs=P("d"))
    shards = np.asarray(jax.jit(smap)(p, tx.init(p), g)["w"], np.float32).reshape(4, 16, 4)
    out["shard_map_shards_differ"] = [bool(np.any(shards[0] != shards[i])) for i in (1, 2, 3)]
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def devices():
    return json.loads(
        once_per_run("low_precision_compose", lambda: run_subprocess(DEVICES, devices=8)).strip().splitlines()[-1]
    )


@pytest.mark.parametrize("name", TRANSFORMS)
def test_pmap_replicas_stay_identical(devices, name):
    assert devices[name + "_pmap_replicas_equal"]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("name", TRANSFORMS)
def test_sharded_params_update_shard_locally_as_on_one_device(devices, name, axis_type):
    key = f"{name}_{axis_type}"
    assert devices[key + "_same_as_single_device"]
    assert devices[key + "_param_spec"] in ("P('d',)", "P('d', None)")
    assert devices[key + "_collectives"] == 0
    if name == "kahan":
        assert devices[key + "_buffer_specs"] == [devices[key + "_param_spec"]] * 2


def test_shard_map_shards_draw_different_numbers(devices):
    assert devices["shard_map_shards_differ"] == [True, True, True]
