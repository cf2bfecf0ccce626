"""CorpusStats: per-window values kept, mergeable by Chan's update, saved without pickle, and
refusing the stats of another model with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnres_probe import Probe, metrics
from attnres_probe.analysis.windows import WINDOW_COLUMNS
from attnres_probe.corpus.stats import CorpusStats, StatsError

from helpers import tiny_model

DOCS = [
    "The first document is long enough to fill more than two windows of the tiny model.",
    "A second one.",
    "x",  # one token: left out
    "Third document, medium length text.",
    "",
    "Fourth and last document of the little corpus, also several windows long.",
]


@pytest.fixture(scope="module")
def probe():
    return Probe(tiny_model("block"), name="block")


@pytest.fixture(scope="module")
def whole(probe):
    return probe.run_corpus(DOCS, batch_size=3, backward=True, progress=False)


def test_every_window_keeps_its_value_of_every_headline_metric(whole):
    table = whole.window_table()
    assert len(table) == whole.n_windows == whole.n_sequences
    assert list(table.columns[4:]) == list(WINDOW_COLUMNS)
    assert table[list(WINDOW_COLUMNS)].notna().all().all()  # per-window grads too
    short = sum(len(d[i : i + 24]) < 2 for d in DOCS for i in range(0, len(d), 24))  # n_ctx 24
    assert short == 2 and whole.n_skipped == short and sorted(set(table["doc"])) == [0, 1, 3, 5]
    assert (table["n_tokens"] >= 2).all() and table["n_tokens"].sum() == whole.n_tokens


def test_merging_shards_equals_one_run_over_all_documents(probe, whole):
    a = probe.run_corpus(DOCS[:3], batch_size=3, backward=True, progress=False)
    b = probe.run_corpus(DOCS[3:], batch_size=2, backward=True, progress=False, first_doc=3)
    merged = a.merge(b)
    assert (merged.n_tokens, merged.n_windows, merged.n_skipped) == (whole.n_tokens, whole.n_windows, whole.n_skipped)
    for name in ("depth_weights", "contrib", "rms_in", "grad_in", "loss", "param_grad"):
        np.testing.assert_allclose(merged.mean(name), whole.mean(name), rtol=1e-9, atol=1e-12, equal_nan=True)
        np.testing.assert_allclose(merged.var(name), whole.var(name), rtol=1e-7, atol=1e-12, equal_nan=True)
    np.testing.assert_allclose(merged.profile("rms_in").to_numpy(float), whole.profile("rms_in").to_numpy(float), rtol=1e-9)
    t1, t2 = merged.window_table(), whole.window_table()
    assert t1[["doc", "start", "digest"]].equals(t2[["doc", "start", "digest"]])
    np.testing.assert_allclose(t1[list(WINDOW_COLUMNS)].to_numpy(float), t2[list(WINDOW_COLUMNS)].to_numpy(float),
                               rtol=1e-9, equal_nan=True)


def test_merge_refuses_the_stats_of_another_model_with_the_reason(whole):
    other = Probe(tiny_model("block", d_model=16), name="block").run_corpus(["Some text here."], progress=False)
    with pytest.raises(StatsError, match=r"different models \(config .*d_model: 32 vs 16"):
        whole.merge(other)
    full = Probe(tiny_model("full"), name="full").run_corpus(["Some text here."], progress=False)
    with pytest.raises(StatsError, match="residual: 'block' vs 'full'"):
        whole.merge(full)


def test_merge_refuses_a_window_recorded_twice(probe, whole):
    again = probe.run_corpus(DOCS[:1], progress=False)
    with pytest.raises(StatsError, match="document 0, offset 0"):
        whole.merge(again)


def test_save_and_load_give_back_the_same_stats_without_pickle(whole, tmp_path):
    whole.save(tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["arrays.npz", "stats.json", "windows.parquet"]
    back = CorpusStats.load(tmp_path / "s")
    assert (back.n_tokens, back.n_windows, back.n_skipped, back.n_batches) == (whole.n_tokens, whole.n_windows, 2, whole.n_batches)
    for name in whole.stats:
        np.testing.assert_array_equal(back.stats[name].m2, whole.stats[name].m2)
        np.testing.assert_array_equal(back.stats[name].count, whole.stats[name].count)
    assert back.window_table().equals(whole.window_table())
    f1, f2 = metrics.compare(back, n_resamples=100), metrics.compare(whole, n_resamples=100)
    assert f1.equals(f2)
    whole.save(tmp_path / "s")  # replacing a stats folder is allowed
    assert CorpusStats.load(tmp_path / "s").n_windows == whole.n_windows


def test_loading_refuses_corrupt_or_foreign_folders(whole, tmp_path):
    with pytest.raises(StatsError, match="is not a saved CorpusStats folder"):
        CorpusStats.load(tmp_path)
    whole.save(tmp_path / "s")
    (tmp_path / "s" / "windows.parquet").write_bytes(b"garbage")
    with pytest.raises(StatsError, match="does not match the checksum"):
        CorpusStats.load(tmp_path / "s")
    whole.save(tmp_path / "t")
    doc = json.loads((tmp_path / "t" / "stats.json").read_text())
    doc["schema_version"] = 99
    (tmp_path / "t" / "stats.json").write_text(json.dumps(doc))
    with pytest.raises(StatsError, match="upgrade attnres-probe"):
        CorpusStats.load(tmp_path / "t")
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not corpus stats"):
        whole.save(tmp_path / "u")


def test_profiles_give_bands_across_windows(whole):
    prof = whole.profile("rms_in")
    assert list(prof.columns) == ["mean", "low", "high", "sd", "windows"]
    assert (prof["low"] <= prof["mean"]).all() and (prof["mean"] <= prof["high"]).all()
    assert (prof["windows"] == whole.n_windows).all()
    assert len(whole.profile("param_grad")) == len(whole.meta["read_labels"]) - 1
    with pytest.raises(ValueError, match="is not one of"):
        whole.profile("weights")


def test_profile_bands_of_a_spread_out_positive_quantity_stay_above_zero():
    """#16: gradient norms that vary over orders of magnitude between windows: mean ± z·se crosses zero
    (a band below zero on a log axis); the log-scale interval stays positive, around the mean."""
    from attnres_probe.corpus.stats import RunningStats

    stats = CorpusStats(meta={"read_labels": ["L0.attn", "L0.mlp", "final"]})
    g = np.random.default_rng(0).lognormal(0.0, 2.0, size=(5, 3))  # 5 windows, 3 reads
    stats.profiles["grad_in"] = RunningStats.zeros((3,))
    stats.profiles["grad_in"].update(g)
    prof = stats.profile("grad_in")
    mean, sd = g.mean(0), g.std(0, ddof=1)
    assert (mean - 1.96 * sd / np.sqrt(5) < 0).any()  # the normal interval would cross zero
    assert (prof["low"] > 0).all() and (prof["low"] < prof["mean"]).all() and (prof["mean"] < prof["high"]).all()
    np.testing.assert_allclose(prof["low"] * prof["high"], prof["mean"] ** 2)  # as wide on a log axis both ways
    np.testing.assert_allclose(prof["mean"], mean)


def test_run_corpus_refuses_a_corpus_of_only_short_windows_and_an_empty_one(probe):
    with pytest.raises(ValueError, match="no window of at least 2 tokens"):
        probe.run_corpus(["a", "b"], progress=False)
    with pytest.raises(ValueError, match="every text was empty"):
        probe.run_corpus(["", ""], progress=False)


def test_a_resumed_run_equals_an_uninterrupted_one(probe, whole):
    seen = []
    part = probe.run_corpus(DOCS[:2], batch_size=3, backward=True, progress=False, on_batch=lambda s, k: seen.append(k))
    assert seen[-1] == (1, 0)
    rest = probe.run_corpus(DOCS, batch_size=3, backward=True, progress=False, stats=part, resume_after=seen[-1])
    assert rest.window_table()[["doc", "start", "digest"]].equals(whole.window_table()[["doc", "start", "digest"]])
    np.testing.assert_allclose(rest.mean("depth_weights"), whole.mean("depth_weights"), rtol=1e-9, equal_nan=True)
    assert rest.n_skipped == whole.n_skipped


def test_continuing_stats_with_another_model_is_refused(whole):
    with pytest.raises(StatsError, match="different models"):
        Probe(tiny_model("full"), name="full").run_corpus(DOCS, progress=False, stats=whole)


def test_asking_for_an_aggregate_says_which_names_are_valid(whole):
    """#17 item 8: no bare TypeError / KeyError; repr lists the names; stats.stats does not dump arrays."""
    with pytest.raises(TypeError, match="depth_weights"):
        whole.mean()
    with pytest.raises(KeyError) as err:
        whole.mean("foo")
    assert "'foo' is not an aggregate" in str(err.value) and "depth_weights" in str(err.value)
    with pytest.raises(ValueError, match="valid names"):  # also a ValueError, for code that catches those
        whole.var("foo")
    np.testing.assert_array_equal(whole.mean("weights"), whole.mean("depth_weights"), strict=False)
    assert "depth_weights" in repr(whole) and "contrib" in repr(whole) and whole.names == list(whole.stats)
    text = repr(whole.stats)
    assert len(text) < 200 * len(whole.stats) and "array(" not in text and "observations=" in text
