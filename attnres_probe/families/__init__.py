"""Model families from elsewhere that :func:`~attnres_probe.load_pretrained` builds with our own code.

Each family is one module with ``NAME``, ``TITLE``, ``SOURCE`` (the upstream repository and commit it
was read from), ``recognises(config) -> bool``, ``config(config, where) -> ModelConfig``,
``expected(cfg) -> {tensor name: shape}`` and ``state_dict(cfg, weights) -> our state dict``; a family
whose folders have no config.json (LR-AttnRes: a pickled training checkpoint, read weights-only) has
``recognises_folder(directory)`` and ``read_folder(directory) -> (config, weights)`` besides. No code
shipped in a folder ever runs. The README's "Model families" table lists them with what each maps and
refuses.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from attnres_probe.families import fla, lr_attnres, nanogpt, qwen3
from attnres_probe.families.common import PretrainedError

__all__ = ["FAMILIES", "family_of", "folder_family"]

FAMILIES: tuple[ModuleType, ...] = (fla, qwen3, nanogpt, lr_attnres)


def folder_family(directory: Any) -> ModuleType | None:
    """The family that reads this folder from its own checkpoint file (no config.json: ``recognises_folder``),
    else None (the folder's config.json decides, :func:`family_of`)."""
    for family in FAMILIES:
        if hasattr(family, "recognises_folder") and family.recognises_folder(directory):
            return family
    return None


def supported() -> str:
    """The families in words, for an error message."""
    return "; ".join(f"{f.TITLE} ({', '.join(f.MODEL_TYPES)})" for f in FAMILIES)


def family_of(data: dict[str, Any], where: str) -> ModuleType:
    """The family whose ``recognises`` accepts this config.json (a dict).

    Raises:
        PretrainedError: no family does (naming the model_type and architectures, and listing the supported ones).
    """
    for family in FAMILIES:
        if family.recognises(data):
            return family
    arch = data.get("architectures")
    raise PretrainedError(
        f"{where}: model_type is {data.get('model_type')!r}{f' ({arch})' if arch else ''}, which attnres-probe does not "
        f"build; supported families: {supported()}; a live model of another family may be recorded with watch(model) "
        "(fla models, transformers' DeepseekV4ForCausalLM)")
