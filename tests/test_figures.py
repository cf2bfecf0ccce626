"""figures: the right data in every chart (z, NaN, hover customdata, block marks) and safe HTML."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from attnres_probe import AttnResTransformer, ModelConfig, Probe, figures

from trace_factory import BLOCK_W, FULL_W, make_trace

nan = np.nan


# -- token / mean heatmaps --------------------------------------------------------------------
def test_token_heatmap_z_is_the_token_row_with_nan_preserved():
    fig = figures.token_heatmap(make_trace("full"), token=1)
    z = np.asarray(fig.data[0].z, dtype=float)
    np.testing.assert_allclose(z, FULL_W, atol=1e-6)  # assert_allclose treats NaN == NaN
    assert np.isnan(z[0, 1]) and np.isnan(z[1, 2])


def test_token_heatmap_puts_first_read_on_top_and_sources_on_x():
    fig = figures.token_heatmap(make_trace("full"))
    assert list(fig.data[0].y) == ["L0.attn", "L0.mlp", "final"]
    assert list(fig.data[0].x) == ["embed", "L0.attn", "L0.mlp"]
    assert fig.layout.yaxis.autorange == "reversed"


def test_token_heatmap_hover_customdata_holds_weight_logit_and_contrib_of_the_cell():
    fig = figures.token_heatmap(make_trace("full"))
    cell = fig.data[0].customdata[2, 1]  # final read, source L0.attn: weight .3
    np.testing.assert_allclose(cell, [0.3, np.log(0.3), 0.3], atol=1e-6)
    assert "customdata[0]" in fig.data[0].hovertemplate and "customdata[2]" in fig.data[0].hovertemplate
    assert fig.data[0].hoverongaps is False


def test_weights_use_a_fixed_zero_to_one_scale_and_shares_and_logits_a_diverging_one():
    trace = make_trace("full")
    hm = figures.token_heatmap(trace, kind="weights").data[0]
    assert (hm.zmin, hm.zmax) == (0.0, 1.0)
    contrib = figures.token_heatmap(trace, kind="contrib").data[0]
    assert (contrib.zmin, contrib.zmax, contrib.zmid) == (-1.0, 1.0, 0.0)  # shares: centred on 0, at least -1..1
    logits = figures.token_heatmap(trace, kind="logits").data[0]
    assert logits.zmin == -logits.zmax
    assert logits.colorscale != hm.colorscale and contrib.colorscale == logits.colorscale


def _color_at(fig, value: float) -> str:
    import plotly.colors as pc

    hm = fig.data[0]
    t = (value - hm.zmin) / (hm.zmax - hm.zmin)
    return pc.sample_colorscale(pc.make_colorscale([c[1] for c in hm.colorscale], [c[0] for c in hm.colorscale]), [t])[0]


def test_a_negative_share_is_coloured_differently_from_zero_and_above_one_differs_from_one():
    """#17 item 1: shares can be negative (-0.13) or above one (1.035); neither may look like 0 or 1."""
    cube = [[1.0, nan, nan], [-0.13, 1.13, nan], [0.2, -0.235, 1.035]]
    fig = figures.token_heatmap(make_trace("full", cube), kind="contrib")
    assert fig.data[0].zmax >= 1.035 and fig.data[0].zmin <= -1.035
    assert _color_at(fig, -0.13) != _color_at(fig, 0.0)
    assert _color_at(fig, 1.035) != _color_at(fig, 1.0) or fig.data[0].zmax > 1.035


def test_difference_heatmap_is_model_minus_baseline_per_cell_on_a_diverging_scale():
    """#17 item 1: AttnRes model minus the baseline, cell by cell."""
    from trace_factory import PRENORM_C

    a, b = make_trace("full", name="full"), make_trace("prenorm", name="prenorm")
    fig = figures.difference_heatmap(a, b, kind="contrib")
    z = np.asarray(fig.data[0].z, dtype=float)
    np.testing.assert_allclose(z, np.asarray(FULL_W) - np.asarray(PRENORM_C), atol=1e-6)
    assert fig.data[0].zmin == -fig.data[0].zmax and fig.data[0].zmid == 0
    assert fig.data[0].colorscale == figures.token_heatmap(a, kind="logits").data[0].colorscale
    assert "full − prenorm" in fig.layout.title.text
    np.testing.assert_allclose(np.asarray(figures.difference_heatmap(a, b, token=1).data[0].z, dtype=float), z, atol=1e-6)
    with pytest.raises(ValueError, match="same depth"):
        figures.difference_heatmap(make_trace("block"), b)


