"""Dashboard callbacks called directly, as plain functions of the explorer and the browser's values."""

from __future__ import annotations

import numpy as np
import pytest
from dash import html, no_update

from attnres_probe import ByteTokenizer, Probe, figures, metrics
from attnres_probe.analysis.windows import normalised_weights, uniform_weights
from attnres_probe.dashboards import Explorer, PromptError, callbacks, create_app
from attnres_probe.dashboards.layout import build_layout

from dash_helpers import N_CTX, NAMES, TEXT, make_model
from helpers import find_components


def token(ex, pos: int, key: str | None = None) -> dict:
    return {"key": key or ex.initial.key, "token": pos}


def texts(component) -> list[str]:
    """Every string inside a Dash component tree (what the browser shows as text)."""
    out: list[str] = []

    def walk(node):
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, (list, tuple)):
            for n in node:
                walk(n)
        elif hasattr(node, "children"):
            walk(node.children)

    walk(component)
    return out


# -- token selection ----------------------------------------------------------------------------
def test_token_views_show_each_models_weights_for_the_selected_token(ex):
    out = callbacks.token_views(ex, token(ex, 4), "weights", [])
    for name, fig in zip(ex.names, out["figures"]):
        w = ex.initial.traces[name].depth_weights[0, 4].astype(np.float64)
        if name == "prenorm":  # coefficients all one: its implied weights 1/k, no blank-panel note
            np.testing.assert_allclose(fig.data[0].z, w / np.nansum(w, -1, keepdims=True), rtol=1e-12)
            assert not fig.layout.annotations and "implied weight 1/k" in fig.layout.title.text
            continue
        np.testing.assert_array_equal(fig.data[0].z, w)
        # one title line (the page's panel names the model); its parts, the name included, stay in meta
        assert fig.layout.title.text.startswith("token 4 ") and "<br>" not in fig.layout.title.text
        assert fig.layout.meta["title_parts"][0] == name
    assert out["panels"] == [callbacks.SHOWN] * 3
    assert "token 4 of" in "".join(texts(out["info"])) and "next-token loss (nats): " in "".join(texts(out["info"]))


def test_token_views_contribution_share_and_expanded_block_view(ex):
    out = callbacks.token_views(ex, token(ex, 2), "contrib", ["expanded"])
    block = ex.names.index("block")
    trace = ex.initial.traces["block"]
    fig = out["figures"][block]
    expanded, labels = trace.expanded("contrib")
    assert list(fig.data[0].x) == labels
    np.testing.assert_array_equal(fig.data[0].z, expanded[0, 2].astype(np.float64))
    assert len(fig.layout.shapes) > 0  # block boundaries marked


def test_logit_panels_share_one_colour_range(ex):
    out = callbacks.token_views(ex, token(ex, 3), "logits", [])
    full, block = (out["figures"][ex.names.index(n)] for n in ("full", "block"))
    assert full.data[0].zmax == block.data[0].zmax == -full.data[0].zmin > 0


@pytest.mark.parametrize("bad", [{"key": "nope", "token": 1}, None, "x"])
def test_token_views_reject_bad_keys_without_touching_the_figures(ex, bad):
    out = callbacks.token_views(ex, bad, "weights", [])
    assert out["figures"] == [no_update] * 3


@pytest.mark.parametrize("pos", [-1, len(TEXT), 2.5, "3", True])
def test_token_views_reject_positions_outside_the_text(ex, pos):
    out = callbacks.token_views(ex, token(ex, pos), "weights", [])
    assert out["figures"] == [no_update] * 3
    assert "out of range" in out["info"]


def test_an_unknown_colour_kind_falls_back_to_weights(ex):
    out = callbacks.token_views(ex, token(ex, 1), "<script>", "expanded")
    assert "depth weight" in out["figures"][1].layout.title.text


# -- token strip --------------------------------------------------------------------------------
def test_token_strip_has_one_text_chip_per_token_and_selects_an_informative_one(ex):
    """#35 item 1: the page opens on the token whose routing departs furthest from uniform (not the
    first byte, which has no context), marks its chip and says which and why."""
    out = callbacks.token_strip(ex, ex.initial.key)
    assert [c.children for c in out["chips"]] == list(TEXT)
    assert all(isinstance(c, html.Button) for c in out["chips"])
    assert out["chips"][1].id == {"type": "chip", "index": 1}
    traces = ex.initial.traces
    n = len(TEXT)
    distance = np.zeros(n)
    for name in ("full", "block"):  # by hand: total-variation distance to the uniform reference, mean over reads
        t = traces[name]
        w = normalised_weights(t, t.depth_weights[0, :n].astype(np.float64))
        distance += (0.5 * np.nansum(np.abs(w - uniform_weights(t)), -1)).mean(-1) / 2
    want = int(np.argmax(distance))
    assert want != 0 and out["token"] == {"key": ex.initial.key, "token": want}
    assert [c.className for c in out["chips"]].index("chip selected") == want
    assert f"Opened on token {want} '{TEXT[want]}'" in out["note"] and f"{distance[want]:.2f}" in out["note"]


