"""The child pytest of test_generic_cpu.py: the Numba kernels' tests and the whole-model backend
tests with the kernels compiled in memory for a generic x86-64 CPU (conftest.py starts it early)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("test_numba_depth_attn.py", "test_model_backends.py")  # the op, then whole models on every backend
# Leaves out the parametrizations that run only Triton (``[triton-...]``, ``[...-triton]``): the
# Triton interpreter compiles nothing with Numba, so NUMBA_CPU_NAME cannot change what they
# compute, and the main run checks them already. Every test that runs a Numba kernel stays.
DESELECT = "not triton-block and not -triton]"
ENV = {"NUMBA_CPU_NAME": "generic", "ATTNRES_NUMBA_CACHE": "0"}


class GenericCpuRun:
    """The child pytest, started at construction; :meth:`result` waits for it."""

    def __init__(self, folder: Path):
        self.stdout = folder / "stdout.txt"
        self.stderr = folder / "stderr.txt"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(folder / "tmp"),
               "-k", DESELECT, *(str(HERE / f) for f in FILES)]
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:  # files: no pipe to fill while it runs
            self.proc = subprocess.Popen(cmd, env=dict(os.environ, **ENV), stdout=out, stderr=err, cwd=HERE.parents[1])

    def result(self, timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of the child, once it has finished."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return code, self.stdout.read_text(), self.stderr.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
