"""jamp.SkippedStepsWarning: the step counts skip episodes with no callback or conditional, and the host reports
them when it next flattens the state (jamp.scaling.skip_report), or at once with jamp.report_skipped_steps."""

from __future__ import annotations

import inspect
import math
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
from jamp.scaling import skip_report

K1, K2 = jax.random.split(jax.random.key(0))
PARAMS = {"w1": jax.random.normal(K1, (8, 16)) / 3, "w2": jax.random.normal(K2, (16, 1)) / 4}
X = jax.random.normal(jax.random.key(1), (16, 8))
Y = jnp.sin(X.sum(-1, keepdims=True))
X_NAN = X.at[3, 5].set(jnp.nan)  # one NaN in the data


def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


amp_loss = jamp.autocast(loss_fn, device_type="gpu")  # float16 matmuls


@pytest.fixture
def every_look_reads(monkeypatch):
    """The host reads at every look (no read budget: no wait after any read, a slow one or another thread's), so
    that when a warning comes is deterministic."""
    monkeypatch.setattr(skip_report, "READ_BUDGET", math.inf)
    monkeypatch.setattr(skip_report, "_next_read", 0.0)
    skip_report._PENDING.clear()  # states other tests left for a later look


def train_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jamp.scale(amp_loss(p, x, y), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def finish(state):
    """Waits for every array of a scaler state without flattening it (a flatten is a look): a field at a time."""
    for field in state:
        jax.block_until_ready(field)


def train(step, params, opt_state, batches):
    """Runs the steps, each finished before the next is dispatched (whose flatten is the host's look); returns
    the final params and state, per step how many warnings had come by the time it was dispatched, and them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = []
        for x in batches:
            params, opt_state = step(params, opt_state, x, Y)
            jax.block_until_ready(params)  # the state too (one program), without the look a flatten of it is
            seen.append(len([w for w in caught if w.category is jamp.SkippedStepsWarning]))
        jax.tree.leaves(opt_state)  # the look the next step would take
        seen.append(len([w for w in caught if w.category is jamp.SkippedStepsWarning]))
    return params, opt_state, seen, [str(w.message) for w in caught if w.category is jamp.SkippedStepsWarning]


def test_nan_in_the_data_warns_once_per_episode_and_rearms_after_a_step_taken(every_look_reads):
    tx = jamp.scaler(optax.adam(1e-3))
    params, state, seen, messages = train(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN] * 40)
    # the 17th backoff takes 2**16 below 1 (warn_below_scale); the 18th step's dispatch reads it
    assert seen == [0] * 17 + [1] * 24 and len(messages) == 1
    assert messages[0].startswith(
        "jamp.scaler: 17 update(s) in a row were skipped because the scaled gradients held inf/NaN; the "
        "parameters and the optimizer state have not changed since, and the loss scale is down to 0.5, below "
        "warn_below_scale=1. "
    )
    assert (int(state.consecutive_skips), bool(state.warned), int(state.skip_episodes)) == (40, True, 1)
    for advice in (
        "NaN/inf in the input data",
        "jamp.find_overflow(jax.value_and_grad(loss_fn), device_type=..., dtype=...)(params, batch)",
        "given the policy arguments your jamp.autocast has",
        "evaluate loss_fn without jamp.autocast",
        "warn_after_skips=None, warn_below_scale=None",
        "category=jamp.SkippedStepsWarning",
    ):
        assert advice in messages[0]
    # a clean step ends the episode; the next run of skips is a new one
    params, state, _, messages = train(train_step(tx), params, state, [X])
    assert messages == [] and (int(state.consecutive_skips), bool(state.warned), int(state.skip_episodes)) == (0, 0, 1)
    _, state, seen, messages = train(train_step(tx), params, state, [X_NAN] * 33)
    # the scale is below 1 already, so this time the run of warn_after_skips=32 skips is what starts it
    assert seen == [0] * 32 + [1, 1] and messages[0].startswith("jamp.scaler: 32 update(s) in a row were skipped")
    assert int(state.skip_episodes) == 2


def test_warn_after_skips_alone_warns_at_exactly_that_many_skips(every_look_reads):
    tx = jamp.scaler(optax.sgd(0.1), init_scale=2.0**4, warn_after_skips=3, warn_below_scale=None)
    _, state, seen, _ = train(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN] * 6)
    assert seen == [0, 0, 0, 1, 1, 1, 1] and int(state.consecutive_skips) == 6


def test_sparse_skips_are_reported_even_when_the_host_looks_only_later(monkeypatch):
    """Skips too far apart to make a run still halve the scale; the episode (one step long) is counted in the
    state, so a host that looks only at the end still reports it."""
    tx = jamp.scaler(optax.sgd(0.1), init_scale=4.0)
    step, state = train_step(tx), tx.init(PARAMS)
    monkeypatch.setattr(skip_report, "_readable", lambda x: False)  # the device is always behind the host
    for x in [X_NAN, X, X] * 4:
        _, state = step(PARAMS, state, x, Y)
    monkeypatch.undo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.block_until_ready(state)  # a flatten: the host may look here already
        jamp.report_skipped_steps({"opt": state})
        jamp.report_skipped_steps(state)  # nothing new: said once
    # read from whichever state the host saw first with the episode in it (an earlier one still waiting for
    # a look, or the last): it names the fall below the floor either way
    assert len(caught) == 1 and int(state.skip_episodes) == 1
    assert "below warn_below_scale=1" in str(caught[0].message)


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


def test_silenced_by_the_keywords(every_look_reads):
    quiet = jamp.scaler(optax.adam(1e-3), warn_after_skips=None, warn_below_scale=None)
    _, state, seen, _ = train(train_step(quiet), PARAMS, quiet.init(PARAMS), [X_NAN] * 20)
    assert seen == [0] * 21 and (int(state.consecutive_skips), int(state.skip_episodes)) == (20, 0)


def test_silenced_by_a_warnings_filter(every_look_reads):
    tx = jamp.scaler(optax.adam(1e-3), warn_after_skips=2)
    step, state = train_step(tx), tx.init(PARAMS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=jamp.SkippedStepsWarning)
        for _ in range(4):
            _, state = step(PARAMS, state, X_NAN, Y)
        finish(state)
    assert caught == [] and bool(state.warned)
    assert issubclass(jamp.SkippedStepsWarning, UserWarning) and "SkippedStepsWarning" in jamp.__all__


def test_an_error_filter_raises_the_warning_at_the_next_dispatch_before_it_runs(every_look_reads):
    """-W error: the dispatch of the step after the episode started raises jamp.SkippedStepsWarning itself
    (an except clause can catch it), before that step runs."""
    tx = jamp.scaler(optax.sgd(0.1), warn_after_skips=2, warn_below_scale=None)
    step, state = train_step(tx), tx.init(PARAMS)
    for _ in range(2):
        _, state = step(PARAMS, state, X_NAN, Y)
        finish(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.SkippedStepsWarning)
        with pytest.raises(jamp.SkippedStepsWarning, match=r"2 update\(s\) in a row were skipped"):
            step(PARAMS, state, X_NAN, Y)
    assert int(state.consecutive_skips) == 2


def test_the_warning_points_at_the_line_that_dispatched_the_step(every_look_reads):
    """The look that reads the episode is the next dispatch's flatten of the state, or, on a step's first call
    (jit's cache miss), jax's flatten of its outputs as it returns them when the device has finished by then:
    either way the warning names the user's line, once."""
    tx = jamp.scaler(optax.sgd(0.1), warn_after_skips=1, warn_below_scale=None)
    step, state = train_step(tx), tx.init(PARAMS)
    first = inspect.currentframe().f_lineno + 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, state = step(PARAMS, state, X_NAN, Y)  # first: the episode (one skip)
        finish(state)
        step(PARAMS, state, X, Y)  # second
    assert [(w.filename, w.lineno) for w in caught] in ([(__file__, first)], [(__file__, first + 2)])


def test_disabled_scaler_says_nothing(every_look_reads):
    tx = jamp.scaler(optax.adam(1e-3), enabled=False, warn_after_skips=1)
    _, state, seen, _ = train(train_step(tx), PARAMS, tx.init(PARAMS), [X_NAN] * 3)
    assert isinstance(state, jamp.DisabledScalerState) and seen == [0, 0, 0, 0]


def test_two_scalers_report_their_own_episodes(every_look_reads):
    """Each scaler has its number in its state: a second scaler's first episode is not taken for the first's."""
    a = jamp.scaler(optax.sgd(0.1), warn_after_skips=2, warn_below_scale=None)
    b = jamp.scaler(optax.sgd(0.1), warn_after_skips=3, warn_below_scale=None)
    assert int(a.init(PARAMS).scaler_id) != int(b.init(PARAMS).scaler_id)
    _, _, _, said_a = train(train_step(a), PARAMS, a.init(PARAMS), [X_NAN] * 3)
    _, _, _, said_b = train(train_step(b), PARAMS, b.init(PARAMS), [X_NAN] * 4)
    assert [m[:38] for m in said_a + said_b] == [
        "jamp.scaler: 2 update(s) in a row were",
        "jamp.scaler: 3 update(s) in a row were",
    ]
    # init starts a new run: the same scaler's next run reports its first episode again
    _, _, _, again = train(train_step(a), PARAMS, a.init(PARAMS), [X_NAN] * 3)
    assert len(again) == 1


def test_inside_and_around_multisteps(every_look_reads):
    inner = jamp.scaler(
        optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2), warn_after_skips=3, warn_below_scale=None
    )
    _, state, seen, _ = train(train_step(inner), PARAMS, inner.init(PARAMS), [X_NAN] * 5)
    assert seen == [0, 0, 0, 1, 1, 1] and int(state.consecutive_skips) == 5

    outer = optax.MultiSteps(
        jamp.scaler(optax.adam(1e-3), warn_after_skips=2, warn_below_scale=None), every_k_schedule=2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nesting's own warning is tested with the scaler's misuse
        _, state, _, messages = train(train_step(outer), PARAMS, outer.init(PARAMS), [X_NAN] * 8)
    assert len(messages) == 1 and messages[0].startswith("jamp.scaler: 2 update(s) in a row were skipped ")
    assert int(state.inner_opt_state.consecutive_skips) == 4


def test_in_a_scan_over_steps_and_under_vmap(every_look_reads):
    tx = jamp.scaler(optax.sgd(0.1), init_scale=4.0, warn_after_skips=2, warn_below_scale=None)
    grads = {"w": jnp.ones((3, 2)).at[1, 0].set(jnp.nan)}  # model 1 of 3 overflows
    params = {"w": jnp.ones((3, 2))}

    @jax.jit
    def five_steps(state):
        def body(s, _):
            return jax.vmap(tx.update)(grads, s, params)[1], None

        return jax.lax.scan(body, state, None, length=5)[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = jax.block_until_ready(five_steps(jax.vmap(tx.init)(params)))  # its flatten may be the look
        jax.tree.leaves(state)
    assert [int(n) for n in state.consecutive_skips] == [0, 5, 0]
    assert [int(n) for n in state.skip_episodes] == [0, 1, 0]
    assert [str(w.message)[:40] for w in caught] == ["jamp.scaler: 5 update(s) in a row were s"]


def test_the_host_never_waits_and_keeps_to_its_read_budget(monkeypatch):
    """A state the device has not finished is not read; reads take at most READ_BUDGET of the time."""
    tx = jamp.scaler(optax.sgd(0.1), warn_after_skips=1, warn_below_scale=None)
    state = tx.init(PARAMS)
    reads = []
    skip_report._PENDING.clear()  # states other tests left for a later look
    monkeypatch.setattr(skip_report, "_host", lambda x: reads.append(x) or np.ravel(np.asarray(x)))
    monkeypatch.setattr(skip_report, "_readable", lambda x: False)
    jax.tree.leaves(state)
    assert reads == []
    monkeypatch.setattr(skip_report, "_readable", lambda x: True)
    monkeypatch.setattr(skip_report, "_next_read", 0.0)
    jax.tree.leaves(state)  # reads the states seen since the last read: this one, twice
    assert len(reads) == 8 and skip_report._next_read > 0
    jax.tree.leaves(state)  # within the budget's wait: not read again
    assert len(reads) == 8


def test_report_skipped_steps_inside_jit_says_to_call_it_outside():
    tx = jamp.scaler(optax.sgd(0.1))
    with pytest.raises(TypeError, match="call it outside jax.jit"):
        jax.jit(jamp.report_skipped_steps)(tx.init(PARAMS))


def test_restored_in_a_new_process_the_episode_is_reported_there(tmp_path):
    """A checkpoint saved mid-episode (orbax) and restored in a new process: that process's host reports it
    once (it has reported nothing yet)."""
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
                    state = checkpointer.restore(path, target)  # orbax flattens it: the host's look
                jamp.report_skipped_steps(state)  # said already
            print(int(state.consecutive_skips), int(state.skip_episodes), [str(w.message)[:38] for w in caught])
        """
    )
    run = [sys.executable, "-c", code, str(tmp_path / "ckpt")]
    subprocess.run([*run, "save"], check=True, capture_output=True)
    out = subprocess.run([*run, "restore"], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "3 1 ['jamp.scaler: 3 update(s) in a row were']"


def test_an_episode_that_ended_before_the_host_looked_says_so():
    from jamp.scaling.skip_episodes import Thresholds

    said = skip_report.message(0, 0.5, Thresholds(32, np.float32(1.0)), episodes=2)
    assert "reached warn_after_skips=32 or took the loss scale below warn_below_scale=1; it has ended" in said
    assert "(2 such episodes since the last report)" in said


def test_the_advice_leads_to_the_op(every_look_reads):
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
    (said,) = [str(w.message) for w in caught]
    assert "jamp.find_overflow(jax.value_and_grad(loss_fn), device_type=..., dtype=...)" in said
    assert np.isfinite(float(loss_fn(params, x)))
    assert jamp.find_overflow(jax.value_and_grad(loss_fn))(params, x) is None  # the CPU's bfloat16 policy
    found = jamp.find_overflow(jax.value_and_grad(loss_fn), device_type="gpu")(params, x)
    assert found is not None and found.primitive == "dot_general"
