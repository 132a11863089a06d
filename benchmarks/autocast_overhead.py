"""jit(value_and_grad(autocast(loss))) against float32 and a hand-cast flax model, side by side.

A decoder-only transformer in flax linen (LayerNorm, causal MultiHeadDotProductAttention, gelu MLP,
lm_head, optax softmax cross entropy); the step is ``jax.value_and_grad(loss)``. Variants:

  float32        the model as written, no autocast
  hand bf16/f16  the same model with flax ``dtype=`` on every module, params float32
  autocast ...   ``jamp.autocast(loss, device_type="cpu")`` (bfloat16) / ``device_type="gpu"`` (float16)

Reported per variant, with ratios against float32 and against the hand-cast model of the same dtype:
trace time (``jax.make_jaxpr`` of the step around a new forward function, i.e. autocast's cache miss, and
around an already-used one, i.e. its cache hit, which must not call the Python loss again; the forward
trace and the interpreter rewrite separately), lower and compile time, the jaxpr's op mix (forward +
backward), ``convert`` and ``reduce-precision`` ops and dots in the optimized HLO,
``compiled.memory_analysis()``, the bytes ``jax.vjp`` saves for the backward pass, and the runtime per step. Timings run in interleaved rounds, so
drifting machine load hits all variants alike. Below the table: where non-low-precision dots come from,
and the modules where autocast's converts differ from the hand-cast model's.

    python benchmarks/autocast_overhead.py                 # 12 layers, d_model 256, batch 8 x 128
    python benchmarks/autocast_overhead.py --small         # 2 layers, d_model 64, a quick run
    python benchmarks/autocast_overhead.py --layers 4 --steps 9 --repeats 5 --tied
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from gpt_model import Decoder
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var, jaxprs_in_params

import jamp
from jamp.casting import interpreter

LOW_DTYPES = {np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}
MIB = 2**20
LOW_VARIANTS = ("hand bf16", "autocast bf16", "hand f16", "autocast f16")
PYTHON_TRACES: collections.Counter = collections.Counter()  # loss calls per variant: retrace detector


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 12
    d_model: int = 256
    heads: int = 4
    d_mlp: int = 1024
    vocab: int = 512
    seq: int = 128
    batch: int = 8
    tied: bool = False


SMALL = dict(layers=2, d_model=64, d_mlp=256, vocab=128, seq=32, batch=4)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One column of the table: a loss function and, for autocast, its ``jamp.autocast`` arguments."""

    name: str
    loss: Callable
    amp: dict | None = None

    def forward(self) -> Callable:
        """A new forward function: for autocast a fresh ``Autocast`` with an empty cache."""
        return self.loss if self.amp is None else jamp.autocast(self.loss, **self.amp)

    def step(self) -> Callable:
        return jax.value_and_grad(self.forward())


