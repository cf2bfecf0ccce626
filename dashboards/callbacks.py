"""The dashboard's callbacks, as plain functions of an :class:`Explorer` and the inputs' values.

Each function here takes the explorer first and the browser's values after it, validates those
values (they come from the network), reads traces from the explorer's server-side cache, and
returns figures from :mod:`attnres_probe.figures` or plain components. :func:`register` binds
them to one Dash app (``app.callback``, never the global ``dash.callback``), so tests and the
benchmark call the very functions the app runs:

    out = token_views(ex, {"key": ex.initial.key, "token": 3}, "weights", [])
    out["figures"][0]        # the first model's per-token heatmap (a plotly Figure)

Two small pure view changes run in the browser (``assets/dashboard.js``): turning a chip click
or a heatmap click into the selected token, and highlighting the selected chip.
"""

from __future__ import annotations

import functools
import math
import urllib.parse
from typing import Any, Callable

import numpy as np
from dash import ALL, ClientsideFunction, Input, Output, State, html, no_update

from attnres_probe import figures
from attnres_probe.analysis.display import HEADLINE, LABELS, weight_effect_rows
from attnres_probe.analysis.windows import informative_token
from attnres_probe.dashboards import layout as ids
from attnres_probe.dashboards import patching as patching_views
from attnres_probe.dashboards import patterns as pattern_views
from attnres_probe.dashboards.cards import comparison_notes, glance_table, headline_cards, metric_table
from attnres_probe.dashboards.state import Explorer, PromptError, UnknownKeyError, whole_number

__all__ = [
    "CARD_GROUPS",
    "ablation_reads",
    "ablation_view",
    "weight_effect_view",
    "comparison_notes",
    "difference_caption",
    "headline_cards",
    "compare_two",
    "informative_token",
    "jump_to",
    "open_link",
    "read_query",
    "view_query",
    "mean_views",
    "metric_table",
    "metric_cards",
    "profile_views",
    "reading_views",
    "register",
    "run_prompt",
    "source_views",
    "token_strip",
    "token_views",
]

KINDS = ("weights", "contrib", "logits")
SHOWN = {"display": "block"}
HIDDEN = {"display": "none"}
ABLATION_AUTO_LIMIT = 1 << 16  # auto-run an ablation below this many token·source·layer steps; else wait for the button

# the headline groups (locality, embedding retention, gradient uniformity, magnitude growth)
CARD_GROUPS = HEADLINE


# -- helpers ----------------------------------------------------------------------------------
def _kind(kind: Any) -> str:
    return kind if kind in KINDS else "weights"


