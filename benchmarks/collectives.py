"""What crosses devices in a sharded training step, and how much a bfloat16 reduction costs the gradients (issue 45).

The GPT of benchmarks/gpt_model.py (float32 parameters) under ``jax.jit(jax.grad(loss))`` on host CPU devices,
in two shardings: data parallel (parameters replicated, batch sharded) and FSDP (each parameter's first axis that
the device count divides sharded too), and four programs: float32; hand-cast (flax's ``dtype=bfloat16``, the
parameters cast inside each layer); ``jamp.autocast(loss, dtype=bfloat16)`` (its gradients reduced in float32, the
default ``reduce_dtype``); the same with ``reduce_dtype=bfloat16``. For each it prints the collectives
:func:`jamp.collectives` reads right after SPMD partitioning (kind, dtype, count, bytes per device: what a GPU
would send; XLA:CPU widens bfloat16 all-reduces later), then the relative error of the reduced gradients:

* each device's partial gradient (the gradient of its share of the batch, as that program computes it) is summed
  as a ring reduction does, rounding to the dtype the program's gradient all-reduces have after every hop, and
  compared with the float64 sum of the same partials (the reduction's own error, nothing else);
* at 8 partials (the devices here) and at 256 (one per sequence of a 256-sequence batch: a large data-parallel
  job), where a bfloat16 sum has rounded 255 times. Every leaf is rounded to the dtype of the program's largest
  gradient all-reduces (the weights'): for the bfloat16 programs, whose norm and bias gradients cross in float32,
  an upper bound;

and the median time of one compiled step on this host (XLA:CPU widens bfloat16 all-reduces to float32, so a CPU
sends the same bytes either way: the time says what the program costs here, not what a GPU's network would).

A second table gives the floating all-gathers of the forward pass (the loss alone) under FSDP, for each program:
placed by the partitioner, and FSDP by hand (every parameter replicated by a ``with_sharding_constraint`` before the
model reads it), where autocast gathers the cast shard of a parameter that only matmuls read.

    python benchmarks/collectives.py [--devices 8] [--layers 2] [--d-model 128] [--repeats 10]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8, help="host CPU devices (set before JAX starts)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--many", type=int, default=256, help="partials of the large simulated reduction")
    ap.add_argument("--batch", type=int, default=64, help="sequences of the timed and partitioned step")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls of each step (the median is printed)")
    return ap.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:  # before jax is imported
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ARGS.devices}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from gpt_model import Decoder  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jamp  # noqa: E402


class Config:
    def __init__(self, layers: int, d_model: int, seq: int):
        self.layers, self.d_model, self.heads, self.seq = layers, d_model, 4, seq
        self.d_mlp, self.vocab, self.tied = 4 * d_model, 512, False


def losses(config: Config, gather=lambda params: params) -> dict:
    """name -> loss(params, tokens, targets), all on the same float32 parameters, which pass through ``gather``
    first (FSDP by hand)."""

    def loss_of(model):
        def loss(params, tokens, targets):
            logits = model.apply(gather(params), tokens).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        return loss

    float32 = loss_of(Decoder(config))
    return {
        "float32": float32,
        "hand-cast (flax dtype=bfloat16)": loss_of(Decoder(config, jnp.bfloat16)),
        "jamp.autocast(bfloat16)": jamp.autocast(float32, dtype=jnp.bfloat16),
        "jamp.autocast(bfloat16, reduce_dtype=bfloat16)": jamp.autocast(
            float32, dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16
        ),
    }


def shardings(params, mesh, n: int) -> dict:
    """name -> the parameters placed for that sharding."""

    def fsdp(x):
        axis = next((i for i, size in enumerate(x.shape) if size % n == 0), None)
        spec = [None] * x.ndim
        if axis is not None:
            spec[axis] = "data"
        return P(*spec)

    def place(spec_of):
        return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec_of(x))), params)

    return {"data parallel": place(lambda x: P()), "FSDP": place(fsdp)}


def ring_error(partials, dtype) -> float:
    """Relative error (L2 over every leaf) of summing ``partials`` (an iterable of trees of float32 arrays) one hop
    at a time, rounded to ``dtype`` after each, against their float64 sum."""
    exact = acc = None
    for tree in partials:
        flat = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])
        if acc is None:
            exact, acc = flat, flat.astype(dtype)
        else:
            exact = exact + flat
            acc = (acc.astype(np.float32) + flat.astype(dtype).astype(np.float32)).astype(dtype)
    return float(np.linalg.norm(acc.astype(np.float64) - exact) / np.linalg.norm(exact))


def step_time(step, *args, repeats: int) -> float:
    """Median seconds of one call of the compiled ``step`` (after a first call)."""
    jax.block_until_ready(step(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def partial_grads(loss, params, tokens, targets, parts: int):
    """The gradient of each of ``parts`` equal shares of the batch, scaled so that they sum to the batch's."""
    grad = jax.jit(jax.grad(loss))
    for i in range(parts):
        yield jax.tree.map(lambda g: g / parts, grad(params, tokens[i::parts], targets[i::parts]))


