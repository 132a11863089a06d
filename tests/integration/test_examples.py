"""The examples run end to end and say what they claim, on a step budget small enough for CI.

Each example runs as users run it (``python examples/NAME.py``) in a subprocess. The budgets are cut
from the defaults, so the thresholds are looser than the full-budget claims in the examples' docstrings,
but still far from chance: a broken autocast or scaler fails them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> list[str]:
    """Stdout lines of ``python examples/<name> <args>``; the test fails with its stderr if it fails, or if
    it drew progress bars into a stream that is not a terminal (a log would get a line per update)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=EXAMPLES.parent,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "\r" not in proc.stdout + proc.stderr, f"{name} wrote carriage returns into a pipe"
    return proc.stdout.splitlines()


def result(lines: list[str], pattern: str) -> dict[str, float]:
    """The last line must match ``RESULT <pattern>`` exactly; its named groups as floats."""
    match = re.fullmatch("RESULT " + pattern, lines[-1])
    assert match, f"last line is not a RESULT line of the expected form: {lines[-1]!r}"
    return {k: float(v) for k, v in match.groupdict().items()}


def test_digits_four_runs_match_float32(tmp_path):
    figure = tmp_path / "digits.png"
    lines = run_example("digits.py", "--steps", "150", "--out", str(figure))
    acc = result(
        lines, " ".join(f"{k}=(?P<{k}>[01]\\.\\d{{3}})" for k in ("fp32", "bf16", "fp16_scaled", "fp16_unscaled"))
    )
    assert acc["fp32"] >= 0.95
    assert abs(acc["bf16"] - acc["fp32"]) <= 0.025
    assert abs(acc["fp16_scaled"] - acc["fp32"]) <= 0.025
    assert acc["fp16_unscaled"] >= 0.5  # reported as measured, whatever it is; it must still have trained
    assert figure.stat().st_size > 10_000
    assert any(re.fullmatch(r"fp16_scaled: scale 65536 -> \d+, \d+ of 150 steps skipped", ln) for ln in lines)


def test_char_lm_amp_loss_tracks_float32():
    lines = run_example("char_lm.py", "--steps", "60")
    loss = result(lines, r"fp32_eval_loss=(?P<fp32>\d+\.\d{4}) amp_eval_loss=(?P<amp>\d+\.\d{4})")
    assert loss["fp32"] < 3.3  # uniform over bytes is ln(256) = 5.55 nats
    assert abs(loss["amp"] - loss["fp32"]) < 0.005  # the docstring's claims
    gap = next(float(ln.split()[-2]) for ln in lines if ln.startswith("largest per-step difference"))
    assert gap < 0.01
    progress = [ln.split()[:3] for ln in lines if re.fullmatch(r"\s*\S+: step\s+\d+/60\s+loss \d+\.\d+", ln)]
    assert progress == [[run, "step", f"{i}/60"] for run in ("float32:", "amp_fp16:") for i in range(12, 61, 12)]
    assert "dot_general by region and dtype: blocks float16: 8, lm_head float32: 1" in [ln.strip() for ln in lines]
    share = next(float(ln.split()[-1]) for ln in lines if ln.strip().startswith("low_precision_flop_share"))
    assert 0.5 < share < 1.0


def test_char_lm_runs_a_single_step_under_the_fp8_policy():
    """--steps 1 once crashed: the warm-up took the cosine decay's only step (decay_steps=0)."""
    lines = run_example("char_lm.py", "--steps", "1", "--amp", "fp8")
    assert [ln.split()[:3] for ln in lines if " step " in ln] == [
        ["float32:", "step", "1/1"],
        ["amp_fp8:", "step", "1/1"],
    ]
    # the batched attention einsums are not 2-D contractions, so they stay bfloat16
    mix = "dot_general by region and dtype: blocks bfloat16: 2, blocks float8_e4m3fn: 6, lm_head float32: 1"
    assert mix in [ln.strip() for ln in lines]
    assert lines[-1].startswith("RESULT fp32_eval_loss=")


@pytest.mark.parametrize(
    "update,state_dtype,kept",
    [
        ("kahan", None, "8.00 bytes per parameter kept between steps (parameters 2.00 + optimizer state 6.00)"),
        (
            "stochastic",
            "float32",
            "10.00 bytes per parameter kept between steps (parameters 2.00 + optimizer state 8.00)",
        ),
    ],
)
def test_char_lm_trains_bfloat16_parameters_without_float32_masters(update, state_dtype, kept):
    """--params bf16: the same bfloat16 autocast on parameters stored in bfloat16 (the docstring's full-budget
    figures are in docs/low-precision-params.md); at 24 steps the held-out losses agree to 0.02 nats."""
    args = ["--steps", "24", "--params", "bf16", "--update", update] + (
        ["--state-dtype", state_dtype] if state_dtype else []
    )
    lines = run_example("char_lm.py", *args)
    loss = result(lines, r"fp32_eval_loss=(?P<fp32>\d+\.\d{4}) bf16_eval_loss=(?P<bf16>\d+\.\d{4})")
    assert loss["fp32"] < 3.3 and abs(loss["bf16"] - loss["fp32"]) < 0.02
    assert f"bf16_{update}: {kept}" in lines
    assert " float32: 12.00 bytes per parameter kept between steps (parameters 4.00 + optimizer state 8.00)" in lines
    assert "dot_general by region and dtype: blocks bfloat16: 8, lm_head float32: 1" in [ln.strip() for ln in lines]


