"""Checkpoints on disk: ``config.json`` + ``model.safetensors`` in one folder. Never unpickles.

Loading trusts nothing in the folder: the weights file's header (names, shapes, dtypes, byte
ranges) is read first (:func:`read_safetensors_header`: its length bounded by hand, then
``safetensors.safe_open``, which maps the file and allocates no tensor) and checked against the
tensors the config asks for, which are listed from a model built on the meta device (no memory,
no initialisation). Only then is the model built, so every size it allocates is one the file
really holds. The flash-linear-attention loader (:mod:`attnres_probe.pretrained`) reads its
headers with the same function.

Saving goes through :func:`attnres_probe.io.write_directory` (the folder writer of traces and
corpus stats too): locked, and both files swapped in at once. Written files are reproducible:
the safetensors header is stored with sorted keys, so two identical runs give byte-identical
checkpoints (and equal sha256).

This module never imports the model: the model's ``save``/``load`` call it, and the loader is
given the class to build (:func:`load_checkpoint_as`); :mod:`attnres_probe.checkpoint` is the
face that loads an :class:`~attnres_probe.AttnResTransformer`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

from attnres_probe._version import __version__
from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.io import atomic_write, read_json, set_aside, write_directory
from attnres_probe.resources import available_memory, human_bytes
from attnres_probe.validate import check_bytes

__all__ = [
    "CheckpointError",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "load_checkpoint_as",
    "read_config",
    "read_safetensors_header",
    "save_checkpoint",
    "save_safetensors",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "attnres-probe-checkpoint"
FORMAT_VERSION = 1
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few hundred bytes
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# safetensors dtype -> bytes per element
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
FLOAT_DTYPES = {"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"}


class CheckpointError(ValueError):
    """A checkpoint directory is missing, corrupt, or disagrees with its config."""


# -- saving ----------------------------------------------------------------------------------
def save_checkpoint(model: Any, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the model's config and weights into folder ``directory`` (created if missing).

    The folder is written by :func:`attnres_probe.io.write_directory`: locked (a second writer is
    refused), written beside and swapped in, so it holds the old checkpoint or the new one, never
    the weights of one and the config of the other. A folder that holds other files too (a
    training run's folder, the working directory) keeps them: both files are written beside them
    and renamed onto their names, ``config.json`` last.

    Args:
        model: an AttnResTransformer (any module with ``cfg`` and ``state_dict()``).
        directory: target folder.
        dtype: store floating tensors in this dtype (e.g. torch.float16 for shipped demos).
    """
    directory = Path(directory)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "attnres_probe": __version__}
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "attnres_probe": __version__, "config": model.cfg.to_dict()}
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"

    def write(folder: Path) -> None:
        save_safetensors(tensors, folder / WEIGHTS_FILE, metadata=meta)
        (folder / CONFIG_FILE).write_text(text)

    write_directory(directory, write, _is_checkpoint, (WEIGHTS_FILE, CONFIG_FILE), keep_others=True, flag="checkpoint folder")
    return directory


