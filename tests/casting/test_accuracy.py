"""Autocast is never much less accurate than the same program on inputs cast by hand.

For computations users write (means, sums of squares, losses, norms, attention), at realistic sizes
(reductions over 4096 to 262144 elements), under every built-in policy: autocast's error against float32
is at most ``FACTOR`` times the error of the same program run on inputs cast by hand to the policy's
dtype, plus a floor far below one rounding, for the forward result and for both gradients.

A float32 program's reductions carry no upcast for autocast to keep (``jnp.sum`` adds one only for
low-precision inputs): before reductions accumulated in float32, ``jnp.mean((x @ w - 1) ** 2)`` under the
cpu policy was 19% away from float32 while the hand-cast program was 0.2% away, and nothing flagged it.

Every program runs twice: compiled with XLA's default flags, which users run, and with
``xla_allow_excess_precision=False``. By default XLA may keep float16/bfloat16 values in float32 between
fused ops ("excess precision"); that flatters the two sides differently, and it once let one consumer of
a value autocast rounds see it rounded and another unrounded, which made softmax cross-entropies
negative. Losses that a float32 program cannot make negative are checked per example, on every policy.
"""

from __future__ import annotations

import functools
import hashlib
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_flags import as_users
from helpers import eqns
from jax.extend import core as jcore

import jamp

FACTOR = 2.0
# A floor for errors that are tiny by luck (a handful of outputs whose rounding errors cancel): one
# sixteenth of the low dtype's unit roundoff.
FLOOR = {"bfloat16": 2.0**-8 / 16, "float16": 2.0**-11 / 16}
# compile mode -> XLA compiler options: the defaults users run (as_users undoes the suite's faster emitters,
# tests/compile_flags.py), and without excess precision (which hides inconsistent roundings)
XLA_OPTIONS = {"default": as_users(), "strict": {**as_users(), "xla_allow_excess_precision": False}}
# The modes the accuracy tests run in; CI's newer-JAX legs set JAMP_ACCURACY_MODES=default (jamp places the
# roundings itself, the same on every JAX; those legs check the programs each JAX makes under its defaults).
COMPILE_MODES = tuple(os.environ.get("JAMP_ACCURACY_MODES", ",".join(XLA_OPTIONS)).split(","))
if not set(COMPILE_MODES) <= set(XLA_OPTIONS):
    raise ValueError(f"JAMP_ACCURACY_MODES={','.join(COMPILE_MODES)}: expected modes among {sorted(XLA_OPTIONS)}")
LOW_DTYPES = (jnp.float16, jnp.bfloat16)

G, B, K, N = 4, 64, 256, 4096  # 4 independent batches of 64 rows; rows of 4096; 262144 elements a batch
WHOLE, ROW = (1, 2), -1

POLICIES = {
    "cpu": ({"device_type": "cpu"}, "bfloat16"),
    "tpu": ({"device_type": "tpu"}, "bfloat16"),
    "gpu-float16": ({"device_type": "gpu"}, "float16"),
    "gpu-bfloat16": ({"device_type": "gpu", "dtype": jnp.bfloat16}, "bfloat16"),
}


def _layer_norm(h):
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) / jnp.sqrt(var + 1e-5)


def _rms_norm(h):
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)


_FLAX_LN, _FLAX_RMS = nn.LayerNorm(), nn.RMSNorm()
_LN_PARAMS = _FLAX_LN.init(jax.random.key(1), jnp.ones((1, N)))
_RMS_PARAMS = _FLAX_RMS.init(jax.random.key(1), jnp.ones((1, N)))
_LABELS = jax.random.randint(jax.random.key(2), (G, B), 0, N)


def _heads(h):
    """(G, B, N) -> (G, T=1024, H=4, D=64): sequences of 1024 tokens for attention."""
    return h.reshape(G, B * 16, 4, 64)


