"""autocast's recompute (jamp.casting.recompute): what the backward pass keeps, and that nothing else changes.

The yardstick is the same model cast by hand: float32 parameters cast to bfloat16 at use, the norm in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import source_info_util
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import jamp
from jamp.casting import recompute

D, D_MLP, TOKENS, LAYERS = 64, 256, 48, 3


def _rms_norm(x, scale):
    wide = x.astype(jnp.float32)
    return (wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def _block(p, x, dtype=None):
    cast = (lambda w: w) if dtype is None else (lambda w: w.astype(dtype))
    return x + jax.nn.gelu(_rms_norm(x, p["scale"]) @ cast(p["w1"])) @ cast(p["w2"])


def _loss(dtype=None, scanned=False):
    def loss(params, x):
        x = x if dtype is None else x.astype(dtype)
        if scanned:
            x, _ = jax.lax.scan(lambda x, p: (_block(p, x, dtype), None), x, params)
        else:
            for p in params:
                x = _block(p, x, dtype)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    return loss


def _inputs(scanned=False):
    keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 1)
    layers = [
        {
            "scale": jnp.ones(D),
            "w1": jax.random.normal(keys[2 * i], (D, D_MLP)) / D**0.5,
            "w2": jax.random.normal(keys[2 * i + 1], (D_MLP, D)) / D_MLP**0.5,
        }
        for i in range(LAYERS)
    ]
    params = jax.tree.map(lambda *a: jnp.stack(a), *layers) if scanned else layers
    return params, jax.random.normal(keys[-1], (TOKENS, D))


def _residuals(fn, args) -> list:
    """The avals ``jax.vjp`` saves for the backward pass, arguments excluded."""
    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a), return_shape=True)(*args)
    n = len(jax.tree.leaves(shapes[1]))
    inputs = set(closed.jaxpr.invars)
    return [v.aval for v in closed.jaxpr.outvars[-n:] if isinstance(v, jax.extend.core.Var) and v not in inputs]


def _nbytes(avals) -> int:
    return sum(a.size * a.dtype.itemsize for a in avals)


def _autocast(fn, **options):
    return jamp.autocast(fn, device_type="cpu", **options)


@pytest.mark.parametrize("scanned", [False, True], ids=["unrolled", "scan"])
def test_saves_less_than_casting_by_hand(scanned):
    args = _inputs(scanned)
    hand = _nbytes(_residuals(_loss(jnp.bfloat16, scanned), args))
    kept = _nbytes(_residuals(_autocast(_loss(scanned=scanned), recompute=False), args))
    saved = _nbytes(_residuals(_autocast(_loss(scanned=scanned)), args))
    assert kept >= 0.95 * hand  # without recompute: about what the hand-cast model saves
    assert saved <= 0.9 * hand, (saved, hand)


def test_float32_island_keeps_its_low_precision_input():
    """A softmax on bfloat16 logits runs in float32 (a float32 op list); the backward pass keeps the
    bfloat16 logits, not the float32 probabilities."""

    def attend(q, k, v):
        return jax.nn.softmax(q @ k.T) @ v

    args = [jax.random.normal(key, (32, 16)) for key in jax.random.split(jax.random.key(1), 3)]
    gpu = dict(device_type="gpu", dtype=jnp.bfloat16)  # exp and reduce_sum are float32 on the GPU list
    kept = _residuals(jamp.autocast(attend, **gpu, recompute=False), args)
    saved = _residuals(jamp.autocast(attend, **gpu), args)
    assert any(a.shape == (32, 32) and a.dtype == jnp.float32 for a in kept)
    assert not any(a.shape == (32, 32) and a.dtype == jnp.float32 for a in saved)
    assert _nbytes(saved) < _nbytes(kept)


def test_scan_keeps_no_low_precision_copy_of_stacked_parameters():
    params, x = _inputs(scanned=True)
    shapes = {a.shape for a in jax.tree.leaves(params)}
    copies = [a for a in _residuals(_autocast(_loss(scanned=True)), (params, x)) if a.shape in shapes]
    assert not [a for a in copies if a.dtype == jnp.bfloat16], copies
    kept = _residuals(_autocast(_loss(scanned=True), recompute=False), (params, x))
    assert [a for a in kept if a.shape in shapes and a.dtype == jnp.bfloat16]  # what it avoids


@pytest.mark.parametrize("scanned", [False, True], ids=["unrolled", "scan"])
def test_forward_bit_identical_and_gradients_close(scanned):
    args = _inputs(scanned)
    on, off = _autocast(_loss(scanned=scanned)), _autocast(_loss(scanned=scanned), recompute=False)
    assert np.array_equal(on(*args), off(*args))
    assert np.array_equal(jax.jit(on)(*args), jax.jit(off)(*args))
    reference = jax.grad(_loss(scanned=scanned))(*args)
    grads = {name: jax.jit(jax.grad(f))(*args) for name, f in (("on", on), ("off", off))}

    def error(g) -> float:
        diff = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(g)))
        return (diff / sum(float(jnp.sum(a**2)) for a in jax.tree.leaves(reference))) ** 0.5

    assert error(grads["on"]) <= 1.2 * error(grads["off"]) + 1e-3
    for a, b in zip(jax.tree.leaves(grads["on"]), jax.tree.leaves(grads["off"])):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.02 * float(jnp.abs(b).max()))


def test_recompute_false_binds_no_checkpoint():
    args = _inputs()

    def remats(closed) -> int:
        return str(closed.jaxpr).count("remat")

    assert remats(_autocast(_loss(), recompute=False).rewrite(*args)[0]) == 0
    assert remats(_autocast(_loss()).rewrite(*args)[0]) > 0
    with pytest.raises((TypeError, ValueError), match="recompute"):
        jamp.autocast(_loss(), recompute="yes")


def test_islands_interleaved_with_a_matmul():
    """A matmul reads an early value of a chain of cheap ops, and a later op reads the matmul: the chain
    splits where the matmul falls, and the program computes what the original does."""

    def f(x, w):
        a = jnp.tanh(x)
        b = a @ w
        c = jnp.exp(a).sum(axis=-1, keepdims=True)
        return jnp.sum(jnp.sin(b) * c + jnp.log1p(a * a).mean())

    x, w = jax.random.normal(jax.random.key(2), (8, 8)), jax.random.normal(jax.random.key(3), (8, 8))
    for policy in (dict(device_type="gpu"), dict(device_type="cpu")):
        on, off = jamp.autocast(f, **policy), jamp.autocast(f, **policy, recompute=False)
        assert np.array_equal(on(x, w), off(x, w))
        for a, b in zip(jax.grad(on, argnums=(0, 1))(x, w), jax.grad(off, argnums=(0, 1))(x, w)):
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-2)


def test_effects_keep_the_program_as_rewritten():
    def f(x):
        jax.debug.print("{}", x.sum())
        return jnp.sum(jnp.exp(jnp.tanh(x)))

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    assert recompute.with_recompute(closed) is closed
    g = jax.grad(_autocast(f))(jnp.ones(3))
    np.testing.assert_allclose(g, jax.grad(f)(jnp.ones(3)), rtol=1e-2)


def _flax_scans():
    """(loss, params) of the blocks under flax linen's nn.scan and under nnx.scan."""
    flax_linen = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")

    class Block(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x, _):
            h = flax_linen.gelu(flax_linen.Dense(D_MLP, use_bias=False)(flax_linen.RMSNorm()(x)))
            return x + flax_linen.Dense(D, use_bias=False)(h), None

    class Stack(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x):
            scanned = flax_linen.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
            return scanned()(x, None)[0]

    x = jax.random.normal(jax.random.key(1), (TOKENS, D))
    model = Stack()
    linen = (lambda p, x: jnp.mean(model.apply(p, x) ** 2), model.init(jax.random.key(0), x))

    class NBlock(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.RMSNorm(D, rngs=rngs)
            self.w1 = nnx.Linear(D, D_MLP, use_bias=False, rngs=rngs)
            self.w2 = nnx.Linear(D_MLP, D, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return x + self.w2(nnx.gelu(self.w1(self.norm(x))))

    blocks = nnx.vmap(lambda key: NBlock(nnx.Rngs(key)))(jax.random.split(jax.random.key(0), LAYERS))
    graphdef, state = nnx.split(blocks)

    def nnx_loss(state, x):
        scanned = nnx.scan(lambda b, x: b(x), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        return jnp.mean(scanned(nnx.merge(graphdef, state), x) ** 2)

    return {"nn.scan": linen, "nnx.scan": (nnx_loss, state)}, x


def test_flax_scans_keep_no_low_precision_copy_of_stacked_parameters():
    scans, x = _flax_scans()
    for name, (loss, params) in scans.items():
        shapes = {a.shape for a in jax.tree.leaves(params) if a.ndim == 3}
        assert shapes, name
        saved = _residuals(_autocast(loss), (params, x))
        kept = _residuals(_autocast(loss, recompute=False), (params, x))
        assert not [a for a in saved if a.shape in shapes and a.dtype == jnp.bfloat16], name
        assert [a for a in kept if a.shape in shapes and a.dtype == jnp.bfloat16], name
        assert _nbytes(saved) <= 0.5 * _nbytes(kept), name


def _tanh_layer(x, w):
    return jnp.tanh(x @ w) * 2.0


def _sin_layer(x, w):  # the same structure as _tanh_layer, written on other lines
    return jnp.tanh(x @ w) * 2.0


def _ops_in_checkpoints(fn, *args) -> set[tuple[str, str]]:
    """(function of the user frame, primitive) of every equation inside a checkpoint of ``fn``'s rewrite."""
    closed = jax.make_jaxpr(jamp.autocast(fn, device_type="gpu"))(*args)
    return {
        (source_info_util.user_frame(inner.source_info.traceback).function_name, inner.primitive.name)
        for eqn in closed.jaxpr.eqns
        if eqn.primitive.name == "remat2"
        for inner in eqn.params["jaxpr"].eqns
    }


def test_checkpointed_groups_keep_their_own_source_lines():
    """Two functions of the same structure each keep their own lines in the checkpoints (and so in the compiled
    program's locations), not the lines of the first one seen."""
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8)) / 8
    ops = _ops_in_checkpoints(lambda x, w: jnp.sum(_sin_layer(_tanh_layer(x, w), w) @ w), x, w)
    # the matmuls of float32 operands: wide_matmul, whose gradients in them come out in float32
    assert {("_tanh_layer", "tanh"), ("_sin_layer", "tanh"), ("_tanh_layer", "wide_matmul")} <= ops, ops
    assert ("_sin_layer", "wide_matmul") in ops, ops


def test_user_checkpoint_names_reach_the_backward_pass(capsys):
    """A value the user named with ``checkpoint_name`` is saved under its name by an outer
    ``save_only_these_names`` policy, as without autocast (JAX's residual printer names it)."""

    def f(w, x):
        h = checkpoint_name(jnp.tanh(x @ w) * 2, "hidden")
        return jnp.sum(jnp.exp(h) * h)

    policy = jax.checkpoint_policies.save_only_these_names("hidden")
    w, x = jnp.ones((8, 8)) / 8, jnp.ones((4, 8))
    for fn in (f, jamp.autocast(f, device_type="gpu")):
        print_saved_residuals(jax.checkpoint(fn, policy=policy), w, x)
        saved = [line for line in capsys.readouterr().out.splitlines() if "argument" not in line]
        assert len(saved) == 1 and "named 'hidden'" in saved[0], saved


def test_a_call_with_arrays_does_not_regroup_the_program(monkeypatch):
    """Passes over the program per cache miss: a call with arrays traces the function, rewrites it and compiles
    it (checkpoints change nothing in a forward pass); under ``grad`` the rewritten program is regrouped once
    instead of compiled, with the same values."""
    regrouped = []
    monkeypatch.setattr(recompute, "with_recompute", lambda closed: regrouped.append(closed) or closed)
    params, x = _inputs()
    amp = _autocast(_loss())
    value = amp(params, x)
    assert regrouped == []
    grad_value, _ = jax.value_and_grad(amp)(params, x)
    assert len(regrouped) == 1 and float(grad_value) == float(value)
