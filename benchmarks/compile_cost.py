"""Program size and compile time of ``jamp.scaler(adam)``'s step against bare Adam's (issue 38).

Two parameter trees (float32, shapes only: nothing is allocated, so GPT-2 small's 124M parameters cost no
memory), each step ``jax.jit``-ed with params and optimizer state donated, as in
benchmarks/scaler_overhead.py:

  40 leaves      four transformer blocks of d=256: LayerNorm scale and bias, qkv 256x768 + bias, proj
                 256x256 + bias, MLP 256x1024 + bias and 1024x256 + bias (mixed 1-D and 2-D shapes)
  GPT-2 small    the real tree of GPT-2 small (148 leaves, benchmarks/scaler_overhead.py's gpt2_small)

Bare Adam is scaler_overhead.py's baseline: Adam with the unscale (times a constant) fused in, what any
scaler's step must at least hold. The scaler is the default ``jamp.scaler(optax.adam(1e-3))``.

For each it prints the optimized HLO that XLA:CPU compiles (``.compile().as_text()``: lines and
instructions), the StableHLO of the program lowered for "cuda" without a device
(``jax.jit(step).trace(...).lower(lowering_platforms=("cuda",))``, through the tests' ``lower_for_cuda``,
which lets jax >= 0.11 lower the Triton kernel on a host without a GPU: lines and operations) and the XLA:CPU
compile time (``--repeats`` interleaved rounds, each compiling a freshly traced and lowered step of both,
so no cache answers; the median of the rounds' ratios), then the scaler's ratio to bare Adam against the
goal of 1.25 with "met"/"not met". First, the equations of the update's jaxpr (what ``jax.make_jaxpr(tx.update)``
shows, inner jaxprs included) on a 2-leaf tree and on GPT-2 small's, against issue 44's goal of 6x bare Adam's.

    python benchmarks/compile_cost.py [--trees 40,gpt2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jex_core
from scaler_overhead import SCALE, gpt2_small, is_shape

# the tests' CUDA lowering from any host (tests/helpers.py: a patch of JAX's Pallas GPU registry, never jamp's)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers import lower_for_cuda

import jamp

GOAL = 1.25


def forty_leaves(d: int = 256) -> dict:
    """Four blocks of ten leaves each: LayerNorm vectors, attention and MLP kernels with their biases."""

    def dense(n_in, n_out):
        return {"kernel": (n_in, n_out), "bias": (n_out,)}

    def block():
        return {
            "ln": {"scale": (d,), "bias": (d,)},
            "qkv": dense(d, 3 * d),
            "proj": dense(d, d),
            "fc": dense(d, 4 * d),
            "out": dense(4 * d, d),
        }

    return {f"block{i}": block() for i in range(4)}


TREES = {"40": ("40 leaves (4 blocks, d=256)", forty_leaves), "gpt2": ("GPT-2 small (148 leaves)", gpt2_small)}


def bare_step(tx: optax.GradientTransformation) -> Callable:
    def step(params, state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g * (1.0 / SCALE), grads), state, params)
        return optax.apply_updates(params, updates), state

    return step


def scaler_step(tx: optax.GradientTransformation) -> Callable:
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


VARIANTS = {
    "bare Adam": lambda: (optax.adam(1e-3), bare_step),
    "jamp.scaler(adam)": lambda: (jamp.scaler(optax.adam(1e-3), init_scale=SCALE), scaler_step),
}


def hlo_size(text: str) -> tuple[int, int]:
    """(lines, instructions) of an optimized HLO module's text: an instruction is a line that names one."""
    lines = text.splitlines()
    return len(lines), sum(1 for line in lines if re.match(r"\s+(ROOT )?%\S+ = ", line))


def stablehlo_size(text: str) -> tuple[int, int]:
    """(lines, operations) of a StableHLO module's text: an operation is a line that defines a value, or a
    ``return``/``stablehlo.return``."""
    lines = text.splitlines()
    return len(lines), sum(1 for line in lines if re.match(r"\s+(%\S+ = |return |stablehlo\.return )", line))


class Variant:
    """One step of one tree: its arguments' shapes, a fresh trace on demand, and what was compiled last."""

    def __init__(self, shapes, make: Callable):
        self.tx, self.step_of = make()
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=is_shape)
        self.args = (params, jax.eval_shape(self.tx.init, params), params)
        self.compiled = None

    def compile_s(self) -> float:
        """XLA:CPU's compile time of a new function's step: nothing cached answers the trace or the compile."""
        lowered = jax.jit(self.step_of(self.tx), donate_argnums=(0, 1)).trace(*self.args).lower()
        start = time.perf_counter()
        self.compiled = lowered.compile()
        return time.perf_counter() - start

    def cuda_text(self) -> str:
        return lower_for_cuda(self.step_of(self.tx), *self.args).as_text()  # jit(...).trace(...).lower(...)


