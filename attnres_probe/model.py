"""AttnResTransformer: the PreNorm baseline, Full and Block AttnRes, Hyper-Connections / mHC and
DenseFormer as one hooked model.

Modules are defined bottom-up: norm, attention, MLP, depth reads, block, model.
Every component except the residual rule is identical across the rules, and the rules'
parameters are deterministic (zeros, ones, one-hots), so the same seed gives the same other
weights in all of them (docs/design.md, "The math").

There is one forward per residual rule (PreNorm, Full, Block sequential, Block two-phase,
Hyper-Connections, DenseFormer),
and it always runs through the hook points and the norm modules: the forward a trace records
is the forward that trains. Speed comes from the depth-attention kernels
(:mod:`attnres_probe.kernels`), never from a second path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.hook_points import HookPoint

import attnres_probe.kernels as kernels  # the top-level kernels/ folder (setup.py's folder map)
from attnres_probe import generation, text_api
from attnres_probe.activation_cache import AttnResCache, accumulated_bias, residual_directions
from attnres_probe.axis import SourceAxis
from attnres_probe.checkpoint_store import load_checkpoint_as, save_checkpoint
from attnres_probe.config import ModelConfig
from attnres_probe.depth_rules import DepthWeightedAverage, HyperConnection, expand_streams, reduce_streams
from attnres_probe.hook_checks import CheckedHookPoint, warn_if_non_finite
from attnres_probe.layers import MLP, Attention, CoefficientRead, DepthMixer, DepthRead, GatedMLP, RMSNorm, Rotary, StaticMixer, dtype_eps, make_norm
from attnres_probe.losses import next_token_loss
from attnres_probe.rules import implementation
from attnres_probe.tl_weights import TLWeights

__all__ = [
    "AttnResCache",
    "AttnResTransformer",
    "Attention",
    "DepthMixer",
    "GatedMLP",
    "MLP",
    "RMSNorm",
    "Rotary",
    "TransformerBlock",
]

ReturnType = Literal["logits", "loss", "both", None]
RETURN_TYPES = ("logits", "loss", "both", None)


def hyper_connection(cfg: ModelConfig, sublayer: int) -> HyperConnection:
    """The Hyper-Connection (HC or mHC, as ``cfg`` says) that wraps sublayer ``sublayer``."""
    return HyperConnection(cfg.d_model, cfg.n_streams, sublayer, dynamic=cfg.hc_dynamic, mhc=cfg.mhc,
                           dynamic_input=cfg.hc_dynamic_input, tanh=cfg.hc_tanh, sinkhorn_iters=cfg.sinkhorn_iters,
                           norm_eps=cfg.norm_eps)


class TransformerBlock(nn.Module):
    """Attention then MLP, each reading a mixed input through pre-norm.

    Hooks: ``hook_resid_pre`` (the input of attention), ``hook_attn_out``, ``hook_resid_mid``
    (the input of the MLP), ``hook_mlp_out``. Per rule:

    - PreNorm and DenseFormer add ``hook_resid_post``, the residual stream after the MLP as in
      TransformerLens (DenseFormer: the block output x_{i+1}, before the depth-weighted average
      that makes the next block's input);
    - Full and Block AttnRes add the reads' depth mixers ``attn_res`` and ``mlp_res``
      (:class:`DepthMixer`; their reads are mixtures, not a running sum, so no resid_post);
    - Hyper-Connections and DenseFormer add ``attn_res`` and ``mlp_res`` as
      :class:`CoefficientRead` (effective depth weights), and Hyper-Connections the stream state
      ``hook_streams_pre`` / ``hook_streams_mid`` / ``hook_streams_post`` [batch, pos, n_streams,
      d_model] entering attention, entering the MLP and leaving the block.
    """

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.ln1 = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = make_norm(cfg, cfg.d_model)
        self.mlp = GatedMLP(cfg) if cfg.mlp == "swiglu" else MLP(cfg)
        rule = implementation(cfg.residual)
        if rule is not None:  # a rule of attnres_probe.rules builds its own reads
            self.attn_res = rule.make_read(cfg, 2 * index)
            self.mlp_res = rule.make_read(cfg, 2 * index + 1)
        elif cfg.residual in ("full", "block"):
            mixer = StaticMixer if cfg.static_routing else DepthMixer
            self.attn_res = mixer(cfg)
            self.mlp_res = mixer(cfg)
        elif cfg.residual == "hyper":
            self.attn_res = CoefficientRead(cfg, hyper_connection(cfg, 2 * index))
            self.mlp_res = CoefficientRead(cfg, hyper_connection(cfg, 2 * index + 1))
            self.hook_streams_pre = CheckedHookPoint()  # [batch, pos, n_streams, d_model]
            self.hook_streams_mid = CheckedHookPoint()
            self.hook_streams_post = CheckedHookPoint()
        elif cfg.residual == "denseformer":
            self.attn_res = CoefficientRead(cfg)
            self.mlp_res = CoefficientRead(cfg)
        if cfg.residual in ("prenorm", "denseformer"):
            self.hook_resid_post = CheckedHookPoint()  # [batch, pos, d_model]
        self.hook_resid_pre = CheckedHookPoint()  # [batch, pos, d_model] the attention sublayer's input
        self.hook_attn_out = CheckedHookPoint()  # [batch, pos, d_model]
        self.hook_resid_mid = CheckedHookPoint()  # [batch, pos, d_model] the MLP sublayer's input
        self.hook_mlp_out = CheckedHookPoint()  # [batch, pos, d_model]

    def sublayer(self, which: int, h: torch.Tensor) -> torch.Tensor:
        """Run sublayer ``which`` (0 = attention, 1 = MLP) on the mixed input h; return its output."""
        if which == 0:
            return self.hook_attn_out(self.attn(self.ln1(self.hook_resid_pre(h))))
        return self.hook_mlp_out(self.mlp(self.ln2(self.hook_resid_mid(h))))

    def mixer(self, which: int) -> DepthRead:
        """The read that feeds sublayer ``which`` (every rule but PreNorm)."""
        return self.attn_res if which == 0 else self.mlp_res


def _sinusoidal(n_ctx: int, d: int) -> torch.Tensor:
    """The sinusoidal position table, made on the CPU (also when the model is built on the meta device)."""
    pos = torch.arange(n_ctx, dtype=torch.float32, device="cpu")[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32, device="cpu") * (-math.log(10000.0) / d))
    pe = torch.zeros(n_ctx, d, device="cpu")
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)
    return pe


SCHEDULES = ("sequential", "two_phase")


class AttnResTransformer(TLWeights, HookedRootModule):
    """A byte-level transformer whose residual rule is PreNorm, Full AttnRes, Block AttnRes,
    Hyper-Connections / mHC (``residual="hyper"``) or DenseFormer (``residual="denseformer"``).

    ``forward(tokens) -> logits [batch, pos, d_vocab]``. Hook points follow docs/design.md; read
    and source labels are :attr:`read_labels` and :attr:`source_labels`, and :attr:`axis`
    answers every other question about the common source axis.

    Args:
        cfg: the model's :class:`ModelConfig` (validated).
        backend: depth-attention backend, ``"auto"`` | ``"torch"`` | ``"triton"`` |
            ``"numba"``; None defers to ``ATTNRES_BACKEND`` (see :mod:`attnres_probe.kernels`).
            PreNorm has no depth attention and ignores it.
        schedule: Block AttnRes only (refused on the others): ``"sequential"`` or
            ``"two_phase"``; None picks two-phase when the Triton backend is in use, sequential
            otherwise. Both are exact.
    """

    _checking_finite = False  # set while attnres_probe.hook_checks runs a forward again to find a non-finite hook

    def __init__(self, cfg: ModelConfig, backend: str | None = None, schedule: str | None = None):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig; got {type(cfg).__name__}")
        cfg.validate()
        if backend is not None:
            kernels.requested_backend(backend)  # an unknown name is refused here, not at the first forward
        if schedule is not None and schedule not in SCHEDULES:
            raise ValueError(f"schedule is {schedule!r}; accepted values are {', '.join(SCHEDULES)} (or None)")
        if schedule == "two_phase" and cfg.static_routing:
            raise ValueError("schedule='two_phase' scores queries against keys; a static-routing model has none (pass None)")
        if schedule is not None and cfg.residual != "block":
            raise ValueError(f"schedule={schedule!r} applies to Block AttnRes only; this model's residual is {cfg.residual!r} (pass None)")
        self.cfg = cfg
        self.axis = SourceAxis.from_config(cfg)
        self.backend = backend
        self.schedule = schedule
        d = cfg.d_model
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, d))
        if cfg.positional == "learned":
            self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, d))
        elif cfg.positional == "sinusoidal":
            self.register_buffer("W_pos", _sinusoidal(cfg.n_ctx, d), persistent=False)
        # positional == "rope": positions enter each attention's queries and keys, source 0 is the token embedding
        self.hook_embed = CheckedHookPoint()  # [batch, pos, d_model]
        self.hook_pos_embed = CheckedHookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList([TransformerBlock(cfg, i) for i in range(cfg.n_layers)])
        self._rule = implementation(cfg.residual)
        if self._rule is not None:
            self.out_res = self._rule.make_final(cfg)
        elif cfg.residual in ("full", "block"):
            self.out_res = StaticMixer(cfg) if cfg.static_routing else DepthMixer(cfg)
        elif cfg.residual in ("hyper", "denseformer"):
            self.out_res = CoefficientRead(cfg)  # hyper: the sum of the streams; denseformer: z_n
        if cfg.residual == "denseformer":
            self.dwa = DepthWeightedAverage(cfg.n_layers, cfg.dwa_dilation, cfg.dwa_period)
        self.hook_resid_final = CheckedHookPoint()  # [batch, pos, d_model] the final mixed input, before ln_final
        self.ln_final = make_norm(cfg, d)
        if not cfg.tie_embeddings:
            self.W_U = nn.Parameter(torch.empty(d, cfg.d_vocab))
        for mixer, k in zip(self.mixers, self.axis.counts):
            mixer.visible = k
        self.init_weights()
        self.setup()

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
                if isinstance(block.mlp, GatedMLP):
                    nn.init.normal_(block.mlp.W_gate.weight, 0.0, std, generator=g)
                nn.init.normal_(block.mlp.W_in.weight, 0.0, std, generator=g)
                nn.init.normal_(block.mlp.W_out.weight, 0.0, out_std, generator=g)
                if hasattr(block.attn, "W_G"):
                    nn.init.normal_(block.attn.W_G.weight, 0.0, std, generator=g)
                for bias in (block.attn.W_QKV.bias, block.attn.W_O.bias, getattr(block.attn, "W_G", block.attn.W_O).bias,
                             getattr(block.mlp, "W_gate", block.mlp.W_in).bias, block.mlp.W_in.bias, block.mlp.W_out.bias):
                    if bias is not None:
                        nn.init.zeros_(bias)
            if not cfg.tie_embeddings:
                nn.init.normal_(self.W_U, 0.0, std, generator=g)
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)
                if isinstance(m, DepthMixer):
                    m.reset_depth()

    # -- labels and bookkeeping (the source axis answers) ---------------------------------
    @property
    def residual(self) -> str:
        return self.cfg.residual

    @property
    def sublayer_labels(self) -> list[str]:
        """["L0.attn", "L0.mlp", "L1.attn", ...] (L entries)."""
        return self.axis.sublayer_labels

    @property
    def read_labels(self) -> list[str]:
        """Rows of every trace: one read per sublayer, then "final" (L+1 entries)."""
        return self.axis.read_labels

    @property
    def source_labels(self) -> list[str]:
        """Columns of the common source axis: ["embed", "L0.attn", ...] or ["embed", "block1", ...]."""
        return self.axis.source_labels

    @property
    def block_starts(self) -> list[int]:
        """Sublayer index where each block starts (block mode), else []."""
        return list(self.axis.block_starts)

    def block_of(self, sublayer: int) -> int:
        """1-based block that sublayer ``sublayer`` writes into (block mode)."""
        return self.axis.block_of(sublayer)

    def source_members(self, read: int) -> list[tuple[str, ...]]:
        """What each source visible to ``read`` is made of (see :meth:`SourceAxis.members`)."""
        return self.axis.members(read)

    def source_columns(self, read: int) -> list[int]:
        """Common-axis column of each source visible to ``read``."""
        return self.axis.columns(read)

    @property
    def mixers(self) -> list[DepthRead]:
        """The L+1 reads in order: :class:`DepthMixer` for AttnRes, :class:`CoefficientRead` for
        Hyper-Connections and DenseFormer (empty for PreNorm)."""
        if self.cfg.residual == "prenorm":
            return []
        return [*(b.mixer(w) for b in self.blocks for w in (0, 1)), self.out_res]

    def native_source_labels(self) -> list[list[str]] | None:
        """Per read, the labels of the rule's own sources (rules of :mod:`attnres_probe.rules` that keep
        native weights), else None."""
        labels = getattr(self._rule, "native_source_labels", None)
        return labels(self.cfg) if labels is not None else None

    @property
    def device(self) -> torch.device:
        return self.W_E.device

    @property
    def unembed(self) -> torch.Tensor:
        """The unembedding [d_model, d_vocab]: ``W_U``, or ``W_E`` transposed when tied."""
        return self.W_E.T if self.cfg.tie_embeddings else self.W_U

    # -- text in and out, as TransformerLens (attnres_probe.text_api, attnres_probe.generation) --
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: a ByteTokenizer for a 256-token vocabulary (None for others)
        unless set; ``load_pretrained`` sets the checkpoint's own. Settable; with None, a
        256-token model still reads bytes."""
        return text_api.model_tokenizer(self)

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        text_api.set_model_tokenizer(self, tokenizer)

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True, truncate: bool = False) -> torch.Tensor:
        """Token ids [batch, pos] of a text or a list of texts of equal token length (no padding:
        the forward takes no attention mask), checked against the context (``truncate=True``
        keeps the first n_ctx) and vocabulary. ``prepend_bos=True`` needs a tokenizer with a BOS
        token (bytes have none; None and False add nothing). See :mod:`attnres_probe.text_api`."""
        return text_api.to_tokens(self, input, prepend_bos, padding_side, move_to_device, truncate)

    def to_str_tokens(self, input: Any, prepend_bos: bool | None = None, padding_side: str | None = None) -> Any:
        """One label per token of a text, ids [pos] / [1, pos] or a list of ids (``list[str]``);
        a list of lists for a list of texts or a [batch, pos] batch."""
        return text_api.to_str_tokens(self, input, prepend_bos, padding_side)

    def to_string(self, tokens: Any) -> str | list[str]:
        """Text of ids [pos] (a str) or [batch, pos] (a list of str)."""
        return text_api.to_string(self, tokens)

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token."""
        return text_api.to_single_token(self, string)

    def generate(self, input: Any = "", max_new_tokens: int = 10, stop_at_eos: bool = True,
                 eos_token_id: int | list[int] | None = None, do_sample: bool = True, top_k: int | None = None,
                 top_p: float | None = None, temperature: float = 1.0, seed: int | None = None,
                 use_past_kv_cache: bool = True, prepend_bos: bool | None = None, padding_side: str | None = None,
                 return_type: str = "input", verbose: bool = False) -> Any:
        """Continue a text, a list of texts of equal token length, or token ids, as TransformerLens.

        Greedy with ``do_sample=False`` or ``temperature=0``; otherwise sampled from
        softmax(logits / temperature), restricted to ``top_k`` / ``top_p``, with a local
        generator seeded by ``seed`` (same seed, same output; the global RNG is untouched).
        Every step is this model's forward on the sequence so far, under ``torch.no_grad``, through
        its hook points: hooks attached (``add_hook``, ``with model.hooks(fwd_hooks=...)``) act at
        every step. No KV cache (``use_past_kv_cache`` changes nothing). When the prompt and the
        generated tokens exceed n_ctx, each step conditions on the last n_ctx tokens (positions
        counted from the window's start). ``stop_at_eos`` stops at the tokenizer's EOS or
        ``eos_token_id`` (bytes have no EOS: pass e.g. ``eos_token_id=10`` to stop at a newline;
        a batch's finished rows are filled with EOS). The train/eval mode is left as it is.

        Returns:
            ``return_type="input"``: text for text (str, or a list for a list), ids for ids;
            ``"str"``: the text (prompt included); ``"tokens"``: ids [batch, pos] (prompt included).
        """
        return generation.generate(self, input, max_new_tokens, stop_at_eos, eos_token_id, do_sample, top_k, top_p,
                                   temperature, seed, use_past_kv_cache, prepend_bos, padding_side, return_type, verbose)

    def tokens_to_residual_directions(self, tokens: Any) -> torch.Tensor:
        """``ln_final.weight * unembed[:, tokens]``: [d_model] for one token (str, int), else
        [*tokens.shape, d_model] (the final norm's gain folded in, as TransformerLens's folded W_U)."""
        return residual_directions(self, tokens)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        """The output biases summed along the residual stream before ``layer``, [d_model] (PreNorm only)."""
        return accumulated_bias(self, layer, mlp_input, include_mlp_biases)

    def check_tokens(self, tokens: Any, truncate: bool = False) -> torch.Tensor:
        """Validate tokens ([pos] or [batch, pos] integer ids, a str, or a list of texts of equal token
        length, as TransformerLens takes them) and return [batch, pos] on device."""
        from attnres_probe.tokenizer import check_token_ids

        if isinstance(tokens, str) or text_api.is_text_list(tokens):
            return self.to_tokens(tokens if isinstance(tokens, str) else list(tokens), truncate=truncate)
        return check_token_ids(tokens, self.cfg.n_ctx, self.cfg.d_vocab, truncate).to(self.device)

    # -- forward -------------------------------------------------------------------------
    def resolve(self, v0: torch.Tensor) -> tuple[str, str]:
        """(backend, schedule) for a forward on tensors like ``v0``: the backend as
        :func:`~attnres_probe.kernels.resolve_backend` picks it for their device and dtype,
        and the Block schedule (None: two-phase on Triton, else sequential; static routing: sequential)."""
        backend = kernels.resolve_backend(v0.device, self.backend, dtypes=(v0.dtype,), d=self.cfg.d_model)
        schedule = self.schedule or ("two_phase" if backend == "triton" and not self.cfg.static_routing else "sequential")
        return backend, schedule

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Source 0: token embedding + position embedding (none with rotary positions), [batch, pos, d_model]."""
        tok = self.hook_embed(self.W_E[tokens])
        if self.cfg.positional == "rope":
            return tok
        pos = self.hook_pos_embed(self.W_pos[: tokens.shape[1]].unsqueeze(0).expand(tokens.shape[0], -1, -1))
        return tok + pos

    def forward(
        self, tokens: Any, return_type: ReturnType = "logits", loss_per_token: bool = False, *, truncate: bool = False,
        stop_at_layer: int | None = None,
    ) -> Any:
        """Run the model on tokens [batch, pos] (or [pos], or a str), as TransformerLens does.

        Args:
            tokens: token ids [batch, pos] or [pos], or a text.
            return_type: ``"logits"`` [batch, pos, d_vocab] (default), ``"loss"`` (the mean
                next-token cross-entropy, or [batch, pos-1] with ``loss_per_token``),
                ``"both"`` (logits, loss), or None (nothing; for hooks and caches).
            loss_per_token: the loss per predicted token instead of its mean.
            truncate: keep the first n_ctx tokens of a longer input instead of refusing it.
            stop_at_layer: as TransformerLens: run blocks ``0 .. stop_at_layer - 1`` only and return what
                block ``stop_at_layer`` reads, its attention's mixed input (``blocks.{k}.hook_resid_pre``;
                ``n_layers``: the final read, ``hook_resid_final``; negative counts from the end), [batch,
                pos, d_model]; ``return_type`` is then ignored.
        """
        if stop_at_layer is not None:
            return self._forward_until(tokens, stop_at_layer, truncate)
        if return_type not in RETURN_TYPES:
            raise ValueError(f"return_type is {return_type!r}; accepted values are 'logits', 'loss', 'both', None")
        tokens = self.check_tokens(tokens, truncate=truncate)
        if return_type in ("loss", "both") and tokens.shape[1] < 2:
            raise ValueError("the loss needs at least two tokens (it predicts token t+1 from tokens <= t)")
        v0 = self.embed(tokens)  # (B, P, d)
        if self._rule is not None:
            h = self._rule.forward(self, v0)
        elif self.cfg.residual == "prenorm":
            h = self._forward_prenorm(v0)
        elif self.cfg.residual == "hyper":
            h = self._forward_hyper(v0)
        elif self.cfg.residual == "denseformer":
            h = self._forward_denseformer(v0)
        else:
            backend, schedule = self.resolve(v0)
            if self.cfg.residual == "full":
                h = self._forward_full(v0, backend)
            elif schedule == "sequential":
                h = self._forward_block(v0, backend)
            else:
                h = self._forward_block_two_phase(v0, backend)
        logits = self.ln_final(self.hook_resid_final(h)) @ self.unembed  # (B, P, vocab)
        loss = None
        if return_type in ("loss", "both"):
            loss = next_token_loss(logits, tokens, reduction="none" if loss_per_token else "mean")
        if not self._checking_finite and any(hp._forward_hooks for hp in self.hook_dict.values()):
            warn_if_non_finite(self, tokens, {"logits": logits, "loss": loss})  # names the hook point that went first
        if return_type == "logits":
            return logits
        if return_type is None:
            return None
        return loss if return_type == "loss" else (logits, loss)

    def _forward_until(self, tokens: Any, stop_at_layer: int, truncate: bool) -> torch.Tensor:
        n = self.cfg.n_layers
        if isinstance(stop_at_layer, bool) or not isinstance(stop_at_layer, int) or not -n <= stop_at_layer <= n:
            raise ValueError(f"stop_at_layer is {stop_at_layer!r}; accepted values are integers in {-n}..{n} (or None)")
        k = stop_at_layer % n if stop_at_layer < 0 else stop_at_layer
        point = self.hook_resid_final if k == n else self.blocks[k].hook_resid_pre
        seen: list[torch.Tensor] = []

        class _Reached(Exception):
            pass

        def stop(x: torch.Tensor, hook: Any = None) -> None:
            seen.append(x)
            raise _Reached

        with self.hooks(fwd_hooks=[(point.name, stop)]):
            try:
                self.forward(tokens, return_type=None, truncate=truncate)
            except _Reached:
                pass
        return seen[0]

    def _sublayers(self):
        """(l, block, which) for every sublayer l in order: which = 0 attention, 1 MLP."""
        for i, block in enumerate(self.blocks):
            yield 2 * i, block, 0
            yield 2 * i + 1, block, 1

    def _forward_prenorm(self, v0: torch.Tensor) -> torch.Tensor:
        """PreNorm: every read is the plain sum of all sources so far."""
        resid = v0  # (B, P, d)
        for _, block, which in self._sublayers():
            resid = resid + block.sublayer(which, resid)
            if which == 1:
                resid = block.hook_resid_post(resid)
        return resid

    def _forward_hyper(self, v0: torch.Tensor) -> torch.Tensor:
        """Hyper-Connections / mHC: n streams start as copies of the embedding; each sublayer reads
        ``H_pre X`` and writes ``X <- H_res X + H_post^T y``; the final read is the sum of the streams.

        While a read's weights or shares are hooked, every read's coefficients over the sources
        are carried along (docs/depth_rules.md): C [batch, pos, n, L+1] with X = C V, updated
        ``C <- H_res C + H_post^T e_new``, and read l's coefficients are ``H_pre C``. A hook that
        changes the stream state (``hook_streams_*``) makes X differ from C V: the coefficients
        then describe the unchanged streams (a warning says so).
        """
        reads = self.mixers
        track = any(r.hooked for r in reads)
        S = self.axis.n_sources
        X = expand_streams(v0, self.cfg.n_streams)  # (B, P, n, d)
        backend = kernels.resolve_backend(v0.device, self.backend, dtypes=(v0.dtype,)) if self.cfg.mhc else None
        sources = [v0]
        C = None
        for l, block, which in self._sublayers():
            read = reads[l]
            X = self._stream_hook(block.hook_streams_pre if which == 0 else block.hook_streams_mid, X, track)
            w = read.hc.weights(X, backend)  # mHC: its Sinkhorn on the model's backend
            h, _ = read.hc.read(X, w)
            if track:
                if C is None:  # the embedding in every stream
                    C = F.pad(torch.ones(*X.shape[:-1], 1, dtype=w.pre.dtype, device=X.device), (0, S - 1))
                h = read.observe(sources, h, torch.einsum("...s,...sj->...j", w.pre, C))
            y = block.sublayer(which, h)
            X = read.hc.write(X, y, w)
            sources.append(y)
            if track:
                C = torch.einsum("...ts,...sj->...tj", w.res, C)
                C[..., l + 1] = C[..., l + 1] + w.post
            if which == 1:
                X = self._stream_hook(block.hook_streams_post, X, track)
        h = reduce_streams(X)
        if track:
            h = self.out_res.observe(sources, h, C.sum(-2))
        return h

    @staticmethod
    def _stream_hook(hook: HookPoint, X: torch.Tensor, track: bool) -> torch.Tensor:
        version = X._version
        out = hook(X)
        # a backward hook hands back another tensor object on the same storage: not a change
        replaced = out is not X and (out.data_ptr() != X.data_ptr() or out.shape != X.shape)
        if track and (replaced or X._version != version):
            import warnings

            warnings.warn(
                f"a hook changed the stream state at {hook.name} while depth weights are recorded: the weights "
                "describe the streams as the model wrote them, not the changed ones",
                stacklevel=4,
            )
        return out

    def _forward_denseformer(self, v0: torch.Tensor) -> torch.Tensor:
        """DenseFormer: a PreNorm transformer whose block input z_{i+1} is, after every
        ``dwa_period``-th block, a learned weighted average of the embedding and the block outputs
        so far (every ``dwa_dilation``-th); the final read is z_n.

        While a read's weights or shares are hooked, the reads' coefficients (the same for every
        token: products of the DWA weights) are computed once per forward and shown to them.
        """
        reads = self.mixers
        coef = self.dwa.read_coefficients() if any(r.hooked for r in reads) else None  # (L+1, L+1)
        B, P, _ = v0.shape
        outputs, sources, z = [v0], [v0], v0
        for i, block in enumerate(self.blocks):
            h = z if coef is None else reads[2 * i].observe(sources, z, coef[2 * i].expand(B, P, -1).clone())
            a = block.sublayer(0, h)
            sources.append(a)
            mid = z + a
            h = mid if coef is None else reads[2 * i + 1].observe(sources, mid, coef[2 * i + 1].expand(B, P, -1).clone())
            m = block.sublayer(1, h)
            sources.append(m)
            outputs.append(block.hook_resid_post(mid + m))
            z = self.dwa(outputs, i)
        if coef is not None:
            z = self.out_res.observe(sources, z, coef[-1].expand(B, P, -1).clone())
        return z

    def _inv_rms(self, v: torch.Tensor, backend: str) -> torch.Tensor | None:
        """A source's 1/rms for the reference backend, which reuses it across reads (the
        fused kernels normalise inside the kernel at no extra memory traffic)."""
        if backend != "torch":
            return None
        return kernels.inv_rms(v, self._key_eps(v), kernels.compute_dtype(v))

    def _key_eps(self, v: torch.Tensor) -> float:
        """The depth keys' RMS eps for sources like ``v``: ``cfg.norm_eps``, or torch's default for v's dtype
        with ``cfg.eps_from_dtype`` (:func:`~attnres_probe.layers.dtype_eps`)."""
        return dtype_eps(v) if self.cfg.eps_from_dtype else self.cfg.norm_eps

    def _forward_full(self, v0: torch.Tensor, backend: str) -> torch.Tensor:
        """Full AttnRes: read l mixes [v0, ..., v_l]; the final read mixes all L+1."""
        sources = [v0]  # S x (B, P, d)
        inv = [self._inv_rms(v0, backend)]
        cache = inv if backend == "torch" else None  # the same list, growing with the sources (reference only)
        for _, block, which in self._sublayers():
            h = block.mixer(which)(sources, cache, backend)  # (B, P, d)
            out = block.sublayer(which, h)
            sources.append(out)
            inv.append(self._inv_rms(out, backend))
        return self.out_res(sources, cache, backend)

    def _forward_block(self, v0: torch.Tensor, backend: str) -> torch.Tensor:
        """Block AttnRes, sequential: read l mixes the completed blocks and, inside a block,
        the partial sum of the block's outputs so far."""
        axis = self.axis
        blocks = [v0]  # completed blocks, (B, P, d) each; the embedding is b0
        inv = [self._inv_rms(v0, backend)]
        partial: torch.Tensor | None = None  # sum of this block's outputs so far
        for l, block, which in self._sublayers():
            if axis.starts_block(l):  # the previous block is complete
                blocks.append(partial)
                inv.append(self._inv_rms(partial, backend))
                partial = None
            sources, cache = blocks, inv
            if partial is not None:
                sources, cache = [*blocks, partial], [*inv, self._inv_rms(partial, backend)]
            h = block.mixer(which)(sources, cache if backend == "torch" else None, backend)
            out = block.sublayer(which, h)
            partial = out if partial is None else partial + out
        blocks.append(partial)
        inv.append(self._inv_rms(partial, backend))
        return self.out_res(blocks, inv if backend == "torch" else None, backend)

    def _forward_block_two_phase(self, v0: torch.Tensor, backend: str) -> torch.Tensor:
        """Block AttnRes, two-phase (docs/design.md): at each block start, phase 1 scores all the
        block's reads against the completed blocks at once; each read then merges the
        partial block into its phase-1 result (phase 2). Exact: equals the sequential form."""
        axis, eps = self.axis, self._key_eps(v0)
        blocks = [v0]
        partial: torch.Tensor | None = None
        mixers = self.mixers
        phase: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # read -> (o_bar, lse, logits)
        for l, block, which in self._sublayers():
            if axis.starts_block(l):
                blocks.append(partial)
                partial = None
            if l in axis.block_starts:  # phase 1 for every read of this block
                reads = axis.block_reads(l)
                queries = torch.stack([mixers[r].folded_query for r in reads])  # (Q, d)
                o_bar, lse, z = kernels.phase1(blocks, queries, eps, return_logits=True, backend=backend)
                phase = {r: (o_bar[j], lse[j], z[j]) for j, r in enumerate(reads)}
            h = self._merge(block.mixer(which), phase[l], blocks, partial, backend)
            out = block.sublayer(which, h)
            partial = out if partial is None else partial + out
        blocks.append(partial)
        return self.out_res(blocks, None, backend)

    def _merge(self, mixer: DepthMixer, ph: tuple, blocks: list[torch.Tensor], partial, backend: str) -> torch.Tensor:
        """Phase 2 of one read: merge its phase-1 result with the partial block, then show the
        merged read's own logits to the mixer's hooks."""
        o_bar, lse, z = ph  # (B, P, d), (B, P), (B, P, n_completed)
        sources = blocks
        if partial is not None:  # after the block's first read: merge the partial block in
            o_bar, lse, z_p = kernels.phase2(o_bar, lse, partial, mixer.query, mixer.norm.weight, self._key_eps(partial),
                                             backend=backend)
            sources, z = [*blocks, partial], torch.cat([z, z_p.unsqueeze(-1)], dim=-1)
        weights = torch.exp(z - lse.unsqueeze(-1))  # (B, P, k)
        return mixer.observe(sources, o_bar, mixer.on_axis(z, float("-inf")), mixer.on_axis(weights, 0.0))

    # -- conveniences --------------------------------------------------------------------
    def loss(self, tokens: Any, per_token: bool = False) -> torch.Tensor:
        """Next-token cross-entropy: mean, or [batch, pos-1] with ``per_token=True``
        (``self(tokens, return_type="loss", loss_per_token=per_token)``)."""
        return self(tokens, return_type="loss", loss_per_token=per_token)

    def run_with_cache(self, *model_args: Any, return_cache_object: bool = True, incl_bwd: bool = False, **kwargs: Any):
        """``(output, cache)`` as in TransformerLens; the cache is an :class:`AttnResCache` (an
        ``ActivationCache``) unless ``return_cache_object=False``.

        With ``incl_bwd=True`` the backward runs from the model's output, which must be a
        scalar: ``return_type`` then defaults to ``"loss"`` (the mean next-token loss), and the
        cache holds every hook point's gradient too (``"<name>_grad"``).
        """
        if incl_bwd:
            kwargs.setdefault("return_type", "loss")
            if kwargs["return_type"] != "loss" or kwargs.get("loss_per_token"):
                raise ValueError(
                    f"incl_bwd=True runs backward from the model's output, which must be a scalar; "
                    f"return_type={kwargs['return_type']!r} is not (use return_type='loss', the default with incl_bwd)"
                )
        out, cache = super().run_with_cache(*model_args, incl_bwd=incl_bwd, **kwargs)
        if return_cache_object and not isinstance(cache, ActivationCache):
            cache = AttnResCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))
        return out, cache

    def n_params(self, include_mixers: bool = True) -> int:
        """Number of parameters (optionally without the depth mixers')."""
        return sum(
            p.numel() for n, p in self.named_parameters()
            if include_mixers or not ("_res." in n or n.startswith(("out_res", "dwa.")))
        )

    # -- checkpoints ---------------------------------------------------------------------
    # (attnres_probe.checkpoint_store, which never imports this module: it is given the class to build)
    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` + ``model.safetensors`` into ``directory`` (both swapped in at once; see
        :func:`~attnres_probe.checkpoint_store.save_checkpoint`)."""
        return save_checkpoint(self, directory, dtype=dtype)

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu", **kwargs: Any) -> AttnResTransformer:
        """Load a checkpoint written by :meth:`save`; validates config against tensors."""
        return load_checkpoint_as(cls, directory, device=device, **kwargs)

    def extra_repr(self) -> str:
        c = self.cfg
        extra = f", blocks={c.block_starts}" if c.residual == "block" else ""
        if c.residual in ("hyper", "denseformer") or self._rule is not None:
            extra = f", rule={c.rule_label!r}"
        if c.positional == "rope" or c.mlp != "gelu" or c.n_kv_heads != c.n_heads or c.tie_embeddings:
            extra += f", positional={c.positional!r}, mlp={c.mlp!r}, n_kv_heads={c.n_kv_heads}, tied={c.tie_embeddings}"
        run = "".join(f", {k}={v!r}" for k, v in (("backend", self.backend), ("schedule", self.schedule)) if v is not None)
        return f"residual={c.residual!r}, n_layers={c.n_layers}, d_model={c.d_model}{extra}{run}"
