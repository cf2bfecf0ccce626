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
patterns        [B, l, h, P, P]    optional (None unless recorded: ``Probe.run(..., patterns=True)``):
                float32            the attention patterns of the l recorded layers and h recorded heads
                                   (all of them, or those ``patterns=[layers]``, ``pattern_heads=``
                                   chose: ``meta["pattern_layers"]``, ``meta["pattern_heads"]``), query
                                   positions x key positions (softmax over keys; 0 above the diagonal);
                                   4 B l h P^2 bytes
native          {name: [B, P, ..]} optional: a model family's own weights beside the common axis
                                   (e.g. Qwen3-AttnRes's softmax over its cumulative states, mHC's
                                   pre/post/comb); ``meta["native"]`` says what each one is
==============  =================  ==========================================================

``meta`` holds the model description (name, residual, config, read/source/sublayer labels,
block starts), the string tokens, and flags (non-finite values seen while recording).

This module is the record: arrays, selection, tidy frames, summary. Saving and loading (the
folder layout and the schema of ``trace.json``) live in :mod:`attnres_probe.trace_store`, which
``save``/``load`` call; the figures (``heatmap``, ``mean_heatmap``, ``source_heatmap``,
``magnitudes``, ``gradients``, and the notebook card ``_repr_html_``) are functions of
:mod:`attnres_probe.figures`, which binds them onto ``DepthTrace`` when it is imported (the
package's ``attnres_probe.DepthTrace`` and ``attnres_probe.Probe`` import it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe.axis import SourceAxis
from attnres_probe.numeric import token_mean
from attnres_probe.trace_store import (  # noqa: F401  (FILES, META_FILE, check_save_target: importable from here too)
    ALL_ARRAYS,
    DTYPES,
    FILES,
    META_FILE,
    SCHEMA_VERSION,
    TraceError,
    array_shapes,
    check_save_target,
    load_trace,
    save_trace,
)

__all__ = ["DepthTrace", "TraceError", "SCHEMA_VERSION", "check_save_target", "unique_names"]

KINDS = {"weights": "depth_weights", "logits": "logits", "contrib": "contrib"}
# notebook conveniences that attnres_probe.figures binds onto DepthTrace when it is imported
# (the package's DepthTrace and Probe import it): method -> the figures function it calls
PLOT_METHODS = {
    "heatmap": "token_heatmap",
    "mean_heatmap": "mean_heatmap",
    "source_heatmap": "source_heatmap",
    "magnitudes": "magnitudes",
    "gradients": "gradient_norms",
    "_repr_html_": "trace_summary_html",
}


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
    patterns: np.ndarray | None = None  # [B, l, h, P, P] attention patterns of the recorded layers and heads
    # a model family's own weights beside the common axis (models from elsewhere: the softmax over its
    # own sources, mHC's pre/post/comb ...): name -> [B, P, ...] float32; meta["native"] describes them
    native: dict[str, np.ndarray] | None = None

    def __post_init__(self) -> None:
        for name in ALL_ARRAYS:
            arr = np.asarray(getattr(self, name))
            setattr(self, name, arr.astype(DTYPES.get(name, np.float32), copy=False))
        if self.patterns is not None:
            self.patterns = np.asarray(self.patterns).astype(np.float32, copy=False)
        if self.native is not None:
            self.native = {str(k): np.asarray(v).astype(np.float32, copy=False) for k, v in self.native.items()}
        self._check_shapes()
        if "flags" not in self.meta:
            self.meta["flags"] = self.nonfinite_flags()

    # -- shape bookkeeping ---------------------------------------------------------------
    def _check_shapes(self) -> None:
        B, P = self.tokens.shape
        want = array_shapes(B, P, len(self.read_labels), len(self.source_labels))
        for name, shape in want.items():
            got = getattr(self, name).shape
            if got != shape:
                raise TraceError(f"trace array {name!r} has shape {got}; expected {shape} from the tokens and labels")
        if self.patterns is not None:
            got = self.patterns.shape
            layers, heads = self.meta.get("pattern_layers"), self.meta.get("pattern_heads")
            n_layers = (len(self.read_labels) - 1) // 2
            if layers is None:
                layers = list(range(got[1] if len(got) == 5 and got[1] == n_layers else n_layers))
            if heads is None:
                heads = list(range(got[2] if len(got) == 5 else 1))
            if not (_index_list(layers, n_layers) and _index_list(heads, None)):
                raise TraceError(f"meta 'pattern_layers' {layers!r} / 'pattern_heads' {heads!r} must be increasing "
                                 f"lists of distinct layer (0..{n_layers - 1}) and head indices")
            shape = (B, len(layers), len(heads), P, P)
            if got != shape:
                raise TraceError(f"trace array 'patterns' has shape {got}; expected {shape} ([batch, recorded layer, "
                                 "recorded head, query_pos, key_pos]) from the tokens, labels and recorded layers and heads")
        for name, arr in (self.native or {}).items():
            if arr.shape[:2] != (B, P):
                raise TraceError(f"native array {name!r} has shape {arr.shape}; it must start with [batch, pos] = {[B, P]}")

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

    @property
    def has_patterns(self) -> bool:
        """Whether the trace holds attention patterns (recorded with ``patterns=True``)."""
        return self.patterns is not None

    @property
    def pattern_layers(self) -> list[int]:
        """The layers whose attention patterns the trace holds, in the order of ``patterns``' layer axis
        (every layer unless ``patterns=[...]`` chose some; [] without patterns)."""
        if self.patterns is None:
            return []
        return [int(i) for i in self.meta.get("pattern_layers") or range(self.patterns.shape[1])]

    @property
    def pattern_heads(self) -> list[int]:
        """The heads whose attention patterns the trace holds, in the order of ``patterns``' head axis."""
        if self.patterns is None:
            return []
        return [int(i) for i in self.meta.get("pattern_heads") or range(self.patterns.shape[2])]

    def pattern(self, layer: int, head: int | None = None, token: int | None = None, batch: int = 0) -> np.ndarray:
        """Attention pattern of one layer (and head) of sequence ``batch``, over its real tokens.

        Args:
            layer: transformer block (0-based; negative counts from the last).
            head: one head, or None for every head.
            token: one query position (negative counts from the last real token), or None for all.
            batch: which sequence.

        Returns:
            float32, key positions last, over the sequence's n real tokens: [n] (a head and a
            token: the softmax over key positions, 0 after ``token``), [H, n] (every head at a
            token), [n, n] (a head, every query) or [H, n, n].

        Raises:
            ValueError: the trace holds no patterns (record with ``Probe(model).run(text, patterns=True)``).
            IndexError: layer, head or token out of range.
        """
        if self.patterns is None:
            raise ValueError("this trace holds no attention patterns: record it with Probe(model).run(text, patterns=True)")
        slot, head_slot = self.pattern_slot(layer, head)
        batch = _integer("batch", batch, "an integer index")
        if not 0 <= batch < self.tokens.shape[0]:
            raise IndexError(f"batch {batch} is out of range; this trace has {self.tokens.shape[0]} sequences")
        n = int(self.mask[batch].sum())
        block = self.patterns[batch, slot]  # [h, P, P]
        if head_slot is not None:
            block = block[head_slot]
        if token is not None:
            return block[..., self.token_index(token, batch), :n]
        return block[..., :n, :n]

    def pattern_slot(self, layer: int, head: int | None = None) -> tuple[int, int | None]:
        """(index into ``patterns``' layer axis, into its head axis) of a model layer and head (negative
        counting from the model's last layer; a head from the last of the trace's heads).

        Raises:
            IndexError: out of the model's range.
            ValueError: that layer or head was not recorded (the message lists those that were).
        """
        n_layers = (len(self.read_labels) - 1) // 2
        layers, heads = self.pattern_layers, self.pattern_heads
        layer = _integer("layer", layer, "an integer index")
        if not -n_layers <= layer < n_layers:
            raise IndexError(f"layer {layer} is out of range; this trace has layers 0..{n_layers - 1}")
        layer %= n_layers
        if layer not in layers:
            raise ValueError(f"layer {layer}'s attention patterns were not recorded; this trace holds layers "
                             f"{_ranges(layers)} (record it with patterns=[{layer}, ...])")
        if head is None:
            return layers.index(layer), None
        head = _integer("head", head, "an integer index or None")
        H = int(self.meta.get("pattern_n_heads") or (max(heads) + 1 if heads else 0))  # the model's heads
        if not -H <= head < H:
            raise IndexError(f"head {head} is out of range; this trace has heads 0..{H - 1}")
        head %= H
        if head not in heads:
            raise ValueError(f"head {head}'s attention patterns were not recorded; this trace holds heads "
                             f"{_ranges(heads)} (record it with pattern_heads=[{head}, ...])")
        return layers.index(layer), heads.index(head)

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

    def normalised_weights(self) -> np.ndarray:
        """[B, P, R, S] the depth weights every page shows: AttnRes's softmax weights as recorded; for the
        rules whose recorded weights are coefficients (PreNorm's ones, Hyper-Connections', DenseFormer's,
        the cumulative-state rule's) each read's coefficients over their sum, c / sum(c) (PreNorm: 1/k).
        Every consumer of a read is a norm, so this normalised mixture is the read's input as its
        sublayer sees it. A read whose signed coefficients cancel has none (NaN)."""
        from attnres_probe.axis import COEFFICIENT_RULES
        from attnres_probe.numeric import over_sum

        if self.residual in COEFFICIENT_RULES:
            return over_sum(self.depth_weights).astype(np.float32)
        return self.depth_weights

    def weights(
        self, token: int | None = None, read: int | str | None = None, batch: int = 0, kind: str = "weights",
        normalised: bool = True,
    ) -> pd.DataFrame:
        """Depth weights as a labelled DataFrame, reads x sources: by default the normalised weights
        every page shows (:meth:`normalised_weights`: each read's row sums to one under every rule).

        Args:
            token: position in sequence ``batch``; None averages over every real token
                (NaN-aware: unavailable cells stay NaN).
            read: keep one read (label like ``"L3.mlp"`` or index); None keeps all.
            batch: which sequence of the batch (ignored when averaging over tokens: all are used).
            kind: ``"weights"`` | ``"logits"`` | ``"contrib"``.
            normalised: ``kind="weights"`` only: False gives the recorded coefficients c of
                h = sum_i c_i v_i (PreNorm: all one; mHC: they need not sum to one), as
                :meth:`coefficients` does.

        Returns:
            DataFrame indexed by read label, one column per source label.
        """
        arr = self.normalised_weights() if kind == "weights" and normalised else self.cube(kind)
        if token is None:
            data = token_mean(arr[self.mask])  # (R, S)
        else:
            data = arr[batch, self.token_index(token, batch)]
        df = pd.DataFrame(data, index=pd.Index(self.read_labels, name="read"), columns=pd.Index(self.source_labels, name="source"))
        if read is not None:
            df = df.iloc[[self.read_index(read)]]
        return df

    def coefficients(self, token: int | None = None, read: int | str | None = None, batch: int = 0) -> pd.DataFrame:
        """The recorded coefficients c of each read, h = sum_i c_i v_i (AttnRes: its softmax weights;
        PreNorm: all one; Hyper-Connections, DenseFormer, the cumulative-state rule: the effective
        coefficients), reads x sources (``weights(..., normalised=False)``)."""
        return self.weights(token, read, batch, normalised=False)

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
        weight (the normalised weight every page shows, :meth:`normalised_weights`), coefficient (the
        recorded coefficient), logit, contrib. With ``dropna`` (default), unavailable cells are left out.
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
                "weight": self.normalised_weights().ravel(),
                "coefficient": self.depth_weights.ravel(),
                "logit": self.logits.ravel(),
                "contrib": self.contrib.ravel(),
            }
        )
        keep = self.mask[b, p]
        if dropna:
            keep &= ~np.isnan(df["coefficient"].to_numpy())
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

    # -- persistence (attnres_probe.trace_store) -----------------------------------------------
    def save(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write the trace into ``directory``: Parquet tables + ``trace.json`` (schema, shapes, hashes).

        ``directory`` must be new or empty (hidden files aside). A folder that already holds a
        saved trace is replaced only with ``overwrite=True``; a folder holding anything else is
        never written into (its files could share a name with the trace's).

        The trace is written into a hidden folder beside ``directory`` and put in place by one
        rename (a folder swap, :func:`attnres_probe.io.write_directory`), so at every moment
        ``directory`` holds the old trace or the new one, complete: a failed write (a full disk)
        or a killed process leaves the old trace as it was and nothing else behind (hidden
        leftovers of a killed save are removed by the next one). A folder that exists is replaced
        as a whole, hidden files included; the working directory (or a folder holding it) and a
        mount point cannot be renamed and are written into file by file instead, ``trace.json``
        last. While saving, the destination is locked (``.{name}.lock`` beside it): a second
        writer is refused.

        Raises:
            FileExistsError: the folder holds a trace (without ``overwrite``) or other files;
                :class:`~attnres_probe.io.DestinationBusyError` when another writer holds it.
            NotADirectoryError: ``directory`` is a file.
            OSError: the write failed (one line naming the folder and the cause).
        """
        arrays = {n: getattr(self, n) for n in ALL_ARRAYS}
        if self.patterns is not None:
            arrays["patterns"] = self.patterns
        if self.native:
            arrays["native"] = self.native
        return save_trace(directory, arrays, self.meta, overwrite=overwrite)

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
        arrays, meta, folder = load_trace(directory)
        try:
            return cls(**arrays, meta=meta)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{folder}: {exc}") from None

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

    def __repr__(self) -> str:
        s = self.summary()
        flag = f", flags={s['flags']}" if s["flags"] else ""
        return (
            f"DepthTrace(name={s['name']!r}, residual={s['residual']!r}, sequences={s['sequences']}, "
            f"tokens={s['tokens']}, reads={s['reads']}, sources={s['sources']}, mean_loss={s['mean_loss']:.4f}{flag})"
        )

    # -- figures (attnres_probe.figures binds them) ------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # only reached for a name the class does not have: a plot method before figures was imported
        if name in PLOT_METHODS and name != "_repr_html_":
            raise AttributeError(
                f"DepthTrace.{name} is added by attnres_probe.figures, which is not imported yet: "
                f"`import attnres_probe.figures` (the package's DepthTrace and Probe import it), or call "
                f"attnres_probe.figures.{PLOT_METHODS[name]}(trace)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


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


def _index_list(values: Any, n: int | None) -> bool:
    """Whether ``values`` is a non-empty, strictly increasing list of integers in 0..n-1 (any n: None)."""
    return (isinstance(values, (list, tuple)) and len(values) > 0
            and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
            and all(0 <= v and (n is None or v < n) for v in values) and all(a < b for a, b in zip(values, values[1:])))


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0..2, 5'``."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}..{v}")
            start = None
    return ", ".join(out)
