"""The report opened from file:// in headless Chromium: no errors, no network, a working explorer."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from helpers import CHROME_FLAGS

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("ATTNRES_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("ATTNRES_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = ("--headless", *CHROME_FLAGS)
Z_OF = """
const gd = document.getElementById(arguments[0]);
const z = gd.data[0].z._inputArray || gd.data[0].z;  // plotly keeps typed-array specs decoded here
return JSON.stringify({z: Array.from(z, row => Array.from(row)), title: gd.layout.title.text});
"""
CHOOSE = """
const select = document.querySelector(arguments[0]);
select.value = arguments[1];
select.dispatchEvent(new Event('change'));
"""


@pytest.fixture(scope="module")
def browser(report_path):
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"needs Chromium and ChromeDriver ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        driver.get(report_path.as_uri())
        logs = {"browser": driver.get_log("browser"), "performance": driver.get_log("performance")}
        yield driver, logs
    finally:
        driver.quit()


def _z(driver, div: str) -> tuple[np.ndarray, str]:
    got = json.loads(driver.execute_script(Z_OF, div))
    return np.array([[np.nan if v is None else v for v in row] for row in got["z"]], dtype=float), got["title"]


def _explorer_divs(driver) -> list[str]:
    return driver.execute_script("return Array.from(document.querySelectorAll('#explorer .grid:not(.reading) div.plot'), d => d.id)")


def test_page_loads_without_console_errors(browser):
    _, logs = browser
    errors = [e for e in logs["browser"] if e["level"] == "SEVERE"]
    assert errors == []


def test_page_makes_no_network_request(browser):
    driver, logs = browser
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert [r for r in resources if r.startswith(("http:", "https:"))] == []
    sent = [json.loads(e["message"])["message"] for e in logs["performance"]]
    urls = [m["params"]["request"]["url"] for m in sent if m["method"] == "Network.requestWillBeSent"]
    assert urls and all(u.startswith(("file:", "data:")) for u in urls), [u[:80] for u in urls]


def test_every_chart_is_drawn(browser):
    driver, _ = browser
    n_divs, n_drawn = driver.execute_script(
        "const d = document.querySelectorAll('div.plot'); return [d.length, Array.from(d).filter(x => x.querySelector('.main-svg')).length];"
    )
    assert n_divs == n_drawn >= 8


def test_the_payload_in_the_text_never_runs(browser):
    driver, _ = browser
    assert driver.execute_script("return window.__xss === undefined")


def test_explorer_opens_drawn_for_its_opening_token(browser, traces):
    driver, _ = browser
    start = int(driver.execute_script("return document.querySelector('#explorer .explorer').getAttribute('data-token')"))
    assert start > 0 and driver.execute_script("return document.querySelector('#explorer select.token').value") == str(start)
    z, title = _z(driver, _explorer_divs(driver)[1])  # the full model, drawn for that token
    np.testing.assert_allclose(z, np.asarray(traces[1].cube("weights")[0, start], np.float64), rtol=2e-3, atol=1e-6)
    assert f"token {start} " in title


def test_token_selector_swaps_each_models_heatmap(browser, traces):
    driver, _ = browser
    divs = _explorer_divs(driver)
    assert len(divs) == len(traces)
    before = [_z(driver, d) for d in divs]
    k = len(traces[0].str_tokens[0]) + 3  # sequence 1, position 3
    driver.execute_script(CHOOSE, "#explorer select.token", str(k))
    after = [_z(driver, d) for d in divs]
    for trace, (z0, _), (z1, title) in zip(traces, before, after):
        want = np.asarray(trace.cube("weights")[1, 3], np.float64)
        if trace.residual == "prenorm":  # its implied weights 1/k: the same at every token (#35)
            want = want / np.nansum(want, -1, keepdims=True)
        else:
            assert not np.allclose(np.nan_to_num(z0), np.nan_to_num(z1))
        np.testing.assert_allclose(z1, want, rtol=2e-3, atol=1e-6)
        assert "token 3" in title and "(sequence 1)" in title
    assert driver.execute_script("return document.querySelector('#explorer input.token').value") == str(k)


def test_value_selector_shows_logits_with_a_diverging_scale(browser, traces):
    driver, _ = browser
    divs = _explorer_divs(driver)
    driver.execute_script(CHOOSE, "#explorer select.token", "2")
    driver.execute_script(CHOOSE, "#explorer select.kind", "logits")
    z, title = _z(driver, divs[1])  # the full model
    np.testing.assert_allclose(z, traces[1].logits[0, 2], rtol=2e-3, atol=1e-5)
    assert "depth logit z" in title
    zmin, zmax = driver.execute_script(f"const t = document.getElementById('{divs[1]}').data[0]; return [t.zmin, t.zmax];")
    assert zmin == -zmax
    driver.execute_script(CHOOSE, "#explorer select.kind", "auto")


def test_clicking_a_token_chip_selects_it_in_the_explorer(browser):
    driver, _ = browser
    driver.execute_script("document.querySelector('button.tok[data-index=\"7\"]').click();")
    assert driver.execute_script("return document.querySelector('#explorer select.token').value") == "7"
    _, title = _z(driver, _explorer_divs(driver)[1])
    assert "token 7 " in title
