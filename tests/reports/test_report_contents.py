"""build_report: one self-contained HTML file holding every section of the study."""

from __future__ import annotations

import json
import re

import numpy as np
import plotly.offline
import pytest

from attnres_probe import DepthTrace, metrics
from attnres_probe.io import sha256_file
from attnres_probe.reports import SECTIONS, build_report, record_checkpoints, record_text, versions

from helpers import tiny_model
from report_text import XSS_TEXT


def _plot_specs(soup) -> dict[str, dict]:
    """{div id: figure JSON} of every chart in the page."""
    out = {}
    for div in soup.select("div.plot[data-figure]"):
        out[div["id"]] = json.loads(soup.find("script", id=div["data-figure"]).string)
    return out


def _array(value) -> np.ndarray:
    """A figure JSON array: a plain list, or plotly's base64 typed array {"dtype", "bdata", "shape"}."""
    if isinstance(value, dict):
        import base64

        shape = [int(x) for x in str(value.get("shape", "-1")).split(",")]
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).reshape(shape).astype(float)
    return np.asarray(value, dtype=float)


def test_report_parses_as_html_and_has_every_section(soup):
    ids = [s.get("id") for s in soup.find_all("section")]
    shown = {k: v for k, v in SECTIONS.items() if k != "over-training"}  # the fixture has no training history
    assert ids == list(shown)  # ablation included: the fixture report has ablation results
    assert [a["href"] for a in soup.find("nav").find_all("a")] == [f"#{k}" for k in shown]
    for sid, heading in shown.items():
        assert soup.find("section", id=sid).find("h2").get_text() == heading
    assert soup.title.get_text() == 'Study <b>"bold"</b> & co'


def test_report_without_ablations_has_no_ablation_section(traces, tmp_path):
    path = build_report(traces, tmp_path / "r.html")
    assert 'id="ablation"' not in path.read_text()


def test_plotlyjs_is_embedded_once_and_no_figure_carries_its_own_copy(report_html, soup):
    js = plotly.offline.get_plotlyjs()
    assert report_html.count(js) == 1
    assert report_html.count(js[:200]) == 1
    inline = [s for s in soup.find_all("script") if not s.get("src")]
    assert not soup.find_all("script", src=True)
    assert sum(len(s.string or "") > 1_000_000 for s in inline) == 1


def test_no_src_or_href_points_to_another_host(soup):
    for tag in soup.find_all(True):
        for attr in ("src", "href", "action", "data", "poster"):
            value = tag.get(attr)
            if value:
                assert not re.match(r"\s*(https?:)?//", value, re.I), f"<{tag.name} {attr}={value!r}>"


def test_plot_config_hides_the_logo_and_never_typesets_math(soup, report_html):
    config = json.loads(soup.find("script", id="plot-config").string)
    assert config["displaylogo"] is False
    assert "MathJax.Hub.Config" not in report_html and "mathjax" not in config


def test_models_table_names_architecture_parameters_and_hash(soup, traces):
    text = soup.find("section", id="models").get_text(" ")
    for t in traces:
        assert t.name in text
        assert f"{t.meta['n_params']:,}" in text
        assert t.meta["weights_sha256"] in text
    assert "PreNorm baseline" in text and "Full AttnRes" in text and "Block AttnRes" in text


def test_a_model_has_one_digest_on_every_page_the_weights_sha256(tmp_path, monkeypatch):
    """#35 item 6: a prompt report showed the file's sha256, a corpus report the weights' digest."""
    from attnres_probe.io import weights_sha256

    monkeypatch.delenv("ATTNRES_BACKEND", raising=False)  # auto: the Numba kernels on the CPU
    d = tmp_path / "full-run"
    model = tiny_model("full")
    model.save(d)
    (trace,) = record_checkpoints([d], "hello world", backward=False)
    assert trace.meta["weights_sha256"] == weights_sha256(type(model).load(d))
    assert "checkpoint_sha256" not in trace.meta and trace.name == "full-run"
    html = build_report([trace], tmp_path / "r.html").read_text()
    assert trace.meta["weights_sha256"] in html and "weights sha256 (fp32 state dict)" in html
    assert sha256_file(d / "model.safetensors") not in html
    provenance = html.replace("&#34;", '"')  # the provenance names what computed the depth mixing
    assert '"depth_mixing": {\n    "backend": "numba",\n    "schedule": null' in provenance


