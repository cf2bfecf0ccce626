"""A trace on disk: the schema of ``trace.json``, and the save and load of a trace folder.

A saved trace is one folder: six Parquet tables (one column per array, raveled), a seventh,
``patterns.parquet``, when the trace holds attention patterns (their lower triangles: the
entries above the diagonal are zero), and ``trace.json`` (schema version, package version, every array's shape, the tables' sha256, the
trace's metadata), written last because it vouches for the tables. The folder is written by
:func:`attnres_probe.io.write_directory` (locked, swapped in whole).

This module takes a trace's fields as plain data (arrays by name, the metadata dict) and never
imports :mod:`attnres_probe.trace`: ``DepthTrace.save`` and ``DepthTrace.load`` call
:func:`save_trace` and :func:`load_trace`. :func:`array_shapes` is the one table of every
array's shape, used by the record's own check and by the schema.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from attnres_probe._version import __version__
from attnres_probe.axis import RESIDUALS, SourceAxis
from attnres_probe.io import fault_point, read_json, set_aside, sha256_file, write_directory, write_error

__all__ = [
    "ALL_ARRAYS",
    "FILES",
    "META_FILE",
    "OPTIONAL_ARRAYS",
    "SCHEMA_VERSION",
    "TraceError",
    "array_shapes",
    "check_save_target",
    "load_trace",
    "save_trace",
]

SCHEMA_VERSION = 4  # 2: grad_out (a version-1 trace loads with grad_out all NaN); 3: optional attention patterns;
# 4: optional native weights of models from elsewhere (native.safetensors)
NATIVE_FILE = "native.safetensors"
META_FILE = "trace.json"
MAX_META_BYTES = 256 * 2**20

# the arrays by axes (B = batch, P = positions, R = reads = L+1, S = sources, L = sublayers)
TOKEN_ARRAYS = ("tokens", "mask", "loss")  # [B, P]
CUBE = ("depth_weights", "logits", "contrib")  # [B, P, R, S]
READ_ARRAYS = ("rms_in", "grad_in")  # [B, P, R]
SOURCE_ARRAYS = ("rms_out", "grad_out")  # [B, P, L+1]
LAYER_ARRAYS = ("param_grad",)  # [L]
MIXER_ARRAYS = ("mixer_grad",)  # [R]
ALL_ARRAYS = TOKEN_ARRAYS + CUBE + READ_ARRAYS + SOURCE_ARRAYS + LAYER_ARRAYS + MIXER_ARRAYS
FILES = {  # the tables of a saved trace and the arrays each holds
    "tokens.parquet": TOKEN_ARRAYS,
    "cube.parquet": CUBE,
    "reads.parquet": READ_ARRAYS,
    "sources.parquet": SOURCE_ARRAYS,
    "layers.parquet": LAYER_ARRAYS,
    "mixers.parquet": MIXER_ARRAYS,
}
DTYPES = {"tokens": np.int64, "mask": np.bool_}  # every other array is float32
# arrays a trace may hold or not (None): attention patterns [B, n_layers, H, P, P], recorded on request
# (Probe.run(..., patterns=True)); saved as the lower triangle of every [P, P] pattern
OPTIONAL_FILES = {"patterns.parquet": ("patterns",)}
OPTIONAL_ARRAYS = ("patterns",)
ADDED_IN = {"grad_out": 2}  # arrays a trace of an older schema version does not hold (NaN when loaded)


class TraceError(ValueError):
    """A trace directory is missing, corrupt, or from a newer schema."""


def array_shapes(B: int, P: int, R: int, S: int, H: int | None = None) -> dict[str, tuple[int, ...]]:
    """The shape of every array of a trace with B sequences, P positions, R reads and S sources;
    with H (attention heads) also that of the optional ``patterns``: [B, n_layers, H, P, P]
    (n_layers = (R - 1) / 2; query positions, then key positions)."""
    L = R - 1
    shapes = {
        **{n: (B, P) for n in TOKEN_ARRAYS},
        **{n: (B, P, R, S) for n in CUBE},
        **{n: (B, P, R) for n in READ_ARRAYS},
        **{n: (B, P, L + 1) for n in SOURCE_ARRAYS},
        **{n: (L,) for n in LAYER_ARRAYS},
        **{n: (R,) for n in MIXER_ARRAYS},
    }
    if H is not None:
        shapes["patterns"] = (B, L // 2, H, P, P)
    return shapes


def pattern_triangle(patterns: np.ndarray) -> np.ndarray:
    """The lower triangles (diagonal included) of patterns [..., P, P], raveled: what is saved."""
    P = patterns.shape[-1]
    rows, cols = np.tril_indices(P)
    return np.ascontiguousarray(patterns[..., rows, cols]).ravel()


def pattern_from_triangle(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Patterns of ``shape`` [..., P, P] from :func:`pattern_triangle`'s values (zero above the diagonal)."""
    P = shape[-1]
    rows, cols = np.tril_indices(P)
    out = np.zeros(shape, np.float32)
    out[..., rows, cols] = values.reshape(*shape[:-2], len(rows))
    return out


