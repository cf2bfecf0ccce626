"""#35 item 8: ``attnres-probe corpus`` writes documents.csv beside comparison.csv: which documents drive each verdict."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from attnres_probe.analysis.documents import COLUMNS, document_breakdown
from attnres_probe.cli import main
from attnres_probe.corpus import COMPARISON_FILE, DOCUMENTS_FILE, load_stats_dir

from helpers import tiny_model

DOCS = {
    "acts/one.txt": "The first document fills several windows of the tiny model's context, and a little more.\n",
    "acts/two.txt": "A second document, of another kind: 1, 2, 3, 4.",
    "empty.txt": "",
    "notes.md": "Third: café, naïve, 日本語, and a last line.",
    "zz.txt": "def f(x):\n    return x + 1\n",
}


def test_corpus_writes_documents_csv_beside_comparison_csv(tmp_path, capsys):
    ckpts = []
    for r in ("prenorm", "full"):
        tiny_model(r).save(tmp_path / "ckpt" / r)
        ckpts.append(str(tmp_path / "ckpt" / r))
    data = tmp_path / "data"
    for name, text in DOCS.items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    assert main(["corpus", "--models", *ckpts, "--data", str(data), "--out", str(out), "--no-progress",
                 "--resamples", "300", "--seed", "2"]) == 0
    assert DOCUMENTS_FILE in capsys.readouterr().out
    manifest, stats = load_stats_dir(out)
    assert manifest["comparison"]["documents_file"] == DOCUMENTS_FILE and (out / COMPARISON_FILE).is_file()
    names = [f[0] for f in manifest["data"]["files"]]
    assert all(s.meta["documents"] == names for s in stats.values())  # what pages label documents with

    frame = pd.read_csv(out / DOCUMENTS_FILE)
    assert list(frame.columns) == list(COLUMNS)
    by_id = frame.drop_duplicates("doc").set_index("doc")["document"]
    assert dict(by_id) == {i: n for i, n in enumerate(names) if n != "empty.txt"}  # the empty file has no window
    # the verdicts over every document are comparison.csv's
    comparison = pd.read_csv(out / COMPARISON_FILE)
    comps = comparison[comparison["comparison"] != "value"].set_index(["model", "metric"])
    for (model, metric), g in frame.groupby(["model", "metric"]):
        verdict = comps.loc[(model, metric), "verdict"]  # empty where the paper states no direction
        assert (g["verdict"].fillna("") == ("" if pd.isna(verdict) else verdict)).all()
        np.testing.assert_allclose(g["pooled"], comps.loc[(model, metric), "estimate"], rtol=1e-9)
    assert set(frame["baseline"]) == {"uniform", "prenorm"} and set(frame["model"]) == {"full"}
    # the frame the library gives for the same stats, to the precision a CSV keeps
    want = document_breakdown(*stats.values(), names=list(stats), n_resamples=300, seed=2)
    np.testing.assert_allclose(frame["value"], want["value"], rtol=1e-12)
    np.testing.assert_allclose(frame["pooled_without"], want["pooled_without"], rtol=1e-12)
    assert list(frame["changes_verdict"]) == list(want["changes_verdict"])
    assert list(frame["verdict_without"].fillna("")) == list(want["verdict_without"])
    assert (frame.groupby("doc")["n_windows"].max() >= 1).all()


@pytest.mark.parametrize("files", [None, [], [["a.txt", 1, "x"], "b.txt"]])
def test_document_names_come_from_a_manifest_that_lists_them(files):
    from attnres_probe.corpus.run import document_names

    manifest = {"data": {"files": files}} if files is not None else {}
    assert document_names(manifest) == ([] if files == [] else None)
    assert document_names({"data": {"files": [["a.txt", 1, "x"], ["b/c.md", 2, "y"]]}}) == ["a.txt", "b/c.md"]


def test_the_progress_bar_knows_its_total_ahead_for_byte_models_and_token_lists():
    """#50: a notebook's run_corpus shows a total and the time left: the windows it will record, counted ahead."""
    import torch

    from attnres_probe import Probe
    from attnres_probe.corpus.stream import _expected_windows

    from helpers import tiny_model

    probe = Probe(tiny_model("full", d_vocab=256, n_ctx=16))
    texts = ["a" * 40, "b" * 16, "c" * 3, "é" * 10]  # 3 + 1 + 1 + 2 windows (é is two bytes)
    stats = probe.run_corpus(texts, progress=False)
    assert _expected_windows(probe, texts) == stats.n_windows + stats.n_skipped == 7
    assert _expected_windows(probe, [torch.arange(20), list(range(5))]) == 3
    assert _expected_windows(probe, (t for t in texts)) is None  # a generator: not counted ahead
