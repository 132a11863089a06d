"""The gradients of float32 parameters cross devices in ``reduce_dtype`` (float32 by default, as torch AMP + DDP
all-reduces ``param.grad``) in every sharded form users write, read from the program after SPMD partitioning
(``jamp.collectives``: the dtype a GPU would send). In a subprocess with 8 host CPU devices."""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import lower_for_cuda, once_per_run, run_subprocess

import jamp

SCRIPT = r"""
import functools, json
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import jamp


def mlp(p, x):
    return jnp.sum(jax.nn.gelu(x @ p["w1"]) @ p["w2"])


def reductions(fn, *args, kinds=("all-reduce", "reduce-scatter")):
    # the floating collectives of these kinds in fn's program: {dtype: bytes}
    found = {}
    for r in jamp.collectives(fn, *args):
        if r.kind in kinds and r.dtype.startswith(("float", "bfloat")):
            found[r.dtype] = found.get(r.dtype, 0) + r.bytes
    return found


params = {"w1": jnp.ones((128, 256)) / 128, "w2": jnp.ones((256, 128)) / 256}
x = jnp.ones((64, 128))
programs = {
    "float32": mlp,
    "default": jamp.autocast(mlp, dtype=jnp.bfloat16),
    "bfloat16": jamp.autocast(mlp, dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16),
}
auto = jax.sharding.AxisType.Auto
mesh = jax.make_mesh((8,), ("d",), axis_types=(auto,))
mesh2 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))
layouts = {  # jit over NamedSharding: (mesh, the parameters' specs, the batch's)
    "data parallel": (mesh, {"w1": P(), "w2": P()}, P("d")),
    "fsdp": (mesh, {"w1": P("d"), "w2": P("d")}, P("d")),
    "data x model": (mesh2, {"w1": P(None, "model"), "w2": P("model", None)}, P("data")),
}
out = {}
for name, fn in programs.items():
    for layout, (m, specs, batch) in layouts.items():
        shardings = jax.tree.map(lambda s: NamedSharding(m, s), specs)
        placed = jax.tree.map(jax.device_put, params, shardings)
        step = jax.jit(jax.grad(fn), out_shardings=shardings)
        out[f"jit {layout}/{name}"] = reductions(step, placed, jax.device_put(x, NamedSharding(m, batch)))

    # the parameters' gathers (the forward pass's): FSDP, and FSDP x model (each parameter sharded on both axes)
    for layout, (m, specs, batch) in {"fsdp": layouts["fsdp"], "fsdp x model": (mesh2, {"w1": P("data", "model"), "w2": P("model", "data")}, P("data"))}.items():
        placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(m, s)), params, specs)
        gathers = reductions(jax.jit(fn), placed, jax.device_put(x, NamedSharding(m, batch)), kinds=("all-gather",))
        out[f"jit {layout}/{name}/gathers"] = gathers

    # explicit sharding (the arrays' types carry it): data parallel
    explicit_mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(explicit_mesh):
        placed = jax.device_put(params, NamedSharding(explicit_mesh, P()))
        batch = jax.device_put(x, NamedSharding(explicit_mesh, P("d")))
        out[f"jit explicit data parallel/{name}"] = reductions(jax.jit(jax.grad(fn)), placed, batch)

    # shard_map: the implicit psum of a replicated parameter's gradient (check_vma), and an explicit pmean
    implicit = jax.shard_map(
        lambda p, x: jax.grad(lambda p: jax.lax.psum(fn(p, x), "d"))(p), mesh=mesh, in_specs=(P(), P("d")),
        out_specs=P())
    out[f"shard_map implicit psum/{name}"] = reductions(jax.jit(implicit), params, x)
    explicit = jax.shard_map(
        lambda p, x: jax.lax.pmean(jax.grad(fn)(p, x), "d"), mesh=mesh, in_specs=(P(), P("d")), out_specs=P(),
        check_vma=False)
    out[f"shard_map pmean/{name}"] = reductions(jax.jit(explicit), params, x)
    if name != "float32":  # autocast around a function that holds the shard_map
        local = lambda p, x: jax.lax.psum(mlp(p, x), "d")
        around = jamp.autocast(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()),
                               dtype=jnp.bfloat16, reduce_dtype=programs[name].policy.reduce_dtype)
        out[f"autocast around shard_map/{name}"] = reductions(jax.jit(jax.grad(around)), params, x)

    # pmap with the scaler's axis_name
    tx = jamp.scaler(optax.sgd(0.1), axis_name="i")
    def pmap_step(p, s, x, fn=fn):
        g = jax.lax.pmean(jax.grad(lambda p: jamp.scale(fn(p, x), s))(p), "i")
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    stacked = jax.tree.map(lambda a: jnp.stack([a] * 8), params)
    state = jax.pmap(tx.init, axis_name="i")(stacked)
    out[f"pmap/{name}"] = reductions(jax.pmap(pmap_step, axis_name="i"), stacked, state, x.reshape(8, 8, 128))
print(json.dumps(out))
"""

