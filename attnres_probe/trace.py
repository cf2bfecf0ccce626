"""DepthTrace: everything the probe recorded for one batch of text, as arrays plus metadata.

Shapes (B = batch, P = positions, R = reads = L+1, S = columns of the common source axis,
L = sublayers):

==============  =================  ==========================================================
array           shape              meaning
==============  =================  ==========================================================
tokens          [B, P] int64       token ids
mask            [B, P] bool        real (not padding) positions
loss            [B, P] float32     next-token loss at each position (NaN at the last / padding)
depth_weights   [B, P, R, S]       softmax depth weights (PreNorm: coefficient 1); NaN = unavailable
logits          [B, P, R, S]       depth logits (PreNorm: NaN)
contrib         [B, P, R, S]       contribution share c_i = <coef_i v_i, h> / |h|^2
rms_in          [B, P, R]          RMS of every mixed input h (the read's output)
rms_out         [B, P, L+1]        RMS of every source written: embed, then each sublayer output
grad_in         [B, P, R]          norm of dLoss/dh at every mixed input (NaN without backward)
param_grad      [L]                norm of each sublayer's parameter gradient (attention + its norm, ...)
mixer_grad      [R]                norm of each depth mixer's parameter gradient (NaN for PreNorm)
==============  =================  ==========================================================

``meta`` holds the model description (name, residual, config, read/source/sublayer labels,
block starts), the string tokens, and flags (non-finite values seen while recording).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe._version import __version__
from attnres_probe.io import atomic_write, sha256_file
from attnres_probe.numeric import token_mean

__all__ = ["DepthTrace", "TraceError", "SCHEMA_VERSION", "check_save_target", "unique_names"]

SCHEMA_VERSION = 1
META_FILE = "trace.json"

# array name -> axes (used for shapes, tidy frames and file layout)
CUBE = ("depth_weights", "logits", "contrib")  # [B, P, R, S]
KINDS = {"weights": "depth_weights", "logits": "logits", "contrib": "contrib"}
READ_ARRAYS = ("rms_in", "grad_in")  # [B, P, R]
TOKEN_ARRAYS = ("tokens", "mask", "loss")  # [B, P]
SOURCE_ARRAYS = ("rms_out",)  # [B, P, L+1]
LAYER_ARRAYS = ("param_grad",)  # [L]
MIXER_ARRAYS = ("mixer_grad",)  # [R]
ALL_ARRAYS = TOKEN_ARRAYS + CUBE + READ_ARRAYS + SOURCE_ARRAYS + LAYER_ARRAYS + MIXER_ARRAYS
FILES = {
    "tokens.parquet": TOKEN_ARRAYS,
    "cube.parquet": CUBE,
    "reads.parquet": READ_ARRAYS,
    "sources.parquet": SOURCE_ARRAYS,
    "layers.parquet": LAYER_ARRAYS,
    "mixers.parquet": MIXER_ARRAYS,
}
DTYPES = {"tokens": np.int64, "mask": np.bool_}


class TraceError(ValueError):
    """A trace directory is missing, corrupt, or from a newer schema."""


def check_save_target(directory: str | Path, overwrite: bool = False) -> Path:
    """Check that a trace may be saved into ``directory`` (see :meth:`DepthTrace.save`); return it as a Path.

    Raises:
        FileExistsError: the folder holds a trace (without ``overwrite``) or other files.
        NotADirectoryError: ``directory`` is a file.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"{directory} is a file; a DepthTrace is saved as a folder (Parquet tables + {META_FILE}): give a folder path"
        )
    # hidden files (a save's leftover temporary file, a desktop's index file) do not count
    entries = [p for p in directory.iterdir() if not p.name.startswith(".")] if directory.is_dir() else []
    if any(p.name not in {META_FILE, *FILES} for p in entries):
        raise FileExistsError(
            f"{directory} is not empty and does not hold a saved DepthTrace; "
            "save into a new or empty folder (nothing was written)"
        )
    if entries and not overwrite:
        raise FileExistsError(
            f"{directory} already holds a saved DepthTrace; pass overwrite=True "
            "(attnres-probe record --force) to replace it, or choose another folder (nothing was written)"
        )
    return directory