def test_prenorm_weights_panel_shows_its_implied_weights():
    """#35 item 1: PreNorm's weights panel draws its implied weights, 1/k over the k sources each read
    sees (the uniform reference AttnRes is compared with), not blank text; its logits (it has none)
    keep the note that names the "colour by" control."""
    trace = make_trace("prenorm")
    k = np.isfinite(np.asarray(trace.cube("weights"), dtype=float)).sum(-1)  # sources each read sees [B, P, R]
    for fig in (figures.token_heatmap(trace, token=2), figures.mean_heatmap(trace), figures.source_heatmap(trace)):
        z = np.asarray(fig.data[0].z, dtype=float)
        assert np.isfinite(z).any() and not fig.layout.annotations
        assert figures.IMPLIED_TITLE in fig.layout.meta["title_parts"]
    z = np.asarray(figures.token_heatmap(trace, token=2).data[0].z, dtype=float)
    rows = np.isfinite(z).any(-1)
    np.testing.assert_allclose(np.nansum(z, -1)[rows], 1.0, rtol=1e-12)  # each read's weights sum to one
    np.testing.assert_allclose(np.nanmax(z, -1)[rows], 1.0 / k[0, 2][rows], rtol=1e-12)  # and each is 1/k
    src = np.asarray(figures.source_heatmap(trace, source=0).data[0].z, dtype=float)  # the embedding at every token
    np.testing.assert_allclose(src, 1.0 / k[0, : src.shape[1]].T, rtol=1e-12)
    logits = figures.mean_heatmap(trace, kind="logits")
    assert "colour by: contribution share" in logits.layout.annotations[0].text and "kind=" not in logits.layout.annotations[0].text
    assert figures.token_heatmap(make_trace("full")).layout.meta["title_parts"][-1] == figures.KIND_TITLES["weights"]


def test_token_ticks_thin_a_long_axis_so_labels_cannot_overlap():
    """#17 item 2: at 96 tokens no more than one tick per ~20 px of a 300 px panel."""
    vals, text = figures.token_ticks(["a"] * 96, plot_px=300)
    assert 5 <= len(vals) <= 300 // figures.TICK_PX and vals[0] == 0 and len(set(np.diff(vals))) == 1
    assert figures.token_ticks(list("abc"), 300) == ([0, 1, 2], ["a", "b", "c"])
    long = figures.token_ticks(["a very long token"] * 40, 300)[1]
    assert all(len(t) <= 6 for t in long)
    fig = figures.source_heatmap(make_trace("full", n_pos=3))
    assert fig.layout.xaxis.tickangle == 0


def test_titles_are_wrapped_not_cut_and_side_by_side_keeps_the_kind_once():
    fig = figures.source_heatmap(make_trace("full"), kind="contrib")
    assert fig.layout.title.text.count("<br>") == 2 and fig.layout.margin.t >= 80
    both = figures.side_by_side([make_trace("prenorm"), make_trace("full")], "mean_heatmap", kind="contrib")
    titles = [a.text for a in both.layout.annotations if a.text and a.text.startswith(("prenorm", "full"))]
    assert len(titles) == 2 and all("contribution share" not in t and "<br>" in t for t in titles)
    assert both.layout.title.text == figures.KIND_TITLES["contrib"]


