"""Depth diagnostics computed from a :class:`~attnres_probe.trace.DepthTrace`.

Every function reads only the trace's arrays (nothing touches a model) and returns pandas
objects labelled by read (or by metric name for whole-model numbers). Averages run over the
real tokens of every sequence (``trace.mask``); unavailable cells (NaN) are never counted as
zero: a read r has k_r available sources, the non-NaN columns of its row.

Which routing array a metric reads (``kind``):

- ``"weights"``: the softmax depth weights a_i (AttnRes). For PreNorm they are unit
  coefficients, which say nothing about routing.
- ``"contrib"``: contribution shares c_i = <coef_i v_i, h> / |h|^2 (sum to 1 per read, may be
  negative), defined for all three architectures.
- ``"auto"`` (default): weights for AttnRes (full / block), contrib for PreNorm, so that the
  baseline is measured with its comparable stand-in.

``FORMULAS`` maps every metric name used in the frames below (and in :func:`summary` /
:func:`compare`) to its formula, for hover cards and reports.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

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

FORMULAS: dict[str, str] = {
    # per read (locality)
    "distance": "E[d] = Σ_i a_i·(k_r − 1 − i), i = column among the k_r available sources of read r "
    "(most recent = distance 0); mean over real tokens",
    "recent_mass": "a_{k_r−1}: weight on the most recent available source; mean over real tokens",
    "sources": "k_r: number of sources available to read r",
    # per read (retention)
    "embed_weight": "a_0: depth weight on the embedding (source 0); mean over real tokens; NaN for PreNorm",
    "embed_contrib": "c_0 = ⟨coef_0·v_0, h⟩ / ‖h‖²: contribution share of the embedding; mean over real tokens",
    # per read (entropy)
    "entropy": "H(p)/log k_r with H(p) = −Σ_i p_i log p_i, p = a (weights) or p = |c|/Σ|c| (contrib); "
    "NaN where k_r = 1; mean over real tokens",
    # gradient uniformity
    "param_grad_cv": "std/mean (population std) of the L per-sublayer parameter-gradient norms ‖∂Loss/∂θ_j‖",
    "param_grad_max_min": "max_j / min_j of the L per-sublayer parameter-gradient norms",
    "act_grad_cv": "std/mean of g_r = mean over tokens of ‖∂Loss/∂h_r‖, over the L sublayer reads",
    "act_grad_max_min": "max_r g_r / min_r g_r over the L sublayer reads",
    # magnitude growth
    "rms_in_growth": "m_{L−1} / m_0, m_r = mean over tokens of rms(h_r) at sublayer read r",
    "rms_in_log_slope": "least-squares slope of log m_r against r = 0 … L−1 (natural log, per read)",
    "rms_in_max_min": "max_r m_r / min_r m_r over the L sublayer reads (how far the magnitude swings, not only end to end)",
    "rms_in_peak": "max_r m_r: the largest mean rms(h_r) over the L sublayer reads",
    "rms_out_growth": "o_L / o_1, o_j = mean over tokens of rms(v_j), v_1 … v_L the sublayer outputs",
    "rms_out_log_slope": "least-squares slope of log o_j against j = 1 … L (natural log, per sublayer)",
    # summary headline numbers
    "locality_distance": "mean over reads with k_r ≥ 2 of the per-read expected depth distance E[d]",
    "locality_recent_mass": "mean over reads with k_r ≥ 2 of the mass on the most recent available source",
    "embed_weight_deep": "mean of the per-read embedding weight a_0 over the deepest half of reads (r ≥ ⌊R/2⌋)",
    "embed_contrib_deep": "mean of the per-read embedding contribution c_0 over the deepest half of reads (r ≥ ⌊R/2⌋)",
    "mean_entropy": "mean over reads with k_r ≥ 2 of the normalised entropy H(p)/log k_r",
    "mean_loss": "mean next-token loss over real tokens with a target",
}

# metrics compare() sets against the PreNorm baseline as model / baseline (the rest: model − baseline);
# analysis.verdicts.EXPECTED is the owner of this choice
RATIO_METRICS = (
    "param_grad_cv",
    "param_grad_max_min",
    "act_grad_cv",
    "act_grad_max_min",
    "rms_in_growth",
    "rms_in_max_min",
    "rms_in_peak",
    "rms_out_growth",
)


def resolve_kind(trace: DepthTrace, kind: str = "auto") -> str:
    """``"auto"`` -> ``"contrib"`` for PreNorm, ``"weights"`` for AttnRes; else ``kind`` itself.

    Raises:
        ValueError: ``kind`` is not ``"auto"``, ``"weights"`` or ``"contrib"``.
    """
    if kind == "auto":
        return "contrib" if trace.residual == "prenorm" else "weights"
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
    a = _real(trace, trace.cube(resolve_kind(trace, kind)))
    avail = ~np.isnan(a)
    return a, avail, avail.sum(-1)


# -- per-read metrics ---------------------------------------------------------------------
def locality(trace: DepthTrace, kind: str = "auto") -> pd.DataFrame:
    """How far back in depth each read looks.

    For read r with k_r available sources (the non-NaN columns, in column order, i = 0 … k_r−1):

        distance    E[d] = Σ_i a_i · (k_r − 1 − i)       (most recent source: distance 0)
        recent_mass a_{k_r − 1}                          (mass on the most recent source)

    computed per token, then averaged over real tokens. ``kind="auto"`` uses the depth weights
    for AttnRes and the contribution shares c for PreNorm (raw c, which sums to one but may be
    negative, so E[d] is a signed-weight mean there).

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

        embed_weight   mean over real tokens of a_0 (NaN for PreNorm: unit coefficients)
        embed_contrib  mean over real tokens of c_0 = ⟨coef_0·v_0, h⟩ / ‖h‖²

    Returns:
        DataFrame indexed by read label, columns ``embed_weight``, ``embed_contrib``.
    """
    R = len(trace.read_labels)
    if trace.residual == "prenorm":
        weight = np.full(R, np.nan)
    else:
        weight = token_mean(_real(trace, trace.depth_weights[..., 0]))
    contrib = token_mean(_real(trace, trace.contrib[..., 0]))
    return pd.DataFrame({"embed_weight": weight, "embed_contrib": contrib}, index=_read_index(trace))


def entropy(trace: DepthTrace, kind: str = "auto") -> pd.Series:
    """Normalised routing entropy per read: 1 = uniform over the available sources, 0 = one source.

        H(p) / log k_r,   H(p) = −Σ_i p_i log p_i   (0·log 0 = 0)

    with p = a / Σa for weights, and p = |c| / Σ|c| for contribution shares (which may be
    negative, so their absolute values are normalised). NaN where k_r = 1 (no choice to make).
    Computed per token, then averaged over real tokens; ``kind="auto"`` as in :func:`locality`.

    Returns:
        Series ``entropy`` indexed by read label.
    """
    kind = resolve_kind(trace, kind)
    a, avail, k = _routing(trace, kind)
    p = np.abs(np.where(avail, a, 0.0)) if kind == "contrib" else np.where(avail, a, 0.0)
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
def _spread(values: np.ndarray) -> tuple[float, float]:
    """(std/mean, max/min) of a vector; NaN unless every entry is finite."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or not np.isfinite(v).all():
        return float("nan"), float("nan")
    mean, lo = v.mean(), v.min()
    cv = float(v.std() / mean) if mean != 0 else float("nan")
    ratio = float(v.max() / lo) if lo > 0 else float("nan")
    return cv, ratio


