"""Settings of a training run: :class:`TrainConfig`, its validation, and :class:`TrainError`.

The model's shape lives in :class:`~attnres_probe.config.ModelConfig`; this is the rest:
optimisation, schedule, data and evaluation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnres_probe.config import ConfigError, ModelConfig, dataclass_from_dict
from attnres_probe.data import NAMED_CORPORA, SPLITS

__all__ = ["TrainConfig", "TrainError", "memory_estimate", "require_float", "require_int"]


class TrainError(ValueError):
    """A run cannot start or continue: inconsistent resume state, diverged loss, occupied folder."""


@dataclass
class TrainConfig:
    """Optimisation and data settings of one run (the model's shape lives in ModelConfig)."""

    steps: int = 2000  # optimizer updates in the whole run
    batch_size: int = 16  # windows per update
    seq_len: int | None = None  # tokens per window (None: the model's n_ctx); each window holds seq_len + 1
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int | None = None  # linear warm-up (None: min(100, steps // 10))
    weight_decay: float = 0.1  # AdamW decay on matrices only (not norms, biases, embeddings, mixers)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    eval_every: int = 200  # validate (and save resumable state) every this many steps; 0: only at the end
    eval_batches: int = 8  # validation batches of batch_size windows
    seed: int = 0  # batch order and torch's global RNG (model init uses ModelConfig.seed)
    corpus: str = "pydoc"  # "pydoc" | "shakespeare" | path to a UTF-8 text file
    val_fraction: float = 0.1  # with split="tail": the last share of the corpus held out for validation
    split: str = "tail"  # "tail" (the last val_fraction of the tokens) | "plays" (shakespeare: whole held-out plays)
    probe_every: int = 0  # record the probe windows' routing every this many steps (0: never)
    probe_windows: int = 4  # how many held-out validation windows a probe records

    def __post_init__(self) -> None:
        if isinstance(self.corpus, Path):
            self.corpus = str(self.corpus)
        self.validate()

    def validate(self, model_cfg: ModelConfig | None = None) -> None:
        """Raise :class:`ConfigError` naming the first bad field and its accepted range.

        With ``model_cfg``, also check ``seq_len`` against the model's context.
        """
        for name in ("steps", "batch_size", "eval_batches"):
            require_int(name, getattr(self, name), low=1)
        if self.seq_len is not None:
            require_int("seq_len", self.seq_len, low=1)
        for name in ("eval_every", "seed", "probe_every"):
            require_int(name, getattr(self, name), low=0)
        require_int("probe_windows", self.probe_windows, low=1)
        if self.warmup_steps is not None:
            require_int("warmup_steps", self.warmup_steps, low=0)
            if self.warmup_steps > self.steps:
                raise ConfigError(
                    f"warmup_steps={self.warmup_steps} is more than steps={self.steps}; accepted: 0..{self.steps}"
                )
        require_float("lr", self.lr, low=0.0, low_open=True)
        require_float("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        require_float("weight_decay", self.weight_decay, low=0.0)
        require_float("grad_clip", self.grad_clip, low=0.0)
        for name in ("beta1", "beta2"):
            require_float(name, getattr(self, name), low=0.0, high=1.0, high_open=True)
        require_float("val_fraction", self.val_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        if not isinstance(self.corpus, str) or not self.corpus.strip():
            raise ConfigError(
                f"corpus must be 'pydoc', 'shakespeare' or a path to a UTF-8 text file; got {self.corpus!r}"
            )
        if self.split not in SPLITS:
            raise ConfigError(f"split must be one of {', '.join(SPLITS)}; got {self.split!r}")
        if self.split == "plays" and self.corpus != "shakespeare":
            raise ConfigError(
                f"split='plays' holds out whole plays of the 'shakespeare' corpus; corpus is {self.corpus!r} "
                "(use split='tail' for other corpora)"
            )
        if model_cfg is not None and self.seq_len is not None and self.seq_len > model_cfg.n_ctx:
            raise ConfigError(
                f"seq_len={self.seq_len} is longer than the model's context n_ctx={model_cfg.n_ctx}; "
                f"accepted: 1..{model_cfg.n_ctx}"
            )

    def resolved(self, model_cfg: ModelConfig) -> TrainConfig:
        """A copy validated against the model, with ``seq_len`` and ``warmup_steps`` filled in and a
        corpus file path made absolute (so a resume from another folder finds the same file)."""
        self.validate(model_cfg)
        warmup = self.warmup_steps if self.warmup_steps is not None else min(100, self.steps // 10)
        seq_len = self.seq_len if self.seq_len is not None else model_cfg.n_ctx
        corpus = self.corpus if self.corpus in NAMED_CORPORA else str(Path(self.corpus).resolve())
        return dataclasses.replace(self, seq_len=seq_len, warmup_steps=warmup, corpus=corpus)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise a ConfigError listing the known ones."""
        return dataclass_from_dict(cls, data, "train config", "train config")


def memory_estimate(model_cfg: ModelConfig, cfg: TrainConfig) -> int:
    """Bytes a training step needs, estimated from the sizes alone (float32 everywhere).

    Weights, gradients and AdamW's two moments (4 x the parameters), plus one step's
    activations kept for the backward pass: per token and transformer block about 12 d_model +
    3 d_mlp + 4 heads x d_head + 3 heads x seq_len values (norms, attention, MLP, scores), the
    depth sources (2 (L+1) d_model) and the logits (4 d_vocab). An estimate to refuse sizes that
    cannot fit before allocating them, not a measurement.
    """
    m = model_cfg
    T = cfg.seq_len if cfg.seq_len is not None else m.n_ctx
    d, inner = m.d_model, m.n_heads * m.d_head
    params = 2 * m.d_vocab * d + m.n_ctx * d + m.n_layers * (4 * d * inner + 2 * d * m.d_mlp)
    per_token = m.n_layers * (12 * d + 3 * m.d_mlp + 4 * inner + 3 * m.n_heads * T) + 2 * m.n_reads * d + 4 * m.d_vocab
    windows = cfg.batch_size * (1 + cfg.eval_batches)  # training windows, and the validation windows kept
    return 4 * (4 * params + cfg.batch_size * T * per_token) + 8 * windows * (T + 1)


def require_int(name: str, value: Any, low: int) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}; got {value!r}")


def require_float(
    name: str, value: Any, low: float, high: float | None = None, low_open: bool = False, high_open: bool = False
) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a finite number in the given interval.

    The error names the interval: ``lr must be a number in (0, inf); got -1``.
    """
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low)
    if high is not None:
        ok = ok and (value < high if high_open else value <= high)
    if not ok:
        lo = ("(" if low_open else "[") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        raise ConfigError(f"{name} must be a number in {lo}, {hi}; got {value!r}")
