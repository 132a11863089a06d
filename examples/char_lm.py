"""A character-level transformer LM on the Python standard library's own source, float32 vs float16 AMP.

    python examples/char_lm.py [--steps 300] [--amp fp16|bf16|fp8]
    python examples/char_lm.py --params bf16 --update nearest|kahan|stochastic [--state-dtype float32]

It needs flax: ``pip install -e ".[examples]"``.

A decoder-only transformer (flax linen, the layers stacked with ``nn.scan`` over ``nn.remat`` blocks)
learns to predict the next byte of a few stdlib modules; text every Python install carries. It trains
twice from the same initialisation on the same batches: in float32, and under
``jamp.autocast(policy=...)`` with torch's CUDA op lists (float16 matmuls, LayerNorm/softmax/loss in
float32) plus a rule keeping the ``lm_head`` projection in float32, with ``jamp.scaler`` for the loss
scale. It prints both runs' training and held-out losses and the op mix ``jamp.explain`` reports for the
forward pass. Float16 is emulated on a CPU, so the AMP run gains no speed here; the dtype decisions are
the ones a GPU gets. The two runs' training losses differ by less than 0.01 nats at every step and their
held-out losses by less than 0.005 nats/byte (tests/integration/test_examples.py checks both at 60 steps; at the
default 300 steps we measured 1.8769 and 1.8768 nats/byte). It takes about three minutes on a
laptop CPU and prints its progress every fifth of the run. ``--amp bf16`` runs the same GPU op lists in
bfloat16 and ``--amp fp8`` under the ``"fp8"`` policy (float8 matmuls), both without a loss scale.

``--params bf16`` replaces the AMP run by one that keeps the parameters themselves in bfloat16, with no
float32 master copy, under the same bfloat16 autocast (``--amp bf16``'s policy), and applies AdamW's
updates by ``--update``: ``nearest`` (plain ``optax.apply_updates``, round to nearest), ``kahan``
(``jamp.kahan_summation``) or ``stochastic`` (``jamp.stochastic_rounding``). ``--state-dtype float32``
gives AdamW float32 moments instead of bfloat16 ones. Each run prints the bytes per parameter it keeps
between steps (parameters + optimizer state, Kahan buffer included), summed over the state pytrees.
At the default 300 steps we measured held-out 1.9448 (nearest), 1.8838 (kahan) and 1.8912 (stochastic)
nats/byte against float32's 1.8769; the table with float32 moments is in docs/low-precision-params.md.
``--lr`` sets the peak learning rate (3e-3).
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp

SEED = 0
SOURCES = ("functools.py", "textwrap.py", "argparse.py", "dataclasses.py")  # ~215 KB of Python
SEQ, BATCH, DIM, HEADS, LAYERS = 64, 32, 64, 4, 2
VOCAB = 256  # bytes
AMP = {"fp16": ("gpu", True), "bf16": ("d=gpu,c=bf16", False), "fp8": ("fp8", False)}  # --amp: policy, loss scale
UPDATES = {  # --update: how the bfloat16 parameters take AdamW's update
    "nearest": lambda inner, state_dtype: inner,
    "kahan": lambda inner, state_dtype: jamp.kahan_summation(inner, state_dtype=state_dtype),
    "stochastic": lambda inner, state_dtype: jamp.stochastic_rounding(inner, seed=SEED, state_dtype=state_dtype),
}


class Block(nn.Module):
    """Pre-norm transformer block; (carry, None) -> (carry, None) so that ``nn.scan`` can stack it."""

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=HEADS)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * DIM)(nn.LayerNorm()(x)))
        return x + nn.Dense(DIM)(h), None


class CharLM(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, DIM)(tokens) + self.param("pos", nn.initializers.normal(0.02), (SEQ, DIM))
        blocks = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
        )  # one traced block, LAYERS sets of weights, activations recomputed
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(VOCAB, name="lm_head")(nn.LayerNorm()(x))


MODEL = CharLM()


def load_text() -> tuple[np.ndarray, np.ndarray]:
    """Bytes of a few stdlib modules; the last tenth of each file is held out for evaluation."""
    stdlib = os.path.dirname(os.__file__)
    train, held_out = [], []
    for name in SOURCES:
        with open(os.path.join(stdlib, name), "rb") as f:
            data = np.frombuffer(f.read(), np.uint8)
        cut = int(0.9 * len(data))
        train.append(data[:cut])
        held_out.append(data[cut:])
    return np.concatenate(train).astype(np.int32), np.concatenate(held_out).astype(np.int32)


def batches(text: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` random windows of SEQ + 1 bytes (input and next-byte target), the same for every run."""
    starts = np.random.default_rng(seed).integers(0, len(text) - SEQ - 1, size=(n, BATCH))
    return text[starts[..., None] + np.arange(SEQ + 1)]


def loss_fn(apply: Callable, params: dict, window: jax.Array) -> jax.Array:
    logits = apply(params, window[:, :-1]).astype(jnp.float32)  # bfloat16 parameters give bfloat16 logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:]).mean()


def bytes_per_parameter(params: dict, opt_state: optax.OptState) -> tuple[float, float]:
    """What a run keeps between steps, per parameter: the parameters' bytes and the optimizer state's."""
    count = sum(x.size for x in jax.tree.leaves(params))
    return tuple(sum(x.nbytes for x in jax.tree.leaves(tree)) / count for tree in (params, opt_state))