def test_long_source_heatmap_is_compact():
    """#17 item 7: above COMPACT_TOKENS tokens only z goes out, as float32."""
    n = figures.COMPACT_TOKENS + 4
    trace = make_trace("full", n_pos=n, str_tokens=["x"] * n)
    fig = figures.source_heatmap(trace)
    assert fig.data[0].customdata is None and fig.data[0].text is None
    assert np.asarray(fig.data[0].z).dtype == np.float32
    assert figures.source_heatmap(make_trace("full")).data[0].customdata is not None


def test_long_source_heatmap_hover_names_each_token_once_per_column():
    """#17 item 7 follow-up: the compact heatmap's hover names the token ("token 12 'c'"), sent once per
    column (the x categories), not once per cell; ticks sit on those categories; side by side keeps them."""
    n = figures.COMPACT_TOKENS + 4
    toks = [chr(97 + i % 26) for i in range(n)]
    fig = figures.source_heatmap(make_trace("full", n_pos=n, str_tokens=toks))
    heat = fig.data[0]
    assert list(heat.x[:2]) == ["0 'a'", "1 'b'"] and len(heat.x) == n and "%{x}" in heat.hovertemplate
    assert fig.layout.xaxis.type == "category" and set(fig.layout.xaxis.tickvals) <= set(heat.x)
    assert heat.text is None and heat.customdata is None  # nothing per cell but the value
    both = figures.side_by_side([make_trace("full", n_pos=n, str_tokens=toks)] * 2, "source_heatmap")
    assert both.layout.xaxis2.type == "category" and set(both.layout.xaxis2.tickvals) <= set(heat.x)



def test_token_heatmap_title_names_model_and_token():
    fig = figures.token_heatmap(make_trace("full", name="demo-full", str_tokens=["x", "y", "z"]), token=2)
    assert "demo-full" in fig.layout.title.text and "'z'" in fig.layout.title.text


def test_token_heatmap_rejects_out_of_range_token():
    with pytest.raises(IndexError, match="out of range"):
        figures.token_heatmap(make_trace("full"), token=7)


def test_block_heatmap_draws_lines_between_reads_of_different_blocks():
    fig = figures.token_heatmap(make_trace("block"))  # blocks start at sublayers 0, 2; L = 4
    ys = sorted(s.y0 for s in fig.layout.shapes)
    assert ys == [1.5, 3.5]  # between L0.mlp | L1.attn, and L1.mlp | final


def test_expanded_block_heatmap_adds_vertical_lines_at_block_starts():
    fig = figures.token_heatmap(make_trace("block"), expanded=True)
    assert fig.data[0].z.shape == (5, 5)
    assert list(fig.data[0].x) == ["embed", "L0.attn", "L0.mlp", "L1.attn", "L1.mlp"]
    xs = sorted(s.x0 for s in fig.layout.shapes if s.yref == "y domain")
    assert xs == [0.5, 2.5]


def test_expanded_block_heatmap_gives_each_sublayer_its_block_value():
    z = np.asarray(figures.token_heatmap(make_trace("block"), expanded=True).data[0].z)
    np.testing.assert_allclose(z[3], [0.1, 0.2, 0.2, 0.7, nan], atol=1e-6)  # L1.mlp: block2 partial = L1.attn


def test_full_heatmap_has_no_block_lines():
    assert len(figures.token_heatmap(make_trace("full")).layout.shapes) == 0


def test_mean_heatmap_averages_real_tokens_and_keeps_unavailable_cells_nan():
    other = [[1.0, nan, nan], [0.75, 0.25, nan], [0.2, 0.3, 0.5]]
    trace = make_trace("full", n_pos=4, n_real=2, per_token={1: other})
    z = np.asarray(figures.mean_heatmap(trace).data[0].z)
    np.testing.assert_allclose(z[1], [0.5, 0.5, nan], atol=1e-6)
    assert np.isnan(z[0, 1:]).all()


def test_prenorm_logits_heatmap_is_blank_with_an_explanation():
    fig = figures.mean_heatmap(make_trace("prenorm"), kind="logits")
    assert np.isnan(np.asarray(fig.data[0].z, dtype=float)).all()
    assert "PreNorm has no depth logits" in fig.layout.annotations[0].text