def test_without_an_attnres_model_the_page_opens_on_the_last_token():
    solo = Explorer({"prenorm": make_model("prenorm")}, text=TEXT)
    out = callbacks.token_strip(solo, solo.initial.key)
    assert out["token"]["token"] == len(TEXT) - 1 and "last token" in out["note"]


def test_markup_in_a_prompt_stays_plain_text_in_every_component(ex):
    text = '<img src=x onerror="window.__xss=1">'
    key = callbacks.run_prompt(ex, 1, text)["key"]
    chips = callbacks.token_strip(ex, key)["chips"]
    assert "".join(c.children for c in chips) == text
    info = callbacks.token_views(ex, token(ex, 0, key), "weights", [])["info"]
    assert "<" in texts(info)
    assert "dangerously_allow_html" not in repr(build_layout(ex))


# -- prompts ------------------------------------------------------------------------------------
def test_running_a_prompt_records_every_model_and_returns_its_key(ex):
    out = callbacks.run_prompt(ex, 1, "Hello depth.")
    assert out["status_class"] == "status ok"
    traces = ex.traces(out["key"])
    assert list(traces) == list(NAMES)
    assert all(t.n_tokens == len("Hello depth.") for t in traces.values())


@pytest.mark.parametrize(
    "text, message",
    [("", "the prompt is empty"), ("x" * (N_CTX + 1), f"text has {N_CTX + 1} tokens; the models' context is {N_CTX}"),
     ("x" * 10_000, "characters; the limit is"), (None, "must be text"), (["a"], "must be text")],
)
def test_bad_prompts_get_a_message_and_leave_the_key_alone(ex, text, message):
    out = callbacks.run_prompt(ex, 1, text)
    assert out["key"] is no_update
    assert message in out["status"] and out["status_class"] == "status error"


class CountingTokenizer:
    """A byte tokenizer that counts how often it turns text into ids."""

    def __init__(self):
        self.inner = ByteTokenizer()
        self.calls = 0

    def to_tokens(self, text: str):
        self.calls += 1
        return self.inner.to_tokens(text)

    def to_str_tokens(self, tokens):  # labels ids already made: not a tokenization
        return self.inner.to_str_tokens(tokens)


def test_a_prompt_is_tokenized_once_per_model(models):
    """Checking a prompt, recording it and ablating on it share one tokenization per model."""
    counters = {name: CountingTokenizer() for name in NAMES}
    ex = Explorer({n: Probe(models[n], tokenizer=counters[n], name=n) for n in NAMES}, text=TEXT)
    assert {n: c.calls for n, c in counters.items()} == dict.fromkeys(NAMES, 1)  # the initial text
    key = ex.run("Hello depth.")
    assert {n: c.calls for n, c in counters.items()} == dict.fromkeys(NAMES, 2)
    assert ex.traces(key)["block"].str_tokens[0] == list("Hello depth.")
    ex.ablate(key, "block", "final")
    assert counters["block"].calls == 2


def test_a_one_token_prompt_runs_without_gradients(ex):
    key = callbacks.run_prompt(ex, 1, "x")["key"]
    assert not ex.traces(key)["full"].has_gradients
    assert callbacks.profile_views(ex, key)["gradients"].layout.annotations  # "no gradients recorded" notes


def test_the_trace_cache_is_bounded_and_redoes_evicted_results(models):
    app = create_app(models, text=TEXT, cache_size=2)
    ex = app.explorer
    keys = [ex.run(f"text number {i}") for i in range(4)]
    assert len(ex._cache) == 2 and keys[0] not in ex._cache
    again = ex.traces(keys[0])  # recorded again from its remembered text
    assert again["full"].n_tokens == len("text number 0")
    assert ex.traces(ex.initial.key) is ex.initial.traces  # the initial result is never evicted


# -- whole-text views ---------------------------------------------------------------------------
def test_mean_and_source_views_come_from_figures(ex):
    mean = callbacks.mean_views(ex, ex.initial.key, "weights", [])
    trace = ex.initial.traces["full"]
    expected = figures.mean_heatmap(trace)
    np.testing.assert_array_equal(mean["figures"][1].data[0].z, expected.data[0].z)
    src = callbacks.source_views(ex, ex.initial.key, "embed", "weights")
    np.testing.assert_array_equal(src["figures"][1].data[0].z, trace.depth_weights[0, :, :, 0].T.astype(np.float64))


def test_a_source_a_model_lacks_gets_a_note_instead_of_a_chart(ex):
    out = callbacks.source_views(ex, ex.initial.key, "L1.mlp", "weights")
    block = ex.names.index("block")
    assert out["graphs"][block] == callbacks.HIDDEN and "has no source 'L1.mlp'" in out["notes"][block]
    assert out["graphs"][1] == callbacks.SHOWN
    assert callbacks.source_views(ex, ex.initial.key, "../../etc/passwd", "weights")["figures"][0].layout.title.text.find("embed") > 0


