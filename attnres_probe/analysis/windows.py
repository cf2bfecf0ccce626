"""Headline metrics per window: one value of every metric for each sequence of a trace.

A *window* is one sequence of a :class:`~attnres_probe.trace.DepthTrace` (one row of its batch):
a document, or an ``n_ctx``-token piece of one. Windows are the unit of every interval in
:mod:`attnres_probe.analysis.bootstrap`, so each headline metric is computed here for each
window on its own, with exactly the definitions of :func:`attnres_probe.metrics.summary` (a
one-window trace gives the same numbers as ``summary``; a test checks it).

Per-window parameter gradients need one backward pass per window: a trace of one window has
them (its ``param_grad``); a trace of several windows recorded with one backward over their
mean loss does not, and its parameter-gradient metrics are NaN per window (only the pooled
value of ``summary`` exists).
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import pandas as pd

from attnres_probe.trace import DepthTrace

__all__ = ["KEY_COLUMNS", "WINDOW_METRICS", "window_digests", "window_metric_arrays", "window_metrics", "window_profiles"]

# every headline metric, in display order (each is a key of metrics.FORMULAS)
WINDOW_METRICS = (
    "locality_distance",
    "locality_recent_mass",
    "embed_weight_deep",
    "embed_contrib_deep",
    "mean_entropy",
    "act_grad_cv",
    "act_grad_max_min",
    "param_grad_cv",
    "param_grad_max_min",
    "rms_in_growth",
    "rms_in_log_slope",
    "rms_in_max_min",
    "rms_in_peak",
    "rms_out_growth",
    "rms_out_log_slope",
    "mean_loss",
)
# what identifies a window across models: document index, first token's offset in it, tokens, digest
KEY_COLUMNS = ("doc", "start", "n_tokens", "digest")


def _window_mean(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """NaN-aware mean over positions of each window: x [B, P, ...], mask [B, P] -> [B, ...] (NaN where none)."""
    x = np.asarray(x, np.float64)
    ok = mask.reshape(mask.shape + (1,) * (x.ndim - 2)) & ~np.isnan(x)
    n = ok.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.where(ok, x, 0.0).sum(1) / np.maximum(n, 1), np.nan)


def _row_nanmean(x: np.ndarray, cols: np.ndarray | slice) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x[:, cols], axis=1) if x[:, cols].shape[1] else np.full(x.shape[0], np.nan)


def _spread_rows(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row (std/mean, max/min) of v [B, n]; NaN unless every entry of the row is finite."""
    ok = np.isfinite(v).all(axis=1) & (v.shape[1] > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean, lo, hi = v.mean(1), v.min(1, initial=np.inf), v.max(1, initial=-np.inf)
        cv = np.where(ok & (mean != 0), v.std(1) / mean, np.nan)
        ratio = np.where(ok & (lo > 0), hi / lo, np.nan)
    return cv, ratio


def _growth_rows(m: np.ndarray) -> dict[str, np.ndarray]:
    """Per row of m [B, n]: last/first, slope of log m over index, max/min, max; NaN unless all finite and > 0."""
    B, n = m.shape
    ok = (n > 0) & np.isfinite(m).all(1) & (m > 0).all(1)
    safe = np.where(ok[:, None], m, 1.0)
    logm = np.log(safe)
    if n > 1:
        x = np.arange(n) - (n - 1) / 2
        slope = (logm * x).sum(1) / (x**2).sum()
    else:
        slope = np.full(B, np.nan)
    nan = np.full(B, np.nan)
    return {
        "growth": np.where(ok, safe[:, -1] / safe[:, 0], nan) if n else nan,
        "slope": np.where(ok, slope, nan),
        "max_min": np.where(ok, safe.max(1, initial=0) / safe.min(1, initial=np.inf), nan) if n else nan,
        "peak": np.where(ok, safe.max(1, initial=0), nan) if n else nan,
    }


def _routing_rows(trace: DepthTrace) -> dict[str, np.ndarray]:
    """Per window and read: mean over tokens of distance, recent mass, entropy ([B, R] each), and k [R]."""
    from attnres_probe.metrics import resolve_kind

    kind = resolve_kind(trace, "auto")
    a = np.asarray(trace.cube(kind), np.float64)  # [B, P, R, S]
    avail = ~np.isnan(a)
    k = avail.sum(-1)  # [B, P, R]
    pos = np.cumsum(avail, axis=-1, dtype=np.int32) - 1
    vals = np.where(avail, a, 0.0)
    has = k > 0
    dist = np.where(avail, k[..., None] - 1 - pos, 0)
    distance = np.where(has, (vals * dist).sum(-1), np.nan)
    recent = np.where(has, (vals * (avail & (pos == k[..., None] - 1))).sum(-1), np.nan)
    p = np.abs(vals) if kind == "contrib" else vals
    with np.errstate(divide="ignore", invalid="ignore"):
        p = p / p.sum(-1, keepdims=True)
        logp = np.log(p)
        logp[~(p > 0)] = 0.0  # 0 log 0 = 0 (and no NaN from cells that are not there)
        h = -np.einsum("...s,...s->...", np.where(p > 0, p, 0.0), logp)
        h = np.where(k > 1, h / np.log(np.maximum(k, 2)), np.nan)
    mask = trace.mask
    k_read = np.where(mask[..., None], k, 0).max(axis=(0, 1)) if mask.any() else np.zeros(a.shape[2], int)
    return {
        "distance": _window_mean(distance, mask),
        "recent": _window_mean(recent, mask),
        "entropy": _window_mean(h, mask),
        "k": k_read,
    }


def window_metrics(trace: DepthTrace) -> pd.DataFrame:
    """Every headline metric for each window (sequence) of ``trace``: see :func:`window_metric_arrays`.

    Returns:
        DataFrame [B rows, one per window] with columns :data:`WINDOW_METRICS`.
    """
    values = window_metric_arrays(trace)
    return pd.DataFrame({name: values[name] for name in WINDOW_METRICS})


def window_metric_arrays(trace: DepthTrace) -> dict[str, np.ndarray]:
    """Every headline metric for each window (sequence) of ``trace``.

    Definitions are those of :func:`attnres_probe.metrics.summary`, applied to the real tokens
    of one window: locality, entropy and embedding numbers average per read over the window's
    tokens, then over reads (reads with k_r >= 2; deepest half for the embedding);
    gradient uniformity and magnitude growth use the window's per-read means. Parameter-
    gradient metrics need the window's own parameter gradients, which only a one-window trace
    has; with several windows they are NaN.

    Returns:
        {metric: float64 [B]} for every name of :data:`WINDOW_METRICS`.
    """
    B = trace.tokens.shape[0]
    R = len(trace.read_labels)
    L = R - 1
    mask = trace.mask
    route = _routing_rows(trace)
    choice = route["k"] >= 2
    deep = slice(R // 2, None)
    out: dict[str, np.ndarray] = {
        "locality_distance": _row_nanmean(route["distance"], choice),
        "locality_recent_mass": _row_nanmean(route["recent"], choice),
    }
    if trace.residual == "prenorm":
        out["embed_weight_deep"] = np.full(B, np.nan)
    else:
        out["embed_weight_deep"] = _row_nanmean(_window_mean(trace.depth_weights[..., 0], mask), deep)
    out["embed_contrib_deep"] = _row_nanmean(_window_mean(trace.contrib[..., 0], mask), deep)
    out["mean_entropy"] = _row_nanmean(route["entropy"], choice)
    act = _window_mean(trace.grad_in, mask)[:, :L]  # [B, L]
    out["act_grad_cv"], out["act_grad_max_min"] = _spread_rows(act)
    if B == 1:
        p_cv, p_ratio = _spread_rows(np.asarray(trace.param_grad, np.float64)[None])
    else:
        p_cv, p_ratio = np.full(B, np.nan), np.full(B, np.nan)
    out["param_grad_cv"], out["param_grad_max_min"] = p_cv, p_ratio
    g_in = _growth_rows(_window_mean(trace.rms_in, mask)[:, :L])
    g_out = _growth_rows(_window_mean(trace.rms_out, mask)[:, 1 : L + 1])
    out["rms_in_growth"], out["rms_in_log_slope"] = g_in["growth"], g_in["slope"]
    out["rms_in_max_min"], out["rms_in_peak"] = g_in["max_min"], g_in["peak"]
    out["rms_out_growth"], out["rms_out_log_slope"] = g_out["growth"], g_out["slope"]
    out["mean_loss"] = _window_mean(trace.loss, mask)
    return {name: np.asarray(out[name], np.float64) for name in WINDOW_METRICS}


def window_profiles(trace: DepthTrace) -> dict[str, np.ndarray]:
    """Per-window depth profiles: means over each window's real tokens.

    Returns:
        {"rms_in": [B, R], "grad_in": [B, R], "rms_out": [B, L+1], "grad_out": [B, L+1], "param_grad": [B, L]}
        (``param_grad`` is the trace's own for a one-window trace, NaN otherwise).
    """
    B = trace.tokens.shape[0]
    L = len(trace.sublayer_labels)
    pg = np.asarray(trace.param_grad, np.float64)[None] if B == 1 else np.full((B, L), np.nan)
    return {
        "rms_in": _window_mean(trace.rms_in, trace.mask),
        "grad_in": _window_mean(trace.grad_in, trace.mask),
        "rms_out": _window_mean(trace.rms_out, trace.mask),
        "grad_out": _window_mean(trace.grad_out, trace.mask),
        "param_grad": pg,
    }


def window_digests(trace: DepthTrace) -> list[str]:
    """A short hash of each window's real token ids (16 hex digits): equal windows, equal digests."""
    out = []
    for row, m in zip(trace.tokens, trace.mask):
        ids = np.ascontiguousarray(row[m], dtype=np.int64)
        out.append(hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest())
    return out