def _attention_by_hand(h):
    q = _heads(h)
    s = jnp.einsum("gthd,gshd->ghts", q, 0.5 * q) / 8.0
    return jnp.einsum("ghts,gshd->gthd", jax.nn.softmax(s, -1), q)


# name -> f(h), with h = x @ w of shape (G, B, N): a float32 program as users write it.
CASES = {
    "mean": lambda h: jnp.mean(h, WHOLE),
    "row_mean": lambda h: jnp.mean(h, ROW),
    "row_sum_of_squares": lambda h: jnp.sum(h**2, ROW),
    "mse": lambda h: jnp.mean((h - 1.0) ** 2, WHOLE),
    "variance": lambda h: jnp.var(h, ROW),
    "layer_norm_by_hand": _layer_norm,
    "flax_layer_norm": lambda h: _FLAX_LN.apply(_LN_PARAMS, h),
    "rms_norm_by_hand": _rms_norm,
    "flax_rms_norm": lambda h: _FLAX_RMS.apply(_RMS_PARAMS, h),
    "softmax_cross_entropy": lambda h: optax.softmax_cross_entropy_with_integer_labels(h, _LABELS),
    "logsumexp": lambda h: jax.nn.logsumexp(h, ROW),
    "l2_norm": lambda h: jnp.linalg.norm(h, axis=ROW),
    "attention": lambda h: jax.nn.dot_product_attention(_heads(h), 0.5 * _heads(h), _heads(h)),
    "attention_by_hand": _attention_by_hand,
    "cumsum": lambda h: jnp.cumsum(h, ROW),
    "average_pool": lambda h: nn.avg_pool(h[..., None], (1, 64), strides=(1, 64)),
}
# XLA:CPU cannot compile the float16 x float16 -> float32 einsum that jax.nn.dot_product_attention asks
# for on float16 inputs, so that case has no hand-cast yardstick in float16 here ("attention_by_hand"
# covers float16 attention).
NO_YARDSTICK = {("attention", "float16")}


@functools.cache
def _inputs():
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (G, B, K)) + 3.0  # an offset: cancellation in means and variances matters
    w = jax.random.normal(kw, (K, N)) / np.sqrt(K)
    return x, w, kc


def _program(f):
    return lambda x, w: f(x @ w)


@functools.cache
def _run(case: str, variant: str, mode: str):
    """(output, grad x, grad w) of one variant ("float32", "hand:<dtype>" or "autocast:<policy>"), compiled
    in one of ``XLA_OPTIONS``."""
    x, w, kc = _inputs()
    program = _program(CASES[case])
    kind, _, which = variant.partition(":")
    if kind == "hand":
        x, w = x.astype(which), w.astype(which)
    elif kind == "autocast":
        program = jamp.autocast(program, **POLICIES[which][0])

    def forward_and_grads(x, w):
        out, vjp = jax.vjp(program, x, w)
        cotangent = jax.random.normal(kc, out.shape).astype(out.dtype)  # the same draw for every variant
        return (out, *vjp(cotangent))

    lowered = jax.jit(forward_and_grads).lower(x, w)
    key = hashlib.sha256(lowered.as_text().encode()).hexdigest(), mode
    if key not in _RESULTS:  # policies whose lists agree on a case make the same program: run it once
        _RESULTS[key] = tuple(np.asarray(v, np.float64) for v in lowered.compile(XLA_OPTIONS[mode])(x, w))
    return _RESULTS[key]


_RESULTS: dict[tuple[str, str], tuple] = {}  # (program text's hash, mode) -> its outputs


def _relative_error(value, reference) -> float:
    return float(np.linalg.norm((value - reference).ravel()) / np.linalg.norm(reference.ravel()))


# A case's tests run in one pytest-xdist worker (pyproject's --dist loadgroup), which compiles and runs its
# float32 and hand-cast yardsticks once for every policy and mode (_run's cache).
PARAMS = [
    pytest.param(case, policy, mode, marks=pytest.mark.xdist_group(f"accuracy-{case}"))
    for mode in COMPILE_MODES
    for case in CASES
    for policy in POLICIES
    if (case, POLICIES[policy][1]) not in NO_YARDSTICK
]