def test_profiles_draw_every_model_in_one_chart(ex):
    out = callbacks.profile_views(ex, ex.initial.key)
    assert [t.name for t in out["magnitudes"].data if t.showlegend is not False] == list(NAMES)
    assert {t.name for t in out["gradients"].data} == set(NAMES)


_find = find_components


def _verdicts_shown(node) -> list[str]:
    return [b.children for b in _find(node, lambda n: isinstance(n, html.Span) and "verdict" in (getattr(n, "className", "") or ""))]


def _expected_headline_verdicts(frame) -> list[str]:
    out = []
    for _, _, names in callbacks.CARD_GROUPS:
        for m in names:
            models = list(dict.fromkeys(frame.loc[(frame.metric == m) & (frame.comparison == "value"), "model"]))
            for model in models:
                row = frame[(frame.metric == m) & (frame.model == model) & (frame.comparison != "value")]
                out += list(row["verdict"])
    return out


def test_metric_cards_show_compare_s_estimates_intervals_and_verdicts_with_formulas(ex):
    shown_all = callbacks.metric_cards(ex, ex.initial.key)
    cards = [c for c in shown_all if c.className == "metric-card"]
    assert [c.children[0].children for c in cards] == ["Locality", "Embedding retention", "Gradient uniformity", "Magnitude growth"]
    assert [c.className for c in shown_all if c not in cards] == ["help basis-note"]  # said once, above the cards
    frame = metrics.compare(*ex.initial.traces.values(), names=list(NAMES))
    assert _verdicts_shown(cards) == _expected_headline_verdicts(frame) and set(_verdicts_shown(cards)) == {"inconclusive"}
    names = _find(cards[0], lambda n: getattr(n, "className", None) == "metric-name")
    assert names[0].title == metrics.FORMULAS["locality_distance"]
    shown = " ".join(texts(cards[0]))
    row = frame.query("metric == 'locality_distance' and model == 'full' and baseline == 'uniform'").iloc[0]
    assert f"{row['estimate']:+.3g} vs uniform" in shown  # routing: against the uniform weights on the model's own sources
    assert "paper: lower than uniform" in shown
    assert "no interval: 1 window" not in shown  # a prompt is one window: the section says it once, not every cell
    assert "normalised weights" in shown and "uniform: " in shown  # the one quantity, and its reference beside it
    assert "weights vs shares" not in " ".join(texts(shown_all))
    gradients = " ".join(texts(cards[2]))
    assert "vs prenorm" in gradients and "paper: lower than prenorm" in gradients


def test_no_text_asserts_the_papers_direction(ex):
    page = " ".join(texts(build_layout(ex)))
    assert "AttnRes keeps magnitudes bounded and spreads gradients more evenly." not in page
    assert "The paper reports" in page


def test_the_corpus_section_leads_with_compare_s_verdicts_for_the_same_stats(models, corpus_stats):
    app = create_app(models, text=TEXT, stats=corpus_stats)
    page = app.layout
    corpus = _find(page, lambda n: getattr(n, "id", None) == "corpus")[0]
    frame = metrics.compare(*corpus_stats.values(), names=list(corpus_stats))
    headline = _find(corpus, lambda n: getattr(n, "id", None) == "corpus-headline")[0]
    assert _verdicts_shown(headline) == _expected_headline_verdicts(frame)
    shown = " ".join(texts(headline))
    assert "95% CI [" in shown and "windows" in shown
    table = _find(corpus, lambda n: isinstance(n, html.Table) and "full-table" in (n.className or ""))[0]
    rows = {r.to_plotly_json()["props"]["data-metric"]: r for r in _find(table, lambda n: isinstance(n, html.Tr) and
                                                                         "data-metric" in n.to_plotly_json()["props"])}
    for metric in ("param_grad_cv", "mean_loss"):
        want = list(frame[(frame.metric == metric) & (frame.comparison != "value")]["verdict"])
        assert _verdicts_shown(rows[metric]) == want
    graphs = {g.id: g.figure for g in _find(corpus, lambda n: getattr(n, "figure", None) is not None)}
    assert "95% interval" in graphs["corpus-magnitudes"].layout.title.text and "log scale" in graphs["corpus-magnitudes"].layout.title.text
    notes = " ".join(texts(corpus))
    assert "the same quantity, in the same unit, on the same axis" in notes  # what every comparison sets side by side
    assert "Only" not in notes  # twelve documents: no warning
    assert "sd over tokens" in graphs["corpus-contrib"].data[0].hovertemplate


def test_the_corpus_section_warns_once_when_the_documents_are_few(models):
    """#16: a four-document corpus gives rough intervals: the page says so above the cards."""
    from attnres_probe import Probe

    from dash_helpers import CORPUS

    few = {name: Probe(m, name=name).run_corpus(CORPUS, backward=True, progress=False) for name, m in models.items()}
    corpus = _find(create_app(models, text=TEXT, stats=few).layout, lambda n: getattr(n, "id", None) == "corpus")[0]
    warnings = _find(corpus, lambda n: "few-documents" in (getattr(n, "className", "") or ""))
    assert len(warnings) == 1 and "Only 4 documents: intervals are rough" in warnings[0].children


