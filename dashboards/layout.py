"""The dashboard's page: header, prompt box, token strip, one panel per model for each view.

Every chart is a ``dcc.Graph`` filled by a callback with a figure from
:mod:`attnres_probe.figures`; this module only places components and writes short help texts.
Element ids are the constants below (per-model panels take the model's index: ``token-graph-0``).
User text (prompts, token strings, model names) only ever goes into components as text.
"""

from __future__ import annotations

from dash import dcc, html

from attnres_probe.analysis.display import WEIGHT_EFFECT_NOTE, page_warnings
from attnres_probe.dashboards.cards import comparison_notes, glance_study, glance_table, headline_cards, metric_table
from attnres_probe.dashboards.patching import patching_section
from attnres_probe.dashboards.patterns import pattern_section
from attnres_probe.dashboards.state import ABLATION_MODES, Explorer

__all__ = ["build_layout", "panel_id", "KIND_OPTIONS"]

# ids of the single components
KEY = "trace-key"
TOKEN = "token"
PROMPT = "prompt"
RUN = "run"
PROMPT_STATUS = "prompt-status"
STRIP = "token-strip"
STRIP_NOTE = "token-strip-note"
TOKEN_INFO = "token-info"
KIND = "kind"
EXPANDED = "expanded"
SOURCE = "source"
MAGNITUDES = "magnitudes"
GRADIENTS = "gradients"
CARDS = "metric-cards"
GLANCE = "glance"  # the first screen's headline table
URL = "url"  # the page's address: ?token=N&kind=...&view=...&layer=L&head=H&text=... (a shareable view)
QUERY = "view-query"  # the query string of the current view, which the browser puts in its address bar
QUERY_SHOWN = "view-query-shown"  # the output of the browser-side callback that does so (always unchanged)
SOURCE_MARKED = "source-token-marked"  # the output of the browser-side callback that marks it (always unchanged)
JUMP = "token-jump"
TWO_A = "compare-a"  # the two-views comparison: model A, model B, text B, colour, button, status, graph, table
TWO_B = "compare-b"
TWO_TEXT = "compare-text"
TWO_KIND = "compare-kind"
TWO_RUN = "compare-run"
TWO_STATUS = "compare-status"
TWO_GRAPH = "compare-graph"
TWO_TABLE = "compare-table"
JUMP_NOTE = "token-jump-note"
ABL_MODEL = "ablation-model"
ABL_READ = "ablation-read"
ABL_MODE = "ablation-mode"
ABL_RUN = "ablation-run"
ABL_GRAPH = "ablation-graph"
ABL_STATUS = "ablation-status"
WE_RUN = "weight-effect-run"
WE_STATUS = "weight-effect-status"
WE_TABLE = "weight-effect-table"
WE_GRAPH = "weight-effect-graph"
CORPUS = "corpus"
CORPUS_HEADLINE = "corpus-headline"
CORPUS_WEIGHTS = "corpus-weights"
CORPUS_CONTRIB = "corpus-contrib"
CORPUS_SPREAD = "corpus-spread"
CORPUS_DIFF = "corpus-difference"
CORPUS_DIFF_NOTE = "corpus-difference-note"
TOKEN_DIFF_NOTE = "token-difference-note"  # the caption of the per-token difference view (empty while it is off)
CORPUS_MAGNITUDES = "corpus-magnitudes"
CORPUS_GRADIENTS = "corpus-gradients"
CHIP = "chip"  # pattern-matching type of the token chips: {"type": "chip", "index": i}

KIND_OPTIONS = [
    {"label": "depth weights (α, or c/Σc)", "value": "weights"},
    {"label": "contribution share", "value": "contrib"},
    {"label": "depth logits z", "value": "logits"},
]
GRAPH_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "svg"}}


def panel_id(view: str, part: str, index: int) -> str:
    """Id of a per-model element: ``panel_id("token", "graph", 0) == "token-graph-0"``."""
    return f"{view}-{part}-{index}"


def _help(text: str) -> html.P:
    return html.P(text, className="help")


def _swatch(color: str) -> html.Span:
    return html.Span(className="swatch", style={"backgroundColor": color})


