"""Every device takes the same skip decision: pmap/shard_map with axis_name, and jit over a sharded mesh.

Runs in a subprocess with 8 host CPU devices (XLA_FLAGS must be set before jax is imported); the main
pytest process stays single-device.
"""

from __future__ import annotations

import json

import pytest
from helpers import once_per_run, run_subprocess

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

    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child():
    return json.loads(
        once_per_run("scaler_multidevice_child", lambda: run_subprocess(CHILD, devices=8)).strip().splitlines()[-1]
    )


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


# The distributed forms users write, each with the skipped-steps report on and an overflow in one device's batch:
# every device skips, nothing moves, and the report says so once (issue 36: the report's conditional crashed
# shard_map with per-device state under check_vma).
FORMS = """
import json, warnings
import jax, jax.numpy as jnp, numpy as np, optax, jamp
from jax.sharding import NamedSharding, PartitionSpec as P
n = jax.device_count()
mesh = jax.make_mesh((n,), ("d",))
params = {"w": jnp.ones((4,))}
X = jnp.arange(n * 4.0).reshape(n, 4) / 10
X_BAD = X.at[3, 1].set(1e30)  # device 3's batch: its squared loss overflows float32

def loss(p, x):
    return jnp.sum((p["w"] * x) ** 2)

def run(step, p, s, x, steps=3):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p0 = p
        for _ in range(steps):
            p, s = step(p, s, x)
        jax.block_until_ready(p)
        jamp.report_skipped_steps(s)
    found = np.asarray(jamp.found_inf(s)).ravel().tolist()
    moved = bool(jax.tree.reduce(lambda a, b: a or b, jax.tree.map(lambda a, b: bool(jnp.any(a != b)), p0, p)))
    return {"found": found, "moved": moved, "warnings": sum(w.category is jamp.SkippedStepsWarning for w in caught)}

out = {}
tx = jamp.scaler(optax.adam(0.1), axis_name="d", warn_after_skips=2)
sh = NamedSharding(mesh, P("d"))
stack = lambda t: jax.tree.map(lambda a: jax.device_put(jnp.stack([a] * n), sh), t)
def per_device(p, s, x):
    p, s, x = jax.tree.map(lambda a: a[0], (p, s, x))
    g = jax.grad(lambda q: jamp.scale(loss(q, x), s))(p)
    u, s = tx.update(g, s, p)
    return jax.tree.map(lambda a: a[None], (optax.apply_updates(p, u), s))
for check_vma in (True, False):
    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma))
    out[f"shard_map_per_device_vma_{check_vma}"] = run(lambda p, s, x: step(p, s, x), stack(params), stack(tx.init(params)), jax.device_put(X_BAD, sh))

for axis_name in ("d", None):
    txr = jamp.scaler(optax.adam(0.1), axis_name=axis_name, warn_after_skips=2)
    def replicated(p, s, x):
        g = jax.lax.pmean(jax.grad(lambda q: jamp.scale(loss(q, x), s))(p), "d")
        u, s = txr.update(g, s, p)
        return optax.apply_updates(p, u), s
    for check_vma in (True, False):
        step = jax.jit(jax.shard_map(replicated, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=P(), check_vma=check_vma))
        out[f"shard_map_replicated_{axis_name}_vma_{check_vma}"] = run(step, params, txr.init(params), jax.device_put(X_BAD, sh))

txp = jamp.scaler(optax.adam(0.1), axis_name="i", warn_after_skips=2)
def pm(p, s, x):
    g = jax.grad(lambda q: jamp.scale(loss(q, x), s))(p)
    u, s = txp.update(g, s, p)
    return optax.apply_updates(p, u), s
pstep = jax.pmap(pm, axis_name="i")
out["pmap"] = run(pstep, jax.tree.map(lambda a: jnp.stack([a] * n), params), jax.tree.map(lambda a: jnp.stack([a] * n), txp.init(params)), X_BAD)

txj = jamp.scaler(optax.adam(0.1), warn_after_skips=2)
def glob(p, s, x):
    g = jax.grad(lambda q: jamp.scale(loss(q, x), s))(p)
    u, s = txj.update(g, s, p)
    return optax.apply_updates(p, u), s
rep = NamedSharding(mesh, P())
out["jit_named_sharding"] = run(jax.jit(glob), jax.device_put(params, rep), jax.device_put(txj.init(params), rep), jax.device_put(X_BAD, sh))

if hasattr(jax.sharding, "AxisType"):
    mesh_e = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh_e):
        out["jit_explicit_axes"] = run(jax.jit(glob), jax.device_put(params, NamedSharding(mesh_e, P())),
                                       jax.device_put(txj.init(params), NamedSharding(mesh_e, P())),
                                       jax.device_put(X_BAD, NamedSharding(mesh_e, P("d"))))
print(json.dumps(out))
"""

FORM_NAMES = [
    "shard_map_per_device_vma_True",
    "shard_map_per_device_vma_False",
    "shard_map_replicated_d_vma_True",
    "shard_map_replicated_d_vma_False",
    "shard_map_replicated_None_vma_True",
    "shard_map_replicated_None_vma_False",
    "pmap",
    "jit_named_sharding",
    "jit_explicit_axes",
]


@pytest.fixture(scope="module")
def forms():
    return json.loads(
        once_per_run("scaler_multidevice_forms", lambda: run_subprocess(FORMS, devices=8)).strip().splitlines()[-1]
    )


@pytest.mark.parametrize("form", FORM_NAMES)
def test_every_device_skips_and_the_report_comes_once(forms, form):
    if form == "jit_explicit_axes" and form not in forms:
        pytest.skip("this JAX has no explicit mesh axis types")
    result = forms[form]
    assert all(result["found"]) and not result["moved"] and result["warnings"] == 1, result
