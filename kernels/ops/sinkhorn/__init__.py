"""Sinkhorn-Knopp projection towards the doubly stochastic matrices (mHC's residual mixing,
:mod:`attnres_probe.depth_rules.hyper`): ``reference.py`` (PyTorch, also the ``"triton"``
backend's) and ``numba.py`` (a fused CPU kernel with its own backward), one signature; the
public op is here."""

from __future__ import annotations

import torch

from ...dispatch import dispatch
from ...utils import Where

__all__ = ["sinkhorn"]


@dispatch("sinkhorn")
def sinkhorn(logits: torch.Tensor, iters: int = 20, *, backend: str | None = None) -> torch.Tensor:
    """``iters`` rounds of normalising the rows, then the columns, of ``exp(logits)`` [..., n, n].

    The maximum of each row is subtracted first (it cancels in the first row normalisation);
    every sum is clamped at the dtype's smallest normal number before dividing. After the last
    round the columns sum to one to rounding, the rows within the Sinkhorn tolerance
    (docs/depth_rules.md).

    Args:
        logits: [..., n, n], float (the Numba kernel takes float32/float64 CPU tensors and
            computes in float64; ``auto`` sends other dtypes to the reference).
        iters: rounds (at least 1).
        backend: as in :func:`~attnres_probe.kernels.depth_attn`; ``"triton"`` runs the
            reference (the op is [..., n, n] with n a handful of streams: no GPU kernel).

    Returns:
        [..., n, n] in the dtype of ``logits``.

    Raises:
        ValueError: for a bad argument (named in the message) or an unusable backend.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must be a [..., n, n] tensor; got {getattr(logits, 'shape', type(logits))}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point; got {logits.dtype}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive integer; got {iters!r}")
    return Where(logits.device, (logits.dtype,), int(logits.shape[-1]))
