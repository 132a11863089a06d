"""Every jamp.nn entry point under every policy, forward and backward, runs on this CPU and lowers for
CUDA and TPU (issue 36, point 3).

``jax.nn.dot_product_attention`` asks for its float16 logits with ``precision=F16_F16_F32``, which JAX's
lowering for CPU refuses (even for plain ``jax.jit(jax.nn.dot_product_attention)`` on float16 arrays).
jamp binds such a dot through :mod:`jamp.casting.portable_dots`: on a platform that refuses its algorithm
it runs a form the platform accepts, chosen when the program is lowered, so the program lowered for CUDA
(or TPU, which lowers from any host) keeps the algorithm JAX asked for.
"""

import functools
import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_flags import as_users
from flax import nnx

import jamp
from jamp import _jax_compat as jc
from jamp.casting import portable_dots


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """These tests state what XLA:CPU refuses and accepts: they run on the CPU whatever the default backend is."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


F16_F16_F32 = jax.lax.DotAlgorithmPreset.F16_F16_F32
FEATURES = 16

# policy -> (autocast options, the operand type of the algorithm JAX asks for the logits). "none": outside
# autocast, on a float16 model.
POLICIES = {
    "gpu": ({"device_type": "gpu"}, "f16"),
    "gpu-bf16": ({"device_type": "gpu", "dtype": "bf16"}, "bf16"),
    "cpu": ({"device_type": "cpu"}, "bf16"),
    "tpu": ({"device_type": "tpu"}, "bf16"),
    "fp8": ({"policy": "fp8"}, "bf16"),
    "none": (None, "f16"),
}


def _input(shape, dtype):
    return jax.random.normal(jax.random.key(0), shape).astype(dtype)


def _jax_nn(dtype):
    return (lambda x: jamp.nn.dot_product_attention(x, x, x, is_causal=True)), _input((2, 8, 2, 8), dtype)


def _linen(dtype):
    x = _input((2, 8, FEATURES), dtype)
    module = nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=FEATURES, dtype=dtype, attention_fn=jamp.nn.flax_dot_product_attention
    )
    params = jax.tree.map(lambda p: p.astype(dtype), module.init(jax.random.key(1), x, x))
    return (lambda x: module.apply(params, x, x)), x


def _nnx(dtype):
    module = nnx.MultiHeadAttention(
        num_heads=2,
        in_features=FEATURES,
        decode=False,
        dtype=dtype,
        attention_fn=jamp.nn.flax_dot_product_attention,
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(module)
    state = jax.tree.map(lambda p: p.astype(dtype), state)
    return (lambda x: nnx.merge(graphdef, state)(x)), _input((2, 8, FEATURES), dtype)


def _equinox(dtype):
    mha = jax.tree.map(
        lambda p: p.astype(dtype) if eqx.is_inexact_array(p) else p,
        eqx.nn.MultiheadAttention(num_heads=2, query_size=FEATURES, key=jax.random.key(1)),
    )
    mask = jnp.tril(jnp.ones((8, 8), bool))
    return (lambda x: jamp.nn.equinox_multihead_attention(mha, x, x, x, mask)), _input((8, FEATURES), dtype)


ENTRY_POINTS = {"dot_product_attention": _jax_nn, "flax linen": _linen, "flax nnx": _nnx, "equinox": _equinox}


@functools.cache
def _float32_loss(entry: str) -> float:
    attention, x = ENTRY_POINTS[entry](jnp.float32)
    return float(jax.jit(lambda x: jnp.sum(jnp.square(attention(x))))(x))


def _algorithms(lowered) -> list[str]:
    """The operand type of every dot algorithm in a lowered program ('f16' for F16_F16_F32)."""
    return re.findall(r"algorithm = <lhs_precision_type = (\w+),", lowered.as_text())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_point_runs_on_cpu_and_keeps_the_algorithm_for_cuda_and_tpu(entry, policy):
    options, algorithm = POLICIES[policy]
    attention, x = ENTRY_POINTS[entry](jnp.float32 if options else jnp.float16)
    loss = lambda x: jnp.sum(jnp.square(attention(x).astype(jnp.float32)))
    if options:
        loss = jamp.autocast(loss, **options)
    step = jax.jit(jax.value_and_grad(loss)).trace(x)  # forward and backward in one program
    value, grad = step.lower().compile(as_users())(x)
    assert np.isfinite(value) and np.all(np.isfinite(grad)) and grad.dtype == x.dtype
    # the attention computed the right numbers: its float32 loss, within the compute dtype's rounding
    np.testing.assert_allclose(value, _float32_loss(entry), rtol=0.05)
    for platform in ("cuda", "tpu"):
        kept = _algorithms(step.lower(lowering_platforms=(platform,)))
        assert kept and set(kept) == {algorithm}, platform  # the logits, forward and backward
    assert "f16" not in _algorithms(step.lower())  # CPU: the form it accepts


def test_plain_jax_refuses_float16_attention_on_cpu():
    """Why: JAX's own attention, jitted on float16 arrays, does not lower for a CPU (its fallback catches
    errors while tracing; the CPU check comes when lowering). If this starts passing, JAX fixed it."""
    q = _input((2, 8, 2, 8), jnp.float16)
    with pytest.raises(ValueError, match="F16_F16_F32' is not supported by dot_general on CPU"):
        jax.jit(jax.nn.dot_product_attention)(q, q, q)
    assert jc.platforms_refusing(F16_F16_F32, jnp.float16, jnp.float16, jnp.float32) == ("cpu",)
    assert jc.platforms_refusing(jax.lax.DotAlgorithmPreset.BF16_BF16_F32, jnp.bfloat16, jnp.bfloat16, None) == ()


USER_DOTS = {
    "preset": lambda a, b: jax.lax.dot(a, b, precision=F16_F16_F32, preferred_element_type=jnp.float32),
    "preset, float16 result": lambda a, b: jax.lax.dot(
        a.astype(jnp.float16), b.astype(jnp.float16), precision=F16_F16_F32
    ),
    "algorithm": lambda a, b: jax.lax.dot(
        a, b, precision=jax.lax.DotAlgorithm(jnp.float16, jnp.float16, jnp.float32), preferred_element_type=jnp.float32
    ),
    "ragged": lambda a, b: jax.lax.ragged_dot(
        a, jnp.stack([b, b]), jnp.array([3, 5], jnp.int32), precision=F16_F16_F32, preferred_element_type=jnp.float32
    ),
}


@pytest.mark.parametrize("policy", ["gpu", "cpu"])
@pytest.mark.parametrize("dot", USER_DOTS)
def test_user_code_under_autocast_that_names_a_refused_algorithm(dot, policy):
    """A dot the user's code binds with an algorithm JAX's CPU lowering refuses: outside jamp it fails on
    a CPU; under autocast it runs (forward and backward), with the algorithm kept for CUDA."""
    a, b = _input((8, 16), jnp.float32), _input((16, 4), jnp.float32) + 1
    loss = lambda a, b: jnp.sum(USER_DOTS[dot](a, b).astype(jnp.float32) ** 2)
    with pytest.raises(ValueError, match="not supported by dot_general on CPU"):
        jax.jit(loss)(a, b)
    step = jax.jit(jax.value_and_grad(jamp.autocast(loss, **POLICIES[policy][0]), argnums=(0, 1))).trace(a, b)
    value, grads = step.lower().compile(as_users())(a, b)
    np.testing.assert_allclose(value, jnp.sum((a @ b) ** 2), rtol=0.02)  # each ragged group multiplies by b
    assert all(np.all(np.isfinite(g)) for g in grads)
    if dot != "ragged":
        assert _algorithms(step.lower(lowering_platforms=("cuda",))) == ["f16"] * 3


def test_portable_form_is_the_algorithm_meaning():
    """On the CPU: float16 operands, a float32 accumulator (the products of float16 numbers are exact in
    float32), the dtype the dot returns."""
    a, b = _input((4, 64), jnp.float16), _input((64, 4), jnp.float16)
    dims = (((1,), (0,)), ((), ()))
    for preferred, out_dtype in ((jnp.float32, jnp.float32), (None, jnp.float16)):
        dot = lambda a, b: jax.lax.dot_general(a, b, dims, precision=F16_F16_F32, preferred_element_type=preferred)
        (eqn,) = jax.make_jaxpr(dot)(a, b).eqns
        out = jax.jit(lambda a, b: portable_dots.bind(eqn.primitive, [a, b], eqn.params))(a, b)
        exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
        assert out.dtype == out_dtype
        np.testing.assert_allclose(out, exact.astype(out_dtype), rtol=1e-6 if preferred else 1e-3)
