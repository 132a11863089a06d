"""The rule table: primitive name -> rule for higher-order primitives, category -> rule otherwise."""

from __future__ import annotations

from jamp import _jax_compat as jc
from jamp.casting.regions import EFFECTIVE_RULE, LeafRule
from jamp.casting.rules import calls, control_flow, custom_ad, gathers, leaf, shard_map

HIGHER_ORDER_RULES = {
    jc.JIT: calls.jit,
    jc.REMAT: calls.remat,
    jc.SCAN: control_flow.scan,
    jc.WHILE: control_flow.while_loop,
    jc.COND: control_flow.cond,
    jc.CUSTOM_JVP: custom_ad.custom_jvp,
    jc.CUSTOM_VJP: custom_ad.custom_vjp,
    jc.SHARD_MAP: shard_map.shard_map,
}

LEAF_RULES = {
    LeafRule.LOWER: leaf.lower,
    LeafRule.FLOAT32: leaf.float32,
    LeafRule.PROMOTE: leaf.promote,
    LeafRule.PASSTHROUGH: leaf.passthrough,
    LeafRule.DEFAULT: leaf.default,
    LeafRule.LOWER_FLOAT32_OUTPUT: leaf.lower_float32_output,
}
# Data movement that runs on the compute dtype where only matmuls read what it moves (in place of passthrough).
MOVING_RULES = {
    **dict.fromkeys(gathers.GATHERS, gathers.gather),
    **dict.fromkeys(gathers.REARRANGING, gathers.rearrange),
}
# A policy with fp8 on swaps the `lower` rule for one that runs eligible matmuls in float8.
FP8_LEAF_RULES = {**LEAF_RULES, LeafRule.LOWER: leaf.lower_fp8}


def select_rule(eqn, ctx):
    """(rule, effective leaf category) for an equation in a resolved context."""
    name = eqn.primitive.name
    if name in HIGHER_ORDER_RULES:
        return HIGHER_ORDER_RULES[name], name
    effective = EFFECTIVE_RULE[ctx.mode][ctx.policy.category(name)]
    if effective == LeafRule.PASSTHROUGH and name in MOVING_RULES:
        return MOVING_RULES[name], effective
    return (FP8_LEAF_RULES if ctx.policy.fp8 else LEAF_RULES)[effective], effective
