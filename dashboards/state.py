"""Server-side state of the dashboard: the loaded models, a bounded cache of traces, validation.

The browser never holds arrays. A prompt run through the models becomes one *result* (a dict
model name -> :class:`~attnres_probe.DepthTrace`), stored here under a short key derived from
the text; the browser keeps only that key. Every callback looks the traces up by key.

    ex = Explorer({"prenorm": base_model, "block": block_model}, text="The cat sat")
    key = ex.run("A new prompt")          # records every model, caches, returns the key
    traces = ex.traces(key)               # {"prenorm": DepthTrace, "block": DepthTrace}

Models are not thread-safe under the recorder (it attaches hooks to them), so every model run
holds one lock; cache look-ups hold another, short one. Both make the explorer safe under a
multi-threaded WSGI server (waitress, several threads, one process).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from attnres_probe import figures
from attnres_probe.ablation import MODES as ABLATION_MODES
from attnres_probe.ablation import weight_beside_effect
from attnres_probe.axis import rule_title
from attnres_probe.probe import Probe
from attnres_probe.texts import SHORT_TEXT
from attnres_probe.trace import DepthTrace

__all__ = ["ABLATION_MODES", "DEFAULT_TEXT", "Explorer", "PromptError", "Result", "UnknownKeyError"]

DEFAULT_TEXT = SHORT_TEXT  # a passage of a play the demo models never trained on (attnres_probe.texts)
KEY_PATTERN = re.compile(r"^[a-z]+-[0-9a-f]{16}$")
CHARS_PER_TOKEN_LIMIT = 8  # raw-length cap before tokenising: max_chars = this * n_ctx (at least 1024) ...
MAX_CHARS = 1 << 16  # ... and at most this (models without a real context limit)


def whole_number(value: Any) -> int | None:
    """A value from the browser (JSON: an int, or a float such as 3.0) as an int; None for anything
    else (booleans, strings, fractions), which the callbacks treat as "not given"."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


class PromptError(ValueError):
    """A prompt the models cannot run (empty, too long, bad characters); the message says why."""


class UnknownKeyError(KeyError):
    """A result key the server does not know (expired from the cache with no text to redo it, or forged)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown result key"


@dataclass
class Result:
    """One text run through every model: traces by model name, in the explorer's order."""

    key: str
    text: str | None
    traces: dict[str, DepthTrace]
    nbytes: int = 0
    ablations: OrderedDict = field(default_factory=OrderedDict)
    comparison: Any = None  # metrics.compare of its traces, made once (the headline table and the cards share it)

    def compared(self) -> Any:
        """``metrics.compare`` of the traces (one window: estimates, no intervals), computed once."""
        if self.comparison is None:
            from attnres_probe import metrics

            self.comparison = metrics.compare(*self.traces.values(), names=list(self.traces))
        return self.comparison

    @property
    def first(self) -> DepthTrace:
        return next(iter(self.traces.values()))

    @property
    def str_tokens(self) -> list[str]:
        """Tokens of sequence 0 of the first trace (the token strip)."""
        return list(self.first.str_tokens[0])


class ViewTrace(DepthTrace):
    """A DepthTrace that remembers its expanded (sublayer-axis) cubes: the dashboard redraws the
    expanded view for every token click, and expanding copies the whole cube."""

    def expanded(self, kind: str = "weights"):
        memo = self.__dict__.setdefault("_expanded_memo", {})
        if kind not in memo:
            memo[kind] = super().expanded(kind)
        return memo[kind]

    @classmethod
    def of(cls, trace: DepthTrace, name: str | None = None) -> "ViewTrace":
        meta = trace.meta if name is None or name == trace.name else {**trace.meta, "name": name}
        return cls(**{n: getattr(trace, n) for n in _ARRAYS}, meta=meta, patterns=trace.patterns)


def _trace_bytes(trace: DepthTrace) -> int:
    return sum(getattr(trace, n).nbytes for n in ("depth_weights", "logits", "contrib", "rms_in", "grad_in", "rms_out"))


