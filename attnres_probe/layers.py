"""The parts every residual rule's model is built of: the norm, rotary positions, attention, the
MLPs and the depth reads (:class:`DepthRead`, :class:`CoefficientRead`, :class:`DepthMixer`).

:mod:`attnres_probe.model` assembles them into blocks and the model; the rule files of
:mod:`attnres_probe.rules` build their reads from them. Hook points carry their shapes as comments,
as TransformerLens does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import attnres_probe.kernels as kernels  # the top-level kernels/ folder (setup.py's folder map)
from attnres_probe.config import ModelConfig
from attnres_probe.hook_checks import CheckedHookPoint

__all__ = ["Attention", "CoefficientRead", "DepthMixer", "DepthRead", "GainlessRMSNorm", "GatedMLP", "MLP", "RMSNorm", "Rotary",
           "StaticMixer", "dtype_eps", "make_norm", "rms_norm_module"]


def dtype_eps(x: torch.Tensor) -> float:
    """torch's default RMSNorm eps for ``x`` (``F.rms_norm(eps=None)``): ``finfo(compute dtype).eps``,
    1.19e-7 for float32 and the half types (computed in float32), 2.2e-16 for float64."""
    return torch.finfo(kernels.compute_dtype(x)).eps


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32. ``eps`` None: :func:`dtype_eps` of
    each input (``cfg.eps_from_dtype``); :attr:`eps` then reads the gain's dtype."""

    def __init__(self, d: int, eps: float | None):
        super().__init__()
        self._eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    @property
    def eps(self) -> float:
        return self._eps if self._eps is not None else dtype_eps(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self._eps if self._eps is not None else dtype_eps(x))


class GainlessRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) with no learned gain: ``F.rms_norm(x, (d,), eps=eps)`` (``cfg.norm_gain=False``,
    LR-AttnRes's ``norm``). ``eps`` None is torch's default, :func:`dtype_eps`. No parameters; ``weight`` is a
    non-persistent buffer of ones (not in the state dict) so that what reads a norm's gain (the logit lens,
    ``apply_ln_to_stack``) reads 1, and :attr:`eps` is the eps of the model's dtype."""

    def __init__(self, d: int, eps: float | None):
        super().__init__()
        self.d, self._eps = d, eps
        self.register_buffer("weight", torch.ones(d, device="cpu"), persistent=False)  # CPU: real even in a meta-built model

    @property
    def eps(self) -> float:
        return self._eps if self._eps is not None else dtype_eps(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.d,), eps=self._eps)


def rms_norm_module(cfg: ModelConfig, d: int, eps: float) -> nn.Module:
    """An RMSNorm of width ``d`` as ``cfg`` says: with a gain (:class:`RMSNorm`) unless ``cfg.norm_gain`` is
    False (:class:`GainlessRMSNorm`), eps ``eps`` unless ``cfg.eps_from_dtype`` (then torch's default)."""
    e = None if cfg.eps_from_dtype else eps
    return RMSNorm(d, e) if cfg.norm_gain else GainlessRMSNorm(d, e)


class _Normalized:
    """``hook_normalized`` on a pre-norm or the final norm, as TransformerLens has it: the normalised input
    before the gain (and bias), [batch, pos, d_model]. Computed only while a hook is attached there (then
    ``gain * hooked + bias``); without one the norm is its own single op, bit for bit."""

    def _init_hook(self) -> None:
        self.hook_normalized = CheckedHookPoint()  # [batch, pos, d_model] before the gain (only when hooked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hp = self.hook_normalized
        if not (hp._forward_hooks or hp._backward_hooks):
            return super().forward(x)
        xf = x.to(kernels.compute_dtype(x))
        if isinstance(self, nn.LayerNorm):
            xf = xf - xf.mean(-1, keepdim=True)
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.hook_normalized(normed.to(x.dtype))
        weight = getattr(self, "weight", None)
        out = out if weight is None else out * weight
        bias = getattr(self, "bias", None)
        return out if bias is None else out + bias


class NormRMS(_Normalized, RMSNorm):
    def __init__(self, d: int, eps: float | None):
        super().__init__(d, eps)
        self._init_hook()


class NormGainless(_Normalized, GainlessRMSNorm):
    def __init__(self, d: int, eps: float | None):
        super().__init__(d, eps)
        self._init_hook()