@pytest.mark.parametrize("case, policy, mode", PARAMS)
def test_autocast_is_as_accurate_as_casting_by_hand(case, policy, mode):
    dtype = POLICIES[policy][1]
    reference = _run(case, "float32", "strict")  # a float32 program has no low-precision value for the flag
    amp, hand = _run(case, f"autocast:{policy}", mode), _run(case, f"hand:{dtype}", mode)
    for what, a, h, r in zip(("output", "grad x", "grad w"), amp, hand, reference):
        error, yardstick = _relative_error(a, r), _relative_error(h, r)
        assert np.isfinite(error), f"{case} under {policy} ({mode} flags): {what} is not finite"
        assert error <= FACTOR * yardstick + FLOOR[dtype], (
            f"{case} under the {policy} policy, {mode} flags: {what} is {error:.2e} away from float32, the same "
            f"program on inputs cast by hand to {dtype} {yardstick:.2e}"
        )


def _bounded_below_losses(w, b, x, labels):
    """Per-example losses of a linear classifier that float32 arithmetic keeps >= 0 when every consumer of
    the logits sees the same numbers: a log-sum-exp is at least the largest logit, a log-softmax at most 0;
    a binary cross-entropy and a squared error are >= 0 term by term."""
    logits = x @ w + b
    targets = jax.nn.one_hot(labels, logits.shape[-1])
    label_logit = jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
    return {
        "optax.softmax_cross_entropy_with_integer_labels": optax.softmax_cross_entropy_with_integer_labels(
            logits, labels
        ),
        "optax.softmax_cross_entropy": optax.softmax_cross_entropy(logits, targets),
        "-log_softmax at the label": -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1)[:, 0],
        "logsumexp - label logit": jax.nn.logsumexp(logits, -1) - label_logit,
        "optax.sigmoid_binary_cross_entropy": optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1),
        "optax.squared_error": optax.squared_error(logits, targets).sum(-1),
    }


@functools.cache
def _classifier(examples: int, features: int, classes: int, scale: float):
    """Weights, bias, inputs and the labels the float32 classifier predicts (a confident model: its losses
    lie near 0, where a rounding that one consumer sees and another does not turns them negative)."""
    kx, kw = jax.random.split(jax.random.key(examples))
    x = jax.random.normal(kx, (examples, features))
    w = jax.random.normal(kw, (features, classes)) * scale
    b = jnp.linspace(-1, 1, classes)
    return w, b, x, jnp.argmax(x @ w + b, -1)


# (examples, features, classes, weight scale): issue 28's classifier, and a wider head with 512 classes
CLASSIFIERS = {"4096x32 to 10": (4096, 32, 10, 1.0), "2048x128 to 512": (2048, 128, 512, 4 / np.sqrt(128))}


def _evaluate_bounded_below(amp, form: str, args: tuple) -> dict:
    """The losses of ``amp`` (an autocast of ``_bounded_below_losses``) by one of ``BOUNDED_BELOW_FORMS``."""
    if form == "call":  # autocast's own executable
        return amp(*args)
    if form == "jit(value_and_grad)":  # the per-example losses of a differentiated step (autocast's replay)

        def loss(*a):
            losses = amp(*a)
            return sum(v.mean() for v in losses.values()), losses

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(*args)[0][1]
    mode = form.removeprefix("jit, ").removesuffix(" flags")
    return jax.jit(amp).lower(*args).compile(XLA_OPTIONS[mode])(*args)


BOUNDED_BELOW_FORMS = ("call", *(f"jit, {mode} flags" for mode in COMPILE_MODES), "jit(value_and_grad)")


