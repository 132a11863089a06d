"""Autocast reads float16/bfloat16 values into float32 ops with their rounding explicit
(jamp.casting.rounding), so that XLA's excess precision cannot show one consumer another number."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_flags import as_users
from jax.extend import core as jcore

import jamp
from jamp.casting import rounding

LOW_DTYPES = (jnp.bfloat16, jnp.float16)
POLICIES = {
    "cpu": {"device_type": "cpu"},
    "gpu": {"device_type": "gpu"},
    "gpu-bfloat16": {"device_type": "gpu", "dtype": jnp.bfloat16},
}


def _jaxprs(closed):
    """The jaxpr and every sub-jaxpr in it."""
    jaxpr = getattr(closed, "jaxpr", closed)
    yield jaxpr
    for e in jaxpr.eqns:
        for sub in jcore.jaxprs_in_params(e.params):
            yield from _jaxprs(sub)


def _widening_reads(closed) -> list[tuple]:
    """(low dtype, [(primitive, params, the readers of its result)] for each reader of the float32 result)
    of every float16/bfloat16 -> float32 convert_element_type."""
    reads = []
    for jaxpr in _jaxprs(closed):
        readers: dict = {}
        for e in jaxpr.eqns:
            for v in e.invars:
                if isinstance(v, jcore.Var):
                    readers.setdefault(v, []).append(e)
        for e in jaxpr.eqns:
            if (
                e.primitive.name == "convert_element_type"
                and e.invars[0].aval.dtype in LOW_DTYPES
                and e.outvars[0].aval.dtype == jnp.float32
            ):
                reads.append(
                    (
                        e.invars[0].aval.dtype,
                        [
                            (r.primitive.name, r.params, readers.get(r.outvars[0], []))
                            for r in readers.get(e.outvars[0], [])
                        ],
                    )
                )
    return reads


def _rounds_back(readers: list, dtype) -> bool:
    """Only converted back to ``dtype``: the same number whether XLA kept the value's rounding or not."""
    return bool(readers) and all(
        r.primitive.name == "convert_element_type" and r.params["new_dtype"] == dtype for r in readers
    )


class _Block(nn.Module):
    """LayerNorm (float32 regions), attention, a biased gelu MLP, a residual: many float32 reads."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(4)(h, h)
        return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_float32_read_of_a_low_precision_value_rounds_explicitly(policy):
    """In the rewritten program each conversion of a float16/bfloat16 value to float32 is read only through
    reduce_precision to that dtype's ROUNDING_BITS, or by a broadcast that is rounded back to the dtype
    (a broadcast autocast runs in float32 so that its transpose sums in float32)."""
    block = _Block()
    x = jnp.ones((2, 16, 32))
    params = block.init(jax.random.key(0), x)

    def loss(params, x, labels):
        return optax.softmax_cross_entropy_with_integer_labels(block.apply(params, x), labels).mean()

    closed = jax.make_jaxpr(jamp.autocast(loss, **POLICIES[policy]))(params, x, jnp.zeros((2, 16), jnp.int32))
    reads = _widening_reads(closed)
    rounded = [
        dtype
        for dtype, readers in reads
        if [(name, params.get("exponent_bits"), params.get("mantissa_bits")) for name, params, _ in readers]
        == [("reduce_precision", *rounding.ROUNDING_BITS[np.dtype(dtype)])]
    ]
    broadcast_back = [
        dtype
        for dtype, readers in reads
        if all(name == "broadcast_in_dim" and _rounds_back(after, dtype) for name, _, after in readers)
    ]
    assert len(rounded) >= 3  # the residual add before the second LayerNorm, the softmax or logits, the loss
    assert len(rounded) + len(broadcast_back) == len(reads), reads


def test_the_rounding_survives_xla_under_default_flags():
    """XLA keeps the reduce_precision in the optimized program (it is no no-op on float32)."""
    x, w = jnp.ones((64, 32)), jnp.ones((32, 10))
    f = jamp.autocast(lambda w, x, y: optax.softmax_cross_entropy_with_integer_labels(x @ w, y), device_type="cpu")
    hlo = jax.jit(f).lower(w, x, jnp.zeros(64, jnp.int32)).compile(as_users()).as_text()
    assert "reduce-precision(" in hlo


def _every_number(dtype) -> np.ndarray:
    return np.arange(2**16, dtype=np.uint16).view(dtype)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_reading_changes_no_low_precision_number(dtype):
    """All 65536 bit patterns, subnormals, infinities and NaNs included, read as the conversion reads them."""
    numbers = _every_number(dtype)
    read = np.asarray(jax.jit(lambda x: rounding.widen(x, jnp.float32))(numbers))
    expected = numbers.astype(np.float32)
    assert read.dtype == np.float32
    np.testing.assert_array_equal(read, expected)  # NaN positions must match too


def _float32_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.concatenate(
        [rng.standard_normal(20000).astype(np.float32) * scale for scale in (1e-30, 1e-6, 1e-4, 1.0, 1e3, 6e4, 1e30)]
    )


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_where_xla_drops_a_rounding_the_read_rounds_as_the_conversion(dtype):
    """What a read gives when XLA hands it the unrounded float32 value: bfloat16's own rounding everywhere;
    float16's within float16's normal range (see ROUNDING_BITS for the rest)."""
    y = _float32_values()
    read = np.asarray(jax.jit(lambda v: jax.lax.reduce_precision(v, *rounding.ROUNDING_BITS[np.dtype(dtype)]))(y))
    with np.errstate(over="ignore"):
        converted = y.astype(dtype).astype(np.float32)
    normal = np.abs(y) >= jnp.finfo(dtype).smallest_normal
    if dtype == jnp.float16:
        normal &= np.abs(y) <= jnp.finfo(dtype).max
    np.testing.assert_array_equal(read[normal], converted[normal])


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_reading_keeps_derivatives(dtype):
    """The tangent passes unchanged; the cotangent, converted back to the low dtype, is the one the plain
    conversion gives (float16: for cotangents of float16's normal range)."""
    x = jnp.asarray(_every_number(dtype)[:30000:7])
    x = x[jnp.isfinite(x)]
    tangent = jnp.asarray(_every_number(dtype)[30000::7][: x.size])
    _, out_tangent = jax.jvp(lambda v: rounding.widen(v, jnp.float32), (x,), (tangent,))
    np.testing.assert_array_equal(np.asarray(out_tangent), np.asarray(tangent, np.float32))

    cotangent = jnp.asarray(_float32_values()[: x.size])
    (read,) = jax.vjp(lambda v: rounding.widen(v, jnp.float32), x)[1](cotangent)
    (plain,) = jax.vjp(lambda v: v.astype(jnp.float32), x)[1](cotangent)
    assert read.dtype == plain.dtype == dtype
    normal = np.abs(np.asarray(cotangent)) >= jnp.finfo(dtype).smallest_normal
    np.testing.assert_array_equal(np.asarray(read, np.float32)[normal], np.asarray(plain, np.float32)[normal])
