"""Routing patching (issue #34 item 5): Probe.patch on the demo models.

"Exactly" means within the frame's ``attrs["tolerance"]``, the bound from float32 roundoff
(:func:`attnres_probe.patching.metric_roundoff`: C u G times the logits' scale, for each of the two
runs compared, over the clean - corrupted difference); each sanity check also checks that the
bound is tight enough to tell 0 from 1, so a wrong patch cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnres_probe import Probe, load_demo
from attnres_probe.patching import (
    UNIT,
    Patch,
    SamePrediction,
    _short_pair,
    logit_difference,
    metric_roundoff,
    patched_metrics,
    patching_bars,
    patching_heatmap,
    record_donor,
)

CLEAN = "I pray you, sir"  # the demo models predict ','
CORRUPT = "I pray you, lad"  # and 'y': one token length, two predictions
NAMES = ("full", "block")


@pytest.fixture(scope="module")
def probes() -> dict[str, Probe]:
    return {name: Probe(load_demo(name)[0], name=name) for name in NAMES}


@pytest.fixture(scope="module")
def per_read(probes) -> dict:
    return {name: p.patch(CLEAN, CORRUPT) for name, p in probes.items()}


def _tol(frame) -> float:
    tol = frame.attrs["tolerance"]
    assert 0 < tol < 0.01, f"the roundoff bound {tol} cannot tell 0 from 1"
    return tol


# -- sanity checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_patching_nothing_recovers_zero(probes, name):
    frame = probes[name].patch(CLEAN, CORRUPT, positions=[])
    assert len(frame) == len(probes[name].spec.read_labels)
    assert np.abs(frame["recovered"].to_numpy()).max() <= _tol(frame)


@pytest.mark.parametrize("name", NAMES)
def test_patching_the_corrupted_runs_own_weights_into_itself_recovers_zero(probes, name, per_read):
    probe, ref = probes[name], per_read[name]
    corrupted, _ = probe.tokenize(CORRUPT)
    own = record_donor(probe, corrupted)
    metric = logit_difference(-1, ref.attrs["clean_top"], ref.attrs["corrupted_top"])
    runs = [[Patch(r)] for r in range(len(probe.spec.read_labels))] + [[Patch(r) for r in range(len(probe.spec.read_labels))]]
    values = patched_metrics(probe, corrupted, own, runs, metric)
    recovered = (values - ref.attrs["metric_corrupted"]) / ref.attrs["denominator"]
    assert np.abs(recovered).max() <= _tol(ref)


@pytest.mark.parametrize("name", NAMES)
def test_patching_everything_recovers_one(probes, name):
    probe = probes[name]
    final = probe.patch(CLEAN, CORRUPT, what="input", reads=["final"])
    every_input = probe.patch(CLEAN, CORRUPT, what="input", joint=True)  # every read's weights and sources
    for frame in (final, every_input):
        assert len(frame) == 1 and abs(frame["recovered"].iloc[0] - 1) <= _tol(frame)
    assert every_input["read_label"].iloc[0] == "joint"
    # every read's weights alone leave the corrupted sources in place: not the clean run
    weights_only = probe.patch(CLEAN, CORRUPT, joint=True)
    assert abs(weights_only["recovered"].iloc[0] - 1) > 10 * _tol(weights_only)


@pytest.mark.parametrize("name", NAMES)
def test_the_final_read_at_the_last_position_alone_decides_the_last_logits(probes, name):
    probe = probes[name]
    n = probe.tokenize(CLEAN)[0].shape[1]
    last = probe.patch(CLEAN, CORRUPT, what="input", reads="final", positions=[-1])
    others = probe.patch(CLEAN, CORRUPT, what="input", reads="final", positions=list(range(n - 1)))
    assert abs(last["recovered"].iloc[0] - 1) <= _tol(last)
    assert abs(others["recovered"].iloc[0]) <= _tol(others)
    assert last.attrs["positions"] == [n - 1]


def test_the_roundoff_bound_is_c_u_g_times_the_logit_scale(probes):
    probe = probes["full"]
    cfg = probe.model.cfg
    g = cfg.n_reads * (cfg.d_model ** 0.5 + cfg.n_sources)
    assert metric_roundoff(probe, 3.0, n_terms=2) == pytest.approx(2 * 8 * 2.0**-24 * g * 3.0, rel=1e-12)


# -- per source -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_every_source_of_a_read_patched_together_is_the_read_patched(probes, name):
    """Weights as given: the per-source patches of a read compose to the per-read patch, bit for bit."""
    probe = probes[name]
    counts = probe.spec.axis.counts
    for read in ("L3.mlp", "final"):
        r = probe.spec.read_labels.index(read)
        assert counts[r] > 1
        together = probe.patch(CLEAN, CORRUPT, reads=[read], per_source=True, joint=True)
        row = probe.patch(CLEAN, CORRUPT, reads=[read])
        assert together["metric_patched"].iloc[0] == row["metric_patched"].iloc[0]
        alone = probe.patch(CLEAN, CORRUPT, reads=[read], per_source=True)
        assert len(alone) == counts[r]
        assert not np.allclose(alone["metric_patched"], row["metric_patched"].iloc[0])  # one source is not the row


def test_a_source_patch_keeps_the_other_weights_as_given(probes):
    """The read's other weights stay the corrupted run's, the row is not renormalised, and the read mixes
    the corrupted sources with exactly those weights."""
    probe = probes["full"]
    spec = probe.spec
    r, s = spec.read_labels.index("L5.attn"), 3
    k, d = spec.axis.counts[r], probe.model.cfg.d_model
    clean_t, corrupt_t = probe.tokenize(CLEAN)[0], probe.tokenize(CORRUPT)[0]
    clean, corrupt = record_donor(probe, clean_t), record_donor(probe, corrupt_t)
    mixer = probe.model.mixers[r]
    seen: dict = {}
    pre = mixer.register_forward_pre_hook(lambda m, args: seen.__setitem__("sources", [v[0].double() for v in args[0]]))
    hp = probe.model.hook_dict[spec.read_hooks[r]]  # the mixed input the read hands its sublayer
    handle = hp.add_hook(lambda h, hook: seen.__setitem__("h", h[0].double()), dir="fwd")
    try:
        patched_metrics(probe, corrupt_t, clean, [[Patch(r, columns=(s,))]], lambda logits: logits[-1, 0])
    finally:
        pre.remove()
        handle.hook.remove()
        hp.fwd_hooks.remove(handle)
    w = corrupt.weights[r].double().clone()
    w[:, s] = clean.weights[r][:, s].double()
    shift = w.sum(-1) - 1
    assert shift.abs().max() > 1e-3  # the patched rows do not sum to one ...
    terms = torch.stack([w[:, i, None] * v for i, v in enumerate(seen["sources"])])  # (k, P, d)
    assert len(seen["sources"]) == k
    # ... and the read uses them as given: h = sum_i w_i v_i, within float32 roundoff of that sum
    bound = 8 * 2.0**-24 * (d**0.5 + k) * terms.abs().sum(0).max().item()
    assert (seen["h"] - terms.sum(0)).abs().max().item() <= bound
    renormalised = terms.sum(0) / (1 + shift)[:, None]
    assert (seen["h"] - renormalised).abs().max().item() > 100 * bound


# -- refusals and metrics -------------------------------------------------------------------------
def test_prenorm_is_refused_because_its_routing_is_fixed():
    probe = Probe(load_demo("prenorm")[0], name="prenorm")
    with pytest.raises(ValueError, match="PreNorm.*routing is fixed"):
        probe.patch(CLEAN, CORRUPT)


def test_prompts_of_different_lengths_are_refused_naming_both(probes):
    with pytest.raises(ValueError, match="clean prompt has 15 tokens and the corrupted prompt 17"):
        probes["full"].patch(CLEAN, "I pray you, madam")


# prompts differing in a middle word: the demo models predict the same next byte after both, but not
# at every position (after "the k"/"the d" and on: positions 13, 14, 15 of 17)
LORD, DUKE = "My lord, the king", "My lord, the duke"


def test_the_default_position_is_the_last_where_the_predictions_differ(probes):
    probe = probes["full"]
    clean_t, corrupt_t = probe.tokenize(LORD)[0], probe.tokenize(DUKE)[0]
    with torch.no_grad():
        clean, corrupt = probe.logits(clean_t)[0], probe.logits(corrupt_t)[0]
    differ = torch.nonzero(clean.argmax(-1) != corrupt.argmax(-1)).flatten().tolist()
    assert differ and differ[-1] < clean.shape[0] - 1  # the last token's predictions agree: -1 would be refused
    with pytest.raises(SamePrediction, match="differ at positions " + ", ".join(map(str, differ))):
        probe.patch(LORD, DUKE, position=-1)
    frame = probe.patch(LORD, DUKE)
    p = differ[-1]
    a = frame.attrs
    assert a["position"] == p and a["position_auto"] is True and a["differ"] == differ
    assert (a["clean_top"], a["corrupted_top"]) == (int(clean[p].argmax()), int(corrupt[p].argmax()))
    assert a["clean_top"] != a["corrupted_top"] and a["denominator"] > 0
    assert a["metric_clean"] == pytest.approx(float(clean[p, a["clean_top"]] - clean[p, a["corrupted_top"]]), abs=1e-5)
    assert a["clean_text"] == LORD and a["corrupted_text"] == DUKE
    # an explicit position keeps today's behaviour, normalised to 0..n-1
    explicit = probe.patch(LORD, DUKE, position=p - clean.shape[0])
    assert explicit.attrs["position"] == p and explicit.attrs["position_auto"] is False
    np.testing.assert_array_equal(explicit["metric_patched"], frame["metric_patched"])


def test_when_the_last_token_differs_the_default_position_is_the_last(per_read, probes):
    n = probes["full"].tokenize(CLEAN)[0].shape[1]
    assert per_read["full"].attrs["position"] == n - 1 and per_read["full"].attrs["position_auto"] is True


def test_no_position_differing_is_refused_naming_what_both_runs_predict(probes):
    probe = probes["full"]
    with pytest.raises(SamePrediction) as info:
        probe.patch("Sir,", "Sir!")  # the demo models predict the same byte after every prefix of both
    exc, message = info.value, str(info.value)
    assert isinstance(exc, ValueError) and exc.position is None and exc.differ == [] and exc.n_tokens == 4
    assert "every one of the 4 positions" in message and "identically 0" in message
    assert f"both predict token {exc.token} ({exc.token_text!r})" in message
    assert "prompts that end where the next token" in message and "metric=" in message
    # with an explicit position the message says where the predictions differ, or that they differ nowhere
    with pytest.raises(SamePrediction, match="differ at no position"):
        probe.patch("Sir,", "Sir!", position=-1)


def test_a_user_metric_needs_no_position(probes):
    frame = probes["full"].patch("Sir,", "Sir!", lambda logits: logits[-1, 0], reads=["final"])
    assert frame.attrs["position"] is None and frame.attrs["position_auto"] is False


@pytest.mark.parametrize("kwargs, message", [
    ({"what": "sources"}, "what is 'sources'"),
    ({"what": "input", "per_source": True}, "per_source"),
    ({"position": 15}, "position 15 is out of range"),
    ({"position": 1.5}, "position 1.5 is out of range"),
    ({"positions": [20]}, "position 20 is out of range"),
    ({"reads": ["L9.attn"]}, "read 'L9.attn' is not one of"),
])
def test_bad_arguments_get_a_message(probes, kwargs, message):
    with pytest.raises(ValueError, match=message):
        probes["block"].patch(CLEAN, CORRUPT, **kwargs)


def test_a_user_metric_is_used_as_given(probes, per_read):
    probe = probes["block"]
    top = per_read["block"].attrs["clean_top"]

    def log_prob(logits):
        return logits.log_softmax(-1)[-1, top]

    frame = probe.patch(CLEAN, CORRUPT, log_prob, what="input")
    with torch.no_grad():
        expected = [float(log_prob(probe.model(probe.tokenize(t)[0])[0])) for t in (CLEAN, CORRUPT)]
    assert frame.attrs["metric"] == "log_prob" and "clean_top" not in frame.attrs
    assert frame.attrs["metric_clean"] == pytest.approx(expected[0], abs=1e-5)
    assert frame.attrs["metric_corrupted"] == pytest.approx(expected[1], abs=1e-5)
    assert abs(frame.set_index("read_label").loc["final", "recovered"] - 1) <= _tol(frame)
    with pytest.raises(ValueError, match="must return a scalar"):
        probe.patch(CLEAN, CORRUPT, lambda logits: logits[-1])


def test_a_denominator_within_roundoff_gives_nan_with_a_warning(probes):
    with pytest.warns(RuntimeWarning, match="within the float32 roundoff"):
        frame = probes["full"].patch(CLEAN, CORRUPT, lambda logits: logits[0, 0] * 0 + 1.0, reads=["final"])
    assert frame["recovered"].isna().all() and frame["metric_patched"].notna().all()


# -- the frame and the figures --------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_the_frame_is_tidy_and_labelled(probes, per_read, name):
    probe = probes[name]
    spec = probe.spec
    frame = per_read[name]
    assert list(frame.columns) == ["read", "read_label", "source", "source_label", "what", "metric_patched", "recovered",
                                   "metric_clean", "metric_corrupted"]
    assert list(frame["read_label"]) == spec.read_labels and list(frame["read"]) == list(range(len(spec.read_labels)))
    assert frame["source"].isna().all() and set(frame["source_label"]) == {"all"}
    assert (frame["metric_clean"] == frame.attrs["metric_clean"]).all()
    assert frame.attrs["clean_top_text"] == "," and frame.attrs["corrupted_top_text"] == "y"
    assert frame.attrs["denominator"] > 0
    cells = probe.patch(CLEAN, CORRUPT, per_source=True)
    counts = spec.axis.counts
    assert len(cells) == sum(counts)
    assert all(int(s) < counts[int(r)] for r, s in zip(cells["read"], cells["source"]))
    assert list(cells["source_label"]) == [spec.source_labels[int(s)] for s in cells["source"]]
    assert cells["recovered"].notna().all()


@pytest.mark.parametrize("name", NAMES)
def test_the_heatmap_is_blank_where_a_read_cannot_see_a_source(probes, name):
    probe = probes[name]
    fig = patching_heatmap(probe.patch(CLEAN, CORRUPT, per_source=True))
    z = np.asarray(fig.data[0].z, dtype=float)
    spec = probe.spec
    assert z.shape == (len(spec.read_labels), len(spec.source_labels))
    seen = np.arange(z.shape[1])[None, :] < np.asarray(spec.axis.counts)[:, None]
    assert np.isfinite(z[seen]).all() and np.isnan(z[~seen]).all()
    heat = fig.data[0]
    top = np.abs(z[seen]).max()
    # symmetric to the largest |value| (not forced to -1..1: real cells are a few tenths at most)
    assert heat.zmid == 0 and heat.zmin == -heat.zmax and heat.zmax == pytest.approx(top) and top < 1
    assert heat.colorscale[0][1] != heat.colorscale[-1][1] and heat.colorbar.title.text == UNIT
    title = fig.layout.title.text
    assert UNIT in title and "(recovered)" not in title and f"±{top:.3g}" in title
    assert "clean 'I pray you, sir' → ','" in title and "corrupted 'I pray you, lad' → 'y'" in title
    assert f"position {probe.tokenize(CLEAN)[0].shape[1] - 1} (picked" in title
    assert list(heat.y) == spec.read_labels and list(heat.x) == spec.source_labels
    with pytest.raises(ValueError, match="per_source=True"):
        patching_heatmap(probe.patch(CLEAN, CORRUPT, reads=["final"]))


def test_the_bars_show_each_reads_weights_beside_its_whole_input(probes, per_read):
    inputs = probes["full"].patch(CLEAN, CORRUPT, what="input")
    fig = patching_bars(per_read["full"], inputs)
    assert len(fig.data) == 2 and UNIT in fig.layout.title.text
    assert "clean 'I pray you, sir' → ','" in fig.layout.title.text and "position 14" in fig.layout.title.text
    assert list(fig.data[0].x) == probes["full"].spec.read_labels
    np.testing.assert_array_equal(fig.data[1].y, inputs["recovered"].to_numpy())
    assert {s.y0 for s in fig.layout.shapes} == {0.0, 1.0}


def test_the_two_phase_block_schedule_patches_the_same(probes, per_read):
    from attnres_probe import AttnResTransformer
    from attnres_probe.demo import demo_dir

    two = Probe(AttnResTransformer.load(demo_dir("block"), schedule="two_phase").eval(), name="block")
    frame, ref = two.patch(CLEAN, CORRUPT), per_read["block"]
    assert np.abs(frame["recovered"].to_numpy() - ref["recovered"].to_numpy()).max() <= 2 * _tol(ref)
    assert np.abs(frame["recovered"].to_numpy()).max() > 0.05  # the comparison is not between zeros


def test_the_low_level_patches_refuse_columns_a_read_cannot_see(probes):
    probe = probes["block"]
    tokens = probe.tokenize(CORRUPT)[0]
    donor = record_donor(probe, probe.tokenize(CLEAN)[0])
    k = probe.spec.axis.counts[4]
    with pytest.raises(ValueError, match=f"sees columns 0..{k - 1}"):
        patched_metrics(probe, tokens, donor, [[Patch(4, columns=(k,))]], lambda logits: logits[-1, 0])
    with pytest.raises(ValueError, match="columns apply to what='weights' only"):
        patched_metrics(probe, tokens, donor, [[Patch(4, what="input", columns=(0,))]], lambda logits: logits[-1, 0])
    with pytest.raises(ValueError, match="same token length"):
        patched_metrics(probe, tokens[:, :-1], donor, [[Patch(4)]], lambda logits: logits[-1, 0])


def test_long_prompts_are_cut_in_the_titles_around_where_they_differ(probes):
    a, b = _short_pair("Now is the winter of our discontent made glorious summer",
                       "Now is the summer of our discontent made glorious summer", width=20)
    assert a.startswith("…") and a.endswith("…") and "winter" in a and "summer" in b and len(a) == 22
    assert _short_pair("short", "shirt") == ("short", "shirt")
    frame = probes["full"].patch("I pray you, <sir>", "I pray you, <lad>", reads=["final"])
    assert "&lt;sir&gt;" in patching_bars(frame).layout.title.text  # escaped for plotly's HTML titles
