"""Every device takes the same skip decision: pmap/shard_map with axis_name, and jit over a sharded mesh.

Runs in a subprocess with 8 host CPU devices (XLA_FLAGS must be set before jax is imported); the main
pytest process stays single-device.
"""

from __future__ import annotations

import json

import pytest
from helpers import run_subprocess

CHILD = """
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jamp

    n = jax.device_count()
    params = {"w": jnp.linspace(-1.0, 1.0, 4), "b": jnp.zeros(2)}
    stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * n), t)
    out = {"devices": n}

    def grads(bad_device):
        g = {"w": jnp.ones((n, 4)) * jnp.arange(1.0, n + 1)[:, None] * 1024, "b": jnp.ones((n, 2)) * 1024}
        return {**g, "w": g["w"].at[bad_device, 1].set(jnp.inf)} if bad_device is not None else g

    for axis_name in ("i", None):
        tx = jamp.scaler(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2, axis_name=axis_name)
        step = jax.pmap(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)),
                        axis_name="i")
        p0, s0 = stack(params), stack(tx.init(params))
        p1, s1 = step(grads(3), s0, p0)
        p2, s2 = step(grads(None), s1, p1)
        out[f"pmap_{axis_name}"] = {
            "found": np.asarray(jamp.found_inf(s1)).tolist(),
            "scale": np.asarray(jamp.get_scale(s1)).tolist(),
            "moved": [bool(np.any(p1["w"][d] != p0["w"][d])) for d in range(n)],
            "adam_count": np.asarray(s1.inner_state[0].count).tolist(),
            "next_found": np.asarray(jamp.found_inf(s2)).tolist(),
            "next_scale": np.asarray(jamp.get_scale(s2)).tolist(),
        }

    mesh = Mesh(np.array(jax.devices()), ("x",))
    tx = jamp.scaler(optax.sgd(1.0), init_scale=4.0, axis_name="x")
    sharded = jax.shard_map(lambda g, s: tx.update(g, s)[1].found_inf[None], mesh=mesh,
                            in_specs=(P("x"), P()), out_specs=P("x"))
    out["shard_map"] = np.asarray(jax.jit(sharded)({"w": grads(5)["w"]}, tx.init({"w": jnp.ones(4)}))).tolist()

    tx = jamp.scaler(optax.sgd(1.0), init_scale=4.0)
    g = jax.device_put({"w": grads(6)["w"]}, NamedSharding(mesh, P("x")))
    p = jax.device_put({"w": jnp.ones((n, 4))}, NamedSharding(mesh, P("x")))
    u, s = jax.jit(tx.update)(g, tx.init(p), p)
    out["jit_sharded"] = {"found": bool(s.found_inf), "zero_updates": bool(jnp.all(u["w"] == 0)),
                          "sharding_kept": u["w"].sharding.is_equivalent_to(g["w"].sharding, 2)}

    # jamp.SkippedStepsWarning: three skips in a row with warn_after_skips=2, counted per layout
    import warnings

    def skipped_warnings(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.block_until_ready(steps())
        return sum(w.category is jamp.SkippedStepsWarning for w in caught)

    def warn_after_2(**kw):
        return jamp.scaler(optax.sgd(0.1), init_scale=4.0, warn_after_skips=2, warn_below_scale=None, **kw)

    def pmapped(axis_name):
        tx = warn_after_2(axis_name=axis_name)
        update = jax.pmap(tx.update, axis_name="i")

        def steps():
            s = stack(tx.init(params))
            for _ in range(3):
                _, s = update(grads(2), s, stack(params))
            return s
        return steps

    tx = warn_after_2(axis_name="x")
    sharded = jax.jit(jax.shard_map(lambda g, s: tx.update(g, s)[1], mesh=mesh, in_specs=(P("x"), P()),
                                    out_specs=P()))

    def shard_map_steps():
        s = tx.init({"w": jnp.ones(4)})
        for _ in range(3):
            s = sharded({"w": grads(5)["w"]}, s)
        return s

    tx_jit = warn_after_2()
    update_jit = jax.jit(tx_jit.update)

    def jit_steps():
        s = tx_jit.init(p)
        for _ in range(3):
            _, s = update_jit(g, s, p)
        return s

    out["warnings"] = {"pmap_i": skipped_warnings(pmapped("i")), "pmap_None": skipped_warnings(pmapped(None)),
                       "shard_map": skipped_warnings(shard_map_steps), "jit_sharded": skipped_warnings(jit_steps)}
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child():
    return json.loads(run_subprocess(CHILD, devices=8).strip().splitlines()[-1])


def test_eight_devices(child):
    assert child["devices"] == 8


def test_pmap_axis_name_one_overflow_skips_every_device(child):
    r = child["pmap_i"]
    assert r["found"] == [True] * 8 and r["scale"] == [512.0] * 8
    assert r["moved"] == [False] * 8 and r["adam_count"] == [0] * 8
    assert r["next_found"] == [False] * 8 and r["next_scale"] == [512.0] * 8


def test_pmap_without_axis_name_only_the_overflowing_device_skips(child):
    r = child["pmap_None"]
    assert r["found"] == [d == 3 for d in range(8)]
    assert r["moved"] == [d != 3 for d in range(8)]
    assert r["scale"] == [512.0 if d == 3 else 1024.0 for d in range(8)]  # replicas diverge: why axis_name exists


def test_shard_map_axis_name(child):
    assert child["shard_map"] == [True] * 8


def test_jit_over_a_sharded_mesh_reduces_the_flag_globally(child):
    assert child["jit_sharded"] == {"found": True, "zero_updates": True, "sharding_kept": True}


def test_skipped_steps_warn_once_not_once_per_device(child):
    """With axis_name every replica takes the same decision and only the first calls the host; under jit the
    callback runs once; a pmap without axis_name warns for the one replica whose steps are skipped."""
    assert child["warnings"] == {"pmap_i": 1, "pmap_None": 1, "shard_map": 1, "jit_sharded": 1}
