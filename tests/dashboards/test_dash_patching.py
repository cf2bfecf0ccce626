"""The routing-patching section (dashboards/patching.py): its callback called directly, and its place on the page."""

from __future__ import annotations

import numpy as np
import pytest
from dash import no_update

from attnres_probe.dashboards import create_app
from attnres_probe.dashboards import patching as views
from attnres_probe.dashboards.layout import build_layout
from attnres_probe.patching import UNIT

from dash_helpers import TEXT
from helpers import find_components

CLEAN, CORRUPT = "abc", "xyz"  # the tiny Full and Block models predict different next tokens after these


def _ids(component) -> set:
    return {getattr(c, "id", None) for c in find_components(component, lambda c: getattr(c, "id", None) is not None)}


def test_the_page_has_the_patching_section_with_both_prompts_and_the_live_models(ex):
    page = build_layout(ex)
    (section,) = find_components(page, lambda c: getattr(c, "id", None) == views.SECTION_ID)
    assert {views.PATCH_MODEL, views.PATCH_CLEAN, views.PATCH_CORRUPT, views.PATCH_RUN, views.PATCH_HEAT,
            views.PATCH_BARS, views.PATCH_STATUS} <= _ids(section)
    (dropdown,) = find_components(section, lambda c: getattr(c, "id", None) == views.PATCH_MODEL)
    assert [o["value"] for o in dropdown.options] == list(ex.names) and dropdown.value == "full"  # the first AttnRes model
    # PreNorm is always refused (fixed routing): listed, but disabled and saying why
    disabled = {o["value"]: o["label"] for o in dropdown.options if o.get("disabled")}
    assert disabled == {"prenorm": f"prenorm ({views.PRENORM_OPTION})"}


def test_the_callback_is_registered_on_the_app(app):
    outputs = " ".join(app.callback_map)
    assert views.PATCH_HEAT in outputs and views.PATCH_BARS in outputs and views.PATCH_STATUS in outputs


def test_before_the_button_nothing_runs(ex):
    out = views.patching_view(ex, 0, "full", CLEAN, CORRUPT)
    assert out["heatmap"] is no_update and out["graphs"] == views.HIDDEN and "press Patch" in out["status"]


@pytest.mark.parametrize("name", ["full", "block"])
def test_patching_two_prompts_draws_the_heatmap_and_the_bars(ex, name):
    out = views.patching_view(ex, 1, name, CLEAN, CORRUPT)
    assert out["graphs"] == views.SHOWN, out["status"]
    spec = ex.probes[name].spec
    z = np.asarray(out["heatmap"].data[0].z, dtype=float)
    seen = np.arange(z.shape[1])[None, :] < np.asarray(spec.axis.counts)[:, None]
    assert z.shape == (len(spec.read_labels), len(spec.source_labels))
    assert np.isfinite(z[seen]).all() and np.isnan(z[~seen]).all()  # blank where a read cannot see a source
    assert UNIT in out["heatmap"].layout.title.text
    bars = out["bars"]
    assert len(bars.data) == 2 and list(bars.data[0].x) == spec.read_labels
    final = list(bars.data[1].x).index("final")
    assert abs(bars.data[1].y[final] - 1) < 1e-3  # the final read's whole input recovers the clean metric
    assert "predicts" in out["status"] and "logit difference" in out["status"]


@pytest.mark.parametrize("model, clean, corrupt, message", [
    ("full", "abc", "abcd", "clean prompt has 3 tokens and the corrupted prompt 4"),
    ("prenorm", CLEAN, CORRUPT, "PreNorm model: its routing is fixed"),
    ("nope", CLEAN, CORRUPT, "choose one of the live models"),
    (["full"], CLEAN, CORRUPT, "choose one of the live models"),
    ("full", "", CORRUPT, "clean prompt is empty"),
    ("full", CLEAN, None, "corrupted prompt is empty"),
    ("full", "abc", "abc", "Both prompts predict the same next token at every position"),
])
def test_what_cannot_be_patched_gets_a_message_and_no_chart(ex, model, clean, corrupt, message):
    out = views.patching_view(ex, 1, model, clean, corrupt)
    assert message in out["status"]
    assert out["graphs"] == views.HIDDEN and out["heatmap"] is no_update and out["bars"] is no_update


