"""Probe: the notebook entry point. Runs text through a model with the recorder attached.

    probe = Probe(model)                      # an AttnResTransformer or a TransformerLens-style model
    trace = probe.run("The cat sat", backward=True)
    trace.weights(token=3)                    # reads x sources DataFrame
    stats = probe.run_corpus(texts, batch_size=8)
    probe.ablate("The cat sat", sources="embed")
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from attnres_probe.hooks import Recorder, spec_for
from attnres_probe.losses import trace_loss
from attnres_probe.tokenizer import check_token_ids
from attnres_probe.trace import DepthTrace

__all__ = ["Probe"]


class Probe:
    """Records depth routing, magnitudes and gradients of one model.

    Args:
        model: an :class:`~attnres_probe.AttnResTransformer`, or any TransformerLens-style
            PreNorm model exposing the hook points listed in :mod:`attnres_probe.hooks.spec`.
        tokenizer: turns text into ids (needs ``to_tokens(text)`` or ``encode(text)``, and
            optionally ``to_str_tokens``). Default: :class:`~attnres_probe.ByteTokenizer` for
            models with a 256-token vocabulary.
        name: label of this model in traces, charts and comparisons (default: its residual mode).

    Raises:
        MissingHooksError: the model lacks needed hook points (all of them are listed).
    """

    def __init__(self, model: Any, tokenizer: Any = None, name: str | None = None):
        self.model = model
        self.spec = spec_for(model, name)
        self._params = list(model.parameters())  # listed once: walking the module tree is slow
        if tokenizer is None and self.spec.d_vocab == 256:
            from attnres_probe.tokenizer import ByteTokenizer

            tokenizer = ByteTokenizer()
        self.tokenizer = tokenizer

    @property
    def name(self) -> str:
        return self.spec.meta["name"]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- input ---------------------------------------------------------------------------
    def tokenize(self, text_or_tokens: Any, truncate: bool = False) -> tuple[torch.Tensor, list[list[str]]]:
        """Tokens [batch, pos] on the model's device and their printable labels.

        Raises:
            ValueError: empty input, more tokens than the model's context (unless
                ``truncate``), ids outside the vocabulary.
        """
        if isinstance(text_or_tokens, str):
            if not text_or_tokens:
                raise ValueError("text is empty: need at least one character")
            if self.tokenizer is None:
                raise ValueError("this probe has no tokenizer: pass token ids, or Probe(model, tokenizer=...)")
            tokens, what = self.encode(text_or_tokens), "text"
        else:
            tokens, what = text_or_tokens, "input"
        tokens = check_token_ids(tokens, self.spec.n_ctx, self.spec.d_vocab, truncate, what).to(self.device)
        return tokens, [self._str_tokens(row) for row in tokens]

    def encode(self, text: str) -> torch.Tensor:
        """The tokenizer's ids for ``text``: [1, pos] (or [batch, pos] if it returns a batch).

        Unlike :meth:`tokenize`, nothing is checked (context length, vocabulary) and the ids stay
        where the tokenizer put them.

        Raises:
            TypeError: the tokenizer has neither ``to_tokens`` nor ``encode``.
        """
        tok = self.tokenizer
        if hasattr(tok, "to_tokens"):
            ids = tok.to_tokens(text)
        elif hasattr(tok, "encode"):
            ids = tok.encode(text)
        else:
            raise TypeError(f"tokenizer {type(tok).__name__} has neither to_tokens nor encode")
        ids = torch.as_tensor(ids)
        return ids if ids.dim() == 2 else ids.unsqueeze(0)

    def _str_tokens(self, row: torch.Tensor) -> list[str]:
        tok = self.tokenizer
        if tok is not None and hasattr(tok, "to_str_tokens"):
            try:
                return list(tok.to_str_tokens(row.cpu()))
            except Exception:
                pass
        if tok is not None and hasattr(tok, "decode"):
            return [str(tok.decode([int(t)])) for t in row.tolist()]
        return [str(int(t)) for t in row.tolist()]

    # -- recording -----------------------------------------------------------------------
    def run(
        self,
        text_or_tokens: Any,
        backward: bool = True,
        truncate: bool = False,
        contributions: bool = True,
    ) -> DepthTrace:
        """Run text (or tokens [batch, pos]) and record everything.

        Args:
            text_or_tokens: a string, or token ids [pos] / [batch, pos].
            backward: also run a backward pass of the mean next-token loss and record
                per-token gradient norms at every mixed input and per-sublayer parameter
                gradient norms (the model's ``.grad`` fields are not touched).
            truncate: keep the first n_ctx tokens of a longer input instead of raising.
            contributions: compute contribution shares (skip to save time).

        Returns:
            The :class:`DepthTrace`.
        """
        tokens, str_tokens = self.tokenize(text_or_tokens, truncate=truncate)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        return self.record(tokens, mask, str_tokens, backward=backward, contributions=contributions)

    def record(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        str_tokens: list[list[str]],
        backward: bool = True,
        contributions: bool = True,
        extra_meta: dict | None = None,
    ) -> DepthTrace:
        """Record already-validated tokens [batch, pos] with a right-padding ``mask``."""
        if backward and int(mask[:, 1:].sum()) == 0:
            raise ValueError(
                "a backward pass needs at least two tokens (the loss predicts token t+1); pass backward=False "
                "(--no-backward on the command line)"
            )
        spec = self.spec
        rec = Recorder(self.model, spec, contributions=contributions, gradients=backward)
        params = [p for p in self._params if p.requires_grad] if backward else []
        grads: dict[int, torch.Tensor] = {}
        with rec, torch.set_grad_enabled(backward):
            logits = self.logits(tokens)
            rec.raise_if_failed()
            per_tok, loss = trace_loss(logits, tokens, mask)
            if backward and params:
                got = torch.autograd.grad(loss, params, allow_unused=True)
                grads = {id(p): g for p, g in zip(params, got) if g is not None}
        rec.finish()
        arrays = {k: v.detach().cpu().numpy() for k, v in rec.arrays().items()}
        L = spec.n_sublayers
        param_grad = np.full(L, np.nan, np.float32)
        mixer_grad = np.full(L + 1, np.nan, np.float32)
        if grads:
            sq = _squared_norms(grads)
            param_grad[:] = [_group_norm(ps, sq) for ps in spec.sublayer_params]
            if spec.mixer_params:
                mixer_grad[:] = [_group_norm(ps, sq) for ps in spec.mixer_params]
        meta = {
            **spec.meta,
            "str_tokens": [row[: int(m.sum())] for row, m in zip(str_tokens, mask.cpu())],
            "backward": bool(backward),
            "mean_loss": float(loss.detach()),
        }
        if extra_meta:
            meta.update(extra_meta)
        return DepthTrace(
            tokens=tokens.cpu().numpy(),
            mask=mask.cpu().numpy(),
            loss=per_tok.detach().cpu().numpy(),
            param_grad=param_grad,
            mixer_grad=mixer_grad,
            meta=meta,
            **arrays,
        )

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The model's logits [batch, pos, vocab] for tokens [batch, pos] (one plain forward).

        Whatever hooks are attached to the model at the time run (the recorder's inside
        :meth:`record`, an ablation's weight edit).

        Raises:
            TypeError: the model returned neither a tensor nor an object with ``.logits``.
        """
        out = self.model(tokens)
        if isinstance(out, torch.Tensor):
            return out
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):
            return logits
        raise TypeError(f"the model returned {type(out).__name__}; the probe needs logits [batch, pos, vocab]")

    # -- many texts ----------------------------------------------------------------------
    def batches(
        self, texts: Iterable[str | Sequence[int] | torch.Tensor], batch_size: int = 8
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[list[str]]]]:
        """Split texts into n_ctx-token windows and yield right-padded batches (tokens, mask, str_tokens)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
        if isinstance(texts, (str, torch.Tensor)):
            texts = [texts]  # one text (or one tensor of ids), not a sequence of characters
        n_ctx = self.spec.n_ctx
        pending: list[torch.Tensor] = []
        for text in texts:
            if isinstance(text, str):
                if not text:
                    continue  # an empty document contributes no tokens
                if self.tokenizer is None:
                    raise ValueError("this probe has no tokenizer: pass token ids, or Probe(model, tokenizer=...)")
                ids = self.encode(text)
            else:
                ids = torch.as_tensor(text)
            ids = ids if ids.dim() == 2 else ids.reshape(1, -1)
            for row in ids:
                for start in range(0, row.shape[0], n_ctx):
                    chunk, _ = self.tokenize(row[start : start + n_ctx])  # validates ids
                    pending.append(chunk[0])
                    if len(pending) == batch_size:
                        yield self._pad(pending)
                        pending = []
        if pending:
            yield self._pad(pending)

    def _pad(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
        P = max(r.shape[0] for r in rows)
        tokens = torch.zeros(len(rows), P, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(rows), P, dtype=torch.bool, device=self.device)
        for i, r in enumerate(rows):
            tokens[i, : r.shape[0]] = r
            mask[i, : r.shape[0]] = True
        return tokens, mask, [self._str_tokens(r) for r in rows]

    def run_corpus(
        self,
        texts: Iterable[str],
        batch_size: int = 8,
        backward: bool = False,
        contributions: bool = True,
        progress: bool = True,
        keep_traces: bool = False,
    ):
        """Stream many texts through the model, keeping running aggregates in bounded memory.

        Each text is split into n_ctx-token windows; windows are batched (right-padded).
        Memory is that of one batch plus the aggregates, whatever the corpus size.

        Args:
            texts: strings (or token-id sequences); a single string counts as one text.
            batch_size: windows per forward pass.
            backward: also aggregate gradient norms (one backward per batch).
            contributions: aggregate contribution shares.
            progress: show a tqdm progress bar.
            keep_traces: also return the per-batch traces (unbounded memory; for tests).

        Returns:
            :class:`~attnres_probe.stats.CorpusStats` (and the list of traces with ``keep_traces``).
        """
        from tqdm.auto import tqdm

        from attnres_probe.stats import CorpusStats

        stats = CorpusStats.empty(self.spec.meta)
        traces = []
        bar = tqdm(self.batches(texts, batch_size), desc=f"recording {self.name}", unit="batch", disable=not progress)
        for tokens, mask, str_tokens in bar:
            use_backward = backward and bool(mask[:, 1:].any())
            trace = self.record(tokens, mask, str_tokens, backward=use_backward, contributions=contributions)
            stats.update(trace)
            bar.set_postfix(tokens=stats.n_tokens)
            if keep_traces:
                traces.append(trace)
        if stats.n_tokens == 0:
            raise ValueError("the corpus produced no tokens: every text was empty")
        return (stats, traces) if keep_traces else stats

    # -- ablation ------------------------------------------------------------------------
    def ablate(self, text_or_tokens: Any, sources: Any = "all", reads: Any = None, mode: str = "zero", joint: bool = False, truncate: bool = False):
        """Remove sources from reads through the weight hooks and report the change in loss.

        See :func:`attnres_probe.ablation.ablate` for the arguments.
        """
        from attnres_probe.ablation import ablate

        return ablate(self, text_or_tokens, sources=sources, reads=reads, mode=mode, joint=joint, truncate=truncate)


def _squared_norms(grads: dict[int, torch.Tensor]) -> dict[int, float]:
    """Squared L2 norm of every gradient, keyed like ``grads`` (one fused op for all of them)."""
    keys = list(grads)
    tensors = [grads[k].detach() for k in keys]
    norms = torch.stack(torch._foreach_norm([t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]))
    return dict(zip(keys, norms.double().pow(2).tolist()))


def _group_norm(params: list[torch.nn.Parameter], sq: dict[int, float]) -> float:
    """L2 norm of the gradients of a group of parameters (NaN when none has one)."""
    parts = [sq[id(p)] for p in params if id(p) in sq]
    return math.sqrt(sum(parts)) if parts else float("nan")
