"""Everything jamp needs from JAX internals, in one place.

jaxpr internals (primitive names, parameter names, where helpers live) change between JAX
releases. pyproject.toml states the supported range (jax 0.10.2 through 0.12.x, each tested in CI);
where releases differ, the choice is made here by feature detection (an import that moved, an
attribute that appeared), never by comparing version strings. tests/casting/test_oplists.py names the
primitive and parameter when a new release moves something read here.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax._src import config as jax_config
from jax._src import xla_bridge
from jax._src.interpreters import batching
from jax._src.interpreters import partial_eval as pe
from jax._src.util import weakref_lru_cache
from jax.extend import core as jcore
from jax.extend import linear_util as lu

from jamp._jax_compat.equations import *  # noqa: F403 (the one evaluation loop, re-exported)
from jamp._jax_compat.fused import one_equation  # noqa: F401 (re-exported)
from jamp._jax_compat.loops import *  # noqa: F403 (scan, while and shard_map parameters, re-exported)
from jamp._jax_compat.primitives import *  # noqa: F403 (the higher-order primitives and their parameters)
from jamp._jax_compat.scopes import *  # noqa: F403 (source information, name stacks)
from jamp._jax_compat.scopes import transposed
from jamp._jax_compat.shard_casts import cast_on_shard  # noqa: F401 (re-exported)
from jamp._jax_compat.wide_tangents import wide_matmul  # noqa: F401 (re-exported)

try:  # jax >= 0.11: FlatTree moved to its own module, with a module-level flatten
    from jax._src.flattree import flatten as _flat_tree
except ImportError:  # jax 0.10
    from jax._src.tree_util import FlatTree as _FlatTree

    _flat_tree = _FlatTree.flatten

ClosedJaxpr = jcore.ClosedJaxpr
Jaxpr = jcore.Jaxpr
Literal = jcore.Literal
Var = jcore.Var
jaxpr_as_fun = jcore.jaxpr_as_fun
jaxprs_in_params = jcore.jaxprs_in_params
wrap_init = lu.wrap_init
convert_constvars_jaxpr = pe.convert_constvars_jaxpr


def _autocast_tracing_state():
    """A JAX configuration state in the trace context, which JAX's caches of traced jitted functions key
    on: True while an autocast traces its function (see :mod:`jamp.casting.tracing`). Defined once per
    process (a re-imported jamp finds it)."""
    name = "jamp_autocast_tracing"
    return jax_config.config_states.get(name) or jax_config.bool_state(
        name,
        False,
        help="Set by jamp while jamp.autocast traces a function; not a user option.",
        include_in_trace_context=True,
    )


_AUTOCAST_TRACING = _autocast_tracing_state()


def autocast_tracing():
    """A context manager that sets the state above for the trace it encloses."""
    return _AUTOCAST_TRACING(True)


# ``jax.jit(..., inline=...)`` that inlines the call into the enclosing jaxpr while tracing: jax >= 0.11 names
# it ``jax.Inline.JAX_EARLY`` (``inline=True`` there inlines only when lowering); jax 0.10 has only True.
INLINE_WHILE_TRACING = jax.Inline.JAX_EARLY if hasattr(jax, "Inline") else True


def is_differentiated(x) -> bool:
    """Whether ``x`` is (or wraps, as vmap's and shard_map's tracers do) a tracer of forward- or reverse-mode
    differentiation."""
    from jax._src.interpreters import ad

    while isinstance(x, jax.core.Tracer):
        if isinstance(x, (ad.JVPTracer, ad.LinearizeTracer)):
            return True
        x = getattr(x, "val", None)
    return False


def is_symbolic_zero(x) -> bool:
    """True for the ``Zero`` placeholders a custom_vjp bwd rule may return."""
    from jax._src.ad_util import Zero

    return isinstance(x, Zero)


def unbatched(x):
    """The value under ``vmap``'s tracers: a vmapped step's gradients and scale are tracers of the jit around it."""
    while isinstance(x, batching.BatchTracer):
        x = x.val
    return x


def jaxpr_trace_of(x) -> Any | None:
    """The jaxpr trace under way (a ``jit``, ``pmap`` or loop body) that ``x`` is a tracer of, else None."""
    return x._trace if isinstance(x, pe.DynamicJaxprTracer) else None


def producer(x) -> Any | None:
    """The equation that computed the jaxpr tracer ``x`` in the trace under way (its ``in_tracers`` are the tracers
    it read; jax 0.10 through 0.12 record it as ``tracer.parent``), or None for an input of the trace, a constant,
    or a JAX whose tracers do not record it (the callers then claim nothing: tests/scaling/test_scaler_misuse.py fails)."""
    eqn = getattr(x, "parent", None)
    return eqn if all(hasattr(eqn, a) for a in ("in_tracers", "params", "source_info")) else None


def producer_inputs(eqn) -> list:
    return list(eqn.in_tracers)


def made_by_backward_pass(eqn, budget: int = 10_000) -> bool:
    """Whether reverse-mode differentiation (``jax.grad``/``vjp``: a transpose) emitted ``eqn``, or, up to ``budget``
    equations, one inside the jaxprs of its parameters (a nested ``jit``, a ``scan`` that accumulates gradients)."""
    pending = [eqn]
    while pending and budget > 0:
        e = pending.pop()
        budget -= 1
        if transposed(e):
            return True
        for inner in jaxprs_in_params(e.params):
            pending.extend(inner.eqns)
    return False


# jax >= 0.11: a custom_vjp's flat bwd returns ``(cotangents, logs)`` (``defvjp_with_logs``);
# jax 0.10 returns the cotangents alone.
BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def split_bwd_result(result) -> tuple[list, Any]:
    """A flat custom_vjp bwd's result as ``(cotangents, logs)``; logs are None before jax 0.11."""
    if BWD_RETURNS_LOGS:
        cts, logs = result
        return list(cts), logs
    return list(result), None


