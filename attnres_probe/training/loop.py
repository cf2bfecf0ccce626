"""The training loop: AdamW with warm-up + cosine decay on a byte corpus, seeded end to end, resumable.

:func:`train` writes everything into one output folder (see :mod:`attnres_probe.training.state`):
the checkpoint, ``train_log.json``, and the resumable state.

Two runs with the same configs give bit-identical weights, and a run stopped at step k and
resumed equals the uninterrupted run: the learning rate is a pure function of the step, the
batches come from one seeded ``torch.Generator`` whose state is saved, and the optimizer
state is restored exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnres_probe._version import __version__
from attnres_probe.checkpoint import WEIGHTS_FILE
from attnres_probe.config import ModelConfig
from attnres_probe.data import Corpus, load_corpus, sample_batch, validation_batches
from attnres_probe.io import DestinationBusyError, exclusive_lock, write_error
from attnres_probe.kernels import resolve_backend
from attnres_probe.losses import Reduction, next_token_loss
from attnres_probe.model import AttnResTransformer
from attnres_probe.resources import available_memory, human_bytes
from attnres_probe.training.config import TrainConfig, TrainError, memory_estimate, require_int
from attnres_probe.training.schedule import learning_rate, make_optimizer
from attnres_probe.training.state import (
    FORMAT_VERSION,
    LOG_FILE,
    LOG_FORMAT,
    STATE_FILE,
    History,
    check_same,
    code_version,
    load_verified,
    read_run_configs,
    read_state,
    recover_run,
    restore_state,
    save_state,
    write_json,
)

__all__ = ["TrainResult", "check_memory", "evaluate", "frozen_gc", "lm_loss", "train"]


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


# -- pieces of a step ----------------------------------------------------------------------
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


def lm_loss(model: AttnResTransformer, windows: torch.Tensor, reduction: Reduction = "mean") -> torch.Tensor:
    """Next-token cross-entropy of windows [batch, seq_len + 1] (inputs [:, :-1], targets [:, 1:])."""
    logits = model(windows[:, :-1])  # (B, T, vocab)
    return next_token_loss(logits, windows, reduction=reduction)


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


def _update(
    model: AttnResTransformer, opt: torch.optim.Optimizer, windows: torch.Tensor, lr: float, clip: float, step: int
) -> tuple[float, float]:
    """Update ``step`` (0-based) at learning rate ``lr`` on windows [batch, seq_len + 1]: (loss, gradient norm)."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss = lm_loss(model, windows)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    value = loss.item()
    if not math.isfinite(value):
        raise TrainError(f"the training loss became {value} at step {step + 1} (lr {lr:.3g}); lower lr or set grad_clip")
    opt.step()
    return value, float(norm)


# -- one session of a run ------------------------------------------------------------------
@dataclass
class _Data:
    """The corpus of a run, split, with its fixed validation windows."""

    corpus: Corpus
    train_tokens: torch.Tensor  # [n_train] uint8
    val_tokens: torch.Tensor  # [n_val] uint8
    val_batches: list[torch.Tensor]  # each [batch_size, seq_len + 1]


