"""The kernel tests' shared set-up: the generic-CPU rerun (test_generic_cpu.py) starts early.

That rerun is one child pytest (generic_cpu.py: the Numba kernels compiled in memory for a
generic x86-64 CPU) that takes a minute or more on one core, while the tests of this folder run
one at a time in this process. So the child starts when the first test of this folder starts,
and test_generic_cpu.py, moved after the folder's other tests, waits for it and checks its
result: on a two-core machine the two overlap instead of running one after the other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from generic_cpu import GenericCpuRun

HERE = Path(__file__).resolve().parent
GENERIC_TEST = HERE / "test_generic_cpu.py"
SELECTED = pytest.StashKey[bool]()


def _path(item) -> Path:
    return Path(str(item.path)).resolve()


def pytest_collection_modifyitems(config, items):
    """Run test_generic_cpu.py after the other tests of this folder (its child runs beside them)."""
    generic = [i for i in items if _path(i) == GENERIC_TEST]
    if not generic:
        return
    rest = [i for i in items if i not in generic]
    ours = [k for k, i in enumerate(rest) if _path(i).parent == HERE]
    at = ours[-1] + 1 if ours else len(rest)
    items[:] = [*rest[:at], *generic, *rest[at:]]


def pytest_collection_finish(session):
    """Whether test_generic_cpu.py is among the tests that will run (after -k, -m, --deselect)."""
    session.config.stash[SELECTED] = any(_path(i) == GENERIC_TEST for i in session.items)


@pytest.fixture(scope="session")
def generic_cpu_run(tmp_path_factory):
    run = GenericCpuRun(tmp_path_factory.mktemp("generic-cpu"))
    yield run
    run.stop()  # an interrupted session leaves no child behind


@pytest.fixture(autouse=True)
def _start_the_generic_cpu_run_early(request):
    """Start the child as soon as this folder's first test runs, where test_generic_cpu.py is selected."""
    if request.config.stash.get(SELECTED, False):
        request.getfixturevalue("generic_cpu_run")
