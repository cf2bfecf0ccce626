"""#35 item 1 in a real headless Chromium at 1400x1000: the first screen answers "what am I looking
at" and "what should I conclude" without scrolling: every model's routing of the selected token
(the whole reads x sources plot), the headline comparisons (estimate, interval, reference, verdict),
an informative opening token (not the first byte), and PreNorm's implied weights instead of blank text."""

from __future__ import annotations

import numpy as np
import pytest

from attnres_probe.dashboards import create_app
from attnres_probe.dashboards.callbacks import informative_token
from attnres_probe.seed_study import demo_summary

from dash_helpers import make_model
from helpers import BOXES
from test_dash_browser import as_array, figure, wait_for_title

pytestmark = pytest.mark.browser

TEXT96 = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 3)[:96]
# the shape of results.json's primaries (seed_study.demo_summary keeps these keys)
STUDY = {
    "plan": "docs/study/plan-v3.md", "command": "attnres-probe study", "seeds": [0, 1, 2], "missing": [], "level": 0.95,
    "primaries": [
        {"key": "P1", "title": "validation loss, Block", "model": "block", "against": "baseline", "unit": "nats per byte",
         "expected": "lower", "per_seed": {"0": -0.03, "1": -0.02, "2": -0.01}, "mean": -0.02, "low": -0.045,
         "high": 0.005, "p": 0.1, "p_holm": 0.3, "paper_way": 3, "n": 3, "sign_p": 0.25, "verdict": "inconclusive"},
        {"key": "P3", "title": "locality, Full", "model": "full", "against": "uniform", "unit": "sublayers back",
         "expected": "lower", "per_seed": {"0": -0.6, "1": -0.7, "2": -0.5}, "mean": -0.6, "low": -0.85,
         "high": -0.35, "p": 0.01, "p_holm": 0.03, "paper_way": 3, "n": 3, "sign_p": 0.25, "verdict": "consistent"},
    ],
}


@pytest.fixture(scope="module")
def models8():
    """Three 8-layer models (17 reads, as the demo models): the tallest heatmap a first screen must hold."""
    return {r: make_model(r, n_layers=8, n_ctx=128, scale=1.5) for r in ("prenorm", "full", "block")}


def _open(dash_duo, app) -> int:
    """Start ``app`` at 1400x1000 and wait for the opening token's panels; return that token."""
    dash_duo.driver.set_window_size(1400, 1000)
    dash_duo.start_server(app)
    ex = app.explorer
    pos, _ = informative_token(ex.result(ex.initial.key).traces.values())
    for i in range(len(ex.names)):
        wait_for_title(dash_duo, f"token-graph-{i}", f"token {pos} ", timeout=40)
    dash_duo.driver.execute_script("window.scrollTo(0, 0)")
    return pos


def _in_view(dash_duo, selector: str) -> list[dict]:
    height = dash_duo.driver.execute_script("return window.innerHeight")
    width = dash_duo.driver.execute_script("return window.innerWidth")
    boxes = dash_duo.driver.execute_script(BOXES, selector)
    assert boxes, f"nothing matches {selector}"
    return [b for b in boxes if not (0 <= b["y0"] and b["y1"] <= height + 0.5 and 0 <= b["x0"] and b["x1"] <= width + 0.5)]


def test_the_first_screen_holds_every_models_routing_and_the_headline(dash_duo, models8):
    """The first screen of the 8-layer models at 96 tokens; then, on the same page, #35 item 4: the token
    axis of "one source at every token" carries positions, a box marks the selected token's column and
    follows a click; the 17 source labels of a token panel do not touch."""
    from dash.testing.wait import until

    app = create_app(models8, text=TEXT96)
    pos = _open(dash_duo, app)
    assert pos != 0  # the first byte has no context: never the opening token when AttnRes models route
    # every model's whole plot area (all 17 reads x every source), in view without scrolling
    for i in range(3):
        assert _in_view(dash_duo, f"#token-graph-{i} .nsewdrag") == [], (f"model {i} below the fold", _shot(dash_duo))
    # the headline comparisons of this text: one row per headline metric, each AttnRes model's estimate,
    # the reference it is set against, and a verdict; all in view
    dash_duo.wait_for_element("#glance tbody tr", timeout=30)
    assert _in_view(dash_duo, "#glance tr") == [] and _inside(dash_duo, "#glance tr", ".glance-headline"), _shot(dash_duo)
    rows = dash_duo.driver.execute_script(
        "return Array.from(document.querySelectorAll('#glance tbody tr'), (tr) => Array.from(tr.cells, (c) => c.textContent))")
    assert len(rows) == 7
    for cells in rows:
        against, full, block = cells[1], cells[2], cells[3]
        assert against.endswith(("than uniform", "than prenorm"))  # the reference, with the paper's direction
        for cell in (full, block):
            assert any(ch.isdigit() for ch in cell) and "[" not in cell  # one text, one window: no interval
            assert any(v in cell for v in ("consistent", "contrary", "inconclusive"))
    assert "without intervals" in dash_duo.find_element("#glance-section").text  # said once, above the table
    # the strip says which token was opened and why
    note = dash_duo.find_element("#token-strip-note").text
    assert f"Opened on token {pos} " in note and "total-variation" in note
    assert "selected" in dash_duo.find_element(f"#token-strip button:nth-child({pos + 1})").get_attribute("class")
    # PreNorm's panel draws its implied weights (1/k), with no blank-panel note
    fig = figure(dash_duo, "token-graph-0")
    z = as_array(fig["z"])
    assert "implied weight 1/k" in fig["title"]
    rows = ~np.isnan(z).all(1)
    assert rows.all() and np.abs(np.nansum(z, 1) - 1).max() < 1e-9  # each read's implied weights sum to one
    assert dash_duo.driver.execute_script(BOXES, "#token-graph-0 .annotation-text-g text") == []
    _shot(dash_duo, "first_screen_text.png")
    # #35 item 4 (the page as opened, before any click): the one-source view's token axis and selection box
    wait_for_title(dash_duo, "source-graph-1", "at every token", timeout=30)

    def marked():
        return dash_duo.driver.execute_script(
            "const gd = document.querySelector('#source-graph-1 .js-plotly-plot');"
            "return (gd.layout.shapes || []).filter(s => s.name === 'selected-token').map(s => (s.x0 + s.x1) / 2);")

    until(lambda: marked() == [pos], timeout=20)
    ticks = dash_duo.driver.execute_script(BOXES, "#source-graph-1 .xtick text")
    assert ticks and all(t["text"].split(" ")[0].isdigit() or t["text"][:1].isdigit() for t in ticks)  # "20" over "a"
    dash_duo.find_element("#token-strip button:nth-child(4)").click()  # token 3
    until(lambda: marked() == [3], timeout=20)
    for i in range(3):
        labels = dash_duo.driver.execute_script(BOXES, f"#token-graph-{i} .xtick text")
        for a, b in zip(labels, labels[1:]):
            assert a["x1"] <= b["x0"] + 0.5 or b["x1"] <= a["x0"] + 0.5, (i, a["text"], b["text"])