RANKS = {n: len(shape) for n, shape in array_shapes(1, 1, 3, 2).items()}


# -- saving ----------------------------------------------------------------------------------
def check_save_target(directory: str | Path, overwrite: bool = False) -> Path:
    """Check that a trace may be saved into ``directory`` (see :func:`save_trace`); return it as a Path.

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
    if any(p.name not in {META_FILE, *FILES, *OPTIONAL_FILES, NATIVE_FILE} for p in entries):
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


def is_trace_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a complete save (its ``trace.json``, written last)."""
    return (folder / META_FILE).is_file()


def save_trace(directory: str | Path, arrays: Mapping[str, np.ndarray], meta: dict[str, Any], overwrite: bool = False) -> Path:
    """Write a trace (its arrays by name and its metadata) into folder ``directory``; see ``DepthTrace.save``.

    Raises:
        FileExistsError: the folder holds a trace (without ``overwrite``) or other files;
            :class:`~attnres_probe.io.DestinationBusyError` when another writer holds it.
        NotADirectoryError: ``directory`` is a file.
        OSError: the write failed (one line naming the folder and the cause).
    """
    directory = check_save_target(directory, overwrite)  # fail fast, before taking the lock
    had_trace = is_trace_folder(directory)
    json.dumps(meta, default=_json_default)  # an unstorable value fails before anything is written
    optional = {n: arrays[n] for n in OPTIONAL_ARRAYS if arrays.get(n) is not None}
    files = {**FILES, **{f: names for f, names in OPTIONAL_FILES.items() if all(n in optional for n in names)}}
    native = {str(k): np.ascontiguousarray(v, np.float32) for k, v in (arrays.get("native") or {}).items()}

    def write(folder: Path) -> None:
        hashes = {}
        if native:
            from safetensors.numpy import save_file

            save_file(native, str(folder / NATIVE_FILE))
            hashes[NATIVE_FILE] = sha256_file(folder / NATIVE_FILE)
        for fname, names in files.items():
            path = folder / fname
            columns = {n: pattern_triangle(np.asarray(arrays[n], np.float32)) if n == "patterns" else np.asarray(arrays[n]).ravel()
                       for n in names}
            pd.DataFrame(columns).to_parquet(path, index=False)
            fault_point(f"trace.save:{fname}")
            hashes[fname] = sha256_file(path)
        doc = {
            "schema_version": SCHEMA_VERSION if native else 3,  # without native arrays, older readers read it
            "attnres_probe": __version__,
            "shapes": {n: list(np.shape(arrays[n])) for n in (*ALL_ARRAYS, *optional)},
            **({"native_shapes": {k: list(v.shape) for k, v in native.items()}} if native else {}),
            "files": hashes,
            "meta": meta,
        }
        (folder / META_FILE).write_text(json.dumps(doc, indent=1, default=_json_default))
        fault_point("trace.save:written")

    try:
        write_directory(directory, write, is_trace_folder, [*files, *([NATIVE_FILE] if native else []), META_FILE],
                        check=lambda target: check_save_target(target, overwrite))  # again, now that no one else writes here
    except (FileExistsError, NotADirectoryError):
        raise
    except OSError as exc:
        kept = "the trace already there is unchanged" if had_trace else "nothing was written"
        raise write_error(exc, "the trace", directory, kept) from None
    return directory