def test_hash_from_saved_trace_meta_survives_save_and_load(tmp_path):
    d = tmp_path / "ckpt"
    tiny_model("block").save(d)
    (trace,) = record_checkpoints([d], "abc def", backward=False)
    loaded = DepthTrace.load(trace.save(tmp_path / "trace"))
    html = build_report([loaded], tmp_path / "r.html").read_text()
    assert trace.meta["weights_sha256"] in html and "abc def" in html


def test_long_text_is_recorded_in_context_windows_as_one_batch(traces):
    t = traces[0]
    n = len(XSS_TEXT.encode())
    assert t.tokens.shape == (-(-n // 24), 24)
    assert t.n_tokens == n
    assert t.meta["windows"] == {"n_ctx": 24, "count": t.tokens.shape[0]}
    assert t.meta["text"] == XSS_TEXT


def test_text_section_shows_the_text_and_every_token(soup, traces):
    section = soup.find("section", id="text")
    assert section.find("pre").get_text() == XSS_TEXT
    chips = section.select("button.tok")
    assert len(chips) == traces[0].n_tokens
    assert [int(c["data-index"]) for c in chips] == list(range(len(chips)))
    assert chips[1].get_text() == "<"


def test_metric_table_matches_compare_against_the_baseline(soup, traces):
    frame = metrics.compare(*traces)
    table = soup.find("section", id="metrics").find("table", class_="metrics")
    header = [th.get_text() for th in table.find("tr").find_all("th")]
    assert header == ["metric", "unit", "prenorm", "full", "block", "full vs uniform", "block vs uniform", "full vs prenorm",
                      "block vs prenorm", "verdict: full vs uniform", "verdict: block vs uniform", "verdict: full vs prenorm",
                      "verdict: block vs prenorm"]
    rows = {tr["data-metric"]: tr for tr in table.select("tr[data-metric]")}
    assert set(rows) == set(frame["metric"])
    assert rows["mean_loss"].find("td")["title"] == metrics.FORMULAS["mean_loss"]
    for metric, tr in rows.items():  # no verdict where the paper states no direction
        want = [v for v in frame[(frame.metric == metric) & (frame.comparison != "value")]["verdict"] if v]
        assert [s.get_text() for s in tr.select("span.verdict")] == want
    loss = frame.query("metric == 'mean_loss' and comparison == 'value'")
    cells = [td.get_text() for td in rows["mean_loss"].find_all("td")[2:5]]
    assert [c.split(" ")[0] for c in cells] == [f"{v:.4g}" for v in loss["estimate"]]


def test_headline_panel_shows_compare_s_verdicts_and_says_why_there_is_no_interval(soup, traces):
    frame = metrics.compare(*traces)
    headline = soup.find(id="headline")
    assert [h.get_text() for h in headline.find_all("h3")] == ["Locality", "Embedding retention", "Gradient uniformity", "Magnitude growth"]
    want = []
    for card in headline.select("div.metric-card"):
        for name in card.select("div.metric-name"):
            m = name["data-metric"]
            want += [v for v in frame[(frame.metric == m) & (frame.comparison != "value")]["verdict"] if v]
    assert [s.get_text() for s in headline.select("span.verdict")] == want
    text = soup.find("section", id="metrics").get_text()
    assert "paper: lower than prenorm" in text and "The paper reports" in text


def test_heatmap_magnitude_and_gradient_charts_come_from_figures(soup, traces):
    specs = _plot_specs(soup)
    section_plots = {
        sid: [specs[d["id"]] for d in soup.find("section", id=sid).select("div.plot")] for sid in ("heatmaps", "magnitudes", "gradients")
    }
    weights, contrib, _difference = section_plots["heatmaps"]
    assert [d["type"] for d in weights["data"]] == ["heatmap"] * 3
    assert weights["layout"]["title"]["text"] == "depth weights: implied weight 1/k; depth weight α"
    assert contrib["layout"]["title"]["text"] == "contribution share c"
    (mags,) = section_plots["magnitudes"]
    assert mags["layout"]["title"]["text"] == "Magnitudes by depth" and len(mags["data"]) == 6
    (grads,) = section_plots["gradients"]
    assert grads["layout"]["title"]["text"] == "Gradient norms by depth"
    assert {d["name"] for d in grads["data"]} == {"prenorm", "full", "block"}


def test_report_shows_each_attnres_model_minus_the_baseline_on_a_scale_centred_on_zero(soup, traces, tmp_path):
    """#17 item 1 in the report: the difference view the dashboard has, with a caption saying what is subtracted."""
    from attnres_probe.numeric import token_mean

    section = soup.find("section", id="heatmaps")
    caption = section.find(id="difference").find_next("p").get_text(" ", strip=True)
    assert "full, block minus prenorm" in caption and "contribution share" in caption and "zero" in caption
    diff = _plot_specs(soup)[section.select("div.plot")[-1]["id"]]
    assert [d["type"] for d in diff["data"]] == ["heatmap"] * 2
    for d in diff["data"]:
        assert d["zmin"] == -d["zmax"] and d["zmid"] == 0 and d["colorscale"][0][1] != d["colorscale"][-1][1]
    base, full = traces[0], traces[1]
    want = token_mean(full.expanded("contrib")[0][full.mask]) - token_mean(base.expanded("contrib")[0][base.mask])
    np.testing.assert_allclose(_array(diff["data"][0]["z"]), want, atol=1e-5)
    assert "full − prenorm" in diff["layout"]["annotations"][0]["text"]
    one = build_report([traces[1]], tmp_path / "one.html")  # no baseline: no difference view
    assert 'id="difference"' not in one.read_text()


def test_explorer_offers_every_token_and_one_heatmap_per_model(soup, traces):
    section = soup.find("section", id="explorer")
    options = section.select("select.token option")
    assert len(options) == traces[0].n_tokens
    assert section.select_one("input.token")["max"] == str(traces[0].n_tokens - 1)
    assert len(section.select("div.plot")) == len(traces)
    data = json.loads(soup.find("script", id="explorer-0-json").string)
    assert [m["name"] for m in data["models"]] == ["prenorm", "full", "block"]
    # every model opens on its weights; PreNorm's are its implied weights 1/k (#35), not its shares
    assert [m["auto"] for m in data["models"]] == ["weights", "weights", "weights"]


def test_explorer_opens_on_the_informative_token_and_says_why(soup, traces):
    """#35: the explorer opened on token 0 (often the least informative); it now opens where the
    dashboard does, analysis.windows.informative_token, among the tokens with stored readings."""
    from attnres_probe.analysis.windows import informative_token

    data = json.loads(soup.find("script", id="explorer-0-json").string)
    section = soup.find("section", id="explorer")
    readings = [r for r in data["readings"] if r]
    limit = min(len(traces[0].str_tokens[0]), max((sum(t is not None for t in r["tokens"]) for r in readings), default=10**9))
    start, why = informative_token(traces, limit=limit)
    assert data["start"] == start > 0
    assert section.select_one("input.token")["value"] == str(start)
    assert section.select_one("p.opened-on").get_text() == why and f"Opened on token {start} " in why


def test_explorer_data_holds_each_tokens_cells_rounded(soup, traces):
    data = json.loads(soup.find("script", id="explorer-0-json").string)
    full = data["models"][1]
    k = len(traces[1].str_tokens[0]) + 3  # a token of the second window
    b, p = data["tokens"][k][:2]
    assert (b, p) == (1, 3)
    rows = full["cells"][k][0]  # weights, R rows without trailing NaN
    want = traces[1].depth_weights[1, 3]
    for r, row in enumerate(rows):
        np.testing.assert_allclose(row, want[r, : len(row)], rtol=1e-3)
        assert np.isnan(want[r, len(row) :]).all()


def test_explorer_stores_a_kind_the_same_at_every_token_once(soup, traces):
    """PreNorm's implied weights 1/k do not depend on the token: stored once ("fixed"), each token
    holding 0 in their place; its contribution shares, which do, stay per token."""
    data = json.loads(soup.find("script", id="explorer-0-json").string)
    names = [t.name for t in traces]
    pre = data["models"][names.index("prenorm")]
    assert all(cell[0] == 0 for cell in pre["cells"]) and pre["fixed"][0] is not None
    k = 1 / np.arange(1, pre["R"] + 1)
    for r, row in enumerate(pre["fixed"][0]):
        np.testing.assert_allclose(row, k[r], rtol=1e-3)
    assert pre["fixed"][2] is None and all(cell[2] != 0 for cell in pre["cells"])
    full = data["models"][names.index("full")]
    assert full["fixed"][0] is None and all(cell[0] != 0 for cell in full["cells"])


def test_explorer_tokens_caps_the_explorer_and_says_so(traces, tmp_path):
    html = build_report(traces, tmp_path / "r.html", explorer_tokens=5).read_text()
    assert "first 5 of" in html
    assert html.count("<option value=") == 5 + 4  # five tokens + the four value kinds


def test_ablation_section_has_a_chart_and_a_table_per_model(soup, ablations):
    section = soup.find("section", id="ablation")
    assert [h.get_text() for h in section.find_all("h3")] == list(ablations)
    tables = section.find_all("table")
    for table, frame in zip(tables, ablations.values()):
        assert len(table.find_all("tr")) == len(frame) + 1
    specs = _plot_specs(soup)
    chart = specs[section.select_one("div.plot")["id"]]
    assert "Ablation at read final" in chart["layout"]["title"]["text"]


def test_weight_effect_section_sets_each_models_weights_beside_their_loss_change(soup, weight_effects):
    """#31 item 3: per model (PreNorm too) the embedding's and the most recent source's weight in the deep
    reads beside the loss change of removing it, and the rank correlation, with units; one chart."""
    section = soup.find("section", id="weight-effect")
    rows = section.find("table", class_="weight-effect").find_all("tr")[1:]
    assert [r.find("td").get_text() for r in rows] == list(weight_effects)
    for tr, (name, frame) in zip(rows, weight_effects.items()):
        cells = [td.get_text() for td in tr.find_all("td")]
        assert cells[1] == str(len(frame))
        assert cells[2] == f"{frame['embed_weight'].mean():.3g}" and cells[4] == f"{frame['embed_delta'].mean():+.3g}"
        assert cells[3] == f"{frame['embed_uniform'].mean():.3g}" and cells[7] == f"{frame['recent_delta'].mean():+.3g}"
        if name == "prenorm":  # uniform weights: no rank correlation, and each weight is its uniform share
            assert cells[8].startswith("—") and cells[2] == cells[3] and cells[5] == cells[6]
    text = section.get_text(" ", strip=True)
    assert "nats per token" in text and "2606.13168" in text and "share under the uniform reference" in text
    assert f"the first {weight_effects['full'].attrs['n_tokens']} tokens" in text
    chart = _plot_specs(soup)[section.select_one("div.plot")["id"]]
    assert {t["name"] for t in chart["data"]} == {f"{n} · {s}" for n in weight_effects for s in ("embedding", "most recent source")}


def test_formulas_section_lists_every_metric_formula(soup):
    section = soup.find("section", id="formulas")
    terms = [dt.find("code").get_text() for dt in section.find_all("dt")]
    assert terms == list(metrics.FORMULAS)
    assert [dd.get_text() for dd in section.find_all("dd")] == list(metrics.FORMULAS.values())


def test_versions_of_toolkit_and_dependencies_are_recorded(soup):
    text = soup.find("section", id="reproduce").get_text(" ")
    v = versions()
    for name in ("attnres_probe", "torch", "transformer_lens", "numpy", "pandas", "plotly", "dash", "jinja2", "python"):
        assert name in v and v[name] != "not installed"
        assert name in text and v[name] in text


def test_build_report_rejects_an_empty_list(tmp_path):
    with pytest.raises(ValueError, match="at least one DepthTrace"):
        build_report([], tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_traces_of_different_texts_get_one_explorer_each(tmp_path):
    a = record_text(tiny_model("full"), "first text", name="a", backward=False)
    b = record_text(tiny_model("block"), "second, longer text", name="b", backward=False)
    html = build_report([a, b], tmp_path / "r.html").read_text()
    assert 'id="explorer-0"' in html and 'id="explorer-1"' in html


def test_every_metric_table_groups_rows_under_plain_names_not_snake_case_keys(soup):
    """#17 item 6: the table groups metrics under the headline comparisons and names them in words."""
    from attnres_probe.analysis.display import LABELS

    table = soup.find("section", id="metrics").find("table", class_="metrics")
    groups = [th.get_text() for th in table.select("tr.group th")]
    assert groups[:3] == ["Locality", "Embedding retention", "Gradient uniformity"]
    for tr in table.select("tr[data-metric]"):
        name = tr.find("td").get_text()
        assert name == LABELS[tr["data-metric"]] and "_" not in name



def test_a_one_model_report_promises_no_baseline_and_says_once_why_there_is_no_interval(tmp_path):
    """#16: the one-model intro spoke of a baseline ("…with a baseline.This text…") and every cell
    repeated "no interval: 1 window"."""
    from bs4 import BeautifulSoup

    trace = record_text(tiny_model("full"), "abc def", name="full")
    soup = BeautifulSoup(build_report([trace], tmp_path / "one.html").read_text(), "html.parser")
    section = soup.find("section", id="metrics")
    text = section.get_text(" ", strip=True)
    assert section.find("h2").get_text() == "Metrics"
    assert "set against the PreNorm baseline" not in text and "nothing is compared with a baseline" in text
    assert not re.search(r"[a-z]\.[A-Z]", section.find("p").get_text())  # every sentence followed by a space
    assert "one window per model, so there are no intervals" in text
    assert "no interval:" not in text and "PreNorm has unit coefficients" not in soup.get_text()


def test_locality_is_set_against_uniform_weights_on_the_same_sources_and_windows_of_one_text_are_one_document(soup):
    """#31: every model's normalised weights, each AttnRes model against the uniform weights on its own
    sources (no comparison of weights with shares remains); the fixture text spans several windows of
    one text: one document, no interval, said once."""
    section = soup.find("section", id="metrics")
    note = soup.find(id="basis-note").get_text()
    assert "normalised weights" in note and "uniform" in note and "same quantity" in note
    assert section.select(".caveat") == [] and "weights vs shares" not in soup.get_text()
    headline = soup.find(id="headline")
    assert {b.get_text() for b in headline.select(".basis")} == {"normalised weights", "contribution shares"}
    assert headline.select(".reference") and all(r.get_text().startswith("uniform: ") for r in headline.select(".reference"))
    assert "Only 1 document" in soup.find(id="few-documents").get_text()
    assert "no interval: 1 document" not in headline.get_text()


def test_the_pooled_only_reason_is_said_once_under_its_metric_not_in_every_cell(soup):
    """A text in several windows has one backward pass: parameter-gradient metrics are pooled values only.
    The headline cells carry a footnote mark and the reason stands once under that metric's table."""
    reason = "per-window values need one backward pass per window"
    headline = soup.find(id="headline")
    assert headline.get_text().count(reason) == 1
    name = headline.find("div", attrs={"data-metric": "param_grad_cv"})
    table = name.find_next("table")
    cells = [td for td in table.select("td.num")]
    assert cells and all(td.find("sup", class_="mark").get_text() == "†" for td in cells)
    assert reason not in table.get_text()
    footnote = table.find_next_sibling("p")
    assert "footnote" in footnote["class"] and footnote.get_text().startswith("† pooled value only") and reason in footnote.get_text()
    note = soup.find(id="pooled-note").get_text()  # the full table's "(pooled)" cells, said once under it
    assert note.startswith("(pooled):") and reason in note


def test_profile_charts_have_captions_solid_lines_and_the_corpus_page_s_names(soup, traces):
    """The magnitude and gradient charts say what their lines are; every line is solid (the legend shows solid
    lines); section, chart and axis titles use the words of the corpus report."""
    from attnres_probe import figures
    from attnres_probe.reports.builder import STATS_SECTIONS

    specs = _plot_specs(soup)
    for sid in ("magnitudes", "gradients"):
        section = soup.find("section", id=sid)
        caption = section.find("p", class_="caption").get_text(" ", strip=True)
        assert "One line per model" in caption and "log scale" in caption and "every token of the text" in caption
        (fig,) = [specs[d["id"]] for d in section.select("div.plot")]
        assert section.find("h2").get_text() == fig["layout"]["title"]["text"] == STATS_SECTIONS[sid]
        assert all(d.get("line", {}).get("dash") in (None, "solid") for d in fig["data"])
    grads = soup.find("section", id="gradients").get_text(" ")
    assert "‖∂L/∂h‖" in grads and "‖∂L/∂θ‖" in grads
    mags, grads_fig = figures.magnitudes(traces), figures.gradient_norms(traces)
    assert [mags.layout.yaxis.title.text, mags.layout.yaxis2.title.text] == ["rms(h) (log)", "rms(v) (log)"]
    assert [grads_fig.layout.yaxis.title.text, grads_fig.layout.yaxis2.title.text] == ["‖∂L/∂h‖ (log)", "‖∂L/∂θ‖ (log)"]
