"""Residual rules beyond AttnRes, seen through effective depth weights (issue #36).

Hyper-Connections / mHC (:mod:`.hyper`) and DenseFormer (:mod:`.denseformer`) keep every
sublayer's input a linear combination of the embedding and the earlier sublayers' outputs. The
coefficients of that combination, per read and per token, are these rules' depth weights on the
common source axis ``[embed, L0.attn, L0.mlp, ...]`` (the Full/PreNorm axis of
:class:`~attnres_probe.axis.SourceAxis`), with reads ``[L0.attn, L0.mlp, ..., final]``:

- :func:`hyper_read_coefficients` from the :class:`StreamWeights` a forward used;
- :func:`denseformer_read_coefficients` from the DWA weights (the same for every token);
- :func:`watch_hyper_connections` (:mod:`.watch_hc`): the same coefficients recorded from a model
  built with the ``hyper-connections`` package (imported lazily).

Unlike AttnRes's softmax weights these coefficients need not be non-negative or sum to one
(PreNorm's are all one); :func:`normalise_coefficients` divides a read's row by its sum, the
form the routing diagnostics use. docs/depth_rules.md has the formulas and conventions.

:class:`~attnres_probe.ModelConfig` offers them as ``residual="hyper"`` and
``residual="denseformer"`` (the model's forwards use these modules).
"""

from __future__ import annotations

import torch

from .denseformer import DepthWeightedAverage, denseformer_read_coefficients, dwa_after, dwa_sources
from .hyper import (
    HyperConnection,
    HyperStep,
    StreamWeights,
    expand_streams,
    from_package_layout,
    hyper_read_coefficients,
    package_to_ours,
    reduce_streams,
    sinkhorn,
    to_package_layout,
)
from .watch_hc import HCCall, HCWatch, watch_hyper_connections

__all__ = [
    "DepthWeightedAverage",
    "HCCall",
    "HCWatch",
    "HyperConnection",
    "HyperStep",
    "StreamWeights",
    "denseformer_read_coefficients",
    "dwa_after",
    "dwa_sources",
    "expand_streams",
    "from_package_layout",
    "hyper_read_coefficients",
    "normalise_coefficients",
    "package_to_ours",
    "read_labels",
    "reduce_streams",
    "sinkhorn",
    "source_labels",
    "to_package_layout",
    "watch_hyper_connections",
]


def source_labels(n_layers: int) -> list[str]:
    """``["embed", "L0.attn", "L0.mlp", ...]`` (2 n_layers + 1 columns)."""
    return ["embed", *(f"L{i}.{kind}" for i in range(n_layers) for kind in ("attn", "mlp"))]


def read_labels(n_layers: int) -> list[str]:
    """``["L0.attn", "L0.mlp", ..., "final"]`` (2 n_layers + 1 rows)."""
    return [*source_labels(n_layers)[1:], "final"]


def normalise_coefficients(coefficients: torch.Tensor) -> torch.Tensor:
    """Each read's coefficients [..., reads, sources] divided by their sum over the sources.

    The result sums to one over each row, like AttnRes's weights, but entries may be negative or
    above one (HC and DenseFormer weights are unconstrained); a row whose coefficients cancel (sum
    under :data:`attnres_probe.numeric.CANCELLED` of their absolute sum) gives NaN, as the pages do.
    """
    from attnres_probe.numeric import CANCELLED

    total = coefficients.sum(-1, keepdim=True)
    ok = (total.abs() >= CANCELLED * coefficients.abs().sum(-1, keepdim=True)) & (total != 0)
    return torch.where(ok, coefficients / torch.where(ok, total, torch.ones_like(total)), torch.full_like(coefficients, float("nan")))
