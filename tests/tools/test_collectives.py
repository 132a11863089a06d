"""jamp.collectives: what crosses devices, read after SPMD partitioning."""

import json

import jax
import jax.numpy as jnp
import pytest
from helpers import run_subprocess

import jamp
from jamp.tools.collectives import parse_hlo

HLO = """
HloModule m
ENTRY %main {
  %p = f32[64,16]{1,0} parameter(0)
  %dot.1 = bf16[32,16]{1,0} dot(%a, %b)
  %all-reduce = bf16[32,16]{1,0} all-reduce(%dot.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %all-reduce.1 = (f32[8]{0}, bf16[4,4]{1,0}) all-reduce(%x, %y), channel_id=2, to_apply=%add
  %all-gather = bf16[64,16]{1,0} all-gather(%c), channel_id=3, dimensions={0}
  ROOT %reduce-scatter = f32[8,16]{1,0} reduce-scatter(%p), channel_id=4, dimensions={0}, to_apply=%add
}
"""


def test_parse_hlo_counts_kinds_dtypes_and_bytes():
    rows = parse_hlo(HLO)
    assert [tuple(r) for r in rows] == [
        ("all-reduce", "bfloat16", 2, 32 * 16 * 2 + 16 * 2),
        ("all-reduce", "float32", 1, 8 * 4),
        ("reduce-scatter", "float32", 1, 64 * 16 * 4),  # the operand: the array that is reduced
        ("all-gather", "bfloat16", 1, 64 * 16 * 2),
    ]
    assert rows.select("all-reduce") == {"bfloat16": 2, "float32": 1}
    text = str(rows)
    assert text.splitlines()[0].split() == ["kind", "dtype", "count", "bytes"]
    assert "1,056" in text and "reduce-scatter" in text


def test_one_device_program_has_none():
    rows = jamp.collectives(lambda x: jnp.sin(x) @ x, jnp.ones((4, 4)))
    assert rows == () and str(rows) == "no collectives"


SCRIPT = r"""
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jamp
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
w = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("d")))
x = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("d")))
def loss(w, x):
    return jnp.sum(jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32))
grad = jax.jit(jax.grad(loss))
rows = jamp.collectives(grad, w, x)
final = grad.lower(w, x).compile().as_text()
print(json.dumps({"rows": [list(r) for r in rows], "table": str(rows),
                  "final_has_bf16_all_reduce": "bf16" in "".join(l for l in final.splitlines() if "all-reduce(" in l)}))
"""


@pytest.mark.multidevice
def test_reads_the_dtype_a_gpu_would_send():
    out = json.loads(run_subprocess(SCRIPT, env={"PYTHONPATH": "tests"}).strip().splitlines()[-1])
    kinds = {(k, d) for k, d, _, _ in out["rows"]}
    assert ("all-gather", "bfloat16") in kinds  # the float32 parameter cast on its shard, then gathered
    assert ("all-reduce", "bfloat16") in kinds  # the hand-cast weight gradient, summed in bfloat16
    assert all(d == "bfloat16" for k, d, _, _ in out["rows"])
    assert not out["final_has_bf16_all_reduce"]  # what XLA:CPU's later passes make of it: float32
    assert "all-gather" in out["table"] and "bytes" in out["table"]
    assert jax.tree.map(lambda r: isinstance(r, (int, str)), out["rows"])
