"""#17 in a real headless Chromium: what a page shows at 96 tokens (signed colours, legible token
axes, uncut titles, PreNorm notes that do not overlap, a drawn info mark). A screenshot of the
page goes to $ATTNRES_SCREENSHOTS when that is set."""

from __future__ import annotations

import os
import re
import time

import pytest
from dash.testing.wait import until

from attnres_probe.dashboards import create_app

from dash_helpers import TEXT, make_model
from helpers import BOXES
from test_dash_browser import figure, opening_token, wait_for_title

pytestmark = pytest.mark.browser

N_TOKENS = 96
TEXT96 = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 3)[:N_TOKENS]

# colour of a value under a trace's colourscale, interpolated as plotly does (rgb, linear)
COLOR_AT = """
const gd = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');
const t = gd._fullData[0];
const v = arguments[1];
const f = Math.min(1, Math.max(0, (v - t.zmin) / (t.zmax - t.zmin)));
const cs = t.colorscale;
const rgb = (c) => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
for (let i = 1; i < cs.length; i++) {
  if (f <= cs[i][0]) {
    const a = rgb(cs[i - 1][1]), b = rgb(cs[i][1]);
    const w = (f - cs[i - 1][0]) / (cs[i][0] - cs[i - 1][0] || 1);
    return a.map((x, k) => Math.round(x + w * (b[k] - x)));
  }
}
return rgb(cs[cs.length - 1][1]);
"""


@pytest.fixture(scope="module")
def app96():
    return create_app({r: make_model(r, n_ctx=128, scale=1.5) for r in ("prenorm", "full", "block")}, text=TEXT96)


def _overlaps(boxes: list[dict], pad: float = 0.5) -> list[tuple[str, str]]:
    out = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a["x0"] < b["x1"] - pad and b["x0"] < a["x1"] - pad and a["y0"] < b["y1"] - pad and b["y0"] < a["y1"] - pad:
                out.append((a["text"], b["text"]))
    return out


def _start(dash_duo, app) -> None:
    dash_duo.start_server(app)
    dash_duo.wait_for_element("#token-strip button", timeout=30)
    pos = opening_token(app)
    for i in range(3):
        wait_for_title(dash_duo, f"token-graph-{i}", f"token {pos} ", timeout=30)
        wait_for_title(dash_duo, f"source-graph-{i}", "at every token", timeout=30)


def test_a_96_token_page_is_legible(dash_duo, app96):
    _start(dash_duo, app96)
    driver = dash_duo.driver
    shot = os.environ.get("ATTNRES_SCREENSHOTS")
    if shot:
        driver.set_window_size(1400, 1000)
        driver.execute_script("document.querySelector('#source-graph-0').scrollIntoView()")
        driver.save_screenshot(os.path.join(shot, "dashboard_96_source.png"))
        for i, where in enumerate(("#token-graph-0", "#reading", "#mean-graph-0", "#metric-cards")):
            driver.execute_script(f"document.querySelector('{where}').scrollIntoView()")
            driver.save_screenshot(os.path.join(shot, f"dashboard_96_{i}.png"))
        driver.execute_script("window.scrollTo(0, 0)")
    # item 2: token tick labels of every "one source at every token" panel do not overlap
    for i in range(3):
        ticks = driver.execute_script(BOXES, f"#source-graph-{i} .xtick text")
        assert 4 <= len(ticks) <= 20, len(ticks)
        assert _overlaps(ticks) == []
        title = driver.execute_script(BOXES, f"#source-graph-{i} .gtitle")
        panel = driver.execute_script(BOXES, f"#source-graph-{i} .main-svg")[0]
        assert title and all(panel["x0"] - 1 <= b["x0"] and b["x1"] <= panel["x1"] + 1 for b in title)  # never cut
    # item 3 (#35 since): PreNorm's weights panel draws its implied weights, so it carries no blank-panel note;
    # its logits panel (it has none) keeps the note, which overlaps neither axis title nor the title
    assert driver.execute_script(BOXES, "#token-graph-0 .annotation-text-g text, #token-graph-0 .annotation text") == []
    dash_duo.find_element("#kind input[value='logits']").click()
    until(lambda: driver.execute_script(BOXES, "#token-graph-0 .annotation-text-g text, #token-graph-0 .annotation text"),
          timeout=20)
    note = driver.execute_script(BOXES, "#token-graph-0 .annotation-text-g text, #token-graph-0 .annotation text")
    others = driver.execute_script(BOXES, "#token-graph-0 .ytitle, #token-graph-0 .xtitle, #token-graph-0 .gtitle")
    assert all(not _overlaps([n, o]) for n in note for o in others)
    text = " ".join(b["text"] for b in note)
    assert "colour by: contribution share" in text and "kind=" not in text
    # item 4: the info mark is drawn (a bordered box with a letter), not a glyph the fonts may lack
    assert dash_duo.driver.execute_script("return document.body.innerText.includes('ⓘ')") is False


