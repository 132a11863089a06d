"""Per-primitive semantics of autocast: categories, eligibility, literals, bias, explicit casts."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count, dtypes_of, eqns, run_subprocess

import jamp

F16, BF16, F32 = "float16", "bfloat16", "float32"
KEY = jax.random.key(0)
W = jax.random.normal(KEY, (8, 8), jnp.float32)
X = jax.random.normal(jax.random.key(1), (4, 8), jnp.float32)
B = jnp.ones((8,), jnp.float32)


def out_dtype(fun, *args, **kw):
    return jax.eval_shape(jamp.autocast(fun, **kw), *args).dtype


def last_dtype(fun, *args, primitive, **kw):
    return dtypes_of(jamp.autocast(fun, **kw), *args, primitive=primitive)[-1][-1]


def result_dtype(fun, *args, primitive, **kw):
    """The dtype the last ``primitive``'s result has for the rest of the program (a reduction given a
    low-precision input runs on float32 in the jaxpr and rounds its result to the dtype its rule gives)."""
    return [r for r in jamp.explain(fun, **kw)(*args).rows if r.primitive == primitive][-1].out_dtypes[0]


@pytest.mark.parametrize("device_type,dtype", [("gpu", F16), ("cuda", F16), ("cpu", BF16), ("tpu", BF16)])
def test_default_dtype_per_device(device_type, dtype):
    assert dtypes_of(jamp.autocast(jnp.matmul, device_type=device_type), X, W) == [(dtype, dtype, dtype)]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, "f16", "bf16", "float16", "bfloat16"])
def test_dtype_argument_forms(dtype):
    expected = str(jnp.dtype({"f16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)))
    assert dtypes_of(jamp.autocast(jnp.matmul, dtype=dtype), X, W) == [(expected,) * 3]


@pytest.mark.parametrize("device_type", ["gpu", "cpu"])
def test_forward_and_backward_matmuls_run_in_compute_dtype(device_type):
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) @ w.T)

    fwd = dtypes_of(jamp.autocast(loss, device_type=device_type), W, X)
    bwd = dtypes_of(jax.grad(jamp.autocast(loss, device_type=device_type)), W, X)
    low = F16 if device_type == "gpu" else BF16
    assert fwd == [(low, low, low)] * 2
    # the two forward matmuls and the activation gradient's in the compute dtype; the weight gradient's two take
    # compute-dtype operands into float32 (reduce_dtype: jamp.casting.wide_cotangents)
    assert sorted(bwd) == sorted([(low, low, low)] * 3 + [(low, low, F32)] * 2)
    assert jax.grad(jamp.autocast(loss, device_type=device_type))(W, X).dtype == jnp.float32


def test_linear_bias_add_stays_in_compute_dtype():
    def linear(x, w, b):
        return x @ w + b

    adds = dtypes_of(jamp.autocast(linear, dtype="bf16"), X, W, B, primitive="add")
    assert adds == [(BF16, BF16, BF16)]
    # a residual of the full size promotes like torch (addmm output + fp32 tensor -> fp32)
    adds = dtypes_of(jamp.autocast(lambda x, w: x @ w + x, dtype="bf16"), X, W, primitive="add")
    assert adds == [(F32, F32, F32)]
    # the matmul's result rearranged before the bias comes (Equinox's Linear under vmap is w @ x, transposed)
    rearranged = lambda x, w, b: (w.T @ x.T).T.reshape(X.shape[0], 1, -1).squeeze(1) + b
    assert dtypes_of(jamp.autocast(rearranged, dtype="bf16"), X, W, B, primitive="add") == [(BF16, BF16, BF16)]
    np.testing.assert_allclose(jamp.autocast(rearranged, dtype="bf16")(X, W, B), linear(X, W, B), rtol=0.02, atol=0.02)


def test_conv_bias_from_flax_stays_in_compute_dtype():
    import flax.linen as nn

    conv = nn.Conv(4, (3, 3))
    x = jnp.ones((2, 8, 8, 3))
    params = conv.init(KEY, x)
    assert (
        dtypes_of(jamp.autocast(conv.apply, dtype="bf16"), params, x, primitive="conv_general_dilated")[0][-1] == BF16
    )
    assert dtypes_of(jamp.autocast(conv.apply, dtype="bf16"), params, x, primitive="add") == [(BF16,) * 3]


@pytest.mark.parametrize(
    "fn,prim",
    [
        (jnp.exp, "exp"),
        (jnp.log, "log"),
        (jnp.log1p, "log1p"),
        (jnp.expm1, "expm1"),
        (lambda x: x**3.5, "pow"),
        (jax.lax.rsqrt, "rsqrt"),
        (jnp.sum, "reduce_sum"),
        (lambda x: jnp.cumsum(x, 0), "cumsum"),
        (jnp.sinh, "sinh"),
        (jnp.square, "square"),
    ],
)
def test_float32_list_on_gpu_passthrough_on_cpu(fn, prim):
    def f(x, w):
        return fn(jnp.abs(x @ w) + 1.0)

    assert last_dtype(f, X, W, primitive=prim, device_type="gpu") == F32
    assert result_dtype(f, X, W, primitive=prim, device_type="cpu") == BF16


def test_integer_powers_keep_the_input_dtype_so_gelu_stays_low():
    f = lambda x, w: jax.nn.gelu(x @ w) ** 2
    for device_type, low in (("gpu", F16), ("cpu", BF16)):
        assert {d[-1] for d in dtypes_of(jamp.autocast(f, device_type=device_type), X, W, primitive="integer_pow")} == {
            low
        }
        assert last_dtype(f, X, W, primitive="tanh", device_type=device_type) == low


def test_scalar_literal_that_does_not_fit_the_low_dtype_promotes():
    f = lambda w, h: (h @ w) * 1e5
    h = jnp.full((4, 4), 1e-3)
    with warnings.catch_warnings():  # deciding that 1e5 overflows float16 is not worth a RuntimeWarning
        warnings.simplefilter("error")
        out = jamp.autocast(f, device_type="gpu")(jnp.eye(4), h)
    np.testing.assert_allclose(out, f(jnp.eye(4), h), rtol=1e-3)
    assert last_dtype(f, jnp.eye(4), h, primitive="mul", device_type="gpu") == F32
    assert last_dtype(lambda w, h: (h @ w) * 2.0, jnp.eye(4), h, primitive="mul", device_type="gpu") == F16


def test_stop_gradient_keeps_softmax_in_the_input_dtype_on_cpu():
    f = lambda x, w: jax.nn.softmax(x @ w)
    assert last_dtype(f, X, W, primitive="exp", device_type="cpu") == BF16


def test_nnx_layernorm_without_a_scope_does_not_overflow_on_gpu():
    from flax import nnx

    norm = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
    x = jnp.array([[-300.0, 300.0, 300.0, 300.0]])
    f = lambda m, x: m(x @ jnp.eye(4))
    np.testing.assert_allclose(jamp.autocast(f, device_type="gpu")(norm, x), f(norm, x), rtol=1e-2, atol=1e-2)


def test_prod_is_float32_on_both_lists():
    f = lambda x, w: jnp.prod(x @ w, axis=0)
    assert last_dtype(f, X, W, primitive="reduce_prod", device_type="gpu") == F32
    assert last_dtype(f, X, W, primitive="reduce_prod", device_type="cpu") == F32


def test_softmax_and_log_softmax_results_are_float32_on_gpu():
    assert out_dtype(lambda x, w: jax.nn.softmax(x @ w), X, W, policy=jamp.get_policy("p=f32,c=f16,o=f16,d=gpu")) == F16
    f = lambda x, w: jax.nn.softmax(x @ w)
    assert last_dtype(f, X, W, primitive="div", device_type="gpu") == F32
    g = lambda x, w: jax.nn.log_softmax(x @ w)
    assert last_dtype(g, X, W, primitive="sub", device_type="gpu") == F32
    assert last_dtype(g, X, W, primitive="sub", device_type="cpu") == F32  # loss building block


def test_elementwise_unlisted_ops_keep_low_precision():
    def f(x, w):
        h = x @ w
        return jnp.tanh(h) * jax.nn.sigmoid(h) + jnp.sqrt(jnp.abs(h))

    ops = {
        e.primitive.name: str(e.outvars[0].aval.dtype)
        for e in eqns(jax.make_jaxpr(jamp.autocast(f, dtype="bf16"))(X, W))
    }
    assert ops["tanh"] == ops["logistic"] == ops["sqrt"] == ops["mul"] == ops["add"] == BF16


def test_relu_and_gelu_keep_low_precision():
    f = lambda x, w: jax.nn.relu(x @ w)
    assert last_dtype(f, X, W, primitive="max", dtype="bf16") == BF16
    g = lambda x, w: jax.nn.gelu(x @ w, approximate=False)
    assert last_dtype(g, X, W, primitive="erfc", dtype="bf16") == BF16


def test_scalar_literals_and_rank0_operands_do_not_promote():
    def f(x, w, s):
        h = x @ w
        return h * 2.0 + 1.0, h * s, h + x

    closed = jax.make_jaxpr(jamp.autocast(f, dtype="bf16", policy="cpu"))(X, W, jnp.float32(3.0))
    muls = [str(e.outvars[0].aval.dtype) for e in eqns(closed) if e.primitive.name == "mul"]
    adds = [str(e.outvars[0].aval.dtype) for e in eqns(closed) if e.primitive.name == "add"]
    assert muls == [BF16, BF16]
    assert adds == [BF16, F32]


def test_float16_with_bfloat16_promotes_to_float32():
    def f(a, b):
        return a + b

    assert dtypes_of(
        jamp.autocast(f, dtype="bf16"), X.astype(jnp.float16), X.astype(jnp.bfloat16), primitive="add"
    ) == [(F32, F32, F32)]


def test_concatenate_promotes_to_widest():
    def f(x, w):
        return jnp.concatenate([x @ w, x])

    assert last_dtype(f, X, W, primitive="concatenate", dtype="bf16") == F32


def test_explicit_user_cast_is_kept():
    def f(x, w):
        return (x @ w).astype(jnp.float32) @ w.astype(jnp.bfloat16).astype(jnp.float32)

    converts = [
        str(e.params["new_dtype"])
        for e in eqns(jax.make_jaxpr(jamp.autocast(f, dtype="f16"))(X, W))
        if e.primitive.name == "convert_element_type"
    ]
    assert "bfloat16" in converts  # the user's bf16 rounding survives
    assert dtypes_of(jamp.autocast(f, dtype="f16"), X, W) == [(F16,) * 3] * 2


@pytest.mark.parametrize(
    "args",
    [
        (jnp.arange(12, dtype=jnp.int32).reshape(3, 4), jnp.ones((4, 2), jnp.int32)),
        (jnp.ones((3, 4), jnp.int8), jnp.ones((4, 2), jnp.int8)),
        (jnp.ones((3, 4), jnp.complex64), jnp.ones((4, 2), jnp.complex64)),
    ],
)
def test_ineligible_inputs_are_never_cast(args):
    recorded = dtypes_of(jnp.matmul, *args)
    assert dtypes_of(jamp.autocast(jnp.matmul, dtype="bf16"), *args) == recorded
    np.testing.assert_array_equal(jamp.autocast(jnp.matmul, dtype="bf16")(*args), jnp.matmul(*args))


def test_bools_ints_and_prng_keys_pass_through():
    def f(key, x, w, n, mask):
        noise = jax.random.normal(key, x.shape)
        h = (x + noise) @ w
        return jnp.where(mask[:, None], h, 0.0).sum() + n.sum(), jax.random.split(key)

    args = (KEY, X, W, jnp.arange(3), jnp.array([True, False, True, True]))
    out, keys = jamp.autocast(f, dtype="bf16")(*args)
    assert out.dtype == jnp.float32 and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)


def test_float64_is_never_cast():
    out = run_subprocess(
        """
        import jax, jax.numpy as jnp, jamp
        from helpers import dtypes_of
        x = jnp.ones((3, 4), jnp.float64); w = jnp.ones((4, 4), jnp.float64)
        f = lambda x, w: jnp.exp(x @ w).sum() + jnp.float64(1e300) * 1e5
        print(dtypes_of(jamp.autocast(f, dtype="bf16"), x, w))
        print(jamp.autocast(f, dtype="bf16")(x, w).dtype, jamp.autocast(f, dtype="bf16")(x, w))
        mixed = lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32) + (x @ w).astype(jnp.float32)
        print(dtypes_of(jamp.autocast(mixed, dtype="bf16"), x, w))
    """,
        devices=1,
        env={"JAX_ENABLE_X64": "1", "PYTHONPATH": "tests"},
    )
    lines = out.strip().splitlines()
    assert lines[0] == "[('float64', 'float64', 'float64')]"
    assert lines[1].startswith("float64 ") and "inf" not in lines[1]
    assert lines[2] == "[('bfloat16', 'bfloat16', 'bfloat16'), ('float64', 'float64', 'float64')]"


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: jnp.linalg.inv(a),
        lambda a: jnp.linalg.solve(a, a[:, :1]),
        lambda a: jnp.linalg.cholesky(a),
        lambda a: jnp.linalg.eigh(a)[0],
        lambda a: jnp.linalg.svd(a)[1],
        lambda a: jnp.linalg.qr(a)[1],
        lambda a: jnp.linalg.det(a),
        lambda a: jnp.linalg.pinv(a),
        lambda a: jnp.fft.rfft(a).real,
        lambda a: jax.scipy.linalg.solve_triangular(a, a[:, :1], lower=True),
    ],
)
@pytest.mark.parametrize("device_type", ["gpu", "cpu"])
def test_linear_algebra_runs_in_float32(fn, device_type):
    a = W @ W.T + 8 * jnp.eye(8)

    def f(x, a):
        spd = x @ x.T + a  # a low-precision activation meets a decomposition
        return fn(spd)

    x = jnp.ones((8, 8)) * 0.1
    closed = jax.make_jaxpr(jamp.autocast(f, device_type=device_type))(x, a)
    linalg_eqns = [
        e
        for e in eqns(closed)
        if e.primitive.name
        in ("lu", "cholesky", "eigh", "svd", "qr", "householder_product", "geqrf", "triangular_solve", "fft")
    ]
    assert linalg_eqns
    assert all(str(v.aval.dtype) in (F32, "complex64") for e in linalg_eqns for v in e.invars)
    result = jamp.autocast(f, device_type=device_type)(x, a)
    np.testing.assert_allclose(result, f(x, a), rtol=0.05, atol=0.05)


def test_cast_cache_casts_a_weight_once():
    def f(w, x):
        return (x @ w) @ w + x @ w.T

    # the rewrite's cache; recompute (on by default) then casts again inside each matmul's checkpoint on purpose
    amp = functools.partial(jamp.autocast, dtype="bf16", recompute=False)
    cached = count(amp(f), W, X, primitive="convert_element_type")
    uncached = count(amp(f, cache_enabled=False), W, X, primitive="convert_element_type")
    assert cached < uncached
    w_casts = lambda fn: sum(
        e.primitive.name in ("convert_element_type", "cast_on_shard") and e.invars[0] is closed.jaxpr.invars[0]
        for closed in [jax.make_jaxpr(fn)(W, X)]
        for e in closed.jaxpr.eqns
    )
    assert w_casts(amp(f)) == 1
    assert w_casts(amp(f, cache_enabled=False)) == 2


@pytest.mark.parametrize("device_type", ["gpu", "cpu"])
def test_numerics_close_to_float32(device_type):
    def mlp(params, x):
        for w, b in params:
            x = jax.nn.gelu(x @ w + b)
        return jax.nn.log_softmax(x).mean()

    keys = jax.random.split(KEY, 3)
    params = [(jax.random.normal(k, (16, 16)) / 4, jnp.zeros(16)) for k in keys]
    x = jax.random.normal(KEY, (8, 16))
    ref, ref_grads = jax.value_and_grad(mlp)(params, x)
    val, grads = jax.value_and_grad(jamp.autocast(mlp, device_type=device_type))(params, x)
    np.testing.assert_allclose(val, ref, rtol=2e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == r.dtype == jnp.float32
        np.testing.assert_allclose(g, r, atol=3e-2 * float(jnp.abs(r).max()) + 1e-6)
