"""jamp.SkippedStepsWarning on explicit reads: the step counts skip episodes with no callback or conditional, the
state is an inert NamedTuple, and get_scale / scaler_summary / report_skipped_steps say so when asked."""

from __future__ import annotations

import inspect
import pickle
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import count

import jamp

K1, K2 = jax.random.split(jax.random.key(0))
PARAMS = {"w1": jax.random.normal(K1, (8, 16)) / 3, "w2": jax.random.normal(K2, (16, 1)) / 4}
X = jax.random.normal(jax.random.key(1), (16, 8))
Y = jnp.sin(X.sum(-1, keepdims=True))
X_NAN = X.at[3, 5].set(jnp.nan)  # one NaN in the data


def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


amp_loss = jamp.autocast(loss_fn, device_type="gpu")  # float16 matmuls


def train_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jamp.scale(amp_loss(p, x, y), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def skipped_steps_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if w.category is jamp.SkippedStepsWarning]


def train_logging_the_scale(step, params, opt_state, batches):
    """Runs the steps and logs the scale after each, as a torch user logs scaler.get_scale(); returns the final
    params and state, and per step the warnings that step's read gave."""
    said = []
    for x in batches:
        params, opt_state = step(params, opt_state, x, Y)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            float(jamp.get_scale(opt_state))
        said.append(skipped_steps_warnings(caught))
    return params, opt_state, said


def test_nan_in_the_data_is_said_at_the_read_of_the_step_that_starts_the_episode():
    tx = jamp.scaler(optax.adam(1e-3))
    params, state, said = train_logging_the_scale(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN] * 20)
    # the 17th backoff takes 2**16 below 1 (warn_below_scale): from that step's read on, each read says so
    assert [len(s) for s in said] == [0] * 16 + [1] * 4
    assert said[16][0].startswith(
        "jamp.scaler at opt_state: 17 update(s) in a row were skipped because the scaled gradients held inf/NaN; "
        "the parameters and the optimizer state have not changed since, and the loss scale is down to 0.5 "
        "(warn_after_skips=32, warn_below_scale=1; skip episode(s) so far: 1). "
    )
    assert said[19][0].startswith("jamp.scaler at opt_state: 20 update(s) in a row were skipped")
    for advice in (
        "NaN/inf in the input data",
        "jamp.find_overflow(jax.value_and_grad(loss_fn), device_type=..., dtype=...)(params, batch)",
        "given the policy arguments your jamp.autocast has",
        "evaluate loss_fn without jamp.autocast",
        "warn_after_skips=None, warn_below_scale=None",
        "category=jamp.SkippedStepsWarning",
    ):
        assert advice in said[16][0]
    # a clean step ends the episode: reads say nothing; the summary keeps the count
    params, state, said = train_logging_the_scale(train_step(tx), params, state, [X])
    assert said == [[]] and jamp.scaler_summary(state) == {
        "scale": 0.0625,  # 2**16 halved 20 times
        "found_inf": False,
        "skipped_steps": 0,
        "skip_episodes": 1,
        "in_episode": False,
    }
    _, state, said = train_logging_the_scale(train_step(tx), params, state, [X_NAN] * 33)
    # the scale is below 1 already, so this time the run of warn_after_skips=32 skips is what starts it
    assert [len(s) for s in said] == [0] * 31 + [1, 1]
    assert said[31][0].startswith("jamp.scaler at opt_state: 32 update(s) in a row were skipped")
    assert int(state.skip_episodes) == 2


def test_warn_after_skips_alone_starts_an_episode_at_exactly_that_many_skips():
    tx = jamp.scaler(optax.sgd(0.1), init_scale=2.0**4, warn_after_skips=3, warn_below_scale=None)
    _, state, said = train_logging_the_scale(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN] * 6)
    assert [len(s) for s in said] == [0, 0, 1, 1, 1, 1] and int(state.consecutive_skips) == 6
    assert "(warn_after_skips=3, warn_below_scale=None;" in said[2][0]


