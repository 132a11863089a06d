"""Two traces of the same code on other dtypes, equation by equation: what the shadows of a
``jamp.lower_precision`` call run.

Autocast evaluates a lower-precision call's function as traced on its compute dtype; the float32 program
a tool compares it with is the function traced on the dtypes the call recorded. The two are the same
code when their equations match one for one, reading the same values, except for conversions only the
low-precision trace has (``jnp.sum`` and friends upcast float16/bfloat16 inputs: the shadow of such a
conversion's output is its input's shadow) and conversions only the float32 trace has that change no
dtype (``weak_type`` only). Bodies of matched higher-order equations are matched the same way.
"""

from __future__ import annotations

from jamp import _jax_compat as jc

# The only equation one trace may have and the other not: its output stands for its input.
_PASS_THROUGH = "convert_element_type"


def _bodies(eqn) -> list:
    """The jaxprs in an equation's parameters (ClosedJaxpr or Jaxpr), in parameter order."""
    return [
        x
        for value in eqn.params.values()
        for x in (value if isinstance(value, tuple) else (value,))
        if isinstance(x, (jc.ClosedJaxpr, jc.Jaxpr))
    ]


def _keeps_dtype(eqn) -> bool:
    """A conversion to its input's own dtype (weak_type aside): the value it stands for is its input's."""
    return eqn.primitive.name == _PASS_THROUGH and eqn.params.get("new_dtype") == getattr(
        eqn.invars[0].aval, "dtype", 0
    )


class _Alignment:
    """Walks two jaxprs' equations together: which variable of ``shadowed`` stands for which of ``walked``."""

    def __init__(self, walked: jc.Jaxpr, shadowed: jc.Jaxpr):
        self.same = {}  # a variable of walked -> the one it stands for (itself, or a pass-through's input's)
        self.of_b = dict(zip((*shadowed.constvars, *shadowed.invars), (*walked.constvars, *walked.invars)))

    def canonical(self, v):
        return self.same.get(v, v)

    def reads_same(self, a, b) -> bool:
        return (len(a.invars), len(a.outvars)) == (len(b.invars), len(b.outvars)) and all(
            self.of_b.get(y) is self.canonical(x) if isinstance(x, jc.Var) else not isinstance(y, jc.Var)
            for x, y in zip(a.invars, b.invars)
        )


def _plan(walked: jc.Jaxpr, shadowed: jc.Jaxpr) -> list | None:
    """[(an equation or body of ``walked``, its counterpart in ``shadowed``, None for a pass-through)], or None
    where the two are other code."""
    if (len(walked.constvars), len(walked.invars), len(walked.outvars)) != (
        len(shadowed.constvars),
        len(shadowed.invars),
        len(shadowed.outvars),
    ):
        return None
    at, plan, rest = _Alignment(walked, shadowed), [(walked, shadowed)], list(shadowed.eqns)
    for a in walked.eqns:
        while rest and _keeps_dtype(rest[0]) and not (rest[0].primitive == a.primitive and at.reads_same(a, rest[0])):
            b = rest.pop(0)  # a conversion only shadowed has, that changes no dtype: skipped
            at.of_b[b.outvars[0]] = at.of_b.get(b.invars[0])
        if rest and rest[0].primitive == a.primitive and at.reads_same(a, rest[0]):
            b = rest.pop(0)
            bodies = list(zip(_bodies(a), _bodies(b)))
            subs = [_plan(getattr(x, "jaxpr", x), getattr(y, "jaxpr", y)) for x, y in bodies]
            if len(bodies) != len(_bodies(a)) or any(sub is None for sub in subs):
                return None
            plan += [(a, b), *bodies, *(p for sub in subs for p in sub)]
            at.of_b.update(zip(b.outvars, a.outvars))
        elif a.primitive.name == _PASS_THROUGH and isinstance(a.invars[0], jc.Var):
            plan.append((a, None))  # a conversion only walked has (jnp upcasts float16 to sum)
            at.same[a.outvars[0]] = at.canonical(a.invars[0])
        else:
            return None
    while rest and _keeps_dtype(rest[0]):
        b = rest.pop(0)
        at.of_b[b.outvars[0]] = at.of_b.get(b.invars[0])
    outs = zip(walked.outvars, shadowed.outvars)
    return (
        plan if not rest and all(at.of_b.get(y) is at.canonical(x) for x, y in outs if isinstance(x, jc.Var)) else None
    )


def pair(observer, walked: jc.Jaxpr, shadowed: jc.Jaxpr) -> bool:
    """Whether ``walked`` and ``shadowed`` are the same code on other dtypes; if so, the observer learns what
    each equation and body of ``walked`` stands for in ``shadowed`` (``Observer.pair``)."""
    plan = _plan(walked, shadowed)
    for a, b in plan or ():
        observer.pair(a, b)
    return plan is not None
