"""The scaler's checks on public information (jamp.scaling.guards), float0 and integer gradients, and a default path
that reads no other library's frames, closures or tracers (issue 43, points 3 to 5)."""

from __future__ import annotations

import inspect
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import once_per_run, run_subprocess

import jamp
from jamp import _jax_compat
from jamp.scaling import nesting, unscaled_grads

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "n": jnp.int32(3)}
LABELS = {"w": "float", "n": "int"}


def loss_fn(p):
    return jnp.sum(p["w"] ** 2) * p["n"]


def int_safe(opt):
    """What a user with integer parameters writes: the integers' float0 gradients go to set_to_zero."""
    return optax.multi_transform({"float": opt, "int": optax.set_to_zero()}, LABELS)


def test_float0_gradients_of_integer_parameters_pass_through_under_jit():
    tx = jamp.scaler(int_safe(optax.adam(0.1)))
    state = tx.init(PARAMS)

    @jax.jit
    def step(p, s, poison):
        grads = jax.grad(lambda q: jamp.scale(loss_fn(q) * poison, s), allow_int=True)(p)
        return tx.update(grads, s, p)

    updates, state = step(PARAMS, state, 1.0)
    assert updates["n"].dtype == jax.dtypes.float0 and not bool(state.found_inf)
    assert float(jnp.abs(updates["w"]).max()) == pytest.approx(0.1, rel=1e-4)
    skipped, state = step(PARAMS, state, jnp.inf)
    assert bool(state.found_inf) and not np.any(np.asarray(skipped["w"]))
    ints = jamp.scaler(optax.sgd(0.1))  # integer gradient leaves (not float0) reach the optimizer as they are
    grads = {"w": jnp.ones(3), "k": jnp.arange(3)}
    updates, _ = jax.jit(ints.update)(grads, ints.init(grads))
    np.testing.assert_allclose(updates["k"], [0.0, -0.1, -0.2])  # not divided by the scale


