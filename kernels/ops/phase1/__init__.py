"""Phase 1 of the two-phase Block AttnRes schedule: ``reference.py`` (PyTorch, also the
``"numba"`` backend's), ``triton.py`` (fused GPU kernels), one signature; the public op is here."""

from __future__ import annotations

import torch

from ...dispatch import dispatch
from ...utils import Sources, Where, device_of, validate_depth_attn_args

__all__ = ["phase1"]


@dispatch("phase1")
def phase1(
    sources: Sources,
    queries: torch.Tensor,
    eps: float = 1e-6,
    return_logits: bool = False,
    *,
    backend: str | None = None,
):
    """Phase 1 of the two-phase Block AttnRes schedule (one launch for a whole block).

    Args:
        sources: completed block summaries [S, *batch, d] or a sequence of S [*batch, d].
        queries: [Q, d] gain-folded pseudo-queries of the Q reads of the block.
        eps: RMS epsilon.
        return_logits: also return the logits [Q, *batch, S] (the weights are
            ``exp(logits - lse)``).
        backend: as in :func:`~attnres_probe.kernels.depth_attn`; ``"numba"`` runs the
            reference (there are no Numba phase kernels).

    Returns:
        (o_bar [Q, *batch, d] normalised partial mixture in the sources' dtype, lse [Q, *batch])
        and, on request, logits [Q, *batch, S].

    Raises:
        ValueError: for a bad argument (named in the message) or an unusable backend.
    """
    # the checks: @dispatch resolves the backend from where they say the call runs, then calls it
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2 or queries.shape[0] == 0:
        raise ValueError(f"queries must be a [Q, d] tensor; got {getattr(queries, 'shape', type(queries))}")
    _, _, d = validate_depth_attn_args(sources, queries[0], None, eps)
    return Where(device_of(sources), (sources[0].dtype, queries.dtype), d)
