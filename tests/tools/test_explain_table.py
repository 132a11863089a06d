"""What jamp.explain's rows and tables say about accumulation, and a table layout that never cuts a source line."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import eqns

import jamp
from jamp.tools.sources import fitted_source

W = jax.random.normal(jax.random.key(0), (16, 16))
X = jax.random.normal(jax.random.key(1), (8, 16))


def _rows(report, primitive):
    return [r for r in report.rows if r.primitive == primitive]


def test_a_low_precision_sum_shows_that_it_accumulates_in_float32():
    """Issue 28.3: a mean over a bfloat16 matmul (the cpu list passes reduce_sum through) is a bfloat16 op whose
    sum runs in float32; the record and both tables say both, as the rewritten program does."""
    f = lambda w, x: jnp.mean(x @ w)
    report = jamp.explain(f, device_type="cpu")(W, X)
    (row,) = _rows(report, "reduce_sum")
    assert row.ran_dtypes == ("bfloat16",) and row.out_dtypes == ("bfloat16",) and row.accumulated_in == "float32"
    program = jax.make_jaxpr(jamp.autocast(f, device_type="cpu"))(W, X)
    (sum_eqn,) = [e for e in eqns(program) if e.primitive.name == "reduce_sum"]  # inner jaxprs too (recompute)
    assert sum_eqn.invars[0].aval.dtype == jnp.float32  # what the record claims is what runs
    assert "reduce_sum    bfloat16 (accumulates in float32)" in report.to_text(full=True)
    assert "bf16 (acc f32) 1" in str(report)
    assert report.to_dicts()[1]["accumulated_in"] == "float32"


def test_sums_that_need_no_widening_say_nothing():
    """A float32 sum (the gpu list) and a broadcast (it sums only in its transpose) carry no accumulation note."""
    report = jamp.explain(lambda w, x: jnp.mean(x @ w), device_type="gpu")(W, X)
    (row,) = _rows(report, "reduce_sum")
    assert row.ran_dtypes == ("float32",) and row.accumulated_in == ""
    report = jamp.explain(lambda w, x: jnp.broadcast_to((x @ w)[:1], (8, 16)) * 2, device_type="cpu")(W, X)
    (row,) = _rows(report, "broadcast_in_dim")
    assert row.ran_dtypes == ("bfloat16",) and row.accumulated_in == ""
    assert "accumulates" not in report.to_text(full=True) and "acc f32" not in str(report)


# A model in a deep directory outside the current directory and sys.path, its op on line 400.
DEEP_FILE = "/srv/experiments/team_mixed_precision/checkpoints_and_models/model_definitions.py"
SOURCE_LINE = 400


@pytest.fixture(scope="module")
def deep_report():
    namespace = {"jnp": jnp}
    code = "\n" * (SOURCE_LINE - 2) + "def classifier_head_loss(w, x):\n    return jnp.tanh(x @ w).sum()\n"
    exec(compile(code, DEEP_FILE, "exec"), namespace)
    return jamp.explain(namespace["classifier_head_loss"], device_type="gpu")(W, X)


@pytest.mark.parametrize("full,width", [(False, 60), (False, 80), (False, 120), (False, 200), (True, 120), (True, 200)])
def test_table_never_breaks_a_file_and_line(deep_report, full, width):
    """The source column stays whole (it once folded 'model_definitions.py:40' / '0' even 200 wide), cut from
    the left where it is long; the other columns wrap instead. (The full table's eight columns need 120.)"""
    text = deep_report.to_text(full=full, width=width)
    sources = [ln for ln in text.splitlines() if "model_definitions" in ln]
    assert sources, text
    for line in sources:
        assert re.search(rf"…/(\w+/)*model_definitions\.py:{SOURCE_LINE}( \(classifier_head_loss\))?$", line), text
    assert all(len(ln) <= width for ln in text.splitlines() if "model_definitions" in ln)


def test_fitted_source_cuts_directories_from_the_left_only():
    source = f"{DEEP_FILE}:{SOURCE_LINE} (classifier_head_loss)"
    shown = "…/checkpoints_and_models/model_definitions.py:400 (classifier_head_loss)"
    assert fitted_source(source, width=49) == shown
    # however narrow, the file and line stay whole
    assert fitted_source(source, width=10) == "…/model_definitions.py:400 (classifier_head_loss)"
    assert fitted_source("model.py:3 (loss)") == "model.py:3 (loss)" and fitted_source("") == ""
