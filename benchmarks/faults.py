"""Rerun the fault cases of docs/reliability.md and print their outcome table.

Each case is a test in tests/test_reliability.py marked ``@pytest.mark.faults(case, tried)``:
kills at named points of a save (a forked child SIGKILLed through ``ATTNRES_PROBE_FAULT``), full
and read-only disks (a small tmpfs when run as root, otherwise the same errno injected at the
same point), concurrent writers, hostile files, threads. This script runs them with pytest and
prints one row per case: what was tried, how many variants ran, and the outcome.

    python benchmarks/faults.py            # the table, as docs/reliability.md shows it
    python benchmarks/faults.py -k train   # a subset (any pytest -k expression)

The same cases run in the test suite (``pytest -m faults``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class _Collect:
    """A pytest plugin that records every faults-marked test's case, what it tried, and its outcome."""

    def __init__(self) -> None:
        self.rows: OrderedDict[tuple[str, str, str], list[str]] = OrderedDict()
        self.how: dict[tuple[str, str, str], set[str]] = {}
        self.marks: dict[str, tuple[tuple[str, str, str], str]] = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            mark = item.get_closest_marker("faults")
            if mark is not None:
                case, tried = mark.args[:2]
                holds = item.originalname.removeprefix("test_").replace("_", " ")
                self.marks[item.nodeid] = ((str(case), tried, holds), mark.kwargs.get("how", "in process"))

    def pytest_runtest_logreport(self, report):
        if report.nodeid not in self.marks or (report.when != "call" and report.passed):
            return
        key, how = self.marks[report.nodeid]
        outcome = "passed" if report.passed else ("skipped" if report.skipped else "failed")
        self.rows.setdefault(key, []).append(outcome)
        self.how.setdefault(key, set()).add(dict(report.user_properties).get("how", how))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default=None, help="only the cases whose test name matches this pytest -k expression")
    args = parser.parse_args(argv)
    collect = _Collect()
    pytest_args = [str(ROOT / "tests" / "test_reliability.py"), "-m", "faults", "-q", "-p", "no:cacheprovider",
                   "--rootdir", str(ROOT), "-W", "ignore"]  # fmt: skip
    if args.k:
        pytest_args += ["-k", args.k]
    t0 = time.perf_counter()
    status = pytest.main(pytest_args, plugins=[collect])
    took = time.perf_counter() - t0
    print("\n| # | tried | how | runs | outcome | what holds (test) |\n|---|---|---|---|---|---|")
    for (case, tried, holds), outcomes in sorted(collect.rows.items(), key=lambda kv: int(kv[0][0])):
        bad = [o for o in outcomes if o != "passed"]
        outcome = "held" if not bad else f"**{len(bad)} of {len(outcomes)} {bad[0]}**"
        how = ", ".join(sorted(collect.how.get((case, tried, holds), ())))
        print(f"| {case} | {tried} | {how} | {len(outcomes)} | {outcome} | {holds} |")
    print(f"\n{sum(map(len, collect.rows.values()))} runs in {took:.0f} s (python {sys.version.split()[0]}).")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
