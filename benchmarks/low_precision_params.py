"""Cost of an optimizer step on bfloat16 parameters: Kahan summation and stochastic rounding against plain Adam.

The step is ``tx.update`` + ``optax.apply_updates`` under ``jax.jit`` with parameters and optimizer state
donated, on 20M parameters in 20 leaves (``--small``: 2M). Variants, side by side in one run:

  float32 Adam                  AMP's optimizer step: float32 masters and float32 moments
  bfloat16 Adam, nearest        bfloat16 parameters and moments, plain apply_updates
  kahan / kahan, f32 state      jamp.kahan_summation(adam) [state_dtype=float32]
  stochastic / ..., f32 state   jamp.stochastic_rounding(adam) [state_dtype=float32]

Steps are timed in interleaved rounds and the median is reported with its ratio to the float32 step. The
memory columns come from ``compiled.memory_analysis()`` of the step, per parameter: the bytes its
arguments hold (parameters, optimizer state, gradients) and its temporaries. On a CPU bfloat16 arithmetic
is emulated in float32, so the times say little about a GPU, where the step is memory-bound and the bytes
moved decide.

    python benchmarks/low_precision_params.py [--small] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jamp

F32 = jnp.float32
VARIANTS = {  # name -> (parameter dtype, optimizer)
    "float32 Adam (AMP's masters)": (jnp.float32, lambda adam: adam),
    "bfloat16 Adam, round to nearest": (jnp.bfloat16, lambda adam: adam),
    "bfloat16 + kahan_summation": (jnp.bfloat16, jamp.kahan_summation),
    "bfloat16 + kahan_summation, state_dtype=float32": (
        jnp.bfloat16,
        lambda adam: jamp.kahan_summation(adam, state_dtype=F32),
    ),
    "bfloat16 + stochastic_rounding": (jnp.bfloat16, jamp.stochastic_rounding),
    "bfloat16 + stochastic_rounding, state_dtype=float32": (
        jnp.bfloat16,
        lambda adam: jamp.stochastic_rounding(adam, state_dtype=F32),
    ),
}


def make_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def timed(run, grads):
    t0 = time.perf_counter()
    run[1], run[2] = jax.block_until_ready(run[0](run[1], run[2], grads))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="2M parameters instead of 20M (a quick run)")
    ap.add_argument("--rounds", type=int, default=9, help="timed steps per variant (median reported)")
    args = ap.parse_args()
    n_leaves, rows = 20, (100 if args.small else 1000)
    n_params = n_leaves * rows * 1000
    key = jax.random.key(0)
    master = [jax.random.normal(k, (rows, 1000)) for k in jax.random.split(key, n_leaves)]
    grads32 = [
        1e-3 * jax.random.normal(k, (rows, 1000)) for k in jax.random.split(jax.random.fold_in(key, 1), n_leaves)
    ]
    adam = optax.adam(1e-3)

    runs, memory = {}, {}
    for name, (dtype, wrap) in VARIANTS.items():
        tx = wrap(adam)
        params, grads = [p.astype(dtype) for p in master], [g.astype(dtype) for g in grads32]
        state = tx.init(params)
        compiled = make_step(tx).lower(params, state, grads).compile()
        mem = compiled.memory_analysis()
        memory[name] = (mem.argument_size_in_bytes / n_params, mem.temp_size_in_bytes / n_params)
        runs[name] = [compiled, params, state, grads]
    for run in runs.values():  # warm up
        timed(run, run[3])

    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(timed(run, run[3]) * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    floor = med["float32 Adam (AMP's masters)"]
    print(
        f"{n_params / 1e6:.0f}M parameters in {n_leaves} leaves, Adam, jit + donation, median of "
        f"{args.rounds} interleaved steps, {jax.devices()[0].device_kind}"
    )
    print("| variant | step ms | / float32 | argument bytes per parameter | temporary bytes per parameter |")
    print("|---|---|---|---|---|")
    for name, ms in med.items():
        print(f"| {name} | {ms:.2f} | {ms / floor:.2f} | {memory[name][0]:.2f} | {memory[name][1]:.2f} |")


if __name__ == "__main__":
    main()
