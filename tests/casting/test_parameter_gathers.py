"""FSDP written by hand gathers float32 parameters across devices in the compute dtype (cast on the shard, then
gathered, as torch FSDP2 gathers ``param_dtype``): a replicating ``with_sharding_constraint``, ``jax.sharding.reshard``
under explicit sharding, ``all_gather`` in shard_map and pmap; the gradients still reduced in ``reduce_dtype``. Read
from the program after SPMD partitioning (``jamp.collectives``), in a subprocess with 8 host CPU devices. The
partitioner's own gathers: tests/casting/test_gradient_reduction.py."""

import json

import jax
import jax.numpy as jnp
import pytest
from helpers import eqns, once_per_run, run_subprocess

import jamp

SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jamp


def floats(fn, *args):
    # {"gather": {dtype: bytes}, "reduce": {dtype: bytes}} of fn's floating all-gathers and reductions
    found = {"gather": {}, "reduce": {}}
    for r in jamp.collectives(fn, *args):
        kind = "gather" if r.kind == "all-gather" else "reduce" if r.kind in ("all-reduce", "reduce-scatter") else None
        if kind and r.dtype.startswith(("float", "bfloat")):
            found[kind][r.dtype] = found[kind].get(r.dtype, 0) + r.bytes
    return found


def mlp(gather):
    # a 2-layer MLP whose parameters pass through gather(); the second is read transposed (x @ w.T)
    return lambda p, x: jnp.sum(jax.nn.gelu(x @ gather(p["w1"])) @ gather(p["w2"]).T)


def programs(fn):
    return {
        "float32": fn,
        "default": jamp.autocast(fn, dtype=jnp.bfloat16),
        "bfloat16": jamp.autocast(fn, dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16),
    }


k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
params = {"w1": jax.random.normal(k1, (128, 256)) / 11, "w2": jax.random.normal(k2, (128, 256)) / 16}
x = jax.random.normal(k3, (64, 128))
auto = jax.sharding.AxisType.Auto
mesh = jax.make_mesh((8,), ("d",), axis_types=(auto,))
out, grads = {}, {}


def record(form, fns, args, forward=jax.jit, grad=lambda f: jax.jit(jax.grad(f))):
    for name, fn in fns.items():
        out[f"{form}/{name}"] = {"forward": floats(forward(fn), *args)["gather"], **floats(grad(fn), *args)}
        grads[f"{form}/{name}"] = jax.tree.map(np.asarray, grad(fn)(*args))


# FSDP by hand under jit: a replicating constraint
replicate = lambda w: jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
placed = jax.device_put(params, NamedSharding(mesh, P("d")))
record("jit constraint", programs(mlp(replicate)), (placed, jax.device_put(x, NamedSharding(mesh, P("d")))))

# explicit sharding: jax.sharding.reshard
explicit = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
with jax.set_mesh(explicit):
    placed = jax.device_put(params, NamedSharding(explicit, P("d")))
    batch = jax.device_put(x, NamedSharding(explicit, P("d")))
    record("explicit reshard", programs(mlp(lambda w: jax.sharding.reshard(w, P()))), (placed, batch))

# shard_map: all_gather of each device's shard, the loss summed over devices
gather = lambda w: jax.lax.all_gather(w, "d", axis=0, tiled=True)
fns = {name: jax.shard_map(lambda p, x, f=f: jax.lax.psum(f(p, x), "d"), mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P())
       for name, f in programs(mlp(gather)).items()}
record("shard_map all_gather", fns, (params, x))

# pmap: the same, each device's gradient of its shard
gather = lambda w: jax.lax.all_gather(w, "i", axis=0, tiled=True)
shards = jax.tree.map(lambda a: a.reshape(8, 16, 256), params)
record("pmap all_gather", programs(mlp(gather)), (shards, x.reshape(8, 8, 128)),
       forward=lambda f: jax.pmap(f, axis_name="i"),
       grad=lambda f: jax.pmap(lambda p, x: jax.grad(lambda p: jax.lax.psum(f(p, x), "i"))(p), axis_name="i"))
