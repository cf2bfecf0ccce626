"""Mixtures in plain PyTorch (this op has no fused version): the mixture of given weights, and
each source's share in a mixture. The Numba depth kernels compute the shares in their own
mixing pass (``depth_attn(..., return_contrib=True)``); the other backends call these."""

from __future__ import annotations

import torch

from ...utils import Sources, as_list, to_dtype

__all__ = ["contribution_shares", "weighted_sum"]


def weighted_sum(weights: torch.Tensor, src: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """sum_i weights[..., i] * src[i], accumulated in place (autograd-safe: no saved value is overwritten)."""
    acc = weights[..., 0, None] * to_dtype(src[0], dtype)
    for i in range(1, len(src)):
        acc.addcmul_(weights[..., i, None], to_dtype(src[i], dtype))
    return acc


def contribution_shares(sources: Sources, h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Share of each source in the mixture h = sum_i w_i v_i: ``w_i <v_i, h> / |h|^2`` [*batch, S].

    The shares of a row sum to one (they may be negative, or above one, when sources point
    against each other). Computed without gradient, in the weights' dtype. ``h`` must be the
    mixture the weights produced (after any intervention).
    """
    with torch.no_grad():
        src = as_list(sources)
        dt = weights.dtype
        hf = to_dtype(h, dt)
        dots = torch.stack([torch.linalg.vecdot(to_dtype(v, dt), hf) for v in src], dim=-1)
        return dots.mul_(weights).div_(torch.linalg.vecdot(hf, hf).unsqueeze(-1))