# -- loading ---------------------------------------------------------------------------------
def load_trace(directory: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any], Path]:
    """Read a trace folder written by :func:`save_trace`: ``(arrays by name, metadata, the folder read)``.

    ``trace.json`` is checked against the schema before any table is read (types, shapes
    consistent with one another and with the residual rule, labels as long as the axes), then
    every table against its hash and shape. An array that an older schema did not hold is NaN.

    Raises:
        TraceError: the trace is missing, corrupt, inconsistent or too new; the message names
            the first violation in one line.
    """
    directory = Path(directory)
    if not directory.exists():  # a save killed in the middle of its two-rename fallback swap
        aside = [p for p in set_aside(directory) if is_trace_folder(p)]
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
        present = [n for n in names if n in shapes]
        table = _checked_table(path, doc["files"][fname], math.prod(shapes[present[0]]) if present else None)
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
    for fname, names in OPTIONAL_FILES.items():
        if not any(n in shapes for n in names):
            continue  # not recorded (or an older schema): None
        path = directory / fname
        if not path.is_file():
            raise TraceError(f"{path} is missing ({META_FILE} lists its arrays)")
        shape = shapes[names[0]]
        table = _checked_table(path, doc["files"].get(fname), math.prod(shape[:-2]) * shape[-1] * (shape[-1] + 1) // 2)
        for n in names:
            shape = shapes[n]
            if n not in table.columns:
                raise TraceError(f"{path} has no column {n!r}: the trace is corrupt")
            values = table[n].to_numpy()
            need = math.prod(shape[:-2]) * shape[-1] * (shape[-1] + 1) // 2  # lower triangles
            if values.size != need:
                raise TraceError(f"{path}: column {n!r} has {values.size} values; shape {shape} needs {need}")
            arrays[n] = pattern_from_triangle(values, shape)
    if "native_shapes" in doc:
        arrays["native"] = _native_arrays(directory, doc, shapes["depth_weights"][:2])
    full = array_shapes(*shapes["depth_weights"])
    for n in ADDED_IN:
        if n not in arrays:
            arrays[n] = np.full(full[n], np.nan, np.float32)
    _check_meta_against_arrays(doc["meta"], arrays, meta_path)
    return arrays, doc["meta"], directory


def _native_arrays(directory: Path, doc: dict[str, Any], lead: list[int]) -> dict[str, np.ndarray]:
    """The native weights of ``native.safetensors`` (schema 4), checked against the hash and the shapes
    that ``trace.json`` lists before anything is read (float32 only, each starting with [batch, pos])."""
    from safetensors import SafetensorError, safe_open

    path = directory / NATIVE_FILE
    want = doc["native_shapes"]
    if not isinstance(want, dict) or not all(isinstance(k, str) and isinstance(v, list) and len(v) >= 2 and v[:2] == list(lead)
                                             and all(_is_int(d) and d >= 0 for d in v) for k, v in want.items()):
        raise TraceError(f"{directory / META_FILE}: native_shapes must map names to shapes starting with {list(lead)}; got {want!r:.200}")
    if not path.is_file():
        raise TraceError(f"{path} is missing ({META_FILE} lists native arrays)")
    if doc["files"].get(NATIVE_FILE) != sha256_file(path):
        raise TraceError(f"{path} does not match the sha256 in {META_FILE}: the trace is corrupt")
    out = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            if set(f.keys()) != set(want):
                raise TraceError(f"{path} holds {sorted(f.keys())}; {META_FILE} lists {sorted(want)}")
            for name, shape in want.items():
                if list(f.get_slice(name).get_shape()) != shape or f.get_slice(name).get_dtype() != "F32":
                    raise TraceError(f"{path}: {name!r} is not float32 of shape {shape}")
                out[name] = f.get_tensor(name)
    except SafetensorError as exc:
        raise TraceError(f"{path} is not a readable safetensors file ({exc})") from None
    return out


# -- the schema of trace.json ----------------------------------------------------------------
def _checked_table(path: Path, checksum: str | None, rows: int | None = None) -> pd.DataFrame:
    """One of a trace's Parquet files, after its sha256 matched the one ``trace.json`` lists and its
    footer declared the ``rows`` the document's shapes imply (before a row is read); every column
    numeric."""
    if checksum != sha256_file(path):
        raise TraceError(f"{path} does not match the checksum in {META_FILE}: the trace is corrupt")
    try:
        if rows is not None:
            import pyarrow.parquet as pq

            declared = pq.ParquetFile(path).metadata.num_rows
            if declared != rows:
                raise TraceError(f"{path} holds {declared} rows; the shapes in {META_FILE} need {rows}: the trace is corrupt")
        table = pd.read_parquet(path)
    except TraceError:
        raise
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise TraceError(f"{path} is not a readable Parquet file ({exc})") from None
    text = [str(c) for c in table.columns if table[c].dtype.kind not in "biuf"]
    if text:
        raise TraceError(f"{path}: column {text[0]!r} holds {table[text[0]].dtype} values, not numbers: the trace is corrupt")
    return table


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
        if not isinstance(shape, list) or len(shape) != RANKS[n] or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"shapes.{n} must be a list of {RANKS[n]} non-negative integers; got {shape!r}")
        shapes[n] = tuple(shape)
    B, P, R, S = shapes["depth_weights"]
    patterns = doc["shapes"].get("patterns")
    if patterns is not None:  # optional: [B, recorded layers, recorded heads, P, P]
        if not isinstance(patterns, list) or len(patterns) != 5 or not all(_is_int(d) and d >= 0 for d in patterns):
            raise bad(f"shapes.patterns must be a list of 5 non-negative integers; got {patterns!r}")
        l, H = patterns[1], patterns[2]
        if [patterns[0], *patterns[3:]] != [B, P, P] or not 1 <= l <= (R - 1) // 2 or not 1 <= H <= 4096:
            raise bad(f"shapes.patterns is {patterns}; the other arrays make it [{B}, 1..{(R - 1) // 2} layers, "
                      f"1..4096 heads, {P}, {P}]")
        if not isinstance(files.get("patterns.parquet"), str):
            raise bad("files.patterns.parquet (its sha256) is missing or not a string")
        shapes["patterns"] = tuple(patterns)
    for n, shape in array_shapes(B, P, R, S).items():
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
