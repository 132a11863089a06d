"""unscale_and_check throughput against a plain copy (``tree_map(x * c)``) of the same bytes.

    python benchmarks/kernels.py            # 50M float32 in 50 leaves
    python benchmarks/kernels.py --small    # 2M float32 in 20 leaves, a quick run

The same script runs unchanged on a GPU, where it adds the Pallas (Triton) kernel. Targets: XLA on CPU
>= 0.6x a copy (it reads the input twice; limit about 0.67x), Pallas on GPU >= 0.9x (one read, one write).
Variants run interleaved, round by round, so drifting machine load hits them alike.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jamp_kernels  # noqa: E402


def make_grads(total: int, leaves: int) -> list[jax.Array]:
    """``leaves`` float32 leaves of slightly different, mostly ragged sizes adding up to ~``total``."""
    base = total // leaves
    keys = jax.random.split(jax.random.key(0), leaves)
    return [jax.random.normal(k, (base + 7 * i,), jnp.float32) * 1024 for i, k in enumerate(keys)]


def variants(backends: list[str]) -> dict:
    out = {"copy tree_map(x*c)": jax.jit(lambda g, c: jax.tree.map(lambda x: x * c, g))}
    for backend in backends:
        out[f"unscale_and_check[{backend}]"] = jax.jit(
            lambda g, c, b=backend: jamp_kernels.unscale_and_check(g, c, backend=b))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2M elements in 20 leaves, 10 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--calls", type=int, default=5, help="calls per timed round (hides dispatch on a GPU)")
    args = parser.parse_args()
    total, n_leaves, rounds = (2_000_000, 20, 10) if args.small else (50_000_000, 50, 20)
    rounds = args.rounds or rounds

    on_gpu = jax.default_backend() == "gpu"
    fns = variants(["xla", "pallas", "auto"] if on_gpu else ["xla", "auto"])
    grads = make_grads(total, n_leaves)
    inv = jnp.float32(1 / 1024)
    nbytes = 2 * sum(g.nbytes for g in grads)  # one read and one write: what a copy must move

    for fn in fns.values():  # compile and touch every output buffer once
        jax.block_until_ready(fn(grads, inv))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready([fn(grads, inv) for _ in range(args.calls)])  # dispatch overlaps the work
            times[name].append((time.perf_counter() - start) / args.calls)

    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}), {len(grads)} leaves, "
          f"{sum(g.size for g in grads) / 1e6:.1f}M float32 ({nbytes / 2e6:.0f} MB), "
          f"median of {rounds} rounds x {args.calls} calls")
    copy = float(np.median(times["copy tree_map(x*c)"]))
    print(f"{'variant':32s} {'median ms':>10s} {'best ms':>9s} {'GB/s':>7s} {'vs copy':>8s}")
    for name, ts in times.items():
        median = float(np.median(ts))
        print(f"{name:32s} {median * 1e3:10.2f} {min(ts) * 1e3:9.2f} {nbytes / median / 1e9:7.1f} "
              f"{copy / median:7.2f}x")
    target = "pallas >= 0.90x" if on_gpu else "xla >= 0.60x"
    print(f"target: {target} (throughput ratio = copy time / variant time, same bytes)")


if __name__ == "__main__":
    main()
