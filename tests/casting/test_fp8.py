"""The fp8 policy: float8 matmuls with per-tensor current scaling (jamp.casting.fp8) under autocast."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import dtypes_of

import jamp
from jamp.casting import fp8

E4M3, E5M2, BF16, F16, F32 = "float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32"
FORWARD_DOT = (E4M3, E4M3, F32)  # float8 operands, float32 accumulation (rescaled, then cast to bf16)


class MLP(nn.Module):
    """Two eligible Dense layers on a (batch, seq, features) input, and an ineligible 10-wide head."""

    head: int = 10

    @nn.compact
    def __call__(self, x):
        h = jax.nn.gelu(nn.Dense(64)(x))
        h = nn.Dense(32)(h)
        return nn.Dense(self.head, name="head")(h)


X = jax.random.normal(jax.random.key(1), (4, 16, 32))
PARAMS = MLP().init(jax.random.key(0), X)


def loss(params, x):
    return jnp.mean(MLP().apply(params, x) ** 2)


def relative_error(approx, exact) -> float:
    approx, exact = np.asarray(approx, np.float32), np.asarray(exact, np.float32)
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


# ---------------------------------------------------------------- policy


def test_fp8_policy_is_the_bf16_gpu_policy_with_fp8_on():
    policy = jamp.get_policy("fp8")
    assert policy.fp8 and policy.device_type == "gpu" and policy.compute_dtype == jnp.bfloat16
    gpu_bf16 = jamp.get_policy("gpu").with_compute_dtype(jnp.bfloat16)
    assert policy == gpu_bf16.with_fp8() == dataclasses.replace(gpu_bf16, fp8=True)
    assert policy != gpu_bf16 and hash(policy) != hash(gpu_bf16)
    assert policy.categories == gpu_bf16.categories and policy.rules == gpu_bf16.rules
    assert "fp8=True" in repr(policy) and "fp8" not in repr(gpu_bf16)
    assert not policy.with_fp8(False).fp8
    assert jamp.get_policy("fp8", device_type="cpu").device_type == "gpu"  # like "mixed_float16"
    with pytest.raises(TypeError, match="fp8="):
        jamp.Policy(jnp.bfloat16, fp8="yes")


@pytest.mark.parametrize(
    "lhs,rhs,dims,ok",
    [
        ((32, 16), (16, 48), ((1,), (0,)), True),
        ((4, 16, 32), (32, 64), ((2,), (0,)), True),  # flax Dense on (batch, seq, features)
        ((16, 4, 8), (4, 8, 32), ((1, 2), (0, 1)), True),  # DenseGeneral over (heads, head_dim)
        ((10, 12), (12, 7), ((1,), (0,)), False),  # extents not multiples of 16
        ((32, 24), (24, 32), ((1,), (0,)), False),  # K = 24
        ((32, 16), (16, 8), ((1,), (0,)), False),  # N = 8
        ((0, 16), (16, 16), ((1,), (0,)), False),  # empty
    ],
)
def test_eligibility(lhs, rhs, dims, ok):
    assert fp8.eligible(lhs, rhs, (dims, ((), ()))) is ok


def test_batched_matmuls_are_not_eligible():
    assert not fp8.eligible((2, 16, 32), (2, 32, 16), (((2,), (1,)), ((0,), (0,))))


# ---------------------------------------------------------------- the float8 matmul itself


@pytest.mark.parametrize(
    "lhs,rhs,dims",
    [
        ((32, 16), (16, 48), ((1,), (0,))),
        ((2, 16, 32), (32, 16), ((2,), (0,))),
        ((32, 2, 16), (32, 4, 8), ((0,), (0,))),  # contracting dimension first on both sides
        ((16, 4, 8), (4, 16, 8), ((1, 2), (0, 2))),  # two contracting dimensions
        ((16, 4, 8), (8, 16, 4), ((1, 2), (2, 0))),  # ... in another order on the rhs
    ],
)
def test_exact_where_float8_is_exact(lhs, rhs, dims):
    """Small integers are exact in e4m3fn and e5m2 after a power-of-two scale, so the float8 matmul and
    its gradients must equal float32's bit for bit: this checks scaling and the backward's dimension
    bookkeeping for every layout."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.integers(-4, 5, lhs), jnp.float32)
    b = jnp.asarray(rng.integers(-4, 5, rhs), jnp.bfloat16)
    dn = (dims, ((), ()))
    exact = lambda a, b: jax.lax.dot_general(a, b.astype(jnp.float32), dn)
    out, exact_vjp = jax.vjp(exact, a, b)
    out8, vjp8 = jax.vjp(lambda a, b: fp8.dot_general(a, b, dn, jnp.float32), a, b)
    np.testing.assert_array_equal(out8, out)
    ct = jnp.asarray(rng.integers(-4, 5, out.shape), jnp.float32)
    (da, db), (da8, db8) = exact_vjp(ct), vjp8(ct)
    assert (da8.dtype, db8.dtype) == (jnp.float32, jnp.bfloat16)
    np.testing.assert_array_equal(da8, da)
    np.testing.assert_array_equal(db8.astype(jnp.float32), db.astype(jnp.float32))