def _header(ex: Explorer) -> html.Header:
    badges = []
    for name in ex.names:
        role = "baseline" if name == ex.baseline else ("saved trace" if name in ex.saved else "")
        badges.append(
            html.Span(
                [_swatch(ex.colors[name]), html.B(name), html.Span(" · " + ex.describe(name, short=True), className="muted"),
                 html.Span(role, className="role") if role else None],
                className="badge", title=ex.describe(name),
                style={"borderColor": ex.colors[name]},
            )
        )
    if ex.baseline is None:
        base = "No PreNorm baseline is loaded: metric cards show absolute values only."
    else:
        base = None  # the badge says "baseline"; the headline names each comparison's reference
    return html.Header(
        [
            html.Div([html.H1(["attnres-probe ", html.Span("depth-routing explorer", className="muted")]),
                      html.Div(badges, className="badges", id="model-badges")], className="header-row"),
            html.P(base, className="help") if base else None,
        ],
        className="header",
    )


def _guide_items() -> html.Ul:
    return html.Ul(
        [
            html.Li("Every AttnRes sublayer reads a softmax mixture of earlier depth sources (the embedding, "
                    "earlier sublayer outputs or blocks); PreNorm adds them all with weight one, which is the uniform "
                    "mixture 1/k over the k sources a read sees (its implied weights, drawn in its panel)."),
            html.Li("Rows of a heatmap are reads (one per sublayer, then the final read), columns are sources. "
                    "Blank cells are sources a read cannot see yet; black lines mark block boundaries."),
            html.Li("Contribution share c = ⟨coef·v, h⟩ / ‖h‖² is defined for every model and compares shares with "
                    "shares. Hover a cell for the exact weight, logit and share."),
            html.Li("Click a token (or a cell of the 'one source' heatmap) to see how that token routes."),
        ]
    )


def _saved_text(trace) -> str:
    """The text of a saved trace's first sequence: its bytes decoded (a newline is a newline, not
    the chip label ``\\n``), else its token labels joined."""
    ids = [int(i) for i in trace.tokens[0][trace.mask[0]]]
    if ids and max(ids) < 256 and len(trace.str_tokens[0]) == len(ids):
        return bytes(ids).decode("utf-8", errors="replace")
    return "".join(trace.str_tokens[0])


def _byte_level(ex: Explorer) -> bool:
    """Whether every live model reads bytes (no tokenizer of its own, or the byte tokenizer)."""
    return all(getattr(p, "tokenizer", None) is None or type(p.tokenizer).__name__ == "ByteTokenizer"
               for p in ex.probes.values())


def _prompt(ex: Explorer) -> tuple[list, str]:
    """The text box, its Run button and status (the first screen's left column), and the length limit in words."""
    if ex.live:
        limit = (f"Up to {ex.n_ctx} tokens (the models' context); the byte tokenizer counts one token per byte."
                 if _byte_level(ex) else f"Up to {ex.n_ctx} tokens (the models' context), as the models' tokenizer counts them.")
        note = None
    else:
        limit = ""
        note = html.P(
            "Traces-only mode: this dashboard shows saved traces and has no model to run new text. "
            "Start it with --models DIR … to explore new prompts.",
            className="notice",
            id="traces-only-note",
        )
    text = ex.initial.text if ex.initial.text is not None else _saved_text(ex.initial.first)
    return [
        note,
        html.Div(
            [
                dcc.Textarea(
                    id=PROMPT,
                    value=text,
                    maxLength=ex.max_chars or None,
                    disabled=not ex.live,
                    className="prompt",
                    placeholder="Type a text to run through every model",
                    spellCheck=False,
                    rows=2,
                    title=limit or None,
                ),
                html.Button("Run", id=RUN, n_clicks=0, disabled=not ex.live, className="primary"),
            ],
            className="prompt-row",
        ),
        html.Div(id=PROMPT_STATUS, className="status", role="status"),
    ], limit


def _tokens() -> list:
    """The token strip (every tenth chip numbered), a box to jump to a token by position or text, why the
    selected token was chosen, and the selected token's line."""
    return [
        html.Div(id=STRIP, className="strip"),
        html.Div(
            [
                html.Label("go to token", htmlFor=JUMP, className="control-label"),
                dcc.Input(id=JUMP, type="text", placeholder="position (12, -1) or text", debounce=True, className="jump",
                          autoComplete="off", spellCheck=False),
                html.Span(id=JUMP_NOTE, className="help inline"),
            ],
            className="row jump-row",
        ),
        html.Div(id=STRIP_NOTE, className="help"),
        html.Div(id=TOKEN_INFO, className="token-info"),
    ]


