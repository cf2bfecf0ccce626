"""ModelSpec: what the recorder needs to know about a model, for ours and for foreign ones.

:func:`spec_for` builds it for an :class:`~attnres_probe.AttnResTransformer` (all three
residual rules) or for any TransformerLens-style PreNorm model exposing ``hook_embed``,
``hook_pos_embed``, ``blocks.{i}.hook_resid_pre``/``_mid`` and ``blocks.{i}.hook_attn_out``/
``_mlp_out`` (a TransformerLens 4.x ``TransformerBridge``, say), which is treated as a PreNorm
baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from attnres_probe.axis import SourceAxis
from attnres_probe.hooks.names import REQUIRED_TL_HOOKS, mixed_input_hook_names, output_hook_names

__all__ = ["ModelSpec", "MissingHooksError", "spec_for"]


class MissingHooksError(ValueError):
    """The model lacks hook points the recorder needs."""


@dataclass
class ModelSpec:
    """Structure of a model, as the recorder sees it.

    Attributes:
        axis: the model's common source axis (residual rule, layers, blocks, labels).
        read_hooks: mixed-input hook of each read (L+1; the last may be None: the recorder
            then sums the sources itself, which is exact for PreNorm).
        output_hooks: the L sublayer outputs.
        weight_hooks: per read, the read's depth weights (AttnRes: the softmax weights;
            Hyper-Connections and DenseFormer: the coefficients over the sources), else None
            (PreNorm: the recorder writes its coefficients, all one, itself).
        logit_hooks: per read, AttnRes's depth logits; None for every other rule.
        contrib_hooks: per read, the mixer's contribution-share hook (AttnRes only): the
            recorder takes the shares from the mixer, which has the sources at hand, instead
            of keeping sources itself.
        sublayer_params: per sublayer, the parameters of that sublayer (and its pre-norm).
        mixer_params: per read, the depth mixer's parameters (AttnRes only).
        pattern_hooks: per transformer block, its attention-pattern hook
            (``blocks.{i}.attn.hook_pattern``, [batch, head, query_pos, key_pos]), or None when
            the model has none; used only when patterns are asked for.
        n_ctx, d_vocab: input limits.
        meta: description stored in traces (name, config, labels).
    """

    axis: SourceAxis
    read_hooks: list[str | None]
    output_hooks: list[str]
    weight_hooks: list[str] | None
    logit_hooks: list[str] | None
    sublayer_params: list[list[nn.Parameter]]
    mixer_params: list[list[nn.Parameter]] | None
    n_ctx: int
    d_vocab: int
    meta: dict[str, Any] = field(default_factory=dict)
    contrib_hooks: list[str] | None = None
    pos_embed: bool = True  # source 0 = hook_embed + hook_pos_embed (False: hook_embed alone, rotary models)
    pattern_hooks: list[str] | None = None
    # a rule's own weights kept beside the common axis (rules of attnres_probe.rules): name -> per read,
    # the read's hook_native_<name> (None where a read has none)
    native_hooks: dict[str, list[str | None]] = field(default_factory=dict)

    @property
    def residual(self) -> str:
        return self.axis.residual

    @property
    def n_layers(self) -> int:
        return self.axis.n_layers

    @property
    def n_sublayers(self) -> int:
        return self.axis.n_sublayers

    @property
    def block_starts(self) -> list[int]:
        return list(self.axis.block_starts)

    @property
    def sublayer_labels(self) -> list[str]:
        return self.axis.sublayer_labels

    @property
    def read_labels(self) -> list[str]:
        return self.axis.read_labels

    @property
    def source_labels(self) -> list[str]:
        return self.axis.source_labels


def spec_for(model: nn.Module, name: str | None = None) -> ModelSpec:
    """Build the recorder's view of ``model``.

    Raises:
        MissingHooksError: listing every hook point the model lacks.
    """
    from attnres_probe.model import AttnResTransformer

    if isinstance(model, AttnResTransformer):
        return _spec_attnres(model, name)
    return _spec_foreign(model, name)


def _spec_attnres(model, name: str | None) -> ModelSpec:
    """Our model's spec; hook names are read from its module tree (``HookPoint.name``)."""
    cfg = model.cfg
    blocks, mixers = list(model.blocks), model.mixers
    sub_params = []
    for block in blocks:
        sub_params.append([*block.ln1.parameters(), *block.attn.parameters()])
        sub_params.append([*block.ln2.parameters(), *block.mlp.parameters()])
    spec = ModelSpec(
        axis=model.axis,
        read_hooks=[*(hp.name for b in blocks for hp in (b.hook_resid_pre, b.hook_resid_mid)), model.hook_resid_final.name],
        output_hooks=[hp.name for b in blocks for hp in (b.hook_attn_out, b.hook_mlp_out)],
        weight_hooks=[m.hook_weights.name for m in mixers] or None,
        logit_hooks=[m.hook_logits.name for m in mixers if hasattr(m, "hook_logits")] or None,  # AttnRes only
        contrib_hooks=[m.hook_contrib.name for m in mixers] or None,
        sublayer_params=sub_params,
        mixer_params=[list(m.parameters()) for m in mixers] or None,
        n_ctx=cfg.n_ctx,
        d_vocab=cfg.d_vocab,
        pos_embed=cfg.positional != "rope",
        pattern_hooks=[b.attn.hook_pattern.name for b in blocks],
        native_hooks=_native_hooks(cfg.residual, mixers),
    )
    spec.meta = _meta(spec, name or cfg.residual, cfg.to_dict(), model)
    if spec.native_hooks:
        from attnres_probe.rules import RULES

        spec.meta["native"] = dict(RULES[cfg.residual].native)
        labels = getattr(model, "native_source_labels", None)
        if callable(labels):
            spec.meta["native_sources"] = labels()
    return spec