class NormLayer(_Normalized, nn.LayerNorm):
    def __init__(self, d: int, eps: float, bias: bool):
        super().__init__(d, eps=eps, bias=bias)
        self._init_hook()


def make_norm(cfg: ModelConfig, d: int) -> nn.Module:
    """The model's pre-norms and final norm, each with TransformerLens's ``hook_normalized``: an RMSNorm
    (``cfg.norm="rms"``, eps ``cfg.norm_eps``; without a gain when ``cfg.norm_gain`` is False, torch's eps when
    ``cfg.eps_from_dtype``) or a LayerNorm with a gain and, with ``cfg.norm_bias``, a bias (``"layernorm"``)."""
    if cfg.norm == "layernorm":
        return NormLayer(d, cfg.norm_eps, cfg.norm_bias)
    eps = None if cfg.eps_from_dtype else cfg.norm_eps
    return NormRMS(d, eps) if cfg.norm_gain else NormGainless(d, eps)


class Rotary(nn.Module):
    """Rotary position embedding. ``layout="neox"`` (the default): GPT-NeoX's, the two halves of each
    head rotate together, as fla's ``RotaryEmbedding(interleaved=False)``; ``"interleaved"``: GPT-J's,
    dims (2i, 2i+1) form pair i (LR-AttnRes).

    By default the angles' cosines and sines are computed once in float64 and kept out of the
    module's buffers (so ``model.to(dtype)`` never rounds them): each forward takes them rounded
    once to its own dtype, so a float64 model rotates in float64 and a float32 one within an ulp of
    a float32 table. With ``stored=True`` the tables are persistent buffers ``cos`` and ``sin``
    [n_ctx, d_head / 2] that a checkpoint fills (``cfg.rope_stored_tables``): LR-AttnRes keeps its
    tables as buffers of its state dict, saved in bf16, and rotates with those rounded values, so
    matching its logits needs its tables, not exact ones (bf16 rounds them by up to 2^-9, far more
    than float32 rounding). Stored bf16 values are exact in float32 and float64, so ``model.to`` keeps them."""

    def __init__(self, d_head: int, n_ctx: int, theta: float, layout: str = "neox", stored: bool = False):
        super().__init__()
        self.layout, self.stored = layout, stored
        # on the CPU explicitly: a model built under torch.device("meta") (load_pretrained) still has its tables
        inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, dtype=torch.float64, device="cpu") / d_head))
        angles = torch.outer(torch.arange(n_ctx, dtype=torch.float64, device="cpu"), inv_freq)  # (n_ctx, d_head / 2)
        if stored:
            self.register_buffer("cos", angles.cos().float())
            self.register_buffer("sin", angles.sin().float())
        else:
            self._table = (angles.cos(), angles.sin())
        self._cast: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _cos_sin(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n_ctx, d_head / 2] in x's dtype (neox: each repeated over the two halves, [n_ctx, d_head])."""
        if self.stored:  # the buffers (a checkpoint's, on the model's device): cast per call, never cached
            cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
            return (cos.repeat(1, 2), sin.repeat(1, 2)) if self.layout == "neox" else (cos, sin)
        key = (x.device, x.dtype)
        if key not in self._cast:
            self._cast[key] = tuple(t.to(device=x.device, dtype=x.dtype) for t in self._table)
            if self.layout == "neox":
                self._cast[key] = tuple(t.repeat(1, 2) for t in self._cast[key])
        return self._cast[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, pos, head, d_head] rotated by its position."""
        P = x.shape[1]
        cos, sin = (t[:P][None, :, None, :] for t in self._cos_sin(x))  # (1, P, 1, d_head or d_head / 2)
        if self.layout == "interleaved":
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([cos * x1 - sin * x2, sin * x1 + cos * x2], dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal multi-head attention through ``F.scaled_dot_product_attention``.

    One projection ``W_QKV`` gives the queries (n_heads), keys and values (n_kv_heads each:
    grouped-query attention when fewer); optional per-head q/k RMSNorm and rotary positions.

    ``hook_attn_scores`` and ``hook_pattern`` follow TransformerLens: [batch, head, query_pos,
    key_pos], the scaled scores q.k/sqrt(d_head) (``-inf`` above the diagonal) and their softmax
    over key positions (0 there; float32 for half-precision inputs). They are computed only while
    a hook is attached to either (forward or backward); without one the forward is SDPA's and
    costs nothing more. With one, :meth:`explicit_attention` computes them:

    - hooks that only look (``run_with_cache``, a recorder) leave the output SDPA's, bit for bit
      the forward without hooks;
    - a hook that returns changed scores or a changed pattern (or changes them in place) is an
      intervention: the output is ``pattern @ v`` from what it returns;
    - a backward hook at either point (``run_with_cache(incl_bwd=True)``) needs the pattern in
      the graph: the output is ``pattern @ v``, equal to SDPA's within rounding (a test bounds it).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        inner, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
        self.W_QKV = nn.Linear(cfg.d_model, inner + 2 * kv, bias=cfg.qkv_bias or bool(cfg.bias))
        self.W_O = nn.Linear(inner, cfg.d_model, bias=bool(cfg.bias))
        if cfg.attn_gate:  # an output gate, z * sigmoid(W_G x) before W_O (x: the attention's normed input)
            self.W_G = nn.Linear(cfg.d_model, inner, bias=bool(cfg.bias))
        if cfg.qk_norm:
            self.q_norm = rms_norm_module(cfg, cfg.d_head, cfg.qk_norm_eps)
            self.k_norm = rms_norm_module(cfg, cfg.d_head, cfg.qk_norm_eps)
        self.rotary = (Rotary(cfg.d_head, cfg.n_ctx, cfg.rope_theta, cfg.rope_layout, cfg.rope_stored_tables)
                       if cfg.positional == "rope" else None)
        self.hook_q = CheckedHookPoint()  # [batch, pos, head, d_head] (after the q/k norm, before rotary)
        self.hook_k = CheckedHookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_v = CheckedHookPoint()  # [batch, pos, kv_head, d_head]
        self.hook_attn_scores = CheckedHookPoint()  # [batch, head, query_pos, key_pos] scaled q.k (-inf where masked; computed only when hooked)
        self.hook_pattern = CheckedHookPoint()  # [batch, head, query_pos, key_pos] softmax over key positions (0 where masked; only when hooked)
        self.hook_z = CheckedHookPoint()  # [batch, pos, head, d_head] attention output per head, before W_O

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, P, _ = x.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        q, k, v = self.W_QKV(x).split([H * dh, Hkv * dh, Hkv * dh], dim=-1)
        q, k, v = q.view(B, P, H, dh), k.view(B, P, Hkv, dh), v.view(B, P, Hkv, dh)  # (B, P, heads, dh)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, P, dh)
        z = self.explicit_attention(q, k, v, sdpa_unless_changed=True) if self.patterns_hooked else None
        if z is None:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
        z = self.hook_z(z.transpose(1, 2)).reshape(B, P, H * dh)  # hook: (B, P, H, dh)
        if hasattr(self, "W_G"):
            z = z * torch.sigmoid(self.W_G(x))
        return self.W_O(z)

    @property
    def patterns_hooked(self) -> bool:
        """Whether a hook (forward or backward) is attached to ``hook_attn_scores`` or ``hook_pattern``."""
        return any(bool(hp._forward_hooks or hp._backward_hooks) for hp in (self.hook_attn_scores, self.hook_pattern))

    def explicit_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa_unless_changed: bool = False
    ) -> torch.Tensor | None:
        """Causal attention computed step by step through ``hook_attn_scores`` and ``hook_pattern``.

        q [batch, head, pos, d_head], k and v [batch, kv_head, pos, d_head] (after rotary);
        returns z [batch, head, pos, d_head] from the pattern the hooks return. With
        ``sdpa_unless_changed`` it returns None instead when the hooks changed neither the scores
        nor the pattern and no backward hook is attached to either (the caller then uses SDPA).
        """
        B, H, P, dh = q.shape
        Hkv = k.shape[1]
        if Hkv != H:  # grouped-query attention: query head h reads kv head h // (H / Hkv), as SDPA's enable_gqa
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        dtype = kernels.compute_dtype(q)  # float32 (float64 for float64 inputs)
        causal = torch.full((P, P), float("-inf"), dtype=dtype, device=q.device).triu(1)  # 0 on and below the diagonal
        # scores = q.k / sqrt(d_head) + causal, in one op ([batch * head, query, key])
        scores = torch.baddbmm(causal.expand(B * H, P, P), q.to(dtype).flatten(0, 1), k.to(dtype).flatten(0, 1).transpose(1, 2),
                               alpha=1.0 / math.sqrt(dh)).view(B, H, P, P)
        version = scores._version
        scores_h = self.hook_attn_scores(scores)
        changed = scores_h is not scores or scores._version != version
        pattern = torch.softmax(scores_h, dim=-1)
        if changed:  # a hook's scores may mask a whole row: 0 there, not NaN
            pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
        version = pattern._version
        pattern_h = self.hook_pattern(pattern)
        changed = changed or pattern_h is not pattern or pattern._version != version
        graph = self.hook_attn_scores._backward_hooks or self.hook_pattern._backward_hooks
        if sdpa_unless_changed and not changed and not graph:
            return None  # the hooks only looked: the output stays SDPA's, bit for bit
        return torch.matmul(pattern_h.to(v.dtype), v)


class MLP(nn.Module):
    """d_model -> d_mlp -> GELU (exact, erf) -> d_model, with biases (unless ``cfg.bias`` is False)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = cfg.bias is not False
        self.W_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=bias)
        self.W_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=bias)
        self.hook_post = CheckedHookPoint()  # [batch, pos, d_mlp] after the GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.W_out(self.hook_post(F.gelu(self.W_in(x))))