# -- source heatmap ---------------------------------------------------------------------------
def test_source_heatmap_is_reads_by_tokens_with_token_tick_labels():
    trace = make_trace("block", n_pos=4, n_real=3, str_tokens=["a", "a", " "])
    fig = figures.source_heatmap(trace, source=1)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z.shape == (5, 3)
    np.testing.assert_allclose(z[:, 0], np.asarray(BLOCK_W)[:, 1], atol=1e-6)
    assert list(fig.layout.xaxis.tickvals) == [0, 1, 2]
    # duplicates kept, positional x; each label is the token's position over its text (#35 item 4)
    assert list(fig.layout.xaxis.ticktext) == ["0<br>a", "1<br>a", "2<br>␣"]
    assert figures.token_ticks(["a", "b"], positions=True, start=10) == ([10, 11], ["10<br>a", "11<br>b"])


def test_source_heatmap_accepts_a_source_label():
    fig = figures.source_heatmap(make_trace("block"), source="block2")
    assert "block2" in fig.layout.title.text
    assert np.isnan(np.asarray(fig.data[0].z, dtype=float)[:3]).all()  # reads before block2 exists


# -- line charts ------------------------------------------------------------------------------
def test_magnitudes_draws_both_profiles_per_trace_in_one_colour_on_log_axes():
    fig = figures.magnitudes([make_trace("full", rms_in=[1, 2, 4]), make_trace("prenorm", rms_in=[1, 3, 9])])
    assert [d.name for d in fig.data] == ["full", "full", "prenorm", "prenorm"]
    assert fig.data[0].line.color == fig.data[1].line.color != fig.data[2].line.color
    np.testing.assert_allclose(fig.data[2].y, [1, 3, 9])
    assert all(d.line.dash in (None, "solid") for d in fig.data)  # the legend shows solid lines: so do both panels
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    assert fig.layout.yaxis.tickformat == fig.layout.yaxis2.tickformat == figures.LOG_TICKFORMAT


@pytest.mark.parametrize("low, high, dtick", [(0.2, 5.0, "D2"), (0.004, 0.09, "D2"), (1e-5, 10.0, 1), (0.3, 0.9, None)])
def test_log_axes_format_every_tick_in_full_at_one_two_five(low, high, dtick):
    """Plotly's own "D1"/"D2" ticks label the digits between powers of ten with one small digit (0.2 reads "2");
    a tickformat labels them in full, at 1-2-5 over a few decades, powers of ten over many, plotly's evenly
    spaced "L" ticks under one (see also the browser test in tests/reports/test_report_readability.py)."""
    axis = figures.log_axis(np.geomspace(low, high, 9))
    assert axis["type"] == "log" and axis["tickformat"] == "~g"
    assert axis.get("dtick") == dtick
    fig = figures.gradient_norms([make_trace("full", rms_in=[1, 2, 4])])
    assert fig.layout.yaxis.tickformat == "~g"


def test_corpus_bands_are_positive_and_the_title_says_what_they_are():
    """#16: bands by depth on log axes never go below zero; the caption and the hover say what a band is."""
    from attnres_probe import Probe
    from attnres_probe.corpus.stats import RunningStats

    from helpers import tiny_model

    stats = Probe(tiny_model("full"), name="full").run_corpus(["a short text.", "another, longer text here"], backward=True,
                                                              progress=False)
    g = np.random.default_rng(1).lognormal(0.0, 2.0, size=(6, len(stats.meta["read_labels"])))
    stats.profiles["grad_in"] = RunningStats.zeros((g.shape[1],))
    stats.profiles["grad_in"].update(g)  # spread over orders of magnitude between windows
    fig = figures.gradient_bands([stats])
    band = next(d for d in fig.data if d.name == "full band")
    assert np.nanmin(np.asarray(band.y, float)) > 0
    title = fig.layout.title.text
    assert "95% interval of that mean" in title and "log scale" in title and "windows" in title
    line = next(d for d in fig.data if d.name == "full")
    assert "95% interval of the mean" in line.hovertemplate and "windows" in line.hovertemplate


