"""AttnResTransformer: the PreNorm baseline, Full AttnRes and Block AttnRes as one hooked model.

Modules appear in the order data meets them: norm, attention, MLP, depth mixer, block, model.
Every component except the residual rule is identical across the three modes, and the depth
mixers' parameters are deterministic (zeros and ones), so the same seed gives the same other
weights in all three (DESIGN.md, "The math").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.hook_points import HookPoint

from attnres_probe import kernels
from attnres_probe.config import ModelConfig

__all__ = ["AttnResTransformer", "Attention", "DepthMixer", "MLP", "RMSNorm", "TransformerBlock"]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.reference.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Causal multi-head attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        inner = cfg.n_heads * cfg.d_head
        self.W_QKV = nn.Linear(cfg.d_model, 3 * inner, bias=False)
        self.W_O = nn.Linear(inner, cfg.d_model, bias=False)
        self.hook_q = HookPoint()  # [batch, pos, head, d_head]
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_z = HookPoint()  # attention output per head, before W_O

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, P, _ = x.shape
        q, k, v = self.W_QKV(x).view(B, P, 3, self.n_heads, self.d_head).unbind(2)  # 3 x (B, P, H, dh)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        z = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        z = self.hook_z(z.transpose(1, 2))  # (B, P, H, dh)
        return self.W_O(z.reshape(B, P, self.n_heads * self.d_head))


class MLP(nn.Module):
    """d_model -> d_mlp -> GELU -> d_model."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.W_in = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.W_out = nn.Linear(cfg.d_mlp, cfg.d_model)
        self.hook_post = HookPoint()  # [batch, pos, d_mlp] after the GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.W_out(self.hook_post(F.gelu(self.W_in(x))))


