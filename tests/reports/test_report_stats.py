"""``report --stats``: the corpus report shows compare's estimates, intervals and verdicts, opened from file://."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup

from attnres_probe import Probe, metrics
from attnres_probe.cli import main
from attnres_probe.reports.builder import build_stats_report

DOCS = ["The cat sat on the mat, and then the dog sat on the log.", "Depth routing, window by window.",
        "def f(x):\n    return x + 1\n", "A fourth and longer document, long enough for two windows."] * 2


@pytest.fixture(scope="module")
def corpus_stats(tiny_models):
    return {r: Probe(m, name=r).run_corpus(DOCS, backward=True, progress=False) for r, m in tiny_models.items()}


@pytest.fixture(scope="module")
def stats_report(corpus_stats, tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "corpus.html"
    build_stats_report(corpus_stats, path, title="corpus <b>report</b>", n_resamples=400, seed=3)
    return path


@pytest.fixture(scope="module")
def stats_soup(stats_report):
    return BeautifulSoup(stats_report.read_text(encoding="utf-8"), "html.parser")


def _expected(frame, metric_names):
    out = []
    for m in metric_names:
        out += [v for v in frame[(frame.metric == m) & (frame.comparison != "value")]["verdict"] if v]  # none without a direction
    return out


def test_corpus_report_shows_compare_s_verdicts_and_intervals(stats_soup, corpus_stats):
    frame = metrics.compare(*corpus_stats.values(), names=list(corpus_stats), n_resamples=400, seed=3)
    headline = stats_soup.find(id="headline")
    shown = [m["data-metric"] for m in headline.select("div.metric-name")]
    assert [s.get_text() for s in headline.select("span.verdict")] == _expected(frame, shown)
    table = stats_soup.find("table", class_="metrics")
    for tr in table.select("tr[data-metric]"):  # group rows (plain names) hold no metric
        assert [s.get_text() for s in tr.select("span.verdict")] == _expected(frame, [tr["data-metric"]])
    text = headline.get_text()
    assert "95% CI [" in text and "windows" in text and "paper: lower than prenorm" in text
    assert stats_soup.find("section", id="explorer") is None and stats_soup.find("section", id="text") is None
    assert stats_soup.find("h1").get_text() == "corpus <b>report</b>"  # escaped, not markup


def test_report_stats_from_the_command_line_and_its_refusals(tmp_path, capsys, corpus_stats):
    assert main(["report", "--stats", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 2
    assert "not a folder written by `attnres-probe corpus`" in capsys.readouterr().err
    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    for name, st in corpus_stats.items():
        st.save(run / "models" / name)
    manifest = {"schema_version": 1, "complete": False,
                "models": [{"name": n, "source": "demo:" + n, "dir": f"models/{n}", "complete": n != "block"} for n in corpus_stats]}
    (run / "corpus.json").write_text(__import__("json").dumps(manifest))
    assert main(["report", "--stats", str(run), "--out", str(tmp_path / "r.html")]) == 2
    assert "the corpus run is unfinished (prenorm done, full done, block unfinished)" in capsys.readouterr().err
    manifest["complete"] = True
    (run / "corpus.json").write_text(__import__("json").dumps(manifest))
    assert main(["report", "--stats", str(run), "--resamples", "200", "--out", str(tmp_path / "r.html")]) == 0
    soup = BeautifulSoup((tmp_path / "r.html").read_text(encoding="utf-8"), "html.parser")
    assert len(soup.select("#headline span.verdict")) > 0


@pytest.mark.browser
def test_corpus_report_from_file_url_draws_and_shows_the_same_verdicts(stats_report, corpus_stats, chromium):
    driver = chromium(window=None)
    driver.get(stats_report.as_uri())
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    shown = driver.execute_script("return Array.from(document.querySelectorAll('#headline span.verdict'), s => s.textContent)")
    metric_names = driver.execute_script("return Array.from(document.querySelectorAll('#headline div.metric-name'), d => d.dataset.metric)")
    frame = metrics.compare(*corpus_stats.values(), names=list(corpus_stats), n_resamples=400, seed=3)
    assert shown == _expected(frame, metric_names)
    n_divs, n_drawn = driver.execute_script(
        "const d = document.querySelectorAll('div.plot'); return [d.length, Array.from(d).filter(x => x.querySelector('.main-svg')).length];")
    assert n_divs == n_drawn == 6  # three heatmaps, the difference from the baseline, two band charts


def test_corpus_report_warns_of_few_documents_and_names_what_each_side_measures(stats_soup):
    """#16: eight documents: intervals are rough, said once at the top; #31: locality set against the
    uniform weights on each model's own sources, the same quantity on both sides (no caveat)."""
    warning = stats_soup.find(id="few-documents").get_text()
    assert "Only 8 documents: intervals are rough" in warning
    assert "only 8 documents" not in stats_soup.find(id="headline").get_text()  # not in every cell
    note = stats_soup.find(id="basis-note").get_text()
    assert "normalised weights" in note and "uniform" in note and "same quantity" in note
    cards = {m["data-metric"]: m.find_next("table") for m in stats_soup.select("#headline div.metric-name")}
    assert cards["locality_distance"].select(".caveat") == [] and "vs uniform" in cards["locality_distance"].get_text()


def test_corpus_profiles_use_the_single_text_report_s_names_and_say_what_the_lines_are(stats_soup, corpus_stats):
    from attnres_probe import figures
    from attnres_probe.reports import SECTIONS

    for sid in ("magnitudes", "gradients"):
        section = stats_soup.find("section", id=sid)
        assert section.find("h2").get_text() == SECTIONS[sid]
        caption = section.find("p", class_="caption").get_text(" ", strip=True)
        assert "One line per model" in caption and "band" in caption and "log scale" in caption
    grads, mags = figures.gradient_bands(list(corpus_stats.values())), figures.magnitude_bands(list(corpus_stats.values()))
    assert [grads.layout.yaxis.title.text, grads.layout.yaxis2.title.text] == ["‖∂L/∂h‖ (log)", "‖∂L/∂θ‖ (log)"]
    assert [mags.layout.yaxis.title.text, mags.layout.yaxis2.title.text] == ["rms(h) (log)", "rms(v) (log)"]


@pytest.mark.browser
def test_corpus_headline_cards_sit_two_a_row_and_each_interval_on_one_line(stats_report, chromium):
    """At 1400 px the four headline cards sit two a row (three a row made "95% CI [a, b]" wrap over three lines
    and left the fourth card alone); every interval holds on one line."""
    driver = chromium()
    driver.get(stats_report.as_uri())
    cards = driver.execute_script(
        "return Array.from(document.querySelectorAll('#headline .metric-card'), c => {"
        "const r = c.getBoundingClientRect(); return [Math.round(r.left), Math.round(r.top), Math.round(r.width)]; });")
    assert len(cards) == 4
    assert len({left for left, _, _ in cards}) == 2 and len({top for _, top, _ in cards}) == 2
    assert min(w for _, _, w in cards) > 500
    spans = driver.execute_script(
        "return Array.from(document.querySelectorAll('#headline td span.note'), s => {"
        "const r = s.getBoundingClientRect(); return [s.textContent, r.height, "
        "parseFloat(getComputedStyle(s).lineHeight) || 1.2 * parseFloat(getComputedStyle(s).fontSize)]; });")
    intervals = [(t, h, lh) for t, h, lh in spans if t.startswith("95% CI")]
    assert intervals
    for text, height, line in intervals:
        assert height < 1.5 * line, (text, height, line)
