"""The package as a user installs it: a wheel built from the tree, used without the checkout.

The wheel is built once (``pip wheel --no-deps``), unpacked with ``pip install --target`` and
imported by a Python that does not read ``.pth`` files (``-S``, so the editable install's finder is
not there) and does not start in the repository: only the wheel provides ``attnres_probe``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"attnres_probe": "attnres_probe", "kernels": "attnres_probe/kernels", "hooks": "attnres_probe/hooks",
           "dashboards": "attnres_probe/dashboards", "reports": "attnres_probe/reports"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tree (setuptools' build/ folder in a checkout could hold stale modules)."""
    import shutil

    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("tree") / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                                              ".pytest_cache", "study_models", ".demo-work", "out"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("attnres_probe-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def _run(installed: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Python without site's .pth files, the wheel first on the path, then the venv's other packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = os.pathsep.join([str(installed), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env.setdefault("TRITON_INTERPRET", "1")
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_wheel_holds_every_module_and_data_file_of_the_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder, inside in FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            rel = path.relative_to(ROOT / folder).as_posix()
            wanted = path.suffix == ".py" or path.suffix in (".json", ".safetensors", ".j2", ".html", ".css", ".js")
            if wanted and f"{inside}/{rel}" not in names:
                missing.append(f"{folder}/{rel}")
    assert not missing, f"the wheel lacks {missing[:10]} ({len(missing)} files)"
    assert "attnres_probe/demo_models/full/model.safetensors" in names


def test_the_installed_wheel_runs_the_command_and_loads_every_demo_model(installed, tmp_path):
    from attnres_probe.demo_recipe import DEMO_NAMES

    code = ("import attnres_probe, sys; from attnres_probe import load_demo\n"
            "assert attnres_probe.__file__.startswith(sys.argv[1]), attnres_probe.__file__\n"
            "import attnres_probe.kernels, attnres_probe.dashboards.app, attnres_probe.reports.builder\n"
            f"for name in {list(DEMO_NAMES)!r}:\n"
            "    model, tok = load_demo(name)\n"
            "    print(name, model.cfg.residual, model(tok.to_tokens('ROMEO:')).shape)\n")
    done = _run(installed, "-c", code, str(installed), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(name in done.stdout for name in DEMO_NAMES), done.stdout
    done = _run(installed, "-m", "attnres_probe.cli", "summary", "--demo", "full", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final" in done.stdout, done.stdout[-2000:]


def test_no_top_level_folder_shadows_an_installed_distribution():
    """From the repository root, ``import kernels`` is Hugging Face's distribution (which transformers
    imports), and transformers and fla import; a bare name with no distribution fails as if the
    folder were not there."""
    code = ("import importlib.metadata as md, kernels, pathlib\n"
            "assert pathlib.Path(kernels.__file__).resolve().parent != pathlib.Path('kernels').resolve(), kernels.__file__\n"
            "from transformers import LlamaForCausalLM\n"
            "import fla\n"
            "try:\n"
            "    import hooks\n"
            "except ModuleNotFoundError as err:\n"
            "    print('hooks:', err)\n"
            "else:\n"
            "    assert md.distribution('hooks'), hooks.__file__\n"
            "import attnres_probe.kernels as k; assert k.depth_attn\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("TRITON_INTERPRET", "1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attnres_probe.hooks" in done.stdout
