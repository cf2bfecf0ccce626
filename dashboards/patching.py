"""The dashboard's routing-patching section: a clean and a corrupted prompt, one model, the fraction
of the metric recovered by patching each read's routing (:mod:`attnres_probe.patching`).

:func:`patching_section` is the layout (placed by :func:`attnres_probe.dashboards.layout.build_layout`),
:func:`patching_view` the callback as a plain function of the explorer and the browser's values
(tests call it directly), :func:`register` binds it to one app (called from
:func:`attnres_probe.dashboards.callbacks.register`).
"""

from __future__ import annotations

import warnings
from typing import Any

from dash import Input, Output, State, dcc, html, no_update

from attnres_probe.axis import fixed_routing, rule_title
from attnres_probe.dashboards.state import Explorer
from attnres_probe.patching import SamePrediction, patching_bars, patching_heatmap

__all__ = ["PATCH_CLEAN", "PATCH_CORRUPT", "PATCH_MODEL", "PATCH_RUN", "patching_section", "patching_view", "register"]

PATCH_MODEL = "patch-model"
PATCH_CLEAN = "patch-clean"
PATCH_CORRUPT = "patch-corrupt"
PATCH_RUN = "patch-run"
PATCH_STATUS = "patch-status"
PATCH_HEAT = "patch-heatmap"
PATCH_BARS = "patch-bars"
PATCH_GRAPHS = "patch-graphs"
SECTION_ID = "routing-patching"
DEFAULT_CLEAN = "I pray you, sir"  # the demo models predict ',' after it
DEFAULT_CORRUPT = "I pray you, lad"  # and 'y' after this one: one token length, two predictions
GRAPH_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "svg"}}
SHOWN, HIDDEN = {"display": "block"}, {"display": "none"}
HELP = ("Run a clean and a corrupted prompt of the same token length, write one read's depth weights from the clean "
        "run into the corrupted run (its sources stay the corrupted run's) and measure the fraction of the metric "
        "recovered, (patched − corrupted) / (clean − corrupted). The metric is the logit of the clean run's next token "
        "minus that of the corrupted run's, at the last position where the two prompts' predicted next tokens differ "
        "(two prompts that differ in a middle word often predict the same next token at the end). "
        "The heatmap patches one source's weight at one read "
        "(the read's other weights kept as they are, not renormalised); the bars patch each read's whole row of "
        "weights beside its whole input (weights and sources), where the final read's input recovers 1. "
        "Blank cells: sources a read cannot see.")


PRENORM_OPTION = "PreNorm: fixed routing, nothing to patch"
FIXED_OPTION = "{title}: weights the same for every input, nothing to patch"


def _live_models(ex: Explorer) -> list[str]:
    return [n for n in ex.names if n in ex.probes]


def _fixed(ex: Explorer, name: str) -> bool:
    """Whether a live model's depth weights are the same for every input (PreNorm, DenseFormer, static HC)."""
    config = ex.probes[name].spec.meta.get("config") if name in ex.probes else None
    return fixed_routing(ex.residual_of(name), config)


def _patchable(ex: Explorer) -> list[str]:
    """The live models patching can run on: those whose depth weights depend on the input (AttnRes,
    dynamic Hyper-Connections / mHC); not PreNorm, DenseFormer or static HC, whose clean and corrupted
    weights are the same."""
    return [n for n in _live_models(ex) if not _fixed(ex, n)]


def _model_options(ex: Explorer, models: list[str]) -> list[dict]:
    """The model menu: models with fixed routing are listed but disabled (patching always refuses
    them), with the reason in their label."""
    options = []
    for m in models:
        if ex.residual_of(m) == "prenorm":
            options.append({"label": f"{m} ({PRENORM_OPTION})", "value": m, "disabled": True})
        elif _fixed(ex, m):
            title = rule_title(ex.residual_of(m), ex.probes[m].spec.meta.get("config"))
            options.append({"label": f"{m} ({FIXED_OPTION.format(title=title)})", "value": m, "disabled": True})
        else:
            options.append({"label": m, "value": m})
    return options


def _same_prediction_message(exc: SamePrediction) -> str:
    """The card's words for two prompts whose predictions never differ (no API text: the card has no
    position or metric control)."""
    shown = repr(exc.token_text) if exc.token_text is not None else f"token {exc.token}"
    if exc.position is None:
        return (f"Both prompts predict the same next token at every position ({shown} after the last one), so there "
                "is no difference to recover. Try prompts whose continuations differ, e.g. ones that end inside the "
                "word that differs.")
    return (f"Both prompts predict {shown} next at position {exc.position}, so there is no difference to recover there. "
            "Try prompts whose continuations differ.")


