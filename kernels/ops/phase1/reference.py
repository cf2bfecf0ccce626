"""Phase 1 of the two-phase Block schedule in plain PyTorch (the ``"torch"`` backend, and the
``"numba"`` one: there are no Numba phase kernels)."""

from __future__ import annotations

import torch

from ...utils import Sources, as_list, compute_dtype
from ..mixture.reference import weighted_sum
from ..rms.reference import inv_rms

__all__ = ["phase1"]


def phase1(
    sources: Sources,
    queries: torch.Tensor,
    eps: float = 1e-6,
    return_logits: bool = False,
):
    """Phase 1 in plain PyTorch: see :func:`attnres_probe.kernels.phase1`."""
    src = as_list(sources)
    if queries.dim() != 2 or queries.shape[-1] != src[0].shape[-1]:
        raise ValueError(f"queries must be [Q, {src[0].shape[-1]}]; got {tuple(queries.shape)}")
    out_dtype = src[0].dtype
    cdt = compute_dtype(src[0], queries)
    q = queries.to(cdt)
    inv = [inv_rms(v, eps, cdt) for v in src]
    # [Q, *batch, S]
    logits = torch.stack(
        [torch.movedim(v.to(cdt) @ q.T, -1, 0) * r.to(cdt) for v, r in zip(src, inv)], dim=-1
    )
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - lse.unsqueeze(-1))
    o_bar = weighted_sum(weights, src, cdt).to(out_dtype)
    if return_logits:
        return o_bar, lse, logits
    return o_bar, lse
