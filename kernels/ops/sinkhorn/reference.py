"""Sinkhorn-Knopp in PyTorch: the reference of :func:`~attnres_probe.kernels.sinkhorn` (every
device and dtype; autograd differentiates the loop)."""

from __future__ import annotations

import torch

__all__ = ["sinkhorn"]


def sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """``iters`` rounds of normalising the rows, then the columns, of ``exp(logits - rowmax)``
    [..., n, n] (the row maximum detached: it cancels in the first row normalisation). Sums are
    clamped at the dtype's smallest normal number before dividing."""
    m = logits - logits.amax(dim=-1, keepdim=True).detach()
    m = m.exp()
    tiny = torch.finfo(m.dtype).tiny
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True).clamp_min(tiny)
        m = m / m.sum(dim=-2, keepdim=True).clamp_min(tiny)
    return m
