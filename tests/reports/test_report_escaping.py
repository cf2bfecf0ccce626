"""Text from traces (tokens, names, titles, flags) is escaped everywhere the report shows it."""

from __future__ import annotations

import json
import re

import pytest

from attnres_probe.reports import build_report

from trace_factory import make_trace

PAYLOAD = "<script>window.__xss"


def _json_scripts(soup):
    return soup.find_all("script", type="application/json")


def test_raw_file_never_contains_the_script_payload(report_html):
    assert PAYLOAD not in report_html
    assert "<img src=x" not in report_html
    assert "window.__xss" in report_html  # the text is there, escaped


def test_text_is_entity_escaped_in_the_page(report_html):
    assert "a&lt;script&gt;window.__xss=1&lt;/script&gt;&#34;&amp;&#39;b" in report_html


def test_json_in_script_tags_escapes_closing_tags_and_ampersands(soup):
    blocks = _json_scripts(soup)
    assert len(blocks) >= 8
    for block in blocks:
        body = block.string
        assert "</" not in body and "<" not in body and "&" not in body
        json.loads(body)  # still valid JSON after escaping


def test_only_the_pages_own_script_tags_exist(soup):
    scripts = soup.find_all("script")
    assert all(s.get("type") in (None, "application/json") for s in scripts)
    assert sum(s.get("type") is None for s in scripts) == 2  # plotly.js + the report's own script
    assert not soup.find_all("img")


def test_hostile_model_names_tokens_and_flags_are_escaped(tmp_path):
    evil = '<script>window.__xss=3</script>"&\''
    trace = make_trace(
        "full",
        name=f"m{evil}",
        str_tokens=[evil, "&amp;", "</script><b>"],
        flags=[f"flag {evil}"],
    )
    trace.meta["text"] = f"text {evil}"
    path = build_report([trace], tmp_path / "r.html", title=f"title {evil}", description=f"about {evil}")
    html = path.read_text()
    assert "<script>window.__xss=3" not in html
    assert "</script><b>" not in html
    assert html.count("&lt;script&gt;window.__xss=3") >= 5  # title, heading, description, text, flags, name, token chip
    # inside plotly's JSON the token strings survive as data, with < and & escaped
    assert "\\u003cscript\\u003ewindow.__xss=3" in html
    assert "&amp;amp;" in html  # the token "&amp;" is shown literally


@pytest.mark.parametrize("field", ["title", "description"])
def test_report_arguments_are_escaped_too(tmp_path, field):
    trace = make_trace("block")
    html = build_report([trace], tmp_path / "r.html", **{field: "<script>window.__xss=4</script>"}).read_text()
    assert "<script>window.__xss=4" not in html and "&lt;script&gt;window.__xss=4" in html


def test_no_inline_event_handlers_are_emitted(report_html):
    assert not re.search(r"<[^>]+\son[a-z]+\s*=", report_html.split("<script>")[0])