def main() -> None:
    n = len(jax.devices())
    config = Config(ARGS.layers, ARGS.d_model, ARGS.seq)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    key_t, key_y, key_p = jax.random.split(jax.random.key(0), 3)
    batch = max(ARGS.many, n)
    tokens = jax.random.randint(key_t, (batch, config.seq), 0, config.vocab)
    targets = jax.random.randint(key_y, (batch, config.seq), 0, config.vocab)
    params = Decoder(config).init(key_p, tokens[:1])
    data = NamedSharding(mesh, P("data"))
    print(
        f"jax {jax.__version__}, {n} {jax.devices()[0].platform} devices; GPT {config.layers} layers, "
        f"d_model {config.d_model}, {sum(x.size for x in jax.tree.leaves(params)):,} float32 parameters"
    )
    rows = []
    for loss_name, loss in losses(config).items():
        errors = {}
        for sharding_name, placed in shardings(params, mesh, n).items():
            step_args = (placed, *(jax.device_put(x[: ARGS.batch], data) for x in (tokens, targets)))
            found = jamp.collectives(jax.jit(jax.grad(loss)), *step_args)
            seconds = step_time(jax.jit(jax.grad(loss)), *step_args, repeats=ARGS.repeats)
            reduced = {r.dtype for r in found if r.kind in ("all-reduce", "reduce-scatter") and r.bytes > 8}
            dtype = jnp.bfloat16 if "bfloat16" in reduced else np.float32
            if not errors:
                errors = {
                    parts: ring_error(partial_grads(loss, params, tokens, targets, parts), dtype)
                    for parts in (n, ARGS.many)
                }
            kinds = "; ".join(f"{r.kind} {r.dtype} x{r.count} ({r.bytes:,} B)" for r in found)
            rows.append((sharding_name, loss_name, kinds, errors[n], errors[ARGS.many], seconds))
    print_table(rows, n)
    print_gathers(config, params, mesh, n, [jax.device_put(x[: ARGS.batch], data) for x in (tokens, targets)])


def print_table(rows: list, n: int) -> None:
    print()
    print(
        f"| sharding | program | collectives after partitioning (per device) | reduction error, {n} partials "
        f"| {ARGS.many} partials | step (ms, this host) |"
    )
    print("|---|---|---|---|---|---|")
    for sharding_name, loss_name, kinds, few, many, seconds in rows:
        print(f"| {sharding_name} | {loss_name} | {kinds} | {few:.1e} | {many:.1e} | {1e3 * seconds:.1f} |")


def print_gathers(config: Config, params, mesh, n: int, batch: list) -> None:
    """The floating all-gathers of the forward pass (the loss alone) under FSDP: the partitioner's, and FSDP by hand
    (every parameter replicated by a ``with_sharding_constraint`` before the model reads it)."""
    replicate = functools.partial(jax.tree.map, lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())))
    placed = shardings(params, mesh, n)["FSDP"]
    print()
    print("| FSDP | program | all-gathers of the forward pass (per device) |")
    print("|---|---|---|")
    for form, gather in (("by the partitioner", lambda p: p), ("by hand (a replicating constraint)", replicate)):
        for loss_name, loss in losses(config, gather).items():
            found = [r for r in jamp.collectives(jax.jit(loss), placed, *batch) if r.kind == "all-gather"]
            floats = [r for r in found if r.dtype.startswith(("float", "bfloat"))]
            kinds = "; ".join(f"{r.dtype} x{r.count} ({r.bytes:,} B)" for r in floats)
            print(f"| {form} | {loss_name} | {kinds} |")


if __name__ == "__main__":
    sys.exit(main())
