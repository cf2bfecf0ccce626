"""Depth diagnostics computed from a :class:`~attnres_probe.trace.DepthTrace`.

Every function reads only the trace's arrays (nothing touches a model) and returns pandas
objects labelled by read (or by metric name for whole-model numbers). Averages run over the
real tokens of every sequence (``trace.mask``); unavailable cells (NaN) are never counted as
zero: a read r has k_r available sources, the non-NaN columns of its row.

Which routing array a metric reads (``kind``):

- ``"weights"`` (and ``"auto"``, the default): the normalised weights w = c m / sum(c m) on the
  model's own source axis (:func:`attnres_probe.analysis.windows.normalised_weights`): AttnRes
  its softmax weights (Block: a block's members share its weight), PreNorm its implied uniform
  weights 1/k. The same quantity for every model (docs/design.md, "Statistics").
- ``"contrib"``: contribution shares c_i = <coef_i v_i, h> / |h|^2 (sum to 1 per read, may be
  negative), defined for every model.

Every whole-model number is a diagnostic of :data:`attnres_probe.analysis.catalog.CATALOG`,
computed by :mod:`attnres_probe.analysis.windows` (one implementation; :func:`summary` is its
pooled value). ``FORMULAS`` maps every name used in the frames below to its formula, for hover
cards and reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe.analysis.catalog import CATALOG, LiveMapping
from attnres_probe.analysis.windows import WINDOW_METRICS, normalised_weights, pooled_metrics
from attnres_probe.numeric import token_mean
from attnres_probe.trace import DepthTrace, unique_names

__all__ = [
    "FORMULAS",
    "compare",
    "embedding_retention",
    "entropy",
    "gradient_uniformity",
    "locality",
    "magnitude_growth",
    "read_profile",
    "resolve_kind",
    "source_profile",
    "summary",
]

_READ_FORMULAS: dict[str, str] = {
    # per read (locality), on the normalised weights w (kind="weights") or the shares c
    "distance": "E[d] = Σ_i w_i·(k_r − 1 − i), i = column among the k_r available sources of read r "
    "(most recent = distance 0); mean over real tokens",
    "recent_mass": "w_{k_r−1}: weight on the most recent available source; mean over real tokens",
    "sources": "k_r: number of sources available to read r",
    # per read (retention)
    "embed_weight": "w_0: normalised weight of the embedding (source 0; PreNorm: 1/k_r); mean over real tokens",
    "embed_contrib": "c_0 = ⟨coef_0·v_0, h⟩ / ‖h‖²: contribution share of the embedding; mean over real tokens",
    # per read (entropy)
    "entropy": "H(p)/log k_r with H(p) = −Σ_i p_i log p_i, p = w (weights) or p = |c|/Σ|c| (contrib); "
    "NaN where k_r = 1; mean over real tokens",
}
# the per-read formulas, then every diagnostic of the catalog (read afresh, so registered ones show)
FORMULAS: Mapping[str, str] = LiveMapping(lambda: {**_READ_FORMULAS, **{n: d.formula for n, d in CATALOG.items()}})


def resolve_kind(trace: DepthTrace, kind: str = "auto") -> str:
    """``"auto"`` -> ``"weights"`` (the normalised weights, for every model); else ``kind`` itself.

    Raises:
        ValueError: ``kind`` is not ``"auto"``, ``"weights"`` or ``"contrib"``.
    """
    if kind == "auto":
        return "weights"
    if kind not in ("weights", "contrib"):
        raise ValueError(f"kind is {kind!r}; routing metrics accept 'auto', 'weights' or 'contrib'")
    return kind


# -- helpers ------------------------------------------------------------------------------
def _nanmean(values: np.ndarray) -> float:
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else float("nan")


def _real(trace: DepthTrace, arr: np.ndarray) -> np.ndarray:
    """Real-token rows of a [B, P, ...] array as float64 [N, ...]."""
    return np.asarray(arr, dtype=np.float64)[trace.mask]


def _read_index(trace: DepthTrace) -> pd.Index:
    return pd.Index(trace.read_labels, name="read")


def _routing(trace: DepthTrace, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a [N, R, S] with NaN, avail [N, R, S], k [N, R]) for the real tokens."""
    kind = resolve_kind(trace, kind)
    a = _real(trace, normalised_weights(trace, trace.depth_weights) if kind == "weights" else trace.contrib)
    avail = ~np.isnan(a)
    return a, avail, avail.sum(-1)


