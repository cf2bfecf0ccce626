"""What every family loader of :mod:`attnres_probe.families` shares: the error, reading a folder's
config.json (bounded; a config naming code to run is refused), its safetensors weights (every header
checked against the names and shapes the config implies before a tensor is read) and its tokenizer
(transformers' ``AutoTokenizer`` from the folder only, ``trust_remote_code=False``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from attnres_probe.validate import field, inside

__all__ = ["CONFIG_LIMIT", "FLOAT_DTYPES", "PretrainedError", "PretrainedTokenizer", "getter", "has_config", "read_config",
           "read_weights", "refuse_code", "tokenizer", "weight_files"]

CONFIG_LIMIT = 1 << 20  # bytes: a config.json larger than this is not a model config
# the largest sizes a config may give (beyond every public model; bounds what is built from the config alone)
MAX_WIDTH, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB = 1 << 16, 1024, 1 << 20, 1 << 22


class PretrainedError(ValueError):
    """A folder is not a checkpoint this loader can represent (the message says why)."""


def has_config(directory: str | Path) -> bool:
    """Whether ``directory`` holds a Hugging Face-style config (``model_type`` set), as every family but LR-AttnRes writes."""
    path = Path(directory) / "config.json"
    try:
        if not path.is_file() or path.stat().st_size > CONFIG_LIMIT:
            return False
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "model_type" in data


def read_config(directory: Path) -> dict[str, Any]:
    """The folder's config.json as a dict (bounded in size; one line naming the problem otherwise). Its
    ``auto_map`` (code shipped in the folder) is never run: a family's loader builds the model itself."""
    from attnres_probe.io import read_json

    path = directory / "config.json"
    if not path.is_file():
        raise PretrainedError(f"{directory} has no config.json; a checkpoint folder holds config.json, weights and tokenizer files")
    data = read_json(path, PretrainedError, max_bytes=CONFIG_LIMIT)
    if not isinstance(data, dict):
        raise PretrainedError(f"{path} must hold a JSON object; got {type(data).__name__}")
    return data


def refuse_code(data: Any, path: Path) -> None:
    """A config asking for code shipped in the folder (``auto_map``) is refused: a folder's code never runs."""
    if isinstance(data, dict) and data.get("auto_map"):
        raise PretrainedError(
            f"{path} names custom code to run ('auto_map': {json.dumps(data['auto_map'])[:80]}); attnres-probe never "
            "runs code from a model folder (transformers' trust_remote_code stays False): remove 'auto_map' if the "
            "model is one of the families attnres-probe builds itself"
        )


def getter(data: dict[str, Any], where: str):
    """``get(key, kind, default, lo, hi)``: a config value checked by :func:`attnres_probe.validate.field`
    (None or absent: the default)."""
    def get(key: str, kind: str, default: Any, lo: Any = None, hi: Any = None) -> Any:
        return field(data if data.get(key) is not None else {}, key, kind, where, PretrainedError, lo=lo, hi=hi,
                     required=False, default=default)
    return get


