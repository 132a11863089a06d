"""What a user who inspects the scaler's update sees (issue 44, point 4): the wrapped optimizer traced once,
one flat choice per platform, and nothing of another platform's forms left once the step is compiled.

The size of the update's jaxpr against bare Adam's is printed by benchmarks/compile_cost.py, not asserted here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import eqns, lower_for_cuda

import jamp
from jamp.scaling import scale_update, skip
from jamp_kernels import xla

PARAMS = {"w": jnp.ones((3, 4)), "b": jnp.ones(4)}


def _update_jaxpr(tx):
    state = tx.init(PARAMS)
    return jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(PARAMS, state, PARAMS)


def _is_platform_choice(eqn) -> bool:
    return eqn.primitive.name == "cond" and any(p is not None for p in eqn.params.get("branches_platforms") or ())


def test_the_wrapped_optimizer_is_bound_once():
    """Adam takes one square root per leaf: the scaler's update holds Adam's once, not once per skip form."""
    closed = _update_jaxpr(jamp.scaler(optax.adam(1e-3)))
    assert sum(e.primitive.name == "sqrt" for e in eqns(closed)) == len(PARAMS)


def test_no_platform_choice_sits_inside_another():
    """Each platform choice (the check's forms, the skip's reads) is one flat ``lax.platform_dependent``."""
    closed = _update_jaxpr(jamp.scaler(optax.adam(1e-3)))
    choices = [e for e in eqns(closed) if _is_platform_choice(e)]
    assert choices  # the check has a form per platform
    for choice in choices:
        inner = [e for branch in choice.params["branches"] for e in eqns(branch)]
        assert not any(_is_platform_choice(e) for e in inner)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compiles the step for the CPU and reads its program")
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_a_compiled_step_keeps_only_its_platforms_forms(backend, monkeypatch):
    """Lowered for the CPU, the step is the program of the CPU's forms alone: no conditional, no Pallas kernel,
    and the same instructions as with the forms forced (the choice folds away when XLA compiles)."""
    tx = jamp.scaler(optax.adam(1e-3), backend=backend)
    state = tx.init(PARAMS)

    def compiled_text():
        return jax.jit(tx.update).lower(PARAMS, state, PARAMS).compile().as_text()

    def instructions(text):  # the opcodes of the optimized HLO, as a sorted list
        return sorted(re.findall(r" = .*? ([a-z][\w-]*)\(", text))

    chosen = compiled_text()
    assert "conditional(" not in chosen and "__gpu$xla.gpu.triton" not in chosen
    monkeypatch.setattr(skip, "FORM_OF_PLATFORM", {"default": skip.select_where_produced})
    monkeypatch.setattr(xla, "CHECK_OF_PLATFORM", {"default": xla.CHECK_OF_PLATFORM["cpu"]})
    jax.clear_caches()
    assert instructions(compiled_text()) == instructions(chosen)


def test_lowered_for_cuda_the_step_reads_moments_as_computed_and_checks_with_the_kernel():
    """The CUDA program holds the Triton check and no select between the platforms' reads after lowering."""
    tx = jamp.scaler(optax.adam(1e-3))
    state = tx.init(PARAMS)
    text = lower_for_cuda(tx.update, PARAMS, state, PARAMS).as_text()
    assert "triton" in text.lower()


def test_the_scale_rule_is_one_equation_that_transformations_go_through():
    """torch's ``_amp_update_scale_`` is one kernel, and the update shows one ``amp_update_scale`` equation; vmap over
    stacked states gives each state's own rule, and a derivative of the rule is zero (it computes on the scale's bits)."""
    tx = jamp.scaler(optax.sgd(0.1), init_scale=4.0, growth_interval=1)
    closed = _update_jaxpr(tx)
    assert [e.primitive.name for e in closed.jaxpr.eqns].count("amp_update_scale") == 1
    assert sum(e.primitive.name == "amp_update_scale" for e in eqns(closed)) == 1

    states = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(2))
    grads = {"w": jnp.stack([jnp.ones((3, 4)), jnp.full((3, 4), jnp.inf)]), "b": jnp.ones((2, 4))}
    _, new = jax.vmap(lambda g, s: tx.update(g, s))(grads, states)
    assert new.scale.tolist() == [8.0, 2.0] and new.growth_tracker.tolist() == [0, 0]

    state = tx.init(PARAMS)
    rule = lambda scale: scale_update.next_scale(state._replace(scale=scale), jnp.bool_(False))[0]
    assert float(jax.grad(rule)(jnp.float32(4.0))) == 0.0  # as the bits it computes on were before
