"""Models from elsewhere, built with our own code from their checkpoint folders.

:func:`load_pretrained` reads ``config.json`` (``model_type``, ``architectures``), picks the family
that recognises it (:mod:`attnres_probe.families`: flash-linear-attention ``transformer``,
Qwen3-AttnRes and its Qwen3 baseline, the attnres4babylm ``nanogpt`` models), checks the weights'
headers against the names and shapes the config implies, and loads them into an
:class:`~attnres_probe.AttnResTransformer`, so that every hook, trace, chart and report works on it.
A folder without config.json that holds LR-AttnRes's ``final_model.pt`` (train.py's training
checkpoint) is read by that family (:mod:`attnres_probe.families.lr_attnres`: ``torch.load`` with
``weights_only=True`` only, the config from the checkpoint's ``model_args``).
No code shipped in a folder ever runs (``trust_remote_code`` stays False; an ``auto_map`` is ignored).
An unknown family, or a variant a family's loader cannot represent, is refused in one line that names
the key and what is supported.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from attnres_probe.families import family_of, folder_family, supported
from attnres_probe.families.common import PretrainedError, PretrainedTokenizer, has_config, read_config, read_weights, weight_files
from attnres_probe.families.common import tokenizer as read_tokenizer
from attnres_probe.families.fla import config as config_from_fla
from attnres_probe.validate import check_bytes

__all__ = ["PretrainedError", "PretrainedTokenizer", "config_from_fla", "is_fla_folder", "is_pretrained_folder",
           "load_pretrained", "supported"]


def is_pretrained_folder(directory: str | Path) -> bool:
    """Whether ``directory`` is a folder for :func:`load_pretrained` rather than one of ours: it holds a
    Hugging Face-style config (``model_type`` set), or a family's own checkpoint file and no config.json
    (LR-AttnRes's ``final_model.pt``)."""
    return has_config(directory) or folder_family(directory) is not None


is_fla_folder = is_pretrained_folder  # its name before the other families


def load_pretrained(
    directory: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
    tokenizer: bool = True,
):
    """Read a checkpoint folder of a supported family into an AttnResTransformer and its tokenizer.

    Args:
        directory: the folder ``save_pretrained`` wrote (config.json, model.safetensors or a
            sharded index, tokenizer files), of a family :mod:`attnres_probe.families` builds; or an
            LR-AttnRes folder (``final_model.pt``, no config.json; upstream reads text with tiktoken's
            cl100k_base, which its folders do not hold: save a tokenizer beside it, or pass tokenizer=False).
        device, dtype: where and in which dtype to put the weights (float32 by default, so
            that the CPU kernels run; the checkpoint may be bf16).
        backend: the depth-attention backend (see :class:`~attnres_probe.AttnResTransformer`).
        tokenizer: read the tokenizer too (False: return None for it).

    Returns:
        (model in eval mode, tokenizer or None; the tokenizer is also ``model.tokenizer``). A
        family's baseline folder (fla without ``attnres_block_size``, ``qwen3``, ``nanogpt`` without
        ``use_attn_res``, LR-AttnRes without ``use_attnres``) is the PreNorm baseline of the same recipe,
        so the two can be compared.

    Raises:
        PretrainedError: a missing or unreadable file, a family attnres-probe does not build, an option
            the model cannot represent, or weights that do not match the config (one line each).
    """
    from attnres_probe.model import AttnResTransformer
    from attnres_probe.placement import parse_device, parse_dtype

    device = device if isinstance(device, torch.device) else parse_device(str(device))  # one line, not torch's assertion
    dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype(str(dtype).removeprefix("torch."))
    if not dtype.is_floating_point:
        raise PretrainedError(f"dtype {dtype} is not a floating-point dtype; accepted: float32, bfloat16, float16, float64")
    directory = Path(directory)
    if not directory.is_dir():
        raise PretrainedError(f"{directory} is not a folder")
    own = folder_family(directory)  # a folder without config.json whose family reads its own checkpoint file
    if own is not None:
        cfg, tensors = own.read_folder(directory)  # bounded, weights-only, names, shapes and dtypes checked
        family, expected = own, own.expected(cfg)
    else:
        where = str(directory / "config.json")
        data = read_config(directory)
        family = family_of(data, where)
        cfg = family.config(data, where)
        files, mapping = weight_files(directory)
        expected = family.expected(cfg)
    n_params = sum(math.prod(s) for s in expected.values())
    if own is None:
        stored = sum(f.stat().st_size for f in files)
        if 2 * n_params > stored:  # every tensor is stored, in at least 2 bytes per value
            raise PretrainedError(f"{directory / 'config.json'} implies {n_params:,} parameters ({2 * n_params:,} bytes at "
                                  f"least), but the weight files hold {stored:,} bytes: config/weights mismatch")
    check_bytes(n_params * torch.finfo(dtype).bits // 8, f"the model ({n_params:,} parameters)",
                str(directory), PretrainedError)
    if own is not None:
        weights = {name: t.to(dtype) for name, t in tensors.items()}
        del tensors
        tok = own.tokenizer(directory) if tokenizer else None
    else:
        weights = read_weights(files, expected, dtype, mapping)  # headers checked first
        tok = read_tokenizer(directory) if tokenizer else None
    with torch.device("meta"):  # no second copy of the weights: the model's tensors are the ones read
        model = AttnResTransformer(cfg, backend=backend)
    state = family.state_dict(cfg, weights)
    del weights
    model.load_state_dict(state, strict=True, assign=True)
    del state
    if tok is not None:
        model.tokenizer = tok  # model.to_tokens, to_string, generate read text with the checkpoint's tokenizer
    return model.to(device=device, dtype=dtype).eval(), tok

