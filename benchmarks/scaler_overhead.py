"""Cost of skip-on-overflow: jamp.scaler(adam) against a bare Adam step and the peers' patterns.

50M float32 parameters in 50 leaves (``--small``: 5M in 50), Adam, ``jax.jit`` with params and optimizer
state donated. Every variant starts from grads scaled by 1024 and unscales them, so the bare step is
Adam with the unscale fused in (the floor). Steps are timed in interleaved rounds (each round times
every variant once) and the median is reported, so machine-load drift hits all variants alike.

    python benchmarks/scaler_overhead.py [--small] [--rounds 9]

``jamp.scaler(adam)`` is the default (backend "auto", the skip form the platform's entry in
``jamp.scaling.skip.FORM_OF_PLATFORM`` names); the two rows below it force each skip form, so both are
measured on every platform. On a GPU a second table gives what a ``jax.profiler`` trace shows per step:
kernels launched, their device time, the span from first to last kernel, and the costliest ops.

Peers, written inline (no jmp/flax import needed):
  optax.apply_if_finite   unscale by tree_map, then optax's isfinite + lax.cond around Adam
  jmp                     all_finite(grads) then select_tree(finite, new, old) over params and state
  flax DynamicScale       is_fin from the grads, then jnp.where(is_fin, new, old) over params and state
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from device_profile import profile

import jamp
from jamp.scaling import skip

SCALE = 1024.0


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def unscale(grads):
    return jax.tree.map(lambda g: g * (1.0 / SCALE), grads)


def bare(adam):
    def step(params, state, grads):
        updates, state = adam.update(unscale(grads), state, params)
        return optax.apply_updates(params, updates), state

    return adam.init, step


def jamp_scaler(adam, backend="auto", form=None):
    """``form`` forces one skip form (patched while the step is traced) instead of the platform's."""
    tx = jamp.scaler(adam, init_scale=SCALE, backend=backend)

    def step(params, state, grads):
        with forced_form(form):
            updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx.init, step


@contextlib.contextmanager
def forced_form(form):
    if form is None:
        yield
        return
    saved = skip.FORM_OF_PLATFORM
    skip.FORM_OF_PLATFORM = {"default": getattr(skip, form)}
    try:
        yield
    finally:
        skip.FORM_OF_PLATFORM = saved


def apply_if_finite(adam):
    tx = optax.apply_if_finite(adam, max_consecutive_errors=1000)

    def step(params, state, grads):
        updates, state = tx.update(unscale(grads), state, params)
        return optax.apply_updates(params, updates), state

    return tx.init, step


def jmp_select_tree(adam):
    def step(params, state, grads):
        grads = unscale(grads)
        finite = all_finite(grads)
        updates, new_state = adam.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        def select(new, old):
            return jax.tree.map(lambda x, y: jax.lax.select(finite, x, y), new, old)

        return select(new_params, params), select(new_state, state)

    return adam.init, step


def flax_dynamic_scale(adam):
    def step(params, state, grads):
        grads = unscale(grads)
        is_fin = jnp.array(True)
        for g in jax.tree.leaves(grads):
            is_fin &= jnp.all(jax.lax.is_finite(g))
        updates, new_state = adam.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        def where(new, old):
            return jax.tree.map(lambda x, y: jnp.where(is_fin, x, y), new, old)

        return where(new_params, params), where(new_state, state)

    return adam.init, step


VARIANTS: dict[str, Callable] = {
    "bare Adam": bare,
    "jamp.scaler(adam)": jamp_scaler,
    "  skip form select_where_produced": lambda adam: jamp_scaler(adam, form="select_where_produced"),
    "  skip form select_after": lambda adam: jamp_scaler(adam, form="select_after"),
    "  check backend xla": lambda adam: jamp_scaler(adam, backend="xla"),
    "optax.apply_if_finite": apply_if_finite,
    "jmp all_finite+select_tree": jmp_select_tree,
    "flax DynamicScale where": flax_dynamic_scale,
}


def timed(step, params, state, grads):
    t0 = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state, grads))
    return time.perf_counter() - t0, params, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="5M parameters instead of 50M (a quick run)")
    ap.add_argument("--rounds", type=int, default=9, help="timed steps per variant (median reported)")
    args = ap.parse_args()
    n_leaves, per_leaf = 50, (100_000 if args.small else 1_000_000)
    key = jax.random.key(0)

    def make(k):
        return [jax.random.normal(kk, (per_leaf // 1000, 1000)) for kk in jax.random.split(k, n_leaves)]

    grads = [g * SCALE for g in make(jax.random.fold_in(key, 1))]
    bad = [grads[0].at[3, 7].set(jnp.inf)] + grads[1:]
    adam = optax.adam(1e-3)

    runs = {}
    for name, variant in VARIANTS.items():
        init, step = variant(adam)
        params = make(key)
        runs[name] = [jax.jit(step, donate_argnums=(0, 1)), params, init(params)]
    for run in runs.values():  # compile and warm up, finite and overflowing
        for g in (grads, grads, bad):
            _, run[1], run[2] = timed(run[0], run[1], run[2], g)

    times = {name: {"step": [], "skipped step": []} for name in runs}
    for _ in range(args.rounds):
        for kind, g in (("step", grads), ("skipped step", bad)):
            for name, run in runs.items():
                dt, run[1], run[2] = timed(run[0], run[1], run[2], g)
                times[name][kind].append(dt * 1e3)

    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    floor = med["bare Adam"]["step"]
    n_params = n_leaves * per_leaf
    print(f"{n_params / 1e6:.0f}M float32 params in {n_leaves} leaves, Adam, jit + donation, "
          f"median of {args.rounds} interleaved steps, {jax.devices()[0].device_kind}")
    print("| variant | step ms | / bare Adam | skipped step ms | / bare Adam |")
    print("|---|---|---|---|---|")
    for name, m in med.items():
        skipped = "no skip (inf applied)" if name == "bare Adam" else f"{m['skipped step']:.2f}"
        skipped_ratio = "-" if name == "bare Adam" else f"{m['skipped step'] / floor:.2f}"
        print(f"| {name} | {m['step']:.2f} | {m['step'] / floor:.2f} | {skipped} | {skipped_ratio} |")

    profiles = {}
    for name, run in runs.items():
        def one_step(run=run):
            _, run[1], run[2] = timed(run[0], run[1], run[2], grads)
        profiles[name] = profile(one_step)
    if all(p is not None for p in profiles.values()):
        base = profiles["bare Adam"]
        print("\nDevice view (jax.profiler trace, per finite step):")
        print("| variant | kernels | device ms | / bare | span ms | / bare | costliest ops |")
        print("|---|---|---|---|---|---|---|")
        for name, p in profiles.items():
            print(f"| {name} | {p.launches:g} | {p.device_ms:.3f} | {p.device_ms / base.device_ms:.2f} | "
                  f"{p.span_ms:.3f} | {p.span_ms / base.span_ms:.2f} | {p.top(6)} |")


if __name__ == "__main__":
    main()