def test_prompts_predicting_the_same_everywhere_get_the_cards_own_words(ex):
    status = views.patching_view(ex, 1, "block", "The cat", "The cat")["status"]
    assert "Try prompts whose continuations differ" in status
    assert "metric=" not in status and "position=" not in status and "identically" not in status  # no API text


def test_the_metric_is_taken_at_the_last_position_where_the_predictions_differ(ex):
    clean, corrupt = "The cat sat", "The dog sat"  # the tiny Full model's predictions agree after the last token
    frame = ex.probes["full"].patch(clean, corrupt)
    p = frame.attrs["position"]
    assert frame.attrs["position_auto"] and p == frame.attrs["differ"][-1] < len(clean) - 1
    out = views.patching_view(ex, 1, "full", clean, corrupt)
    assert out["graphs"] == views.SHOWN, out["status"]
    assert f"at position {p}, the last position where the two predictions differ" in out["status"]
    for fig in (out["heatmap"], out["bars"]):
        assert f"position {p} (picked" in fig.layout.title.text and "'The cat sat'" in fig.layout.title.text


def test_a_page_whose_live_models_are_all_prenorm_explains_and_binds_nothing(models):
    only = create_app({"prenorm": models["prenorm"]}, text=TEXT)
    (section,) = find_components(build_layout(only.explorer), lambda c: getattr(c, "id", None) == views.SECTION_ID)
    assert views.PATCH_RUN not in _ids(section)
    assert "PreNorm" in " ".join(str(c.children) for c in find_components(section, lambda c: hasattr(c, "children")))
    assert views.PATCH_HEAT not in " ".join(only.callback_map)


def test_a_text_longer_than_the_page_allows_is_refused(ex):
    long = "a" * (ex.max_chars + 1)
    assert "the limit is" in views.patching_view(ex, 1, "full", long, long)["status"]


def test_traces_only_pages_say_patching_needs_a_live_model(ex):
    saved = create_app({"full": ex.initial.traces["full"]}, text=TEXT)
    (section,) = find_components(build_layout(saved.explorer), lambda c: getattr(c, "id", None) == views.SECTION_ID)
    assert views.PATCH_RUN not in _ids(section)
    assert "saved traces only" in " ".join(str(c.children) for c in find_components(section, lambda c: hasattr(c, "children")))
    assert views.PATCH_HEAT not in " ".join(saved.callback_map)


@pytest.mark.browser
def test_in_the_browser_the_button_draws_the_heatmap_without_console_errors(dash_duo, app):
    from test_dash_browser import figure, start, wait_for_title

    start(dash_duo, app)
    for box_id, text in ((views.PATCH_CLEAN, CLEAN), (views.PATCH_CORRUPT, CORRUPT)):
        box = dash_duo.find_element(f"#{box_id}")
        dash_duo.clear_input(box)
        box.send_keys(text)
    dash_duo.find_element(f"#{views.PATCH_RUN}").click()
    dash_duo.wait_for_contains_text(f"#{views.PATCH_STATUS}", "predicts", timeout=30)
    heat = wait_for_title(dash_duo, views.PATCH_HEAT, UNIT)
    assert heat["x"] == app.explorer.probes["full"].spec.source_labels
    assert figure(dash_duo, views.PATCH_BARS)["n"] == 2
    dash_duo.find_element(f"#{views.PATCH_CORRUPT}").send_keys("!")  # one token longer
    dash_duo.find_element(f"#{views.PATCH_RUN}").click()
    dash_duo.wait_for_contains_text(f"#{views.PATCH_STATUS}", "the corrupted prompt 4", timeout=30)
    assert dash_duo.get_logs() == []
