"""What the skipped-steps report costs a small training step, called through ``jax.jit`` and AOT-compiled, and what
a flatten of the scaler's state costs beside an optax state's.

A small MLP (three 64-wide layers, batch 32) trained with Adam, each variant a whole step (forward, backward,
update) with params and optimizer state donated:

  bare adam        optax.adam, gradients of the plain loss
  scaler, off      jamp.scaler(adam, warn_after_skips=None, warn_below_scale=None): no episode counted, and
                   nothing read on the host
  scaler           jamp.scaler(adam): the default, the report on (episodes counted in the step; the host reads
                   nothing unless asked: jamp.get_scale / scaler_summary / report_skipped_steps)

Each is called through ``jax.jit`` and through ``jax.jit(step).lower(...).compile()`` (the AOT executable,
whose C++ dispatch path a host callback in the program would have disabled), on finite data and on data with a
NaN (every step skipped, so an episode is under way). Rounds interleave the
variants; each round times ``--calls`` calls of each; the ratios are taken within a round and their median and
interquartile range printed, so machine load hits all variants alike. ``--clock process`` times with the
process's CPU time (``time.process_time``: every thread of this process, XLA's included) instead of wall time:
on a machine shared with other jobs it counts this process's work only. Goal (issue 36): scaler / scaler-off
within 1.05 through both paths.

The flatten rows time ``jax.tree.leaves`` of the scaler's state around Adam's and of a NamedTuple with the same
fields (what an optax state is): JAX flattens every argument on every dispatch. Goal (issue 43): the same cost.

    python benchmarks/skip_report_cost.py [--rounds 15] [--calls 200] [--clock wall|process]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import optax

import jamp

SIZES = (64, 64, 64, 10)
BATCH = 32


def init_params(key: jax.Array) -> dict:
    keys = jax.random.split(key, len(SIZES) - 1)
    return {
        f"layer{i}": {"w": jax.random.normal(k, (a, b)) / a**0.5, "b": jnp.zeros(b)}
        for i, (k, a, b) in enumerate(zip(keys, SIZES[:-1], SIZES[1:]))
    }


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    for i in range(len(SIZES) - 1):
        layer = params[f"layer{i}"]
        x = x @ layer["w"] + layer["b"]
        x = jax.nn.relu(x) if i < len(SIZES) - 2 else x
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()


def make_step(tx: optax.GradientTransformation, scaled: bool):
    def step(params, opt_state, x, y):
        if scaled:
            grads = jax.grad(lambda p: jamp.scale(loss_fn(p, x, y), opt_state))(params)
        else:
            grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


VARIANTS = {
    "bare adam": lambda: (optax.adam(1e-3), False),
    "scaler, off": lambda: (jamp.scaler(optax.adam(1e-3), warn_after_skips=None, warn_below_scale=None), True),
    "scaler": lambda: (jamp.scaler(optax.adam(1e-3)), True),
}


def build(data: tuple) -> dict:
    """(variant, path) -> [call, params, opt_state], each with buffers of its own."""
    runs = {}
    for name, make in VARIANTS.items():
        tx, scaled = make()
        for path in ("jit", "aot"):
            params = init_params(jax.random.key(0))
            state = tx.init(params)
            jitted = jax.jit(make_step(tx, scaled), donate_argnums=(0, 1))
            call = jitted if path == "jit" else jitted.lower(params, state, *data).compile()
            runs[name, path] = [call, params, state]
    return runs


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def time_calls(run: list, data: tuple, calls: int, clock=time.perf_counter) -> float:
    call, params, state = run
    jax.block_until_ready(params)
    start = clock()
    for _ in range(calls):
        params, state = call(params, state, *data)
    jax.block_until_ready(params)
    run[1], run[2] = params, state
    return (clock() - start) / calls


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return q1, statistics.median(xs), q3


def measure(data: tuple, rounds: int, calls: int, clock) -> dict:
    runs = build(data)
    for run in runs.values():  # warm: compiled, caches filled
        time_calls(run, data, 5)
    times = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            times[key].append(time_calls(run, data, calls, clock))
    return times


def flatten_cost(rounds: int, calls: int, clock) -> tuple[float, float]:
    """Median microseconds of ``jax.tree.leaves`` of a ScalerState around Adam's state, and of a plain
    NamedTuple holding the same fields, interleaved round by round."""
    state = jamp.scaler(optax.adam(1e-3)).init(init_params(jax.random.key(0)))
    plain = collections.namedtuple("Plain", jamp.ScalerState._fields)(*state)
    times: dict[str, list[float]] = {"scaler": [], "plain": []}
    for _ in range(rounds):
        for name, tree in (("scaler", state), ("plain", plain)):
            start = clock()
            for _ in range(calls * 10):
                jax.tree.leaves(tree)
            times[name].append((clock() - start) / (calls * 10) * 1e6)
    return statistics.median(times["scaler"]), statistics.median(times["plain"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=jamp.SkippedStepsWarning)  # the NaN rows skip on purpose
    x = jax.random.normal(jax.random.key(1), (BATCH, SIZES[0]))
    y = jax.random.randint(jax.random.key(2), (BATCH,), 0, SIZES[-1])
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {args.rounds} rounds of {args.calls} calls, "
        f"{args.clock} time"
    )
    print(
        f"{'data':8} {'path':4} {'bare adam us':>13} {'scaler off us':>14} {'scaler us':>10}"
        f" {'scaler / off (IQR)':>22} {'scaler / bare':>14}"
    )
    worst = 0.0
    for label, data in (("finite", (x, y)), ("NaN", (x.at[0, 0].set(jnp.nan), y))):
        times = measure(data, args.rounds, args.calls, CLOCKS[args.clock])
        for path in ("jit", "aot"):
            bare, off, on = (times[name, path] for name in VARIANTS)
            q1, ratio, q3 = quartiles([a / b for a, b in zip(on, off)])
            worst = max(worst, ratio)
            print(
                f"{label:8} {path:4} {statistics.median(bare) * 1e6:13.1f} {statistics.median(off) * 1e6:14.1f}"
                f" {statistics.median(on) * 1e6:10.1f} {ratio:9.3f} ({q1:.3f}-{q3:.3f})"
                f" {statistics.median([a / b for a, b in zip(on, bare)]):14.3f}"
            )
    print(
        f"goal: scaler / scaler-off <= 1.05 on every row: {'met' if worst <= 1.05 else 'NOT met'} (worst {worst:.3f})"
    )
    scaler_us, plain_us = flatten_cost(args.rounds, args.calls, CLOCKS[args.clock])
    print(
        f"flatten: ScalerState {scaler_us:.2f} us, a NamedTuple of the same fields {plain_us:.2f} us, "
        f"ratio {scaler_us / plain_us:.2f}"
    )


if __name__ == "__main__":
    main()
