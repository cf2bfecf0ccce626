"""CorpusStats: running aggregates over many windows, in memory independent of corpus size, mergeable.

Three kinds of aggregate, all combinable across batches, processes and machines:

- per token, cell by cell (count, mean, M2 with Chan et al.'s parallel update, NaN cells
  skipped): the depth weights, logits and contribution shares [R, S], RMS in [R] and out
  [L+1], activation-gradient norms [R] and the loss, so the means equal those of all tokens
  pooled; parameter- and mixer-gradient norms are aggregated per backward pass (per batch);
- per window, the same way: each window's mean depth profiles (``profiles``: rms_in, grad_in,
  rms_out, param_grad), for bands across windows;
- the value of every headline metric in every window (``window_table()``), kept for the
  bootstrap (a few dozen numbers per window).

``merge`` combines two aggregates of the same model (refusing any other, with the reason);
``save``/``load`` write one folder of JSON + NPZ (loaded with ``allow_pickle=False``) + Parquet,
never a pickle. Windows are kept in (document, offset) order, so a merge of shards equals one
run over the same documents.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe._version import __version__
from attnres_probe.analysis.catalog import CATALOG
from attnres_probe.analysis.windows import (
    KEY_COLUMNS,
    LATER_COLUMNS,
    WINDOW_COLUMNS,
    mixture_rms,
    pooled_metrics,
    profile_values,
    window_digests,
    window_metric_arrays,
    window_profiles,
)
from attnres_probe.io import clear_leftovers, exclusive_lock, fault_point, read_json, set_aside, sha256_file, write_directory
from attnres_probe.trace import DepthTrace
from attnres_probe.validate import check_bytes, npz_headers, npz_inflated_bytes
from attnres_probe.validate import field as check_field

__all__ = ["CorpusStats", "RunningStats", "StatsError", "STATS_SCHEMA_VERSION"]

STATS_SCHEMA_VERSION = 2  # 2: the diagnostics catalog (matched quantities), grad_out and rms_mix
STATS_FILE = "stats.json"
ARRAYS_FILE = "arrays.npz"
WINDOWS_FILE = "windows.parquet"

# trace array -> aggregated per token (True) or per batch (False)
AGGREGATED = {
    "depth_weights": True,
    "logits": True,
    "contrib": True,
    "rms_in": True,
    "grad_in": True,
    "rms_out": True,
    "grad_out": True,
    "rms_mix": True,  # derived: rms(h_r / sum c), analysis.windows.mixture_rms
    "loss": True,
    "param_grad": False,
    "mixer_grad": False,
}
PROFILES = ("rms_in", "grad_in", "rms_out", "grad_out", "param_grad")  # per-window mean profiles
# what must agree for two aggregates to be of the same model
IDENTITY_KEYS = ("residual", "config", "read_labels", "source_labels", "block_starts", "weights_sha256")


class StatsError(ValueError):
    """Stats that cannot be combined or loaded (another model, a corrupt or too new folder)."""


class UnknownStatError(KeyError, ValueError):
    """An aggregate name a CorpusStats does not hold; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


STAT_ALIASES = {"weights": "depth_weights"}  # the figures' kind names


@dataclass
class RunningStats:
    """Count, mean and M2 per cell of a fixed shape; NaN observations are skipped."""

    count: np.ndarray
    mean: np.ndarray
    m2: np.ndarray

    def __repr__(self) -> str:  # never dump whole arrays
        total = int(self.count.sum()) if self.count.size else 0
        return f"RunningStats(shape={tuple(self.count.shape)}, observations={total}; .mean_or_nan, .var, .sample_var)"

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
        self._combine(n_b, mean_b, m2_b)

    def _combine(self, n_b: np.ndarray, mean_b: np.ndarray, m2_b: np.ndarray) -> None:
        """Chan et al.'s parallel update with another (count, mean, M2)."""
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        safe = np.maximum(n, 1)
        self.mean = np.where(n > 0, self.mean + delta * n_b / safe, 0.0)
        self.m2 = np.where(n > 0, self.m2 + m2_b + delta**2 * n_a * n_b / safe, 0.0)
        self.count = n

    def merged(self, other: RunningStats) -> RunningStats:
        """A new RunningStats holding both sets of observations (shapes must match)."""
        if self.count.shape != other.count.shape:
            raise StatsError(f"cannot merge aggregates of shapes {self.count.shape} and {other.count.shape}")
        out = RunningStats(self.count.copy(), self.mean.copy(), self.m2.copy())
        out._combine(other.count, other.mean, other.m2)
        return out

    @property
    def mean_or_nan(self) -> np.ndarray:
        return np.where(self.count > 0, self.mean, np.nan)

    @property
    def var(self) -> np.ndarray:
        """Population variance (ddof = 0); NaN where nothing was observed."""
        return np.where(self.count > 0, self.m2 / np.maximum(self.count, 1), np.nan)

    @property
    def sample_var(self) -> np.ndarray:
        """Sample variance (ddof = 1); NaN with fewer than two observations."""
        return np.where(self.count > 1, self.m2 / np.maximum(self.count - 1, 1), np.nan)


