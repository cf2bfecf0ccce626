"""Training: AdamW with warm-up + cosine decay on a byte corpus, seeded end to end, resumable.

One idea per module:

- :mod:`~attnres_probe.training.config`: :class:`TrainConfig` (optimisation and data
  settings), its validation, :class:`TrainError`;
- :mod:`~attnres_probe.training.schedule`: the learning rate of a step, AdamW's decay groups;
- :mod:`~attnres_probe.training.state`: the run folder and its resumable state (read, save,
  verify, restore);
- :mod:`~attnres_probe.training.loop`: :func:`train`, :func:`evaluate`, the loss of a window.

The ``attnres-probe train`` command is :mod:`attnres_probe.cli.train`.

    from attnres_probe import ModelConfig
    from attnres_probe.training import TrainConfig, train
    result = train(ModelConfig(residual="block"), TrainConfig(steps=500), "runs/block")
"""

from __future__ import annotations

from attnres_probe.training.config import TrainConfig, TrainError
from attnres_probe.training.loop import TrainResult, evaluate, frozen_gc, lm_loss, train
from attnres_probe.training.schedule import learning_rate, make_optimizer, param_groups
from attnres_probe.training.state import LOG_FILE, STATE_FILE, STATE_TENSORS_FILE, read_run_configs

__all__ = [
    "LOG_FILE",
    "STATE_FILE",
    "STATE_TENSORS_FILE",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "evaluate",
    "frozen_gc",
    "learning_rate",
    "lm_loss",
    "make_optimizer",
    "param_groups",
    "read_run_configs",
    "train",
]
