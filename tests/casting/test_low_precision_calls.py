"""jamp.lower_precision: kernels that need low-precision inputs get them under autocast, as written outside.

Two stand-ins for such kernels: one that refuses float32 while it is traced (as cuDNN attention does) and
a Pallas interpret-mode kernel (with a custom_vjp, as Pallas attention kernels have) that asserts its
inputs are bfloat16. Each runs forward and backward under the forms autocast composes with.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import eqns
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import jamp

F32, BF16, F16 = "float32", "bfloat16", "float16"
W = jax.random.normal(jax.random.key(0), (8, 8)) * 0.3
X = jax.random.normal(jax.random.key(1), (4, 8))
TRACED = []  # the input dtypes each stand-in kernel was traced with


def _refusing_math(a, b, *, scale):
    return jnp.tanh(a * scale) @ b


@jamp.lower_precision
def refuses_float32(a, b, *, scale):
    """Refuses float32 while it is traced, as jax.nn.dot_product_attention(implementation="cudnn") does."""
    TRACED.append((str(a.dtype), str(b.dtype)))
    if a.dtype == jnp.float32 or b.dtype == jnp.float32:
        raise NotImplementedError(f"refuses_float32 takes float16/bfloat16, got {a.dtype}")
    return _refusing_math(a, b, scale=scale)


def _pallas_mul(a, b):
    def kernel(a_ref, b_ref, o_ref):
        TRACED.append((str(a_ref.dtype), str(b_ref.dtype)))
        assert a_ref.dtype == b_ref.dtype == jnp.bfloat16, (a_ref.dtype, b_ref.dtype)
        o_ref[...] = a_ref[...] * b_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), interpret=True)(a, b)


@jax.custom_vjp
def _pallas_product(a, b):
    return _pallas_mul(a, b)


_pallas_product.defvjp(
    lambda a, b: (_pallas_mul(a, b), (a, b)), lambda res, g: (_pallas_mul(g, res[1]), _pallas_mul(g, res[0]))
)
pallas_product = jamp.lower_precision(_pallas_product)  # a bfloat16 Pallas kernel and its backward kernel

# (the layer with the kernel, the same layer in float32 without it)
LAYERS = {
    "refuses_float32": (
        lambda w, x: refuses_float32(x @ w, w, scale=0.5),
        lambda w, x: _refusing_math(x @ w, w, scale=0.5),
    ),
    "pallas": (lambda w, x: pallas_product(x @ w, x), lambda w, x: (x @ w) * x),
}


def _scan_layers(layer):
    def model(w, x):
        return jax.lax.scan(lambda h, wi: (layer(wi, h), None), x, jnp.stack([w, 0.5 * w]))[0]

    return model


def _shard_mapped(layer):
    mesh = jax.make_mesh((1,), ("d",))
    # Pallas kernels in shard_map need check_vma=False (or a manual_axis_type on their out_shape)
    return jax.shard_map(layer, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


# form -> model built from a layer; every form is traced by the autocast that wraps it
FORMS = {
    "plain": lambda layer: layer,
    "jit": jax.jit,
    "vmap": lambda layer: lambda w, x: jax.vmap(layer, in_axes=(None, 0))(w, x[:, None])[:, 0],
    "remat": jax.checkpoint,
    "scan": _scan_layers,
    "shard_map": _shard_mapped,
}


def _kernel_dtypes(closed, primitives=("tanh", "pallas_call")) -> list:
    """The input dtypes of the equations only the kernels have, in the whole program."""
    return sorted({str(v.aval.dtype) for e in eqns(closed) if e.primitive.name in primitives for v in e.invars})


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kernel", LAYERS)
def test_kernel_runs_in_bfloat16_forward_and_backward(kernel, form):
    layer, reference = (FORMS[form](f) for f in LAYERS[kernel])
    step = jax.value_and_grad(jamp.autocast(lambda w, x: jnp.square(layer(w, x)).sum(), dtype="bf16"), argnums=(0, 1))
    ref_step = jax.value_and_grad(lambda w, x: jnp.square(reference(w, x)).sum(), argnums=(0, 1))
    TRACED.clear()
    (value, grads), (ref_value, ref_grads) = (jax.jit(f)(W, X) for f in (step, ref_step))
    np.testing.assert_allclose(value, ref_value, rtol=0.05)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, r, rtol=0.05, atol=0.1 * float(jnp.abs(r).max()))
    # forward and backward, with every matmul (the kernel's, its transposes, the model's)
    assert _kernel_dtypes(jax.make_jaxpr(step)(W, X), ("tanh", "pallas_call", "dot_general")) == [BF16]
    assert set(TRACED) <= {(BF16, BF16)}  # never float32 (traces are cached across tests)


@pytest.mark.parametrize("kernel", LAYERS)
def test_grad_inside_the_autocast_function(kernel):
    """jax.grad inside: the recorded call is differentiated by JAX, and runs as recorded (bfloat16)."""
    layer, reference = LAYERS[kernel]
    grad_fn = jamp.autocast(jax.grad(lambda w, x: layer(w, x).sum()), dtype="bf16")
    ref = jax.grad(lambda w, x: reference(w, x).sum())(W, X)
    np.testing.assert_allclose(grad_fn(W, X), ref, rtol=0.05, atol=0.1 * float(jnp.abs(ref).max()))
    assert _kernel_dtypes(jax.make_jaxpr(grad_fn)(W, X)) == [BF16]


@pytest.mark.parametrize("kernel,error", [("refuses_float32", NotImplementedError), ("pallas", AssertionError)])
def test_outside_autocast_the_kernel_runs_as_written(kernel, error):
    layer, _ = LAYERS[kernel]
    with pytest.raises(error):
        layer(W, X)
    with pytest.raises(error):
        jax.jit(layer)(W, X)
    assert jax.make_jaxpr(layer)(W.astype(jnp.bfloat16), X.astype(jnp.bfloat16)) is not None


@jamp.lower_precision
def accepts_any(a, b):
    """A kernel that runs in any dtype: the dtypes it is traced with show what the region decided."""
    return jnp.tanh(a) @ b


def _region(mode_block, kernel=accepts_any):
    def model(w, x):
        h = x @ w
        with mode_block():
            return kernel(h, w)

    return model


@pytest.mark.parametrize(
    "block,expected",
    [
        (lambda: jamp.autocast(enabled=False), F32),
        (lambda: jamp.autocast(dtype=jnp.float16), F16),
    ],
)
def test_nested_region_decides_the_dtype(block, expected):
    closed = jax.make_jaxpr(jamp.autocast(_region(block), dtype="bf16"))(W, X)
    assert _kernel_dtypes(closed) == [expected]


@pytest.mark.parametrize(
    "block,expected",
    [
        (lambda: jamp.autocast(enabled=False), F32),
        (lambda: jamp.autocast(dtype=jnp.float16), F16),
    ],
)
def test_nested_region_with_grad_inside(block, expected):
    """Under jax.grad inside the autocast function JAX differentiates the recorded body, which runs as
    recorded: the trace already read the region off the name stack."""
    grad_fn = jamp.autocast(jax.grad(lambda w, x: _region(block)(w, x).sum()), dtype="bf16")
    assert _kernel_dtypes(jax.make_jaxpr(grad_fn)(W, X)) == [expected]


def test_off_region_behind_a_jit_is_seen_by_the_interpreter():
    """The trace cannot see a region outside a jitted function (JAX starts a new name stack there); the
    interpreter, tracing the kernel again with the whole path known, runs it as written."""

    def model(w, x):
        h = x @ w
        with jamp.autocast(enabled=False):
            return jax.jit(accepts_any)(h, w)

    assert _kernel_dtypes(jax.make_jaxpr(jamp.autocast(model, dtype="bf16"))(W, X)) == [F32]


def test_refusing_kernel_in_an_off_region_raises_as_written():
    with pytest.raises(NotImplementedError):
        jamp.autocast(
            _region(lambda: jamp.autocast(enabled=False), functools.partial(refuses_float32, scale=0.5)), dtype="bf16"
        )(W, X)


def test_policy_region_rules_name_the_call():
    """The recorded call is a jit named after the function: a float32 region rule keeps it in float32."""
    policy = jamp.get_policy("cpu").with_rules({"accepts_any": "float32"})
    closed = jax.make_jaxpr(jamp.autocast(lambda w, x: accepts_any(x @ w, w), policy=policy))(W, X)
    assert _kernel_dtypes(closed) == [F32]
    calls = [[str(v.aval.dtype) for v in e.invars] for e in eqns(closed) if e.params.get("name") == "accepts_any"]
    assert calls == [[F32, F32]]  # the function traced on float32, not its bfloat16 recording cast up


def test_fp8_policy_gives_the_kernel_its_compute_dtype():
    closed = jax.make_jaxpr(jamp.autocast(accepts_any, policy="fp8"))(X, W)
    assert _kernel_dtypes(closed) == [BF16]


def test_outputs_keep_the_declared_dtype_and_the_kernel_is_traced_once_per_layer_type():
    TRACED.clear()

    def model(w, x):
        for _ in range(4):
            x = refuses_float32(x, w, scale=0.5)
        return x

    amp = jamp.autocast(model, dtype="bf16")
    x = X[:2]  # a shape no other test traces the kernel with
    assert amp(W, x).dtype == jnp.float32
    assert jax.make_jaxpr(amp)(W, x).out_avals[0].dtype == jnp.float32
    assert len(TRACED) == 2  # the recorded trace and the interpreter's, shared by the four layers


@pytest.mark.parametrize(
    "wrap",
    [
        jamp.lower_precision,
        lambda f: jamp.custom_fwd(f, cast_inputs=jnp.float16),
    ],
)
def test_a_jitted_function_traced_under_autocast_runs_as_written_outside(wrap):
    """JAX caches the trace of a jitted function; traced inside an autocast (with jamp's casts in it),
    it must not be reused outside, where the function runs as written."""
    kernel = wrap(lambda a, b: jnp.tanh(a) @ b)
    block = jax.jit(lambda w, x: kernel(x @ w, w))
    jamp.autocast(block, dtype="bf16")(W, X)
    outside = jax.make_jaxpr(block)(W, X)
    assert {str(v.aval.dtype) for e in eqns(outside) for v in e.outvars} == {F32}
    assert block(W, X).dtype == jnp.float32


def test_only_floating_arrays_are_cast_and_other_arguments_are_static():
    @jamp.lower_precision
    def kernel(a, index, key, wide, config):
        assert isinstance(config["scale"], float)  # static, even an unhashable pytree leaf beside it
        assert (a.dtype, index.dtype, wide.dtype) == (jnp.bfloat16, jnp.int32, jnp.float64)
        noise = jax.random.uniform(key, a.shape, a.dtype)
        return a[index] * config["scale"] + len(config["tags"]) + 0 * noise[index] + wide.astype(a.dtype)

    with jax.enable_x64(True):
        wide = jnp.ones((), jnp.float64)
        fn = lambda x, key: kernel(
            x,
            jnp.arange(2, dtype=jnp.int32),
            key,
            wide,
            {"scale": 0.5, "tags": {"a", "b"}},
        )
        out = jamp.autocast(fn, dtype="bf16")(X, jax.random.key(0))
    np.testing.assert_allclose(out, X[:2] * 0.5 + 3, rtol=1e-2)


def test_lower_precision_requires_a_callable():
    with pytest.raises(TypeError, match="lower_precision requires a callable"):
        jamp.lower_precision(3)


def test_wrapper_keeps_the_function_name_and_doc():
    assert refuses_float32.__name__ == "refuses_float32" and "Refuses float32" in refuses_float32.__doc__
    assert jamp.nn.dot_product_attention.__name__ == "dot_product_attention"
