"""Fixtures of the report tests: tiny models, traces of a hostile text, one report built once."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup

from attnres_probe.reports import build_report, record_text

from helpers import tiny_model
from report_text import XSS_TEXT

RESIDUALS = ("prenorm", "full", "block")


@pytest.fixture(scope="session")
def tiny_models():
    return {r: tiny_model(r) for r in RESIDUALS}


@pytest.fixture(scope="session")
def traces(tiny_models):
    return [record_text(m, XSS_TEXT, name=r) for r, m in tiny_models.items()]


@pytest.fixture(scope="session")
def ablations(tiny_models):
    from attnres_probe import Probe

    return {r: Probe(m, name=r).ablate(XSS_TEXT, sources="embed", truncate=True) for r, m in tiny_models.items() if r != "prenorm"}


@pytest.fixture(scope="session")
def weight_effects(tiny_models):
    from attnres_probe import Probe
    from attnres_probe.ablation import weight_beside_effect

    return {r: weight_beside_effect(Probe(m, name=r), XSS_TEXT, truncate=True) for r, m in tiny_models.items()}


@pytest.fixture(scope="session")
def report_path(traces, ablations, weight_effects, tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "report.html"
    build_report(traces, path, title='Study <b>"bold"</b> & co', ablations=ablations, description="tiny <i>models</i>",
                 weight_effects=weight_effects)
    return path


@pytest.fixture(scope="session")
def report_html(report_path) -> str:
    return report_path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def soup(report_html) -> BeautifulSoup:
    return BeautifulSoup(report_html, "html.parser")
