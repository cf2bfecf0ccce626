"""Tests over training seeds: the unit of inference for a claim about an architecture.

Each seed s gives one value x_s of an endpoint (AttnRes seed s against PreNorm seed s, or against
its own uniform reference). :func:`seed_test` gives the mean, a t interval, the two-sided
one-sample t-test of mean(x) = 0, and the exact two-sided sign test; :func:`holm` adjusts a
family of p-values (Holm's step-down: controls the family-wise error); :func:`holm_verdict` reads
a verdict from the adjusted p and the paper's direction. docs/study/plan-v3.md fixed these
choices before the runs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import stats

__all__ = ["holm", "holm_verdict", "seed_test", "t_interval"]


def _values(x: Any) -> np.ndarray:
    v = np.asarray(x, np.float64).ravel()
    if v.size and not np.isfinite(v).all():
        raise ValueError(f"seed values must be finite; got {v.tolist()}")
    return v


def t_interval(x: Any, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the t interval of the mean over seeds (NaN bounds with fewer than 2 seeds)."""
    v = _values(x)
    if not 0 < level < 1:
        raise ValueError(f"level is {level}; accepted range is (0, 1)")
    if v.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(v.mean())
    if v.size < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
    return mean, mean - half, mean + half


def seed_test(x: Any, expected: str, level: float = 0.95) -> dict[str, Any]:
    """The plan's tests of one endpoint over seeds.

    Args:
        x: one value per seed (a difference or a log ratio; 0 = no effect).
        expected: the paper's direction of x, ``"lower"`` (below 0) or ``"higher"``.

    Returns:
        {"n", "mean", "sd", "low", "high" (t interval), "t", "df", "p" (two-sided t-test),
        "paper_way" (seeds on the paper's side of 0), "sign_p" (exact two-sided sign test over the
        seeds not exactly 0)}; p and t are NaN with fewer than 2 seeds or no spread.
    """
    if expected not in ("lower", "higher"):
        raise ValueError(f"expected is {expected!r}; accepted: 'lower', 'higher'")
    v = _values(x)
    mean, low, high = t_interval(v, level)
    sd = float(v.std(ddof=1)) if v.size >= 2 else math.nan
    if v.size >= 2 and sd > 0:
        res = stats.ttest_1samp(v, 0.0)
        t, p = float(res.statistic), float(res.pvalue)
    else:
        t = p = math.nan
    way = v < 0 if expected == "lower" else v > 0
    nonzero = int((v != 0).sum())
    sign_p = float(stats.binomtest(int(way.sum()), nonzero, 0.5).pvalue) if nonzero else math.nan
    return {"n": int(v.size), "mean": mean, "sd": sd, "low": low, "high": high, "t": t, "df": int(v.size) - 1, "p": p,
            "paper_way": int(way.sum()), "sign_p": sign_p}


def holm(pvalues: Any) -> np.ndarray:
    """Holm's step-down adjusted p-values, in the input order: the i-th smallest p times (m - i + 1),
    made non-decreasing along the order and capped at 1. NaN stays NaN and does not count in m."""
    p = np.asarray(pvalues, np.float64).ravel()
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    if ok.size == 0:
        return out
    if ((p[ok] < 0) | (p[ok] > 1)).any():
        raise ValueError(f"p-values must lie in [0, 1]; got {p.tolist()}")
    order = ok[np.argsort(p[ok], kind="stable")]
    m = order.size
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    out[order] = adjusted
    return out


def holm_verdict(mean: float, p_adjusted: float, expected: str, alpha: float = 0.05) -> str:
    """"consistent" (adjusted p < alpha, mean on the paper's side of 0), "contrary" (adjusted p < alpha,
    mean on the other side), else "inconclusive"."""
    if not (math.isfinite(p_adjusted) and math.isfinite(mean)) or p_adjusted >= alpha or mean == 0:
        return "inconclusive"
    paper_way = mean < 0 if expected == "lower" else mean > 0
    return "consistent" if paper_way else "contrary"
