"""AttnResCache: TransformerLens's ``ActivationCache`` for an :class:`~attnres_probe.AttnResTransformer`,
and the pieces of the model its helpers read (``tokens_to_residual_directions``, ``accumulated_bias``).

Every public helper of ``ActivationCache`` either works where it is well defined for these
models or raises one error naming the routing-aware alternative:

- The generic ones (indexing, ``keys``, ``to``, ``remove_batch_dim``, ``apply_slice_to_batch_dim``,
  ``stack_activation``, ``toggle_autodiff``) work in every mode.
- ``compute_head_results`` (per-head outputs from ``hook_z`` and ``W_O``; they add up to
  ``hook_attn_out``) and ``get_neuron_results`` (each MLP neuron's output through ``W_out``, the
  bias excluded) are sublayer outputs: well defined in every mode.
- ``apply_ln_to_stack`` divides a stack by the scale of the norm that reads it
  (``sqrt(mean(x^2) + eps)`` of that norm's input, computed from the cached input:
  ``hook_resid_pre`` for ``ln1``, ``hook_resid_mid`` for ``ln2``, ``hook_resid_final`` for
  ``ln_final``; the models have no ``hook_scale``). Our norms are RMSNorm
  (``cfg.normalization_type == "RMS"``: no centring). As in TransformerLens, the norm's gain is
  not applied there; ``model.tokens_to_residual_directions`` folds it into the unembedding
  directions instead (TransformerLens folds it into ``W_U`` when it loads a model), so
  ``logit_attrs`` of a stack that adds up to the final read's input adds up to the logits.
  Both are well defined in every mode: under AttnRes the stack must add up to the mixed read
  (e.g. the final read's ``alpha_i v_i``, which ``Probe.logit_contributions`` computes).
- The residual-stream decompositions (``accumulated_resid``, ``decompose_resid``,
  ``get_full_resid_decomposition``, ``stack_head_results``, ``stack_neuron_results``) work on the
  PreNorm baseline, where the stream is a sum; under AttnRes a read is a softmax-weighted mixture
  of earlier sources, not their running sum, so they raise and name ``Probe.logit_lens`` and
  ``Probe.logit_contributions`` (docs/design.md, "Reading the residual stream under AttnRes").
- ``logit_lens`` is TransformerLens's reader for ``TransformerBridge`` models (it reads their
  ``W_U``, ``b_U`` and unembed component); it raises in every mode and names ``Probe.logit_lens``
  (on PreNorm, ``cache.accumulated_resid(apply_ln=True) @ model.unembed`` is the same recipe).
- ``compute_ssm_state``, ``compute_ssm_effective_attention``: the models have no SSM layers
  (``ssm_layers()`` is ``[]``); they raise saying so.

This module never imports :mod:`attnres_probe.model` (the model imports it).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.nn as nn
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice

from attnres_probe.axis import rule_title

__all__ = ["AttnResCache", "accumulated_bias", "head_output_weights", "residual_directions"]

_ROUTING_AWARE = (
    "use Probe(model).logit_lens(tokens) (what each read predicts) or Probe(model).logit_contributions(tokens, token=...) "
    "(each source's direct share of the final logits)"
)


# -- the model's side ----------------------------------------------------------------------
def head_output_weights(attn: Any) -> torch.Tensor:
    """An attention's output projection per head, [n_heads, d_head, d_model] (TransformerLens's ``W_O``)."""
    w = attn.W_O
    if isinstance(w, nn.Linear):  # ours: W_O(z.reshape(B, P, H * dh)), weight [d_model, H * dh]
        w = w.weight.T
    return w.reshape(attn.n_heads, attn.d_head, -1)


def _out_bias(module: Any) -> torch.Tensor | None:
    return getattr(module, "bias", None) if isinstance(module, nn.Linear) else None


def residual_directions(model: Any, tokens: Any) -> torch.Tensor:
    """``model.tokens_to_residual_directions``: the direction in the final read's input whose
    dot product with that input divided by the final norm's scale is a token's logit,
    ``ln_final.weight * unembed[:, token]`` (TransformerLens's ``W_U[:, token]`` on a model whose
    final norm gain is folded into ``W_U``).

    Args:
        tokens: a str of one token, an int, or a tensor of ids (any shape).

    Returns:
        [d_model] for one token, else [*tokens.shape, d_model].
    """
    if isinstance(tokens, str):
        tokens = model.to_single_token(tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, (int, torch.Tensor)):
        raise TypeError(f"tokens must be a str of one token, an int or a tensor of ids; got {type(tokens).__name__}")
    ids = torch.as_tensor(tokens, device=model.device).long()
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < model.cfg.d_vocab):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"token id {bad} is out of range; this model's vocabulary is 0..{model.cfg.d_vocab - 1}")
    directions = model.ln_final.weight[:, None] * model.unembed  # (d_model, vocab)
    if ids.numel() == 1:
        return directions[:, int(ids.reshape(()))]
    return directions[:, ids].movedim(0, -1)


def accumulated_bias(model: Any, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
    """``model.accumulated_bias``: the sum of the output biases that reach the residual stream
    before ``layer`` (attention output biases, and the MLPs' ``W_out`` biases with
    ``include_mlp_biases``; with ``mlp_input`` also ``layer``'s attention bias), [d_model].
    PreNorm only: under AttnRes the stream is a weighted mixture, not a sum of biases."""
    if model.cfg.residual != "prenorm":
        raise ValueError(
            f"accumulated_bias sums the biases along the residual stream, but under {rule_title(model.cfg.residual)} "
            f"({model.cfg.residual!r}) each read is a weighted mixture of earlier sources: {_ROUTING_AWARE}"
        )
    n = model.cfg.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n or (mlp_input and layer == n):
        raise ValueError(f"layer is {layer!r}; accepted values are 0..{n} ({n - 1} at most with mlp_input=True)")
    total = torch.zeros(model.cfg.d_model, device=model.device, dtype=model.W_E.dtype)
    for i, block in enumerate(model.blocks[: layer + (1 if mlp_input else 0)]):
        b = _out_bias(block.attn.W_O)
        total = total + b if b is not None else total
        b = _out_bias(block.mlp.W_out)
        if include_mlp_biases and i < layer and b is not None:
            total = total + b
    return total


# -- the cache -------------------------------------------------------------------------------
class AttnResCache(ActivationCache):
    """TransformerLens's ``ActivationCache`` for an :class:`~attnres_probe.AttnResTransformer`.

    On the PreNorm baseline the residual-stream helpers work as in TransformerLens. Under
    AttnRes a read is a softmax-weighted mixture of earlier sources, not their running sum (under
    Hyper-Connections and DenseFormer a mixture with learned coefficients), so
    the helpers that add up residual-stream pieces (``accumulated_resid``, ``decompose_resid``,
    ``get_full_resid_decomposition``, ``stack_head_results``, ``stack_neuron_results``) would
    describe a stream that does not exist: they raise, and name the routing-aware ones
    (:meth:`Probe.logit_lens`, :meth:`Probe.logit_contributions`). See this module's docstring
    for every helper.
    """

    def _attnres(self) -> bool:
        return self.model.cfg.residual != "prenorm"

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            name = key if isinstance(key, str) else None
            if isinstance(key, tuple) and key and isinstance(key[0], str):
                from transformer_lens.utilities import get_act_name

                try:
                    name = get_act_name(*key)
                except Exception:
                    name = None
            if name and "resid_post" in name and self._attnres():
                raise KeyError(
                    f"{name}: under {rule_title(self.model.cfg.residual)} there is no residual stream after a block (each "
                    "read mixes earlier sources afresh); what a sublayer reads is blocks.{i}.hook_resid_pre (attention) "
                    "or blocks.{i}.hook_resid_mid (MLP), and the final norm reads hook_resid_final") from None
            raise
    def _refuse(self, helper: str, hint: str = "") -> NoReturn:
        raise ValueError(
            f"cache.{helper}() sums residual-stream pieces, but under {rule_title(self.model.cfg.residual)} "
            f"({self.model.cfg.residual!r}) each read is a weighted mixture of earlier sources: {_ROUTING_AWARE}{hint}"
        )

    # -- residual-stream decompositions: PreNorm only ----------------------------------
    def accumulated_resid(self, *args: Any, **kwargs: Any):
        if self._attnres():
            self._refuse("accumulated_resid")
        return super().accumulated_resid(*args, **kwargs)

    def decompose_resid(self, *args: Any, **kwargs: Any):
        if self._attnres():
            self._refuse("decompose_resid")
        return super().decompose_resid(*args, **kwargs)

    def get_full_resid_decomposition(self, *args: Any, **kwargs: Any):
        if self._attnres():
            self._refuse("get_full_resid_decomposition")
        return super().get_full_resid_decomposition(*args, **kwargs)

    def stack_head_results(self, *args: Any, **kwargs: Any):
        if self._attnres():
            self._refuse("stack_head_results", "; the per-head outputs themselves: cache.compute_head_results(), then "
                          "cache['blocks.{l}.attn.hook_result']")
        return super().stack_head_results(*args, **kwargs)

    def stack_neuron_results(self, *args: Any, **kwargs: Any):
        if self._attnres():
            self._refuse("stack_neuron_results", "; each neuron's output itself: cache.get_neuron_results(layer)")
        return super().stack_neuron_results(*args, **kwargs)

    def logit_lens(self, *args: Any, **kwargs: Any):
        if self._attnres():
            self._refuse("logit_lens")
        raise ValueError(
            "cache.logit_lens() is TransformerLens's reader for TransformerBridge models (it reads their W_U, b_U and "
            "unembed component, which this model does not have): use Probe(model).logit_lens(tokens) (what each read "
            "predicts; Probe(model).logit_contributions(tokens, token=...) splits the final logits by source), or on "
            "this PreNorm model cache.accumulated_resid(apply_ln=True) @ model.unembed"
        )

    # -- the pieces TransformerLens reads off its own modules ------------------------------
    def _ensure_head_results(self) -> bool:
        """Per-head results ``blocks.{l}.attn.hook_result`` [..., pos, head, d_model] from
        ``hook_z`` and the per-head ``W_O`` (our ``W_O`` is one ``nn.Linear``); they add up to
        ``hook_attn_out`` (less an output bias, which these models do not have)."""
        expected_ndim = 4 if self.has_batch_dim else 3
        all_cached = True
        for layer, block in enumerate(self.model.blocks):
            key = f"blocks.{layer}.attn.hook_result"
            cached = self.cache_dict.get(key)
            if isinstance(cached, torch.Tensor) and cached.ndim == expected_ndim and cached.shape[-2] == block.attn.n_heads:
                continue
            all_cached = False
            z = self[("z", layer, "attn")]
            w = head_output_weights(block.attn).detach()
            dtype = torch.promote_types(z.dtype, w.dtype)
            self.cache_dict[key] = torch.einsum("...hd,hdm->...hm", z.to(dtype), w.to(device=z.device, dtype=dtype))
        return all_cached

    def get_neuron_results(
        self, layer: int, neuron_slice: Any = None, pos_slice: Any = None, project_output_onto: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each MLP neuron's output, ``hook_post[..., n] * W_out[n]`` (bias excluded): [..., pos,
        d_mlp, d_model], or projected onto ``project_output_onto`` ([d_model] or [d_model, k]),
        as TransformerLens's ``get_neuron_results``."""
        neuron_slice = neuron_slice if isinstance(neuron_slice, Slice) else Slice(neuron_slice)
        pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
        acts = pos_slice.apply(self[("post", layer, "mlp")], dim=-2)
        w_out = self.model.blocks[layer].mlp.W_out.weight.T.detach()  # (d_mlp, d_model)
        acts = neuron_slice.apply(acts, dim=-1)
        w_out = neuron_slice.apply(w_out, dim=0).to(device=acts.device, dtype=acts.dtype)
        if project_output_onto is None:
            return acts[..., None] * w_out
        projected = w_out @ project_output_onto.to(device=acts.device, dtype=acts.dtype)
        return acts * projected if project_output_onto.ndim == 1 else acts[..., None] * projected

    def _stack_neuron_results_apply_ln_projected(
        self, layer: int, pos_slice: Slice, neuron_slice: Slice, project_2d: torch.Tensor, mlp_input: bool = False
    ) -> torch.Tensor:
        """RMSNorm-scaled neuron results projected onto ``project_2d`` [d_model, k] without the
        [..., d_mlp, d_model] intermediate: ``(a_n / s) * (W_out[n] @ p)`` (no centring)."""
        scale = self._get_cached_ln_scale(layer, mlp_input=mlp_input, pos_slice=pos_slice)  # (..., pos, 1)
        parts = [self.get_neuron_results(l, neuron_slice, pos_slice, project_2d) / scale[..., None] for l in range(layer)]
        if not parts:
            empty = pos_slice.apply(self["hook_embed"], dim=-2)
            return torch.zeros(0, *empty.shape[:-1], project_2d.shape[-1], dtype=empty.dtype, device=empty.device)
        return torch.cat(parts, dim=-2).movedim(-2, 0)

    def _get_cached_ln_scale(self, layer: int | None, mlp_input: bool, pos_slice: Slice, batch_slice: Slice | None = None):
        """The scale ``sqrt(mean(x^2) + eps)`` [..., pos, 1] of the RMSNorm that reads ``layer``'s
        attention (``ln1``), MLP (``ln2``, with ``mlp_input``) or the unembedding (``ln_final``,
        ``layer`` None or n_layers), computed from its cached input (TransformerLens caches it as
        ``hook_scale``; these models compute it inside the norm)."""
        n = self.model.cfg.n_layers
        if layer is None or layer == n or layer == -1:
            key, norm = "hook_resid_final", self.model.ln_final
        else:
            block = self.model.blocks[layer]
            key, norm = (f"blocks.{layer}.hook_resid_mid", block.ln2) if mlp_input else (f"blocks.{layer}.hook_resid_pre", block.ln1)
        if key not in self.cache_dict:
            raise KeyError(
                f"apply_ln needs {key} in the cache: the scale of the norm that reads it is computed from it (run "
                "run_with_cache with a names_filter that keeps it)"
            )
        x = self.cache_dict[key]
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        scale = (xf.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
        scale = pos_slice.apply(scale, dim=-2)
        if batch_slice is not None and self.has_batch_dim:
            scale = batch_slice.apply(scale)
        return scale

    def apply_slice_to_batch_dim(self, batch_slice: Any) -> AttnResCache:
        """As TransformerLens's, and the slice is an :class:`AttnResCache` too."""
        out = super().apply_slice_to_batch_dim(batch_slice)
        return AttnResCache(out.cache_dict, out.model, has_batch_dim=out.has_batch_dim)

    # -- not these models ----------------------------------------------------------------
    def _no_ssm(self, helper: str) -> NoReturn:
        raise RuntimeError(
            f"cache.{helper}() reads SSM / recurrent layers, and this model has none (every block is attention + MLP; "
            "cache.ssm_layers() is []): for how the model routes across depth, use Probe(model).run(tokens)"
        )

    def compute_ssm_state(self, *args: Any, **kwargs: Any):
        self._no_ssm("compute_ssm_state")

    def compute_ssm_effective_attention(self, *args: Any, **kwargs: Any):
        self._no_ssm("compute_ssm_effective_attention")
