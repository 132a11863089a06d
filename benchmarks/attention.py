"""Attention of a float32 model under autocast: cuDNN flash attention vs XLA's, and torch's SDPA.

One attention layer with float32 parameters (query, key, value and output projections, ``--heads`` heads
of ``--head-dim``, causal unless ``--no-causal``) on a float32 input ``[batch, seq, heads * head_dim]``;
each step is a forward and backward pass (``jax.value_and_grad`` over the parameters, jitted). Variants:

  fp32_xla     the layer as written: ``jax.nn.dot_product_attention``, float32 throughout
  jamp_xla     ``jamp.autocast`` (bfloat16) of the same layer: XLA's attention with bf16 matmuls
  jamp_cudnn   ``jamp.autocast`` (bfloat16) with ``jamp.nn.dot_product_attention``: cuDNN's flash attention
               where the backend is CUDA and cuDNN takes the call (XLA's elsewhere)
  hand_cudnn   parameters and input cast to bfloat16 by hand, ``jax.nn.dot_product_attention`` with
               ``implementation="cudnn"`` on a GPU (XLA's elsewhere): the yardstick for jamp_cudnn
  torch_sdpa   the same layer in torch (float32 ``nn.Linear`` weights) under ``torch.autocast("cuda",
               torch.bfloat16)`` with ``F.scaled_dot_product_attention``; only where torch sees a GPU

Each variant runs in its own process, so each peak memory figure is its own: ``peak_bytes_in_use`` of
``device.memory_stats()`` (torch: ``max_memory_allocated``), or on a CPU the compiled program's argument +
output + temporary bytes. Per variant: the median step time, the peak, both as ratios to jamp_xla, and
whether the optimized program calls cuDNN's fused attention (``__cudnn$fmha``).

    python benchmarks/attention.py                   # seq 8192 on a GPU, 512 on a CPU
    python benchmarks/attention.py --seq 4096 --batch 2 --variants jamp_xla,jamp_cudnn
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import variant_process
from variant_process import ratio

VARIANTS = ("fp32_xla", "jamp_xla", "jamp_cudnn", "hand_cudnn", "torch_sdpa")
BASELINE = "jamp_xla"
MIB = 2**20


def jax_step(variant: str, args: argparse.Namespace) -> tuple[Callable, tuple]:
    """(jitted forward + backward step, its arguments) for a JAX variant."""
    import jax
    import jax.numpy as jnp

    import jamp

    width = args.heads * args.head_dim
    keys = jax.random.split(jax.random.key(0), 5)
    params = {
        name: jax.random.normal(k, (width, width)) / width**0.5
        for name, k in zip(("query", "key", "value", "out"), keys)
    }
    x = jax.random.normal(keys[4], (args.batch, args.seq, width))

    attend = {
        "fp32_xla": jax.nn.dot_product_attention,
        "jamp_xla": jax.nn.dot_product_attention,
        "jamp_cudnn": jamp.nn.dot_product_attention,
        "hand_cudnn": jamp.nn.dot_product_attention,
    }[variant]  # outside autocast: cuDNN for bf16 on CUDA

    def loss(params, x):
        def heads(name):
            return (x @ params[name]).reshape(args.batch, args.seq, args.heads, args.head_dim)

        out = attend(heads("query"), heads("key"), heads("value"), is_causal=args.causal)
        y = out.reshape(args.batch, args.seq, width) @ params["out"]
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    if variant.startswith("jamp_"):
        loss = jamp.autocast(loss, device_type="gpu", dtype=jnp.bfloat16)
    if variant == "hand_cudnn":
        params, x = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params, x))
    return jax.jit(jax.value_and_grad(loss)), (params, x)


def run_jax(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import jax

    step, arguments = jax_step(variant, args)
    start = time.perf_counter()
    compiled = step.lower(*arguments).compile()
    compile_s = time.perf_counter() - start
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*arguments))
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak = stats["peak_bytes_in_use"]
    else:
        mem = compiled.memory_analysis()
        peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    return {
        "variant": variant,
        "step_ms": statistics.median(times) * 1e3,
        "peak_bytes": peak,
        "compile_s": compile_s,
        "cudnn_fmha": "__cudnn$fmha" in compiled.as_text(),
        "device": f"{device.platform} ({device.device_kind})",
        "versions": f"jax {jax.__version__}",
    }


def run_torch(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {"variant": "torch_sdpa", "error": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"variant": "torch_sdpa", "error": "torch sees no CUDA GPU"}
    width = args.heads * args.head_dim
    torch.manual_seed(0)
    layers = torch.nn.ModuleDict(
        {name: torch.nn.Linear(width, width, bias=False, device="cuda") for name in ("query", "key", "value", "out")}
    )
    x = torch.randn(args.batch, args.seq, width, device="cuda")

    def step():
        layers.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q, k, v = (
                layers[n](x).view(args.batch, args.seq, args.heads, args.head_dim).transpose(1, 2)
                for n in ("query", "key", "value")
            )
            out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
            y = layers["out"](out.transpose(1, 2).reshape(args.batch, args.seq, width))
            loss = y.float().square().mean()
        loss.backward()

    times = []
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return {
        "variant": "torch_sdpa",
        "step_ms": statistics.median(times) * 1e3,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "compile_s": None,
        "cudnn_fmha": None,
        "device": f"cuda ({torch.cuda.get_device_name()})",
        "versions": f"torch {torch.__version__}",
    }


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    return run_torch(args) if variant == "torch_sdpa" else run_jax(variant, args)


# ---------------------------------------------------------------- the driver: one process per variant


def run_subprocess(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    options = [
        "--seq",
        str(args.seq),
        "--batch",
        str(args.batch),
        "--heads",
        str(args.heads),
        "--head-dim",
        str(args.head_dim),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    return variant_process.run(__file__, variant, options + ([] if args.causal else ["--no-causal"]), args.timeout)


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"attention layer: batch {args.batch}, seq {args.seq}, {args.heads} heads x {args.head_dim}, "
        f"{'causal' if args.causal else 'not causal'}; float32 parameters; forward + backward, "
        f"median of {args.steps} steps"
    )
    base = next((r for r in results if r["variant"] == BASELINE and "error" not in r), {})
    print(f"| variant | device | step ms | vs {BASELINE} | peak MiB | peak vs {BASELINE} | cuDNN fmha | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error']} |")
            continue
        fmha = "-" if r["cudnn_fmha"] is None else "yes" if r["cudnn_fmha"] else "no"
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        print(
            f"| {r['variant']} | {r['device']}, {r['versions']} | {r['step_ms']:.2f} "
            f"| {ratio(r['step_ms'], base.get('step_ms'))} | {r['peak_bytes'] / MIB:,.0f} "
            f"| {ratio(r['peak_bytes'], base.get('peak_bytes'))} | {fmha} | {compile_s} |"
        )


def default_seq() -> int:
    """8192 on a GPU, 512 elsewhere; asked in a throwaway process so this one holds no GPU memory."""
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True, text=True, check=False
    )
    return 8192 if probe.stdout.strip() == "gpu" else 512


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {VARIANTS}")
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant here and print one JSON line")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 8192 on a GPU, else 512)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant's process")
    args = parser.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    for name in ("seq", "batch", "heads", "head_dim", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def main() -> None:
    args = parse_args()
    if args.variant is not None:
        args.seq = args.seq or 512
        print(json.dumps(run_variant(args.variant, args)))
        return
    args.seq = args.seq or default_seq()
    results = []
    for variant in args.variants.split(","):
        print(f"running {variant} (seq {args.seq}) ...", file=sys.stderr, flush=True)
        results.append(run_subprocess(variant, args))
    print_table(results, args)


if __name__ == "__main__":
    main()
