"""``attnres-probe corpus`` and ``Probe.run_corpus`` under torchrun (gloo, CPU): the merged result equals
one process's, a rank that dies or raises fails the whole run without a result, ``--resume`` completes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attnres_probe.corpus import COMPARISON_FILE, CORPUS_FILE, RANKS_DIR, load_stats_dir, record_corpus
from attnres_probe.corpus.distributed import Ranks, is_mine
from attnres_probe.corpus.stats import CorpusStats

WORKER = Path(__file__).with_name("dist_worker.py")
MODELS = ("prenorm", "block")
# six documents of different lengths (one empty), and a corpus of two for more ranks than documents
DOCS = {
    f"{i:02d}.txt": ("To be, or not to be, that is the question. " * 20)[: 90 + 130 * i] for i in range(5)
} | {"05_empty.txt": ""}
TWO_DOCS = {"a.txt": "Whether 'tis nobler in the mind to suffer " * 7, "b.txt": "the slings and arrows " * 5}


def _write(root: Path, docs: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    for name, text in docs.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


def _torchrun(n: int, *args: str, fault: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNRES_DIST_TIMEOUT": "60", "PYTHONWARNINGS": "ignore"}
    env.pop("ATTNRES_TEST_FAULT", None)
    if fault:
        env["ATTNRES_TEST_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(WORKER), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _corpus_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["corpus", "--demo", *MODELS, "--data", str(data), "--out", str(out), "--no-progress", "--resamples", "50", *extra]


def assert_same_stats(a: CorpusStats, b: CorpusStats) -> None:
    """Cell by cell to float rounding (the merges add in another order); per-window values identical."""
    assert (a.n_tokens, a.n_sequences, a.n_skipped) == (b.n_tokens, b.n_sequences, b.n_skipped)
    assert set(a.names) == set(b.names) and set(a.profiles) == set(b.profiles)
    for group_a, group_b in ((a.stats, b.stats), (a.profiles, b.profiles)):
        for k in group_a:
            np.testing.assert_array_equal(group_a[k].count, group_b[k].count)
            for f in ("mean", "m2"):
                x, y = getattr(group_a[k], f), getattr(group_b[k], f)
                # a mean or M2 summed over at most a few hundred float64 terms: 1e-12 relative is ~4500 u
                np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12 * np.nanmax(np.abs(x), initial=1.0), equal_nan=True)
    ta, tb = a.window_table(), b.window_table()
    assert ta.equals(tb), "the per-window values differ"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One-process runs over both corpora: the references."""
    root = tmp_path_factory.mktemp("dist")
    refs = {}
    for name, docs in (("six", DOCS), ("two", TWO_DOCS)):
        data = _write(root / f"data-{name}", docs)
        record_corpus(data, root / f"single-{name}", demo=list(MODELS), progress=False, n_resamples=50)
        refs[name] = (data, load_stats_dir(root / f"single-{name}")[1])
    return refs


def test_documents_are_dealt_round_robin_and_every_rank_numbers_them_alike():
    assert [r for i in range(7) for r in range(3) if is_mine(i, r, 3)] == [0, 1, 2, 0, 1, 2, 0]
    shards = [list(Ranks(rank=r, world=3, device=None).shard(["a", "b", "c", "d"], empty="")) for r in range(3)]
    assert shards == [["a", "", "", "d"], ["", "b", "", ""], ["", "", "c", ""]]


def test_stats_travel_as_bytes_without_pickle_and_come_back_equal(single):
    stats = single["six"][1]["block"]
    blob = stats.to_bytes()
    assert b"\x80\x04\x95" not in blob  # no pickle protocol-4 frame anywhere
    back = CorpusStats.from_bytes(blob)
    assert back.meta == json.loads(json.dumps(stats.meta))
    assert_same_stats(stats, back)


@pytest.mark.parametrize("n, corpus", [(2, "six"), (3, "two")], ids=["2 ranks, 6 documents", "3 ranks, 2 documents"])
def test_ranks_under_torchrun_merge_to_the_single_process_result(tmp_path, single, n, corpus):
    data, reference = single[corpus]
    out = tmp_path / "out"
    run = _torchrun(n, *_corpus_args(data, out))
    assert run.returncode == 0, run.stderr[-3000:]
    manifest, stats = load_stats_dir(out)
    assert manifest["complete"] and (out / COMPARISON_FILE).is_file()
    assert not (out / RANKS_DIR).exists()  # the ranks' progress is gone once the result is written
    assert run.stdout.count("wrote ") == 1  # rank 0 reports, once
    for name in MODELS:
        assert_same_stats(reference[name], stats[name])


