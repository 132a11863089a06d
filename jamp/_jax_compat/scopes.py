"""Equations' source information: the user's line, the name stack. A call holding equations re-bound inside
it enters the scopes they share, each equation the rest of its own (so a call's operations keep the names of
the layer they come from). Part of :mod:`jamp._jax_compat`, which re-exports every name here."""

from __future__ import annotations

from jax._src import source_info_util


def scopes(eqn, start: int = 0) -> tuple:
    """``eqn``'s name-stack entries (scopes, transformations) from ``start``, outermost first: hashable."""
    return tuple(eqn.source_info.name_stack.stack[start:])


def common_scopes(eqns) -> int:
    """How many name-stack entries (scopes, transformations) all of ``eqns`` share from the outermost."""
    stacks = [scopes(e) for e in eqns]
    n = 0
    while all(len(s) > n for s in stacks) and len({s[n] for s in stacks}) == 1:
        n += 1
    return n


def scoped_context(eqn, start: int = 0, stop: int | None = None):
    """The source-info context ``jax.core.eval_jaxpr`` binds ``eqn`` under, with its name-stack entries
    ``start:stop`` only (a call holding equations of one scope enters the shared part, each equation inside
    its own rest)."""
    stack = source_info_util.NameStack(eqn.source_info.name_stack.stack[start:stop])
    return source_info_util.user_context(
        eqn.source_info.traceback, name_stack=source_info_util.current_name_stack() + stack
    )


def user_context(eqn):
    """The source-info context ``jax.core.eval_jaxpr`` binds each equation under."""
    return scoped_context(eqn)


def name_stack_str(eqn) -> str:
    return str(eqn.source_info.name_stack)


def current_name_stack() -> str:
    """The name scopes entered at this point of a trace ('outer/inner'), as ``name_stack_str`` spells them."""
    return str(source_info_util.current_name_stack())


def hide_from_source_info(path: str) -> None:
    """Equations traced from the file ``path`` point to their caller's line, as JAX's own do (``jamp.explain``'s
    source column, the locations in lowered programs)."""
    source_info_util.register_exclusion(path)


def source_location(eqn) -> str:
    """'file.py:12 (fn)' of the user code that created ``eqn``, or '' when unknown."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})" if frame else ""


def source_lines(eqn) -> tuple:
    """(file, line) of each user frame that created ``eqn``, innermost first: hashable."""
    return tuple((f.file_name, f.start_line) for f in source_info_util.user_frames(eqn.source_info.traceback))


def transposed(eqn) -> bool:
    """Whether reverse-mode differentiation (a transpose) emitted ``eqn``."""
    return any(
        isinstance(t, source_info_util.Transform) and t.name == "transpose"
        for t in getattr(eqn.source_info.name_stack, "stack", ())
    )


__all__ = [
    "common_scopes",
    "current_name_stack",
    "hide_from_source_info",
    "name_stack_str",
    "scoped_context",
    "scopes",
    "source_lines",
    "source_location",
    "transposed",
    "user_context",
]
