"""The study page (study.md) says what its comparisons set side by side (#16); the study of another seed's
models and across seeds (#21)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnres_probe.analysis.compare import Windows, compare_windows
from attnres_probe.analysis.windows import WINDOW_COLUMNS
from attnres_probe.study import FINDINGS, _page, run_seed_study, run_study, study_model

STUDY = Path(__file__).resolve().parents[1] / "docs" / "study"


def test_the_study_page_compares_like_with_like_and_warns_of_few_documents(seed_studies):
    """The demo-model study's page (``study --demo``): twelve windows of v3's seed-0 runs from three
    documents, set side by side by the one comparison engine."""
    _, (one, _) = seed_studies
    results = json.loads((one / "results.json").read_text())
    table = pd.read_csv(STUDY / "v3" / "windows.csv")
    items = []
    for name, t in table[table["seed"] == 0].groupby("model", sort=False):
        t = t.reset_index(drop=True).iloc[:12]
        keys = pd.DataFrame({"doc": np.arange(len(t)) // 4, "start": np.arange(len(t)) % 4 * 128,
                             "n_tokens": 128, "digest": [f"w{i}" for i in range(len(t))]})
        cols = t.reindex(columns=list(WINDOW_COLUMNS))
        items.append(Windows(name, name, pd.concat([keys, cols], axis=1), cols.mean()))
    frame = compare_windows(items, n_resamples=200)  # twelve windows from three documents
    page = _page(results, frame, {})
    every = page[page.index("## Every metric"):]
    assert "the same quantity, in the same unit, on the same axis" in every
    assert "weights vs shares" not in page and "contribution shares (its coefficients" not in page
    top = page[: page.index("## Findings")]  # said once, above every table
    assert "Only 3 documents: intervals are rough" in top and page.count("Only 3 documents") == 1
    loc = next(line for line in every.splitlines() if "`locality_distance`" in line)
    assert loc.count("|") > 6  # values, comparisons with uniform and with PreNorm, verdicts
    assert "uniform reference of each routing number" in page
    assert "log scale" in page[page.index("## Figures"):]


# -- the study of another seed's models, and across seeds (#21) --------------------------------------------


@pytest.fixture(scope="module")
def seed_studies(tmp_path_factory):
    """Two seeds of a 2-step demo recipe, each studied on 3 validation windows (the whole pipeline, tiny).

    Each seed builds the demo models the study reads (DEMO_NAMES), not every buildable one
    (DEMO_RULES): a model run_study never opens would only add its training time."""
    from attnres_probe.demo import DEMO_NAMES, build_demo_models

    root = tmp_path_factory.mktemp("seeds")
    folders = []
    for s in (1, 2):
        build_demo_models(root / f"models{s}", names=DEMO_NAMES, seed=s, work=root / "work", progress=False, steps=2,
                          warmup_steps=0, eval_every=0, probe_every=1)
        run_study(root / f"study{s}", n_windows=3, images="html", n_resamples=50, models=root / f"models{s}")
        folders.append(root / f"study{s}")
    return root, folders


def test_a_study_of_another_seeds_models_says_which_models_and_recipe(seed_studies):
    root, (one, _) = seed_studies
    results = json.loads((one / "results.json").read_text())
    assert results["training"]["seed"] == 1 and results["training"]["steps"] == 2
    page = (one / "study.md").read_text()
    assert f"--models {(root / 'models1').as_posix()}" in page and "2 steps of 16 x 128 tokens on `shakespeare`, seed 1" in page
    assert (one / "over_training.html").is_file()  # the runs' probes drawn against the training step


def test_the_study_across_seeds_draws_seeds_and_windows_and_lists_each_seeds_verdict(seed_studies, tmp_path):
    _, folders = seed_studies
    summary = run_seed_study(tmp_path / "across", folders, n_resamples=200)
    assert summary["seeds"] == [1, 2] and summary["bootstrap"]["unit"] == "seed x document (crossed)"
    assert [f["key"] for f in summary["findings"]] == [f.key for f in FINDINGS]
    for f in summary["findings"]:
        assert set(f["per_seed"]) == {"1", "2"}
        assert f["verdict"] in ("consistent", "contrary", "inconclusive")
        if f["low"] is not None:
            assert f["low"] <= f["high"]
    page = (tmp_path / "across" / "seeds.md").read_text()
    assert "1: " in page and "2: " in page and "seeds *and* documents" in page


def test_a_study_resamples_the_documents_its_windows_come_from(seed_studies):
    """Each window carries the play it was cut from (windows.csv, results.json), and the bootstrap
    draws plays: windows of one play are alike, so they must not count as independent."""
    from attnres_probe.demo import demo_validation_documents

    root, (one, _) = seed_studies
    results = json.loads((one / "results.json").read_text())
    table = pd.read_csv(one / "windows.csv")
    log = json.loads((root / "models1" / "block" / "train_log.json").read_text())
    docs = demo_validation_documents(log, 3)
    assert results["bootstrap"]["unit"] == "document" and sum(results["documents"].values()) == 3
    for _, t in table.groupby("model"):
        assert t.sort_values("window")["document"].tolist() == docs


def test_findings_resample_whole_documents():
    """Twelve windows, three documents whose windows are identical: resampling windows gives a
    narrow interval that the data do not support; resampling documents (what evaluate_findings
    draws with, through the one comparison engine) gives the honest, wider one."""
    from attnres_probe.analysis.windows import WINDOW_COLUMNS
    from attnres_probe.study import evaluate_findings

    def table(loss):
        t = pd.DataFrame({c: np.full(12, np.nan) for c in WINDOW_COLUMNS})
        t["mean_loss"] = loss
        return t

    a = 2.0 + np.repeat([0.0, -0.2, 0.1], 4)  # model, per window
    windows = {"prenorm": table(np.full(12, 2.0)), "full": table(a), "block": table(a)}
    pooled = {n: {"mean_loss": float(t["mean_loss"].mean())} for n, t in windows.items()}
    docs = [f"play{i}" for i in np.repeat([0, 1, 2], 4)]

    def width(documents):
        f = next(f for f in evaluate_findings(windows, pooled, 400, 0, documents=documents) if f["key"] == "full_mean_loss")
        return f["high"] - f["low"]

    assert width(docs) > 1.5 * width(None)
    with pytest.raises(ValueError, match="11 document labels for 12 windows"):
        evaluate_findings(windows, pooled, 400, 0, documents=docs[:11])


def test_the_study_across_seeds_refuses_mixed_recipes_and_single_seeds(seed_studies, tmp_path):
    _, (one, two) = seed_studies
    with pytest.raises(ValueError, match="at least two seeds"):
        run_seed_study(tmp_path / "x", [one])
    other = tmp_path / "other"
    other.mkdir()
    results = json.loads((two / "results.json").read_text())
    results["training"]["steps"] = 8000
    (other / "results.json").write_text(json.dumps(results))
    (other / "windows.csv").write_text((two / "windows.csv").read_text())
    with pytest.raises(ValueError, match="another recipe"):
        run_seed_study(tmp_path / "x", [one, other])
    with pytest.raises(ValueError, match="same seed"):
        run_seed_study(tmp_path / "x", [two, two])
    with pytest.raises(FileNotFoundError, match="holds no demo model"):
        study_model("block", tmp_path)
