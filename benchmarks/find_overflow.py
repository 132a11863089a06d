"""jamp.find_overflow against what it compares: one autocast pass plus one float32 pass.

The model is benchmarks/autocast_overhead.py's decoder-only transformer (2 layers, d_model 64 by
default). Two functions are checked: the loss (forward) and ``jax.value_and_grad(loss)`` (a training
step). For each, two figures, as ratios to the sum of ``jax.jit(jamp.autocast(f))`` and ``jax.jit(f)``:

  first call   find_overflow's first call (trace, compile, run) / the two jits' first calls
  repeat call  a call with the same argument types (compile excluded) / a call of each compiled jit

Repeat calls are timed in interleaved rounds, so drifting machine load hits both sides alike; the
median is reported.

    python benchmarks/find_overflow.py                  # 2 layers, d_model 64, batch 4 x 32
    python benchmarks/find_overflow.py --layers 4 --rounds 15
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
from autocast_overhead import (  # benchmarks/, the script's directory
    SMALL,
    Config,
    Decoder,
    make_loss,
)

import jamp


def seconds(fn: Callable, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def measure(name: str, make: Callable[[], Callable], args: tuple, rounds: int) -> None:
    """Print find_overflow's first and repeat call against the two jitted passes' for ``make()``."""
    check = jamp.find_overflow(make(), device_type="gpu")
    amp, ref = jax.jit(jamp.autocast(make(), device_type="gpu")), jax.jit(make())
    first = (seconds(check, *args), seconds(amp, *args) + seconds(ref, *args))
    finding = check(*args)
    repeat_check, repeat_passes = [], []
    for _ in range(rounds):
        repeat_check.append(seconds(check, *args))
        repeat_passes.append(seconds(amp, *args) + seconds(ref, *args))
    repeat = (statistics.median(repeat_check), statistics.median(repeat_passes))
    print(
        f"{name:14s} first call {first[0]:7.2f} s vs {first[1]:6.2f} s ({first[0] / first[1]:5.2f}x)   "
        f"repeat call {repeat[0] * 1e3:7.2f} ms vs {repeat[1] * 1e3:6.2f} ms ({repeat[0] / repeat[1]:5.2f}x)   "
        f"finding: {finding.kind + ' in ' + finding.primitive if finding else None}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=SMALL["layers"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()

    config = dataclasses.replace(Config(**SMALL), layers=args.layers)
    model = Decoder(config)
    tokens = jax.random.randint(jax.random.key(0), (config.batch, config.seq), 0, config.vocab)
    params = jax.jit(model.init)(jax.random.key(1), tokens)
    print(
        f"decoder, {config.layers} layers, d_model {config.d_model}, batch {config.batch} x {config.seq}, "
        f"jax {jax.__version__} on {jax.default_backend()}; find_overflow vs jit(autocast(f)) + jit(f)"
    )
    measure("forward", lambda: make_loss(model, "loss"), (params, tokens, tokens), args.rounds)
    measure(
        "training step", lambda: jax.value_and_grad(make_loss(model, "step")), (params, tokens, tokens), args.rounds
    )


if __name__ == "__main__":
    main()