def _is_checkpoint(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to a safetensors file atomically, with a reproducible header.

    safetensors stores ``metadata`` in hash order, which changes from process to process; the
    header is rewritten with sorted keys, so equal tensors and metadata give equal bytes. A
    failed write (a full disk) raises an OSError with its errno, never a SafetensorError.
    """

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as exc:
            code = re.search(r"os error (\d+)", str(exc))
            raise OSError(int(code.group(1)) if code else 5, str(exc), str(tmp)) from None
        _sort_header(tmp)

    atomic_write(path, write)


def _sort_header(path: Path) -> None:
    """Rewrite a safetensors header in place with sorted keys (same length, padded with spaces)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        if len(text) > n:  # cannot happen (same keys and values), but never write past the header
            return
        f.seek(8)
        f.write(text + b" " * (n - len(text)))


# -- the safetensors header (shared with attnres_probe.pretrained) ---------------------------
def read_safetensors_header(
    path: str | Path, error: type[Exception] = CheckpointError
) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """The tensors a safetensors file holds, read from its header alone: ``{name: (dtype, shape)}``, metadata.

    The header is bounded before safetensors reads it: the file must be a regular file whose
    8-byte header length is at most 100 MB, inside the file and within the memory bound
    (:func:`~attnres_probe.validate.check_bytes`). ``safetensors.safe_open`` then parses it (a
    map of strings for the metadata; for every tensor a known dtype, a shape of non-negative
    integers and a byte range exactly as long as shape and dtype need; the ranges covering the
    data without overlap), mapping the file without allocating any tensor. Every dtype must be
    one this toolkit knows, and the tensors together must fit in the file's data bytes.

    Args:
        path: the file.
        error: the exception class to raise (CheckpointError, PretrainedError).

    Raises:
        error: the first violation, in one line.
    """
    path = Path(path)

    def bad(detail: str) -> Exception:
        return error(f"{path} is not a readable safetensors file ({detail})")

    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path} is not a regular file")
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise error(f"{path} cannot be read ({exc.strerror or exc})") from None
    size = st.st_size
    if len(head) < 8:
        raise bad(f"{size} bytes: too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise bad(f"header length {n} does not fit in a file of {size} bytes")
    check_bytes(n, "its header", str(path), error)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            held = {}
            for name in handle.keys():
                piece = handle.get_slice(name)
                held[name] = (str(piece.get_dtype()), tuple(int(d) for d in piece.get_shape()))
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
        text = str(exc).removeprefix("Error while deserializing header: ")
        raise bad(text.splitlines()[0] if text.strip() else type(exc).__name__) from None
    data, total = size - 8 - n, 0
    for name, (dtype, shape) in held.items():
        if dtype not in DTYPE_SIZES:
            raise bad(f"tensor {name!r} has an unknown dtype {dtype!r}")
        total += math.prod(shape) * DTYPE_SIZES[dtype]
        if total > data:
            raise bad(f"tensor {name!r} (shape {list(shape)}, {dtype}) does not fit in the file's {data} data bytes")
    return held, dict(metadata)


# -- loading ---------------------------------------------------------------------------------
def _set_aside_checkpoint(directory: Path) -> Path:
    """``directory``, or where a save killed between the two renames of its fallback swap left the
    previous checkpoint (the next save puts it back)."""
    if directory.exists():
        return directory
    aside = [p for p in set_aside(directory) if _is_checkpoint(p)]
    return aside[-1] if aside else directory


def read_config(directory: str | Path) -> ModelConfig:
    """The validated ModelConfig stored in a checkpoint directory."""
    directory = _set_aside_checkpoint(Path(directory))
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.exists():
        raise CheckpointError(f"{cfg_path} is missing: a checkpoint holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    doc = read_json(cfg_path, CheckpointError, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "config" not in doc:
        raise CheckpointError(f"{cfg_path} is not an attnres-probe checkpoint config (no 'format'/'config' keys)")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{cfg_path} has format_version {version!r}; a checkpoint's version is an integer >= 1")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{cfg_path} has format_version {version!r}; this toolkit reads versions up to "
            f"{FORMAT_VERSION} (upgrade attnres-probe)"
        )
    try:
        return ModelConfig.from_dict(doc["config"])
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{cfg_path}: invalid config: {exc}") from None


def load_checkpoint_as(model_cls: type, directory: str | Path, device: str | torch.device = "cpu", **model_kwargs: Any) -> Any:
    """Build a ``model_cls`` (AttnResTransformer) from ``config.json`` and load ``model.safetensors`` into it.

    The weights file's header is checked against the config before anything is built (see the
    module docstring); floating tensors stored in another dtype (fp16 demos) are cast to the
    model's dtype. :func:`attnres_probe.checkpoint.load_checkpoint` and
    ``AttnResTransformer.load`` call it.

    Raises:
        CheckpointError: naming the first missing, unexpected or mis-shaped tensor, the
            unreadable file, or a size this machine cannot hold.
    """
    directory = _set_aside_checkpoint(Path(directory))
    cfg = read_config(directory)
    w_path = directory / WEIGHTS_FILE
    if not w_path.exists():
        raise CheckpointError(f"{w_path} is missing")
    if not w_path.is_file():
        raise CheckpointError(f"{w_path} is not a regular file")
    held, _ = read_safetensors_header(w_path)
    _check_unstored_sizes(cfg, w_path)
    expected = _expected_tensors(cfg, held, w_path, model_cls)
    for name, (shape, dtype) in expected.items():
        if name not in held:
            raise CheckpointError(
                f"{w_path} has no tensor {name!r}, which the config (residual={cfg.residual!r}, "
                f"n_layers={cfg.n_layers}) requires"
            )
        if held[name][1] != shape:
            raise CheckpointError(f"tensor {name!r} in {w_path} has shape {held[name][1]}; the config needs {shape}")
        if (held[name][0] in FLOAT_DTYPES) != dtype.is_floating_point:
            raise CheckpointError(f"tensor {name!r} in {w_path} has dtype {held[name][0]}; expected {dtype}")
    extra = sorted(set(held) - set(expected))
    if extra:
        raise CheckpointError(
            f"{w_path} has tensor {extra[0]!r} that the config (residual={cfg.residual!r}, n_layers={cfg.n_layers}) "
            "does not define"
        )
    try:
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{w_path} is not a readable safetensors file ({exc})") from None
    model = model_cls(cfg, **model_kwargs)
    state = model.state_dict()
    model.load_state_dict({k: v.to(state[k].dtype) for k, v in tensors.items()})
    return model.to(device)


_CPU_FACTORIES = {torch.arange, torch.zeros, torch.ones}


class _NoInit(TorchFunctionMode):
    """Skip in-place initialisers (``normal_``, ``zero_``, ``kaiming_uniform_`` ...) on meta tensors.

    On the meta device they compute nothing, but dispatching them loads torch's compiler stack
    (about 2 s, once per process); the shapes are all a meta model is built for. For the same
    reason ``arange``, ``zeros`` and ``ones`` (norm gains, zero queries: vectors as long as
    d_model, already bounded by the file) are made on the CPU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CPU_FACTORIES and "device" not in kwargs:  # small tables (bounded by the file's sizes)
            return func(*args, **kwargs, device="cpu")  # whose meta versions are decomposed (the same 2 s)
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def _meta_state(cfg: ModelConfig, model_cls: type) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of the state dict of a model of ``cfg``, built on the meta device.

    Sinusoidal positions are a table the file does not hold: it is built for one position only.
    """
    if cfg.positional == "sinusoidal":
        cfg = dataclasses.replace(cfg, n_ctx=1)
    try:
        with torch.device("meta"), _NoInit():
            model = model_cls(cfg)
    except (RuntimeError, ValueError, OverflowError) as exc:  # sizes beyond what a tensor can describe
        raise CheckpointError(f"the config describes tensors that cannot exist ({exc})") from None
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def _expected_tensors(
    cfg: ModelConfig, held: dict[str, Any], w_path: Path, model_cls: type
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors ``cfg`` asks for; refused early when there are far more of them than the file holds.

    The count per transformer block comes from meta models of one and two blocks, so a config
    asking for a million blocks is refused without building a million modules.
    """
    def count(n_layers: int) -> int:
        return len(_meta_state(dataclasses.replace(cfg, n_layers=n_layers, block_size=None, block_boundaries=None), model_cls))

    if not held:
        raise CheckpointError(f"{w_path} holds no tensors; a checkpoint's weights file holds every tensor of the model")
    largest = max(math.prod(shape) for _, shape in held.values())
    sizes = {"d_model": cfg.d_model, "d_vocab": cfg.d_vocab, "d_mlp": cfg.d_mlp, "n_heads * d_head": cfg.n_heads * cfg.d_head}
    if cfg.positional == "learned":
        sizes["n_ctx"] = cfg.n_ctx
    for what, size in sizes.items():
        if size > largest:  # every one of these is a dimension of some tensor the file must hold
            raise CheckpointError(
                f"the config's {what}={size} is larger than any tensor in {w_path} (the largest holds {largest} "
                "values): config.json does not belong to these weights"
            )
    one, two = count(1), count(2)
    per_block, base = two - one, 2 * one - two
    need = base + per_block * cfg.n_layers
    if need > 2 * len(held) + 64:
        fits = f" (a model of n_layers={(len(held) - base) // per_block})" if per_block and len(held) > base else ""
        raise CheckpointError(
            f"the config (n_layers={cfg.n_layers}) needs {need} tensors; {w_path} holds {len(held)}{fits}: "
            "config.json does not belong to these weights"
        )
    return _meta_state(cfg, model_cls)


def _check_unstored_sizes(cfg: ModelConfig, w_path: Path) -> None:
    """Refuse a buffer the file does not hold (sinusoidal positions: n_ctx x d_model) larger than memory."""
    if cfg.positional != "sinusoidal":
        return
    need = 4 * cfg.n_ctx * cfg.d_model
    avail = available_memory()
    if avail is not None and need > avail // 2:
        raise CheckpointError(
            f"the config's sinusoidal position table (n_ctx={cfg.n_ctx} x d_model={cfg.d_model}) needs "
            f"{human_bytes(need)}; this machine has {human_bytes(avail)} available ({w_path.parent})"
        )
