"""autocast with pmap and shard_map on 8 host CPU devices (in a subprocess: XLA_FLAGS must be set
before jax is imported)."""

import json

from helpers import run_subprocess

SCRIPT = r"""
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jamp
from helpers import dtypes_of

results = {}
mesh = jax.make_mesh((8,), ("d",))
w = jnp.ones((4, 4)) * 0.1
x = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("d")))

def local(w, x):
    return jax.lax.psum(jnp.sum(jnp.tanh(x @ w)), "d")

sm = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
with jax.set_mesh(mesh):
    outside = jamp.autocast(sm, dtype="bf16")
    inside = jax.shard_map(jamp.autocast(local, dtype="bf16"), mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    for name, f in [("shard_map_outside", outside), ("shard_map_inside", inside)]:
        results[name] = {
            "value": float(f(w, x)), "ref": float(sm(w, x)),
            "fwd": dtypes_of(f, w, x), "bwd": dtypes_of(jax.grad(f), w, x),
            "grad_dtype": str(jax.grad(f)(w, x).dtype),
        }

pm_local = lambda w, x: jax.lax.psum(jnp.sum(x @ w), "i")
xs = jnp.ones((8, 2, 4))
pm = jax.pmap(pm_local, axis_name="i", in_axes=(None, 0))
for name, f in [("pmap_outside", jamp.autocast(pm, dtype="bf16")),
                ("pmap_inside", jax.pmap(jamp.autocast(pm_local, dtype="bf16"), axis_name="i", in_axes=(None, 0)))]:
    results[name] = {"value": f(w, xs).tolist(), "ref": pm(w, xs).tolist(), "fwd": dtypes_of(f, w, xs),
                     "grad_dtype": str(jax.grad(lambda w: f(w, xs).sum())(w).dtype)}
print(json.dumps(results))
"""


def test_shard_map_and_pmap_inside_and_outside():
    results = json.loads(run_subprocess(SCRIPT, env={"PYTHONPATH": "tests"}).strip().splitlines()[-1])
    low = ["bfloat16"] * 3
    for name in ("shard_map_outside", "shard_map_inside"):
        r = results[name]
        assert abs(r["value"] - r["ref"]) < 0.02 * abs(r["ref"]), name
        assert r["fwd"] == [low], name
        # the forward matmul, and the weight gradient's: bfloat16 operands into float32 (reduce_dtype)
        assert sorted(r["bwd"]) == [low, ["bfloat16", "bfloat16", "float32"]], name
        assert r["grad_dtype"] == "float32"
    for name in ("pmap_outside", "pmap_inside"):
        r = results[name]
        assert all(abs(v - ref) < 0.02 * abs(ref) for v, ref in zip(r["value"], r["ref"])), name
        assert r["fwd"] == [low] and r["grad_dtype"] == "float32", name
