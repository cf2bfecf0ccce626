"""The two residual rules beyond AttnRes in the model (issue #36): Hyper-Connections / mHC
(``residual="hyper"``) and DenseFormer (``residual="denseformer"``), through the hook points.

The effective depth weights ``hook_weights`` shows are the coefficients c of every read
``h_r = sum_j c_rj v_j``; the reconstruction tests bound ``|sum_j c_j v_j - h|`` in float64 by
``gamma_K(2^-53) mag``: mag the same bookkeeping run on absolute values (|H_pre|, |H_res|,
|H_post|, |alpha|) applied to |v|, K = 2 (L + 1)(n + 2) rounding steps on the longest path (the
streams' and the coefficients' sums of n terms per sublayer, the read's sum over L + 1 sources).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from attnres_probe import AttnResTransformer, ModelConfig, metrics
from attnres_probe.config import ConfigError
from attnres_probe.depth_rules import StreamWeights, denseformer_read_coefficients, hyper_read_coefficients
from attnres_probe.model import CoefficientRead
from attnres_probe.probe import Probe
from attnres_probe.training.schedule import param_groups

from helpers import randomize_routing, route, sample_tokens, tiny_config, tiny_model

EPS = 2.0**-53
HYPER = {
    "HC static": dict(residual="hyper", hc_dynamic=False, n_streams=3),
    "HC dynamic": dict(residual="hyper", n_streams=2),
    "HC no tanh": dict(residual="hyper", n_streams=3, hc_tanh=False),
    "mHC flat": dict(residual="hyper", mhc=True, n_streams=4),
    "mHC stream": dict(residual="hyper", mhc=True, n_streams=2, hc_dynamic_input="stream"),
    "mHC static": dict(residual="hyper", mhc=True, hc_dynamic=False, n_streams=3),
}
DENSE = {
    "DenseFormer": dict(residual="denseformer"),
    "DenseFormer 2x2": dict(residual="denseformer", dwa_dilation=2, dwa_period=2),
    "DenseFormer 3x1": dict(residual="denseformer", dwa_dilation=3),
}
RULES = {**HYPER, **DENSE}


def gamma(k: int, u: float = EPS) -> float:
    return k * u / (1 - k * u)


def model64(kw: dict, n_layers: int = 3) -> AttnResTransformer:
    m = AttnResTransformer(tiny_config(n_layers=n_layers, **kw)).double()
    return randomize_routing(m, seed=7).eval()


def sources_and_reads(cache, n_layers: int):
    srcs = [cache["hook_embed"] + cache["hook_pos_embed"]]
    for i in range(n_layers):
        srcs += [cache[f"blocks.{i}.hook_attn_out"], cache[f"blocks.{i}.hook_mlp_out"]]
    reads = [cache[f"blocks.{i}.hook_resid_{w}"] for i in range(n_layers) for w in ("pre", "mid")]
    return torch.stack(srcs, -2), [*reads, cache["hook_resid_final"]]


def weights_of(cache, model):
    return torch.stack([cache[m.hook_weights.name] for m in model.mixers], -2)  # [B, P, R, S]


def magnitude_coefficients(model, cache) -> torch.Tensor:
    """The coefficient bookkeeping on absolute values, [B, P, R, S] (module docstring)."""
    if model.cfg.residual == "denseformer":
        alphas = {int(k): v.detach().abs() for k, v in model.dwa.alphas.items()}
        return denseformer_read_coefficients(alphas, model.cfg.n_layers, model.cfg.dwa_dilation, model.cfg.dwa_period)
    steps = []
    for l, read in enumerate(model.mixers[:-1]):
        block = model.blocks[l // 2]
        X = cache[(block.hook_streams_pre if l % 2 == 0 else block.hook_streams_mid).name]
        w = read.hc.weights(X, "torch")
        steps.append(StreamWeights(w.pre.abs(), w.res.abs(), w.post.abs()))
    return hyper_read_coefficients(steps)


@pytest.mark.parametrize("name", list(RULES))
def test_coefficients_times_sources_rebuild_every_read(name):
    model = model64(RULES[name])
    tokens = sample_tokens(10, batch=2, seed=3)
    logits_plain = model(tokens)
    logits, cache = model.run_with_cache(tokens)
    assert torch.equal(logits, logits_plain)  # recording the weights does not change the forward
    V, reads = sources_and_reads(cache, 3)
    W = weights_of(cache, model)
    L1 = W.shape[-1]
    assert torch.equal(W.triu(1), torch.zeros_like(W))  # read r sees columns 0..r only (0 beyond)
    mag = magnitude_coefficients(model, cache) @ V.abs().double() if model.cfg.residual == "denseformer" else None
    if mag is None:
        mag = torch.einsum("bprs,bpsd->bprd", magnitude_coefficients(model, cache), V.abs())
    else:
        mag = torch.einsum("rs,bpsd->bprd", magnitude_coefficients(model, cache), V.abs())
    n = model.cfg.n_streams or 1
    bound = gamma(2 * L1 * (n + 2)) * mag
    rebuilt = torch.einsum("bprs,bpsd->bprd", W, V)
    err = (rebuilt - torch.stack(reads, -2)).abs()
    assert (err <= bound).all(), f"{name}: worst err/bound {(err / bound).max():.3g}"
    # the bound sees a coefficient off by 1e-9: it can fail
    W2 = W.clone()
    W2[..., 4, 2] += 1e-9
    err2 = (torch.einsum("bprs,bpsd->bprd", W2, V) - torch.stack(reads, -2)).abs()
    assert not (err2 <= bound).all()


@pytest.mark.parametrize("kw", [dict(residual="denseformer"), dict(residual="hyper", n_streams=1, hc_dynamic=False),
                                dict(residual="hyper", n_streams=1)], ids=["denseformer", "HC n=1 static", "HC n=1 dynamic"])
def test_a_fresh_rule_is_its_prenorm_baseline_bit_for_bit(kw):
    tokens = sample_tokens(12, batch=2)
    base = AttnResTransformer(tiny_config("prenorm"))
    other = AttnResTransformer(tiny_config(**kw))
    assert torch.equal(base(tokens), other(tokens))
    # and its coefficients are PreNorm's: all one over what each read sees
    _, cache = other.run_with_cache(tokens)
    W = weights_of(cache, other)
    assert torch.equal(W, torch.ones_like(W).tril())


def test_fresh_mhc_coefficients_follow_the_package_init():
    model = AttnResTransformer(tiny_config(residual="hyper", mhc=True, n_streams=4)).double()
    _, cache = model.run_with_cache(sample_tokens(6, batch=1))
    W = weights_of(cache, model)[0, 0]  # the streams stay equal: (sigmoid(1) + 3/2) on the embedding
    a, post = 1 / (1 + np.exp(-1.0)), 2 / (1 + np.exp(-1.0))
    first = a + 1.5
    assert W[0, 0].item() == pytest.approx(first, rel=1e-12)
    assert W[3, 1].item() == pytest.approx(first * post, rel=1e-9)


def test_a_weights_hook_is_an_intervention_on_that_read_only():
    model = tiny_model("hyper", n_streams=3).double()
    tokens = sample_tokens(8, batch=1)
    _, cache = model.run_with_cache(tokens)
    V, _ = sources_and_reads(cache, 2)

    def keep_embedding(w, k):
        out = torch.zeros_like(w)
        out[..., 0] = w[..., 0]
        return out

    target = model.blocks[1].attn_res  # read 2 only
    target.hook_weights.add_hook(lambda w, hook: keep_embedding(w, 3))
    try:
        _, cache2 = model.run_with_cache(tokens)
    finally:
        model.reset_hooks()
    h = cache2["blocks.1.hook_resid_pre"]
    want = cache["blocks.1.attn_res.hook_weights"][..., :1, None] * V[..., 0:1, :]
    assert torch.allclose(h, want.squeeze(-2), rtol=0, atol=1e-12)
    assert torch.equal(cache2["blocks.0.hook_resid_mid"], cache["blocks.0.hook_resid_mid"])  # earlier reads unchanged
    # later reads differ only through the changed sublayer output (the streams are not edited)
    assert not torch.equal(cache2["blocks.1.hook_resid_mid"], cache["blocks.1.hook_resid_mid"])


def test_uniform_routing_hooks_work_for_every_rule():
    for name, kw in RULES.items():
        model = tiny_model(**kw)
        route(model, lambda w, k: torch.where(torch.arange(w.shape[-1]) < k, 1.0 / k, 0.0).to(w.dtype).expand_as(w))
        _, cache = model.run_with_cache(sample_tokens(6, batch=1))
        V, reads = sources_and_reads(cache, 2)
        for r, h in enumerate(reads):
            want = V[..., : r + 1, :].mean(-2)
            assert torch.allclose(h, want, atol=1e-5), (name, r)


def test_a_hook_that_changes_the_streams_while_weights_are_recorded_warns():
    model = tiny_model("hyper", n_streams=2)
    model.blocks[0].hook_streams_mid.add_hook(lambda x, hook: x * 2)
    try:
        with pytest.warns(UserWarning, match="changed the stream state at blocks.0.hook_streams_mid"):
            model.run_with_cache(sample_tokens(6, batch=1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(sample_tokens(6, batch=1))  # nothing recorded: nothing to warn about
    finally:
        model.reset_hooks()


@pytest.mark.parametrize("residual, kw", [("hyper", dict(mhc=True, n_streams=2)), ("denseformer", dict(dwa_period=2))])
def test_probe_records_coefficients_and_shares(residual, kw, tmp_path):
    model = tiny_model(residual, **kw)
    trace = Probe(model, name=residual).run("To be, or not to be: ay", backward=True)
    W, C = trace.depth_weights, trace.contrib
    assert np.isnan(trace.logits).all()  # no depth logits in these rules
    tril = np.tril(np.ones(W.shape[-2:], bool))
    assert np.isfinite(W[..., tril]).all() and np.isnan(W[..., ~tril]).all()
    assert np.allclose(np.nansum(C, -1), 1.0, atol=1e-4)  # shares sum to one for any coefficients
    assert np.isfinite(trace.grad_in).all()
    trace.save(tmp_path / "t")
    back = type(trace).load(tmp_path / "t")
    assert back.residual == residual and back.meta["config"]["residual"] == residual
    assert np.array_equal(back.depth_weights, W, equal_nan=True)
    # the diagnostics use the normalised coefficients: a row sums to one
    loc = metrics.locality(trace)
    assert np.isfinite(loc["recent_mass"].to_numpy()).all()


def test_config_fields_belong_to_their_rule():
    cfg = ModelConfig(residual="hyper")
    assert (cfg.n_streams, cfg.hc_dynamic, cfg.mhc, cfg.hc_dynamic_input, cfg.sinkhorn_iters) == (4, True, False, "stream", 20)
    assert ModelConfig(residual="hyper", mhc=True).hc_dynamic_input == "flat"
    d = ModelConfig(residual="denseformer")
    assert (d.dwa_dilation, d.dwa_period, d.n_streams) == (1, 1, None)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="n_streams=2 apply only to residual='hyper'"):
        ModelConfig(residual="full", n_streams=2)
    with pytest.raises(ConfigError, match="dwa_period=2 apply only to residual='denseformer'"):
        ModelConfig(residual="hyper", dwa_period=2)
    with pytest.raises(ConfigError, match=r"n_streams must be an integer in 1..64"):
        ModelConfig(residual="hyper", n_streams=0)
    with pytest.raises(ConfigError, match="hc_dynamic_input is 'rows'; accepted values are stream, flat"):
        ModelConfig(residual="hyper", hc_dynamic_input="rows")
    with pytest.raises(ConfigError, match="mhc must be true or false"):
        ModelConfig(residual="hyper", mhc="yes")
    with pytest.raises(ConfigError, match="residual is 'dense'; accepted values are prenorm, full, block, hyper, denseformer"):
        ModelConfig(residual="dense")
    assert ModelConfig(residual="hyper", mhc=True, hc_dynamic=False, n_streams=2).rule_label == "mHC (static, 2 streams)"
    assert ModelConfig(residual="denseformer", dwa_dilation=2).rule_label == "DenseFormer (dilation 2)"


@pytest.mark.parametrize("name", ["mHC flat", "DenseFormer 2x2"])
def test_checkpoints_round_trip(name, tmp_path):
    model = tiny_model(**RULES[name])
    model.save(tmp_path / "m")
    back = AttnResTransformer.load(tmp_path / "m")
    assert back.cfg == model.cfg
    tokens = sample_tokens(6, batch=1)
    assert torch.equal(back(tokens), model(tokens))


def test_rule_parameters_are_not_decayed_and_count_as_mixers():
    for kw in (HYPER["mHC flat"], DENSE["DenseFormer"]):
        model = tiny_model(**kw)
        rule = {id(p) for n, p in model.named_parameters() if ".hc." in n or n.startswith("dwa.")}
        assert rule
        decay, rest = param_groups(model, 0.1)
        assert not rule & {id(p) for p in decay["params"]} and rule <= {id(p) for p in rest["params"]}
        assert model.n_params() - model.n_params(include_mixers=False) == sum(
            p.numel() for p in model.parameters() if id(p) in rule)
    assert isinstance(tiny_model("denseformer").out_res, CoefficientRead)


# -- pages and comparisons --------------------------------------------------------------------
@pytest.fixture(scope="module")
def rule_traces():
    text = "Now is the winter of our"
    out = {}
    for name, kw in (("prenorm", dict(residual="prenorm")), ("full", dict(residual="full")),
                     ("mhc", dict(residual="hyper", mhc=True, n_streams=3)), ("denseformer", dict(residual="denseformer"))):
        out[name] = Probe(tiny_model(**kw), name=name).run(text, backward=True)
    return out


def test_figures_draw_the_normalised_coefficients(rule_traces):
    from attnres_probe import figures

    for name in ("mhc", "denseformer"):
        t = rule_traces[name]
        cells, _ = figures.cell_values(t, expanded=False)
        w = cells["weights"]
        assert np.allclose(np.nansum(w, -1), 1.0)  # c / sum(c): rows sum to one
        raw = t.cube("weights")
        assert not np.allclose(np.nansum(raw, -1), 1.0)  # the recorded coefficients do not
        assert figures.kind_title(t, "weights") == figures.NORMALISED_TITLE
        fig = figures.mean_heatmap(t, kind="weights")
        z = np.asarray(fig.data[0].z, float)
        rng = fig.data[0].zmin, fig.data[0].zmax
        assert rng[0] <= np.nanmin(z) and rng[1] >= np.nanmax(z)  # signed coefficients are not clipped
        logits = figures.mean_heatmap(t, kind="logits")
        assert "no depth logits" in str(logits.layout.annotations)


def test_compare_gives_no_paper_verdict_to_other_rules(rule_traces):
    frame = metrics.compare(*rule_traces.values(), n_resamples=50)
    rows = frame[frame["comparison"] != "value"]
    other = rows[rows["model"].isin(["mhc", "denseformer"])]
    attnres = rows[rows["model"] == "full"]
    assert len(other) and (other["verdict"] == "").all() and (other["expected"] == "").all()
    assert other["note"].str.contains("claim about AttnRes|states no direction").all()
    assert other["note"].str.contains("claim about AttnRes, not mHC: no verdict").any()
    assert (attnres.loc[attnres["expected"] != "", "verdict"] != "").all()  # AttnRes still gets its verdicts
    assert other["estimate"].notna().any()  # the estimates are shown


def test_ablation_keeps_the_gain_of_a_coefficient_read():
    from attnres_probe.ablation import ablate

    model = tiny_model("denseformer")
    probe = Probe(model, name="denseformer")
    text = "Now is the winter of our"
    out = ablate(probe, text, sources="embed", reads=[4], mode="zero")
    assert len(out) == 1 and np.isfinite(out["delta_loss"]).all()
    # by hand: the embedding's coefficient set to 0, the rest scaled to keep sum(c)
    tokens, _ = probe.tokenize(text)
    k = 5

    def edit(w, hook):
        w = w.clone()
        c = w[..., :k]
        total = c.sum(-1, keepdim=True)
        rest = c.clone()
        rest[..., 0] = 0
        w[..., :k] = rest * total / rest.sum(-1, keepdim=True)
        return w

    model.mixers[4].hook_weights.add_hook(edit)
    try:
        with torch.no_grad():
            want = float(model(tokens, return_type="loss"))
    finally:
        model.reset_hooks()
    assert out["loss"].iloc[0] == pytest.approx(want, rel=1e-6)
    uniform = ablate(probe, text, sources="embed", reads=[4], mode="uniform")
    assert np.isfinite(uniform["loss"]).all()


def test_patching_runs_on_the_new_rules():
    model = tiny_model("hyper", n_streams=2)
    result = Probe(model, name="hc").patch("Now is the winter", "Now is the summer", reads=[2, 4])
    assert len(result) == 2 and np.isfinite(result["metric_patched"].to_numpy(float)).all()
    assert np.isfinite(result["recovered"].to_numpy(float)).all()


def test_caching_with_backward_hooks_does_not_warn_about_the_streams():
    model = tiny_model("hyper", n_streams=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, cache = model.run_with_cache(sample_tokens(6, batch=1), incl_bwd=True)
    assert "blocks.0.hook_streams_mid_grad" in cache.cache_dict


# -- a review of #36: one quantity, honest words, for every rule --------------------------------------------


def test_coefficients_that_cancel_have_no_normalised_weights_anywhere(rule_traces):
    """A read whose signed coefficients sum to (nearly) nothing has no c/Σc: the pages, the metrics, the
    torch helper and the ablation all say "unavailable" (NaN) or fall back, instead of numbers in the millions."""
    import copy

    from attnres_probe import figures
    from attnres_probe.analysis.windows import mixture_rms, normalised_weights
    from attnres_probe.depth_rules import normalise_coefficients
    from attnres_probe.numeric import CANCELLED, over_sum

    row = np.array([[1.0, -1.0 + 1e-6, np.nan], [0.5, 0.25, 0.25], [1.0, -(1 - 2 * CANCELLED), np.nan]])
    out = over_sum(row)
    assert np.isnan(out[0]).all()  # cancelled
    assert np.allclose(out[1], row[1]) and np.isnan(out[2, 2])  # a proper row, NaN kept NaN
    assert np.allclose(out[2, :2], row[2, :2] / (2 * CANCELLED))  # at 2x the threshold: still defined
    torch_out = normalise_coefficients(torch.tensor(np.nan_to_num(row[:2]), dtype=torch.float64))
    assert torch.isnan(torch_out[0]).all() and torch.allclose(torch_out[1], torch.tensor(row[1]))
    assert np.isnan(figures.implied_weights(row)[0]).all()

    t = copy.deepcopy(rule_traces["denseformer"])
    w = np.array(t.depth_weights, np.float64)
    k = int(np.sum(~np.isnan(w[0, 0, 3])))
    w[..., 3, :k] = 0.0
    w[..., 3, 0], w[..., 3, 1] = 1.0, -1.0 + 1e-6  # read 3: coefficients that cancel
    t.depth_weights = w.astype(np.float32)
    assert np.isnan(normalised_weights(t, t.depth_weights)[..., 3, :]).all()
    assert np.isfinite(normalised_weights(t, t.depth_weights)[..., 2, :2]).all()
    assert np.isnan(mixture_rms(t, t.rms_in, t.depth_weights)[..., 3]).all()
    locality = metrics.locality(t, kind="weights")
    assert np.isfinite(locality.to_numpy(float)).any() and np.nanmax(np.abs(locality.to_numpy(float))) < 1e3


def test_a_page_opens_where_weights_depend_on_the_token(rule_traces):
    """DenseFormer's coefficients are the same at every token: they cannot say which token routes furthest."""
    from attnres_probe.analysis.windows import informative_token

    dense = rule_traces["denseformer"]
    n = int(dense.mask[0].sum())
    pos, why = informative_token([rule_traces["prenorm"], dense])
    assert pos == n - 1 and "last token" in why
    pos, why = informative_token([rule_traces["prenorm"], dense, rule_traces["mhc"]])
    assert "mhc route furthest" in why and "(denseformer: its weights are the same at every token)" in why