@dataclass
class _Session:
    """One call of :func:`train`: the model and optimizer, the data, the history so far."""

    cfg: TrainConfig
    out_dir: Path
    device: torch.device
    model: AttnResTransformer
    opt: torch.optim.Optimizer
    batch_gen: torch.Generator
    data: _Data
    history: History
    base: dict[str, Any]  # configs and data identity, in the state and the log
    t0: float = field(default_factory=time.perf_counter)

    def wall_time(self) -> float:
        """Seconds spent training, earlier sessions included."""
        return self.history.wall_before + time.perf_counter() - self.t0

    def validate(self) -> None:
        self.history.val_losses.append((self.history.step, evaluate(self.model, self.data.val_batches)))

    def probe(self) -> None:
        """Record the probe windows' routing at this step (``probe_every``), keep its summary
        and the latest full trace."""
        from attnres_probe.training.probes import probe_tokens, record_probe, save_last, summarize

        tokens = probe_tokens(self.data.val_batches, self.cfg.probe_windows, self.cfg.seq_len)
        trace = record_probe(self.model, tokens)
        self.history.probes.append(summarize(trace, self.history.step))
        save_last(trace, self.out_dir)

    def probe_due(self) -> bool:
        every = self.cfg.probe_every
        done = {p["step"] for p in self.history.probes}
        return bool(every) and (self.history.step % every == 0 or self.history.step == self.cfg.steps) and self.history.step not in done

    def save(self) -> None:
        doc = self.history.state_doc(self.base, self.wall_time())
        save_state(self.out_dir, self.model, self.opt, self.batch_gen, doc)


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
        out_dir: output folder (created if missing). It is locked for the whole call (a second
            writer is refused), and every save is atomic (see :mod:`attnres_probe.training.state`).
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
            occupied or locked ``out_dir``, a step too large for the memory available, or a
            loss that became NaN/inf.
        CheckpointError: an unreadable saved checkpoint.
        OSError: a save failed (full or read-only disk): one line naming the folder and the
            cause; the last saved step is unchanged, and a new run leaves no folder behind.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise TrainError(f"out_dir {out_dir} exists and is not a directory")
    device = _torch_device(device)
    if stop_at is not None:
        require_int("stop_at", stop_at, low=0)
    created = not out_dir.exists()
    try:
        with exclusive_lock(out_dir):  # one writer per run folder, for the whole session
            try:
                recover_run(out_dir)
                return _train_locked(model_cfg, train_cfg, out_dir, resume, progress, stop_at, overwrite, device, backend)
            finally:
                if created and out_dir.is_dir() and not any(out_dir.iterdir()):
                    out_dir.rmdir()  # a new run that saved nothing leaves no folder behind
    except DestinationBusyError as exc:
        raise TrainError(str(exc)) from None
    except OSError as exc:  # a full or read-only disk: one line, the last saved step kept
        kept = "nothing was saved" if created else "the run's last saved step is unchanged"
        raise write_error(exc, "the training run", out_dir, kept) from None


def _train_locked(
    model_cfg: ModelConfig | None,
    train_cfg: TrainConfig | None,
    out_dir: Path,
    resume: bool,
    progress: bool,
    stop_at: int | None,
    overwrite: bool,
    device: torch.device,
    backend: str | None,
) -> TrainResult:
    """The body of :func:`train`, with ``out_dir`` locked and recovered."""
    model_cfg, cfg, state = _run_configs(model_cfg, train_cfg, out_dir, resume, overwrite)
    try:
        used_backend = resolve_backend(device, backend, dtypes=(torch.float32,), d=model_cfg.d_model)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    check_memory(model_cfg, cfg, device)
    data = _load_data(cfg, state, out_dir)
    session = _start(model_cfg, cfg, state, data, out_dir, device, backend)
    history = session.history
    end = cfg.steps if stop_at is None else min(cfg.steps, max(stop_at, history.step))
    out_dir.mkdir(parents=True, exist_ok=True)
    if history.step == 0 and cfg.eval_every and not history.val_losses:
        session.validate()
    if session.probe_due():  # the routing at initialisation (uniform for AttnRes)
        session.probe()
    _run_steps(session, end, progress)
    return _finish(session, used_backend)


def check_memory(model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device) -> None:
    """Refuse a run whose memory estimate (:func:`memory_estimate`) exceeds what ``device`` has free.

    Raises:
        TrainError: naming the estimate, the memory available and what to lower.
    """
    need = memory_estimate(model_cfg, cfg)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        where = f"{device} has"
    else:
        free = available_memory()
        where = "this machine has"
    if free is not None and need > free:
        raise TrainError(
            f"training needs about {human_bytes(need)} (estimated for batch_size={cfg.batch_size} windows x "
            f"seq_len={cfg.seq_len} tokens at d_model={model_cfg.d_model}, {model_cfg.n_layers} layers); "
            f"{where} {human_bytes(free)} available: lower batch_size (--batch-size) or seq_len (--seq-len)"
        )


