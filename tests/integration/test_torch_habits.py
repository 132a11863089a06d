"""What a PyTorch AMP user types first gets an error that says what to write in jamp (issue 29)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import eqns

import jamp
from jamp import _torch_names

# torch.amp name -> a piece of the jamp form the message must show
TORCH_NAMES = {
    "GradScaler": r"tx = jamp\.scaler\(optax\.adam\(1e-3\)\).*jamp\.scale\(loss, opt_state\).*tx\.update\(grads, "
    r"opt_state, params\)",
    "ShardedGradScaler": r"jamp\.scaler\(optimizer, axis_name=\.\.\.\)",
    "custom_bwd": r"not needed.*jamp\.custom_fwd\(fn, cast_inputs=jnp\.float32\)",
    "amp": r"jamp\.autocast\(fn, device_type='gpu', dtype=jnp\.float16\).*jamp\.scaler\(optimizer\)",
    "autocast_mode": r"jamp\.autocast\(fn, device_type='gpu'",
    "cuda": r"torch\.cuda\.amp\.autocast is jamp\.autocast\(fn, device_type='gpu'",
    "cpu": r"jamp\.autocast\(fn, device_type='cpu'\)",
    "is_autocast_enabled": r"no global autocast state.*jamp\.explain\(fn, device_type='gpu'\)\(\*args\)",
    "get_autocast_dtype": r"jamp\.get_policy\('gpu'\)\.compute_dtype",
    "set_autocast_enabled": r"no global autocast state",
    "DynamicScale": r"jamp\.scaler\(optimizer\)",
}


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_torch_name_says_what_to_write(name):
    with pytest.raises(AttributeError, match=TORCH_NAMES[name]) as info:
        getattr(jamp, name)
    assert str(info.value).startswith(f"jamp.{name}: ")
    assert not hasattr(jamp, name)  # hasattr still works: the hint is an AttributeError


def test_every_hinted_name_is_missing_from_jamp():
    """A name that jamp gains stops being a hint silently; the table must not list it."""
    assert not set(_torch_names.MODULE_NAMES) & set(dir(jamp))


def test_other_missing_names_keep_pythons_message_and_suggestion():
    with pytest.raises(AttributeError, match=r"^module 'jamp' has no attribute 'scaler_'$") as info:
        jamp.scaler_  # noqa: B018
    assert info.value.name == "scaler_" and info.value.obj is jamp  # what Python's "Did you mean" reads


def _suggested_call(message: str) -> str:
    return re.search(r"Write (jamp\.autocast\(fn, [^)]*\))\(\*args\)", message).group(1)


@pytest.mark.parametrize(
    "args,kwargs,call",
    [
        (("cuda",), {"dtype": jnp.float16}, "jamp.autocast(fn, device_type='cuda', dtype=jnp.float16)"),
        (("cpu",), {}, "jamp.autocast(fn, device_type='cpu')"),
        (("gpu",), {"dtype": "bf16", "enabled": True}, "jamp.autocast(fn, device_type='gpu', dtype=jnp.bfloat16)"),
        (("bf16",), {"device_type": "cpu"}, "jamp.autocast(fn, dtype=jnp.bfloat16, device_type='cpu')"),
    ],
)
def test_positional_device_type_shows_the_keyword_call(args, kwargs, call):
    """torch.autocast("cuda", dtype=torch.float16): the message shows the call, and that call runs."""
    with pytest.raises(TypeError, match="is a keyword argument") as info:
        jamp.autocast(*args, **kwargs)
    message = str(info.value)
    assert _suggested_call(message) == call
    assert f"@{call.replace('fn, ', '')}" in message

    def fn(w, x):
        return x @ w

    amp = eval(call, {"jamp": jamp, "jnp": jnp, "fn": fn})
    w = jnp.ones((4, 4))
    dots = eqns(jax.make_jaxpr(amp)(w, w))  # recompute puts the matmul inside a checkpoint
    # the matmul, of float32 operands: a wide_matmul (its gradients in them come out in float32)
    assert any(e.primitive.name == "wide_matmul" and e.invars[0].aval.dtype != jnp.float32 for e in dots)


def test_non_string_non_callable_keeps_the_plain_message():
    with pytest.raises(TypeError, match=r"requires a callable, but got int"):
        jamp.autocast(3)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize(
    "method,shown",
    [
        ("step", r"updates, opt_state = tx\.update\(grads, opt_state, params\)"),
        ("scale", r"jamp\.scale\(loss, opt_state\)"),
        ("unscale_", r"not needed.*jamp\.scaler\(optax\.clip_by_global_norm\(1\.0\), optax\.adam\(1e-3\)\)"),
        ("get_scale", r"jamp\.get_scale\(opt_state\)"),
        (
            "set_growth_factor",
            r"opt_state = jamp\.load_state_dict\(opt_state, \{\*\*jamp\.state_dict\(opt_state\), 'growth_factor'",
        ),
    ],
)
def test_grad_scaler_methods_on_the_transformation_say_what_to_write(enabled, method, shown):
    """scaler.step(optimizer) and the other GradScaler methods, tried on what jamp.scaler returns."""
    tx = jamp.scaler(optax.adam(1e-3), enabled=enabled)
    expected = rf"^jamp\.scaler\(\.\.\.\)\.{method}: torch's scaler\.{method} is {shown}"
    with pytest.raises(AttributeError, match=expected):
        getattr(tx, method)
    assert isinstance(tx, optax.GradientTransformationExtraArgs) and not hasattr(tx, "no_such_name")
    state = optax.chain(tx, optax.identity()).init({"w": jnp.ones(2)})  # still an optax transformation
    assert jax.tree.leaves(state)
