"""Nested autocast regions, policy region rules (scopes, module paths, jit names) and custom_fwd."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dtypes_of, eqns

import jamp

F16, BF16, F32 = "float16", "bfloat16", "float32"
W = jax.random.normal(jax.random.key(0), (8, 8)) / 3
X = jax.random.normal(jax.random.key(1), (4, 8))


def test_nested_enabled_false_runs_in_input_precision():
    def inner(h, w):
        return h @ w

    def f(w, x):
        h = x @ w
        return jamp.autocast(inner, enabled=False)(h.astype(jnp.float32), w) @ w

    assert dtypes_of(jamp.autocast(f, dtype="bf16"), W, X) == [(BF16,) * 3, (F32,) * 3, (BF16,) * 3]
    # and in the backward pass too (as lowered for a GPU: a CPU computes the float32 weight gradients on float32
    # copies of the bfloat16 operands, jamp.casting.wide_cotangents)
    bwd = dtypes_of(jax.grad(lambda w, x: jamp.autocast(f, dtype="bf16")(w, x).sum()), W, X)
    assert bwd.count((F32,) * 3) == 3


def test_nested_enabled_false_casts_low_inputs_back_to_recorded_dtype():
    def f(w, x):
        h = x @ w  # bf16 at run time, f32 in the traced program
        return jamp.autocast(lambda a: jnp.exp(a) @ w, enabled=False)(h)

    assert dtypes_of(jamp.autocast(f, dtype="bf16"), W, X)[-1] == (F32,) * 3


def test_nested_dtype_switches_region_dtype():
    def f(w, x):
        h = jamp.autocast(lambda a: a @ w, dtype="float16")(x)
        return h @ w

    assert dtypes_of(jamp.autocast(f, dtype="bf16"), W, X) == [(F16,) * 3, (BF16,) * 3]


def _with_off(w, x):
    h = x @ w
    with jamp.autocast(enabled=False):
        h = h.astype(jnp.float32) @ w
    return h @ w


def _nested_off(w, x):
    h = x @ w
    return jamp.autocast(lambda h, w: h.astype(jnp.float32) @ w, enabled=False)(h, w) @ w


def _with_f16(w, x):
    with jamp.autocast(dtype=jnp.float16):
        h = x @ w
    return h @ w


def _nested_f16(w, x):
    return jamp.autocast(lambda x: x @ w, dtype=jnp.float16)(x) @ w


@pytest.mark.parametrize(
    "with_form,nested_form,forward",
    [
        (_with_off, _nested_off, [(BF16,) * 3, (F32,) * 3, (BF16,) * 3]),
        (_with_f16, _nested_f16, [(F16,) * 3, (BF16,) * 3]),
    ],
    ids=["enabled=False", "dtype=float16"],
)
def test_with_block_marks_the_region_as_the_nested_call_does(with_form, nested_form, forward):
    amp = jamp.autocast(with_form, dtype="bf16")
    assert dtypes_of(amp, W, X) == forward == dtypes_of(jamp.autocast(nested_form, dtype="bf16"), W, X)
    loss = lambda f: jax.grad(lambda w, x: jamp.autocast(f, dtype="bf16")(w, x).sum())
    backward = dtypes_of(loss(with_form), W, X)
    assert backward == dtypes_of(loss(nested_form), W, X)
    # the backward ops of a region keep its operand dtype (the float32 weights' gradients come out in float32)
    assert {b[:-1] for b in backward} == {f[:-1] for f in forward}
    np.testing.assert_allclose(amp(W, X), jamp.autocast(nested_form, dtype="bf16")(W, X), rtol=1e-6)


def test_with_block_holds_inside_jit_and_can_be_reused():
    off = jamp.autocast(enabled=False)

    def f(w, x):
        @jax.jit
        def inner(h):
            with off:
                return h.astype(jnp.float32) @ w

        with off:
            g = x @ w
        return inner(x @ w) @ w + g

    assert sorted(dtypes_of(jamp.autocast(f, dtype="bf16"), W, X)) == [(BF16,) * 3] * 2 + [(F32,) * 3] * 2


def test_with_block_outside_autocast():
    # enabled=False has nothing to turn off: model code that uses it also runs without autocast
    def model(w, x):
        with jamp.autocast(enabled=False):
            return x @ w

    assert dtypes_of(model, W.astype(jnp.bfloat16), X.astype(jnp.bfloat16)) == [(BF16,) * 3]
    np.testing.assert_array_equal(jax.jit(model)(W, X), X @ W)
    np.testing.assert_array_equal(jamp.autocast(model, enabled=False)(W, X), X @ W)
    # turning autocast on needs the function: the message shows the form to write
    with (
        pytest.raises(
            RuntimeError,
            match=r"jamp.autocast\(fn, device_type='gpu'\)\(\*args\).*"
            r"@jamp.autocast\(device_type='gpu'\)",
        ),
        jamp.autocast(device_type="gpu"),
    ):
        pass
    with pytest.raises(RuntimeError, match=r"jamp.autocast\(fn, dtype=jnp.float16\)"):
        jax.jit(_with_f16)(W, X)  # a jit is not an autocast
    # and the decorator form is unchanged
    assert dtypes_of(jamp.autocast(dtype=jnp.bfloat16)(_nested_off), W, X)[0] == (BF16,) * 3


def test_nested_region_inside_jit_and_scan():
    off = jamp.autocast(lambda a, w: a @ w, enabled=False)

    def f(w, x):
        def body(c, _):
            return jnp.tanh(off(c, w)) @ w, None

        return jax.jit(lambda x: jax.lax.scan(body, x, None, length=2)[0])(x).sum()

    assert sorted(dtypes_of(jamp.autocast(f, dtype="bf16"), W, X)) == [(BF16,) * 3, (F32,) * 3]


def test_top_level_enabled_false_is_the_function_itself():
    f = lambda w, x: x @ w
    assert dtypes_of(jamp.autocast(f, enabled=False), W, X) == dtypes_of(f, W, X)
    np.testing.assert_array_equal(jamp.autocast(f, enabled=False)(W, X), f(W, X))


def test_scope_rule_keeps_a_named_scope_in_float32():
    def f(w, x):
        with jax.named_scope("head"):
            h = x @ w
        return h @ w

    policy = jamp.get_policy("cpu").with_rules({"head": "float32"})
    assert dtypes_of(jamp.autocast(f, policy=policy), W, X) == [(F32,) * 3, (BF16,) * 3]


def test_innermost_rule_wins():
    def f(w, x):
        with jax.named_scope("block"):
            with jax.named_scope("attn"):
                a = x @ w
            b = a @ w
        return b

    policy = jamp.get_policy("cpu").with_rules({"block": "float32", "block/attn": "autocast"})
    assert dtypes_of(jamp.autocast(f, policy=policy), W, X) == [(BF16,) * 3, (F32,) * 3]
    glob = jamp.get_policy("cpu").with_rules({"*attn*": "float32"})
    assert dtypes_of(jamp.autocast(f, policy=glob), W, X) == [(F32,) * 3, (BF16,) * 3]


def test_jit_name_rule():
    @jax.jit
    def my_head(h, w):
        return h @ w

    policy = jamp.get_policy("cpu").with_rules({"my_head": "float32"})
    f = lambda w, x: my_head(x @ w, w)
    assert dtypes_of(jamp.autocast(f, policy=policy), W, X) == [(BF16,) * 3, (F32,) * 3]


def test_compute_and_native_modes():
    def f(w, x):
        with jax.named_scope("sm"):
            return jnp.exp(x @ w).sum()

    compute = jamp.get_policy("gpu").with_rules({"sm": "compute"})
    assert dtypes_of(jamp.autocast(f, policy=compute), W, X, primitive="exp")[0][-1] == F16
    # the sum's result is float16; it accumulates in float32 (the bound primitive's dtypes)
    (row,) = [r for r in jamp.explain(f, policy=compute)(W, X).rows if r.primitive == "reduce_sum"]
    assert row.out_dtypes == (F16,) and dtypes_of(jamp.autocast(f, policy=compute), W, X, primitive="reduce_sum") == [
        (F32, F32)
    ]

    def g(w, x):
        h = x @ w
        with jax.named_scope("sm"):
            return jnp.exp(h) * 2.0

    native = jamp.get_policy("gpu").with_rules({"sm": "native"})
    assert dtypes_of(jamp.autocast(g, policy=native), W, X, primitive="exp")[0][-1] == F16
    assert dtypes_of(jamp.autocast(g, device_type="gpu"), W, X, primitive="exp")[0][-1] == F32


def test_builtin_gpu_rules_keep_flax_layernorm_in_float32():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.LayerNorm()(nn.Dense(8)(x)))

    params = Block().init(jax.random.key(0), X)
    closed = jax.make_jaxpr(jamp.autocast(Block().apply, device_type="gpu"))(params, X)
    norm_ops = [
        e
        for e in eqns(closed)
        if "LayerNorm" in str(e.source_info.name_stack) and e.primitive.name in ("mul", "sub", "add", "rsqrt")
    ]
    assert norm_ops and all(str(e.outvars[0].aval.dtype) == F32 for e in norm_ops)
    assert dtypes_of(jamp.autocast(Block().apply, device_type="gpu"), params, X) == [(F16,) * 3] * 2


def test_custom_fwd_casts_inputs_and_disables_autocast():
    @jax.custom_vjp
    def matmul(a, w):
        return a @ w

    matmul.defvjp(lambda a, w: (a @ w, (a, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    kernel = jamp.custom_fwd(matmul, cast_inputs=jnp.float32)

    def f(w, x):
        return kernel((x @ w), w).sum()

    fwd = dtypes_of(jamp.autocast(f, dtype="bf16"), W, X)
    assert fwd == [(BF16,) * 3, (F32,) * 3]
    bwd = dtypes_of(jax.grad(jamp.autocast(f, dtype="bf16")), W, X)
    assert bwd.count((F32,) * 3) == 3  # the custom bwd runs with autocast off too
    # outside autocast it is a no-op: bf16 inputs stay bf16
    assert dtypes_of(kernel, X.astype(jnp.bfloat16), W.astype(jnp.bfloat16)) == [(BF16,) * 3]


def test_custom_fwd_without_cast_inputs_follows_autocast():
    k = jamp.custom_fwd(lambda a, w: a @ w)
    assert dtypes_of(jamp.autocast(lambda w, x: k(x, w), dtype="bf16"), W, X) == [(BF16,) * 3]


@pytest.mark.parametrize("bad", [jnp.float64, "int8", "float32x"])
def test_custom_fwd_rejects_bad_cast_inputs(bad):
    with pytest.raises(ValueError, match="cast_inputs"):
        jamp.custom_fwd(lambda x: x, cast_inputs=bad)
