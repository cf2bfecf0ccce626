"""The run folder and its resumable state: what ``resume=True`` reads back, and how it is checked.

A run folder holds

- ``config.json`` + ``model.safetensors``: the checkpoint (:meth:`AttnResTransformer.save`);
- ``train_state.safetensors``: AdamW's moments and the two RNG states (batch order, torch);
- ``train_state.json``: step, histories, configs, data hash, and the sha256 of both tensor
  files, written last: it vouches for a checkpoint and optimizer state of the same step;
- ``train_log.json``: written by :func:`~attnres_probe.training.train` at the end of a session.

No pickle anywhere: tensors go to safetensors, scalars to JSON.

A save is one atomic unit. The four files of a step are written into a hidden folder
``.step-NNNNNNNN.tmp-PID`` inside the run folder; renaming it to ``.step-NNNNNNNN`` commits the
step; then each file is moved onto its name in the run folder (``train_state.json`` last) and the
hidden folder removed. A process killed before the commit leaves the previous step in place (the
uncommitted folder is removed later); one killed after it leaves a committed folder that
:func:`recover_run` (called by every training session before it reads anything) finishes moving
into place. So ``resume`` always finds the last complete step.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from attnres_probe.checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, save_safetensors
from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.io import atomic_write, fault_point, read_json, remove_stale_temps, sha256_file
from attnres_probe.model import AttnResTransformer
from attnres_probe.training.config import TrainConfig, TrainError

__all__ = [
    "FORMAT_VERSION",
    "LOG_FILE",
    "LOG_FORMAT",
    "STATE_FILE",
    "STATE_FORMAT",
    "STATE_TENSORS_FILE",
    "History",
    "check_same",
    "load_optimizer_tensors",
    "load_verified",
    "optimizer_tensors",
    "read_run_configs",
    "read_state",
    "read_train_log",
    "recover_run",
    "restore_state",
    "save_state",
    "write_json",
]

LOG_FILE = "train_log.json"
STATE_FILE = "train_state.json"
STATE_TENSORS_FILE = "train_state.safetensors"
LOG_FORMAT = "attnres-probe-train-log"
STATE_FORMAT = "attnres-probe-train-state"
FORMAT_VERSION = 1


@dataclass
class History:
    """What a run has done so far: saved in ``train_state.json``, restored on resume, logged.

    Attributes:
        step: updates done.
        losses: training loss of every update, index = step - 1.
        grad_norms: global gradient norm of every update (before clipping).
        lrs: learning rate of every update.
        val_losses: ``(step, loss)`` of every validation.
        wall_before: seconds spent training in earlier sessions of the run.
        resumed_at: the step at which each later session started.
        probes: the summary of every routing probe so far (``train --probe-every``; see
            :func:`attnres_probe.training.probes.summarize`).
        code: the code each session ran: ``{"step": first step, "commit": git commit or None,
            "dirty": uncommitted changes or None}`` (:func:`code_version`), one per session.
    """

    step: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    wall_before: float = 0.0
    resumed_at: list[int] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    code: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def resumed(cls, state: dict[str, Any]) -> History:
        """The history saved in a train state (see :func:`read_state`), as a new session starts on it."""
        step = int(state["step"])
        return cls(
            step=step,
            losses=list(state["loss"]),
            grad_norms=list(state["grad_norm"]),
            lrs=list(state["lr"]),
            val_losses=[(int(s), float(v)) for s, v in state["val"]],
            wall_before=float(state["wall_time_s"]),
            resumed_at=[*state["resumed_at"], step],
            probes=list(state.get("probes", [])),
            code=[*state.get("code", []), {"step": step, **code_version()}],
        )

    def state_doc(self, base: dict[str, Any], wall_time_s: float) -> dict[str, Any]:
        """The ``train_state.json`` document (without the file hashes :func:`save_state` adds).

        Args:
            base: the run's configs and data identity (model_config, train_config, corpus_name,
                data_sha256).
            wall_time_s: seconds spent training, this session included.
        """
        return {
            **base,
            "format": STATE_FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "loss": self.losses,
            "grad_norm": self.grad_norms,
            "lr": self.lrs,
            "val": self.val_losses,
            "wall_time_s": wall_time_s,
            "resumed_at": self.resumed_at,
            "probes": self.probes,
            "code": self.code,
        }


def code_version() -> dict[str, Any]:
    """The git commit of the package's checkout and whether it has uncommitted changes (both None
    outside a git checkout, e.g. an installed wheel): train logs record it for every session."""
    import subprocess

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    if git("rev-parse", "--show-toplevel") is None or Path(git("rev-parse", "--show-toplevel") or "").resolve() != root:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def read_run_configs(out_dir: str | Path) -> tuple[ModelConfig, TrainConfig]:
    """The (model, train) configs of the resumable run saved in ``out_dir``.

    Raises:
        TrainError: no readable train state in ``out_dir``, or an invalid saved config.
    """
    state = read_state(Path(out_dir))
    try:
        return ModelConfig.from_dict(state["model_config"]), TrainConfig.from_dict(state["train_config"])
    except (ConfigError, TypeError) as exc:
        raise TrainError(f"{Path(out_dir) / STATE_FILE}: invalid saved config: {exc}") from None


MAX_LOG_BYTES = 256 * 2**20  # a log of 100,000 steps with probes is about 30 MB


def read_train_log(folder: str | Path, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The ``train_log.json`` of a run folder, checked before anything uses it: a regular file of at
    most 256 MB, JSON nested at most as deep as Python parses, an object whose ``train_config`` is a
    valid :class:`TrainConfig` and whose ``step``, ``finished``, ``data_sha256``, ``backend``,
    ``final_val_loss`` and ``wall_time_s`` (where present) have their types and ranges.

    Raises:
        error: one line naming the file, the key and what is accepted.
    """
    from attnres_probe.io import read_json
    from attnres_probe.validate import field

    path = Path(folder) / LOG_FILE
    log = read_json(path, error, max_bytes=MAX_LOG_BYTES)
    where = str(path)
    if not isinstance(log, dict):
        raise error(f"{where}: a training log is a JSON object; got {type(log).__name__}")
    tc = field(log, "train_config", "dict", where, error)
    try:
        TrainConfig.from_dict(tc).validate()
    except (ConfigError, TypeError) as exc:
        raise error(f"{where}: 'train_config' is not a valid training recipe ({exc})") from None
    field(log, "step", "int", where, error, lo=0)
    field(log, "finished", "bool", where, error, required=False)
    for key in ("data_sha256", "backend"):
        field(log, key, "str", where, error, required=False, hi=256)
    for key in ("final_val_loss", "wall_time_s"):
        if log.get(key) is not None:
            field(log, key, "number", where, error)
    if log.get("probes") is not None:
        field(log, "probes", "dict", where, error)
    return log


