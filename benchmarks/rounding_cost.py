"""What autocast's explicit rounding costs: a GPT step with it and with plain conversions, side by side.

Autocast reads a float16/bfloat16 value into a float32 op through ``lax.reduce_precision`` to the value's
format (``jamp.casting.rounding``), so that XLA's excess precision cannot show one consumer the value
rounded and another unrounded. The same ``jax.value_and_grad`` step of the flax GPT of
``autocast_overhead.py`` is built twice per policy: as autocast writes it, and traced with that reading
replaced by a plain ``convert`` (the program before the rounding; ``jamp.casting.rounding.widen`` patched
for the trace). Per variant: ``reduce-precision``, ``convert`` and all instructions in the optimized HLO,
the fusions, ``compiled.memory_analysis()``, the compile time and the runtime per step (median of
interleaved steps, so drifting load hits both alike); and the ratio rounding / plain.

    python benchmarks/rounding_cost.py                 # 12 layers, d_model 256, batch 8 x 128
    python benchmarks/rounding_cost.py --small --steps 9
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import jax
from autocast_overhead import (
    SMALL,
    Config,
    interleaved,
    make_inputs,
    make_loss,
    step_probes,
)
from gpt_model import Decoder

import jamp
from jamp.casting import interpreter, rounding

MIB = 2**20
POLICIES = {"bf16 (device_type='cpu')": {"device_type": "cpu"}, "f16 (device_type='gpu')": {"device_type": "gpu"}}


def clear_rewrites() -> None:
    """Forget autocast's cached rewrites of sub-programs (jit bodies), so no variant reuses the other's."""
    interpreter.retrace.cache_clear()
    interpreter.retrace_open.cache_clear()


@contextlib.contextmanager
def plain_conversions() -> Iterator[None]:
    """Trace with autocast's float32 reads as plain converts, as before the explicit rounding."""
    explicit = rounding.widen
    rounding.widen = lambda x, dtype: jax.lax.convert_element_type(x, dtype)
    clear_rewrites()
    try:
        yield
    finally:
        rounding.widen = explicit
        clear_rewrites()


def hlo_counts(text: str) -> dict[str, float]:
    instructions = re.findall(r"^\s*(?:ROOT )?%\S+ = \S+ ([\w-]+)\(", text, re.MULTILINE)
    return {
        "reduce_precision": instructions.count("reduce-precision"),
        "convert": instructions.count("convert"),
        "instructions": len(instructions),
        "fusions": instructions.count("fusion"),
    }


def build(loss, amp: dict, args: tuple, plain: bool) -> tuple[Any, dict[str, float]]:
    """The compiled step and its figures."""
    with plain_conversions() if plain else contextlib.nullcontext():
        lowered = jax.jit(jax.value_and_grad(jamp.autocast(loss, **amp))).trace(*args).lower()
    start = time.perf_counter()
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    return compiled, {
        "compile": time.perf_counter() - start,
        **hlo_counts(compiled.as_text()),
        "temp": mem.temp_size_in_bytes / MIB,
        "argument": mem.argument_size_in_bytes / MIB,
        "output": mem.output_size_in_bytes / MIB,
    }


ROWS = [  # key, label, scale, format
    ("reduce_precision", "optimized HLO reduce-precision", 1, ".0f"),
    ("convert", "optimized HLO convert", 1, ".0f"),
    ("instructions", "optimized HLO instructions", 1, ".0f"),
    ("fusions", "optimized HLO fusions", 1, ".0f"),
    ("temp", "compiled temp (MiB)", 1, ".1f"),
    ("argument", "compiled arguments (MiB)", 1, ".1f"),
    ("output", "compiled outputs (MiB)", 1, ".1f"),
    ("compile", "compile (ms)", 1e3, ".0f"),
    ("runtime", "runtime per step (ms)", 1e3, ".2f"),
]


def print_table(results: dict[str, dict[str, float]]) -> None:
    header = f"{'metric':32s}" + "".join(f" | {'rounding':>9s} {'plain':>9s} {'ratio':>6s}" for _ in POLICIES)
    print(f"{'':32s}" + "".join(f" | {name:^26s}" for name in POLICIES))
    print(header)
    print("-" * len(header))
    for key, label, scale, fmt in ROWS:
        line = f"{label:32s}"
        for name in POLICIES:
            explicit, plain = results[f"{name} rounding"][key], results[f"{name} plain"][key]
            ratio = f"{explicit / plain:.3f}" if plain else "-"
            line += f" | {format(explicit * scale, fmt):>9s} {format(plain * scale, fmt):>9s} {ratio:>6s}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2 layers, d_model 64, seq 32, batch 4")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per variant (median)")
    args = parser.parse_args()
    sizes = dict(SMALL) if args.small else {}
    if args.layers is not None:
        sizes["layers"] = args.layers
    config = Config(**sizes)
    inputs = make_inputs(config)
    loss = make_loss(Decoder(config), "rounding cost")

    compiled, results = {}, {}
    for name, amp in POLICIES.items():
        for plain in (False, True):
            variant = f"{name} {'plain' if plain else 'rounding'}"
            compiled[variant], results[variant] = build(loss, amp, inputs, plain)
    for variant, figures in interleaved(step_probes(compiled, inputs), max(args.steps, 3)).items():
        results[variant].update(figures)

    device = jax.devices()[0]
    print(
        f"device: {device.platform} ({device.device_kind}), jax {jax.__version__}; model: {config.layers} layers, "
        f"d_model {config.d_model}, batch {config.batch} x seq {config.seq}; step = value_and_grad(autocast(loss)); "
        f"runtime: median of {max(args.steps, 3)} interleaved steps after a warm-up call"
    )
    print()
    print_table(results)


if __name__ == "__main__":
    main()
