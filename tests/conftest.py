import os
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_flags  # beside this file, on the path just set

compile_flags.set_flags(os.environ)  # fast XLA:CPU compiles (compile_flags.py says which, and why)


@pytest.fixture
def compilations():
    """The XLA compilations JAX runs while the test body runs (eager ops included)."""
    import jax  # after the environment above is set

    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


def pytest_terminal_summary(terminalreporter):
    """Print the coverage sweep's pass rate (tests/casting/test_sweep.py)."""
    stats = terminalreporter.stats
    outcome_of = {"passed": "passed", "failed": "failed", "xfailed": "known limitation"}
    counts = {
        label: sum("test_sweep.py::test_sweep[" in r.nodeid for r in stats.get(key, []) if r.when == "call")
        for key, label in outcome_of.items()
    }
    total = sum(counts.values())
    if total:
        terminalreporter.write_line(
            f"autocast coverage sweep: {counts['passed']}/{total} cases pass ({100 * counts['passed'] / total:.1f}%), "
            f"{counts['failed']} failed, {counts['known limitation']} known limitations"
        )


@pytest.fixture(params=["select_where_produced", "select_after"])
def skip_form(request, monkeypatch):
    """Run jamp.scaler with each skip form on this platform (each platform picks one by default)."""
    from jamp.scaling import skip

    monkeypatch.setattr(skip, "FORM_OF_PLATFORM", {"default": getattr(skip, request.param)})
    return request.param
