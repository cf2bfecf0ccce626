"""#35 item 8: which documents drive a corpus verdict (analysis.documents.document_breakdown) on synthetic
windows whose answer is known: each document's own value, and the pooled verdict without it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from attnres_probe.analysis.compare import Windows, compare_windows
from attnres_probe.analysis.documents import COLUMNS, document_breakdown, document_table
from attnres_probe.analysis.windows import WINDOW_COLUMNS, reference_column

D, W = 12, 3  # documents, windows per document
DOCS = np.repeat(np.arange(D), W)
BASE = np.random.default_rng(0).normal(4.0, 0.5, D * W)


def _windows(name: str, residual: str, values: dict[str, np.ndarray], docs: np.ndarray = DOCS, tag: str = "w") -> Windows:
    n = len(docs)
    table = pd.DataFrame({"doc": docs, "start": np.arange(n) * 64, "n_tokens": np.full(n, 64),
                          "digest": [f"{tag}{i}" for i in range(n)]})
    for m in WINDOW_COLUMNS:
        table[m] = values.get(m, np.full(n, np.nan))
    pooled = pd.Series({m: float(np.nanmean(table[m])) if table[m].notna().any() else np.nan for m in WINDOW_COLUMNS})
    return Windows(name, residual, table, pooled)


def _pair(effect: np.ndarray) -> list[Windows]:
    """PreNorm and an AttnRes model whose loss is lower by each document's effect (per window: the same)."""
    return [_windows("prenorm", "prenorm", {"mean_loss": BASE}), _windows("full", "full", {"mean_loss": BASE + effect[DOCS]})]


def test_a_contrary_document_that_hides_a_consistent_verdict_is_the_one_flagged():
    """Eleven documents with a lower loss, one far the other way: over all twelve the interval spans zero; without
    that document the verdict is consistent, and leaving out any other keeps it inconclusive."""
    effect = -0.2 + np.linspace(-0.03, 0.03, D)
    effect[5] = 3.0
    frame = document_breakdown(*_pair(effect), metrics=["mean_loss"])
    assert list(frame.columns) == list(COLUMNS) and len(frame) == D
    assert (frame["verdict"] == "inconclusive").all()
    flagged = frame[frame["changes_verdict"]]
    assert list(flagged["doc"]) == [5] and flagged.iloc[0]["verdict_without"] == "consistent"
    assert flagged.iloc[0]["high_without"] < 0
    assert frame.loc[frame["shift"].abs().idxmax(), "doc"] == 5
    assert flagged.iloc[0]["value"] == pytest.approx(3.0)  # its own value: its windows alone
    assert flagged.iloc[0]["shift"] == pytest.approx(effect[np.arange(D) != 5].mean() - effect.mean())


def test_the_document_that_tips_a_verdict_is_flagged_and_moves_the_estimate_most():
    """Under a cluster bootstrap no document carries a verdict on its own (any one is left out of about a third of
    the resamples), but one can tip it: the rest of the corpus leans the paper's way, not firmly; with document 0's
    large effect the verdict is consistent, without it inconclusive. It has the largest shift; a document whose
    removal leaves the verdict as it is is not flagged."""
    effect = np.random.default_rng(2).normal(-0.1, 0.15, D)
    effect[0] = -1.5
    frame = document_breakdown(*_pair(effect), metrics=["mean_loss"])
    row = frame.set_index("doc").loc[0]
    assert row["verdict"] == "consistent" and row["verdict_without"] == "inconclusive" and row["changes_verdict"]
    assert row["low_without"] < 0 < row["high_without"]
    assert row["value"] == pytest.approx(-1.5) and row["shift"] > 0  # without it the loss difference is nearer zero
    assert frame.loc[frame["shift"].abs().idxmax(), "doc"] == 0
    kept = frame[~frame["changes_verdict"]]
    assert len(kept) and (kept["verdict_without"] == "consistent").all()


def _three_kinds() -> list[Windows]:
    """A difference against the baseline (loss), a ratio of means (output growth) and routing against the uniform
    reference, over documents of uneven sizes, a few values missing."""
    rng = np.random.default_rng(7)
    docs = np.repeat(np.arange(7), [1, 2, 3, 4, 2, 5, 3])
    n = len(docs)
    loss = rng.normal(4, 0.3, n)
    growth = rng.lognormal(0.5, 0.2, n)
    growth[3] = np.nan
    pre = _windows("prenorm", "prenorm", {"mean_loss": loss, "rms_out_growth": growth}, docs)
    ref = reference_column("locality_distance")
    att = _windows("block", "block", {"mean_loss": loss - 0.05 + rng.normal(0, 0.05, n),
                                      "rms_out_growth": growth * rng.lognormal(-0.1, 0.1, n),
                                      "locality_distance": rng.normal(0.8, 0.2, n), ref: np.full(n, 1.0)}, docs)
    return [pre, att]


def _compare_rows(items: list[Windows], n_resamples: int) -> pd.DataFrame:
    f = compare_windows(items, n_resamples=n_resamples, seed=0)
    return f[f["comparison"] != "value"].set_index(["model", "metric"])