def test_an_episode_that_ended_is_reported_by_report_skipped_steps():
    """Skips too far apart to make a run still halve the scale; the episode (one step long) has ended when the
    loop reads, so get_scale says nothing, and report_skipped_steps at the end says it happened."""
    tx = jamp.scaler(optax.sgd(0.1), init_scale=4.0)
    step, state = train_step(tx), tx.init(PARAMS)
    for x in [X_NAN, X, X] * 4:
        _, state = step(PARAMS, state, x, Y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jamp.get_scale(state)
        jamp.report_skipped_steps({"opt": state})
    (said,) = skipped_steps_warnings(caught)
    assert int(state.skip_episodes) == 1 and said.startswith(
        "jamp.scaler at opt_state['opt']: 1 skip episode(s) so far (runs of updates skipped because the scaled "
        "gradients held inf/NaN that reached warn_after_skips=32, warn_below_scale=1); none is under way now"
    )


def test_the_step_has_no_callback_no_conditional_and_no_effect():
    """What costs every step: a host callback takes the step off JAX's C++ dispatch path, and a conditional on
    a GPU is a host read of its predicate. The default step has neither: the same callbacks (none) and
    conditionals as with the report turned off."""
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    quiet, loud = (
        jamp.scaler(optax.adam(1e-3), warn_after_skips=None, warn_below_scale=None),
        jamp.scaler(optax.adam(1e-3)),
    )
    for primitive in ("pure_callback", "io_callback", "debug_callback", "cond"):
        counts = [count(tx.update, grads, tx.init(PARAMS), PARAMS, primitive=primitive) for tx in (quiet, loud)]
        assert counts[0] == counts[1], primitive
    assert count(loud.update, grads, loud.init(PARAMS), PARAMS, primitive="pure_callback") == 0
    assert not jax.make_jaxpr(loud.update)(grads, loud.init(PARAMS), PARAMS).effects
    hlo = jax.jit(loud.update).lower(grads, loud.init(PARAMS), PARAMS).compile().as_text()
    assert not [t for t in re.findall(r'custom_call_target="([^"]+)"', hlo) if "callback" in t]


def mid_episode_state():
    tx = jamp.scaler(optax.adam(1e-3), warn_after_skips=2)
    state = tx.init(PARAMS)
    for _ in range(3):
        _, state = tx.update(jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), PARAMS), state, PARAMS)
    assert bool(state.warned)
    return tx, state


def test_the_state_is_inert_under_an_error_filter():
    """Flattening, tree_map, eval_shape, device_put, pickling, a jitted step with donation: none of them reads
    or warns, whatever the warnings filter (a flatten that warned raised here, after the donated step ran)."""
    tx, state = mid_episode_state()
    step = jax.jit(lambda p, s: tx.update(jax.tree.map(jnp.ones_like, p), s, p), donate_argnums=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.tree.leaves({"logging": 1, "opt": state})
        jax.tree.map(lambda x: x.shape, state)
        jax.eval_shape(tx.init, PARAMS)
        jax.device_put(state)
        pickle.loads(pickle.dumps(state))
        _, new = step(PARAMS, jax.tree.map(jnp.copy, state))
    assert type(state) is jamp.ScalerState and not bool(new.warned)


def test_identical_scalers_make_bit_identical_states():
    a, b = (jamp.scaler(optax.adam(1e-3), warn_after_skips=5) for _ in range(2))
    grads = jax.tree.map(lambda p: p * 2.0**16, PARAMS)
    sa, sb = a.init(PARAMS), b.init(PARAMS)
    for _ in range(3):
        sa, sb = a.update(grads, sa, PARAMS)[1], b.update(grads, sb, PARAMS)[1]
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert jax.tree.structure(sa) == jax.tree.structure(sb)


def test_silenced_by_the_keywords_even_restored_from_a_checkpoint():
    quiet = jamp.scaler(optax.adam(1e-3), warn_after_skips=None, warn_below_scale=None)
    _, state, said = train_logging_the_scale(train_step(quiet), PARAMS, quiet.init(PARAMS), [X_NAN] * 20)
    assert said == [[]] * 20 and (int(state.consecutive_skips), int(state.skip_episodes)) == (20, 0)
    restored = pickle.loads(pickle.dumps(jax.device_get(state)))  # a host copy, as a checkpoint restores it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jamp.report_skipped_steps(restored)
        assert jamp.scaler_summary(restored)["skip_episodes"] == 0
        _, state, said = train_logging_the_scale(train_step(quiet), PARAMS, restored, [X_NAN] * 3)
    assert said == [[]] * 3


def test_silenced_by_a_warnings_filter():
    tx, state = mid_episode_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=jamp.SkippedStepsWarning)
        jamp.get_scale(state)
        jamp.report_skipped_steps(state)
    assert caught == []
    assert issubclass(jamp.SkippedStepsWarning, UserWarning) and "SkippedStepsWarning" in jamp.__all__


