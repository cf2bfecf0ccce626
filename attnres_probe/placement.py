"""Where and in which dtype commands load their models: ``--device`` and ``--dtype``.

Every command that loads a model (``record``, ``summary``, ``report``, ``dash``, ``corpus``,
``figures``, ``study``) takes ``--device`` (a torch device: ``cpu``, ``cuda``, ``cuda:1``) and
``--dtype`` (``float32``, ``bfloat16``, ``float16``, ``float64``); the command line sets them for the
whole command with :func:`use`, and :func:`attnres_probe.loading.load_model` reads :func:`current`.
In Python, pass ``device=`` and ``dtype=`` to ``load_pretrained`` / ``load_model`` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["DTYPES", "Placement", "current", "parse_device", "parse_dtype", "use"]

# the dtypes a command may ask for, by name (torch is imported only when one is used: the command line
# builds its parsers without it)
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class Placement:
    device: Any  # torch.device, or None: the CPU
    dtype: Any  # torch.dtype, or None: the model's own (float32 for ours and for every loader's default)


_CURRENT = Placement(None, None)


def current() -> Placement:
    """The placement a command set (default: the CPU, each model's own dtype)."""
    if _CURRENT.device is None:
        import torch

        return Placement(torch.device("cpu"), _CURRENT.dtype)
    return _CURRENT


def parse_dtype(text: str | None):
    """A dtype name (or None); a ValueError listing the accepted names otherwise."""
    if text is None:
        return None
    if text not in DTYPES:
        raise ValueError(f"--dtype {text!r} is not a dtype this toolkit computes in; accepted: {', '.join(DTYPES)}")
    import torch

    return getattr(torch, text)


def parse_device(text: str | None):
    """A torch device that exists here; a ValueError naming what is available otherwise."""
    import torch

    try:
        device = torch.device(text or "cpu")
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (device.index is not None and device.index >= n):
            raise ValueError(f"--device {text}: {'no CUDA device is available here' if n == 0 else f'only cuda:0..cuda:{n - 1} exist'}; "
                             "use --device cpu")
    elif device.type not in ("cpu", "mps", "xpu"):
        raise ValueError(f"--device {text!r}: accepted device types are cpu and cuda (mps, xpu where torch has them)")
    return device


@contextlib.contextmanager
def use(device: Any = None, dtype: Any = None) -> Iterator[Placement]:
    """Load models on ``device`` in ``dtype`` inside the context (names are checked first)."""
    import torch

    global _CURRENT
    dev = device if isinstance(device, torch.device) else parse_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) or dtype is None else parse_dtype(dtype)
    saved = _CURRENT
    _CURRENT = Placement(dev, dt)
    try:
        yield _CURRENT
    finally:
        _CURRENT = saved