def test_model_colors_are_deterministic_by_name_and_order():
    a = figures.model_colors(["mine", "prenorm", "other"])
    assert a == figures.model_colors(["mine", "prenorm", "other"])
    assert a["prenorm"] == figures.BASELINE_COLOR and a["mine"] != a["other"]


def test_gradient_norms_plots_recorded_gradients():
    fig = figures.gradient_norms([make_trace("full", grad_in=[1, 2, 3], param_grad=[4, 5])])
    np.testing.assert_allclose(fig.data[0].y, [1, 2, 3])
    np.testing.assert_allclose(fig.data[1].y, [4, 5])


def test_gradient_norms_notes_traces_without_gradients_instead_of_failing():
    fig = figures.gradient_norms([make_trace("full", grad_in=[1, 2, 3], param_grad=[4, 5]), make_trace("prenorm")])
    notes = [a.text for a in fig.layout.annotations]
    assert "prenorm: no gradients recorded" in notes
    assert {d.name for d in fig.data} == {"full"}


# -- side by side -----------------------------------------------------------------------------
def test_side_by_side_has_one_heatmap_per_trace_with_block_lines_on_their_own_subplot():
    fig = figures.side_by_side([make_trace("prenorm"), make_trace("block")], "mean_heatmap", kind="contrib")
    assert [type(d).__name__ for d in fig.data] == ["Heatmap", "Heatmap"]
    assert [d.showscale for d in fig.data] == [False, True]
    assert {s.yref for s in fig.layout.shapes} == {"y2"}


def test_side_by_side_turns_source_labels_upright_when_panels_get_narrow():
    """Block's few source labels lie flat in one or two panels; five panels a fifth of the page wide
    each would run them together ("embedblock1block2..."), so they stand upright there."""
    two = figures.side_by_side([make_trace("prenorm"), make_trace("block")], "mean_heatmap", kind="contrib")
    block = make_trace("block", [[0.2] * 5] * 5, block_starts=[0, 1, 2, 3])  # embed + 4 blocks, as the demo Block has
    five = figures.side_by_side([make_trace("prenorm"), make_trace("full"), block, make_trace("full"),
                                 make_trace("prenorm")], "mean_heatmap", kind="contrib", names=list("abcde"))
    assert two.layout.xaxis2.tickangle == 0
    assert five.layout.xaxis3.tickangle == -90


def test_side_by_side_rejects_unknown_chart_names():
    with pytest.raises(ValueError, match="mean_heatmap"):
        figures.side_by_side([make_trace("full")], "magnitudes")


# -- ablation, tables -------------------------------------------------------------------------
def test_ablation_chart_shows_delta_loss_bars_beside_mass_for_one_read():
    frame = pd.DataFrame(
        {
            "read": ["final"] * 3 + ["L0.mlp"] * 2,
            "source": ["embed", "L0.attn", "L0.mlp", "embed", "L0.attn"],
            "mass": [0.2, 0.3, 0.5, 0.25, 0.75],
            "contrib": [0.1, 0.3, 0.6, 0.2, 0.8],
            "delta_loss": [0.4, 0.1, 0.9, 0.05, 0.2],
        }
    )
    fig = figures.ablation_chart(frame, read="final")
    bar, mass = fig.data[0], fig.data[1]
    assert type(bar).__name__ == "Bar" and list(bar.x) == ["embed", "L0.attn", "L0.mlp"]
    np.testing.assert_allclose(bar.y, [0.4, 0.1, 0.9])
    np.testing.assert_allclose(mass.y, [0.2, 0.3, 0.5])
    assert mass.yaxis == "y2"
    contrib = fig.data[2]
    assert contrib.yaxis == "y3"  # #17 item 4: routing mass and contribution share on their own axes
    assert fig.layout.yaxis2.range[0] <= 0 and fig.layout.yaxis2.range[1] >= 1  # weights 0..1
    assert fig.layout.yaxis3.range[0] <= 0 and fig.layout.yaxis3.range[1] >= 1
    # another rule's normalised coefficients may lie outside 0..1: the mass axis widens to show them
    signed = figures.ablation_chart(frame.assign(mass=[-0.3, 0.1, 1.2, 0.25, 0.75]), read="final")
    assert signed.layout.yaxis2.range[0] < -0.3 and signed.layout.yaxis2.range[1] > 1.2


