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
grad_out        [B, P, L+1]        norm of dLoss/dv at every source written (the gradient at each
                                   sublayer output, through every read of it; NaN without backward)
grad_in         [B, P, R]          norm of dLoss/dh at every mixed input (NaN without backward):
                                   under AttnRes only the path through that read's sublayer
param_grad      [L]                norm of each sublayer's parameter gradient (attention + its norm, ...)
mixer_grad      [R]                norm of each depth mixer's parameter gradient (NaN for PreNorm)
==============  =================  ==========================================================

``meta`` holds the model description (name, residual, config, read/source/sublayer labels,
block starts), the string tokens, and flags (non-finite values seen while recording).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe._version import __version__
from attnres_probe.axis import RESIDUALS, SourceAxis
from attnres_probe.io import (
    atomic_write,
    clear_leftovers,
    exclusive_lock,
    fault_point,
    read_json,
    remove_stale_temps,
    replace_directory,
    set_aside,
    sha256_file,
    write_error,
)
from attnres_probe.numeric import token_mean

__all__ = ["DepthTrace", "TraceError", "SCHEMA_VERSION", "check_save_target", "unique_names"]

SCHEMA_VERSION = 2  # 2: grad_out (a version-1 trace loads with grad_out all NaN)
META_FILE = "trace.json"

# array name -> axes (used for shapes, tidy frames and file layout)
CUBE = ("depth_weights", "logits", "contrib")  # [B, P, R, S]
KINDS = {"weights": "depth_weights", "logits": "logits", "contrib": "contrib"}
READ_ARRAYS = ("rms_in", "grad_in")  # [B, P, R]
TOKEN_ARRAYS = ("tokens", "mask", "loss")  # [B, P]
SOURCE_ARRAYS = ("rms_out", "grad_out")  # [B, P, L+1]
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
ADDED_IN = {"grad_out": 2}  # arrays a trace of an older schema version does not hold (NaN when loaded)


class TraceError(ValueError):
    """A trace directory is missing, corrupt, or from a newer schema."""