def test_rows_without_a_direction_say_no_verdict_not_half_a_sentence(rule_traces):
    from attnres_probe.analysis.display import comparison_rows, expected_text, held_text
    from attnres_probe.dashboards.cards import glance_table, headline_cards

    frame = metrics.compare(*rule_traces.values(), n_resamples=50)
    rows = frame[(frame["comparison"] != "value") & frame["model"].isin(["mhc", "denseformer"])]
    assert rows["held"].isna().all()  # nothing counted against a direction the paper does not give
    for r in rows.to_dict("records"):
        assert expected_text(r) == "" and held_text(r) == ""
    for m in ("locality_distance", "embed_weight_deep"):
        for r in comparison_rows(frame, m):
            if r["model"] in ("mhc", "denseformer"):
                assert "than" not in r["expected"] and r["held"] == ""
    colors = {n: "#000" for n in rule_traces}
    text = str(headline_cards(frame, colors))
    assert "no verdict" in text and " than uniform'" not in text and "paper:  than" not in text
    glance = str(glance_table(frame))
    import re

    against = re.findall(r"Td\(children='([^']*)', className='vs against'\)", glance)  # the "paper: the model is" column
    assert against and all(a.startswith(("lower than", "higher than")) for a in against), against  # from the AttnRes row


def test_the_corpus_heatmap_puts_the_sd_on_the_scale_of_its_colours(rule_traces):
    from attnres_probe import figures
    from attnres_probe.corpus.stats import CorpusStats

    t = rule_traces["mhc"]
    stats = CorpusStats.empty(t.meta)
    stats.update(t)
    fig = figures.corpus_heatmap(stats, "weights", value="sd")
    sd = np.asarray(fig.data[0].z, float)
    raw = np.sqrt(np.asarray(stats.var("depth_weights"), np.float64))
    total = np.nansum(np.asarray(stats.mean("depth_weights"), np.float64), -1, keepdims=True)
    assert np.allclose(sd, raw / total, equal_nan=True)
    assert "c/Σc̄" in fig.data[0].hovertemplate