def make_loss(model: Decoder, name: str) -> Callable:
    """Mean softmax cross entropy of ``model``'s logits (cast to float32, as hand-cast code does)."""

    def loss(params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        PYTHON_TRACES[name] += 1
        logits = model.apply(params, tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss


def make_variants(config: Config) -> list[Variant]:
    def loss(name: str, dtype: Any = None) -> Callable:
        return make_loss(Decoder(config, dtype), name)

    return [
        Variant("float32", loss("float32")),
        Variant("hand bf16", loss("hand bf16", jnp.bfloat16)),
        Variant("autocast bf16", loss("autocast bf16"), dict(device_type="cpu")),
        Variant("hand f16", loss("hand f16", jnp.float16)),
        Variant("autocast f16", loss("autocast f16"), dict(device_type="gpu")),
    ]


def make_inputs(config: Config) -> tuple:
    """float32 params and random token / target batches."""
    k_tok, k_tgt = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(k_tok, (config.batch, config.seq), 0, config.vocab)
    targets = jax.random.randint(k_tgt, (config.batch, config.seq), 0, config.vocab)
    params = Decoder(config).init(jax.random.key(0), tokens)
    return params, tokens, targets


def seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


Probe = Callable[[], dict[str, float]]  # one measurement: metric -> value


def interleaved(probes: dict[str, list[Probe]], rounds: int) -> dict[str, dict[str, float]]:
    """Median over ``rounds`` of every probe's figures, run round by round across variants so that
    drifting machine load hits them alike."""
    samples = {name: collections.defaultdict(list) for name in probes}
    for _ in range(rounds):
        for name, variant_probes in probes.items():
            for probe in variant_probes:
                for key, value in probe().items():
                    samples[name][key].append(value)
    return {name: {key: statistics.median(v) for key, v in s.items()} for name, s in samples.items()}


def walk(jaxpr: Jaxpr, prefix: str = "") -> Iterator[tuple[JaxprEqn, str]]:
    """Every equation, sub-jaxprs included, with its full name stack."""
    for eqn in jaxpr.eqns:
        stack = "/".join(s for s in (prefix, str(eqn.source_info.name_stack)) if s)
        yield eqn, stack
        for sub in jaxprs_in_params(eqn.params):
            yield from walk(sub, stack)


def dot_kind(eqn: JaxprEqn) -> str:
    dtypes = {np.dtype(v.aval.dtype) for v in eqn.invars}
    if dtypes <= LOW_DTYPES:
        return "low"
    return "f32" if dtypes == {np.dtype(jnp.float32)} else "mixed"


def module_path(stack: str) -> str:
    """A name stack with the AD wrappers and the layer index folded: ``Decoder/layers_*/attn/query``."""
    return re.sub(r"layers_\d+", "layers_*", re.sub(r"(transpose|jvp)\(|\)", "", stack)) or "<top>"


def op_mix(closed: ClosedJaxpr) -> tuple[dict, dict[str, collections.Counter]]:
    """Counts of the step's jaxpr; non-low-precision dots by ``fwd``/``bwd`` site, converts by module."""
    counts = collections.Counter(dots_low=0, dots_f32=0, dots_mixed=0, converts=0, eqns=0)
    sites: dict[str, collections.Counter] = {"f32 dots": collections.Counter(), "converts": collections.Counter()}
    for eqn, stack in walk(closed.jaxpr):
        counts["eqns"] += 1
        if eqn.primitive.name == "dot_general":
            kind = dot_kind(eqn)
            counts[f"dots_{kind}"] += 1
            if kind != "low":
                direction = "bwd" if "transpose(" in stack else "fwd"
                sites["f32 dots"][f"{direction} {module_path(stack)} [{kind}]"] += 1
        elif eqn.primitive.name == "convert_element_type":
            counts["converts"] += 1
            sites["converts"][module_path(stack)] += 1
    return dict(counts), sites


def hlo_counts(text: str) -> dict:
    """``convert(`` and ``reduce-precision(`` ops (autocast's explicit roundings, ``jamp.casting.rounding``) and
    dots by result type in the optimized HLO text."""
    dot_types = collections.Counter(re.findall(r"= (\w+)\[[^\]]*\]\S* dot\(", text))
    low = sum(n for t, n in dot_types.items() if t in ("bf16", "f16"))
    return {
        "hlo_converts": text.count(" convert("),
        "hlo_reduce_precision": text.count(" reduce-precision("),
        "hlo_dots_low": low,
        "hlo_dots_f32": dot_types["f32"],
    }


def nbytes(variables: set) -> int:
    return sum(v.aval.size * v.aval.dtype.itemsize for v in variables)


def saved_residuals(forward: Callable, args: tuple) -> dict[str, float]:
    """MiB the forward saves for the backward pass (``jax.vjp``'s residuals), arguments excluded:
    a backend-independent memory figure."""
    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(forward, *a), return_shape=True)(*args)
    n_residuals = len(jax.tree.leaves(shapes[1]))
    jaxpr = closed.jaxpr
    inputs = set(jaxpr.invars)
    saved = {v for v in jaxpr.outvars[-n_residuals:] if isinstance(v, Var) and v not in inputs}
    f32 = {v for v in saved if v.aval.dtype == jnp.float32}
    return {"residuals": nbytes(saved) / MIB, "residuals_f32": nbytes(f32) / MIB}


def trace_probes(v: Variant, args: tuple) -> list[Probe]:
    """Trace (``make_jaxpr`` is ``jit(f).trace``) and lower a step around a new forward function (for
    autocast a cache miss); trace a new step around a used forward (autocast's cache hits while JAX
    retraces the step) counting Python calls of the loss; trace the same step again (JAX's own cache);
    trace the forward alone; for autocast, its full rewrite."""
    forward = v.forward()
    step = jax.value_and_grad(forward)
    jax.make_jaxpr(step)(*args)  # fill autocast's and JAX's caches

    def new() -> dict[str, float]:
        start = time.perf_counter()
        traced = jax.jit(v.step()).trace(*args)
        traced_at = time.perf_counter()
        traced.lower()
        return {"trace_new": traced_at - start, "lower": time.perf_counter() - traced_at}

    def cached() -> dict[str, float]:
        before = PYTHON_TRACES[v.name]
        elapsed = seconds(lambda: jax.make_jaxpr(jax.value_and_grad(forward))(*args))
        return {"trace_cached": elapsed, "retraces": PYTHON_TRACES[v.name] - before}

    def same() -> dict[str, float]:
        return {"trace_same": seconds(lambda: jax.make_jaxpr(step)(*args))}

    def forward_only() -> dict[str, float]:
        if v.amp is None:  # a new wrapper each time: make_jaxpr caches by function
            return {"trace_fwd": seconds(lambda: jax.make_jaxpr(lambda *a: v.loss(*a))(*args))}
        start = time.perf_counter()
        closed, _, ctx = forward.trace_original(*args)
        traced_at = time.perf_counter()
        out_dtypes = tuple(a.dtype for a in closed.out_avals)
        interpreter.retrace(closed, tuple(closed.in_avals), ctx, out_dtypes)  # a new jaxpr: a cache miss
        return {"trace_fwd": traced_at - start, "rewrite": time.perf_counter() - traced_at}

    return [new, cached, same, forward_only]


def build(v: Variant, args: tuple) -> tuple[Any, dict, dict]:
    """Compiled step, its figures (jaxpr op mix, compile time, HLO counts, memory) and op sites."""
    traced = jax.jit(v.step()).trace(*args)
    counts, sites = op_mix(traced.jaxpr)
    lowered = traced.lower()
    start = time.perf_counter()
    compiled = lowered.compile()
    out = {"compile": time.perf_counter() - start, **counts, **saved_residuals(v.forward(), args)}
    mem = compiled.memory_analysis()
    out.update(
        temp=mem.temp_size_in_bytes / MIB,
        argument=mem.argument_size_in_bytes / MIB,
        output=mem.output_size_in_bytes / MIB,
        **hlo_counts(compiled.as_text()),
    )
    return compiled, out, sites


def step_probes(compiled: dict[str, Any], args: tuple) -> dict[str, list[Probe]]:
    """One timed compiled step per variant, after a warm-up call."""
    for fn in compiled.values():
        jax.block_until_ready(fn(*args))
    return {name: [lambda fn=fn: {"runtime": seconds(lambda: fn(*args))}] for name, fn in compiled.items()}


ROWS = [  # key, label, scale, format
    ("trace_new", "trace step, new forward fn (ms)", 1e3, ".1f"),
    ("lower", "lower that trace (ms)", 1e3, ".1f"),
    ("trace_cached", "trace new step, same forward (ms)", 1e3, ".1f"),
    ("retraces", "  python calls of loss per such trace", 1, ".0f"),
    ("trace_same", "trace the same step again (ms)", 1e3, ".1f"),
    ("trace_fwd", "trace forward only (ms)", 1e3, ".1f"),
    ("rewrite", "autocast interpreter rewrite (ms)", 1e3, ".1f"),
    ("compile", "compile (ms)", 1e3, ".0f"),
    ("eqns", "jaxpr equations (fwd+bwd)", 1, ".0f"),
    ("dots_low", "jaxpr dot_general bf16/f16", 1, ".0f"),
    ("dots_f32", "jaxpr dot_general float32", 1, ".0f"),
    ("dots_mixed", "jaxpr dot_general mixed", 1, ".0f"),
    ("converts", "jaxpr convert_element_type", 1, ".0f"),
    ("hlo_converts", "optimized HLO convert(", 1, ".0f"),
    ("hlo_reduce_precision", "optimized HLO reduce-precision(", 1, ".0f"),
    ("hlo_dots_low", "optimized HLO dot bf16/f16 result", 1, ".0f"),
    ("hlo_dots_f32", "optimized HLO dot f32 result", 1, ".0f"),
    ("temp", "compiled temp (MiB)", 1, ".1f"),
    ("argument", "compiled arguments (MiB)", 1, ".1f"),
    ("output", "compiled outputs (MiB)", 1, ".1f"),
    ("residuals", "saved for backward, jax.vjp (MiB)", 1, ".1f"),
    ("residuals_f32", "  of which float32 (MiB)", 1, ".1f"),
    ("runtime", "runtime per step (ms)", 1e3, ".1f"),
]


NO_RATIO = {"retraces"}


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def show(x: float | None, scale: float, fmt: str) -> str:
    return "-" if x is None else format(x * scale, fmt)


def print_table(results: dict[str, dict]) -> None:
    """Metrics as rows; per dtype: hand, autocast, autocast/float32, autocast/hand."""
    header = f"{'metric':36s} {'float32':>9s}"
    for dt in ("bf16", "f16"):
        header += f" | {'hand ' + dt:>9s} {'autocast':>9s} {'ac/f32':>7s} {'ac/hand':>7s}"
    print(header)
    print("-" * len(header))
    for key, label, scale, fmt in ROWS:
        f32 = results["float32"].get(key)
        line = f"{label:36s} {show(f32, scale, fmt):>9s}"
        for dt in ("bf16", "f16"):
            hand, amp = results[f"hand {dt}"].get(key), results[f"autocast {dt}"].get(key)
            vs_f32, vs_hand = ("-", "-") if key in NO_RATIO else (ratio(amp, f32), ratio(amp, hand))
            line += f" | {show(hand, scale, fmt):>9s} {show(amp, scale, fmt):>9s} {vs_f32:>7s} {vs_hand:>7s}"
        print(line)


def print_sites(sites: dict[str, dict]) -> None:
    """Where non-low-precision dots come from, and the modules where autocast's converts differ from
    the hand-cast model's (jaxpr, forward + backward, summed over layers)."""
    for name in LOW_VARIANTS:
        dots = sites[name]["f32 dots"]
        print(
            f"  {name}: float32/mixed dot_general sites: "
            f"{', '.join(f'{s} x{n}' for s, n in sorted(dots.items())) or 'none'}"
        )
    converts = {name: sites[name]["converts"] for name in LOW_VARIANTS}
    differing = sorted(
        m
        for m in set().union(*converts.values())
        if any(converts[f"hand {dt}"][m] != converts[f"autocast {dt}"][m] for dt in ("bf16", "f16"))
    )
    print("  convert_element_type by module where autocast and hand-cast differ:")
    print(f"    {'module':46s}" + "".join(f"{name:>15s}" for name in LOW_VARIANTS))
    for module in differing:
        print(f"    {module:46s}" + "".join(f"{converts[name][module]:15d}" for name in LOW_VARIANTS))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2 layers, d_model 64, seq 32, batch 4")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (median), >= 5")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of trace / lower timings (median)")
    parser.add_argument("--tied", action="store_true", help="lm_head = embed.attend (tied weights)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sizes = dict(SMALL) if args.small else {}
    if args.layers is not None:
        sizes["layers"] = args.layers
    config = Config(**sizes, tied=args.tied)
    steps = max(args.steps, 5)
    inputs = make_inputs(config)
    variants = make_variants(config)

    results: dict[str, dict] = {}
    sites: dict[str, dict] = {}
    compiled: dict[str, Any] = {}
    for v in variants:
        compiled[v.name], results[v.name], sites[v.name] = build(v, inputs)
    for timing in (
        interleaved({v.name: trace_probes(v, inputs) for v in variants}, args.repeats),
        interleaved(step_probes(compiled, inputs), steps),
    ):
        for name, figures in timing.items():
            results[name].update(figures)

    device = jax.devices()[0]
    n_params = sum(x.size for x in jax.tree.leaves(inputs[0]))
    print(
        f"device: {device.platform} ({device.device_kind}), jax {jax.__version__}; model: {config.layers} layers, "
        f"d_model {config.d_model}, {config.heads} heads, mlp {config.d_mlp}, vocab {config.vocab}, "
        f"{'tied' if config.tied else 'untied'} lm_head, {n_params / 1e6:.2f}M params; "
        f"batch {config.batch} x seq {config.seq}"
    )
    print(
        f"step = value_and_grad(loss); trace and lower times: median of {args.repeats} interleaved rounds; "
        f"compile: once; runtime: median of {steps} interleaved steps after a warm-up call"
    )
    print()
    print_table(results)
    print()
    print("op sites (name stacks with the AD wrappers and the layer index folded):")
    print_sites(sites)
    print()
    if device.platform == "cpu":
        print(
            "note: on CPU, bfloat16/float16 compute is emulated (XLA:CPU runs low-precision dots in float32 and\n"
            "inserts its own converts around them, counted in the HLO row), so runtime ratios say nothing about\n"
            "GPU speed; compiled memory and op counts are the meaningful CPU figures, and 'saved for backward'\n"
            "is the same on every backend."
        )


if __name__ == "__main__":
    main()
