"""Intervals over seeds and windows (analysis.seeds): they cover a recipe's mean when seeds differ,
where an interval over windows alone does not, and pair each seed's model with its own baseline."""

from __future__ import annotations

import numpy as np
import pytest

from attnres_probe.analysis import bootstrap
from attnres_probe.analysis.seeds import crossed_counts, crossed_means, seed_interval


def test_draws_are_seeded_and_count_whole_documents():
    cs, cw = crossed_counts(3, np.array([0, 0, 1, 1, 1, 2]), n_resamples=50, seed=4)
    cs2, cw2 = crossed_counts(3, np.array([0, 0, 1, 1, 1, 2]), n_resamples=50, seed=4)
    assert np.array_equal(cs, cs2) and np.array_equal(cw, cw2)
    assert (cs.sum(1) == 3).all()
    assert (cw[:, 0] == cw[:, 1]).all() and (cw[:, 2] == cw[:, 4]).all()  # a document's windows go together


def test_crossed_means_leave_out_missing_cells():
    v = np.array([[1.0, np.nan], [3.0, 5.0]])
    cs, cw = np.array([[1, 1], [2, 0]]), np.array([[1, 1], [1, 1]])
    np.testing.assert_allclose(crossed_means(v, cs, cw), [3.0, 1.0])


def test_intervals_over_seeds_cover_the_recipe_mean_where_windows_alone_do_not():
    """Seeds differ (a seed effect of sd 1) far more than windows average out: the crossed interval covers
    the recipe's mean in about 95% of repetitions; the interval over windows of the pooled seeds rarely does."""
    rng = np.random.default_rng(0)
    n_seeds, n_windows, reps = 12, 40, 200
    covered = covered_windows_only = 0
    for r in range(reps):
        values = rng.normal(0, 1, (n_seeds, 1)) + rng.normal(0, 0.5, (1, n_windows)) + rng.normal(0, 0.3, (n_seeds, n_windows))
        _, lo, hi = seed_interval(values, n_resamples=400, seed=r)
        covered += lo <= 0 <= hi
        pooled = values.mean(0)  # the seeds averaged per window, then windows resampled alone
        _, lo_w, hi_w = bootstrap.mean_interval(pooled, bootstrap.resample_counts(n_windows, 400, r))
        covered_windows_only += lo_w <= 0 <= hi_w
    assert 0.85 <= covered / reps <= 0.99, covered / reps  # few seeds: percentile intervals run a little narrow
    assert covered_windows_only / reps < 0.6, covered_windows_only / reps


def test_paired_comparisons_pair_each_seed_with_its_own_baseline():
    rng = np.random.default_rng(1)
    seed_effect = rng.normal(0, 5, (3, 1))  # large, shared by a seed's model and its baseline
    base = seed_effect + rng.normal(0, 0.1, (3, 64)) + 10
    model = base - 1.0 + rng.normal(0, 0.1, (3, 64))
    est, lo, hi = seed_interval(model, base, "difference", n_resamples=500)
    assert est == pytest.approx(-1.0, abs=0.05) and hi < -0.8  # the shared seed effect cancels
    est_r, lo_r, hi_r = seed_interval(model, base, "ratio", n_resamples=500)
    assert lo_r <= est_r <= hi_r < 1.0


def test_bad_shapes_and_kinds_are_refused():
    with pytest.raises(ValueError, match="differ in shape"):
        seed_interval(np.ones((2, 3)), np.ones((3, 3)))
    with pytest.raises(ValueError, match="seeds, windows"):
        seed_interval(np.ones(3))
    with pytest.raises(ValueError, match="kind"):
        seed_interval(np.ones((2, 3)), np.ones((2, 3)), "log")
