"""``attnres-probe corpus``: records a folder or file through models, resumes, and refuses bad input with the reason."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from attnres_probe.cli import main
from attnres_probe.corpus import CorpusDataError, CorpusRunError, list_documents, load_stats_dir, record_corpus
from attnres_probe.corpus import documents as documents_mod
from attnres_probe.corpus import record as record_mod

from helpers import tiny_model

DOCS = {
    "a.txt": "The first document fills several windows of the tiny model's context.\n",
    "b/c.md": "A second, nested document.",
    "d.txt": "Third: café, naïve, 日本語.",
    "e.txt": "",
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    for r in ("prenorm", "block"):
        tiny_model(r).save(root / r)
    return [str(root / "prenorm"), str(root / "block")]


def _write_docs(root, docs=DOCS):
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".hidden").write_text("never read")
    return root


def test_corpus_records_every_document_and_writes_aggregates_and_comparisons(tmp_path, ckpts, capsys):
    data = _write_docs(tmp_path / "data")
    out = tmp_path / "out"
    assert main(["corpus", "--models", *ckpts, "--data", str(data), "--out", str(out), "--no-progress", "--resamples", "200"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "prenorm:" in printed and "block:" in printed and "comparison.csv" in printed
    assert "note: Only 3 documents" in captured.err  # the few-documents warning, on the command line too (one doc is empty)
    manifest, stats = load_stats_dir(out)
    assert manifest["complete"] and [d[0] for d in manifest["data"]["files"]] == ["a.txt", "b/c.md", "d.txt", "e.txt"]
    n_bytes = sum(len(t.encode()) for t in DOCS.values())
    for s in stats.values():
        assert s.n_tokens + s.n_skipped <= n_bytes and s.n_windows == s.n_sequences
        assert s.window_table()["param_grad_cv"].notna().all()  # one backward per window
    frame = pd.read_csv(out / "comparison.csv")
    assert set(frame["verdict"].dropna()) <= {"consistent", "contrary", "inconclusive"}
    assert (frame.query("comparison != 'value'")["windows"] == stats["block"].n_windows).all()


def test_an_interrupted_run_resumes_and_equals_an_uninterrupted_one(tmp_path, ckpts, monkeypatch, capsys):
    data = _write_docs(tmp_path / "data")
    whole = record_corpus(data, tmp_path / "whole", models=ckpts, batch_size=2, progress=False, n_resamples=100)
    calls = {"n": 0}
    real = record_mod._save_progress

    def crash_after_two_saves(*args, **kw):
        real(*args, **kw)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(record_mod, "_save_progress", crash_after_two_saves)
    with pytest.raises(KeyboardInterrupt):
        record_corpus(data, tmp_path / "part", models=ckpts, batch_size=2, save_every=0, progress=False, n_resamples=100)
    monkeypatch.setattr(record_mod, "_save_progress", real)
    with pytest.raises(CorpusRunError, match="unfinished"):
        load_stats_dir(tmp_path / "part")
    capsys.readouterr()
    record_corpus(data, tmp_path / "part", models=ckpts, batch_size=2, save_every=0, progress=False, n_resamples=100)
    assert "prenorm: resuming after 4 windows" in capsys.readouterr().err  # two saves of two windows: says what it continues from
    _, a = load_stats_dir(tmp_path / "whole")
    _, b = load_stats_dir(tmp_path / "part")
    for name in a:
        ta, tb = a[name].window_table(), b[name].window_table()
        assert ta[["doc", "start", "digest"]].equals(tb[["doc", "start", "digest"]])
        np.testing.assert_allclose(a[name].mean("depth_weights"), b[name].mean("depth_weights"), rtol=1e-9, equal_nan=True)
        assert a[name].n_skipped == b[name].n_skipped
    assert whole["complete"]


def test_a_folder_holding_a_run_of_another_model_is_refused_with_the_reason(tmp_path, ckpts, capsys):
    data = _write_docs(tmp_path / "data")
    out = tmp_path / "out"
    record_corpus(data, out, models=ckpts, progress=False, n_resamples=50)
    other = tmp_path / "other" / "block"
    tiny_model("block", seed=7).save(other)
    assert main(["corpus", "--models", ckpts[0], str(other), "--data", str(data), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds stats of another model" in err and "'block'" in err and "weights sha256" in err
    (data / "new.txt").write_text("more text")
    assert main(["corpus", "--models", *ckpts, "--data", str(data), "--out", str(out), "--no-progress"]) == 2
    assert "holds a corpus run over other data" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_named_with_its_byte_offset(tmp_path, ckpts, capsys, monkeypatch):
    data = _write_docs(tmp_path / "data")
    (data / "latin1.txt").write_bytes("caf\u00e9 ok ".encode() + b"then caf\xe9 in latin-1")
    assert main(["corpus", "--models", *ckpts, "--data", str(data), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "latin1.txt" in err and "byte 0xe9 at byte offset 17" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before anything was written
    monkeypatch.setattr(documents_mod, "_CHUNK", 4)  # the bad byte lands after a chunk boundary, behind a split character
    with pytest.raises(CorpusDataError, match="byte 0xe9 at byte offset 17"):
        list_documents(data / "latin1.txt")
    (data / "cut.txt").write_bytes(b"ends inside a character \xe6\x97")
    with pytest.raises(CorpusDataError, match="a truncated character at byte offset 24"):
        list_documents(data / "cut.txt")


def test_an_empty_corpus_is_refused(tmp_path, ckpts, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["corpus", "--models", *ckpts, "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "the folder holds no files" in capsys.readouterr().err
    _write_docs(tmp_path / "blank", {"x.txt": "", "y.txt": ""})
    assert main(["corpus", "--models", *ckpts, "--data", str(tmp_path / "blank"), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "every document is empty" in capsys.readouterr().err


def test_windows_shorter_than_two_tokens_are_left_out_and_said(tmp_path, ckpts, capsys):
    data = _write_docs(tmp_path / "data", {"one.txt": "x", "two.txt": "ab"})  # "x": one token
    assert main(["corpus", "--models", *ckpts, "--data", str(data), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "1 window, 2 tokens, 1 window under two tokens left out" in out
    frame = pd.read_csv(tmp_path / "o" / "comparison.csv")  # one window: no interval, said in words
    comps = frame[frame["comparison"] != "value"]
    directed = comps["expected"].notna()  # no verdict where the paper states no direction
    assert (comps.loc[directed, "verdict"] == "inconclusive").all() and comps.loc[~directed, "verdict"].isna().all()
    assert comps["note"].str.contains("no interval: 1 window").all()
    only_short = _write_docs(tmp_path / "short", {"one.txt": "x"})
    assert main(["corpus", "--models", *ckpts, "--data", str(only_short), "--out", str(tmp_path / "o2"), "--no-progress"]) == 2
    assert "no window of at least 2 tokens" in capsys.readouterr().err


def test_out_that_holds_something_else_is_refused(tmp_path, ckpts, capsys):
    data = _write_docs(tmp_path / "data")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["corpus", "--models", *ckpts, "--data", str(data), "--out", str(tmp_path / "busy"), "--no-progress"]) == 2
    assert "holds no corpus run" in capsys.readouterr().err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    bad = json.loads('{"schema_version": 99}')
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "corpus.json").write_text(json.dumps(bad))
    assert main(["corpus", "--models", *ckpts, "--data", str(data), "--out", str(tmp_path / "new"), "--no-progress"]) == 2
    assert "upgrade attnres-probe" in capsys.readouterr().err