for key, g in grads.items():  # each gradient's relative error against the float32 program's
    want = grads[key.rsplit("/", 1)[0] + "/float32"]
    out[key]["error"] = {n: float(np.linalg.norm(g[n] - want[n]) / np.linalg.norm(want[n])) for n in g}
    out[key]["grad dtypes"] = sorted({str(v.dtype) for v in g.values()})
print(json.dumps(out))
"""

FORMS = ("jit constraint", "explicit reshard", "shard_map all_gather", "pmap all_gather")


@pytest.fixture(scope="module")
def found() -> dict:
    return json.loads(once_per_run("parameter_gathers", lambda: run_subprocess(SCRIPT)).strip().splitlines()[-1])


@pytest.mark.multidevice
@pytest.mark.parametrize("form", FORMS)
def test_parameters_are_gathered_in_the_compute_dtype(found, form):
    """The forward program gathers the parameters in bfloat16: half the float32 program's bytes, nothing wider."""
    gathered = found[f"{form}/float32"]["forward"]["float32"]
    assert found[f"{form}/default"]["forward"] == {"bfloat16": gathered // 2}
    assert found[f"{form}/bfloat16"]["forward"] == {"bfloat16": gathered // 2}


@pytest.mark.multidevice
@pytest.mark.parametrize("form", FORMS)
def test_a_gather_written_by_hand_keeps_the_gradients_reduced_in_reduce_dtype(found, form):
    """Gathering the cast shard leaves the gradient's reduction where it was: float32 by default (the float32
    program's bytes), bfloat16 with ``reduce_dtype=bfloat16``; the backward pass gathers nothing in float32."""
    reduced = found[f"{form}/float32"]["reduce"]
    assert found[f"{form}/default"]["reduce"] == reduced
    assert set(found[f"{form}/default"]["gather"]) == {"bfloat16"}
    # the weight gradients' bytes halve (a psum of the scalar loss stays what the program wrote)
    halved = found[f"{form}/bfloat16"]["reduce"]
    assert halved["bfloat16"] == (reduced["float32"] - halved.get("float32", 0)) // 2


@pytest.mark.multidevice
@pytest.mark.parametrize("form", FORMS)
def test_the_gradients_are_the_float32_programs_to_bfloat16_accuracy(found, form):
    for program in ("default", "bfloat16"):
        assert found[f"{form}/{program}"]["grad dtypes"] == ["float32"]
        assert max(found[f"{form}/{program}"]["error"].values()) < 2e-2, program


MESH = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def _constraint_operands(fn, *args) -> list[str]:
    return [
        str(e.invars[0].aval.dtype)
        for e in eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name == "sharding_constraint"
    ]


def test_a_gathered_value_something_else_reads_is_gathered_as_it_is():
    """Only a value that matmuls alone read is gathered in the compute dtype: one a sum also reads stays float32."""
    replicate = lambda w: jax.lax.with_sharding_constraint(
        w, jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec())
    )
    w, x = jnp.ones((16, 8)), jnp.ones((4, 16))
    only_matmuls = jamp.autocast(lambda w, x: jnp.sum(x @ replicate(w)), dtype=jnp.bfloat16)
    also_summed = jamp.autocast(lambda w, x: jnp.sum(x @ (g := replicate(w))) + jnp.sum(g), dtype=jnp.bfloat16)
    assert _constraint_operands(only_matmuls, w, x) == ["bfloat16"]
    assert _constraint_operands(also_summed, w, x) == ["float32"]

    def in_a_float16_region(w, x):
        g = replicate(w)
        with jamp.autocast(dtype=jnp.float16):  # the matmul's compute dtype is not the gather's
            return jnp.sum(x @ g)

    assert _constraint_operands(jamp.autocast(in_a_float16_region, dtype=jnp.bfloat16), w, x) == ["float32"]
