"""The Qwen3-AttnRes family (gouzigouzi/attention-residuals-reproduction, ``modeling_attnres.py`` at
7fa43ed) and its baseline, a plain transformers Qwen3 of the same recipe.

``model_type: "qwen3_attnres"`` is built as our model with the ``cumulative`` rule
(:mod:`attnres_probe.rules.cumulative`: a softmax over cumulative residual states with a recency
bias, then a gate); ``model_type: "qwen3"`` (the ``baseline`` folders) as PreNorm. The body is Qwen3's:
RMSNorm (eps ``rms_norm_eps``, the q/k norms' too), per-head q/k RMSNorm before rotary, grouped
KV heads, rotary positions in the rotate-half layout (``rope_parameters.rope_theta``), SwiGLU,
tied embeddings when ``tie_word_embeddings``. Refused, naming the key: the per-dimension gate
``attnres_gate_type: "sigmoid_vector"`` (no scalar coefficient per source), attention biases,
sliding-window attention, another activation, scaled rotary positions, an unknown ``attnres_mode``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.families.common import MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, PretrainedError, getter
from attnres_probe.validate import check_bytes

NAME = "qwen3_attnres"
MODEL_TYPES = ("qwen3_attnres", "qwen3")
TITLE = "Qwen3-AttnRes"
SOURCE = "gouzigouzi/attention-residuals-reproduction@7fa43edfd11e28498d7b42362192c26de7d8fc65, modeling_attnres.py"
GATES = ("bias", "sigmoid_scalar", "learnable_alpha")  # "none" and unknown strings fall through to "bias" upstream
MODES = ("block", "full")


def recognises(data: dict[str, Any]) -> bool:
    return data.get("model_type") in ("qwen3_attnres", "qwen3")


def config(data: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` for a Qwen3-AttnRes (or Qwen3 baseline) config.json."""
    get = getter(data, where)
    attnres = data.get("model_type") == "qwen3_attnres"
    if data.get("attention_bias"):
        raise PretrainedError(f"{where}: 'attention_bias' = true is not supported (Qwen3-AttnRes is trained without)")
    if data.get("use_sliding_window"):
        raise PretrainedError(f"{where}: 'use_sliding_window' = true (sliding-window attention) is not supported; only full causal attention is")
    if data.get("hidden_act", "silu") != "silu":
        raise PretrainedError(f"{where}: 'hidden_act' = {data['hidden_act']!r} is not supported; only 'silu' (SwiGLU) is")
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        raise PretrainedError(f"{where}: rotary scaling {rope!r} is not supported; only rope_type 'default' is")
    d = get("hidden_size", "int", 4096, 1, MAX_WIDTH)
    n_layers = get("num_hidden_layers", "int", 32, 1, MAX_LAYERS)
    heads = get("num_attention_heads", "int", 32, 1, 1024)
    kv = get("num_key_value_heads", "int", heads, 1, heads)
    d_head = get("head_dim", "int", d // heads, 1, MAX_WIDTH)
    n_ctx = get("max_position_embeddings", "int", 32768, 1, MAX_POSITIONS)
    vocab = get("vocab_size", "int", 151936, 1, MAX_VOCAB)
    d_mlp = get("intermediate_size", "int", 22016, 1, 64 * MAX_WIDTH)
    eps = get("rms_norm_eps", "number", 1e-6, 0, 1)
    theta = rope.get("rope_theta", data.get("rope_theta", 10000.0))
    rule: dict[str, Any] = {}
    if attnres:
        mode = data.get("attnres_mode", "block")
        if mode not in MODES:
            raise PretrainedError(f"{where}: 'attnres_mode' = {mode!r}; supported: {', '.join(MODES)}")
        gate = data.get("attnres_gate_type", "bias")
        if gate == "sigmoid_vector":
            raise PretrainedError(
                f"{where}: 'attnres_gate_type' = 'sigmoid_vector' (a per-dimension gate) is not supported: its read is not a "
                f"combination of the sources with one coefficient each; supported gates: {', '.join(GATES)}")
        if gate not in GATES:  # upstream treats every other string as "bias" (no gate)
            gate = "bias"
        blocks = get("attnres_num_blocks", "int", 8, 1, MAX_LAYERS)
        per = max(1, math.ceil(n_layers / blocks))  # upstream's layers per block (ceil: 28 layers in 8 blocks keep 7 states)
        rule = {"mode": mode, "layers_per_block": per if mode == "block" else 1, "gate": gate}
    check_bytes(2 * 4 * n_ctx * d_head, f"the rotary table for 'max_position_embeddings' {n_ctx}", where, PretrainedError)
    try:
        return ModelConfig(
            d_model=d, n_layers=n_layers, n_heads=heads, n_kv_heads=kv, d_head=d_head, d_mlp=d_mlp, n_ctx=n_ctx,
            d_vocab=vocab, residual="cumulative" if attnres else "prenorm", rule_options=rule or None,
            norm_eps=float(eps), qk_norm=True, qk_norm_eps=float(eps), positional="rope", rope_theta=float(theta),
            mlp="swiglu", tie_embeddings=bool(data.get("tie_word_embeddings", False)),
            extra={"source": TITLE, "family": NAME, "model_type": data.get("model_type"),
                   **({"attnres_num_blocks": data.get("attnres_num_blocks")} if attnres else {})},
        )
    except (ConfigError, TypeError, ValueError) as exc:
        raise PretrainedError(f"{where}: {exc}") from None


def expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes (transformers' Qwen3 names, the AttnRes reads' beside them)."""
    d, dh, H, Hkv, V, F = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads, cfg.d_vocab, cfg.d_mlp
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    gate = (cfg.rule_options or {}).get("gate")
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (H * dh, d), p + "self_attn.k_proj.weight": (Hkv * dh, d),
            p + "self_attn.v_proj.weight": (Hkv * dh, d), p + "self_attn.o_proj.weight": (d, H * dh),
            p + "self_attn.q_norm.weight": (dh,), p + "self_attn.k_norm.weight": (dh,),
            p + "mlp.gate_proj.weight": (F, d), p + "mlp.up_proj.weight": (F, d), p + "mlp.down_proj.weight": (d, F),
        })
        if cfg.residual == "cumulative":
            for m in ("attn", "mlp"):
                out.update({p + f"{m}_res_proj.weight": (1, d), p + f"{m}_res_norm.weight": (d,), p + f"{m}_res_bias": ()})
                if gate == "sigmoid_scalar":
                    out[p + f"{m}_res_gate_logit"] = ()
                elif gate == "learnable_alpha":
                    out[p + f"{m}_res_alpha"] = ()
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    return out


def state_dict(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-AttnRes names -> ours."""
    sd = {"W_E": w["model.embed_tokens.weight"], "ln_final.weight": w["model.norm.weight"]}
    gate = (cfg.rule_options or {}).get("gate")
    for i in range(cfg.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        sd[b + "ln1.weight"] = w[p + "input_layernorm.weight"]
        sd[b + "ln2.weight"] = w[p + "post_attention_layernorm.weight"]
        sd[b + "attn.W_QKV.weight"] = torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        sd[b + "attn.W_O.weight"] = w[p + "self_attn.o_proj.weight"]
        sd[b + "attn.q_norm.weight"] = w[p + "self_attn.q_norm.weight"]
        sd[b + "attn.k_norm.weight"] = w[p + "self_attn.k_norm.weight"]
        sd[b + "mlp.W_gate.weight"] = w[p + "mlp.gate_proj.weight"]
        sd[b + "mlp.W_in.weight"] = w[p + "mlp.up_proj.weight"]
        sd[b + "mlp.W_out.weight"] = w[p + "mlp.down_proj.weight"]
        if cfg.residual == "cumulative":
            for m in ("attn", "mlp"):
                sd[b + f"{m}_res.query"] = w[p + f"{m}_res_proj.weight"].reshape(-1)
                sd[b + f"{m}_res.norm.weight"] = w[p + f"{m}_res_norm.weight"]
                sd[b + f"{m}_res.bias"] = w[p + f"{m}_res_bias"].reshape(())
                if gate == "sigmoid_scalar":
                    sd[b + f"{m}_res.gate_logit"] = w[p + f"{m}_res_gate_logit"].reshape(())
                elif gate == "learnable_alpha":
                    sd[b + f"{m}_res.alpha"] = w[p + f"{m}_res_alpha"].reshape(())
    if not cfg.tie_embeddings:
        sd["W_U"] = w["lm_head.weight"].T.contiguous()
    return sd