JIT_FORMS = ("jit data parallel", "jit fsdp", "jit data x model", "jit explicit data parallel")
FORMS = JIT_FORMS + ("shard_map implicit psum", "shard_map pmean", "pmap")


@pytest.fixture(scope="module")
def reduced() -> dict:
    return json.loads(once_per_run("gradient_reduction", lambda: run_subprocess(SCRIPT)).strip().splitlines()[-1])


@pytest.mark.multidevice
@pytest.mark.parametrize("form", FORMS)
def test_gradients_cross_devices_in_float32_by_default(reduced, form):
    """Under autocast the gradients are reduced in float32, the float32 program's bytes exactly."""
    assert reduced[f"{form}/default"] == reduced[f"{form}/float32"]
    assert set(reduced[f"{form}/default"]) == {"float32"}


@pytest.mark.multidevice
@pytest.mark.parametrize("form", JIT_FORMS)
def test_reduce_dtype_bfloat16_halves_the_bytes_of_the_partitioners_reductions(reduced, form):
    """``reduce_dtype=bfloat16``: the weight-gradient matmuls' partial sums, and so the partitioner's reductions of
    them, are bfloat16 (what casting by hand gives)."""
    assert reduced[f"{form}/bfloat16"] == {"bfloat16": reduced[f"{form}/float32"]["float32"] // 2}


@pytest.mark.multidevice
@pytest.mark.parametrize("form", ["shard_map implicit psum", "shard_map pmean", "pmap", "autocast around shard_map"])
def test_a_gradient_reduced_after_the_backward_pass_is_float32_either_way(reduced, form):
    """shard_map's and pmap's reductions come after each device's backward pass, on the float32 gradients; autocast
    around a function that holds the shard_map reduces them there too."""
    assert set(reduced[f"{form}/default"]) == set(reduced[f"{form}/bfloat16"]) == {"float32"}


@pytest.mark.multidevice
@pytest.mark.parametrize("form", ["jit fsdp", "jit fsdp x model"])
def test_the_partitioner_gathers_the_parameters_in_the_compute_dtype(reduced, form):
    """Each parameter is cast on its shard (``jamp._jax_compat.cast_on_shard``): the forward pass gathers bfloat16,
    half the float32 program's bytes (FSDP by hand: tests/casting/test_parameter_gathers.py)."""
    gathered = reduced[f"{form}/float32/gathers"]["float32"]
    assert reduced[f"{form}/default/gathers"] == reduced[f"{form}/bfloat16/gathers"] == {"bfloat16": gathered // 2}


def _dots(lowered) -> list[str]:
    """The operand and result types of each dot_general of a lowered program's StableHLO."""
    return [re.search(r":\s*\((.*)", line).group(1) for line in lowered.as_text().splitlines() if "dot_general" in line]


@pytest.mark.parametrize("dtype,short", [(jnp.bfloat16, "bf16"), (jnp.float16, "f16")])
def test_the_weight_gradient_matmul_takes_low_operands_into_float32_where_the_backend_can(dtype, short):
    """Lowered for a GPU, the weight-gradient matmul multiplies compute-dtype operands into float32 (tensor-core
    speed, float32 partial sums); lowered for XLA:CPU, which runs no such dot, it widens them first."""
    f = jamp.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), dtype=dtype)
    w, x = jnp.ones((16, 32)), jnp.ones((8, 16))
    forward = f"tensor<8x16x{short}>, tensor<16x32x{short}>) -> tensor<8x32x{short}>"
    cuda, cpu = (
        _dots(lower_for_cuda(jax.grad(f), w, x)),
        _dots(jax.jit(jax.grad(f)).trace(w, x).lower(lowering_platforms=("cpu",))),
    )
    assert cuda == [forward, f"tensor<8x32x{short}>, tensor<8x16x{short}>) -> tensor<32x16xf32>"]
    assert cpu == [forward, "tensor<8x32xf32>, tensor<8x16xf32>) -> tensor<32x16xf32>"]
    assert jax.grad(f)(w, x).dtype == jnp.float32


@pytest.mark.parametrize(
    "reduce_dtype,match",
    [
        (jnp.int32, "reduce_dtype"),
        ("float64", "reduce_dtype"),
        (jnp.float16, "reduce_dtype=float16"),
        ("bogus", "reduce_dtype"),
    ],
)
def test_bad_reduce_dtype_is_refused_naming_it(reduce_dtype, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jamp.autocast(lambda x: x, dtype=jnp.bfloat16, reduce_dtype=reduce_dtype)(jnp.ones(2))


def test_reduce_dtype_narrower_or_other_than_float32_and_the_compute_dtype_is_refused():
    with pytest.raises(ValueError, match="reduce_dtype=bfloat16 .* float32 .* or in the compute dtype"):
        jamp.Policy(compute_dtype=jnp.float16, reduce_dtype=jnp.bfloat16)
    assert jamp.Policy(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16).reduce_dtype == jnp.bfloat16


def test_reduce_dtype_is_refused_in_a_with_region():
    with pytest.raises(ValueError, match="reduce_dtype"):
        with jamp.autocast(dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16):
            pass
