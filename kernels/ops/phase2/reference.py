"""Phase 2 of the two-phase Block schedule in plain PyTorch (the ``"torch"`` backend, and the
``"numba"`` one: there are no Numba phase kernels)."""

from __future__ import annotations

import torch

from ...utils import compute_dtype, folded_query
from ..rms.reference import inv_rms

__all__ = ["phase2"]


def phase2(
    o_bar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
):
    """Phase 2 in plain PyTorch: see :func:`attnres_probe.kernels.phase2`.

    Both weights of the merge are computed directly: the form ``o_bar + s (partial - o_bar)``
    cancels in float32 when s is close to one and the partial is small (docs/design.md, "The
    math").
    """
    cdt = compute_dtype(partial, query, gain, o_bar)
    q = folded_query(query, gain, cdt)
    r = inv_rms(partial, eps, cdt)
    z_p = (partial.to(cdt) @ q) * r.to(cdt)
    lse_c = lse.to(cdt)
    s = torch.sigmoid(z_p - lse_c).unsqueeze(-1)
    s_rest = torch.sigmoid(lse_c - z_p).unsqueeze(-1)  # 1 - s, without cancellation
    h = s_rest * o_bar.to(cdt) + s * partial.to(cdt)
    lse_total = torch.logaddexp(lse_c, z_p)
    return h.to(partial.dtype), lse_total, z_p
