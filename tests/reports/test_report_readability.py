"""#17 in the report, opened from file:// in headless Chromium at 96 tokens: PreNorm notes that name
the control and overlap nothing, signed shares, the logit decomposition and logit lens in the
per-token explorer, routing over training. A screenshot goes to $ATTNRES_SCREENSHOTS when set."""

from __future__ import annotations

import json
import os

import pytest

from attnres_probe.reports import build_report, record_text
from attnres_probe.reports.recording import record_readings

from helpers import BOXES, tiny_model

TEXT96 = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 3)[:96]
HISTORY = [{"step": s, "embed_weight": [0.5 - 0.01 * s] * 5, "recent_mass": [0.5] * 5, "entropy": [0.9] * 5,
            "rms_in": [1.0 + 0.01 * s] * 5, "act_grad_cv": 0.3} for s in (0, 10, 20)]


@pytest.fixture(scope="module")
def report96(tmp_path_factory):
    models = {r: tiny_model(r, n_ctx=128) for r in ("prenorm", "full", "block")}
    traces = [record_text(m, TEXT96, name=r) for r, m in models.items()]
    readings = {t.name: record_readings(models[t.name], t, n_tokens=8) for t in traces}
    path = tmp_path_factory.mktemp("report96") / "report.html"
    build_report(traces, path, readings=readings, histories={"prenorm": HISTORY, "full": HISTORY})
    return path


def test_report_holds_the_reading_views_and_routing_over_training(report96):
    html = report96.read_text()
    assert "Reading the residual stream at this token" in html and "logit lens" in html
    assert "Stored for the first 8 tokens" in html
    assert 'id="over-training"' in html and 'href="#over-training"' in html  # the navigation links to it
    assert "colour by: contribution share" in html and "kind=&#39;contrib&#39;" not in html and "kind='contrib'" not in html
    # #35: the mean-routing figure draws PreNorm's implied weights (1/k), not a blank panel with a note
    assert "implied weight 1/k" in html and "no routing to colour here" not in html


def test_a_report_of_saved_traces_says_it_holds_no_activations(tmp_path):
    trace = record_text(tiny_model("full"), "abc", name="full")
    html = build_report([trace], tmp_path / "r.html").read_text()
    assert "holds depth weights, not activations" in html


@pytest.mark.browser
def test_report_at_96_tokens_in_chromium(report96, chromium):
    driver = chromium()
    driver.get(report96.as_uri())
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    # item 3 (#35 since): PreNorm's panel of the mean heatmaps is drawn (its implied weights, which sum to one
    # in every read), and its subplot title, which says so, overlaps no other title or axis title
    heat = driver.execute_script("return document.querySelector('#heatmaps div.plot').id")
    z = driver.execute_script(f"return Array.from(document.getElementById('{heat}')._fullData[0].z, r => Array.from(r))")
    rows = [[v for v in row if v is not None and v == v] for row in z]
    assert all(abs(sum(r) - 1) < 1e-6 for r in rows if r)
    texts = driver.execute_script(BOXES, f"#{heat} .annotation text, #{heat} .xtitle, #{heat} .ytitle, #{heat} .gtitle")
    notes = [b for b in texts if "implied weight 1/k" in b["text"]]
    assert notes
    for n in notes:
        for o in texts:
            if o is n or o["text"] in n["text"]:
                continue
            assert not (n["x0"] < o["x1"] and o["x0"] < n["x1"] and n["y0"] < o["y1"] and o["y0"] < n["y1"]), (n, o)
    # item 13: choosing a token updates the logit decomposition and the lens
    reading = driver.execute_script("return Array.from(document.querySelectorAll('#explorer .grid.reading div.plot'), d => d.id)")
    assert len(reading) == 6
    driver.execute_script("const s = document.querySelector('#explorer select.token'); s.value = '5'; s.dispatchEvent(new Event('change'));")
    title = driver.execute_script(f"return document.getElementById('{reading[0]}').layout.title.text")
    assert "token 5" in title
    got = json.loads(driver.execute_script(f"return JSON.stringify(document.getElementById('{reading[1]}').data[0].text)"))
    assert all(all(cell for cell in row) for row in got)
    shot = os.environ.get("ATTNRES_SCREENSHOTS")
    if shot:
        for where in ("metrics", "heatmaps", "explorer", "over-training"):
            driver.execute_script(f"document.getElementById('{where}').scrollIntoView()")
            driver.save_screenshot(os.path.join(shot, f"report_96_{where}.png"))
        driver.execute_script("document.querySelector('#explorer .grid.reading').scrollIntoView()")
        driver.save_screenshot(os.path.join(shot, "report_96_reading.png"))