def test_models_of_different_shapes_are_compared_under_a_warning(rule_traces):
    from attnres_probe.analysis.display import readable
    from attnres_probe.reports.builder import render_report

    text = "Now is the winter of our"
    deeper = Probe(tiny_model(residual="full", n_layers=3), name="deep").run(text, backward=True)
    frame = metrics.compare(rule_traces["prenorm"], deeper)
    warning = frame.attrs["shape"]
    assert warning.startswith("These models differ in more than the residual rule: deep against prenorm")
    assert "n_layers 3 vs 2" in warning
    # models that differ only in the rule (and its fields) compare without it
    same = metrics.compare(*rule_traces.values())
    assert same.attrs["shape"] == ""
    # and the page says once why the rules beyond AttnRes get no verdict
    from attnres_probe.analysis.display import verdict_scope_note

    assert verdict_scope_note(same).startswith("The paper's directions are claims about AttnRes: mhc, denseformer are set")
    assert verdict_scope_note(frame) == ""  # PreNorm and an AttnRes model only
    # every page says it once above the comparison: the notebook frame, the report
    with pytest.warns(UserWarning, match="differ in more than the residual rule"):
        assert warning in readable(frame).attrs["notes"]
    page = render_report([rule_traces["prenorm"], deeper])
    assert 'id="shape-warning"' in page and "n_layers 3 vs 2" in page
    assert 'id="shape-warning"' not in render_report(list(rule_traces.values()))