# -- per-read metrics ---------------------------------------------------------------------
def locality(trace: DepthTrace, kind: str = "auto") -> pd.DataFrame:
    """How far back in depth each read looks.

    For read r with k_r available sources (the non-NaN columns, in column order, i = 0 … k_r−1):

        distance    E[d] = Σ_i a_i · (k_r − 1 − i)       (most recent source: distance 0)
        recent_mass a_{k_r − 1}                          (mass on the most recent source)

    computed per token, then averaged over real tokens, on the normalised weights w (``kind``
    "auto" or "weights"; PreNorm: uniform) or the contribution shares c (``"contrib"``: raw c,
    which sums to one but may be negative, so E[d] is a signed-weight mean there).

    Returns:
        DataFrame indexed by read label, columns ``distance``, ``recent_mass``, ``sources`` (k_r).
    """
    a, avail, k = _routing(trace, kind)  # [N, R, S], [N, R]
    pos = np.cumsum(avail, axis=-1) - 1  # column's index among the available ones
    dist = np.where(avail, k[..., None] - 1 - pos, 0)
    vals = np.where(avail, a, 0.0)
    has = k > 0
    distance = np.where(has, (vals * dist).sum(-1), np.nan)
    recent = np.where(has, (vals * (avail & (pos == k[..., None] - 1))).sum(-1), np.nan)
    sources = k.max(axis=0) if k.shape[0] else np.zeros(len(trace.read_labels), int)
    return pd.DataFrame(
        {"distance": token_mean(distance), "recent_mass": token_mean(recent), "sources": sources},
        index=_read_index(trace),
    )


def embedding_retention(trace: DepthTrace) -> pd.DataFrame:
    """How much of each read still comes from the embedding (source 0).

        embed_weight   mean over real tokens of w_0, the embedding's normalised weight (PreNorm: 1/k_r)
        embed_contrib  mean over real tokens of c_0 = ⟨coef_0·v_0, h⟩ / ‖h‖²

    Returns:
        DataFrame indexed by read label, columns ``embed_weight``, ``embed_contrib``.
    """
    weight = token_mean(_real(trace, normalised_weights(trace, trace.depth_weights)[..., 0]))
    contrib = token_mean(_real(trace, trace.contrib[..., 0]))
    return pd.DataFrame({"embed_weight": weight, "embed_contrib": contrib}, index=_read_index(trace))