def _native_hooks(residual: str, mixers: list[nn.Module]) -> dict[str, list[str | None]]:
    from attnres_probe.rules import RULES

    info = RULES.get(residual)
    if info is None:
        return {}
    out = {}
    for key in info.native:
        hooks = [getattr(getattr(m, f"hook_native_{key}", None), "name", None) for m in mixers]
        if any(hooks):
            out[key] = hooks
    return out


def _spec_foreign(model: nn.Module, name: str | None) -> ModelSpec:
    hook_dict = getattr(model, "hook_dict", None)
    cfg = getattr(model, "cfg", None)
    n = getattr(cfg, "n_layers", None)
    if not isinstance(hook_dict, dict) or not isinstance(n, int):
        raise MissingHooksError(
            f"{type(model).__name__} is not a TransformerLens-style model: the recorder needs `hook_dict` "
            "and `cfg.n_layers`, and hook points hook_embed, hook_pos_embed, blocks.{i}.hook_resid_pre, "
            "blocks.{i}.hook_attn_out, blocks.{i}.hook_resid_mid, blocks.{i}.hook_mlp_out"
        )
    missing = [h for h in REQUIRED_TL_HOOKS(n) if h not in hook_dict]
    if missing:
        raise MissingHooksError(f"{type(model).__name__} lacks the hook points the recorder needs: {', '.join(missing)}")
    final = f"blocks.{n - 1}.hook_resid_post"
    reads = mixed_input_hook_names(n, final=final if final in hook_dict else None)
    if len(reads) == 2 * n:
        reads.append(None)
    blocks = getattr(model, "blocks", None)
    sub_params: list[list[nn.Parameter]] = []
    for i in range(n):
        block = blocks[i] if blocks is not None else None
        for parts in (("ln1", "attn"), ("ln2", "mlp")):
            params: list[nn.Parameter] = []
            for part in parts:
                mod = getattr(block, part, None) if block is not None else None
                if isinstance(mod, nn.Module):
                    params += [p for p in mod.parameters() if p.requires_grad]
            sub_params.append(params)
    patterns = [f"blocks.{i}.attn.hook_pattern" for i in range(n)]  # TransformerLens's pattern hooks
    config: dict[str, Any] = {}
    for key in ("d_model", "n_layers", "n_heads", "d_head", "d_mlp", "n_ctx", "d_vocab", "normalization_type", "act_fn"):
        value = getattr(cfg, key, None)
        if isinstance(value, (int, float, str, bool)) or value is None:
            config[key] = value
    spec = ModelSpec(
        axis=SourceAxis("prenorm", n),
        read_hooks=reads,
        output_hooks=output_hook_names(n),
        weight_hooks=None,
        logit_hooks=None,
        sublayer_params=sub_params,
        mixer_params=None,
        n_ctx=int(getattr(cfg, "n_ctx", 0) or 0) or 10**9,
        d_vocab=int(getattr(cfg, "d_vocab", 0) or 0) or 10**9,
        pattern_hooks=patterns if all(p in hook_dict for p in patterns) else None,
    )
    spec.meta = _meta(spec, name or type(model).__name__, config, model)
    spec.meta["foreign"] = True
    return spec


def _meta(spec: ModelSpec, name: str, config: dict, model: nn.Module) -> dict[str, Any]:
    return {
        "name": name,
        **spec.axis.to_meta(),
        "config": config,
        "n_params": int(sum(p.numel() for p in model.parameters())),
        "model_class": type(model).__name__,
    }