def _headline(ex: Explorer) -> list:
    """The first screen's right column: the headline comparisons, from the strongest evidence loaded:
    a corpus run (``--stats``: intervals over windows), else the study's seeds beside the demo models,
    else this text (one window: estimates only, filled by a callback)."""
    if ex.stats:
        frame = ex.stats_frame
        n = ", ".join(f"{name} {s.n_windows} windows" for name, s in ex.stats.items())
        warning = " ".join(page_warnings(frame))
        title, body = "Corpus: each model against its references", glance_table(frame)
        note = [f"{n}; 95% bootstrap intervals, documents resampled with their windows.",
                html.Span(" " + warning, className="few-documents") if warning else None]
    elif getattr(ex, "study", None) and ex.study.get("primaries"):
        seeds = ex.study["seeds"]
        planned = ex.study.get("planned_seeds", 5)
        title = f"What {len(seeds)} training seed{'s' if len(seeds) != 1 else ''} show (study v3" + (
            f"; {planned} planned, the rest still training)" if len(seeds) < planned else ")")
        note = "Pre-registered endpoints; a t-test over seeds, Holm-corrected. The demo models are seed 0 (details below)."
        body = glance_study(ex.study)
    else:
        title = "This text against the references"
        note = "One text is one window: estimates without intervals. For intervals, record a corpus (dash --stats)."
        body = None
    return [html.H2(title), html.P(note, className="help"), html.Div(body, id=GLANCE)]


def _glance(ex: Explorer) -> html.Section:
    """The first screen: the text and its tokens beside the headline comparisons."""
    prompt, limit = _prompt(ex)
    if limit:
        limit = f" · up to {ex.n_ctx} tokens" + (", one per byte" if _byte_level(ex) else "")
    return html.Section(
        [
            html.Div([html.H2(["Text and tokens", html.Span(limit, className="muted small")]), *prompt, *_tokens()],
                     className="glance-text"),
            html.Div(_headline(ex), className="glance-headline"),
        ],
        className="card glance",
        id="glance-section",
    )


def _panels(ex: Explorer, view: str, note: bool = False, loading: bool = False) -> html.Div:
    panels = []
    for i, name in enumerate(ex.names):
        graph = dcc.Graph(id=panel_id(view, "graph", i), config=GRAPH_CONFIG, className="graph")
        body = [
            html.Div([_swatch(ex.colors[name]), html.B(name), html.Span(" · " + ex.describe(name), className="muted")],
                     className="panel-title"),
            html.Div(id=panel_id(view, "note", i), className="help") if note else None,
            graph,
        ]
        # the outer slot's style is what callbacks toggle (display); the colour sits on the inner panel
        panels.append(
            html.Div(html.Div(body, className="panel", style={"borderTopColor": ex.colors[name]}),
                     id=panel_id(view, "panel", i), className="panel-slot")
        )
    return html.Div(panels, className="panels")


def _controls() -> html.Div:
    return html.Div(
        [
            html.Label("colour by:", className="control-label"),
            dcc.RadioItems(id=KIND, options=KIND_OPTIONS, value="weights", inline=True, className="radio"),
            dcc.Checklist(
                id=EXPANDED,
                options=[{"label": "expanded (Block: a column per sublayer)", "value": "expanded"},
                         {"label": "difference: model − baseline", "value": "diff"}],
                value=[],
                inline=True,
                className="radio",
            ),
        ],
        className="row controls",
    )


def _token_help(ex: Explorer) -> str:
    text = "Reads (rows) × sources (columns) for the selected token"
    if ex.baseline is not None and len(ex.names) > 1:
        text += ", AttnRes beside the baseline"
    return (text + ". Depth weights (0 to 1) run from dark purple to yellow; contribution shares and logits, which can "
            "be below zero (and shares above one), from blue (negative) through white (zero) to red (positive).")