class GatedMLP(nn.Module):
    """SwiGLU: ``W_out(silu(W_gate x) * W_in x)``, no biases (Llama's, fla's ``GatedMLP``) unless ``cfg.bias``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = bool(cfg.bias)
        self.W_gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=bias)
        self.W_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=bias)
        self.W_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=bias)
        self.hook_post = CheckedHookPoint()  # [batch, pos, d_mlp] after the gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.W_out(self.hook_post(F.silu(self.W_gate(x)) * self.W_in(x)))


class WeightSumWarning(UserWarning):
    """A hook returned softmax depth weights whose visible columns no longer sum to one: the read uses them as
    given (not renormalised). Patching and ablation, which do this on purpose, silence it."""


def _warn_unnormalised(name: str, w: torch.Tensor) -> None:
    """Warn once per call site when the weights a hook returned do not sum to one on the visible columns (the old
    idiom that found them with ``isnan``, before unavailable columns were 0, now drops the read's mass)."""
    with torch.no_grad():
        sums = w.detach().float().nan_to_num(0.0).sum(-1)
        lo, hi = float(sums.min()), float(sums.max())
    if not (abs(lo - 1) <= 1e-3 and abs(hi - 1) <= 1e-3):
        import warnings

        warnings.warn(f"a hook at {name} returned depth weights whose visible columns sum to {lo:.4g}..{hi:.4g}, not 1: "
                      "the read uses them as given (not renormalised). For a distribution divide by the row's sum; the "
                      "columns a read cannot see are 0 (not NaN)", WeightSumWarning, stacklevel=6)


class DepthRead(nn.Module):
    """What every read of a depth-mixing rule shows its hooks: the read's weights over the common
    source axis (``hook_weights``, [batch, pos, n_sources], 0 in the columns the read cannot see)
    and the contribution shares of the mixture (``hook_contrib``, computed only while a hook is
    attached there). :attr:`visible` is the number of columns the read sees (the first ``visible``).

    A hook that returns changed weights (or changes them in place) is an intervention: the read
    becomes ``sum_i w_i v_i`` over the visible columns, with the weights **as given** (not
    renormalised). Values written into unseen columns are ignored.
    """

    weights_sum_to_one = False  # softmax reads (DepthMixer): a hook's weights that do not sum to one are warned about

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_src = cfg.n_sources
        self.visible = self.n_src  # columns this read sees (the model sets it per read)
        self.hook_weights = CheckedHookPoint()  # [batch, pos, n_sources] depth weights (0 where unavailable)
        self.hook_contrib = CheckedHookPoint()  # [batch, pos, n_sources] contribution shares (0 where unavailable; computed only when hooked)

    @property
    def hooked(self) -> bool:
        """Whether a hook (forward or backward) is attached to this read's weights or shares."""
        return any(bool(hp._forward_hooks or hp._backward_hooks) for hp in (self.hook_weights, self.hook_contrib))

    def on_axis(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        """A read's [..., k] weights, logits or shares on the common source axis [..., n_src]:
        the columns past k hold ``fill`` (0; -inf for logits)."""
        return F.pad(t, (0, self.n_src - t.shape[-1]), value=fill)

    def observe_weights(
        self,
        sources: Sequence[torch.Tensor],
        mix: torch.Tensor,
        weights: torch.Tensor,
        contrib: torch.Tensor | None = None,
        changed: bool = False,
    ) -> torch.Tensor:
        """Show ``weights`` [batch, pos, n_src] to ``hook_weights``; return the mixture the read
        uses: ``mix`` unless a hook changed the weights (or ``changed``), then ``sum_i w_i v_i``
        over the k = len(sources) visible columns. Shares go to ``hook_contrib`` when it is hooked
        (``contrib``, if given and still valid, else computed here)."""
        k = len(sources)
        version = weights._version
        weights_h = self.hook_weights(weights)
        changed = changed or weights_h is not weights or weights._version != version
        if changed:
            w = weights_h[..., :k]
            if self.weights_sum_to_one:
                _warn_unnormalised(self.hook_weights.name, w)
            w = w.to(kernels.compute_dtype(sources[0], w))
            mix = kernels.weighted_sum(w, list(sources), w.dtype).to(mix.dtype)
            contrib = None  # shares computed before the intervention describe the old mixture
        if self.hook_contrib._forward_hooks:
            if contrib is None:
                contrib = self.on_axis(kernels.contribution_shares(sources, mix, weights_h[..., :k]), 0.0)
            self.hook_contrib(contrib)
        return mix


class CoefficientRead(DepthRead):
    """One read of a rule whose reads are linear in the sources with coefficients that are not a
    softmax (Hyper-Connections / mHC, DenseFormer): ``hook_weights`` shows the **coefficients**
    c_i of ``h = sum_i c_i v_i`` (docs/depth_rules.md: they need not be non-negative nor sum to
    one; PreNorm's would all be one). The model computes them only while a hook is attached to a
    read's weights or shares; the read itself is computed by the rule (streams, averages), and a
    hook that changes the weights rebuilds it from them (:meth:`DepthRead.observe_weights`).

    Hyper-Connections keep the sublayer's :class:`~attnres_probe.depth_rules.HyperConnection`
    here (``hc``); the final read and DenseFormer's reads have no parameters.
    """

    def __init__(self, cfg: ModelConfig, hc: nn.Module | None = None):
        super().__init__(cfg)
        if hc is not None:
            self.hc = hc

    def observe(self, sources: Sequence[torch.Tensor], mix: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        """``coefficients`` [batch, pos, n_src] (0 past the visible columns) to the hooks; the read."""
        return self.observe_weights(sources, mix, coefficients)


class DepthMixer(DepthRead):
    """One AttnRes read: softmax over depth sources scored by a learned pseudo-query.

    Parameters: ``query`` [d_model], zero-initialised (uniform weights at init), and
    ``norm.weight`` [d_model], the key RMSNorm gain (ones). The gain is folded into the query
    inside the op: ``(w * gain) . v / rms(v)``, ``rms(v) = sqrt(mean(v^2) + eps)`` with eps ``cfg.norm_eps``,
    or with ``cfg.eps_from_dtype`` torch's default for the sources' dtype (:meth:`key_eps`).

    Hooks, all [batch, pos, n_src] on the common source axis, masked as TransformerLens masks an
    attention pattern: ``hook_logits`` (the op's own logits; ``-inf`` in the columns this read
    cannot see), ``hook_weights`` and ``hook_contrib`` (0 there). :attr:`visible` is the number
    of columns the read sees (the first ``visible``); traces and charts show the unseen columns
    as NaN ("unavailable"), not 0.

    A hook that returns changed logits or weights is an intervention: the mixture is recomputed
    from them (changed logits are softmaxed first, over the visible columns). Weights a hook
    returns are used **as given**: the mixture is ``sum_i w_i v_i`` over the visible columns,
    not renormalised, so a hook that zeroes a source and wants a distribution divides by the
    row's sum itself (``w / w.sum(-1, keepdim=True)``: the masked zeros do not disturb it), and
    one that scales every weight by 2 doubles the read. Values a hook writes into unseen
    columns are ignored. ``hook_contrib`` shows each source's share of the mixture the read
    finally used, ``w_i <v_i, h> / |h|^2``; the op computes the shares only while a hook is
    attached there (an observation: its return value is ignored).
    """

    weights_sum_to_one = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.eps = cfg.norm_eps
        self.eps_from_dtype = cfg.eps_from_dtype
        self.query = nn.Parameter(torch.zeros(cfg.d_model))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # only .weight is used: the key gain
        self.hook_logits = CheckedHookPoint()  # [batch, pos, n_sources] depth scores (-inf where unavailable)
        # hook_weights: the softmax depth weights; hook_contrib: the shares (DepthRead)

    def reset_depth(self) -> None:
        """The initial depth parameters: a zero query (uniform weights)."""
        self.query.data.zero_()

    @property
    def folded_query(self) -> torch.Tensor:
        """query * gain, [d_model]."""
        return self.query * self.norm.weight

    def key_eps(self, source: torch.Tensor) -> float:
        """The keys' RMS eps for sources like ``source``: ``cfg.norm_eps``, or :func:`dtype_eps` with ``cfg.eps_from_dtype``."""
        return dtype_eps(source) if self.eps_from_dtype else self.eps

    def forward(
        self,
        sources: Sequence[torch.Tensor],
        inv_rms_cache: Sequence[torch.Tensor] | None = None,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Mix ``sources`` (k tensors [batch, pos, d], columns 0..k-1) into [batch, pos, d].

        ``inv_rms_cache``: each source's 1/rms, reused across reads by the reference backend.
        ``backend``: the backend the model resolved for this forward (None: resolve here).
        """
        want_contrib = bool(self.hook_contrib._forward_hooks)
        # a backend the model resolved for this forward (its sources match): its implementation, unchecked
        op = kernels.depth_attn if backend is None else kernels.implementation("depth_attn", backend)
        mix, lse, weights, logits, *contrib = op(
            sources,
            self.query,
            self.norm.weight,
            self.key_eps(sources[0]),
            return_weights=True,
            inv_rms_cache=inv_rms_cache,
            return_logits=True,
            return_contrib=want_contrib,
            width=self.n_src,  # rows of the common source axis, as the hooks show them
        )
        return self.observe(sources, mix, logits, weights, contrib[0] if contrib else None)

    def observe(
        self,
        sources: Sequence[torch.Tensor],
        mix: torch.Tensor,
        logits: torch.Tensor,
        weights: torch.Tensor,
        contrib: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Show the op's logits and weights to the hooks; recompute the mixture if they changed them.

        Args:
            sources: the k sources the op mixed.
            mix: [batch, pos, d] the op's mixture.
            logits: [batch, pos, n_src] the op's logits on the common source axis (-inf past k).
            weights: [batch, pos, n_src] the op's weights (0 past k).
            contrib: [batch, pos, n_src] the op's contribution shares, if it computed them
                (else they are computed here when ``hook_contrib`` has a hook).

        Returns:
            The mixture the read uses, [batch, pos, d].
        """
        k = len(sources)
        version = logits._version
        logits_h = self.hook_logits(logits)
        changed = logits_h is not logits or logits._version != version
        if changed:
            z = logits_h[..., :k]
            w = torch.softmax(z.to(kernels.compute_dtype(z)), dim=-1).to(weights.dtype)
            weights = self.on_axis(w, 0.0)
            contrib = None
        return self.observe_weights(sources, mix, weights, contrib, changed=changed)


class StaticMixer(DepthMixer):
    """A read whose depth weights are learned and the same for every input: ``softmax(logits[:k])`` over
    the k sources it sees (attnres4babylm's static-routing control of Block AttnRes). ``logits``
    [n_sources] is zero at init (uniform); the hooks are :class:`DepthMixer`'s (its logits and weights
    expanded over batch and positions), and so is the intervention rule."""

    def __init__(self, cfg: ModelConfig):
        DepthRead.__init__(self, cfg)
        self.logits = nn.Parameter(torch.zeros(cfg.n_sources))
        self.hook_logits = CheckedHookPoint()  # [batch, pos, n_sources] the static logits (-inf where unavailable)

    def reset_depth(self) -> None:
        self.logits.data.zero_()

    def forward(self, sources: Sequence[torch.Tensor], inv_rms_cache: Sequence[torch.Tensor] | None = None,
                backend: str | None = None) -> torch.Tensor:
        k = len(sources)
        B, P, _ = sources[0].shape
        dtype = kernels.compute_dtype(sources[0])
        z = self.logits[:k].to(dtype).expand(B, P, k)
        w = torch.softmax(z, dim=-1)
        mix = kernels.weighted_sum(w, list(sources), dtype).to(sources[0].dtype)
        return self.observe(sources, mix, self.on_axis(z, float("-inf")), self.on_axis(w, 0.0))
