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
estimate                mean over windows (value), mean paired difference, or ratio of means
low, high               the bootstrap interval (NaN: none; see ``note``)
pooled                  the same number from the pooled data (all windows' tokens together)
windows                 windows used (for comparisons: windows both models recorded)
held                    comparisons: windows where the model is on the paper's side of the baseline
expected                comparisons: the paper's direction ("lower" / "higher")
verdict                 comparisons: consistent / contrary / inconclusive (analysis.verdicts.verdict)
note                    why an interval or value is missing, how windows were paired
======================  ===================================================================

Models are compared on the same windows: rows are matched by window (document, offset and a
digest of the tokens); each bootstrap resample takes the same windows for both. Models that
share no window are compared unpaired (each resampled on its own) and the note says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe.analysis import bootstrap
from attnres_probe.analysis.verdicts import EXPECTED, verdict
from attnres_probe.analysis.windows import KEY_COLUMNS, WINDOW_METRICS, window_digests, window_metrics

__all__ = ["COLUMNS", "Windows", "compare_windows"]

COLUMNS = (
    "metric", "model", "baseline", "comparison", "estimate", "low", "high", "pooled",
    "windows", "held", "expected", "verdict", "note",
)
PAIR_KEYS = ["doc", "start", "digest"]


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
        """Each sequence of a DepthTrace is a window (document b, offset 0)."""
        from attnres_probe.metrics import summary

        table = window_metrics(trace)
        keys = pd.DataFrame(
            {
                "doc": np.arange(len(table), dtype=np.int64),
                "start": np.zeros(len(table), np.int64),
                "n_tokens": trace.mask.sum(1).astype(np.int64),
                "digest": window_digests(trace),
            }
        )
        return cls(name or trace.name, trace.residual, pd.concat([keys, table], axis=1), summary(trace))

    @classmethod
    def of_stats(cls, stats: Any, name: str | None = None) -> Windows:
        """The windows a :class:`~attnres_probe.stats.CorpusStats` recorded, and its pooled means."""
        from attnres_probe.metrics import summary

        return cls(name or stats.name, stats.meta["residual"], stats.window_table(), summary(stats.to_trace()))

    @property
    def n(self) -> int:
        return len(self.table)


def _note_value(item: Windows, metric: str, n_ok: int, pooled: float) -> str:
    if n_ok == 0:
        if np.isfinite(pooled):
            return "pooled value only: per-window values need one backward pass per window"
        if metric == "embed_weight_deep" and item.residual == "prenorm":
            return "PreNorm has no depth weights (unit coefficients)"
        if item.n == 0:
            return "no windows"
        return "not available (recorded without gradients?)" if "grad" in metric else "not available"
    if n_ok == 1:
        return "no interval: 1 window (an interval needs at least two)"
    return ""


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
    cache: dict[int, np.ndarray] = {}

    def counts(n: int) -> np.ndarray | bootstrap.Resamples:
        """The resamples of n windows: drawn once and kept when small, else drawn in bounded chunks
        at each use (the same resamples either way)."""
        plan = bootstrap.Resamples(n, n_resamples, seed)
        if plan.chunk < n_resamples:
            return plan
        if n not in cache:
            cache[n] = bootstrap.resample_counts(n, n_resamples, seed)
        return cache[n]

    values: dict[str, list[dict]] = {m: [] for m in metrics}
    for it in items:
        v = it.table[metrics].to_numpy(np.float64) if it.n else np.empty((0, len(metrics)))
        est, lo, hi = bootstrap.mean_intervals(v, counts(it.n), level)
        n_ok = np.isfinite(v).sum(0)
        for j, m in enumerate(metrics):
            pooled = float(it.pooled.get(m, np.nan))
            values[m].append({
                "metric": m, "model": it.name, "baseline": "", "comparison": "value", "estimate": est[j],
                "low": lo[j], "high": hi[j], "pooled": pooled, "windows": int(n_ok[j]), "held": pd.NA,
                "expected": "", "verdict": "", "note": _note_value(it, m, int(n_ok[j]), pooled),
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
                est, lo, hi = bootstrap.paired_intervals(a, b, ratio, counts(len(ia)), level)
                ok = np.isfinite(a) & np.isfinite(b)
                n_used = ok.sum(0)
            else:
                est, lo, hi = (np.full(len(cmp_metrics), np.nan) for _ in range(3))
                ca = bootstrap.Resamples(it.n, n_resamples, seed) if it.n else None
                cb = bootstrap.Resamples(base.n, n_resamples, seed + 1) if base.n else None
                for j, r in enumerate(ratio):
                    if ca is not None and cb is not None:
                        est[j], lo[j], hi[j] = bootstrap.unpaired_interval(
                            a_all[:, j], b_all[:, j], ca, cb, "ratio" if r else "difference", level)
                ok = None
                n_used = np.minimum(np.isfinite(a_all).sum(0), np.isfinite(b_all).sum(0))
            for j, m in enumerate(cmp_metrics):
                exp = EXPECTED[m]
                pa, pb = float(it.pooled.get(m, np.nan)), float(base.pooled.get(m, np.nan))
                with np.errstate(invalid="ignore", divide="ignore"):
                    pooled = pa / pb if exp.kind == "ratio" and pb != 0 else (pa - pb if exp.kind == "difference" else np.nan)
                held: Any = pd.NA
                if ok is not None and n_used[j]:
                    aj, bj = a[ok[:, j], j], b[ok[:, j], j]
                    held = int((aj < bj).sum() if exp.direction == "lower" else (aj > bj).sum())
                notes = [pair_note] if pair_note else []
                if n_used[j] == 0:
                    notes.append("pooled value only: per-window values need one backward pass per window"
                                 if np.isfinite(pooled) else "not available for both models")
                elif n_used[j] == 1:
                    notes.append("no interval: 1 window (an interval needs at least two)")
                comps[m].append({
                    "metric": m, "model": it.name, "baseline": baseline, "comparison": exp.kind,
                    "estimate": est[j], "low": lo[j], "high": hi[j], "pooled": pooled, "windows": int(n_used[j]),
                    "held": held, "expected": exp.direction,
                    "verdict": verdict(lo[j], hi[j], exp.direction, 1.0 if exp.kind == "ratio" else 0.0),
                    "note": "; ".join(notes),
                })
    rows = [r for m in metrics for r in values[m] + comps[m]]
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    frame["windows"] = frame["windows"].astype("int64")
    frame["held"] = frame["held"].astype("Int64")
    for c in ("estimate", "low", "high", "pooled"):
        frame[c] = frame[c].astype(np.float64)
    frame.attrs.update({"n_resamples": int(n_resamples), "seed": seed, "level": level, "baseline": baseline})
    return frame
