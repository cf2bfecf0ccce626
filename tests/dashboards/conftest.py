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
