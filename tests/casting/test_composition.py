"""Composition matrix: autocast applied inside and outside each JAX transformation and higher-order
primitive. Each cell must run, match the float32 result, and run its matmuls in the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dtypes_of

import jamp

W = jax.random.normal(jax.random.key(0), (8, 8)) / 3
X = jax.random.normal(jax.random.key(1), (4, 8))


def base(w, x):
    """The function every transformation wraps: a matmul, a nonlinearity, a reduction."""
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _pallas_double(x):
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _custom_jvp_of(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda p, t: (f(*p), jax.jvp(f, p, t)[1]))
    return g


def _custom_vjp_of(f):
    g = jax.custom_vjp(f)
    g.defvjp(lambda w, x: (f(w, x), (w, x)), lambda r, ct: jax.tree.map(lambda d: ct * d, jax.grad(f, (0, 1))(*r)))
    return g


# name -> transformation of a function f(w, x) -> scalar, returning a function of (w, x).
TRANSFORMS = {
    "jit": jax.jit,
    "grad": lambda f: jax.grad(f),
    "value_and_grad": lambda f: lambda w, x: jax.value_and_grad(f)(w, x)[1],
    "jacfwd": lambda f: jax.jacfwd(f),
    "jacrev": lambda f: jax.jacrev(f),
    "hessian": lambda f: lambda w, x: jax.hessian(lambda x: f(w, x))(x[:1]),
    "vmap": lambda f: lambda w, x: jax.vmap(f, (None, 0))(w, jnp.stack([x, 2 * x])),
    "scan": lambda f: lambda w, x: jax.lax.scan(lambda c, _: (c + f(w, x), None), 0.0, None, length=2)[0],
    "fori_loop": lambda f: lambda w, x: jax.lax.fori_loop(0, 2, lambda i, c: c + f(w, x * i), 0.0),
    "while_loop": lambda f: (
        lambda w, x: jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + f(w, x)), (0, 0.0))[1]
    ),
    "cond": lambda f: lambda w, x: jax.lax.cond(x.sum() > 0, f, lambda w, x: -f(w, x), w, x),
    "switch": lambda f: lambda w, x: jax.lax.switch(1, [lambda w, x: 0.0 * f(w, x), f], w, x),
    "checkpoint": lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    "checkpoint_grad": lambda f: jax.grad(jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)),
    "custom_jvp": lambda f: lambda w, x: _custom_jvp_of(f)(w, x) + jax.grad(_custom_jvp_of(f), 1)(w, x).sum(),
    "custom_vjp": lambda f: lambda w, x: _custom_vjp_of(f)(w, x) + jax.grad(_custom_vjp_of(f), 1)(w, x).sum(),
    "custom_linear_solve": lambda f: (
        lambda w, x: f(w, x) + jax.lax.custom_linear_solve(lambda v: 2.0 * v, x, lambda mv, b: b / 2.0).sum()
    ),
    "pure_callback": lambda f: (
        lambda w, x: jax.pure_callback(lambda v: np.asarray(v) + 1, jax.ShapeDtypeStruct((), jnp.float32), f(w, x))
    ),
    "pallas_call": lambda f: lambda w, x: f(w, _pallas_double(x)),
    "nested_autocast": lambda f: (
        lambda w, x: jamp.autocast(f, enabled=False)(w, x) + jamp.autocast(f, dtype="f16")(w, x)
    ),
    "named_scope": lambda f: lambda w, x: jax.named_scope("block")(f)(w, x),
}
NO_LOW_DOTS = {"nested_autocast"}  # mixes a float32 region on purpose


@pytest.mark.parametrize("order", ["inside", "outside"])
@pytest.mark.parametrize("name", TRANSFORMS)
def test_composition(name, order):
    transform = TRANSFORMS[name]
    ref = transform(base)(W, X)
    fun = (
        jamp.autocast(transform(base), dtype="bf16")
        if order == "inside"
        else transform(jamp.autocast(base, dtype="bf16"))
    )
    out = fun(W, X)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert o.dtype == r.dtype
        np.testing.assert_allclose(o, r, rtol=0.05, atol=0.05 * float(jnp.abs(r).max()) + 1e-3)
    dots = dtypes_of(fun, W, X)
    assert dots
    if name not in NO_LOW_DOTS:  # bfloat16 results, or float32 where a matmul computes a float32 operand's gradient
        assert all(d in (("bfloat16",) * 3, ("bfloat16", "bfloat16", "float32")) for d in dots), dots
    elif order == "inside":  # the enabled=False region runs float32, the dtype region float16
        assert {d[0] for d in dots} == {"float16", "float32"}


def test_transforms_of_an_autocast_function_retrace_nothing():
    calls = []

    def f(w, x):
        calls.append(1)
        return base(w, x)

    g = jamp.autocast(f, dtype="bf16")
    for transform in (jax.grad, jax.jacfwd, jax.jacrev, jax.jit):
        transform(g)(W, X)
    jax.vmap(g, (None, 0))(W, jnp.stack([X, X]))  # per-example shape equals X's
    assert len(calls) == 1


def test_shard_map_body_with_literal_outputs():
    """A shard_map body whose outputs include jaxpr literals (a Python bool, typed scalars)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    body = lambda w, x: (x @ w, jnp.array(False), jnp.array(1.5, jnp.float32), jnp.float16(2))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P("d"), P(), P(), P()))
    x = jax.device_put(X, NamedSharding(mesh, P("d")))
    ref, out = f(W, x), jamp.autocast(f, dtype="bf16")(W, x)
    assert dtypes_of(jamp.autocast(f, dtype="bf16"), W, x) == [("bfloat16",) * 3]
    for o, r in zip(out, ref):
        assert jax.typeof(o) == jax.typeof(r), (o, r)
        np.testing.assert_allclose(o, r, rtol=0.02, atol=0.02)
