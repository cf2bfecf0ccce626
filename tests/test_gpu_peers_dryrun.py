"""benchmarks/gpu_peers.py on the CPU (issue #20): its ``--dry-run`` under the Triton
interpreter, with a deliberately wrong implementation and a peer that cannot be imported
added to the ones it compares; and fla's reference agreeing with ours."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_peers = _load("gpu_peers", ROOT / "benchmarks" / "gpu_peers.py")


class WrongMixture(gpu_peers.Impl):
    """The reference with its mixture 5% too large; counts its calls."""

    name = "wrong-mixture"

    def __init__(self):
        self.calls = 0

    def read(self, x, query, gain, eps):
        self.calls += 1
        return gpu_peers.kernels.depth_attn(x, query, gain, eps, backend="torch")[0] * 1.05


class _NoGainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gain):
        return gain.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


class WrongGradient(WrongMixture):
    """The right mixture with a zero gain gradient."""

    name = "wrong-gradient"

    def read(self, x, query, gain, eps):
        self.calls += 1
        return gpu_peers.kernels.depth_attn(x, query, _NoGainGrad.apply(gain), eps, backend="torch")[0]


class NotInstalled(gpu_peers.Impl):
    name, package = "no-such-peer", "attnres-probe-no-such-peer"

    def setup(self, device):
        import attnres_probe_no_such_peer  # noqa: F401


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of the reads and the Block path (no fla import, no torch.compile: seconds)."""
    out = tmp_path_factory.mktemp("gpu_peers") / "results.md"
    extra = [WrongMixture(), WrongGradient(), NotInstalled()]
    argv = ["--dry-run", "--no-compile", "--peers", "--parts", "reads", "block", "--warmup", "0", "--reps", "1", "--out", str(out)]
    assert gpu_peers.main(argv, extra_impls=extra) == 0
    return out.read_text(), extra


def _tables(markdown: str) -> list[list[dict[str, str]]]:
    """Every markdown table in the text, as rows of {column: cell}."""
    lines, tables = markdown.splitlines(), []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith("|---") and not (i and lines[i - 1].startswith("|")):
            head = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for body in lines[i + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(head, (c.strip() for c in body.strip("|").split("|")))))
            tables.append(rows)
    return tables


def _table(markdown: str, *columns: str, without: str = "") -> list[dict[str, str]]:
    """The first table that has all these columns (and not the column ``without``)."""
    return next(t for t in _tables(markdown) if t and all(c in t[0] for c in columns) and without not in t[0])


def test_dry_run_checks_and_times_ours_against_the_reference(dry_run):
    md, _ = dry_run
    assert "dry run" in md
    ours = [r for r in _table(md, "impl", "S") if r["impl"] == "ours"]
    assert len(ours) == 2 and all(r["check"] == "ok" and float(r["fwd ms"]) > 0 for r in ours)
    assert all(float(r["eager/ours f+b"]) > 0 for r in _table(md, "ours fwd BW/copy"))
    block = {r["impl"]: r for r in _table(md, "impl", "fwd+bwd ms", without="S")}
    for name in ("ours two-phase", "ours one read at a time", "eager two-phase"):
        assert block[name]["check"] == "ok" and float(block[name]["fwd+bwd ms"]) > 0


@pytest.mark.parametrize("which", [0, 1], ids=["wrong-mixture", "wrong-gradient"])
def test_a_wrong_implementation_is_reported_and_never_timed(dry_run, which):
    md, extra = dry_run
    impl = extra[which]
    rows = [r for r in _table(md, "impl", "S") if r["impl"] == impl.name]
    assert len(rows) == 2  # one per shape
    for r in rows:
        assert r["check"].startswith("MISMATCH") and ("mix rel RMS" if which == 0 else "d gain rel RMS") in r["check"]
        assert r["first call s"] == r["fwd ms"] == r["fwd+bwd ms"] == "", f"{impl.name} was timed: {r}"
    assert impl.calls == 2  # the check's one call per shape, nothing after it
    for r in _table(md, "ours fwd BW/copy"):
        assert r[f"{impl.name}/ours fwd"] == r[f"{impl.name}/ours f+b"] == "MISMATCH"


def test_a_peer_that_cannot_be_imported_is_a_row_saying_why(dry_run):
    md, _ = dry_run
    row = next(r for r in _table(md, "implementation", "status") if r["implementation"] == "no-such-peer")
    assert row["package"] == "attnres-probe-no-such-peer (not installed)"
    assert row["status"] == "not installed: ModuleNotFoundError: No module named 'attnres_probe_no_such_peer'"
    assert all(r["impl"] != "no-such-peer" for r in _table(md, "impl", "S"))


def test_fla_reference_agrees_with_ours():
    """fla's naive_attnres, loaded from its file (importing fla itself takes ten seconds)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (pip install -e '.[gpu]')")
    naive = Path(next(iter(spec.submodule_search_locations))) / "ops" / "attnres" / "naive.py"
    pytest.importorskip("einops")
    verdict = gpu_peers.check_fla_naive(torch.device("cpu"), _load("fla_attnres_naive", naive).naive_attnres)
    assert verdict.startswith("agrees"), verdict