def test_values_and_leave_one_out_equal_compare_on_the_same_windows():
    """A document's value is compare's estimate over its windows alone; the pooled estimate and verdict are
    compare's over every document, and the leave-one-out estimate, interval and verdict compare's over the other
    documents' windows, with the same resamples (a ratio as a ratio of means, routing against uniform)."""
    items = _three_kinds()
    ms = ["mean_loss", "rms_out_growth", "locality_distance"]
    frame = document_breakdown(*items, metrics=ms, n_resamples=300, loo_resamples=150)
    assert set(frame["comparison"]) == {"difference", "ratio"}
    assert frame.set_index("metric").loc["locality_distance", "baseline"].eq("uniform").all()
    whole = _compare_rows(items, 300)
    for (model, metric), g in frame.groupby(["model", "metric"]):
        want = whole.loc[(model, metric)]
        assert g["pooled"].iloc[0] == pytest.approx(want["estimate"], rel=1e-12)
        assert (g["verdict"] == want["verdict"]).all() and g["comparison"].iloc[0] == want["comparison"]
    for doc in np.unique(items[0].docs):
        alone = _compare_rows([Windows(w.name, w.residual, w.table[w.docs == doc].reset_index(drop=True), w.pooled)
                               for w in items], 1)
        without = _compare_rows([Windows(w.name, w.residual, w.table[w.docs != doc].reset_index(drop=True), w.pooled)
                                 for w in items], 150)
        for _, r in frame[frame["doc"] == doc].iterrows():
            a, b = alone.loc[(r["model"], r["metric"])], without.loc[(r["model"], r["metric"])]
            np.testing.assert_allclose(r["value"], a["estimate"], rtol=1e-12)
            np.testing.assert_allclose([r["pooled_without"], r["low_without"], r["high_without"]],
                                       [b["estimate"], b["low"], b["high"]], rtol=1e-9)
            assert r["verdict_without"] == b["verdict"]
            assert r["n_windows"] == a["windows"]


def test_many_documents_take_one_pass_over_the_windows_and_stay_equal_to_compare():
    """Leave-one-out sums are updated document by document (and recomputed every 64): still compare's numbers."""
    rng = np.random.default_rng(1)
    docs = np.repeat(np.arange(150), 2)
    loss = rng.normal(4, 0.3, len(docs))
    items = [_windows("prenorm", "prenorm", {"mean_loss": loss}, docs),
             _windows("full", "full", {"mean_loss": loss - 0.02 + rng.normal(0, 0.1, 150)[docs]}, docs)]
    frame = document_breakdown(*items, metrics=["mean_loss"], loo_resamples=100).set_index("doc")
    for doc in (0, 63, 64, 65, 130, 149):
        rest = [Windows(w.name, w.residual, w.table[w.docs != doc].reset_index(drop=True), w.pooled) for w in items]
        b = _compare_rows(rest, 100).loc[("full", "mean_loss")]
        np.testing.assert_allclose(frame.loc[doc, ["pooled_without", "low_without", "high_without"]].to_numpy(float),
                                   [b["estimate"], b["low"], b["high"]], rtol=1e-9)


def test_it_is_seeded_and_labels_documents_by_name():
    items = _three_kinds()
    a = document_breakdown(*items, metrics=["mean_loss"], seed=3)
    pd.testing.assert_frame_equal(a, document_breakdown(*items, metrics=["mean_loss"], seed=3))
    assert a.attrs["loo_resamples"] == 200 and a.attrs["n_resamples"] == 1000 and a.attrs["unit"] == "document"
    assert a["document"].iloc[0] == "document 0"
    names = [f"play{i}.txt" for i in range(7)]
    named = document_breakdown(*items, metrics=["mean_loss"], documents=names)
    assert list(named.drop_duplicates("doc")["document"]) == names

    class Stats:  # what load_stats_dir gives: the run's file names in meta
        def __init__(self, w: Windows):
            self.name, self.meta = w.name, {"residual": w.residual, "documents": names}
            self._w = w

        def window_table(self):
            return self._w.table

        def pooled(self):
            return self._w.pooled

    from_meta = document_breakdown(*[Stats(w) for w in items], metrics=["mean_loss"])
    assert list(from_meta.drop_duplicates("doc")["document"]) == names


def test_models_on_other_windows_are_broken_down_unpaired_by_compare_itself():
    docs = np.repeat(np.arange(4), 3)
    loss = np.random.default_rng(4).normal(4, 0.2, 12)
    items = [_windows("prenorm", "prenorm", {"mean_loss": loss}, docs, tag="a"),
             _windows("full", "full", {"mean_loss": loss - 0.1}, docs, tag="b")]
    frame = document_breakdown(*items, metrics=["mean_loss"], n_resamples=100, loo_resamples=100)
    assert list(frame["doc"]) == [0, 1, 2, 3]
    np.testing.assert_allclose(frame["value"], -0.1, rtol=1e-9)
    rest = [Windows(w.name, w.residual, w.table[w.docs != 2].reset_index(drop=True), w.pooled) for w in items]
    assert frame.loc[2, "pooled_without"] == pytest.approx(_compare_rows(rest, 100).loc[("full", "mean_loss"), "estimate"])


def test_the_page_table_marks_the_documents_that_change_a_verdict():
    effect = -0.2 + np.linspace(-0.03, 0.03, D)
    effect[5] = 3.0
    frame = document_breakdown(*_pair(effect), documents=[f"doc{i}.txt" for i in range(D)])
    table = document_table(frame, metrics=["mean_loss"])
    assert [c["model"] for c in table["columns"]] == ["full"] and table["changing"] == 1
    first = table["rows"][0]  # documents that change a verdict come first
    assert first["document"] == "doc5.txt" and first["cells"][0]["mark"] == table["mark"]
    assert first["cells"][0]["text"] == "+3" and "consistent" in first["cells"][0]["title"]
    assert all(not c["mark"] for r in table["rows"][1:] for c in r["cells"])
    assert table["all"][0]["verdict"] == "inconclusive" and len(table["rows"]) == D and table["hidden"] == 0
    short = document_table(frame, metrics=["mean_loss"], max_rows=3)
    assert len(short["rows"]) == 3 and short["hidden"] == D - 3 and short["rows"][0]["doc"] == 5