def read_state(out_dir: Path) -> dict[str, Any]:
    """The parsed ``train_state.json`` of ``out_dir``, its format and version checked.

    Raises:
        TrainError: the file is missing, not JSON, not a train state, or of another version.
    """
    pending = _committed(out_dir)
    path = pending / STATE_FILE if pending is not None else out_dir / STATE_FILE  # a step being moved into place
    if not path.exists():
        raise TrainError(
            f"{out_dir} holds no resumable run ({STATE_FILE} is missing); start one without resume"
        )
    state = read_json(path, TrainError, max_bytes=1 << 30)  # histories grow with the steps
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise TrainError(f"{path} is not an attnres-probe train state (no format {STATE_FORMAT!r})")
    if state.get("format_version") != FORMAT_VERSION:
        raise TrainError(
            f"{path} has format_version {state.get('format_version')!r}; this toolkit resumes version {FORMAT_VERSION}"
        )
    for key, kind in (("model_config", dict), ("train_config", dict), ("step", int), ("data_sha256", str)):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise TrainError(f"{path}: {key} is missing or not a {kind.__name__}; the train state is corrupt")
    return state


def check_same(what: str, saved: dict[str, Any], given: dict[str, Any], out_dir: Path) -> None:
    """Raise :class:`TrainError` listing every key where a resume's ``given`` config differs from the ``saved`` one."""
    diff = [k for k in sorted(set(saved) | set(given)) if saved.get(k) != given.get(k)]
    if diff:
        detail = "; ".join(f"{k}: saved {saved.get(k)!r}, given {given.get(k)!r}" for k in diff)
        raise TrainError(f"cannot resume the run in {out_dir}: the {what} differs ({detail})")


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flatten AdamW's per-parameter state into ``optimizer.{index}.{key}`` tensors (on the CPU)."""
    out = {}
    for index, slots in opt.state_dict()["state"].items():
        for key, value in slots.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            out[f"optimizer.{index}.{key}"] = value.detach().cpu().contiguous()
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Inverse of :func:`optimizer_tensors`, into a freshly built optimizer over the same params.

    Raises:
        TrainError: a tensor of a parameter the optimizer does not have, or of another shape.
    """
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


def save_state(
    out_dir: Path,
    model: AttnResTransformer,
    opt: torch.optim.Optimizer,
    batch_gen: torch.Generator,
    doc: dict[str, Any],
) -> None:
    """Save one step as an atomic unit (see the module docstring): checkpoint, optimizer/RNG
    tensors, and the JSON that vouches for both, committed together.

    Call it with the run folder locked (:func:`~attnres_probe.io.exclusive_lock`). If it fails
    (a full disk), the previous step is left as it was and nothing of this one remains.

    Args:
        out_dir: the run folder.
        model: the model being trained.
        opt: its optimizer.
        batch_gen: the generator of the batch order.
        doc: the state document (:meth:`History.state_doc`); the two file hashes are added.
    """
    recover_run(out_dir)
    step = int(doc["step"])
    stage = out_dir / f"{_STEP_PREFIX}{step:08d}.tmp-{os.getpid()}"
    stage.mkdir()
    try:
        model.save(stage)
        fault_point("train.save:weights")
        tensors = optimizer_tensors(opt)
        tensors["rng.batches"] = batch_gen.get_state()
        tensors["rng.torch"] = torch.get_rng_state()
        meta = {"format": STATE_FORMAT, "format_version": str(FORMAT_VERSION)}
        save_safetensors(tensors, stage / STATE_TENSORS_FILE, metadata=meta)
        doc = {
            **doc,
            "weights_sha256": sha256_file(stage / WEIGHTS_FILE),
            "state_tensors_sha256": sha256_file(stage / STATE_TENSORS_FILE),
        }
        write_json(stage / STATE_FILE, doc)
        fault_point("train.save:staged")
        committed = out_dir / f"{_STEP_PREFIX}{step:08d}"
        os.rename(stage, committed)  # the commit: from here on, this step is the run's state
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    fault_point("train.save:committed")
    _move_into_place(out_dir, committed)


_STEP_PREFIX = ".step-"
_STEP_FILES = (CONFIG_FILE, WEIGHTS_FILE, STATE_TENSORS_FILE, STATE_FILE)  # the vouching JSON last


def _committed(out_dir: Path) -> Path | None:
    """The committed step folder whose files are not all in place yet (the newest, if several)."""
    found = [
        p
        for p in out_dir.glob(f"{_STEP_PREFIX}*")
        if p.is_dir() and ".tmp-" not in p.name and (p / STATE_FILE).is_file()
    ]
    return max(found, key=lambda p: p.name) if found else None


def _move_into_place(out_dir: Path, committed: Path) -> None:
    """Move a committed step's files onto their names in the run folder, the vouching JSON last."""
    for name in _STEP_FILES:
        if (committed / name).exists():
            os.replace(committed / name, out_dir / name)
            fault_point(f"train.save:moved:{name}")
    shutil.rmtree(committed, ignore_errors=True)