def gradient_uniformity(trace: DepthTrace) -> pd.Series:
    """How evenly gradients spread over depth (1 / 0 = perfectly even).

        param_grad_cv       std/mean (population std) of the L parameter-gradient norms
        param_grad_max_min  max/min of the same
        act_grad_cv         std/mean of g_r = mean over real tokens of ‖∂Loss/∂h_r‖, r = 0 … L−1
        act_grad_max_min    max/min of the same

    NaN when the trace has no gradients (recorded without backward), or any of the L values
    is not finite.

    Returns:
        Series indexed by the four names above.
    """
    L = len(trace.sublayer_labels)
    p_cv, p_ratio = _spread(trace.param_grad)
    act = token_mean(_real(trace, trace.grad_in))[:L]
    a_cv, a_ratio = _spread(act)
    return pd.Series(
        {"param_grad_cv": p_cv, "param_grad_max_min": p_ratio, "act_grad_cv": a_cv, "act_grad_max_min": a_ratio},
        name=trace.name,
    )


def _growth(m: np.ndarray) -> tuple[float, float, float, float]:
    """(last/first, least-squares slope of log m over index, max/min, max)."""
    m = np.asarray(m, dtype=np.float64)
    if m.size == 0 or not (np.isfinite(m).all() and (m > 0).all()):
        return float("nan"), float("nan"), float("nan"), float("nan")
    ratio = float(m[-1] / m[0])
    slope = float(np.polyfit(np.arange(m.size), np.log(m), 1)[0]) if m.size > 1 else float("nan")
    return ratio, slope, float(m.max() / m.min()), float(m.max())