@pytest.mark.parametrize(
    "name,norm_path,head_path,min_accuracy",
    [
        ("flax_linen.py", "MLP/LayerNorm_0", "MLP/head", 0.9),
        ("flax_nnx.py", "LayerNorm", "head", 0.6),
    ],
)
def test_flax_pattern_keeps_head_and_norm_in_float32(name, norm_path, head_path, min_accuracy):
    lines = run_example(name, "--steps", "40")
    assert result(lines, r"train_accuracy=(?P<acc>[01]\.\d{3})")["acc"] >= min_accuracy
    ran = dict(m.groups() for m in (re.fullmatch(r"\s*(.+?)\s+ran in (.+)", ln) for ln in lines) if m)
    assert ran[norm_path] == ran[head_path] == "float32"
    assert any("float16" in dtypes for dtypes in ran.values())
    assert re.match(r"step\s+0\s+loss \d+\.\d+\s+scale 65536\s+skipped False", lines[0])
    if name == "flax_nnx.py":  # the model is an argument of the autocast function: its writes reach it
        moved = next(
            m
            for m in (re.search(r"\|mean\| (\d\.\d{3}) \(0 at init\); Dropout RNG count (\d+)", ln) for ln in lines)
            if m
        )
        assert float(moved[1]) > 0 and int(moved[2]) == 40


def test_equinox_example_tracks_float32_with_state_and_the_scaler():
    lines = run_example("equinox_cnn.py", "--steps", "60")
    acc = result(lines, r"fp32_test_accuracy=(?P<fp32>[01]\.\d{3}) amp_test_accuracy=(?P<amp>[01]\.\d{3})")
    assert acc["fp32"] >= 0.8 and abs(acc["amp"] - acc["fp32"]) <= 0.03
    ran = dict(m.groups() for m in (re.fullmatch(r"\s*(.+?)\s+ran in (.+)", ln) for ln in lines) if m)
    assert ran["eqx.nn.Conv"] == ran["eqx.nn.Linear"] == "float16"  # bias adds included
    assert ran["eqx.nn.BatchNorm"] == "float32; its sums in float32"
    first_amp_step = next(ln for ln in lines if ln.startswith("amp "))
    assert re.fullmatch(r"amp\s+step\s+0\s+loss \d+\.\d+\s+scale 65536\s+skipped False", first_amp_step)


def test_explain_example_reports_low_precision_matmuls_and_finds_the_injected_overflow():
    lines = run_example("explain.py")
    rows = {m[1]: m[2] for m in (re.fullmatch(r" (Block/\S+)\s+\d+\s+(.+?)\s{3,}.*", ln) for ln in lines) if m}
    assert rows["Block/mlp_in"] == rows["Block/lm_head"] == "f16 2, f32 1" and rows["Block/LayerNorm_0"] == "f32 18"
    assert (
        "9 of 9 matmuls ran in float16; Block/LayerNorm_0 and Block/LayerNorm_1 ran in float32 (the GPU list's "
        "LayerNorm rule)." in lines
    )
    slow = [i for i, ln in enumerate(lines) if ln.endswith("...")]  # a progress line before each slow search
    assert len(slow) == 2 and lines[slow[0] + 1] == "   No overflow: every float16 result is finite where float32 is."
    assert re.fullmatch(
        r"   Found: overflow in mul \(op #\d+\) at explain\.py:\d+ \(Block\.__call__\) \[Block\]: .*",
        lines[slow[1] + 1],
    )
    assert re.fullmatch(r"   explain\.py:\d+ \(Block\.__call__\) is the line to change: .*", lines[-1])
    assert not any(ln.startswith("RESULT") for ln in lines)


def test_quickstart_trains_with_autocast_and_the_scaler_and_matches_float32():
    lines = run_example("quickstart.py")
    accuracy = next(line for line in lines if line.startswith("train accuracy"))
    fp32, amp = (float(v) for v in re.findall(r"\d\.\d{3}", accuracy))
    assert fp32 > 0.9 and abs(fp32 - amp) < 0.02
    losses = [ln.split() for ln in lines if re.fullmatch(r"\s*\d+\s+\d+\.\d{4}\s+\d+\.\d{4}", ln)]
    assert [int(row[0]) for row in losses] == list(range(0, 60, 10))
    assert all(abs(float(ref) - float(amp)) < 0.005 for _, ref, amp in losses)  # "about three decimals"
    assert re.fullmatch(
        r"loss scale: 65536 -> \d+, \d+ of 60 steps skipped", next(ln for ln in lines if ln.startswith("loss scale"))
    )
    assert any(ln.startswith("A good result: ") for ln in lines)  # the table is explained
    ran = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines if ln.startswith("  ")}
    assert re.fullmatch(r"float16: \d+", ran["dot_general"]) and ran["exp"] == ran["log"] == "float32: 1"
    assert "gradient dtypes: ['float32']" in lines
