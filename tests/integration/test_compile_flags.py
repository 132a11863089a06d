"""The suite's fast XLA:CPU flags (tests/compile_flags.py) leave the programs users get within reach: a compile with
``as_users()`` makes the optimized program a process without the suite's flags makes."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
from compile_flags import SUITE, as_users
from helpers import run_subprocess

PROGRAM = """
import jax, jax.numpy as jnp

def f(x):  # fusions that XLA:CPU's older and newer emitters group differently
    return jnp.tanh(jnp.exp(x) * x).sum(-1) + jax.nn.logsumexp(x.astype(jnp.float32), -1)

lowered = jax.jit(f).lower(jnp.ones((64, 256), jnp.bfloat16))
"""


def _instructions(text: str) -> list[str]:
    """The optimized program's computations and instructions, without the source locations."""
    lines = [re.sub(r", metadata=\{[^}]*\}", "", line) for line in text.splitlines()]
    return [line for line in lines if re.match(r"\s*(ROOT )?%|\S.* \{$|\}$", line)]


def _compiled(options: dict):
    scope: dict = {}
    exec(PROGRAM, scope)  # the same text the child runs
    return scope["lowered"].compile(options)


def test_as_users_compiles_what_a_process_without_the_suites_flags_compiles():
    users_flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0][2:] not in SUITE)
    child = run_subprocess(PROGRAM + "print(lowered.compile().as_text())", devices=1, env={"XLA_FLAGS": users_flags})
    users = _compiled(as_users())
    assert _instructions(users.as_text()) == _instructions(child)
    if as_users():  # the suite's flags change this program (jaxlib 0.10): the comparison above can fail, and
        fast = _compiled({})  # the program they make computes the same numbers
        assert _instructions(fast.as_text()) != _instructions(child)
        x = jax.random.normal(jax.random.key(0), (64, 256)).astype(jnp.bfloat16)
        assert jnp.array_equal(fast(x), users(x))