def _token_views(ex: Explorer) -> html.Section:
    return html.Section(
        [
            html.Div([html.H2("Depth routing of the selected token"), _controls(),
                      html.Details([html.Summary("How to read these panels"), _help(_token_help(ex)), _guide_items()],
                                   className="guide")], className="row title-row"),
            html.P(id=TOKEN_DIFF_NOTE, className="help diff-caption"),
            _panels(ex, "token", note=True),
        ],
        className="card",
        id="token-views",
    )


def _reading_views(ex: Explorer) -> html.Section:
    """Per model: direct logit contributions and the logit lens at the selected token (models only)."""
    from attnres_probe import figures

    panels = []
    for i, name in enumerate(ex.names):
        body = [
            html.Div([_swatch(ex.colors[name]), html.B(name), html.Span(" · " + ex.describe(name), className="muted")],
                     className="panel-title"),
            html.Div(id=panel_id("decomp", "note", i), className="help"),
            dcc.Graph(id=panel_id("decomp", "graph", i), config=GRAPH_CONFIG, className="graph"),
            dcc.Graph(id=panel_id("lens", "graph", i), config=GRAPH_CONFIG, className="graph"),
        ]
        panels.append(html.Div(html.Div(body, className="panel", style={"borderTopColor": ex.colors[name]}),
                               id=panel_id("decomp", "panel", i), className="panel-slot"))
    return html.Section(
        [
            html.H2("Reading the residual stream at the selected token"),
            _help("Top: how much each source adds, through the final read's weights, to the logits of the model's "
                  "most likely next tokens (red raises a token, blue lowers it; the last row is their sum, the logit). "
                  "Bottom: the logit lens, what each read's mixed input would predict through the final norm and the "
                  "unembedding (✓ marks the token that follows)."),
            _help(figures.VOCAB_ID_NOTE),
            html.Div(panels, className="panels"),
        ],
        className="card",
        id="reading",
    )


def _over_training(ex: Explorer) -> html.Section | None:
    """Routing over training, for loaded run folders that recorded it (train --probe-every N)."""
    if not ex.histories:
        return None
    from attnres_probe import figures

    names = [n for n in ex.names if n in ex.histories]  # the baseline first, as everywhere
    missing = [n for n in ex.names if n in ex.probes and n not in ex.histories]
    note = (f" {', '.join(missing)} recorded no routing probes (train with --probe-every N to add them)." if missing else "")
    return html.Section(
        [
            html.H2("Routing over training"),
            _help("How each run's routing changed while it trained, measured on the same held-out windows at every "
                  "probe (train --probe-every N), each run beside the baseline." + note),
            dcc.Graph(id="over-training", figure=figures.over_training({n: ex.histories[n] for n in names}),
                      config=GRAPH_CONFIG, className="graph"),
        ],
        className="card",
        id="over-training-section",
    )


def _study(ex: Explorer) -> html.Section | None:
    """What five training seeds show (study v3): the pre-registered endpoints, per seed, with Holm's
    correction; shown beside the demo models, which are seed 0 of those runs."""
    study = getattr(ex, "study", None)
    if not study or not study.get("primaries"):
        return None
    seeds = [str(s) for s in study["seeds"]]
    level = f"{float(study.get('level', 0.95)):.0%}"

    def num(x, spec="+.3g"):
        return "—" if x is None else format(float(x), spec)

    head = html.Tr([html.Th(h) for h in ("id", "endpoint", "unit", "paper", *[f"seed {s}" for s in seeds],
                                         f"mean [{level} CI, unadjusted]", "Holm p", "paper's side", "verdict")])
    body = []
    for p in study["primaries"]:
        body.append(html.Tr([
            html.Td(p["key"]), html.Td(p["title"]), html.Td(p["unit"], className="unit"),
            html.Td("< 0" if p["expected"] == "lower" else "> 0"),
            *[html.Td(num(p["per_seed"].get(s)), className="num") for s in seeds],
            html.Td(f"{num(p['mean'])} [{num(p['low'])}, {num(p['high'])}]", className="num"),
            html.Td(num(p["p_holm"], ".2g"), className="num"), html.Td(f"{p['paper_way']} of {p['n']}", className="num"),
            html.Td(html.Span(p["verdict"], className=f"verdict {p['verdict']}")),
        ], **{"data-endpoint": p["key"]}))
    missing = study.get("missing") or []
    return html.Section(
        [
            html.H2(f"What {len(seeds)} training seed{'s' if len(seeds) != 1 else ''} show (study v3, "
                    f"{study.get('planned_seeds', 5)} planned)"),
            _help("The demo models are seed 0 of these runs. Each endpoint was fixed before the runs "
                  f"({study['plan']}); per seed, the AttnRes model against PreNorm of the same seed (or against its own "
                  "uniform reference), a t-test over seeds with Holm's correction across the six, and how many seeds "
                  "fall on the paper's side. The verdict reads Holm's adjusted p alone; the interval beside it is the "
                  f"unadjusted t interval of that endpoint. Regenerate with `{study['command']}`."),
            html.P("Not finished yet (left out): " + "; ".join(missing), className="notice") if missing else None,
            html.Table([html.Thead(head), html.Tbody(body)], className="metric-table study-table"),
        ],
        className="card",
        id="study-v3",
    )