class DepthMixer(nn.Module):
    """One AttnRes read: softmax over depth sources scored by a learned pseudo-query.

    Parameters: ``query`` [d_model], zero-initialised (uniform weights at init), and
    ``norm.weight`` [d_model], the key RMSNorm gain (ones). The gain is folded into the query
    inside the op: ``(w * gain) . v / rms(v)``.

    Hooks, all [batch, pos, n_src] on the common source axis: ``hook_logits`` (``-inf`` in
    unavailable columns), ``hook_weights`` and ``hook_contrib`` (NaN in unavailable columns).
    A hook that returns changed logits or weights is an intervention: the mixture is
    recomputed from them (changed logits are softmaxed first). ``hook_contrib`` shows each
    source's share of the mixture the read finally used, ``w_i <v_i, h> / |h|^2`` (computed
    only while a hook is attached; it is an observation, its return value is ignored).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.n_src = cfg.n_sources
        self.query = nn.Parameter(torch.zeros(cfg.d_model))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # only .weight is used: the key gain
        self.hook_logits = HookPoint()
        self.hook_weights = HookPoint()
        self.hook_contrib = HookPoint()

    @property
    def folded_query(self) -> torch.Tensor:
        """query * gain, [d_model]."""
        return self.query * self.norm.weight

    def fused(self, sources: Sequence[torch.Tensor], partial: torch.Tensor, out: torch.Tensor, slots=None, norm=None):
        """Block AttnRes on the Numba backend: (mixture over ``[*sources, partial + out]``,
        ``partial + out``), the partial-block sum formed by the read's kernel as it reads it.
        The model uses it only while nothing watches it (see
        :meth:`AttnResTransformer.unwatched`); ``slots`` and ``norm`` as for :meth:`forward`."""
        from attnres_probe.kernels.numba_depth_attn import fused_mixture  # Numba loads on first use

        return fused_mixture(sources, partial, out, self.query, self.norm.weight, self.eps, slots, _norm_args(norm))

    @property
    def hooked(self) -> bool:
        """Whether any forward hook is attached to this mixer's logits, weights or shares."""
        return bool(self.hook_logits._forward_hooks or self.hook_weights._forward_hooks or self.hook_contrib._forward_hooks)

    def forward(
        self,
        sources: Sequence[torch.Tensor],
        inv_rms_cache: Sequence[torch.Tensor] | None = None,
        backend: str | None = None,
        slots: Sequence | None = None,
        norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Mix ``sources`` (k tensors [batch, pos, d], columns 0..k-1) into [batch, pos, d].

        ``slots``: the model's gradient slots for an unhooked read on the Numba backend (see
        :class:`~attnres_probe.kernels.numba_depth_attn.GradSlot`); ignored otherwise.
        ``norm``: the next sublayer's pre-norm, returned applied to the mixture (``norm(h)``);
        an unhooked read on the Numba backend applies an RMSNorm's gain and eps in its kernel
        (when the gain is a [d] tensor of the sources' dtype; else PyTorch ops apply it after).
        """
        hooked = self.hooked
        if backend == "numba" and not hooked:  # the model resolved the backend: the op directly
            from attnres_probe.kernels.numba_depth_attn import mixture  # Numba loads on first use

            return mixture(sources, self.query, self.norm.weight, self.eps, slots, _norm_args(norm))
        if norm is not None:
            return norm(self.forward(sources, inv_rms_cache, backend))  # (not self(): hooks fire once)
        want_contrib = bool(self.hook_contrib._forward_hooks)
        out = kernels.depth_attn(
            sources,
            self.query,
            self.norm.weight,
            self.eps,
            return_weights=hooked,
            inv_rms_cache=inv_rms_cache,
            backend=backend,
            trusted=backend is not None,  # the model resolved the backend; its sources match
            return_contrib=want_contrib,
        )
        if not hooked:
            return out[0]
        return self.apply_hooks(sources, *out)

    def apply_hooks(
        self,
        sources: Sequence[torch.Tensor],
        mix: torch.Tensor,
        lse: torch.Tensor,
        weights: torch.Tensor,
        contrib: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Show the op's logits and weights to the hooks; recompute the mixture if they changed them.

        Args:
            sources: the k sources the op mixed.
            mix: [batch, pos, d] the op's mixture.
            lse: [batch, pos] the op's log-sum-exp.
            weights: [batch, pos, k] the op's weights.
            contrib: [batch, pos, k] the op's contribution shares, if it computed them
                (else they are computed here when ``hook_contrib`` has a hook).
        """
        k = len(sources)
        logits = torch.log(weights) + lse.unsqueeze(-1)  # the op's own logits, rebuilt from (weights, lse)
        pad = self.n_src - k
        logits_p = F.pad(logits, (0, pad), value=float("-inf"))
        version = logits_p._version
        logits_h = self.hook_logits(logits_p)
        changed = logits_h is not logits_p or logits_p._version != version
        if changed:
            weights = torch.softmax(logits_h[..., :k].float(), dim=-1).to(weights.dtype)
        weights_p = F.pad(weights, (0, pad), value=float("nan"))
        version = weights_p._version
        weights_h = self.hook_weights(weights_p)
        if weights_h is not weights_p or weights_p._version != version:
            weights, changed = weights_h[..., :k], True
        if changed:
            w = weights.to(kernels.reference.compute_dtype(sources[0], weights))
            mix = kernels.reference.weighted_sum(w, list(sources), w.dtype).to(mix.dtype)
            contrib = None  # the op's shares describe the mixture before the intervention
        if self.hook_contrib._forward_hooks:
            if contrib is None:
                contrib = kernels.contribution_shares(sources, mix, weights)
            self.hook_contrib(F.pad(contrib, (0, pad), value=float("nan")))
        return mix


def _norm_args(norm: RMSNorm | None) -> tuple[torch.Tensor, float] | None:
    return None if norm is None else (norm.weight, norm.eps)


class TransformerBlock(nn.Module):
    """Attention then MLP, each reading a mixed input through pre-norm.

    Hooks: ``hook_resid_pre`` (mixed input to attention), ``hook_attn_out``, ``hook_resid_mid``
    (mixed input to the MLP), ``hook_mlp_out``; AttnRes modes add ``attn_res`` and ``mlp_res``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        if cfg.residual != "prenorm":
            self.attn_res = DepthMixer(cfg)
            self.mlp_res = DepthMixer(cfg)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()

    def sublayer(self, which: int, h: torch.Tensor) -> torch.Tensor:
        """Run sublayer ``which`` (0 = attention, 1 = MLP) on the mixed input h; return its output."""
        if which == 0:
            return self.hook_attn_out(self.attn(self.ln1(self.hook_resid_pre(h))))
        return self.hook_mlp_out(self.mlp(self.ln2(self.hook_resid_mid(h))))

    def normed_sublayer(self, which: int, x: torch.Tensor) -> torch.Tensor:
        """Sublayer ``which`` on an input already pre-normed (``ln(which)`` applied): the
        model's fused path, taken only while nothing watches it, so no hook point is called."""
        return self.attn(x) if which == 0 else self.mlp(x)

    def ln(self, which: int) -> RMSNorm:
        return self.ln1 if which == 0 else self.ln2

    def mixer(self, which: int) -> DepthMixer:
        return self.attn_res if which == 0 else self.mlp_res


# What the Numba fast paths stand in for (see AttnResTransformer._fusable): they apply the
# pre-norms in the kernels, skip the hook points between a read and its sublayer, call the
# blocks' sublayers and mixers in their own way, and assume that every read's output reaches
# the loss. They run only while the module tree has the classes it was built with and none of
# these methods is replaced, on its class or on an instance.
_STOOD_IN = {
    RMSNorm: ("forward",),
    Attention: ("forward",),
    MLP: ("forward",),
    DepthMixer: ("forward", "fused"),
    TransformerBlock: ("sublayer", "normed_sublayer", "ln", "mixer"),
    HookPoint: ("forward",),
    nn.Linear: ("forward",),
}
_ORIGINAL = {(cls, name): cls.__dict__[name] for cls, names in _STOOD_IN.items() for name in names}
_OTHER = ("forward",)  # what is checked on an instance of any other class


def _global_hooks() -> bool:
    """Whether any global module hook is registered (``torch.nn.modules.module.register_module_*_hook``)."""
    from torch.nn.modules import module as nn_module

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")
    return any(getattr(nn_module, name, None) for name in names)


def _classes_intact() -> bool:
    """Whether every method in ``_STOOD_IN`` is still the one defined on its class."""
    return all(cls.__dict__.get(name) is f for (cls, name), f in _ORIGINAL.items())


def _sinusoidal(n_ctx: int, d: int) -> torch.Tensor:
    pos = torch.arange(n_ctx, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n_ctx, d)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)
    return pe


