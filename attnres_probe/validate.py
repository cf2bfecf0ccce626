"""Every file the toolkit reads is untrusted: the checks its readers share.

A reader (stats folder, trace, checkpoint, fla/HF folder) checks what it is about to use before
allocating anything for it: JSON through :func:`attnres_probe.io.read_json` (size, encoding,
nesting, no NaN/Infinity); typed fields with their accepted range (:func:`field`); paths a folder
names kept inside it (:func:`inside`); sizes implied by a file checked against one memory bound
(:func:`check_bytes`, :func:`memory_cap`). A refusal is one line that names the file, the key and
what is accepted, raised as the reader's own error class.
"""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from attnres_probe.resources import human_bytes, memory_limits

__all__ = ["MAX_RESAMPLES", "MEMORY_CAP_ENV", "check_bytes", "field", "inside", "memory_cap", "npz_headers", "npz_inflated_bytes"]

MAX_RESAMPLES = 100_000  # bootstrap resamples a flag may ask for (1,000-10,000 is usual)
MEMORY_CAP_ENV = "ATTNRES_MEMORY_CAP"  # bytes (e.g. 8e9): the most any one file may make the toolkit allocate
_DEFAULT_SHARE = 0.5  # without the variable: half of the memory available when the file is read


def memory_cap() -> int:
    """The memory bound, stated once: ``$ATTNRES_MEMORY_CAP`` bytes if set, else half of what this
    process may still allocate (:func:`~attnres_probe.resources.available_memory`: physical memory,
    its cgroup's ``memory.max`` and its own ``RLIMIT_AS``, the least of them; 8 GB when none is known)."""
    return _cap()[0]


def _cap() -> tuple[int, str]:
    """(the bound, where it comes from, in words)."""
    env = os.environ.get(MEMORY_CAP_ENV)
    if env:
        try:
            cap = float(env)
        except ValueError:
            raise ValueError(f"${MEMORY_CAP_ENV} is {env!r}; give a number of bytes such as 8e9") from None
        if not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"${MEMORY_CAP_ENV} is {env!r}; give a positive number of bytes such as 8e9")
        return int(cap), f"${MEMORY_CAP_ENV}"
    limits = memory_limits()
    if not limits:
        return 8 * 10**9, "a default, as this machine's memory is unknown"
    name = min(limits, key=limits.__getitem__)
    return int(limits[name] * _DEFAULT_SHARE), f"half the {human_bytes(limits[name])} left under {name}"


def check_bytes(n: float, what: str, where: str, error: type[Exception]) -> None:
    """Refuse ``what`` (which would take ``n`` bytes, from ``where``) above :func:`memory_cap`; the
    message names the limit that sets the bound."""
    cap, source = _cap()
    if not math.isfinite(n) or n > cap:
        raise error(f"{where}: {what} would need {human_bytes(n) if math.isfinite(n) else 'unbounded memory'}, more "
                    f"than the {human_bytes(cap)} allowed for one file ({source}; ${MEMORY_CAP_ENV} sets the bound)")


_KINDS = {"int": "an integer", "number": "a finite number", "str": "a string", "bool": "true or false",
          "list": "a list", "dict": "an object"}


def field(doc: Any, key: str, kind: str, where: str, error: type[Exception], *, lo: float | None = None,
          hi: float | None = None, required: bool = True, default: Any = None) -> Any:
    """``doc[key]`` checked: ``kind`` one of int (an integral number; 64.0 is 64, 64.9 is refused), number
    (finite), str, bool, list, dict; ``lo`` / ``hi`` bound numbers (and lengths of str/list/dict).

    Raises:
        error: ``doc`` is not an object, the key is missing (when ``required``), or the value is of
            another type or out of range; the message names ``where``, the key and what is accepted.
    """
    if not isinstance(doc, dict):
        raise error(f"{where}: expected a JSON object holding {key!r}; got {type(doc).__name__}")
    if key not in doc:
        if required:
            raise error(f"{where}: key {key!r} is missing; it must be {_KINDS[kind]}{_range(lo, hi)}")
        return default
    v = doc[key]
    ok = {
        "int": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and float(v).is_integer(),
        "number": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
        "str": isinstance(v, str), "bool": isinstance(v, bool), "list": isinstance(v, list), "dict": isinstance(v, dict),
    }[kind]
    if not ok:
        raise error(f"{where}: {key!r} is {_show(v)}; it must be {_KINDS[kind]}{_range(lo, hi)}")
    if kind == "int":
        v = int(v)
    size = v if kind in ("int", "number") else len(v) if kind in ("str", "list", "dict") else None
    if size is not None and ((lo is not None and size < lo) or (hi is not None and size > hi)):
        what = "" if kind in ("int", "number") else "the length of "
        raise error(f"{where}: {what}{key!r} is {_show(size)}; accepted{_range(lo, hi)}")
    return v


def _range(lo: float | None, hi: float | None) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" (at least {_show(lo)})"
    if lo is None:
        return f" (at most {_show(hi)})"
    return f" in {_show(lo)}..{_show(hi)}"


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def inside(folder: str | Path, name: Any, where: str, error: type[Exception]) -> Path:
    """``folder / name`` for a relative ``name`` that stays inside ``folder`` once resolved (symlinks
    followed): no absolute path, no ``..``, no link leading out.

    Raises:
        error: ``name`` is not a non-empty string, or leads out of ``folder``.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{where}: {_show(name)} is not a file name inside {folder}")
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        raise error(f"{where}: {name!r} leads out of {folder}; only names inside the folder are followed")
    try:
        root = Path(folder).resolve()
        target = (root / p).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop: RuntimeError before Python 3.13, OSError after
        raise error(f"{where}: {name!r} cannot be followed inside {folder} (a symlink loop? {exc})") from None
    if target != root and root not in target.parents:
        raise error(f"{where}: {name!r} resolves to {target}, outside {folder} (a link leading out is not followed)")
    return Path(folder) / p


def npz_inflated_bytes(path: str | Path) -> int:
    """The bytes an ``.npz`` file's arrays take once inflated, from each array's own ``.npy`` header
    (its declared shape and dtype; :func:`npz_headers`), before reading any array."""
    return sum(int(np.prod(shape, dtype=np.float64)) * dtype.itemsize for shape, dtype in npz_headers(path).values())


def npz_headers(path: str | Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{array name: (shape, dtype)} of an ``.npz`` file, read from the headers alone (a few hundred
    bytes inflated per array), so that a caller can check them against what it expects and against
    :func:`memory_cap` before numpy allocates what a header declares.

    Raises:
        ValueError: a member is not an ``.npy`` array, holds Python objects, or declares more data
            than its zip entry holds (one line naming the member).
    """
    from numpy.lib import format as npy

    out = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name = info.filename.removesuffix(".npy")
            with z.open(info) as f:
                try:
                    version = npy.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = npy.read_array_header_1_0(f)
                    else:
                        shape, _, dtype = npy.read_array_header_2_0(f)
                except (ValueError, OSError, EOFError, SyntaxError, TypeError) as exc:
                    raise ValueError(f"member {info.filename!r} is not a numpy array ({exc})") from None
                header = f.tell()
            if dtype.hasobject:
                raise ValueError(f"member {info.filename!r} holds Python objects ({dtype}); only numeric arrays are read")
            data = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
            if data != info.file_size - header:
                raise ValueError(f"member {info.filename!r} declares shape {list(shape)} of {dtype} ({data} bytes), but "
                                 f"its zip entry holds {info.file_size - header} bytes after the header")
            out[name] = (tuple(shape), dtype)
    return out
