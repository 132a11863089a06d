"""Cost of skip-on-overflow: jamp.scaler(adam) against a bare Adam step and the peers' patterns.

Four parameter trees (float32, Adam, ``jax.jit`` with params and optimizer state donated):

  GPT-2 small        the real tree of GPT-2 small: 124M parameters in 148 leaves (wte 50257x768, wpe
                     1024x768, 12 blocks of LayerNorm vectors, attention 768x2304 + 768x768, MLP
                     768x3072 + 3072x768 and their biases, ln_f)
  50 x 1000x1000     50M parameters in 50 equal matrices
  50 x 1M (1-D)      50M parameters in 50 equal vectors: bare Adam runs at memory speed here
  1000 biases        1000 vectors of 1000 beside four 2048x2048 and two 4096x1024 matrices (26M)

    python benchmarks/scaler_overhead.py [--trees gpt2,matrices,vectors,biases] [--rounds 9] [--small]

Every variant starts from grads scaled by 1024 and unscales them, so the bare step is Adam with the
unscale fused in (the floor). Each variant is timed on a finite step and on an overflowing ("skipped")
step, in interleaved rounds (each round times every variant once); the ratio to bare Adam is taken
within each round and its median reported, with the rounds' interquartile range, so drifting machine
load hits all variants alike. A summary table ends the run: one row per tree, as in issue 23.

``jamp.scaler(adam)`` is the default (backend "auto"; the check form and the skip form that the platform's
entries in ``jamp_kernels.xla.CHECK_OF_PLATFORM`` and ``jamp.scaling.skip.FORM_OF_PLATFORM`` name); the
rows below it force each form, so every form is measured on every platform. On a GPU a second table per
tree gives what a ``jax.profiler`` trace shows per step: kernels launched, their device time, the span
from first to last kernel, and the costliest ops.

"without the skipped-steps warning" is ``jamp.scaler(adam, warn_after_skips=None, warn_below_scale=None)``: the
summary's last column is the default's finite step over it, round by round (what jamp.SkippedStepsWarning costs).

"the check alone" runs ``jamp_kernels.has_nonfinite`` by itself: one plus its ratio is the least that any scaler
whose check is a separate pass over the gradients can cost (the summary prints it beside the scaler).
The summary also prints the memory rate of bare Adam (28 bytes per parameter, :data:`ADAM_BYTES`) and of the
check alone (4 bytes): where Adam already runs at the machine's memory speed, one read of the gradients
costs about 4/28 = 0.14 of it however the check is written.

Peers, written inline (no jmp/flax import needed):
  optax.apply_if_finite   unscale by tree_map, then optax's isfinite + lax.cond around Adam
  jmp                     all_finite(grads) then select_tree(finite, new, old) over params and state
  flax DynamicScale       is_fin from the grads, then jnp.where(is_fin, new, old) over params and state

Variants that share a state structure share one set of buffers (each step donates them to the next), so
the 124M-parameter tree needs three copies of params and moments, not one per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from device_profile import profile

import jamp
import jamp_kernels
from jamp.scaling import skip
from jamp_kernels import dispatch, xla

SCALE = 1024.0


def gpt2_small(vocab: int = 50257, layers: int = 12, d: int = 768) -> dict:
    """GPT-2 small's parameter shapes under the Hugging Face names (flax layout)."""

    def dense(n_in, n_out):
        return {"kernel": (n_in, n_out), "bias": (n_out,)}

    def norm():
        return {"scale": (d,), "bias": (d,)}

    block = {
        "ln_1": norm(),
        "attn": {"c_attn": dense(d, 3 * d), "c_proj": dense(d, d)},
        "ln_2": norm(),
        "mlp": {"c_fc": dense(d, 4 * d), "c_proj": dense(4 * d, d)},
    }
    return {"wte": (vocab, d), "wpe": (1024, d), "h": {str(i): block for i in range(layers)}, "ln_f": norm()}


class Tree(NamedTuple):
    title: str
    shapes: Callable[[bool], object]  # small -> pytree of shapes
    not_run: tuple[str, ...] = ()  # variants left out, with NOT_RUN as the reason


NOT_RUN = (
    "XLA:CPU (jax 0.10.2) compiles a select between old and new state over 1006 leaves for more than "
    "10 minutes and past 15 GB of memory"
)