def test_dash_stats_refuses_models_the_stats_were_not_recorded_from(tmp_path, corpus_stats):
    from attnres_probe.corpus import CorpusRunError
    from attnres_probe.dashboards.serving import load_with_stats

    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    for name, st in corpus_stats.items():
        st.save(run / "models" / name)
    manifest = {"schema_version": 1, "complete": True,
                "models": [{"name": n, "source": "demo:" + n, "dir": f"models/{n}", "complete": True} for n in corpus_stats]}
    (run / "corpus.json").write_text(__import__("json").dumps(manifest))
    other = make_model("block", seed=5)
    other.save(tmp_path / "block")
    with pytest.raises(CorpusRunError, match="the stats of 'block' were recorded from another model"):
        load_with_stats([str(tmp_path / "block")], None, str(run))
    with pytest.raises(CorpusRunError, match="not a folder written by `attnres-probe corpus`"):
        load_with_stats(None, None, str(tmp_path))


# -- ablation -----------------------------------------------------------------------------------
def test_ablation_shows_delta_loss_beside_mass_for_the_chosen_read(ex):
    out = callbacks.ablation_view(ex, 1, ex.initial.key, "block", "final", "zero")
    expected = Probe(ex.probes["block"].model, name="block").ablate(TEXT, sources="all", reads=["final"])
    bars = out["figure"].data[0]
    assert list(bars.x) == list(expected["source"])
    np.testing.assert_allclose(bars.y, expected["delta_loss"], rtol=1e-5, atol=1e-7)
    assert "base loss" in out["status"]


@pytest.mark.parametrize("model, read, mode", [("prenorm", "final", "zero"), ("full", "L0.attn", "zero"), ("full", "final", "rm -rf")])
def test_ablation_rejects_choices_it_does_not_offer(ex, model, read, mode):
    out = callbacks.ablation_view(ex, 1, ex.initial.key, model, read, mode)
    assert out["figure"] is no_update and out["status"]


def test_ablation_read_options_skip_the_one_source_read(ex):
    out = callbacks.ablation_reads(ex, "full")
    assert out["options"][0]["value"] == "L0.mlp" and out["value"] == "final"


def test_weight_effect_waits_for_the_button_then_shows_every_live_model(ex):
    """#31 item 3 in the dashboard: nothing runs until the button; then one summary row per live model
    (PreNorm included) from ablation.weight_beside_effect, and the chart; a new text clears it."""
    from attnres_probe.ablation import weight_beside_effect

    idle = callbacks.weight_effect_view(ex, 0, ex.initial.key, pressed=False)
    assert idle["table"] == [] and idle["graph_style"] == {"display": "none"} and "Press" in idle["status"]
    out = callbacks.weight_effect_view(ex, 1, ex.initial.key)
    table = out["table"][0]
    rows = _find(table, lambda n: isinstance(n, html.Tr))[1:]
    assert [r.children[0].children for r in rows] == list(NAMES)
    want = weight_beside_effect(Probe(ex.probes["full"].model, name="full"), TEXT)
    full = rows[list(NAMES).index("full")]
    assert full.children[2].children == f"{want['embed_weight'].mean():.3g}"
    assert full.children[3].children == f"{want['embed_uniform'].mean():.3g}"
    assert full.children[4].children == f"{want['embed_delta'].mean():+.3g}"
    block = rows[list(NAMES).index("block")]  # Block's uniform share counts a block's sublayers (not 1 / blocks)
    wb = weight_beside_effect(Probe(ex.probes["block"].model, name="block"), TEXT)
    assert block.children[3].children == f"{wb['embed_uniform'].mean():.3g}"
    assert (wb["embed_uniform"] < 1.0 / wb["sources"]).all()
    assert {t.name for t in out["figure"].data} == {f"{n} · {s}" for n in NAMES for s in ("embedding", "most recent source")}
    assert out["graph_style"] == {} and "nats per token" in " ".join(texts(out["table"]))
    again = callbacks.weight_effect_view(ex, 1, ex.initial.key, pressed=False)
    assert again["table"] == []


def test_weight_effect_on_an_unknown_key_says_so(ex):
    out = callbacks.weight_effect_view(ex, 1, "no-such-key")
    assert out["table"] == [] and out["status"]


# -- traces-only and mixed modes ----------------------------------------------------------------
def test_traces_only_mode_shows_saved_traces_and_refuses_new_prompts(ex):
    saved = dict(ex.initial.traces)
    app = create_app(saved)
    tex = app.explorer
    assert not tex.live and "Traces-only mode" in "".join(texts(app.layout))
    with pytest.raises(PromptError, match="traces-only mode"):
        tex.run("new text")
    out = callbacks.token_views(tex, token(tex, 2), "weights", [])
    np.testing.assert_array_equal(out["figures"][2].data[0].z, saved["block"].depth_weights[0, 2].astype(np.float64))
    assert [c.children for c in callbacks.token_strip(tex, tex.initial.key)["chips"]] == list(TEXT)


