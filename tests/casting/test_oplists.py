"""The op tables are data about the installed JAX: every primitive they name must exist, and the
higher-order primitives jamp rewrites must still carry the parameters it reads."""

import gc

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas  # noqa: F401  (registers pallas_call)
from jax.extend import core as jcore
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jamp
from jamp import _jax_compat as jc
from jamp.casting import oplists


def installed_primitive_names():
    import jax._src.lax.fft
    import jax._src.lax.linalg
    import jax._src.lax.special
    import jax.random  # noqa: F401

    return {o.name for o in gc.get_objects() if isinstance(o, jcore.Primitive)}


def test_every_listed_primitive_exists_in_installed_jax():
    names = installed_primitive_names()
    listed = {p for row in oplists.OP_TABLE for p in row.primitives}
    missing = sorted(listed - names)
    assert not missing, f"primitives not in jax {jax.__version__}: {missing}"


def test_no_primitive_is_listed_twice():
    listed = [p for row in oplists.OP_TABLE for p in row.primitives]
    assert len(listed) == len(set(listed))


def test_categories_are_known_and_both_lists_cover_the_same_primitives():
    for row in oplists.OP_TABLE:
        assert row.gpu in oplists.CATEGORIES and row.cpu in oplists.CATEGORIES
    assert set(oplists.categories_for("gpu")) == set(oplists.categories_for("cpu"))


def assert_params(eqn, name: str, params: list[str]) -> None:
    """Name the primitive and parameter that moved, so a new JAX release says what to change in _jax_compat."""
    assert eqn is not None, f"jax {jax.__version__} staged no {name!r} equation (jamp/_jax_compat.py names it)"
    missing = [p for p in params if p not in eqn.params]
    assert not missing, (
        f"jax {jax.__version__}: primitive {name!r} has no parameter {missing} that jamp reads "
        f"(it has {sorted(eqn.params)}); update jamp/_jax_compat.py"
    )


def first_eqn(closed, name: str):
    return next((e for e in closed.jaxpr.eqns if e.primitive.name == name), None)


@pytest.mark.parametrize(
    "fun,name,params",
    [
        (lambda x: jax.jit(jnp.sin)(x), jc.JIT, [jc.JIT_JAXPR, jc.JIT_NAME]),
        (lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=2)[0], jc.SCAN, [jc.SCAN_JAXPR]),
        (
            lambda x: jax.lax.while_loop(lambda c: c.sum() < 0, lambda c: c, x),
            jc.WHILE,
            [jc.WHILE_COND, jc.WHILE_BODY, jc.WHILE_COND_NCONSTS, jc.WHILE_BODY_NCONSTS],
        ),
        (lambda x: jax.lax.cond(True, jnp.sin, jnp.cos, x), jc.COND, [jc.COND_BRANCHES]),
        (lambda x: jax.checkpoint(jnp.sin)(x), jc.REMAT, [jc.REMAT_JAXPR]),
        (lambda x: jax.nn.relu(x), jc.CUSTOM_JVP, [jc.CALL_JAXPR, jc.JVP_THUNK, jc.NUM_CONSTS]),
        (
            lambda x: jax.shard_map(
                jnp.sin,
                mesh=jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,)),
                in_specs=P("d"),
                out_specs=P("d"),
            )(x),
            jc.SHARD_MAP,
            [jc.SHARD_MAP_JAXPR, jc.SHARD_MAP_OUT_SPECS, jc.SHARD_MAP_IN_SPECS],
        ),
    ],
)
def test_higher_order_primitive_parameters(fun, name, params):
    assert_params(first_eqn(jax.make_jaxpr(fun)(jnp.ones(3)), name), name, params)


def test_scan_operand_groups_and_shard_map_axes():
    """What the tools' threading reads and rebinds (jamp/_jax_compat/loops.py): a scan's consts/carry/xs
    groups, read and written back, and a shard_map's manual axes."""
    w, x, xs = jnp.ones(3), jnp.ones(3), jnp.ones((2, 3))
    f = lambda w, x, xs: jax.lax.scan(lambda c, y: (c * w + y, c.sum()), x, xs)
    eqn = first_eqn(jax.make_jaxpr(f)(w, x, xs), jc.SCAN)
    assert jc.scan_sizes(eqn.params) == (1, 1)
    params = jc.scan_params(eqn.params, eqn.params[jc.SCAN_JAXPR], 1, 1, 1)
    carry, ys = eqn.primitive.bind(w, x, xs, **params)
    assert jnp.array_equal(carry, f(w, x, xs)[0]) and jnp.array_equal(ys, f(w, x, xs)[1])
    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))
    sm = jax.shard_map(jnp.sin, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    assert jc.shard_map_manual_axes(first_eqn(jax.make_jaxpr(sm)(x), jc.SHARD_MAP).params) == ("d",)


def custom_vjp_identity():
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g,))
    return f


def test_custom_vjp_parameters():
    eqn = first_eqn(jax.make_jaxpr(custom_vjp_identity())(1.0), jc.CUSTOM_VJP)
    assert_params(eqn, jc.CUSTOM_VJP, [jc.CALL_JAXPR, jc.FWD_THUNK, jc.BWD, jc.NUM_CONSTS])


def test_custom_vjp_bwd_protocol():
    """What a flat bwd returns (cotangents, or (cotangents, logs) since jax 0.11) is what jc expects."""
    eqn = first_eqn(jax.make_jaxpr(custom_vjp_identity())(1.0), jc.CUSTOM_VJP)
    eqn.params[jc.FWD_THUNK].call_wrapped(True)  # tracing fwd records the trees bwd unflattens with
    result = eqn.params[jc.BWD].call_wrapped(jnp.float32(2.0))  # residual None is dropped: one cotangent in
    cts, _ = jc.split_bwd_result(result)
    assert len(cts) == 1 and float(cts[0]) == 2.0, (
        f"jax {jax.__version__}: a custom_vjp bwd returned {result!r}; jc.BWD_RETURNS_LOGS={jc.BWD_RETURNS_LOGS} "
        "does not describe it"
    )


def test_jit_body_is_the_object_the_equation_holds():
    jitted = jax.jit(jnp.sin)
    body = jc.jit_body(jitted, 1.0)
    eqn = first_eqn(jax.make_jaxpr(lambda x: jitted(x) + jitted(x))(1.0), jc.JIT)
    assert eqn.params[jc.JIT_JAXPR] is body, (
        f"jax {jax.__version__}: jitted.trace(...).jaxpr is not the {jc.JIT_JAXPR!r} parameter of the equation; "
        "jamp/_jax_compat.py jit_body must find it another way"
    )


def test_builtin_policies_are_built_from_the_tables():
    for device, oplist in oplists.OPLIST_OF_DEVICE.items():
        policy = jamp.get_policy(device)
        for prim, cat in oplists.categories_for(oplist).items():
            assert policy.category(prim) == cat
        assert str(policy.compute_dtype) == oplists.DEFAULT_DTYPE_OF_DEVICE[device]
