"""Statistics over windows: per-window metrics, bootstrap intervals that cover, paired
comparisons on the same windows, and verdicts decided by the interval alone."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest
import torch

from attnres_probe import Probe, metrics
from attnres_probe.analysis import bootstrap
from attnres_probe.analysis.catalog import routing_names
from attnres_probe.analysis.compare import Windows, compare_windows
from attnres_probe.analysis.verdicts import EXPECTED, VERDICTS, verdict
from attnres_probe.analysis.windows import KEY_COLUMNS, WINDOW_COLUMNS, WINDOW_METRICS, reference_column, window_metrics

from helpers import local_routing, route, sample_tokens, tiny_model, uniform_routing
from trace_factory import make_trace

TEXT = "The cat sat on the mat."


# -- intervals cover the truth --------------------------------------------------------------
def _coverage(draw, truth: float, reps: int = 240, n: int = 40, resamples: int = 1000) -> float:
    rng = np.random.default_rng(2024)
    hits = 0
    for rep in range(reps):
        a, b = draw(rng, n)
        counts = bootstrap.resample_counts(n, resamples, seed=rep)
        _, lo, hi = draw.interval(a, b, counts)
        hits += lo <= truth <= hi
    return hits / reps


def test_paired_difference_interval_covers_the_true_difference_about_95_percent_of_the_time():
    # per-window values of the baseline vary a lot between windows; the model adds 0.3 ± noise
    def draw(rng, n):
        base = rng.normal(2.0, 1.0, n)
        return base + 0.3 + rng.normal(0, 0.5, n), base

    draw.interval = lambda a, b, c: bootstrap.paired_interval(a, b, c, "difference")
    assert 0.90 <= _coverage(draw, truth=0.3) <= 0.99


def test_ratio_of_means_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    # gamma-distributed CVs; the model's windows are 0.8x the baseline's in expectation
    def draw(rng, n):
        base = rng.gamma(4.0, 0.1, n)  # mean 0.4
        return base * rng.gamma(25.0, 0.8 / 25.0, n), base  # independent factor with mean 0.8

    draw.interval = lambda a, b, c: bootstrap.paired_interval(a, b, c, "ratio")
    assert 0.90 <= _coverage(draw, truth=0.8, n=60) <= 0.99


def test_mean_interval_covers_the_true_mean_of_a_skewed_distribution():
    def draw(rng, n):
        return rng.exponential(1.5, n), None

    draw.interval = lambda a, b, c: bootstrap.mean_interval(a, c)
    assert 0.90 <= _coverage(draw, truth=1.5, n=60) <= 0.99


def test_resampling_documents_covers_when_windows_of_a_document_are_alike_and_resampling_windows_does_not():
    """#16: windows of one document share a document effect; resampled one by one they give intervals far
    too narrow (about half cover), resampled by document about 95% cover."""
    rng = np.random.default_rng(2024)
    n_docs, per_doc, reps = 30, 8, 200
    docs = np.repeat(np.arange(n_docs), per_doc)
    by_window = by_document = 0
    for rep in range(reps):
        v = rng.normal(0, 1, n_docs)[docs] + rng.normal(0, 0.3, docs.size)  # true mean 0
        _, lo, hi = bootstrap.mean_interval(v, bootstrap.resample_counts(docs.size, 400, seed=rep))
        by_window += lo <= 0 <= hi
        _, lo, hi = bootstrap.mean_interval(v, bootstrap.cluster_counts(docs, 400, seed=rep))
        by_document += lo <= 0 <= hi
    assert 0.90 <= by_document / reps <= 0.99
    assert by_window / reps < 0.75


def test_cluster_counts_take_whole_documents_and_equal_window_counts_for_one_window_per_document():
    docs = np.array([7, 7, 3, 3, 3, 9])
    c = bootstrap.cluster_counts(docs, 200, seed=5)
    assert c.shape == (200, 6)
    assert (c[:, 0] == c[:, 1]).all() and (c[:, 2] == c[:, 3]).all() and (c[:, 3] == c[:, 4]).all()
    np.testing.assert_array_equal(c, bootstrap.cluster_counts(docs, 200, seed=5))  # seeded
    np.testing.assert_array_equal(bootstrap.cluster_counts(np.arange(9), 50, seed=2), bootstrap.resample_counts(9, 50, seed=2))
    plan = bootstrap.Resamples(6, 200, seed=5, groups=docs, max_cells=12)  # chunks of two resamples
    np.testing.assert_array_equal(plan.matrix(), c)


def test_vectorised_intervals_equal_the_one_metric_functions():
    rng = np.random.default_rng(0)
    a, b = rng.normal(1, 1, (50, 4)), rng.normal(1.2, 1, (50, 4))
    a[3, 1] = np.nan
    counts = bootstrap.resample_counts(50, 400, seed=3)
    est, lo, hi = bootstrap.paired_intervals(a, b, np.array([False, True, False, True]), counts)
    for j, kind in enumerate(["difference", "ratio", "difference", "ratio"]):
        np.testing.assert_allclose((est[j], lo[j], hi[j]), bootstrap.paired_interval(a[:, j], b[:, j], counts, kind))
    est, lo, hi = bootstrap.mean_intervals(a, counts)
    np.testing.assert_allclose((est[1], lo[1], hi[1]), bootstrap.mean_interval(a[:, 1], counts))


def test_resampling_is_seeded_and_the_number_of_resamples_is_a_parameter():
    c1, c2 = bootstrap.resample_counts(30, 500, seed=7), bootstrap.resample_counts(30, 500, seed=7)
    np.testing.assert_array_equal(c1, c2)
    assert c1.shape == (500, 30) and (c1.sum(1) == 30).all()
    assert not np.array_equal(c1, bootstrap.resample_counts(30, 500, seed=8))
    with pytest.raises(ValueError, match="n_resamples must be a positive integer"):
        bootstrap.resample_counts(30, 0)


def test_resamples_in_bounded_chunks_are_the_same_resamples():
    full = bootstrap.resample_counts(50, 300, seed=4)
    plan = bootstrap.Resamples(50, 300, seed=4, max_cells=50 * 7)  # chunks of 7 resamples
    assert plan.chunk == 7
    np.testing.assert_array_equal(np.concatenate(list(plan.chunks())), full)
    v = np.random.default_rng(0).normal(size=(50, 3))
    np.testing.assert_allclose(bootstrap.mean_intervals(v, plan), bootstrap.mean_intervals(v, full))
    big = bootstrap.Resamples(1_000_000, 1000, seed=0)  # a full matrix would hold 10^9 counts
    assert big.chunk * big.n <= 1 << 23


def test_bootstrap_of_a_thousand_windows_a_thousand_times_takes_well_under_two_seconds():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(1000, 16)), rng.normal(size=(1000, 16))
    t0 = time.perf_counter()
    counts = bootstrap.resample_counts(1000, 1000, seed=0)
    bootstrap.paired_intervals(a, b, np.arange(16) % 2 == 0, counts)
    assert time.perf_counter() - t0 < 2.0


# -- verdicts ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "low, high, expected, null, want",
    [
        (-0.5, -0.1, "lower", 0.0, "consistent"),
        (-0.5, -0.1, "higher", 0.0, "contrary"),
        (0.1, 0.4, "higher", 0.0, "consistent"),
        (0.1, 0.4, "lower", 0.0, "contrary"),
        (-0.2, 0.3, "lower", 0.0, "inconclusive"),  # crosses zero
        (-0.2, 0.0, "lower", 0.0, "inconclusive"),  # touches zero: does not exclude it
        (0.85, 0.97, "lower", 1.0, "consistent"),  # ratio below one
        (0.97, 1.08, "lower", 1.0, "inconclusive"),  # ratio interval holding one
        (1.1, 1.4, "lower", 1.0, "contrary"),
        (float("nan"), float("nan"), "lower", 0.0, "inconclusive"),  # no interval
    ],
)
def test_verdict_is_decided_by_where_the_interval_lies(low, high, expected, null, want):
    assert verdict(low, high, expected, null) == want
    assert want in VERDICTS


def test_verdict_rejects_a_direction_it_does_not_know():
    with pytest.raises(ValueError, match="'lower' and 'higher'"):
        verdict(0.1, 0.2, "smaller")


def test_every_compared_metric_has_a_paper_direction_and_a_formula():
    from attnres_probe.analysis.catalog import CATALOG

    for m, exp in EXPECTED.items():
        assert m in metrics.FORMULAS and m in WINDOW_METRICS
        assert exp.direction in ("lower", "higher") and exp.kind in ("ratio", "difference") and exp.claim
    for m, d in CATALOG.items():  # a direction only where the paper's words are quoted
        assert (d.direction is not None) == bool(d.paper) and d.unit and d.formula and d.label
        assert (m in EXPECTED) == (d.direction is not None)


# -- per-window metrics -------------------------------------------------------------------------
@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_window_metrics_of_a_one_window_trace_equal_the_summary(residual):
    trace = Probe(tiny_model(residual)).run(TEXT, backward=True)
    row = window_metrics(trace).iloc[0]
    s = metrics.summary(trace)
    assert list(window_metrics(trace).columns) == list(WINDOW_COLUMNS)
    np.testing.assert_allclose(row[list(WINDOW_METRICS)].to_numpy(float), s[list(WINDOW_METRICS)].to_numpy(float),
                               rtol=1e-9, atol=1e-12, equal_nan=True)


def test_window_metrics_of_a_batch_are_those_of_each_sequence_alone_except_parameter_gradients():
    probe = Probe(tiny_model("block"))
    tokens = sample_tokens(12, batch=3)
    batch = probe.run(tokens, backward=True)
    table = window_metrics(batch)
    assert len(table) == 3 and table["param_grad_cv"].isna().all()  # one backward over all three
    no_grad = [m for m in WINDOW_METRICS if not m.startswith(("act_grad", "param_grad"))]
    for b in range(3):
        alone = window_metrics(probe.run(tokens[b : b + 1], backward=True)).iloc[0]
        np.testing.assert_allclose(table.loc[b, no_grad].to_numpy(float), alone[no_grad].to_numpy(float), rtol=1e-5, atol=1e-7)
        # activation-gradient spreads do not depend on the loss's scale (mean over 3 windows vs 1)
        np.testing.assert_allclose(table.loc[b, ["act_grad_cv", "act_grad_max_min"]].to_numpy(float),
                                   alone[["act_grad_cv", "act_grad_max_min"]].to_numpy(float), rtol=1e-4)


def test_window_metrics_ignore_padding():
    trace = make_trace("full", n_pos=4, n_real=2, rms_out=[5, 1, 2])
    row = window_metrics(trace).iloc[0]
    assert row["rms_out_growth"] == pytest.approx(2.0)
    assert row["locality_distance"] == pytest.approx((0.25 + 0.7) / 2)
    assert row[reference_column("locality_distance")] == pytest.approx((0.5 + 1.0) / 2)  # uniform: [.5 .5], [1/3 x 3]


# -- compare ---------------------------------------------------------------------------------------
def _windows(name: str, residual: str, values: dict[str, np.ndarray], digests: list[str] | None = None) -> Windows:
    n = len(next(iter(values.values())))
    table = pd.DataFrame({"doc": np.arange(n), "start": np.zeros(n, int), "n_tokens": np.full(n, 10),
                          "digest": digests or [f"d{i}" for i in range(n)]})
    for m in WINDOW_COLUMNS:
        table[m] = values.get(m, np.full(n, np.nan))
    pooled = pd.Series({m: float(np.nanmean(table[m])) if table[m].notna().any() else np.nan for m in WINDOW_COLUMNS})
    return Windows(name, residual, table, pooled)


def test_compare_gives_intervals_paired_differences_and_verdicts_on_the_same_windows():
    rng = np.random.default_rng(0)
    base = rng.normal(5, 1, 30)
    ref = reference_column("locality_distance")
    pre = _windows("prenorm", "prenorm", {"mean_loss": base, "param_grad_cv": np.full(30, 0.3) + rng.normal(0, .01, 30)})
    att = _windows("block", "block", {"mean_loss": base - 1 + rng.normal(0, .2, 30),
                                      "locality_distance": np.full(30, 1.0) + rng.normal(0, .1, 30), ref: np.full(30, 1.5),
                                      "param_grad_cv": np.full(30, 0.3) + rng.normal(0, .01, 30)})
    frame = compare_windows([pre, att], n_resamples=500, seed=1)
    row = frame[(frame.metric == "mean_loss") & (frame.model == "block") & (frame.baseline == "prenorm")].iloc[0]
    assert row["comparison"] == "difference" and row["low"] < row["estimate"] < row["high"] < 0
    assert row["verdict"] == "consistent" and row["held"] == 30 and row["windows"] == 30
    loc = frame[(frame.metric == "locality_distance") & (frame.model == "block") & (frame.comparison != "value")]
    assert list(loc["baseline"]) == ["uniform"] and loc.iloc[0]["verdict"] == "consistent"  # against its own reference
    assert loc.iloc[0]["estimate"] == pytest.approx(-0.5, abs=0.05)
    cv = frame[(frame.metric == "param_grad_cv") & (frame.baseline == "prenorm")].iloc[0]
    assert cv["comparison"] == "ratio" and cv["low"] < 1 < cv["high"] and cv["verdict"] == "inconclusive"
    again = compare_windows([pre, att], n_resamples=500, seed=1)
    pd.testing.assert_frame_equal(frame, again)
    other = compare_windows([pre, att], n_resamples=200, seed=2)
    assert not np.allclose(other["low"].dropna(), frame["low"].dropna())


def test_compare_resamples_documents_and_warns_when_they_are_few():
    """#16: four documents of ten alike windows each: the interval spans the documents' spread, the
    note says the intervals are rough; one document gives no interval at all."""
    rng = np.random.default_rng(3)
    docs = np.repeat(np.arange(4), 10)
    base = rng.normal(3, 1, 4)[docs] + rng.normal(0, 0.05, 40)
    model = base + rng.normal(-0.5, 0.6, 4)[docs] + rng.normal(0, 0.05, 40)
    pre = _windows("prenorm", "prenorm", {"mean_loss": base})
    att = _windows("block", "block", {"mean_loss": model})
    for w in (pre, att):
        w.table["doc"], w.table["start"] = docs, np.tile(np.arange(10), 4) * 24
    frame = compare_windows([pre, att], n_resamples=500, seed=0)
    row = frame.query("metric == 'mean_loss' and baseline == 'prenorm'").iloc[0]
    assert row["documents"] == 4 and row["windows"] == 40
    assert "only 4 documents: intervals are rough" in row["note"]
    assert frame.attrs["documents"] == {"prenorm": 4, "block": 4} and frame.attrs["unit"] == "document"
    d = model - base
    window_lo, window_hi = bootstrap.mean_interval(d, bootstrap.resample_counts(40, 500, seed=0))[1:]
    assert row["high"] - row["low"] > 3 * (window_hi - window_lo)  # document effects widen it
    value = frame.query("metric == 'mean_loss' and model == 'block' and comparison == 'value'").iloc[0]
    assert value["documents"] == 4 and "only 4 documents" in value["note"]
    from attnres_probe import analysis

    with pytest.warns(UserWarning, match="Only 4 documents"):  # a notebook's readable table says it too
        table = frame.pipe(analysis.display.readable)
    assert table.attrs["notes"] and "Only 4 documents" in table.attrs["notes"][0]
    one = _windows("prenorm", "prenorm", {"mean_loss": base[:10]})
    one.table["doc"] = 0
    row = compare_windows([one], n_resamples=200).query("metric == 'mean_loss'").iloc[0]
    assert np.isnan(row["low"]) and row["note"].startswith("no interval: 1 document")


def test_compare_names_the_one_quantity_both_sides_read_with_its_unit_and_reference():
    """#31: routing reads every model's normalised weights and is set against the uniform weights on the
    model's own axis (PreNorm's implied weights, grouped as the model groups its sources)."""
    frame = metrics.compare(make_trace("prenorm"), make_trace("full"))
    loc = frame.query("metric == 'locality_distance'").set_index(["model", "comparison"])
    assert loc.loc[("prenorm", "value"), "basis"] == loc.loc[("full", "value"), "basis"] == "normalised weights"
    assert loc.loc[("prenorm", "value"), "estimate"] == pytest.approx(loc.loc[("prenorm", "value"), "reference"])
    assert loc.loc[("full", "value"), "reference"] == pytest.approx((0.5 + 1.0) / 2)  # uniform over the same sources
    comp = loc.loc[("full", "difference")]
    assert comp["baseline"] == "uniform" and comp["unit"].startswith("sources back")
    assert "different quantities" not in frame["note"].str.cat()
    share = frame.query("metric == 'embed_contrib_deep' and comparison != 'value'").iloc[0]
    assert share["basis"] == "contribution shares" and share["baseline"] == "prenorm"
    assert (frame.query("metric == 'mean_loss'")["basis"] == "").all()
    assert not ((frame["model"] == "prenorm") & (frame["comparison"] != "value")).any()  # PreNorm is the reference


def test_a_text_recorded_in_windows_is_one_document():
    trace = make_trace("full", batch=3)
    trace.meta["windows"] = {"n_ctx": trace.tokens.shape[1], "count": 3}
    w = Windows.of_trace(trace)
    assert list(w.table["doc"]) == [0, 0, 0] and list(w.table["start"]) == [0, trace.tokens.shape[1], 2 * trace.tokens.shape[1]]
    assert list(Windows.of_trace(make_trace("full", batch=3)).table["doc"]) == [0, 1, 2]  # a batch of texts


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_one_window_pools_to_its_window_as_summary_does(residual):
    """compare() takes a one-window trace's pooled values from its window row instead of
    summary(): the same float64 arithmetic on the same tokens (only the order of sums may differ)."""
    traces = [make_trace(residual), Probe(tiny_model(residual)).run(sample_tokens(12))]
    for trace in traces:
        pooled, full = Windows.of_trace(trace).pooled, metrics.summary(trace)
        assert set(full.index) <= set(pooled.index)
        np.testing.assert_allclose(pooled[full.index].to_numpy(float), full.to_numpy(float), rtol=1e-12, atol=1e-15)
    two = make_trace(residual, batch=2)  # several windows: pooled is summary's, not one window's
    pooled = Windows.of_trace(two).pooled
    np.testing.assert_array_equal(pooled[list(WINDOW_METRICS)].to_numpy(float), metrics.summary(two).to_numpy(float))


def test_compare_pairs_windows_by_key_not_by_position():
    v = np.arange(1.0, 11.0)
    pre = _windows("prenorm", "prenorm", {"mean_loss": v}, digests=[f"d{i}" for i in range(10)])
    shuffled = _windows("full", "full", {"mean_loss": v[::-1] - 0.5}, digests=[f"d{i}" for i in range(10)][::-1])
    shuffled.table["doc"] = shuffled.table["doc"].to_numpy()[::-1]
    frame = compare_windows([pre, shuffled], n_resamples=200)
    row = frame[(frame.metric == "mean_loss") & (frame.baseline == "prenorm")].iloc[0]
    assert row["estimate"] == pytest.approx(-0.5) and row["low"] == pytest.approx(-0.5) and row["held"] == 10
    assert "paired on the 10 windows" in row["note"]


def test_compare_of_models_on_different_windows_is_unpaired_and_says_so():
    pre = _windows("prenorm", "prenorm", {"mean_loss": np.arange(10.0)}, digests=[f"a{i}" for i in range(10)])
    full = _windows("full", "full", {"mean_loss": np.arange(10.0) + 1}, digests=[f"b{i}" for i in range(10)])
    row = compare_windows([pre, full], n_resamples=300).query("metric == 'mean_loss' and baseline == 'prenorm'").iloc[0]
    assert row["note"].startswith("unpaired") and row["estimate"] == pytest.approx(1.0) and pd.isna(row["held"])


def test_compare_of_one_window_says_there_is_no_interval_and_is_inconclusive():
    probe_traces = [Probe(tiny_model(r), name=r).run(TEXT, backward=True) for r in ("prenorm", "full", "block")]
    frame = metrics.compare(*probe_traces)
    comps = frame[frame["comparison"] != "value"]
    directed = comps["expected"] != ""
    assert (comps.loc[directed, "verdict"] == "inconclusive").all() and (comps.loc[~directed, "verdict"] == "").all()
    assert comps["low"].isna().all()
    assert comps["note"].str.contains("no interval: 1 window").all()
    values = frame[frame["comparison"] == "value"]
    assert values["estimate"].notna().sum() > 0 and (values["windows"] <= 1).all()


def test_compare_of_a_multi_window_trace_keeps_parameter_gradients_pooled_only():
    probe = Probe(tiny_model("full"), name="full")
    base = Probe(tiny_model("prenorm"), name="prenorm")
    tokens = sample_tokens(20, batch=4)
    frame = metrics.compare(base.run(tokens), probe.run(tokens), n_resamples=200)
    row = frame.query("metric == 'param_grad_cv' and baseline == 'prenorm'").iloc[0]
    assert np.isnan(row["estimate"]) and np.isfinite(row["pooled"]) and row["verdict"] == "inconclusive"
    assert "pooled value only" in row["note"]
    loc = frame.query("metric == 'locality_distance' and baseline == 'uniform'").iloc[0]
    assert loc["windows"] == 4 and np.isfinite(loc["low"])


def test_compare_columns_and_the_baseline_choice():
    frame = metrics.compare(make_trace("prenorm"), make_trace("full"), names=["base", "model"])
    assert list(frame.columns) == ["metric", "model", "baseline", "comparison", "basis", "unit", "reference", "estimate",
                                   "low", "high", "pooled", "windows", "documents", "held", "expected", "verdict", "note"]
    assert set(frame.loc[frame.comparison != "value", "baseline"]) == {"base", "uniform"}
    assert frame.attrs["n_resamples"] == 1000 and frame.attrs["baseline"] == "base"
    no_base = metrics.compare(make_trace("full"), make_trace("block"))
    assert set(no_base.loc[no_base.comparison != "value", "baseline"]) == {"uniform"}
    assert list(dict.fromkeys(metrics.compare(make_trace("full"), make_trace("full"))["model"])) == ["full", "full (2)"]
    with pytest.raises(TypeError, match="DepthTrace or CorpusStats"):
        metrics.compare("not a trace")


def test_key_columns_come_first_in_window_tables():
    probe = Probe(tiny_model("full"))
    w = Windows.of_trace(probe.run(sample_tokens(8, batch=2)))
    assert list(w.table.columns[: len(KEY_COLUMNS)]) == list(KEY_COLUMNS) and w.n == 2


def test_readable_groups_a_compare_frame_under_plain_names():
    """#17 item 6: compare's snake_case keys, grouped under the comparisons with plain names."""
    from attnres_probe import Probe, metrics
    from attnres_probe.analysis.display import LABELS, readable

    from helpers import tiny_model

    a = Probe(tiny_model("prenorm"), name="prenorm").run("the cat sat", backward=True)
    b = Probe(tiny_model("full"), name="full").run("the cat sat", backward=True)
    table = metrics.compare(a, b).pipe(readable)
    groups = list(dict.fromkeys(table.index.get_level_values("group")))
    assert groups[:3] == ["Locality", "Embedding retention", "Gradient uniformity"]
    assert LABELS["locality_distance"] in table.loc["Locality"].index
    assert "full vs prenorm" in table.columns and "verdict: full vs prenorm" in table.columns


