"""Which documents drive a corpus verdict: each document's own value and its leave-one-out influence.

:func:`document_breakdown` takes the same models as :func:`attnres_probe.metrics.compare` and makes
exactly the comparisons :func:`~attnres_probe.analysis.compare.compare_windows` makes (each AttnRes
model's routing against the uniform weights on its own axis; every other diagnostic against the
baseline's same quantity, a difference or the catalog's ratio of means). For every comparison and
every document it gives:

- the document's own value: the comparison's estimate over that document's windows alone (what
  ``compare_windows`` would estimate from them);
- its influence: the pooled estimate, interval and verdict recomputed without the document
  (leave-one-document-out: what ``compare_windows`` gives on the other documents' windows, with the
  same resamples), the shift of the estimate, and whether the verdict changes.

A *document* is the bootstrap's resampling unit, a document id of the windows (a file of the
corpus). The bootstrap does not join files that hold the same text (two editions of a play are
two documents there), so neither does this breakdown: each file is a row.

The resampled statistics are computed from per-document sums (the mean difference and the ratio
of means of a cluster bootstrap only need each document's sums), so the leave-one-out intervals
cost O(documents x resamples) per comparison and metric, not a pass over the windows each; the
count matrices are drawn as ``compare_windows`` draws them (:class:`~attnres_probe.analysis.bootstrap.Resamples`,
the same seed and chunks), the quantiles are ``bootstrap``'s, and the verdict comes from the same
code (:func:`attnres_probe.analysis.verdicts.verdict` through the comparison rows of
:mod:`~attnres_probe.analysis.compare`). Models that share no window (compared unpaired) are
broken down by ``compare_windows`` itself, once per document (slower; rare).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe.analysis import bootstrap
from attnres_probe.analysis.catalog import CATALOG, UNIFORM
from attnres_probe.analysis.compare import Windows, _align, _row, compare_windows, judged_direction
from attnres_probe.analysis.windows import WINDOW_METRICS, reference_column
from attnres_probe.trace import unique_names

__all__ = ["CHANGES_MARK", "COLUMNS", "LOO_RESAMPLES", "document_breakdown", "document_labels", "document_table"]

COLUMNS = (
    "model", "metric", "baseline", "comparison", "expected", "doc", "document", "n_windows", "n_tokens", "value",
    "pooled", "verdict", "pooled_without", "low_without", "high_without", "verdict_without", "shift", "changes_verdict",
)
LOO_RESAMPLES = 200  # one leave-one-out interval per document and comparison: fewer resamples than compare's 1000


def document_labels(source: Any) -> dict[int, str]:
    """Document id -> name: from a list of names in document order or an {id: name} mapping, or from what
    stats know (``stats.meta["documents"]``, the data's file names in document order, which
    :func:`~attnres_probe.corpus.run.load_stats_dir` sets from corpus.json); {} when none is known."""
    names = source if isinstance(source, (list, tuple, Mapping)) else (getattr(source, "meta", None) or {}).get("documents")
    if isinstance(names, Mapping):
        return {int(k): str(v) for k, v in names.items()}
    if isinstance(names, (list, tuple)):
        return {i: str(v) for i, v in enumerate(names)}
    return {}


def _windows(items: Sequence[Any], names: Sequence[str] | None) -> list[Windows]:
    """One :class:`Windows` per item (CorpusStats, DepthTrace or Windows), named as ``metrics.compare`` names them."""
    if names is not None and len(names) != len(items):
        raise ValueError(f"names has {len(names)} entries for {len(items)} models; give one name per model")
    cols = unique_names(list(names) if names is not None else [getattr(t, "name", str(t)) for t in items])
    out = []
    for item, name in zip(items, cols):
        if isinstance(item, Windows):
            out.append(item if item.name == name else Windows(name, item.residual, item.table, item.pooled))
        elif hasattr(item, "window_table"):
            out.append(Windows.of_stats(item, name))
        elif hasattr(item, "depth_weights"):
            out.append(Windows.of_trace(item, name))
        else:
            raise TypeError(f"document_breakdown() takes CorpusStats or DepthTrace objects; got {type(item).__name__}")
    return out


def _doc_counts(n_docs: int, n_windows: int, n_resamples: int, seed: int, cache: dict) -> np.ndarray:
    """Document-level counts, float64 [n_resamples, n_docs], of the cluster bootstrap ``compare_windows`` draws for
    ``n_windows`` windows of ``n_docs`` documents (the same generator, seed and chunks, so the same draws)."""
    chunk = bootstrap.Resamples(n_windows, n_resamples, seed).chunk
    key = (n_docs, chunk, n_resamples, seed)
    if key not in cache:
        cache[key] = bootstrap.Resamples(n_docs, n_resamples, seed, max_cells=chunk * max(n_docs, 1)).matrix().astype(np.float64)
    return cache[key]


def _stat(R: np.ndarray, ratio: np.ndarray) -> np.ndarray:
    """The resampled statistic of every column from the resampled sums R = [C @ SA, C @ SB, C @ N] ([K, 3M]): what
    ``bootstrap.paired_intervals`` computes from the windows (ratio of summed values, or summed differences over
    the windows used)."""
    M = len(ratio)
    sa, sb, n = R[:, :M], R[:, M : 2 * M], R[:, 2 * M :]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(ratio, sa / sb, (sa - sb) / n)


def _estimate(SA: np.ndarray, SB: np.ndarray, N: np.ndarray, ratio: np.ndarray) -> np.ndarray:
    """The estimate from summed values (``bootstrap.paired_intervals``' estimate); NaN where no window is usable."""
    with np.errstate(invalid="ignore", divide="ignore"):
        est = np.where(ratio, SA / SB, (SA - SB) / N)
    return np.where(N > 0, est, np.nan)


def _quantiles(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """``bootstrap._quantile_cols`` of every column of samples [K, X]: columns without NaN through one vectorised
    ``np.quantile`` (the same numbers), the others through ``_quantile_cols`` itself."""
    lo, hi = np.full(samples.shape[1], np.nan), np.full(samples.shape[1], np.nan)
    clean = np.isfinite(samples).all(0)
    if clean.any():
        lo[clean], hi[clean] = np.quantile(samples[:, clean], [(1 - level) / 2, (1 + level) / 2], axis=0)
    if (~clean).any():
        lo[~clean], hi[~clean] = bootstrap._quantile_cols(samples[:, ~clean], level)
    return lo, hi


REFRESH = 64  # leave-one-out sums are updated one document at a time and recomputed whole every this many


def _leave_one_out(S: np.ndarray, ratio: np.ndarray, doc_windows: np.ndarray, n_resamples: int, seed: int,
                   level: float, cache: dict, block: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) [D, M] of the interval without each document in turn, from per-document sums S = [SA, SB, N].

    Without document d the resampled sums are C' @ S_{-d} (C' [K, D−1], the counts ``compare_windows`` would draw
    for the other documents); S_{-d} and S_{-(d−1)} differ in one row, so each is one rank-one update of the last
    (recomputed whole every :data:`REFRESH` documents): O(D·K·M) in all, not O(D²·K·M)."""
    D, M = S.shape[0], len(ratio)
    lo, hi = np.full((D, M), np.nan), np.full((D, M), np.nan)
    if D < 2:
        return lo, hi
    total = int(doc_windows.sum())
    plans: dict[int, list[int]] = {}  # the count matrix's chunk size (it fixes the draws) -> documents left out
    for d in range(D):
        plans.setdefault(bootstrap.Resamples(total - int(doc_windows[d]), n_resamples, seed).chunk, []).append(d)
    for chunk, ds in plans.items():
        C = _doc_counts(D - 1, total - int(doc_windows[ds[0]]), n_resamples, seed, cache)
        wanted = set(ds)
        pending: list[int] = []
        stats: list[np.ndarray] = []
        R = None
        for d in range(ds[0], ds[-1] + 1):
            if R is None or (d - ds[0]) % REFRESH == 0:
                R = C[:, :d] @ S[:d] + C[:, d:] @ S[d + 1 :]
            else:
                R += np.outer(C[:, d - 1], S[d - 1] - S[d])
            if d in wanted:
                pending.append(d)
                stats.append(_stat(R, ratio))
            if pending and (len(pending) == block or d == ds[-1]):
                l, h = _quantiles(np.concatenate(stats, axis=1), level)
                lo[pending], hi[pending] = l.reshape(len(pending), M), h.reshape(len(pending), M)
                pending, stats = [], []
    return lo, hi


def _paired(ms: list[str], it: Windows, against: str, a: np.ndarray, b: np.ndarray, docs: np.ndarray,
            tokens: np.ndarray, ratio: np.ndarray, n_resamples: int, loo_resamples: int, seed: int, level: float,
            cache: dict) -> list[dict]:
    """The rows of one paired comparison (a, b [n, len(ms)], the same windows), every document left out in turn."""
    ok = np.isfinite(a) & np.isfinite(b)
    okf = ok.astype(np.float64)
    uniq, inv = np.unique(docs, return_inverse=True)
    D, M = len(uniq), len(ms)
    S = np.zeros((D, 3 * M))  # per document: summed model values, summed reference values, windows used
    np.add.at(S, inv, np.concatenate([np.where(ok, a, 0.0), np.where(ok, b, 0.0), okf], axis=1))
    SA, SB, N = S[:, :M], S[:, M : 2 * M], S[:, 2 * M :]
    TOK = np.zeros((D, M))
    np.add.at(TOK, inv, okf * tokens[:, None])
    win = np.bincount(inv, minlength=D)  # windows per document (they fix the resampling plan's chunks)
    has = N > 0

    def verdicts(est, lo, hi, n_used, n_docs) -> list[str]:
        """compare's verdict of each column (its comparison row, so its rule for missing intervals too)."""
        return [_row(m, it, against, est[j], lo[j], hi[j], np.nan, int(n_used[j]), int(n_docs[j]), pd.NA, [])["verdict"]
                for j, m in enumerate(ms)]

    def few(n_used, n_docs) -> np.ndarray:
        return (n_used < 2) | (n_docs < 2)  # compare: no interval from one window or one document

    n_all, docs_all = N.sum(0), has.sum(0)
    est_all = _estimate(SA.sum(0), SB.sum(0), n_all, ratio)
    lo_all, hi_all = _quantiles(_stat(_doc_counts(D, len(docs), n_resamples, seed, cache) @ S, ratio), level)
    lo_all, hi_all = np.where(few(n_all, docs_all), np.nan, lo_all), np.where(few(n_all, docs_all), np.nan, hi_all)
    verdict_all = verdicts(est_all, lo_all, hi_all, n_all, docs_all)
    own = _estimate(SA, SB, N, ratio)  # [D, M]
    lo_loo, hi_loo = _leave_one_out(S, ratio, win, loo_resamples, seed, level, cache)
    rows = []
    for d in range(D):
        n, h = n_all - N[d], docs_all - has[d]
        est = _estimate(SA.sum(0) - SA[d], SB.sum(0) - SB[d], n, ratio)
        lo, hi = np.where(few(n, h), np.nan, lo_loo[d]), np.where(few(n, h), np.nan, hi_loo[d])
        v_without = verdicts(est, lo, hi, n, h)
        for j, m in enumerate(ms):
            rows.append({
                "model": it.name, "metric": m, "baseline": against, "comparison": CATALOG[m].compare,
                "expected": judged_direction(m, it.residual, it.config), "doc": int(uniq[d]), "n_windows": int(N[d, j]),
                "n_tokens": int(TOK[d, j]), "value": own[d, j], "pooled": est_all[j], "verdict": verdict_all[j],
                "pooled_without": est[j], "low_without": lo[j], "high_without": hi[j], "verdict_without": v_without[j],
            })
    return rows


def _subset(it: Windows, keep: np.ndarray) -> Windows:
    return Windows(it.name, it.residual, it.table[keep].reset_index(drop=True), it.pooled)


def _unpaired(ms: list[str], it: Windows, base: Windows, n_resamples: int, loo_resamples: int, seed: int,
              level: float) -> list[dict]:
    """Models that share no window (each side resampled on its own): ``compare_windows`` itself on each
    document's windows and without each document (slower, and rare: models recorded on other windows)."""

    def rows_of(a: Windows, b: Windows, k: int) -> pd.DataFrame:
        f = compare_windows([a, b], n_resamples=k, seed=seed, level=level, baseline=base.name)
        return f[(f["model"] == it.name) & (f["baseline"] == base.name)].set_index("metric")

    whole = rows_of(it, base, n_resamples)
    docs = np.union1d(np.unique(it.docs), np.unique(base.docs))
    out = []
    for d in docs:
        alone = rows_of(_subset(it, it.docs == d), _subset(base, base.docs == d), 1)
        without = rows_of(_subset(it, it.docs != d), _subset(base, base.docs != d), loo_resamples)
        mine = it.table[it.docs == d]
        for m in ms:
            ok = np.isfinite(mine[m].to_numpy(np.float64))
            out.append({
                "model": it.name, "metric": m, "baseline": base.name, "comparison": CATALOG[m].compare,
                "expected": judged_direction(m, it.residual, it.config), "doc": int(d), "n_windows": int(ok.sum()),
                "n_tokens": int(mine["n_tokens"].to_numpy()[ok].sum()), "value": alone.at[m, "estimate"],
                "pooled": whole.at[m, "estimate"], "verdict": whole.at[m, "verdict"],
                "pooled_without": without.at[m, "estimate"], "low_without": without.at[m, "low"],
                "high_without": without.at[m, "high"], "verdict_without": without.at[m, "verdict"],
            })
    return out


def document_breakdown(
    *items: Any,
    names: Sequence[str] | None = None,
    documents: Sequence[str] | Mapping[int, str] | None = None,
    n_resamples: int = bootstrap.DEFAULT_RESAMPLES,
    loo_resamples: int = LOO_RESAMPLES,
    seed: int = 0,
    level: float = bootstrap.DEFAULT_LEVEL,
    baseline: str | None = None,
    metrics: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Documents x comparisons: each document's own value and how the pooled verdict moves without it.

    Args:
        *items: CorpusStats and/or DepthTraces (or :class:`Windows`), one per model, as
            :func:`attnres_probe.metrics.compare` takes them.
        names: display names (default each item's name; duplicates get " (2)", ...).
        documents: document names by id (a list in document order, or {id: name}); default what the
            first item's stats know (``meta["documents"]``, set by ``load_stats_dir`` from corpus.json),
            else "document <id>".
        n_resamples: bootstrap resamples of the interval over every document (``pooled``, ``verdict``):
            with compare's ``n_resamples`` and ``seed`` these are the draws ``compare_windows`` makes, so
            ``verdict`` is ``metrics.compare``'s (pages pass their own).
        loo_resamples: resamples of each leave-one-out interval; 200 by default, a modest number
            because there is one interval per document and comparison. Each ``*_without`` is
            ``compare_windows``'s on the other documents' windows with ``n_resamples=loo_resamples``
            and the same seed (the same draws). Cost: one pass over the windows, then per comparison
            O(documents x loo_resamples x metrics) for all the leave-one-out intervals together (one
            [loo_resamples x documents] count matrix in memory), whatever the number of windows; a
            few seconds for a thousand documents.
        seed, level, baseline: as :func:`attnres_probe.metrics.compare`.
        metrics: the diagnostics to break down (default every one with a comparison).

    Returns:
        A tidy frame, one row per (model, metric, document), columns :data:`COLUMNS`:

        ======================  ==============================================================
        model, metric           the comparison's model and diagnostic
        baseline                what it is compared with: "uniform" (routing) or the baseline's name
        comparison              "difference" (model − reference) or "ratio" (ratio of means)
        expected                the paper's direction ("" where it states none, and for rules other
                                than AttnRes: no verdict)
        doc, document           the document's id and its name ("document <id>" where unknown)
        n_windows, n_tokens     the document's windows (and their tokens) with both values
        value                   the comparison's estimate over this document's windows alone
        pooled, verdict         the estimate and verdict over every document (this frame's resamples)
        pooled_without          the estimate without this document
        low_without, high_without  its interval
        verdict_without         its verdict
        shift                   pooled_without − pooled (how the estimate moves without the document)
        changes_verdict         verdict_without differs from verdict
        ======================  ==============================================================

        ``attrs``: n_resamples, loo_resamples, seed, level, baseline, unit ("document").
    """
    if not items:
        raise ValueError("document_breakdown() needs at least one model")
    wins = _windows(items, names)
    all_names = [w.name for w in wins]
    if baseline is None:
        baseline = next((w.name for w in wins if w.residual == "prenorm"), None)
    elif baseline not in all_names:
        raise ValueError(f"baseline {baseline!r} is not one of the models {all_names}")
    wanted = list(metrics) if metrics is not None else list(WINDOW_METRICS)
    unknown = [m for m in wanted if m not in CATALOG]
    if unknown:
        raise ValueError(f"unknown diagnostics {unknown}; the catalog holds {', '.join(CATALOG)}")
    bootstrap.resample_counts(0, n_resamples)  # validates both
    bootstrap.resample_counts(0, loo_resamples)
    cache: dict = {}
    rows: list[dict] = []
    routing = [m for m in wanted if CATALOG[m].reference == UNIFORM]
    others = [m for m in wanted if CATALOG[m].reference != UNIFORM]
    for it in wins:  # routing: each AttnRes model against the uniform reference on its own axis
        if it.residual == "prenorm" or not it.n or not routing:
            continue
        a = it.table[routing].to_numpy(np.float64)
        b = it.table[[reference_column(m) for m in routing]].to_numpy(np.float64)
        rows += _paired(routing, it, "uniform", a, b, it.docs, it.table["n_tokens"].to_numpy(np.float64),
                        np.zeros(len(routing), bool), n_resamples, loo_resamples, seed, level, cache)
    if baseline is not None and others:
        base = wins[all_names.index(baseline)]
        ratio = np.array([CATALOG[m].compare == "ratio" for m in others])
        for it in wins:
            if it.name == baseline:
                continue
            ia, ib, _ = _align(it, base)
            if ia is None:
                rows += _unpaired(others, it, base, n_resamples, loo_resamples, seed, level)
                continue
            a = it.table[others].to_numpy(np.float64)[ia]
            b = base.table[others].to_numpy(np.float64)[ib]
            rows += _paired(others, it, baseline, a, b, it.docs[ia], it.table["n_tokens"].to_numpy(np.float64)[ia],
                            ratio, n_resamples, loo_resamples, seed, level, cache)
    labels = document_labels(documents) if documents is not None else next(
        (lab for lab in (document_labels(x) for x in items) if lab), {})
    frame = pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in ("document", "shift", "changes_verdict")])
    frame.insert(COLUMNS.index("document"), "document", [labels.get(int(d), f"document {int(d)}") for d in frame["doc"]])
    for c in ("value", "pooled", "pooled_without", "low_without", "high_without"):
        frame[c] = frame[c].astype(np.float64)
    frame["shift"] = frame["pooled_without"] - frame["pooled"]
    frame["changes_verdict"] = (frame["verdict"] != frame["verdict_without"]).astype(bool)
    rank = {"metric": {m: i for i, m in enumerate(CATALOG)}, "model": {m: i for i, m in enumerate(all_names)}}
    frame = frame.sort_values(["metric", "model", "doc"], key=lambda s: s.map(rank[s.name]) if s.name in rank else s,
                              kind="stable").reset_index(drop=True)
    for c in ("doc", "n_windows", "n_tokens"):
        frame[c] = frame[c].astype("int64")
    frame.attrs.update({"n_resamples": int(n_resamples), "loo_resamples": int(loo_resamples), "seed": seed, "level": level,
                        "baseline": baseline, "unit": "document"})
    return frame[list(COLUMNS)]


# -- for pages -------------------------------------------------------------------------------
CHANGES_MARK = "‡"
DOCUMENTS_NOTE = (
    "Rows are documents, columns the headline comparisons (each AttnRes model against its reference). A cell is "
    "that document's own value: the comparison's estimate over its windows alone. {mark} marks a document whose "
    "removal changes the verdict: the pooled estimate and verdict recomputed without it (leave-one-document-out) "
    "differ from the verdict over every document; hover a cell for the estimate and verdict without it. One mark in "
    "a column: that verdict leans on that text. Many marks: the verdict is near the edge, and several texts can tip "
    "it. Rows are ordered with the marked documents first, then by how far leaving them out moves the estimate. "
    "The last row is every document together. The verdicts over every document are the ones above ({n} resamples); each leave-one-out interval uses "
    "{loo} (seed {seed}). documents.csv beside comparison.csv holds every diagnostic."
)


def document_table(frame: pd.DataFrame, metrics: Sequence[str] | None = None, max_rows: int = 30) -> dict[str, Any]:
    """The page table of a :func:`document_breakdown` frame, as strings: documents x (metric, model) cells.

    Args:
        frame: :func:`document_breakdown`'s frame.
        metrics: the columns' diagnostics (default the headline panel's, :data:`~attnres_probe.analysis.display.HEADLINE`),
            those with a verdict and rows in ``frame``.
        max_rows: documents shown: every one whose removal changes a shown verdict, then the largest
            shifts, up to this many (the rest are counted in ``hidden``).

    Returns:
        {"columns": [{"metric", "label", "model", "baseline", "verdict", "comparison"}], "spans": [{"metric",
        "label", "n"}] (the header over each metric's n columns), "rows": [{"doc", "document", "windows", "cells":
        [{"metric", "model", "text", "mark", "title", "changes", "value"}]}], "all": [the same cells for every
        document together, with its "verdict"], "hidden": documents not shown, "more": a sentence saying so (""
        if none), "changing": documents that change a shown verdict, "mark", "note": how to read the table}
    """
    from attnres_probe.analysis.display import HEADLINE, LABELS, fmt_estimate

    if metrics is None:
        metrics = [m for _, _, ms in HEADLINE for m in ms]
    f = frame[frame["metric"].isin(metrics) & (frame["expected"] != "")]
    keys = list(dict.fromkeys(zip(f["metric"], f["model"], f["baseline"])))
    keys.sort(key=lambda k: list(metrics).index(k[0]))

    def num(x: Any, kind: str) -> str:  # as the headline writes an estimate: "+0.0123", "×0.93"
        return fmt_estimate({"estimate": x, "comparison": kind, "pooled": np.nan})

    records = {(r["metric"], r["model"], r["baseline"], r["doc"]): r for r in f.to_dict("records")}
    firsts: dict[tuple, dict] = {}  # a row of each comparison: its numbers over every document
    for k, r in records.items():
        firsts.setdefault(k[:3], r)
    docs = f.drop_duplicates("doc").set_index("doc")["document"]
    changing = set(f[f["changes_verdict"]]["doc"].tolist())
    influence = f.assign(size=f["shift"].abs() / f.groupby(["metric", "model"])["pooled"].transform(
        lambda s: np.maximum(np.abs(s), 1e-12))).groupby("doc")["size"].max()
    order = sorted(docs.index, key=lambda d: (d not in changing, -float(np.nan_to_num(influence.get(d, 0.0))), d))
    shown = order[: max(int(max_rows), len(changing))]
    columns, total = [], []
    for k in keys:
        first = firsts[k]
        columns.append({"metric": k[0], "label": LABELS.get(k[0], k[0]), "model": k[1], "baseline": k[2],
                        "verdict": str(first["verdict"]), "comparison": str(first["comparison"])})
        total.append({"text": num(first["pooled"], first["comparison"]), "mark": "", "changes": False,
                      "value": float(first["pooled"]), "metric": k[0], "model": k[1],
                      "title": f"every document: {num(first['pooled'], first['comparison'])}, {first['verdict']}",
                      "verdict": str(first["verdict"])})
    rows = []
    for d in shown:
        cells, windows = [], 0
        for k in keys:
            r = records.get((*k, d))
            if r is None:
                cells.append({"text": "", "mark": "", "title": "", "changes": False, "value": float("nan"), "metric": k[0],
                              "model": k[1]})
                continue
            windows = max(windows, int(r["n_windows"]))
            without = (f"without it: {num(r['pooled_without'], r['comparison'])} ({r['verdict_without']}; shift "
                       f"{float(r['shift']):+.3g})" if np.isfinite(r["pooled_without"]) else "without it: —")
            cells.append({"text": num(r["value"], r["comparison"]), "mark": CHANGES_MARK if r["changes_verdict"] else "",
                          "changes": bool(r["changes_verdict"]), "value": float(r["value"]), "metric": k[0], "model": k[1],
                          "title": f"{r['document']}, {k[1]} vs {k[2]}: {num(r['value'], r['comparison'])} over its "
                                   f"{int(r['n_windows'])} windows; {without}; with every document: "
                                   f"{num(r['pooled'], r['comparison'])} ({r['verdict']})"})
        rows.append({"doc": int(d), "document": str(docs[d]), "windows": windows, "cells": cells})
    spans: list[dict[str, Any]] = []  # the header over each metric's columns
    for c in columns:
        if spans and spans[-1]["metric"] == c["metric"]:
            spans[-1]["n"] += 1
        else:
            spans.append({"metric": c["metric"], "label": c["label"], "n": 1})
    hidden = len(order) - len(shown)
    more = (f"{hidden} more documents change no verdict shown and move the estimates less; documents.csv (written by "
            "attnres-probe corpus beside comparison.csv) lists every document and diagnostic." if hidden else "")
    return {"columns": columns, "spans": spans, "rows": rows, "all": total, "hidden": hidden, "more": more,
            "changing": int(len(changing)), "mark": CHANGES_MARK,
            "note": DOCUMENTS_NOTE.format(mark=CHANGES_MARK, n=frame.attrs.get("n_resamples", "?"),
                                          loo=frame.attrs.get("loo_resamples", "?"), seed=frame.attrs.get("seed", "?"))}
