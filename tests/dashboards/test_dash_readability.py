"""#17 in a real headless Chromium: what a page shows at 96 tokens (signed colours, legible token
axes, uncut titles, PreNorm notes that do not overlap, a drawn info mark). A screenshot of the
page goes to $ATTNRES_SCREENSHOTS when that is set."""

from __future__ import annotations

import os

import pytest
import torch

from attnres_probe import AttnResTransformer, ModelConfig
from attnres_probe.dashboards import create_app
from test_dash_browser import figure, wait_for_title

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
# the bounding boxes of an element set, as plain objects
BOXES = """
return Array.from(document.querySelectorAll(arguments[0]), (e) => {
  const r = e.getBoundingClientRect();
  return {x0: r.left, x1: r.right, y0: r.top, y1: r.bottom, text: e.textContent};
}).filter((b) => b.x1 > b.x0);
"""


def _model(residual: str) -> AttnResTransformer:
    kw = {"block_size": 2} if residual == "block" else {}
    model = AttnResTransformer(ModelConfig(d_model=32, n_layers=2, n_heads=2, n_ctx=128, residual=residual, seed=1, **kw),
                               backend="torch")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.mixers:
            m.query.copy_(torch.randn(m.query.shape, generator=g) * 1.5)
            m.norm.weight.copy_(1 + 0.5 * torch.randn(m.query.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def app96():
    return create_app({r: _model(r) for r in ("prenorm", "full", "block")}, text=TEXT96)


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
    for i in range(3):
        wait_for_title(dash_duo, f"token-graph-{i}", "token 0 ", timeout=30)
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
    # item 3: PreNorm's weights panel is blank with one note, which overlaps neither axis title nor the title
    note = driver.execute_script(BOXES, "#token-graph-0 .annotation-text-g text, #token-graph-0 .annotation text")
    assert note, "the PreNorm panel has no note"
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
