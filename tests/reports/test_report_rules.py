"""A report on the rules beyond AttnRes (issue #36): mHC and DenseFormer beside PreNorm and Full."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup

from attnres_probe import Probe
from attnres_probe.ablation import weight_beside_effect
from attnres_probe.reports import build_report, record_text

from helpers import tiny_model

TEXT = "Now is the winter of our discontent made glorious summer by this sun of York."


@pytest.fixture(scope="module")
def rule_report(tmp_path_factory):
    models = {"prenorm": tiny_model("prenorm"), "full": tiny_model("full"),
              "mhc": tiny_model("hyper", mhc=True, n_streams=2), "denseformer": tiny_model("denseformer", dwa_period=2)}
    traces = [record_text(m, TEXT, name=n) for n, m in models.items()]
    ablations = {n: Probe(m, name=n).ablate(TEXT, sources="embed", truncate=True) for n, m in models.items() if n != "prenorm"}
    effects = {n: weight_beside_effect(Probe(m, name=n), TEXT, truncate=True) for n, m in models.items()}
    path = tmp_path_factory.mktemp("rules") / "report.html"
    build_report(traces, path, title="rules", ablations=ablations, weight_effects=effects)
    return path.read_text(encoding="utf-8")


def test_the_report_names_every_rule_and_judges_attnres_only(rule_report):
    soup = BeautifulSoup(rule_report, "html.parser")
    text = soup.get_text(" ")
    for title in ("PreNorm baseline", "Full AttnRes", "mHC", "DenseFormer"):
        assert title in text
    # the comparison rows' notes (hovered) and the page's legend say why these models get no verdict
    assert "claim about AttnRes, not mHC: no verdict" in rule_report
    assert "claim about AttnRes, not DenseFormer: no verdict" in rule_report
    assert "nor for Hyper-Connections or DenseFormer models" in text
    assert "normalised coefficient" in rule_report  # the weights heatmaps of mHC and DenseFormer say what they show
