"""jamp.explain and jamp.find_overflow, and region rules on flax linen and NNX models."""

import csv
import io
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import dtypes_of

import jamp

X = jax.random.normal(jax.random.key(1), (2, 8))


class Block(nn.Module):
    scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(nn.LayerNorm()(x))
        h = jax.nn.relu(h) * self.scale
        return jax.nn.log_softmax(nn.Dense(4, name="lm_head")(h))


PARAMS = Block().init(jax.random.key(0), X)


def test_explain_rows_name_source_module_path_and_rule():
    report = jamp.explain(Block().apply, device_type="gpu")(PARAMS, X)
    dots = [r for r in report.rows if r.primitive == "dot_general"]
    assert [r.path for r in dots] == ["Block/Dense_0", "Block/lm_head"]
    assert all(r.ran_dtypes == ("float16", "float16") and r.traced_dtypes == ("float32", "float32") for r in dots)
    assert all(r.rule == "lower" and "linear.py" in r.source for r in dots)
    assert [r.casts for r in dots] == [2, 1]  # lm_head's input already arrives in float16
    norm = [r for r in report.rows if r.path == "Block/LayerNorm_0" and r.primitive == "rsqrt"]
    assert norm[0].rule == "float32" and norm[0].mode == "float32"  # the built-in LayerNorm* rule
    summary = report.summary
    assert summary["matmul_conv_count"] == 2 and summary["low_precision_flop_share"] == 1.0
    assert summary["casts_inserted"] == sum(r.casts for r in report.rows) > 0
    assert summary["activation_bytes_saved"] > 0


def test_explain_flop_share_counts_float32_regions():
    policy = jamp.get_policy("gpu").with_rules({"lm_head": "float32"})
    report = jamp.explain(Block().apply, policy=policy)(PARAMS, X)
    flops = {r.path: r.flops for r in report.rows if r.flops}
    assert flops == {"Block/Dense_0": 2 * 2 * 8 * 16, "Block/lm_head": 2 * 2 * 16 * 4}
    assert report.summary["low_precision_flop_share"] == pytest.approx(256 / (256 + 128))


def test_explain_reports_what_custom_vjp_ran_on():
    @jax.custom_vjp
    def f(a):
        return a * 2

    f.defvjp(lambda a: (a * 2, None), lambda _, g: (g * 2,))
    report = jamp.explain(lambda w, x: f(x @ w), dtype="bf16")(jnp.eye(8), X)
    row = next(r for r in report.rows if r.primitive == "custom_vjp_call")
    assert row.arrived_dtypes == ("bfloat16",) and row.ran_dtypes == ("float32",) and row.casts == 1


class TwoBlocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
            x = x + nn.Dense(8)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))
        return Block().apply(PARAMS, x[0])


def test_explain_prints_one_row_per_module_path_at_human_width():
    x = jnp.ones((2, 4, 8))
    params = TwoBlocks().init(jax.random.key(0), x)
    report = jamp.explain(TwoBlocks().apply, device_type="gpu")(params, x)
    lines = str(report).splitlines()
    paths = {r.path for r in report.rows}
    assert max(map(len, lines)) <= 120 and len(lines) < len(report.rows) // 2
    assert [line.split()[0] for line in lines if line.split()[:1] == ["TwoBlocks/Dense_1"]] == ["TwoBlocks/Dense_1"]
    assert len([line for line in lines if line.startswith(" TwoBlocks")]) <= len(paths)
    dense = next(line for line in lines if line.startswith(" TwoBlocks/Dense_0 "))
    assert "f16" in dense and "lower 1" in dense and "flax/linen/linear.py:" in dense
    assert "site-packages" not in str(report)
    full = report.to_text(full=True).splitlines()
    assert sum(" dot_general " in line for line in full) == sum(r.primitive == "dot_general" for r in report.rows)
    assert any("flax/linen/linear.py:" in line and "(Dense.__call__)" in line for line in full)


