"""The Triton kernel lowers for CUDA on this CPU-only machine (the Triton-to-PTX compile itself is not run)."""

import jax
import jax.numpy as jnp
import pytest
from helpers import lower_for_cuda
from jax.sharding import PartitionSpec as P

import jamp_kernels
from jamp_kernels import pallas_triton

TRITON = "__gpu$xla.gpu.triton"


def cuda_text(fn, *args) -> str:
    return lower_for_cuda(fn, *args).as_text()


def mixed_tree():
    return {
        "h": jnp.ones(4097, jnp.float16),
        "b": jnp.ones((33, 5), jnp.bfloat16),
        "f": jnp.ones(65537),
        "full": jnp.ones(8192),
        "scalar": jnp.float32(2.0),
        "step": jnp.int32(3),
    }


@pytest.mark.parametrize("backend", ["pallas", "auto"])
def test_one_triton_launch_covers_every_leaf(backend):
    text = cuda_text(lambda g: jamp_kernels.unscale_and_check(g, 0.5, backend=backend), mixed_tree())
    assert text.count(TRITON) == 1


def test_lowers_under_vmap():
    batch = {"w": jnp.ones((3, 1000)), "h": jnp.ones((3, 4097), jnp.float16)}
    fn = jax.vmap(lambda g: jamp_kernels.unscale_and_check(g, 0.5, backend="pallas"))
    assert cuda_text(fn, batch).count(TRITON) == 1


def test_auto_lowers_xla_for_cpu():
    text = jax.jit(lambda g: jamp_kernels.unscale_and_check(g, 0.5)).lower(mixed_tree()).as_text()
    assert TRITON not in text


def test_leaf_groups_bound_the_kernel_size(monkeypatch):
    monkeypatch.setattr(pallas_triton, "MAX_LEAVES_PER_CALL", 4)
    leaves = [jnp.ones(3 + i) for i in range(9)]
    text = cuda_text(lambda g: jamp_kernels.unscale_and_check(g, 0.5, backend="pallas"), leaves)
    assert text.count(TRITON) == 3


@pytest.mark.parametrize("donate", [False, True])
def test_donate_aliases_outputs_to_inputs(donate):
    fn = lambda g: jamp_kernels.unscale_and_check(g, 0.5, backend="pallas", donate=donate)
    text = cuda_text(fn, mixed_tree())
    assert ("output_operand_aliases" in text) == donate


def test_lowers_inside_shard_map_with_varying_axes_checked():
    """Inside a user's shard_map the output types carry the manual axes (check_vma=True)."""
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def step(g):
        out, found = jamp_kernels.unscale_and_check(g, 0.5, backend="pallas")
        return out, jax.lax.pmax(found, "d")

    fn = jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P()), check_vma=True)
    assert cuda_text(fn, {"w": jnp.ones(1000), "h": jnp.ones(64, jnp.float16)}).count(TRITON) == 1