def _torch_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise TrainError(f"device {device!r} is not a torch device; use e.g. 'cpu' or 'cuda'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"device {str(device)!r} was asked for, but CUDA is not available here; use device='cpu'")
    return device


def _run_configs(
    model_cfg: ModelConfig | None, train_cfg: TrainConfig | None, out_dir: Path, resume: bool, overwrite: bool
) -> tuple[ModelConfig, TrainConfig, dict[str, Any] | None]:
    """The model config, the resolved train config and the saved state (None for a new run), all checked."""
    state: dict[str, Any] | None = None
    if resume:
        state = read_state(out_dir)
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
        check_same("model config", state["model_config"], model_cfg.to_dict(), out_dir)
        saved = dict(TrainConfig.from_dict(state["train_config"]).to_dict(), steps=cfg.steps)  # fields added since: defaults
        check_same("train config (all but steps)", saved, cfg.to_dict(), out_dir)
        if state["step"] > cfg.steps:
            raise TrainError(
                f"the run in {out_dir} is already at step {state['step']}; steps={cfg.steps} does not go beyond it "
                f"(pass steps > {state['step']} to continue it)"
            )
    return model_cfg, cfg, state


def _load_data(cfg: TrainConfig, state: dict[str, Any] | None, out_dir: Path) -> _Data:
    """The corpus split for training and validation; a resume checks it is the run's data."""
    corpus = load_corpus(cfg.corpus)
    if state is not None and state["data_sha256"] != corpus.sha256:
        raise TrainError(
            f"corpus {cfg.corpus!r} changed since the run in {out_dir} started "
            f"(sha256 then {state['data_sha256'][:12]}…, now {corpus.sha256[:12]}…); resume needs the same data"
        )
    train_tokens, val_tokens = corpus.split(cfg.val_fraction, cfg.seq_len, cfg.split)
    val_batches = validation_batches(val_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    return _Data(corpus, train_tokens, val_tokens, val_batches)


def _start(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    state: dict[str, Any] | None,
    data: _Data,
    out_dir: Path,
    device: torch.device,
    backend: str | None,
) -> _Session:
    """Seed, then build the model and optimizer fresh or restore them (and the RNGs) from ``state``.

    The order is part of the run's determinism: seeds first, then the model, the optimizer,
    and last the saved optimizer and RNG states.
    """
    torch.manual_seed(cfg.seed)
    batch_gen = torch.Generator().manual_seed(cfg.seed)
    if state is None:
        model = AttnResTransformer(model_cfg, backend=backend).to(device)
    else:
        model = load_verified(out_dir, state, device)
        model.backend = backend
    model.train()
    opt = make_optimizer(model, cfg)
    history = History(code=[{"step": 0, **code_version()}])
    if state is not None:
        restore_state(out_dir, opt, batch_gen)
        history = History.resumed(state)
    base = {
        "model_config": model_cfg.to_dict(),
        "train_config": cfg.to_dict(),
        "corpus_name": data.corpus.name,
        "data_sha256": data.corpus.sha256,
    }
    return _Session(cfg, out_dir, device, model, opt, batch_gen, data, history, base)


def _run_steps(session: _Session, end: int, progress: bool) -> None:
    """Update up to step ``end``, validating (and saving resumable state) every ``eval_every`` steps."""
    cfg, history = session.cfg, session.history
    mcfg = session.model.cfg
    bar = _progress_bar(progress, history.step, cfg.steps, "mhc" if mcfg.residual == "hyper" and mcfg.mhc else mcfg.residual)
    clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    # the estimate leaves out the session's first step: it compiles kernels (Numba, Triton) and warms caches
    start, t_start, estimated = history.step, None, False
    try:
        with frozen_gc():  # the collector skips the objects that predate the loop
            while history.step < end:
                lr = learning_rate(history.step, cfg)
                windows = sample_batch(session.data.train_tokens, cfg.batch_size, cfg.seq_len, session.batch_gen)
                value, norm = _update(session.model, session.opt, windows.to(session.device), lr, clip, history.step)
                history.step += 1
                if t_start is None:
                    t_start = time.perf_counter()
                history.losses.append(value)
                history.grad_norms.append(norm)
                history.lrs.append(lr)
                probed = session.probe_due()
                if probed:
                    session.probe()
                validated = False
                if cfg.eval_every and history.step % cfg.eval_every == 0 or history.step == cfg.steps:
                    session.validate()
                    validated = True
                    if history.step < end:  # the end of the session saves in _finish
                        session.save()
                elif probed and history.step < end:
                    session.save()  # a probe's summary survives a kill
                if bar is not None:
                    bar.set_postfix(progress_postfix(value, history.val_losses), refresh=False)
                    bar.update(1)
                    if validated:
                        bar.refresh()  # show the new validation loss now, not at the next redraw
                    if not estimated and history.step - start - 1 >= ESTIMATE_AFTER_STEPS and history.step < end:
                        estimated = True
                        bar.write(time_estimate(time.perf_counter() - t_start, history.step - start - 1, end - history.step),
                                  file=sys.stderr)
    finally:
        if bar is not None:
            bar.close()


ESTIMATE_AFTER_STEPS = 5  # the progress bar prints the expected run time after this many steps (after the first)


def progress_postfix(loss: float, val_losses: list) -> dict[str, str]:
    """The progress bar's figures: the last training loss and the latest validation loss with its step."""
    out = {"loss": f"{loss:.3f}"}
    if val_losses:
        step, val = val_losses[-1]
        out["val"] = f"{val:.3f} (step {step})"
    return out


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def time_estimate(elapsed: float, done: int, remaining: int) -> str:
    """One line after the first steps: seconds per step and the time the remaining steps will take
    (validation and probes come on top)."""
    per = elapsed / max(done, 1)
    return (f"{per:.2f} s/step over {done} steps after the first (which compiles kernels): about "
            f"{_duration(per * remaining)} for the remaining {remaining} steps (plus validation)")


def _finish(session: _Session, used_backend: str) -> TrainResult:
    """Validate at the last step if not done yet, save the resumable state, write the log."""
    cfg, history, data, model = session.cfg, session.history, session.data, session.model
    finished = history.step >= cfg.steps
    if finished and (not history.val_losses or history.val_losses[-1][0] != history.step):
        session.validate()  # resumed at the end: nothing ran
    session.save()
    final = history.val_losses[-1][1] if finished else None
    wall = session.wall_time()
    log = {
        "format": LOG_FORMAT,
        "format_version": FORMAT_VERSION,
        **session.base,
        "corpus": {
            "name": data.corpus.name,
            "source": data.corpus.source,
            "sha256": data.corpus.sha256,
            "n_tokens": len(data.corpus),
            "n_train": int(data.train_tokens.numel()),
            "n_val": int(data.val_tokens.numel()),
            "n_val_windows": sum(int(b.shape[0]) for b in data.val_batches),
        },
        "step": history.step,
        "finished": finished,
        "loss": history.losses,
        "grad_norm": history.grad_norms,
        "lr": history.lrs,
        "val": [{"step": s, "loss": v} for s, v in history.val_losses],
        "final_val_loss": final,
        "n_params": model.n_params(),
        "wall_time_s": wall,
        "resumed_at": history.resumed_at,
        "code": history.code,
        "probes": _probe_log(session),
        "device": str(session.device),
        "backend": used_backend,
        "attnres_probe": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    write_json(session.out_dir / LOG_FILE, log)
    return TrainResult(
        model=model,
        out_dir=session.out_dir,
        step=history.step,
        finished=finished,
        train_losses=history.losses,
        val_losses=history.val_losses,
        final_val_loss=final,
        wall_time_s=wall,
        log=log,
    )


def _probe_log(session: _Session) -> dict[str, Any] | None:
    """The log's record of the routing probes: settings, the windows' hash, every summary."""
    cfg = session.cfg
    if not cfg.probe_every:
        return None
    from attnres_probe.training.probes import PROBE_DIR, probe_tokens, tokens_sha256

    tokens = probe_tokens(session.data.val_batches, cfg.probe_windows, cfg.seq_len)
    return {
        "every": cfg.probe_every,
        "windows": int(tokens.shape[0]),
        "window_tokens": int(tokens.shape[1]),
        "windows_sha256": tokens_sha256(tokens),
        "last_trace": PROBE_DIR,
        "history": session.history.probes,
    }


def _progress_bar(enabled: bool, initial: int, total: int, residual: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=f"train {residual}", unit="step", dynamic_ncols=True)
