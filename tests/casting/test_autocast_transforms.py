"""autocast composes with JAX transformations and higher-order primitives, inside and outside."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dtypes_of, eqns

import jamp

BF16, F32 = "bfloat16", "float32"
W = jax.random.normal(jax.random.key(0), (8, 8)) / 3
X = jax.random.normal(jax.random.key(1), (4, 8))
LOW = (BF16, BF16, BF16)
WIDE = (BF16, BF16, "float32")  # a float32 operand's gradient: compute-dtype operands, a float32 result (reduce_dtype)


def all_dots_low(fun, *args, expected=None):
    """Every matmul takes bfloat16 operands; each returns bfloat16, or float32 where it computes the gradient of a
    float32 operand."""
    dots = dtypes_of(fun, *args)
    assert dots, "no dot_general found"
    assert all(d in (LOW, WIDE) for d in dots), dots
    if expected is not None:
        assert len(dots) == expected, dots


def _scan_model(w, x):
    def body(c, _):
        h = jnp.tanh(c @ w)
        return h, h.sum()

    c, ys = jax.lax.scan(body, x, None, length=3)
    return c.sum() + ys.sum()


def _fori_model(w, x):
    return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x).sum()


def _while_model(w, x):
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[0].sum()


def _cond_model(w, x):
    return jax.lax.cond(x.sum() > 0, lambda c: c @ w, lambda c: jnp.sin(c) * 2, x).sum()


def _switch_model(w, x):
    branches = [lambda c: c @ w, lambda c: (c @ w) @ w, lambda c: c * 1.5]
    return jax.lax.switch(jnp.int32(1), branches, x).sum()


def _jit_model(w, x):
    inner = jax.jit(lambda a, b: jnp.tanh(a @ b))
    return jax.jit(lambda a, b: inner(a, b) @ b)(x, w).sum()


def _remat_model(w, x):
    layer = jax.checkpoint(lambda c: jax.nn.relu(c @ w), policy=jax.checkpoint_policies.dots_saveable)
    return jax.checkpoint(lambda c: layer(layer(c)))(x).sum()


@jax.custom_vjp
def _custom_matmul(a, b):
    return a @ b


def _cm_fwd(a, b):
    return a @ b, (a, b)


def _cm_bwd(res, g):
    a, b = res
    return g @ b.T * 3.0, a.T @ g  # the "* 3" proves our rule, not autodiff, produced the grad


_custom_matmul.defvjp(_cm_fwd, _cm_bwd)


def _custom_vjp_model(w, x):
    return _custom_matmul(x, w).sum()


@jax.custom_jvp
def _scaled_tanh(x):
    return jnp.tanh(x)


_scaled_tanh.defjvp(lambda primals, tangents: (jnp.tanh(primals[0]), 5.0 * tangents[0]))


def _custom_jvp_model(w, x):
    return _scaled_tanh(x @ w).sum()


MODELS = {
    "scan": _scan_model,
    "fori": _fori_model,
    "cond": _cond_model,
    "switch": _switch_model,
    "jit": _jit_model,
    "remat": _remat_model,
    "custom_vjp": _custom_vjp_model,
    "custom_jvp": _custom_jvp_model,
}


@pytest.mark.parametrize("name", MODELS)
def test_forward_matmuls_low_inside_higher_order_primitives(name):
    all_dots_low(jamp.autocast(MODELS[name], dtype="bf16"), W, X)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("order", ["grad_of_autocast", "autocast_of_grad"])
def test_backward_matmuls_low_and_grads_in_param_dtype(name, order):
    f = MODELS[name]
    g = (
        jax.grad(jamp.autocast(f, dtype="bf16"))
        if order == "grad_of_autocast"
        else jamp.autocast(jax.grad(f), dtype="bf16")
    )
    all_dots_low(g, W, X)
    grad = g(W, X)
    ref = jax.grad(f)(W, X)
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, ref, rtol=0.05, atol=0.05 * float(jnp.abs(ref).max()))


def test_while_loop_forward_and_jvp():
    all_dots_low(jamp.autocast(_while_model, dtype="bf16"), W, X)
    primal, tangent = jax.jvp(jamp.autocast(_while_model, dtype="bf16"), (W, X), (W, X))
    ref_p, ref_t = jax.jvp(_while_model, (W, X), (W, X))
    np.testing.assert_allclose(primal, ref_p, rtol=0.05)
    np.testing.assert_allclose(tangent, ref_t, rtol=0.05, atol=0.1)


def test_loop_carries_and_branch_outputs_keep_their_dtypes():
    for name in ("scan", "fori", "cond", "switch"):
        closed = jax.make_jaxpr(jamp.autocast(MODELS[name], dtype="bf16"))(W, X)
        original = jax.make_jaxpr(MODELS[name])(W, X)
        hops = [e for e in eqns(closed) if e.primitive.name in ("scan", "while", "cond")]
        orig_hops = [e for e in eqns(original) if e.primitive.name in ("scan", "while", "cond")]
        assert [[v.aval.dtype for v in e.outvars] for e in hops] == [
            [v.aval.dtype for v in e.outvars] for e in orig_hops
        ]


def test_custom_rules_are_the_ones_that_differentiate():
    g = jax.grad(jamp.autocast(_custom_vjp_model, dtype="bf16"), argnums=1)(W, X)
    np.testing.assert_allclose(g, jax.grad(_custom_vjp_model, argnums=1)(W, X), rtol=0.02, atol=0.05)
    np.testing.assert_allclose(g, 3.0 * jnp.ones_like(X) @ W.T, rtol=0.02, atol=0.05)
    t = jax.grad(lambda x: jamp.autocast(_scaled_tanh, dtype="bf16")(x).sum())(X)
    np.testing.assert_allclose(t, 5.0 * jnp.ones_like(X))


def test_custom_vjp_bwd_outputs_are_cast_back_to_primal_dtypes():
    @jax.custom_vjp
    def f(x):
        return x * 2

    f.defvjp(lambda x: (x * 2, x), lambda x, g: ((g @ jnp.eye(8)) * 2,))  # a matmul inside bwd
    g = jax.grad(lambda x: jamp.autocast(f, dtype="bf16")(x).sum())(X)
    assert g.dtype == jnp.float32
    assert any(d == LOW for d in dtypes_of(jax.grad(lambda x: jamp.autocast(f, dtype="bf16")(x).sum()), X))


@pytest.mark.skipif(not hasattr(jax.custom_vjp, "defvjp_with_logs"), reason="backward-pass logs came in jax 0.11")
def test_custom_vjp_backward_logs_come_through():
    @jax.custom_vjp
    def f(x):
        return x * 2

    f.defvjp_with_logs(lambda x: (x * 2, x), lambda x, g: (((g @ jnp.eye(8)) * 2,), {"g_sq": jnp.sum(g * g)}))
    out, f_vjp = jax.vjp(jamp.autocast(f, dtype="bf16"), X)
    (ct,), logs = f_vjp.with_logs(jnp.ones_like(out))
    assert ct.dtype == jnp.float32 and float(logs["g_sq"]) == X.size
    np.testing.assert_allclose(ct, 2.0 * jnp.ones_like(X), rtol=0.01)


def test_relu_custom_jvp_keeps_low_precision_activations():
    f = lambda w, x: jax.nn.relu(x @ w) @ w
    all_dots_low(jamp.autocast(f, dtype="bf16"), W, X)
    maxes = dtypes_of(jamp.autocast(f, dtype="bf16"), W, X, primitive="max")
    assert maxes and all(m[-1] == BF16 for m in maxes)


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_vmap(order):
    xs = jnp.stack([X, -X, 2 * X])
    f = lambda w, x: jnp.tanh(x @ w).sum()
    g = (
        jax.vmap(jamp.autocast(f, dtype="bf16"), (None, 0))
        if order == "outside"
        else jamp.autocast(jax.vmap(f, (None, 0)), dtype="bf16")
    )
    all_dots_low(g, W, xs)
    np.testing.assert_allclose(g(W, xs), jax.vmap(f, (None, 0))(W, xs), rtol=0.03)


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_jit(order):
    f = lambda w, x: jnp.tanh(x @ w).sum()
    g = jax.jit(jamp.autocast(f, dtype="bf16")) if order == "outside" else jamp.autocast(jax.jit(f), dtype="bf16")
    all_dots_low(g, W, X)
    np.testing.assert_allclose(g(W, X), f(W, X), rtol=0.03)


def test_value_and_grad_jacfwd_jacrev_hessian():
    f = lambda w, x: jnp.tanh(x @ w).sum()
    a = jamp.autocast(f, dtype="bf16")
    v, g = jax.value_and_grad(a)(W, X)
    assert v.dtype == g.dtype == jnp.float32
    np.testing.assert_allclose(jax.jacfwd(a)(W, X), jax.jacrev(a)(W, X), rtol=0.05, atol=0.05)
    h = jax.hessian(lambda x: a(W, x))(X[:1])
    np.testing.assert_allclose(h, jax.hessian(lambda x: f(W, x))(X[:1]), atol=0.1)


def test_pallas_call_runs_opaque_with_recorded_dtypes():
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    double = functools.partial(
        pl.pallas_call, kernel, out_shape=jax.ShapeDtypeStruct((4, 8), jnp.float32), interpret=True
    )()

    def f(w, x):
        return double(x @ w).sum()

    closed = jax.make_jaxpr(jamp.autocast(f, dtype="bf16"))(W, X)
    calls = [e for e in eqns(closed) if e.primitive.name == "pallas_call"]
    assert [str(v.aval.dtype) for v in calls[0].invars] == [F32]
    np.testing.assert_allclose(jamp.autocast(f, dtype="bf16")(W, X), f(W, X), rtol=0.03)


def test_remat_policy_and_checkpoint_name_survive():
    from jax.ad_checkpoint import checkpoint_name

    def f(w, x):
        def layer(c):
            return jnp.tanh(checkpoint_name(c @ w, "h"))

        return jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("h"))(x).sum()

    closed = jax.make_jaxpr(jax.grad(jamp.autocast(f, dtype="bf16")))(W, X)
    remats = [e for e in eqns(closed) if e.primitive.name == "remat2"]
    assert remats and remats[0].params["policy"] is not None
    all_dots_low(jax.grad(jamp.autocast(f, dtype="bf16")), W, X)


def test_custom_linear_solve_and_pure_callback_are_opaque():
    def f(w, x):
        a = w @ w.T + 8 * jnp.eye(8)
        sol = jax.lax.custom_linear_solve(lambda v: a @ v, x[0], lambda mv, b: jnp.linalg.solve(a, b))
        cb = jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct((8,), jnp.float32), sol)
        return cb.sum()

    np.testing.assert_allclose(jamp.autocast(f, dtype="bf16")(W, X), f(W, X), rtol=0.05)


# -- literals: a jaxpr keeps scalar constants inline (Python bools as they are), and they reach rules,
# -- output casts and every body's outputs
def _literals():
    """(a Python bool, float32 and float16 scalars, a weak-typed Python float), as a jaxpr inlines them."""
    return jnp.array(False), jnp.array(1.5, jnp.float32), jnp.float16(2), 2.0


def _other_literals():
    return jnp.array(True), jnp.array(2.5, jnp.float32), jnp.float16(3), 4.0


@jax.custom_jvp
def _literal_jvp(w, x):
    return (x @ w, *_literals())


@_literal_jvp.defjvp
def _literal_jvp_rule(primals, tangents):
    (w, x), (tw, tx) = primals, tangents
    float0 = np.zeros((), jax.dtypes.float0)
    return _literal_jvp(w, x), (tx @ w + x @ tw, float0, jnp.array(0.5, jnp.float32), jnp.float16(0), 0.0)


@jax.custom_vjp
def _literal_vjp(w, x, s):
    return (s * (x @ w), *_literals())


_literal_vjp.defvjp(
    lambda w, x, s: (_literal_vjp(w, x, s), (w, x, s)),
    lambda r, ct: (r[2] * r[1].T @ ct[0], r[2] * ct[0] @ r[0].T, jnp.array(0.25, jnp.float32)),
)


LITERAL_MODELS = {
    "output": lambda w, x: (x @ w, *_literals()),
    "operand": lambda w, x: jax.lax.select_n(jnp.array(True), x, x @ w),
    "cond": lambda w, x: jax.lax.cond(
        x.sum() > 0, lambda x: (x @ w, *_literals()), lambda x: (x, *_other_literals()), x
    ),
    "scan": lambda w, x: jax.lax.scan(
        lambda c, _: ((c[0] @ w, *_literals()), _literals()), (x, *_other_literals()), None, length=2
    ),
    "while": lambda w, x: jax.lax.while_loop(
        lambda c: c[1], lambda c: (c[0] @ w, *_literals()), (x, *_other_literals())
    ),
    "jit": lambda w, x: jax.jit(lambda x: (x @ w, *_literals()))(x),
    "remat": lambda w, x: jax.checkpoint(lambda x: (x @ w, *_literals()))(x),
    "custom_jvp": _literal_jvp,
    "custom_jvp_tangents": lambda w, x: [t for i, t in enumerate(jax.jvp(_literal_jvp, (w, x), (w, x))[1]) if i != 1],
    "custom_vjp": lambda w, x: _literal_vjp(w, x, x[0, 0]),
    "custom_vjp_cotangent": lambda w, x: jax.grad(lambda s: _literal_vjp(w, x, s)[0].sum())(x[0, 0]),
    "grad_aux": lambda w, x: jax.value_and_grad(lambda w: ((x @ w).sum(), _literals()), has_aux=True)(w),
}


@pytest.mark.parametrize("name", LITERAL_MODELS)
def test_literal_values_come_out_as_arrays_of_their_declared_types(name):
    """A literal output stays what it is (a False output a bool array, a float16 literal float16, a
    Python float a weak float32), wherever the jaxpr holds it; matmuls still run low."""
    f = LITERAL_MODELS[name]
    ref, out = jax.jit(f)(W, X), jamp.autocast(f, dtype="bf16")(W, X)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert isinstance(o, jax.Array) and jax.typeof(o) == jax.typeof(r), (o, r)
        np.testing.assert_allclose(o, r, rtol=0.02, atol=0.02)
    assert dtypes_of(jamp.autocast(f, dtype="bf16"), W, X)[0][:2] == (BF16, BF16)


def test_literal_aux_outputs_of_a_differentiated_autocast_function_are_arrays():
    """Under a transformation the rewritten program runs inline (eval_jaxpr), which hands literal outputs
    back as the jaxpr holds them; they still come out as arrays of their types."""
    f = jamp.autocast(lambda w, x: ((x @ w).sum(), _literals()), dtype="bf16")
    (_, aux), grad = jax.value_and_grad(f, has_aux=True)(W, X)
    for a, r in zip(aux, jax.jit(_literals)()):
        assert isinstance(a, jax.Array) and jax.typeof(a) == jax.typeof(r) and a == r, (a, r)
    assert grad.dtype == jnp.float32
