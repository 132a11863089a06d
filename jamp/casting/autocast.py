"""``jamp.autocast``: the public transformation, as a function wrapper, a decorator and a ``with`` block.

Where a call goes from here: :class:`jamp.casting.transformation.Autocast` (a function),
:mod:`jamp.casting.adapters.modules` (an NNX or Equinox module as the function), or, without a function,
:class:`AutocastSpec` (a decorator with options, or a region inside another autocast's function).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jamp.casting import torch_habits
from jamp.casting.adapters.modules import module_autocast
from jamp.casting.policy import Policy
from jamp.casting.regions import marker_for
from jamp.casting.signature import same
from jamp.casting.tracing import tracing_depth
from jamp.casting.transformation import Autocast, checked_options, region_of


class AutocastSpec:
    """``jamp.autocast(...)`` without a function: a decorator, and a ``with`` block.

    Inside a function that an autocast is tracing, ``with jamp.autocast(enabled=False):`` (or
    ``dtype=``, ``device_type=``, ``policy=``) marks its lines as a region exactly as the nested call
    ``jamp.autocast(g, enabled=False)(...)`` does: torch's nested ``with autocast(...)``. A rewrite needs
    the whole function, so a ``with`` that would turn autocast on outside any autocast function is an
    error that shows the function form; ``with jamp.autocast(enabled=False):`` there does nothing, as in
    torch (outside autocast every op already runs as written), so model code that uses it also runs
    without autocast.
    """

    def __init__(self, options: dict):
        self._options = options
        self._dtype, self._device_type, self._enabled, _, self._policy_arg, _ = checked_options(
            *(options[k] for k in ("dtype", "device_type", "enabled", "cache_enabled", "policy", "recompute"))
        )
        self._scopes = threading.local()

    def __call__(self, fun: Callable) -> Autocast:
        return autocast(fun, **self._options)

    def __repr__(self) -> str:
        return f"jamp.autocast({self._given()})"

    def _given(self) -> str:
        """The options that differ from the defaults, as the user would write them."""
        given = {k: v for k, v in self._options.items() if not same(v, DEFAULT_OPTIONS[k])}
        if "dtype" in given:
            given["dtype"] = f"jnp.{self._dtype.name}"
        return ", ".join(f"{k}={v if k == 'dtype' else repr(v)}" for k, v in given.items())

    def __enter__(self) -> None:
        if any(not same(self._options[k], DEFAULT_OPTIONS[k]) for k in ("static_argnums", "static_argnames")):
            raise TypeError(
                f"static_argnums and static_argnames describe a function's arguments; a `with {self!r}:` block has none"
            )
        if self._options["reduce_dtype"] is not None:
            raise ValueError(
                f"reduce_dtype is the dtype of the gradients a whole autocast function produces; a `with {self!r}:` "
                "block cannot change it: give it to the function, jamp.autocast(fun, reduce_dtype=...)"
            )
        if tracing_depth():
            scope = jax.named_scope(
                marker_for(region_of(self._enabled, self._dtype, self._device_type, self._policy_arg))
            )
        elif not self._enabled:
            scope = contextlib.nullcontext()
        else:
            given = self._given()
            raise RuntimeError(
                f"`with {self!r}:` is used outside any function that jamp.autocast transforms. jamp.autocast "
                "rewrites a whole function (its jaxpr), so it takes the function: write "
                f"`jamp.autocast(fn{', ' + given if given else ''})(*args)` or decorate it with "
                f"`@{self!r}`. Inside such a function, `with jamp.autocast(enabled=False):` and "
                "`with jamp.autocast(dtype=...):` mark regions."
            )
        scope.__enter__()
        self._scopes.__dict__.setdefault("stack", []).append(scope)

    def __exit__(self, *exc: object) -> bool | None:
        return self._scopes.stack.pop().__exit__(*exc)


@torch_habits.keywords_only
def autocast(
    fun: Callable | None = None,
    /,
    *,
    dtype: Any = None,
    device_type: str | None = None,
    enabled: bool = True,
    cache_enabled: bool = True,
    policy: Policy | str | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    recompute: bool = True,
    reduce_dtype: Any = None,
) -> Autocast | AutocastSpec:
    """Run ``fun`` with automatic mixed precision (torch's ``autocast``, as a function transformation).

    Matmuls and convolutions run in ``dtype``, numerically sensitive ops in float32, multi-input ops at their
    widest input (the op lists of ``policy``, see :mod:`jamp.casting.oplists`). Outputs keep the dtypes ``fun``
    declares (or the policy's output dtype). Inside another autocast function, ``autocast(g, enabled=False)``
    runs ``g`` as written and ``autocast(g, dtype=...)`` switches the dtype for ``g``; ``with
    jamp.autocast(enabled=False):`` inside ``fun`` does the same for a block.

    Arrays and Python floats (weak-typed, as under jax.jit) are traced; bools, ints, strings and other
    objects are static, part of the cache key; inside an Equinox module only arrays are traced, as under
    ``eqx.filter_jit``. As with jax.jit, arrays that ``fun`` closes over are constants of the trace, except for
    an NNX or Equinox module (or a bound method of one) given as ``fun``, whose current arrays are inputs of
    every call. NNX objects among the arguments get what the call writes to them, as under ``nnx.jit``.

    Args:
        fun: the function to transform; omit it to get a decorator (``@jamp.autocast(dtype=...)``) or a
            ``with`` block for a region inside another autocast's function.
        dtype: the compute dtype of matmuls and convolutions: ``jnp.float16`` or ``jnp.bfloat16`` (or
            "float16"/"bfloat16"/"f16"/"bf16"); None takes the device type's default.
        device_type: "gpu" (alias "cuda": torch's CUDA op lists, float16), "cpu" or "tpu" (bfloat16); None
            means ``jax.default_backend()``. It picks op lists and never checks the hardware.
        enabled: False runs ``fun`` as written (inside another autocast: a region with autocast off).
        cache_enabled: whether the casts of an input are shared by its uses (torch's weight cast cache).
        policy: a :class:`jamp.Policy` or policy string ("fp8", ...) replacing the built-in op lists.
        static_argnums: positional arguments that are static (part of the cache key), as in ``jax.jit``.
        static_argnames: keyword arguments that are static.
        recompute: whether the backward pass recomputes the values of elementwise ops and reductions between
            matmuls (norms, softmax, activations) from their inputs, and casts float32 parameters again,
            instead of keeping them (:mod:`jamp.casting.recompute`). The forward pass is unchanged; False
            keeps every value, as JAX does by default. It holds for the whole function: a nested autocast
            region follows the outer one.
        reduce_dtype: the dtype the gradients of float32 matmul operands (parameters) are produced in by the
            backward matmuls, and so cross devices in (the all-reduce of data parallelism, FSDP's reduce-scatter):
            None takes the policy's, float32 unless the policy says otherwise, as torch AMP + DDP all-reduces
            ``param.grad``; the compute dtype sends half the bytes, rounded at every hop. The backward matmuls
            keep compute-dtype operands either way. It holds for the whole function.

    Returns:
        The transformed function (same signature as ``fun``), or an :class:`AutocastSpec` when ``fun`` is
        omitted.

    Examples:
        >>> import jax, jax.numpy as jnp, jamp
        >>> f = jamp.autocast(lambda a, b: a @ b, device_type="gpu")
        >>> f(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype  # the matmul ran in float16
        dtype('float32')
    """
    options = {
        "dtype": dtype,
        "device_type": device_type,
        "enabled": enabled,
        "cache_enabled": cache_enabled,
        "policy": policy,
        "static_argnums": static_argnums,
        "static_argnames": static_argnames,
        "recompute": recompute,
        "reduce_dtype": reduce_dtype,
    }
    if fun is None:
        return AutocastSpec(options)
    if not callable(fun):
        raise torch_habits.autocast_positional((fun,), options, DEFAULT_OPTIONS)
    return module_autocast(fun, options) or Autocast(fun, **options)


DEFAULT_OPTIONS = {
    name: p.default for name, p in inspect.signature(autocast).parameters.items() if p.kind is p.KEYWORD_ONLY
}