def _mean_views(ex: Explorer) -> html.Section:
    return html.Section(
        [
            html.H2("Mean routing over all tokens"),
            _help("The same heatmap averaged over every token of the prompt (uses the colour and view choices above)."),
            _panels(ex, "mean"),
        ],
        className="card",
    )


def _source_views(ex: Explorer) -> html.Section:
    options = ex.source_options()
    return html.Section(
        [
            html.H2("One source at every token"),
            _help("Tokens (x, labelled with their positions) × reads (y) for one source; 'embed' shows embedding "
                  "retention token by token. A red box marks the selected token; click a cell to select its token."),
            html.Div(
                [html.Label("source", className="control-label"),
                 dcc.Dropdown(id=SOURCE, options=[{"label": s, "value": s} for s in options], value=options[0],
                              clearable=False, className="dropdown")],
                className="row controls",
            ),
            _panels(ex, "source", note=True),
        ],
        className="card",
    )


def _profiles() -> html.Section:
    return html.Section(
        [
            html.H2("Magnitudes and gradients by depth"),
            _help("Every loaded model in one chart, in its own colour. The paper reports that PreNorm's residual stream "
                  "grows with depth while AttnRes keeps magnitudes bounded and spreads gradients more evenly; whether "
                  "these models do on this text is what the comparisons below say (verdicts for the AttnRes models; "
                  "the paper makes no claim about mHC or DenseFormer)."),
            html.Div(
                [dcc.Graph(id=MAGNITUDES, config=GRAPH_CONFIG, className="graph"),
                 dcc.Graph(id=GRADIENTS, config=GRAPH_CONFIG, className="graph")],
                className="stack",
            ),
        ],
        className="card",
    )


VERDICT_HELP = ("Each comparison is the model against the baseline on the same windows: a ratio (×) for spreads, "
                "growths and peaks, a difference (±) otherwise, with its 95% bootstrap interval (whole documents "
                "resampled, since windows of one document are alike). The verdict "
                "sets that interval against the paper's direction: consistent (the whole interval lies on the paper's side "
                "of no difference: zero for ±, one for ×), contrary (it lies wholly on the other side), inconclusive "
                "(it contains no difference, or there is no interval). The paper's directions are claims about AttnRes: "
                "other rules (mHC, DenseFormer) get "
                "estimates and intervals against the same references but \"no verdict\". Hover a metric name for its "
                "formula.")


def _cards(ex: Explorer) -> html.Section:
    title = "This text against the baseline" if ex.stats else "Metrics against the baseline"
    return html.Section(
        [
            html.H2(title),
            _help(VERDICT_HELP + " A prompt is one window, so it has no interval: record a corpus "
                  "(attnres-probe corpus) for intervals and verdicts that can hold."),
            html.Div(id=CARDS, className="cards"),
        ],
        className="card",
    )


