"""Components drawn from a :func:`attnres_probe.metrics.compare` frame: the notes above the
comparisons, the headline cards and the every-metric table. The layout (the corpus section) and
the callbacks (the cards for a typed text) both draw them; neither imports the other for them."""

from __future__ import annotations

from dash import html

from attnres_probe import metrics
from attnres_probe.analysis.display import BASIS_NOTE, LABELS, documents_warning, headline, shape_warning, table_rows, verdict_scope_note
from attnres_probe.seed_study import PRIMARIES

__all__ = ["comparison_notes", "glance_study", "glance_table", "headline_cards", "metric_table"]


def comparison_notes(frame) -> list:
    """What a page says once above the comparisons of a :func:`metrics.compare` frame: too few
    documents for firm intervals, and what each comparison sets side by side (the same quantity,
    routing against the uniform reference on each model's own axis)."""
    out = []
    if shape_warning(frame):
        out.append(html.P(shape_warning(frame), className="notice shape-warning"))
    warning = documents_warning(frame)
    if warning:
        out.append(html.P(warning, className="notice few-documents"))
    if (frame["comparison"] != "value").any():
        out.append(html.P(" ".join(x for x in (BASIS_NOTE, verdict_scope_note(frame)) if x), className="help basis-note"))
    return out


def _verdict_badge(verdict: str, note: str = "") -> html.Span:
    if not verdict:  # no direction to judge against (the note, on hover, says why)
        return html.Span("no verdict", className="vs no-verdict", title=note or None)
    return html.Span(verdict, className=f"verdict {verdict}", title=note or None)


def headline_cards(frame, colors: dict[str, str]) -> list:
    """One card per headline group (:data:`attnres_probe.analysis.display.HEADLINE`) from a
    :func:`metrics.compare` frame: per metric, each model's value with its interval, and each
    comparison's estimate, interval, the paper's direction and the verdict, as compare has them."""
    cards = []
    for group in headline(frame):
        blocks = []
        for m in group["metrics"]:
            comps = {c["model"]: c for c in m["comparisons"]}
            head = html.Tr([html.Th("model"), html.Th("value"), html.Th("against its reference"), html.Th("verdict")])
            body = []
            for v in m["rows"]:
                c = comps.get(v["model"])
                name = html.Td(v["model"], style={"color": colors.get(v["model"])}, className="model")
                value = html.Td([html.Div(v["estimate"], className="value"), html.Div(v["interval"], className="vs interval"),
                                 html.Div(f"uniform: {v['reference']}", className="vs reference") if v["reference"] else None,
                                 html.Div(v["basis"], className="vs basis") if v["basis"] else None])
                if c is None:
                    body.append(html.Tr([name, value, html.Td("baseline" if v["is_baseline"] else v["own"], className="vs"),
                                         html.Td("")]))
                    continue
                against = html.Td([html.Div(f"{c['estimate']} vs {c['baseline']}", className="value"),
                                   html.Div(c["interval"], className="vs interval"),
                                   html.Div(" · ".join(x for x in (c["expected"], c["held"]) if x), className="vs")])
                verdict = [_verdict_badge(c["verdict"], c["note"]),
                           html.Div(c["caveat"], className="vs caveat") if c["caveat"] else None]
                body.append(html.Tr([name, value, against, html.Td(verdict)], className="comparison"))
            blocks.append(html.Div(
                [html.Div([m["label"], html.Span("i", className="formula info-icon", **{"aria-label": "formula"})],
                          title=metrics.FORMULAS.get(m["metric"], ""), className="metric-name", **{"data-metric": m["metric"]}),
                 html.Div(f"unit: {m['unit']} · {m['reference']}", className="metric-unit help") if m["unit"] else None,
                 html.Table([html.Thead(head), html.Tbody(body)], className="metric-table")],
                className="metric-block",
            ))
        cards.append(html.Div(
            [html.H3(group["title"], title="; ".join(f"{m['metric']}: {metrics.FORMULAS.get(m['metric'], '')}" for m in group["metrics"])),
             html.P(group["help"], className="help"),
             html.P(group["claim"], className="claim") if group["claim"] else None,
             *blocks],
            className="metric-card",
        ))
    return cards


