"""Float8 matmuls with per-tensor current scaling: what an eligible ``dot_general`` runs as under a
policy with ``fp8`` on.

Each operand is multiplied by a power of two chosen from its own absolute maximum (*current* scaling:
no amax history, so the matmul stays a pure function and needs no state in the parameters or the
optimizer), cast to float8, multiplied with float32 accumulation, and rescaled. Forward operands use
float8_e4m3fn (more precision), the backward pass's incoming cotangent float8_e5m2 (more range, for
the heavy tails of gradients). A ``jax.custom_vjp`` makes the backward matmuls float8 as well and
keeps float8 residuals (1 byte per element).

Scales are powers of two: multiplying by one is exact, so the only rounding is the float8 cast itself,
the rescale is exact too, and the scaled absolute maximum never exceeds the format's maximum. A loss
scale that is a power of two therefore cancels exactly in the cotangent's cast.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp._floats import exact_pow2
from jamp.casting import rounding

# cuBLASLt's float8 GEMM needs the contracting and the free extents in multiples of 16 bytes (16 float8
# elements); other shapes stay in the compute dtype rather than being padded.
ALIGNMENT = 16
# Scales lie in [2**-63, 2**63]: the product of two scales and its inverse are then normal float32.
MAX_EXPONENT = 63


class Format(NamedTuple):
    """A float8 format and what it carries."""

    dtype: np.dtype
    role: str

    @property
    def max(self) -> float:
        return float(jnp.finfo(self.dtype).max)


FORWARD = Format(np.dtype(jnp.float8_e4m3fn), "forward operands (activations and weights)")
BACKWARD = Format(np.dtype(jnp.float8_e5m2), "the incoming cotangent of the backward matmuls")
FORMATS = (FORWARD, BACKWARD)


def eligible(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dimension_numbers) -> bool:
    """A GEMM without batch dimensions whose contracted extent (K) and free extents (M, N), each the
    product of its dimensions, are positive multiples of :data:`ALIGNMENT`."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_batch or rhs_batch or not lhs_contract:
        return False
    k = math.prod(lhs_shape[d] for d in lhs_contract)
    m = math.prod(s for d, s in enumerate(lhs_shape) if d not in lhs_contract)
    n = math.prod(s for d, s in enumerate(rhs_shape) if d not in rhs_contract)
    return all(size > 0 and size % ALIGNMENT == 0 for size in (k, m, n))


def quantize(x: jax.Array, fmt: Format) -> tuple[jax.Array, jax.Array]:
    """``(x * 2**e)`` in ``fmt`` and ``2**-e`` (float32), with the largest ``e`` that keeps the absolute
    maximum within the format. An all-zero ``x`` gets ``e = 0``; an ``x`` holding inf or NaN becomes all
    NaN with a NaN inverse scale, so the product is NaN, never finite garbage, and a loss scaler skips
    the step."""
    x32 = rounding.to_float32(x)  # the numbers a float16/bfloat16 x holds, as x's other consumers see them
    amax = jnp.max(jnp.abs(x32))
    mantissa, exponent = jnp.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    max_mantissa, max_exponent = np.frexp(fmt.max)  # e4m3fn: 448 = 0.875 * 2**9
    e = max_exponent - exponent - (mantissa > max_mantissa).astype(jnp.int32)
    e = jnp.clip(jnp.where(amax > 0, e, 0), -MAX_EXPONENT, MAX_EXPONENT)
    finite = jnp.isfinite(amax)
    scale = jnp.where(finite, exact_pow2(e), jnp.nan)
    inverse = jnp.where(finite, exact_pow2(-e), jnp.nan)
    # The clip saturates only where the exponent was clamped; an e4m3fn cast of a larger finite value is NaN.
    return jnp.clip(x32 * scale, -fmt.max, fmt.max).astype(fmt.dtype), inverse


