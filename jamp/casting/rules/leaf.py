"""Rules for first-order primitives, one per category (see jamp.casting.oplists)."""

from __future__ import annotations

import jax
import numpy as np

from jamp._jax_compat import Literal
from jamp.casting import fp8, wide_cotangents
from jamp.casting.call import MATMUL_LIKE, Call, is_float
from jamp.casting.dtypes import FLOAT32, is_eligible, is_low, widest
from jamp.casting.float32_output import bilinear_float32_output

BILINEAR = ("dot_general", "conv_general_dilated")  # two operands, the result linear in each


def _set_preferred(call: Call, dtype) -> dict:
    """Matmul-likes: the output dtype is ``preferred_element_type``; jnp sets it to float32."""
    if call.eqn.primitive.name not in MATMUL_LIKE or "preferred_element_type" not in call.params:
        return {}
    pref = call.params["preferred_element_type"]
    if pref is not None and not np.issubdtype(pref, np.floating):
        return {}
    return {"preferred_element_type": dtype}


def _all_floats_eligible(call: Call) -> bool:
    return all(is_eligible(x.dtype) for x in call.invals if is_float(x))


def lower(call: Call, output_dtype=None):
    """Cast floating inputs to the compute dtype; matmuls also emit it (or ``output_dtype``)."""
    dtype = call.ctx.compute_dtype
    if not _all_floats_eligible(call) or (
        call.eqn.primitive.name in MATMUL_LIKE and not all(is_float(x) for x in call.invals)
    ):
        return default(call)
    given = [call.env.wide_origin(x) for x in call.invals]  # a gather run on the compute dtype: what it gathered
    if output_dtype is None and _widens_cotangents(call, given):
        call.bound = [call.env.cast(x, dtype) for x in call.invals]  # what jamp.explain shows
        return wide_cotangents.dot_general(call.bound, given, call.params, dtype, call.ctx.policy.reduce_dtype)
    invals = [call.env.cast(x, dtype) if is_float(x) else x for x in call.invals]
    return call.bind(invals, **_set_preferred(call, output_dtype or dtype))


def _widens_cotangents(call: Call, given: list) -> bool:
    """A ``dot_general`` with an operand (``given``) wider than the compute dtype, whose gradient the policy's
    ``reduce_dtype`` asks for in a wider dtype (:mod:`jamp.casting.wide_cotangents`)."""
    if call.eqn.primitive.name != "dot_general" or not wide_cotangents.applies(call.params):
        return False
    dtype, reduce_dtype = call.ctx.compute_dtype, call.ctx.policy.reduce_dtype
    return any(wide_cotangents.widens(x.dtype, dtype, reduce_dtype) for x in given)


def lower_float32_output(call: Call):
    """``lower``, but a matmul returns its float32 accumulator instead of rounding it to the compute
    dtype: what ``jax.nn.dot_product_attention`` asks for its logits (``preferred_element_type=float32``
    on low-precision q and k), which a softmax then exponentiates, so their rounding error would not stay
    small. Operands and backward matmuls stay in the compute dtype (:mod:`jamp.casting.float32_output`)."""
    if call.eqn.primitive.name not in BILINEAR or not all(is_float(x) and is_eligible(x.dtype) for x in call.invals):
        return lower(call, FLOAT32)
    invals = [call.env.cast(x, call.ctx.compute_dtype) for x in call.invals]
    call.bound = invals
    return bilinear_float32_output(call.eqn.primitive, call.params, call.ctx.compute_dtype)(*invals)


def lower_fp8(call: Call):
    """``lower`` under a policy with ``fp8`` on: a ``dot_general`` of two eligible floating operands
    whose shapes :func:`jamp.casting.fp8.eligible` accepts runs as a float8 matmul with current
    scaling, emitting the compute dtype; everything else runs as ``lower``."""
    if call.eqn.primitive.name != "dot_general" or not _fp8_eligible(call):
        return lower(call)
    lhs, rhs = call.invals
    call.bound = [jax.ShapeDtypeStruct(x.shape, fp8.FORWARD.dtype) for x in (lhs, rhs)]  # what jamp.explain shows
    return fp8.dot_general(lhs, rhs, call.params["dimension_numbers"], call.ctx.compute_dtype)


