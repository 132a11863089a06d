"""Memory of a training step: autocast against the same model cast by hand, with and without recompute.

Three models, float32 parameters, bfloat16 compute:

  gpt       the 12-layer flax GPT of benchmarks/gpt_model.py (d_model 256, batch 8 x 128)
  mlp       8 residual blocks of RMSNorm + gelu MLP (d 512, MLP 2048, 480 tokens), unrolled
  mlp scan  the same blocks under ``lax.scan`` over the stacked layer parameters

Variants: ``hand`` (flax ``dtype=`` on the GPT; the blocks cast their parameters at use and run the norm in
float32), ``autocast`` (``jamp.autocast(loss, device_type="cpu")`` of the float32 model) and ``recompute off``
(the same with ``recompute=False``, every value kept). Per model and variant: the bytes ``jax.vjp`` saves for the
backward pass (its residuals, arguments excluded: the same on every backend) and their float32 part, the low-
precision copies of stacked parameters among them (scan), the compiled step's temp buffers
(``compiled.memory_analysis()``, this backend's), and the step time (median of interleaved rounds); then the
ratios to ``hand`` and the goals: saved <= 0.9x hand on the GPT and the scanned blocks, temp <= 1.0x hand on
each model.

    python benchmarks/memory.py              # the three models, about 2 minutes on a 2-core CPU
    python benchmarks/memory.py --rounds 0   # memory only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from autocast_overhead import Config, make_inputs, make_loss, saved_residuals
from gpt_model import Decoder

import jamp

MIB = 2**20
D, D_MLP, LAYERS, TOKENS = 512, 2048, 8, 480  # 4 sequences of 120 tokens
SAVED_GOAL = {"gpt": 0.9, "mlp scan": 0.9}  # saved for backward, autocast / hand
TEMP_GOAL = 1.0  # compiled temp, autocast / hand, on every model


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm computed in float32, returned in ``x``'s dtype (as hand-cast code and flax's RMSNorm do)."""
    wide = x.astype(jnp.float32)
    normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + 1e-6)
    return (normed * scale).astype(x.dtype)


def block(params: dict, x: jax.Array, dtype) -> jax.Array:
    """x + W2 gelu(W1 rms_norm(x)); ``dtype`` casts the matrices at use (None: as they are)."""
    cast = (lambda w: w) if dtype is None else (lambda w: w.astype(dtype))
    h = jax.nn.gelu(rms_norm(x, params["scale"]) @ cast(params["w1"]))
    return x + h @ cast(params["w2"])


def mlp_loss(dtype, scanned: bool) -> Callable:
    def loss(params, x: jax.Array) -> jax.Array:
        x = x if dtype is None else x.astype(dtype)
        if scanned:
            x, _ = jax.lax.scan(lambda x, p: (block(p, x, dtype), None), x, params)
        else:
            for p in params:
                x = block(p, x, dtype)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    return loss


def mlp_inputs(scanned: bool) -> tuple:
    keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 1)
    layers = [
        {
            "scale": jnp.ones(D),
            "w1": jax.random.normal(keys[2 * i], (D, D_MLP)) / D**0.5,
            "w2": jax.random.normal(keys[2 * i + 1], (D_MLP, D)) / D_MLP**0.5,
        }
        for i in range(LAYERS)
    ]
    params = jax.tree.map(lambda *a: jnp.stack(a), *layers) if scanned else layers
    return params, jax.random.normal(keys[-1], (TOKENS, D))


def models() -> dict[str, tuple[dict[str, Callable], tuple]]:
    """model -> ({variant: loss}, args)."""
    config = Config()

    def variants(hand: Callable, plain: Callable) -> dict[str, Callable]:
        return {
            "hand": hand,
            "autocast": jamp.autocast(plain, device_type="cpu"),
            "recompute off": jamp.autocast(plain, device_type="cpu", recompute=False),
        }

    gpt = variants(make_loss(Decoder(config, jnp.bfloat16), "hand"), make_loss(Decoder(config), "autocast"))
    out = {"gpt": (gpt, make_inputs(config))}
    for name, scanned in (("mlp", False), ("mlp scan", True)):
        out[name] = (variants(mlp_loss(jnp.bfloat16, scanned), mlp_loss(None, scanned)), mlp_inputs(scanned))
    return out


