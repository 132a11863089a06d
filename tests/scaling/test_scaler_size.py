"""The scaler's share of the program it is compiled into (issue 38): counted, not timed.

``jamp.scaler(adam)``'s step against bare Adam's (Adam with the unscale by a constant fused in, as in
benchmarks/compile_cost.py, which prints the same ratios and the compile times): instructions of the
optimized HLO that XLA:CPU compiles, and operations of the StableHLO lowered for CUDA (no GPU needed).
Before issue 38 the ratios were 3.69 (CPU, 40 leaves), 2.33 (CUDA, 40 leaves) and 1.87 (CUDA, GPT-2 small).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from compile_flags import as_users
from helpers import lower_for_cuda

import jamp

SCALE = 1024.0


def _dense(n_in: int, n_out: int) -> dict:
    return {"kernel": (n_in, n_out), "bias": (n_out,)}


def _block(d: int) -> dict:
    return {
        "ln_1": {"scale": (d,), "bias": (d,)},
        "attn": _dense(d, 3 * d),
        "proj": _dense(d, d),
        "mlp": {"c_fc": _dense(d, 4 * d), "c_proj": _dense(4 * d, d)},
    }


def forty_leaves(d: int = 256) -> dict:
    return {str(i): _block(d) for i in range(4)}


def gpt2_small(d: int = 768) -> dict:  # 148 leaves, as benchmarks/scaler_overhead.py's
    norm = {"scale": (d,), "bias": (d,)}
    return {"wte": (50257, d), "wpe": (1024, d), "h": {str(i): {**_block(d), "ln_2": norm} for i in range(12)}}


def _args(tx, shapes):
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(n, int) for n in x)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=is_shape)
    return params, jax.eval_shape(tx.init, params), params


def _steps():
    adam, scaler = optax.adam(1e-3), jamp.scaler(optax.adam(1e-3), init_scale=SCALE)

    def bare(params, state, grads):
        updates, state = adam.update(jax.tree.map(lambda g: g * (1.0 / SCALE), grads), state, params)
        return optax.apply_updates(params, updates), state

    def scaled(params, state, grads):
        updates, state = scaler.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return (adam, bare), (scaler, scaled)


def _hlo_instructions(tx, step, shapes) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # donated buffers that nothing runs with
        text = jax.jit(step, donate_argnums=(0, 1)).lower(*_args(tx, shapes)).compile(as_users()).as_text()
    return sum(1 for line in text.splitlines() if re.match(r"\s+(ROOT )?%\S+ = ", line))


def _cuda_operations(tx, step, shapes) -> int:
    text = lower_for_cuda(step, *_args(tx, shapes)).as_text()
    return sum(1 for line in text.splitlines() if re.match(r"\s+(%\S+ = |return |stablehlo\.return )", line))


def _ratio(count, shapes) -> float:
    (bare_tx, bare), (scaler_tx, scaled) = _steps()
    return count(scaler_tx, scaled, shapes) / count(bare_tx, bare, shapes)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="counts XLA:CPU's optimized HLO")
def test_cpu_optimized_hlo_of_a_40_leaf_step_is_at_most_2_8_times_bare_adams():
    """The scalars of the scale once instead of in every loop, one product in the scale rule, one reduction
    for the check's loops (3.69 before; 2.40-2.55 on jax 0.10-0.12)."""
    assert _ratio(_hlo_instructions, forty_leaves()) <= 2.8


@pytest.mark.parametrize(("tree", "most"), [(forty_leaves, 1.6), (gpt2_small, 1.25)])
def test_program_lowered_for_cuda_is_at_most_the_goal_times_bare_adams(tree, most):
    """Scalars broadcast once per shape, selects without jnp.where's calls, a smaller exact product (2.33 and
    1.87 before; 1.48 and 1.23 after). GPT-2 small's tree meets issue 38's goal of 1.25; 40 leaves do not:
    what a skippable step needs per leaf (four selects) and once (the scale rule) weighs more there."""
    assert _ratio(_cuda_operations, tree()) <= most
