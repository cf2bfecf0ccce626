"""The dashboard in a real headless Chromium (dash_duo): loading, token clicks, new prompts, XSS."""

from __future__ import annotations

import numpy as np
import pytest
from dash.testing.wait import until

from attnres_probe.dashboards import create_app

from dash_helpers import TEXT

pytestmark = pytest.mark.browser

FIGURE_JS = """
const gd = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');
if (!gd || !gd._fullData || !gd._fullData.length) { return null; }
const fd = gd._fullData[0];
const arr = (a) => Array.from(a, (v) => (typeof v === 'number' && Number.isNaN(v)) ? null : v);
return {title: (gd.layout.title || {}).text || '', z: fd.z ? Array.from(fd.z, (row) => arr(row)) : null,
        x: fd.x ? arr(fd.x) : null, n: gd._fullData.length};
"""
CHIPS_JS = "return Array.from(document.querySelectorAll('#token-strip button'), (b) => b.textContent);"


def figure(dash_duo, graph_id: str) -> dict | None:
    return dash_duo.driver.execute_script(FIGURE_JS, graph_id)


def wait_for_title(dash_duo, graph_id: str, needle: str, timeout: float = 20) -> dict:
    until(lambda: needle in (figure(dash_duo, graph_id) or {}).get("title", ""), timeout=timeout)
    return figure(dash_duo, graph_id)


def count(dash_duo, selector: str) -> int:
    """Number of elements matching ``selector`` (no implicit wait, unlike find_elements)."""
    return dash_duo.driver.execute_script("return document.querySelectorAll(arguments[0]).length", selector)


def as_array(z) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in z], dtype=np.float64)


def opening_token(app, text: str | None = None) -> int:
    """The token a page opens on for ``text`` (default: the initial one): where the AttnRes models
    route furthest from uniform (``callbacks.informative_token``)."""
    from attnres_probe.dashboards.callbacks import informative_token

    ex = app.explorer
    key = ex.initial.key if text is None else ex.key_for(text)
    return informative_token(ex.result(key).traces.values())[0]


def start(dash_duo, app) -> int:
    """Serve ``app`` and wait for the opening token's panels; return that token."""
    dash_duo.start_server(app)
    dash_duo.wait_for_element("#token-strip button", timeout=30)
    pos = opening_token(app)
    for i in range(len(app.explorer.names)):
        wait_for_title(dash_duo, f"token-graph-{i}", f"token {pos} ", timeout=30)
    return pos


def implied(trace, pos: int) -> np.ndarray:
    """What a token panel colours by default: the depth weights; PreNorm's implied weights 1/k."""
    w = np.asarray(trace.depth_weights[0, pos], np.float64)
    return w / np.nansum(w, -1, keepdims=True) if trace.residual == "prenorm" else w


def run_prompt(dash_duo, text: str, expect: str = "Ran ") -> None:
    box = dash_duo.find_element("#prompt")
    dash_duo.clear_input(box)
    if text:
        box.send_keys(text)
    dash_duo.find_element("#run").click()
    dash_duo.wait_for_contains_text("#prompt-status", expect, timeout=30)


def test_page_loads_with_baseline_and_attnres_panels_and_no_console_errors(dash_duo, app):
    pos = start(dash_duo, app)
    for i, name in enumerate(app.explorer.names):  # prenorm (baseline), full, block
        assert name in dash_duo.find_element(f"#token-panel-{i} .panel-title").text  # the panel names the model
        assert figure(dash_duo, f"token-graph-{i}")["title"].startswith(f"token {pos} ")  # one title line
        wait_for_title(dash_duo, f"mean-graph-{i}", f"{name}<br>mean over")
    assert wait_for_title(dash_duo, "magnitudes", "Magnitudes by depth")["n"] == 2 * len(app.explorer.names)
    dash_duo.wait_for_element(".metric-card", timeout=20)
    dash_duo.wait_for_contains_text("#ablation-status", "base loss", timeout=30)
    assert count(dash_duo, "div.dash-debug-alert") == 0
    assert dash_duo.get_logs() == []
    dash_duo.driver.execute_script("console.error('attnres-probe: console capture works')")
    assert any("console capture works" in e["message"] for e in dash_duo.get_logs())


def test_clicking_a_token_shows_that_tokens_weights(dash_duo, app):
    pos = start(dash_duo, app)
    pick = 5 if pos != 5 else 6
    dash_duo.find_element(f"#token-strip button:nth-child({pick + 1})").click()
    dash_duo.wait_for_contains_text("#token-info", f"token {pick} of", timeout=20)
    traces = app.explorer.initial.traces
    for i, name in enumerate(app.explorer.names):
        fig = wait_for_title(dash_duo, f"token-graph-{i}", f"token {pick} ")
        np.testing.assert_allclose(as_array(fig["z"]), implied(traces[name], pick), rtol=1e-6, atol=1e-7, equal_nan=True)
    chips = dash_duo.find_elements("#token-strip button")
    assert "selected" in chips[pick].get_attribute("class") and "selected" not in chips[pos].get_attribute("class")