class _Static(NamedTuple):
    dimension_numbers: tuple
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, out_dtype) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` in float8 with current scaling, returned in
    ``out_dtype``; its gradients come back in the dtypes of ``lhs`` and ``rhs``. The shapes must be
    :func:`eligible`."""
    (lhs_contract, rhs_contract), batch = dimension_numbers
    dims = ((tuple(lhs_contract), tuple(rhs_contract)), tuple(map(tuple, batch)))
    if not eligible(lhs.shape, rhs.shape, dims):
        raise ValueError(
            f"fp8 dot_general: shapes {lhs.shape} x {rhs.shape} with dimension_numbers={dims} are "
            f"not a batch-free GEMM with extents in multiples of {ALIGNMENT}"
        )
    return _dot(lhs, rhs, _Static(dims, np.dtype(out_dtype), np.dtype(lhs.dtype), np.dtype(rhs.dtype)))


def _scaled_dot(a8: jax.Array, b8: jax.Array, dimension_numbers, inverse: jax.Array) -> jax.Array:
    return lax.dot_general(a8, b8, dimension_numbers, preferred_element_type=jnp.float32) * inverse


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dot(lhs, rhs, static: _Static):
    return _dot_fwd(lhs, rhs, static)[0]


def _dot_fwd(lhs, rhs, static: _Static):
    lhs8, lhs_inv = quantize(lhs, FORWARD)
    rhs8, rhs_inv = quantize(rhs, FORWARD)
    out = _scaled_dot(lhs8, rhs8, static.dimension_numbers, lhs_inv * rhs_inv)
    return out.astype(static.out_dtype), (lhs8, lhs_inv, rhs8, rhs_inv)


def _dot_bwd(static: _Static, residuals, g):
    """dlhs = g . rhs and drhs = lhs . g over the free dimensions, then transposed back into the
    operands' dimension order (lax.dot_general puts the result's dimensions in its own order)."""
    lhs8, lhs_inv, rhs8, rhs_inv = residuals
    g8, g_inv = quantize(g, BACKWARD)
    (lhs_contract, rhs_contract), _ = static.dimension_numbers
    lhs_free = [d for d in range(lhs8.ndim) if d not in lhs_contract]
    rhs_free = [d for d in range(rhs8.ndim) if d not in rhs_contract]
    g_lhs = tuple(range(len(lhs_free)))  # g's dimensions: lhs free, then rhs free
    g_rhs = tuple(range(len(lhs_free), len(lhs_free) + len(rhs_free)))

    # g . rhs: dimensions (lhs free..., rhs contracting in ascending order)
    dlhs = _scaled_dot(g8, rhs8, ((g_rhs, tuple(rhs_free)), ((), ())), g_inv * rhs_inv)
    rhs_contract_sorted = sorted(rhs_contract)
    lhs_axis = {d: i for i, d in enumerate(lhs_free)}
    lhs_axis.update({d: len(lhs_free) + rhs_contract_sorted.index(r) for d, r in zip(lhs_contract, rhs_contract)})
    dlhs = lax.transpose(dlhs, tuple(lhs_axis[d] for d in range(lhs8.ndim)))

    # lhs . g: dimensions (lhs contracting in ascending order, rhs free...)
    drhs = _scaled_dot(lhs8, g8, ((tuple(lhs_free), g_lhs), ((), ())), lhs_inv * g_inv)
    lhs_contract_sorted = sorted(lhs_contract)
    rhs_axis = {d: len(lhs_contract) + i for i, d in enumerate(rhs_free)}
    rhs_axis.update({r: lhs_contract_sorted.index(d) for d, r in zip(lhs_contract, rhs_contract)})
    drhs = lax.transpose(drhs, tuple(rhs_axis[d] for d in range(rhs8.ndim)))
    return dlhs.astype(static.lhs_dtype), drhs.astype(static.rhs_dtype)


_dot.defvjp(_dot_fwd, _dot_bwd)
