"""Issue #49 item 1: the "Errata and review" section of study v3, every figure generated from
results.json (the page's number test covers it, tests/test_seed_study.py) and recomputed here from
the runs' values it comes from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as st

from attnres_probe.seed_study import ALPHA, BOOT, errata, lr_check, predecessor_wins, render_page, seeds_needed, t_power

V3 = Path(__file__).resolve().parents[1] / "docs" / "study" / "v3"


def _results() -> dict:
    return json.loads((V3 / "results.json").read_text())


def test_the_t_tests_power_is_the_share_of_simulated_tests_that_reject():
    rng = np.random.default_rng(0)
    for effect, n, alpha in ((1.05, 5, 0.05), (1.58, 5, 0.05 / 3), (0.5, 12, 0.05)):
        x = rng.normal(effect, 1.0, size=(40_000, n))
        t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
        rejected = np.mean(np.abs(t) > st.t.ppf(1 - alpha / 2, n - 1))
        assert abs(t_power(effect, n, alpha) - rejected) < 0.01, (effect, n, alpha)
    assert t_power(30.0, 5) == pytest.approx(1.0) and t_power(0.0, 5) == pytest.approx(0.05)
    n = seeds_needed(1.05)
    assert t_power(1.05, n) >= 0.8 > t_power(1.05, n - 1)
    assert seeds_needed(0.0) is None


def test_predecessor_wins_counts_the_reads_whose_last_source_weighs_most():
    weights = [[1.0, None, None], [0.3, 0.7, None], [0.5, 0.2, 0.3], [0.1, 0.2, 0.3, 0.4]]
    assert predecessor_wins(weights) == (2, 3)  # read 0 sees one source: not counted


def test_the_errata_follow_from_the_runs_of_results_json():
    results = _results()
    e = results["errata"]
    assert e == errata(results, {f"full/{s}": json.loads((V3 / "runs" / "full" / f"seed{s}" / "train_log.json").read_text())
                                 ["probes"]["history"] for s in results["runs"]["full"]}, lr=e["lr"])
    full = results["runs"]["full"]
    for s, row in e["p4"].items():
        pooled = full[s]["pooled"]
        assert row["weight"] == pooled["embed_weight_deep"] and row["uniform"] == pooled["embed_weight_deep@uniform"]
        assert 0 < row["share_of_uniform"] < 1  # keeps weight, less than a uniform share: not favoured
    for s, row in e["p3"].items():
        assert row["reads"] == 16 and 0 <= row["predecessor_wins"] <= 16
        assert row["predecessor_wins"] == predecessor_wins(full[s]["mean_weights"])[0]
    keys = [p["key"] for p in results["primaries"]]
    assert [p["key"] for p in e["power"]] == keys
    levels = sorted(p["holm_level"] for p in e["power"])
    assert levels == pytest.approx([ALPHA / k for k in range(len(keys), 0, -1)])
    base = results["runs"]["prenorm"]
    for w in e["welch"]:
        other = results["runs"][w["model"]]
        seeds = sorted(set(other) & set(base), key=int)
        a = [other[s]["pooled"]["mean_loss"] for s in seeds]
        b = [base[s]["pooled"]["mean_loss"] for s in seeds]
        assert w["p_welch"] == pytest.approx(st.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-12)
        assert w["correlation"] == pytest.approx(np.corrcoef(a, b)[0, 1], rel=1e-12)
    for b in e["plays_bootstrap"]:
        assert b["low"] <= b["mean"] <= b["high"] and e["resamples"] == BOOT
    block = results["runs"]["block"]
    for s, profile in e["partial_block"].items():
        cols = block[s]["partial_columns"]
        assert [v is None for v in profile] == [c is None for c in cols] and cols[0] is None  # a block's first read


def test_the_page_carries_the_errata_after_the_plans_sections():
    page = (V3 / "study.md").read_text()
    assert page == render_page(_results())
    assert page.index("## Afterwards: the reads of P4") < page.index("## Errata and review")
    errata_text = page[page.index("## Errata and review"):]
    for needed in ("P4 tests a narrower claim", "P3 is a direction", "not the models' size", "Welch", "One recipe",
                   "Disclosures", "8f39119", "Bootstrap over plays", "Weight beside effect", "Over training",
                   "partial-block profile"):
        assert needed in errata_text, needed
    assert "cannot tell the direction at this scale" not in errata_text


def test_the_learning_rate_check_reads_finished_runs_only(tmp_path):
    runs = tmp_path / "v3" / "runs"
    for model, loss in (("prenorm", 1.6), ("full", 1.5), ("block", 1.55)):
        folder = runs / model / "seed0"
        folder.mkdir(parents=True)
        log = json.loads((V3 / "runs" / model / "seed0" / "train_log.json").read_text())
        log["final_val_loss"] = loss
        (folder / "train_log.json").write_text(json.dumps(log))
    lr = tmp_path / "v3" / "lr" / "full" / "lr1e-3" / "seed0"
    lr.mkdir(parents=True)
    log = json.loads((V3 / "runs" / "full" / "seed0" / "train_log.json").read_text())
    log.update(final_val_loss=1.7, step=7500, finished=False)  # in flight: not counted
    (lr / "train_log.json").write_text(json.dumps(log))
    check = lr_check(runs)
    assert check["rates"] == [0.001, 0.003, 0.006]
    assert check["loss"]["full"] == [None, 1.5, None] and check["gap"]["full"] == [None, pytest.approx(-0.1), None]