def magnitude_growth(trace: DepthTrace) -> pd.Series:
    """How hidden-state magnitude grows with depth.

        rms_in_growth      m_{L−1} / m_0, m_r = mean over real tokens of rms(h_r), the L sublayer reads
        rms_in_log_slope   least-squares slope of log m_r over r = 0 … L−1 (natural log per read)
        rms_in_max_min     max_r m_r / min_r m_r (a stream can end where it began and still swing)
        rms_in_peak        max_r m_r
        rms_out_growth     o_L / o_1, o_j = mean over real tokens of rms(v_j), the L sublayer outputs
                           (the embedding v_0 left out)
        rms_out_log_slope  least-squares slope of log o_j over j = 1 … L

    PreNorm's growing stream shows as a ratio well above one and a positive slope.

    Returns:
        Series indexed by the six names above (NaN where a mean is not finite and positive).
    """
    L = len(trace.sublayer_labels)
    m_in = token_mean(_real(trace, trace.rms_in))[:L]
    m_out = token_mean(_real(trace, trace.rms_out))[1 : L + 1]
    in_ratio, in_slope, in_max_min, in_peak = _growth(m_in)
    out_ratio, out_slope, _, _ = _growth(m_out)
    return pd.Series(
        {
            "rms_in_growth": in_ratio,
            "rms_in_log_slope": in_slope,
            "rms_in_max_min": in_max_min,
            "rms_in_peak": in_peak,
            "rms_out_growth": out_ratio,
            "rms_out_log_slope": out_slope,
        },
        name=trace.name,
    )


def summary(trace: DepthTrace) -> pd.Series:
    """Headline numbers of one trace (each name is a key of :data:`FORMULAS`).

    ``locality_distance``, ``locality_recent_mass`` and ``mean_entropy`` average over reads with
    at least two sources (read 0 has only the embedding); ``embed_weight_deep`` and
    ``embed_contrib_deep`` over the deepest half of reads, r ≥ ⌊R/2⌋ (final read included).
    Routing numbers use ``kind="auto"`` (weights for AttnRes, contrib for PreNorm).

    Returns:
        Series named by the trace, indexed by metric name.
    """
    loc = locality(trace)
    choice = loc["sources"].to_numpy() >= 2
    ret = embedding_retention(trace)
    deep = slice(len(trace.read_labels) // 2, None)
    ent = entropy(trace)
    loss = _real(trace, trace.loss)
    return pd.Series(
        {
            "locality_distance": _nanmean(loc["distance"].to_numpy()[choice]),
            "locality_recent_mass": _nanmean(loc["recent_mass"].to_numpy()[choice]),
            "embed_weight_deep": _nanmean(ret["embed_weight"].to_numpy()[deep]),
            "embed_contrib_deep": _nanmean(ret["embed_contrib"].to_numpy()[deep]),
            "mean_entropy": _nanmean(ent.to_numpy()[choice]),
            **gradient_uniformity(trace).to_dict(),
            **magnitude_growth(trace).to_dict(),
            "mean_loss": _nanmean(loss),
        },
        name=trace.name,
    )


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
    :class:`~attnres_probe.stats.CorpusStats` recorded. For each model and metric the estimate
    is the mean over windows with a percentile-bootstrap interval; for each AttnRes model
    against the baseline (the first PreNorm model unless ``baseline`` names one) it is the mean
    paired difference, or for spreads, growths and peaks (:data:`RATIO_METRICS`) the ratio of
    means, on the windows both recorded, with its interval and the verdict of
    :func:`attnres_probe.analysis.verdicts.verdict` against the paper's direction. With one
    window there is no interval (the note says so) and every verdict is "inconclusive".

    The bootstrap resamples documents (a cluster bootstrap; windows of one document together):
    a corpus's windows carry their document, a trace's sequences are one document each, except a
    text recorded in context-sized windows (``meta["windows"]``), which is one document. Under
    ten documents the note says the intervals are rough. Locality and entropy read each model's
    routing array (``kind="auto"``: weights for AttnRes, contribution shares for PreNorm); the
    ``basis`` column names it, and a comparison of the two says so in its note.

    Args:
        *items: DepthTraces and/or CorpusStats, one per model.
        names: display names (default each item's name; duplicates get " (2)", ...).
        n_resamples: bootstrap resamples (shared by every metric and model).
        seed: seeds the resampling; the same inputs and seed give the same frame.
        level: interval coverage.
        baseline: name of the model to compare against (default: the first PreNorm one).

    Returns:
        The tidy frame of :func:`attnres_probe.analysis.compare.compare_windows`: columns
        metric, model, baseline, comparison ("value" / "difference" / "ratio"), basis, estimate,
        low, high, pooled, windows, documents, held, expected, verdict, note.
    """
    from attnres_probe.analysis.compare import Windows, compare_windows
    from attnres_probe.stats import CorpusStats

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
