"""Training: AdamW with warm-up + cosine decay on a byte corpus, seeded end to end, resumable.

:func:`train` writes everything into one output folder:

- ``config.json`` + ``model.safetensors``: the checkpoint (:meth:`AttnResTransformer.save`);
- ``train_log.json``: loss per step, validation losses, configs, data hash, versions, timing;
- ``train_state.json`` + ``train_state.safetensors``: what ``resume=True`` needs (step,
  histories, optimizer moments, RNG states). No pickle anywhere: tensors go to safetensors,
  scalars to JSON.

Two runs with the same configs give bit-identical weights, and a run stopped at step k and
resumed equals the uninterrupted run: the learning rate is a pure function of the step, the
batches come from one seeded ``torch.Generator`` whose state is saved, and the optimizer
state is restored exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from attnres_probe._version import __version__
from attnres_probe.checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, atomic_write, sha256_file
from attnres_probe.config import RESIDUALS, ConfigError, ModelConfig, dataclass_from_dict
from attnres_probe.data import NAMED_CORPORA, DataError, load_corpus, sample_batch, validation_batches
from attnres_probe.kernels import BACKENDS
from attnres_probe.model import AttnResTransformer, DepthMixer, RMSNorm

__all__ = [
    "LOG_FILE",
    "STATE_FILE",
    "STATE_TENSORS_FILE",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "add_train_parser",
    "evaluate",
    "frozen_gc",
    "learning_rate",
    "lm_loss",
    "param_groups",
    "read_run_configs",
    "train",
]

LOG_FILE = "train_log.json"
STATE_FILE = "train_state.json"
STATE_TENSORS_FILE = "train_state.safetensors"
LOG_FORMAT = "attnres-probe-train-log"
STATE_FORMAT = "attnres-probe-train-state"
FORMAT_VERSION = 1
NO_DECAY_PARAMS = ("W_E", "W_pos")  # embeddings: source 0 of every depth mixture


class TrainError(ValueError):
    """A run cannot start or continue: inconsistent resume state, diverged loss, occupied folder."""


# -- configuration -------------------------------------------------------------------------
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
    val_fraction: float = 0.1  # the last share of the corpus held out for validation

    def __post_init__(self) -> None:
        if isinstance(self.corpus, Path):
            self.corpus = str(self.corpus)
        self.validate()

    def validate(self, model_cfg: ModelConfig | None = None) -> None:
        """Raise :class:`ConfigError` naming the first bad field and its accepted range.

        With ``model_cfg``, also check ``seq_len`` against the model's context.
        """
        for name in ("steps", "batch_size", "eval_batches"):
            _require_int(name, getattr(self, name), low=1)
        if self.seq_len is not None:
            _require_int("seq_len", self.seq_len, low=1)
        for name in ("eval_every", "seed"):
            _require_int(name, getattr(self, name), low=0)
        if self.warmup_steps is not None:
            _require_int("warmup_steps", self.warmup_steps, low=0)
            if self.warmup_steps > self.steps:
                raise ConfigError(
                    f"warmup_steps={self.warmup_steps} is more than steps={self.steps}; accepted: 0..{self.steps}"
                )
        _require_float("lr", self.lr, low=0.0, low_open=True)
        _require_float("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _require_float("weight_decay", self.weight_decay, low=0.0)
        _require_float("grad_clip", self.grad_clip, low=0.0)
        for name in ("beta1", "beta2"):
            _require_float(name, getattr(self, name), low=0.0, high=1.0, high_open=True)
        _require_float("val_fraction", self.val_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        if not isinstance(self.corpus, str) or not self.corpus.strip():
            raise ConfigError(
                f"corpus must be 'pydoc', 'shakespeare' or a path to a UTF-8 text file; got {self.corpus!r}"
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


def _require_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}; got {value!r}")


def _require_float(
    name: str, value: Any, low: float, high: float | None = None, low_open: bool = False, high_open: bool = False
) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low)
    if high is not None:
        ok = ok and (value < high if high_open else value <= high)
    if not ok:
        lo = ("(" if low_open else "[") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        raise ConfigError(f"{name} must be a number in {lo}, {hi}; got {value!r}")


# -- pieces of a step ----------------------------------------------------------------------
def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Learning rate of update ``step`` (0-based): linear warm-up, then cosine to lr * min_lr_ratio.

    Warm-up: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``. Decay: over the
    remaining updates, from ``lr`` at the first to ``lr * min_lr_ratio`` at the last.
    """
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(100, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    span = cfg.steps - 1 - warmup
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: AttnResTransformer, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on weight matrices; none on norms, biases, embeddings, depth mixers.

    The no-decay group holds every RMSNorm gain (the depth mixers' ``norm.weight`` included),
    every bias, the token and position embeddings, and every mixer's ``query``.
    """
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, (RMSNorm, DepthMixer)):
            no_decay.update(id(p) for p in module.parameters(recurse=True))
    for name, p in model.named_parameters():
        if name.endswith("bias") or name in NO_DECAY_PARAMS or p.dim() < 2:
            no_decay.add(id(p))
    decay = [p for p in model.parameters() if id(p) not in no_decay]
    rest = [p for p in model.parameters() if id(p) in no_decay]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


@contextlib.contextmanager
def frozen_gc():
    """Keep Python's cyclic garbage collector away from the objects that exist before a loop.

    A training step creates thousands of short-lived Python objects (autograd nodes, tensor
    wrappers), and each collection they trigger may traverse every object the process holds:
    hundreds of thousands from torch, Numba and the rest, none of which becomes garbage during
    training. ``gc.freeze()`` sets those aside for the loop (after one full collection) and
    ``gc.unfreeze()`` returns them afterwards, so an interactive session that calls
    :func:`train` keeps its normal collector. A process that froze objects itself is left as
    it is. (Measured at the demo size: 3-6 ms less per training step.)
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def lm_loss(model: AttnResTransformer, windows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of windows [batch, seq_len + 1] (inputs [:, :-1], targets [:, 1:])."""
    logits = model(windows[:, :-1])  # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model: AttnResTransformer, val_batches: list[torch.Tensor]) -> float:
    """Mean next-token loss over every target token of ``val_batches`` (each [b, seq_len + 1])."""
    if not val_batches:
        raise ValueError("val_batches is empty: need at least one batch of windows")
    was_training = model.training
    model.eval()
    try:
        total, count = 0.0, 0
        for windows in val_batches:
            windows = windows.to(model.device)
            total += float(lm_loss(model, windows, reduction="sum"))
            count += windows[:, 1:].numel()
    finally:
        model.train(was_training)
    return total / count


# -- results and saved state ---------------------------------------------------------------
@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        model: the trained model (in train mode).
        out_dir: the folder holding the checkpoint, log and resumable state.
        step: updates done so far (``steps``, or ``stop_at`` for a deliberately stopped run).
        finished: whether ``step`` reached ``train_cfg.steps``.
        train_losses: training loss of every update, index = step - 1.
        val_losses: ``(step, loss)`` of every validation.
        final_val_loss: validation loss at the last step (None when stopped early).
        wall_time_s: seconds spent training, summed over resumed sessions.
        log: the contents of ``train_log.json``.
    """

    model: AttnResTransformer
    out_dir: Path
    step: int
    finished: bool
    train_losses: list[float]
    val_losses: list[tuple[int, float]]
    final_val_loss: float | None
    wall_time_s: float
    log: dict[str, Any]


def read_run_configs(out_dir: str | Path) -> tuple[ModelConfig, TrainConfig]:
    """The (model, train) configs of the resumable run saved in ``out_dir``."""
    state = _read_state(Path(out_dir))
    try:
        return ModelConfig.from_dict(state["model_config"]), TrainConfig.from_dict(state["train_config"])
    except (ConfigError, TypeError) as exc:
        raise TrainError(f"{Path(out_dir) / STATE_FILE}: invalid saved config: {exc}") from None


def _read_state(out_dir: Path) -> dict[str, Any]:
    path = out_dir / STATE_FILE
    if not path.is_file():
        raise TrainError(
            f"{out_dir} holds no resumable run ({STATE_FILE} is missing); start one without resume"
        )
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TrainError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise TrainError(f"{path} is not an attnres-probe train state (no format {STATE_FORMAT!r})")
    if state.get("format_version") != FORMAT_VERSION:
        raise TrainError(
            f"{path} has format_version {state.get('format_version')!r}; this toolkit resumes version {FORMAT_VERSION}"
        )
    return state


def _optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flatten AdamW's per-parameter state into ``optimizer.{index}.{key}`` tensors."""
    out = {}
    for index, slots in opt.state_dict()["state"].items():
        for key, value in slots.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            out[f"optimizer.{index}.{key}"] = value.detach().cpu().contiguous()
    return out


def _load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Inverse of :func:`_optimizer_tensors`, into a freshly built optimizer over the same params."""
    fresh = opt.state_dict()
    n_params = sum(len(g["params"]) for g in fresh["param_groups"])
    shapes = [tuple(p.shape) for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if not name.startswith("optimizer."):
            continue
        _, index, key = name.split(".", 2)
        i = int(index)
        if i >= n_params or (key != "step" and tuple(value.shape) != shapes[i]):
            raise TrainError(f"{where}: optimizer tensor {name!r} does not fit this model's parameters")
        state.setdefault(i, {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": fresh["param_groups"]})


def _save_state(
    out_dir: Path,
    model: AttnResTransformer,
    opt: torch.optim.Optimizer,
    batch_gen: torch.Generator,
    doc: dict[str, Any],
) -> None:
    """Checkpoint + optimizer/RNG tensors, then the JSON that vouches for both (written last)."""
    model.save(out_dir)
    tensors = _optimizer_tensors(opt)
    tensors["rng.batches"] = batch_gen.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    meta = {"format": STATE_FORMAT, "format_version": str(FORMAT_VERSION)}
    atomic_write(out_dir / STATE_TENSORS_FILE, lambda p: save_file(tensors, str(p), metadata=meta))
    doc = {
        **doc,
        "weights_sha256": sha256_file(out_dir / WEIGHTS_FILE),
        "state_tensors_sha256": sha256_file(out_dir / STATE_TENSORS_FILE),
    }
    _write_json(out_dir / STATE_FILE, doc)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    atomic_write(path, lambda p: p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n"))


# -- the loop ------------------------------------------------------------------------------
def train(
    model_cfg: ModelConfig | None,
    train_cfg: TrainConfig | None,
    out_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    *,
    stop_at: int | None = None,
    overwrite: bool = False,
    device: str | torch.device = "cpu",
    backend: str | None = None,
) -> TrainResult:
    """Train a model on a byte corpus and write checkpoint, log and resumable state to ``out_dir``.

    Args:
        model_cfg: the model to build. With ``resume`` it may be None (use the saved one); if
            given it must equal the saved one.
        train_cfg: optimisation settings. With ``resume`` it may be None (the saved one); if
            given, every field but ``steps`` must equal the saved one (``steps`` may grow).
        out_dir: output folder (created if missing).
        resume: continue the run saved in ``out_dir`` from its last saved step to ``steps``.
        progress: show a tqdm bar with the loss.
        stop_at: stop after this many updates (as if interrupted), leaving resumable state;
            the learning-rate schedule still spans ``steps``.
        overwrite: allow starting a new run in a folder that already holds one.
        device: where to train ("cpu", "cuda", ...).
        backend: depth-attention backend of the model (``"auto"``, ``"torch"``, ``"triton"``,
            ``"numba"``; None reads ``ATTNRES_BACKEND``, see :mod:`attnres_probe.kernels`).
            Backends agree to float rounding, so a run is bit-exact only on the same one; the
            log records it.

    Returns:
        the :class:`TrainResult`.

    Raises:
        ConfigError: a bad model or train config (e.g. seq_len > n_ctx, batch_size < 1).
        DataError: a missing, empty or too short corpus.
        TrainError: nothing to resume, a resume that disagrees with the saved run, an
            occupied ``out_dir``, or a loss that became NaN/inf.
        CheckpointError: an unreadable saved checkpoint.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise TrainError(f"out_dir {out_dir} exists and is not a directory")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise TrainError(f"device {device!r} is not a torch device; use e.g. 'cpu' or 'cuda'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"device {str(device)!r} was asked for, but CUDA is not available here; use device='cpu'")
    state: dict[str, Any] | None = None
    if resume:
        state = _read_state(out_dir)
        saved_model, saved_train = read_run_configs(out_dir)
        model_cfg = saved_model if model_cfg is None else model_cfg
        train_cfg = train_cfg if train_cfg is not None else dataclasses.replace(saved_train)
        if isinstance(train_cfg, TrainConfig) and train_cfg.warmup_steps is None:
            # the default warm-up depends on steps; a resume that extends steps keeps the saved one
            train_cfg = dataclasses.replace(train_cfg, warmup_steps=saved_train.warmup_steps)
    else:
        if model_cfg is None or train_cfg is None:
            raise TrainError("model_cfg and train_cfg are required unless resume=True")
        occupied = [f for f in (STATE_FILE, WEIGHTS_FILE, LOG_FILE) if (out_dir / f).exists()]
        if occupied and not overwrite:
            raise TrainError(
                f"{out_dir} already holds a training run ({', '.join(occupied)}); pass resume=True (--resume) to "
                "continue it, overwrite=True (--overwrite) to replace it, or choose another folder"
            )
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig; got {type(model_cfg).__name__}")
    if not isinstance(train_cfg, TrainConfig):
        raise TypeError(f"train_cfg must be a TrainConfig; got {type(train_cfg).__name__}")
    model_cfg.validate()
    cfg = train_cfg.resolved(model_cfg)
    if state is not None:
        _check_same("model config", state["model_config"], model_cfg.to_dict(), out_dir)
        saved = dict(state["train_config"], steps=cfg.steps)
        _check_same("train config (all but steps)", saved, cfg.to_dict(), out_dir)
        if state["step"] > cfg.steps:
            raise TrainError(
                f"the run in {out_dir} is already at step {state['step']}; steps={cfg.steps} does not go beyond it "
                f"(pass steps > {state['step']} to continue it)"
            )
    if stop_at is not None:
        _require_int("stop_at", stop_at, low=0)
    from attnres_probe.kernels import resolve_backend

    try:
        used_backend = resolve_backend(device, backend, dtypes=(torch.float32,), d=model_cfg.d_model)
    except ValueError as exc:
        raise TrainError(str(exc)) from None

    corpus = load_corpus(cfg.corpus)
    if state is not None and state["data_sha256"] != corpus.sha256:
        raise TrainError(
            f"corpus {cfg.corpus!r} changed since the run in {out_dir} started "
            f"(sha256 then {state['data_sha256'][:12]}…, now {corpus.sha256[:12]}…); resume needs the same data"
        )
    train_tokens, val_tokens = corpus.split(cfg.val_fraction, cfg.seq_len)
    val_batches = validation_batches(val_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_batches)

    torch.manual_seed(cfg.seed)
    batch_gen = torch.Generator().manual_seed(cfg.seed)
    if state is None:
        model = AttnResTransformer(model_cfg, backend=backend).to(device)
    else:
        model = _load_verified(out_dir, state, device)
        model.backend = backend
    model.train()
    opt = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=learning_rate(0, cfg), betas=(cfg.beta1, cfg.beta2)
    )
    losses: list[float] = []
    grad_norms: list[float] = []
    lrs: list[float] = []
    val_losses: list[tuple[int, float]] = []
    step, wall_before, resumed_at = 0, 0.0, []
    if state is not None:
        tensors = load_file(str(out_dir / STATE_TENSORS_FILE))
        _load_optimizer_tensors(opt, tensors, out_dir / STATE_TENSORS_FILE)
        batch_gen.set_state(tensors["rng.batches"])
        torch.set_rng_state(tensors["rng.torch"])
        step = int(state["step"])
        losses, grad_norms, lrs = list(state["loss"]), list(state["grad_norm"]), list(state["lr"])
        val_losses = [(int(s), float(v)) for s, v in state["val"]]
        wall_before = float(state["wall_time_s"])
        resumed_at = [*state["resumed_at"], step]
    end = cfg.steps if stop_at is None else min(cfg.steps, max(stop_at, step))

    base = {
        "model_config": model_cfg.to_dict(),
        "train_config": cfg.to_dict(),
        "corpus_name": corpus.name,
        "data_sha256": corpus.sha256,
    }
    t0 = time.perf_counter()

    def snapshot() -> dict[str, Any]:
        return {
            **base,
            "format": STATE_FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "loss": losses,
            "grad_norm": grad_norms,
            "lr": lrs,
            "val": val_losses,
            "wall_time_s": wall_before + time.perf_counter() - t0,
            "resumed_at": resumed_at,
        }

    out_dir.mkdir(parents=True, exist_ok=True)
    if step == 0 and cfg.eval_every and not val_losses:
        val_losses.append((0, evaluate(model, val_batches)))
    bar = _progress_bar(progress, step, cfg.steps, model_cfg.residual)
    clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    try:
        with frozen_gc():  # the collector skips the objects that predate the loop
            while step < end:
                lr = learning_rate(step, cfg)
                for group in opt.param_groups:
                    group["lr"] = lr
                windows = sample_batch(train_tokens, cfg.batch_size, cfg.seq_len, batch_gen).to(device)
                loss = lm_loss(model, windows)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                value = loss.item()
                if not math.isfinite(value):
                    raise TrainError(
                        f"the training loss became {value} at step {step + 1} (lr {lr:.3g}); lower lr or set grad_clip"
                    )
                opt.step()
                step += 1
                losses.append(value)
                grad_norms.append(float(norm))
                lrs.append(lr)
                postfix = {"loss": f"{value:.3f}"}
                if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps:
                    val_losses.append((step, evaluate(model, val_batches)))
                    if step < end:  # the end of the session saves below
                        _save_state(out_dir, model, opt, batch_gen, snapshot())
                if val_losses:
                    postfix["val"] = f"{val_losses[-1][1]:.3f}"
                if bar is not None:
                    bar.set_postfix(postfix, refresh=False)
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    finished = step >= cfg.steps
    if finished and (not val_losses or val_losses[-1][0] != step):  # resumed at the end: nothing ran
        val_losses.append((step, evaluate(model, val_batches)))
    _save_state(out_dir, model, opt, batch_gen, snapshot())
    final = val_losses[-1][1] if finished else None
    wall = wall_before + time.perf_counter() - t0
    log = {
        "format": LOG_FORMAT,
        "format_version": FORMAT_VERSION,
        **base,
        "corpus": {
            "name": corpus.name,
            "source": corpus.source,
            "sha256": corpus.sha256,
            "n_tokens": len(corpus),
            "n_train": int(train_tokens.numel()),
            "n_val": int(val_tokens.numel()),
            "n_val_windows": sum(int(b.shape[0]) for b in val_batches),
        },
        "step": step,
        "finished": finished,
        "loss": losses,
        "grad_norm": grad_norms,
        "lr": lrs,
        "val": [{"step": s, "loss": v} for s, v in val_losses],
        "final_val_loss": final,
        "n_params": model.n_params(),
        "wall_time_s": wall,
        "resumed_at": resumed_at,
        "device": str(device),
        "backend": used_backend,
        "attnres_probe": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    _write_json(out_dir / LOG_FILE, log)
    return TrainResult(
        model=model,
        out_dir=out_dir,
        step=step,
        finished=finished,
        train_losses=losses,
        val_losses=val_losses,
        final_val_loss=final,
        wall_time_s=wall,
        log=log,
    )


def _check_same(what: str, saved: dict[str, Any], given: dict[str, Any], out_dir: Path) -> None:
    diff = [k for k in sorted(set(saved) | set(given)) if saved.get(k) != given.get(k)]
    if diff:
        detail = "; ".join(f"{k}: saved {saved.get(k)!r}, given {given.get(k)!r}" for k in diff)
        raise TrainError(f"cannot resume the run in {out_dir}: the {what} differs ({detail})")


def _load_verified(out_dir: Path, state: dict[str, Any], device: torch.device) -> AttnResTransformer:
    """The saved model, after checking that weights and optimizer state belong to the same step."""
    for name, key in ((WEIGHTS_FILE, "weights_sha256"), (STATE_TENSORS_FILE, "state_tensors_sha256")):
        path = out_dir / name
        if not path.is_file():
            raise TrainError(f"cannot resume: {path} is missing")
        if sha256_file(path) != state.get(key):
            raise TrainError(
                f"cannot resume: {path} does not match {STATE_FILE} (was the run interrupted while saving, "
                "or a file replaced?); start a new run"
            )
    try:
        return AttnResTransformer.load(out_dir, device=device)
    except SafetensorError as exc:
        raise CheckpointError(f"{out_dir / WEIGHTS_FILE} is unreadable ({exc})") from None


def _progress_bar(enabled: bool, initial: int, total: int, residual: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=f"train {residual}", unit="step", dynamic_ncols=True)


# -- command line --------------------------------------------------------------------------
_MODEL_FLAGS = {  # flag dest -> ModelConfig field
    "residual": "residual",
    "n_layers": "n_layers",
    "d_model": "d_model",
    "n_heads": "n_heads",
    "n_ctx": "n_ctx",
    "block_size": "block_size",
}
_TRAIN_FLAGS = (
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "eval_every",
    "eval_batches",
    "corpus",
    "val_fraction",
)


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand; its ``func(args)`` returns an exit code.

    Flags left out keep the defaults of ModelConfig / TrainConfig (or, with ``--config``, the
    file's model config; with ``--resume``, the saved run's configs).
    """
    p = subparsers.add_parser(
        "train",
        help="train a model on an offline byte corpus",
        description="Train a PreNorm / Full AttnRes / Block AttnRes model on an offline corpus. Writes the "
        "checkpoint, train_log.json and resumable state into --out.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (checkpoint, log, resumable state)")
    p.add_argument("--config", metavar="JSON", help="model config file (ModelConfig fields); flags below override it")
    m = p.add_argument_group("model")
    m.add_argument("--residual", choices=RESIDUALS, help="residual rule (default full)")
    m.add_argument("--n-layers", type=int, help="transformer blocks (2 sublayers each)")
    m.add_argument("--d-model", type=int, help="residual stream width")
    m.add_argument("--n-heads", type=int, help="attention heads")
    m.add_argument("--n-ctx", type=int, help="context length")
    m.add_argument("--block-size", type=int, help="sublayers per block (--residual block)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, help="optimizer updates (default 2000)")
    t.add_argument("--batch-size", type=int, help="windows per update (default 16)")
    t.add_argument("--seq-len", type=int, help="tokens per window (default: n_ctx)")
    t.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    t.add_argument("--min-lr-ratio", type=float, help="final lr / peak lr (default 0.1)")
    t.add_argument("--warmup-steps", type=int, help="linear warm-up updates (default min(100, steps/10))")
    t.add_argument("--weight-decay", type=float, help="AdamW decay on matrices (default 0.1)")
    t.add_argument("--grad-clip", type=float, help="max gradient norm, 0 = off (default 1.0)")
    t.add_argument("--eval-every", type=int, help="validate and save every N steps, 0 = only at the end (default 200)")
    t.add_argument("--eval-batches", type=int, help="validation batches (default 8)")
    t.add_argument("--corpus", help="pydoc (default) | shakespeare | path to a UTF-8 text file")
    t.add_argument("--val-fraction", type=float, help="held-out share at the end of the corpus (default 0.1)")
    t.add_argument("--seed", type=int, help="seed of the model init and the batch order (default 0)")
    r = p.add_argument_group("run")
    r.add_argument("--resume", action="store_true", help="continue the run saved in --out up to --steps")
    r.add_argument("--overwrite", action="store_true", help="replace a run already saved in --out")
    r.add_argument("--device", default="cpu", help="torch device (default cpu)")
    r.add_argument(
        "--backend",
        choices=BACKENDS,
        help="depth-attention backend (default: ATTNRES_BACKEND, else auto: numba on CPU, triton on CUDA)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_train)
    return p


def _configs_from_args(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig]:
    """Model and train configs: a base (defaults, the --config file, or the saved run), then flags."""
    saved = read_run_configs(args.out) if args.resume else None
    if args.config:
        base = _read_model_config(args.config).to_dict()
    else:
        base = saved[0].to_dict() if saved else {}
    model_dict = dict(base)
    train_dict = saved[1].to_dict() if saved else {}
    for dest, field in _MODEL_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            model_dict[field] = value
    for name in _TRAIN_FLAGS:
        value = getattr(args, name)
        if value is not None:
            train_dict[name] = value
    if args.seed is not None:
        model_dict["seed"] = train_dict["seed"] = args.seed
    if args.residual not in (None, "block") and args.block_size is None:  # an explicit non-block residual
        model_dict.pop("block_size", None)
        model_dict.pop("block_boundaries", None)
    if base and (model_dict["d_model"], model_dict["n_heads"]) != (base["d_model"], base["n_heads"]):
        # the width changed: re-derive the sizes the base had derived from the old width
        if base["d_head"] == base["d_model"] // base["n_heads"]:
            model_dict.pop("d_head")
        if base["d_mlp"] == 4 * base["d_model"]:
            model_dict.pop("d_mlp")
    return ModelConfig.from_dict(model_dict), TrainConfig.from_dict(train_dict)


def _read_model_config(path: str) -> ModelConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file (expected a JSON file of ModelConfig fields)")
    try:
        return ModelConfig.from_json(p)
    except (TypeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None


def _run_train(args: argparse.Namespace) -> int:
    """Handler of ``attnres-probe train``: 0 on success, 2 on a usage/data error, 130 on Ctrl-C."""
    try:
        model_cfg, train_cfg = _configs_from_args(args)
        result = train(
            model_cfg,
            train_cfg,
            args.out,
            resume=args.resume,
            progress=not args.quiet,
            overwrite=args.overwrite,
            device=args.device,
            backend=args.backend,
        )
    except (ConfigError, DataError, TrainError, CheckpointError, OSError, RuntimeError, TypeError) as exc:
        print(f"attnres-probe train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"attnres-probe train: interrupted; rerun with --resume --out {args.out} to continue from the last "
            "saved step",
            file=sys.stderr,
        )
        return 130
    print(
        f"trained {result.step} steps ({result.model.cfg.residual}); final validation loss "
        f"{result.final_val_loss:.4f}; wrote {result.out_dir}/{{{CONFIG_FILE},{WEIGHTS_FILE},{LOG_FILE}}}"
    )
    return 0