def test_running_a_new_prompt_updates_every_view(dash_duo, app):
    start(dash_duo, app)
    text = "Depth routing, token by token."
    run_prompt(dash_duo, text, expect=f"Ran {len(text)} tokens")
    assert dash_duo.driver.execute_script(CHIPS_JS) == list(text)
    traces = app.explorer.traces(app.explorer.key_for(text))
    pos = opening_token(app, text)
    for i, name in enumerate(app.explorer.names):
        fig = wait_for_title(dash_duo, f"token-graph-{i}", f"token {pos} {text[pos]!r}")
        np.testing.assert_allclose(as_array(fig["z"]), implied(traces[name], pos), rtol=1e-6, equal_nan=True)
        wait_for_title(dash_duo, f"mean-graph-{i}", f"mean over {len(text)} tokens")
        assert len(figure(dash_duo, f"source-graph-{i}")["x"]) == len(text)
    assert figure(dash_duo, "magnitudes")["n"] == 2 * len(app.explorer.names)
    dash_duo.wait_for_contains_text("#token-info", f"token {pos} of {len(text)}", timeout=20)
    dash_duo.wait_for_contains_text("#ablation-status", "base loss", timeout=30)
    assert dash_duo.get_logs() == []


def test_empty_and_too_long_prompts_leave_the_views_alone(dash_duo, app):
    pos = start(dash_duo, app)
    run_prompt(dash_duo, "", expect="the prompt is empty")
    run_prompt(dash_duo, "x" * 65, expect="text has 65 tokens")
    assert dash_duo.driver.execute_script(CHIPS_JS) == list(TEXT)
    assert figure(dash_duo, "token-graph-1")["title"].startswith(f"token {pos} {TEXT[pos]!r}")


XSS_PROMPTS = ('<img src=x onerror="window.__xss=1">', "<script>window.__xss=2</script>")


def test_markup_in_a_prompt_is_shown_as_literal_text(dash_duo, app):
    start(dash_duo, app)
    for payload in XSS_PROMPTS:
        run_prompt(dash_duo, payload, expect=f"Ran {len(payload)} tokens")
        until(lambda: dash_duo.driver.execute_script(CHIPS_JS) == list(payload), timeout=20)
        dash_duo.find_element("#token-strip button:nth-child(1)").click()  # the "<"
        dash_duo.wait_for_contains_text("#token-info", f"token 0 of {len(payload)}", timeout=20)
        assert dash_duo.find_element("#token-info code").text == "<"
        wait_for_title(dash_duo, "token-graph-1", "token 0 '<'")
        assert dash_duo.driver.execute_script("return window.__xss") is None
        assert count(dash_duo, "#token-strip img, #token-strip script, #token-info img, #prompt-status img") == 0
    assert dash_duo.get_logs() == []


def test_traces_only_mode_says_so_and_still_renders(dash_duo, app):
    saved = create_app(dict(app.explorer.initial.traces))  # DepthTraces only, no model
    start(dash_duo, saved)
    dash_duo.wait_for_contains_text("#traces-only-note", "Traces-only mode", timeout=20)
    assert not dash_duo.find_element("#run").is_enabled() and not dash_duo.find_element("#prompt").is_enabled()
    pos = opening_token(saved)
    pick = 2 if pos != 2 else 3
    dash_duo.find_element(f"#token-strip button:nth-child({pick + 1})").click()
    wait_for_title(dash_duo, "token-graph-2", f"token {pick} ")
    assert dash_duo.get_logs() == []


VERDICTS_JS = "return Array.from(document.querySelectorAll(arguments[0] + ' span.verdict'), (s) => s.textContent);"


def test_the_page_shows_the_same_verdicts_as_compare_for_the_same_stats(dash_duo, models, corpus_stats):
    from attnres_probe import metrics

    from test_dash_callbacks import _expected_headline_verdicts

    app = create_app(models, text=TEXT, stats=corpus_stats)
    start(dash_duo, app)
    frame = metrics.compare(*corpus_stats.values(), names=list(corpus_stats))
    dash_duo.wait_for_element("#corpus-headline .metric-card", timeout=20)
    assert dash_duo.driver.execute_script(VERDICTS_JS, "#corpus-headline") == _expected_headline_verdicts(frame)
    prompt = metrics.compare(*app.explorer.initial.traces.values(), names=list(app.explorer.names))
    until(lambda: len(dash_duo.driver.execute_script(VERDICTS_JS, "#metric-cards")) > 0, timeout=20)
    assert dash_duo.driver.execute_script(VERDICTS_JS, "#metric-cards") == _expected_headline_verdicts(prompt)
    assert "95% CI [" in dash_duo.find_element("#corpus-headline").text
    assert wait_for_title(dash_duo, "corpus-magnitudes", "Magnitudes by depth")["n"] == 2 * 2 * len(models)
    assert dash_duo.get_logs() == []


def test_the_difference_checkbox_shows_its_caption_and_titles_with_the_token_text(dash_duo, app):
    """Ticking "difference: each AttnRes model minus the baseline" shows the view's own caption and panel titles
    that name the token's text, as the other per-token panels do; unticking hides the caption again."""
    pos = start(dash_duo, app)
    assert not dash_duo.find_element("#token-difference-note").is_displayed()
    box = dash_duo.driver.execute_script(
        "return Array.from(document.querySelectorAll('#expanded input'), i => i).find(i => i.value === 'diff');")
    box.click()
    dash_duo.wait_for_contains_text("#token-difference-note", "minus prenorm", timeout=20)
    caption = dash_duo.find_element("#token-difference-note")
    assert caption.is_displayed() and "Blue is negative" in caption.text and "red positive" in caption.text
    for i in (1, 2):  # full, block: model minus the baseline
        title = wait_for_title(dash_duo, f"token-graph-{i}", " − prenorm")["title"]
        assert f"token {pos} {TEXT[pos]!r} (sequence 0)" in title
    box.click()
    until(lambda: not dash_duo.find_element("#token-difference-note").is_displayed(), timeout=20)
    assert dash_duo.get_logs() == []
