"""The attnres4babylm ``nanogpt`` family (YpLarryWang/attnres4babylm2026 at 785492a; its exported
``modeling_nanogpt.py``): Kimi-style Block AttnRes on a nanoGPT body, its PreNorm baseline and its
static-routing control.

- ``use_attn_res`` with ``attn_res_block_size`` S (sublayers per block) is our Block AttnRes with
  ``block_size=S``: the sources are the embedding, the completed blocks' sums and the partial block,
  the first read sees the embedding alone, every read's key is ``RMSNorm(v)`` with eps 1e-5 and a
  learned gain (``attn_res_norm{1,2,f}``), its query ``attn_res_q{1,2}`` / ``attn_res_qf``, and the
  final read feeds ``ln_f``;
- ``use_static_attn_res`` is the static-routing control: each read's weights are ``softmax(q[:k])`` of
  a learned logit vector, the same for every input (Block AttnRes with ``static_routing``:
  :class:`~attnres_probe.layers.StaticMixer`);
- without ``use_attn_res`` it is the PreNorm baseline.

The body: LayerNorm (with a bias when ``bias``) or RMSNorm (``use_rmsnorm``), eps
``layer_norm_epsilon``; fused ``c_attn`` (q, k, v); learned positions ``wpe`` or rotary ones
(``use_rope``, rotate-half, ``rope_theta``); an optional attention output gate
``z * sigmoid(attn_gate(x))`` (``use_attn_gate``); GELU (exact) with 4C hidden units or SwiGLU with
``round(int(swiglu_mult * C) / 64) * 64``; a bias on every Linear when ``bias``; tied embeddings.
The exported ``config.json`` names the folder's ``modeling_nanogpt.py`` in ``auto_map``: it is never
run (the model is built here). Refused, naming the key: ``bidirectional`` (the masked-LM export), a body
norm eps other than the depth keys' 1e-5, untied embeddings.
"""

from __future__ import annotations

from typing import Any

import torch

from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.families.common import MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, PretrainedError, getter
from attnres_probe.validate import check_bytes

NAME = "nanogpt"
MODEL_TYPES = ("nanogpt",)
TITLE = "attnres4babylm nanogpt"
SOURCE = "YpLarryWang/attnres4babylm2026@785492ad3dbb8d4195583e82cc2aed303f2e058a, eval/hf_nanogpt/modeling_nanogpt.py"
DEPTH_EPS = 1e-5  # the depth keys' RMSNorm eps, fixed upstream whatever layer_norm_epsilon says


def recognises(data: dict[str, Any]) -> bool:
    return data.get("model_type") == "nanogpt"


def swiglu_width(d: int, mult: float) -> int:
    """Upstream's SwiGLU hidden width: ``round(int(mult * d) / 64) * 64`` (Python's round)."""
    return round(int(mult * d) / 64) * 64


