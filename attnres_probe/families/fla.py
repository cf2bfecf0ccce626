"""The flash-linear-attention (fla) family: fla ``transformer`` AttnRes checkpoints as our model.

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

import warnings
from typing import Any

import torch

from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.families.common import MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, PretrainedError, getter, refuse_code
from attnres_probe.validate import check_bytes

NAME = "fla"
MODEL_TYPES = ("transformer",)
TITLE = "flash-linear-attention 'transformer'"
SOURCE = "fla-org/flash-linear-attention 0.6.0, models/transformer"


def recognises(data: dict[str, Any]) -> bool:
    return data.get("model_type") == "transformer"


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


def _mlp_width(d: int, hidden_ratio: Any, intermediate_size: Any) -> int:
    """fla's GatedMLP width: ``intermediate_size``, or from ``hidden_ratio`` rounded up to 256."""
    if intermediate_size is not None:
        return int(intermediate_size)
    ratio = 4 if hidden_ratio is None else hidden_ratio
    width = int(d * ratio * 2 / 3)
    return 256 * ((width + 256 - 1) // 256)


def config(data: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` for an fla ``transformer`` config (a dict of config.json).

    Raises:
        PretrainedError: another ``model_type``, or an option this model cannot represent
            (the message names the key).
    """
    model_type = data.get("model_type")
    refuse_code(data, where)
    if model_type != "transformer":
        raise PretrainedError(
            f"{where}: model_type is {model_type!r}; load_pretrained reads fla 'transformer' checkpoints "
            "(use attnres_probe.watch(model) for a live fla model of any family)"
        )
    if data.get("window_size") is not None:
        raise PretrainedError(f"{where}: 'window_size' = {data['window_size']} (sliding-window attention) is not supported; "
                              "only full causal attention is")
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
    get = getter(data, where)
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


def expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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


def state_dict(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