def _empty_windows() -> dict[str, list]:
    return {c: [] for c in (*KEY_COLUMNS, *WINDOW_COLUMNS)}


def _is_stats_folder(folder: Path) -> bool:
    """Whether a folder set aside by an interrupted save holds whole stats (stats.json is written last)."""
    return (folder / STATS_FILE).is_file()


@dataclass
class CorpusStats:
    """Aggregates of one model over a corpus: ``stats["depth_weights"].mean_or_nan`` is [R, S].

    Attributes:
        meta: the model's description (name, residual, config, labels; ``weights_sha256`` when
            the recorder knew it) plus ``progress`` bookkeeping of a resumable run.
        stats: per-token aggregates (per-batch for ``param_grad``, ``mixer_grad``).
        profiles: per-window aggregates of each window's mean depth profile.
        windows: per-window keys and headline metric values (see :meth:`window_table`).
        n_tokens, n_sequences, n_batches: what was folded in.
        n_skipped: windows left out for being shorter than the minimum (two tokens by default).
    """

    meta: dict[str, Any]
    stats: dict[str, RunningStats] = field(default_factory=dict)
    n_tokens: int = 0
    n_sequences: int = 0
    n_batches: int = 0
    profiles: dict[str, RunningStats] = field(default_factory=dict)
    windows: dict[str, list] = field(default_factory=_empty_windows)
    n_skipped: int = 0

    @classmethod
    def empty(cls, meta: dict[str, Any]) -> CorpusStats:
        meta = {k: v for k, v in dict(meta).items() if k not in ("str_tokens", "flags", "mean_loss", "backward")}
        return cls(meta=meta)

    @property
    def name(self) -> str:
        return self.meta.get("name") or self.meta.get("residual", "?")

    @property
    def n_windows(self) -> int:
        return len(self.windows["doc"])

    @property
    def names(self) -> list[str]:
        """The aggregates this object holds: the valid ``name`` of :meth:`mean`, :meth:`var`, :meth:`frame`."""
        return list(self.stats)

    def __repr__(self) -> str:
        names = ", ".join(self.names) or "none yet"
        return (
            f"CorpusStats(name={self.name!r}, sequences={self.n_sequences}, tokens={self.n_tokens}, "
            f"batches={self.n_batches}, windows={self.n_windows}; aggregates: {names}; "
            ".mean(name), .var(name), .frame(name), .profile(name), .window_table(), .to_trace())"
        )

    def _get(self, name: str | None, method: str) -> RunningStats:
        valid = ", ".join(repr(n) for n in self.names) or "none (nothing recorded yet)"
        if name is None:
            raise TypeError(f"stats.{method}(name) needs the name of an aggregate; this one holds {valid}")
        key = STAT_ALIASES.get(name, name) if isinstance(name, str) else name
        if key not in self.stats:
            raise UnknownStatError(f"{name!r} is not an aggregate of {self.name!r}; valid names: {valid}")
        return self.stats[key]

    # -- folding in ---------------------------------------------------------------------------
    def update(self, trace: DepthTrace, docs: list[int] | None = None, starts: list[int] | None = None) -> None:
        """Fold one trace's real tokens, and each of its windows (sequences), into the aggregates.

        Args:
            trace: a recorded batch.
            docs, starts: per sequence, the document index and the offset (in tokens) of its
                first token in that document; default: documents numbered after those seen
                so far, offset 0.
        """
        m = trace.mask
        derived = {"rms_mix": mixture_rms(trace, trace.rms_in, trace.depth_weights)}  # what each read sees, as a mixture
        for name, per_token in AGGREGATED.items():
            arr = derived[name] if name in derived else getattr(trace, name)
            obs = arr[m] if per_token else arr[None]
            if name not in self.stats:
                self.stats[name] = RunningStats.zeros(obs.shape[1:])
            self.stats[name].update(obs)
        B = trace.tokens.shape[0]
        for name, prof in window_profiles(trace).items():
            if name not in self.profiles:
                self.profiles[name] = RunningStats.zeros(prof.shape[1:])
            self.profiles[name].update(prof)
        first = (self.windows["doc"][-1] + 1) if self.windows["doc"] else 0  # windows are kept in document order
        docs = list(range(first, first + B)) if docs is None else [int(d) for d in docs]
        starts = [0] * B if starts is None else [int(s) for s in starts]
        if len(docs) != B or len(starts) != B:
            raise ValueError(f"docs and starts need one entry per sequence ({B}); got {len(docs)} and {len(starts)}")
        values = window_metric_arrays(trace)
        self.windows["doc"] += docs
        self.windows["start"] += starts
        self.windows["n_tokens"] += [int(n) for n in m.sum(1)]
        self.windows["digest"] += window_digests(trace)
        for c in WINDOW_COLUMNS:
            self.windows[c] += values[c].tolist()
        self.n_tokens += int(m.sum())
        self.n_sequences += B
        self.n_batches += 1

    # -- reading ------------------------------------------------------------------------------
    def mean(self, name: str | None = None) -> np.ndarray:
        """The per-cell mean over tokens of aggregate ``name`` (one of :attr:`names`), NaN where unobserved."""
        return self._get(name, "mean").mean_or_nan

    def var(self, name: str | None = None) -> np.ndarray:
        """The per-cell population variance over tokens of aggregate ``name`` (one of :attr:`names`)."""
        return self._get(name, "var").var

    def window_table(self) -> pd.DataFrame:
        """One row per window: doc, start, n_tokens, digest, then every headline metric."""
        df = pd.DataFrame({c: self.windows[c] for c in (*KEY_COLUMNS, *WINDOW_COLUMNS)})
        df = df.astype({"doc": np.int64, "start": np.int64, "n_tokens": np.int64, "digest": object,
                        **{c: np.float64 for c in WINDOW_COLUMNS}})
        return df

    def profile(self, name: str, level: float = 0.95) -> pd.DataFrame:
        """A depth profile over windows: the mean of the per-window means, its interval, the spread.

        Columns ``mean``, ``low``, ``high``, ``sd`` (standard deviation across windows) and
        ``windows``; indexed by read (rms_in, grad_in), source (rms_out) or sublayer (param_grad).

        ``low``/``high`` is the ``level`` interval of the mean over windows, computed on the log
        scale: mean ×/÷ exp(z·se/mean), se = sd/√windows (the delta method for log(mean)). The
        profiles are norms and RMS values, positive by nature, drawn on log axes: this interval
        stays above zero however wide it is, where mean ± z·se would cross zero for a spread-out
        profile, and it is as wide on the log axis above the line as below. NaN where the mean is
        not positive or fewer than two windows were recorded. Windows are taken as independent
        here (the profiles are aggregated without document ids); :func:`attnres_probe.metrics.compare`
        resamples by document.
        """
        from statistics import NormalDist

        if name not in PROFILES:
            raise ValueError(f"profile {name!r} is not one of {', '.join(PROFILES)}")
        labels = {
            "rms_in": self.meta["read_labels"],
            "grad_in": self.meta["read_labels"],
            "rms_out": ["embed", *self.meta["read_labels"][:-1]],
            "grad_out": ["embed", *self.meta["read_labels"][:-1]],
            "param_grad": self.meta["read_labels"][:-1],
        }[name]
        s = self.profiles.get(name) or RunningStats.zeros((len(labels),))
        z = NormalDist().inv_cdf((1 + level) / 2)
        sd = np.sqrt(s.sample_var)
        mean = s.mean_or_nan
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(mean > 0, z * sd / np.sqrt(np.maximum(s.count, 1)) / mean, np.nan)  # z·se/mean
            factor = np.exp(rel)
        return pd.DataFrame(
            {"mean": mean, "low": mean / factor, "high": mean * factor, "sd": sd, "windows": s.count},
            index=pd.Index(list(labels), name="source" if name in ("rms_out", "grad_out") else "read"),
        )

    def frame(self, name: str = "depth_weights") -> pd.DataFrame:
        """Tidy (read, source, mean, var, count) frame of a [R, S] aggregate."""
        reads, sources = self.meta["read_labels"], self.meta["source_labels"]
        s = self._get(name, "frame")
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
        if not self.stats:
            raise StatsError(f"the stats of {self.name!r} hold no tokens yet")
        n_src = len(self.meta["read_labels"])  # L + 1 sources written: the embedding and each sublayer
        kept = {name: per_token for name, per_token in AGGREGATED.items() if name != "rms_mix"}  # trace arrays only
        means = {name: self.mean(name) if name in self.stats else np.full(n_src, np.nan) for name in kept}
        arrays = {name: means[name].astype(np.float32)[None, None] if per_token else means[name].astype(np.float32)
                  for name, per_token in kept.items()}
        arrays["loss"] = arrays["loss"].reshape(1, 1)
        meta = {**self.meta, "str_tokens": [["<corpus mean>"]], "corpus": {"tokens": self.n_tokens, "sequences": self.n_sequences}}
        meta.pop("flags", None)
        meta.pop("progress", None)
        return DepthTrace(tokens=np.zeros((1, 1), np.int64), mask=np.ones((1, 1), bool), meta=meta, **arrays)

    def pooled(self) -> pd.Series:
        """Every diagnostic over every token the stats folded in, the same function as for one window
        (:func:`~attnres_probe.analysis.windows.pooled_metrics` of a trace of the same tokens):
        means over tokens are the windows' values weighted by their tokens (or by their tokens with
        a next token, for the loss); functions of depth profiles use the profiles averaged over
        every token. Parameter gradients exist per window only (one backward pass each): their
        pooled diagnostics use the mean over windows of each sublayer's gradient norm."""
        if not self.stats:
            raise StatsError(f"the stats of {self.name!r} hold no tokens yet")
        table = self.window_table()
        out = pooled_metrics(self.to_trace())  # every column; the routing ones are replaced below
        n = table["n_tokens"].to_numpy(np.float64)
        for column in WINDOW_COLUMNS:
            base = column.split("@")[0]
            pooling = CATALOG[base].pooling
            if pooling == "profile":
                continue
            v = table[column].to_numpy(np.float64)
            wt = np.maximum(n - 1, 0) if pooling == "targets" else n
            ok = np.isfinite(v) & (wt > 0)
            out[column] = float((v[ok] * wt[ok]).sum() / wt[ok].sum()) if ok.any() else float("nan")
        L = len(self.meta["read_labels"]) - 1
        mean = {k: (self.mean(k) if k in self.stats else np.full(L + 1, np.nan)) for k in ("rms_out", "grad_out", "rms_mix")}
        pg = self.profiles.get("param_grad")
        out.update({k: float(v[0]) for k, v in profile_values(
            rms_out=np.asarray(mean["rms_out"], np.float64)[None, 1 : L + 1],
            rms_mix=np.asarray(mean["rms_mix"], np.float64)[None, :L],
            grad_out=np.asarray(mean["grad_out"], np.float64)[None, 1 : L + 1],
            param_grad=None if pg is None else pg.mean_or_nan[None], n=1).items()})
        return out.rename(self.name)

    # -- combining ----------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What makes two aggregates comparable: residual, config, labels, block starts, weights digest."""
        return {k: self.meta.get(k) for k in IDENTITY_KEYS}

    def check_same_model(self, other: CorpusStats | dict[str, Any], what: str = "merge") -> None:
        """Raise :class:`StatsError` naming the first difference if ``other`` (stats or model meta) is another model.

        A weights digest missing on either side is not compared; everything else must agree.
        """
        mine = self.identity()
        theirs = other.identity() if isinstance(other, CorpusStats) else {k: other.get(k) for k in IDENTITY_KEYS}
        other_name = other.name if isinstance(other, CorpusStats) else other.get("name", "?")
        for key in IDENTITY_KEYS:
            a, b = mine[key], theirs[key]
            if key == "weights_sha256" and (a is None or b is None):
                continue
            if key == "config" and isinstance(a, dict) and isinstance(b, dict):
                diff = sorted(k for k in set(a) | set(b) if k != "extra" and a.get(k) != b.get(k))
                if diff:
                    shown = ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in diff[:4])
                    raise StatsError(
                        f"cannot {what}: the stats of {self.name!r} and {other_name!r} are of different models "
                        f"(config {shown}{', …' if len(diff) > 4 else ''})"
                    )
                continue
            if _jsonable(a) != _jsonable(b):
                shown = (lambda v: f"{str(v)[:16]}…") if key == "weights_sha256" else repr
                raise StatsError(
                    f"cannot {what}: the stats of {self.name!r} and {other_name!r} are of different models "
                    f"({key}: {shown(a)} vs {shown(b)})"
                )

    def merge(self, other: CorpusStats) -> CorpusStats:
        """A new CorpusStats holding both aggregates, as if one run had recorded both sets of windows.

        Raises:
            StatsError: ``other`` is another model (the message names the difference), or both
                hold the same window (document, offset and tokens).
        """
        self.check_same_model(other)
        mine = set(zip(self.windows["doc"], self.windows["start"], self.windows["digest"]))
        dup = next((k for k in zip(other.windows["doc"], other.windows["start"], other.windows["digest"]) if k in mine), None)
        if dup is not None:
            raise StatsError(f"cannot merge: both stats hold window (document {dup[0]}, offset {dup[1]}); each window must be recorded once")
        out = CorpusStats(meta=dict(self.meta))
        for attr in ("stats", "profiles"):
            a, b = getattr(self, attr), getattr(other, attr)
            merged = {}
            for k in dict.fromkeys([*a, *b]):
                merged[k] = a[k].merged(b[k]) if k in a and k in b else _copy(a.get(k) or b[k])
            setattr(out, attr, merged)
        table = pd.concat([self.window_table(), other.window_table()], ignore_index=True)
        table = table.sort_values(["doc", "start"], kind="stable").reset_index(drop=True)
        out.windows = {c: table[c].tolist() for c in (*KEY_COLUMNS, *WINDOW_COLUMNS)}
        out.n_tokens = self.n_tokens + other.n_tokens
        out.n_sequences = self.n_sequences + other.n_sequences
        out.n_batches = self.n_batches + other.n_batches
        out.n_skipped = self.n_skipped + other.n_skipped
        out.meta.pop("progress", None)
        return out

    # -- serialisation ------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able document, name -> array): everything, without pickle. See :meth:`from_state`."""
        arrays: dict[str, np.ndarray] = {}
        for prefix, group in (("token", self.stats), ("window", self.profiles)):
            for name, s in group.items():
                arrays[f"{prefix}.{name}.count"] = s.count
                arrays[f"{prefix}.{name}.mean"] = s.mean
                arrays[f"{prefix}.{name}.m2"] = s.m2
        doc = {
            "schema_version": STATS_SCHEMA_VERSION,
            "attnres_probe": __version__,
            "meta": self.meta,
            "n_tokens": self.n_tokens,
            "n_sequences": self.n_sequences,
            "n_batches": self.n_batches,
            "n_skipped": self.n_skipped,
            "n_windows": self.n_windows,
        }
        return doc, arrays

    @classmethod
    def from_state(cls, doc: dict[str, Any], arrays: dict[str, np.ndarray], table: pd.DataFrame | None = None) -> CorpusStats:
        """Rebuild from :meth:`state` (and the window table, :meth:`window_table`)."""
        out = cls(meta=dict(doc["meta"]))
        for key in ("n_tokens", "n_sequences", "n_batches", "n_skipped"):
            setattr(out, key, int(doc.get(key, 0)))
        for name in {k.rsplit(".", 1)[0] for k in arrays}:
            prefix, stat = name.split(".", 1)
            rs = RunningStats(np.asarray(arrays[f"{name}.count"], np.int64), np.asarray(arrays[f"{name}.mean"], np.float64),
                              np.asarray(arrays[f"{name}.m2"], np.float64))
            (out.stats if prefix == "token" else out.profiles)[stat] = rs
        if table is not None:
            for c in LATER_COLUMNS:  # a table written before these diagnostics existed: not measured then
                if c not in table.columns:
                    table[c] = np.nan
            missing = [c for c in (*KEY_COLUMNS, *WINDOW_COLUMNS) if c not in table.columns]
            if missing:
                raise StatsError(f"the window table lacks columns {missing}")
            out.windows = {c: table[c].tolist() for c in (*KEY_COLUMNS, *WINDOW_COLUMNS)}
        return out

    def to_bytes(self) -> bytes:
        """Everything as bytes, without pickle: the JSON document, the ``.npz`` arrays and the
        Parquet window table, each prefixed by its length (what ranks of a distributed run exchange)."""
        doc, arrays = self.state()
        npz, table = io.BytesIO(), io.BytesIO()
        np.savez(npz, **arrays)
        self.window_table().to_parquet(table, index=False)
        parts = [json.dumps(doc, default=_json_default, allow_nan=True).encode(), npz.getvalue(), table.getvalue()]
        return b"".join(struct.pack("<Q", len(p)) + p for p in parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> CorpusStats:
        """The stats of :meth:`to_bytes` (arrays read with ``allow_pickle=False``)."""
        parts, at = [], 0
        for _ in range(3):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            parts.append(data[at + 8 : at + 8 + n])
            at += 8 + n
        with np.load(io.BytesIO(parts[1]), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        return cls.from_state(json.loads(parts[0]), arrays, pd.read_parquet(io.BytesIO(parts[2])))

    def save(self, directory: str | Path) -> Path:
        """Write the stats into ``directory`` (created or replaced as a whole): stats.json, arrays.npz, windows.parquet.

        The files are written into a hidden folder beside it, which then takes its place
        (:func:`~attnres_probe.io.write_directory`, the folder writer of traces and checkpoints
        too), so a reader (or a resumed run) sees the old stats or the new ones, never a mix. The
        folder is locked while saving (a second writer is refused), and what a killed save left
        beside it is removed first.

        Raises:
            NotADirectoryError: ``directory`` is a file.
            FileExistsError: it holds files that are not corpus stats.
            DestinationBusyError: another writer holds it.
        """
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"{directory} is a file; stats are saved as a folder")
        if directory.is_dir() and any(p.name not in (STATS_FILE, ARRAYS_FILE, WINDOWS_FILE) for p in directory.iterdir()
                                      if not p.name.startswith(".")):
            raise FileExistsError(f"{directory} holds files that are not corpus stats; save into a new folder (nothing was written)")
        doc, arrays = self.state()

        def write(folder: Path) -> None:
            with open(folder / ARRAYS_FILE, "wb") as f:
                np.savez(f, **arrays)
            fault_point("stats.save:arrays")
            self.window_table().to_parquet(folder / WINDOWS_FILE, index=False)
            fault_point("stats.save:windows")
            doc["files"] = {n: sha256_file(folder / n) for n in (ARRAYS_FILE, WINDOWS_FILE)}
            (folder / STATS_FILE).write_text(json.dumps(doc, indent=1, default=_json_default, allow_nan=True))

        write_directory(directory, write, _is_stats_folder, (ARRAYS_FILE, WINDOWS_FILE, STATS_FILE), flag="stats folder")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> CorpusStats:
        """Read stats written by :meth:`save`.

        Raises:
            StatsError: not a stats folder, a checksum mismatch, a newer schema, unreadable files.
        """
        directory = Path(directory)
        if not directory.is_dir() and (set_aside(directory) or directory.with_name(f".{directory.name}.old").is_dir()):
            with exclusive_lock(directory, flag="stats folder"):  # a save was interrupted between its two renames
                clear_leftovers(directory, _is_stats_folder)
        path = directory / STATS_FILE
        if not path.is_file():
            raise StatsError(f"{path} is missing: {directory} is not a saved CorpusStats folder")
        doc = read_json(path, StatsError, max_bytes=MAX_STATS_JSON)
        version = doc.get("schema_version") if isinstance(doc, dict) else None
        if not isinstance(version, int):
            raise StatsError(f"{path} has no integer schema_version")
        if version < STATS_SCHEMA_VERSION:
            raise StatsError(
                f"{directory} holds schema-version {version} stats, recorded with the diagnostics' earlier definitions "
                "(routing on PreNorm's shares, gradients at the mixed inputs): they cannot be compared with today's; "
                "record the corpus again into a new folder (attnres-probe corpus)"
            )
        if version > STATS_SCHEMA_VERSION:
            raise StatsError(
                f"{directory} holds schema-version {version} stats; this attnres-probe ({__version__}) reads "
                f"versions up to {STATS_SCHEMA_VERSION}: upgrade attnres-probe"
            )
        for name in (ARRAYS_FILE, WINDOWS_FILE):
            if not (directory / name).is_file():
                raise StatsError(f"{directory / name} is missing")
            if doc.get("files", {}).get(name) != sha256_file(directory / name):
                raise StatsError(f"{directory / name} does not match the checksum in {STATS_FILE}: the stats are corrupt")
        _check_doc(doc, str(path))
        try:  # sizes first: the arrays' declared shapes, then their bytes once inflated, the table's rows
            try:
                headers = npz_headers(directory / ARRAYS_FILE)
            except ValueError as exc:
                raise StatsError(f"{directory / ARRAYS_FILE}: {exc}") from None
            _check_shapes({k: shape for k, (shape, _) in headers.items()}, doc["meta"], str(directory / ARRAYS_FILE))
            check_bytes(npz_inflated_bytes(directory / ARRAYS_FILE), "the arrays once inflated", str(directory / ARRAYS_FILE),
                        StatsError)
            import pyarrow.parquet as pq

            rows = pq.ParquetFile(directory / WINDOWS_FILE).metadata.num_rows
        except StatsError:
            raise
        except Exception as exc:  # zipfile / pyarrow raise several types for damaged files
            raise StatsError(f"{directory}: the stats files cannot be read ({exc})") from None
        if rows != doc["n_windows"]:
            raise StatsError(f"{directory / WINDOWS_FILE} holds {rows} rows, but {STATS_FILE} says {doc['n_windows']} "
                             "windows: the stats are corrupt")
        try:
            with np.load(directory / ARRAYS_FILE, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            table = pd.read_parquet(directory / WINDOWS_FILE)
        except Exception as exc:  # numpy / pyarrow raise several types for damaged files
            raise StatsError(f"{directory}: the stats files cannot be read ({exc})") from None
        _check_arrays(arrays, doc["meta"], str(directory / ARRAYS_FILE))
        try:
            return cls.from_state(doc, arrays, table)
        except StatsError:
            raise
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # a table of the wrong types, ...
            raise StatsError(f"{directory}: the stats cannot be read ({type(exc).__name__}: {exc})") from None


MAX_STATS_JSON = 64 * 2**20
MAX_LABELS = 4097  # reads of the deepest model a config may describe (2 x 2048 sublayers + 1)
_STATS = ("count", "mean", "m2")


def _check_doc(doc: Any, where: str) -> None:
    """The document of a stats folder, before anything is allocated from it (one-line StatsError)."""
    meta = check_field(doc, "meta", "dict", where, StatsError)
    for key in ("n_tokens", "n_sequences", "n_batches", "n_skipped", "n_windows"):
        check_field(doc, key, "int", where, StatsError, lo=0, required=key == "n_windows", default=0)
    doc["n_windows"] = int(doc["n_windows"])
    where = f"{where} 'meta'"
    check_field(meta, "residual", "str", where, StatsError, lo=1, hi=64)
    for key in ("read_labels", "source_labels"):
        labels = check_field(meta, key, "list", where, StatsError, lo=1, hi=MAX_LABELS)
        if not all(isinstance(x, str) for x in labels):
            raise StatsError(f"{where}: {key!r} must be a list of strings")
    if len(meta["source_labels"]) > len(meta["read_labels"]):
        raise StatsError(f"{where}: {len(meta['source_labels'])} source labels for {len(meta['read_labels'])} reads; a read "
                         "sees at most one source per read before it")
    starts = check_field(meta, "block_starts", "list", where, StatsError, required=False, default=None, hi=MAX_LABELS)
    if starts is not None and not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(meta["read_labels"])
                                      for x in starts):
        raise StatsError(f"{where}: 'block_starts' must be a list of sublayer indices 0..{len(meta['read_labels']) - 2}")
    if "name" in meta:
        check_field(meta, "name", "str", where, StatsError, lo=1, hi=256)
    R = len(meta["read_labels"])
    if R % 2 != 1 or R < 3:
        raise StatsError(f"{where}: {R} read labels; a model of n layers has 2n + 1 reads")
    cfg = meta.get("config")
    if cfg is not None:
        n = check_field(cfg, "n_layers", "int", f"{where} 'config'", StatsError, lo=1, hi=MAX_LABELS // 2, required=False,
                        default=(R - 1) // 2)
        if n != (R - 1) // 2:
            raise StatsError(f"{where}: 'config' says {n} layers, the read labels {(R - 1) // 2}")
    from attnres_probe.axis import SourceAxis

    try:
        axis = SourceAxis.from_meta(meta)
    except (ValueError, TypeError, KeyError) as exc:
        raise StatsError(f"{where}: the model's source axis is inconsistent ({exc})") from None
    if axis.n_sources != len(meta["source_labels"]) or axis.n_reads != R:
        raise StatsError(f"{where}: {len(meta['source_labels'])} source labels and {R} read labels; a {meta['residual']} "
                         f"model of {axis.n_layers} layers has {axis.n_sources} sources and {axis.n_reads} reads")


def _check_arrays(arrays: dict[str, np.ndarray], meta: dict[str, Any], where: str) -> None:
    """Every aggregate complete (count, mean, m2), of one shape, finite where counted, counts >= 0."""
    groups: dict[str, set[str]] = {}
    for key in arrays:
        prefix, _, rest = key.partition(".")
        name, _, stat = rest.rpartition(".")
        if prefix not in ("token", "window") or not name or stat not in _STATS:
            raise StatsError(f"{where}: array {key!r} is not an aggregate (token.<name>.count/mean/m2 or window.<name>...)")
        groups.setdefault(f"{prefix}.{name}", set()).add(stat)
    for name, stats in groups.items():
        if stats != set(_STATS):
            raise StatsError(f"{where}: aggregate {name!r} lacks {sorted(set(_STATS) - stats)}")
        count, mean, m2 = (arrays[f"{name}.{s}"] for s in _STATS)
        if not (count.shape == mean.shape == m2.shape):
            raise StatsError(f"{where}: aggregate {name!r} has count, mean and m2 of different shapes")
        if count.dtype.kind not in "iu" or mean.dtype.kind != "f" or m2.dtype.kind != "f":
            raise StatsError(f"{where}: aggregate {name!r} must hold integer counts and float means")
        if (count < 0).any() or (m2 < -1e-6 * np.abs(m2).max(initial=1.0)).any():
            raise StatsError(f"{where}: aggregate {name!r} holds negative counts or variances")
    _check_shapes({k: a.shape for k, a in arrays.items()}, meta, where)


def _check_shapes(shapes: dict[str, tuple[int, ...]], meta: dict[str, Any], where: str) -> None:
    """Every array (``token.<name>.<stat>``) of the shape a model of the document's reads and
    sources gives; run on the arrays' headers before they are inflated, and on the arrays."""
    R, S = len(meta["read_labels"]), len(meta["source_labels"])
    expected = {"depth_weights": (R, S), "logits": (R, S), "contrib": (R, S), "rms_in": (R,), "grad_in": (R,), "rms_out": (R,),
                "grad_out": (R,), "rms_mix": (R,), "mixer_grad": (R,), "loss": (), "param_grad": (R - 1,)}
    for key, shape in shapes.items():
        prefix, _, rest = key.partition(".")
        stat = rest.rpartition(".")[0]
        if prefix not in ("token", "window") or stat not in expected:
            raise StatsError(f"{where}: array {key!r} is not an aggregate a corpus run records "
                             f"(token.<name>.count/mean/m2 or window.<name>..., name one of {', '.join(expected)})")
        if tuple(shape) != expected[stat]:
            raise StatsError(f"{where}: aggregate {key!r} has shape {list(shape)}; a model of "
                             f"{R} reads x {S} sources gives {list(expected[stat])}")


def _copy(s: RunningStats) -> RunningStats:
    return RunningStats(s.count.copy(), s.mean.copy(), s.m2.copy())


def _jsonable(v: Any) -> Any:
    return json.loads(json.dumps(v, default=_json_default)) if v is not None else None


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot store {type(obj).__name__} in stats metadata")
