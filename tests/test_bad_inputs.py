"""Every documented bad input raises the documented error, and the message names the argument."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import jamp
import jamp_kernels

IDENTITY = lambda x: x  # noqa: E731
GRADS = {"w": jnp.ones(3)}


def _state():
    return jamp.scaler(optax.sgd(0.1)).init(GRADS)


def _top_level_with():
    with jamp.autocast(device_type="gpu"):
        pass


def _with_static_argnums():
    def f(x):
        with jamp.autocast(enabled=False, static_argnums=0):
            return x

    jamp.autocast(f)(GRADS["w"])


def _restored_without_target():
    """What orbax's restore(path) gives for {"opt_state": _state()} without a target: NamedTuples become dicts."""
    return {"opt_state": _state()._asdict()}


# (description, thunk, exception type, regex the message must match)
BAD_INPUTS = [
    # autocast
    ("autocast dtype float32", lambda: jamp.autocast(IDENTITY, dtype=jnp.float32), ValueError, r"dtype=.*allowed"),
    ("autocast dtype float64", lambda: jamp.autocast(IDENTITY, dtype="float64"), ValueError, r"dtype=.*allowed"),
    ("autocast dtype int", lambda: jamp.autocast(IDENTITY, dtype=jnp.int8), ValueError, r"dtype=.*allowed"),
    ("autocast dtype typo", lambda: jamp.autocast(IDENTITY, dtype="bfloat"), ValueError, r"dtype='bfloat'"),
    ("autocast device_type", lambda: jamp.autocast(IDENTITY, device_type="xpu"), ValueError, r"device_type='xpu'"),
    ("autocast device_type not str", lambda: jamp.autocast(IDENTITY, device_type=0), ValueError, r"device_type=0"),
    ("autocast non-callable", lambda: jamp.autocast(3), TypeError, r"requires a callable, but got int"),
    ("autocast policy type", lambda: jamp.autocast(IDENTITY, policy=3.5), TypeError, r"policy must be"),
    ("autocast policy name", lambda: jamp.autocast(IDENTITY, policy="gpuu"), ValueError,
     (r"'gpuu' is not a policy name.*device name \('cpu', 'cuda', 'gpu', 'tpu'\).*'mixed_float16'.*'bf16'.*"
      r"p=f32,c=bf16,o=f32.*Did you mean 'gpu'\?")),
    ("autocast enabled not a bool", lambda: jamp.autocast(IDENTITY, enabled="no"), TypeError,
     r"enabled must be a bool.*'no' of type str"),
    ("autocast cache_enabled not a bool", lambda: jamp.autocast(IDENTITY, cache_enabled=None), TypeError,
     r"cache_enabled must be a bool"),
    ("autocast decorator enabled not a bool", lambda: jamp.autocast(enabled=1), TypeError, r"enabled must be a bool"),
    ("autocast str output", lambda: jamp.autocast(lambda x: {"y": x, "name": "run"})(GRADS["w"]), TypeError,
     r"<lambda> returned str 'run' as output\['name'\].*pytree of arrays and Python numbers"),
    ("autocast with at top level", _top_level_with, RuntimeError,
     r"outside any function that jamp.autocast transforms.*jamp.autocast\(fn, device_type='gpu'\)\(\*args\)"),
    ("autocast with static_argnums", _with_static_argnums, TypeError, r"static_argnums .* a `with"),
    ("custom_fwd cast_inputs", lambda: jamp.custom_fwd(IDENTITY, cast_inputs="int8"), ValueError, r"cast_inputs"),
    ("custom_fwd non-callable", lambda: jamp.custom_fwd(3), TypeError, r"custom_fwd requires a callable"),
    # policies
    ("policy key", lambda: jamp.get_policy("q=f32"), ValueError, r"cannot parse 'q=f32'"),
    ("policy compute float32", lambda: jamp.get_policy("c=f32"), ValueError, r"compute dtype float32"),
    ("policy output dtype", lambda: jamp.get_policy("c=bf16,o=f64"), ValueError, r"output_dtype"),
    ("policy device", lambda: jamp.get_policy("c=bf16,d=npu"), ValueError, r"device_type='npu'"),
    ("policy type", lambda: jamp.get_policy(None), TypeError, r"policy must be"),
    ("region mode", lambda: jamp.get_policy("gpu").with_rules({"x": "fp32"}), ValueError, r"region mode 'fp32'"),
    ("category", lambda: jamp.get_policy("gpu").with_categories({"exp": "low"}), ValueError, r"categories\['exp'\]"),
    ("find_overflow threshold", lambda: jamp.find_overflow(IDENTITY, min_underflow=-1), ValueError, r"min_underflow"),
    # kernels
    ("kernel backend", lambda: jamp_kernels.unscale_and_check(GRADS, 1.0, backend="cuda"), ValueError, r"backend"),
    ("kernel non-array leaf", lambda: jamp_kernels.unscale_and_check({"w": 1.0}, 1.0), TypeError, r"grads\['w'\]"),
    ("kernel complex leaf", lambda: jamp_kernels.unscale_and_check({"w": jnp.ones(2, jnp.complex64)}, 1.0),
     TypeError, r"grads\['w'\].*complex"),
    ("kernel inv_scale shape", lambda: jamp_kernels.unscale_and_check(GRADS, jnp.ones(3)), ValueError, r"inv_scale"),
    # scaler hyperparameters
    ("growth_factor <= 1", lambda: jamp.scaler(optax.sgd(0.1), growth_factor=1.0), ValueError, r"growth_factor"),
    ("backoff_factor >= 1", lambda: jamp.scaler(optax.sgd(0.1), backoff_factor=1.0), ValueError, r"backoff_factor"),
    ("backoff_factor <= 0", lambda: jamp.scaler(optax.sgd(0.1), backoff_factor=0.0), ValueError, r"backoff_factor"),
    ("init_scale inf", lambda: jamp.scaler(optax.sgd(0.1), init_scale=float("inf")), ValueError, r"init_scale"),
    ("init_scale <= 0", lambda: jamp.scaler(optax.sgd(0.1), init_scale=-1.0), ValueError, r"init_scale"),
    ("growth_interval < 1", lambda: jamp.scaler(optax.sgd(0.1), growth_interval=0), ValueError, r"growth_interval"),
    ("scaler backend", lambda: jamp.scaler(optax.sgd(0.1), backend="gpu"), ValueError, r"backend"),
    ("scaler without inner", lambda: jamp.scaler(), TypeError, r"jamp.scaler\(optax.adam"),
    ("scaler inner type", lambda: jamp.scaler(lambda g: g), TypeError, r"argument 0 must be an optax"),
    ("scaler enabled not a bool", lambda: jamp.scaler(optax.sgd(0.1), enabled="no"), TypeError,
     r"enabled must be a bool"),
    ("scaler under inject_hyperparams",
     lambda: optax.inject_hyperparams(jamp.scaler)(optax.sgd(0.1), init_scale=4.0).init(GRADS), TypeError,
     (r"inject_hyperparams\(jamp.scaler\) is not supported.*"
      r"jamp.scaler\(optax.inject_hyperparams\(optax.adam\)\(learning_rate=1e-3\)\)")),
    ("value_and_grad without opt_state", lambda: jamp.value_and_grad(lambda p: p["w"].sum())(GRADS), TypeError,
     r"first argument must be the optimizer state.*jamp.value_and_grad\(loss_fn\)\(opt_state, params, batch\)"),
    # state dicts
    ("load empty state_dict", lambda: jamp.load_state_dict(_state(), {}), ValueError, r"disabled"),
    ("load state_dict missing key", lambda: jamp.load_state_dict(_state(), {"scale": 2.0}), ValueError,
     r"growth_factor"),
    ("helpers without a scaler", lambda: jamp.get_scale(optax.sgd(0.1).init(GRADS)), ValueError, r"opt_state.*no jamp.scaler state"),
    ("helpers on a checkpoint restored without a target", lambda: jamp.get_scale(_restored_without_target()),
     ValueError, (r"ScalerState's fields at \['opt_state'\].*restored without a target.*tx.init\(params\).*"
                  r"jax.eval_shape\(tx.init, params\)")),
    ("value_and_grad on a checkpoint restored without a target",
     lambda: jamp.value_and_grad(lambda p: p["w"].sum())(_restored_without_target(), GRADS), ValueError,
     r"restored without a target"),
]


@pytest.mark.parametrize("description,thunk,error,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(description, thunk, error, match):
    with pytest.raises(error, match=match):
        thunk()
