"""Whether an autocast is tracing its function, and under which policy.

While ``jamp.autocast`` traces the user's function, nested autocasts become region markers,
``jamp.custom_fwd`` casts its inputs and ``jamp.lower_precision`` records its call in the region's dtype
(:mod:`jamp.casting.lower_precision`). What they see here is the tracing autocast's policy and
mode; the regions entered since are on JAX's name stack.

JAX caches the trace of a ``jax.jit`` function per argument types and per its trace context, so the
state is also part of that context: a jitted function traced while an autocast traces its caller (with
jamp's casts in it) is never reused outside autocast, and one traced outside is never reused inside.
"""

from __future__ import annotations

import threading

from jamp import _jax_compat as jc
from jamp.casting import regions
from jamp.casting.policy import Mode, Policy

_state = threading.local()


def _stack() -> list[tuple[Policy, str]]:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def tracing_depth() -> int:
    """How many autocast traces enclose this point (0: none, the code runs as written)."""
    return len(_stack())


class Tracing:
    """Marks that an autocast traces a function under ``policy`` in region ``mode``."""

    def __init__(self, policy: Policy, mode: Mode = Mode.AUTOCAST):
        self._region = (policy, mode)
        self._jax_context = jc.autocast_tracing()

    def __enter__(self) -> None:
        _stack().append(self._region)
        self._jax_context.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._jax_context.__exit__(*exc)
        _stack().pop()


def traced_region() -> tuple[Policy, str]:
    """The (policy, mode) in force here while an autocast traces: the tracing autocast's, descended through
    the name scopes entered since (nested autocast markers, region rules). Inside a jitted function JAX
    starts a fresh name stack, so regions entered outside it are not seen; the interpreter, which sees the
    whole path, has the last word (:mod:`jamp.casting.rules.lower_precision`)."""
    policy, mode = _stack()[-1]
    return regions.resolve(policy, mode, (), regions.components(jc.current_name_stack()))
