"""Models from elsewhere: flash-linear-attention (fla) AttnRes checkpoints as our model.

fla 0.6 adds Attention Residuals to its model families through ``attnres_block_size`` (docs/design.md,
"Models from elsewhere"). :func:`load_pretrained` reads an fla ``transformer`` checkpoint
folder (``config.json`` with ``model_type: "transformer"``, safetensors weights, tokenizer
files; everything local, nothing fetched) into an :class:`~attnres_probe.AttnResTransformer`
with the Llama-style parts fla uses, so that every hook, trace, chart and report works on it.

The conventions, read from fla's ``models/transformer/modeling_transformer.py`` and
``ops/attnres/``:

- a read's query is ``{attn,mlp}_res_proj.weight`` ([1, d]) and its key gain
  ``{attn,mlp}_res_norm.weight``; the sublayer's pre-norm (``attn_norm``/``mlp_norm``) is fused
  into fla's op as ``output_rms_weight`` (with the key norm's eps), which is our ``ln1``/``ln2``
  applied to the mixture; the final read is ``res_proj``/``res_norm`` followed by ``norm``;
- blocks are counted in sublayers: ``attnres_block_size`` 1 is Full AttnRes, an even size S is
  Block AttnRes with a new block at every multiple of S (our ``block_size``), and a checkpoint
  without it is the PreNorm baseline;
- the first read sees the embedding alone (fla bypasses the op there; its unused
  ``layers.0.attn_res_proj``/``attn_res_norm`` are loaded anyway);
- attention: separate q/k/v projections (concatenated into our ``W_QKV``), grouped KV heads,
  optional q/k RMSNorm with eps fixed at 1e-5 whatever ``norm_eps`` says, optional qkv bias,
  rotary positions (``rope_theta``, GPT-NeoX layout), no position embedding;
- MLP: SwiGLU ``down(silu(gate x) * up x)`` with the intermediate size fla derives from
  ``hidden_ratio`` (``256 * ceil(d * ratio * 2/3 / 256)``) unless ``intermediate_size`` is set;
- ``lm_head.weight`` is absent when ``tie_word_embeddings`` is set.

fla options that change the function the model computes and that this model cannot represent
(``window_size``, ``hidden_act`` other than ``swish``, norms without weights) are refused with
a message naming the key; the ``fuse_*`` and ``use_l2warp`` flags only choose kernels or a
training loss and are accepted.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch

from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.validate import check_bytes, field, inside

__all__ = ["PretrainedError", "PretrainedTokenizer", "is_fla_folder", "load_pretrained"]

CONFIG_LIMIT = 1 << 20  # bytes: a config.json larger than this is not a model config
# the largest sizes a config may give (beyond every public fla model; bounds what is built from the config alone)
MAX_WIDTH, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB = 1 << 16, 1024, 1 << 20, 1 << 22
# keys of fla's TransformerConfig that this loader reads
_READ = {
    "model_type", "hidden_size", "num_hidden_layers", "num_heads", "num_kv_heads", "qkv_bias", "qk_norm",
    "window_size", "rope_theta", "max_position_embeddings", "hidden_ratio", "intermediate_size", "hidden_act",
    "elementwise_affine", "norm_eps", "vocab_size", "tie_word_embeddings", "attnres_block_size",
}
# keys that choose kernels, training losses, generation or bookkeeping: no effect on the forward
_HARMLESS = {
    "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp", "use_cache",
    "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id", "architectures", "transformers_version",
    "torch_dtype", "dtype", "_name_or_path", "return_dict", "output_hidden_states", "output_attentions",
    "keys_to_ignore_at_inference", "auto_map", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "use_return_dict",
}
QK_NORM_EPS = 1e-5  # fla's q/k RMSNorm keeps its default eps


class PretrainedError(ValueError):
    """A folder is not a checkpoint this loader can represent (the message says why)."""


def is_fla_folder(directory: str | Path) -> bool:
    """Whether ``directory`` holds a Hugging Face-style config (``model_type`` set), as fla writes."""
    path = Path(directory) / "config.json"
    try:
        if not path.is_file() or path.stat().st_size > CONFIG_LIMIT:
            return False
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "model_type" in data


def _read_config(directory: Path) -> dict[str, Any]:
    from attnres_probe.io import read_json

    path = directory / "config.json"
    if not path.is_file():
        raise PretrainedError(f"{directory} has no config.json; an fla checkpoint folder holds config.json, weights and tokenizer files")
    data = read_json(path, PretrainedError, max_bytes=CONFIG_LIMIT)
    if not isinstance(data, dict):
        raise PretrainedError(f"{path} must hold a JSON object; got {type(data).__name__}")
    _refuse_code(data, path)
    return data


def _refuse_code(data: Any, path: Path) -> None:
    """A config asking for code shipped in the folder (``auto_map``) is refused: a folder's code never runs."""
    if isinstance(data, dict) and data.get("auto_map"):
        raise PretrainedError(
            f"{path} names custom code to run ('auto_map': {json.dumps(data['auto_map'])[:80]}); attnres-probe never "
            "runs code from a model folder (transformers' trust_remote_code stays False): remove 'auto_map' if the "
            "model is a standard fla 'transformer'"
        )


