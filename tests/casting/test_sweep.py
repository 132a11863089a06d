"""Coverage sweep: autocast must not break real code.

Every case of ``sweep_cases.CASES`` runs under the gpu policy and the covering ones under the cpu policy
(``JAMP_SWEEP_CASES`` below), forward and (where the
float32 function is differentiable) ``jax.grad``, on activations that come out of a matmul (so
they arrive in the compute dtype) mixed with float32 inputs. A case passes when it runs, keeps
integer/bool outputs integer/bool, yields only float16/bfloat16/float32 floats, is finite wherever
float32 is, and is close to float32 evaluated on the same (rounded) inputs. The terminal summary
prints the pass rate (see conftest.py).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import eqns
from sweep_cases import CASES

import jamp
from jamp.casting.oplists import CATEGORIES
from jamp.casting.policy import builtin_policy

FLOATS = {jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
EYE = jnp.eye(8)
DOMAINS = {
    "real": lambda k: 0.8 * jax.random.normal(k, (4, 8)),
    "pos": lambda k: jax.random.uniform(k, (4, 8), minval=0.5, maxval=2.0),
    "unit": lambda k: jax.random.uniform(k, (4, 8), minval=-0.9, maxval=0.9),
    "prob": lambda k: jax.random.uniform(k, (4, 8), minval=0.05, maxval=0.95),
    "gt1": lambda k: jax.random.uniform(k, (4, 8), minval=1.1, maxval=3.0),
}
RTOL = {"float16": 0.02, "bfloat16": 0.06}
# The policies every case runs under; CI's newer-JAX legs set JAMP_SWEEP_DEVICES=gpu (the same primitives
# through the same rules, half the time).
SWEEP_DEVICES = os.environ.get("JAMP_SWEEP_DEVICES", "gpu,cpu").split(",")
# Which cases run under each policy: "all", or "cover": the fewest cases whose programs bind every (primitive,
# parameter names) pair that all the cases bind under the installed JAX (about 70 of 500). By default every case runs
# under the gpu policy and the covering ones under the cpu policy (the same rules, other op lists); CI's newer-JAX
# legs set JAMP_SWEEP_CASES=cover, what depends on JAX's internals.
_CASES_SETTING = os.environ.get("JAMP_SWEEP_CASES", "gpu=all,cpu=cover")
SWEEP_CASES = dict(item.split("=") for item in _CASES_SETTING.split(",")) if "=" in _CASES_SETTING else {}
SWEEP_CASES = {device: SWEEP_CASES.get(device, _CASES_SETTING) for device in SWEEP_DEVICES}
if not set(SWEEP_CASES.values()) <= {"all", "cover"}:
    raise ValueError(f"JAMP_SWEEP_CASES={_CASES_SETTING}: expected 'all', 'cover' or 'gpu=all,cpu=cover'")

# name -> why it cannot pass; each is asserted to still fail (strict xfail), so a fix shows up.
KNOWN_LIMITATIONS: dict[str, str] = {
    "jnp.isclose_self[cpu]": "x * 1.001 rounds to x in bfloat16, so isclose(x, x * 1.001) is True where float32 "
    "says False: a comparison of values computed in low precision inherits its rounding "
    "(torch's autocast behaves the same)",
}


def inputs(domain: str, arity: int) -> list:
    keys = jax.random.split(jax.random.key(7), arity)
    return [DOMAINS[domain](k) for k in keys]


def readout(tree):
    """A scalar from every float output, so grad has something to differentiate."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum(jnp.sum(x.astype(jnp.float32) * jnp.cos(jnp.arange(x.size).reshape(x.shape))) for x in leaves)


def problems(amp, ref, rtol: float) -> list[str]:
    out = []
    amp_leaves, ref_leaves = jax.tree.leaves(amp), jax.tree.leaves(ref)
    if len(amp_leaves) != len(ref_leaves):
        return [f"{len(amp_leaves)} outputs, float32 gives {len(ref_leaves)}"]
    for i, (a, r) in enumerate(zip(amp_leaves, ref_leaves)):
        a, r = np.asarray(a), np.asarray(r)
        if a.shape != r.shape:
            out.append(f"output {i}: shape {a.shape} vs {r.shape}")
            continue
        if not np.issubdtype(r.dtype, np.floating):
            if a.dtype != r.dtype:
                out.append(f"output {i}: dtype {a.dtype}, float32 program gives {r.dtype}")
            elif np.issubdtype(r.dtype, np.complexfloating):
                out.append(f"output {i}: complex") if not np.allclose(a, r, rtol=rtol, atol=rtol) else None
            elif not np.array_equal(a, r):
                out.append(f"output {i}: {np.mean(a != r):.0%} of integer/bool values differ")
            continue
        if a.dtype not in FLOATS:
            out.append(f"output {i}: dtype {a.dtype} is not float16/bfloat16/float32")
            continue
        a32, finite = a.astype(np.float32), np.isfinite(r)
        if not np.isfinite(a32[finite]).all():
            out.append(f"output {i}: non-finite where float32 is finite")
            continue
        scale = max(1.0, float(np.abs(r[finite]).max(initial=0.0)))
        err = np.abs(a32[finite] - r[finite])
        if (err > rtol * (np.abs(r[finite]) + scale)).any():
            out.append(f"output {i}: max error {err.max():.3g} (scale {scale:.3g})")
    return out


