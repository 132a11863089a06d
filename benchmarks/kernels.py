"""unscale_and_check and has_nonfinite throughput against a plain copy, on the gradient trees users have.

    python benchmarks/kernels.py             # the rows below (sizes cut 8x on a CPU)
    python benchmarks/kernels.py --sweep     # GPU: the Pallas kernel's block size x warps on the 50-leaf tree

Rows: one 1 GiB float32 leaf (the reference: what one plain copy reaches), 50 float32 leaves of 4 MiB
(200 MB, an ordinary model), 500 float32 leaves of 100 KB, and 50 bfloat16 leaves of 4 MiB. Bandwidth
counts the bytes an operation must move: read + write for a copy and an unscale, read only for a check.
On a GPU the time is the kernels' device time from a ``jax.profiler`` trace (host dispatch of 50-500
arguments would otherwise dominate); on a CPU it is wall-clock per call. Target (issue 14): the Pallas
unscale_and_check on the 50-leaf tree at >= 0.8x the single-leaf copy's bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from device_profile import profile

import jamp_kernels
from jamp_kernels import pallas_triton

GIB = 1 << 30
ROWS = {  # name -> (leaves, bytes per leaf, dtype)
    "1 x 1 GiB f32": (1, GIB, jnp.float32),
    "50 x 4 MiB f32": (50, 4 << 20, jnp.float32),
    "500 x 100 KB f32": (500, 100_000, jnp.float32),
    "50 x 4 MiB bf16": (50, 4 << 20, jnp.bfloat16),
}


def make_tree(leaves: int, nbytes: int, dtype) -> list[jax.Array]:
    n = nbytes // jnp.dtype(dtype).itemsize
    keys = jax.random.split(jax.random.key(0), leaves)
    return [(jax.random.normal(k, (n,), jnp.float32) * 1024).astype(dtype) for k in keys]


def variants(on_gpu: bool) -> dict:
    """name -> (jitted fn(tree, inv), bytes moved per byte of the tree)."""
    out = {"copy tree_map(x*c)": (jax.jit(lambda g, c: jax.tree.map(lambda x: x * c.astype(x.dtype), g)), 2)}
    for backend in ["xla", "pallas"] if on_gpu else ["xla"]:
        out[f"unscale_and_check[{backend}]"] = (
            jax.jit(lambda g, c, b=backend: jamp_kernels.unscale_and_check(g, c, backend=b)),
            2,
        )
        out[f"has_nonfinite[{backend}]"] = (
            jax.jit(lambda g, c, b=backend: jamp_kernels.has_nonfinite(g, backend=b)),
            1,
        )
    return out


def seconds_per_call(fn, tree, inv, calls: int, rounds: int) -> float:
    """Device time per call from a trace on a GPU; wall-clock median elsewhere."""
    jax.block_until_ready(fn(tree, inv))
    traced = profile(lambda: jax.block_until_ready(fn(tree, inv)), steps=calls)
    if traced is not None:
        return traced.device_ms / 1e3
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready([fn(tree, inv) for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def table(shrink: int, calls: int, rounds: int) -> None:
    on_gpu = jax.default_backend() == "gpu"
    fns = variants(on_gpu)
    inv = jnp.float32(1 / 1024)
    reference = None
    print("| tree | variant | ms | GB/s | vs 1-leaf copy |\n|---|---|---|---|---|")
    for row, (leaves, nbytes, dtype) in ROWS.items():
        tree = make_tree(leaves, nbytes // shrink, dtype)
        size = sum(g.nbytes for g in tree)
        for name, (fn, passes) in fns.items():
            t = seconds_per_call(fn, tree, inv, calls, rounds)
            gbs = passes * size / t / 1e9
            if reference is None:
                reference = gbs  # the first row's copy
            label = row if shrink == 1 else f"{row} / {shrink}"
            print(f"| {label} | {name} | {t * 1e3:.3f} | {gbs:.0f} | {gbs / reference:.2f}x |", flush=True)
        del tree


def sweep(calls: int) -> None:
    """The Pallas kernel's bandwidth on the 50-leaf tree for each block size and warp count."""
    big = make_tree(1, GIB, jnp.float32)
    copy = jax.jit(lambda g, c: jax.tree.map(lambda x: x * c, g))
    inv = jnp.float32(1 / 1024)
    reference = 2 * GIB / seconds_per_call(copy, big, inv, calls, 1) / 1e9
    del big
    tree = make_tree(50, 4 << 20, jnp.float32)
    size = sum(g.nbytes for g in tree)
    print(
        f"reference: 1 GiB copy {reference:.0f} GB/s\n| block bytes | warps | unscale GB/s | vs copy | check GB/s | vs copy |"
    )
    print("|---|---|---|---|---|---|")
    for block in (16 << 10, 32 << 10, 64 << 10, 128 << 10):
        for warps in (4, 8, 16):
            pallas_triton.BLOCK_BYTES, pallas_triton.NUM_WARPS = block, warps
            unscale = jax.jit(lambda g, c: jamp_kernels.unscale_and_check(g, c, backend="pallas"))
            check = jax.jit(lambda g, c: jamp_kernels.has_nonfinite(g, backend="pallas"))
            u = 2 * size / seconds_per_call(unscale, tree, inv, calls, 1) / 1e9
            c = size / seconds_per_call(check, tree, inv, calls, 1) / 1e9
            print(
                f"| {block} | {warps} | {u:.0f} | {u / reference:.2f}x | {c:.0f} | {c / reference:.2f}x |", flush=True
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="GPU: block size x warps of the Pallas kernel")
    parser.add_argument("--calls", type=int, default=20, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="CPU: timed rounds (median)")
    args = parser.parse_args()
    device = jax.devices()[0]
    print(
        f"device: {device.platform} ({device.device_kind}), jax {jax.__version__}, "
        f"Pallas block {pallas_triton.BLOCK_BYTES} bytes, {pallas_triton.NUM_WARPS} warps"
    )
    if args.sweep:
        sweep(args.calls)
    else:
        table(shrink=1 if device.platform == "gpu" else 8, calls=args.calls, rounds=args.rounds)


if __name__ == "__main__":
    main()