def config(data: dict[str, Any], where: str = "config.json") -> ModelConfig:
    get = getter(data, where)
    if data.get("bidirectional"):
        raise PretrainedError(f"{where}: 'bidirectional' = true (the masked-LM export) is not supported; only causal models are")
    if data.get("tie_word_embeddings", True) is not True:
        raise PretrainedError(f"{where}: 'tie_word_embeddings' = false is not supported (nanogpt ties the head to wte)")
    d = get("n_embd", "int", 512, 1, MAX_WIDTH)
    heads = get("n_head", "int", 8, 1, 1024)
    n_layers = get("n_layer", "int", 8, 1, MAX_LAYERS)
    n_ctx = get("block_size", "int", 512, 1, MAX_POSITIONS)
    vocab = get("vocab_size", "int", 16384, 1, MAX_VOCAB)
    eps = get("layer_norm_epsilon", "number", 1e-5, 0, 1)
    if eps != DEPTH_EPS:
        raise PretrainedError(f"{where}: 'layer_norm_epsilon' = {eps} is not supported; the depth keys' norm uses 1e-5 and "
                              "this model shares one eps between them and the body's norms")
    if d % heads:
        raise PretrainedError(f"{where}: 'n_embd' {d} is not a multiple of 'n_head' {heads}")
    attn_res, static = bool(data.get("use_attn_res")), bool(data.get("use_static_attn_res"))
    if static and not attn_res:
        raise PretrainedError(f"{where}: 'use_static_attn_res' needs 'use_attn_res' (upstream asserts it)")
    S = get("attn_res_block_size", "int", 2, 1, 2 * n_layers)
    if attn_res and (S % 2 or (2 * n_layers) % S):
        raise PretrainedError(f"{where}: 'attn_res_block_size' = {S}; upstream needs an even number of sublayers dividing "
                              f"2 * n_layer = {2 * n_layers}")
    rope = bool(data.get("use_rope"))
    theta = get("rope_theta", "number", 10000.0, 1, 1e12)
    swiglu = bool(data.get("use_swiglu"))
    mult = get("swiglu_mult", "number", 8 / 3, 1e-3, 64)
    bias = bool(data.get("bias", False))
    if rope:
        check_bytes(2 * 4 * n_ctx * (d // heads), f"the rotary table for 'block_size' {n_ctx}", where, PretrainedError)
    residual = "block" if attn_res else "prenorm"
    try:
        return ModelConfig(
            d_model=d, n_layers=n_layers, n_heads=heads, n_ctx=n_ctx, d_vocab=vocab,
            d_mlp=swiglu_width(d, mult) if swiglu else 4 * d, mlp="swiglu" if swiglu else "gelu",
            residual=residual, block_size=S if attn_res else None, static_routing=static,
            norm="rms" if data.get("use_rmsnorm") else "layernorm", norm_bias=bias and not data.get("use_rmsnorm"),
            norm_eps=DEPTH_EPS, bias=bias, attn_gate=bool(data.get("use_attn_gate")),
            positional="rope" if rope else "learned", rope_theta=float(theta), tie_embeddings=True,
            extra={"source": TITLE, "family": NAME, "model_type": "nanogpt", "attn_res_block_size": S if attn_res else None},
        )
    except (ConfigError, TypeError, ValueError) as exc:
        raise PretrainedError(f"{where}: {exc}") from None


def _linear(out: dict, name: str, shape: tuple[int, int], bias: bool) -> None:
    out[name + ".weight"] = shape
    if bias:
        out[name + ".bias"] = (shape[0],)


def expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, V, F, n = cfg.d_model, cfg.d_vocab, cfg.d_mlp, cfg.n_layers
    bias, nb = bool(cfg.bias), cfg.norm_bias
    out: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (V, d), "transformer.ln_f.weight": (d,)}
    if nb:
        out["transformer.ln_f.bias"] = (d,)
    if cfg.positional == "learned":
        out["transformer.wpe.weight"] = (cfg.n_ctx, d)
    k = cfg.n_sources  # static logits: one per source of the final read
    for i in range(n):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[p + ln + ".weight"] = (d,)
            if nb:
                out[p + ln + ".bias"] = (d,)
        _linear(out, p + "attn.c_attn", (3 * d, d), bias)
        _linear(out, p + "attn.c_proj", (d, d), bias)
        if cfg.attn_gate:
            _linear(out, p + "attn.attn_gate", (d, d), bias)
        if cfg.mlp == "swiglu":
            _linear(out, p + "mlp.c_gate", (F, d), bias)
            _linear(out, p + "mlp.c_val", (F, d), bias)
        else:
            _linear(out, p + "mlp.c_fc", (F, d), bias)
        _linear(out, p + "mlp.c_proj", (d, F), bias)
        if cfg.static_routing:
            out.update({p + "attn_res_q1": (k,), p + "attn_res_q2": (k,)})
        elif cfg.residual == "block":
            out.update({p + "attn_res_q1": (d,), p + "attn_res_q2": (d,),
                        p + "attn_res_norm1.weight": (d,), p + "attn_res_norm2.weight": (d,)})
    if cfg.static_routing:
        out["attn_res_qf"] = (k,)
    elif cfg.residual == "block":
        out.update({"attn_res_qf": (d,), "attn_res_normf.weight": (d,)})
    return out


def state_dict(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {"W_E": w["transformer.wte.weight"]}
    if cfg.positional == "learned":
        sd["W_pos"] = w["transformer.wpe.weight"]

    def copy(ours: str, theirs: str) -> None:
        for part in ("weight", "bias"):
            if f"{theirs}.{part}" in w:
                sd[f"{ours}.{part}"] = w[f"{theirs}.{part}"]

    copy("ln_final", "transformer.ln_f")
    for i in range(cfg.n_layers):
        p, b = f"transformer.h.{i}.", f"blocks.{i}."
        copy(b + "ln1", p + "ln_1")
        copy(b + "ln2", p + "ln_2")
        copy(b + "attn.W_QKV", p + "attn.c_attn")
        copy(b + "attn.W_O", p + "attn.c_proj")
        copy(b + "attn.W_G", p + "attn.attn_gate")
        if cfg.mlp == "swiglu":
            copy(b + "mlp.W_gate", p + "mlp.c_gate")
            copy(b + "mlp.W_in", p + "mlp.c_val")
        else:
            copy(b + "mlp.W_in", p + "mlp.c_fc")
        copy(b + "mlp.W_out", p + "mlp.c_proj")
        if cfg.static_routing:
            sd[b + "attn_res.logits"], sd[b + "mlp_res.logits"] = w[p + "attn_res_q1"], w[p + "attn_res_q2"]
        elif cfg.residual == "block":
            sd[b + "attn_res.query"], sd[b + "mlp_res.query"] = w[p + "attn_res_q1"], w[p + "attn_res_q2"]
            sd[b + "attn_res.norm.weight"] = w[p + "attn_res_norm1.weight"]
            sd[b + "mlp_res.norm.weight"] = w[p + "attn_res_norm2.weight"]
    if cfg.static_routing:
        sd["out_res.logits"] = w["attn_res_qf"]
    elif cfg.residual == "block":
        sd["out_res.query"], sd["out_res.norm.weight"] = w["attn_res_qf"], w["attn_res_normf.weight"]
    return sd