def _corpus(ex: Explorer) -> html.Section | None:
    """The corpus section (``dash --stats``): headline panel, metric table, heatmaps and profiles, all static."""
    if not ex.stats:
        return None
    from attnres_probe import figures

    stats = list(ex.stats.values())
    names = list(ex.stats)
    sizes = "; ".join(f"{n}: {s.n_windows} windows, {s.n_tokens} tokens" for n, s in ex.stats.items())
    frame = ex.stats_frame
    return html.Section(
        [
            html.H2("Corpus: each model against the baseline, window by window"),
            _help(f"Recorded corpus ({sizes}). " + VERDICT_HELP),
            *comparison_notes(frame),
            html.Div(headline_cards(frame, ex.colors), className="cards", id=CORPUS_HEADLINE),
            html.Details(
                [html.Summary("Every metric with its interval and verdict"), metric_table(frame)],
                className="guide", open=False,
            ),
            *_corpus_documents(ex),
            html.H3("Mean routing over the corpus"),
            _help("Mean over every token of the corpus (hover a cell for its standard deviation over tokens and its count); "
                  "the last chart shows each cell's spread over tokens."),
            dcc.Graph(id=CORPUS_WEIGHTS, figure=figures.corpus_side_by_side(stats, "weights", names=names),  # PreNorm: 1/k
                      config=GRAPH_CONFIG, className="graph"),
            dcc.Graph(id=CORPUS_CONTRIB, figure=figures.corpus_side_by_side(stats, "contrib", names=names),
                      config=GRAPH_CONFIG, className="graph"),
            dcc.Graph(id=CORPUS_SPREAD, figure=figures.corpus_side_by_side(stats, "contrib", names=names, value="sd"),
                      config=GRAPH_CONFIG, className="graph"),
            *_corpus_difference(ex),
            html.H3("Magnitudes and gradients by depth"),
            dcc.Graph(id=CORPUS_MAGNITUDES, figure=figures.magnitude_bands(stats, names), config=GRAPH_CONFIG, className="graph"),
            dcc.Graph(id=CORPUS_GRADIENTS, figure=figures.gradient_bands(stats, names), config=GRAPH_CONFIG, className="graph"),
        ],
        className="card",
        id=CORPUS,
    )


CORPUS_DOCUMENTS = "corpus-documents"  # the table of which documents drive the verdicts


def _corpus_documents(ex: Explorer) -> list:
    """Which documents drive the verdicts (:func:`attnres_probe.analysis.documents.document_breakdown`, with the
    corpus comparisons' resamples and seed, so the "every document" row holds their verdicts): documents as rows,
    the headline comparisons as columns, each cell the document's own value, marked where leaving it out changes
    the verdict; nothing without comparisons."""
    from attnres_probe import metrics
    from attnres_probe.analysis.documents import document_breakdown, document_table
    from attnres_probe.dashboards.cards import _verdict_badge

    attrs = ex.stats_frame.attrs if ex.stats_frame is not None else {}
    frame = document_breakdown(*ex.stats.values(), names=list(ex.stats), n_resamples=int(attrs.get("n_resamples", 1000)),
                               seed=attrs.get("seed", 0))
    t = document_table(frame)
    if not t["columns"]:
        return []
    head = [html.Tr([html.Th("document", rowSpan=2), html.Th("windows", rowSpan=2),
                     *[html.Th(sp["label"], colSpan=sp["n"], title=metrics.FORMULAS.get(sp["metric"], ""),
                               className="metric-name") for sp in t["spans"]]]),
            html.Tr([html.Th(c["model"], title=f"{c['model']} vs {c['baseline']} ({c['comparison']})") for c in t["columns"]])]
    body = []
    for r in t["rows"]:
        cells = [html.Td(r["document"], className="metric-name"), html.Td(str(r["windows"]), className="num")]
        for cell in r["cells"]:
            mark = [html.Sup(cell["mark"], className="mark")] if cell["mark"] else []
            cells.append(html.Td([cell["text"], *mark], title=cell["title"] or None, className="num",
                                 **{"data-metric": cell["metric"], "data-model": cell["model"], "data-value": repr(cell["value"]),
                                    "data-changes": "true" if cell["changes"] else "false"}))
        body.append(html.Tr(cells, **{"data-doc": str(r["doc"])}))
    body.append(html.Tr([html.Th("every document", colSpan=2),
                         *[html.Td([cell["text"], " ", _verdict_badge(cell["verdict"])], className="num",
                                   **{"data-metric": cell["metric"], "data-model": cell["model"], "data-value": repr(cell["value"])})
                           for cell in t["all"]]], className="group", **{"data-doc": "all"}))
    return [html.H3("Which documents drive the verdicts"),
            _help(t["note"]),
            html.Table([html.Thead(head), html.Tbody(body)], className="metric-table full-table documents-table",
                       id=CORPUS_DOCUMENTS),
            _help(t["more"]) if t["more"] else None]