def test_saved_traces_beside_models_are_hidden_for_other_texts(models, ex):
    app = create_app({"block": models["block"], "old full": ex.initial.traces["full"]}, text=TEXT)
    mex = app.explorer
    assert set(mex.initial.traces) == {"block", "old full"}
    key = mex.run("another text")
    out = callbacks.token_views(mex, token(mex, 0, key), "weights", [])
    assert out["panels"] == [callbacks.SHOWN, callbacks.HIDDEN]
    assert "belong to the initial text" in callbacks.token_strip(mex, key)["note"]


def test_a_model_with_a_shorter_context_sets_the_limit(models):
    app = create_app({"prenorm": models["prenorm"], "short": make_model("full")}, text="ab")
    assert app.explorer.n_ctx == N_CTX



# -- #17: signed scales, difference view, reading the residual stream, names, one model -----------
def test_share_panels_share_one_symmetric_range_centred_on_zero(ex):
    out = callbacks.token_views(ex, token(ex, 3), "contrib", [])
    ranges = {(f.data[0].zmin, f.data[0].zmax) for f in out["figures"]}
    assert len(ranges) == 1 and next(iter(ranges))[0] == -next(iter(ranges))[1] <= -1


def test_difference_view_shows_each_attnres_model_minus_the_baseline(ex):
    out = callbacks.token_views(ex, token(ex, 3), "contrib", ["diff"])
    figs = dict(zip(ex.names, out["figures"]))
    assert "full − prenorm" in figs["full"].layout.title.text and "block − prenorm" in figs["block"].layout.title.text
    assert "−" not in figs["prenorm"].layout.title.text  # the baseline itself
    want = figures.difference_heatmap(ex.initial.traces["full"], ex.initial.traces["prenorm"], token=3)
    np.testing.assert_allclose(np.asarray(figs["full"].data[0].z, float), np.asarray(want.data[0].z, float))
    mean = callbacks.mean_views(ex, ex.initial.key, "contrib", ["diff"])
    assert "mean over tokens" in mean["figures"][1].layout.title.text


def test_against_prenorm_the_difference_view_subtracts_contribution_shares_whatever_the_colour(ex):
    """PreNorm has no routing weights (its coefficients are all one, not a softmax) and no logits: a
    weights-minus-ones panel would paint every cell negative. The view subtracts shares and says so."""
    want = figures.difference_heatmap(ex.initial.traces["full"], ex.initial.traces["prenorm"], kind="contrib", token=3)
    for kind in ("weights", "logits"):
        out = callbacks.token_views(ex, token(ex, 3), kind, ["diff"])
        full = dict(zip(ex.names, out["figures"]))["full"]
        np.testing.assert_allclose(np.asarray(full.data[0].z, float), np.asarray(want.data[0].z, float))
        assert "difference in contribution share" in out["caption"] and "prenorm has no routing" in out["caption"]
    with pytest.raises(ValueError, match="PreNorm has no routing weights"):
        figures.difference_heatmap(ex.initial.traces["full"], ex.initial.traces["prenorm"], kind="weights")


def test_reading_views_show_logit_contributions_and_the_logit_lens_of_each_model(ex):
    out = callbacks.reading_views(ex, token(ex, 2))
    for i, name in enumerate(ex.names):
        assert "token 2" in out["decomp"][i].layout.title.text and name in out["decomp"][i].layout.title.text
        assert "logit lens" in out["lens"][i].layout.title.text
        assert out["decomp_graphs"][i] == out["lens_graphs"][i] == callbacks.SHOWN and out["notes"][i] == ""
    # #35 item 4: the panels side by side share one symmetric colour range, the widest of them
    # (each chart's own range leaves out its last row, the logit itself, as figures.logit_contributions_chart does)
    widest = max(np.nanmax(np.abs(np.asarray(f.data[0].z, dtype=float)[:-1])) for f in out["decomp"])
    assert {(f.data[0].zmin, f.data[0].zmax) for f in out["decomp"]} == {(-widest, widest)}


def test_reading_views_say_in_words_that_saved_traces_hold_no_activations(models):
    trace = Probe(models["full"], name="saved").run(TEXT)
    ex = create_app({"saved": trace}).explorer
    out = callbacks.reading_views(ex, token(ex, 1))
    assert out["decomp_graphs"] == [callbacks.HIDDEN] and "holds depth weights, not activations" in out["notes"][0]


def test_one_model_page_does_not_talk_about_a_baseline(models):
    page = " ".join(texts(build_layout(create_app({"mine": models["full"]}, text=TEXT).explorer)))
    assert "beside the baseline" not in page and "PreNorm's weights are all one" not in page