def test_an_error_filter_raises_at_the_read_and_an_except_clause_can_stop_the_run():
    tx = jamp.scaler(optax.sgd(0.1), warn_after_skips=2, warn_below_scale=None)
    step, state = train_step(tx), tx.init(PARAMS)
    stopped_at = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.SkippedStepsWarning)
        for i in range(5):
            _, state = step(PARAMS, state, X_NAN, Y)
            try:
                jamp.scaler_summary(state)
            except jamp.SkippedStepsWarning as e:
                stopped_at, message = i, str(e)
                break
    assert stopped_at == 1 and "2 update(s) in a row were skipped" in message


def test_the_warning_points_at_the_line_that_reads():
    _, state = mid_episode_state()
    line = inspect.currentframe().f_lineno + 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jamp.get_scale(state)
        jamp.scaler_summary(state)
        jamp.report_skipped_steps(state)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line), (__file__, line + 1), (__file__, line + 2)]


def test_inside_jit_get_scale_reads_nothing_and_the_explicit_reads_say_to_call_them_outside():
    _, state = mid_episode_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(jax.jit(jamp.get_scale)(state)) == float(state.scale)
    for read in (jamp.report_skipped_steps, jamp.scaler_summary):
        with pytest.raises(TypeError, match=r"opt_state to the host: call it outside jax.jit"):
            jax.jit(read)(state)


def test_disabled_scaler_says_nothing():
    tx = jamp.scaler(optax.adam(1e-3), enabled=False, warn_after_skips=1)
    _, state, said = train_logging_the_scale(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN] * 3)
    assert isinstance(state, jamp.DisabledScalerState) and said == [[]] * 3
    assert jamp.scaler_summary(state)["scale"] == 1.0


def test_two_states_of_one_scaler_are_each_reported_where_they_sit():
    """One tx for two models (a GAN): each state is read on its own and named by its place in the tree."""
    tx = jamp.scaler(optax.sgd(0.1), warn_after_skips=2, warn_below_scale=None)
    step = train_step(tx)
    states = {"generator": tx.init(PARAMS), "discriminator": tx.init(PARAMS)}
    for _ in range(3):
        _, states["generator"] = step(PARAMS, states["generator"], X_NAN, Y)
    for _ in range(4):
        _, states["discriminator"] = step(PARAMS, states["discriminator"], X_NAN, Y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jamp.report_skipped_steps(states)
    assert [m[:68] for m in skipped_steps_warnings(caught)] == [
        "jamp.scaler at opt_state['discriminator']: 4 update(s) in a row were",
        "jamp.scaler at opt_state['generator']: 3 update(s) in a row were ski",
    ]


def test_inside_and_around_multisteps():
    inner = jamp.scaler(
        optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2), warn_after_skips=3, warn_below_scale=None
    )
    _, state, said = train_logging_the_scale(train_step(inner), PARAMS, inner.init(PARAMS), [X_NAN] * 5)
    assert [len(s) for s in said] == [0, 0, 1, 1, 1] and int(state.consecutive_skips) == 5

    outer = optax.MultiSteps(
        jamp.scaler(optax.adam(1e-3), warn_after_skips=2, warn_below_scale=None), every_k_schedule=2
    )
    _, state, said = train_logging_the_scale(train_step(outer), PARAMS, outer.init(PARAMS), [X_NAN] * 8)
    assert [len(s) for s in said] == [0] * 3 + [1] * 5
    assert said[3][0].startswith("jamp.scaler at opt_state.inner_opt_state: 2 update(s) in a row were skipped ")


def test_in_a_scan_over_steps_and_under_vmap_each_model_is_counted():
    tx = jamp.scaler(optax.sgd(0.1), init_scale=4.0, warn_after_skips=2, warn_below_scale=None)
    grads = {"w": jnp.ones((3, 2)).at[1, 0].set(jnp.nan)}  # model 1 of 3 overflows
    params = {"w": jnp.ones((3, 2))}

    @jax.jit
    def five_steps(state):
        def body(s, _):
            return jax.vmap(tx.update)(grads, s, params)[1], None

        return jax.lax.scan(body, state, None, length=5)[0]

    state = five_steps(jax.vmap(tx.init)(params))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = jamp.scaler_summary(state)
    assert summary["skipped_steps"] == [0, 5, 0] and summary["skip_episodes"] == [0, 1, 0]
    assert summary["in_episode"] == [False, True, False]
    (said,) = skipped_steps_warnings(caught)
    assert said.startswith("jamp.scaler at opt_state: [0, 5, 0] update(s) in a row were skipped")


