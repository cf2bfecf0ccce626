"""Which backend runs an op: the names, what is available here, and the choice.

Choice, first match wins: the ``backend=`` argument; the ``ATTNRES_BACKEND`` environment
variable (``torch`` | ``triton`` | ``numba`` | ``auto``, read case-insensitively); otherwise
``auto``: Triton for CUDA tensors, Numba for float32/float64 CPU tensors, the reference for
everything else (and for what the fused kernels do not take: float64 or d above ``MAX_D`` on
CUDA, float16/bfloat16 on the CPU). Forcing ``triton`` on CPU tensors works only under
``TRITON_INTERPRET=1`` (Triton's interpreter; this is how CI tests the kernels).

The Triton backend is available when ``triton_utils`` imports (it imports Triton), the Numba
one when the Numba kernels' module imports (``ops/depth_attn/numba.py``: Numba, and a writable
cache folder unless ``ATTNRES_NUMBA_CACHE=0``); a broken Numba import warns once and ``auto``
falls back to the reference.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Literal

import torch

from .utils import interpret_mode

Backend = Literal["auto", "torch", "triton", "numba"]
BACKENDS = ("auto", "torch", "triton", "numba")

__all__ = [
    "BACKENDS",
    "Backend",
    "numba_available",
    "requested_backend",
    "resolve_backend",
    "triton_available",
]


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        from . import triton_utils  # noqa: F401  (imports triton)
    except Exception as exc:  # triton missing, or not importable on this platform
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    """Whether the Triton kernels can be imported here."""
    return _triton_import_error() is None


@functools.lru_cache(maxsize=None)
def _numba_import_error() -> str | None:
    """Why the Numba kernels cannot be imported (None if they can); warns once, the first time."""
    try:
        from .ops.depth_attn import numba  # noqa: F401  (its cached kernels need a writable cache folder)
    except Exception as exc:  # numba missing or broken (e.g. no writable cache folder)
        reason = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"the Numba CPU kernels could not be imported ({reason}); depth attention on the CPU uses the "
            "slower PyTorch reference instead (set ATTNRES_BACKEND=torch to choose it and silence this, or "
            "NUMBA_CACHE_DIR to a writable folder if the cache is the cause)",
            RuntimeWarning,
            stacklevel=3,
        )
        return reason
    return None


def numba_available() -> bool:
    """Whether the Numba CPU kernels can be imported here."""
    return _numba_import_error() is None


def _numba_takes(dtypes: tuple[torch.dtype | None, ...]) -> bool:
    return all(dt is None or dt in (torch.float32, torch.float64) for dt in dtypes)


def _triton_takes(dtypes: tuple[torch.dtype | None, ...], d: int | None) -> bool:
    from .triton_utils import MAX_D, SUPPORTED_DTYPES

    return (d is None or d <= MAX_D) and all(dt is None or dt in SUPPORTED_DTYPES for dt in dtypes)


def requested_backend(backend: str | None = None) -> tuple[str, str]:
    """The backend asked for, and where: ``(backend, "backend argument")``, or, for None,
    ``ATTNRES_BACKEND`` (default ``"auto"``; its value is read case-insensitively).

    Raises:
        ValueError: for a name not in :data:`BACKENDS` (saying which are accepted).
    """
    source = "backend argument"
    if backend is None:
        backend = os.environ.get("ATTNRES_BACKEND", "auto").strip().lower() or "auto"
        source = "ATTNRES_BACKEND"
    if backend not in BACKENDS:
        raise ValueError(f"{source} is {backend!r}; accepted values are {', '.join(BACKENDS)}")
    return backend, source


def resolve_backend(
    device: torch.device | str,
    backend: str | None = None,
    *,
    dtypes: tuple[torch.dtype | None, ...] = (),
    d: int | None = None,
) -> Literal["torch", "triton", "numba"]:
    """Pick the backend for tensors on ``device``.

    Args:
        device: where the op's tensors live.
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"numba"`` or None (read
            ``ATTNRES_BACKEND``).
        dtypes, d: optionally, the op's input dtypes and width; ``auto`` then sends inputs the
            fused kernels do not take (float64 or d above the limit on CUDA, float16/bfloat16
            on the CPU) to the reference.

    Raises:
        ValueError: for an unknown backend name, or when a backend is asked for where it
            cannot run (Triton on CPU tensors without ``TRITON_INTERPRET=1``, Numba on
            non-CPU tensors, either not importable).
    """
    device = torch.device(device)
    backend, source = requested_backend(backend)
    on_gpu_or_interp = device.type == "cuda" or (device.type == "cpu" and interpret_mode())
    if backend == "auto":
        if device.type == "cuda" and triton_available() and _triton_takes(tuple(dtypes), d):
            return "triton"
        if device.type == "cpu" and numba_available() and _numba_takes(tuple(dtypes)):
            return "numba"
        return "torch"
    if backend == "numba":
        if device.type != "cpu":
            raise ValueError(f"{source} asks for the numba backend, which runs on CPU tensors; the tensors are on {device}")
        err = _numba_import_error()
        if err is not None:
            raise ValueError(f"{source} asks for the numba backend, but it cannot be imported ({err})")
    if backend == "triton":
        if not on_gpu_or_interp:
            raise ValueError(
                f"{source} asks for the Triton backend, but the tensors are on {device}; "
                "Triton runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 is set"
            )
        err = _triton_import_error()
        if err is not None:
            raise ValueError(f"{source} asks for the Triton backend, but it cannot be imported ({err})")
    return backend  # type: ignore[return-value]