def test_traces_of_other_texts_say_so_on_their_panels(models):
    a = Probe(models["full"], name="a").run("dog")
    b = Probe(models["block"], name="b").run("fox")
    ex = create_app({"a": a, "b": b}).explorer
    out = callbacks.token_views(ex, token(ex, 0), "weights", [])
    assert out["notes"][0] == "" and "b holds another text: its token 0 is 'f'" in out["notes"][1]


def test_dash_names_trace_folders_by_folder_or_by_names(tmp_path, models):
    from attnres_probe.dashboards.serving import load_entries

    for d in ("run-a", "run-b"):
        Probe(models["block"], name="block").run(TEXT).save(tmp_path / d)
    dirs = [str(tmp_path / "run-a"), str(tmp_path / "run-b")]
    assert list(load_entries(None, dirs)) == ["run-a", "run-b"]
    assert list(load_entries(None, dirs, names=["first", "second"])) == ["first", "second"]
    with pytest.raises(ValueError, match="one per folder"):
        load_entries(None, dirs, names=["only"])


def test_over_training_section_appears_for_a_run_with_routing_probes(models, tmp_path):
    import json

    from attnres_probe.training.probes import load_history

    hist = [{"step": s, "embed_weight": [0.5, 0.4, 0.3, 0.2, 0.1], "recent_mass": [0.5] * 5, "entropy": [0.9] * 5,
             "rms_in": [1.0] * 5, "act_grad_cv": 0.3} for s in (0, 10)]
    (tmp_path / "train_log.json").write_text(json.dumps({"probes": {"history": hist}}))
    assert load_history(tmp_path) == hist and load_history(tmp_path / "missing") is None
    model = make_model("full")
    model.train_history = hist
    ex = create_app({"prenorm": models["prenorm"], "run": model}, text=TEXT).explorer
    page = build_layout(ex)
    graphs = [n for n in _walk(page) if getattr(n, "id", None) == "over-training"]
    assert graphs and "Routing over training" in graphs[0].figure.layout.title.text
    assert "prenorm recorded no routing probes" in " ".join(texts(page))
    plain = build_layout(create_app(models, text=TEXT).explorer)
    assert not [n for n in _walk(plain) if getattr(n, "id", None) == "over-training"]


def test_the_demo_dashboard_shows_the_demo_models_routing_over_training():
    from attnres_probe.dashboards.app import demo_entries

    models = demo_entries()
    for name, model in models.items():
        steps = [h["step"] for h in model.train_history]
        assert steps[0] == 0 and steps[-1] == 8000 and len(steps) == 33, name  # a probe every 250 steps
    page = build_layout(create_app(models, text=TEXT).explorer)
    assert [n for n in _walk(page) if getattr(n, "id", None) == "over-training"]


def test_the_token_caption_names_the_colours_each_kind_is_drawn_in(models):
    """The default view colours depth weights on viridis: the caption must not say blue and red only."""
    words = " ".join(texts(build_layout(create_app(models, text=TEXT).explorer)))
    assert "Depth weights (0 to 1) run from dark purple to yellow" in words
    assert "from blue (negative) through white (zero) to red (positive)" in words


def _walk(node):
    yield node
    kids = getattr(node, "children", None)
    if isinstance(kids, (list, tuple)):
        for k in kids:
            yield from _walk(k)
    elif kids is not None and not isinstance(kids, str):
        yield from _walk(kids)


def test_metric_names_carry_a_drawn_info_mark_not_a_glyph(ex):
    cards = callbacks.metric_cards(ex, ex.initial.key)
    assert "ⓘ" not in " ".join(texts(cards))


def test_traces_only_prompt_box_shows_the_text_not_token_labels(models):
    """#17 item 5: a saved trace of "a\nb" shows a newline in the prompt box, not the chip label \\n."""
    trace = Probe(models["full"], tokenizer=ByteTokenizer(), name="saved").run("a\nb")
    page = build_layout(create_app({"saved": trace}).explorer)
    box = [n for n in _walk(page) if getattr(n, "id", None) == "prompt"][0]
    assert box.value == "a\nb"


def test_the_corpus_section_shows_each_attnres_model_minus_the_baseline_as_the_report_does(models, corpus_stats):
    """The corpus report's difference view in `dash --stats`: the same figure function, a scale centred on zero,
    and a caption saying what is subtracted from what."""
    import dataclasses

    corpus = _find(create_app(models, text=TEXT, stats=corpus_stats).layout, lambda n: getattr(n, "id", None) == "corpus")[0]
    graphs = {g.id: g.figure for g in _find(corpus, lambda n: getattr(n, "figure", None) is not None)}
    diff = graphs["corpus-difference"]
    traces = {n: dataclasses.replace(s.to_trace(), meta={**s.to_trace().meta, "name": n}) for n, s in corpus_stats.items()}
    want = figures.difference_side_by_side([traces["full"], traces["block"]], traces["prenorm"], "contrib")
    assert [d.type for d in diff.data] == ["heatmap"] * 2
    for got, exp in zip(diff.data, want.data):
        np.testing.assert_allclose(np.asarray(got.z, float), np.asarray(exp.z, float))
        assert got.zmid == 0 and got.zmin == -got.zmax > -np.inf
        assert got.colorscale == exp.colorscale and got.colorscale[0][1] != got.colorscale[-1][1]  # diverging
    caption = _find(corpus, lambda n: getattr(n, "id", None) == "corpus-difference-note")[0].children
    assert "full, block minus prenorm" in caption and "contribution share" in caption and "zero" in caption
    headings = [h.children for h in _find(corpus, lambda n: isinstance(n, html.H3))]
    assert "Difference: each model minus prenorm" in headings