class Explorer:
    """Models and/or saved traces, and the traces recorded for every prompt (bounded LRU).

    Args:
        entries: name -> AttnResTransformer, Probe or DepthTrace (a saved trace), in display
            order; or a sequence of them (named by their residual / ``.name``). With no model
            at all the explorer is in traces-only mode: no new prompts.
        text: the initial prompt for the models (default :data:`DEFAULT_TEXT`, cut to the
            context); in traces-only mode the saved traces' own tokens are shown.
        cache_size: results kept besides the initial one (least recently used dropped first).
        cache_bytes: also drop results while the cached arrays exceed this many bytes.
        stats: name -> :class:`~attnres_probe.corpus.stats.CorpusStats` of a recorded corpus
            (``attnres-probe corpus``): the page then leads with the corpus comparisons.
        n_resamples, seed: the bootstrap of those comparisons.

    Raises:
        ValueError: no entries, an entry of another type, or an initial text the models reject.
    """

    def __init__(
        self,
        entries: Mapping[str, Any] | Sequence[Any],
        text: str | None = None,
        cache_size: int = 16,
        cache_bytes: int = 512 * 2**20,
        stats: Mapping[str, Any] | None = None,
        n_resamples: int = 1000,
        seed: int = 0,
    ):
        named = _name_entries(entries)
        self.study: dict[str, Any] | None = None  # a study-v3 summary shown beside the models (create_app sets it)
        self.names: list[str] = list(named)
        self.probes: dict[str, Probe] = {}
        self.saved: dict[str, DepthTrace] = {}
        for name, obj in named.items():
            if isinstance(obj, DepthTrace):
                self.saved[name] = ViewTrace.of(obj, name)
            elif isinstance(obj, Probe):
                self.probes[name] = obj if obj.name == name else Probe(obj.model, obj.tokenizer, name=name)
            elif hasattr(obj, "parameters"):
                self.probes[name] = Probe(obj, name=name)
            else:
                raise ValueError(
                    f"entry {name!r} is a {type(obj).__name__}; pass an AttnResTransformer, a Probe or a DepthTrace"
                )
        for p in self.probes.values():
            p.model.eval()
        self.colors = figures.model_colors(self.names)
        self.residuals = {
            **{n: p.spec.residual for n, p in self.probes.items()},
            **{n: t.residual for n, t in self.saved.items()},
        }
        self.n_ctx: int | None = min((p.spec.n_ctx for p in self.probes.values()), default=None)
        self.max_chars = min(max(1024, CHARS_PER_TOKEN_LIMIT * self.n_ctx), MAX_CHARS) if self.n_ctx else 0
        self.cache_size = max(1, int(cache_size))
        self.cache_bytes = int(cache_bytes)
        self._cache: OrderedDict[str, Result] = OrderedDict()
        self._texts: OrderedDict[str, str] = OrderedDict()  # key -> text, to redo an evicted result
        self._cache_lock = threading.Lock()
        self._model_lock = threading.RLock()
        # routing over training (train --probe-every N), for models loaded from a run folder that recorded it
        self.histories: dict[str, list] = {
            n: p.model.train_history for n, p in self.probes.items() if getattr(p.model, "train_history", None)
        }
        self.initial = self._initial_result(text)
        self.stats: dict[str, Any] = dict(stats or {})
        self.stats_frame: pd.DataFrame | None = None
        if self.stats:
            from attnres_probe import metrics

            self.stats_frame = metrics.compare(*self.stats.values(), names=list(self.stats), n_resamples=n_resamples, seed=seed)

    # -- description ------------------------------------------------------------------------
    @property
    def live(self) -> bool:
        """True when at least one model can run new prompts."""
        return bool(self.probes)

    @property
    def baseline(self) -> str | None:
        """Name of the first PreNorm entry (the baseline every AttnRes model is compared with)."""
        return next((n for n in self.names if self.residuals[n] == "prenorm"), None)

    @property
    def attnres_probes(self) -> list[str]:
        """Names of live models with depth weights (AttnRes, Hyper-Connections, DenseFormer: the ones routing
        ablation and patching work on)."""
        return [n for n, p in self.probes.items() if p.spec.residual != "prenorm"]

    def residual_of(self, name: str) -> str:
        """The residual rule of an entry ("prenorm", "full", "block", ...)."""
        return self.probes[name].spec.residual if name in self.probes else self.saved[name].residual

    def describe(self, name: str, short: bool = False) -> str:
        """One line about an entry: 'Block AttnRes · 8 layers · n_ctx 128' (+ 'saved trace');
        ``short``: without the context length ('Block AttnRes · 8 layers')."""
        if name in self.probes:
            spec = self.probes[name].spec
            parts = [rule_title(spec.residual, spec.meta.get("config")), f"{spec.n_layers} layers"]
            parts += [] if short else [f"n_ctx {spec.n_ctx}"]
        else:
            t = self.saved[name]
            parts = [rule_title(t.residual, t.meta.get("config")), f"{len(t.sublayer_labels) // 2} layers", "saved trace"]
        return " · ".join(parts)

    def source_options(self) -> list[str]:
        """Every source label of every entry, in order of first appearance ('embed' first)."""
        labels: dict[str, None] = {}
        for name in self.names:
            src = self.probes[name].spec.source_labels if name in self.probes else self.saved[name].source_labels
            labels.update(dict.fromkeys(src))
        return list(labels)

    def read_options(self, name: str) -> list[str]:
        """Reads of a live model that have more than one source (the ones worth ablating)."""
        spec = self.probes[name].spec
        return spec.read_labels[1:]

    # -- prompts ------------------------------------------------------------------------------
    def check_text(self, text: Any) -> str:
        """Validate a prompt for every model; returns it, or raises :class:`PromptError`."""
        self._tokenize(text)
        return text

    def _tokenize(self, text: Any) -> dict[str, torch.Tensor]:
        """Validate a prompt for every model and return its ids, model name -> [1, n].

        Each model's tokenizer runs once; recording the prompt reuses these ids.

        Raises:
            PromptError: see :meth:`check_text`.
        """
        if not self.live:
            raise PromptError("traces-only mode: this dashboard shows saved traces and has no model to run new text")
        if not isinstance(text, str):
            raise PromptError(f"the prompt must be text; got {type(text).__name__}")
        if not text:
            raise PromptError("the prompt is empty: type at least one character")
        if len(text) > self.max_chars:
            raise PromptError(
                f"text has {len(text)} characters; the limit is {self.max_chars} "
                f"(the models' context is {self.n_ctx} tokens)"
            )
        tokens: dict[str, torch.Tensor] = {}
        for name, probe in self.probes.items():
            try:
                tokens[name] = ids = probe.encode(text)
                n = int(ids.shape[-1])
            except Exception as exc:
                raise PromptError(f"{name}: cannot tokenise the text ({exc})") from None
            if n > probe.spec.n_ctx:
                whose = "the models'" if len({p.spec.n_ctx for p in self.probes.values()}) == 1 else f"{name!r}'s"
                raise PromptError(
                    f"text has {n} tokens; {whose} context is {probe.spec.n_ctx} tokens: "
                    f"shorten it by {n - probe.spec.n_ctx} tokens"
                )
            if n == 0:
                raise PromptError("the text has no tokens: type at least one character")
        return tokens

    @staticmethod
    def key_for(text: str, kind: str = "text") -> str:
        return f"{kind}-{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"

    def run(self, text: Any) -> str:
        """Record ``text`` with every model (cached) and return its key.

        Raises:
            PromptError: the text is empty, too long, or the models reject it.
        """
        tokens = self._tokenize(text)
        if text == self.initial.text:
            return self.initial.key
        key = self.key_for(text)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return key
        self._store(self._record(key, text, tokens, extra={}))
        return key

    def _record(
        self, key: str, text: str, tokens: Mapping[str, torch.Tensor] | None, extra: dict[str, DepthTrace]
    ) -> Result:
        """Run every live model on ``text``: on its ``tokens`` (name -> [1, n]) when given, else
        tokenizing the text once per model. Saved traces in ``extra`` join the result."""
        traces: dict[str, DepthTrace] = {}
        with self._model_lock:
            for name in self.names:
                if name in self.probes:
                    probe = self.probes[name]
                    ids = tokens[name] if tokens is not None else probe.encode(text)  # [1, n]
                    traces[name] = ViewTrace.of(probe.run(ids, backward=ids.shape[-1] >= 2))
                elif name in extra:
                    traces[name] = extra[name]
        # expanded views of block traces are remembered: count them twice
        return Result(key, text, traces, nbytes=sum(_trace_bytes(t) * (2 if t.residual == "block" else 1) for t in traces.values()))

    def _store(self, result: Result) -> None:
        with self._cache_lock:
            self._cache[result.key] = result
            self._cache.move_to_end(result.key)
            if result.text is not None:
                self._texts[result.key] = result.text
                while len(self._texts) > 4096:
                    self._texts.popitem(last=False)
            total = sum(r.nbytes for r in self._cache.values())
            while len(self._cache) > self.cache_size or (total > self.cache_bytes and len(self._cache) > 1):
                _, old = self._cache.popitem(last=False)
                total -= old.nbytes

    def _initial_result(self, text: str | None) -> Result:
        if not self.live:
            first = self.saved[self.names[0]]
            key = self.key_for("\x00".join(self.names) + "".join(first.str_tokens[0]), kind="saved")
            return Result(key, None, dict(self.saved), sum(_trace_bytes(t) for t in self.saved.values()))
        if text is None:
            text = DEFAULT_TEXT
            limit = min(self.n_ctx or len(text), len(text))
            text = text[:limit]
        try:
            tokens = self._tokenize(text)
        except PromptError as exc:
            raise ValueError(f"initial text: {exc}") from None
        key = self.key_for(text, kind="initial")
        return self._record(key, text, tokens, extra=self.saved)

    def result(self, key: Any) -> Result:
        """The result stored under ``key``; an evicted one is recorded again from its text.

        Raises:
            UnknownKeyError: the key is malformed, or unknown and its text is gone.
        """
        if not isinstance(key, str) or not KEY_PATTERN.match(key):
            raise UnknownKeyError("no result: the page's result key is missing or malformed; run the prompt again")
        if key == self.initial.key:
            return self.initial
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            text = self._texts.get(key)
        if text is None or not self.live:
            raise UnknownKeyError("this result is no longer on the server (it restarted?): run the prompt again")
        result = self._record(key, text, None, extra={})
        self._store(result)
        return result

    def traces(self, key: Any) -> dict[str, DepthTrace]:
        """name -> DepthTrace for ``key`` (see :meth:`result`)."""
        return self.result(key).traces

    # -- ablation -----------------------------------------------------------------------------
    def ablate(self, key: Any, name: Any, read: Any, mode: Any = "zero") -> pd.DataFrame:
        """Routing ablation of every source at one read of one live AttnRes model (cached per result).

        Returns:
            The frame of :func:`attnres_probe.ablation.ablate` (read, source, mode, mass, contrib,
            base_loss, loss, delta_loss).

        Raises:
            PromptError: the model, read or mode is not one of the offered ones, or the text is
                shorter than two tokens.
        """
        if name not in self.attnres_probes:
            raise PromptError(f"choose one of the live AttnRes models {self.attnres_probes} for an ablation")
        if read not in self.read_options(name):
            raise PromptError(f"read {read!r} is not one of {self.read_options(name)}")
        if mode not in ABLATION_MODES:
            raise PromptError(f"mode {mode!r} is not one of {', '.join(ABLATION_MODES)}")
        result = self.result(key)
        if result.text is None:
            raise PromptError("this result has no text to ablate on")
        ck = (name, read, mode)
        with self._cache_lock:
            if ck in result.ablations:
                return result.ablations[ck]
        if result.traces[name].n_tokens < 2:
            raise PromptError("ablation measures the next-token loss: the text needs at least two tokens")
        tokens = torch.from_numpy(result.traces[name].tokens.copy())  # the ids it was recorded on: no new tokenizing
        with self._model_lock:
            frame = self.probes[name].ablate(tokens, sources="all", reads=[read], mode=mode)
        with self._cache_lock:
            result.ablations[ck] = frame
            while len(result.ablations) > 32:
                result.ablations.popitem(last=False)
        return frame


    def weight_effect(self, key: Any) -> dict[str, pd.DataFrame]:
        """Weight beside effect (:func:`attnres_probe.ablation.weight_beside_effect`) of every live
        model on the result's tokens (cached per result): model name -> one row per deep read.

        Raises:
            PromptError: no live model, or the text is shorter than two tokens.
        """
        if not self.probes:
            raise PromptError("weight beside effect needs a live model; this dashboard has saved traces only")
        result = self.result(key)
        out: dict[str, pd.DataFrame] = {}
        for name, probe in self.probes.items():
            ck = ("weight-effect", name)
            with self._cache_lock:
                if ck in result.ablations:
                    out[name] = result.ablations[ck]
                    continue
            if result.traces[name].n_tokens < 2:
                raise PromptError("weight beside effect measures the next-token loss: the text needs at least two tokens")
            tokens = torch.from_numpy(result.traces[name].tokens.copy())
            with self._model_lock:
                frame = weight_beside_effect(probe, tokens)
            with self._cache_lock:
                result.ablations[ck] = out[name] = frame
                while len(result.ablations) > 32:
                    result.ablations.popitem(last=False)
        return out


_ARRAYS = ("tokens", "mask", "loss", "depth_weights", "logits", "contrib", "rms_in", "grad_in", "rms_out", "grad_out",
           "param_grad", "mixer_grad")


def _name_entries(entries: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
    if isinstance(entries, Mapping):
        named = {str(k): v for k, v in entries.items()}
    elif isinstance(entries, (DepthTrace, Probe)) or hasattr(entries, "parameters"):
        named = _auto_names([entries])
    else:
        named = _auto_names(list(entries))
    if not named:
        raise ValueError("the dashboard needs at least one model or trace")
    return named


def _auto_names(items: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for obj in items:
        if isinstance(obj, (DepthTrace, Probe)):
            base = obj.name
        else:
            base = getattr(getattr(obj, "cfg", None), "residual", None) or type(obj).__name__
        name, i = base, 2
        while name in out:
            name, i = f"{base} ({i})", i + 1
        out[name] = obj
    return out