def _fp8_eligible(call: Call) -> bool:
    lhs, rhs = call.invals
    return all(is_float(x) and is_eligible(x.dtype) for x in (lhs, rhs)) and fp8.eligible(
        lhs.shape, rhs.shape, call.params["dimension_numbers"]
    )


def float32(call: Call):
    """Cast float16/bfloat16 inputs up to float32; matmuls emit float32 instead of a low dtype."""
    invals = [call.env.cast(x, FLOAT32) if is_float(x) and is_low(x.dtype) else x for x in call.invals]
    pref = call.params.get("preferred_element_type")
    updates = _set_preferred(call, FLOAT32) if pref is None or is_low(pref) else {}
    return call.bind(invals, **updates)


def _is_array_operand(call: Call, i: int) -> bool:
    """Scalar literals and rank-0 operands do not promote an array (``x_bf16 * 2.0`` stays bf16)."""
    return call.eqn.invars[i].aval.ndim > 0 and np.ndim(call.invals[i]) > 0


def _bias_target(call: Call, float_idx: list[int]):
    """torch's ``linear`` (matmul + bias) yields the compute dtype: a smaller operand broadcast onto
    a matmul output is cast to the matmul's dtype rather than promoting it to float32."""
    if call.eqn.primitive.name != "add" or len(float_idx) != 2:
        return None
    a, b = float_idx
    if any(isinstance(call.eqn.invars[i], Literal) for i in float_idx):
        return None
    for mm, other in ((a, b), (b, a)):
        mm_var, other_var = call.eqn.invars[mm], call.eqn.invars[other]
        if (
            call.env.is_lowered(mm_var)
            and call.invals[mm].dtype == call.ctx.compute_dtype
            and is_eligible(call.invals[other].dtype)
            and call.env.size_before_broadcast(other_var) < np.size(call.invals[mm])
        ):
            return call.ctx.compute_dtype
    return None


def _literal_fits(call: Call, i: int, dtype) -> bool:
    """A scalar literal that overflows or flushes to zero in ``dtype`` must not be rounded into it
    (``h_f16 * 1e5``): torch computes tensor-scalar ops in float32 and would not lose it either."""
    if not isinstance(call.eqn.invars[i], Literal):
        return True
    value = np.asarray(call.invals[i], np.float64)
    with np.errstate(over="ignore"):  # overflowing is what is being asked, not an event to warn about
        rounded = value.astype(dtype).astype(np.float64)
    return not ((np.isfinite(value) & ~np.isfinite(rounded)) | ((value != 0) & (rounded == 0))).any()


def promote(call: Call):
    """Cast floating inputs to the widest one (array operands only, when there are any)."""
    float_idx = [i for i, x in enumerate(call.invals) if is_float(x)]
    if not float_idx:
        return call.bind()
    array_idx = [i for i in float_idx if _is_array_operand(call, i)] or float_idx
    target = _bias_target(call, float_idx) or widest(call.invals[i].dtype for i in array_idx)
    if is_low(target) and not all(_literal_fits(call, i, target) for i in float_idx):
        target = FLOAT32
    invals = [
        call.cast_operand(i, target) if i in float_idx and is_eligible(x.dtype) else x
        for i, x in enumerate(call.invals)
    ]
    if len({invals[i].dtype for i in float_idx}) > 1:
        return default(call)
    return call.bind(invals)


def passthrough(call: Call):
    """Run in whatever dtype arrives."""
    return call.bind()


def default(call: Call):
    """Unknown to jamp: give the primitive exactly the input dtypes it was traced with (and bind it
    as recorded: a float16 sum the program wrote stays one)."""
    return call.bind_with(call.cast_to_recorded(), call.params)