MULTIDEVICE = """
import json, jax, jax.numpy as jnp, numpy as np, optax, jamp
from jax.sharding import PartitionSpec as P
n = jax.device_count()
out = {}
params = {"w": jnp.ones((3,)), "n": jnp.int32(2)}
labels = {"w": "float", "n": "int"}
tx = jamp.scaler(optax.multi_transform({"float": optax.sgd(0.1), "int": optax.set_to_zero()}, labels), axis_name="d")
def loss(p, x):
    return jnp.sum(p["w"] * x) * p["n"]
def step(p, s, x):
    g = jax.grad(lambda q: jamp.scale(loss(q, x), s), allow_int=True)(p)
    g = {"w": jax.lax.pmean(g["w"], "d"), "n": g["n"]}
    u, s = tx.update(g, s, p)
    return u["w"], s.found_inf
x = jnp.ones((n, 3)).at[2, 0].set(jnp.inf)
stack = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)
u, found = jax.pmap(step, axis_name="d")(stack(params), stack(tx.init(params)), x)
out["pmap"] = [bool(f) for f in found]
mesh = jax.make_mesh((n,), ("d",))
x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("d")))
per = lambda p, s, x: step(p, s, x[0])
u, found = jax.jit(jax.shard_map(per, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=P(), check_vma=True))(
    params, tx.init(params), x)
out["shard_map"] = bool(found)

# the optimizer averages the gradients over the pmap axis, the scaler is not told
averaging = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.lax.pmean(u, "d"), s))
def forgot(p, s, x, tx):
    g = jax.grad(lambda q: jamp.scale(jnp.sum(q["w"] * x), s))(p)
    u, s = tx.update(g, s, p)
    return s.scale
p1 = {"w": jnp.ones((3,))}
for axis_name in (None, "d"):
    t = jamp.scaler(averaging, optax.sgd(0.1), axis_name=axis_name)
    try:
        scales = jax.pmap(lambda p, s, x: forgot(p, s, x, t), axis_name="d")(stack(p1), stack(t.init(p1)), x)
        out[f"averaging_{axis_name}"] = [float(v) for v in scales]
    except ValueError as e:
        out[f"averaging_{axis_name}"] = str(e)
    try:
        sm = jax.shard_map(lambda p, s, x: forgot(p, s, x[0], t), mesh=mesh, in_specs=(P(), P(), P("d")),
                           out_specs=P(), check_vma=False)
        out[f"shard_map_averaging_{axis_name}"] = float(jax.jit(sm)(p1, t.init(p1), x))
    except ValueError as e:
        out[f"shard_map_averaging_{axis_name}"] = str(e)
# an ensemble: no collective anywhere, each replica skips on its own
t = jamp.scaler(optax.sgd(0.1))
scales = jax.pmap(lambda p, s, x: forgot(p, s, x, t), axis_name="d")(stack(p1), stack(t.init(p1)), x)
out["ensemble"] = [float(v) for v in scales]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def multidevice():
    out = once_per_run("scaler_guards", lambda: run_subprocess(MULTIDEVICE, devices=4))
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.multidevice
def test_float0_gradients_pass_through_under_pmap_and_shard_map(multidevice):
    assert multidevice["pmap"] == [True] * 4 and multidevice["shard_map"] is True


@pytest.mark.multidevice
def test_an_optimizer_that_averages_over_an_axis_the_scaler_does_not_name_is_refused(multidevice):
    for form in ("averaging_None", "shard_map_averaging_None"):
        said = multidevice[form]
        assert isinstance(said, str), form
        assert said.startswith("jamp.scaler(axis_name=None): the optimizer it wraps communicates over the axis 'd'")
        assert said.endswith("Pass jamp.scaler(..., axis_name='d')")
    assert multidevice["averaging_d"] == [32768.0] * 4  # every replica backed off together
    assert multidevice["shard_map_averaging_d"] == 32768.0
    assert multidevice["ensemble"] == [65536.0, 65536.0, 32768.0, 65536.0]  # each model on its own


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_parameters_under_a_rounding_optimizer_are_named_with_the_fix(dtype):
    params = {"w": jnp.ones(4, dtype), "b": jnp.zeros(2, jnp.float32)}
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 2.0**10, params)
    tx = jamp.scaler(optax.adam(1e-3))
    with pytest.warns(UserWarning, match=rf"grads\['w'\] is {dtype}, and so are the updates.*kahan_summation") as said:
        jax.jit(tx.update)(grads, tx.init(params), params)
    assert "Attempting to unscale FP16 gradients" in str(said[0].message)
    params = {"w": jnp.ones(4, jnp.float16), "b": jnp.zeros(2, jnp.float32)}
    for fine, p in (
        (jamp.scaler(jamp.kahan_summation(optax.adam(1e-3), state_dtype=jnp.float32)), params),
        (jamp.scaler(jamp.stochastic_rounding(optax.adam(1e-3), seed=0)), params),
        (jamp.scaler(optax.adam(1e-3)), {"b": params["b"]}),  # float32 parameters
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax.jit(fine.update)(jax.tree.map(jnp.ones_like, p), fine.init(p), p)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "cuda"}, r"jamp\.scaler has no device argument \(torch's GradScaler\(device='cuda'\)\).*Write tx"),
        ({"init_scal": 2.0}, r"unexpected keyword argument 'init_scal'; did you mean init_scale=\?"),
        ({"init_scale": jnp.float32(2.0)}, r"init_scale is an array.*inject into the optimizer the scaler wraps"),
    ],
)
def test_keywords_torch_habits_and_arrays_say_what_to_write(kwargs, match):
    with pytest.raises(TypeError, match=match):
        jamp.scaler(optax.adam(1e-3), **kwargs)


def test_inject_hyperparams_around_the_scaler_says_where_to_inject():
    with pytest.raises(TypeError, match=r"optax\.inject_hyperparams\(jamp\.scaler\) passes arrays"):
        optax.inject_hyperparams(jamp.scaler)(optax.adam(1e-3)).init({"w": jnp.ones(3)})


def test_the_default_path_reads_no_frames_closures_or_tracers(monkeypatch):
    """With every reader of optax's frames and closures and of JAX's tracers made to fail, the nestings those
    readers judge still trace and run: only jamp.check_step calls them."""

    def refuse(*args, **kwargs):
        raise AssertionError("a default path read another library's internals")

    for module, name in [
        (_jax_compat, "producer"),
        (_jax_compat, "jaxpr_trace_of"),
        (nesting, "chain_message"),
        (nesting, "multisteps_keeps_an_overflow"),
        (unscaled_grads, "message"),
        (inspect, "getclosurevars"),
    ]:
        monkeypatch.setattr(module, name, refuse)
    params = {"w": jnp.ones(3)}
    for tx in (
        optax.chain(optax.clip_by_global_norm(1.0), jamp.scaler(optax.adam(1e-3)), optax.add_decayed_weights(0.1)),
        optax.MultiSteps(jamp.scaler(optax.adam(1e-3)), every_k_schedule=2),
    ):

        @jax.jit
        def step(p, s, tx=tx):
            grads = jax.grad(lambda q: jnp.sum(q["w"] ** 2))(p)  # jamp.scale forgotten, on purpose
            return tx.update(grads, s, p)

        jax.block_until_ready(step(params, tx.init(params)))
        jamp.scale(jnp.float32(1.0), tx.init(params))