def test_scales_are_powers_of_two_that_fit_the_format():
    for amax in (448.0, 449.0, 1.0, 3e-5, 7e4):
        x = jnp.array([amax, -amax / 3], jnp.float32)
        x8, inverse = fp8.quantize(x, fp8.FORWARD)
        mantissa, _ = np.frexp(float(inverse))
        assert mantissa == 0.5  # a power of two
        assert 448 / 2 <= float(jnp.abs(x8.astype(jnp.float32)).max()) <= 448  # amax lands in the top binade
    x8, inverse = fp8.quantize(jnp.zeros(4), fp8.BACKWARD)
    assert float(inverse) == 1.0 and not x8.astype(jnp.float32).any()


def test_zero_operand_gives_zeros_not_nan():
    f = jamp.autocast(loss, policy="fp8")
    zeros = jax.tree.map(jnp.zeros_like, PARAMS)
    value, grads = jax.jit(jax.value_and_grad(f))(zeros, X)
    assert float(value) == 0.0
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    out = jamp.autocast(MLP().apply, policy="fp8")(PARAMS, jnp.zeros_like(X))
    np.testing.assert_array_equal(out, MLP().apply(PARAMS, jnp.zeros_like(X)))  # the biases alone
    assert np.isfinite(jax.jit(jax.grad(f, argnums=1))(PARAMS, jnp.zeros_like(X))).all()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_inf_or_nan_operand_makes_the_product_non_finite(bad):
    w = jax.random.normal(jax.random.key(2), (32, 16))
    x = jnp.ones((16, 32)).at[3, 5].set(bad)
    out = jamp.autocast(jnp.matmul, policy="fp8")(x, w)
    assert out.dtype == jnp.float32 and not np.isfinite(out).any()  # every element, not just row 3
    grad_w = jax.grad(lambda w: jamp.autocast(jnp.matmul, policy="fp8")(x, w).sum())(w)
    assert not np.isfinite(grad_w).all()


def test_inf_cotangent_makes_the_gradients_non_finite():
    w = jax.random.normal(jax.random.key(2), (32, 16))
    x = jax.random.normal(jax.random.key(3), (16, 32))
    overflowing = lambda w: jnp.sum(jamp.autocast(jnp.matmul, policy="fp8")(x, w) * 1e38) * 10.0
    grads = jax.grad(overflowing)(w)
    assert not np.isfinite(grads).all()


def test_scaler_skips_a_step_with_an_inf_operand():
    tx = jamp.scaler(optax.sgd(0.1))
    state = tx.init(PARAMS)
    f = jamp.autocast(loss, policy="fp8")
    bad_x = X.at[0, 0, 0].set(jnp.inf)
    grads = jax.grad(lambda p: jamp.scale(f(p, bad_x), state))(PARAMS)
    updates, state = tx.update(grads, state, PARAMS)
    assert bool(jamp.found_inf(state)) and float(jamp.get_scale(state)) == 2.0**15
    assert all(not u.any() for u in jax.tree.leaves(updates))
    grads = jax.grad(lambda p: jamp.scale(f(p, X), state))(PARAMS)
    updates, state = tx.update(grads, state, PARAMS)
    assert not bool(jamp.found_inf(state)) and all(u.any() for u in jax.tree.leaves(updates))


def test_a_power_of_two_loss_scale_cancels_exactly():
    """Current scaling re-derives each cotangent's scale from its own amax, so a loss scale changes no
    bit of the float8 cotangents: the unscaled gradients are those of the unscaled loss."""
    f = jamp.autocast(loss, policy="fp8")
    plain = jax.grad(f)(PARAMS, X)
    scaled = jax.grad(lambda p: f(p, X) * 2.0**16)(PARAMS)
    for g, s in zip(jax.tree.leaves(plain), jax.tree.leaves(scaled)):
        np.testing.assert_array_equal(s / 2.0**16, g)


# ---------------------------------------------------------------- under autocast


def test_flax_mlp_runs_eligible_dots_in_float8_forward_and_backward():
    f = jamp.autocast(loss, policy="fp8")
    forward = dtypes_of(f, PARAMS, X)
    assert forward == [FORWARD_DOT, FORWARD_DOT, (BF16, BF16, BF16)]  # the 10-wide head is not eligible
    backward = dtypes_of(jax.grad(f), PARAMS, X)
    # the head's weight gradient: bfloat16 operands into float32 (reduce_dtype)
    float8_backward = [d for d in backward if d not in (FORWARD_DOT, (BF16, BF16, BF16), (BF16, BF16, F32))]
    # per eligible layer: dlhs = g . rhs (e5m2 x e4m3) and drhs = lhs . g (e4m3 x e5m2)
    assert sorted(float8_backward) == sorted([(E5M2, E4M3, F32), (E4M3, E5M2, F32)] * 2)
    assert all(E5M2 not in d for d in forward)