def test_the_per_token_difference_view_has_its_own_caption_and_names_the_token(ex):
    """The checkbox in "Depth routing of the selected token": a caption (each model minus the baseline, per
    cell, blue negative, red positive) shown while it is on, and titles that give the token's text as the
    other panels do."""
    assert _find(build_layout(ex), lambda n: getattr(n, "id", None) == "token-difference-note")
    off = callbacks.token_views(ex, token(ex, 3), "contrib", [])
    assert off["caption"] == ""
    on = callbacks.token_views(ex, token(ex, 3), "contrib", ["diff"])
    caption = on["caption"]
    assert "minus prenorm" in caption and "cell by cell" in caption and "Blue is negative" in caption and "red positive" in caption
    tok = ex.initial.traces["full"].str_tokens[0][3]
    for name, fig in zip(ex.names, on["figures"]):
        assert f"token 3 {tok!r} (sequence 0)" in fig.layout.title.text, name


def test_the_reading_views_explain_the_numbered_tokens(ex):
    reading = _find(build_layout(ex), lambda n: getattr(n, "id", None) == "reading")[0]
    assert figures.VOCAB_ID_NOTE in texts(reading)


# -- #35 item 8: a shareable view (the state in the address bar) and jumping to a token ----------
def test_the_view_query_round_trips_and_a_link_opens_its_token_colour_views_and_text(ex):
    text = "Depth, then routing."
    key = callbacks.run_prompt(ex, 1, text)["key"]
    query = callbacks.view_query(ex, {"key": key, "token": 7}, "contrib", ["diff", "expanded"])
    assert query.startswith("?token=7&kind=contrib&view=expanded%2Cdiff&text=")
    assert callbacks.read_query(query) == {"token": 7, "kind": "contrib", "view": ["expanded", "diff"], "text": text}
    # the opening text stays out of the link; a link without a text means the opening text
    short = callbacks.view_query(ex, {"key": ex.initial.key, "token": 3}, "weights", [])
    assert short == "?token=3&kind=weights"
    assert callbacks.linked_token(ex, ex.result(ex.initial.key), short) == 3
    assert callbacks.linked_token(ex, ex.result(key), short) is None  # about another text
    # opening the link: its colour and views, its text run, and its token taken up by the strip
    opened = callbacks.open_link(ex, query)
    assert (opened["kind"], opened["expanded"], opened["key"], opened["prompt"]) == ("contrib", ["expanded", "diff"], key, text)
    strip = callbacks.token_strip(ex, opened["key"], query)
    assert strip["token"] == {"key": key, "token": 7} and "as the link asked" in strip["note"]


def test_a_malformed_link_never_breaks_the_page(ex):
    for search in ("", "?", "?token=abc&kind=<script>&view=nope", "?token=99999999999999", "?token=1e3", None, 5):
        assert "token" not in callbacks.read_query(search) and "kind" not in callbacks.read_query(search)
    assert callbacks.read_query("?view=diff,nope")["view"] == ["diff"]
    assert callbacks.read_query("?token=-1")["token"] == -1  # from the end, as the jump box reads it
    assert callbacks.token_strip(ex, ex.initial.key, "?token=-1")["token"]["token"] == len(TEXT) - 1
    # a link the page cannot follow opens the informative token and says what was wrong with the link
    out = callbacks.token_strip(ex, ex.initial.key, f"?token={len(TEXT) + 5}")
    assert out["token"]["token"] == callbacks.informative_token(ex.initial.traces.values())[0]
    assert f"The link's token {len(TEXT) + 5} is past this text's last token ({len(TEXT) - 1})" in out["note"]
    bad = callbacks.token_strip(ex, ex.initial.key, "?token=abc&kind=%3Cb%3E")["note"]
    assert "The link's token 'abc' is not a position" in bad and "The link's colour '<b>' is not one of" in bad