def corpus_difference_caption(models: list[str], baseline: str) -> str:
    """What the corpus difference chart shows: which model minus which, and how the colours read."""
    return (f"Each cell is the model's mean contribution share over every token of the corpus minus "
            f"{baseline}'s ({', '.join(models)} minus {baseline}), like from like: a Block model on its blocks (with "
            f"{baseline}'s shares summed into the same blocks), the others on sublayers, so a row sums to about zero. "
            f"The scale diverges around zero: red, the model takes more from "
            f"that source than {baseline}; blue, less; white, the same. Hover a cell for both values.")


def _corpus_difference(ex: Explorer) -> list:
    """Each AttnRes model minus the baseline over the corpus (mean contribution shares, cell by cell), as the
    corpus report draws it (:func:`attnres_probe.figures.difference_side_by_side`); nothing without a baseline."""
    import dataclasses

    from attnres_probe import figures

    traces = [(n, s.to_trace()) for n, s in ex.stats.items()]
    traces = [(n, t if t.name == n else dataclasses.replace(t, meta={**t.meta, "name": n})) for n, t in traces]
    base = next((t for _, t in traces if t.residual == "prenorm"), None)
    others = [t for _, t in traces if t.residual != "prenorm"]
    if base is None or not others:
        return []
    same = [t for t in others if list(t.read_labels) == list(base.read_labels)]
    skipped = [t.name for t in others if t not in same]
    out: list = [html.H3(f"Difference: each model minus {base.name}")]
    if same:
        out += [html.P(corpus_difference_caption([t.name for t in same], base.name), className="help", id=CORPUS_DIFF_NOTE),
                dcc.Graph(id=CORPUS_DIFF, figure=figures.difference_side_by_side(same, base, "contrib"),
                          config=GRAPH_CONFIG, className="graph")]
    if skipped:
        out.append(_help(f"{', '.join(skipped)} differ{'s' if len(skipped) == 1 else ''} in depth from {base.name}: "
                         "no cell-by-cell difference."))
    return out


def _ablation(ex: Explorer) -> html.Section:
    models = ex.attnres_probes
    if not models:
        why = ("Routing ablation needs a live model with depth weights (AttnRes, mHC, DenseFormer); this dashboard has "
               + ("saved traces only." if not ex.live else "only PreNorm models (no softmax weights to edit)."))
        return html.Section([html.H2("Routing ablation"), html.P(why, className="notice", id=ABL_STATUS)], className="card")
    reads = ex.read_options(models[0])
    return html.Section(
        [
            html.H2("Routing ablation"),
            _help("Remove one source from one read (weights renormalised; for mHC and DenseFormer on the normalised "
                  "weights c/Σc, scaled back by Σc so the read keeps its gain) and measure the change in next-token "
                  "loss, beside how much routing mass and contribution that source had. Large mass with small Δloss "
                  "means the mass is not needed."),
            html.Div(
                [
                    html.Label("model", className="control-label"),
                    dcc.Dropdown(id=ABL_MODEL, options=[{"label": m, "value": m} for m in models], value=models[0],
                                 clearable=False, className="dropdown"),
                    html.Label("read", className="control-label"),
                    dcc.Dropdown(id=ABL_READ, options=[{"label": r, "value": r} for r in reads], value=reads[-1],
                                 clearable=False, className="dropdown"),
                    html.Label("mode", className="control-label"),
                    dcc.RadioItems(id=ABL_MODE, options=list(ABLATION_MODES), value="zero", inline=True, className="radio"),
                    html.Button("Run ablation", id=ABL_RUN, n_clicks=0),
                ],
                className="row controls",
            ),
            html.Div(id=ABL_STATUS, className="status", role="status"),
            dcc.Loading(dcc.Graph(id=ABL_GRAPH, config=GRAPH_CONFIG, className="graph"), type="dot", delay_show=300),
        ],
        className="card",
    )


