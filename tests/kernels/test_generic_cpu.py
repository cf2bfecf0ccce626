"""The Numba kernels' tests and the whole-model backend tests once more, with the kernels
compiled in memory for a generic x86-64 target (``NUMBA_CPU_NAME=generic``: no AVX, no FMA,
other rounding in the reductions): the tolerances come from the arithmetic, not from this
machine's instruction set (README, "Backends")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("test_numba_depth_attn.py", "test_model_backends.py")  # the op, then whole models on every backend


def test_the_kernel_tests_pass_with_the_numba_kernels_compiled_for_a_generic_x86_64_cpu():
    env = dict(os.environ, NUMBA_CPU_NAME="generic", ATTNRES_NUMBA_CACHE="0")
    probe = "import numba; print(numba.config.CPU_NAME)"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip() == "generic"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(HERE / f) for f in FILES)],
        env=env, capture_output=True, text=True, timeout=1200, cwd=HERE.parents[1],
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout and " skipped" not in run.stdout
