"""jamp.explain and jamp.find_overflow see inside every higher-order primitive autocast enters (issue 37.2):
they observe autocast's own interpreter, so a scan's iterations, a while loop's, the branch a cond takes,
a shard_map body on each device and a lower_precision call are checked op by op, and a model scanned
over its layers (flax nn.scan, NNX nnx.scan, Haiku hk.layer_stack) reports the layer that overflowed."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import run_subprocess

import jamp
from jamp import _jax_compat as jc
from jamp.casting.rules import HIGHER_ORDER_RULES

D = 256
X = jnp.ones((2, D))
W = jnp.full((D, D), 300.0)  # x @ W is 76800 for a row of ones: past float16's 65504
SCALES = jnp.array([1e-4, 1e-4, 1.0])  # a layer per scale: the third one overflows


def _layer(h, w, s):
    return jnp.tanh(h @ (w * s))


def test_the_issue_scan_is_found_in_its_first_iteration():
    f = lambda x, w: jax.lax.scan(lambda c, _: (c + 0.0 * jnp.tanh(c @ w / 1e6), None), x, None, length=3)[0]
    finding = jamp.find_overflow(f, device_type="gpu")(X, W)
    assert (finding.kind, finding.primitive, finding.iteration) == ("overflow", "dot_general", (0,))
    assert "iteration 0 of scan (length 3)" in str(finding)


def test_a_scan_reports_the_iteration_that_overflowed_first():
    f = lambda x, w: jax.lax.scan(lambda h, s: (_layer(h, w, s), None), x, SCALES)[0]
    finding = jamp.find_overflow(f, device_type="gpu")(X, W)
    assert (finding.primitive, finding.iteration, finding.branch) == ("dot_general", (2,), ())
    assert finding.bad_elements == finding.total_elements == X.size
    # a reversed scan reports the index along the scanned axis: the scale that broke, not the step
    g = lambda x, w: jax.lax.scan(lambda h, s: (_layer(h, w, s), None), x, SCALES[::-1], reverse=True)[0]
    assert jamp.find_overflow(g, device_type="gpu")(X, W).iteration == (0,)
    assert jamp.find_overflow(f, device_type="gpu")(X, W / 1e3) is None


def test_nested_scans_report_both_iterations():
    def f(x, w):
        inner = lambda h, s: (_layer(h, w, s), None)
        outer = lambda h, ss: (jax.lax.scan(inner, h, ss)[0], None)
        return jax.lax.scan(outer, x, jnp.stack([SCALES * 1e-2, SCALES]))[0]

    finding = jamp.find_overflow(f, device_type="gpu")(X, W)
    assert finding.iteration == (1, 2) and "iteration 1 of scan (length 2), iteration 2 of scan (length 3)" in str(
        finding
    )


def test_a_while_loop_reports_its_iteration():
    def f(x, w):
        def body(c):
            i, h = c
            return i + 1, _layer(h, w, jnp.where(i == 3, 1.0, 1e-4))

        return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

    finding = jamp.find_overflow(f, device_type="gpu")(X, W)
    assert (finding.primitive, finding.iteration) == ("dot_general", (3,))
    assert "iteration 3 of while loop" in str(finding)


def test_a_cond_reports_the_branch_that_ran():
    f = lambda i, x, w: jax.lax.switch(i, [lambda x: x * 2, lambda x: jnp.tanh(x @ w), lambda x: x], x)
    finding = jamp.find_overflow(f, device_type="gpu")(1, X, W)
    assert (finding.primitive, finding.branch, finding.iteration) == ("dot_general", (1,), ())
    assert "branch 1 of cond" in str(finding)
    assert jamp.find_overflow(f, device_type="gpu")(0, X, W) is None  # the branch that overflows did not run


def test_a_lower_precision_call_is_compared_op_by_op_with_its_float32_trace():
    @jamp.lower_precision
    def attention(q, k):
        return jax.nn.softmax((q @ k.T) * 1000.0, axis=-1)  # jnp's sum upcasts float16: the traces differ there

    f = lambda q, k: attention(q, k).sum()
    finding = jamp.find_overflow(f, device_type="gpu")(jnp.full((4, 16), 3.0), jnp.full((4, 16), 3.0))
    assert (finding.primitive, finding.path, finding.input_dtypes) == ("mul", "attention", ("float16", "float16"))
    assert jamp.find_overflow(f, device_type="gpu", min_underflow=1)(jnp.ones((4, 16)), jnp.ones((4, 16))) is None


def _programs():
    """Per higher-order primitive: a program whose overflow is inside its body, and the Finding's iteration and
    branch."""
    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    matmul = lambda x, w: jnp.tanh(x @ w)
    jvp, vjp = jax.custom_jvp(matmul), jax.custom_vjp(matmul)
    jvp.defjvp(lambda p, t: (matmul(*p), t[0] @ p[1]))
    vjp.defvjp(lambda x, w: (matmul(x, w), (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    return {
        jc.JIT: (jax.jit(matmul), (), ()),
        jc.REMAT: (jax.checkpoint(matmul), (), ()),
        jc.SCAN: (lambda x, w: jax.lax.scan(lambda h, s: (_layer(h, w, s), None), x, SCALES)[0], (2,), ()),
        jc.WHILE: (
            lambda x, w: jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, matmul(c[1], w)), (0, x))[1],
            (0,),
            (),
        ),
        jc.COND: (lambda x, w: jax.lax.cond(x[0, 0] > 0, matmul, lambda x, w: x, x, w), (), (1,)),
        jc.CUSTOM_JVP: (jvp, (), ()),
        jc.CUSTOM_VJP: (vjp, (), ()),
        jc.SHARD_MAP: (jax.shard_map(matmul, mesh=mesh, in_specs=jax.P(), out_specs=jax.P()), (), ()),
    }


def test_every_higher_order_rule_is_entered_by_both_tools():
    """A higher-order rule the tools do not enter fails here: each primitive of the rule table, with an overflow
    inside its body, is found at the op inside; explain lists that op with the loop or branch around it."""
    programs = _programs()
    assert set(programs) == set(HIGHER_ORDER_RULES), "add a program for the new rule"
    for name, (f, iteration, branch) in programs.items():
        finding = jamp.find_overflow(f, device_type="gpu")(X, W)
        assert finding is not None, name
        assert (finding.primitive, finding.iteration, finding.branch) == ("dot_general", iteration, branch), name
        rows = jamp.explain(f, device_type="gpu")(X, W).rows
        assert name in {r.primitive for r in rows}, name
        (dot,) = [r for r in rows if r.primitive == "dot_general"]
        scopes = {
            jc.SCAN: "scan length 3",
            jc.WHILE: "while",
            jc.COND: "cond branch 1",
            jc.SHARD_MAP: "shard_map on 1 device",
        }
        scope = scopes.get(name, "")
        assert dot.scope == scope and dot.flops == 2 * X.size * D * (3 if name == jc.SCAN else 1), name


def test_explain_counts_a_scan_body_once_per_iteration_and_marks_while_loops():
    one = jamp.explain(lambda x, w: _layer(x, w, 1.0), device_type="gpu")(X, W)
    scanned = jamp.explain(lambda x, w: jax.lax.scan(lambda h, s: (_layer(h, w, s), None), x, SCALES)[0])(X, W)
    (dot,) = [r for r in scanned.rows if r.flops]
    assert (dot.repeats, dot.scope) == (3, "scan length 3") and dot.flops == 3 * sum(r.flops for r in one.rows)
    nested = lambda x, w: jax.lax.scan(
        lambda h, _: (jax.lax.scan(lambda g, s: (_layer(g, w, s), None), h, SCALES)[0], None), x, None, length=2
    )[0]
    (dot,) = [r for r in jamp.explain(nested)(X, W).rows if r.flops]
    assert (dot.repeats, dot.scope) == (6, "scan length 2 > scan length 3")
    looped = lambda n, x, w: jax.lax.fori_loop(0, n, lambda i, h: _layer(h, w, 1e-4), x)  # n traced: a while loop
    report = jamp.explain(looped)(jnp.int32(3), X, W)
    (dot,) = [r for r in report.rows if r.flops]
    assert (dot.repeats, dot.scope, dot.flops) == (1, "while", 2 * X.size * D)  # the trip count is not in the program
    assert report.summary["equations_in_while_loops"] == sum("while" in r.scope for r in report.rows) > 0
    branches = jamp.explain(lambda i, x, w: jax.lax.switch(i, [lambda x: x @ w, lambda x: x @ w @ w], x))(0, X, W)
    assert [r.scope for r in branches.rows if r.flops] == ["cond branch 0", "cond branch 1", "cond branch 1"]


# Models scanned over their layers, the way large JAX models are written: three layers, the overflow
# injected in one of them through its kernel (0.01s elsewhere: tanh keeps the activations below 1).
WIDTH = 64
INPUT = jnp.ones((4, WIDTH))


def _kernels(bad: int):
    return jnp.stack([jnp.full((WIDTH, WIDTH), 5000.0 if i == bad else 0.01) for i in range(3)])


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(WIDTH)(h)), None


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, h):
        layers = nn.scan(LinenLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return layers(name="layers")(h, None)[0]


def test_a_flax_linen_scanned_model_reports_the_layer_forward_and_backward():
    params = LinenModel().init(jax.random.key(0), INPUT)
    params["params"]["layers"]["Dense_0"]["kernel"] = _kernels(bad=2)
    finding = jamp.find_overflow(LinenModel().apply, device_type="gpu")(params, INPUT)
    assert (finding.primitive, finding.path, finding.iteration) == ("dot_general", "LinenModel/layers/Dense_0", (2,))
    # the backward pass runs the layers in reverse: the weight gradient of the last layer overflows first
    params["params"]["layers"]["Dense_0"]["kernel"] = _kernels(bad=-1)
    loss = lambda p, x: LinenModel().apply(p, x).sum() * 2.0**16
    assert jamp.find_overflow(loss, device_type="gpu")(params, INPUT) is None
    finding = jamp.find_overflow(jax.grad(loss), device_type="gpu", min_underflow=1)(params, INPUT)
    assert (finding.primitive, finding.iteration) == ("dot_general", (2,)) and "reversed" in finding.scope
    # explain counts what runs: the scanned layer's FLOPs three times
    report = jamp.explain(LinenModel().apply, device_type="gpu")(params, INPUT)
    one = jamp.explain(LinenLayer().apply, device_type="gpu")(
        {"params": jax.tree.map(lambda p: p[0], params["params"]["layers"])}, INPUT, None
    )
    assert sum(r.flops for r in report.rows) == 3 * sum(r.flops for r in one.rows) == 3 * 2 * INPUT.size * WIDTH


class NNXLayer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.linear(h))


def test_an_nnx_model_scanned_over_stacked_layers_reports_the_layer():
    layers = nnx.vmap(lambda key: NNXLayer(nnx.Rngs(key)))(jax.random.split(jax.random.key(0), 3))
    layers.linear.kernel[...] = _kernels(bad=1)
    graphdef, state = nnx.split(layers)

    def forward(state, h):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, layer):
            return layer(h)

        return body(h, nnx.merge(graphdef, state))

    finding = jamp.find_overflow(forward, device_type="gpu")(state, INPUT)
    assert (finding.primitive, finding.iteration) == ("dot_general", (1,))
    assert "nnx/nn/linear.py" in finding.source


def test_a_haiku_layer_stack_reports_the_layer():
    hk = pytest.importorskip("haiku")

    def forward(h):
        return hk.layer_stack(3)(lambda h: jnp.tanh(hk.Linear(WIDTH)(h)))(h)

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(0), INPUT)
    (name,) = params
    params[name]["w"] = _kernels(bad=2)
    finding = jamp.find_overflow(model.apply, device_type="gpu")(params, INPUT)
    assert (finding.primitive, finding.iteration) == ("dot_general", (2,))
    report = jamp.explain(model.apply, device_type="gpu")(params, INPUT)
    (dot,) = [r for r in report.rows if r.flops]
    assert (dot.flops, dot.repeats) == (3 * 2 * INPUT.size * WIDTH, 3)  # a 3-layer stack runs its layer 3 times


def test_shard_map_reports_the_device_and_the_iteration_on_it():
    """8 host devices: data shard 2 (devices 4 and 5 of the 4 x 2 mesh) holds the row that overflows."""
    out = run_subprocess(
        """
        import json
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jamp

        mesh = jax.make_mesh((4, 2), ("data", "model"))
        x = jax.device_put(jnp.ones((8, 64)).at[5].set(100.0), NamedSharding(mesh, P("data")))
        w = jnp.eye(64) * 1000.0
        def layers(x, w):  # the second layer overflows where the row is 100, and nowhere else
            return jax.lax.scan(lambda h, s: (h @ (w * s), None), x, jnp.array([1e-3, 1.0]))[0]
        f = jax.shard_map(layers, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
        finding = jamp.find_overflow(f, device_type="gpu")(x, w)
        clean = jamp.find_overflow(f, device_type="gpu")(x / 100, w)
        rows = jamp.explain(f, device_type="gpu")(x, w).rows
        dot = next(r for r in rows if r.flops)
        print(json.dumps({"finding": [finding.primitive, finding.device, finding.iteration, finding.bad_elements,
                                      finding.total_elements, finding.scope], "clean": clean is None,
                          "dot": [dot.flops, dot.repeats, dot.scope]}))
        """
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["finding"][:5] == ["dot_general", [4], [1], 64, 128]
    assert result["finding"][5] == "device 4 of shard_map, iteration 1 of scan (length 2)"
    assert result["clean"]
    assert result["dot"] == [8 * 2 * 2 * 2 * 64 * 64, 16, "shard_map on 8 devices > scan length 2"]


def test_explain_enters_a_lower_precision_kernel_that_refuses_float32():
    """explain evaluates the kernel as autocast runs it (compute dtype) and never traces it on float32."""

    @jamp.lower_precision
    def kernel(a, b):
        if a.dtype == jnp.float32:
            raise NotImplementedError("a kernel for float16/bfloat16 only")
        return jnp.tanh(a) @ b

    rows = jamp.explain(lambda x, w: kernel(x, w) + x @ w, device_type="gpu")(X, W).rows
    assert [r.ran_dtypes for r in rows if r.primitive == "dot_general"] == [("float16", "float16")] * 2
