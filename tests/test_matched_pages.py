"""#31 on every page: a model forced to route uniformly gets no routing verdict against PreNorm, and
one with strongly local weights gets consistent locality verdicts, in ``metrics.compare`` (see
test_analysis.py), the dashboard's corpus panel and the corpus report; every number's unit and
reference is shown beside it (the catalog's)."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup
from dash import html

from attnres_probe import Probe, metrics
from attnres_probe.analysis.catalog import CATALOG, routing_names
from attnres_probe.dashboards import create_app
from attnres_probe.reports.builder import render_stats_report

from helpers import find_components, local_routing, route, tiny_model, uniform_routing

ROUTING = set(routing_names())
# several documents (the bootstrap resamples documents): each a different text, two windows each
DOCUMENTS = ["".join(chr(32 + (i * 7 + j * (i + 3)) % 90) for j in range(80)) for i in range(8)]


_route, _uniform, _local = route, uniform_routing, local_routing


def _stats(residual: str, route=None) -> dict:
    base = tiny_model("prenorm", n_layers=3, n_ctx=40)
    model = tiny_model(residual, n_layers=3, n_ctx=40)
    if route is not None:
        _route(model, route)
    return {name: Probe(m, name=name).run_corpus(DOCUMENTS, backward=True, progress=False)
            for name, m in (("prenorm", base), (residual, model))}


@pytest.fixture(scope="module", params=["full", "block"])
def uniform_stats(request):
    return request.param, _stats(request.param, _uniform)


@pytest.fixture(scope="module")
def local_stats():
    return _stats("full", _local)


_find = find_components


def _dash_verdicts(stats) -> dict[str, list[str]]:
    """metric -> the verdict badges the dashboard's corpus headline panel shows under it."""
    app = create_app({n: tiny_model(n, n_layers=3, n_ctx=40) for n in stats}, text="abc", stats=stats)
    panel = _find(app.layout, lambda n: getattr(n, "id", None) == "corpus-headline")[0]
    out = {}
    for block in _find(panel, lambda n: getattr(n, "className", None) == "metric-block"):
        metric = _find(block, lambda n: getattr(n, "className", None) == "metric-name")[0].to_plotly_json()["props"]["data-metric"]
        out[metric] = [b.children for b in _find(block, lambda n: isinstance(n, html.Span) and "verdict" in (n.className or ""))]
    return out


def _report_verdicts(stats) -> tuple[dict[str, list[str]], BeautifulSoup]:
    soup = BeautifulSoup(render_stats_report(stats, n_resamples=300), "html.parser")
    out = {tr["data-metric"]: [s.get_text() for s in tr.select("span.verdict")]
           for tr in soup.find("table", class_="metrics").select("tr[data-metric]")}
    return out, soup


def test_uniform_routing_gets_no_routing_verdict_on_any_page(uniform_stats):
    residual, stats = uniform_stats
    frame = metrics.compare(*stats.values(), names=list(stats), n_resamples=300)
    values = frame[(frame.model == residual) & (frame.comparison == "value") & frame.metric.isin(ROUTING)]
    assert len(values) == len(ROUTING)
    for _, row in values.iterrows():  # its routing numbers equal the uniform reference
        assert row["estimate"] == pytest.approx(row["reference"], rel=1e-5, abs=1e-6), row["metric"]
    decided = {"consistent", "contrary"}
    report, _ = _report_verdicts(stats)
    dash = _dash_verdicts(stats)
    for m in ROUTING:
        assert not decided & set(report.get(m, [])), ("report", m, report.get(m))
        assert not decided & set(dash.get(m, [])), ("dashboard", m, dash.get(m))
    assert any(report.get(m) for m in ROUTING) and any(dash.get(m) for m in ROUTING)  # shown, just undecided


