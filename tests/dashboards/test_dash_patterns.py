"""The attention-pattern view (dashboards/patterns.py), called directly as plain functions of the
explorer and the browser's values, and once over HTTP."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from dash import no_update

from attnres_probe import Probe, figures
from attnres_probe.dashboards import create_app, patterns
from attnres_probe.dashboards.layout import build_layout
from attnres_probe.dashboards.wire import update_payload

from dash_helpers import NAMES, TEXT, make_model
from helpers import find_components as _find


def find_components(node, id_: str) -> list:
    """Every Dash component under ``node`` whose id is ``id_``."""
    return _find(node, lambda n: getattr(n, "id", None) == id_)


def token(ex, pos: int, key: str | None = None) -> dict:
    return {"key": key or ex.initial.key, "token": pos}


def hooked_pattern(model, text: str, layer: int) -> np.ndarray:
    """The model's own hook_pattern [head, query, key] on the text (TransformerLens's run_with_cache)."""
    tokens = model.to_tokens(text)
    _, cache = model.run_with_cache(tokens, names_filter=f"blocks.{layer}.attn.hook_pattern")
    return cache["pattern", layer][0].numpy()


@pytest.fixture
def counted(monkeypatch):
    """Counts the forward passes the view runs (Probe.attention_patterns calls)."""
    calls = []
    original = Probe.attention_patterns

    def count(self, *args, **kw):
        calls.append((self.name, kw.get("layers")))
        return original(self, *args, **kw)

    monkeypatch.setattr(Probe, "attention_patterns", count)
    return calls


def test_each_models_bars_are_its_hook_pattern_at_the_selected_token(ex, models):
    out = patterns.pattern_views(ex, token(ex, 5), 1, 1)
    assert out["notes"] == [""] * 3 and out["panels"] == [patterns.SHOWN] * 3
    for name, fig in zip(ex.names, out["figures"]):
        want = hooked_pattern(models[name], TEXT, 1)[1, 5, :6]
        np.testing.assert_allclose(fig.data[0].y, want, rtol=1e-6, atol=1e-7)
        assert list(fig.data[0].x) == list(range(6))  # keys 0..5: the ones token 5 sees
        assert abs(sum(fig.data[0].y) - 1) < 1e-5
        assert list(fig.data[0].customdata) == [figures.show_token(t) for t in ex.initial.traces[name].str_tokens[0][:6]]
        assert fig.layout.title.text.endswith("<br>attention weight (softmax over key positions)")
        assert fig.layout.yaxis.title.text == "attention weight"
        assert "layer 1 head 1" in fig.layout.title.text and fig.layout.title.text.startswith(name)
        assert fig.data[0].marker.color == ex.colors[name]


def test_a_layer_is_computed_up_to_the_token_then_once_for_the_text_then_sliced(ex, counted):
    each = sorted((n, [0]) for n in NAMES)
    patterns.pattern_views(ex, token(ex, 3), 0, 0)  # the first request: the text up to token 3 (causal)
    assert sorted(counted) == each
    assert patterns.cache_of(ex).get((ex.initial.key, "full", 0)).shape == (2, 4, 4)
    counted.clear()
    patterns.pattern_views(ex, token(ex, 2), 0, 1)  # inside the prefix: a slice
    assert counted == []
    out = patterns.pattern_views(ex, token(ex, 7), 0, 0)  # past it: the whole text, once
    assert sorted(counted) == each and out["notes"] == [""] * 3
    assert patterns.cache_of(ex).get((ex.initial.key, "full", 0)).shape == (2, len(TEXT), len(TEXT))
    counted.clear()
    patterns.pattern_views(ex, token(ex, len(TEXT) - 1), 0, 1)
    patterns.pattern_views(ex, token(ex, 0), 0, 0)
    assert counted == []  # the layer is cached: no model run
    patterns.pattern_views(ex, token(ex, 1), 1, 0)
    assert sorted(counted) == sorted((n, [1]) for n in NAMES)


def test_the_depth_routing_callbacks_compute_no_pattern(ex, counted):
    from attnres_probe.dashboards import callbacks

    callbacks.token_views(ex, token(ex, 4), "weights", [])
    callbacks.token_strip(ex, ex.initial.key)
    assert counted == [] and patterns.cache_of(ex).nbytes == 0
    assert all(t.patterns is None for t in ex.initial.traces.values())  # nothing recorded with the traces


@pytest.mark.parametrize("layer, head", [(2, 0), (-1, 0), (0, 2), (None, 0), (0, "1"), (True, 0)])
def test_layers_and_heads_out_of_range_leave_the_charts_with_a_note(ex, layer, head):
    out = patterns.pattern_views(ex, token(ex, 2), layer, head)
    assert out["figures"] == [no_update] * 3
    assert all("layers 0..1 and heads 0..1" in n for n in out["notes"])


@pytest.mark.parametrize("bad", [{"key": "nope", "token": 1}, None, "x", {"key": None, "token": 0}])
def test_bad_keys_touch_nothing(ex, bad):
    out = patterns.pattern_views(ex, bad, 0, 0)
    assert out["figures"] == [no_update] * 3


@pytest.mark.parametrize("pos", [-1, len(TEXT), 2.5, "3", True])
def test_positions_outside_the_text_give_a_note(ex, pos):
    out = patterns.pattern_views(ex, token(ex, pos), 0, 0)
    assert out["figures"] == [no_update] * 3 and all("has no token" in n for n in out["notes"])


def test_a_new_prompt_gets_its_own_patterns(ex, models):
    key = ex.run("A different prompt, longer than the first one.")
    out = patterns.pattern_views(ex, token(ex, 20, key), 1, 0)
    want = hooked_pattern(models["full"], "A different prompt, longer than the first one.", 1)[0, 20, :21]
    np.testing.assert_allclose(out["figures"][NAMES.index("full")].data[0].y, want, rtol=1e-6, atol=1e-7)


def test_saved_traces_show_the_patterns_they_hold_and_say_so_when_they_hold_none(models):
    with_patterns = Probe(models["block"], name="saved").run(TEXT, patterns=True)
    without = Probe(models["full"], name="plain").run(TEXT)
    ex = create_app({"saved": with_patterns, "plain": without}).explorer
    out = patterns.pattern_views(ex, token(ex, 4), 1, 1)
    np.testing.assert_allclose(out["figures"][0].data[0].y, with_patterns.patterns[0, 1, 1, 4, :5])
    assert out["figures"][1] is no_update and out["graphs"][1] == patterns.HIDDEN
    assert "holds no attention patterns" in out["notes"][1] and "patterns=True" in out["notes"][1]


def test_grouped_query_models_with_rotary_positions(models):
    from attnres_probe import AttnResTransformer

    from helpers import tiny_config

    gqa = AttnResTransformer(tiny_config("block", n_heads=4, n_kv_heads=2, positional="rope", n_ctx=64, block_size=2),
                             backend="torch").eval()
    ex = create_app({"prenorm": models["prenorm"], "gqa": gqa}, text=TEXT).explorer
    layout = patterns.pattern_section(ex)
    head = find_components(layout, patterns.PATTERN_HEAD)[0]
    assert [o["value"] for o in head.options] == [0, 1, 2, 3]  # the most heads any model has
    out = patterns.pattern_views(ex, token(ex, 6), 0, 3)
    assert "heads 0..1" in out["notes"][0] and out["figures"][0] is no_update  # prenorm has 2 heads
    np.testing.assert_allclose(out["figures"][1].data[0].y, hooked_pattern(gqa, TEXT, 0)[3, 6, :7], rtol=1e-6, atol=1e-7)


def test_the_section_sits_after_the_depth_routing_with_one_panel_per_model(ex):
    page = build_layout(ex)
    ids = [getattr(c, "id", None) for c in page.children]
    assert ids.index(patterns.SECTION_ID) == ids.index("token-views") + 1
    section = page.children[ids.index(patterns.SECTION_ID)]
    layer = find_components(section, patterns.PATTERN_LAYER)[0]
    assert [o["value"] for o in layer.options] == [0, 1] and layer.value == patterns.opening_head(ex)[0]
    for i in range(3):
        assert find_components(section, patterns.panel_id("graph", i))


def test_the_cache_is_bounded_in_bytes():
    cache = patterns.PatternCache(max_bytes=3000)
    for i in range(4):
        cache.put(("k", "m", i), np.zeros((2, 10, 10), np.float32))  # 800 bytes each
    assert cache.nbytes == 2400 and cache.get(("k", "m", 0)) is None and cache.get(("k", "m", 3)) is not None
    cache.put(("k", "m", 9), np.zeros((4, 30, 30), np.float32))  # larger than the bound: kept alone
    assert cache.nbytes == 14400


def test_the_view_over_http(app):
    ex = app.explorer
    body = update_payload(app, "pattern-graph-0.figure", {"token.data": token(ex, 3), "pattern-layer.value": 1,
                                                            "pattern-head.value": 0})
    resp = app.server.test_client().post("/_dash-update-component", json=body)
    assert resp.status_code == 200
    response = json.loads(resp.data)["response"]
    fig = response["pattern-graph-2"]["figure"]
    y = fig["data"][0]["y"]  # plotly's typed array: base64 bytes of float64
    y = np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"]) if isinstance(y, dict) else np.asarray(y)
    assert len(y) == 4 and abs(float(y.sum()) - 1) < 1e-5
    assert fig["layout"]["yaxis"]["title"]["text"].startswith("attention weight")


# -- in Chromium -----------------------------------------------------------------------------------
PATTERN_JS = """
const gd = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');
if (!gd || !gd._fullData || !gd._fullData.length) { return null; }
return {title: (gd.layout.title || {}).text || '', y: Array.from(gd._fullData[0].y)};
"""


@pytest.mark.browser
def test_the_page_redraws_the_pattern_for_a_clicked_token_and_a_chosen_layer(dash_duo, app, models):
    from dash.testing.wait import until

    def chart(i):
        return dash_duo.driver.execute_script(PATTERN_JS, patterns.panel_id("graph", i)) or {"title": "", "y": []}

    layer0, head0, _ = patterns.opening_head(app.explorer)
    other = 1 - layer0
    dash_duo.start_server(app)
    dash_duo.wait_for_element("#token-strip button", timeout=30)
    until(lambda: all(f"layer {layer0} head {head0}" in chart(i)["title"] for i in range(3)), timeout=30)
    dash_duo.wait_for_contains_text(f"#{patterns.PATTERN_OPENED}", f"Opened on layer {layer0} head {head0}", timeout=10)
    dash_duo.find_element("#token-strip button:nth-child(4)").click()  # token 3
    until(lambda: all(chart(i)["title"].split("<br>")[1].startswith("token 3 ") for i in range(3)), timeout=30)
    dash_duo.select_dcc_dropdown(f"#{patterns.PATTERN_LAYER}", value=f"layer {other}")
    until(lambda: all(f"layer {other} head {head0}" in chart(i)["title"] for i in range(3)), timeout=30)
    got = chart(NAMES.index("full"))["y"]
    np.testing.assert_allclose(got, hooked_pattern(models["full"], TEXT, other)[head0, 3, :4], rtol=1e-6, atol=1e-7)
    until(lambda: f"layer={other}&head={head0}" in dash_duo.driver.current_url, timeout=10)  # the view in the address bar
    assert dash_duo.get_logs() == []


# -- the opening layer and head ---------------------------------------------------------------------
SHARP = (1, 1)  # the layer and head made sharp below


def sharpened(residual: str, layer: int = SHARP[0], head: int = SHARP[1], factor: float = 30.0):
    """A tiny model whose one attention head has its queries and keys scaled up: a concentrated
    (low-entropy) pattern."""
    import torch

    model = make_model(residual)
    attn = model.blocks[layer].attn
    dh, inner = attn.d_head, attn.n_heads * attn.d_head
    assert attn.n_kv_heads == attn.n_heads
    with torch.no_grad():
        attn.W_QKV.weight[head * dh: (head + 1) * dh] *= factor  # its queries
        attn.W_QKV.weight[inner + head * dh: inner + (head + 1) * dh] *= factor  # and its keys
    return model


def entropy(row: np.ndarray) -> float:
    row = row[row > 0]
    return float(-(row * np.log(row)).sum())


def test_the_view_opens_on_the_most_concentrated_head_at_the_opening_token(models):
    from attnres_probe.analysis.windows import informative_token

    sharp = {"prenorm": models["prenorm"], "full": sharpened("full"), "block": sharpened("block")}
    ex = create_app(sharp, text=TEXT).explorer
    pos = informative_token(ex.initial.traces.values())[0]
    assert pos > 0
    # the choice, recomputed from the models' own hook_pattern: lowest entropy averaged over full and block
    mean = np.zeros((2, 2))
    for name in ("full", "block"):
        for layer in range(2):
            rows = hooked_pattern(sharp[name], TEXT, layer)[:, pos, : pos + 1]
            mean[layer] += [entropy(r) / 2 for r in rows]
    want = tuple(int(i) for i in np.unravel_index(np.argmin(mean), mean.shape))
    assert want == SHARP and mean[SHARP] < mean.max() - 0.5  # a real difference, not a tie
    assert patterns.opening_head(ex)[:2] == SHARP
    section = patterns.pattern_section(ex)
    assert find_components(section, patterns.PATTERN_LAYER)[0].value == SHARP[0]
    assert find_components(section, patterns.PATTERN_HEAD)[0].value == SHARP[1]
    (note,) = find_components(section, patterns.PATTERN_OPENED)
    assert note.children.startswith(f"Opened on layer {SHARP[0]} head {SHARP[1]}, the most concentrated pattern at the "
                                    f"token the page opened on ({pos} ")  # still true after another token is picked
    assert "full, block" in note.children and "prenorm" not in note.children  # averaged over the AttnRes models


def test_choosing_the_opening_head_costs_one_row_per_attnres_model_and_caches_nothing(models, counted):
    ex = create_app(models, text=TEXT).explorer  # the layout is built here: the choice is made once
    assert sorted(counted) == [("block", None), ("full", None)]  # one forward each, PreNorm not run
    assert patterns.cache_of(ex).nbytes == 0


def test_without_patterns_or_at_token_0_the_view_opens_on_layer_0_head_0(models):
    plain = create_app({"plain": Probe(models["full"], name="plain").run(TEXT)}).explorer
    assert patterns.opening_head(plain) == (0, 0, "")
    one = create_app(models, text="A").explorer  # token 0 sees itself only: every head is the same
    assert patterns.opening_head(one) == (0, 0, "")


def test_the_layer_and_head_go_in_the_link_and_a_link_opens_them(ex):
    from attnres_probe.dashboards import callbacks

    query = callbacks.view_query(ex, token(ex, 3), "weights", [], 1, 0)
    assert query == "?token=3&kind=weights&layer=1&head=0"
    assert callbacks.read_query(query) == {"token": 3, "kind": "weights", "layer": 1, "head": 0}
    opened = callbacks.open_link(ex, query)
    assert (opened["layer"], opened["head"]) == (1, 0) and opened["opened"] == "Opened on layer 1 and head 0, as the link asked."
    assert callbacks.open_link(ex, "?token=3")["layer"] is no_update  # no layer asked: the opening choice stays
    far = callbacks.open_link(ex, "?layer=7&head=x")
    assert far["layer"] is no_update and far["head"] is no_update and far["opened"] is no_update
    note = callbacks.token_strip(ex, ex.initial.key, "?token=999&layer=7&head=x")["note"]
    assert "The link's layer '7' is not one of this page's layers (0..1)" in note
    assert "The link's head 'x' is not one of this page's heads (0..1)" in note


def test_a_saved_trace_of_some_layers_and_heads_shows_those_and_names_them_for_the_others(models):
    every = Probe(models["block"], name="every").run(TEXT, patterns=True)
    some = Probe(models["block"], name="some").run(TEXT, patterns=[1], pattern_heads=[1])
    ex = create_app({"some": some, "every": every}).explorer
    out = patterns.pattern_views(ex, token(ex, 4), 1, 1)  # recorded: the model's layer 1, head 1
    np.testing.assert_array_equal(out["figures"][0].data[0].y, every.patterns[0, 1, 1, 4, :5].astype(np.float64))
    out = patterns.pattern_views(ex, token(ex, 4), 0, 1)  # not recorded: a note naming what was
    assert out["graphs"][0] == patterns.HIDDEN and out["graphs"][1] == patterns.SHOWN
    assert "layer 0's attention patterns were not recorded; this trace holds layers 1" in out["notes"][0]
    layer, head, _ = patterns.opening_head(ex)  # chosen among what both hold (or 0, 0): never a NaN pick
    assert (layer, head) in ((1, 1), (0, 0))
