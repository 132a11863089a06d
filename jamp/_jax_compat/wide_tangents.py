"""Matmuls whose wider operands get their cotangents in a chosen dtype: three primitives.

Under autocast a float32 parameter ``w`` enters a matmul cast to bfloat16. JAX transposes ``dot(x, cast(w))``
into a bfloat16 product ``x^T @ ct`` and casts it back to float32 afterwards, so wherever that product is a
partial sum (the batch sharded over devices) XLA's partitioner reduces it across devices in bfloat16. Here:

- ``wide_matmul(x_c, w_c, w)``: the forward matmul, ``dot_general(x_c, w_c)`` on the compute-dtype operands; ``w``
  (the operand as given, wider) enters only for its tangent, which replaces the tangent of its cast ``w_c``;
- ``wide_tangent(x_c, dw)``: that tangent, ``dot(x_c, cast(dw))``, linear in ``dw``; transposed, it is
- ``wide_dot(ct, x_c)``: ``x_c^T @ ct`` with compute-dtype operands and a ``reduce_dtype`` result
  (``preferred_element_type``), so the partial sums, and every reduction of them across devices, are float32, as
  torch DDP's all-reduce of ``.grad``; lowered per platform (XLA:CPU widens the operands first).

Primitives, not a ``custom_jvp``: JAX caches the linearization of each distinct one (jamp.casting.replay), so a
deep model's layers pay it once. Where operands vary differently over shard_map's manual axes they are made to vary
alike before binding (as jax.lax does for its own primitives), so a transpose sums the float32 cotangent.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax._src import core, dispatch
from jax._src.interpreters import ad, batching, mlir
from jax._src.lax import lax as lax_internal
from jax.extend import core as jcore

_WIDE_TANGENT = jcore.Primitive("wide_tangent")


def _tangent_sum(out, terms: list):
    """A jvp rule's (primal, tangent) from the tangent's terms (none: a symbolic zero)."""
    if not terms:
        return out, ad.Zero.from_primal_value(out)
    return out, functools.reduce(jax.lax.add, terms)


def _operands(other, d, *, other_is_lhs: bool, compute_dtype):
    other, d = other.astype(compute_dtype), d.astype(compute_dtype)
    return (other, d) if other_is_lhs else (d, other)


def _impl(other, d, *, dimension_numbers, precision, other_is_lhs, compute_dtype, reduce_dtype):
    lhs, rhs = _operands(other, d, other_is_lhs=other_is_lhs, compute_dtype=compute_dtype)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type=compute_dtype)


def _abstract_eval(other, d, *, dimension_numbers, precision, other_is_lhs, compute_dtype, reduce_dtype):
    d, other = (x.update(dtype=np.dtype(compute_dtype), weak_type=False) for x in (d, other))
    lhs, rhs = (other, d) if other_is_lhs else (d, other)
    out, _ = lax_internal.dot_general_p.abstract_eval(
        lhs,
        rhs,
        dimension_numbers=dimension_numbers,
        precision=precision,
        preferred_element_type=np.dtype(compute_dtype),
        out_sharding=None,
    )
    return out


def _transpose(ct, other, d, *, dimension_numbers, precision, other_is_lhs, compute_dtype, reduce_dtype):
    if ad.is_undefined_primal(other):
        raise NotImplementedError("wide_tangent is linear in its second operand only")
    if type(ct) is ad.Zero:
        return None, ad.Zero(d.aval)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if other_is_lhs:  # d is the right operand: swap the roles, and the answer's kept dimensions with them
        dimension_numbers = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    dims, order = _transposed(dimension_numbers, d.aval.ndim, np.ndim(other), swap_answer=other_is_lhs)
    product = _WIDE_DOT.bind(
        *core.auto_insert_reshard(ct.astype(compute_dtype), other.astype(compute_dtype)),
        dimension_numbers=dims,
        precision=precision,
        preferred_element_type=np.dtype(reduce_dtype),
        out_sharding=_in_order(d.aval.sharding, order),
    )
    return None, jax.lax.transpose(product, tuple(int(a) for a in np.argsort(order))).astype(d.aval.dtype)


def _in_order(sharding, order: list[int]):
    """The sharding of an array of ``sharding`` whose axes are permuted into ``order`` (None without a mesh: the
    partitioner decides, as for JAX's own transpose of a dot)."""
    if sharding is None or sharding.mesh.empty:
        return None
    spec = tuple(sharding.spec) + (None,) * (len(order) - len(sharding.spec))
    return sharding.update(spec=jax.sharding.PartitionSpec(*(spec[o] for o in order)))


def _transposed(dimension_numbers, x_ndim: int, y_ndim: int, *, swap_answer: bool) -> tuple:
    """For ``dot_general(x, y, dimension_numbers)``: the dimension numbers of the product of its cotangent with
    ``y`` that gives ``x``'s cotangent, and the axis of ``x`` each axis of that product is."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = [i for i in range(x_ndim) if i not in (*x_contract, *x_batch)]
    y_kept = [i for i in range(y_ndim) if i not in (*y_contract, *y_batch)]
    n_batch = len(x_batch)
    if swap_answer:  # the answer's axes: batch, then y's kept, then x's kept
        ans_y = range(n_batch, n_batch + len(y_kept))
    else:  # batch, x's kept, y's kept
        ans_y = range(n_batch + len(x_kept), n_batch + len(x_kept) + len(y_kept))
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(range(n_batch)), tuple(y_batch)))
    x_contract_by_y = [x_contract[i] for i in np.argsort(y_contract)]
    return dims, [int(a) for a in (*x_batch, *x_kept, *x_contract_by_y)]


def _batch(args, dims, *, dimension_numbers, other_is_lhs, **params):
    other, d = args
    other_dim, d_dim = dims
    lhs, rhs = (other, d) if other_is_lhs else (d, other)
    lhs_dim, rhs_dim = (other_dim, d_dim) if other_is_lhs else (d_dim, other_dim)
    new_dims, out_dim = lax_internal._dot_general_batch_dim_nums(
        (np.ndim(lhs), np.ndim(rhs)), (lhs_dim, rhs_dim), dimension_numbers
    )
    return _bind(other, d, dimension_numbers=new_dims, other_is_lhs=other_is_lhs, **params), out_dim


def _jvp(primals, tangents, **params):
    other, d = primals
    t_other, t_d = tangents
    out = _bind(other, d, **params)
    terms = []
    if type(t_d) is not ad.Zero:
        terms.append(_bind(other, t_d, **params))
    if type(t_other) is not ad.Zero:  # bilinear: the other operand's tangent, in the compute dtype throughout
        terms.append(_impl(t_other, d, **params))
    return _tangent_sum(out, terms)


_WIDE_TANGENT.def_impl(_impl)
_WIDE_TANGENT.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_WIDE_TANGENT, mlir.lower_fun(_impl, multiple_results=False))
ad.primitive_transposes[_WIDE_TANGENT] = _transpose
ad.primitive_jvps[_WIDE_TANGENT] = _jvp
batching.primitive_batchers[_WIDE_TANGENT] = _batch


def _bind(other, d, **params):
    """``wide_tangent(other, d)``: linear in ``d`` (see the module docstring)."""
    other, d = core.auto_insert_reshard(other, d)
    return _WIDE_TANGENT.bind(other, d, **params)


# The transposed product: compute-dtype operands, a reduce_dtype result. One equation, chosen per platform when it
# is lowered: XLA:CPU's dot runs no compute-dtype operands into a wider result ("Unsupported element type for
# DotThunk::Execute: BF16 x BF16 = F32"), so there the operands are widened first, exactly (a bfloat16 or float16
# value is a float32 one), which gives the same products and sums.
_WIDE_DOT = jcore.Primitive("wide_dot")


def _wide_dot(lhs, rhs, **params):
    return lax_internal.dot_general_p.bind(lhs, rhs, **params)


def _wide_dot_on_cpu(lhs, rhs, **params):
    return _wide_dot(*(x.astype(params["preferred_element_type"]) for x in (lhs, rhs)), **params)


def _wide_dot_abstract_eval(lhs, rhs, **params):
    out, _ = lax_internal.dot_general_p.abstract_eval(lhs, rhs, **params)
    return out


def _wide_dot_jvp(primals, tangents, **params):
    lhs, rhs = primals
    t_lhs, t_rhs = tangents
    out = _WIDE_DOT.bind(lhs, rhs, **params)
    pairs = ((t_lhs, rhs), (lhs, t_rhs))
    return _tangent_sum(out, [_WIDE_DOT.bind(a, b, **params) for a, b in pairs if ad.Zero not in (type(a), type(b))])


def _wide_dot_transpose(ct, lhs, rhs, *, preferred_element_type, **params):
    # a second derivative: JAX's own transposes of the dot, each operand's cotangent in its own dtype
    if type(ct) is ad.Zero:
        return [None if not ad.is_undefined_primal(x) else ad.Zero(x.aval) for x in (lhs, rhs)]
    if ad.is_undefined_primal(lhs):
        ct_lhs = lax_internal._dot_general_transpose_lhs(ct, lhs, rhs, preferred_element_type=lhs.aval.dtype, **params)
        return [ct_lhs, None]
    ct_rhs = lax_internal._dot_general_transpose_rhs(ct, lhs, rhs, preferred_element_type=rhs.aval.dtype, **params)
    return [None, ct_rhs]


def _wide_dot_batch(args, dims, *, dimension_numbers, out_sharding, **params):
    lhs, rhs = args
    new_dims, out_dim = lax_internal._dot_general_batch_dim_nums((np.ndim(lhs), np.ndim(rhs)), dims, dimension_numbers)
    return _WIDE_DOT.bind(
        lhs, rhs, dimension_numbers=new_dims, out_sharding=_unsharded_at(out_sharding, out_dim), **params
    ), out_dim


def _unsharded_at(sharding, axis: int):
    """``sharding`` with a new axis, not sharded, at ``axis`` (what vmap adds), or None."""
    if sharding is None:
        return None
    spec = tuple(sharding.spec)
    return sharding.update(spec=jax.sharding.PartitionSpec(*spec[:axis], None, *spec[axis:]))


_WIDE_DOT.def_impl(functools.partial(dispatch.apply_primitive, _WIDE_DOT))
_WIDE_DOT.def_abstract_eval(_wide_dot_abstract_eval)
mlir.register_lowering(_WIDE_DOT, mlir.lower_fun(_wide_dot, multiple_results=False))
mlir.register_lowering(_WIDE_DOT, mlir.lower_fun(_wide_dot_on_cpu, multiple_results=False), platform="cpu")
ad.primitive_jvps[_WIDE_DOT] = _wide_dot_jvp
ad.primitive_transposes[_WIDE_DOT] = _wide_dot_transpose
batching.primitive_batchers[_WIDE_DOT] = _wide_dot_batch

# The forward matmul: ``wide_matmul(lhs, rhs, *wide)`` is ``dot_general(lhs, rhs)`` on compute-dtype operands, and
# ``wide`` holds, for each position in ``positions``, the operand as given (wider) whose cast is there.
_WIDE_MATMUL = jcore.Primitive("wide_matmul")


def _wide_matmul(lhs, rhs, *wide, positions, reduce_dtype, **dot):
    return lax_internal.dot_general_p.bind(lhs, rhs, **dot)


def _wide_matmul_abstract_eval(lhs, rhs, *wide, positions, reduce_dtype, **dot):
    out, _ = lax_internal.dot_general_p.abstract_eval(lhs, rhs, **dot)
    return out


def _wide_matmul_jvp(primals, tangents, *, positions, reduce_dtype, **dot):
    lhs, rhs = primals[:2]
    out = _WIDE_MATMUL.bind(*primals, positions=positions, reduce_dtype=reduce_dtype, **dot)
    d = dict(enumerate(tangents[:2]))
    d.update(zip(positions, tangents[2:]))  # a wider operand's tangent, not its cast's
    terms = []
    for i, t in d.items():
        if type(t) is ad.Zero:
            continue
        other = rhs if i == 0 else lhs
        if i in positions:
            terms.append(
                _bind(
                    other,
                    t,
                    dimension_numbers=dot["dimension_numbers"],
                    precision=dot["precision"],
                    other_is_lhs=i == 1,
                    compute_dtype=dot["preferred_element_type"],
                    reduce_dtype=reduce_dtype,
                )
            )
        else:
            terms.append(lax_internal.dot_general_p.bind(*((t, other) if i == 0 else (other, t)), **dot))
    return _tangent_sum(out, terms)


def _wide_matmul_batch(args, dims, *, positions, dimension_numbers, **rest):
    lhs, rhs, *wide = args
    lhs_dim, rhs_dim, *wide_dims = dims
    new_dims, out_dim = lax_internal._dot_general_batch_dim_nums(
        (np.ndim(lhs), np.ndim(rhs)), (lhs_dim, rhs_dim), dimension_numbers
    )
    if rest.get("out_sharding") is not None:
        rest["out_sharding"] = _unsharded_at(rest["out_sharding"], out_dim)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    casts_at = (lhs_dim, rhs_dim)
    placed = []  # each wider operand batched as its cast is
    for x, x_dim, i in zip(wide, wide_dims, positions):
        want = casts_at[i]
        if want is None:
            placed.append(x)  # (its cast is unbatched, so it is too)
        elif x_dim is None:
            placed.append(batching.broadcast(x, size, want, None))
        else:
            placed.append(batching.moveaxis(x, x_dim, want))
    return _bind_matmul(lhs, rhs, *placed, positions=positions, dimension_numbers=new_dims, **rest), out_dim


_WIDE_MATMUL.def_impl(functools.partial(dispatch.apply_primitive, _WIDE_MATMUL))
_WIDE_MATMUL.def_abstract_eval(_wide_matmul_abstract_eval)
mlir.register_lowering(_WIDE_MATMUL, mlir.lower_fun(_wide_matmul, multiple_results=False))
ad.primitive_jvps[_WIDE_MATMUL] = _wide_matmul_jvp
batching.primitive_batchers[_WIDE_MATMUL] = _wide_matmul_batch


def _bind_matmul(lhs, rhs, *wide, **params):
    return _WIDE_MATMUL.bind(*core.auto_insert_reshard(lhs, rhs, *wide), **params)


def wide_matmul(low: list, wide: list, *, params: dict, positions: tuple, reduce_dtype: Any) -> Any:
    """``dot_general(*low, **params)`` (compute-dtype operands, ``params`` the dot's, its
    ``preferred_element_type`` the compute dtype), differentiated with each operand at ``positions`` as given in
    ``wide``: that operand's tangent in its place, a ``wide_tangent`` whose transpose is its cotangent in
    ``reduce_dtype``."""
    return _bind_matmul(*low, *wide, positions=tuple(positions), reduce_dtype=np.dtype(reduce_dtype), **params)