TREES = {
    "gpt2": Tree(
        "GPT-2 small (124M params, 148 leaves)",
        lambda small: gpt2_small(vocab=5000, layers=2) if small else gpt2_small(),
    ),
    "matrices": Tree("50 x 1000x1000", lambda small: [(100 if small else 1000, 1000)] * 50),
    "vectors": Tree("50 x 1M (1-D)", lambda small: [(100_000 if small else 1_000_000,)] * 50),
    "biases": Tree(
        "1000 biases of 1000 + 6 matrices (26M)",
        lambda small: [(1000,)] * 1000 + [(512 if small else 2048, 2048)] * 4 + [(1024 if small else 4096, 1024)] * 2,
        not_run=("jmp all_finite+select_tree", "flax DynamicScale where"),
    ),
}


def is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def make(shapes, key):
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, s) for k, s in zip(keys, leaves)])


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def unscale(grads):
    return jax.tree.map(lambda g: g * (1.0 / SCALE), grads)


def bare(adam):
    def step(params, state, grads):
        updates, state = adam.update(unscale(grads), state, params)
        return optax.apply_updates(params, updates), state

    return "adam", adam.init, step


def jamp_scaler(adam, backend="auto", form=None, check=None, **kwargs):
    """``form`` / ``check`` force one skip form / check form (patched while the step is traced)."""
    tx = jamp.scaler(adam, init_scale=SCALE, backend=backend, **kwargs)

    def step(params, state, grads):
        with forced(skip, "FORM_OF_PLATFORM", form), forced(xla, "CHECK_OF_PLATFORM", check):
            updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return "jamp", tx.init, step


@contextlib.contextmanager
def forced(module, table: str, name: str | None):
    """Replace ``module.<table>`` (a platform -> implementation table) by ``{"default": module.<name>}``.

    The check runs inside a jitted helper whose trace is cached per input shapes: its cache is cleared on
    the way in and out, so the forced table is traced and the next variant gets the real one again.
    """
    if name is None:
        yield
        return
    saved = getattr(module, table)
    setattr(module, table, {"default": getattr(module, name)})
    dispatch._check.clear_cache()
    try:
        yield
    finally:
        setattr(module, table, saved)
        dispatch._check.clear_cache()


def apply_if_finite(adam):
    tx = optax.apply_if_finite(adam, max_consecutive_errors=1000)

    def step(params, state, grads):
        updates, state = tx.update(unscale(grads), state, params)
        return optax.apply_updates(params, updates), state

    return "apply_if_finite", tx.init, step


def jmp_select_tree(adam):
    def step(params, state, grads):
        grads = unscale(grads)
        finite = all_finite(grads)
        updates, new_state = adam.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)

        def select(new, old):
            return jax.tree.map(lambda x, y: jax.lax.select(finite, x, y), new, old)

        return select(new_params, params), select(new_state, state)

    return "adam", adam.init, step


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

    return "adam", adam.init, step


def check_alone(adam):
    """The default finite check by itself: what a scaler whose check is a separate pass over the gradients
    pays on top of bare Adam at the least (the parameters pass through, donated, untouched)."""

    def step(params, found_inf, grads):
        return params, jamp_kernels.has_nonfinite(grads)

    return "check", lambda params: jnp.zeros((), jnp.bool_), step


CHECK_ALONE = "the check alone (jamp_kernels.has_nonfinite)"
QUIET = "  without the skipped-steps warning"
VARIANTS: dict[str, Callable] = {
    "bare Adam": bare,
    "jamp.scaler(adam)": jamp_scaler,
    QUIET: lambda adam: jamp_scaler(adam, warn_after_skips=None, warn_below_scale=None),
    "  check form _folded (views in loops)": lambda adam: jamp_scaler(adam, backend="xla", check="_folded"),
    "  check form _reduced (a reduction per leaf)": lambda adam: jamp_scaler(adam, backend="xla", check="_reduced"),
    "  skip form select_where_produced": lambda adam: jamp_scaler(adam, form="select_where_produced"),
    "  skip form select_after": lambda adam: jamp_scaler(adam, form="select_after"),
    CHECK_ALONE: check_alone,
    "optax.apply_if_finite": apply_if_finite,
    "jmp all_finite+select_tree": jmp_select_tree,
    "flax DynamicScale where": flax_dynamic_scale,
}
PEERS = ("optax.apply_if_finite", "jmp all_finite+select_tree", "flax DynamicScale where")
KINDS = {  # what is timed -> (gradients, state of the CPU caches when the step starts)
    "step": ("finite", "fresh"),
    "skipped step": ("overflow", "fresh"),
    "step, cold caches": ("finite", "cold"),
}