def join_bwd_result(cts: list, logs: Any):
    """Inverse of :func:`split_bwd_result`: what this JAX expects a flat bwd to return."""
    return (cts, logs) if BWD_RETURNS_LOGS else cts


def shard_map_body(out_specs, body):
    """Wrap ``body(*args) -> list`` into the subfun form ``shard_map_p.bind`` expects; ``out_specs`` may be a
    function, called after ``body`` (which may decide how many outputs there are)."""

    def subfun(*args):
        outs = body(*args)
        return _flat_tree(outs).with_aux(out_specs() if callable(out_specs) else out_specs)

    return subfun


def jit_body(jitted, *args):
    """The body a ``jitted(*args)`` equation holds as its ``JIT_JAXPR`` parameter, the very object (JAX caches
    the trace), so that the equation can be recognised by its body (jamp.lower_precision's calls)."""
    return jitted.trace(*args).jaxpr


def cudnn_version() -> int | None:
    """cuDNN's version (91000 for 9.10) where JAX's CUDA plugin is installed, else None. Read where
    ``jax.nn.dot_product_attention(implementation="cudnn")`` reads it, so that both agree."""
    from jax._src.cudnn import fused_attention_stablehlo

    versions = fused_attention_stablehlo.cuda_versions
    return None if versions is None else versions.cudnn_get_version()


# -- dot algorithms (``precision=lax.DotAlgorithmPreset.F16_F16_F32``) -----------------------------------
# The platforms a program may be lowered for from any host, as ``lax.platform_dependent`` names them.
LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def dot_algorithm(precision: Any) -> Any:
    """``precision`` (a dot_general's parameter) if it names an algorithm other than the default, else None."""
    named = isinstance(precision, (jax.lax.DotAlgorithm, jax.lax.DotAlgorithmPreset))
    return precision if named and precision != jax.lax.DotAlgorithmPreset.DEFAULT else None


def platforms_refusing(algorithm: Any, lhs: Any, rhs: Any, preferred: Any) -> tuple[str, ...]:
    """The platforms that refuse a ``dot_general`` of ``lhs`` x ``rhs`` operands (dtypes) with ``algorithm``
    and ``preferred_element_type=preferred``, where another platform accepts it (none accepting it: the
    program's own error, left for JAX to report). JAX itself is asked, once per algorithm and dtypes: a 2x2
    dot is lowered for each of :data:`LOWERING_PLATFORMS` (JAX checks the algorithm there: CPU accepts a
    few) and, for this process's own platform, compiled (XLA checks: JAX notes that a TPU refuses
    F16_F16_F32, some GPUs BF16_BF16_F32). A platform the plain dot cannot be lowered for from here is
    not asked."""
    return _refusing(algorithm, *(None if d is None else np.dtype(d) for d in (lhs, rhs, preferred)))


@functools.cache
def _refusing(algorithm: Any, lhs: np.dtype, rhs: np.dtype, preferred: np.dtype | None) -> tuple[str, ...]:
    local = xla_bridge.canonicalize_platform(jax.default_backend())
    operands = [jax.ShapeDtypeStruct((2, 2), d) for d in (lhs, rhs)]

    def builds(platform: str, precision: Any) -> bool:
        def dot(a, b):
            dims = (((1,), (0,)), ((), ()))
            return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=preferred)

        try:
            lowered = jax.jit(dot).trace(*operands).lower(lowering_platforms=(platform,))
            if platform == local:
                lowered.compile()
        except (ValueError, TypeError, NotImplementedError, jax.errors.JaxRuntimeError):
            return False
        return True

    platforms = dict.fromkeys((*LOWERING_PLATFORMS, local))
    accepts = {p: builds(p, algorithm) for p in platforms if builds(p, None)}
    return tuple(p for p, ok in accepts.items() if not ok) if any(accepts.values()) else ()


__all__ = [
    "INLINE_WHILE_TRACING",
    "LOWERING_PLATFORMS",
    "ClosedJaxpr",
    "Jaxpr",
    "Literal",
    "Var",
    "autocast_tracing",
    "convert_constvars_jaxpr",
    "cudnn_version",
    "dot_algorithm",
    "is_differentiated",
    "is_symbolic_zero",
    "jaxpr_as_fun",
    "jaxpr_trace_of",
    "jaxprs_in_params",
    "jit_body",
    "join_bwd_result",
    "made_by_backward_pass",
    "platforms_refusing",
    "producer",
    "producer_inputs",
    "shard_map_body",
    "split_bwd_result",
    "weakref_lru_cache",
    "wrap_init",
]