def train(
    name: str,
    apply: Callable,
    params: dict,
    data: np.ndarray,
    scaling: bool,
    lr: float,
    wrap: Callable = lambda inner: inner,
) -> tuple[dict, list[float], int, float, tuple[float, float]]:
    """AdamW with warm-up, gradients clipped inside the scaler (torch's unscale-before-clip recipe);
    ``jamp.scaler(enabled=False)`` lets the float32 run share the step code. ``wrap`` wraps the optimizer
    (``jamp.kahan_summation``...)."""
    warmup = max(1, len(data) // 10)  # the cosine part needs at least one step, even for --steps 1
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(len(data), warmup + 1))
    tx = jamp.scaler(wrap(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))), enabled=scaling)
    opt_state = tx.init(params)
    memory = bytes_per_parameter(params, opt_state)

    @jax.jit
    def step(params, opt_state, window):
        def scaled_loss(p):
            loss = loss_fn(apply, p, window)
            return jamp.scale(loss, opt_state), loss  # the identity when the scaler is disabled

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # clip sees unscaled grads
        return optax.apply_updates(params, updates), opt_state, loss

    losses, skipped, every = [], 0, max(1, len(data) // 5)
    for i, window in enumerate(data, 1):
        params, opt_state, loss = step(params, opt_state, window)
        losses.append(float(loss))
        # the scale and skip counts as Python numbers; warns jamp.SkippedStepsWarning if steps keep being skipped
        summary = jamp.scaler_summary(opt_state)
        skipped += summary["found_inf"]
        if i % every == 0 or i == len(data):
            print(f"{name:>8}: step {i:4d}/{len(data)}  loss {losses[-1]:.4f}", flush=True)
    return params, losses, skipped, summary["scale"], memory


def evaluate(apply: Callable, params: dict, held_out: np.ndarray) -> float:
    """Mean next-byte cross-entropy (nats) on fixed windows of the held-out text."""
    loss = jax.jit(functools.partial(loss_fn, apply))
    return float(np.mean([loss(params, w) for w in batches(held_out, 8, 1)]))


def op_mix(policy: jamp.Policy, params: dict, window: np.ndarray) -> None:
    """What ran in which dtype: the summary of ``jamp.explain`` plus the matmuls per path and dtype."""
    report = jamp.explain(MODEL.apply, policy=policy)(params, window[:, :-1])
    for key, value in report.summary.items():
        print(f"  {key:28s} {value:.3f}" if isinstance(value, float) else f"  {key:28s} {value}")
    dots: dict[tuple[str, str], int] = {}
    for row in report.rows:
        if row.primitive == "dot_general":
            where = "lm_head" if "lm_head" in row.path else "blocks"
            dots[where, row.ran_dtypes[0]] = dots.get((where, row.ran_dtypes[0]), 0) + 1
    print("  dot_general by region and dtype: " + ", ".join(f"{w} {d}: {n}" for (w, d), n in sorted(dots.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--amp", choices=AMP, default="fp16", help="the AMP run's precision (default: fp16)")
    parser.add_argument("--params", choices=("bf16",), help="instead of AMP, keep the parameters in bfloat16")
    parser.add_argument("--update", choices=UPDATES, help="how --params bf16 applies the updates (default: kahan)")
    parser.add_argument(
        "--state-dtype", choices=("float32",), help="AdamW's moments for --params bf16 (default: the parameters' dtype)"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    args = parser.parse_args()
    if args.params is None and (args.update or args.state_dtype):
        parser.error("--update and --state-dtype apply to --params bf16")
    update = args.update or "kahan"
    if update == "nearest" and args.state_dtype:
        parser.error("--state-dtype applies to --update kahan or stochastic (the wrappers' state_dtype)")

    train_text, held_out = load_text()
    data = batches(train_text, args.steps, SEED)
    params = jax.jit(MODEL.init)(jax.random.key(SEED), data[0, :, :-1])
    print(
        f"{len(train_text):,} training bytes from {', '.join(SOURCES)}; "
        f"{sum(x.size for x in jax.tree.leaves(params)):,} parameters"
    )

    policy_name, loss_scaling = AMP["bf16" if args.params else args.amp]
    policy = jamp.get_policy(policy_name).with_rules({"*lm_head*": "float32"})
    amp = jamp.autocast(MODEL.apply, policy=policy)
    if args.params:  # the same bfloat16 autocast, on parameters stored in bfloat16
        amp_name, amp_params = f"bf16_{update}", jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        wrap = functools.partial(UPDATES[update], state_dtype=args.state_dtype)
    else:
        amp_name, amp_params, wrap = f"amp_{args.amp}", params, lambda inner: inner
    results, curves = {}, {}
    for name, apply, start, scaling, wrapper in (
        ("float32", MODEL.apply, params, False, lambda inner: inner),
        (amp_name, amp, amp_params, loss_scaling, wrap),
    ):
        trained, curves[name], skipped, scale, memory = train(name, apply, start, data, scaling, args.lr, wrapper)
        results[name] = (np.mean(curves[name][-20:]), evaluate(apply, trained, held_out))
        print(
            f"{name:>8}: train loss {curves[name][0]:.4f} -> {results[name][0]:.4f} (last 20 steps), "
            f"held-out {results[name][1]:.4f} nats/byte, {skipped} skipped steps, final loss scale {scale:g}",
            flush=True,
        )
        print(
            f"{name:>8}: {sum(memory):.2f} bytes per parameter kept between steps (parameters {memory[0]:.2f} "
            f"+ optimizer state {memory[1]:.2f})",
            flush=True,
        )
    gap = np.max(np.abs(np.subtract(curves["float32"], curves[amp_name])))
    print(f"largest per-step difference of the training losses: {gap:.2e} nats")

    print("op mix of the AMP forward pass (jamp.explain(...).summary; the scanned block counts once):")
    op_mix(policy, params, data[0])
    (_, ref), (_, low) = results["float32"], results[amp_name]
    print(f"RESULT fp32_eval_loss={ref:.4f} {'bf16_eval_loss' if args.params else 'amp_eval_loss'}={low:.4f}")


if __name__ == "__main__":
    main()
