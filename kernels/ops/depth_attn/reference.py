"""Depth attention in plain PyTorch (the ``"torch"`` backend): the oracle of the fused kernels.

Depth attention mixes S depth sources of width d at every token with one learned query
(docs/design.md, "The math"):

    k_i = gain * v_i / rms(v_i),   rms(v) = sqrt(mean(v^2) + eps)
    z_i = query . k_i = (query * gain) . v_i / rms(v_i)
    alpha = softmax(z),  lse = logsumexp(z),  h = sum_i alpha_i v_i

Values are the unnormalised sources. Everything is computed in float32 (float64 when any
input is float64), whatever the input dtype; the mixture is returned in the sources' dtype,
the log-sum-exp and the weights in the compute dtype.

Sources may be one stacked tensor ``[S, *batch, d]`` or a sequence of S tensors
``[*batch, d]``; the sequence form never stacks them (the model keeps its sources as a list
and caches each source's inverse RMS, see ``inv_rms_cache``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ...utils import Sources, as_list, check_width, compute_dtype, folded_query, to_dtype
from ..mixture.reference import contribution_shares, weighted_sum
from ..rms.reference import inv_rms

__all__ = ["depth_attn", "finish"]


def depth_attn(
    sources: Sources,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
    *,
    inv_rms_cache: Sequence[torch.Tensor] | None = None,
    return_logits: bool = False,
    return_contrib: bool = False,
    width: int | None = None,
):
    """Depth attention in plain PyTorch: see :func:`attnres_probe.kernels.depth_attn`.

    The arguments are not checked here (the public op checks them); ``width`` is.
    ``inv_rms_cache``, when given, must equal ``[inv_rms(v_i, eps, compute dtype) for v_i in
    sources]``: the only backend that reads it.
    """
    if width is not None:
        check_width(width, len(sources))
    src = as_list(sources)
    out_dtype = src[0].dtype
    cdt = compute_dtype(src[0], query, gain)
    q = folded_query(query, gain, cdt)
    if inv_rms_cache is None:
        inv_rms_cache = [inv_rms(v, eps, cdt) for v in src]
    elif len(inv_rms_cache) != len(src):
        raise ValueError(f"inv_rms_cache has {len(inv_rms_cache)} entries; it must have one per source ({len(src)})")
    # z_i = (q . v_i) / rms(v_i): one dot product per source, no stacked copy of the sources.
    logits = torch.stack([(to_dtype(v, cdt) @ q) * to_dtype(r, cdt) for v, r in zip(src, inv_rms_cache)], dim=-1)  # [*batch, S]
    lse = torch.logsumexp(logits, dim=-1)  # [*batch]
    weights = torch.exp(logits - lse.unsqueeze(-1))  # [*batch, S]
    mix = weighted_sum(weights, src, cdt).to(out_dtype)
    want_w = return_weights or return_contrib
    outs = (mix, lse, *((weights,) if want_w else ()), *((logits,) if return_logits else ()))
    return finish(outs, sources, return_weights, return_logits, return_contrib, width)


def finish(outs: tuple, sources: Sources, return_weights: bool, return_logits: bool, return_contrib: bool, width: int | None):
    """The op's outputs from a backend's own ``(mix, lse[, weights][, logits])`` (the weights
    there when asked for or needed for the shares): the contribution shares added on request,
    computed after the mixture, and the weights, logits and shares padded to ``width``
    (checked by the caller). The Triton backend shares this; the Numba kernels do both
    themselves."""
    n_src = len(sources)
    if return_contrib:
        mix, lse, w, *logits = outs
        outs = (mix, lse, *((w,) if return_weights else ()), *logits, contribution_shares(sources, mix, w))
    if width is None:
        return outs
    # padded copies, also at width == S: the caller (a model's hooks) may edit them in place, and
    # the reference's own weights and logits are saved for its backward
    pad = (0, width - n_src)
    mix, lse, *rest = outs
    fills = [0.0] * return_weights + [float("-inf")] * return_logits + [0.0] * return_contrib
    return (mix, lse, *(F.pad(t, pad, value=v) if pad[1] else t.clone() for t, v in zip(rest, fills)))