def test_host_copies_are_read_as_the_device_state():
    _, state = mid_episode_state()
    host = jax.device_get(state)
    assert isinstance(host.scale, np.ndarray)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert jamp.scaler_summary(host) == jamp.scaler_summary(state)
        jamp.report_skipped_steps(host)
    said = skipped_steps_warnings(caught)
    assert len(said) == 3 and said[0] == said[1] == said[2]


def test_restored_in_a_new_process_the_episode_is_reported_there(tmp_path):
    """A checkpoint saved mid-episode (orbax) and restored in a new process: restoring reads nothing, and the
    explicit read reports it."""
    code = textwrap.dedent(
        """
        import sys, warnings, jax, jax.numpy as jnp, optax, orbax.checkpoint as ocp, jamp
        path = sys.argv[1]
        tx = jamp.scaler(optax.sgd(0.1), init_scale=4.0, warn_after_skips=2, warn_below_scale=None)
        params = {"w": jnp.ones(3)}
        bad = {"w": jnp.array([1.0, jnp.inf, 1.0])}
        if sys.argv[2] == "save":
            state = tx.init(params)
            for _ in range(3):
                state = tx.update(jax.tree.map(lambda g: g * state.scale, bad), state, params)[1]
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(path, state)
        else:
            target = jax.eval_shape(tx.init, params)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with ocp.StandardCheckpointer() as checkpointer:
                    state = checkpointer.restore(path, target)
                restoring = len(caught)
                jamp.report_skipped_steps(state)
            print(restoring, int(state.consecutive_skips), int(state.skip_episodes), [str(w.message)[:51] for w in caught])
        """
    )
    run = [sys.executable, "-c", code, str(tmp_path / "ckpt")]
    subprocess.run([*run, "save"], check=True, capture_output=True)
    out = subprocess.run([*run, "restore"], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "0 3 1 ['jamp.scaler at opt_state: 3 update(s) in a row were']"


def test_the_advice_leads_to_the_op():
    """Issue 36: trained with device_type="gpu" on a CPU, a float16 matmul overflows in the forward pass every
    step. find_overflow without the policy arguments uses the CPU's bfloat16 policy and finds nothing (the
    float32 loss is finite); the warning says to pass the policy arguments autocast has, and with them
    find_overflow names the matmul."""

    def loss_fn(p, x):
        return jnp.mean((x @ p["w"] / 1e3) ** 2)  # x @ w is about 3e5: inf in float16, finite in float32

    params, x = {"w": jnp.full((64, 8), 300.0)}, jnp.full((4, 64), 16.0)
    amp = jamp.autocast(loss_fn, device_type="gpu")
    tx = jamp.scaler(optax.sgd(1e-3), warn_after_skips=3, warn_below_scale=None)

    @jax.jit
    def step(p, s):
        g = jax.grad(lambda q: jamp.scale(amp(q, x), s))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            params, state = step(params, state)
        jamp.report_skipped_steps(state)
    (said,) = skipped_steps_warnings(caught)
    assert "jamp.find_overflow(jax.value_and_grad(loss_fn), device_type=..., dtype=...)" in said
    assert np.isfinite(float(loss_fn(params, x)))
    assert jamp.find_overflow(jax.value_and_grad(loss_fn))(params, x) is None  # the CPU's bfloat16 policy
    found = jamp.find_overflow(jax.value_and_grad(loss_fn), device_type="gpu")(params, x)
    assert found is not None and found.primitive == "dot_general"


def test_an_nnx_optimizer_s_state_is_read_through_its_variables():
    """nnx.Optimizer keeps the scaler's state in variables: the reads unwrap them, as get_scale always did."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))

    model = Model()
    optimizer = nnx.Optimizer(model, jamp.scaler(optax.sgd(0.1), warn_after_skips=1), wrt=nnx.Param)
    optimizer.update(model, jax.tree.map(lambda g: g * jnp.inf, nnx.state(model, nnx.Param)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert float(jamp.get_scale(optimizer.opt_state)) == 32768.0
        assert jamp.scaler_summary(optimizer.opt_state)["in_episode"] is True
        jamp.report_skipped_steps(optimizer.opt_state)
    assert [m[:60] for m in skipped_steps_warnings(caught)] == [
        "jamp.scaler at opt_state: 1 update(s) in a row were skipped "
    ] * 3