def _expanded(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and "expanded" in value


def _diff(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and "diff" in value


def _difference(ex: Explorer, result, name: str, kind: str, token: int | None):
    """(figure, note) of model minus the baseline, or (None, why not) when it does not apply."""
    base = ex.baseline
    if base is None or name == base or base not in result.traces:
        return None, ("" if name == base else "no PreNorm baseline loaded: showing the model itself")
    trace, baseline = result.traces[name], result.traces[base]
    if list(trace.read_labels) != list(baseline.read_labels):
        return None, f"{name} and {base} differ in depth: no cell-by-cell difference; showing {name} itself"
    return figures.difference_heatmap(trace, baseline, kind=difference_kind(ex, kind), token=token), ""


def difference_kind(ex: Explorer, kind: str) -> str:
    """What the difference view subtracts: the chosen quantity, or contribution shares against PreNorm,
    which has no routing weights or logits to subtract."""
    return "contrib" if ex.baseline is not None and kind != "contrib" else kind


def _share_logit_range(figs: list) -> None:
    """Give every signed heatmap (logits, contribution shares, differences) the widest symmetric
    range, so panels side by side compare."""
    figs = [f for f in figs if f is not None and f is not no_update and f.data[0].zmin is not None and f.data[0].zmin < 0]
    groups: dict[str, list] = {}  # one range per quantity (differences apart from shares and logits)
    for f in figs:
        groups.setdefault(str(f.data[0].colorbar.title.text), []).append(f)
    for group in groups.values():
        ranges = [abs(float(f.data[0].zmax)) for f in group if np.isfinite(np.asarray(f.data[0].z, dtype=float)).any()]
        if not ranges:
            continue
        z = max(ranges)
        for f in group:
            f.data[0].update(zmin=-z, zmax=z)


def _fmt(value: float) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.2e}"


# -- prompt -----------------------------------------------------------------------------------
def run_prompt(ex: Explorer, n_clicks: Any, text: Any) -> dict:
    """Run the prompt through every model. On error the key is left unchanged (old views stay).

    Returns:
        {"key": new key or no_update, "status": message, "status_class": css class}
    """
    try:
        key = ex.run(text)
    except PromptError as exc:
        return {"key": no_update, "status": str(exc), "status_class": "status error"}
    except Exception as exc:  # a model failing on some text must not break the page
        return {"key": no_update, "status": f"the models failed on this text: {exc}", "status_class": "status error"}
    result = ex.result(key)
    n = result.first.n_tokens
    return {"key": key, "status": f"Ran {n} token{'s' if n != 1 else ''} through {', '.join(result.traces)}.", "status_class": "status ok"}


# -- token strip ------------------------------------------------------------------------------
def token_strip(ex: Explorer, key: Any, search: Any = None) -> dict:
    """The prompt's tokens as chips (html.Button, text as text) and the token selection reset to 0.

    Returns:
        {"chips": [html.Button], "token": {"key", "token"} or no_update, "note": str}
    """
    try:
        result = ex.result(key)
    except UnknownKeyError as exc:
        return {"chips": no_update, "token": no_update, "note": str(exc)}
    toks = result.str_tokens
    start, why = informative_token(result.traces.values())
    linked = linked_token(ex, result, search)
    if linked is not None:
        start, why = linked, f"Opened on token {linked} {toks[linked]!r}, as the link asked."
    else:
        asked = link_problem(ex, result, search)
        why = f"{asked} {why}" if asked else why
    chips = [
        html.Button(t if t else "∅", id={"type": ids.CHIP, "index": i}, className="chip selected" if i == start else "chip",
                    title=f"token {i}: {figures.quote_token(t)}", **({"data-mark": str(i)} if i % 10 == 0 else {}))
        for i, t in enumerate(toks)
    ]
    notes = [why] if why else []
    first = result.first
    if first.tokens.shape[0] > 1:
        notes.append(f"{first.name} holds {first.tokens.shape[0]} sequences; showing sequence 0.")
    lengths = {n: int(t.mask[0].sum()) for n, t in result.traces.items()}
    if len(set(lengths.values())) > 1:
        notes.append("The traces have different lengths: " + ", ".join(f"{n} {k}" for n, k in lengths.items()) + ".")
    missing = [n for n in ex.names if n not in result.traces]
    if missing:
        notes.append(f"Saved traces {', '.join(missing)} belong to the initial text only; they are hidden for this prompt.")
    return {"chips": chips, "token": {"key": result.key, "token": start}, "note": " ".join(notes)}


# -- the view in the address bar, and jumping to a token --------------------------------------------
VIEWS = ("expanded", "diff")


def read_query(search: Any) -> dict:
    """The view a link asks for: ``?token=N&kind=weights|contrib|logits&view=expanded,diff&layer=L&head=H&text=...``
    (layer and head: the attention-pattern view's). Unknown or malformed values are dropped (a link never
    breaks the page)."""
    if not isinstance(search, str) or not search.startswith("?"):
        return {}
    q = urllib.parse.parse_qs(search[1:], keep_blank_values=False)
    out: dict[str, Any] = {}
    token = (q.get("token") or [""])[0]
    if token.isdigit() and len(token) <= 9:
        out["token"] = int(token)
    elif token.startswith("-") and token[1:].isdigit() and len(token) <= 10:
        out["token"] = int(token)  # from the end, as the jump box reads it
    if (q.get("kind") or [None])[0] in KINDS:
        out["kind"] = q["kind"][0]
    if q.get("view"):
        out["view"] = [v for v in q["view"][0].split(",") if v in VIEWS]
    for part in ("layer", "head"):
        value = (q.get(part) or [""])[0]
        if value.isdigit() and len(value) <= 4:
            out[part] = int(value)
    if q.get("text"):
        out["text"] = q["text"][0]
    return out


def view_query(ex: Explorer, token: Any, kind: Any, expanded: Any, layer: Any = None, head: Any = None) -> Any:
    """The query string of the current view (see :func:`read_query`); the text goes in only when it is
    not the page's initial text (a link to the opening view stays short). ``layer``, ``head``: the
    attention-pattern view's dropdowns (left out when not given)."""
    if not isinstance(token, dict):
        return no_update
    pos = whole_number(token.get("token"))
    parts = [("token", str(pos))] if pos is not None else []
    parts.append(("kind", _kind(kind)))
    view = [v for v in VIEWS if isinstance(expanded, list) and v in expanded]
    if view:
        parts.append(("view", ",".join(view)))
    for part, value in (("layer", whole_number(layer)), ("head", whole_number(head))):
        if value is not None and value >= 0:
            parts.append((part, str(value)))
    try:
        result = ex.result(token.get("key"))
    except UnknownKeyError:
        return no_update
    if result.key != ex.initial.key and result.text is not None:
        parts.append(("text", result.text))
    return "?" + urllib.parse.urlencode(parts, quote_via=urllib.parse.quote)


def linked_token(ex: Explorer, result, search: Any) -> int | None:
    """The token a link asks for, if it is about this text and in range: a link with a text names
    that text; one without names the page's initial text."""
    q = read_query(search)
    if "token" not in q:
        return None
    same = result.text == q["text"] if "text" in q else result.key == ex.initial.key
    n = int(result.first.mask[0].sum())
    pos = q["token"] + n if q["token"] < 0 else q["token"]
    return pos if same and 0 <= pos < n else None


def link_problem(ex: Explorer, result, search: Any) -> str:
    """What of a link could not be followed for this text, in words ("" when nothing)."""
    if not isinstance(search, str) or not search.startswith("?") or result.key != ex.initial.key and "text=" not in search:
        return ""
    q = urllib.parse.parse_qs(search[1:])
    said = []
    token = (q.get("token") or [None])[0]
    n = int(result.first.mask[0].sum())
    if token is not None:
        parsed = read_query(search).get("token")
        if parsed is None:
            said.append(f"The link's token {token[:20]!r} is not a position (0..{n - 1}).")
        elif parsed >= n:
            said.append(f"The link's token {parsed} is past this text's last token ({n - 1}).")
    kind = (q.get("kind") or [None])[0]
    if kind is not None and kind not in KINDS:
        said.append(f"The link's colour {kind[:20]!r} is not one of {', '.join(KINDS)}.")
    for part, count in zip(("layer", "head"), pattern_views._options(ex)):
        value = (q.get(part) or [None])[0]
        if value is not None and read_query(search).get(part, count) >= count:
            said.append(f"The link's {part} {value[:20]!r} is not one of this page's {part}s (0..{count - 1}).")
    return " ".join(said)


def open_link(ex: Explorer, search: Any) -> dict:
    """At page load, the view a link asks for: its colour and views, and its text run through every model
    (its token is taken up by :func:`token_strip`)."""
    q = read_query(search)
    out = {"kind": q.get("kind", no_update), "expanded": q.get("view", no_update), "key": no_update,
           "prompt": no_update, "status": no_update, "layer": no_update, "head": no_update, "opened": no_update}
    n_layers, n_heads = pattern_views._options(ex)
    if q.get("layer", n_layers) < n_layers:
        out["layer"] = q["layer"]
    if q.get("head", n_heads) < n_heads:
        out["head"] = q["head"]
    if out["layer"] is not no_update or out["head"] is not no_update:  # named, so the note stays true after a change
        asked = [f"{part} {out[part]}" for part in ("layer", "head") if out[part] is not no_update]
        out["opened"] = f"Opened on {' and '.join(asked)}, as the link asked."
    text = q.get("text")
    if text is not None and ex.live and text != ex.initial.text:
        ran = run_prompt(ex, 1, text)
        out.update(key=ran["key"], status=ran["status"], prompt=text if ran["key"] is not no_update else no_update)
    elif text is not None and not ex.live and text != ex.initial.text:
        out["status"] = "This link names a text, but this dashboard shows saved traces and cannot run it."
    return out


def jump_to(ex: Explorer, value: Any, token: Any) -> dict:
    """The token the jump box names: a position (negative counts from the end) or a text, found in the
    token strings at or after the selected token (wrapping round).

    Returns:
        {"token": the token store or no_update, "note": what was found (or why nothing was)}
    """
    if not isinstance(value, str) or not value.strip() or not isinstance(token, dict):
        return {"token": no_update, "note": ""}
    try:
        result = ex.result(token.get("key"))
    except UnknownKeyError as exc:
        return {"token": no_update, "note": str(exc)}
    toks = [t for t in result.str_tokens]
    n = int(result.first.mask[0].sum())
    toks = toks[:n]
    raw = value.strip()
    pos = int(raw) if raw.lstrip("-").isdigit() and len(raw) <= 10 else None
    if pos is not None:
        if not -n <= pos < n:
            return {"token": no_update, "note": f"no token {pos}: this text has tokens 0..{n - 1} (or -1..-{n})"}
        pos %= n
        return {"token": {"key": result.key, "token": pos}, "note": f"token {pos} '{figures.show_token(toks[pos])}'"}
    needle = value if value.strip() != value and value.strip() else raw
    starts, at = [], 0
    for t in toks:
        starts.append(at)
        at += len(t)
    text = "".join(toks)
    here = whole_number(token.get("token")) or 0
    begin = starts[here] + 1 if 0 <= here < n else 0
    hit = text.find(needle, begin)
    if hit < 0:
        hit = text.find(needle)
    if hit < 0:
        return {"token": no_update, "note": f"{needle!r} is not in this text"}
    pos = max(i for i, s0 in enumerate(starts) if s0 <= hit)
    count = text.count(needle)
    return {"token": {"key": result.key, "token": pos},
            "note": f"token {pos} '{figures.show_token(toks[pos])}'"
            + (f" (1 of {count} matches: press Enter again for the next)" if count > 1 else "")}


# -- per-token views --------------------------------------------------------------------------
def token_views(ex: Explorer, token: Any, kind: Any, expanded: Any) -> dict:
    """Per-token depth heatmap of every model for the selected token.

    Args:
        token: the token store, {"key": result key, "token": position in sequence 0}.
        kind: "weights" | "contrib" | "logits".
        expanded: the checklist value (contains "expanded" for the expanded sublayer view).

    Returns:
        {"figures": [Figure or no_update per model], "panels": [style per model],
         "notes": [str per model], "info": components describing the token}
    """
    n = len(ex.names)
    keep = {"figures": [no_update] * n, "panels": [no_update] * n, "notes": [no_update] * n, "caption": no_update}
    if not isinstance(token, dict):
        return {**keep, "info": no_update}
    try:
        result = ex.result(token.get("key"))
    except UnknownKeyError as exc:
        return {**keep, "info": str(exc)}
    pos = whole_number(token.get("token"))
    n_first = int(result.first.mask[0].sum())
    if pos is None or not 0 <= pos < n_first:
        return {**keep, "info": f"token {token.get('token')!r} is out of range; this text has tokens 0..{n_first - 1}"}
    kind, diff, expanded = _kind(kind), _diff(expanded), _expanded(expanded)
    figs, panels, notes = [], [], []
    first = result.first
    for name in ex.names:
        trace = result.traces.get(name)
        if trace is None:
            figs.append(no_update), panels.append(HIDDEN), notes.append("")
            continue
        n_tok = int(trace.mask[0].sum())
        if pos >= n_tok:
            figs.append(no_update), panels.append(SHOWN)
            notes.append(f"{name} has only {n_tok} tokens")
            continue
        note = ""
        if trace is not first and _other_text(trace, first):
            note = f"{name} holds another text: its token {pos} is {trace.str_tokens[0][pos]!r} (the chips show {first.name}'s)."
        fig = None
        if diff:
            fig, why = _difference(ex, result, name, kind, pos)
            note = " ".join(x for x in (note, why) if x)
        if fig is None:  # the first screen: one title line; the panel names the model
            fig = figures.compact(figures.token_heatmap(trace, token=pos, kind=kind, expanded=expanded))
        # a difference keeps its title's lines ("model − baseline", the token, the quantity): one line is cut
        figs.append(fig)
        panels.append(SHOWN)
        notes.append(note)
    _share_logit_range(figs)
    return {"figures": figs, "panels": panels, "notes": notes, "info": _token_info(ex, result, pos),
            "caption": difference_caption(ex, kind) if diff else ""}


def difference_caption(ex: Explorer, kind: str) -> str:
    """The caption of the per-token difference view: what is subtracted from what, and how to read the colours."""
    base = ex.baseline
    if base is None:
        return "Difference view: no PreNorm baseline is loaded, so every panel shows the model itself."
    shown = difference_kind(ex, kind)
    why = (f" {base} has no routing {'weights' if kind == 'weights' else 'logits'} (its coefficients are all one), so the "
           "difference is in contribution shares whatever the colour choice." if shown != kind else "")
    return (f"Difference view: each other panel is that model minus {base}, cell by cell, for the selected token "
            f"(difference in {figures.KIND_TITLES[shown]}, on one source axis: Block's blocks where Block is drawn, else sublayers).{why} "
            f"Blue is negative (the model is lower "
            f"there than {base}), red positive (higher), white the same; the {base} panel shows {base} itself.")


def _other_text(trace, first) -> bool:
    """True when ``trace`` holds other tokens than ``first`` (saved traces of different texts)."""
    a, b = trace.tokens[0][trace.mask[0]], first.tokens[0][first.mask[0]]
    return a.shape != b.shape or bool((a != b).any())


def _token_info(ex: Explorer, result, pos: int) -> list:
    first = result.first
    tok = first.str_tokens[0][pos]
    parts: list = [html.Span(f"token {pos} of {int(first.mask[0].sum())}: "), html.Code(tok, className="tok"),
                   html.Span(f" (id {int(first.tokens[0, pos])}) · next-token loss (nats): ")]
    for name, trace in result.traces.items():
        loss = float(trace.loss[0, pos]) if pos < trace.loss.shape[1] else float("nan")
        parts.append(html.Span(f"{name} {_fmt(loss)}", style={"color": ex.colors[name]}, className="loss"))
    return parts


# -- reading the residual stream at the selected token ---------------------------------------
LENS_K = 5


def reading_views(ex: Explorer, token: Any) -> dict:
    """Direct logit contributions and the logit lens (one forward: Probe.token_readings)
    of every live model at the selected token; a saved trace gets a note instead (it holds no activations).

    Returns:
        {"decomp": [Figure], "lens": [Figure], "decomp_graphs": [style], "lens_graphs": [style],
         "panels": [style], "notes": [str]} per model.
    """
    import torch

    n = len(ex.names)
    keep = {k: [no_update] * n for k in ("decomp", "lens", "decomp_graphs", "lens_graphs", "panels", "notes")}
    if not isinstance(token, dict):
        return keep
    try:
        result = ex.result(token.get("key"))
    except UnknownKeyError as exc:
        return {**keep, "notes": [str(exc)] * n}
    pos = whole_number(token.get("token"))
    out = {k: [] for k in keep}
    for name in ex.names:
        trace = result.traces.get(name)
        add = lambda d, l, dg, lg, p, note: [out[k].append(v) for k, v in zip(out, (d, l, dg, lg, p, note))]  # noqa: E731
        if trace is None:
            add(no_update, no_update, HIDDEN, HIDDEN, HIDDEN, "")
            continue
        if name not in ex.probes:
            add(no_update, no_update, HIDDEN, HIDDEN, SHOWN, f"{name}: {figures.NO_ACTIVATIONS_NOTE}")
            continue
        n_tok = int(trace.mask[0].sum())
        if pos is None or not 0 <= pos < n_tok:
            add(no_update, no_update, HIDDEN, HIDDEN, SHOWN, f"{name} has no token {token.get('token')!r} (0..{n_tok - 1})")
            continue
        probe = ex.probes[name]
        # causal: the logits and reads at pos see tokens 0..pos only (one more names the token that follows)
        tokens = torch.from_numpy(np.ascontiguousarray(trace.tokens[:1, : min(n_tok, pos + 2)])).long()
        try:
            with ex._model_lock:
                (lc,), lens = probe.token_readings(tokens, positions=[pos], k=LENS_K)
        except Exception as exc:  # a model that cannot be read this way must not break the page
            add(no_update, no_update, HIDDEN, HIDDEN, SHOWN, f"{name}: cannot read the residual stream ({exc})")
            continue
        tok = trace.str_tokens[0][pos] if pos < len(trace.str_tokens[0]) else None
        add(figures.logit_contributions_chart(lc, k=LENS_K, name=name), figures.logit_lens_chart(lens, pos, name=name, token=tok),
            SHOWN, SHOWN, SHOWN, "")
    _share_logit_range(out["decomp"])  # one colour range for the models side by side (#35 item 4)
    return out


# -- whole-text views -------------------------------------------------------------------------
def mean_views(ex: Explorer, key: Any, kind: Any, expanded: Any) -> dict:
    """Mean heatmap over tokens of every model. Returns {"figures": [...], "panels": [...]}."""
    n = len(ex.names)
    try:
        result = ex.result(key)
    except UnknownKeyError:
        return {"figures": [no_update] * n, "panels": [no_update] * n}
    kind, diff, expanded = _kind(kind), _diff(expanded), _expanded(expanded)
    figs, panels = [], []
    for name in ex.names:
        trace = result.traces.get(name)
        fig = _difference(ex, result, name, kind, None)[0] if diff and trace is not None else None
        if fig is None and trace is not None:
            fig = figures.mean_heatmap(trace, kind=kind, expanded=expanded)
        figs.append(no_update if trace is None else fig)
        panels.append(HIDDEN if trace is None else SHOWN)
    _share_logit_range(figs)
    return {"figures": figs, "panels": panels}


def source_views(ex: Explorer, key: Any, source: Any, kind: Any) -> dict:
    """Token × read heatmap of one source for every model that has it.

    Returns:
        {"figures": [...], "graphs": [graph style], "panels": [panel style], "notes": [str]}
    """
    n = len(ex.names)
    try:
        result = ex.result(key)
    except UnknownKeyError as exc:
        return {"figures": [no_update] * n, "graphs": [no_update] * n, "panels": [no_update] * n, "notes": [str(exc)] * n}
    kind = _kind(kind)
    options = ex.source_options()
    source = source if source in options else options[0]
    figs, graphs, panels, notes = [], [], [], []
    for name in ex.names:
        trace = result.traces.get(name)
        if trace is None:
            figs.append(no_update), graphs.append(no_update), panels.append(HIDDEN), notes.append("")
        elif source not in trace.source_labels:
            figs.append(no_update), graphs.append(HIDDEN), panels.append(SHOWN)
            notes.append(f"{name} has no source {source!r}; its sources are {', '.join(trace.source_labels)}.")
        else:
            figs.append(figures.source_heatmap(trace, source=source, kind=kind))
            graphs.append(SHOWN), panels.append(SHOWN), notes.append("")
    _share_logit_range(figs)
    return {"figures": figs, "graphs": graphs, "panels": panels, "notes": notes}


def profile_views(ex: Explorer, key: Any) -> dict:
    """Magnitudes and gradient norms by depth, every model in one chart each."""
    try:
        traces = list(ex.traces(key).values())
    except UnknownKeyError:
        return {"magnitudes": no_update, "gradients": no_update}
    return {"magnitudes": figures.magnitudes(traces), "gradients": figures.gradient_norms(traces)}


def glance_for_text(ex: Explorer, key: Any) -> Any:
    """The first screen's headline table for the current text (no corpus or study loaded)."""
    try:
        result = ex.result(key)
    except UnknownKeyError as exc:
        return html.P(str(exc), className="status error")
    if len(result.traces) < 2 and not any(t.residual != "prenorm" for t in result.traces.values()):
        return html.P("Load an AttnRes model beside the baseline to compare them.", className="help")
    return glance_table(result.compared())


def metric_cards(ex: Explorer, key: Any) -> list:
    """The headline cards for the current text: each AttnRes model against the baseline (one window: no intervals)."""
    try:
        result = ex.result(key)
    except UnknownKeyError as exc:
        return [html.P(str(exc), className="status error")]
    frame = result.compared()
    return [*comparison_notes(frame), *headline_cards(frame, ex.colors)]


# -- ablation ---------------------------------------------------------------------------------
def ablation_reads(ex: Explorer, model: Any) -> dict:
    """Read options of the chosen model (reads with more than one source); 'final' selected."""
    if model not in ex.attnres_probes:
        return {"options": no_update, "value": no_update}
    reads = ex.read_options(model)
    return {"options": [{"label": r, "value": r} for r in reads], "value": reads[-1]}


def ablation_view(ex: Explorer, n_clicks: Any, key: Any, model: Any, read: Any, mode: Any, pressed: bool = True) -> dict:
    """Δloss per source at one read of one model, beside its routing mass (figures.ablation_chart).

    Args:
        pressed: the Run button triggered the call; otherwise a costly ablation (long text, deep
            model) waits for the button.

    Returns:
        {"figure": Figure or no_update, "status": message}
    """
    try:
        result = ex.result(key)
        if model not in ex.attnres_probes:
            raise PromptError(f"choose one of {ex.attnres_probes}")
        trace = result.traces[model]
        k = int(np.isfinite(trace.weights(read=read).to_numpy()).sum()) if read in trace.read_labels else 0
        cost = trace.n_tokens * max(k, 1) * len(trace.sublayer_labels)
        if not pressed and cost > ABLATION_AUTO_LIMIT:
            return {"figure": figures.ablation_chart(_empty_ablation()),
                    "status": f"Press 'Run ablation': it takes {k + 1} forward passes of {trace.n_tokens} tokens."}
        frame = ex.ablate(key, model, read, mode)
    except (PromptError, UnknownKeyError) as exc:
        return {"figure": no_update, "status": str(exc)}
    top = frame.loc[frame["delta_loss"].idxmax()] if len(frame) else None
    status = "" if top is None else (
        f"{model} · read {read} · mode {mode}: base loss {_fmt(float(top['base_loss']))}; removing {top['source']} "
        f"costs most (Δloss {float(top['delta_loss']):+.3g})."
    )
    return {"figure": figures.ablation_chart(frame, read=read), "status": status}


WEIGHT_EFFECT_HEADER = ("model", "deep reads", "embedding weight", "its uniform share", "embedding Δloss", "recent weight",
                        "its uniform share", "recent Δloss", "rank correlation")
WEIGHT_EFFECT_KEYS = ("model", "reads", "embed_weight", "uniform", "embed_delta", "recent_weight", "recent_uniform",
                      "recent_delta", "rank_correlation")


def weight_effect_view(ex: Explorer, n_clicks: Any, key: Any, pressed: bool = True) -> dict:
    """Weight beside effect of every live model on the current text, on the button (it costs one
    forward pass per source of every deep read): a summary table and the chart. A new text
    (``pressed`` False) clears the last one's results.

    Returns:
        {"table": children, "figure": Figure or no_update, "graph_style": style, "status": message}
    """
    if not pressed or not n_clicks:
        return {"table": [], "figure": no_update, "graph_style": {"display": "none"},
                "status": "Press the button to measure it on the current text."}
    try:
        effects = ex.weight_effect(key)
    except (PromptError, UnknownKeyError) as exc:
        return {"table": [], "figure": no_update, "graph_style": {"display": "none"}, "status": str(exc)}
    rows = weight_effect_rows(effects)
    keys = WEIGHT_EFFECT_KEYS
    table = html.Table([html.Thead(html.Tr([html.Th(h) for h in WEIGHT_EFFECT_HEADER])),
                        html.Tbody([html.Tr([html.Td(r[k], className="num" if k != "model" else "model") for k in keys])
                                    for r in rows])], className="metric-table weight-effect-table")
    note = html.P("Weights are normalised weights (fraction of the read, 0-1), each beside its share under the uniform "
                  "reference on the model's own axis (a block counts its sublayers); Δloss in nats per token; means over "
                  "the deep reads.", className="help")
    return {"table": [table, note], "figure": figures.weight_effect_chart(effects, ex.colors), "graph_style": {},
            "status": f"measured on {next(iter(ex.result(key).traces.values())).n_tokens} tokens."}


# -- two texts or two checkpoints ----------------------------------------------------------------------
COMPARED = ("locality_distance", "locality_recent_mass", "embed_weight_deep", "embed_contrib_deep", "mean_loss")


def compare_two(ex: Explorer, n_clicks: Any, key: Any, a: Any, b: Any, text_b: Any, kind: Any) -> dict:
    """Model ``a`` on the page's text against model ``b`` on ``text_b`` (empty: the same text): the
    difference of their mean routing (:func:`figures.difference_heatmap`, A − B on one source axis) and
    their routing diagnostics side by side, each beside its uniform reference.

    Returns:
        {"figure": Figure or no_update, "graph": style, "table": component, "status": str}
    """
    from attnres_probe.analysis.catalog import CATALOG
    from attnres_probe.analysis.windows import pooled_metrics, reference_column

    keep = {"figure": no_update, "graph": no_update, "table": no_update, "status": ""}
    if not n_clicks:
        return {**keep, "status": "Choose A and B (and a text B) and press Compare."}
    if a not in ex.names or b not in ex.names:
        return {**keep, "status": f"choose A and B among {', '.join(ex.names)}"}
    try:
        result_a = ex.result(key)
        text_b = text_b if isinstance(text_b, str) else ""
        key_b = ex.run(text_b) if text_b.strip() else result_a.key
        result_b = ex.result(key_b)
    except (PromptError, UnknownKeyError) as exc:
        return {**keep, "status": f"text B: {exc}"}
    ta, tb = result_a.traces.get(a), result_b.traces.get(b)
    if ta is None or tb is None:
        return {**keep, "status": "a saved trace holds its own text only: compare it on that text (leave text B empty)"}
    kind = "contrib" if _kind(kind) == "logits" else _kind(kind)
    same_text = result_a.key == result_b.key
    la, lb = f"{a}" + ("" if same_text else " (text A)"), f"{b}" + ("" if same_text else " (text B)")
    cleared = {"figure": no_update, "graph": HIDDEN, "table": None}
    if kind == "weights" and "prenorm" in (ta.residual, tb.residual):
        return {**cleared, "status": "PreNorm's weights are its implied uniform weights 1/k, the reference every routing "
                                     "number is already set against: choose colour by 'contribution share' to compare "
                                     "PreNorm with another model."}
    try:
        fig = figures.difference_heatmap(ta, tb, kind=kind)
    except ValueError as exc:
        return {**cleared, "status": str(exc)}
    fig.update_layout(title={"text": f"{html_text(la)} − {html_text(lb)}: mean {figures.shared_title([ta, tb], kind)}"})
    va, vb = pooled_metrics(ta), pooled_metrics(tb)
    # routing diagnostics are on each model's own source axis (Block's in blocks): A − B only on one axis
    one_axis = ta.residual == tb.residual and list(ta.block_starts or []) == list(tb.block_starts or []) or \
        "block" not in (ta.residual, tb.residual)
    rows = [html.Tr([html.Th("diagnostic"), html.Th("unit"), html.Th(la), html.Th(lb), html.Th("A − B")])]
    for name in COMPARED:
        if name not in va or name not in vb:
            continue
        x, y = float(va[name]), float(vb[name])
        ref = reference_column(name)
        refs = [f" (uniform {_fmt(float(v[ref]))})" if ref in v else "" for v in (va, vb)]
        routing = CATALOG[name].reference == "uniform"
        diff = _fmt(x - y) if one_axis or not routing else "— (other axes: compare each with its uniform)"
        rows.append(html.Tr([html.Td(LABELS.get(name, name), className="metric-name"),
                             html.Td(CATALOG[name].unit, className="unit"),
                             html.Td(_fmt(x) + refs[0], className="num"), html.Td(_fmt(y) + refs[1], className="num"),
                             html.Td(diff, className="num")], **{"data-metric": name}))
    what = "the same text" if same_text else f"text A ({ta.n_tokens} tokens) and text B ({tb.n_tokens} tokens)"
    return {"figure": fig, "graph": SHOWN, "table": html.Table(rows, className="metric-table compare-table"),
            "status": f"{a} against {b} on {what}: one window each, so no interval."}


def html_text(s: str) -> str:
    """A name put into a plotly title as text (plotly titles read a little HTML)."""
    import html as _html

    return _html.escape(s)


def _empty_ablation():
    import pandas as pd

    return pd.DataFrame(columns=list(figures.ABLATION_COLUMNS))


# -- registration -----------------------------------------------------------------------------
def _bind(fn: Callable, ex: Explorer) -> Callable:
    @functools.wraps(fn)
    def bound(*args):
        return fn(ex, *args)

    return bound


def _per_model(view: str, part: str, prop: str, n: int) -> list[Output]:
    return [Output(ids.panel_id(view, part, i), prop) for i in range(n)]


def register(app, ex: Explorer) -> None:
    """Register every callback of the dashboard on ``app`` (bound to ``ex``)."""
    n = len(ex.names)
    if ex.live:
        def _weight_effect(n_clicks, key):
            from dash import ctx

            return weight_effect_view(ex, n_clicks, key, pressed=ctx.triggered_id == ids.WE_RUN)

        app.callback(
            output={"key": Output(ids.KEY, "data"), "status": Output(ids.PROMPT_STATUS, "children"),
                    "status_class": Output(ids.PROMPT_STATUS, "className")},
            inputs=[Input(ids.RUN, "n_clicks"), State(ids.PROMPT, "value")],
            prevent_initial_call=True,
        )(_bind(run_prompt, ex))
    app.callback(
        output={"chips": Output(ids.STRIP, "children"), "token": Output(ids.TOKEN, "data"), "note": Output(ids.STRIP_NOTE, "children")},
        inputs=[Input(ids.KEY, "data"), Input(ids.URL, "search")],
    )(_bind(token_strip, ex))
    # a shared link: its view at load; the view, as it changes, back into the address bar
    link_out = {"kind": Output(ids.KIND, "value"), "expanded": Output(ids.EXPANDED, "value"),
                "status": Output(ids.PROMPT_STATUS, "children", allow_duplicate=True),
                "layer": Output(pattern_views.PATTERN_LAYER, "value"), "head": Output(pattern_views.PATTERN_HEAD, "value"),
                "opened": Output(pattern_views.PATTERN_OPENED, "children")}
    if ex.live:
        link_out.update(key=Output(ids.KEY, "data", allow_duplicate=True), prompt=Output(ids.PROMPT, "value"))

    def _open_link(search):
        out = open_link(ex, search)
        return {k: out[k] for k in link_out}

    app.callback(output=link_out, inputs=[Input(ids.URL, "search")], prevent_initial_call="initial_duplicate")(_open_link)
    app.callback(Output(ids.QUERY, "data"), [Input(ids.TOKEN, "data"), Input(ids.KIND, "value"), Input(ids.EXPANDED, "value"),
                                             Input(pattern_views.PATTERN_LAYER, "value"),
                                             Input(pattern_views.PATTERN_HEAD, "value")],
                 )(_bind(view_query, ex))
    app.clientside_callback(ClientsideFunction("attnres", "mark_source_token"), Output(ids.SOURCE_MARKED, "data"),
                            [Input(ids.TOKEN, "data")] + [Input(ids.panel_id("source", "graph", i), "figure") for i in range(n)],
                            prevent_initial_call=True)
    app.clientside_callback(ClientsideFunction("attnres", "show_query"), Output(ids.QUERY_SHOWN, "data"), Input(ids.QUERY, "data"),
                            prevent_initial_call=True)
    app.callback(output={"token": Output(ids.TOKEN, "data", allow_duplicate=True), "note": Output(ids.JUMP_NOTE, "children")},
                 inputs=[Input(ids.JUMP, "value"), Input(ids.JUMP, "n_submit"), State(ids.TOKEN, "data")],
                 prevent_initial_call=True)(lambda value, _n, token: jump_to(ex, value, token))
    app.callback(
        output={"figures": _per_model("token", "graph", "figure", n), "panels": _per_model("token", "panel", "style", n),
                "notes": _per_model("token", "note", "children", n), "info": Output(ids.TOKEN_INFO, "children"),
                "caption": Output(ids.TOKEN_DIFF_NOTE, "children")},
        inputs=[Input(ids.TOKEN, "data"), Input(ids.KIND, "value"), Input(ids.EXPANDED, "value")],
    )(_bind(token_views, ex))
    app.callback(
        output={"decomp": _per_model("decomp", "graph", "figure", n), "lens": _per_model("lens", "graph", "figure", n),
                "decomp_graphs": _per_model("decomp", "graph", "style", n), "lens_graphs": _per_model("lens", "graph", "style", n),
                "panels": _per_model("decomp", "panel", "style", n), "notes": _per_model("decomp", "note", "children", n)},
        inputs=[Input(ids.TOKEN, "data")],
    )(_bind(reading_views, ex))
    app.callback(
        output={"figures": _per_model("mean", "graph", "figure", n), "panels": _per_model("mean", "panel", "style", n)},
        inputs=[Input(ids.KEY, "data"), Input(ids.KIND, "value"), Input(ids.EXPANDED, "value")],
    )(_bind(mean_views, ex))
    app.callback(
        output={"figures": _per_model("source", "graph", "figure", n), "graphs": _per_model("source", "graph", "style", n),
                "panels": _per_model("source", "panel", "style", n), "notes": _per_model("source", "note", "children", n)},
        inputs=[Input(ids.KEY, "data"), Input(ids.SOURCE, "value"), Input(ids.KIND, "value")],
    )(_bind(source_views, ex))
    app.callback(
        output={"magnitudes": Output(ids.MAGNITUDES, "figure"), "gradients": Output(ids.GRADIENTS, "figure")},
        inputs=[Input(ids.KEY, "data")],
    )(_bind(profile_views, ex))
    app.callback(Output(ids.CARDS, "children"), Input(ids.KEY, "data"))(_bind(metric_cards, ex))
    if not ex.stats and not (getattr(ex, "study", None) and ex.study.get("primaries")):
        app.callback(Output(ids.GLANCE, "children"), Input(ids.KEY, "data"))(_bind(glance_for_text, ex))
    if ex.attnres_probes:
        app.callback(
            output={"options": Output(ids.ABL_READ, "options"), "value": Output(ids.ABL_READ, "value")},
            inputs=[Input(ids.ABL_MODEL, "value")],
            prevent_initial_call=True,
        )(_bind(ablation_reads, ex))

        def _ablation(n_clicks, key, model, read, mode):
            from dash import ctx

            pressed = ctx.triggered_id == ids.ABL_RUN
            return ablation_view(ex, n_clicks, key, model, read, mode, pressed=pressed)

        app.callback(
            output={"figure": Output(ids.ABL_GRAPH, "figure"), "status": Output(ids.ABL_STATUS, "children")},
            inputs=[Input(ids.ABL_RUN, "n_clicks"), Input(ids.KEY, "data"), Input(ids.ABL_MODEL, "value"),
                    Input(ids.ABL_READ, "value"), Input(ids.ABL_MODE, "value")],
        )(_ablation)
    if ex.live:
        app.callback(
            output={"table": Output(ids.WE_TABLE, "children"), "figure": Output(ids.WE_GRAPH, "figure"),
                    "graph_style": Output(ids.WE_GRAPH, "style"), "status": Output(ids.WE_STATUS, "children")},
            inputs=[Input(ids.WE_RUN, "n_clicks"), Input(ids.KEY, "data")],
        )(_weight_effect)
    app.callback(
        output={"figure": Output(ids.TWO_GRAPH, "figure"), "graph": Output(ids.TWO_GRAPH, "style"),
                "table": Output(ids.TWO_TABLE, "children"), "status": Output(ids.TWO_STATUS, "children")},
        inputs=[Input(ids.TWO_RUN, "n_clicks"), State(ids.KEY, "data"), State(ids.TWO_A, "value"), State(ids.TWO_B, "value"),
                State(ids.TWO_TEXT, "value"), State(ids.TWO_KIND, "value")],
    )(_bind(compare_two, ex))
    patching_views.register(app, ex)  # routing patching of two prompts (dashboards/patching.py)
    pattern_views.register(app, ex)  # attention pattern at the selected token (dashboards/patterns.py)
    # browser-side: a chip click or a click on a one-source heatmap selects a token; the chip is highlighted
    app.clientside_callback(
        ClientsideFunction("attnres", "pick_token"),
        Output(ids.TOKEN, "data", allow_duplicate=True),
        [Input({"type": ids.CHIP, "index": ALL}, "n_clicks")]
        + [Input(ids.panel_id("source", "graph", i), "clickData") for i in range(n)],
        State(ids.TOKEN, "data"),
        prevent_initial_call=True,
    )
    app.clientside_callback(
        ClientsideFunction("attnres", "mark_chips"),
        Output({"type": ids.CHIP, "index": ALL}, "className"),
        Input(ids.TOKEN, "data"),
        State({"type": ids.CHIP, "index": ALL}, "id"),
    )
