"""Checkpoints: ``config.json`` + ``model.safetensors`` in one directory. Never unpickles.

The face of :mod:`attnres_probe.checkpoint_store`, which holds the format, the checks and the
writer, and never imports the model (``AttnResTransformer.save``/``load`` call it directly).
Here :func:`load_checkpoint` builds an :class:`~attnres_probe.AttnResTransformer`.

Loading trusts nothing in the folder: the weights file's header (names, shapes, dtypes, byte
ranges) is read first, with its size capped, and checked against the tensors the config asks
for, which are listed from a model built on the meta device (no memory, no initialisation).
Only then is the model built, so every size it allocates is one the file really holds.

Written files are reproducible: the safetensors header is stored with sorted keys, so two
identical runs give byte-identical checkpoints (and equal sha256).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attnres_probe.checkpoint_store import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    load_checkpoint_as,
    read_config,
    read_safetensors_header,
    save_checkpoint,
    save_safetensors,
)
from attnres_probe.model import AttnResTransformer

__all__ = [
    "CheckpointError",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "load_checkpoint",
    "read_config",
    "read_safetensors_header",
    "save_checkpoint",
    "save_safetensors",
]


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu", **model_kwargs: Any) -> AttnResTransformer:
    """Build the model from ``config.json`` and load ``model.safetensors`` into it
    (:func:`~attnres_probe.checkpoint_store.load_checkpoint_as`; the same as ``AttnResTransformer.load``).

    The weights file's header is checked against the config before anything is built (see the
    module docstring); floating tensors stored in another dtype (fp16 demos) are cast to the
    model's dtype.

    Raises:
        CheckpointError: naming the first missing, unexpected or mis-shaped tensor, the
            unreadable file, or a size this machine cannot hold.
    """
    return load_checkpoint_as(AttnResTransformer, directory, device=device, **model_kwargs)
