"""``unscale_and_check``: pick a backend, keep pass-through leaves out of the kernels, rebuild the tree."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jamp_kernels import leafwise, pallas_triton, sharding, xla
from jamp_kernels.platforms import per_platform

BACKENDS = ("auto", "xla", "pallas", "interpret")


def _xla_forms() -> dict:
    """The XLA unscale beside each form of ``xla.CHECK_OF_PLATFORM``: ``(inv, leaves) -> (unscaled, found)``."""

    def with_check(check):
        return lambda inv, leaves: (xla.unscale(leaves, inv), check(leaves))

    return {platform: with_check(check) for platform, check in xla.CHECK_OF_PLATFORM.items()}


def _pallas(inv: jax.Array, leaves: list, *, interpret: bool, donate: bool) -> tuple[list, jax.Array]:
    kernel = functools.partial(pallas_triton.unscale_and_check, interpret=interpret, donate=donate)
    return sharding.shard_local(kernel, inv, leaves)


def _pallas_check(leaves: list, *, interpret: bool) -> jax.Array:
    return sharding.shard_local_check(functools.partial(pallas_triton.check, interpret=interpret), leaves)


@functools.partial(jax.jit, static_argnames=("backend",))
def _check(work: list, *, backend: str) -> jax.Array:
    """The check in one form per platform: the Pallas kernel on CUDA beside the XLA forms of
    ``xla.CHECK_OF_PLATFORM`` for "auto" (one flat table, no conditional inside another)."""
    pallas = functools.partial(_pallas_check, interpret=backend == "interpret")
    if backend == "auto":
        return per_platform({**xla.CHECK_OF_PLATFORM, "cuda": pallas}, work)
    return xla.has_nonfinite(work) if backend == "xla" else pallas(work)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def has_nonfinite(grads: Any, *, backend: str = "auto") -> jax.Array:
    """Scalar bool: any inf/NaN in any floating leaf of ``grads``, exact (see :func:`xla.has_nonfinite`).

    ``backend="auto"`` reads the leaves with one Pallas kernel launch on CUDA (a launch per leaf costs more
    than the reading on a GPU) and with XLA elsewhere, in the form ``xla.CHECK_OF_PLATFORM`` picks
    (elementwise loops over views of the leaves on a CPU); "xla", "pallas", "interpret" as for
    :func:`unscale_and_check`. The Pallas kernel and the CPU form read sharded leaves shard by shard and OR
    the flag over the mesh; XLA partitions the per-leaf reductions of the other form itself.

    Args:
        grads: a pytree of JAX or NumPy arrays (real floating, integer or bool); integer, bool and empty
            leaves are not read.
        backend: "auto", "xla", "pallas" (the Triton kernel, on a GPU) or "interpret" (the Pallas kernel interpreted,
            for CPU tests).

    Returns:
        A bool scalar array: True when any element of a floating leaf is inf or NaN.

    Raises:
        TypeError: for a leaf that is not an array (a Python number) or is complex.
        ValueError: for an unknown ``backend``.

    Examples:
        >>> import jax.numpy as jnp, jamp_kernels
        >>> grads = {"w": jnp.ones(3), "b": jnp.array([1.0, jnp.nan])}
        >>> jamp_kernels.has_nonfinite(grads)
        Array(True, dtype=bool)
        >>> jamp_kernels.has_nonfinite({"w": jnp.ones(3), "step": jnp.arange(3)})
        Array(False, dtype=bool)
    """
    _check_backend(backend)
    leaves, _ = leafwise.flatten(grads)
    work = [g for g in leaves if leafwise.is_scaled(g)]
    if not work:
        return jnp.zeros((), jnp.bool_)
    return _check(work, backend=backend)


@functools.partial(jax.jit, static_argnames=("backend", "donate"))
def _unscale_and_check(inv: jax.Array, work: list, *, backend: str, donate: bool) -> tuple[list, jax.Array]:
    """Jitted even when called eagerly, so sharded inputs always reach XLA's partitioner (see sharding.py)."""
    pallas = functools.partial(_pallas, interpret=backend == "interpret", donate=donate)
    if backend == "auto":
        return per_platform({**_xla_forms(), "cuda": pallas}, inv, work)
    return per_platform(_xla_forms(), inv, work) if backend == "xla" else pallas(inv, work)


def unscale_and_check(
    grads: Any, inv_scale: Any, *, backend: str = "auto", donate: bool = False
) -> tuple[Any, jax.Array]:
    """Return ``(unscaled_grads, found_inf)``, torch's ``_amp_foreach_non_finite_check_and_unscale_``.

    ``inv_scale`` is a scalar or a ``[factor, power_of_two]`` pair from :func:`inverse` (which keeps the
    inverse of scales above 2**126 from flushing to zero). Floating leaves are multiplied by it in float32 (float64 leaves in float64) and rounded
    once; integer, bool and empty leaves pass through. ``found_inf`` is a scalar bool, True when any
    *input* element is inf or NaN. ``backend``: "auto" (the Pallas kernel on CUDA, XLA elsewhere, chosen
    when lowering), "xla", "pallas" (Triton), "interpret" (the Pallas kernel interpreted, for CPU tests).
    ``donate=True`` lets the Pallas kernel write in place (see ``pallas_triton.unscale_and_check``).

    Args:
        grads: a pytree of JAX or NumPy arrays (real floating, integer or bool).
        inv_scale: the inverse scale: a positive finite scalar, or a ``[factor, power_of_two]`` pair whose
            product it is (``jamp_kernels.inverse(scale)``).
        backend: "auto", "xla", "pallas" or "interpret", as above.
        donate: whether the Pallas kernel may write the unscaled gradients over the inputs.

    Returns:
        ``(unscaled_grads, found_inf)``: ``grads``' structure with each floating leaf times ``inv_scale``
        in its dtype, and a bool scalar array.

    Raises:
        TypeError: for a leaf that is not an array (a Python number) or is complex, or an ``inv_scale``
            that is not real.
        ValueError: for an unknown ``backend``, or an ``inv_scale`` of another shape, or concrete and not
            finite and positive.

    Examples:
        >>> import jax.numpy as jnp, jamp_kernels
        >>> grads = {"w": jnp.array([2.0, 4.0]), "step": jnp.arange(2)}
        >>> unscaled, found_inf = jamp_kernels.unscale_and_check(grads, 0.5)
        >>> unscaled
        {'step': Array([0, 1], dtype=int32), 'w': Array([1., 2.], dtype=float32)}
        >>> found_inf
        Array(False, dtype=bool)
        >>> jamp_kernels.unscale_and_check({"w": jnp.array([2.0, jnp.inf])}, 0.5)[1]
        Array(True, dtype=bool)
    """
    _check_backend(backend)
    leaves, treedef = leafwise.flatten(grads)
    inv = leafwise.inv_scale_pair(inv_scale)
    picked = [i for i, g in enumerate(leaves) if leafwise.is_scaled(g)]
    if not picked:
        return grads, jnp.zeros((), jnp.bool_)
    outs, found = _unscale_and_check(inv, [leaves[i] for i in picked], backend=backend, donate=donate)
    for i, out in zip(picked, outs):
        leaves[i] = out
    return jax.tree.unflatten(treedef, leaves), found
