"""Next-token cross-entropy: the one loss of the toolkit (model, training, probe, ablation).

Position t's logits score token t+1: for tokens [B, P] the targets are ``tokens[:, 1:]`` and
the scores ``logits[:, :P-1]``. Logits may cover all P positions (a forward over the tokens:
the last one predicts nothing) or only the first P-1 (a training window of P tokens run on its
first P-1). The cross-entropy is always taken in float32.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["Reduction", "next_token_loss", "trace_loss"]

Reduction = Literal["mean", "sum", "none"]
REDUCTIONS = ("mean", "sum", "none")


def next_token_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    reduction: Reduction = "mean",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of every next-token prediction.

    Args:
        logits: [B, P, vocab] or [B, P-1, vocab]; position t scores token t+1.
        tokens: [B, P] token ids (the targets are ``tokens[:, 1:]``).
        reduction: ``"mean"`` or ``"sum"`` over the counted targets (a scalar), or ``"none"``:
            the loss of every target, [B, P-1].
        mask: [B, P] bool, True at real (not padding) positions. A target counts only when it
            and the position predicting it are both real; with ``"none"`` the others are NaN,
            and a ``"mean"`` with no counted target is NaN. None counts every target.

    Returns:
        A scalar, or [B, P-1] with ``reduction="none"``; differentiable in ``logits``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction is {reduction!r}; accepted values are {', '.join(REDUCTIONS)}")
    B, P = tokens.shape
    if mask is None:
        ce = _cross_entropy(logits, tokens, reduction)
        return ce.view(B, P - 1) if reduction == "none" else ce
    ce = _cross_entropy(logits, tokens, "none").view(B, P - 1)
    valid = _counted(mask)
    if reduction == "none":
        return torch.where(valid, ce, torch.full_like(ce, float("nan")))
    if reduction == "sum":
        return (ce * valid).sum()
    return _masked_mean(ce, valid)


def trace_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss as a :class:`~attnres_probe.DepthTrace` stores it, and the mean to differentiate.

    One cross-entropy gives both: the per-token losses aligned with ``tokens`` (the loss at
    position t is that of predicting token t+1) and their mean over the counted targets (see
    :func:`next_token_loss`'s ``mask``).

    Args:
        logits: [B, P, vocab].
        tokens: [B, P] token ids.
        mask: [B, P] bool, True at real (not padding) positions.

    Returns:
        (per_token [B, P], detached, NaN at the last position, at padding and wherever a
        target does not count; mean, a differentiable scalar, NaN when nothing counts).
    """
    B, P = tokens.shape
    per_token = torch.full((B, P), float("nan"), device=logits.device)
    if P < 2:
        return per_token, torch.tensor(float("nan"), device=logits.device)
    ce = next_token_loss(logits, tokens, reduction="none")  # (B, P-1)
    valid = _counted(mask)
    per_token[:, :-1] = torch.where(valid, ce.detach(), torch.full_like(ce, float("nan")))
    return per_token, _masked_mean(ce, valid)


def _cross_entropy(logits: torch.Tensor, tokens: torch.Tensor, reduction: str) -> torch.Tensor:
    scores = logits[:, : tokens.shape[1] - 1]  # (B, P-1, vocab)
    return F.cross_entropy(scores.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction=reduction)


def _counted(mask: torch.Tensor) -> torch.Tensor:
    """Targets that count, [B, P-1]: the target and the position predicting it are both real."""
    return mask[:, 1:] & mask[:, :-1]


def _masked_mean(ce: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    n = valid.sum()
    return (ce * valid).sum() / n.clamp(min=1) if int(n) > 0 else ce.sum() * float("nan")
