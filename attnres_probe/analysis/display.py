"""Words and numbers for the comparisons, shared by the dashboard, the report and the study.

Everything here formats rows of the frame :func:`attnres_probe.metrics.compare` returns; no
number or verdict is computed here, so every page shows the same strings.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import pandas as pd

from attnres_probe.analysis.bootstrap import FEW_DOCUMENTS
from attnres_probe.analysis.catalog import CATALOG, LiveMapping
from attnres_probe.analysis.verdicts import EXPECTED
from attnres_probe.axis import ATTNRES_RULES

__all__ = [
    "BASIS_NOTE",
    "HEADLINE",
    "LABELS",
    "basis_caveat",
    "comparison_rows",
    "documents_warning",
    "page_warnings",
    "shape_warning",
    "verdict_scope_note",
    "fmt_estimate",
    "fmt_interval",
    "fmt_number",
    "group_rows",
    "headline",
    "held_text",
    "metric_group",
    "no_interval_reason",
    "readable",
    "interval_text",
    "table_rows",
    "reference_text",
    "unit_text",
    "weight_effect_rows",
]

# said once wherever comparisons are shown
BASIS_NOTE = (
    "Every comparison sets the same quantity, in the same unit, on the same axis. Routing numbers are normalised "
    "weights (each source's share of what the read mixes) on the model's own source axis, Block's in blocks; PreNorm's "
    "are its implied weights, uniform over what a read sees. Each AttnRes model's routing is compared with the uniform "
    "reference on its own axis, which is PreNorm's implied weights grouped the same way; the embedding's share c₀, "
    "the magnitudes, gradients and loss are compared with the PreNorm baseline's same quantity."
)
CAVEAT = "weights vs shares: different quantities"  # no comparison is marked so any more (basis_caveat)

# the headline panel: the comparisons the toolkit exists for
HEADLINE: list[tuple[str, str, list[str]]] = [
    ("Locality", "How far back in depth the reads look, against uniform weights on the same sources.",
     ["locality_distance", "locality_recent_mass"]),
    ("Embedding retention", "How much the deep reads still take from the embedding.", ["embed_weight_deep", "embed_contrib_deep"]),
    ("Gradient uniformity", "Spread of gradient norms over depth (0 = even).", ["act_grad_cv", "param_grad_cv"]),
    ("Magnitude growth", "What the sublayers write: RMS of their outputs, last quarter over first.", ["rms_out_growth"]),
]
LABELS: Mapping[str, str] = LiveMapping(lambda: {name: d.label for name, d in CATALOG.items()})  # the catalog's, live


def _finite(x: Any) -> bool:
    try:
        return x is not None and x is not pd.NA and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


ROUNDOFF = 1e-12  # every diagnostic is of order 1e-3 or more: a smaller magnitude is float roundoff of 0


def _clean(x: Any) -> float:
    """``x`` as a float, with float roundoff of zero (below :data:`ROUNDOFF`) shown as 0."""
    v = float(x)
    return 0.0 if abs(v) < ROUNDOFF else v


def fmt_number(x: Any, digits: int = 4) -> str:
    """A number to ``digits`` significant digits; "—" when missing."""
    return f"{_clean(x):.{digits}g}" if _finite(x) else "—"


def fmt_estimate(row: pd.Series | dict, digits: int = 3) -> str:
    """The row's estimate: "0.123" (value), "+0.0123" (difference), "×0.93" (ratio); the pooled
    number when there is no per-window estimate (marked "pooled")."""
    est, kind = row["estimate"], row["comparison"]
    pooled = not _finite(est) and _finite(row["pooled"])
    x = row["pooled"] if pooled else est
    if not _finite(x):
        return "—"
    x = _clean(x)
    text = f"×{x:.{digits}g}" if kind == "ratio" else (f"{x:+.{digits}g}" if kind == "difference" else f"{x:.{digits + 1}g}")
    return f"{text} (pooled)" if pooled else text


FIXED = "no interval: fixed coefficients, the same in every window"


def _fixed(row: pd.Series | dict) -> bool:
    """Whether the row's windows all share one value because the model's weights do not depend on the
    input (DenseFormer's coefficients): its zero-width interval is no evidence, so none is shown."""
    from attnres_probe.analysis.compare import CONSTANT

    # only where an interval would be shown: without one (one window, one document) the usual reason stands
    return CONSTANT in str(row.get("note") or "") and _finite(row.get("low")) and _finite(row.get("high"))


def fmt_interval(row: pd.Series | dict, digits: int = 3) -> str:
    """"[low, high]" (with × for ratios), or "" when there is no interval (or only the zero-width
    one of fixed coefficients)."""
    lo, hi = row["low"], row["high"]
    if not (_finite(lo) and _finite(hi)) or _fixed(row):
        return ""
    lo, hi = _clean(lo), _clean(hi)
    if row["comparison"] == "ratio":
        return f"[×{float(lo):.{digits}g}, ×{float(hi):.{digits}g}]"
    if row["comparison"] == "difference":
        return f"[{float(lo):+.{digits}g}, {float(hi):+.{digits}g}]"
    return f"[{float(lo):.{digits + 1}g}, {float(hi):.{digits + 1}g}]"


def interval_text(row: pd.Series | dict, level: float = 0.95, said: str = "") -> str:
    """The interval with its level ("95% CI [0.85, 1.02]"), or in words why there is none; "" when
    that reason is ``said`` (the page says it once, :func:`no_interval_reason`)."""
    iv = fmt_interval(row)
    if iv:
        return f"{level:.0%} CI {iv}"
    reason = _reason(row)
    if said and reason.startswith(said):
        return ""
    return reason or "no interval"


def _reason(row: pd.Series | dict) -> str:
    if _fixed(row):
        return FIXED
    note = str(row.get("note") or "")
    return next((p for p in note.split("; ") if p.startswith(("no interval", "pooled", "not available", "no windows", "PreNorm"))), "")


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The frame's rows as dicts (formatting reads rows one by one: dicts are much faster than Series)."""
    return frame.to_dict("records")


def no_interval_reason(frame: pd.DataFrame | list[dict]) -> str:
    """"no interval: 1 window" or "no interval: 1 document" when no value of the frame has an
    interval for that one reason, for every model; else "". A page says it once instead of in
    every cell (:func:`interval_text` leaves out a reason that starts with it)."""
    rows = _records(frame) if isinstance(frame, pd.DataFrame) else frame
    vals = [r for r in rows if r["comparison"] == "value"]
    if not vals or any(_finite(r["low"]) and _finite(r["high"]) for r in vals):
        return ""
    reasons = [r for r in (_reason(row) for row in vals) if r.startswith("no interval")]
    for prefix in ("no interval: 1 window", "no interval: 1 document"):
        if reasons and all(r.startswith(prefix) for r in reasons):
            return prefix
    return ""


def documents_warning(frame: pd.DataFrame) -> str:
    """A sentence for the top of a page when the intervals rest on few documents ("" otherwise).

    The bootstrap resamples documents (their windows are alike), so the number of documents, not of
    windows, is what an interval rests on: below :data:`FEW_DOCUMENTS` they are rough."""
    docs = {str(k): int(v) for k, v in (frame.attrs.get("documents") or {}).items()}
    vals = frame[frame["comparison"] == "value"]
    if not docs or vals.empty or int(vals["windows"].max()) <= 1:
        return ""  # one window: the page's one-window note says it
    n = min(docs.values())
    each = "" if len(set(docs.values())) == 1 else " (" + ", ".join(f"{k}: {v}" for k, v in docs.items()) + ")"
    if n == 1:
        return (f"Only 1 document{each}: windows of one text are alike, so they are resampled together and there is "
                "no interval; every verdict is inconclusive. Record several documents (attnres-probe corpus) for intervals.")
    if n < FEW_DOCUMENTS:
        return (f"Only {n} documents{each}: intervals are rough. The bootstrap resamples whole documents (windows of "
                f"one document are alike), so every interval rests on {n} documents (fewer independent texts where a corpus holds a text "
                f"twice); {FEW_DOCUMENTS} or more "
                "give firmer ones.")
    return ""


def shape_warning(frame: pd.DataFrame) -> str:
    """A sentence for the top of a page when the compared models differ in more than the residual
    rule (depth, width, context...): their differences are then not the rule's alone ("" otherwise)."""
    return str(frame.attrs.get("shape") or "")


def verdict_scope_note(frame: pd.DataFrame) -> str:
    """Why some rows carry no verdict: "" unless the frame holds a model of a rule other than AttnRes
    and PreNorm (mHC, DenseFormer), whose comparisons are estimates and intervals only."""
    others = [n for n, r in (frame.attrs.get("residuals") or {}).items() if r not in ATTNRES_RULES and r != "prenorm"]
    if not others:
        return ""
    return (f"The paper's directions are claims about AttnRes: {', '.join(others)} "
            f"{'is' if len(others) == 1 else 'are'} set against the same references with estimates and intervals, "
            "and no verdict.")


def page_warnings(frame: pd.DataFrame) -> list[str]:
    """What a page says once above a comparison: models of different shapes, too few documents."""
    return [w for w in (shape_warning(frame), documents_warning(frame)) if w]


def basis_caveat(row: pd.Series | dict) -> str:
    """"weights vs shares: different quantities" for a comparison of AttnRes's routing weights with
    PreNorm's contribution shares (the frame's ``basis``); else ""."""
    b = str(row.get("basis") or "")
    return CAVEAT if row.get("comparison") != "value" and " vs " in b else ""


def held_text(row: pd.Series | dict) -> str:
    """"lower in 6 of 16 windows" for a comparison row with per-window values; else ""."""
    held, n = row.get("held"), row.get("windows")
    if row["comparison"] == "value" or not row.get("expected") or held is None or held is pd.NA or not _finite(held) or not n:
        return ""
    return f"{row['expected']} in {int(held)} of {int(n)} windows"


def expected_text(row: pd.Series | dict) -> str:
    """"paper: lower than prenorm" for a comparison row; "" where the paper states no direction for it
    (a metric without one, or a rule other than AttnRes: the row's note says which)."""
    if row["comparison"] == "value" or not row.get("expected"):
        return ""
    return f"paper: {row['expected']} than {row['baseline']}"


def comparison_rows(frame: pd.DataFrame | list[dict], metric: str, level: float | None = None,
                    said: str | None = None) -> list[dict[str, Any]]:
    """Every comparison of ``metric`` (one per AttnRes model) as display strings (``level`` and
    ``said`` default to the frame's level and :func:`no_interval_reason`)."""
    rows = _records(frame) if isinstance(frame, pd.DataFrame) else frame
    if level is None:
        level = float(frame.attrs.get("level", 0.95)) if isinstance(frame, pd.DataFrame) else 0.95
    if said is None:
        said = no_interval_reason(rows)
    out = []
    for r in rows:
        if r["metric"] != metric or r["comparison"] == "value":
            continue
        out.append({
            "model": r["model"],
            "baseline": r["baseline"],
            "estimate": fmt_estimate(r),
            "interval": interval_text(r, level, said),
            "expected": expected_text(r),
            "verdict": r["verdict"],
            "basis": str(r.get("basis") or ""),
            "caveat": basis_caveat(r),
            "held": held_text(r),
            "note": r["note"],
            "claim": EXPECTED[metric].claim if metric in EXPECTED else "",
        })
    return out


def headline(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The headline panel: per group (locality, embedding retention, gradient uniformity,
    magnitude growth), per metric, each model's value and each comparison's estimate,
    interval, paper's direction and verdict, all as strings.

    A reason for no interval that holds for every model (one window) is left out of the cells:
    the page says it once (:func:`no_interval_reason`).

    Returns:
        [{"title", "help", "claim", "metrics": [{"metric", "label", "values": [{"model",
        "estimate", "interval", "basis"}], "comparisons": [comparison_rows entries], "rows": [value entry +
        {"comparison": its comparison or None, "is_baseline"}]}]}]
    """
    level = float(frame.attrs.get("level", 0.95))
    records = _records(frame)
    said = no_interval_reason(records)
    groups = []
    for title, help_text, names in HEADLINE:
        rows = []
        for m in names:
            values = [{"model": r["model"], "estimate": fmt_estimate(r), "interval": interval_text(r, level, said),
                       "basis": str(r.get("basis") or ""), "unit": str(r.get("unit") or ""),
                       "reference": fmt_number(r.get("reference"), 4) if _finite(r.get("reference")) else ""}
                      for r in records if r["metric"] == m and r["comparison"] == "value"]
            comps = comparison_rows(records, m, level, said)
            by_model = {c["model"]: c for c in comps}
            baselines = {c["baseline"] for c in comps}
            rows.append({
                "metric": m,
                "label": LABELS.get(m, m),
                "unit": unit_text(m),
                "reference": reference_text(m),
                "values": values,
                "comparisons": comps,
                # one row per model: its value and, for every model but the baseline, its comparison
                "rows": [{**v, "comparison": by_model.get(v["model"]), "is_baseline": v["model"] in baselines,
                          # PreNorm's routing is its implied weights: it *is* the uniform reference, nothing to compare
                          "own": "is the uniform reference (implied weights)" if v["model"] not in by_model
                          and CATALOG.get(m) is not None and CATALOG[m].reference == "uniform" and v["reference"] else ""}
                         for v in values],
            })
        claim = next((EXPECTED[m].claim for m in names if m in EXPECTED), "")
        groups.append({"title": title, "help": help_text, "claim": claim, "metrics": rows})
    return groups


def table_rows(frame: pd.DataFrame) -> dict[str, Any]:
    """The whole metric table, wide: one row per metric; per model "value [low, high]"; per
    comparison "estimate [low, high]" and its verdict.

    Returns:
        {"columns": [header strings], "comparisons": [the comparisons with a verdict column: those
        judged in some row], "rows": [{"metric", "label", "cells": [str], "verdicts": [str per judged
        comparison], "caveats": [str per judged comparison, :func:`basis_caveat`]}]}
    """
    records = _records(frame)
    models = list(dict.fromkeys(r["model"] for r in records if r["comparison"] == "value"))
    comps = list(dict.fromkeys((r["model"], r["baseline"]) for r in records if r["comparison"] != "value"))
    columns = [*models, *[f"{m} vs {b}" for m, b in comps]]
    by_metric: dict[str, dict] = {}
    for r in records:  # the first row of each (metric, model, baseline), as the table shows it
        key = (r["model"], None) if r["comparison"] == "value" else (r["model"], r["baseline"])
        by_metric.setdefault(r["metric"], {}).setdefault(key, r)
    rows = []
    for metric, sub in by_metric.items():
        cells = [_cell(sub[(m, None)], with_reference=True) if (m, None) in sub else "" for m in models]
        found = [sub.get(c) for c in comps]
        cells += [_cell(r) if r is not None else "" for r in found]
        verdicts = [str(r["verdict"]) if r is not None else "" for r in found]
        caveats = [basis_caveat(r) if r is not None else "" for r in found]
        rows.append({"metric": metric, "label": LABELS.get(metric, metric), "unit": unit_text(metric),
                     "reference": reference_text(metric), "cells": cells, "verdicts": verdicts,
                     "caveats": caveats, "n_models": len(models)})
    # a verdict column only for the comparisons judged somewhere (mHC's, DenseFormer's never are)
    judged = [j for j in range(len(comps)) if any(r["verdicts"][j] for r in rows)]
    for r in rows:
        r["verdicts"], r["caveats"] = [r["verdicts"][j] for j in judged], [r["caveats"][j] for j in judged]
    return {"columns": columns, "models": models, "comparisons": [f"{comps[j][0]} vs {comps[j][1]}" for j in judged],
            "rows": rows, "groups": group_rows(rows)}


OTHER_GROUP = "Other measures"


def metric_group(metric: str) -> str:
    """The headline group a metric belongs to (:data:`HEADLINE`), else :data:`OTHER_GROUP`."""
    return next((title for title, _, keys in HEADLINE if metric in keys), OTHER_GROUP)


def group_rows(rows: list[dict]) -> list[dict[str, Any]]:
    """Rows (each with a ``metric``) under the headline groups' plain names, in the headline's order,
    the rest last under "Other measures": [{"title", "rows"}], empty groups left out."""
    order = [title for title, _, _ in HEADLINE] + [OTHER_GROUP]
    by = {t: [] for t in order}
    for r in rows:
        by[metric_group(r["metric"])].append(r)
    return [{"title": t, "rows": by[t]} for t in order if by[t]]


def unit_text(metric: str) -> str:
    """The unit of one value of ``metric`` (the catalog's), "" for a metric the catalog lacks."""
    d = CATALOG.get(metric)
    return d.unit if d is not None else ""


def reference_text(metric: str) -> str:
    """What ``metric`` is set against, in words: "uniform weights on the same sources" or "the baseline's
    same quantity", and how ("difference" / "ratio"); "" for a metric the catalog lacks."""
    d = CATALOG.get(metric)
    if d is None:
        return ""
    against = "uniform weights on the same sources" if d.reference == "uniform" else "the baseline's same quantity"
    return f"{d.compare} against {against}"


def _cell(r: pd.Series | dict, with_reference: bool = False) -> str:
    """"estimate [interval]"; a value's uniform reference after it ("(uniform 0.25)") with ``with_reference``."""
    est = fmt_estimate(r)
    iv = fmt_interval(r)
    text = f"{est} {iv}" if iv else (f"{est} (fixed: no interval)" if _fixed(r) and est != "—" else est)
    if with_reference and _finite(r.get("reference")):
        text += f" (uniform {fmt_number(r['reference'], 4)})"
    return text


def readable(frame: pd.DataFrame) -> pd.DataFrame:
    """A :func:`attnres_probe.metrics.compare` frame as a person reads it: one row per metric,
    indexed by (comparison group, plain name) as the dashboard and the report group them; one
    column per model ("value [interval]") and per comparison ("estimate [interval]"), then each
    comparison's verdict. ``metrics.compare(a, b).pipe(readable)`` in a notebook."""
    t = table_rows(frame)
    rows, index = [], []
    for g in t["groups"]:
        for r in g["rows"]:
            index.append((g["title"], r["label"]))
            rows.append([r["unit"], *r["cells"], *(f"{v} ({c})" if c else v for v, c in zip(r["verdicts"], r["caveats"]))])
    columns = ["unit", *t["columns"], *(f"verdict: {c}" for c in t["comparisons"])]
    out = pd.DataFrame(rows, index=pd.MultiIndex.from_tuples(index, names=["group", "metric"]), columns=columns)
    notes = page_warnings(frame)
    out.attrs["notes"] = notes  # what a page says once above the table
    for note in notes:  # a notebook shows the frame, not its attrs: say it as a warning too
        warnings.warn(note, UserWarning, stacklevel=2)
    return out


WEIGHT_EFFECT_NOTE = (
    "Weight beside effect: in each deep read (the second half of reads) every source is removed on its own (AttnRes: "
    "its weight zeroed and the rest renormalised; mHC, DenseFormer: the same on the normalised weights c/Σc, scaled "
    "back by Σc so the read keeps its gain; PreNorm: the source taken out of the sum, rescaled the same way) "
    "and the change in next-token loss is set beside the source's mean normalised weight. Routing weight is not "
    "causal importance (arXiv 2606.13168): a source with much weight may matter little, and the other way round. "
    "The rank correlation is Spearman's, over a read's sources, of weight against loss change (none where the "
    "weights are all equal, as PreNorm's uniform ones are), averaged over the deep reads."
)


def weight_effect_rows(effects: Any) -> list[dict[str, str]]:
    """One row of display strings per model from ``{model: ablation.weight_beside_effect(...)}``: the
    means over the deep reads of the embedding's and the most recent source's weight (with the uniform
    share 1/k beside it) and loss change, and the rank correlation of weight with effect."""
    rows = []
    for name, frame in effects.items():
        if frame is None or len(frame) == 0:
            rows.append({"model": str(name), "reads": "0", "embed_weight": "—", "embed_delta": "—", "recent_weight": "—",
                         "recent_delta": "—", "uniform": "—", "recent_uniform": "—", "rank_correlation": "—", "tokens": ""})
            continue
        uniform = float(frame["embed_uniform"].astype(float).mean())
        rank = frame["rank_correlation"].astype(float)
        rows.append({
            "model": str(name),
            "reads": str(len(frame)),
            "embed_weight": fmt_number(frame["embed_weight"].mean(), 3),
            "embed_delta": _signed(frame["embed_delta"].mean()),
            "recent_weight": fmt_number(frame["recent_weight"].mean(), 3),
            "recent_delta": _signed(frame["recent_delta"].mean()),
            "uniform": fmt_number(uniform, 3),
            "recent_uniform": fmt_number(float(frame["recent_uniform"].astype(float).mean()), 3),
            "tokens": str(frame.attrs.get("n_tokens") or ""),
            "rank_correlation": _signed(rank.mean()) if rank.notna().any() else "— (equal weights)",
        })
    return rows


def _signed(x: Any) -> str:
    return f"{float(x):+.3g}" if _finite(x) else "—"