def _weight_effect(ex: Explorer) -> html.Section | None:
    if not ex.live:
        return None
    return html.Section(
        [
            html.H2("Weight beside effect"),
            _help(WEIGHT_EFFECT_NOTE),
            html.Div([html.Button("Measure weight beside effect", id=WE_RUN, n_clicks=0),
                      html.Span(" every deep read of every live model: one forward pass per source and read",
                                className="help")], className="row controls"),
            html.Div(id=WE_STATUS, className="status", role="status"),
            dcc.Loading(html.Div([html.Div(id=WE_TABLE), dcc.Graph(id=WE_GRAPH, config=GRAPH_CONFIG, className="graph",
                                                                   style={"display": "none"})]), type="dot", delay_show=300),
        ],
        className="card", id="weight-effect",
    )


def default_pair(ex: Explorer) -> tuple[str, str]:
    """Models A and B the comparison opens with: two checkpoints of one architecture where loaded, else
    the first AttnRes model against itself (on a second text)."""
    names = list(ex.names)
    by_kind: dict[str, list[str]] = {}
    for n in names:
        by_kind.setdefault(ex.residual_of(n), []).append(n)
    pairs = [v for k, v in by_kind.items() if len(v) > 1 and k != "prenorm"] + [v for v in by_kind.values() if len(v) > 1]
    if pairs:
        return pairs[0][0], pairs[0][1]
    first = next((n for n in names if ex.residual_of(n) != "prenorm"), names[0])
    return first, first


def _compare_two(ex: Explorer) -> html.Section:
    """Two texts, or two checkpoints of one architecture, set against each other: A − B, like from like."""
    a, b = default_pair(ex)
    options = [{"label": n, "value": n} for n in ex.names]
    return html.Section(
        [
            html.H2("Compare two texts or two checkpoints"),
            _help("A is a model on this page's text, B a model on text B (empty: the same text). The heatmap is "
                  "A − B of the mean over tokens, cell by cell on one source axis (Block's blocks when either is "
                  "Block), and the table sets the routing diagnostics of A and B side by side. Two checkpoints of "
                  "one architecture (dash --models run/step2000 run/step8000) compare weights with weights; against "
                  "PreNorm only contribution shares compare."),
            html.Div(
                [
                    html.Label("A", className="control-label"),
                    dcc.Dropdown(id=TWO_A, options=options, value=a, clearable=False, className="dropdown"),
                    html.Label("B", className="control-label"),
                    dcc.Dropdown(id=TWO_B, options=options, value=b, clearable=False, className="dropdown"),
                    html.Label("colour by", className="control-label"),
                    dcc.RadioItems(id=TWO_KIND, options=KIND_OPTIONS[:2], value="weights", inline=True, className="radio"),
                ],
                className="row controls",
            ),
            html.Div(
                [
                    dcc.Textarea(id=TWO_TEXT, value="", className="prompt", rows=2, disabled=not ex.live, spellCheck=False,
                                 placeholder="text B (empty: the same text as A)", maxLength=ex.max_chars or None),
                    html.Button("Compare", id=TWO_RUN, n_clicks=0, className="primary"),
                ],
                className="prompt-row",
            ),
            html.Div(id=TWO_STATUS, className="status", role="status"),
            dcc.Loading(html.Div([dcc.Graph(id=TWO_GRAPH, config=GRAPH_CONFIG, className="graph", style={"display": "none"}),
                                  html.Div(id=TWO_TABLE)]), type="dot", delay_show=300),
        ],
        className="card",
        id="compare-two",
    )


def build_layout(ex: Explorer) -> html.Div:
    """The whole page for an :class:`Explorer` (stores hold the result key and the selected token only)."""
    return html.Div(
        [
            dcc.Store(id=KEY, data=ex.initial.key),
            dcc.Store(id=TOKEN, data=None),
            dcc.Location(id=URL, refresh=False),
            dcc.Store(id=QUERY, data=None),
            dcc.Store(id=QUERY_SHOWN, data=None),
            dcc.Store(id=SOURCE_MARKED, data=None),
            _header(ex),
            _glance(ex),
            _token_views(ex),
            pattern_section(ex),  # attention pattern at the selected token (dashboards/patterns.py)
            _corpus(ex),
            _reading_views(ex),
            _mean_views(ex),
            _source_views(ex),
            _profiles(),
            _over_training(ex),
            _study(ex),
            _cards(ex),
            _compare_two(ex),
            _ablation(ex),
            patching_section(ex),
            _weight_effect(ex),
            html.Footer("attnres-probe · charts from attnres_probe.figures · traces stay on the server", className="help"),
        ],
        className="page",
    )