def stacked_copies(forward: Callable, args: tuple) -> float:
    """MiB of the residuals that are low-precision arrays shaped like a stacked parameter (scan)."""
    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(forward, *a), return_shape=True)(*args)
    n = len(jax.tree.leaves(shapes[1]))
    params = {(a.shape) for a in jax.tree.leaves(args[0]) if a.ndim == 3}
    low = [v.aval for v in closed.jaxpr.outvars[-n:] if v.aval.dtype == jnp.bfloat16 and v.aval.shape in params]
    return sum(a.size * a.dtype.itemsize for a in low) / MIB


def measure(step_losses: dict[str, Callable], args: tuple, scanned: bool) -> tuple[dict, dict]:
    figures, steps = {}, {}
    for name, loss in step_losses.items():
        step = jax.jit(jax.value_and_grad(loss))
        compiled = step.lower(*args).compile()
        figures[name] = {
            **saved_residuals(loss, args),
            "temp": compiled.memory_analysis().temp_size_in_bytes / MIB,
            "stacked": stacked_copies(loss, args) if scanned else None,
        }
        jax.block_until_ready(compiled(*args))
        steps[name] = compiled
    return figures, steps


def timed(steps: dict[str, dict], inputs: dict[str, tuple], rounds: int) -> dict[str, dict[str, float]]:
    """Median step time (ms) per model and variant over interleaved rounds."""
    samples: dict = {m: {v: [] for v in s} for m, s in steps.items()}
    for _ in range(rounds):
        for model, variants in steps.items():
            for name, step in variants.items():
                start = time.perf_counter()
                jax.block_until_ready(step(*inputs[model]))
                samples[model][name].append(time.perf_counter() - start)
    return {m: {v: 1e3 * statistics.median(t) for v, t in s.items()} for m, s in samples.items() if rounds}


def verdict(value: float, goal: float | None) -> str:
    return "" if goal is None else ("met" if value <= goal + 1e-9 else "NOT MET")


def report(model: str, figures: dict, times: dict) -> None:
    rows = [
        ("residuals", "saved for backward (MiB)", SAVED_GOAL.get(model)),
        ("residuals_f32", "  of which float32 (MiB)", None),
        ("stacked", "  low-precision stacked params (MiB)", None),
        ("temp", "compiled temp (MiB)", TEMP_GOAL),
        ("time", "step time (ms)", None),
    ]
    names = list(figures)
    print(f"\n{model}")
    print(f"{'':38s}" + "".join(f"{n:>14s}" for n in names) + f"{'ac/hand':>9s}{'off/hand':>9s}  goal")
    for key, label, goal in rows:
        values = [times.get(n) if key == "time" else figures[n][key] for n in names]
        if any(v is None for v in values):
            continue
        ac, off = (values[1] / values[0], values[2] / values[0]) if values[0] else (float("nan"),) * 2
        goal_text = f"<= {goal:.1f}x: {verdict(ac, goal)}" if goal is not None else ""
        print(f"{label:38s}" + "".join(f"{v:14.1f}" for v in values) + f"{ac:8.2f}x{off:8.2f}x  {goal_text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per variant (0: memory only)")
    parser.add_argument("--models", default="gpt,mlp,mlp scan", help="comma-separated subset")
    args = parser.parse_args()
    chosen = {k: v for k, v in models().items() if k in args.models.split(",")}
    figures, steps = {}, {}
    for model, (losses, inputs) in chosen.items():
        figures[model], steps[model] = measure(losses, inputs, scanned="scan" in model)
    times = timed(steps, {m: v[1] for m, v in chosen.items()}, args.rounds)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; bfloat16, float32 parameters")
    for model in chosen:
        report(model, figures[model], times.get(model, {}))


if __name__ == "__main__":
    main()
