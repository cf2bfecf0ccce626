"""Fixtures for the dashboard tests: tiny models (d_model 32, 2 layers, n_ctx 64) and Chromium options.

Browser tests run Debian's chromium through dash's ``dash_duo`` fixture:
``pytest tests/dashboards --headless``. Without chromedriver they are skipped.
"""

from __future__ import annotations

import os
import shutil

import pytest

from dash_helpers import CORPUS, NAMES, TEXT, make_model
from helpers import CHROME_FLAGS

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is many times faster (no spin-waits)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def models() -> dict:
    """prenorm (the baseline), full and block, in display order."""
    return {name: make_model(name) for name in NAMES}


@pytest.fixture(scope="session")
def corpus_stats(models) -> dict:
    """name -> CorpusStats of a four-document corpus (one backward per window), with weights digests."""
    from attnres_probe import Probe
    from attnres_probe.io import weights_sha256

    out = {}
    for name, model in models.items():
        stats = Probe(model, name=name).run_corpus(CORPUS * 3, backward=True, progress=False)
        stats.meta["weights_sha256"] = weights_sha256(model)
        out[name] = stats
    return out


@pytest.fixture
def app(models):
    from attnres_probe.dashboards import create_app

    return create_app(models, text=TEXT)


@pytest.fixture
def ex(app):
    return app.explorer


# -- browser ------------------------------------------------------------------------------------
WINDOW = (1400, 1000)  # as pytest_setup_options sets it


@pytest.fixture(scope="module")
def _dash_browser(request, tmp_path_factory):
    """One Chromium for the browser tests of a module (starting and quitting one takes seconds):
    dash's own ``dash_duo`` set-up, made once; :func:`dash_duo` gives each test a fresh server."""
    from dash.testing.composite import DashComposite

    with DashComposite(
        server=None,
        browser=request.config.getoption("webdriver"),
        remote=request.config.getoption("remote"),
        remote_url=request.config.getoption("remote_url"),
        headless=request.config.getoption("headless"),
        options=request.config.hook.pytest_setup_options(),
        download_path=str(tmp_path_factory.mktemp("download")),
        percy_assets_root=request.config.getoption("percy_assets"),
        percy_finalize=request.config.getoption("nopercyfinalize"),
        pause=request.config.getoption("pause"),
    ) as dc:
        yield dc


@pytest.fixture
def dash_duo(_dash_browser, dash_thread_server):
    """dash's ``dash_duo`` on the module's Chromium: a server of its own (a new port, so nothing a
    page stored for its origin carries over), a blank page at the usual window size and an empty
    console log to start from; the page is left before the server stops."""
    from selenium.common.exceptions import WebDriverException

    dc = _dash_browser
    dc.server = dash_thread_server
    try:
        dc.driver.get("about:blank")
    except WebDriverException:  # an earlier test left the browser unusable: a new one, as dash_duo would make
        try:
            dc.driver.quit()
        except WebDriverException:
            pass
        dc._driver = dc.get_webdriver()
        dc._driver.implicitly_wait(2)
        dc.driver.get("about:blank")
    dc.driver.set_window_size(*WINDOW)
    dc.driver.get_log("browser")  # what earlier tests' pages logged is read (and dropped) here
    dc._last_ts, dc._url, dc._window_idx = 0, "", 0
    yield dc
    dc.driver.get("about:blank")
    dc.server = None


def pytest_setup_options():
    """Chrome options for dash_duo: Debian's chromium, no sandbox (root), nothing on the network."""
    from selenium.webdriver.chrome.options import Options

    options = Options()
    if os.path.exists(CHROMIUM):
        options.binary_location = CHROMIUM
    for arg in (*CHROME_FLAGS, "--disable-extensions", "--disable-default-apps", "--window-size=1400,1000"):
        options.add_argument(arg)
    if not os.environ.get("DISPLAY"):
        options.add_argument("--headless=new")
    return options


def pytest_collection_modifyitems(config, items):
    if shutil.which("chromedriver") and (shutil.which("chromium") or os.path.exists(CHROMIUM)):
        return
    skip = pytest.mark.skip(reason="chromium + chromedriver are not installed (make browser)")
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)
