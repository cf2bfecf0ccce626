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

from attnres_probe.resources import available_memory, human_bytes

__all__ = ["MAX_RESAMPLES", "MEMORY_CAP_ENV", "check_bytes", "field", "inside", "memory_cap", "npz_inflated_bytes"]

MAX_RESAMPLES = 100_000  # bootstrap resamples a flag may ask for (1,000-10,000 is usual)
MEMORY_CAP_ENV = "ATTNRES_MEMORY_CAP"  # bytes (e.g. 8e9): the most any one file may make the toolkit allocate
_DEFAULT_SHARE = 0.5  # without the variable: half of the memory available when the file is read


def memory_cap() -> int:
    """The memory bound, stated once: ``$ATTNRES_MEMORY_CAP`` bytes if set, else half the available memory
    (8 GB when that is unknown)."""
    env = os.environ.get(MEMORY_CAP_ENV)
    if env:
        try:
            cap = float(env)
        except ValueError:
            raise ValueError(f"${MEMORY_CAP_ENV} is {env!r}; give a number of bytes such as 8e9") from None
        if not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"${MEMORY_CAP_ENV} is {env!r}; give a positive number of bytes such as 8e9")
        return int(cap)
    avail = available_memory()
    return int(avail * _DEFAULT_SHARE) if avail else 8 * 10**9


def check_bytes(n: float, what: str, where: str, error: type[Exception]) -> None:
    """Refuse ``what`` (which would take ``n`` bytes, from ``where``) above :func:`memory_cap`."""
    cap = memory_cap()
    if not math.isfinite(n) or n > cap:
        raise error(f"{where}: {what} would need {human_bytes(n) if math.isfinite(n) else 'unbounded memory'}, more "
                    f"than the {human_bytes(cap)} this machine allows for one file (${MEMORY_CAP_ENV} sets the bound)")


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
    root = Path(folder).resolve()
    target = (root / p).resolve()
    if target != root and root not in target.parents:
        raise error(f"{where}: {name!r} resolves to {target}, outside {folder} (a link leading out is not followed)")
    return Path(folder) / p


def npz_inflated_bytes(path: str | Path) -> int:
    """The bytes an ``.npz`` file's arrays take once inflated (from the zip directory, before reading any)."""
    with zipfile.ZipFile(path) as z:
        return sum(info.file_size for info in z.infolist())
