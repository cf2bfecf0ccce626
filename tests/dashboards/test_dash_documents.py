"""#35 item 8: the corpus section says which documents drive the verdicts, with document_breakdown's numbers."""

from __future__ import annotations

import copy
import math

import pytest
from dash import html

from attnres_probe import metrics
from attnres_probe.analysis.documents import CHANGES_MARK, document_breakdown
from attnres_probe.dashboards import create_app

from dash_helpers import TEXT
from helpers import find_components


def _props(node) -> dict:
    return node.to_plotly_json()["props"]


def _texts(node) -> str:
    out: list[str] = []

    def walk(n):
        if isinstance(n, str):
            out.append(n)
        elif isinstance(n, (list, tuple)):
            for x in n:
                walk(x)
        elif hasattr(n, "children"):
            walk(n.children)

    walk(node)
    return "".join(out)


@pytest.fixture(scope="module")
def named_stats(corpus_stats) -> dict:
    """The fixture's stats as load_stats_dir gives them: the data's file names in meta (copies: the fixture is shared)."""
    out = {}
    for name, s in corpus_stats.items():
        c = copy.copy(s)
        c.meta = {**s.meta, "documents": [f"notes/{i:02d}.txt" for i in range(12)]}
        out[name] = c
    return out


def test_the_corpus_section_shows_which_documents_drive_the_verdicts_with_document_breakdown_s_numbers(models, named_stats):
    app = create_app(models, text=TEXT, stats=named_stats)
    corpus = find_components(app.layout, lambda n: getattr(n, "id", None) == "corpus")[0]
    heads = [_texts(h) for h in find_components(corpus, lambda n: isinstance(n, html.H3))]
    assert "Which documents drive the verdicts" in heads
    table = find_components(corpus, lambda n: getattr(n, "id", None) == "corpus-documents")[0]
    note = " ".join(_texts(p) for p in find_components(corpus, lambda n: isinstance(n, html.P)))
    assert "leave-one-document-out" in note and "its windows alone" in note and "1000 resamples" in note

    frame = document_breakdown(*named_stats.values(), names=list(named_stats))  # compare's resamples and seed
    rows = [r for r in find_components(table, lambda n: isinstance(n, html.Tr)) if "data-doc" in _props(r)]
    docs = [r for r in rows if _props(r)["data-doc"] != "all"]
    assert len(docs) == 12  # every document of the fixture (twelve: under the table's limit)
    names = {_texts(r.children[0]) for r in docs}
    assert names == {f"notes/{i:02d}.txt" for i in range(12)}
    checked = 0
    for r in docs:
        doc = int(_props(r)["data-doc"])
        for td in r.children[2:]:
            p = _props(td)
            want = frame[(frame.doc == doc) & (frame.metric == p["data-metric"]) & (frame.model == p["data-model"])].iloc[0]
            assert float(p["data-value"]) == want["value"] or (math.isnan(want["value"]) and p["data-value"] == "nan")
            assert (p["data-changes"] == "true") == bool(want["changes_verdict"])
            assert _texts(td).endswith(CHANGES_MARK) == bool(want["changes_verdict"])
            assert want["verdict_without"] in p["title"] and want["document"] in p["title"]
            checked += 1
    shown = {(c["data-metric"], c["data-model"]) for c in (_props(td) for r in docs for td in r.children[2:])}
    assert {m for m, _ in shown} == {"locality_distance", "locality_recent_mass", "embed_weight_deep", "embed_contrib_deep",
                                     "act_grad_cv", "param_grad_cv", "rms_out_growth"}
    assert {m for _, m in shown} == {"full", "block"} and checked == 12 * len(shown)
    # the last row: every document together, with the verdicts the corpus comparisons give
    every = next(r for r in rows if _props(r)["data-doc"] == "all")
    compared = metrics.compare(*named_stats.values(), names=list(named_stats))
    for td in every.children[1:]:
        p = _props(td)
        want = compared[(compared.metric == p["data-metric"]) & (compared.model == p["data-model"])
                        & (compared.comparison != "value")].iloc[0]
        assert float(p["data-value"]) == pytest.approx(want["estimate"], rel=1e-12)
        badge = find_components(td, lambda n: isinstance(n, html.Span) and "verdict" in (n.className or ""))[0]
        assert badge.children == want["verdict"]


def test_without_stats_or_comparisons_there_is_no_documents_table(models, corpus_stats):
    plain = create_app(models, text=TEXT)
    assert not find_components(plain.layout, lambda n: getattr(n, "id", None) == "corpus-documents")
    alone = create_app({"prenorm": models["prenorm"]}, text=TEXT, stats={"prenorm": corpus_stats["prenorm"]})
    assert not find_components(alone.layout, lambda n: getattr(n, "id", None) == "corpus-documents")


@pytest.mark.browser
def test_the_browser_shows_the_documents_table_with_its_marks(dash_duo, models, named_stats):
    app = create_app(models, text=TEXT, stats=named_stats)
    dash_duo.start_server(app)
    dash_duo.wait_for_element("#corpus-documents tbody tr", timeout=30)
    frame = document_breakdown(*named_stats.values(), names=list(named_stats))
    cells = dash_duo.driver.execute_script(
        "return Array.from(document.querySelectorAll('#corpus-documents td[data-changes]'), (td) => "
        "[td.closest('tr').dataset.doc, td.dataset.metric, td.dataset.model, td.dataset.value, td.dataset.changes, "
        "td.textContent]);")
    assert len(cells) == 12 * 14
    for doc, metric, model, value, changes, text in cells:
        want = frame[(frame.doc == int(doc)) & (frame.metric == metric) & (frame.model == model)].iloc[0]
        assert float(value) == want["value"] or (math.isnan(want["value"]) and value == "nan")
        assert (changes == "true") == bool(want["changes_verdict"])
        assert text.endswith(CHANGES_MARK) == bool(want["changes_verdict"])
    assert "notes/00.txt" in dash_duo.find_element("#corpus-documents").text
    assert dash_duo.get_logs() == []
