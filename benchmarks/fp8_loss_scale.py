"""Does the fp8 policy need a loss scaler? Train the same small GPT with and without ``jamp.scaler``.

Under ``jamp.autocast(loss, policy="fp8")`` the matmuls run in float8 with per-tensor current scaling
and every other op in bfloat16, which has float32's exponent range. A loss scale multiplies every
cotangent by a power of two, and current scaling divides it out again in each float8 cast, so the
prediction is that the scaler changes nothing. This trains a character-level GPT (``GPT`` of
train_throughput.py, 2 layers, d_model 64) on bytes of the Python standard library's own source from
the same initialisation on the same batches:

  float32           no autocast
  bf16              jamp.autocast(device_type="gpu", dtype=bfloat16), for reference
  fp8               jamp.autocast(policy="fp8"), AdamW
  fp8 + scaler      the same inside jamp.scaler(AdamW) (init_scale 2**16, growth every 100 steps)
  fp8 + scaler at 1 the same with the scale held at 1: the scaler's program without a loss scale

and prints, per run, the mean training loss of the last 50 steps, the held-out loss, the skipped steps,
the first step whose loss differs from the fp8 run without the scaler, and the largest per-step loss
difference from that run and from the fp8 run with the scaler.

    python benchmarks/fp8_loss_scale.py               # 300 steps
    python benchmarks/fp8_loss_scale.py --steps 1000
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from train_throughput import GPT, Config, make_loss, make_train_step

import jamp

CONFIG = Config(layers=2, d_model=64, heads=4, vocab=256, seq=64, batch=16)
SOURCES = ("functools.py", "textwrap.py", "argparse.py", "dataclasses.py")  # ~215 KB of Python


def load_text() -> tuple[np.ndarray, np.ndarray]:
    """Bytes of a few stdlib modules; the last tenth of each is held out."""
    stdlib = os.path.dirname(os.__file__)
    train, held_out = [], []
    for name in SOURCES:
        with open(os.path.join(stdlib, name), "rb") as f:
            data = np.frombuffer(f.read(), np.uint8).astype(np.int32)
        cut = int(0.9 * len(data))
        train.append(data[:cut])
        held_out.append(data[cut:])
    return np.concatenate(train), np.concatenate(held_out)


def windows(text: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` batches of random windows of seq + 1 bytes (inputs and next-byte targets)."""
    starts = np.random.default_rng(seed).integers(0, len(text) - CONFIG.seq - 1, size=(n, CONFIG.batch))
    return text[starts[..., None] + np.arange(CONFIG.seq + 1)]


def train(name: str, amp: dict | None, scaler: dict | None, batches: np.ndarray, held_out: np.ndarray) -> dict:
    """Train from the same initialisation on ``batches``; ``scaler``: the ``jamp.scaler`` arguments, if any."""
    model = GPT(CONFIG)
    loss_fn = make_loss(model)
    if amp is not None:
        loss_fn = jamp.autocast(loss_fn, **amp)
    tx = optax.adamw(1e-3, weight_decay=0.01)
    scaled = scaler is not None
    if scaled:
        tx = jamp.scaler(tx, **scaler)
    params = model.init(jax.random.key(0), jnp.asarray(batches[0, :, :-1]))
    opt_state = tx.init(params)
    step = jax.jit(make_train_step(loss_fn, tx, scaled), donate_argnums=(0, 1))
    evaluate = jax.jit(loss_fn)
    losses, skipped, scales = [], 0, []
    start = time.perf_counter()
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch[:, :-1], batch[:, 1:])
        losses.append(float(loss))
        if scaled:
            skipped += int(jamp.found_inf(opt_state))
            scales.append(float(jamp.get_scale(opt_state)))
    held = float(np.mean([evaluate(params, b[:, :-1], b[:, 1:]) for b in held_out]))
    return {
        "name": name,
        "losses": np.array(losses),
        "held_out": held,
        "skipped": skipped,
        "scale": scales[-1] if scales else None,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    train_text, held_text = load_text()
    batches, held_out = windows(train_text, args.steps, seed=1), windows(held_text, 8, seed=2)
    fp8 = dict(policy="fp8")
    runs = [
        train("float32", None, None, batches, held_out),
        train("bf16", dict(device_type="gpu", dtype=jnp.bfloat16), None, batches, held_out),
        train("fp8", fp8, None, batches, held_out),
        train("fp8 + scaler", fp8, dict(growth_interval=100), batches, held_out),
        train("fp8 + scaler at 1", fp8, dict(init_scale=1.0, max_scale=1.0), batches, held_out),
    ]
    plain, scaled = runs[2]["losses"], runs[3]["losses"]
    device = jax.devices()[0]
    print(
        f"device: {device.platform} ({device.device_kind}), jax {jax.__version__}; {args.steps} steps of "
        f"{CONFIG.batch}x{CONFIG.seq} bytes, {CONFIG.layers} layers, d_model {CONFIG.d_model}, AdamW 1e-3"
    )
    print()
    print(
        "| run | train loss (last 50 steps) | held-out loss | skipped steps | final scale | "
        "first step differing from fp8 | largest difference from fp8 | from fp8 + scaler |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        diff = np.abs(r["losses"] - plain)
        first = str(int(np.argmax(diff > 0))) if diff.any() else "none"
        scale = "-" if r["scale"] is None else f"{r['scale']:g}"
        print(
            f"| {r['name']} | {r['losses'][-50:].mean():.4f} | {r['held_out']:.4f} | {r['skipped']} | {scale} "
            f"| {first} | {diff.max():.2e} | {np.abs(r['losses'] - scaled).max():.2e} |"
        )


if __name__ == "__main__":
    main()