# -- matched quantities (#31) ------------------------------------------------------------------
_route, _uniform, _local = route, uniform_routing, local_routing


@pytest.mark.parametrize("residual", ["full", "block"])
def test_a_model_forced_to_route_uniformly_gets_no_routing_verdict_and_equals_its_reference(residual):
    """A Block read with equal weights on its blocks gives each sublayer the same coefficient: PreNorm's
    function. Its routing numbers equal the uniform reference, and no routing comparison is decided."""
    tokens = sample_tokens(24, batch=12, seed=5)
    pre = Probe(tiny_model("prenorm"), name="prenorm").run(tokens, backward=True)
    forced = Probe(_route(tiny_model(residual), _uniform), name=residual).run(tokens, backward=True)
    frame = metrics.compare(pre, forced, n_resamples=300)
    routing = frame[frame["basis"] == "normalised weights"]
    values = routing[(routing["model"] == residual) & (routing["comparison"] == "value")]
    np.testing.assert_allclose(values["estimate"], values["reference"], rtol=1e-6, atol=1e-6)
    comps = routing[routing["comparison"] != "value"]
    assert len(comps) == len(routing_names()) and set(comps["verdict"]) <= {"inconclusive", ""}
    assert comps["estimate"].abs().max() < 1e-6


@pytest.mark.parametrize("residual", ["full", "block"])
def test_a_model_with_strongly_local_weights_gets_consistent_locality_verdicts(residual):
    tokens = sample_tokens(24, batch=12, seed=6)
    pre = Probe(tiny_model("prenorm"), name="prenorm").run(tokens, backward=True)
    local = Probe(_route(tiny_model(residual, n_layers=3), _local), name=residual).run(tokens, backward=True)
    frame = metrics.compare(pre, local, n_resamples=300).set_index(["metric", "comparison"])
    assert frame.loc[("locality_distance", "difference"), "verdict"] == "consistent"
    assert frame.loc[("locality_recent_mass", "difference"), "verdict"] == "consistent"


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_a_trace_and_corpus_stats_of_the_same_tokens_pool_to_the_same_values(residual):
    """#31 item 5: one window as a DepthTrace and as a CorpusStats: every diagnostic's pooled value is
    the same function of the same tokens (the stats from their windows and their per-token means)."""
    probe = Probe(tiny_model(residual, n_layers=2, n_ctx=64), name=residual)
    text = "def area(r):\n    return 3.14159 * r * r\n\nprint(area(2.0))\n"
    trace = probe.run(text, backward=True)
    stats = probe.run_corpus([text], backward=True, progress=False)
    a, b = Windows.of_trace(trace).pooled, Windows.of_stats(stats).pooled
    for m in WINDOW_COLUMNS:
        assert a[m] == pytest.approx(b[m], rel=1e-5, abs=1e-7, nan_ok=True), m