@pytest.mark.parametrize("classifier", CLASSIFIERS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("form", BOUNDED_BELOW_FORMS)
def test_losses_bounded_below_stay_bounded_per_example(form, policy, classifier):
    """Every consumer of a value autocast rounds sees the same number, under XLA's default flags too: no
    per-example loss that float32 keeps >= 0 comes out negative. (A bfloat16 logit read in float32 by the
    log-sum-exp once skipped its rounding while the gathered label logit kept it.)"""
    args = _classifier(*CLASSIFIERS[classifier])
    losses = _evaluate_bounded_below(jamp.autocast(_bounded_below_losses, **POLICIES[policy][0]), form, args)
    negative = {
        name: f"{int((v < 0).sum())} of {v.size}, min {float(v.min()):.3g}"
        for name, v in losses.items()
        if not (np.asarray(v) >= 0).all()
    }
    assert not negative, f"negative per-example losses under the {policy} policy ({form}): {negative}"


def test_issue_28_cross_entropy_is_not_negative_under_default_flags():
    """Issue 28's repro as reported: 425 of 4096 losses were negative (min -0.0625) under the cpu policy."""
    x = jax.random.normal(jax.random.key(1), (4096, 32))
    w = jax.random.normal(jax.random.key(2), (32, 10))
    b = jnp.linspace(-1, 1, 10)
    y = jnp.argmax(x @ w, -1)

    def f(w, b, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y)

    assert float(jax.jit(jamp.autocast(f, device_type="cpu"))(w, b, x, y).min()) >= 0.0


def test_reductions_accumulate_in_float32_but_keep_their_result_dtype():
    """The cpu policy runs ``reduce_sum`` in the input dtype (torch's CPU list): its result stays bfloat16,
    the running sum is float32 (the jaxpr shows the widening and the one rounding)."""
    f = jamp.autocast(lambda x, w: jnp.sum(x @ w, -1), device_type="cpu")
    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 8)), jnp.ones((8, 4)))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert eqn.invars[0].aval.dtype == jnp.float32
    (rounding,) = [e for e in jaxpr.eqns if e.invars and e.invars[0] is eqn.outvars[0]]
    assert rounding.primitive.name == "convert_element_type" and rounding.params["new_dtype"] == jnp.bfloat16


class _Block(nn.Module):
    """What a training step differentiates: LayerNorm, attention, a biased MLP, a scaled residual."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(4)(h, h)
        h = nn.gelu(nn.Dense(64)(nn.LayerNorm()(x)))
        return x + self.param("gate", nn.initializers.ones, ()) * nn.Dense(32)(h)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_sum_of_a_training_step_accumulates_in_float32(policy):
    """Forward and backward: no live reduction of the differentiated program sums float16/bfloat16 values.
    The bias and gate gradients are sums over batch x sequence (the transposes of their broadcasts)."""
    block = _Block()
    x = jnp.ones((2, 16, 32))
    params = block.init(jax.random.key(0), x)

    def loss(params, x, labels):
        logits = block.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    step = jax.grad(jamp.autocast(loss, **POLICIES[policy][0]))
    closed = jax.make_jaxpr(step)(params, x, jnp.zeros((2, 16), jnp.int32))
    summing = {"reduce_sum", "cumsum", "reduce_window_sum", "reduce_prod"}
    # JAX's derivative of reduce_max counts the tied maxima (a sum of converted bools: exact to 256 ties)
    counts = {
        e.outvars[0]
        for e in eqns(closed)
        if e.primitive.name == "convert_element_type" and e.invars[0].aval.dtype == jnp.bool_
    }
    low_sums = [
        e
        for e in eqns(closed)
        if e.primitive.name in summing
        and e.invars[0].aval.dtype in LOW_DTYPES
        and e.invars[0] not in counts
        and not all(isinstance(v, jcore.DropVar) for v in e.outvars)
        and e.invars[0].aval.size > e.outvars[0].aval.size
    ]  # a size-1 axis sums nothing
    assert not low_sums, "\n".join(str(e) for e in low_sums)
    # and the step has sums to check: the bias and gate gradients, the losses' and the norms' sums
    assert sum(e.primitive.name == "reduce_sum" for e in eqns(closed)) > 10
