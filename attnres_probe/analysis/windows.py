"""Every diagnostic of the catalog per window: one value for each sequence of a trace.

A *window* is one sequence of a :class:`~attnres_probe.trace.DepthTrace` (one row of its batch):
a document, or an ``n_ctx``-token piece of one. Windows are the unit of every interval in
:mod:`attnres_probe.analysis.bootstrap`, so each diagnostic of
:data:`~attnres_probe.analysis.catalog.CATALOG` is computed here for each window on its own
(:func:`window_metric_arrays`), and the pooled value is the same function over every token at
once (:func:`pooled_metrics`). Routing diagnostics also get their uniform reference per window
(``{name}@uniform``: the same function of the uniform weights on the model's own source axis).

Per-window parameter gradients need one backward pass per window: a trace of one window has
them (its ``param_grad``); a trace of several windows recorded with one backward over their
mean loss does not, and its parameter-gradient diagnostics are NaN per window (the pooled value,
from that one backward, exists).
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe.analysis.catalog import CATALOG, COMPUTE, LiveList, routing_names
from attnres_probe.numeric import over_sum, row_sum
from attnres_probe.trace import DepthTrace

__all__ = [
    "KEY_COLUMNS",
    "REFERENCE_COLUMNS",
    "mixture_rms",
    "normalised_weights",
    "profile_values",
    "source_members",
    "COMPUTE",
    "LATER_COLUMNS",
    "WINDOW_COLUMNS",
    "WINDOW_METRICS",
    "pooled_metrics",
    "reference_column",
    "uniform_weights",
    "window_digests",
    "window_metric_arrays",
    "window_metrics",
    "window_profiles",
    "informative_token",
]

# These tables are views of the catalog, read afresh each time: a diagnostic added with
# :func:`attnres_probe.analysis.catalog.register` appears in all of them (and so on every page).
WINDOW_METRICS = LiveList(lambda: list(CATALOG))  # every diagnostic, in display order


def reference_column(metric: str) -> str:
    """The column holding a routing diagnostic's uniform reference."""
    return f"{metric}@uniform"


REFERENCE_COLUMNS = LiveList(lambda: [reference_column(n) for n in routing_names()])
WINDOW_COLUMNS = LiveList(lambda: [*CATALOG, *(reference_column(n) for n in routing_names())])  # besides keys
# columns added after stats schema 2 was written: a table saved before them lacks them (they read as NaN)
LATER_COLUMNS = tuple(c for n in ("embed_weight_deep_attn", "embed_weight_deep_mlp") for c in (n, reference_column(n)))
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


def _positive_rows(m: np.ndarray) -> np.ndarray:
    """Rows of m [B, n] whose every entry is finite and positive."""
    return (m.shape[1] > 0) & np.isfinite(m).all(1) & (m > 0).all(1)