def metric_table(frame) -> html.Table:
    """Every metric of a :func:`metrics.compare` frame: each model's value [interval], each comparison's
    estimate [interval] and verdict."""
    t = table_rows(frame)
    n_models = len(t["models"])
    head = html.Tr([html.Th("metric"), html.Th("unit"), *[html.Th(c) for c in t["columns"]],
                    *[html.Th(f"verdict: {c}") for c in t["comparisons"]]])
    body = []
    width = 2 + len(t["columns"]) + len(t["comparisons"])
    rows = []
    for g in t["groups"]:
        rows.append(g["title"])
        rows.extend(g["rows"])
    for r in rows:
        if isinstance(r, str):  # a group's plain name
            body.append(html.Tr(html.Th(r, colSpan=width), className="group"))
            continue
        cells = [html.Td(LABELS.get(r["metric"], r["metric"]), title=metrics.FORMULAS.get(r["metric"], ""), className="metric-name"),
                 html.Td(r["unit"], title=r["reference"], className="unit")]
        cells += [html.Td(c, className="num") for c in r["cells"][:n_models]]
        cells += [html.Td(c, className="num") for c in r["cells"][n_models:]]
        cells += [html.Td([_verdict_badge(v), html.Div(c, className="vs caveat") if c else None] if v else "")
                  for v, c in zip(r["verdicts"], r["caveats"])]
        body.append(html.Tr(cells, **{"data-metric": r["metric"]}))
    return html.Table([html.Thead(head), html.Tbody(body)], className="metric-table full-table")


def glance_table(frame) -> html.Table:
    """The first screen's headline: one row per headline metric of a :func:`metrics.compare` frame,
    and per AttnRes model its comparison (estimate with interval) against the reference the catalog
    names (uniform weights on the same sources, or the baseline's same quantity) and the verdict.
    The unit and the paper's direction are in each metric's row, the formula on hover."""
    groups = headline(frame)
    models = []
    for g in groups:
        for m in g["metrics"]:
            for c in m["comparisons"]:
                if c["model"] not in models:
                    models.append(c["model"])
    head = html.Tr([html.Th("metric (unit)"), html.Th("paper: the model is"), *[html.Th(m) for m in models]])
    body = []
    for g in groups:
        for m in g["metrics"]:
            comps = {c["model"]: c for c in m["comparisons"]}
            if not comps:
                continue
            first = next((c for c in comps.values() if c["expected"]), next(iter(comps.values())))  # the paper's side, if any
            cells = []
            for model in models:
                c = comps.get(model)
                if c is None:
                    cells.append(html.Td(""))
                    continue
                interval = [html.Div(c["interval"], className="vs interval")] if c["interval"] else []  # its own line
                cells.append(html.Td([html.Span(c["estimate"], className="value"), " ",
                                      _verdict_badge(c["verdict"], c["note"]), *interval],
                                     className="num glance-cell", **{"data-model": model}))
            expected = first["expected"].removeprefix("paper: ") if first["expected"] else f"against {first['baseline']}"
            body.append(html.Tr([
                html.Td([html.Span(m["label"], className="metric-name", title=metrics.FORMULAS.get(m["metric"], "")),
                         html.Div(m["unit"], className="vs")]),
                html.Td(expected, className="vs against"),
                *cells,
            ], **{"data-metric": m["metric"]}))
    return html.Table([html.Thead(head), html.Tbody(body)], className="metric-table glance-table")


AGAINST = {"baseline": "PreNorm", "uniform": "uniform"}
_AGAINST = {p.key: p.against for p in PRIMARIES}  # summaries written before they said it


def glance_study(study: dict) -> html.Table:
    """The first screen's headline for the demo models: the study's pre-registered endpoints over
    training seeds (mean of the per-seed differences, its t-interval, Holm's p and the verdict)."""
    level = f"{float(study.get('level', 0.95)):.0%}"

    def num(x, spec="+.3g"):
        return "—" if x is None else format(float(x), spec)

    head = html.Tr([html.Th(h) for h in ("endpoint, against (paper's side)", f"mean over seeds [{level} CI, unadjusted], unit", "Holm p",
                                         "verdict")])
    body = [html.Tr([
        html.Td([html.Span(f"{p['key']} {p['title']}", className="metric-name"),
                 html.Span(f" vs {AGAINST.get(p.get('against') or _AGAINST.get(p['key']), '')}"
                           f" (paper {'< 0' if p['expected'] == 'lower' else '> 0'})", className="vs")]),
        html.Td([html.Span(num(p["mean"]), className="value"), " ",
                 html.Span(f"[{num(p['low'])}, {num(p['high'])}]", className="vs interval"), " ",
                 html.Span(p["unit"], className="vs unit")], className="num"),
        html.Td(num(p["p_holm"], ".2g"), className="num"),
        html.Td(_verdict_badge(p["verdict"], f"{p['paper_way']} of {p['n']} seeds on the paper's side")),
    ], **{"data-endpoint": p["key"]}) for p in study["primaries"]]
    return html.Table([html.Thead(head), html.Tbody(body)], className="metric-table glance-table")