def test_the_demo_first_screen_leads_with_the_studys_seeds(dash_duo, models8):
    """With a study summary (as beside the demo models), the headline is the pre-registered endpoints over
    seeds: mean, interval, reference, Holm's p and verdict, in view."""
    assert set(STUDY["primaries"][0]) >= set(demo_summary({"plan": "", "command": "", "seeds": [], "missing": [],
                                                           "level": 0.95, "primaries": [STUDY["primaries"][0]]})["primaries"][0])
    app = create_app(models8, text=TEXT96, study=STUDY)
    _open(dash_duo, app)
    assert _in_view(dash_duo, "#glance tr") == [] and _inside(dash_duo, "#glance tr", ".glance-headline"), _shot(dash_duo)
    for i in range(3):
        assert _in_view(dash_duo, f"#token-graph-{i} .nsewdrag") == []
    text = dash_duo.find_element("#glance").text
    assert "P1 validation loss, Block" in text and "vs PreNorm" in text and "vs uniform" in text
    assert "-0.02" in text and "[-0.045, +0.005]" in text and "nats per byte" in text
    assert "consistent" in text and "inconclusive" in text and "0.03" in text
    assert "What 3 training seeds show" in dash_duo.find_element("#glance-section").text
    _shot(dash_duo, "first_screen_study.png")


def _inside(dash_duo, selector: str, container: str) -> bool:
    """Every ``selector`` box lies within ``container``'s box (nothing hidden behind a scroll bar)."""
    (box,) = dash_duo.driver.execute_script(BOXES, container)
    return all(b["x0"] >= box["x0"] - 0.5 and b["x1"] <= box["x1"] + 0.5 for b in dash_duo.driver.execute_script(BOXES, selector))


def _shot(dash_duo, name: str = "first_screen_failed.png") -> str:
    """Where a failing screen was saved ($ATTNRES_SCREENSHOTS), for the assertion message."""
    import os

    folder = os.environ.get("ATTNRES_SCREENSHOTS")
    if not folder:
        return "set ATTNRES_SCREENSHOTS=DIR to keep a screenshot"
    path = os.path.join(folder, name)
    dash_duo.driver.save_screenshot(path)
    return path


def test_a_link_opens_its_view_and_the_address_bar_follows_the_view(dash_duo, app):
    """#35 item 8: the state in the URL (token, colour, views, text) opens the same view elsewhere, and
    the address bar follows each change; the jump box finds a token by position or text."""
    from dash.testing.wait import until
    from selenium.webdriver.common.keys import Keys

    dash_duo.start_server(app, navigate=False)  # the first page this test opens is the link's
    base = dash_duo.server.url
    text = "Routing, then depth."
    dash_duo.driver.get(base + "/?token=4&kind=contrib&view=diff&text=" + text.replace(" ", "%20"))
    wait_for_title(dash_duo, "token-graph-1", "token 4 'i'", timeout=40)
    assert "contribution share" in figure(dash_duo, "token-graph-1")["title"]
    assert " − prenorm" in figure(dash_duo, "token-graph-1")["title"]  # the difference view, as the link asked
    assert dash_duo.find_element("#prompt").get_attribute("value") == text
    assert "as the link asked" in dash_duo.find_element("#token-strip-note").text
    dash_duo.find_element("#token-strip button:nth-child(7)").click()  # token 6
    until(lambda: "token=6&" in dash_duo.driver.current_url, timeout=20)
    assert "kind=contrib" in dash_duo.driver.current_url and "text=Routing%2C%20then%20depth." in dash_duo.driver.current_url
    # the address, opened afresh, shows the same token
    dash_duo.driver.get(dash_duo.driver.current_url)
    wait_for_title(dash_duo, "token-graph-1", f"token 6 {text[6]!r}", timeout=40)
    box = dash_duo.find_element("#token-jump")
    box.send_keys("-1", Keys.ENTER)
    wait_for_title(dash_duo, "token-graph-1", f"token {len(text) - 1} ", timeout=20)
    dash_duo.clear_input(box)
    box.send_keys("depth", Keys.ENTER)
    wait_for_title(dash_duo, "token-graph-1", f"token {text.index('depth')} 'd'", timeout=20)
    assert dash_duo.get_logs() == []