def run(fn, arity, domain, device_type):
    xs = inputs(domain, arity)
    policy = jamp.get_policy(device_type)
    low = policy.compute_dtype
    rounded = [xs[0].astype(low).astype(jnp.float32), *xs[1:]]
    amp_fn = jamp.autocast(lambda x0, *rest: fn(x0 @ EYE, *rest), policy=policy)
    ref_fn = lambda x0, *rest: fn(x0 @ EYE, *rest)
    rtol = RTOL[str(low)]

    def program(differentiable: bool):
        """Both sides in one program: one compile per case instead of two. The float32 side is traced
        first, so a float32 function JAX cannot differentiate raises NotDifferentiable before autocast's
        side is traced; once float32 differentiates, autocast must too (strict)."""

        def outputs(f, strict):
            return with_grad(f, strict) if differentiable else lambda *a: (f(*a), None)

        return jax.jit(lambda r, x: (outputs(ref_fn, False)(*r), outputs(amp_fn, True)(*x)))

    try:
        (ref, ref_grad), (amp, amp_grad) = program(True)(rounded, xs)
    except NotDifferentiable:
        (ref, ref_grad), (amp, amp_grad) = program(False)(rounded, xs)
    found = [f"forward: {p}" for p in problems(amp, ref, rtol)]
    if ref_grad is not None:
        found += [f"grad: {p}" for p in problems(amp_grad, ref_grad, 2 * rtol)]
    return found


class NotDifferentiable(Exception):
    pass


def with_grad(fun, strict: bool = False):
    """(outputs, d readout / d inputs); NotDifferentiable where JAX cannot differentiate ``fun``
    (a while_loop with a dynamic trip count, integer-only outputs, ...)."""

    def both(*args):
        grad = jax.grad(lambda *a: readout(fun(*a)))
        try:
            g = grad(*args)
        except Exception as e:
            if strict:
                raise
            raise NotDifferentiable from e
        return fun(*args), g

    return both


def _signature(fn, domain: str, arity: int) -> set:
    """The (primitive, parameter names) pairs a case's program binds, inner jaxprs included."""
    try:
        closed = jax.make_jaxpr(lambda x0, *rest: fn(x0 @ EYE, *rest))(*inputs(domain, arity))
    except Exception:  # a case that does not trace fails when it runs: keep it in the cover
        return {("untraceable", fn)}
    return {(e.primitive.name, tuple(sorted(e.params))) for e in eqns(closed)}


def covering(cases: list) -> list:
    """The cases a greedy set cover picks (in CASES' order) so that their programs bind every pair that all the
    cases' programs bind."""
    signatures = [_signature(fn, domain, arity) for _, fn, domain, arity in cases]
    left, chosen = set().union(*signatures), set()
    while left:
        best = max(range(len(cases)), key=lambda i: len(signatures[i] & left))
        chosen.add(best)
        left -= signatures[best]
    return [case for i, case in enumerate(cases) if i in chosen]


def _params():
    cover = covering(CASES) if "cover" in SWEEP_CASES.values() else []
    for device_type in SWEEP_DEVICES:
        for name, fn, domain, arity in CASES:
            case_id = f"{name}[{device_type}]"
            if SWEEP_CASES[device_type] == "cover" and case_id not in KNOWN_LIMITATIONS:  # a limitation stays checked
                if not any(name == covered for covered, *_ in cover):
                    continue
            marks = (
                [pytest.mark.xfail(strict=True, reason=KNOWN_LIMITATIONS[case_id])]
                if case_id in KNOWN_LIMITATIONS
                else []
            )
            yield pytest.param(fn, domain, arity, device_type, id=case_id, marks=marks)


@pytest.mark.sweep
@pytest.mark.parametrize("fn,domain,arity,device_type", list(_params()))
def test_sweep(fn, domain, arity, device_type):
    found = run(fn, arity, domain, device_type)
    assert not found, "; ".join(found)


def test_sweep_reaches_every_category_of_each_policy():
    """Some case binds a primitive of each category of the op reference (lower, float32, linalg, promote,
    passthrough, default) under each policy the sweep runs, inside loops and bodies included; case names are
    unique, so a failure names one case."""
    bound = set()
    for _, fn, domain, arity in CASES:
        bound |= {e.primitive.name for e in eqns(jax.make_jaxpr(fn)(*inputs(domain, arity)))}
    for device_type in SWEEP_DEVICES:
        policy = builtin_policy(device_type)
        assert {policy.category(name) for name in bound} == set(CATEGORIES), device_type
    names = [name for name, *_ in CASES]
    assert len(names) == len(set(names))