def test_outputs_and_gradients_keep_their_dtypes():
    f = jamp.autocast(loss, policy="fp8")
    assert f(PARAMS, X).dtype == jnp.float32
    grads = jax.jit(jax.grad(f, argnums=(0, 1)))(PARAMS, X.astype(jnp.bfloat16))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads[0]))
    assert grads[1].dtype == jnp.bfloat16
    bf16_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(jax.grad(f)(bf16_params, X)))


def test_numerics_are_close_to_float32():
    """Measured: loss 2%, gradients 3-8% (e5m2 keeps 2 mantissa bits; bf16 autocast: under 1%)."""
    value, grads = jax.jit(jax.value_and_grad(jamp.autocast(loss, policy="fp8")))(PARAMS, X)
    value32, grads32 = jax.value_and_grad(loss)(PARAMS, X)
    assert relative_error(value, value32) < 0.03
    for g, g32 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads32)):
        assert relative_error(g, g32) < 0.1


def test_residuals_are_float8():
    """The forward keeps its float8 operands for the backward pass: 1 byte per element."""
    f = jamp.autocast(lambda w, x: jnp.tanh(x @ w).sum(), policy="fp8")
    w, x = jnp.ones((32, 64)), jnp.ones((16, 32))
    _, vjp = jax.vjp(f, w, x)
    residual_dtypes = {str(r.dtype) for r in jax.tree.leaves(vjp) if hasattr(r, "dtype") and r.ndim == 2}
    assert E4M3 in residual_dtypes and F32 not in residual_dtypes


def test_lowering_shows_float8_types():
    step = jax.jit(jax.grad(jamp.autocast(loss, policy="fp8")))
    text = step.lower(PARAMS, X).as_text()
    assert "f8E4M3FN" in text and "f8E5M2" in text
    compiled = step.lower(PARAMS, X).compile().as_text()  # XLA:CPU emulates the float8 types
    assert "f8e4m3fn" in compiled and "f8e5m2" in compiled


@pytest.mark.parametrize(
    "fun,args",
    [
        (jnp.matmul, (jnp.ones((10, 12)), jnp.ones((12, 7)))),
        (lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), (jnp.ones((2, 16, 4, 16)), jnp.ones((2, 16, 4, 16)))),
        (jnp.matmul, (jnp.ones((2, 16, 32)), jnp.ones((2, 32, 16)))),  # batched
        (jnp.matmul, (jnp.ones((32, 16)), jnp.ones((16,)))),  # matrix-vector
    ],
)
def test_ineligible_matmuls_follow_the_bf16_rule(fun, args):
    assert dtypes_of(jamp.autocast(fun, policy="fp8"), *args) == [(BF16, BF16, BF16)]


def test_integer_matmul_is_never_cast():
    a, b = jnp.ones((32, 16), jnp.int32), jnp.ones((16, 32), jnp.int32)
    assert dtypes_of(jamp.autocast(jnp.matmul, policy="fp8"), a, b) == dtypes_of(jnp.matmul, a, b)


def test_region_modes_decide_where_float8_applies():
    f = jamp.autocast(loss, policy=jamp.get_policy("fp8").with_rules({"Dense_1": "float32"}))
    assert dtypes_of(f, PARAMS, X) == [FORWARD_DOT, (F32, F32, F32), (BF16, BF16, BF16)]
    f = jamp.autocast(loss, policy=jamp.get_policy("fp8").with_rules({"Dense_1": "compute"}))
    assert dtypes_of(f, PARAMS, X)[:2] == [FORWARD_DOT, FORWARD_DOT]
    inner_off = lambda p, x: jamp.autocast(loss, enabled=False)(p, x)
    assert dtypes_of(jamp.autocast(inner_off, policy="fp8"), PARAMS, X) == [(F32, F32, F32)] * 3


def test_other_ops_follow_the_bf16_gpu_policy():
    f = lambda x, w: jnp.exp(jax.nn.gelu(x @ w)).sum()
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    fp8_ops = {(r.primitive, r.ran_dtypes) for r in jamp.explain(f, policy="fp8")(x, w).rows if not r.flops}
    bf16_ops = {
        (r.primitive, r.ran_dtypes) for r in jamp.explain(f, policy="gpu", dtype="bf16")(x, w).rows if not r.flops
    }
    assert fp8_ops == bf16_ops and ("exp", (F32,)) in fp8_ops


