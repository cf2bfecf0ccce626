"""Phase 2 of the two-phase Block AttnRes schedule: ``reference.py`` (PyTorch, also the
``"numba"`` backend's), ``triton.py`` (fused GPU kernels), one signature; the public op is here."""

from __future__ import annotations

import torch

from ...dispatch import dispatch
from ...utils import Where, validate_depth_attn_args

__all__ = ["phase2"]


@dispatch("phase2")
def phase2(
    o_bar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
):
    """Phase 2: merge a read's phase-1 result with the current partial block.

    ``h = (1 - s) o_bar + s partial`` with ``s = sigmoid(z_p - lse)`` and ``1 - s =
    sigmoid(lse - z_p)`` (each computed directly: no cancellation when s is close to one),
    fused with the partial's key norm and logit ``z_p = (query*gain) . partial / rms(partial)``.

    Args:
        o_bar: [*batch, d] phase-1 mixture of this read.
        lse: [*batch] phase-1 log-sum-exp of this read.
        partial: [*batch, d] the partial sum of the current block.
        query, gain: [d] this read's pseudo-query and key gain (None for ones).
        eps: RMS epsilon.
        backend: as in :func:`~attnres_probe.kernels.depth_attn`; ``"numba"`` runs the
            reference (there are no Numba phase kernels).

    Returns:
        (h [*batch, d] in the partial's dtype, lse_total [*batch], z_p [*batch]): the
        log-sum-exp over all sources and the partial's logit. The partial's weight is
        ``exp(z_p - lse_total)`` and completed block i has ``exp(z_i - lse_total)``.

    Raises:
        ValueError: for a bad argument (named in the message) or an unusable backend.
    """
    # the checks: @dispatch resolves the backend from where they say the call runs, then calls it
    validate_depth_attn_args([partial], query, gain, eps)
    if o_bar.shape != partial.shape:
        raise ValueError(f"o_bar has shape {tuple(o_bar.shape)}; it must match partial {tuple(partial.shape)}")
    if lse.shape != partial.shape[:-1]:
        raise ValueError(f"lse has shape {tuple(lse.shape)}; it must be {tuple(partial.shape[:-1])}")
    dtypes = (o_bar.dtype, lse.dtype, partial.dtype, query.dtype, None if gain is None else gain.dtype)
    return Where(partial.device, dtypes, partial.shape[-1])