def test_ablation_chart_draws_one_bar_series_per_mode_and_markers_once():
    frame = pd.DataFrame(
        {
            "read": ["final"] * 4,
            "source": ["embed", "L0.attn", "embed", "L0.attn"],
            "mode": ["zero", "zero", "uniform", "uniform"],
            "mass": [0.2, 0.8, 0.2, 0.8],
            "contrib": [0.1, 0.9, 0.1, 0.9],
            "delta_loss": [0.4, 0.1, 0.2, 0.05],
        }
    )
    fig = figures.ablation_chart(frame)
    bars = [d for d in fig.data if type(d).__name__ == "Bar"]
    assert [b.name for b in bars] == ["Δloss when ablated (zero)", "Δloss when ablated (uniform)"]
    np.testing.assert_allclose(bars[1].y, [0.2, 0.05])
    assert list(fig.data[2].x) == ["embed", "L0.attn"]


def test_ablation_chart_names_missing_columns():
    with pytest.raises(ValueError, match="delta_loss"):
        figures.ablation_chart(pd.DataFrame({"read": [], "source": [], "mass": [], "contrib": []}))


def test_metric_table_figure_shows_nan_as_a_dash():
    fig = figures.metric_table_figure(pd.DataFrame({"a": [1.23456, nan]}, index=pd.Index(["x", "y"], name="metric")))
    assert list(fig.data[0].cells.values[1]) == ["1.235", "—"]


# -- HTML summary -----------------------------------------------------------------------------
def test_summary_html_escapes_tokens_and_names():
    trace = make_trace("full", str_tokens=["<script>", "alert(1)", "</script>"], name="<b>x</b>")
    out = figures.trace_summary_html(trace)
    assert "<script>" not in out and "&lt;script&gt;" in out
    assert "<b>x</b>" not in out


def test_summary_html_highlights_flags_only_when_present():
    flagged = figures.trace_summary_html(make_trace("full", flags=["rms_in: 2 non-finite values <x>"]))
    assert "attnres-flags" in flagged and "rms_in: 2 non-finite values &lt;x&gt;" in flagged
    assert "attnres-flags" not in figures.trace_summary_html(make_trace("full"))


def test_repr_html_of_a_trace_is_the_summary_card():
    trace = make_trace("block", grad_in=[1, 1, 1, 1, 1])
    out = trace._repr_html_()
    assert "5 × 3" in out and "recorded" in out and "2.0000" in out



# -- reading the residual stream (#17 item 13) --------------------------------------------------
def test_logit_contributions_and_logit_lens_charts_from_a_probe():
    from attnres_probe import ByteTokenizer, Probe

    from helpers import tiny_model

    probe = Probe(tiny_model("block"), tokenizer=ByteTokenizer(), name="block")
    lc = probe.logit_contributions("hello there", token=4)
    fig = figures.logit_contributions_chart(lc, k=3, name="block")
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z.shape == (len(lc.sources) + 1, 3)
    np.testing.assert_allclose(z[-1], np.sort(lc.logits)[::-1][:3], rtol=1e-5, atol=1e-5)  # the sum row is the logit
    assert fig.data[0].zmin == -fig.data[0].zmax and "token 4" in fig.layout.title.text
    text = np.asarray(fig.data[0].text)
    # the sum row prints the logits (3 significant digits)
    assert (text[:-1] == "").all() and [float(t) for t in text[-1]] == pytest.approx(z[-1], rel=5e-3)
    lens = probe.logit_lens("hello there", k=3, positions=[4])
    lf = figures.logit_lens_chart(lens, 4, name="block")
    assert np.asarray(lf.data[0].z, dtype=float).shape == (len(set(lens["read"])), 3)
    assert (np.asarray(lf.data[0].text) != "").all()