@pytest.mark.parametrize("residual", ["full", "block"])
def test_embedding_weight_before_attention_and_before_the_mlp_are_measured_apart(residual):
    """#31: the embedding's weight in the deep reads, split by the sublayer a read feeds. Attention reads
    are set to give the embedding 0.6 (the rest spread evenly), MLP reads to uniform weights."""
    model = tiny_model(residual, n_layers=4)

    def embed_heavy(w, k):
        cols = torch.arange(w.shape[-1])
        return torch.where(cols < k, torch.where(cols == 0, 0.6, 0.4 / max(k - 1, 1)), 0.0).expand_as(w)

    for name, mixer in zip(model.read_labels, model.mixers):
        edit = embed_heavy if name.endswith("attn") else _uniform
        mixer.hook_weights.add_hook(lambda w, hook, k=mixer.visible, edit=edit: edit(w, k))
    trace = Probe(model, name=residual).run(sample_tokens(16, batch=3, seed=2))
    table = window_metrics(trace)
    if residual == "full":
        np.testing.assert_allclose(table["embed_weight_deep_attn"], 0.6, rtol=1e-5)
    else:  # normalised weights: a block's softmax weight times its members, over the sum (the embedding has one)
        assert (table["embed_weight_deep_attn"] > table[reference_column("embed_weight_deep_attn")] + 0.1).all()
    deep_mlp = [r for r in range(len(trace.read_labels) // 2, len(trace.read_labels)) if trace.read_labels[r].endswith(".mlp")]
    uniform_share = np.mean([1.0 / np.isfinite(trace.weights(read=trace.read_labels[r]).to_numpy()).sum(-1).max() for r in deep_mlp])
    np.testing.assert_allclose(table["embed_weight_deep_mlp"], table[reference_column("embed_weight_deep_mlp")], rtol=1e-5)
    if residual == "full":
        assert table["embed_weight_deep_mlp"].iloc[0] == pytest.approx(uniform_share, rel=1e-5)


def test_a_window_table_saved_before_the_attention_mlp_split_loads_with_those_columns_empty(tmp_path):
    from attnres_probe.analysis.windows import LATER_COLUMNS
    from attnres_probe.corpus.stats import CorpusStats

    probe = Probe(tiny_model("full", n_layers=2, n_ctx=32), name="full")
    stats = probe.run_corpus(["one text here", "and another text"], backward=True, progress=False)
    folder = stats.save(tmp_path / "s")
    tables = list(folder.rglob("*.parquet"))
    assert tables, "the stats folder holds its window table as Parquet"
    import json

    from attnres_probe.io import sha256_file

    doc = json.loads((folder / "stats.json").read_text())
    for path in tables:  # the table an earlier version saved, with its checksum
        pd.read_parquet(path).drop(columns=list(LATER_COLUMNS)).to_parquet(path)
        doc["files"][path.name] = sha256_file(path)
    (folder / "stats.json").write_text(json.dumps(doc))
    back = CorpusStats.load(folder)
    t = back.window_table()
    assert t[list(LATER_COLUMNS)].isna().all().all() and t["embed_weight_deep"].notna().all()


def test_display_snaps_float_roundoff_to_zero_and_prints_a_reference_as_precisely_as_its_value():
    """#31 walkthrough: PreNorm's embedding-against-old-sources printed as 3.084e-18; a value 0.08019
    beside "uniform: 0.0802" looked like a difference that is not there."""
    from attnres_probe.analysis.display import fmt_estimate, fmt_interval, headline, table_rows

    row = {"estimate": 3.084e-18, "comparison": "value", "pooled": 3.084e-18, "low": 3.084e-18, "high": 3.1e-18}
    assert fmt_estimate(row) == "0" and fmt_interval(row) == "[0, 0]"
    assert fmt_estimate({**row, "estimate": -0.0123}) == "-0.0123"  # real values untouched
    tokens = sample_tokens(24, batch=6, seed=3)
    frame = metrics.compare(Probe(tiny_model("prenorm"), name="prenorm").run(tokens, backward=True),
                            Probe(tiny_model("block", n_layers=4), name="block").run(tokens, backward=True), n_resamples=100)
    loc = next(m for g in headline(frame) for m in g["metrics"] if m["metric"] == "locality_distance")
    pre = next(r for r in loc["rows"] if r["model"] == "prenorm")
    assert pre["own"] == "is the uniform reference (implied weights)" and pre["estimate"] == pre["reference"]
    cells = next(r for r in table_rows(frame)["rows"] if r["metric"] == "locality_distance")["cells"]
    assert all("(uniform " in c for c in cells[:2])  # each model's value with its own uniform reference