def test_routing_that_does_not_depend_on_the_input_says_why_its_interval_has_no_width():
    """DenseFormer's coefficients are parameters: its routing metrics are one number in every window,
    and the frame says so instead of showing a zero-width interval as if it were evidence."""
    from attnres_probe.analysis.compare import CONSTANT

    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))  # 3 windows of 3 documents
    traces = [Probe(tiny_model(**kw), name=kw["residual"]).run(tokens, backward=False)
              for kw in (dict(residual="prenorm"), dict(residual="denseformer"), dict(residual="full"))]
    frame = metrics.compare(*traces, n_resamples=50)
    routing = frame[frame["metric"] == "mean_entropy"].set_index(["model", "comparison"])
    dense = routing.loc[("denseformer", "value")]
    assert dense["low"] == pytest.approx(dense["high"], rel=1e-9) and CONSTANT in dense["note"]
    assert CONSTANT in routing.loc[("denseformer", "difference")]["note"]
    full = routing.loc[("full", "value")]  # AttnRes routes by the token: a real interval, no such note
    assert full["high"] > full["low"] and CONSTANT not in full["note"]
    # the pages show no zero-width interval for it, and say why
    from attnres_probe.analysis.display import FIXED, interval_text, table_rows

    def value_row(model):
        return frame[(frame["model"] == model) & (frame["comparison"] == "value") & (frame["metric"] == "mean_entropy")].iloc[0]

    assert interval_text(value_row("denseformer")) == FIXED and interval_text(value_row("full")).startswith("95% CI [")
    row = next(r for r in table_rows(frame)["rows"] if r["metric"] == "mean_entropy")
    cells = dict(zip(table_rows(frame)["columns"], row["cells"]))
    assert cells["denseformer"].endswith("(fixed: no interval) (uniform 1)") and "[" in cells["full"]
    # the per-document breakdown states the same directions as the comparison: none for DenseFormer
    from attnres_probe.analysis.documents import document_breakdown

    docs = document_breakdown(*traces, n_resamples=20, loo_resamples=20)
    dense_rows = docs[docs["model"] == "denseformer"]
    assert len(dense_rows) and (dense_rows["expected"] == "").all() and (dense_rows["verdict"] == "").all()
    assert (docs[(docs["model"] == "full") & (docs["metric"] == "locality_distance")]["expected"] == "lower").all()