def weight_files(directory: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The weight files, and for a sharded checkpoint the index's key -> file map (each file inside
    the folder: no absolute path, no ``..``, no link leading out)."""
    from attnres_probe.io import read_json

    single = directory / "model.safetensors"
    if single.is_file():
        return [single], None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        doc = read_json(index, PretrainedError, max_bytes=CONFIG_LIMIT)
        weight_map = field(doc, "weight_map", "dict", str(index), PretrainedError, lo=1)
        where = f"{index} 'weight_map'"
        mapping = {}
        for key, name in weight_map.items():
            mapping[key] = inside(directory, name, where, PretrainedError)
        files = sorted(set(mapping.values()))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise PretrainedError(f"{index} names weight files that are missing: {missing}")
        return files, mapping
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise PretrainedError(f"{directory} holds pickled weights (.bin/.pt), which are never loaded; save the model with safetensors")
    raise PretrainedError(f"{directory} has no model.safetensors (or model.safetensors.index.json)")


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # weights are floats: an integer or bool tensor is not a weight


def read_weights(files: list[Path], expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
                  mapping: dict[str, Path] | None = None) -> dict[str, torch.Tensor]:
    """Check every file's header against ``expected`` (names, shapes, float dtypes; for a sharded
    checkpoint, each tensor in exactly the file the index maps it to) before reading a tensor.
    Headers are read as checkpoints' are (:func:`~attnres_probe.checkpoint_store.read_safetensors_header`:
    bounded first, then ``safe_open``)."""
    from safetensors import safe_open

    from attnres_probe.checkpoint_store import read_safetensors_header

    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        held, _ = read_safetensors_header(f, PretrainedError)
        for name, (stored, shape) in held.items():
            if name in found:
                raise PretrainedError(f"tensor {name!r} is stored twice, in {found[name][0].name} and {f.name}")
            if mapping is not None and mapping.get(name) != f:
                raise PretrainedError(
                    f"tensor {name!r} is in {f.name}, but the shard index maps it to "
                    f"{mapping[name].name if name in mapping else 'no file'}: the index and the shards disagree")
            if stored not in FLOAT_DTYPES:
                raise PretrainedError(f"tensor {name!r} in {f.name} is {stored}; weights are floating point "
                                      f"({', '.join(FLOAT_DTYPES)})")
            found[name] = (f, shape)
    if mapping is not None:
        absent = sorted(k for k in mapping if k not in found)
        if absent:
            raise PretrainedError(f"the shard index maps {len(absent)} tensor(s) that no shard holds, e.g. {absent[:3]}")
    missing = [n for n in expected if n not in found]
    if missing:
        raise PretrainedError(f"the weights lack {len(missing)} tensor(s) the config implies, e.g. {missing[:3]} (config/weights mismatch)")
    for name, shape in expected.items():
        if found[name][1] != shape:
            raise PretrainedError(f"tensor {name!r} has shape {list(found[name][1])}; the config implies {list(shape)} (config/weights mismatch)")
    extra = sorted(n for n in found if n not in expected)
    if extra:
        raise PretrainedError(f"the weights hold {len(extra)} tensor(s) the config does not explain, e.g. {extra[:3]} (config/weights mismatch)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                out[name] = handle.get_tensor(name).to(dtype)
    return out


class PretrainedTokenizer:
    """A Hugging Face tokenizer with the methods the toolkit calls (``to_tokens``,
    ``to_str_tokens``, ``decode``), read from a checkpoint folder only (nothing fetched)."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        """The whole text's token ids (no special tokens added; no context limit)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def to_tokens(self, text: str) -> torch.Tensor:
        """Token ids [1, pos] (no special tokens added)."""
        return torch.tensor([self.encode(text)], dtype=torch.long)

    def to_str_tokens(self, tokens: Any) -> list[str]:
        ids = torch.as_tensor(tokens).reshape(-1).tolist()
        return [self.hf.decode([i]) for i in ids]

    def decode(self, tokens: Any) -> str:
        return self.hf.decode(torch.as_tensor(tokens).reshape(-1).tolist())


def tokenizer(directory: Path, hint: str = "") -> PretrainedTokenizer:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / n).is_file() for n in names):
        raise PretrainedError(
            f"{directory} has no tokenizer files ({', '.join(names)}): save the tokenizer beside the weights "
            "(tokenizer.save_pretrained into the same folder) so the commands can read text; in Python, "
            f"load_pretrained(folder, tokenizer=False) loads the weights alone, and Probe.run takes token ids{hint}")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is installed with the fla extra
        raise PretrainedError(f"reading the tokenizer needs transformers ({exc}); pip install 'attnres-probe[fla]'") from None
    from transformers.utils import logging as hf_logging

    for name in ("tokenizer_config.json",):  # a tokenizer asking for its own code is refused before transformers reads it
        path = directory / name
        if path.is_file():
            from attnres_probe.io import read_json

            refuse_code(read_json(path, PretrainedError, max_bytes=CONFIG_LIMIT), path)

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "model of type `transformer`" notice is about its own model registry, not this load
    try:
        return PretrainedTokenizer(AutoTokenizer.from_pretrained(str(directory), local_files_only=True,
                                                                 trust_remote_code=False))
    except Exception as exc:  # transformers raises many types for unreadable files
        raise PretrainedError(f"cannot read the tokenizer in {directory}: {type(exc).__name__}: {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


