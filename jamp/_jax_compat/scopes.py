"""Name stacks of equations re-bound inside a call: the call enters the scopes its equations share, each
equation the rest of its own (so a call's operations keep the names of the layer they come from)."""

from __future__ import annotations

from jax._src import source_info_util


def common_scopes(eqns) -> int:
    """How many name-stack entries (scopes, transformations) all of ``eqns`` share from the outermost."""
    stacks = [e.source_info.name_stack.stack for e in eqns]
    n = 0
    while all(len(s) > n for s in stacks) and len({s[n] for s in stacks}) == 1:
        n += 1
    return n


def scoped_context(eqn, start: int = 0, stop: int | None = None):
    """``user_context`` with ``eqn``'s name-stack entries ``start:stop`` only (a call holding equations of
    one scope enters the shared part, each equation inside its own rest)."""
    stack = source_info_util.NameStack(eqn.source_info.name_stack.stack[start:stop])
    return source_info_util.user_context(
        eqn.source_info.traceback, name_stack=source_info_util.current_name_stack() + stack
    )
