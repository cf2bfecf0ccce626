"""The optimiser's schedule and groups: warm-up + cosine learning rate, AdamW decay groups.

The learning rate is a pure function of the step (no scheduler state), which is what makes a
resumed run equal the uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attnres_probe.depth_rules import DepthWeightedAverage
from attnres_probe.model import AttnResTransformer, DepthRead, RMSNorm
from attnres_probe.training.config import TrainConfig

__all__ = ["NO_DECAY_PARAMS", "learning_rate", "make_optimizer", "param_groups"]

NO_DECAY_PARAMS = ("W_E", "W_pos")  # embeddings: source 0 of every depth mixture


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
    """AdamW groups: decay on weight matrices; none on norms, biases, embeddings, depth rules.

    The no-decay group holds every RMSNorm gain (the depth mixers' ``norm.weight`` included),
    every bias, the token and position embeddings, every AttnRes mixer's ``query``, and every
    parameter of the other depth rules: Hyper-Connections' biases, projections and scales (its
    ``res_bias`` starts as the identity, which decay would pull towards 0) and DenseFormer's DWA
    weights.
    """
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, (RMSNorm, DepthRead, DepthWeightedAverage)):
            no_decay.update(id(p) for p in module.parameters(recurse=True))
    for name, p in model.named_parameters():
        if name.endswith("bias") or name in NO_DECAY_PARAMS or p.dim() < 2:
            no_decay.add(id(p))
    decay = [p for p in model.parameters() if id(p) not in no_decay]
    rest = [p for p in model.parameters() if id(p) in no_decay]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(model: AttnResTransformer, cfg: TrainConfig) -> torch.optim.AdamW:
    """The trainer's AdamW: :func:`param_groups`, step 0's learning rate, ``cfg``'s betas, and the
    multi-tensor ("foreach") update. That update computes the same numbers as torch's default
    per-parameter loop on the CPU, bit for bit (a test), without a Python loop over the parameters:
    the loop costs every model a fixed time per parameter tensor, and an AttnRes model has two more
    per read (its query and key gain) than the PreNorm baseline it is compared with."""
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=learning_rate(0, cfg), betas=(cfg.beta1, cfg.beta2), foreach=True
    )
