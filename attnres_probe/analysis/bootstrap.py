"""Bootstrap intervals over windows, vectorised with NumPy.

One resampling plan serves every metric and every model: :func:`resample_counts` draws
``n_resamples`` resamples of ``n`` windows (with replacement) as a count matrix
C [n_resamples, n], C[b, i] = how often window i is in resample b. A resampled mean of any
per-window column v is then (C @ v) / (C @ 1), so all metrics of all models cost one matrix
product, and paired comparisons of two models use the same resamples (same C) for both.

Windows of one document are not independent (they share a topic, a style, a length), so when
windows carry document ids the resampling unit is the document (a cluster bootstrap):
:func:`cluster_counts` resamples documents with replacement and gives every window the count of
its document, so each resample takes all windows of the documents it drew. With one window per
document it is the plain window bootstrap, count for count.

Intervals are percentile intervals: the (1 − level)/2 and (1 + level)/2 quantiles of the
resampled statistic. Windows where a value is NaN are left out of that value's mean (a
resample holding none of the valid windows gives NaN, which the quantiles skip).

    C = resample_counts(len(a), n_resamples=1000, seed=0)    # or Resamples(...): the same, in chunks
    C = cluster_counts(docs, n_resamples=1000, seed=0)       # by document: docs[i] = window i's document
    est, lo, hi = mean_interval(a, C)
    est, lo, hi = paired_interval(a, b, C, kind="ratio")
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = [
    "DEFAULT_LEVEL",
    "FEW_DOCUMENTS",
    "Resamples",
    "cluster_counts",
    "DEFAULT_RESAMPLES",
    "mean_interval",
    "mean_intervals",
    "paired_interval",
    "paired_intervals",
    "resample_counts",
    "resampled_means",
    "unpaired_interval",
]

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95
FEW_DOCUMENTS = 10  # below this many documents an interval rests on too few independent units: pages warn
# (benchmarks/bootstrap_coverage.py measures a nominal 95% cluster-bootstrap interval's coverage at 0.86-0.89
# with 8 documents and 0.88-0.92 with 10, within 4 points of its large-sample 0.91-0.92: docs/benchmarks.md)


def resample_counts(n: int, n_resamples: int = DEFAULT_RESAMPLES, seed: int | np.random.Generator = 0) -> np.ndarray:
    """Counts of ``n_resamples`` bootstrap resamples of ``n`` windows: int [n_resamples, n], rows sum to n.

    Seeded (``seed`` an int or a ``numpy.random.Generator``): the same arguments give the same counts.

    Raises:
        ValueError: ``n_resamples`` < 1 or ``n`` < 0.
    """
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, (int, np.integer)) or n_resamples < 1:
        raise ValueError(f"n_resamples must be a positive integer; got {n_resamples!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    if n == 0:
        return np.zeros((int(n_resamples), 0), np.int64)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(int(n_resamples), n))  # (n_resamples, n)
    idx += (np.arange(n_resamples) * n)[:, None]
    return np.bincount(idx.ravel(), minlength=int(n_resamples) * n).reshape(int(n_resamples), n)


def _groups(groups) -> tuple[np.ndarray, int]:
    """(index of each window's document among the sorted distinct documents, number of documents)."""
    g = np.asarray(groups)
    if g.ndim != 1:
        raise ValueError(f"groups must be one document id per window; got shape {g.shape}")
    if g.size == 0:
        return np.zeros(0, np.int64), 0
    uniq, inv = np.unique(g, return_inverse=True)
    return inv.astype(np.int64), len(uniq)


def cluster_counts(groups, n_resamples: int = DEFAULT_RESAMPLES, seed: int | np.random.Generator = 0) -> np.ndarray:
    """Counts of a cluster bootstrap: ``n_resamples`` resamples of the documents (with replacement),
    each window counted as often as its document was drawn: int [n_resamples, n].

    Args:
        groups: the document id of each of the n windows (any sortable ids; the order of the
            distinct ids, not of the windows, fixes which document each draw picks).
        n_resamples, seed: as :func:`resample_counts` (the documents are drawn with it, so one
            window per document gives exactly its counts).
    """
    inv, n_docs = _groups(groups)
    return resample_counts(n_docs, n_resamples, seed)[:, inv]


class Resamples:
    """The counts of :func:`resample_counts`, drawn chunk by chunk so memory stays bounded.

    A count matrix has ``n_resamples x n`` entries (8 GB for 1,000 resamples of a million
    windows); this draws at most ``max_cells`` entries at a time, from one seeded generator,
    and every function here that takes ``counts`` accepts it in place of the matrix.

    Args:
        n: windows.
        n_resamples: resamples.
        seed: an int (or a ``numpy.random.Generator``).
        max_cells: the largest chunk, in matrix entries.
        groups: the document id of each window: resample documents (:func:`cluster_counts`);
            None resamples windows (:func:`resample_counts`).
    """

    def __init__(self, n: int, n_resamples: int = DEFAULT_RESAMPLES, seed: int | np.random.Generator = 0,
                 max_cells: int = 1 << 23, groups=None):
        resample_counts(0, n_resamples)  # validates n_resamples
        if n < 0:
            raise ValueError(f"n must be >= 0; got {n}")
        self.n, self.n_resamples, self.seed = int(n), int(n_resamples), seed
        self.chunk = max(1, min(self.n_resamples, max_cells // max(self.n, 1)))
        self.inv, self.n_docs = (np.arange(self.n), self.n) if groups is None else _groups(groups)
        if len(self.inv) != self.n:
            raise ValueError(f"groups has {len(self.inv)} entries for {self.n} windows")

    def chunks(self):
        """Count matrices [k, n] whose rows, in order, are the ``n_resamples`` resamples."""
        rng = self.seed if isinstance(self.seed, np.random.Generator) else np.random.default_rng(self.seed)
        done = 0
        while done < self.n_resamples:
            k = min(self.chunk, self.n_resamples - done)
            yield resample_counts(self.n_docs, k, rng)[:, self.inv]
            done += k

    def matrix(self) -> np.ndarray:
        """All resamples at once: int [n_resamples, n] (what :func:`cluster_counts` gives)."""
        return np.concatenate(list(self.chunks()), axis=0)


def _chunks(counts):
    return counts.chunks() if isinstance(counts, Resamples) else (counts,)


def _apply(counts, fn) -> np.ndarray:
    """fn(count chunk as float64) for every chunk, stacked along the resample axis."""
    return np.concatenate([fn(c.astype(np.float64)) for c in _chunks(counts)], axis=0)


def resampled_means(values: np.ndarray, counts: np.ndarray | Resamples) -> np.ndarray:
    """Resampled means of each column of ``values`` [n, M] (or [n]) under ``counts`` [K, n]: [K, M] (or [K]).

    NaN entries are left out of their column's means; a resample with no valid entry gives NaN.
    """
    v = np.asarray(values, np.float64)
    flat = v.ndim == 1
    v = v[:, None] if flat else v
    ok = np.isfinite(v)
    v0, okf = np.where(ok, v, 0.0), ok.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = _apply(counts, lambda c: (c @ v0) / (c @ okf))
    return out[:, 0] if flat else out


def _quantiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    finite = samples[np.isfinite(samples)]
    if finite.size < 0.9 * samples.size or finite.size == 0:  # too many empty resamples: no honest interval
        return float("nan"), float("nan")
    lo, hi = np.quantile(finite, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level!r}")


def mean_interval(values: np.ndarray, counts: np.ndarray, level: float = DEFAULT_LEVEL) -> tuple[float, float, float]:
    """(mean, low, high) of the finite per-window ``values`` [n]; low/high NaN with fewer than two.

    Args:
        values: one value per window (NaN: not available in that window).
        counts: :func:`resample_counts` for the same n windows.
        level: coverage of the interval (0.95: the 2.5 % and 97.5 % quantiles).
    """
    _check_level(level)
    v = np.asarray(values, np.float64)
    ok = np.isfinite(v)
    if not ok.any():
        return float("nan"), float("nan"), float("nan")
    est = float(v[ok].mean())
    if ok.sum() < 2:
        return est, float("nan"), float("nan")
    return (est, *_quantiles(resampled_means(v, counts), level))


def paired_interval(
    a: np.ndarray, b: np.ndarray, counts: np.ndarray, kind: str = "difference", level: float = DEFAULT_LEVEL
) -> tuple[float, float, float]:
    """Paired comparison of two models on the same windows: (estimate, low, high).

    Only windows where both values are finite are used, and each resample takes the same
    windows for both models.

        kind="difference"   mean over windows of a_i − b_i          (no difference: 0)
        kind="ratio"        mean_i a_i / mean_i b_i (ratio of means) (no difference: 1)

    Args:
        a, b: per-window values [n] of the model and of the baseline, window i the same in both.
        counts: :func:`resample_counts` for these n windows.

    Returns:
        (estimate, low, high); low/high NaN with fewer than two usable windows.
    """
    _check_level(level)
    if kind not in ("difference", "ratio"):
        raise ValueError(f"kind is {kind!r}; accepted values are 'difference' and 'ratio'")
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same windows: got {a.shape} and {b.shape}")
    ok = np.isfinite(a) & np.isfinite(b)
    if not ok.any():
        return float("nan"), float("nan"), float("nan")
    if kind == "difference":
        d = np.where(ok, a - b, np.nan)
        return mean_interval(d, counts, level)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        est = float(a[ok].mean() / b[ok].mean())
    if ok.sum() < 2:
        return est, float("nan"), float("nan")
    both = np.stack([np.where(ok, a, np.nan), np.where(ok, b, np.nan)], axis=1)
    means = resampled_means(both, counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = means[:, 0] / means[:, 1]
    return (est, *_quantiles(ratios, level))


def unpaired_interval(
    a: np.ndarray,
    b: np.ndarray,
    counts_a: np.ndarray,
    counts_b: np.ndarray,
    kind: str = "difference",
    level: float = DEFAULT_LEVEL,
) -> tuple[float, float, float]:
    """Like :func:`paired_interval` for models recorded on different windows: each side resampled on its own.

    ``kind="difference"``: mean(a) − mean(b); ``kind="ratio"``: mean(a) / mean(b).
    """
    _check_level(level)
    if kind not in ("difference", "ratio"):
        raise ValueError(f"kind is {kind!r}; accepted values are 'difference' and 'ratio'")
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok_a, ok_b = np.isfinite(a), np.isfinite(b)
    if not (ok_a.any() and ok_b.any()):
        return float("nan"), float("nan"), float("nan")
    ma, mb = a[ok_a].mean(), b[ok_b].mean()
    with np.errstate(invalid="ignore", divide="ignore"):
        est = float(ma - mb if kind == "difference" else ma / mb)
        if ok_a.sum() < 2 or ok_b.sum() < 2:
            return est, float("nan"), float("nan")
        ra, rb = resampled_means(a, counts_a), resampled_means(b, counts_b)
        stat = ra - rb if kind == "difference" else ra / rb
    return (est, *_quantiles(stat, level))


# -- every metric at once ------------------------------------------------------------------
def _quantile_cols(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Per column of samples [K, M]: the interval's quantiles (NaN where under 90 % of resamples are finite)."""
    finite = np.isfinite(samples)
    enough = finite.sum(0) >= max(1, int(np.ceil(0.9 * samples.shape[0])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = np.nanquantile(np.where(finite, samples, np.nan), [(1 - level) / 2, (1 + level) / 2], axis=0)
    return np.where(enough, q[0], np.nan), np.where(enough, q[1], np.nan)


def mean_intervals(values: np.ndarray, counts: np.ndarray, level: float = DEFAULT_LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`mean_interval` of every column of ``values`` [n, M]: (mean [M], low [M], high [M])."""
    _check_level(level)
    v = np.asarray(values, np.float64)
    ok = np.isfinite(v)
    n_ok = ok.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        est = np.where(ok, v, 0.0).sum(0) / n_ok
    if v.shape[0] == 0:
        nan = np.full(v.shape[1], np.nan)
        return nan, nan.copy(), nan.copy()
    lo, hi = _quantile_cols(resampled_means(v, counts), level)
    few = n_ok < 2
    return est, np.where(few, np.nan, lo), np.where(few, np.nan, hi)


def paired_intervals(
    a: np.ndarray, b: np.ndarray, ratio: np.ndarray, counts: np.ndarray, level: float = DEFAULT_LEVEL
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`paired_interval` of every column: a, b [n, M] on the same windows; ``ratio`` [M] bool
    picks a ratio of means (True) or a mean difference (False) per column. Returns (estimate, low, high), each [M]."""
    _check_level(level)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ratio = np.asarray(ratio, bool)
    ok = np.isfinite(a) & np.isfinite(b)
    n_ok = ok.sum(0)
    a0, b0 = np.where(ok, a, 0.0), np.where(ok, b, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        est = np.where(ratio, a0.sum(0) / b0.sum(0), (a0 - b0).sum(0) / n_ok)
        est = np.where(n_ok > 0, est, np.nan)
        if a.shape[0] == 0:
            nan = np.full(a.shape[1], np.nan)
            return nan, nan.copy(), nan.copy()
        okf = ok.astype(np.float64)

        def stat_of(c: np.ndarray) -> np.ndarray:
            sa, sb, n = c @ a0, c @ b0, c @ okf
            return np.where(ratio, sa / sb, (sa - sb) / n)

        stat = _apply(counts, stat_of)
    lo, hi = _quantile_cols(stat, level)
    few = n_ok < 2
    return est, np.where(few, np.nan, lo), np.where(few, np.nan, hi)
