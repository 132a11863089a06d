"""A dot that names its algorithm, bound so that every platform runs it.

``lax.dot_general(..., precision=lax.DotAlgorithmPreset.F16_F16_F32)`` asks for float16 operands and a
float32 accumulator, and a platform may refuse the algorithm: JAX's lowering for CPU accepts only a few
(not F16_F16_F32), and XLA refuses others when it compiles (JAX notes that a TPU refuses F16_F16_F32, some
GPUs BF16_BF16_F32). ``jax.nn.dot_product_attention`` names one for its logits on float16/bfloat16 inputs,
so the float16 attention a float32 model gets under autocast (or a float16 model, jitted) would not run on
a CPU.

Every matmul jamp binds goes through :func:`bind` (:meth:`jamp.casting.call.Call.bind_with`,
:mod:`jamp.casting.float32_output`). A dot whose algorithm some platform refuses
(:func:`jamp._jax_compat.platforms_refusing` asks JAX) is bound with ``lax.platform_dependent``: where the
program is lowered for a platform that refuses it, the algorithm's meaning in a form it accepts (the
operands converted to the algorithm's operand types, multiplied at ``HIGHEST`` precision, which asks for no
faster algorithm, into the algorithm's accumulation type, the result converted to the dtype the dot
returns); everywhere else the dot as written. The choice is made when the program is lowered, so a
program lowered for CUDA keeps its algorithm, and JAX differentiates either branch (a transpose keeps
its branch's precision). Convolutions never need it: JAX's lowering drops their algorithm.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jamp import _jax_compat as jc

# Primitives whose lowering checks a named algorithm; it types their first two operands (ragged_dot_general's
# group sizes pass as they are).
CHECKED = frozenset({"dot_general", "ragged_dot_general"})
HIGHEST = (jax.lax.Precision.HIGHEST,) * 2  # ``precision`` as a bound dot_general holds it


def _named(types: tuple | None, given: Any) -> Any:
    return given if types is None else types[0]


# algorithm type -> (algorithm, lhs dtype, rhs dtype) -> the dtypes it multiplies and accumulates in (None: as
# given). A preset's operand type is the one it names (BF16_BF16_F32 rounds float32 operands to bfloat16).
ALGORITHM_TYPES = {
    jax.lax.DotAlgorithm: lambda a, lhs, rhs: (a.lhs_precision_type, a.rhs_precision_type, a.accumulation_type),
    jax.lax.DotAlgorithmPreset: lambda a, lhs, rhs: (
        _named(a.supported_lhs_types, lhs),
        _named(a.supported_rhs_types, rhs),
        a.accumulation_type,
    ),
}


def refusing(primitive: Any, invals: list, params: dict) -> tuple[str, ...]:
    """The platforms that refuse this bind's dot algorithm; empty when it names none, or none refuses it."""
    algorithm = jc.dot_algorithm(params.get("precision")) if primitive.name in CHECKED else None
    if algorithm is None:
        return ()
    lhs, rhs = invals[:2]
    return jc.platforms_refusing(algorithm, lhs.dtype, rhs.dtype, params.get("preferred_element_type"))


def holds_refused(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or a jaxpr in its equations' parameters) binds a dot whose algorithm a platform refuses."""
    return any(
        refusing(e.primitive, [v.aval for v in e.invars], e.params)
        or any(holds_refused(inner) for inner in jc.jaxprs_in_params(e.params))
        for e in jaxpr.eqns
    )


def bind(primitive: Any, invals: list, params: dict) -> Any:
    """``primitive`` bound on ``invals`` with ``params`` in bind form (:func:`jamp._jax_compat.bind_as`), portable to
    the platforms that refuse its dot algorithm."""
    platforms = refusing(primitive, invals, params)
    as_written = functools.partial(_bind, primitive, params)
    if not platforms:
        return as_written(*invals)
    out_dtype = jax.eval_shape(as_written, *invals).dtype
    portable = functools.partial(_portable, primitive, params, out_dtype)
    return jax.lax.platform_dependent(*invals, default=as_written, **dict.fromkeys(platforms, portable))


def _bind(primitive: Any, params: dict, *invals) -> Any:
    return jc.bind_as(primitive, invals, params)


def _portable(primitive: Any, params: dict, out_dtype: Any, *invals) -> Any:
    """The dot's algorithm spelled as operand dtypes and an accumulator dtype, at ``HIGHEST`` precision."""
    algorithm = params["precision"]
    lhs_type, rhs_type, accumulation = ALGORITHM_TYPES[type(algorithm)](algorithm, invals[0].dtype, invals[1].dtype)
    lhs, rhs = (jax.lax.convert_element_type(x, t) for x, t in zip(invals, (lhs_type, rhs_type)))
    accumulation = params.get("preferred_element_type") if accumulation is None else np.dtype(accumulation)
    updates = {"precision": HIGHEST, "preferred_element_type": accumulation}
    out = jc.bind_as(primitive, [lhs, rhs, *invals[2:]], {**params, **updates})
    return jax.lax.convert_element_type(out, out_dtype)