def measure(shapes, repeats: int) -> dict:
    """Sizes, and compile times in interleaved rounds (bare Adam, then the scaler): the ratio is taken
    within each round and its median kept, so a machine whose load drifts slows both alike."""
    variants = {name: Variant(shapes, make) for name, make in VARIANTS.items()}
    times: dict = {name: [] for name in variants}
    for _ in range(repeats):
        for name, variant in variants.items():
            times[name].append(variant.compile_s())
    bare, amp = times["bare Adam"], times["jamp.scaler(adam)"]
    return {
        "sizes": {
            name: {"cpu_hlo": hlo_size(v.compiled.as_text()), "cuda_stablehlo": stablehlo_size(v.cuda_text())}
            for name, v in variants.items()
        },
        "compile_s": (statistics.median(bare), statistics.median(amp)),
        "compile_ratio": statistics.median(a / b for a, b in zip(amp, bare)),
    }


def verdict(ratio: float, goal: float = GOAL) -> str:
    return "met" if ratio <= goal else "not met"


JAXPR_GOAL = 6.0  # issue 44: the scaler's update at most 6x bare Adam's equations on a 2-leaf tree


def equations(jaxpr) -> int:
    """Equations of a jaxpr, those of every jaxpr inside its equations included (branches, calls, kernels)."""
    return sum(1 + sum(equations(sub) for sub in jex_core.jaxprs_in_params(e.params)) for e in jaxpr.eqns)


def update_equations(tx: optax.GradientTransformation, shapes) -> int:
    """What a user's ``jax.make_jaxpr(tx.update)`` shows, counted by :func:`equations`."""
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=is_shape)
    state = jax.eval_shape(tx.init, params)
    return equations(jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(params, state, params).jaxpr)


def print_jaxpr_sizes() -> None:
    """The update's jaxpr: bare Adam's, optax.apply_if_finite(adam)'s and jamp.scaler(adam)'s."""
    print()
    print(
        f"| tree | update's jaxpr, equations | bare Adam | optax.apply_if_finite | jamp.scaler | ratio | goal {JAXPR_GOAL:g} |"
    )
    print("|---|---|---|---|---|---|---|")
    for title, shapes in [("2 leaves (3x4, 4)", {"w": (3, 4), "b": (4,)}), TREES["gpt2"]]:
        shapes = shapes() if callable(shapes) else shapes
        adam, finite, amp = (
            update_equations(tx, shapes)
            for tx in (optax.adam(1e-3), optax.apply_if_finite(optax.adam(1e-3), 5), jamp.scaler(optax.adam(1e-3)))
        )
        print(
            f"| {title} | recursive | {adam} | {finite} | {amp} | {amp / adam:.2f}x | {verdict(amp / adam, JAXPR_GOAL)} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="40,gpt2", help=f"comma-separated, from {sorted(TREES)}")
    ap.add_argument("--repeats", type=int, default=7, help="rounds of compiles (the median is printed)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # donation warnings: nothing runs
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; goal: the scaler's step / bare Adam's <= {GOAL}")
    print_jaxpr_sizes()
    rows = []
    for key in args.trees.split(","):
        title, shapes = TREES[key]
        got = measure(shapes(), args.repeats)
        bare, amp = got["sizes"]["bare Adam"], got["sizes"]["jamp.scaler(adam)"]
        for what, label, unit in [
            ("cpu_hlo", "CPU optimized HLO", "instructions"),
            ("cuda_stablehlo", 'StableHLO lowered for "cuda"', "operations"),
        ]:
            (bl, bo), (sl, so) = bare[what], amp[what]
            rows.append((title, f"{label}, lines", bl, sl, sl / bl))
            rows.append((title, f"{label}, {unit}", bo, so, so / bo))
        rows.append((title, "XLA:CPU compile, s (median of rounds)", *got["compile_s"], got["compile_ratio"]))
    print()
    print("| tree | measure | bare Adam | jamp.scaler(adam) | ratio | goal 1.25 |")
    print("|---|---|---|---|---|---|")
    for title, what, b, s, r in rows:
        fmt = "{:.2f}" if isinstance(b, float) else "{}"
        print(f"| {title} | {what} | {fmt.format(b)} | {fmt.format(s)} | {r:.2f}x | {verdict(r)} |")


if __name__ == "__main__":
    main()
