"""The one loop that re-binds a jaxpr's equations, and how it reads them: part of :mod:`jamp._jax_compat`,
which re-exports every name here.

``jax.core.eval_jaxpr`` binds each equation inside its source information (traceback and name stack),
inside the context managers the equation recorded (``eqn.ctx``), with the parameters its primitive binds
(``get_bind_params``). Every jamp loop that evaluates a jaxpr (autocast's interpreter, the replay under
``grad``, recompute's checkpointed groups, ``jamp.find_overflow``'s float32 program) goes through
:func:`evaluate` or :func:`run` here, each with its own per-equation ``hook``, so the equations are bound
the same way everywhere and literals are read one way (:func:`literal_value`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from jamp._jax_compat.scopes import scoped_context

Hook = Callable[[Any, list], list]  # (equation, its input values) -> its output values, a list


def literal_value(v: jcore.Literal) -> Any:
    """A jaxpr literal's value, with a dtype: jaxprs keep a Python bool (``jnp.array(False)``) or int as it is,
    and rules, output casts and the tools all ask a value for its dtype."""
    return v.val if hasattr(v.val, "dtype") else np.asarray(v.val, v.aval.dtype)


def read(env: dict, v: Any) -> Any:
    """The value of the atom ``v`` (a variable in ``env``, or a literal) in an evaluation."""
    return literal_value(v) if isinstance(v, jcore.Literal) else env[v]


@contextlib.contextmanager
def equation_context(eqn: jcore.JaxprEqn, scopes: int = 0):
    """What ``eqn`` is bound inside: its source information, its name-stack entries after the first ``scopes``
    (entered by a call that holds it), and the context managers it recorded (``eqn.ctx``)."""
    with scoped_context(eqn, scopes), eqn.ctx.manager:
        yield


def bind_params(eqn: jcore.JaxprEqn, **updates: Any) -> dict:
    """The parameters ``eqn``'s primitive binds with (``get_bind_params``), ``updates`` replacing some."""
    return eqn.primitive.get_bind_params({**eqn.params, **updates})


def bind(eqn: jcore.JaxprEqn, invals: Sequence, **updates: Any) -> list:
    """``eqn``'s primitive bound on ``invals`` (with ``updates`` to its parameters); its outputs as a list."""
    return bind_primitive(eqn.primitive, invals, {**eqn.params, **updates})


def bind_primitive(primitive: jcore.Primitive, invals: Sequence, params: dict) -> list:
    """``primitive`` bound on ``invals`` with the parameters an equation of it records; its outputs as a list."""
    outs = bind_as(primitive, invals, primitive.get_bind_params(params))
    return list(outs) if primitive.multiple_results else [outs]


def bind_as(primitive: jcore.Primitive, invals: Sequence, params: dict) -> Any:
    """``primitive`` bound on ``invals`` with ``params`` already in the form it binds with (:func:`bind_params`);
    its result as the primitive returns it (a list for a primitive of several results)."""
    return primitive.bind(*invals, **params)


def run(eqns: Iterable[jcore.JaxprEqn], env: dict, hook: Hook = bind, scopes: int = 0) -> None:
    """Evaluate ``eqns`` in order on the values in ``env`` (variable -> value), writing their outputs there:
    each is ``hook(eqn, invals)``, called inside :func:`equation_context`."""
    for eqn in eqns:
        with equation_context(eqn, scopes):
            outs = hook(eqn, [read(env, v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))


def evaluate(jaxpr: jcore.Jaxpr, consts: Sequence, args: Sequence, hook: Hook = bind, env: dict | None = None) -> list:
    """The outputs of ``jaxpr`` on ``args`` (``jax.core.eval_jaxpr``), every equation evaluated by ``hook``
    (default: bound as recorded); ``env`` is the evaluation's environment, when the caller keeps one."""
    env = {} if env is None else env
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    run(jaxpr.eqns, env, hook)
    return [read(env, v) for v in jaxpr.outvars]


__all__ = [
    "Hook",
    "bind",
    "bind_as",
    "bind_params",
    "bind_primitive",
    "equation_context",
    "evaluate",
    "literal_value",
    "read",
    "run",
]