def test_a_models_table_names_each_rules_own_settings():
    from attnres_probe.axis import rule_settings

    mhc = ModelConfig(residual="hyper", mhc=True, n_streams=4).to_dict()
    assert rule_settings("hyper", mhc) == "4 streams, dynamic with flat input, Sinkhorn 20 rounds"
    hc = ModelConfig(residual="hyper", n_streams=2, hc_dynamic=False).to_dict()
    assert rule_settings("hyper", hc) == "2 streams, static"
    dense = ModelConfig(residual="denseformer", dwa_period=2).to_dict()
    assert rule_settings("denseformer", dense) == "a DWA after every 2 blocks, dilation 1, period 2"
    assert rule_settings("full", ModelConfig().to_dict()) == "" and rule_settings("hyper", None) == ""


@pytest.mark.parametrize("kw", [dict(residual="hyper", mhc=True, n_streams=3), dict(residual="hyper", n_streams=2),
                                dict(residual="denseformer", dwa_period=2)], ids=["mhc", "hc", "denseformer"])
def test_the_recorders_gram_shares_equal_each_reads_own(kw):
    """The recorder computes these rules' shares from the sources' Gram matrix and the recorded
    coefficients (one batched product); each read's hook_contrib computes w_i <v_i, h> / |h|^2 from
    the read h itself. Float64 model; the recorder keeps coefficients in float32 and forms the Gram
    matrix in float32, so the bound is u32 = 2^-24 times the row's condition K = (sum_j |c_j|
    |v_j|)^2 / |h|^2 times (3 + 2 d): a relative error u in each coefficient moves a share by at most
    ~3 u K, and each Gram entry, a float32 dot product of d terms, is off by at most ~d u |v_i||v_j|
    (twice: in G a_r and in |h|^2); plus u32 for the stored share."""
    n_layers = 2
    model = model64(kw, n_layers=n_layers)
    tokens = sample_tokens(9, batch=2)
    trace = Probe(model).run(tokens, backward=False)
    _, cache = model.run_with_cache(tokens)
    sources, reads = sources_and_reads(cache, n_layers)  # [B, P, S, d], R x [B, P, d]
    names = [f"blocks.{i}.{w}_res" for i in range(n_layers) for w in ("attn", "mlp")] + ["out_res"]
    u32 = 2.0**-24
    for r, (name, h) in enumerate(zip(names, reads)):
        k = r + 1
        own = cache[f"{name}.hook_contrib"][..., :k]
        c = cache[f"{name}.hook_weights"][..., :k]
        K = (c.abs() * sources[..., :k, :].norm(dim=-1)).sum(-1) ** 2 / (h * h).sum(-1)  # [B, P]
        got = torch.as_tensor(trace.contrib[:, :, r, :k], dtype=torch.float64)
        bound = (3 + 2 * model.cfg.d_model) * u32 * K[..., None] + u32
        assert ((got - own).abs() <= bound).all(), (name, float(((got - own).abs() / bound).max()))
        assert (got - own).abs().max() > 0 or r == 0  # a float32 record: not the same numbers, so this compares