def test_a_negative_share_is_coloured_differently_from_zero(dash_duo, app96):
    _start(dash_duo, app96)
    dash_duo.find_element("#kind input[value='contrib']").click()
    wait_for_title(dash_duo, "token-graph-1", "contribution share")
    fig = figure(dash_duo, "token-graph-1")
    assert fig is not None
    zero = dash_duo.driver.execute_script(COLOR_AT, "token-graph-1", 0.0)
    neg = dash_duo.driver.execute_script(COLOR_AT, "token-graph-1", -0.13)
    one = dash_duo.driver.execute_script(COLOR_AT, "token-graph-1", 1.0)
    assert neg != zero and one != zero
    assert neg[2] > neg[0]  # blue side for negative shares, red for positive
    shot = os.environ.get("ATTNRES_SCREENSHOTS")
    if shot:
        dash_duo.driver.save_screenshot(os.path.join(shot, "dashboard_96_contrib.png"))


def test_one_model_panel_is_not_stretched_across_the_page(dash_duo):
    """#17 item 5: with one model, a heatmap's panel keeps a bounded width instead of filling a 1400 px page."""
    dash_duo.driver.set_window_size(1400, 1000)
    dash_duo.start_server(create_app({"full": make_model("full")}, text=TEXT))
    wait_for_title(dash_duo, "token-graph-0", "token ", timeout=30)
    wait_for_title(dash_duo, "mean-graph-0", "mean over", timeout=30)
    page = driver_width(dash_duo, ".page")
    for view in ("token", "mean", "source"):
        slot = driver_width(dash_duo, f"#{view}-panel-0")
        plot = driver_width(dash_duo, f"#{view}-graph-0 .main-svg")
        assert page > 1100 and slot <= 761 and plot <= slot, (view, page, slot, plot)


def driver_width(dash_duo, selector: str) -> float:
    return dash_duo.driver.execute_script("return document.querySelector(arguments[0]).getBoundingClientRect().width", selector)


# hover label of a heatmap cell: Plotly's own hover at data coordinates (a category axis counts columns)
HOVER_JS = """
const gd = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');
Plotly.Fx.hover(gd, {xval: arguments[1], yval: arguments[2]});
const t = gd.querySelector('.hoverlayer .hovertext');
return t ? t.textContent : null;
"""
# a click on that cell, as Plotly's click handler emits it (the hovered points)
CLICK_JS = """
const gd = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');
Plotly.Fx.hover(gd, {xval: arguments[1], yval: arguments[2]});
gd.emit('plotly_click', {points: gd._hoverdata, event: {}});
"""


def test_a_long_trace_names_the_token_in_the_one_source_hover_and_a_click_selects_it(dash_duo):
    """#17 item 7: the compact (>256 tokens) one-source heatmap still names each token in its hover,
    and a click on a cell still selects that token."""
    text = ("abcdefghijklmnopqrstuvwxyz" * 12)[:300]
    dash_duo.driver.set_window_size(1400, 1000)
    dash_duo.start_server(create_app({"full": make_model("full", n_ctx=320)}, text=text))
    wait_for_title(dash_duo, "source-graph-0", "at every token", timeout=30)
    label = dash_duo.driver.execute_script(HOVER_JS, "source-graph-0", 28, 1)
    assert label is not None and "token 28 'c'" in label, label
    col = 150
    time.sleep(0.3)  # Plotly throttles hover: a second one at once would keep the first point
    dash_duo.driver.execute_script(CLICK_JS, "source-graph-0", col, 1)
    until(lambda: f"token {col} " in (figure(dash_duo, "token-graph-0") or {}).get("title", ""), timeout=20)
    picked = int(re.search(r"token (\d+) ", figure(dash_duo, "token-graph-0")["title"]).group(1))
    assert picked == col
    assert dash_duo.get_logs() == []