def _quarter_ratio(m: np.ndarray, last_over_first: bool = True) -> np.ndarray:
    """Per row of m [B, n]: mean of the last quarter over the mean of the first (or the reverse); the
    quarter is max(1, n // 4) entries; NaN unless the row is finite and positive."""
    n = m.shape[1]
    q = max(1, n // 4)
    ok = _positive_rows(m)
    safe = np.where(ok[:, None], m, 1.0)
    first, last = safe[:, :q].mean(1), safe[:, n - q :].mean(1) if n else safe[:, :0].sum(1)
    return np.where(ok, last / first if last_over_first else first / last, np.nan)


def _log_slope(m: np.ndarray) -> np.ndarray:
    """Per row of m [B, n]: least-squares slope of log m over the index; NaN unless finite and positive."""
    B, n = m.shape
    ok = _positive_rows(m)
    if n < 2:
        return np.full(B, np.nan)
    logm = np.log(np.where(ok[:, None], m, 1.0))
    x = np.arange(n) - (n - 1) / 2
    return np.where(ok, (logm * x).sum(1) / (x**2).sum(), np.nan)


def source_members(trace: Any) -> np.ndarray:
    """[R, S] how many written sources (sublayer outputs, or the embedding) each column of each read
    sums: 1 for Full and PreNorm, a block's sublayers for Block; NaN where the read sees no column."""
    axis = trace.axis
    out = np.full((axis.n_reads, axis.n_sources), np.nan)
    for r in range(axis.n_reads):
        members = [len(m) for m in axis.members(r)]
        out[r, : len(members)] = members
    return out


def uniform_weights(trace: Any) -> np.ndarray:
    """[R, S] the uniform reference on the trace's own source axis: every written source the read
    sees gets the same coefficient, so a column of m of them holds m / k_r of the read (k_r
    counting the embedding and every sublayer output it sees). For Full and PreNorm this is 1/k_r
    per column; for Block it is PreNorm's implied weights grouped into Block's blocks, and also
    what a Block read with equal weights on its blocks gives (its members share the block's
    weight)."""
    m = source_members(trace)
    return m / np.nansum(m, axis=-1, keepdims=True)


def normalised_weights(trace: Any, coefficients: np.ndarray) -> np.ndarray:
    """w: a read's coefficients as shares of the read on the trace's own axis, [..., R, S].

    Each written source's coefficient c (the softmax weight of its column for AttnRes, 1 for
    PreNorm) times the written sources in that column, over their sum: w_i = c_i m_i / sum_j c_j m_j.
    Full and PreNorm: c / sum(c). Block: a block's members share its weight, so its column holds
    m_i of them. NaN stays NaN (unavailable); a read whose signed coefficients cancel (sum under
    :data:`~attnres_probe.numeric.CANCELLED` of their absolute sum) has none (NaN)."""
    return over_sum(np.asarray(coefficients, np.float64) * source_members(trace))


def _routing_rows(w: np.ndarray, mask: np.ndarray, R: int) -> dict[str, np.ndarray]:
    """Per window and read ([B, R] each): the means over tokens of distance, recent mass, entropy, the
    embedding's weight and the embedding against the other old sources, from the normalised
    weights w [B, P, R, S] (NaN = unavailable); and k [R]."""
    avail = ~np.isnan(w)
    k = avail.sum(-1)  # [B, P, R]
    pos = np.cumsum(avail, axis=-1, dtype=np.int32) - 1
    vals = np.where(avail, w, 0.0)
    has = k > 0
    dist = np.where(avail, k[..., None] - 1 - pos, 0)
    distance = np.where(has, (vals * dist).sum(-1), np.nan)
    recent = np.where(has, (vals * (avail & (pos == k[..., None] - 1))).sum(-1), np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.abs(vals)  # signed weights (HC, DenseFormer): the entropy of their magnitudes, as metrics.entropy
        p = p / p.sum(-1, keepdims=True)
        logp = np.log(np.where(p > 0, p, 1.0))
        h = -(np.where(p > 0, p, 0.0) * logp).sum(-1)
        h = np.where(k > 1, h / np.log(np.maximum(k, 2)), np.nan)
        old = avail & (pos >= 1) & (pos <= k[..., None] - 2)  # neither the embedding nor the most recent
        n_old = old.sum(-1)
        old_mean = np.where(n_old > 0, np.where(old, vals, 0.0).sum(-1) / np.maximum(n_old, 1), np.nan)
        embed = np.where(has, vals[..., 0], np.nan)
        embed_vs_old = np.where(k >= 3, embed - old_mean, np.nan)
    k_read = np.where(mask[..., None], k, 0).max(axis=(0, 1)) if mask.any() else np.zeros(R, int)
    return {
        "distance": _window_mean(distance, mask),
        "recent": _window_mean(recent, mask),
        "entropy": _window_mean(h, mask),
        "embed": _window_mean(embed, mask),
        "embed_vs_old": _window_mean(embed_vs_old, mask),
        "k": k_read,
    }


def _routing_values(route: dict[str, np.ndarray], read_labels: list[str]) -> dict[str, np.ndarray]:
    R = len(read_labels)
    choice = route["k"] >= 2
    deep = np.arange(R) >= R // 2
    attn = np.array([str(lab).endswith(".attn") for lab in read_labels])  # the read feeds an attention sublayer
    mlp = np.array([str(lab).endswith(".mlp") for lab in read_labels])
    return {
        "locality_distance": _row_nanmean(route["distance"], choice),
        "locality_recent_mass": _row_nanmean(route["recent"], choice),
        "mean_entropy": _row_nanmean(route["entropy"], choice),
        "embed_weight_deep": _row_nanmean(route["embed"], deep),
        "embed_vs_old_deep": _row_nanmean(route["embed_vs_old"], deep & (route["k"] >= 3)),
        "embed_weight_deep_attn": _row_nanmean(route["embed"], deep & attn),
        "embed_weight_deep_mlp": _row_nanmean(route["embed"], deep & mlp),
    }


def _metric_arrays(trace: Any, mask: np.ndarray, arrays: dict[str, np.ndarray], param_grad: np.ndarray | None) -> dict[str, np.ndarray]:
    """Every diagnostic and routing reference for each window of ``arrays`` ([B, P, ...] with ``mask``)."""
    B = mask.shape[0]
    R = len(trace.read_labels)
    L = R - 1
    c = np.asarray(arrays["depth_weights"], np.float64)
    w = normalised_weights(trace, c)
    out: dict[str, np.ndarray] = _routing_values(_routing_rows(w, mask, R), list(trace.read_labels))
    uni = np.broadcast_to(uniform_weights(trace), w.shape).copy()
    uni[np.isnan(w)] = np.nan  # the same sources as the model's own weights
    for name, value in _routing_values(_routing_rows(uni, mask, R), list(trace.read_labels)).items():
        out[reference_column(name)] = value
    deep = slice(R // 2, None)
    out["embed_contrib_deep"] = _row_nanmean(_window_mean(arrays["contrib"][..., 0], mask), deep)
    mix = mixture_rms(trace, arrays["rms_in"], c)
    out.update(profile_values(
        rms_out=_window_mean(arrays["rms_out"], mask)[:, 1 : L + 1],
        rms_mix=_window_mean(mix, mask)[:, :L],
        grad_out=_window_mean(arrays["grad_out"], mask)[:, 1 : L + 1],
        param_grad=None if param_grad is None else np.asarray(param_grad, np.float64).reshape(-1, L),
        n=B,
    ))
    out["mean_loss"] = _window_mean(arrays["loss"], mask)
    for name, fn in COMPUTE.items():  # diagnostics added with catalog.register: per token, then the window mean
        ctx = {"trace": trace, "mask": mask, "arrays": arrays}
        out[name] = _window_mean(np.asarray(fn(w, ctx), np.float64), mask)
        if reference_column(name) in REFERENCE_COLUMNS:
            out[reference_column(name)] = _window_mean(np.asarray(fn(uni, ctx), np.float64), mask)
    return {name: np.asarray(out[name], np.float64) for name in WINDOW_COLUMNS}


def profile_values(rms_out: np.ndarray, rms_mix: np.ndarray, grad_out: np.ndarray, param_grad: np.ndarray | None,
                   n: int) -> dict[str, np.ndarray]:
    """The diagnostics that are functions of depth profiles, for ``n`` rows of profiles:
    ``rms_out`` [n, L] (sublayer outputs' mean RMS), ``rms_mix`` [n, L] (the sublayer reads' mean
    mixture RMS), ``grad_out`` [n, L] (mean ||dL/dv_j|| at the sublayer outputs), ``param_grad``
    [n, L] (per-sublayer parameter-gradient norms; None: not available)."""
    out = {"rms_out_growth": _quarter_ratio(rms_out), "rms_out_log_slope": _log_slope(rms_out),
           "rms_mix_growth": _quarter_ratio(rms_mix)}
    out["act_grad_cv"], out["act_grad_max_min"] = _spread_rows(grad_out)
    out["act_grad_early_late"] = _quarter_ratio(grad_out, last_over_first=False)
    if param_grad is not None:
        attn, mlp = param_grad[:, 0::2], param_grad[:, 1::2]
        out["param_grad_cv"], out["param_grad_max_min"] = _spread_rows(np.sqrt(attn**2 + mlp**2))
        out["param_grad_attn_cv"], _ = _spread_rows(attn)
        out["param_grad_mlp_cv"], _ = _spread_rows(mlp)
    else:
        for name in ("param_grad_cv", "param_grad_max_min", "param_grad_attn_cv", "param_grad_mlp_cv"):
            out[name] = np.full(n, np.nan)
    return out


def mixture_rms(trace: Any, rms_in: np.ndarray, depth_weights: np.ndarray) -> np.ndarray:
    """rms(h_r / sum_i c_i) per token and read, [..., R]: what a read sees as a mixture (PreNorm: its sum over k;
    NaN where the coefficients cancel, as in :func:`normalised_weights`)."""
    return np.asarray(rms_in, np.float64) / row_sum(np.asarray(depth_weights, np.float64) * source_members(trace))


_USED = ("depth_weights", "contrib", "rms_in", "rms_out", "grad_out", "loss")


def window_metric_arrays(trace: DepthTrace) -> dict[str, np.ndarray]:
    """Every diagnostic of the catalog for each window (sequence) of ``trace``, and each routing
    diagnostic's uniform reference (:data:`WINDOW_COLUMNS`).

    Definitions: :data:`~attnres_probe.analysis.catalog.CATALOG`. Parameter-gradient diagnostics
    need the window's own parameter gradients, which only a one-window trace has; with several
    windows they are NaN.

    Returns:
        {column: float64 [B]}.
    """
    B = trace.tokens.shape[0]
    pg = np.asarray(trace.param_grad, np.float64)[None] if B == 1 else None
    return _metric_arrays(trace, trace.mask, {n: getattr(trace, n) for n in _USED}, pg)


def pooled_metrics(trace: DepthTrace) -> pd.Series:
    """Every diagnostic over every real token of ``trace`` at once: the windows' function applied to
    all their tokens as one window (the parameter gradients are the trace's own, from its one
    backward pass over every window). A one-window trace gives its window's values."""
    m = trace.mask
    arrays = {n: np.asarray(getattr(trace, n))[m][None] for n in _USED}  # [1, N, ...]
    values = _metric_arrays(trace, np.ones((1, int(m.sum())), bool), arrays, np.asarray(trace.param_grad, np.float64)[None])
    return pd.Series({n: float(v[0]) for n, v in values.items()}, name=trace.name)


def window_metrics(trace: DepthTrace) -> pd.DataFrame:
    """Every diagnostic (and routing reference) for each window of ``trace``: see :func:`window_metric_arrays`.

    Returns:
        DataFrame [B rows, one per window] with columns :data:`WINDOW_COLUMNS`.
    """
    values = window_metric_arrays(trace)
    return pd.DataFrame({name: values[name] for name in WINDOW_COLUMNS})


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


def _varies_by_token(weights: np.ndarray) -> bool:
    """Whether a sequence's depth weights [n, R, S] differ between its tokens (beyond float32 rounding)."""
    w = np.asarray(weights, np.float64)
    if w.shape[0] < 2:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        spread = np.nanmax(np.abs(w - w[:1]))
        scale = np.nanmax(np.abs(w))
    return bool(np.isfinite(spread) and spread > 4 * np.finfo(np.float32).eps * max(float(scale), 1e-30))


def informative_token(traces, limit: int | None = None) -> tuple[int, str]:
    """The token a page opens on, and why: in sequence 0, the token whose depth weights depart furthest
    from uniform, averaged over the models whose weights depend on the token (AttnRes, dynamic
    Hyper-Connections / mHC; not PreNorm, DenseFormer or static HC, whose weights are the same at
    every token) (per read, the total-variation distance between its normalised weights and the
    uniform weights on the same sources, PreNorm's implied weights; mean over reads). Without such a
    model, the last token (it sees the most context).
    ``limit``: choose among the first ``limit`` tokens only (a page that stores only those).

    Returns:
        (position, a sentence saying which token and why)
    """
    traces = list(traces)
    first = traces[0]
    n = int(first.mask[0].sum())
    if n == 0:
        return 0, ""
    if limit is not None:
        n_all, n = n, max(1, min(n, int(limit)))
    else:
        n_all = n
    routed = [t for t in traces if t.residual != "prenorm" and t.depth_weights is not None
              and int(t.mask[0].sum()) == n_all and _varies_by_token(t.depth_weights[0, :n])]
    if not routed or n == 1:
        return n - 1, f"Opened on the last token ({n - 1}): it sees the most context." if n > 1 else ""
    distance = np.zeros(n)
    for t in routed:
        w = normalised_weights(t, np.asarray(t.depth_weights[0, :n], np.float64))  # [n, R, S]
        tv = 0.5 * np.nansum(np.abs(w - uniform_weights(t)), axis=-1)  # [n, R]
        distance += tv.mean(axis=-1) / len(routed)
    pos = int(np.argmax(distance))
    tok = first.str_tokens[0][pos] if pos < len(first.str_tokens[0]) else ""
    models = ", ".join(t.name for t in routed)
    names = {t.name for t in routed}
    fixed = [t.name for t in traces if t.residual != "prenorm" and t.name not in names and t.depth_weights is not None
             and int(t.mask[0].sum()) == n_all]  # the same tokens, weights that do not vary by token
    left_out = (f" ({', '.join(fixed)}: {'its weights are' if len(fixed) == 1 else 'their weights are'} the same at "
                "every token)") if fixed else ""
    return pos, (f"Opened on token {pos} '{tok}', where {models} route furthest from uniform (mean total-variation "
                 f"distance {distance[pos]:.2f} over reads; 0 = PreNorm's uniform mixture, 1 = no overlap for "
                 f"non-negative weights){left_out}. "
                 "Click any token to route it.")
from attnres_probe.analysis import published as _published  # noqa: E402,F401  (registers the diagnostics others publish)
