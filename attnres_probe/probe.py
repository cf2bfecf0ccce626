"""Probe: the notebook entry point. Runs text through a model with the recorder attached.

    probe = Probe(model)                      # an AttnResTransformer or a TransformerLens-style model
    trace = probe.run("The cat sat", backward=True)
    trace.weights(token=3)                    # reads x sources DataFrame
    stats = probe.run_corpus(texts, batch_size=8)
    probe.ablate("The cat sat", sources="embed")

Threads: recordings are per call. The probe's hooks act only on forward passes run by the
thread that records, so several threads may record (or ablate) through one model at the same
time, each getting exactly the trace a sequential call gives, and a plain ``model(tokens)`` on
another thread neither writes into a recording nor is changed by an ablation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from attnres_probe.hooks import Recorder, spec_for
from attnres_probe.losses import trace_loss
from attnres_probe.tokenizer import ByteTokenizer, check_token_ids
from attnres_probe.trace import DepthTrace

__all__ = ["Probe"]


class Probe:
    """Records depth routing, magnitudes and gradients of one model.

    Args:
        model: an :class:`~attnres_probe.AttnResTransformer`, or any TransformerLens-style
            PreNorm model exposing the hook points listed in :mod:`attnres_probe.hooks.spec`.
        tokenizer: turns text into ids (needs ``to_tokens(text)`` or ``encode(text)``, and
            optionally ``to_str_tokens``). Default: the model's ``tokenizer`` (an fla model's
            after :func:`~attnres_probe.load_pretrained`), else :class:`~attnres_probe.ByteTokenizer`
            for models with a 256-token vocabulary.
        name: label of this model in traces, charts and comparisons (default: its residual mode).

    Raises:
        MissingHooksError: the model lacks needed hook points (all of them are listed).
    """

    def __init__(self, model: Any, tokenizer: Any = None, name: str | None = None):
        self.model = model
        self.spec = spec_for(model, name)
        self._params = list(model.parameters())  # listed once: walking the module tree is slow
        if tokenizer is None:  # the model's own (TransformerLens's model.tokenizer; set by load_pretrained)
            tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None and self.spec.d_vocab == 256:
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
        from attnres_probe.text_api import is_text_list

        if is_text_list(text_or_tokens) and len(text_or_tokens) > 1:  # a batch of texts of equal token length
            rows = [self.tokenize(t, truncate)[0] for t in text_or_tokens]
            lengths = [int(r.shape[1]) for r in rows]
            if len(set(lengths)) > 1:
                raise ValueError(f"the texts are {lengths} tokens long; a batch needs texts of equal token length "
                                 "(no padding: the forward takes no attention mask); run them one by one")
            tokens = torch.cat(rows)
            return tokens, [self._str_tokens(row) for row in tokens]
        if is_text_list(text_or_tokens):
            text_or_tokens = text_or_tokens[0]
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
        patterns: bool | Sequence[int] = False,
        pattern_heads: Sequence[int] | None = None,
    ) -> DepthTrace:
        """Run text (or tokens [batch, pos]) and record everything.

        Args:
            text_or_tokens: a string, or token ids [pos] / [batch, pos].
            backward: also run a backward pass of the mean next-token loss and record
                per-token gradient norms at every mixed input and per-sublayer parameter
                gradient norms (the model's ``.grad`` fields are not touched). Default True:
                one text is cheap, and its gradients are half of what a trace shows.
            truncate: keep the first n_ctx tokens of a longer input instead of raising.
            contributions: compute contribution shares (skip to save time).
            patterns: also keep every layer's attention pattern in the trace (``trace.patterns``
                [batch, layer, head, query_pos, key_pos] float32, ``trace.pattern(layer, head,
                token=...)``): 4 bytes per entry, ``4 B n_layers n_heads P^2`` in all (2 MiB for
                one 128-token sequence of a demo model, 8 layers x 4 heads; 576 MiB for 1024
                tokens, 12 layers x 12 heads), kept on the CPU. They come from the recorded
                forward itself, whose hooks only look: every other number of the trace is bit
                for bit what it is without patterns; the forward computes each layer's scores
                and softmax explicitly besides SDPA. Default False: nothing is kept or computed.
                A list of layers keeps only those (``patterns=[0, 11]``; negative counts from the
                last), and only those layers run the explicit attention: a large model at a long
                context keeps ``4 B len(layers) len(heads) P^2`` bytes instead of every layer's.
            pattern_heads: with ``patterns``, keep only these heads of each kept layer (None: all).
                ``trace.pattern(layer, head)`` takes the model's own layer and head numbers and says
                which were recorded when asked for another.

        Returns:
            The :class:`DepthTrace`.
        """
        tokens, str_tokens = self.tokenize(text_or_tokens, truncate=truncate)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        return self.record(tokens, mask, str_tokens, backward=backward, contributions=contributions, patterns=patterns,
                           pattern_heads=pattern_heads)

    def record(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        str_tokens: list[list[str]],
        backward: bool = True,
        contributions: bool = True,
        extra_meta: dict | None = None,
        patterns: bool | Sequence[int] = False,
        pattern_heads: Sequence[int] | None = None,
    ) -> DepthTrace:
        """Record already-validated tokens [batch, pos] with a right-padding ``mask`` (``patterns``,
        ``pattern_heads``: see :meth:`run`)."""
        layers, heads = self._pattern_choice(patterns, pattern_heads)
        if backward and int(mask[:, 1:].sum()) == 0:
            raise ValueError(
                "a backward pass needs at least two tokens (the loss predicts token t+1); pass backward=False "
                "(--no-backward on the command line)"
            )
        spec = self.spec
        rec = Recorder(self.model, spec, contributions=contributions, gradients=backward)  # hooks scoped to this thread
        params = [p for p in self._params if p.requires_grad] if backward else []
        grads: dict[int, torch.Tensor] = {}
        pat = self._pattern_recorder(layers, heads=heads) if layers else contextlib.nullcontext()
        with rec, pat, torch.set_grad_enabled(backward):
            logits = self.logits(tokens)
            rec.raise_if_failed()
            per_tok, loss = trace_loss(logits, tokens, mask)
            if backward and params:
                got = torch.autograd.grad(loss, params, allow_unused=True)
                grads = {id(p): g for p, g in zip(params, got) if g is not None}
        rec.finish()
        arrays = {k: v.detach().cpu().numpy() for k, v in rec.arrays().items()}
        native = {k: v.cpu().numpy() for k, v in rec.native_arrays().items()}
        L = spec.n_sublayers
        param_grad = np.full(L, np.nan, np.float32)
        mixer_grad = np.full(L + 1, np.nan, np.float32)
        if grads:
            sq = _squared_norms(grads)
            param_grad[:] = [_group_norm(ps, sq) for ps in spec.sublayer_params]
            if spec.mixer_params:
                mixer_grad[:] = [_group_norm(ps, sq) for ps in spec.mixer_params]
        param = next(iter(self.model.parameters()), None)
        meta = {
            **spec.meta,
            **self.kernels(),
            "device": str(self.device),  # where and in which dtype it ran (--device / --dtype)
            "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
            "str_tokens": [row[: int(m.sum())] for row, m in zip(str_tokens, mask.cpu())],
            "backward": bool(backward),
            "mean_loss": float(loss.detach()),
        }
        if layers:
            meta.update(pattern_layers=layers, pattern_heads=heads if heads is not None else list(range(self._n_heads())),
                        pattern_n_heads=self._n_heads())
        if extra_meta:
            meta.update(extra_meta)
        return DepthTrace(
            tokens=tokens.cpu().numpy(),
            mask=mask.cpu().numpy(),
            loss=per_tok.detach().cpu().numpy(),
            param_grad=param_grad,
            mixer_grad=mixer_grad,
            meta=meta,
            patterns=pat.result().numpy() if layers else None,
            native=native or None,
            **arrays,
        )

    def memory_estimate(self, n_tokens: int, batch: int = 1, backward: bool = True, patterns: bool | Sequence[int] = False,
                        pattern_heads: Sequence[int] | None = None) -> dict[str, int]:
        """About how many bytes a recording of ``batch`` sequences of ``n_tokens`` tokens holds, by part:
        ``weights`` (parameters), ``gradients`` (their gradients, with ``backward``), ``activations`` (what
        the forward keeps for the backward: per token and layer about ``34 d + 5 h P`` values and the L+1
        sources, at the model's dtype; a forward alone keeps a few layers' worth), ``trace`` (the three
        [reads x sources] cubes and per-token vectors, float32) and ``patterns`` (4 l h P^2 bytes per
        sequence for the l layers and h heads kept); ``total`` their sum. A rough bound, to say before a long recording what it needs."""
        param = next(iter(self.model.parameters()), None)
        size = param.element_size() if param is not None else 4
        n_params = sum(p.numel() for p in self.model.parameters())
        cfg = getattr(self.model, "cfg", None)
        d = getattr(cfg, "d_model", 0) or 0
        heads = getattr(cfg, "n_heads", 0) or 0
        L = self.spec.n_layers
        R, S = self.spec.n_sublayers + 1, len(self.spec.source_labels)
        tokens = batch * n_tokens
        kept_layers, kept_heads = self._pattern_choice(patterns, pattern_heads) if self.spec.pattern_hooks else ([], None)
        n_layers_kept = len(kept_layers)
        n_heads_kept = heads if kept_heads is None else len(kept_heads)
        per_layer = (34 * d + 5 * heads * n_tokens) * size
        acts = tokens * (L * per_layer + (2 * L + 1) * d * size)
        out = {
            "weights": n_params * size,
            "gradients": n_params * size if backward else 0,
            "activations": acts if backward else tokens * 2 * per_layer,
            "trace": tokens * (12 * R * S + 4 * (2 * R + 2 * S + 4)),
            "patterns": 4 * n_layers_kept * n_heads_kept * n_tokens * tokens,
        }
        out["total"] = sum(out.values())
        return out

    def _n_heads(self) -> int:
        cfg = getattr(self.model, "cfg", None)
        return int(getattr(cfg, "n_heads", 0) or 0)

    def _pattern_choice(self, patterns: Any, heads: Any) -> tuple[list[int], list[int] | None]:
        """(the layers, the heads or None for all) that ``patterns`` / ``pattern_heads`` ask for, sorted and
        unique; ([], None) for none.

        Raises:
            TypeError: ``patterns`` neither a bool nor a list of layers, or ``pattern_heads`` without patterns.
            ValueError: a layer or head out of range, or an empty list.
        """
        if patterns is False or patterns is None:
            if heads is not None:
                raise TypeError("pattern_heads chooses heads of the recorded patterns: pass patterns=True (or a list "
                                "of layers) too")
            return [], None
        n = len(self.spec.pattern_hooks)
        if patterns is True:
            layers = list(range(n))
        elif isinstance(patterns, (str, bytes, float)) or not hasattr(patterns, "__iter__"):
            raise TypeError(f"patterns must be True, False or a list of layers (0..{n - 1}); got {patterns!r}")
        else:
            layers = _indices(patterns, n, "layer", "patterns")
        if heads is not None:
            heads = _indices(heads, self._n_heads(), "head", "pattern_heads")
        return layers, heads

    def _pattern_recorder(self, layers: list[int] | None = None, positions: Any = None, stop: bool = False,
                          heads: list[int] | None = None):
        """A :class:`~attnres_probe.hooks.patterns.PatternRecorder` on the given layers' ``hook_pattern`` (all: None).

        Raises:
            ValueError: the model has no attention-pattern hook points, or a layer is out of range.
        """
        from attnres_probe.hooks.patterns import PatternRecorder

        names = self.spec.pattern_hooks
        if not names:
            raise ValueError(f"{type(self.model).__name__} has no blocks.{{i}}.attn.hook_pattern hook points: "
                             "attention patterns cannot be recorded")
        n = len(names)
        layers = list(range(n)) if layers is None else [int(i) for i in layers]
        bad = [i for i in layers if not -n <= i < n]
        if bad:
            raise ValueError(f"layer {bad[0]} is out of range; the model has layers 0..{n - 1}")
        return PatternRecorder(self.model, [names[i] for i in layers], rows=positions, stop=stop, heads=heads)

    def static_routing(self, texts: Any, reads: bool = True):
        """The value of input-dependent routing: each read's weights replaced by their mean over ``texts``
        (one read at a time with ``reads``, and all at once), the loss change per window, per read and in
        total with intervals (:func:`attnres_probe.controls.static_routing`; 0 exactly where routing is
        static)."""
        from attnres_probe.controls import static_routing

        return static_routing(self, texts, reads=reads)

    def mask_sources(self, texts: Any, which: str = "nonrecent", seed: int | None = None, repeats: int = 5):
        """attnres4babylm's masking contrasts (``which``: ``"nonrecent"``, ``"random"``, ``"embed"``), the
        loss change per window and in total; ``"nonrecent"`` also nonrecent − random, count-matched and
        repeated ``repeats`` times (:func:`attnres_probe.controls.mask_sources`)."""
        from attnres_probe.controls import mask_sources

        return mask_sources(self, texts, which=which, seed=seed, repeats=repeats)

    def attention_patterns(
        self, text_or_tokens: Any, layers: Any = None, positions: Any = None, truncate: bool = False
    ) -> np.ndarray:
        """Attention patterns (``blocks.{i}.attn.hook_pattern``) of one forward pass without gradients.

        Only the layers asked for are hooked (the others run no explicit attention), and the
        forward ends at the last of them (the layers after it are not run).

        Args:
            text_or_tokens: a string, or token ids [pos] / [batch, pos].
            layers: transformer blocks to keep (ints; None: all), in the order given.
            positions: query positions to keep (None: all); keys are always every position.
            truncate: keep the first n_ctx tokens of a longer input instead of raising.

        Returns:
            float32 [batch, len(layers), head, len(positions) or pos, pos]: the softmax over key
            positions, 0 above the diagonal (4 bytes per entry).

        Raises:
            ValueError: the model has no attention-pattern hook points, or a layer is out of range.
        """
        from attnres_probe.hooks.patterns import PatternsComplete

        rec = self._pattern_recorder(None if layers is None else list(layers), positions, stop=True)
        tokens, _ = self.tokenize(text_or_tokens, truncate=truncate)
        with rec, torch.no_grad():
            try:
                self.logits(tokens)
            except PatternsComplete:
                pass  # every layer asked for is recorded: the rest of the forward is not needed
        return rec.result().numpy()

    def kernels(self) -> dict[str, str | None]:
        """What computed the depth mixing of a recording, as every trace's metadata records it:
        ``{"backend": "numba" | "triton" | "torch", "schedule": "sequential" | "two_phase"}``
        for an :class:`~attnres_probe.AttnResTransformer` (the schedule for Block AttnRes only),
        resolved for the model's device and dtype as its forward resolves them (mHC: the backend
        of its Sinkhorn); None for models without such kernels (PreNorm, plain Hyper-Connections,
        DenseFormer, other models)."""
        model = self.model
        residual = getattr(model, "residual", "prenorm")
        mhc = residual == "hyper" and bool(getattr(getattr(model, "cfg", None), "mhc", False))
        if residual not in ("full", "block") and not mhc or not hasattr(model, "resolve"):
            return {"backend": None, "schedule": None}
        backend, schedule = model.resolve(model.W_E)
        return {"backend": backend, "schedule": schedule if model.residual == "block" else None}

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
        pending: list[torch.Tensor] = []
        for _, _, chunk in self._corpus_windows(texts):
            pending.append(chunk)
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
        texts: Iterable[str | Sequence[int] | torch.Tensor],
        batch_size: int = 8,
        backward: bool = False,
        contributions: bool = True,
        progress: bool = True,
        keep_traces: bool = False,
        *,
        min_tokens: int = 2,
        window_grads: bool = True,
        stats: Any = None,
        first_doc: int = 0,
        resume_after: tuple[int, int] | None = None,
        on_batch: Any = None,
        on_progress: Any = None,
    ):
        """Stream many texts through the model, keeping running aggregates in bounded memory.

        Each text (a *document*) is split into n_ctx-token windows; windows are batched
        (right-padded). Besides the pooled aggregates, the returned stats keep every window's
        value of every headline metric (:func:`attnres_probe.analysis.window_metrics`), the
        unit of the bootstrap intervals of :func:`attnres_probe.metrics.compare`. Memory is that
        of one document and one batch plus the aggregates (a few dozen numbers per window).

        Args:
            texts: strings (or token-id sequences); a single string counts as one text.
            batch_size: windows per forward pass (without per-window gradients).
            backward: also aggregate gradient norms (one backward pass per window with
                ``window_grads``). Default False: a corpus is large and a forward is enough for
                routing; ``attnres-probe corpus`` turns it on (``--no-backward`` turns it off).
            contributions: aggregate contribution shares.
            progress: show a tqdm progress bar (windows).
            keep_traces: also return the per-batch traces (unbounded memory; for tests).
            min_tokens: windows with fewer tokens are left out and counted in
                ``stats.n_skipped`` (the loss, and so every gradient, needs two tokens).
            window_grads: with ``backward``, run one backward pass per window, so each window
                has its own parameter-gradient norms (per-window parameter-gradient metrics);
                False runs one backward per batch (those metrics then exist only pooled).
            stats: a :class:`~attnres_probe.corpus.stats.CorpusStats` of this model to continue.
            first_doc: the document index of the first text (documents are numbered from it).
            resume_after: (document, offset) of the last window already recorded: windows up
                to and including it are skipped (a resumed run).
            on_batch: called as ``on_batch(stats, (doc, offset))`` after every recorded batch,
                with the key of its last window (for saving progress). Under ``torchrun`` the
                stats are this rank's.
            on_progress: called with the number of tokens recorded so far after every batch
                (under ``torchrun``: by all ranks together).

        Under ``torchrun`` (or in a process group the caller initialised) each rank records
        its shard of the texts (text ``i`` belongs to rank ``i % world``), the ranks advance in
        lock step, and every rank returns the merged stats of all texts
        (:mod:`attnres_probe.corpus.distributed`). ``stats`` and ``resume_after`` are then this rank's.
        The recording itself is :func:`attnres_probe.corpus.stream.run_corpus`.

        Returns:
            :class:`~attnres_probe.corpus.stats.CorpusStats` (and the list of traces with ``keep_traces``).

        Raises:
            ValueError: the corpus has no window of at least ``min_tokens`` tokens; ``stats``
                from another model.
            DistributedRunError: under ``torchrun``, a rank failed or stopped (on every rank).
        """
        from attnres_probe.corpus.stream import run_corpus

        return run_corpus(
            self, texts, batch_size=batch_size, backward=backward, contributions=contributions, progress=progress,
            keep_traces=keep_traces, min_tokens=min_tokens, window_grads=window_grads, stats=stats, first_doc=first_doc,
            resume_after=resume_after, on_batch=on_batch, on_progress=on_progress,
        )

    def _corpus_windows(
        self, texts: Iterable[str | Sequence[int] | torch.Tensor], first_doc: int = 0
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(document index, offset of the window's first token, ids [n]) of every n_ctx-token window."""
        if isinstance(texts, (str, torch.Tensor)):
            texts = [texts]  # one text (or one tensor of ids), not a sequence of characters
        n_ctx = self.spec.n_ctx
        for doc, text in enumerate(texts, start=first_doc):
            if hasattr(text, "iter_bytes") and isinstance(self.tokenizer, ByteTokenizer):
                # byte tokens: windows cut from the file chunk by chunk (memory: one chunk, not the document)
                carry, offset = b"", 0
                for chunk in text.iter_bytes():
                    buf = carry + chunk
                    full = len(buf) // n_ctx * n_ctx
                    for start in range(0, full, n_ctx):
                        yield doc, offset + start, torch.frombuffer(bytearray(buf[start : start + n_ctx]), dtype=torch.uint8).long().to(self.device)
                    offset += full
                    carry = buf[full:]
                if carry:
                    yield doc, offset, torch.frombuffer(bytearray(carry), dtype=torch.uint8).long().to(self.device)
                continue
            if hasattr(text, "read_text"):
                text = text.read_text()
            if isinstance(text, str):
                if not text:
                    continue  # an empty document contributes no tokens
                if self.tokenizer is None:
                    raise ValueError("this probe has no tokenizer: pass token ids, or Probe(model, tokenizer=...)")
                ids = self.encode(text)
            else:
                ids = _token_ids(text, doc)
            rows = ids if ids.dim() == 2 else ids.reshape(1, -1)
            for r, row in enumerate(rows):  # rows of a [batch, pos] tensor: one after the other
                for start in range(0, row.shape[0], n_ctx):
                    chunk, _ = self.tokenize(row[start : start + n_ctx])  # validates ids
                    yield doc, r * row.shape[0] + start, chunk[0]

    # -- ablation ------------------------------------------------------------------------
    def ablate(self, text_or_tokens: Any, sources: Any = "all", reads: Any = None, mode: str = "zero", joint: bool = False, truncate: bool = False):
        """Remove sources from reads through the weight hooks and report the change in loss.

        See :func:`attnres_probe.ablation.ablate` for the arguments.
        """
        from attnres_probe.ablation import ablate

        return ablate(self, text_or_tokens, sources=sources, reads=reads, mode=mode, joint=joint, truncate=truncate)

    # -- routing patching ----------------------------------------------------------------
    def patch(self, clean: Any, corrupted: Any, metric: Any = None, *, position: int | None = None, reads: Any = None,
              per_source: bool = False, what: str = "weights", positions: Any = None, joint: bool = False,
              batch_size: int = 32, truncate: bool = False):
        """Patch one read's depth weights (or whole input) from a clean run into a corrupted run of the
        same token length and report the fraction of the metric recovered,
        ``(m_patched - m_corrupted) / (m_clean - m_corrupted)``, per read (or read and source).

        Default metric: ``logits[position, clean_top] - logits[position, corrupted_top]`` (each run's
        predicted next token); ``position=None`` (default) takes the last position where the two runs'
        predictions differ (``frame.attrs["position"]``; a ValueError lists what each run predicts when
        none differs). PreNorm models are refused (fixed routing). Sanity checks: patching
        nothing recovers 0, the final read's whole input (``what="input", reads=["final"]``) 1. See
        :func:`attnres_probe.patching.patch` for every argument and the conventions.

        Lists of prompts (``clean`` and ``corrupted`` of the same length, pairs of equal token length)
        patch pair by pair: one frame with a ``pair`` column (its index), each pair's metrics and
        position in ``frame.attrs["pairs"]``.
        """
        from attnres_probe.patching import patch
        from attnres_probe.text_api import is_text_list

        if is_text_list(clean) or is_text_list(corrupted):
            if not (is_text_list(clean) and is_text_list(corrupted)) or len(clean) != len(corrupted):
                raise ValueError("clean and corrupted must both be texts, or lists of texts of the same length (pairs); got "
                                 f"{type(clean).__name__} of {len(clean) if isinstance(clean, (list, tuple)) else 1} and "
                                 f"{type(corrupted).__name__} of {len(corrupted) if isinstance(corrupted, (list, tuple)) else 1}")
            import pandas as pd

            frames = [self.patch(c, x, metric, position=position, reads=reads, per_source=per_source, what=what,
                                 positions=positions, joint=joint, batch_size=batch_size, truncate=truncate)
                      for c, x in zip(clean, corrupted)]
            out = pd.concat([f.assign(pair=i) for i, f in enumerate(frames)], ignore_index=True)
            out.attrs = {**frames[0].attrs, "pairs": [dict(f.attrs) for f in frames]}
            return out
        return patch(self, clean, corrupted, metric, position=position, reads=reads, per_source=per_source, what=what,
                     positions=positions, joint=joint, batch_size=batch_size, truncate=truncate)

    # -- reading the residual stream (routing-aware) -------------------------------------
    def _own_model(self, what: str) -> None:
        if not hasattr(self.model, "axis") or not hasattr(self.model, "out_res") and self.spec.residual != "prenorm":
            raise ValueError(f"{what} reads an AttnResTransformer's mixers and final norm; {type(self.model).__name__} is not one")

    def _decode(self):
        tok = self.tokenizer
        return (lambda ids: str(tok.decode(ids))) if tok is not None and hasattr(tok, "decode") else None

    def logit_contributions(self, text_or_tokens: Any, token: int = -1, batch: int = 0, truncate: bool = False):
        """Each source's direct contribution to the logits at one token: the final read's
        mixture ``sum_i alpha_i v_i`` through the final norm (its scale from this run) and
        the unembedding, split by source; the contributions add up to the model's logits.

        Returns:
            :class:`~attnres_probe.lens.LogitContributions` (``.frame(k)`` for a table of the
            contributions to the top-k predictions).
        """
        from attnres_probe.lens import logit_contributions

        self._own_model("logit_contributions")
        tokens, _ = self.tokenize(text_or_tokens, truncate=truncate)
        return logit_contributions(self.model, tokens, position=token, batch=batch, decode=self._decode())

    def logit_lens(self, text_or_tokens: Any, k: int = 5, positions: list[int] | None = None, batch: int = 0, truncate: bool = False):
        """What every read predicts: its mixed input through the final norm and the
        unembedding, top ``k`` tokens per read and position (a long DataFrame; see
        :func:`attnres_probe.lens.logit_lens`)."""
        from attnres_probe.lens import logit_lens

        self._own_model("logit_lens")
        tokens, _ = self.tokenize(text_or_tokens, truncate=truncate)
        return logit_lens(self.model, tokens, k=k, batch=batch, positions=positions, decode=self._decode())

    def token_readings(self, text_or_tokens: Any, positions: list[int] | None = None, k: int = 5, batch: int = 0,
                       truncate: bool = False):
        """:meth:`logit_contributions` at each of ``positions`` (default: every token) and
        :meth:`logit_lens` of those positions from one forward, as the dashboard's per-token view
        and the report's explorer show them (:func:`attnres_probe.lens.token_readings`).

        Returns:
            ([:class:`~attnres_probe.lens.LogitContributions` per position], the logit-lens frame)
        """
        from attnres_probe.lens import token_readings

        self._own_model("token_readings")
        tokens, _ = self.tokenize(text_or_tokens, truncate=truncate)
        return token_readings(self.model, tokens, positions=positions, k=k, batch=batch, decode=self._decode())


