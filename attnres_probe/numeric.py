"""NaN-aware reductions over tokens, shared by the trace, the metrics and the figures.

Unavailable cells are NaN in every trace array and must never count as zero; these helpers
average over what is there and keep an all-NaN cell NaN, without numpy's warnings.
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["CANCELLED", "over_sum", "row_sum", "token_mean"]

# A row of coefficients whose sum is under this fraction of its absolute sum "cancels": divided by
# its sum, its entries would exceed 1/CANCELLED in magnitude and measure the cancellation, not how the
# row mixes its sources. Such a row has no normalised weights (NaN, "unavailable"). Softmax weights and
# non-negative coefficients (PreNorm, mHC, the DenseFormer demo) never cancel.
CANCELLED = 0.05


def token_mean(values: np.ndarray) -> np.ndarray:
    """NaN-aware mean over axis 0 (tokens): [N, ...] -> [...]; all-NaN (or N = 0) -> NaN, no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=0) if values.shape[0] else np.full(values.shape[1:], np.nan)


def over_sum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``x / sum(x)`` along ``axis`` (NaN entries ignored in the sums and kept NaN), in float64; a row
    whose sum is below :data:`CANCELLED` of its absolute sum, or that has no finite entry, is all NaN."""
    x = np.asarray(x, np.float64)
    return x / np.expand_dims(row_sum(x, axis), axis)  # a NaN sum (the row cancels) makes the row NaN


def row_sum(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``sum(x)`` along ``axis`` (NaN entries ignored), NaN where the row cancels (see :func:`over_sum`)."""
    x = np.asarray(x, np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        total = np.nansum(x, axis=axis)
        size = np.nansum(np.abs(x), axis=axis)
        return np.where((np.abs(total) >= CANCELLED * size) & (size > 0), total, np.nan)