def test_static_image_export_is_in_the_default_install():
    """#17 item 9: kaleido is a default dependency, not only the study extra."""
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith("kaleido") for d in project["dependencies"])


def test_titles_of_one_line_per_part_hang_from_the_top_with_room_above_the_plot():
    """A three-line title anchored at the top of the figure, in a margin that holds all three lines and a gap
    (plotly's default centres the first line in the margin, which put the third line on the first row)."""
    for fig in (figures.token_heatmap(make_trace("full"), token=1), figures.difference_heatmap(make_trace("full"), make_trace("prenorm"), token=1)):
        n = len(fig.layout.meta["title_parts"])
        assert fig.layout.title.yanchor == "top" and fig.layout.title.yref == "container" and fig.layout.title.y == 1
        last_baseline = fig.layout.title.pad.t + figures.TITLE_LINE_PX * (n - 1)
        assert fig.layout.margin.t >= last_baseline + 12 and fig.layout.title.pad.t >= figures.TITLE_ASCENT_PX


def test_a_per_token_difference_names_the_token_as_the_other_panels_do():
    full, base = make_trace("full"), make_trace("prenorm")
    tok = full.str_tokens[0][1]
    diff = figures.difference_heatmap(full, base, token=1)
    assert f"token 1 {figures.quote_token(tok)} (sequence 0)" in diff.layout.title.text
    assert f"token 1 {figures.quote_token(tok)} (sequence 0)" in figures.token_heatmap(full, token=1).layout.title.text


def _history(n_reads: int, weights: bool) -> list[dict]:
    """A synthetic probe history (training.probes.summarize's keys) over three steps."""
    rng = np.random.default_rng(0)
    out = []
    for step in (0, 250, 500):
        out.append({
            "step": step,
            "embed_weight": list(rng.random(n_reads)) if weights else [None] * n_reads,
            "recent_mass": list(rng.random(n_reads)),
            "entropy": list(rng.random(n_reads)),
            "rms_in": list(1 + rng.random(n_reads)),
            "act_grad_cv": float(rng.random()),
        })
    return out


def test_over_training_draws_prenorms_implied_weights_and_keeps_its_height():
    """#35 item 2: PreNorm's routing rows are its implied weights 1/k (drawn from the reads' source
    counts where an old history lacks them, with a note), never shares beside AttnRes's weights."""
    fig = figures.over_training({"prenorm": _history(5, weights=False), "block": _history(5, weights=True)})
    notes = [(a.text, a.xref) for a in fig.layout.annotations]
    assert [x for t, x in notes if t.startswith("PreNorm: implied weights 1/k")] == ["x domain"]  # row 1, column 1
    assert not any("contribution shares" in t for t, _ in notes)
    k = np.arange(1, 6)
    prenorm = {(t.xaxis, t.name): np.asarray(t.y, float) for t in fig.data if t.xaxis in ("x", "x3", "x5")}
    for r, label in enumerate(["L0.attn", "L0.mlp", "L1.attn", "L1.mlp", "final"]):
        np.testing.assert_allclose(prenorm[("x", label)], 1 / k[r])  # embedding weight 1/k
        np.testing.assert_allclose(prenorm[("x3", label)], 1 / k[r])  # recent mass 1/k
        np.testing.assert_allclose(prenorm[("x5", label)], np.nan if r == 0 else 1.0)  # entropy of a uniform mixture
    assert fig.layout.height == 190 * 5 + 120  # five rows: a saved image must keep this height
    # a flat row (entropy 1 to float rounding) gets short tick labels, not 0.9999999999999978
    assert all(ax.tickformat == ".3~g" for ax in (fig.layout[k] for k in fig.layout if k.startswith("yaxis")))


