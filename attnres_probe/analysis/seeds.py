"""Intervals over training seeds and windows at once (the study across seeds).

Models trained with several seeds and recorded on the same windows give a table of values
V[s, i] (seed s, window i) per model. Seeds and windows are crossed (every seed sees every
window), so a resample draws seeds with replacement and, independently, windows with
replacement (by document when windows carry document ids), and takes the mean over the drawn
cells. Counted with multiplicities cs[b, s] and cw[b, i], the resampled mean of a model is

    sum_s sum_i cs[b, s] cw[b, i] V[s, i]  /  sum_s sum_i cs[b, s] cw[b, i] [V[s, i] is a number]

so the seed-to-seed spread (different trainings of one recipe) and the window-to-window spread
(different texts) both widen the interval. A paired comparison uses the same draws for the
model and its baseline, each seed's model paired with the same seed's baseline. With three
seeds the seed draws take only ten distinct multisets: the interval is rough, and pages say how
many seeds it rests on.
"""

from __future__ import annotations

import numpy as np

from attnres_probe.analysis import bootstrap

__all__ = ["crossed_counts", "crossed_means", "seed_interval"]


def crossed_counts(
    n_seeds: int, window_groups: np.ndarray, n_resamples: int = bootstrap.DEFAULT_RESAMPLES, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(cs [n_resamples, n_seeds], cw [n_resamples, n_windows]): independent draws of seeds and of windows.

    ``window_groups[i]`` is window i's document: windows are drawn by document (all windows of a
    drawn document), or one by one when every window is its own document.
    """
    if isinstance(n_seeds, bool) or not isinstance(n_seeds, (int, np.integer)) or n_seeds < 1:
        raise ValueError(f"n_seeds must be a positive integer; got {n_seeds!r}")
    groups = np.asarray(window_groups)
    if groups.size == 0:
        raise ValueError("no windows to resample")
    rng = np.random.default_rng(seed)  # one generator: seeds drawn first, then documents
    cs = bootstrap.resample_counts(int(n_seeds), n_resamples, rng)
    return cs, bootstrap.cluster_counts(groups, n_resamples, rng)


def crossed_means(values: np.ndarray, cs: np.ndarray, cw: np.ndarray) -> np.ndarray:
    """Resampled means [n_resamples] of ``values`` [n_seeds, n_windows] (NaN cells left out)."""
    v = np.asarray(values, np.float64)
    ok = np.isfinite(v)
    num = np.einsum("bs,si,bi->b", cs, np.where(ok, v, 0.0), cw)
    den = np.einsum("bs,si,bi->b", cs, ok.astype(np.float64), cw)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def seed_interval(
    model: np.ndarray,
    base: np.ndarray | None = None,
    kind: str = "difference",
    window_groups: np.ndarray | None = None,
    n_resamples: int = bootstrap.DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = bootstrap.DEFAULT_LEVEL,
) -> tuple[float, float, float]:
    """(estimate, low, high): the mean of ``model`` [seeds, windows] over both, or its paired
    ``"difference"`` / ``"ratio"`` (of means) against ``base`` (same shape, same seeds and windows),
    with a percentile interval from :func:`crossed_counts` draws.

    Raises:
        ValueError: shapes that differ, an unknown ``kind``, a level outside (0, 1).
    """
    m = np.asarray(model, np.float64)
    if m.ndim != 2:
        raise ValueError(f"values must be [seeds, windows]; got shape {m.shape}")
    if base is not None and np.shape(base) != m.shape:
        raise ValueError(f"model and baseline values differ in shape: {m.shape} vs {np.shape(base)}")
    if kind not in ("difference", "ratio"):
        raise ValueError(f"kind must be 'difference' or 'ratio'; got {kind!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level!r}")
    groups = np.arange(m.shape[1]) if window_groups is None else np.asarray(window_groups)
    cs, cw = crossed_counts(m.shape[0], groups, n_resamples, seed)
    if base is None:
        est, samples = float(np.nanmean(m)), crossed_means(m, cs, cw)
    else:
        b = np.asarray(base, np.float64)
        both = np.isfinite(m) & np.isfinite(b)  # paired: a cell counts only where both models have it
        m, b = np.where(both, m, np.nan), np.where(both, b, np.nan)
        if kind == "difference":
            est, samples = float(np.nanmean(m - b)), crossed_means(m - b, cs, cw)
        else:
            est = float(np.nanmean(m) / np.nanmean(b))
            with np.errstate(invalid="ignore", divide="ignore"):
                samples = crossed_means(m, cs, cw) / crossed_means(b, cs, cw)
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return est, float("nan"), float("nan")
    low, high = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return est, float(low), float(high)
