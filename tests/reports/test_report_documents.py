"""#35 item 8: the corpus report says which documents drive the verdicts, with document_breakdown's numbers."""

from __future__ import annotations

import math

import pytest
from bs4 import BeautifulSoup

from attnres_probe import Probe, metrics
from attnres_probe.analysis.documents import CHANGES_MARK, document_breakdown
from attnres_probe.reports.builder import render_report, render_stats_report

DOCS = ["The cat sat on the mat, and then the dog sat on the log.", "Depth routing, window by window.",
        "def f(x):\n    return x + 1\n", "A fourth and longer document, long enough for two windows."] * 2
FILES = [f"plays/<b>{i}</b>.txt" for i in range(len(DOCS))]  # names from corpus.json, shown as text


@pytest.fixture(scope="module")
def corpus_stats(tiny_models):
    return {r: Probe(m, name=r).run_corpus(DOCS, backward=True, progress=False) for r, m in tiny_models.items()}


def test_the_corpus_report_shows_which_documents_drive_the_verdicts(corpus_stats):
    manifest = {"data": {"path": "/data/plays", "kind": "folder", "documents": len(DOCS), "bytes": 10 * len(DOCS),
                         "sha256": "0" * 64, "files": [[f, 10, "0" * 64] for f in FILES]}}
    page = render_stats_report(corpus_stats, manifest=manifest, n_resamples=400, seed=3)
    soup = BeautifulSoup(page, "html.parser")
    section = soup.find("section", id="metrics")
    assert section.find("h3", id="documents").get_text() == "Which documents drive the verdicts"
    note = section.find("h3", id="documents").find_next_sibling("p").get_text()
    assert "leave-one-document-out" in note and "400 resamples" in note
    table = soup.find("table", class_="documents-table")
    frame = document_breakdown(*corpus_stats.values(), names=list(corpus_stats), documents=FILES, n_resamples=400, seed=3)
    rows = table.select("tr[data-doc]")
    docs = [r for r in rows if r["data-doc"] != "all"]
    assert [r.find("td").get_text() for r in docs] and {r.find("td").get_text() for r in docs} == set(FILES)
    assert "<b>" not in str(table).replace("&lt;b&gt;", "")  # escaped: the names are text
    n = 0
    for r in docs:
        for td in r.select("td[data-metric]"):
            want = frame[(frame.doc == int(r["data-doc"])) & (frame.metric == td["data-metric"])
                         & (frame.model == td["data-model"])].iloc[0]
            assert float(td["data-value"]) == want["value"] or (math.isnan(want["value"]) and td["data-value"] == "nan")
            assert (td["data-changes"] == "true") == bool(want["changes_verdict"])
            assert td.get_text().endswith(CHANGES_MARK) == bool(want["changes_verdict"])
            assert want["verdict_without"] in td["title"]
            n += 1
    assert n == len(DOCS) * 14  # seven headline comparisons, two AttnRes models
    compared = metrics.compare(*corpus_stats.values(), names=list(corpus_stats), n_resamples=400, seed=3)
    every = next(r for r in rows if r["data-doc"] == "all")
    for td in every.select("td[data-metric]"):
        want = compared[(compared.metric == td["data-metric"]) & (compared.model == td["data-model"])
                        & (compared.comparison != "value")].iloc[0]
        assert float(td["data-value"]) == pytest.approx(want["estimate"], rel=1e-12)
        assert td.select_one("span.verdict").get_text() == want["verdict"]


def test_a_report_of_one_text_has_no_documents_table(traces):
    assert 'class="metrics documents-table"' not in render_report(traces)
