"""Attention patterns in the report's per-token explorer (reports/patterns.py): what is stored, its
size, the page's text, and (in Chromium) the chart the page draws for a chosen token, layer and head."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from bs4 import BeautifulSoup

from attnres_probe import Probe
from attnres_probe.reports import build_report, record_text
from attnres_probe.reports.patterns import DIGITS, PATTERN_TOKENS, pattern_source, row_exponents
from attnres_probe.reports.recording import record_readings

from helpers import tiny_model

TEXT = "The cat sat on the mat; the dog sat on the log."  # 47 tokens, two windows of the tiny models' 24
RESIDUALS = ("prenorm", "full", "block")


@pytest.fixture(scope="module")
def models():
    return {r: tiny_model(r, n_heads=4, n_kv_heads=2, positional="rope") if r == "block" else tiny_model(r) for r in RESIDUALS}


@pytest.fixture(scope="module")
def traces(models):
    return [record_text(m, TEXT, name=r) for r, m in models.items()]


@pytest.fixture(scope="module")
def readings(models, traces):
    return {t.name: record_readings(models[t.name], t, n_tokens=16) for t in traces}


@pytest.fixture(scope="module")
def report(traces, readings, tmp_path_factory):
    path = tmp_path_factory.mktemp("patterns") / "report.html"
    build_report(traces, path, readings=readings)
    return path


def explorer_data(html: str) -> dict:
    soup = BeautifulSoup(html, "html.parser")
    return json.loads(soup.select_one("script#explorer-0-json").string)


def hooked(model, tokens) -> np.ndarray:
    """[layer, head, query, key] of the model's hook_pattern on ``tokens`` [1, n]."""
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    return np.stack([cache["pattern", i][0].numpy() for i in range(model.cfg.n_layers)])