def _token_ids(text: Any, index: int) -> torch.Tensor:
    """Token ids [pos] or [batch, pos] of a corpus entry that is not a string.

    Raises:
        TypeError: the entry is neither a string nor a sequence (or tensor) of integer ids.
    """
    if isinstance(text, (bytes, bytearray)) or text is None or isinstance(text, (int, float, dict)):
        raise TypeError(
            f"text {index} of the corpus is {type(text).__name__} {text!r:.40}; pass strings or sequences of "
            "integer token ids"
        )
    try:
        ids = torch.as_tensor(text)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"text {index} of the corpus ({type(text).__name__}) is neither a string nor a sequence of integer "
            "token ids"
        ) from None
    if ids.dim() not in (1, 2):
        raise TypeError(f"text {index} of the corpus has {ids.dim()} dimensions; token ids are [pos] or [batch, pos]")
    return ids


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


def _indices(values: Any, n: int, what: str, flag: str) -> list[int]:
    """``values`` as sorted unique indices into 0..n-1 (negative ones counted from the end).

    Raises:
        TypeError: not integers. ValueError: empty, or out of range.
    """
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{flag} must be a list of {what} indices; got {values!r}") from None
    if not items:
        raise ValueError(f"{flag} is empty; give at least one {what} (0..{n - 1})")
    out = set()
    for v in items:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{flag} holds {v!r}; {what}s are integers 0..{n - 1}")
        if not -n <= int(v) < n:
            raise ValueError(f"{flag}: {what} {int(v)} is out of range; the model has {what}s 0..{n - 1}")
        out.add(int(v) % n)
    return sorted(out)
