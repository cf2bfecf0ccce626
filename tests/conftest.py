"""Shared test set-up.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable must be
set before any kernel module is imported, so it is set here, first.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's models are tiny: one intra-op thread is as fast, and it cannot be slowed down by
# oversubscription when a browser or a second process shares the two CI cores.
torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def _shared_chromium():
    from helpers import SharedChromium

    shared = SharedChromium()
    yield shared
    shared.quit()


@pytest.fixture
def chromium(_shared_chromium):
    """``chromium(window="1400,1000")`` -> the session's headless Chromium WebDriver (helpers.SharedChromium)
    on a blank page at that window size (None: Chromium's own default), for tests that open file:// pages;
    skips the test where Chromium or ChromeDriver is missing. The test does not quit it."""
    yield _shared_chromium.open
    _shared_chromium.leave()
