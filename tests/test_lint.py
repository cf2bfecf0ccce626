"""The committed ruff configuration passes (issue #48): lint and import order, line length 150."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes_on_the_repository():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install -e .[dev] (it is a test dependency)")
    out = subprocess.run([ruff, "check", "attnres_probe", "kernels", "hooks", "dashboards", "reports", "tests", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]
