"""The study page (study.md) says what its comparisons set side by side (#16)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from attnres_probe.analysis.compare import Windows, compare_windows
from attnres_probe.analysis.windows import WINDOW_METRICS
from attnres_probe.study import _page

STUDY = Path(__file__).resolve().parents[1] / "docs" / "study"


def test_the_study_page_marks_weights_against_shares_and_warns_of_few_documents():
    results = json.loads((STUDY / "results.json").read_text())
    table = pd.read_csv(STUDY / "windows.csv")
    items = []
    for name, t in table.groupby("model", sort=False):
        t = t.reset_index(drop=True).iloc[:12]
        keys = pd.DataFrame({"doc": np.arange(len(t)) // 4, "start": np.arange(len(t)) % 4 * 128,
                             "n_tokens": 128, "digest": [f"w{i}" for i in range(len(t))]})
        items.append(Windows(name, name, pd.concat([keys, t[list(WINDOW_METRICS)]], axis=1), t[list(WINDOW_METRICS)].mean()))
    frame = compare_windows(items, n_resamples=200)  # twelve windows from three documents
    page = _page(results, frame, {})
    every = page[page.index("## Every metric"):]
    assert "PreNorm has no weights" in every and "Only 3 documents: intervals are rough" in every
    loc = next(line for line in every.splitlines() if "`locality_distance`" in line)
    assert loc.count("weights vs shares: different quantities") == 2
    loss = next(line for line in every.splitlines() if "`mean_loss`" in line)
    assert "weights vs shares" not in loss
    assert "log scale" in page[page.index("## Figures"):]