def test_autocast_of_grad_runs_the_backward_dots_forward_style():
    """``jamp.autocast(jax.grad(f))`` sees the backward matmuls as ordinary dots: eligible ones run
    e4m3 x e4m3 (the weight gradients contract two dimensions and are eligible too)."""
    f = jamp.autocast(jax.grad(loss), policy="fp8")
    dots = dtypes_of(f, PARAMS, X)
    # forward: Dense_0, Dense_1; backward: both kernels' gradients and Dense_1's input gradient (JAX
    # computes no input gradient for Dense_0); the 10-wide head's three dots are not eligible
    assert dots.count(FORWARD_DOT) == 2 + 3 and dots.count((BF16, BF16, BF16)) == 3 and E5M2 not in str(dots)
    grads, grads32 = f(PARAMS, X), jax.grad(loss)(PARAMS, X)
    for g, g32 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads32)):
        assert g.dtype == jnp.float32 and relative_error(g, g32) < 0.1


def test_a_grad_between_two_autocasts_is_the_autocast_of_grad_order():
    """docs/fp8.md: a nested autocast marks its region and the outermost one applies it after JAX has
    differentiated, so explaining ``grad(autocast(loss))`` reports the second order's e4m3 x e4m3
    backward dots, while the function run on its own takes the cotangent in e5m2."""
    step = jax.grad(jamp.autocast(loss, policy="fp8"))
    assert E5M2 in str(dtypes_of(step, PARAMS, X))
    explained = [r.ran_dtypes for r in jamp.explain(step)(PARAMS, X).rows if r.primitive == "dot_general"]
    assert explained.count((E4M3, E4M3)) == 2 + 3 and E5M2 not in str(explained)


def test_composes_with_scan_remat_and_vmap():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(32)(jax.nn.gelu(nn.Dense(64)(x))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
            return blocks(name="blocks")(x, None)[0]

    params = Stack().init(jax.random.key(0), X)
    stack_loss = lambda p, x: jnp.mean(Stack().apply(p, x) ** 2)
    f = jamp.autocast(stack_loss, policy="fp8")
    dots = dtypes_of(jax.grad(f), params, X)
    assert {E4M3, E5M2} <= {d for dot in dots for d in dot} and BF16 not in str(dots)
    grads = jax.jit(jax.grad(f))(params, X)
    for g, g32 in zip(jax.tree.leaves(grads), jax.tree.leaves(jax.grad(stack_loss)(params, X))):
        assert g.dtype == jnp.float32 and relative_error(g, g32) < 0.15
    batched = jax.vmap(f, in_axes=(None, 0))(params, X[:, None])  # each mapped slice gets its own scales
    np.testing.assert_allclose(batched, [f(params, x[None]) for x in X], rtol=1e-6)


def test_float16_compute_dtype():
    f = jamp.autocast(lambda x, w: x @ w, policy="fp8", dtype=jnp.float16)
    assert f(jnp.ones((16, 32)), jnp.ones((32, 16))).dtype == jnp.float32
    jaxpr = jax.make_jaxpr(f)(jnp.ones((16, 32)), jnp.ones((32, 16)))
    assert dtypes_of(f, jnp.ones((16, 32)), jnp.ones((32, 16))) == [FORWARD_DOT]
    assert "f16[16,16]" in str(jaxpr)


# ---------------------------------------------------------------- precision tools


def test_explain_reports_the_float8_flop_share():
    report = jamp.explain(loss, policy="fp8")(PARAMS, X)
    dots = [r for r in report.rows if r.primitive == "dot_general"]
    assert [r.ran_dtypes for r in dots] == [(E4M3, E4M3), (E4M3, E4M3), (BF16, BF16)]
    assert [r.float8 for r in dots] == [True, True, False] and all(r.low_precision for r in dots)
    flops = [r.flops for r in dots]
    summary = report.summary
    assert summary["float8_flop_share"] == pytest.approx((flops[0] + flops[1]) / sum(flops))
    assert summary["low_precision_flop_share"] == 1.0
    assert jamp.explain(loss, policy="gpu")(PARAMS, X).summary["float8_flop_share"] == 0.0


def test_find_overflow_runs_with_the_fp8_policy():
    def scaled_loss(p, x):
        return loss(p, x * 1e5)

    assert jamp.find_overflow(loss, policy="fp8")(PARAMS, X) is None
    assert jamp.find_overflow(jax.value_and_grad(loss), policy="fp8")(PARAMS, X) is None
    # float8 products emitted in float16 overflow where float32 does not; the finding names the float8 dot
    finding = jamp.find_overflow(scaled_loss, policy="fp8", dtype=jnp.float16)(PARAMS, X)
    assert (finding.kind, finding.primitive, finding.path) == ("overflow", "dot_general", "MLP/Dense_0")
    assert finding.input_dtypes == (E4M3, E4M3) and finding.output_dtype == F16