def test_logit_lens_labels_of_unprintable_tokens_are_explained_once(report96):
    from bs4 import BeautifulSoup

    from attnres_probe import figures

    soup = BeautifulSoup(report96.read_text(), "html.parser")
    notes = soup.select("#explorer p.vocab-note")
    assert [n.get_text() for n in notes] == [figures.VOCAB_ID_NOTE]
    assert "#N is token N" in figures.VOCAB_ID_NOTE and "no printable character" in figures.VOCAB_ID_NOTE
    assert notes[0].find_next("div", class_="grid") is soup.select_one("#explorer .grid.reading")


TITLE_GAP = """
return Array.from(document.querySelectorAll(arguments[0]), (div) => {
  const title = div.querySelector('.gtitle'), drag = div.querySelector('.nsewdrag');
  if (!title || !drag) return null;
  const svg = div.querySelector('.main-svg').getBoundingClientRect(), box = title.getBoundingClientRect();
  return [div.id, box.bottom, drag.getBoundingClientRect().top, title.textContent, box.top - svg.top];
}).filter((x) => x);
"""


@pytest.mark.browser
def test_per_token_titles_end_above_the_first_heatmap_row(report96, chromium):
    """The three-line titles of the explorer's heatmaps and reading charts stand in their own margin: the last
    line ends above the plot area and the first starts inside the figure, also after another token is chosen
    (which rewrites the titles)."""
    driver = chromium()
    driver.get(report96.as_uri())
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    for step in ("first token", "token 5"):
        try:  # plotly draws the figures after the page's load event: wait for all twelve titles
            boxes = WebDriverWait(driver, 20).until(lambda d: (b := d.execute_script(TITLE_GAP, "#explorer div.plot")) and len(b) == 12 and b)
        except TimeoutException:
            boxes = driver.execute_script(TITLE_GAP, "#explorer div.plot")
        # three heatmaps, three attention patterns, three logit decompositions, three logit lenses
        assert len(boxes) == 12, (step, boxes)
        for pid, bottom, top, text, below_edge in boxes:
            assert bottom + 4 <= top, (step, pid, text, bottom, top)  # above the plot
            assert below_edge >= 0, (step, pid, text, below_edge)  # and not cut by the figure's top edge
        driver.execute_script("const s = document.querySelector('#explorer select.token'); s.value = '5'; "
                              "s.dispatchEvent(new Event('change'));")


LOG_TICKS = """
return Array.from(document.querySelectorAll(arguments[0] + ' .yaxislayer-above'), (layer) =>
  Array.from(layer.querySelectorAll('g[class^="y"][class$="tick"] text'), (t) => [t.textContent, t.getBoundingClientRect().top]));
"""


@pytest.mark.browser
@pytest.mark.parametrize("low, high", [(0.2, 5.0), (0.004, 0.09), (0.03, 0.5)])
def test_log_axes_label_every_tick_with_its_full_number(tmp_path, chromium, low, high):
    """Plotly labels the ticks between powers of ten with one small digit ("2" for 0.2); the magnitude and
    gradient charts label them in full, so the labels read in increasing order up the axis."""
    import numpy as np

    trace = record_text(tiny_model("full", n_ctx=128), TEXT96, name="full")
    for name in ("rms_in", "rms_out", "grad_in", "param_grad"):  # every profile from low to high over depth
        arr = getattr(trace, name)
        arr[...] = np.geomspace(low, high, arr.shape[-1])
    path = build_report([trace], tmp_path / "r.html")
    driver = chromium()
    driver.get(path.as_uri())
    from selenium.webdriver.support.ui import WebDriverWait

    for sid in ("magnitudes", "gradients"):
        WebDriverWait(driver, 20).until(lambda d: all(any(t for t, _ in a) for a in d.execute_script(LOG_TICKS, f"#{sid}")))
        axes = driver.execute_script(LOG_TICKS, f"#{sid}")
        assert len(axes) == 2
        for ticks in axes:
            shown = [(float(t.replace("\u2212", "-")), y) for t, y in ticks if t]
            assert len(shown) >= 2, (sid, ticks)
            up = [v for v, _ in sorted(shown, key=lambda p: -p[1])]  # bottom to top
            assert up == sorted(up) and len(set(up)) == len(up), (sid, ticks)
            assert min(up) >= low / 2 and max(up) <= high * 2, (sid, ticks)