class _Slots:
    """Gradient slots of a forward's shared sources (Full: every source; Block: completed
    blocks), for the Numba reads of a model nothing watches, while autograd records. A
    source's first reader owns its slot (see
    :class:`~attnres_probe.kernels.numba_depth_attn.GradSlot`).
    """

    def __init__(self, on: bool):
        self.on = on
        self.shared: list = []  # per source already read: (its GradSlot, False)

    def entries(self, n: int, last: bool | None = None) -> list | None:
        """Entries for a read of the first ``n`` shared sources, then, unless ``last`` is
        None, one more source: not shared (False) or becoming shared with this read (True)."""
        if not self.on:
            return None
        out = self.shared[:n]
        for _ in range(len(self.shared), n + int(bool(last))):  # read for the first time: this read owns them
            from attnres_probe.kernels.numba_depth_attn import GradSlot

            slot = GradSlot()
            out.append((slot, True))
            self.shared.append((slot, False))
        if last is False:
            out.append(None)
        return out


class AttnResTransformer(HookedRootModule):
    """A byte-level transformer whose residual rule is PreNorm, Full AttnRes or Block AttnRes.

    ``forward(tokens) -> logits [batch, pos, d_vocab]``. Hook points follow DESIGN.md; read
    and source labels are :attr:`read_labels` and :attr:`source_labels`.

    Args:
        cfg: the model's :class:`ModelConfig` (validated).
        backend: depth-attention backend, ``"auto"`` | ``"torch"`` | ``"triton"`` |
            ``"numba"``; None defers to ``ATTNRES_BACKEND`` (see :mod:`attnres_probe.kernels`).
            A PreNorm model has no depth attention: on the Numba backend (``auto`` on the
            CPU) it applies each residual add and the next pre-norm in one kernel.
        schedule: Block AttnRes only: ``"sequential"`` or ``"two_phase"``; None picks
            two-phase when the Triton backend is in use, sequential otherwise. Both are exact.
    """

    def __init__(self, cfg: ModelConfig, backend: str | None = None, schedule: str | None = None):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig; got {type(cfg).__name__}")
        cfg.validate()
        self.cfg = cfg
        self.backend = backend
        self.schedule = schedule
        d = cfg.d_model
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, d))
        if cfg.positional == "learned":
            self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, d))
        else:
            self.register_buffer("W_pos", _sinusoidal(cfg.n_ctx, d), persistent=False)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        if cfg.residual != "prenorm":
            self.out_res = DepthMixer(cfg)
        self.hook_resid_final = HookPoint()  # the final mixed input, before ln_final
        self.ln_final = RMSNorm(d, cfg.norm_eps)
        self.W_U = nn.Parameter(torch.empty(d, cfg.d_vocab))
        self.init_weights()
        self.setup()
        self._built = self._scan()[2]  # the module tree's classes, for _fusable

    # -- construction --------------------------------------------------------------------
    def init_weights(self) -> None:
        """Seeded initialisation of everything but the norms and depth mixers (ones / zeros)."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        with torch.no_grad():
            nn.init.normal_(self.W_E, 0.0, cfg.embed_std, generator=g)
            if cfg.positional == "learned":
                nn.init.normal_(self.W_pos, 0.0, cfg.embed_std, generator=g)
            for block in self.blocks:
                nn.init.normal_(block.attn.W_QKV.weight, 0.0, std, generator=g)
                nn.init.normal_(block.attn.W_O.weight, 0.0, out_std, generator=g)
                nn.init.normal_(block.mlp.W_in.weight, 0.0, std, generator=g)
                nn.init.zeros_(block.mlp.W_in.bias)
                nn.init.normal_(block.mlp.W_out.weight, 0.0, out_std, generator=g)
                nn.init.zeros_(block.mlp.W_out.bias)
            nn.init.normal_(self.W_U, 0.0, std, generator=g)
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)
                if isinstance(m, DepthMixer):
                    m.query.zero_()

    # -- labels and bookkeeping ----------------------------------------------------------
    @property
    def residual(self) -> str:
        return self.cfg.residual

    @property
    def sublayer_labels(self) -> list[str]:
        """["L0.attn", "L0.mlp", "L1.attn", ...] (L entries)."""
        return [f"L{i}.{kind}" for i in range(self.cfg.n_layers) for kind in ("attn", "mlp")]

    @property
    def read_labels(self) -> list[str]:
        """Rows of every trace: one read per sublayer, then "final" (L+1 entries)."""
        return [*self.sublayer_labels, "final"]

    @property
    def source_labels(self) -> list[str]:
        """Columns of the common source axis: ["embed", "L0.attn", ...] or ["embed", "block1", ...]."""
        if self.cfg.residual == "block":
            return ["embed", *(f"block{n}" for n in range(1, self.cfg.n_blocks + 1))]
        return ["embed", *self.sublayer_labels]

    @property
    def block_starts(self) -> list[int]:
        """Sublayer index where each block starts (block mode), else []."""
        return self.cfg.block_starts

    def block_of(self, sublayer: int) -> int:
        """1-based block that sublayer ``sublayer`` writes into (block mode)."""
        starts = self.cfg.block_starts
        return max(n for n, s in enumerate(starts, start=1) if s <= sublayer)

    def source_members(self, read: int) -> list[tuple[str, ...]]:
        """What each source visible to ``read`` is made of, in column order.

        Each entry is the tuple of labels summed into that source: ``("embed",)`` for the
        embedding, ``("L0.attn",)`` for a Full source, the sublayers of a completed block or
        of the current partial block for Block AttnRes, and every earlier source for PreNorm
        (whose single mixed input is the sum of all of them, listed as separate sources).
        """
        L = self.cfg.n_sublayers
        if not 0 <= read <= L:
            raise IndexError(f"read {read} is out of range; this model has reads 0..{L} ({L} sublayers + final)")
        subs = self.sublayer_labels
        if self.cfg.residual != "block":
            return [("embed",), *((s,) for s in subs[:read])]
        starts = [*self.cfg.block_starts, L]
        out: list[tuple[str, ...]] = [("embed",)]
        for a, b in zip(starts, starts[1:]):
            if b <= read:
                out.append(tuple(subs[a:b]))  # completed block
            elif a < read:
                out.append(tuple(subs[a:read]))  # current partial block
        return out

    def source_columns(self, read: int) -> list[int]:
        """Common-axis column of each source visible to ``read``."""
        return list(range(len(self.source_members(read))))

    @property
    def mixers(self) -> list[DepthMixer]:
        """The L+1 depth mixers in read order (empty for PreNorm)."""
        if self.cfg.residual == "prenorm":
            return []
        return [*(b.mixer(w) for b in self.blocks for w in (0, 1)), self.out_res]

    @property
    def device(self) -> torch.device:
        return self.W_E.device

    # -- input handling ------------------------------------------------------------------
    def to_tokens(self, text: str, truncate: bool = False) -> torch.Tensor:
        """Byte tokens [1, pos] on the model's device, checked against the context length."""
        from attnres_probe.tokenizer import ByteTokenizer

        tokens = ByteTokenizer().to_tokens(text)
        return self.check_tokens(tokens, truncate=truncate)

    def check_tokens(self, tokens: Any, truncate: bool = False) -> torch.Tensor:
        """Validate tokens ([pos] or [batch, pos] integer ids, or a str) and return [batch, pos] on device."""
        from attnres_probe.tokenizer import check_token_ids

        if isinstance(tokens, str):
            return self.to_tokens(tokens, truncate=truncate)
        return check_token_ids(tokens, self.cfg.n_ctx, self.cfg.d_vocab, truncate).to(self.device)

    # -- forward -------------------------------------------------------------------------
    def unwatched(self) -> bool:
        """Whether nothing watches this model: no forward, pre-forward or backward hook on any of
        its modules (hook points included) and no global module hook.

        Only then does a forward on the Numba backend take its fast paths (each pre-norm applied
        in the kernel of the read, or PreNorm's residual add, that forms its input; Block
        AttnRes's fused partial sums; gradients summed in the kernels): they skip the hook
        points between those ops, and they assume the graph is the model's own, every read's
        output reaching the loss, which a hook that replaces an activation (patching,
        ablation) can undo. A watched model runs the ordinary reads and norm modules.
        """
        return not (_global_hooks() or self._scan()[0])

    def _resolve(self, v0: torch.Tensor) -> tuple[str, str]:
        backend = kernels.resolve_backend(v0.device, self.backend, dtypes=(v0.dtype,), d=self.cfg.d_model)
        schedule = self.schedule
        if schedule is None:
            schedule = "two_phase" if backend == "triton" else "sequential"
        if schedule not in ("sequential", "two_phase"):
            raise ValueError(f"schedule is {schedule!r}; accepted values are 'sequential', 'two_phase'")
        return backend, schedule

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Source 0: token embedding + position embedding, [batch, pos, d_model]."""
        tok = self.hook_embed(self.W_E[tokens])
        pos = self.hook_pos_embed(self.W_pos[: tokens.shape[1]].unsqueeze(0).expand(tokens.shape[0], -1, -1))
        return tok + pos

    def forward(self, tokens: Any, truncate: bool = False) -> torch.Tensor:
        """Logits [batch, pos, d_vocab] for tokens [batch, pos] (or [pos], or a str)."""
        tokens = self.check_tokens(tokens, truncate=truncate)
        v0 = self.embed(tokens)
        mode = self.cfg.residual
        # Numba backend, nothing watching, the model's own norms: each sublayer's pre-norm (and
        # ln_final) is applied by the op that forms its input, a read or PreNorm's residual add.
        if mode == "prenorm":
            x = self._forward_prenorm(v0, self._prenorm_numba(v0) and self._fusable())
        else:
            backend, schedule = self._resolve(v0)
            fast = backend == "numba" and self._fusable()
            if mode == "full":
                x = self._forward_full(v0, backend, fast)
            else:
                x = self._forward_block(v0, backend, schedule, fast)
        return x @ self.W_U

    def _prenorm_numba(self, v0: torch.Tensor) -> bool:
        """Whether a PreNorm forward uses the Numba add-norm kernel. PreNorm has no depth
        attention, so only a request for ``auto`` or ``numba`` on CPU tensors counts; any
        other backend runs its norms as modules (as that backend would)."""
        backend, _ = kernels.requested_backend(self.backend)
        if backend not in ("auto", "numba") or v0.device.type != "cpu":
            return False
        return kernels.resolve_backend(v0.device, backend, dtypes=(v0.dtype,), d=self.cfg.d_model) == "numba"

    # the model's own methods the fast paths rely on (a subclass that overrides one runs the ordinary path)
    _FAST_METHODS = ("forward", "embed", "_forward_prenorm", "_forward_full", "_forward_block", "_final", "_next_norm", "_sublayers")

    def _scan(self) -> tuple[bool, bool, tuple]:
        """One walk of the module tree as it is now (a module assigned after setup() included):
        (any module hooked, any method the fast paths stand in for replaced on an instance, the
        modules' classes in walk order, None for a removed module)."""
        hooked = replaced = False
        types, stack = [], [self]
        while stack:
            m = stack.pop()
            types.append(type(m))
            if m is None:
                continue
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                hooked = True
            d = m.__dict__
            for n in self._FAST_METHODS if m is self else _STOOD_IN.get(type(m), _OTHER):
                if n in d:
                    replaced = True
            stack.extend(m._modules.values())
        return hooked, replaced, tuple(types)

    def _fusable(self) -> bool:
        """Whether the fast paths may run: nothing watches the model (:meth:`unwatched`) and it is
        still the model it was built as: every module of the class it was built with, none of
        the methods the fast paths stand in for replaced on a class or an instance, no method
        the forward relies on overridden by a subclass. Anything else (a module swapped in, a
        patched ``forward``) runs the ordinary path, which calls every module as it is."""
        if _global_hooks() or not _classes_intact():
            return False
        cls = type(self)
        if cls is not AttnResTransformer and any(
            getattr(cls, n) is not getattr(AttnResTransformer, n) for n in self._FAST_METHODS
        ):
            return False
        hooked, replaced, types = self._scan()
        return not (hooked or replaced) and types == getattr(self, "_built", None)

    def _final(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_final(self.hook_resid_final(h))

    def _sublayers(self):
        for i, block in enumerate(self.blocks):
            yield 2 * i, block, 0
            yield 2 * i + 1, block, 1

    def _next_norm(self, l: int) -> RMSNorm:
        """The pre-norm of sublayer l (ln_final after the last)."""
        return self.ln_final if l == self.cfg.n_sublayers else self.blocks[l // 2].ln(l % 2)

    def _forward_prenorm(self, v0: torch.Tensor, fast: bool) -> torch.Tensor:
        if fast:
            from attnres_probe.kernels.numba_depth_attn import add_rms_norm  # Numba loads on first use

            resid, ln = v0, self._next_norm(0)
            x = add_rms_norm(v0, None, ln.weight, ln.eps)
            for l, block, which in self._sublayers():
                ln = self._next_norm(l + 1)
                resid, x = add_rms_norm(resid, block.normed_sublayer(which, x), ln.weight, ln.eps)
            return x
        resid = v0
        for _, block, which in self._sublayers():
            resid = resid + block.sublayer(which, resid)
        return self._final(resid)

    def _forward_full(self, v0: torch.Tensor, backend: str, fast: bool) -> torch.Tensor:
        eps = self.cfg.norm_eps
        cache = backend == "torch"  # the reference reuses each source's 1/rms across reads
        cdt = kernels.reference.compute_dtype(v0)
        sources = [v0]
        inv = [kernels.inv_rms(v0, eps, cdt)] if cache else None
        slots = _Slots(fast and torch.is_grad_enabled())
        for l, block, which in self._sublayers():
            mixer = block.mixer(which)
            if fast:
                x = mixer(sources, None, backend, slots.entries(len(sources)), norm=self._next_norm(l))
                out = block.normed_sublayer(which, x)
            else:
                out = block.sublayer(which, mixer(sources, inv, backend))
            sources.append(out)
            if cache:
                inv.append(kernels.inv_rms(out, eps, cdt))
        if fast:
            return self.out_res(sources, None, backend, slots.entries(len(sources)), norm=self.ln_final)
        return self._final(self.out_res(sources, inv, backend))

    def _forward_block(self, v0: torch.Tensor, backend: str, schedule: str, fast: bool) -> torch.Tensor:
        eps = self.cfg.norm_eps
        cache = backend == "torch"
        cdt = kernels.reference.compute_dtype(v0)
        starts = set(self.cfg.block_starts)
        blocks = [v0]
        inv = [kernels.inv_rms(v0, eps, cdt)] if cache else None
        partial: torch.Tensor | None = None
        # The fast path (sequential schedule): the partial-block sum partial + out is left to
        # the next read, whose kernel forms it as it reads it (one op instead of an add and a
        # read), the completed blocks' gradients are summed in the kernels (slots), and each
        # read returns its sublayer's pre-normed input.
        fast = fast and schedule == "sequential"
        pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (partial, out), not yet added
        phase: dict[int, tuple] = {}  # two-phase: read -> (o_bar, lse, weights or None)
        slots = _Slots(fast and torch.is_grad_enabled())
        for l, block, which in self._sublayers():
            mixer = block.mixer(which)
            norm = self._next_norm(l) if fast else None
            complete = l in starts and l > 0  # the previous block is complete
            if pending is not None:
                # the sum becomes a completed block when this read starts a new block
                h, partial = mixer.fused(blocks, *pending, slots.entries(len(blocks), last=complete), norm=norm)
                pending = None
                if complete:
                    blocks.append(partial)
                    partial = None
            else:
                if complete:
                    blocks.append(partial)
                    if cache:
                        inv.append(kernels.inv_rms(partial, eps, cdt))
                    partial = None
                if schedule == "sequential":
                    if partial is None:
                        h = mixer(blocks, inv, backend, slots.entries(len(blocks)), norm=norm)
                    else:
                        p_inv = [kernels.inv_rms(partial, eps, cdt)] if cache else None
                        h = mixer(
                            [*blocks, partial], inv + p_inv if cache else None, backend,
                            slots.entries(len(blocks), last=False), norm=norm,
                        )
                else:
                    if l in starts:
                        phase = self._phase1(l, blocks, inv, backend)
                    h = self._phase2(mixer, phase[l], blocks, partial, backend)
            out = block.normed_sublayer(which, h) if fast else block.sublayer(which, h)
            if partial is None:
                partial = out
            elif fast:
                partial, pending = None, (partial, out)
            else:
                partial = partial + out
        if pending is not None:
            return self.out_res.fused(blocks, *pending, slots.entries(len(blocks), last=False), norm=self.ln_final)[0]
        blocks.append(partial)
        if cache:
            inv.append(kernels.inv_rms(partial, eps, cdt))
        if fast:
            return self.out_res(blocks, inv, backend, slots.entries(len(blocks)), norm=self.ln_final)
        return self._final(self.out_res(blocks, inv, backend))

    def _phase1(self, start: int, blocks, inv, backend) -> dict[int, tuple]:
        """Two-phase schedule, phase 1: every read of the block starting at ``start`` at once."""
        L = self.cfg.n_sublayers
        later = [s for s in self.cfg.block_starts if s > start]
        reads = list(range(start, later[0] if later else L))
        mixers = [self.mixers[r] for r in reads]
        queries = torch.stack([m.folded_query for m in mixers])  # (Q, d)
        want_w = any(m.hooked for m in mixers)
        res = kernels.phase1(
            blocks, queries, self.cfg.norm_eps, return_weights=want_w, inv_rms_cache=inv, backend=backend
        )
        o_bar, lse = res[0], res[1]
        w = res[2] if want_w else None
        return {r: (o_bar[q], lse[q], None if w is None else w[q]) for q, r in enumerate(reads)}

    def _phase2(self, mixer: DepthMixer, ph: tuple, blocks, partial, backend) -> torch.Tensor:
        """Two-phase schedule, phase 2: merge the read's phase-1 result with the partial block."""
        o_bar, lse, w = ph
        if partial is None:  # first read of a block: nothing to merge
            h, lse_t = o_bar, lse
            if mixer.hooked:
                return mixer.apply_hooks(blocks, h, lse_t, w)
            return h
        h, lse_t, s = kernels.phase2(
            o_bar, lse, partial, mixer.query, mixer.norm.weight, self.cfg.norm_eps, backend=backend
        )
        if mixer.hooked:
            # weights of the merged softmax: completed blocks (1 - s) * w_i, the partial s
            weights = torch.cat([w * (1 - s).unsqueeze(-1), s.unsqueeze(-1)], dim=-1)
            return mixer.apply_hooks([*blocks, partial], h, lse_t, weights)
        return h

    # -- conveniences --------------------------------------------------------------------
    def loss(self, tokens: Any, per_token: bool = False) -> torch.Tensor:
        """Next-token cross-entropy: mean, or [batch, pos-1] with ``per_token=True``."""
        tokens = self.check_tokens(tokens)
        if tokens.shape[1] < 2:
            raise ValueError("the loss needs at least two tokens (it predicts token t+1 from tokens <= t)")
        logits = self(tokens)
        lp = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
        lp = lp.view(tokens.shape[0], -1)
        return lp if per_token else lp.mean()

    def run_with_cache(self, *model_args: Any, return_cache_object: bool = True, **kwargs: Any):
        """``(logits, cache)``; the cache is an :class:`ActivationCache` unless ``return_cache_object=False``."""
        out, cache = super().run_with_cache(*model_args, **kwargs)
        if return_cache_object and not isinstance(cache, ActivationCache):
            cache = ActivationCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))
        return out, cache

    def n_params(self, include_mixers: bool = True) -> int:
        """Number of parameters (optionally without the depth mixers')."""
        return sum(
            p.numel() for n, p in self.named_parameters() if include_mixers or not ("_res." in n or n.startswith("out_res"))
        )

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` + ``model.safetensors`` into ``directory`` (atomically per file)."""
        from attnres_probe.checkpoint import save_checkpoint

        return save_checkpoint(self, directory, dtype=dtype)

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu", **kwargs: Any) -> AttnResTransformer:
        """Load a checkpoint written by :meth:`save`; validates config against tensors."""
        from attnres_probe.checkpoint import load_checkpoint

        return load_checkpoint(directory, device=device, **kwargs)

    def extra_repr(self) -> str:
        c = self.cfg
        extra = f", blocks={c.block_starts}" if c.residual == "block" else ""
        return f"residual={c.residual!r}, n_layers={c.n_layers}, d_model={c.d_model}{extra}"
