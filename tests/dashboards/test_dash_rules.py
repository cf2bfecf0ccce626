"""The dashboard with five rules side by side: PreNorm, Full, Block, mHC and DenseFormer (issue #36)."""

from __future__ import annotations

import numpy as np
import pytest

from attnres_probe import AttnResTransformer
from attnres_probe.dashboards import callbacks, create_app

from dash_helpers import TEXT, make_model
from helpers import randomize_routing, tiny_config


@pytest.fixture(scope="module")
def five():
    models = {name: make_model(name) for name in ("prenorm", "full", "block")}
    for name, kw in (("mhc", dict(residual="hyper", mhc=True, n_streams=3)), ("denseformer", dict(residual="denseformer"))):
        m = AttnResTransformer(tiny_config(n_layers=2, n_ctx=64, seed=1, **kw), backend="torch")
        models[name] = randomize_routing(m).eval()
    app = create_app(models, text=TEXT)
    return app.explorer


def test_every_rule_gets_a_panel_a_title_and_a_colour(five):
    ex = five
    assert [ex.describe(n, short=True).split(" · ")[0] for n in ex.names] == [
        "PreNorm baseline", "Full AttnRes", "Block AttnRes", "mHC", "DenseFormer"]
    assert len(set(ex.colors.values())) == 5
    out = callbacks.token_views(ex, {"key": ex.initial.key, "token": 4}, "weights", [])
    assert out["panels"] == [callbacks.SHOWN] * 5
    for name, fig in zip(ex.names, out["figures"]):
        z = np.asarray(fig.data[0].z, float)
        if name in ("mhc", "denseformer", "prenorm"):  # coefficients, normalised: rows sum to one
            np.testing.assert_allclose(np.nansum(z, -1), 1.0, rtol=1e-9)
        if name in ("mhc", "denseformer"):
            assert "normalised weight c/Σc" in fig.layout.title.text


def test_cards_compare_every_model_with_the_baseline_and_judge_attnres_only(five):
    ex = five
    frame = ex.result(ex.initial.key).compared()
    assert set(frame["model"]) == set(ex.names)
    judged = frame[(frame["verdict"] != "") & (frame["comparison"] != "value")]
    assert set(judged["model"]) <= {"full", "block"}
    cards = callbacks.metric_cards(ex, ex.initial.key)
    assert cards


def test_ablation_and_patching_offer_the_new_rules(five):
    ex = five
    assert ex.attnres_probes == ["full", "block", "mhc", "denseformer"]
    for name in ("mhc", "denseformer"):
        reads = callbacks.ablation_reads(ex, name)
        assert reads["value"] == "final"
    # patching: DenseFormer's weights are parameters (the same for every input): listed, disabled, saying why
    from attnres_probe.dashboards import patching as views

    options = {o["value"]: o for o in views._model_options(ex, list(ex.names))}
    assert options["denseformer"].get("disabled") and "the same for every input" in options["denseformer"]["label"]
    assert not options["mhc"].get("disabled") and not options["full"].get("disabled")
    assert views._patchable(ex) == ["full", "block", "mhc"]
    refused = views.patching_view(ex, 1, "denseformer", "abc", "xyz")
    assert "nothing to patch" in refused["status"] and refused["graphs"] == views.HIDDEN
