"""Checkpoints: ``config.json`` + ``model.safetensors`` in one directory. Never unpickles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from attnres_probe._version import __version__
from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.io import atomic_write
from attnres_probe.model import AttnResTransformer

__all__ = ["CheckpointError", "CONFIG_FILE", "WEIGHTS_FILE", "load_checkpoint", "read_config", "save_checkpoint"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "attnres-probe-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint directory is missing, corrupt, or disagrees with its config."""


def save_checkpoint(model: AttnResTransformer, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the model's config and weights into ``directory`` (created if missing).

    Args:
        model: an AttnResTransformer.
        directory: target folder.
        dtype: store floating tensors in this dtype (e.g. torch.float16 for shipped demos).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "attnres_probe": __version__}
    atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p), metadata=meta))
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "attnres_probe": __version__, "config": model.cfg.to_dict()}
    atomic_write(directory / CONFIG_FILE, lambda p: p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n"))
    return directory


def read_config(directory: str | Path) -> ModelConfig:
    """The validated ModelConfig stored in a checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path} is missing: a checkpoint holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        doc = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "config" not in doc:
        raise CheckpointError(f"{cfg_path} is not an attnres-probe checkpoint config (no 'format'/'config' keys)")
    if not isinstance(doc.get("format_version"), int) or doc["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{cfg_path} has format_version {doc.get('format_version')!r}; this toolkit reads versions up to "
            f"{FORMAT_VERSION} (upgrade attnres-probe)"
        )
    try:
        return ModelConfig.from_dict(doc["config"])
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{cfg_path}: invalid config: {exc}") from None


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu", **model_kwargs: Any) -> AttnResTransformer:
    """Build the model from ``config.json`` and load ``model.safetensors`` into it.

    Floating tensors stored in another dtype (fp16 demos) are cast to the model's dtype.

    Raises:
        CheckpointError: naming the first missing, unexpected or mis-shaped tensor, or the
            unreadable file.
    """
    directory = Path(directory)
    cfg = read_config(directory)
    w_path = directory / WEIGHTS_FILE
    if not w_path.is_file():
        raise CheckpointError(f"{w_path} is missing")
    try:
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{w_path} is not a readable safetensors file ({exc})") from None
    model = AttnResTransformer(cfg, **model_kwargs)
    expected = model.state_dict()
    for name, ref in expected.items():
        if name not in tensors:
            raise CheckpointError(
                f"{w_path} has no tensor {name!r}, which the config (residual={cfg.residual!r}, "
                f"n_layers={cfg.n_layers}) requires"
            )
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"tensor {name!r} in {w_path} has shape {tuple(tensors[name].shape)}; the config needs {tuple(ref.shape)}"
            )
        if tensors[name].is_floating_point() != ref.is_floating_point():
            raise CheckpointError(f"tensor {name!r} in {w_path} has dtype {tensors[name].dtype}; expected {ref.dtype}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(
            f"{w_path} has tensor {extra[0]!r} that the config (residual={cfg.residual!r}, n_layers={cfg.n_layers}) "
            "does not define"
        )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()})
    return model.to(device)
