"""The Numba kernels' tests and the whole-model backend tests once more, with the kernels
compiled in memory for a generic x86-64 target (``NUMBA_CPU_NAME=generic``: no AVX, no FMA,
other rounding in the reductions): the tolerances come from the arithmetic, not from this
machine's instruction set (README, "Backends").

The child pytest (generic_cpu.py) is started by this folder's conftest.py when the folder's
first test runs, so it runs beside them; this test runs after them and checks its result."""

from __future__ import annotations

import os
import subprocess
import sys

from generic_cpu import DESELECT, ENV


def test_the_kernel_tests_pass_with_the_numba_kernels_compiled_for_a_generic_x86_64_cpu(generic_cpu_run):
    env = dict(os.environ, **ENV)
    probe = "import numba; print(numba.config.CPU_NAME)"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip() == "generic"
    code, stdout, stderr = generic_cpu_run.result(timeout=1200)
    assert code == 0, stdout[-4000:] + stderr[-2000:]
    assert " passed" in stdout and " failed" not in stdout and " skipped" not in stdout
    assert "triton" in DESELECT and " deselected" in stdout  # only the parametrizations that run Triton alone
