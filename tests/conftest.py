"""Shared test set-up.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable must be
set before any kernel module is imported, so it is set here, first.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