def entropy(trace: DepthTrace, kind: str = "auto") -> pd.Series:
    """Normalised routing entropy per read: 1 = uniform over the available sources, 0 = one source.

        H(p) / log k_r,   H(p) = −Σ_i p_i log p_i   (0·log 0 = 0)

    with p = |a| / Σ|a| for a the normalised weights or the contribution shares: p = w for
    non-negative weights (AttnRes, PreNorm, mHC); shares, and the coefficients of Hyper-Connections
    and DenseFormer, may be negative, so their absolute values are normalised. NaN where k_r = 1
    (no choice to make).
    Computed per token, then averaged over real tokens; ``kind="auto"`` as in :func:`locality`.

    Returns:
        Series ``entropy`` indexed by read label.
    """
    kind = resolve_kind(trace, kind)
    a, avail, k = _routing(trace, kind)
    p = np.abs(np.where(avail, a, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        p = p / p.sum(-1, keepdims=True)
        h = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)
        h = np.where(k > 1, h / np.log(np.maximum(k, 2)), np.nan)
    return pd.Series(token_mean(h), index=_read_index(trace), name="entropy")


def read_profile(trace: DepthTrace) -> pd.DataFrame:
    """Per-read means over real tokens of ``rms_in`` (RMS of the mixed input h_r) and ``grad_in``
    (‖∂Loss/∂h_r‖, NaN without gradients).

    Returns:
        DataFrame indexed by read label (R rows), columns ``rms_in``, ``grad_in``.
    """
    return pd.DataFrame(
        {"rms_in": token_mean(_real(trace, trace.rms_in)), "grad_in": token_mean(_real(trace, trace.grad_in))},
        index=_read_index(trace),
    )


def source_profile(trace: DepthTrace) -> pd.DataFrame:
    """Per written source (embed, then every sublayer output): mean over real tokens of
    ``rms_out`` = rms(v_j), and the sublayer's parameter-gradient norm ``param_grad`` (NaN for
    the embedding row and without gradients).

    Returns:
        DataFrame indexed by ``["embed", "L0.attn", ...]`` (L+1 rows), columns ``rms_out``, ``param_grad``.
    """
    return pd.DataFrame(
        {
            "rms_out": token_mean(_real(trace, trace.rms_out)),
            "param_grad": np.concatenate([[np.nan], np.asarray(trace.param_grad, dtype=np.float64)]),
        },
        index=pd.Index(["embed", *trace.sublayer_labels], name="source"),
    )


# -- whole-model numbers ------------------------------------------------------------------
GRADIENT_NAMES = ("param_grad_cv", "param_grad_max_min", "param_grad_attn_cv", "param_grad_mlp_cv",
                  "act_grad_cv", "act_grad_max_min", "act_grad_early_late")
MAGNITUDE_NAMES = ("rms_out_growth", "rms_out_log_slope", "rms_mix_growth")


def gradient_uniformity(trace: DepthTrace) -> pd.Series:
    """How evenly gradients spread over depth: the gradient diagnostics of the catalog
    (:data:`GRADIENT_NAMES`; formulas in :data:`FORMULAS`), over every real token of the trace.

    Parameter gradients per transformer block (and per attention and MLP sublayer); activation
    gradients at every sublayer output, ||dL/dv_j||. NaN without gradients.
    """
    return pooled_metrics(trace)[list(GRADIENT_NAMES)]


def magnitude_growth(trace: DepthTrace) -> pd.Series:
    """How magnitudes grow with depth: the magnitude diagnostics of the catalog
    (:data:`MAGNITUDE_NAMES`): what the sublayers write (rms(v_j)) and what the reads see as a
    mixture (rms(h_r / Σc)), over every real token of the trace."""
    return pooled_metrics(trace)[list(MAGNITUDE_NAMES)]


def summary(trace: DepthTrace) -> pd.Series:
    """Every diagnostic of the catalog over every real token of ``trace`` at once (the same
    function as for one window: :func:`attnres_probe.analysis.windows.pooled_metrics`).

    Returns:
        Series named by the trace, indexed by diagnostic name.
    """
    return pooled_metrics(trace)[list(WINDOW_METRICS)]


def compare(
    *items: DepthTrace | Any,
    names: list[str] | None = None,
    n_resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    baseline: str | None = None,
) -> pd.DataFrame:
    """Every headline metric of several models with bootstrap intervals over windows, and each
    model set against the PreNorm baseline with a paired interval and a verdict.

    A *window* is one sequence of a trace (a trace of one prompt is one window) or one window a
    :class:`~attnres_probe.corpus.stats.CorpusStats` recorded. For each model and metric the estimate
    is the mean over windows with a percentile-bootstrap interval; for each AttnRes model
    against the baseline (the first PreNorm model unless ``baseline`` names one) it is the mean
    paired difference, or for spreads and growths (the catalog's ``compare="ratio"``) the ratio of
    means, on the windows both recorded, with its interval and the verdict of
    :func:`attnres_probe.analysis.verdicts.verdict` against the paper's direction. With one
    window there is no interval (the note says so) and every verdict is "inconclusive".

    The bootstrap resamples documents (a cluster bootstrap; windows of one document together):
    a corpus's windows carry their document, a trace's sequences are one document each, except a
    text recorded in context-sized windows (``meta["windows"]``), which is one document. Under
    ten documents the note says the intervals are rough. Routing diagnostics read every model's
    normalised weights and are compared with the uniform reference on the model's own source
    axis (PreNorm's implied weights grouped as the model groups its sources: Block in block
    units); the ``reference`` column holds it beside each value.

    Args:
        *items: DepthTraces and/or CorpusStats, one per model.
        names: display names (default each item's name; duplicates get " (2)", ...).
        n_resamples: bootstrap resamples (shared by every metric and model).
        seed: seeds the resampling; the same inputs and seed give the same frame.
        level: interval coverage.
        baseline: name of the model to compare against (default: the first PreNorm one).

    Returns:
        The tidy frame of :func:`attnres_probe.analysis.compare.compare_windows`: columns
        metric, model, baseline, comparison ("value" / "difference" / "ratio"), basis, unit,
        reference, estimate, low, high, pooled, windows, documents, held, expected, verdict, note.
    """
    from attnres_probe.analysis.compare import Windows, compare_windows
    from attnres_probe.corpus.stats import CorpusStats

    if not items:
        raise ValueError("compare() needs at least one DepthTrace or CorpusStats")
    if names is not None and len(names) != len(items):
        raise ValueError(f"names has {len(names)} entries for {len(items)} models; give one name per model")
    cols = unique_names(list(names) if names is not None else [_item_name(t) for t in items])
    windows = []
    for item, name in zip(items, cols):
        if isinstance(item, DepthTrace):
            windows.append(Windows.of_trace(item, name))
        elif isinstance(item, CorpusStats):
            windows.append(Windows.of_stats(item, name))
        else:
            raise TypeError(f"compare() takes DepthTrace or CorpusStats objects; got {type(item).__name__}")
    return compare_windows(windows, n_resamples=n_resamples, seed=seed, level=level, baseline=baseline)


def _item_name(item: Any) -> str:
    return item.name if hasattr(item, "name") else str(item)
