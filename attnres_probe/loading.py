"""Models a command names: a bundled demo model, a model folder of ours, or a flash-linear-attention checkpoint.

Every command loads its models here. A *source* is what a command line gives and a corpus run's
``corpus.json`` records: ``demo:<name>`` (:func:`demo_source`) for a bundled demo model, or the
path of a model folder (:func:`folder_source`). :func:`load_model` turns it into a
:class:`LoadedModel`, which unpacks as ``(model, tokenizer, digest)``:

- the model in eval mode, on the CPU unless asked otherwise;
- the tokenizer: an fla checkpoint's own, or None for our byte-level models (the demo models
  included), for which :class:`~attnres_probe.Probe` uses bytes;
- the digest: :func:`attnres_probe.io.weights_sha256`, the one digest of a model that traces,
  reports and corpus runs record (computed on first use: it reads every weight).

    model, tokenizer, digest = load_model("demo:block")
    loaded = load_model("runs/block", flag="--model")   # a missing folder: "--model runs/block: not a folder (...)"
    probe = loaded.probe()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEMO_SOURCE",
    "LoadedModel",
    "check_model_folder",
    "demo_source",
    "folder_source",
    "load_model",
    "load_model_folder",
    "not_a_model_folder",
]

DEMO_SOURCE = "demo:"


def demo_source(name: str) -> str:
    """The source of bundled demo model ``name`` (``prenorm``, ``full``, ``block``)."""
    return DEMO_SOURCE + name


def not_a_model_folder(flag: str, directory: str | Path) -> str:
    """The one message of every command whose model-folder flag (``--model``, ``--models``) was
    given something that is not a folder."""
    return (
        f"{flag} {directory}: not a folder (pass a folder written by `attnres-probe train` or "
        "AttnResTransformer.save, or a flash-linear-attention checkpoint)"
    )


def check_model_folder(directory: str | Path, flag: str, error: type[Exception] = NotADirectoryError) -> Path:
    """``directory`` as a Path, or ``error`` with :func:`not_a_model_folder`'s message when it is not a folder."""
    path = Path(directory)
    if not path.is_dir():
        raise error(not_a_model_folder(flag, directory))
    return path


def folder_source(directory: str | Path, flag: str, error: type[Exception] = NotADirectoryError) -> str:
    """The source of the model folder a flag names: its absolute path (checked to be a folder)."""
    return str(check_model_folder(directory, flag, error).resolve())


def load_model_folder(directory: str | Path, device: Any = "cpu", dtype: Any = None):
    """(model, tokenizer) from a model folder of either kind: one of ours (written by
    ``AttnResTransformer.save`` or ``attnres-probe train``; tokenizer None, so bytes) or a checkpoint
    of a family from elsewhere (:func:`~attnres_probe.load_pretrained`, with its tokenizer). ``dtype``
    None: float32."""
    import torch

    from attnres_probe.model import AttnResTransformer
    from attnres_probe.pretrained import is_fla_folder, load_pretrained

    if (Path(directory) / "trace.json").is_file() and not (Path(directory) / "config.json").is_file():
        raise ValueError(f"{directory} is a saved DepthTrace, not a model folder: open it with DepthTrace.load, or "
                         "`attnres-probe report --traces` / `dash --traces`; --model/--models take a model folder")
    if is_fla_folder(directory):
        return load_pretrained(directory, device=device, dtype=dtype or torch.float32)
    model = AttnResTransformer.load(directory, device=device).eval()
    return (model if dtype is None else model.to(dtype)), None


@dataclass
class LoadedModel:
    """A model loaded from a source; unpacks as ``(model, tokenizer, digest)``."""

    model: Any
    tokenizer: Any
    name: str  # the demo name, or the folder's name as given (the residual rule for a folder without one, e.g. ".")
    source: str
    _digest: str | None = field(default=None, repr=False)

    @property
    def digest(self) -> str:
        """sha256 of the weights (:func:`attnres_probe.io.weights_sha256`), computed once."""
        if self._digest is None:
            from attnres_probe.io import weights_sha256

            self._digest = weights_sha256(self.model)
        return self._digest

    def __iter__(self):
        return iter((self.model, self.tokenizer, self.digest))

    def probe(self, name: str | None = None):
        """A :class:`~attnres_probe.Probe` of the model, named ``name`` (default: :attr:`name`)."""
        from attnres_probe.probe import Probe

        return Probe(self.model, tokenizer=self.tokenizer, name=name or self.name)


def load_model(source: str | Path, *, flag: str | None = None, device: Any = None, dtype: Any = None) -> LoadedModel:
    """Load the model ``source`` names: ``demo:<name>`` or a model folder (ours or an fla checkpoint).

    Args:
        source: :func:`demo_source` of a demo name, or a folder path.
        flag: the command-line flag that gave a folder (``--model``, ``--models``): a path that is
            not a folder is refused with :func:`not_a_model_folder`'s message (NotADirectoryError)
            before anything is read. Without it, the loaders' own errors stand.
        device, dtype: where and in which dtype to put the weights (None: the placement the command
            set with ``--device`` / ``--dtype``, :func:`attnres_probe.placement.current`; by default
            the CPU and the model's own float32).

    Raises:
        ValueError: an unknown demo name; a folder that is not a model (the loaders' messages).
        FileNotFoundError: a demo model missing from this installation.
        NotADirectoryError: with ``flag``, a path that is not a folder.
    """
    from attnres_probe.placement import current

    device = current().device if device is None else device
    dtype = current().dtype if dtype is None else dtype
    if isinstance(source, str) and source.startswith(DEMO_SOURCE):
        from attnres_probe.demo import load_demo

        name = source[len(DEMO_SOURCE):]
        model, _ = load_demo(name, device=device)
        return LoadedModel(model if dtype is None else model.to(dtype), None, name, source)
    if flag is not None:
        check_model_folder(source, flag)
    model, tokenizer = load_model_folder(source, device=device, dtype=dtype)
    return LoadedModel(model, tokenizer, Path(source).name or model.cfg.residual, str(source))