class Caches:
    """Puts the CPU caches in a known state before each timed step. ``cold``: a 1 GiB buffer (more than any
    last-level cache; this machine's L3 is 480 MiB) is rewritten, so parameters, moments and gradients
    all come from memory. ``fresh``: the same, then the gradients are rewritten in place (times a runtime
    1.0, bit for bit), so they sit in the caches as far as they fit, as a backward pass leaves them, while
    parameters and moments are cold (a training step touched much else since the last update). Without
    this a variant would find what the previous variant just wrote still cached."""

    def __init__(self, nbytes: int = 1 << 30):
        self.buffer = jnp.zeros(nbytes // 4, jnp.float32)
        self.bump = jax.jit(lambda x: x + 1, donate_argnums=0)
        self.rewrite = jax.jit(lambda g, one: jax.tree.map(lambda x: x * one, g), donate_argnums=0)

    def prepare(self, condition: str, grads):
        self.buffer = jax.block_until_ready(self.bump(self.buffer))
        if condition == "fresh":
            grads = jax.block_until_ready(self.rewrite(grads, jnp.float32(1.0)))
        return grads


def timed(run: dict, buffers: dict, grads: dict, kind: str, caches: Caches) -> float:
    """One step of ``run`` on its state group's buffers (donated, replaced by the step's outputs)."""
    which, condition = KINDS[kind]
    grads[which] = caches.prepare(condition, grads[which])
    group = run["group"]
    t0 = time.perf_counter()
    buffers[group] = jax.block_until_ready(run["step"](*buffers[group], grads[which]))
    return time.perf_counter() - t0


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, _, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
    return q1, statistics.median(xs), q3


def measure(tree: Tree, names: list[str], rounds: int, small: bool) -> dict:
    """{variant: {kind: (median ms, ratio quartiles)}} for ``tree``; also prints the tree's tables."""
    key = jax.random.key(0)
    shapes = tree.shapes(small)
    finite = jax.tree.map(lambda g: g * SCALE, make(shapes, jax.random.fold_in(key, 1)))
    leaves, treedef = jax.tree.flatten(finite)
    overflow = jax.tree.unflatten(
        treedef, [leaves[0].at[(3,) * leaves[0].ndim].set(jnp.inf), *map(jnp.copy, leaves[1:])]
    )  # own buffers: rewritten in place
    grads = {"finite": finite, "overflow": overflow}
    adam = optax.adam(1e-3)

    runs, buffers = {}, {}
    for name in [n for n in names if n not in tree.not_run]:
        group, init, step = VARIANTS[name](adam)
        runs[name] = {"group": group, "step": jax.jit(step, donate_argnums=(0, 1))}
        if group not in buffers:
            params = make(shapes, key)
            buffers[group] = (params, init(params))
    caches = Caches()
    # bare Adam applies the inf of an overflowing step: timed on finite steps only
    kinds = {name: [k for k in KINDS if name != "bare Adam" or KINDS[k][0] == "finite"] for name in runs}
    for name, run in runs.items():  # compile and warm up
        for kind in ["step", *kinds[name]]:
            timed(run, buffers, grads, kind, caches)

    times: dict = {name: {kind: [] for kind in kinds[name]} for name in runs}
    for _ in range(rounds):
        for kind in KINDS:
            for name, run in runs.items():
                if kind in kinds[name]:
                    times[name][kind].append(timed(run, buffers, grads, kind, caches) * 1e3)
    floor = times["bare Adam"]
    result = {
        name: {
            kind: (statistics.median(t), quartiles([a / b for a, b in zip(t, floor[f"step{cold(kind)}"])]))
            for kind, t in per_kind.items()
        }
        for name, per_kind in times.items()
    }

    n_params = sum(x.size for x in leaves)
    print(
        f"\n{tree.title}{' (--small)' if small else ''}: {n_params / 1e6:.1f}M float32 params in {len(leaves)} "
        f"leaves, Adam, jit + donation, {rounds} interleaved rounds, {jax.devices()[0].device_kind}"
    )
    print("Each ratio is to bare Adam's finite step under the same cache condition (see Caches).")
    print("| variant | " + " | ".join(f"{k} ms | / bare Adam (IQR)" for k in KINDS) + " |")
    print("|---" * (1 + 2 * len(KINDS)) + "|")
    for name, r in result.items():
        cells = [f"{r[k][0]:.2f} | {fmt(r[k][1])}" if k in r else "- | applies the inf" for k in KINDS]
        print(f"| {name} | {' | '.join(cells)} |")
    for name in tree.not_run:
        print(f"| {name} | not run: {NOT_RUN} |")
    device_view(runs, buffers, grads, caches)
    if {"jamp.scaler(adam)", QUIET} <= times.keys():  # what the warning's scalar ops and conditional cost
        pairs = zip(times["jamp.scaler(adam)"]["step"], times[QUIET]["step"])
        result["warning_cost"] = quartiles([a / b for a, b in pairs])
    result["size"] = f"{n_params / 1e6:.1f}M params, {len(leaves)} leaves"
    result["n_params"] = n_params
    return result


ADAM_BYTES = 28
"""Bytes of memory traffic per float32 parameter in an Adam step with donated buffers: gradient, parameter
and both moments read once, parameter and moments written once (the least any implementation moves)."""


def rate(result: dict, name: str, bytes_per_param: int) -> str:
    """GB/s that ``name``'s finite step moves at ``bytes_per_param``: bare Adam near the machine's memory
    speed means one more read of the gradients costs about 4 / 28 of its time, whatever the scaler does."""
    if name not in result:
        return "-"
    return f"{result['n_params'] * bytes_per_param / (result[name]['step'][0] * 1e-3) / 1e9:.1f}"


def cold(kind: str) -> str:
    return ", cold caches" if KINDS[kind][1] == "cold" else ""


def fmt(q: tuple[float, float, float]) -> str:
    return f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})"