def test_readings_record_every_layers_pattern_of_the_first_tokens(models, traces, readings):
    for t in traces:
        got = readings[t.name]["patterns"]
        model = models[t.name]
        assert got.shape == (model.cfg.n_layers, model.cfg.n_heads, 16, 16)
        want = hooked(model, np.asarray(t.tokens[:1, :16]).astype("int64"))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def stored_row(pm: dict, layer: int, head: int, p: int) -> tuple[np.ndarray, float]:
    """Row p of a stored pattern, decoded (w / 10**e), and its rounding bound 0.5 * 10**-e."""
    tri = np.asarray(pm["w"][layer][head])
    e = pm["e"][layer][head][p]
    return tri[p * (p + 1) // 2: (p + 1) * (p + 2) // 2] / 10.0**e, 0.5 * 10.0**-e


def test_the_explorer_stores_each_row_to_four_significant_digits_of_its_largest_weight(report, traces, readings):
    from attnres_probe import figures

    data = explorer_data(report.read_text(encoding="utf-8"))
    assert [p["name"] for p in data["patterns"]] == list(RESIDUALS)
    for pm in data["patterns"]:
        pat = readings[pm["name"]]["patterns"]
        L, H, n = pat.shape[0], pat.shape[1], 16
        assert (pm["L"], pm["H"], pm["n"], pm["digits"]) == (L, H, n, DIGITS)
        assert pm["keys"] == [figures.show_token(t) for t in traces[0].str_tokens[0][:n]]
        for layer in range(L):
            for head in range(H):
                tri = np.asarray(pm["w"][layer][head])
                assert tri.shape == (n * (n + 1) // 2,) and tri.dtype.kind == "i" and len(pm["e"][layer][head]) == n
                for p in range(n):
                    row, tol = stored_row(pm, layer, head, p)
                    want = pat[layer, head, p, : p + 1]
                    np.testing.assert_allclose(row, want, atol=tol + 1e-12)
                    assert tol <= 5e-4 * want.max()  # the largest weight to 4 significant digits: 1/1000 of the chart or better


def test_a_near_uniform_row_keeps_its_shape():
    """Weights of 0.0155..0.0157 (a flat head at token 63) were all 16 in thousandths: now each keeps 4 digits."""
    from attnres_probe.reports.patterns import _triangle_json

    n = 64
    row = np.linspace(0.0155, 0.0157, n)
    block = np.tril(np.tile(row / row.sum(), (n, 1)))
    e = row_exponents(block)
    assert e[-1] == 5  # 0.01559 -> 1559
    ints = np.asarray(json.loads(_triangle_json(block, e))[-n:])
    assert len(set(ints.tolist())) > 20 and 1000 <= ints.max() < 10_000
    np.testing.assert_allclose(ints / 10.0**e[-1], block[-1], atol=0.5e-5 + 1e-12)
    assert row_exponents(np.zeros((2, 2))).tolist() == [0, 0]


def test_the_page_explains_the_view_and_offers_every_layer_and_head(report):
    soup = BeautifulSoup(report.read_text(encoding="utf-8"), "html.parser")
    explorer = soup.select_one("#explorer-0")
    assert [o["value"] for o in explorer.select("select.pattern-layer option")] == ["0", "1"]
    assert [o["value"] for o in explorer.select("select.pattern-head option")] == ["0", "1", "2", "3"]  # the most heads
    notes = " ".join(p.get_text() for p in explorer.select("p.note"))
    assert "hook_pattern" in notes and "Stored for the first 16 tokens, each token's row to 4 significant digits" in notes
    missing = explorer.select_one("p.pattern-missing")
    assert missing.has_attr("hidden") and "patterns are stored for the first 16 tokens" in missing.get_text()
    assert len(explorer.select(".pattern-grid div.plot")) == 3
    # the depth-routing grid keeps one chart per model: the pattern charts sit in their own grid
    assert len(explorer.select(".grid:not(.reading) div.plot")) == 3


def test_traces_recorded_with_patterns_need_no_readings(models, tmp_path):
    trace = Probe(models["full"], name="full").run(TEXT[:20], patterns=True)
    page = tmp_path / "saved.html"
    build_report([trace], page)
    data = explorer_data(page.read_text(encoding="utf-8"))
    (pm,) = data["patterns"]
    assert pm["n"] == 20
    p = 7
    row, tol = stored_row(pm, 1, 0, p)
    np.testing.assert_allclose(row, trace.pattern(1, 0, token=p)[: p + 1], atol=tol + 1e-12)


def test_without_patterns_the_explorer_says_how_to_get_them(traces, tmp_path):
    page = tmp_path / "plain.html"
    build_report(traces, page)
    soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
    assert "patterns=True" in soup.select_one("#explorer p.no-patterns").get_text()
    assert explorer_data(str(soup))["patterns"] == []
    assert pattern_source(traces[0], None) is None


def test_the_patterns_cost_few_bytes(traces, readings, tmp_path):
    """The patterns add one integer of at most 4-5 digits per stored weight (L H n (n+1)/2 per model), an
    exponent per row and a chart per model."""
    with_p, without = tmp_path / "with.html", tmp_path / "without.html"
    build_report(traces, with_p, readings=readings)
    build_report(traces, without, readings={k: {**v, "patterns": None} for k, v in readings.items()})
    added = with_p.stat().st_size - without.stat().st_size
    weights = sum(r["patterns"].shape[0] * r["patterns"].shape[1] * 16 * 17 // 2 for r in readings.values())
    assert 0 < added < 5 * weights + 3 * 20_000, (added, weights)


def test_pattern_tokens_default_matches_the_readings():
    from attnres_probe.reports.recording import READING_TOKENS

    assert PATTERN_TOKENS == READING_TOKENS


# -- in Chromium -------------------------------------------------------------------------------------
BARS = """
const gd = document.getElementById(arguments[0]);
const y = gd.data[0].y._inputArray || gd.data[0].y;
return JSON.stringify({y: Array.from(y), x: Array.from(gd.data[0].x), title: gd.layout.title.text,
                       opacity: gd.style.opacity});
"""
CHOOSE = """
const select = document.querySelector(arguments[0]);
select.value = arguments[1];
select.dispatchEvent(new Event('change'));
"""


def atol(readings, name, layer, head, p) -> float:
    """The stored row's rounding bound: half a unit of the 4th significant digit of its largest weight."""
    return 0.5 * 10.0 ** -int(row_exponents(readings[name]["patterns"][layer, head])[p]) + 1e-9


@pytest.mark.browser
def test_the_page_draws_the_chosen_token_layer_and_head(report, readings, chromium):
    driver = chromium(window=None)
    driver.get(report.as_uri())
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    divs = driver.execute_script("return Array.from(document.querySelectorAll('#explorer-0 .pattern-grid div.plot'), d => d.id)")
    assert len(divs) == 3
    driver.execute_script(CHOOSE, "#explorer-0 select.token", "9")
    driver.execute_script(CHOOSE, "#explorer-0 select.pattern-layer", "1")
    driver.execute_script(CHOOSE, "#explorer-0 select.pattern-head", "3")
    for name, div in zip(RESIDUALS, divs):
        got = json.loads(driver.execute_script(BARS, div))
        if name != "block":  # 2 heads: head 3 is not there, the chart is dimmed
            assert got["opacity"] == "0.25"
            continue
        want = readings[name]["patterns"][1, 3, 9, :10]
        np.testing.assert_allclose(got["y"], want, atol=atol(readings, name, 1, 3, 9))
        assert re.search(r"token 9 .* · layer 1 head 3<br>attention weight \(softmax over key positions\)", got["title"])
    driver.execute_script(CHOOSE, "#explorer-0 select.pattern-head", "1")
    got = json.loads(driver.execute_script(BARS, divs[0]))
    np.testing.assert_allclose(got["y"], readings["prenorm"]["patterns"][1, 1, 9, :10],
                               atol=atol(readings, "prenorm", 1, 1, 9))
    assert got["opacity"] == "1"


@pytest.mark.browser
def test_past_the_stored_tokens_the_charts_are_blank_and_a_note_says_why(report, chromium):
    """A token past the stored ones must not leave the last stored token's bars (and title) on the charts."""
    from selenium.webdriver.common.by import By

    driver = chromium(window=None)
    driver.get(report.as_uri())
    divs = driver.execute_script("return Array.from(document.querySelectorAll('#explorer-0 .pattern-grid div.plot'), d => d.id)")
    note = driver.find_element(By.CSS_SELECTOR, "#explorer-0 .pattern-missing")
    driver.execute_script(CHOOSE, "#explorer-0 select.token", "9")
    assert not note.is_displayed()
    assert all(json.loads(driver.execute_script(BARS, d))["y"] for d in divs)
    driver.execute_script(CHOOSE, "#explorer-0 select.token", "20")  # past the 16 stored tokens
    assert note.is_displayed() and "patterns are stored for the first 16 tokens" in note.text
    for div in divs:
        got = json.loads(driver.execute_script(BARS, div))
        assert got["y"] == [] and got["x"] == [] and got["opacity"] == "0.25"
        assert "token 20 " in got["title"] and "token 9 " not in got["title"] and "no pattern stored" in got["title"]
    driver.execute_script(CHOOSE, "#explorer-0 select.pattern-head", "3")  # still none: the note stays
    assert note.is_displayed()
    driver.execute_script(CHOOSE, "#explorer-0 select.token", "9")  # back: bars and no note
    assert not note.is_displayed()
    assert json.loads(driver.execute_script(BARS, divs[2]))["y"] and "token 9 " in json.loads(driver.execute_script(BARS, divs[2]))["title"]
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def test_more_than_three_models_share_the_pattern_budget():
    """Five models with patterns (the five demo models) store fewer tokens each, so the report keeps to
    its size budget; two keep PATTERN_TOKENS."""
    from types import SimpleNamespace

    from attnres_probe.reports.patterns import PATTERN_BUDGET, explorer_pattern_items

    class Plots:
        def add(self, fig):
            return {"id": "p"}

    n = 80
    rng = np.random.default_rng(0)
    pat = rng.random((1, 2, 1, n, n)).astype(np.float32)
    pat /= np.tril(pat).sum(-1, keepdims=True)

    def trace(name):
        return SimpleNamespace(name=name, patterns=pat, mask=np.ones((1, n), bool), str_tokens=[list("x" * n)])

    positions = [(0, p) for p in range(n)]
    two = explorer_pattern_items([trace(f"m{i}") for i in range(2)], [f"m{i}" for i in range(2)], None, positions, Plots())
    five = explorer_pattern_items([trace(f"m{i}") for i in range(5)], [f"m{i}" for i in range(5)], None, positions, Plots())
    assert [x["n"] for x in two] == [PATTERN_TOKENS] * 2
    assert [x["n"] for x in five] == [PATTERN_BUDGET // 5] * 5 and PATTERN_BUDGET // 5 < PATTERN_TOKENS
    assert json.loads(five[0]["data"])["n"] == PATTERN_BUDGET // 5
