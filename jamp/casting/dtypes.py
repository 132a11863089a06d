"""Which dtypes autocast touches, and how dtype arguments are spelled."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

LOW_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
FLOAT32 = np.dtype(jnp.float32)
# Only these are ever cast: float64, integers, bools, complex and PRNG keys never are.
ELIGIBLE_DTYPES = (*LOW_DTYPES, FLOAT32)

DTYPE_NAMES = {
    "float16": jnp.float16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
    "half": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float32": jnp.float32,
    "f32": jnp.float32,
    "fp32": jnp.float32,
    "full": jnp.float32,
}


def is_eligible(dtype) -> bool:
    """True for float16/bfloat16/float32 (extended dtypes such as PRNG keys compare unequal)."""
    return any(dtype == d for d in ELIGIBLE_DTYPES)


def is_low(dtype) -> bool:
    return any(dtype == d for d in LOW_DTYPES)


def parse_dtype(value: Any, argname: str, allowed=LOW_DTYPES) -> np.dtype:
    """A dtype object or name -> numpy dtype; anything outside ``allowed`` is a ValueError naming ``argname``."""
    allowed_names = ", ".join(sorted({str(np.dtype(a)) for a in allowed}))
    try:
        dtype = np.dtype(DTYPE_NAMES.get(value, value) if isinstance(value, str) else value)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in allowed:
        raise ValueError(
            f"{argname}={value!r} is not supported; allowed: {allowed_names} "
            f"(dtype objects or the strings {sorted(k for k, v in DTYPE_NAMES.items() if np.dtype(v) in allowed)})"
        )
    return dtype


def widest(dtypes) -> np.dtype:
    """Promotion among floats the torch way: any f32 wins, f16 with bf16 gives f32, f64 beats all."""
    dtypes = {np.dtype(d) for d in dtypes}
    if len(dtypes) == 1:
        return dtypes.pop()
    if np.dtype(np.float64) in dtypes:
        return np.dtype(np.float64)
    return FLOAT32


def checked_reduce_dtype(value: Any, compute_dtype: Any = None) -> np.dtype:
    """``reduce_dtype`` as a numpy dtype: float32 or the compute dtype (when given); a ValueError that names the
    argument and what is allowed otherwise."""
    dtype = parse_dtype(value, "reduce_dtype", ELIGIBLE_DTYPES)
    if compute_dtype is not None and dtype not in (FLOAT32, np.dtype(compute_dtype)):
        raise ValueError(
            f"reduce_dtype={dtype.name} with the compute dtype {np.dtype(compute_dtype).name}: gradients are reduced "
            f"in float32 (the default) or in the compute dtype ({np.dtype(compute_dtype).name})"
        )
    return dtype
