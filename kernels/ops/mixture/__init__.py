"""Mixtures: :func:`weighted_sum` (``sum_i w_i v_i`` for given weights: the reference's mixture,
and the model's after a hook changed a read's weights) and :func:`contribution_shares` (each
source's share ``w_i <v_i, h> / |h|^2``). PyTorch only (``reference.py``)."""

from .reference import contribution_shares, weighted_sum

__all__ = ["contribution_shares", "weighted_sum"]
