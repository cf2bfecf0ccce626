"""TransformerLens's weight attributes on our model: ``W_Q``, ``W_K``, ``W_V``, ``W_O``, ``W_in``, ``W_out``,
``W_gate``, ``b_U`` and the factored ``QK`` / ``OV`` circuits, with TransformerLens's shapes (stacked over
layers; grouped key/value heads repeated to every query head, as TransformerLens's ``W_K`` does).

They are views computed from the model's own projections (``attn.W_QKV``, ``attn.W_O``, ``mlp.W_in``,
``mlp.W_out``), never a second copy of the parameters: changing them does not change the model.
"""

from __future__ import annotations

import torch
from transformer_lens import FactoredMatrix

__all__ = ["TLWeights"]


class TLWeights:
    """Mixin of :class:`~attnres_probe.AttnResTransformer` (``self.blocks``, ``self.cfg``)."""

    def _qkv(self, which: int) -> torch.Tensor:
        cfg = self.cfg
        H, Hkv, dh, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model
        sizes = [H * dh, Hkv * dh, Hkv * dh]
        out = []
        for block in self.blocks:
            w = block.attn.W_QKV.weight.split(sizes, dim=0)[which]  # [heads * dh, d]
            heads = H if which == 0 else Hkv
            w = w.reshape(heads, dh, d).transpose(1, 2)  # [heads, d, dh]
            out.append(w if heads == H else w.repeat_interleave(H // heads, dim=0))
        return torch.stack(out)

    @property
    def W_Q(self) -> torch.Tensor:
        """[n_layers, n_heads, d_model, d_head] query weights (q = x @ W_Q per head)."""
        return self._qkv(0)

    @property
    def W_K(self) -> torch.Tensor:
        """[n_layers, n_heads, d_model, d_head] key weights (grouped KV heads repeated to every query head)."""
        return self._qkv(1)

    @property
    def W_V(self) -> torch.Tensor:
        """[n_layers, n_heads, d_model, d_head] value weights (grouped KV heads repeated)."""
        return self._qkv(2)

    @property
    def W_O(self) -> torch.Tensor:
        """[n_layers, n_heads, d_head, d_model] output weights (z @ W_O summed over heads)."""
        cfg = self.cfg
        return torch.stack([b.attn.W_O.weight.T.reshape(cfg.n_heads, cfg.d_head, cfg.d_model) for b in self.blocks])

    @property
    def W_in(self) -> torch.Tensor:
        """[n_layers, d_model, d_mlp] the MLP's input weights (SwiGLU: the value branch; ``W_gate`` the gate)."""
        return torch.stack([b.mlp.W_in.weight.T for b in self.blocks])

    @property
    def W_gate(self) -> torch.Tensor:
        """[n_layers, d_model, d_mlp] SwiGLU's gate weights (models with ``mlp="swiglu"``)."""
        if not hasattr(self.blocks[0].mlp, "W_gate"):
            raise AttributeError("W_gate: this model's MLP is GELU, it has no gate (W_in is its input)")
        return torch.stack([b.mlp.W_gate.weight.T for b in self.blocks])

    @property
    def W_out(self) -> torch.Tensor:
        """[n_layers, d_mlp, d_model] the MLP's output weights."""
        return torch.stack([b.mlp.W_out.weight.T for b in self.blocks])

    @property
    def b_U(self) -> torch.Tensor:
        """[d_vocab] the unembedding bias: zeros (the model has none)."""
        return torch.zeros(self.cfg.d_vocab, dtype=self.W_E.dtype, device=self.W_E.device)

    @property
    def QK(self) -> FactoredMatrix:
        """[n_layers, n_heads, d_model, d_model] ``W_Q @ W_K^T`` as TransformerLens's FactoredMatrix (before
        the q/k norms and rotary positions, which act between them when the model has them)."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """[n_layers, n_heads, d_model, d_model] ``W_V @ W_O`` as TransformerLens's FactoredMatrix."""
        return FactoredMatrix(self.W_V, self.W_O)