def recover_run(out_dir: Path) -> None:
    """Finish what a killed save left in ``out_dir`` (call it with the run folder locked).

    A committed step folder is moved into place; uncommitted step folders, empty leftovers and
    the temporary files of killed writers are removed. Nothing is done to a folder without them.
    """
    if not out_dir.is_dir():
        return
    pending = _committed(out_dir)
    if pending is not None:
        _move_into_place(out_dir, pending)
    for leftover in out_dir.glob(f"{_STEP_PREFIX}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    for name in (*_STEP_FILES, LOG_FILE):
        remove_stale_temps(out_dir / name)


def restore_state(out_dir: Path, opt: torch.optim.Optimizer, batch_gen: torch.Generator) -> None:
    """Inverse of :func:`save_state`'s tensors: AdamW's moments into ``opt``, both RNG states back.

    Call it on a model loaded with :func:`load_verified` (which checked the tensor file's hash)
    and an optimizer freshly built over its parameters.
    """
    path = out_dir / STATE_TENSORS_FILE
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise TrainError(f"cannot resume: {path} is unreadable ({exc})") from None
    for key in ("rng.batches", "rng.torch"):
        if key not in tensors:
            raise TrainError(f"cannot resume: {path} has no tensor {key!r}; the train state is corrupt")
    load_optimizer_tensors(opt, tensors, path)
    batch_gen.set_state(tensors["rng.batches"])
    torch.set_rng_state(tensors["rng.torch"])


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as indented, key-sorted JSON, atomically."""
    atomic_write(path, lambda p: p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n"))


def load_verified(out_dir: Path, state: dict[str, Any], device: torch.device) -> AttnResTransformer:
    """The saved model, after checking that weights and optimizer state belong to the same step.

    Raises:
        TrainError: a tensor file is missing or does not match the hash in ``train_state.json``.
        CheckpointError: the weights file is unreadable.
    """
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
