"""Models set side by side over windows: estimates, bootstrap intervals, paired comparisons, verdicts.

:func:`compare_windows` is the engine behind :func:`attnres_probe.metrics.compare`. Its input
is one :class:`Windows` per model (per-window values of every headline metric plus the pooled
values), built from a :class:`~attnres_probe.trace.DepthTrace` (each sequence a window) or a
:class:`~attnres_probe.corpus.stats.CorpusStats` (each recorded window). Its output is one tidy frame:

======================  ===================================================================
column                  meaning
======================  ===================================================================
metric                  a diagnostic of :data:`~attnres_probe.analysis.catalog.CATALOG`
model                   the model the row is about
baseline                "" for a model's own value; else what it is compared with: "uniform"
                        (routing: the uniform weights on the model's own source axis, which are
                        PreNorm's implied weights grouped as the model groups its sources), or
                        the baseline model's name
comparison              "value", "difference" (model − reference) or "ratio" (model / reference)
basis                   the quantity both sides read: "normalised weights" (routing),
                        "contribution shares", "" for magnitudes, gradients and the loss
unit                    the unit of the estimate (a ratio's is dimensionless)
reference               value rows of routing diagnostics: the uniform reference's mean over the
                        same windows, to read beside the value; NaN otherwise
estimate                mean over windows (value), mean paired difference, or ratio of means
low, high               the bootstrap interval (NaN: none; see ``note``)
pooled                  the same number from the pooled data (all windows' tokens together)
windows                 windows used (for comparisons: windows both models recorded)
documents               documents those windows come from (the resampling unit)
held                    comparisons: windows where the model is on the paper's side of the reference
expected                comparisons: the paper's direction ("lower" / "higher"; "" where it states none,
                        and for models that are not AttnRes: the paper's claims are about AttnRes)
verdict                 comparisons: consistent / contrary / inconclusive (analysis.verdicts.verdict);
                        "" where the paper states no direction or the model is not AttnRes
note                    why an interval or value is missing, how windows were paired, too few
                        documents for a firm interval
======================  ===================================================================

Models are compared on the same windows: rows are matched by window (document, offset and a
digest of the tokens); each bootstrap resample takes the same windows for both. Models that
share no window are compared unpaired (each resampled on its own) and the note says so.

The bootstrap resamples documents, not windows (:func:`~attnres_probe.analysis.bootstrap.cluster_counts`):
windows of one document are alike, and resampling them one by one would give intervals too
narrow for the number of independent texts. A value needs windows from at least two documents
for an interval; below :data:`~attnres_probe.analysis.bootstrap.FEW_DOCUMENTS` documents the note
says the intervals are rough, and ``frame.attrs["documents"]`` holds each model's count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe.analysis import bootstrap
from attnres_probe.analysis.catalog import CATALOG, UNIFORM
from attnres_probe.analysis.verdicts import verdict
from attnres_probe.analysis.windows import (
    WINDOW_METRICS,
    pooled_metrics,
    reference_column,
    window_digests,
    window_metrics,
)
from attnres_probe.axis import ATTNRES_RULES, fixed_routing, rule_title
from attnres_probe.config import shape_difference

__all__ = ["COLUMNS", "Windows", "basis", "compare_windows", "few_documents_note"]

COLUMNS = (
    "metric", "model", "baseline", "comparison", "basis", "unit", "reference", "estimate", "low", "high", "pooled",
    "windows", "documents", "held", "expected", "verdict", "note",
)
PAIR_KEYS = ["doc", "start", "digest"]
WEIGHTS, SHARES = "normalised weights", "contribution shares"


@dataclass
class Windows:
    """One model's per-window metric values and pooled values.

    Attributes:
        name: the model's display name.
        residual: ``"prenorm"`` (a baseline), ``"full"``, ``"block"``, ``"hyper"`` or ``"denseformer"``.
        table: one row per window: :data:`~attnres_probe.analysis.windows.KEY_COLUMNS` then
            every metric of :data:`~attnres_probe.analysis.windows.WINDOW_METRICS`.
        pooled: the metrics of the pooled data (:func:`attnres_probe.metrics.summary`).
        config: the model's config as a dict (None: unknown); models of different shapes are
            compared with a warning (``frame.attrs["shape"]``).
    """

    name: str
    residual: str
    table: pd.DataFrame
    pooled: pd.Series
    config: dict | None = None

    @classmethod
    def of_trace(cls, trace: Any, name: str | None = None) -> Windows:
        """Each sequence of a DepthTrace is a window: of document b at offset 0, or, for one text
        recorded in context-sized windows (``meta["windows"]``, as reports record a text), all of
        document 0 at offsets b·n_ctx. The pooled values are the same diagnostics over every real
        token at once (:func:`~attnres_probe.analysis.windows.pooled_metrics`; a one-window
        trace's are its window's)."""
        table = window_metrics(trace)
        B = len(table)
        one_text = isinstance(trace.meta.get("windows"), dict) and B > 1
        n_ctx = int(trace.meta["windows"].get("n_ctx") or trace.tokens.shape[1]) if one_text else 0
        keys = pd.DataFrame(
            {
                "doc": np.zeros(B, np.int64) if one_text else np.arange(B, dtype=np.int64),
                "start": np.arange(B, dtype=np.int64) * n_ctx,
                "n_tokens": trace.mask.sum(1).astype(np.int64),
                "digest": window_digests(trace),
            }
        )
        pooled = table.iloc[0].rename(trace.name) if B == 1 else pooled_metrics(trace)
        return cls(name or trace.name, trace.residual, pd.concat([keys, table], axis=1), pooled, trace.meta.get("config"))

    @classmethod
    def of_stats(cls, stats: Any, name: str | None = None) -> Windows:
        """The windows a :class:`~attnres_probe.corpus.stats.CorpusStats` recorded, and its pooled values
        (:meth:`~attnres_probe.corpus.stats.CorpusStats.pooled`: the same diagnostics over every token)."""
        return cls(name or stats.name, stats.meta["residual"], stats.window_table(), stats.pooled(), stats.meta.get("config"))

    @property
    def n(self) -> int:
        return len(self.table)

    @property
    def docs(self) -> np.ndarray:
        """The document id of each window (the bootstrap's resampling unit)."""
        return self.table["doc"].to_numpy()


def basis(metric: str) -> str:
    """The quantity ``metric`` reads, the same for every model: "normalised weights" (routing),
    "contribution shares" (the embedding's share), "" for magnitudes, gradients and the loss."""
    d = CATALOG[metric]
    if d.reference == UNIFORM:
        return WEIGHTS
    return SHARES if metric == "embed_contrib_deep" else ""


def _documents(docs: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Per column of ok [n, M]: how many distinct documents have a finite value."""
    return np.array([np.unique(docs[ok[:, j]]).size for j in range(ok.shape[1])], np.int64)


def few_documents_note(n_docs: int) -> str:
    """The warning for an interval over fewer than :data:`bootstrap.FEW_DOCUMENTS` documents ("" otherwise)."""
    return f"only {n_docs} documents: intervals are rough" if 2 <= n_docs < bootstrap.FEW_DOCUMENTS else ""


ONE_WINDOW = "no interval: 1 window (an interval needs at least two)"


def _one_document(n_windows: int) -> str:
    return (f"no interval: 1 document (its {n_windows} windows are resampled together; an interval needs windows "
            "from at least two documents)")


def _note_interval(n_ok: int, n_docs: int) -> str:
    """Why a value with n_ok windows from n_docs documents has no interval, or that it is rough; "" if neither."""
    if n_ok == 1:
        return ONE_WINDOW
    if n_ok > 1 and n_docs == 1:
        return _one_document(n_ok)
    return few_documents_note(n_docs)


CONSTANT = ("the same in every window: this model's depth weights do not depend on the input (its coefficients are "
            "fixed parameters), so an interval over windows has no width and says nothing about them")


def _constant(values: np.ndarray) -> bool:
    """Whether a metric's finite per-window values are one number (to float64 rounding of their means)."""
    v = values[np.isfinite(values)]
    return v.size >= 2 and float(v.max() - v.min()) <= 1e-9 * max(float(np.abs(v).max()), 1e-300)


def _note_value(item: Windows, metric: str, n_ok: int, n_docs: int, pooled: float, values: np.ndarray) -> str:
    if n_ok == 0:
        if np.isfinite(pooled):
            return "pooled value only: per-window values need one backward pass per window"
        if item.n == 0:
            return "no windows"
        if "grad" in metric:
            return "not available: recorded without gradients (record with backward=True; `attnres-probe corpus` does unless --no-backward)"
        return "not available"
    fixed = CATALOG[metric].reference == UNIFORM and _constant(values)  # PreNorm's 1/k too
    return "; ".join(x for x in (_note_interval(n_ok, n_docs), CONSTANT if fixed else "") if x)


def _align(model: Windows, base: Windows) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """Row indices of ``model`` and ``base`` for the same windows, or (None, None, note) if none are shared."""
    mk, bk = model.table[PAIR_KEYS], base.table[PAIR_KEYS]
    if len(mk) == len(bk) and mk.reset_index(drop=True).equals(bk.reset_index(drop=True)):
        idx = np.arange(len(mk))
        return idx, idx, ""
    m = mk.reset_index(drop=True).reset_index().merge(bk.reset_index(drop=True).reset_index(), on=PAIR_KEYS)
    if m.empty:
        return None, None, f"unpaired: {model.name} and {base.name} share no window (different texts or contexts)"
    note = f"paired on the {len(m)} windows both recorded ({model.name}: {model.n}, {base.name}: {base.n})"
    return m["index_x"].to_numpy(), m["index_y"].to_numpy(), note


def compare_windows(
    items: list[Windows],
    n_resamples: int = bootstrap.DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = bootstrap.DEFAULT_LEVEL,
    baseline: str | None = None,
) -> pd.DataFrame:
    """Estimates with intervals for every model and metric, and paired comparisons with verdicts.

    Args:
        items: one :class:`Windows` per model, in display order (names unique).
        n_resamples: bootstrap resamples (the same resamples for every metric and model).
        seed: seeds the resampling: the same inputs and seed give the same frame.
        level: interval coverage (0.95: 95 % percentile intervals).
        baseline: the model every other is compared with; default the first PreNorm model
            (no comparisons when there is none).

    Returns:
        the tidy frame described in the module docstring (columns :data:`COLUMNS`), with
        ``attrs`` holding ``n_resamples``, ``seed``, ``level``, ``baseline``, ``documents`` and
        ``shape`` (a warning when the models differ in more than the residual rule, else "").
    """
    if not items:
        raise ValueError("compare needs at least one model")
    names = [it.name for it in items]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique; got {names}")
    if baseline is None:
        baseline = next((it.name for it in items if it.residual == "prenorm"), None)
    elif baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not one of the models {names}")
    metrics = list(WINDOW_METRICS)
    cache: dict[bytes, np.ndarray] = {}

    def counts(docs: np.ndarray, seed: int = seed) -> np.ndarray | bootstrap.Resamples:
        """The resamples of windows from documents ``docs`` (one id per window), by document: drawn
        once and kept when small, else drawn in bounded chunks at each use (the same resamples either way)."""
        plan = bootstrap.Resamples(len(docs), n_resamples, seed, groups=docs)
        if plan.chunk < n_resamples:
            return plan
        key = np.asarray(plan.inv, np.int64).tobytes() + str(seed).encode()
        if key not in cache:
            cache[key] = plan.matrix()
        return cache[key]

    values: dict[str, list[dict]] = {m: [] for m in metrics}
    comps: dict[str, list[dict]] = {m: [] for m in metrics}
    documents: dict[str, int] = {}
    routing = [m for m in metrics if CATALOG[m].reference == UNIFORM]
    for it in items:
        v = it.table[metrics].to_numpy(np.float64) if it.n else np.empty((0, len(metrics)))
        est, lo, hi = bootstrap.mean_intervals(v, counts(it.docs), level)
        n_ok = np.isfinite(v).sum(0)
        n_docs = _documents(it.docs, np.isfinite(v))
        lo, hi = np.where(n_docs < 2, np.nan, lo), np.where(n_docs < 2, np.nan, hi)  # one document: no interval
        documents[it.name] = int(np.unique(it.docs).size)
        for j, m in enumerate(metrics):
            pooled = float(it.pooled.get(m, np.nan))
            ref = np.nan
            if m in routing and it.n:
                col = it.table[reference_column(m)].to_numpy(np.float64)
                ref = float(np.nanmean(col)) if np.isfinite(col).any() else np.nan
            values[m].append({
                "metric": m, "model": it.name, "baseline": "", "comparison": "value", "basis": basis(m),
                "unit": CATALOG[m].unit, "reference": ref,
                "estimate": est[j], "low": lo[j], "high": hi[j], "pooled": pooled, "windows": int(n_ok[j]),
                "documents": int(n_docs[j]), "held": pd.NA, "expected": "", "verdict": "",
                "note": _note_value(it, m, int(n_ok[j]), int(n_docs[j]), pooled, v[:, j]),
            })
        if it.residual != "prenorm" and it.n:  # routing against the uniform reference on the model's own axis
            a = it.table[routing].to_numpy(np.float64)
            b = it.table[[reference_column(m) for m in routing]].to_numpy(np.float64)
            pooled_ref = {m: float(it.pooled.get(reference_column(m), np.nan)) for m in routing}
            rows = _comparison_rows(routing, it, "uniform", a, b, it.docs, np.zeros(len(routing), bool), counts, level,
                                    {m: float(it.pooled.get(m, np.nan)) for m in routing}, pooled_ref, "")
            for m, row in zip(routing, rows):
                comps[m].append(row)
    if baseline is not None:
        base = items[names.index(baseline)]
        cmp_metrics = [m for m in metrics if CATALOG[m].reference != UNIFORM]
        ratio = np.array([CATALOG[m].compare == "ratio" for m in cmp_metrics])
        for it in items:
            if it.name == baseline:
                continue
            ia, ib, pair_note = _align(it, base)
            a_all = it.table[cmp_metrics].to_numpy(np.float64)
            b_all = base.table[cmp_metrics].to_numpy(np.float64)
            pa = {m: float(it.pooled.get(m, np.nan)) for m in cmp_metrics}
            pb = {m: float(base.pooled.get(m, np.nan)) for m in cmp_metrics}
            if ia is not None:
                rows = _comparison_rows(cmp_metrics, it, baseline, a_all[ia], b_all[ib], it.docs[ia], ratio, counts,
                                        level, pa, pb, pair_note)
            else:
                rows = _unpaired_rows(cmp_metrics, it, base, a_all, b_all, ratio, counts, level, pa, pb, pair_note, seed)
            for m, row in zip(cmp_metrics, rows):
                comps[m].append(row)
    rows = [r for m in metrics for r in values[m] + comps[m]]
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    frame["windows"] = frame["windows"].astype("int64")
    frame["documents"] = frame["documents"].astype("int64")
    frame["held"] = frame["held"].astype("Int64")
    for c in ("reference", "estimate", "low", "high", "pooled"):
        frame[c] = frame[c].astype(np.float64)
    frame.attrs.update({"n_resamples": int(n_resamples), "seed": seed, "level": level, "baseline": baseline,
                        "unit": "document", "documents": documents,
                        "shape": shape_difference({it.name: it.config for it in items}),
                        "residuals": {it.name: it.residual for it in items}})
    return frame


def _row(m: str, it: Windows, against: str, est: float, lo: float, hi: float, pooled: float, n_used: int,
         n_docs: int, held: Any, notes: list[str]) -> dict:
    """One comparison row of metric ``m``: the estimate, its interval and the verdict against the paper's
    direction (for AttnRes models only: the paper's claims are about AttnRes)."""
    d = CATALOG[m]
    if n_used == 0:
        notes.append("pooled value only: per-window values need one backward pass per window"
                     if np.isfinite(pooled) else "not available for both models")
    elif _note_interval(n_used, n_docs):
        notes.append(_note_interval(n_used, n_docs))
    direction = judged_direction(m, it.residual, it.config) or None
    if d.direction is None:
        notes.append("the paper states no direction: no verdict")
    elif direction is None:  # HC, DenseFormer, a static-routing control: the AttnRes paper makes no claim about them
        notes.append(f"the paper's direction is a claim about AttnRes, not {rule_title(it.residual, it.config)}: no verdict")
    kind = d.compare
    return {
        "metric": m, "model": it.name, "baseline": against, "comparison": kind, "basis": basis(m),
        "unit": "ratio (dimensionless)" if kind == "ratio" else d.unit, "reference": np.nan,
        "estimate": est, "low": lo, "high": hi, "pooled": pooled, "windows": n_used, "documents": n_docs,
        "held": held if direction else pd.NA, "expected": direction or "",  # no direction: nothing to count against
        "verdict": verdict(lo, hi, direction, 1.0 if kind == "ratio" else 0.0) if direction else "",
        "note": "; ".join(x for x in notes if x),
    }


def judged_direction(metric: str, residual: str, config: Any = None) -> str:
    """The paper's direction a comparison of ``metric`` is judged against for a model of rule
    ``residual``: the catalog's, for the AttnRes rules only ("" otherwise, and where it states none), and
    not for an AttnRes model whose routing is fixed (attnres4babylm's static-routing control: a control
    with input-independent weights, not the input-dependent routing the paper's claims are about)."""
    if residual not in ATTNRES_RULES or fixed_routing(residual, config if isinstance(config, dict) else None):
        return ""
    return CATALOG[metric].direction or ""


def _pooled_pair(kind: str, pa: float, pb: float) -> float:
    with np.errstate(invalid="ignore", divide="ignore"):
        if kind == "ratio":
            return pa / pb if pb != 0 else np.nan
        return pa - pb


def _comparison_rows(ms: list[str], it: Windows, against: str, a: np.ndarray, b: np.ndarray, docs: np.ndarray,
                     ratio: np.ndarray, counts, level: float, pa: dict, pb: dict, pair_note: str) -> list[dict]:
    """Paired rows: the same windows on both sides (a, b [n, len(ms)]), resampled together by document."""
    est, lo, hi = bootstrap.paired_intervals(a, b, ratio, counts(docs), level)
    ok = np.isfinite(a) & np.isfinite(b)
    n_used = ok.sum(0)
    n_docs = _documents(docs, ok)
    lo, hi = np.where(n_docs < 2, np.nan, lo), np.where(n_docs < 2, np.nan, hi)
    out = []
    for j, m in enumerate(ms):
        d = CATALOG[m]
        held: Any = pd.NA
        if n_used[j] and d.direction:
            aj, bj = a[ok[:, j], j], b[ok[:, j], j]
            held = int((aj < bj).sum() if d.direction == "lower" else (aj > bj).sum())
        notes = [pair_note]
        if against == "uniform" and _constant(a[ok[:, j], j] - b[ok[:, j], j]):
            notes.append(CONSTANT)  # fixed coefficients against fixed uniform weights
        out.append(_row(m, it, against, est[j], lo[j], hi[j], _pooled_pair(d.compare, pa[m], pb[m]), int(n_used[j]),
                        int(n_docs[j]), held, notes))
    return out


def _unpaired_rows(ms: list[str], it: Windows, base: Windows, a_all: np.ndarray, b_all: np.ndarray, ratio: np.ndarray,
                   counts, level: float, pa: dict, pb: dict, pair_note: str, seed: int) -> list[dict]:
    """Rows for models that share no window: each side resampled on its own."""
    est, lo, hi = (np.full(len(ms), np.nan) for _ in range(3))
    ca = counts(it.docs) if it.n else None
    cb = counts(base.docs, seed + 1) if base.n else None
    for j, r in enumerate(ratio):
        if ca is not None and cb is not None:
            est[j], lo[j], hi[j] = bootstrap.unpaired_interval(a_all[:, j], b_all[:, j], ca, cb, "ratio" if r else "difference", level)
    n_used = np.minimum(np.isfinite(a_all).sum(0), np.isfinite(b_all).sum(0))
    n_docs = np.minimum(_documents(it.docs, np.isfinite(a_all)), _documents(base.docs, np.isfinite(b_all)))
    lo, hi = np.where(n_docs < 2, np.nan, lo), np.where(n_docs < 2, np.nan, hi)
    return [_row(m, it, base.name, est[j], lo[j], hi[j], _pooled_pair(CATALOG[m].compare, pa[m], pb[m]), int(n_used[j]),
                 int(n_docs[j]), pd.NA, [pair_note]) for j, m in enumerate(ms)]