def test_short_source_is_relative_to_the_package_root_or_the_cwd(monkeypatch, tmp_path):
    import flax

    from jamp.tools.sources import short_source

    linear = os.path.join(os.path.dirname(flax.__file__), "linen", "linear.py")
    assert short_source(f"{linear}:287 (Dense.__call__)") == "flax/linen/linear.py:287 (Dense.__call__)"
    monkeypatch.chdir(tmp_path)
    assert short_source(f"{tmp_path}/model.py:3 (loss)") == "model.py:3 (loss)"
    assert short_source("") == ""


def test_explain_renders_and_exports():
    report = jamp.explain(Block().apply, device_type="cpu")(PARAMS, X)
    text = str(report)
    assert "Block/lm_head" in text and "lower 1" in text and "low_precision_flop_share" in text
    assert "dot_general" in report.to_text(full=True)
    rows = list(csv.DictReader(io.StringIO(report.to_csv())))
    assert len(rows) == len(report.rows) and rows[0].keys() >= {"primitive", "source", "path", "ran_dtypes"}
    assert report.to_dicts()[0]["primitive"] == report.rows[0].primitive


def test_explain_sees_inside_higher_order_primitives_and_grad():
    def loss(p, x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(Block().apply(p, c)) @ jnp.ones((4, 8)), None), x, None, length=2)[
            0
        ].sum()

    report = jamp.explain(jax.grad(loss), dtype="bf16")(PARAMS, X)
    dots = [r for r in report.rows if r.primitive == "dot_general"]
    assert len(dots) == 8 and all(r.low_precision for r in dots)  # 3 forward + 5 backward


def test_find_overflow_points_at_the_op_and_its_source_line():
    def loss(p, x):
        return -Block(scale=1e5).apply(p, x).mean()

    finding = jamp.find_overflow(loss, device_type="gpu")(PARAMS, X)
    assert finding is not None and finding.kind == "overflow"
    # 1e5 does not fit float16, so the multiply runs in float32; its result overflows in lm_head's matmul
    assert (finding.primitive, finding.path, finding.output_dtype) == ("dot_general", "Block/lm_head", "float16")
    assert "linear.py" in finding.source and "Dense.__call__" in finding.source
    assert finding.input_dtypes == ("float16", "float16") and finding.bad_elements == finding.total_elements
    # bfloat16 has float32's range: nothing overflows there
    assert jamp.find_overflow(loss, device_type="cpu")(PARAMS, X) is None
    # and an unscaled model is clean
    assert jamp.find_overflow(lambda p, x: -Block().apply(p, x).mean(), device_type="gpu")(PARAMS, X) is None


def test_find_overflow_compiles_one_program_and_reruns_it(compilations):
    """Both programs and every comparison in one compiled program, kept per argument signature: its
    cost is about an autocast forward plus a float32 forward, not a dispatch and a compile per op."""
    check = jamp.find_overflow(lambda p, x, s: -Block(scale=s).apply(p, x).mean(), device_type="gpu")
    big, small, one_row = jnp.float32(1e5), jnp.float32(1.0), X[:1]
    compilations.clear()
    first = check(PARAMS, X, big)
    assert len(compilations) == 1
    assert (first.kind, first.primitive, first.path) == ("overflow", "mul", "Block")  # relu(h) * s in float16
    assert check(PARAMS, X, big) == first and len(compilations) == 1
    assert check(PARAMS, X, small) is None and len(compilations) == 1  # same signature: the same program
    check(PARAMS, one_row, big)
    assert len(compilations) == 2


def test_find_overflow_in_a_dense_layer():
    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="lm_head", kernel_init=nn.initializers.constant(100.0))(x)

    x = jnp.full((2, 8), 100.0)
    params = Wide().init(jax.random.key(0), x)
    finding = jamp.find_overflow(Wide().apply, device_type="gpu")(params, x)
    assert (finding.primitive, finding.path) == ("dot_general", "Wide/lm_head")
    assert "linear.py" in finding.source and "Wide/lm_head" in str(finding)


def test_find_overflow_in_the_backward_pass():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w)) * 1e6  # forward fine in float32 range, backward cotangents huge

    finding = jamp.find_overflow(jax.grad(loss), device_type="gpu")(jnp.eye(8) * 0.01, X)
    assert finding is not None and finding.kind == "overflow" and finding.primitive in ("mul", "dot_general")