def test_jumping_to_a_token_by_position_or_text(ex):
    here = {"key": ex.initial.key, "token": 0}
    assert callbacks.jump_to(ex, "5", here)["token"] == {"key": ex.initial.key, "token": 5}
    assert callbacks.jump_to(ex, "-1", here)["token"]["token"] == len(TEXT) - 1
    far = callbacks.jump_to(ex, str(len(TEXT)), here)
    assert far["token"] is no_update and f"0..{len(TEXT) - 1}" in far["note"]
    # text: the first match after the selected token, wrapping round; the note counts the matches
    first = TEXT.index("at")
    found = callbacks.jump_to(ex, "at", here)
    assert found["token"]["token"] == first and f"of {TEXT.count('at')} matches" in found["note"]
    again = callbacks.jump_to(ex, "at", found["token"])
    assert again["token"]["token"] == TEXT.index("at", first + 1)
    missing = callbacks.jump_to(ex, "zebra", here)
    assert missing["token"] is no_update and "'zebra' is not in this text" in missing["note"]
    assert callbacks.jump_to(ex, "  ", here)["token"] is no_update
    # the note shows the token as the strip does (a space as ␣), never a doubled escape such as '\\n'
    space = TEXT.index(" ")
    assert callbacks.jump_to(ex, str(space), here)["note"] == f"token {space} '␣'"


def test_every_tenth_chip_shows_its_position(ex):
    chips = callbacks.token_strip(ex, ex.initial.key)["chips"]
    marks = {i: c.to_plotly_json()["props"].get("data-mark") for i, c in enumerate(chips)}
    assert {i: m for i, m in marks.items() if m} == {i: str(i) for i in range(0, len(chips), 10)}


# -- #35 item 8: two texts, or two checkpoints of one architecture -------------------------------
def test_two_checkpoints_of_one_architecture_compare_like_from_like():
    from attnres_probe.analysis.windows import normalised_weights, pooled_metrics
    from attnres_probe.dashboards.layout import default_pair
    from attnres_probe.numeric import token_mean

    two = Explorer({"prenorm": make_model("prenorm"), "full": make_model("full"), "full_b": make_model("full", seed=2)},
                   text=TEXT)
    assert default_pair(two) == ("full", "full_b")  # the page opens on the two checkpoints of one architecture
    out = callbacks.compare_two(two, 1, two.initial.key, "full", "full_b", "", "weights")
    a, b = two.initial.traces["full"], two.initial.traces["full_b"]
    mean = lambda t: token_mean(normalised_weights(t, t.depth_weights.astype(np.float64))[t.mask])  # noqa: E731
    # the page normalises the recorded float32 weights in float32: each weight of a k-source read carries at most
    # about k units of float32 roundoff, and a difference two of them
    bound = 2 * a.depth_weights.shape[-1] * np.finfo(np.float32).eps
    np.testing.assert_allclose(np.asarray(out["figure"].data[0].z, float), mean(a) - mean(b), rtol=0, atol=bound)
    assert out["graph"] == callbacks.SHOWN and "same text" in out["status"] and "no interval" in out["status"]
    cells = {r.to_plotly_json()["props"]["data-metric"]: [c.children for c in r.children]
             for r in out["table"].children[1:]}
    x, y = pooled_metrics(a)["locality_distance"], pooled_metrics(b)["locality_distance"]
    assert cells["locality_distance"][4] == callbacks._fmt(x - y) and "(uniform " in cells["locality_distance"][2]
    assert cells["locality_distance"][1] == "sources back (sublayers; blocks for Block)"


def test_two_texts_on_one_model_and_what_cannot_be_compared(ex):
    text_b = "A second, different text."
    out = callbacks.compare_two(ex, 1, ex.initial.key, "block", "block", text_b, "contrib")
    assert "block (text A) − block (text B)" in out["figure"].layout.title.text
    assert f"text B ({len(text_b)} tokens)" in out["status"]
    z = np.asarray(out["figure"].data[0].z, float)
    assert np.isfinite(z).any() and np.nanmax(np.abs(np.nansum(z, -1))) < 1e-6  # share differences: each row sums to ~0
    refused = callbacks.compare_two(ex, 1, ex.initial.key, "full", "prenorm", "", "weights")
    assert refused["graph"] == callbacks.HIDDEN and "'contribution share'" in refused["status"]
    assert refused["table"] is None  # a refused comparison clears the last one's table
    assert "text B:" in callbacks.compare_two(ex, 1, ex.initial.key, "full", "full", "x" * (N_CTX + 5), "weights")["status"]
    assert "press Compare" in callbacks.compare_two(ex, 0, ex.initial.key, "full", "full", "", "weights")["status"]


def test_compare_subtracts_routing_only_on_one_source_axis(ex):
    """Full's routing is on sublayers, Block's on blocks: no A − B of different units (shares and loss still subtract)."""
    out = callbacks.compare_two(ex, 1, ex.initial.key, "full", "block", "", "contrib")
    cells = {r.to_plotly_json()["props"]["data-metric"]: [c.children for c in r.children] for r in out["table"].children[1:]}
    assert cells["locality_distance"][4].startswith("— (other axes")
    assert cells["locality_recent_mass"][4].startswith("— (other axes")
    assert not cells["embed_contrib_deep"][4].startswith("—") and not cells["mean_loss"][4].startswith("—")
