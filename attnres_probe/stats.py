"""CorpusStats: running aggregates over many traces, in memory independent of corpus size.

Every per-token quantity is aggregated cell by cell (count, mean, population variance) with
Chan et al.'s parallel update, skipping NaN cells (unavailable sources, padding), so the result
equals the statistics of all tokens pooled. Per-batch quantities (parameter-gradient norms) are
aggregated over batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe.trace import DepthTrace

__all__ = ["CorpusStats", "RunningStats"]

# trace array -> aggregated per token (True) or per batch (False)
AGGREGATED = {
    "depth_weights": True,
    "logits": True,
    "contrib": True,
    "rms_in": True,
    "grad_in": True,
    "rms_out": True,
    "loss": True,
    "param_grad": False,
    "mixer_grad": False,
}


@dataclass
class RunningStats:
    """Count, mean and M2 per cell of a fixed shape; NaN observations are skipped."""

    count: np.ndarray
    mean: np.ndarray
    m2: np.ndarray

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> RunningStats:
        return cls(np.zeros(shape, np.int64), np.zeros(shape, np.float64), np.zeros(shape, np.float64))

    def update(self, x: np.ndarray) -> None:
        """Add observations x [N, *shape] (NaN = missing)."""
        x = np.asarray(x, np.float64)
        ok = ~np.isnan(x)
        n_b = ok.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_b = np.where(n_b > 0, np.where(ok, x, 0).sum(axis=0) / np.maximum(n_b, 1), 0.0)
            m2_b = np.where(ok, (x - mean_b) ** 2, 0).sum(axis=0)
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        safe = np.maximum(n, 1)
        self.mean = np.where(n > 0, self.mean + delta * n_b / safe, 0.0)
        self.m2 = np.where(n > 0, self.m2 + m2_b + delta**2 * n_a * n_b / safe, 0.0)
        self.count = n

    @property
    def mean_or_nan(self) -> np.ndarray:
        return np.where(self.count > 0, self.mean, np.nan)

    @property
    def var(self) -> np.ndarray:
        """Population variance (ddof = 0); NaN where nothing was observed."""
        return np.where(self.count > 0, self.m2 / np.maximum(self.count, 1), np.nan)


@dataclass
class CorpusStats:
    """Aggregates of one model over a corpus: ``stats["depth_weights"].mean_or_nan`` is [R, S]."""

    meta: dict[str, Any]
    stats: dict[str, RunningStats] = field(default_factory=dict)
    n_tokens: int = 0
    n_sequences: int = 0
    n_batches: int = 0

    @classmethod
    def empty(cls, meta: dict[str, Any]) -> CorpusStats:
        return cls(meta=dict(meta))

    def __repr__(self) -> str:
        name = self.meta.get("name", "?")
        return (
            f"CorpusStats(name={name!r}, sequences={self.n_sequences}, tokens={self.n_tokens}, "
            f"batches={self.n_batches}; .mean(name), .var(name), .frame(name), .to_trace() for the aggregates)"
        )

    def update(self, trace: DepthTrace) -> None:
        """Fold one trace's real tokens into the aggregates."""
        m = trace.mask
        for name, per_token in AGGREGATED.items():
            arr = getattr(trace, name)
            obs = arr[m] if per_token else arr[None]
            if name not in self.stats:
                self.stats[name] = RunningStats.zeros(obs.shape[1:])
            self.stats[name].update(obs)
        self.n_tokens += int(m.sum())
        self.n_sequences += int(trace.tokens.shape[0])
        self.n_batches += 1

    def mean(self, name: str) -> np.ndarray:
        return self.stats[name].mean_or_nan

    def var(self, name: str) -> np.ndarray:
        return self.stats[name].var

    def frame(self, name: str = "depth_weights") -> pd.DataFrame:
        """Tidy (read, source, mean, var, count) frame of a [R, S] aggregate."""
        reads, sources = self.meta["read_labels"], self.meta["source_labels"]
        s = self.stats[name]
        r_idx, s_idx = np.meshgrid(np.arange(len(reads)), np.arange(len(sources)), indexing="ij")
        df = pd.DataFrame(
            {
                "read": np.asarray(reads, dtype=object)[r_idx.ravel()],
                "source": np.asarray(sources, dtype=object)[s_idx.ravel()],
                "mean": s.mean_or_nan.ravel(),
                "var": s.var.ravel(),
                "count": s.count.ravel(),
            }
        )
        return df[df["count"] > 0].reset_index(drop=True)

    def to_trace(self) -> DepthTrace:
        """A one-token DepthTrace holding the corpus means (for the same figures and metrics)."""
        arrays = {name: self.mean(name).astype(np.float32)[None, None] if per_token else self.mean(name).astype(np.float32)
                  for name, per_token in AGGREGATED.items()}
        arrays["loss"] = arrays["loss"].reshape(1, 1)
        meta = {**self.meta, "str_tokens": [["<corpus mean>"]], "corpus": {"tokens": self.n_tokens, "sequences": self.n_sequences}}
        meta.pop("flags", None)
        return DepthTrace(tokens=np.zeros((1, 1), np.int64), mask=np.ones((1, 1), bool), meta=meta, **arrays)