def test_a_rank_that_raises_fails_the_run_in_one_line_and_writes_no_result(tmp_path, single):
    data, _ = single["six"]
    out = tmp_path / "out"
    run = _torchrun(3, *_corpus_args(data, out), fault="raise:2:3")
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("attnres-probe corpus: error:")]
    assert len(ours) == 1 and "rank 2 failed" in ours[0] and "injected fault" in ours[0], run.stderr[-3000:]
    assert not (out / COMPARISON_FILE).exists()
    assert not json.loads((out / CORPUS_FILE).read_text())["complete"]
    assert "rerun with --resume" in ours[0]
    # every rank finds the same setup error: said once, as one process would say it (no rank, no resume advice)
    other = _torchrun(2, *_corpus_args(single["two"][0], out))
    ours = [line for line in other.stderr.splitlines() if line.startswith("attnres-probe corpus: error:")]
    assert other.returncode != 0 and len(ours) == 1, other.stderr[-3000:]
    assert "holds a corpus run over other data" in ours[0] and "--resume" not in ours[0]
    assert "rank 0" not in ours[0] and "CorpusRunError" not in ours[0]


def test_a_rank_killed_mid_run_fails_the_run_and_resume_completes_it(tmp_path, single):
    data, reference = single["six"]
    out = tmp_path / "out"
    # rank 1 dies at its 9th window: part-way through the second model (its shard of the six documents has 6 windows)
    run = _torchrun(2, *_corpus_args(data, out, "--save-every", "0"), fault="kill:1:8")
    assert run.returncode != 0
    assert "rank      : 1" in run.stderr and "SIGKILL" in run.stderr  # torchrun's report names the rank and the signal
    assert "stopped by torchrun because another rank stopped" in run.stderr
    manifest = json.loads((out / CORPUS_FILE).read_text())
    assert not manifest["complete"] and not (out / COMPARISON_FILE).exists()
    assert [m["complete"] for m in manifest["models"]] == [True, False]  # the first model was merged and written
    with pytest.raises(Exception, match="unfinished"):
        load_stats_dir(out)  # no partial aggregate looks complete
    assert (out / RANKS_DIR / "of2" / "rank0").is_dir()  # rank 0's progress on the second model was kept

    resumed = _torchrun(2, *_corpus_args(data, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "prenorm: already recorded" in resumed.stderr
    _, stats = load_stats_dir(out)
    for name in MODELS:
        assert_same_stats(reference[name], stats[name])


def test_probe_run_corpus_under_torchrun_returns_the_merged_stats_on_every_rank(tmp_path, single):
    data, reference = single["six"]
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from attnres_probe import Probe, load_demo
        model, tok = load_demo("block")
        texts = [p.read_text() for p in sorted(Path({str(data)!r}).iterdir())]
        stats = Probe(model, tok, name="block").run_corpus(texts, backward=True, progress=False)
        Path({str(tmp_path)!r}, "rank" + os.environ["RANK"]).write_bytes(stats.to_bytes())
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNRES_DIST_TIMEOUT": "60"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        got = CorpusStats.from_bytes((tmp_path / f"rank{rank}").read_bytes())
        assert_same_stats(reference["block"], got)


def test_resume_without_a_run_is_refused(tmp_path, single, capsys):
    from attnres_probe.cli import main

    data, _ = single["two"]
    assert main(_corpus_args(data, tmp_path / "new", "--resume")) == 2
    assert "holds no corpus run to continue" in capsys.readouterr().err


def test_a_run_says_when_progress_saved_by_another_number_of_ranks_goes_unused(tmp_path, capsys):
    from attnres_probe.corpus.record import _say_where_it_resumes

    (tmp_path / RANKS_DIR / "of2" / "rank1" / "models" / "block").mkdir(parents=True)
    _say_where_it_resumes(tmp_path, {"name": "block", "dir": "models/block"}, None, None)
    err = capsys.readouterr().err
    assert "progress saved by 2 ranks" in err and "not used by a run of one process" in err
    _say_where_it_resumes(tmp_path, {"name": "prenorm", "dir": "models/prenorm"}, None, None)
    assert capsys.readouterr().err == ""  # nothing saved for that model