def _mlp_width(d: int, hidden_ratio: Any, intermediate_size: Any) -> int:
    """fla's GatedMLP width: ``intermediate_size``, or from ``hidden_ratio`` rounded up to 256."""
    if intermediate_size is not None:
        return int(intermediate_size)
    ratio = 4 if hidden_ratio is None else hidden_ratio
    width = int(d * ratio * 2 / 3)
    return 256 * ((width + 256 - 1) // 256)


def config_from_fla(data: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` for an fla ``transformer`` config (a dict of config.json).

    Raises:
        PretrainedError: another ``model_type``, or an option this model cannot represent
            (the message names the key).
    """
    model_type = data.get("model_type")
    if model_type != "transformer":
        raise PretrainedError(
            f"{where}: model_type is {model_type!r}; load_pretrained reads fla 'transformer' checkpoints "
            "(use attnres_probe.watch(model) for a live fla model of any family)"
        )
    if data.get("window_size") is not None:
        raise PretrainedError(f"{where}: 'window_size' = {data['window_size']} (sliding-window attention) is not supported; only full causal attention is")
    if data.get("hidden_act", "swish") != "swish":
        raise PretrainedError(f"{where}: 'hidden_act' = {data['hidden_act']!r} is not supported; only 'swish' (SwiGLU) is")
    if data.get("elementwise_affine", True) is not True:
        raise PretrainedError(f"{where}: 'elementwise_affine' = {data['elementwise_affine']!r} is not supported (norms without weights)")
    block = data.get("attnres_block_size")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1 or (block != 1 and block % 2)):
        raise PretrainedError(
            f"{where}: 'attnres_block_size' = {block!r}; fla accepts None (PreNorm), 1 (Full AttnRes) or an even number of sublayers"
        )
    unknown = sorted(set(data) - _READ - _HARMLESS)
    if unknown:
        warnings.warn(f"{where}: keys {unknown} are not read (they do not change what load_pretrained builds)", stacklevel=3)
    where_ = where
    get = lambda key, kind, default, lo=None, hi=None: field(  # noqa: E731
        data if data.get(key) is not None else {}, key, kind, where_, PretrainedError, lo=lo, hi=hi, required=False,
        default=default)
    d = get("hidden_size", "int", 2048, 1, MAX_WIDTH)
    heads = get("num_heads", "int", 32, 1, 1024)
    n_layers = get("num_hidden_layers", "int", 24, 1, MAX_LAYERS)
    kv_heads = get("num_kv_heads", "int", heads, 1, heads)
    n_ctx = get("max_position_embeddings", "int", 2048, 1, MAX_POSITIONS)
    vocab = get("vocab_size", "int", 32000, 1, MAX_VOCAB)
    inter = get("intermediate_size", "int", None, 1, 64 * MAX_WIDTH)
    ratio = get("hidden_ratio", "number", None, 1e-3, 64)
    norm_eps = get("norm_eps", "number", 1e-6, 0, 1)
    theta = get("rope_theta", "number", 10000.0, 1e-6, 1e12)
    if d % heads:
        raise PretrainedError(f"{where}: 'hidden_size' {d} is not a multiple of 'num_heads' {heads}")
    # the rotary table is sized by the config alone (not stored in the file): bound it before building it
    check_bytes(2 * 4 * n_ctx * (d // heads), f"the rotary table for 'max_position_embeddings' {n_ctx}", where, PretrainedError)
    try:
        if block is None:
            residual, block_kw = "prenorm", {}
        elif block == 1:
            residual, block_kw = "full", {}
        else:
            residual, block_kw = "block", {"block_size": min(block, 2 * n_layers)}
        return ModelConfig(
            d_model=d,
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=kv_heads,
            d_head=d // heads,
            d_mlp=_mlp_width(d, ratio, inter),
            n_ctx=n_ctx,
            d_vocab=vocab,
            residual=residual,
            norm_eps=float(norm_eps),
            positional="rope",
            rope_theta=float(theta),
            mlp="swiglu",
            qk_norm=bool(data.get("qk_norm", False)),
            qk_norm_eps=QK_NORM_EPS,
            qkv_bias=bool(data.get("qkv_bias", False)),
            tie_embeddings=bool(data.get("tie_word_embeddings", False)),
            extra={"source": "flash-linear-attention", "attnres_block_size": block},
            **block_kw,
        )
    except (ConfigError, TypeError, ValueError) as exc:
        raise PretrainedError(f"{where}: {exc}") from None


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, Path] | None]:
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


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The fla checkpoint's tensor names and shapes for ``cfg``."""
    d, dh, H, Hkv, V, F = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads, cfg.d_vocab, cfg.d_mlp
    out: dict[str, tuple[int, ...]] = {"model.embeddings.weight": (V, d), "model.norm.weight": (d,)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
            p + "attn.q_proj.weight": (H * dh, d), p + "attn.k_proj.weight": (Hkv * dh, d),
            p + "attn.v_proj.weight": (Hkv * dh, d), p + "attn.o_proj.weight": (d, H * dh),
            p + "mlp.gate_proj.weight": (F, d), p + "mlp.up_proj.weight": (F, d), p + "mlp.down_proj.weight": (d, F),
        })
        if cfg.qkv_bias:
            out.update({p + "attn.q_proj.bias": (H * dh,), p + "attn.k_proj.bias": (Hkv * dh,), p + "attn.v_proj.bias": (Hkv * dh,)})
        if cfg.qk_norm:
            out.update({p + "attn.q_norm.weight": (dh,), p + "attn.k_norm.weight": (dh,)})
        if cfg.residual != "prenorm":
            for m in ("attn", "mlp"):
                out.update({p + f"{m}_res_proj.weight": (1, d), p + f"{m}_res_norm.weight": (d,)})
    if cfg.residual != "prenorm":
        out.update({"model.res_proj.weight": (1, d), "model.res_norm.weight": (d,)})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    return out


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # weights are floats: an integer or bool tensor is not a weight


def _read_weights(files: list[Path], expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
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


def _state_dict(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fla names -> ours (docs/design.md, "Models from elsewhere")."""
    sd = {"W_E": w["model.embeddings.weight"], "ln_final.weight": w["model.norm.weight"]}
    for i in range(cfg.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        sd[b + "ln1.weight"] = w[p + "attn_norm.weight"]
        sd[b + "ln2.weight"] = w[p + "mlp_norm.weight"]
        sd[b + "attn.W_QKV.weight"] = torch.cat([w[p + f"attn.{x}_proj.weight"] for x in "qkv"])
        if cfg.qkv_bias:
            sd[b + "attn.W_QKV.bias"] = torch.cat([w[p + f"attn.{x}_proj.bias"] for x in "qkv"])
        sd[b + "attn.W_O.weight"] = w[p + "attn.o_proj.weight"]
        if cfg.qk_norm:
            sd[b + "attn.q_norm.weight"] = w[p + "attn.q_norm.weight"]
            sd[b + "attn.k_norm.weight"] = w[p + "attn.k_norm.weight"]
        sd[b + "mlp.W_gate.weight"] = w[p + "mlp.gate_proj.weight"]
        sd[b + "mlp.W_in.weight"] = w[p + "mlp.up_proj.weight"]
        sd[b + "mlp.W_out.weight"] = w[p + "mlp.down_proj.weight"]
        if cfg.residual != "prenorm":
            for m in ("attn", "mlp"):
                sd[b + f"{m}_res.query"] = w[p + f"{m}_res_proj.weight"].reshape(-1)
                sd[b + f"{m}_res.norm.weight"] = w[p + f"{m}_res_norm.weight"]
    if cfg.residual != "prenorm":
        sd["out_res.query"] = w["model.res_proj.weight"].reshape(-1)
        sd["out_res.norm.weight"] = w["model.res_norm.weight"]
    if not cfg.tie_embeddings:
        sd["W_U"] = w["lm_head.weight"].T.contiguous()
    return sd


class PretrainedTokenizer:
    """A Hugging Face tokenizer with the methods the toolkit calls (``to_tokens``,
    ``to_str_tokens``, ``decode``), read from a checkpoint folder only (nothing fetched)."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer

    def to_tokens(self, text: str) -> torch.Tensor:
        """Token ids [1, pos] (no special tokens added)."""
        return torch.tensor([self.hf.encode(text, add_special_tokens=False)], dtype=torch.long)

    def to_str_tokens(self, tokens: Any) -> list[str]:
        ids = torch.as_tensor(tokens).reshape(-1).tolist()
        return [self.hf.decode([i]) for i in ids]

    def decode(self, tokens: Any) -> str:
        return self.hf.decode(torch.as_tensor(tokens).reshape(-1).tolist())


def _tokenizer(directory: Path) -> PretrainedTokenizer:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / n).is_file() for n in names):
        raise PretrainedError(
            f"{directory} has no tokenizer files ({', '.join(names)}): save the tokenizer beside the weights "
            "(tokenizer.save_pretrained into the same folder) so the commands can read text; in Python, "
            "load_pretrained(folder, tokenizer=False) loads the weights alone, and Probe.run takes token ids")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is installed with the fla extra
        raise PretrainedError(f"reading the tokenizer needs transformers ({exc}); pip install 'attnres-probe[fla]'") from None
    from transformers.utils import logging as hf_logging

    for name in ("tokenizer_config.json", "config.json"):  # a folder asking for its own code is refused before transformers reads it
        path = directory / name
        if path.is_file():
            from attnres_probe.io import read_json

            _refuse_code(read_json(path, PretrainedError, max_bytes=CONFIG_LIMIT), path)

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "model of type `transformer`" notice is about its own model registry, not this load
    try:
        return PretrainedTokenizer(AutoTokenizer.from_pretrained(str(directory), local_files_only=True,
                                                                 trust_remote_code=False))
    except Exception as exc:  # transformers raises many types for unreadable files
        raise PretrainedError(f"cannot read the tokenizer in {directory}: {type(exc).__name__}: {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def load_pretrained(
    directory: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
    tokenizer: bool = True,
):
    """Read an fla ``transformer`` checkpoint folder into an AttnResTransformer and its tokenizer.

    Args:
        directory: the folder ``save_pretrained`` wrote (config.json, model.safetensors or a
            sharded index, tokenizer files).
        device, dtype: where and in which dtype to put the weights (float32 by default, so
            that the CPU kernels run; the checkpoint may be bf16).
        backend: the depth-attention backend (see :class:`~attnres_probe.AttnResTransformer`).
        tokenizer: read the tokenizer too (False: return None for it).

    Returns:
        (model in eval mode, tokenizer or None; the tokenizer is also ``model.tokenizer``). A
        checkpoint without ``attnres_block_size`` is the PreNorm baseline, so a run of the same
        recipe can be compared.

    Raises:
        PretrainedError: a missing or unreadable file, another model_type, an option the model
            cannot represent, or weights that do not match the config (one line each).
    """
    from attnres_probe.model import AttnResTransformer

    directory = Path(directory)
    if not directory.is_dir():
        raise PretrainedError(f"{directory} is not a folder")
    cfg = config_from_fla(_read_config(directory), where=str(directory / "config.json"))
    files, mapping = _weight_files(directory)
    expected = _expected(cfg)
    n_params = sum(math.prod(s) for s in expected.values())
    stored = sum(f.stat().st_size for f in files)
    if 2 * n_params > stored:  # every tensor is stored, in at least 2 bytes per value
        raise PretrainedError(f"{directory / 'config.json'} implies {n_params:,} parameters ({2 * n_params:,} bytes at "
                              f"least), but the weight files hold {stored:,} bytes: config/weights mismatch")
    check_bytes(n_params * torch.finfo(dtype).bits // 8 * 2, f"the model ({n_params:,} parameters, loaded and copied)",
                str(directory), PretrainedError)
    weights = _read_weights(files, expected, dtype, mapping)  # headers checked first
    tok = _tokenizer(directory) if tokenizer else None
    model = AttnResTransformer(cfg, backend=backend)
    model.load_state_dict(_state_dict(cfg, weights), strict=True)
    if tok is not None:
        model.tokenizer = tok  # model.to_tokens, to_string, generate read text with the checkpoint's tokenizer
    return model.to(device=device, dtype=dtype).eval(), tok

