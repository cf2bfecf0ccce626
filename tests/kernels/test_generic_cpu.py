"""The Numba kernels' tests once more for a generic x86-64 target (``NUMBA_CPU_NAME=generic``:
no AVX, no FMA, other rounding in the reductions), compiled in memory: the tolerances come from
the arithmetic, not from this machine's instruction set (README, "Backends")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_the_numba_kernel_tests_pass_when_compiled_for_a_generic_x86_64_cpu():
    env = dict(os.environ, NUMBA_CPU_NAME="generic", ATTNRES_NUMBA_CACHE="0")
    probe = "import numba; print(numba.config.CPU_NAME)"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip() == "generic"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_numba_depth_attn.py")],
        env=env, capture_output=True, text=True, timeout=1200, cwd=HERE.parents[1],
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout and " skipped" not in run.stdout