def test_over_training_lines_are_told_apart_and_the_legend_says_how_to_isolate_one():
    """#35 item 2: 17 reads were near-identical shades; now one colour per layer (its MLP read dotted,
    the final read black), five reads drawn at first and the rest one legend click away, which the
    legend says."""
    fig = figures.over_training({"full": _history(17, weights=True)})
    first = [t for t in fig.data if t.xaxis == "x"]
    assert [t.name for t in first if t.visible is not False and t.visible != "legendonly"] == [
        "L0.attn", "L4.attn", "L7.attn", "L7.mlp", "final"]
    colours = {t.name: t.line.color for t in first}
    assert len({colours[f"L{i}.attn"] for i in range(8)}) == 8 and colours["L3.attn"] == colours["L3.mlp"]
    assert {t.line.dash for t in first if t.name.endswith(".mlp")} == {"dot"}
    assert {t.line.dash for t in first if t.name.endswith(".attn")} == {"solid"} and colours["final"] == "#111"
    assert "double-click" in fig.layout.legend.title.text


def test_the_study_writes_each_image_at_its_figures_height(tmp_path, monkeypatch):
    from attnres_probe import study

    sizes = {}
    monkeypatch.setattr("plotly.graph_objects.Figure.write_image",
                        lambda self, path, **kw: sizes.__setitem__(path.name, (kw["width"], kw["height"])))
    tall = figures.over_training({"block": _history(5, weights=True)})
    plain = figures.go.Figure()
    study._write_figures({"over_training": tall, "plain": plain}, tmp_path, "png")
    assert sizes == {"over_training.png": (1100, 1070), "plain.png": (1100, 520)}


def test_difference_views_subtract_like_from_like_and_a_share_row_sums_to_zero():
    """#31 item 4: Block against PreNorm on Block's axis (PreNorm's shares summed into the same blocks),
    Full against PreNorm on sublayers; each row of share differences sums to about 0."""
    from attnres_probe import Probe

    from helpers import sample_tokens, tiny_model

    tokens = sample_tokens(12, batch=2)
    pre = Probe(tiny_model("prenorm", n_layers=2), name="prenorm").run(tokens)
    for residual, sources in (("block", ["embed", "block1", "block2"]), ("full", ["embed", "L0.attn", "L0.mlp", "L1.attn", "L1.mlp"])):
        model = Probe(tiny_model(residual, n_layers=2), name=residual).run(tokens)
        for token in (None, 3):
            fig = figures.difference_heatmap(model, pre, token=token)
            z = np.asarray(fig.data[0].z, dtype=float)
            assert list(fig.data[0].x) == sources
            np.testing.assert_allclose(np.nansum(z, axis=1), 0.0, atol=1e-5)  # shares of one read add up to 1 on both sides
            vertical = [sh for sh in fig.layout.shapes if sh.xref == "x"]  # lines across the sources stay on the axis
            assert all(-0.5 <= sh.x0 <= len(sources) - 0.5 for sh in vertical)
            if residual == "block":
                assert not vertical  # each column is a block already
    block = Probe(tiny_model("block", n_layers=2), name="block").run(tokens)
    fig = figures.difference_heatmap(block, pre)
    both = np.asarray(fig.data[0].customdata, dtype=float)
    pre_blocks = both[..., 1]  # PreNorm's shares summed into Block's blocks: block1 = L0.attn + L0.mlp at the final read
    shares = np.nanmean(np.where(pre.mask[..., None, None], pre.contrib, np.nan), axis=(0, 1))
    assert pre_blocks[-1, 1] == pytest.approx(shares[-1, 1] + shares[-1, 2], abs=1e-6)


def test_a_newline_token_reads_as_backslash_n_in_titles_not_its_doubled_repr():
    """A title showed a newline token as '\\\\n' (Python's repr of the label \\n)."""
    model = AttnResTransformer(ModelConfig(d_model=16, n_layers=1, n_heads=2, n_ctx=8, residual="full"))
    trace = Probe(model).run("a\nb", backward=False)
    assert trace.str_tokens[0][1] == "\\n"
    title = figures.token_heatmap(trace, token=1).layout.title.text
    assert "token 1 '\\n'" in title and "\\\\n" not in title