@dataclasses.dataclass(eq=False)
class DepthTrace:
    """The record of one probe run; see the module docstring for every array's shape."""

    tokens: np.ndarray
    mask: np.ndarray
    loss: np.ndarray
    depth_weights: np.ndarray
    logits: np.ndarray
    contrib: np.ndarray
    rms_in: np.ndarray
    grad_in: np.ndarray
    rms_out: np.ndarray
    param_grad: np.ndarray
    mixer_grad: np.ndarray
    meta: dict[str, Any]

    def __post_init__(self) -> None:
        for name in ALL_ARRAYS:
            arr = np.asarray(getattr(self, name))
            setattr(self, name, arr.astype(DTYPES.get(name, np.float32), copy=False))
        self._check_shapes()
        if "flags" not in self.meta:
            self.meta["flags"] = self.nonfinite_flags()

    # -- shape bookkeeping ---------------------------------------------------------------
    def _check_shapes(self) -> None:
        B, P = self.tokens.shape
        R, S = len(self.read_labels), len(self.source_labels)
        L = R - 1
        want = {
            **{n: (B, P) for n in TOKEN_ARRAYS},
            **{n: (B, P, R, S) for n in CUBE},
            **{n: (B, P, R) for n in READ_ARRAYS},
            "rms_out": (B, P, L + 1),
            "param_grad": (L,),
            "mixer_grad": (R,),
        }
        for name, shape in want.items():
            got = getattr(self, name).shape
            if got != shape:
                raise TraceError(f"trace array {name!r} has shape {got}; expected {shape} from the tokens and labels")

    @property
    def read_labels(self) -> list[str]:
        return list(self.meta["read_labels"])

    @property
    def source_labels(self) -> list[str]:
        return list(self.meta["source_labels"])

    @property
    def sublayer_labels(self) -> list[str]:
        return self.read_labels[:-1]

    @property
    def residual(self) -> str:
        return self.meta["residual"]

    @property
    def name(self) -> str:
        return self.meta.get("name") or self.residual

    @property
    def str_tokens(self) -> list[list[str]]:
        return self.meta["str_tokens"]

    @property
    def block_starts(self) -> list[int]:
        return list(self.meta.get("block_starts") or [])

    @property
    def has_gradients(self) -> bool:
        return bool(np.isfinite(self.grad_in).any())

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    # -- selection -----------------------------------------------------------------------
    def read_index(self, read: int | str) -> int:
        """Row of a read given by label (``"L3.mlp"``, ``"final"``) or index (negative counts from the end).

        Raises:
            KeyError: an unknown label.
            IndexError: an index out of range.
        """
        labels = self.read_labels
        if isinstance(read, str):
            if read not in labels:
                raise KeyError(f"read {read!r} is not one of {labels}")
            return labels.index(read)
        if not -len(labels) <= read < len(labels):
            raise IndexError(f"read {read} is out of range; this trace has reads 0..{len(labels) - 1}")
        return read % len(labels)

    def source_index(self, source: int | str) -> int:
        """Column of a source given by label (``"embed"``, ``"L0.attn"``, ``"block1"``) or index.

        Raises:
            KeyError: an unknown label.
            IndexError: an index out of range.
        """
        labels = self.source_labels
        if isinstance(source, str):
            if source not in labels:
                raise KeyError(f"source {source!r} is not one of {labels}")
            return labels.index(source)
        if not -len(labels) <= source < len(labels):
            raise IndexError(f"source {source} is out of range; this trace has sources 0..{len(labels) - 1}")
        return source % len(labels)

    def token_index(self, token: int, batch: int = 0) -> int:
        """Position of real token ``token`` of sequence ``batch`` (negative counts from its last real token).

        Raises:
            IndexError: ``token`` is not among the sequence's real (unpadded) tokens.
        """
        n = int(self.mask[batch].sum())
        if not -n <= token < n:
            raise IndexError(f"token {token} is out of range; sequence {batch} has {n} tokens (0..{n - 1})")
        return token % n

    def cube(self, kind: str = "weights") -> np.ndarray:
        """One of the [B, P, R, S] arrays: ``"weights"``, ``"logits"`` or ``"contrib"``."""
        if kind not in KINDS:
            raise ValueError(f"kind is {kind!r}; accepted values are {', '.join(KINDS)}")
        return getattr(self, KINDS[kind])

    def weights(
        self, token: int | None = None, read: int | str | None = None, batch: int = 0, kind: str = "weights"
    ) -> pd.DataFrame:
        """Depth weights as a labelled DataFrame, reads x sources.

        Args:
            token: position in sequence ``batch``; None averages over every real token
                (NaN-aware: unavailable cells stay NaN).
            read: keep one read (label like ``"L3.mlp"`` or index); None keeps all.
            batch: which sequence of the batch (ignored when averaging over tokens: all are used).
            kind: ``"weights"`` | ``"logits"`` | ``"contrib"``.

        Returns:
            DataFrame indexed by read label, one column per source label.
        """
        arr = self.cube(kind)
        if token is None:
            data = token_mean(arr[self.mask])  # (R, S)
        else:
            if not 0 <= batch < self.tokens.shape[0]:
                raise IndexError(f"batch {batch} is out of range; this trace has {self.tokens.shape[0]} sequences")
            data = arr[batch, self.token_index(token, batch)]
        df = pd.DataFrame(data, index=pd.Index(self.read_labels, name="read"), columns=pd.Index(self.source_labels, name="source"))
        if read is not None:
            df = df.iloc[[self.read_index(read)]]
        return df

    def expanded(self, kind: str = "weights") -> tuple[np.ndarray, list[str]]:
        """Block traces on the L+1 sublayer axis: every sublayer gets its block's column value.

        Returns:
            (array [B, P, R, L+1], labels ["embed", "L0.attn", ...]). Full and PreNorm traces
            are returned unchanged.
        """
        arr = self.cube(kind)
        labels = ["embed", *self.sublayer_labels]
        if self.residual != "block":
            return arr, labels
        starts = [*self.block_starts, len(self.sublayer_labels)]
        col = [0]
        for n, (a, b) in enumerate(zip(starts, starts[1:]), start=1):
            col += [n] * (b - a)
        out = arr[..., col].copy()
        # a sublayer not yet written by the time of a read is unavailable to it
        for r in range(len(self.read_labels)):
            out[:, :, r, r + 1 :] = np.nan
        return out, labels

    # -- tidy frames ---------------------------------------------------------------------
    def to_frame(self, dropna: bool = True) -> pd.DataFrame:
        """Tidy long format of the weight cube: one row per (batch, pos, read, source).

        Columns: batch, pos, token, str_token, read, read_index, source, source_index,
        weight, logit, contrib. With ``dropna`` (default), unavailable cells are left out.
        """
        B, P, R, S = self.depth_weights.shape
        b, p, r, s = (a.ravel() for a in np.meshgrid(np.arange(B), np.arange(P), np.arange(R), np.arange(S), indexing="ij"))
        strs = np.array([t for row in self._padded_str_tokens() for t in row], dtype=object)
        df = pd.DataFrame(
            {
                "batch": b,
                "pos": p,
                "token": self.tokens[b, p],
                "str_token": strs[b * P + p],
                "read": np.asarray(self.read_labels, dtype=object)[r],
                "read_index": r,
                "source": np.asarray(self.source_labels, dtype=object)[s],
                "source_index": s,
                "weight": self.depth_weights.ravel(),
                "logit": self.logits.ravel(),
                "contrib": self.contrib.ravel(),
            }
        )
        keep = self.mask[b, p]
        if dropna:
            keep &= ~np.isnan(df["weight"].to_numpy())
        return df[keep].reset_index(drop=True)

    def reads_frame(self) -> pd.DataFrame:
        """One row per (batch, pos, read): rms_in, grad_in, and the token's loss."""
        B, P, R = self.rms_in.shape
        b, p, r = (a.ravel() for a in np.meshgrid(np.arange(B), np.arange(P), np.arange(R), indexing="ij"))
        df = pd.DataFrame(
            {
                "batch": b,
                "pos": p,
                "read": np.asarray(self.read_labels, dtype=object)[r],
                "read_index": r,
                "rms_in": self.rms_in.ravel(),
                "grad_in": self.grad_in.ravel(),
            }
        )
        return df[self.mask[b, p]].reset_index(drop=True)

    def _padded_str_tokens(self) -> list[list[str]]:
        P = self.tokens.shape[1]
        return [list(row) + [""] * (P - len(row)) for row in self.str_tokens]

    # -- checks --------------------------------------------------------------------------
    def nonfinite_flags(self) -> list[str]:
        """Human-readable notes on Inf/NaN seen where values should be finite."""
        flags = []
        m = self.mask
        for name in ("rms_in", "rms_out"):
            bad = ~np.isfinite(getattr(self, name)[m])
            if bad.any():
                flags.append(f"{name}: {int(bad.sum())} non-finite values")
        # columns 0..k_r-1 are available to read r: the most non-NaN weights any token has there
        B, P, R, S = self.depth_weights.shape
        k = np.count_nonzero(~np.isnan(self.depth_weights), axis=-1).reshape(B * P, R).max(axis=0, initial=0)
        avail = np.arange(S)[None, :] < k[:, None]  # (R, S)
        for name in ("depth_weights", "contrib"):
            bad = ~np.isfinite(getattr(self, name)[m])  # (real tokens, R, S)
            count = int(np.count_nonzero(bad & avail))
            if count:
                flags.append(f"{name}: {count} non-finite values in available cells")
        loss = self.loss[m]
        if np.isinf(loss).any() or (np.isnan(loss).sum() > self.tokens.shape[0]):
            flags.append("loss: non-finite values")
        if self.has_gradients and (~np.isfinite(self.grad_in[m])).any():
            flags.append("grad_in: non-finite values")
        return flags

    @property
    def flags(self) -> list[str]:
        return list(self.meta.get("flags", []))

    # -- persistence ---------------------------------------------------------------------
    def save(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write the trace into ``directory``: Parquet tables + ``trace.json`` (schema, shapes, hashes).

        ``directory`` must be new or empty (hidden files aside). A folder that already holds a
        saved trace is replaced only with ``overwrite=True``, file by file (each file is
        replaced atomically, so an interrupted overwrite can leave a trace that no longer
        loads); a folder holding anything else is never written into (its files could share
        a name with the trace's).

        Raises:
            FileExistsError: the folder holds a trace (without ``overwrite``) or other files.
            NotADirectoryError: ``directory`` is a file.
        """
        directory = check_save_target(directory, overwrite)
        directory.mkdir(parents=True, exist_ok=True)
        hashes = {}
        for fname, names in FILES.items():
            table = pd.DataFrame({n: getattr(self, n).ravel() for n in names})
            atomic_write(directory / fname, lambda p, t=table: t.to_parquet(p, index=False))
            hashes[fname] = sha256_file(directory / fname)
        doc = {
            "schema_version": SCHEMA_VERSION,
            "attnres_probe": __version__,
            "shapes": {n: list(getattr(self, n).shape) for n in ALL_ARRAYS},
            "files": hashes,
            "meta": self.meta,
        }
        atomic_write(directory / META_FILE, lambda p: p.write_text(json.dumps(doc, indent=1, default=_json_default)))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> DepthTrace:
        """Read a trace written by :meth:`save`; raises :class:`TraceError` if it is corrupt or too new."""
        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise TraceError(f"{meta_path} is missing: {directory} is not a saved DepthTrace")
        try:
            doc = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TraceError(f"{meta_path} is not valid JSON ({exc})") from None
        version = doc.get("schema_version") if isinstance(doc, dict) else None
        if not isinstance(version, int):
            raise TraceError(f"{meta_path} has no integer schema_version")
        if version > SCHEMA_VERSION:
            raise TraceError(
                f"{directory} is a schema-version {version} trace; this attnres-probe ({__version__}) reads "
                f"versions up to {SCHEMA_VERSION}: upgrade attnres-probe"
            )
        arrays: dict[str, np.ndarray] = {}
        for fname, names in FILES.items():
            path = directory / fname
            if not path.is_file():
                raise TraceError(f"{path} is missing")
            if doc.get("files", {}).get(fname) != sha256_file(path):
                raise TraceError(f"{path} does not match the checksum in {META_FILE}: the trace is corrupt")
            try:
                table = pd.read_parquet(path)
            except Exception as exc:  # pyarrow raises several types for a damaged file
                raise TraceError(f"{path} is not a readable Parquet file ({exc})") from None
            for n in names:
                shape = tuple(doc["shapes"][n])
                values = table[n].to_numpy()
                if values.size != math.prod(shape):
                    raise TraceError(f"{path}: column {n!r} has {values.size} values; shape {shape} needs {math.prod(shape)}")
                arrays[n] = values.reshape(shape)
        return cls(**arrays, meta=doc["meta"])

    # -- display -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """A few headline numbers (model, tokens, loss, flags)."""
        m = self.mask
        return {
            "name": self.name,
            "residual": self.residual,
            "sequences": int(self.tokens.shape[0]),
            "tokens": self.n_tokens,
            "reads": len(self.read_labels),
            "sources": len(self.source_labels),
            "mean_loss": float(np.nanmean(self.loss[m])) if np.isfinite(self.loss[m]).any() else float("nan"),
            "gradients": self.has_gradients,
            "flags": self.flags,
        }

    def _repr_html_(self) -> str:
        from attnres_probe.figures import trace_summary_html

        return trace_summary_html(self)

    def __repr__(self) -> str:
        s = self.summary()
        flag = f", flags={s['flags']}" if s["flags"] else ""
        return (
            f"DepthTrace(name={s['name']!r}, residual={s['residual']!r}, sequences={s['sequences']}, "
            f"tokens={s['tokens']}, reads={s['reads']}, sources={s['sources']}, mean_loss={s['mean_loss']:.4f}{flag})"
        )

    # -- figures (built in attnres_probe.figures) ----------------------------------------
    def heatmap(self, token: int = 0, batch: int = 0, kind: str = "weights", expanded: bool = False):
        """Per-token depth heatmap (reads x sources) as a plotly Figure."""
        from attnres_probe import figures

        return figures.token_heatmap(self, token=token, batch=batch, kind=kind, expanded=expanded)

    def mean_heatmap(self, kind: str = "weights", expanded: bool = False):
        """Mean depth heatmap over tokens as a plotly Figure."""
        from attnres_probe import figures

        return figures.mean_heatmap(self, kind=kind, expanded=expanded)

    def source_heatmap(self, source: int | str = 0, batch: int = 0, kind: str = "weights"):
        """Token x read heatmap of one source's weight (source 0: embedding retention per token)."""
        from attnres_probe import figures

        return figures.source_heatmap(self, source=source, batch=batch, kind=kind)

    def magnitudes(self):
        """RMS of mixed inputs and sublayer outputs by depth, as a plotly Figure."""
        from attnres_probe import figures

        return figures.magnitudes([self])

    def gradients(self):
        """Gradient norms by depth (per-token at mixed inputs, and per sublayer's parameters)."""
        from attnres_probe import figures

        return figures.gradient_norms([self])


def unique_names(names: Sequence[str]) -> list[str]:
    """Display names for traces set side by side: a repeated name gets " (2)", " (3)", ... in order.

    The metric tables (:func:`attnres_probe.metrics.compare`), the line charts and the reports
    all name their columns and lines this way, so one trace has one name in all of them.
    """
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot store {type(obj).__name__} in trace metadata")