def patching_section(ex: Explorer) -> html.Section:
    """The section: model, clean and corrupted prompts, the button, a status line, the heatmap and the bars."""
    title = html.H2("Routing patching: does a read's routing matter?")
    models = _live_models(ex)
    if not models:
        return html.Section([title, html.P("Routing patching runs two prompts through a live model with depth weights (AttnRes, mHC, "
                                           "DenseFormer); this dashboard has saved traces only.", className="notice",
                                           id=PATCH_STATUS)], className="card", id=SECTION_ID)
    if not _patchable(ex):
        return html.Section([title, html.P("Routing patching runs two prompts through a live model with depth weights (AttnRes, mHC, "
                                           "DenseFormer); this dashboard's live models are PreNorm, whose routing is fixed "
                                           "(every source enters each read with weight 1).", className="notice",
                                           id=PATCH_STATUS)], className="card", id=SECTION_ID)
    first = _patchable(ex)[0]
    return html.Section(
        [
            title,
            html.P(HELP, className="help"),
            html.Div(
                [html.Label("model", className="control-label"),
                 dcc.Dropdown(id=PATCH_MODEL, options=_model_options(ex, models), value=first,
                              clearable=False, className="dropdown")],
                className="row controls",
            ),
            html.Div(
                [
                    dcc.Textarea(id=PATCH_CLEAN, value=DEFAULT_CLEAN, className="prompt", rows=2, spellCheck=False,
                                 placeholder="clean prompt", maxLength=ex.max_chars or None),
                    dcc.Textarea(id=PATCH_CORRUPT, value=DEFAULT_CORRUPT, className="prompt", rows=2, spellCheck=False,
                                 placeholder="corrupted prompt (the same number of tokens)",
                                 maxLength=ex.max_chars or None),
                    html.Button("Patch", id=PATCH_RUN, n_clicks=0, className="primary"),
                ],
                className="prompt-row",
            ),
            html.Div(id=PATCH_STATUS, className="status", role="status"),
            dcc.Loading(html.Div([dcc.Graph(id=PATCH_HEAT, config=GRAPH_CONFIG, className="graph"),
                                  dcc.Graph(id=PATCH_BARS, config=GRAPH_CONFIG, className="graph")],
                                 id=PATCH_GRAPHS, style=HIDDEN), type="dot", delay_show=300),
        ],
        className="card",
        id=SECTION_ID,
    )


def _check_text(ex: Explorer, text: Any, which: str) -> str:
    if not isinstance(text, str) or not text:
        raise ValueError(f"the {which} prompt is empty: type at least one character")
    if ex.max_chars and len(text) > ex.max_chars:
        raise ValueError(f"the {which} prompt has {len(text)} characters; the limit is {ex.max_chars}")
    return text


def patching_view(ex: Explorer, n_clicks: Any, model: Any, clean: Any, corrupted: Any) -> dict:
    """Patch model ``model``'s routing from ``clean`` into ``corrupted`` (on the button).

    Returns:
        {"heatmap": Figure or no_update, "bars": Figure or no_update, "graphs": style, "status": str}.
        A refusal (texts of different token lengths, a PreNorm model, both prompts predicting the
        same token, ...) hides the charts and says why.
    """
    refused = {"heatmap": no_update, "bars": no_update, "graphs": HIDDEN}
    if not n_clicks:
        return {**refused, "status": "Type a clean and a corrupted prompt of the same token length and press Patch."}
    if not isinstance(model, str) or model not in ex.probes:
        return {**refused, "status": f"choose one of the live models: {', '.join(_patchable(ex)) or 'none'}"}
    probe = ex.probes[model]
    if probe.spec.residual == "prenorm":
        return {**refused, "status": f"{model} is a PreNorm model: its routing is fixed (every source enters each read "
                                     "with weight 1), so there are no depth weights to patch. Choose a Full or Block "
                                     "AttnRes model."}
    if _fixed(ex, model):
        return {**refused, "status": f"{model}'s depth weights are parameters, the same for every input: the clean and "
                                     "corrupted prompts route alike, so there is nothing to patch. Choose an AttnRes or "
                                     "dynamic mHC model."}
    try:
        clean, corrupted = _check_text(ex, clean, "clean"), _check_text(ex, corrupted, "corrupted")
        with ex._model_lock, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            cells = probe.patch(clean, corrupted, per_source=True)
            rows = probe.patch(clean, corrupted)
            inputs = probe.patch(clean, corrupted, what="input")
    except SamePrediction as exc:
        return {**refused, "status": _same_prediction_message(exc)}
    except (ValueError, TypeError) as exc:
        return {**refused, "status": str(exc)}
    a = rows.attrs
    shown = {k: repr(a.get(f"{k}_text", a.get(k))) for k in ("clean_top", "corrupted_top")}
    last = a["n_tokens"] - 1
    where = (f"at the last token (position {last})" if a["position"] == last else
             f"at position {a['position']}, the last position where the two predictions differ (after the last token "
             "both prompts predict the same)")
    status = (f"{model}, {a['n_tokens']} tokens: {where} the clean prompt predicts {shown['clean_top']} and "
              f"the corrupted one {shown['corrupted_top']}; the metric (logit difference) is {a['metric_clean']:.4g} "
              f"clean and {a['metric_corrupted']:.4g} corrupted.")
    weights = rows.dropna(subset=["recovered"])
    if len(weights):
        top = weights.loc[weights["recovered"].abs().idxmax()]
        status += f" The read whose routing matters most: {top['read_label']} (recovers {top['recovered']:.3g})."
    for w in caught:
        status += f" Note: {w.message}"
    return {"heatmap": patching_heatmap(cells), "bars": patching_bars(rows, inputs), "graphs": SHOWN, "status": status}


def register(app, ex: Explorer) -> None:
    """Bind :func:`patching_view` to ``app`` (only when the section has its controls: a live AttnRes model)."""
    if not _patchable(ex):
        return

    def _patching(n_clicks, model, clean, corrupted):
        return patching_view(ex, n_clicks, model, clean, corrupted)

    app.callback(
        output={"heatmap": Output(PATCH_HEAT, "figure"), "bars": Output(PATCH_BARS, "figure"),
                "graphs": Output(PATCH_GRAPHS, "style"), "status": Output(PATCH_STATUS, "children")},
        inputs=[Input(PATCH_RUN, "n_clicks"), State(PATCH_MODEL, "value"), State(PATCH_CLEAN, "value"),
                State(PATCH_CORRUPT, "value")],
        prevent_initial_call=True,
    )(_patching)