def test_strongly_local_routing_is_consistent_on_every_page(local_stats):
    report, _ = _report_verdicts(local_stats)
    dash = _dash_verdicts(local_stats)
    for m in ("locality_distance", "locality_recent_mass"):
        assert report[m] == ["consistent"], m
        assert dash[m] == ["consistent"], m


def test_every_number_on_the_corpus_pages_has_its_unit_and_reference_beside_it(local_stats):
    _, soup = _report_verdicts(local_stats)
    table = soup.find("table", class_="metrics")
    assert [th.get_text() for th in table.find("tr").find_all("th")][:2] == ["metric", "unit"]
    for tr in table.select("tr[data-metric]"):
        unit = tr.find("td", class_="unit")
        d = CATALOG[tr["data-metric"]]
        assert unit.get_text() == d.unit and d.compare in unit["title"]
    for name in soup.find(id="headline").select("div.metric-name"):
        d = CATALOG[name["data-metric"]]
        line = name.find_next_sibling("div", class_="metric-unit").get_text()
        assert d.unit in line and ("uniform weights" in line) == (d.reference == "uniform")
    app = create_app({n: tiny_model(n, n_layers=3, n_ctx=40) for n in local_stats}, text="abc", stats=local_stats)
    panel = _find(app.layout, lambda n: getattr(n, "id", None) == "corpus-headline")[0]
    for block in _find(panel, lambda n: getattr(n, "className", None) == "metric-block"):
        metric = _find(block, lambda n: getattr(n, "className", None) == "metric-name")[0].to_plotly_json()["props"]["data-metric"]
        unit = _find(block, lambda n: "metric-unit" in (getattr(n, "className", None) or ""))
        assert unit and CATALOG[metric].unit in unit[0].children


def test_a_diagnostic_added_to_the_catalog_shows_everywhere():
    """#31 item 1: one entry and one function; compare, comparison.csv's frame, corpus stats, the
    dashboard, the report, the verdicts and the study's findings all pick it up."""
    import numpy as np

    from attnres_probe import study
    from attnres_probe.analysis import catalog
    from attnres_probe.analysis.display import LABELS
    from attnres_probe.analysis.verdicts import EXPECTED
    from attnres_probe.analysis.windows import WINDOW_COLUMNS, reference_column
    from attnres_probe.dashboards.callbacks import metric_table

    name = "embed_weight_all_reads"
    d = catalog.Diagnostic(name, "embedding", "embedding weight, every read", "the embedding's normalised weight",
                           "fraction of the read (0-1)", "w_0 at every read; mean over reads, then tokens", "uniform",
                           "difference", "higher", "(a test diagnostic)", pooling="tokens")
    catalog.register(d, lambda w, ctx: np.nanmean(w[..., 0], axis=-1))
    try:
        stats = _stats("full")
        assert name in stats["full"].window_table().columns and reference_column(name) in WINDOW_COLUMNS
        frame = metrics.compare(*stats.values(), names=list(stats), n_resamples=100)
        rows = frame[frame.metric == name]
        assert set(rows["comparison"]) == {"value", "difference"}
        comp = rows[rows.comparison != "value"].iloc[0]
        assert comp["baseline"] == "uniform" and comp["verdict"] in ("consistent", "contrary", "inconclusive")
        full = rows[(rows.comparison == "value") & (rows.model == "full")].iloc[0]
        w0 = stats["full"].window_table()[name]
        assert full["estimate"] == pytest.approx(w0.mean(), rel=1e-6)  # the windows' mean
        report, soup = _report_verdicts(stats)
        assert name in report and soup.find("tr", attrs={"data-metric": name}).find("td").get_text() == LABELS[name]
        table = metric_table(frame)
        assert _find(table, lambda n: isinstance(n, html.Tr) and n.to_plotly_json()["props"].get("data-metric") == name)
        assert name in EXPECTED and any(f.metric == name for f in study.FINDINGS)
    finally:
        catalog.unregister(name)
    assert name not in WINDOW_COLUMNS and name not in LABELS and not any(f.metric == name for f in study.FINDINGS)
