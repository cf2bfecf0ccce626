"""metrics: every number checked by hand on small synthetic traces (see trace_factory for the cubes)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnres_probe import metrics

from trace_factory import make_trace

nan = np.nan


def _h(*p):
    return -sum(x * math.log(x) for x in p if x > 0)


# -- locality -------------------------------------------------------------------------------
def test_locality_distance_and_recent_mass_match_hand_values_for_full():
    # reads: [1], [.25 .75], [.2 .3 .5] -> E[d] = 0, .25, .2*2+.3 = .7; recent = 1, .75, .5
    loc = metrics.locality(make_trace("full"))
    assert list(loc.index) == ["L0.attn", "L0.mlp", "final"]
    np.testing.assert_allclose(loc["distance"], [0.0, 0.25, 0.7], atol=1e-6)
    np.testing.assert_allclose(loc["recent_mass"], [1.0, 0.75, 0.5], atol=1e-6)
    assert list(loc["sources"]) == [1, 2, 3]


def test_locality_does_not_count_unavailable_cells_as_zero_weight_sources():
    # read L0.mlp sees 2 of 3 columns: distances are 1, 0 (not 2, 1 as if the NaN column were a source)
    loc = metrics.locality(make_trace("full"))
    assert loc.loc["L0.mlp", "distance"] == pytest.approx(0.25)


def test_locality_averages_over_real_tokens_and_ignores_padding():
    other = [[1.0, nan, nan], [0.75, 0.25, nan], [0.2, 0.3, 0.5]]
    trace = make_trace("full", n_pos=4, n_real=2, per_token={1: other})  # position 2, 3: padding (9.0)
    loc = metrics.locality(trace)
    assert loc.loc["L0.mlp", "distance"] == pytest.approx((0.25 + 0.75) / 2)
    assert loc.loc["L0.mlp", "recent_mass"] == pytest.approx((0.75 + 0.25) / 2)


def test_locality_uses_block_columns_with_the_partial_as_most_recent():
    # block weights per read: [1], [.5 .5], [.4 .6], [.1 .2 .7], [.3 .3 .4]; the members of each column
    # (embed 1, a block's sublayers, the partial block's so far): [1], [1 1], [1 2], [1 2 1], [1 2 2];
    # normalised weights w = a m / sum(a m): [1], [.5 .5], [.4 1.2]/1.6, [.1 .4 .7]/1.2, [.3 .6 .8]/1.7
    loc = metrics.locality(make_trace("block"))
    np.testing.assert_allclose(loc["distance"], [0.0, 0.5, 0.25, 0.5, 1.2 / 1.7], atol=1e-6)
    np.testing.assert_allclose(loc["recent_mass"], [1.0, 0.5, 0.75, 0.7 / 1.2, 0.8 / 1.7], atol=1e-6)


def test_locality_reads_prenorms_implied_uniform_weights_and_shares_on_request():
    # PreNorm's normalised weights are uniform: [1], [.5 .5], [1/3 x 3] -> E[d] = 0, .5, 1; recent 1, .5, 1/3
    loc = metrics.locality(make_trace("prenorm"))
    np.testing.assert_allclose(loc["distance"], [0.0, 0.5, 1.0], atol=1e-6)
    np.testing.assert_allclose(loc["recent_mass"], [1.0, 0.5, 1 / 3], atol=1e-6)
    # contrib: [1], [.6 .4], [.5 -.1 .6] -> E[d] = 0, .6, .5*2 - .1 = .9
    shares = metrics.locality(make_trace("prenorm"), kind="contrib")
    np.testing.assert_allclose(shares["distance"], [0.0, 0.6, 0.9], atol=1e-6)


def test_locality_rejects_logits_as_kind():
    with pytest.raises(ValueError, match="'auto', 'weights' or 'contrib'"):
        metrics.locality(make_trace("full"), kind="logits")


# -- retention ------------------------------------------------------------------------------
def test_embedding_retention_gives_source_zero_weight_and_contrib_per_read():
    ret = metrics.embedding_retention(make_trace("block"))  # w_0 = a_0 / sum(a m) (see the locality test)
    np.testing.assert_allclose(ret["embed_weight"], [1.0, 0.5, 0.4 / 1.6, 0.1 / 1.2, 0.3 / 1.7], atol=1e-6)
    np.testing.assert_allclose(ret["embed_contrib"], [1.0, 0.5, 0.4, 0.1, 0.3], atol=1e-6)


def test_embedding_retention_weight_of_prenorm_is_its_uniform_share():
    ret = metrics.embedding_retention(make_trace("prenorm"))
    np.testing.assert_allclose(ret["embed_weight"], [1.0, 0.5, 1 / 3], atol=1e-6)
    np.testing.assert_allclose(ret["embed_contrib"], [1.0, 0.6, 0.5], atol=1e-6)


# -- entropy --------------------------------------------------------------------------------
def test_entropy_is_normalised_by_log_of_available_sources():
    ent = metrics.entropy(make_trace("full"))
    assert np.isnan(ent["L0.attn"])  # k = 1: no choice
    assert ent["L0.mlp"] == pytest.approx(_h(0.25, 0.75) / math.log(2), abs=1e-6)
    assert ent["final"] == pytest.approx(_h(0.2, 0.3, 0.5) / math.log(3), abs=1e-6)


def test_entropy_of_uniform_weights_is_one():
    cube = [[1.0, nan, nan], [0.5, 0.5, nan], [1 / 3, 1 / 3, 1 / 3]]
    ent = metrics.entropy(make_trace("full", cube))
    np.testing.assert_allclose(ent.to_numpy()[1:], [1.0, 1.0], atol=1e-6)


def test_entropy_with_contrib_uses_normalised_absolute_shares():
    ent = metrics.entropy(make_trace("prenorm"), kind="contrib")  # final c = [.5, -.1, .6] -> p = [.5, .1, .6] / 1.2
    assert ent["final"] == pytest.approx(_h(0.5 / 1.2, 0.1 / 1.2, 0.6 / 1.2) / math.log(3), abs=1e-6)


# -- gradients ------------------------------------------------------------------------------
def test_gradient_uniformity_cv_and_max_min_by_hand():
    # block, 2 layers: per-sublayer parameter norms [3 4 | 6 8] -> per transformer block 5, 10: mean 7.5,
    # population std 2.5 -> cv 1/3, max/min 2; attention [3 6] and MLP [4 8] alone: cv 1/3 each.
    # ||dL/dv_j|| at the sublayer outputs [2 4 2 4] (the embedding's 100 left out): cv 1/3, max/min 2,
    # first quarter over last quarter 2/4; the gradients at the mixed inputs (grad_in) are not read
    trace = make_trace("block", param_grad=[3.0, 4.0, 6.0, 8.0], grad_out=[100.0, 2.0, 4.0, 2.0, 4.0],
                       grad_in=[9.0, 1.0, 9.0, 1.0, 9.0])
    g = metrics.gradient_uniformity(trace)
    assert g["param_grad_cv"] == pytest.approx(1 / 3) and g["param_grad_max_min"] == pytest.approx(2.0)
    assert g["param_grad_attn_cv"] == pytest.approx(1 / 3) and g["param_grad_mlp_cv"] == pytest.approx(1 / 3)
    assert g["act_grad_cv"] == pytest.approx(1 / 3) and g["act_grad_max_min"] == pytest.approx(2.0)
    assert g["act_grad_early_late"] == pytest.approx(0.5)


def test_gradient_uniformity_is_nan_without_gradients():
    g = metrics.gradient_uniformity(make_trace("full"))
    assert g.isna().all()


# -- magnitudes -----------------------------------------------------------------------------
def test_magnitude_growth_of_what_sublayers_write_and_of_what_reads_see_as_a_mixture():
    # block, L = 4: rms_out [embed 7 | 1 1 1 3] -> last quarter over first 3/1 (one sublayer each);
    # slope of ln[1 1 1 3] = .3 ln 3. The mixture h_r / sum(a m): rms_in [1 2 4 8 | final 50] over
    # sum(a m) = 1, 1, 1.6, 1.2 -> [1, 2, 2.5, 6.67] over the sublayer reads -> 6.67 / 1
    trace = make_trace("block", rms_in=[1, 2, 4, 8, 50], rms_out=[7, 1, 1, 1, 3])
    g = metrics.magnitude_growth(trace)
    assert g["rms_out_growth"] == pytest.approx(3.0)
    assert g["rms_out_log_slope"] == pytest.approx(0.3 * math.log(3))
    assert g["rms_mix_growth"] == pytest.approx(8 / 1.2)


def test_read_profile_is_labelled_by_read():
    prof = metrics.read_profile(make_trace("full", rms_in=[1, 2, 4]))
    assert list(prof.index) == ["L0.attn", "L0.mlp", "final"]
    np.testing.assert_allclose(prof["rms_in"], [1, 2, 4])


# -- summary / compare ----------------------------------------------------------------------
def test_summary_headline_numbers_by_hand():
    s = metrics.summary(make_trace("full", rms_out=[5, 1, 4]))
    assert s["locality_distance"] == pytest.approx((0.25 + 0.7) / 2)  # reads with >= 2 sources
    assert s["locality_recent_mass"] == pytest.approx((0.75 + 0.5) / 2)
    assert s["embed_weight_deep"] == pytest.approx((0.25 + 0.2) / 2)  # reads 1, 2 of R = 3
    assert s["embed_vs_old_deep"] == pytest.approx(0.2 - 0.3)  # the final read: embed .2, the old source .3
    assert s["mean_entropy"] == pytest.approx((_h(0.25, 0.75) / math.log(2) + _h(0.2, 0.3, 0.5) / math.log(3)) / 2)
    assert s["rms_out_growth"] == pytest.approx(4.0)
    assert np.isnan(s["param_grad_cv"])  # no gradients recorded
    assert s["mean_loss"] == pytest.approx(2.0)


def test_every_summary_metric_has_a_formula():
    s = metrics.summary(make_trace("block"))
    assert set(s.index) <= set(metrics.FORMULAS)
    loc, ret = metrics.locality(make_trace("full")), metrics.embedding_retention(make_trace("full"))
    assert set(loc.columns) | set(ret.columns) | {"entropy"} <= set(metrics.FORMULAS)


def test_compare_sets_each_model_against_the_prenorm_baseline_as_ratio_or_difference():
    pre = make_trace("prenorm", rms_out=[1, 1, 4], loss=3.0)
    full = make_trace("full", rms_out=[1, 1, 2], loss=2.5)
    df = metrics.compare(pre, full)
    comp = df[(df["comparison"] != "value") & (df["baseline"] == "prenorm")].set_index("metric")
    assert set(comp["model"]) == {"full"}
    assert comp.loc["rms_out_growth", "estimate"] == pytest.approx(2.0 / 4.0)  # ratio
    assert comp.loc["rms_out_growth", "comparison"] == "ratio"
    assert comp.loc["mean_loss", "estimate"] == pytest.approx(-0.5)  # difference
    assert comp.loc["mean_loss", "comparison"] == "difference"
    values = df[df["comparison"] == "value"]
    assert list(dict.fromkeys(values["model"])) == ["prenorm", "full"]


def test_compare_without_baseline_sets_routing_against_uniform_only_and_uses_given_names():
    df = metrics.compare(make_trace("full"), make_trace("block"), names=["a", "b"])
    assert list(dict.fromkeys(df["model"])) == ["a", "b"]
    comps = df[df["comparison"] != "value"]
    assert set(comps["baseline"]) == {"uniform"} and set(comps["basis"]) == {"normalised weights"}


def test_prenorms_read_mixture_is_its_sum_over_k():
    # rms_in of the sums [1, 4 | final 9] over k = 1, 2 -> mixtures [1, 2]: last quarter over first 2
    s = metrics.summary(make_trace("prenorm", rms_in=[1, 4, 9]))
    assert s["rms_mix_growth"] == pytest.approx(2.0)
