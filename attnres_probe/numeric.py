"""NaN-aware reductions over tokens, shared by the trace, the metrics and the figures.

Unavailable cells are NaN in every trace array and must never count as zero; these helpers
average over what is there and keep an all-NaN cell NaN, without numpy's warnings.
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["token_mean"]


def token_mean(values: np.ndarray) -> np.ndarray:
    """NaN-aware mean over axis 0 (tokens): [N, ...] -> [...]; all-NaN (or N = 0) -> NaN, no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=0) if values.shape[0] else np.full(values.shape[1:], np.nan)