def test_find_overflow_underflow():
    f = lambda w, x: (x * 1e-5) @ w
    w = jnp.ones((8, 8)) * 1e-5
    finding = jamp.find_overflow(f, device_type="gpu")(w, X)
    assert finding.kind == "underflow" and finding.primitive == "dot_general"
    assert jamp.find_overflow(f, device_type="gpu", min_underflow=1.0)(w, jnp.abs(X) + 1) is None


def test_find_overflow_rejects_bad_threshold():
    with pytest.raises(ValueError, match="min_underflow"):
        jamp.find_overflow(lambda x: x, min_underflow=2)


def test_linen_module_path_rules_innermost_wins():
    policy = jamp.get_policy("cpu").with_rules({"Block*": "float32", "*/lm_head": "autocast"})
    assert dtypes_of(jamp.autocast(Block().apply, policy=policy), PARAMS, X) == [("float32",) * 3, ("bfloat16",) * 3]


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(8, 16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.body(x))
        with jax.named_scope("head"):  # NNX adds no name scopes itself: name the region you want
            return self.head(h)


def test_nnx_region_rule_by_name_scope_and_by_nested_autocast():
    model = NNXModel(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    apply = lambda s, x: nnx.merge(graphdef, s)(x)
    policy = jamp.get_policy("cpu").with_rules({"head": "float32"})
    assert dtypes_of(jamp.autocast(apply, policy=policy), state, X) == [("bfloat16",) * 3, ("float32",) * 3]

    def apply_nested(s, x):
        m = nnx.merge(graphdef, s)
        return jamp.autocast(m.head, enabled=False)(jax.nn.relu(m.body(x)).astype(jnp.float32))

    assert dtypes_of(jamp.autocast(apply_nested, dtype="bf16"), state, X) == [("bfloat16",) * 3, ("float32",) * 3]


def test_explain_and_find_overflow_walk_literal_values():
    """Literals (a Python bool, typed scalars) as outputs of branches, loop bodies, a custom_vjp, a jit, a
    shard_map body and the function: both tools walk past them to the overflow that follows."""
    from jax.sharding import PartitionSpec as P

    @jax.custom_vjp
    def matmul_flagged(h, w):
        return h @ w, jnp.array(False)

    matmul_flagged.defvjp(lambda h, w: (matmul_flagged(h, w), (h, w)), lambda r, ct: (ct[0] @ r[1].T, r[0].T @ ct[0]))
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    flagged = lambda h, w: (h @ w, jnp.array(False), jnp.float32(1.5))

    def f(w, x):
        h, a, _ = jax.lax.cond(x.sum() > 0, flagged, lambda h, w: (h, jnp.array(True), jnp.float32(2.5)), x, w)
        (h, b, _), _ = jax.lax.scan(
            lambda c, _: (flagged(c[0], w), jnp.array(True)), (h, a, jnp.float32(0)), None, length=2
        )
        h, c, _ = jax.lax.while_loop(lambda c: c[1], lambda c: flagged(c[0], w), (h, b, jnp.float32(0)))
        h, d = matmul_flagged(h, w)
        h, e, _ = jax.jit(flagged)(h, w)
        h, g, _ = jax.shard_map(flagged, mesh=mesh, in_specs=P(), out_specs=P())(h, w)
        return (h * 1e5) @ w, a | b | c | d | e | g, jnp.array(False), jnp.float16(2)

    w = jnp.eye(8) + 0.1
    report = jamp.explain(f, device_type="gpu")(w, X)
    dots = [r for r in report.rows if r.primitive == "dot_general"]
    assert len(dots) == 7 and all(r.ran_dtypes == ("float16", "float16") for r in dots)
    assert {"cond", "scan", "while", "custom_vjp_call", "shard_map"} <= {r.primitive for r in report.rows}
    finding = jamp.find_overflow(f, device_type="gpu")(w, X)
    assert (finding.kind, finding.primitive, finding.source) == ("overflow", "dot_general", dots[-1].source)
