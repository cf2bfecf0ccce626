"""Models set side by side over windows: estimates, bootstrap intervals, paired comparisons, verdicts.

:func:`compare_windows` is the engine behind :func:`attnres_probe.metrics.compare`. Its input
is one :class:`Windows` per model (per-window values of every headline metric plus the pooled
values), built from a :class:`~attnres_probe.trace.DepthTrace` (each sequence a window) or a
:class:`~attnres_probe.stats.CorpusStats` (each recorded window). Its output is one tidy frame:

======================  ===================================================================
column                  meaning
======================  ===================================================================
metric                  a headline metric (key of ``metrics.FORMULAS``)
model                   the model the row is about
baseline                "" for a model's own value; else the baseline it is compared with
comparison              "value", "difference" (model − baseline) or "ratio" (model / baseline)
basis                   routing metrics: which array each side reads, "routing weights" (AttnRes:
                        the softmax depth weights) or "contribution shares" (PreNorm, which has
                        no weights); "routing weights vs contribution shares" when a comparison
                        sets the two side by side (its note says so); "" for other metrics
estimate                mean over windows (value), mean paired difference, or ratio of means
low, high               the bootstrap interval (NaN: none; see ``note``)
pooled                  the same number from the pooled data (all windows' tokens together)
windows                 windows used (for comparisons: windows both models recorded)
documents               documents those windows come from (the resampling unit)
held                    comparisons: windows where the model is on the paper's side of the baseline
expected                comparisons: the paper's direction ("lower" / "higher")
verdict                 comparisons: consistent / contrary / inconclusive (analysis.verdicts.verdict)
note                    why an interval or value is missing, how windows were paired, different
                        quantities compared, too few documents for a firm interval
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
from attnres_probe.analysis.verdicts import EXPECTED, verdict
from attnres_probe.analysis.windows import KEY_COLUMNS, WINDOW_METRICS, window_digests, window_metrics

__all__ = ["COLUMNS", "Windows", "basis", "compare_windows", "few_documents_note", "pair_basis"]

COLUMNS = (
    "metric", "model", "baseline", "comparison", "basis", "estimate", "low", "high", "pooled",
    "windows", "documents", "held", "expected", "verdict", "note",
)
PAIR_KEYS = ["doc", "start", "digest"]
# metrics that read the routing array of metrics.resolve_kind(trace, "auto"): weights for
# AttnRes, contribution shares for PreNorm (which has no weights)
AUTO_ROUTING = ("locality_distance", "locality_recent_mass", "mean_entropy")
FIXED_BASIS = {"embed_weight_deep": "routing weights", "embed_contrib_deep": "contribution shares"}
WEIGHTS, SHARES = "routing weights", "contribution shares"


@dataclass
class Windows:
    """One model's per-window metric values and pooled values.

    Attributes:
        name: the model's display name.
        residual: ``"prenorm"`` (a baseline), ``"full"`` or ``"block"``.
        table: one row per window: :data:`~attnres_probe.analysis.windows.KEY_COLUMNS` then
            every metric of :data:`~attnres_probe.analysis.windows.WINDOW_METRICS`.
        pooled: the metrics of the pooled data (:func:`attnres_probe.metrics.summary`).
    """

    name: str
    residual: str
    table: pd.DataFrame
    pooled: pd.Series

    @classmethod
    def of_trace(cls, trace: Any, name: str | None = None) -> Windows:
        """Each sequence of a DepthTrace is a window: of document b at offset 0, or, for one text
        recorded in context-sized windows (``meta["windows"]``, as reports record a text), all of
        document 0 at offsets b·n_ctx. The pooled values of a one-window trace are its window's
        (:func:`~attnres_probe.metrics.summary` of the same tokens; equal to rounding, a test)."""
        from attnres_probe.metrics import summary

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
        # one window: the pooled data are that window's, and summary() would compute its row again
        pooled = table.iloc[0].rename(trace.name) if B == 1 else summary(trace)
        return cls(name or trace.name, trace.residual, pd.concat([keys, table], axis=1), pooled)

    @classmethod
    def of_stats(cls, stats: Any, name: str | None = None) -> Windows:
        """The windows a :class:`~attnres_probe.stats.CorpusStats` recorded, and its pooled means."""
        from attnres_probe.metrics import summary

        return cls(name or stats.name, stats.meta["residual"], stats.window_table(), summary(stats.to_trace()))

    @property
    def n(self) -> int:
        return len(self.table)

    @property
    def docs(self) -> np.ndarray:
        """The document id of each window (the bootstrap's resampling unit)."""
        return self.table["doc"].to_numpy()


def basis(metric: str, residual: str) -> str:
    """Which quantity ``metric`` reads for a model of ``residual`` ("" when every model is measured alike)."""
    if metric in AUTO_ROUTING:
        return SHARES if residual == "prenorm" else WEIGHTS
    if metric == "embed_weight_deep" and residual == "prenorm":
        return ""  # PreNorm has no weights: no value to name
    return FIXED_BASIS.get(metric, "")


def pair_basis(metric: str, model: Windows, base: Windows) -> tuple[str, str]:
    """(basis, note) of a comparison: one name when both sides read the same quantity, else
    "routing weights vs contribution shares" and a note saying the two are different quantities."""
    a, b = basis(metric, model.residual), basis(metric, base.residual)
    if a == b:
        return a, ""
    return (f"{a} vs {b}", f"different quantities: {model.name}'s {a} against {base.name}'s {b} "
            "(PreNorm has no routing weights: its coefficients are all one)")


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


def _note_value(item: Windows, metric: str, n_ok: int, n_docs: int, pooled: float) -> str:
    if n_ok == 0:
        if np.isfinite(pooled):
            return "pooled value only: per-window values need one backward pass per window"
        if metric == "embed_weight_deep" and item.residual == "prenorm":
            return "PreNorm has no depth weights (unit coefficients)"
        if item.n == 0:
            return "no windows"
        if "grad" in metric:
            return "not available: recorded without gradients (record with backward=True; `attnres-probe corpus` does unless --no-backward)"
        return "not available"
    return _note_interval(n_ok, n_docs)


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
        ``attrs`` holding ``n_resamples``, ``seed``, ``level``, ``baseline``.
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
    documents: dict[str, int] = {}
    for it in items:
        v = it.table[metrics].to_numpy(np.float64) if it.n else np.empty((0, len(metrics)))
        est, lo, hi = bootstrap.mean_intervals(v, counts(it.docs), level)
        n_ok = np.isfinite(v).sum(0)
        n_docs = _documents(it.docs, np.isfinite(v))
        lo, hi = np.where(n_docs < 2, np.nan, lo), np.where(n_docs < 2, np.nan, hi)  # one document: no interval
        documents[it.name] = int(np.unique(it.docs).size)
        for j, m in enumerate(metrics):
            pooled = float(it.pooled.get(m, np.nan))
            values[m].append({
                "metric": m, "model": it.name, "baseline": "", "comparison": "value", "basis": basis(m, it.residual),
                "estimate": est[j], "low": lo[j], "high": hi[j], "pooled": pooled, "windows": int(n_ok[j]),
                "documents": int(n_docs[j]), "held": pd.NA, "expected": "", "verdict": "",
                "note": _note_value(it, m, int(n_ok[j]), int(n_docs[j]), pooled),
            })
    comps: dict[str, list[dict]] = {m: [] for m in metrics}
    if baseline is not None:
        base = items[names.index(baseline)]
        cmp_metrics = [m for m in metrics if m in EXPECTED]
        ratio = np.array([EXPECTED[m].kind == "ratio" for m in cmp_metrics])
        for it in items:
            if it.name == baseline:
                continue
            ia, ib, pair_note = _align(it, base)
            a_all = it.table[cmp_metrics].to_numpy(np.float64)
            b_all = base.table[cmp_metrics].to_numpy(np.float64)
            if ia is not None:
                a, b = a_all[ia], b_all[ib]
                docs = it.docs[ia]
                est, lo, hi = bootstrap.paired_intervals(a, b, ratio, counts(docs), level)
                ok = np.isfinite(a) & np.isfinite(b)
                n_used = ok.sum(0)
                n_docs = _documents(docs, ok)
            else:
                est, lo, hi = (np.full(len(cmp_metrics), np.nan) for _ in range(3))
                ca = counts(it.docs) if it.n else None
                cb = counts(base.docs, seed + 1) if base.n else None
                for j, r in enumerate(ratio):
                    if ca is not None and cb is not None:
                        est[j], lo[j], hi[j] = bootstrap.unpaired_interval(
                            a_all[:, j], b_all[:, j], ca, cb, "ratio" if r else "difference", level)
                ok = None
                n_used = np.minimum(np.isfinite(a_all).sum(0), np.isfinite(b_all).sum(0))
                n_docs = np.minimum(_documents(it.docs, np.isfinite(a_all)), _documents(base.docs, np.isfinite(b_all)))
            lo, hi = np.where(n_docs < 2, np.nan, lo), np.where(n_docs < 2, np.nan, hi)
            for j, m in enumerate(cmp_metrics):
                exp = EXPECTED[m]
                pa, pb = float(it.pooled.get(m, np.nan)), float(base.pooled.get(m, np.nan))
                with np.errstate(invalid="ignore", divide="ignore"):
                    pooled = pa / pb if exp.kind == "ratio" and pb != 0 else (pa - pb if exp.kind == "difference" else np.nan)
                held: Any = pd.NA
                if ok is not None and n_used[j]:
                    aj, bj = a[ok[:, j], j], b[ok[:, j], j]
                    held = int((aj < bj).sum() if exp.direction == "lower" else (aj > bj).sum())
                m_basis, basis_note = pair_basis(m, it, base)
                notes = [x for x in (basis_note, pair_note) if x]
                if n_used[j] == 0:
                    notes.append("pooled value only: per-window values need one backward pass per window"
                                 if np.isfinite(pooled) else "not available for both models")
                elif _note_interval(int(n_used[j]), int(n_docs[j])):
                    notes.append(_note_interval(int(n_used[j]), int(n_docs[j])))
                comps[m].append({
                    "metric": m, "model": it.name, "baseline": baseline, "comparison": exp.kind, "basis": m_basis,
                    "estimate": est[j], "low": lo[j], "high": hi[j], "pooled": pooled, "windows": int(n_used[j]),
                    "documents": int(n_docs[j]), "held": held, "expected": exp.direction,
                    "verdict": verdict(lo[j], hi[j], exp.direction, 1.0 if exp.kind == "ratio" else 0.0),
                    "note": "; ".join(notes),
                })
    rows = [r for m in metrics for r in values[m] + comps[m]]
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    frame["windows"] = frame["windows"].astype("int64")
    frame["documents"] = frame["documents"].astype("int64")
    frame["held"] = frame["held"].astype("Int64")
    for c in ("estimate", "low", "high", "pooled"):
        frame[c] = frame[c].astype(np.float64)
    frame.attrs.update({"n_resamples": int(n_resamples), "seed": seed, "level": level, "baseline": baseline,
                        "unit": "document", "documents": documents})
    return frame
