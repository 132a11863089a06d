"""The XLA:CPU flags the suite compiles with, and the compile options that give a test the program users get.

On a CPU the suite compiles thousands of small programs, and compiling is most of its time. Two flags cut it:

* ``xla_backend_optimization_level=0`` skips LLVM's optimisation passes (a third of the suite's time when it was
  measured, on jaxlib 0.10). They change no IEEE result: XLA's HLO passes, which decide dtypes, excess
  precision and fusions, still run.
* ``xla_cpu_use_fusion_emitters=false`` compiles fusions with XLA's older emitters, where the jaxlib still has
  them (0.10; 0.11 and 0.12 have only the new ones): the README's command went from 593 s to 379 s with it.
  Their fusions differ from the new emitters' (the same operations, grouped otherwise; the results were
  bit-identical on the program ``tests/integration/test_compile_flags.py`` compares), so a test that reads the
  optimized program's fusions or measures accuracy under XLA's default flags compiles with :func:`as_users`
  (``lowered.compile(as_users())``); the newer-JAX legs of CI run the whole internals set on the new emitters.

An unknown flag in ``XLA_FLAGS`` aborts the process, so :func:`set_flags` asks a child interpreter (once per
test session: xdist workers and subprocess tests inherit the environment) which flags this jaxlib has.
"""

from __future__ import annotations

import os
import subprocess
import sys

# flag -> the suite's value (all of them how XLA:CPU makes machine code; none redefines an operation)
SUITE = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
# flag -> the value users compile with, for each suite flag that changes the optimized program
USERS = {"xla_cpu_use_fusion_emitters": True}
_PROBE = """
import sys, jax
lowered = jax.jit(lambda x: x + 1).lower(1.0)
for flag, value in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        lowered.compile({flag: {"true": True, "false": False}.get(value, value)})
        print(flag)
    except Exception:
        pass
"""


def _known(flags: dict[str, str]) -> set[str]:
    """The flags this jaxlib's XLA accepts, asked of a child interpreter as compile options (which raise)."""
    args = [item for pair in flags.items() for item in pair]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=env, check=True)
    return set(out.stdout.split())


def set_flags(environ: os._Environ) -> None:
    """Add the suite's flags this jaxlib knows to ``environ["XLA_FLAGS"]``, once (not where they are set, nor
    off a CPU)."""
    flags = environ.get("XLA_FLAGS", "")
    if environ.get("JAX_PLATFORMS") != "cpu" or any(f"--{flag}" in flags for flag in SUITE):
        return
    known = _known(SUITE)
    added = [f"--{flag}={value}" for flag, value in SUITE.items() if flag in known]
    environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()


def as_users() -> dict:
    """Compile options that undo the suite's flags where they change the optimized program:
    ``lowered.compile(as_users())`` compiles what users get (LLVM's passes aside, which change no result)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {flag: value for flag, value in USERS.items() if f"--{flag}={SUITE[flag]}" in flags}