def device_view(runs: dict, buffers: dict, grads: dict, caches: Caches) -> None:
    profiles = {name: profile(lambda run=run: timed(run, buffers, grads, "step", caches)) for name, run in runs.items()}
    if any(p is None for p in profiles.values()):
        return
    base = profiles["bare Adam"]
    print("\nDevice view (jax.profiler trace, per finite step):")
    print("| variant | kernels | device ms | / bare | span ms | / bare | costliest ops |")
    print("|---|---|---|---|---|---|---|")
    for name, p in profiles.items():
        print(
            f"| {name} | {p.launches:g} | {p.device_ms:.3f} | {p.device_ms / base.device_ms:.2f} | "
            f"{p.span_ms:.3f} | {p.span_ms / base.span_ms:.2f} | {p.top(6)} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=",".join(TREES), help=f"comma-separated, from {', '.join(TREES)}")
    ap.add_argument("--rounds", type=int, default=9, help="timed steps per variant and kind (median reported)")
    ap.add_argument("--small", action="store_true", help="every tree at about a tenth of its size (a quick run)")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants (bare Adam is always run)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=jamp.SkippedStepsWarning)  # the skipped steps timed here are meant
    trees = args.trees.split(",")
    if unknown := set(trees) - set(TREES):
        ap.error(f"--trees: unknown {sorted(unknown)}; choose from {', '.join(TREES)}")
    names = (
        list(VARIANTS)
        if args.variants is None
        else ["bare Adam", *[n for n in VARIANTS if n.strip() in {v.strip() for v in args.variants.split(",")}]]
    )
    results = {key: measure(TREES[key], names, args.rounds, args.small) for key in trees}

    print("\nSummary (ratios to bare Adam's finite step, median of the rounds, interquartile range):")
    print(
        "| parameter tree | bare Adam ms | jamp.scaler(adam) ms | "
        + " | ".join(KINDS)
        + " | 1 + the check alone (step) | bare Adam GB/s | the check alone GB/s | best peer (step) "
        + "| with / without the skipped-steps warning (step) |"
    )
    print("|---" * (8 + len(KINDS)) + "|")
    for key, result in results.items():
        jamp_row, floor = result.get("jamp.scaler(adam)"), result["bare Adam"]["step"][0]
        peers = [(result[p]["step"][1][1], p) for p in PEERS if p in result]
        best = f"{min(peers)[1]} {min(peers)[0]:.2f}" if peers else "-"
        check = result.get(CHECK_ALONE)
        separate_check_floor = f"{1 + check['step'][1][1]:.2f}" if check else "-"
        rates = f"{rate(result, 'bare Adam', ADAM_BYTES)} | {rate(result, CHECK_ALONE, 4)}"
        if jamp_row:
            title = f"{TREES[key].title} ({result['size']})" if args.small else TREES[key].title
            print(
                f"| {title} | {floor:.1f} | {jamp_row['step'][0]:.1f} | "
                + " | ".join(fmt(jamp_row[k][1]) for k in KINDS)
                + f" | {separate_check_floor} | {rates} | {best} | "
                + (fmt(result["warning_cost"]) if "warning_cost" in result else "-")
                + " |"
            )


if __name__ == "__main__":
    main()