def check_save_target(directory: str | Path, overwrite: bool = False) -> Path:
    """Check that a trace may be saved into ``directory`` (see :meth:`DepthTrace.save`); return it as a Path.

    Raises:
        FileExistsError: the folder holds a trace or an incomplete one (without ``overwrite``),
            or other files.
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
        what = (
            "already holds a saved DepthTrace"
            if (directory / META_FILE).is_file()
            else f"holds an incomplete DepthTrace (trace files without {META_FILE}: an interrupted save?)"
        )
        raise FileExistsError(
            f"{directory} {what}; pass overwrite=True "
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
    grad_out: np.ndarray
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
            **{n: (B, P, L + 1) for n in SOURCE_ARRAYS},
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
    def axis(self) -> SourceAxis:
        """The trace's common source axis (built from its metadata): which sources each read
        sees, the partial block's column, the expanded sublayer view."""
        return SourceAxis.from_meta(self.meta)

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
        read = _integer("read", read, "a label such as 'L0.mlp' or an integer index")
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
        source = _integer("source", source, "a label such as 'embed' or an integer index")
        if not -len(labels) <= source < len(labels):
            raise IndexError(f"source {source} is out of range; this trace has sources 0..{len(labels) - 1}")
        return source % len(labels)

    def token_index(self, token: int, batch: int = 0) -> int:
        """Position of real token ``token`` of sequence ``batch`` (negative counts from its last real token).

        Raises:
            IndexError: ``token`` is not among the sequence's real (unpadded) tokens.
        """
        token = _integer("token", token, "an integer position")
        batch = _integer("batch", batch, "an integer index")
        if not 0 <= batch < self.tokens.shape[0]:
            raise IndexError(f"batch {batch} is out of range; this trace has {self.tokens.shape[0]} sequences")
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
        axis = self.axis
        if self.residual != "block":
            return arr, axis.expanded_labels
        out = arr[..., axis.expanded_columns].copy()
        # a sublayer not yet written by the time of a read is unavailable to it
        for r in range(axis.n_reads):
            out[:, :, r, r + 1 :] = np.nan
        return out, axis.expanded_labels

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
        saved trace is replaced only with ``overwrite=True``; a folder holding anything else is
        never written into (its files could share a name with the trace's).

        The trace is written into a hidden folder beside ``directory`` and put in place by one
        rename (a folder swap), so at every moment ``directory`` holds the old trace or the new
        one, complete: a failed write (a full disk) or a killed process leaves the old trace as
        it was and nothing else behind (hidden leftovers of a killed save are removed by the next
        one). A folder that exists is replaced as a whole, hidden files included; the working
        directory (or a folder holding it) and a mount point cannot be renamed and are written
        into file by file instead, ``trace.json`` last. While saving, the destination is locked
        (``.{name}.lock`` beside it): a second writer is refused.

        Raises:
            FileExistsError: the folder holds a trace (without ``overwrite``) or other files;
                :class:`~attnres_probe.io.DestinationBusyError` when another writer holds it.
            NotADirectoryError: ``directory`` is a file.
            OSError: the write failed (one line naming the folder and the cause).
        """
        directory = check_save_target(directory, overwrite)  # fail fast, before taking the lock
        target = Path(os.path.realpath(directory))
        had_trace = (target / META_FILE).is_file()
        json.dumps(self.meta, default=_json_default)  # an unstorable value fails before anything is written
        try:
            with exclusive_lock(target):
                _clear_leftovers(target)
                check_save_target(target, overwrite)  # again, now that no one else writes here
                self._save_locked(target)
        except (FileExistsError, NotADirectoryError):
            raise
        except OSError as exc:
            kept = "the trace already there is unchanged" if had_trace else "nothing was written"
            raise write_error(exc, "the trace", directory, kept) from None
        return directory

    def _save_locked(self, target: Path) -> None:
        """The body of :meth:`save`, with the lock held and the target checked."""
        if target.is_dir() and _holds_cwd(target):
            self._write_files(target, in_place=True)  # renaming the working directory away would strand it
            return
        staging = target.parent / f".{target.name}.new-{os.getpid()}-{secrets.token_hex(4)}"
        staging.mkdir(0o777)  # the usual permissions (the umask applies) ...
        try:
            if target.is_dir():
                os.chmod(staging, os.stat(target).st_mode & 0o7777)  # ... or the replaced folder's
            self._write_files(staging, in_place=False)
            try:
                replace_directory(staging, target)
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.EXDEV) or not target.is_dir():
                    raise
                self._write_files(target, in_place=True)  # a mount point cannot be renamed: write into it
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def _write_files(self, folder: Path, in_place: bool) -> None:
        """The Parquet tables, then ``trace.json`` naming their hashes (last: it marks the trace complete).

        ``in_place``: ``folder`` is the destination itself; every file is replaced atomically and,
        if the write fails, the files it added are removed again.
        """
        folder.mkdir(parents=True, exist_ok=True)
        before = {name for name in (*FILES, META_FILE) if (folder / name).exists()}
        try:
            hashes = {}
            for fname, names in FILES.items():
                table = pd.DataFrame({n: getattr(self, n).ravel() for n in names})
                path = folder / fname
                if in_place:
                    atomic_write(path, lambda p, t=table: t.to_parquet(p, index=False))
                else:
                    table.to_parquet(path, index=False)
                fault_point(f"trace.save:{fname}")
                hashes[fname] = sha256_file(path)
            doc = {
                "schema_version": SCHEMA_VERSION,
                "attnres_probe": __version__,
                "shapes": {n: list(getattr(self, n).shape) for n in ALL_ARRAYS},
                "files": hashes,
                "meta": self.meta,
            }
            text = json.dumps(doc, indent=1, default=_json_default)
            atomic_write(folder / META_FILE, lambda p: p.write_text(text))
            fault_point("trace.save:written")
        except BaseException:
            if in_place:
                for name in {*FILES, META_FILE} - before:
                    (folder / name).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, directory: str | Path) -> DepthTrace:
        """Read a trace written by :meth:`save`.

        Its ``trace.json`` is checked against the schema before any table is read (types,
        shapes consistent with one another and with the residual rule, labels as long as the
        axes), then every table against its hash and shape.

        Raises:
            TraceError: the trace is missing, corrupt, inconsistent or too new; the message
                names the first violation in one line.
        """
        directory = Path(directory)
        if not directory.exists():  # a save killed in the middle of its two-rename fallback swap
            aside = [p for p in set_aside(directory) if (p / META_FILE).is_file()]
            directory = aside[-1] if aside else directory  # the previous trace, put back by the next save
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise TraceError(f"{meta_path} is missing: {directory} is not a saved DepthTrace")
        doc = read_json(meta_path, TraceError, max_bytes=MAX_META_BYTES)
        shapes = _check_doc(doc, meta_path, directory)
        arrays: dict[str, np.ndarray] = {}
        for fname, names in FILES.items():
            path = directory / fname
            if not path.is_file():
                raise TraceError(f"{path} is missing")
            if doc["files"][fname] != sha256_file(path):
                raise TraceError(f"{path} does not match the checksum in {META_FILE}: the trace is corrupt")
            try:
                table = pd.read_parquet(path)
            except Exception as exc:  # pyarrow raises several types for a damaged file
                raise TraceError(f"{path} is not a readable Parquet file ({exc})") from None
            for n in names:
                if n not in shapes:  # not in an older schema: not recorded then
                    continue
                shape = shapes[n]
                if n not in table.columns:
                    raise TraceError(f"{path} has no column {n!r}: the trace is corrupt")
                values = table[n].to_numpy()
                if values.size != math.prod(shape):
                    raise TraceError(f"{path}: column {n!r} has {values.size} values; shape {shape} needs {math.prod(shape)}")
                arrays[n] = values.reshape(shape)
        for n in ADDED_IN:
            if n not in arrays:
                like = "rms_out" if n in SOURCE_ARRAYS else "rms_in"
                arrays[n] = np.full(arrays[like].shape, np.nan, np.float32)
        _check_meta_against_arrays(doc["meta"], arrays, meta_path)
        try:
            return cls(**arrays, meta=doc["meta"])
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{directory}: {exc}") from None

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


def _integer(what: str, value: Any, accepted: str) -> int:
    """``value`` as an int; a bool, a float or anything else that is not an integer is refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be {accepted}; got {value!r} ({type(value).__name__})")
    return int(value)


def _holds_cwd(folder: Path) -> bool:
    """Whether ``folder`` is the working directory or one of its parents."""
    try:
        cwd = Path(os.getcwd())
    except OSError:
        return False
    return cwd == folder or folder in cwd.parents


def _clear_leftovers(target: Path) -> None:
    """Undo what a killed save left beside ``target`` (call with the lock held).

    A trace set aside by an interrupted folder swap is put back; the hidden folders of
    unfinished saves and the temporary files of killed writers are removed.
    """
    clear_leftovers(target, lambda p: (p / META_FILE).is_file())
    if target.is_dir():
        for name in (*FILES, META_FILE):
            remove_stale_temps(target / name)


# -- the schema of trace.json ----------------------------------------------------------------
MAX_META_BYTES = 256 * 2**20
_RANKS = {
    **{n: 2 for n in TOKEN_ARRAYS},
    **{n: 4 for n in CUBE},
    **{n: 3 for n in READ_ARRAYS + SOURCE_ARRAYS},
    **{n: 1 for n in LAYER_ARRAYS + MIXER_ARRAYS},
}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def _check_doc(doc: Any, meta_path: Path, directory: Path) -> dict[str, tuple[int, ...]]:
    """Check ``trace.json`` against the schema; return the arrays' shapes.

    Raises:
        TraceError: the first violation, in one line.
    """

    def bad(msg: str) -> TraceError:
        return TraceError(f"{meta_path}: {msg}; the trace is corrupt")

    if not isinstance(doc, dict):
        raise bad(f"the document is a {type(doc).__name__}, not an object")
    version = doc.get("schema_version")
    if not _is_int(version) or version < 1:
        raise TraceError(f"{meta_path} has no valid schema_version (a positive integer); got {version!r}")
    if version > SCHEMA_VERSION:
        raise TraceError(
            f"{directory} is a schema-version {version} trace; this attnres-probe ({__version__}) reads "
            f"versions up to {SCHEMA_VERSION}: upgrade attnres-probe"
        )
    for key, kind in (("shapes", dict), ("files", dict), ("meta", dict)):
        if key not in doc:
            raise bad(f"the key {key!r} is missing")
        if not isinstance(doc[key], kind):
            raise bad(f"{key!r} is a {type(doc[key]).__name__}, not an object")
    files = doc["files"]
    for fname in FILES:
        if not isinstance(files.get(fname), str):
            raise bad(f"files.{fname} (its sha256) is missing or not a string")
    shapes: dict[str, tuple[int, ...]] = {}
    for n in ALL_ARRAYS:
        if n in ADDED_IN and version < ADDED_IN[n] and n not in doc["shapes"]:
            continue  # an older trace: filled with NaN on load
        shape = doc["shapes"].get(n)
        if not isinstance(shape, list) or len(shape) != _RANKS[n] or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"shapes.{n} must be a list of {_RANKS[n]} non-negative integers; got {shape!r}")
        shapes[n] = tuple(shape)
    B, P, R, S = shapes["depth_weights"]
    want = {
        **{n: (B, P) for n in TOKEN_ARRAYS},
        **{n: (B, P, R, S) for n in CUBE},
        **{n: (B, P, R) for n in READ_ARRAYS},
        **{n: (B, P, R) for n in SOURCE_ARRAYS},
        "param_grad": (R - 1,),
        "mixer_grad": (R,),
    }
    for n, shape in want.items():
        if n in shapes and shapes[n] != shape:  # (an array of a newer schema is absent from an older trace)
            raise bad(f"shapes.{n} is {list(shapes[n])}; the other arrays make it {list(shape)}")
    if B < 1 or P < 1 or R < 3 or R % 2 == 0 or S < 2:
        raise bad(f"the arrays' shape [B, P, R, S] = {[B, P, R, S]} is not that of a trace (B, P >= 1; R = 2 * n_layers + 1)")
    meta = doc["meta"]
    for key in ("residual", "read_labels", "source_labels", "str_tokens"):
        if key not in meta:
            raise bad(f"meta.{key} is missing")
    if meta["residual"] not in RESIDUALS:
        raise bad(f"meta.residual is {meta['residual']!r}; accepted values are {', '.join(RESIDUALS)}")
    for key, length in (("read_labels", R), ("source_labels", S), ("sublayer_labels", R - 1)):
        if key not in meta and key == "sublayer_labels":
            continue
        if not _str_list(meta[key]):
            raise bad(f"meta.{key} must be a list of strings; got a {type(meta[key]).__name__}")
        if len(meta[key]) != length:
            raise bad(f"meta.{key} has {len(meta[key])} labels; the arrays have {length}")
    if meta.get("name") is not None and not isinstance(meta["name"], str):
        raise bad(f"meta.name must be a string; got {meta['name']!r}")
    if "flags" in meta and not _str_list(meta["flags"]):
        raise bad(f"meta.flags must be a list of strings; got {meta['flags']!r}")
    if meta.get("config") is not None and not isinstance(meta["config"], dict):
        raise bad(f"meta.config must be an object; got a {type(meta['config']).__name__}")
    starts = meta.get("block_starts")
    if starts is not None and not (isinstance(starts, list) and all(_is_int(b) for b in starts)):
        raise bad(f"meta.block_starts must be a list of integers; got {starts!r}")
    try:
        axis = SourceAxis.from_meta(meta)
    except (ValueError, TypeError) as exc:
        raise bad(f"meta does not describe a source axis ({exc})") from None
    if (axis.n_reads, axis.n_sources) != (R, S):
        raise bad(
            f"meta describes a {axis.residual} model with {axis.n_reads} reads and {axis.n_sources} sources "
            f"(residual {axis.residual!r}, n_layers {axis.n_layers}, block_starts {list(axis.block_starts)}); "
            f"the arrays have {R} reads and {S} sources"
        )
    tokens = meta["str_tokens"]
    if not isinstance(tokens, list) or len(tokens) != B or not all(_str_list(row) for row in tokens):
        raise bad(f"meta.str_tokens must be {B} list(s) of strings, one per sequence")
    return shapes


def _check_meta_against_arrays(meta: dict[str, Any], arrays: dict[str, np.ndarray], meta_path: Path) -> None:
    """The checks that need the tables: one string token per real token of every sequence."""
    mask = arrays["mask"]
    for b, row in enumerate(meta["str_tokens"]):
        n = int(mask[b].sum())
        if len(row) != n:
            raise TraceError(
                f"{meta_path}: meta.str_tokens[{b}] has {len(row)} strings; sequence {b} has {n} tokens; "
                "the trace is corrupt"
            )


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot store {type(obj).__name__} in trace metadata")
