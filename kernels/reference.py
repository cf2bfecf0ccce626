"""Plain-PyTorch depth attention: the oracle for the Triton kernels and the CPU path.

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
and caches each source's inverse RMS, see ``inv_rms``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

Sources = Union[torch.Tensor, Sequence[torch.Tensor]]

__all__ = [
    "Sources",
    "check_width",
    "compute_dtype",
    "contribution_shares",
    "depth_attn_reference",
    "graph_grads",
    "inv_rms",
    "phase1_reference",
    "phase2_reference",
    "rms_norm",
    "validate_depth_attn_args",
    "weighted_sum",
]


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def check_width(width: int, n_sources: int) -> int:
    """``width`` for an op's padded outputs (see :func:`attnres_probe.kernels.depth_attn`):
    an int no smaller than the number of sources, else a ValueError saying so."""
    if isinstance(width, bool) or not isinstance(width, int) or width < n_sources:
        raise ValueError(f"width is {width!r}; it must be an int >= the number of sources ({n_sources})")
    return width


def inv_rms(v: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """1 / sqrt(mean(v^2, -1) + eps) in ``dtype``: [*batch, d] -> [*batch]."""
    v = v.to(dtype)
    return torch.rsqrt(v.pow(2).mean(-1) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The models' RMSNorm: ``x / sqrt(mean(x^2, -1) + eps) * weight``, computed in float32
    (float64 stays float64) and returned in x's dtype."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight).to(x.dtype)


def graph_grads(fn, inputs: Sequence, upstream: Sequence) -> list:
    """Gradients of ``fn(*inputs)`` (PyTorch ops) for the ``upstream`` gradients of its outputs,
    built as a graph: what the kernel ops' backward returns under ``create_graph=True``, so that
    second-order gradients (gradient penalties, Hessian-vector products) are exact. The
    kernels' own gradients are not differentiable. None for an input that needs none.

    ``fn`` runs on fresh aliases of the inputs and the gradients are taken with respect to
    those: partial derivatives of this op alone. (Taken with respect to the inputs themselves,
    autograd would also follow every path by which one input depends on another through the
    outer graph, as later sources do on earlier ones.)
    """
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    out: list = [None] * len(inputs)
    with torch.enable_grad():
        alias = [t.view_as(t) if i in wanted else t for i, t in enumerate(inputs)]
        outs = fn(*alias)
        pairs = [(o, u) for o, u in zip(outs, upstream) if u is not None and o.requires_grad]
        if not wanted or not pairs:
            return out
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [alias[i] for i in wanted], [u for _, u in pairs], create_graph=True, allow_unused=True
        )
    for i, g in zip(wanted, grads):
        out[i] = g
    return out


def _as_list(sources: Sources) -> list[torch.Tensor]:
    if isinstance(sources, torch.Tensor):
        return list(sources.unbind(0))
    return list(sources)


def validate_depth_attn_args(
    sources: Sources,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[int, tuple[int, ...], int]:
    """Check the arguments of a depth-attention call; return (S, batch shape, d).

    Raises:
        ValueError: naming the argument that is wrong and what is accepted.
    """
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2:
            raise ValueError(
                f"sources must be [S, *batch, d] (at least 2 dims); got shape {tuple(sources.shape)}"
            )
        first = sources[0]
        n_src = sources.shape[0]
        src_list = [sources]
    else:
        if not isinstance(sources, Sequence) or len(sources) == 0:
            raise ValueError("sources must be a tensor [S, *batch, d] or a non-empty sequence of [*batch, d] tensors")
        if not all(isinstance(s, torch.Tensor) for s in sources):
            raise ValueError("sources: every element of the sequence must be a torch.Tensor")
        first = sources[0]
        n_src = len(sources)
        src_list = list(sources)
        for i, s in enumerate(src_list):
            if s.shape != first.shape:
                raise ValueError(
                    f"sources[{i}] has shape {tuple(s.shape)}; every source must match sources[0] {tuple(first.shape)}"
                )
            if s.dtype != first.dtype:
                raise ValueError(f"sources[{i}] has dtype {s.dtype}; every source must be {first.dtype}")
            if s.device != first.device:
                raise ValueError(f"sources[{i}] is on {s.device}; every source must be on {first.device}")
    if n_src < 1:
        raise ValueError("sources must hold at least one source (S >= 1); got S = 0")
    if first.dim() < 1 or first.shape[-1] < 1:
        raise ValueError(f"sources must have a last (feature) dimension d >= 1; got shape {tuple(first.shape)}")
    if not first.dtype.is_floating_point:
        raise ValueError(f"sources must be a floating-point tensor (float16/bfloat16/float32/float64); got {first.dtype}")
    d = first.shape[-1]
    if not isinstance(query, torch.Tensor):
        raise ValueError(f"query must be a torch.Tensor of shape [{d}]; got {type(query).__name__}")
    if query.shape != (d,):
        raise ValueError(f"query must have shape [{d}] (the sources' width); got {tuple(query.shape)}")
    if not query.dtype.is_floating_point:
        raise ValueError(f"query must be a floating-point tensor; got {query.dtype}")
    if query.device != first.device:
        raise ValueError(f"query is on {query.device}; it must be on the sources' device {first.device}")
    if gain is not None:
        if not isinstance(gain, torch.Tensor):
            raise ValueError(f"gain must be None or a torch.Tensor of shape [{d}]; got {type(gain).__name__}")
        if gain.shape != (d,):
            raise ValueError(f"gain must have shape [{d}] (the sources' width); got {tuple(gain.shape)}")
        if not gain.dtype.is_floating_point:
            raise ValueError(f"gain must be a floating-point tensor; got {gain.dtype}")
        if gain.device != first.device:
            raise ValueError(f"gain is on {gain.device}; it must be on the sources' device {first.device}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a non-negative number; got {eps!r}")
    return n_src, tuple(first.shape[:-1]), d


def _folded_query(query: torch.Tensor, gain: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    q = query.to(dtype)
    return q * gain.to(dtype) if gain is not None else q


def weighted_sum(weights: torch.Tensor, src: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """sum_i weights[..., i] * src[i], accumulated in place (autograd-safe: no saved value is overwritten)."""
    acc = weights[..., 0, None] * _as(src[0], dtype)
    for i in range(1, len(src)):
        acc.addcmul_(weights[..., i, None], _as(src[i], dtype))
    return acc


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (no call at all when it already is: this runs once per source per read)."""
    return t if t.dtype == dtype else t.to(dtype)


def contribution_shares(sources: Sources, h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Share of each source in the mixture h = sum_i w_i v_i: ``w_i <v_i, h> / |h|^2`` [*batch, S].

    The shares of a row sum to one (they may be negative, or above one, when sources point
    against each other). Computed without gradient, in the weights' dtype. ``h`` must be the
    mixture the weights produced (after any intervention).
    """
    with torch.no_grad():
        src = _as_list(sources)
        dt = weights.dtype
        hf = _as(h, dt)
        dots = torch.stack([torch.linalg.vecdot(_as(v, dt), hf) for v in src], dim=-1)
        return dots.mul_(weights).div_(torch.linalg.vecdot(hf, hf).unsqueeze(-1))


def depth_attn_reference(
    sources: Sources,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
    inv_rms_cache: Sequence[torch.Tensor] | None = None,
    validate: bool = True,
    return_logits: bool = False,
):
    """Depth attention in plain PyTorch.

    Args:
        sources: [S, *batch, d] tensor, or a sequence of S tensors [*batch, d].
        query: [d] pseudo-query of this read.
        gain: [d] key-norm gain (None means ones).
        eps: added to mean(v^2) inside the RMS.
        return_weights: also return the softmax weights.
        inv_rms_cache: optional per-source 1/rms(v_i), each [*batch], in the compute dtype.
            Must equal ``inv_rms(v_i, eps)``; lets a caller normalise each source once
            and reuse it over many reads.
        validate: check the arguments (callers that already did may skip it).
        return_logits: also return the logits z [*batch, S].

    Returns:
        (mixture [*batch, d] in the sources' dtype, lse [*batch]), then the weights
        [*batch, S] with ``return_weights`` and the logits [*batch, S] with ``return_logits``.
    """
    if validate:
        validate_depth_attn_args(sources, query, gain, eps)
    src = _as_list(sources)
    out_dtype = src[0].dtype
    cdt = compute_dtype(src[0], query, gain)
    q = _folded_query(query, gain, cdt)
    if inv_rms_cache is None:
        inv_rms_cache = [inv_rms(v, eps, cdt) for v in src]
    elif len(inv_rms_cache) != len(src):
        raise ValueError(f"inv_rms_cache has {len(inv_rms_cache)} entries; it must have one per source ({len(src)})")
    # z_i = (q . v_i) / rms(v_i): one dot product per source, no stacked copy of the sources.
    logits = torch.stack([(_as(v, cdt) @ q) * _as(r, cdt) for v, r in zip(src, inv_rms_cache)], dim=-1)  # [*batch, S]
    lse = torch.logsumexp(logits, dim=-1)  # [*batch]
    weights = torch.exp(logits - lse.unsqueeze(-1))  # [*batch, S]
    mix = weighted_sum(weights, src, cdt).to(out_dtype)
    return (mix, lse, *((weights,) if return_weights else ()), *((logits,) if return_logits else ()))


def phase1_reference(
    sources: Sources,
    queries: torch.Tensor,
    eps: float = 1e-6,
    return_logits: bool = False,
    inv_rms_cache: Sequence[torch.Tensor] | None = None,
):
    """Phase 1 of the two-phase block schedule: Q queries against the completed blocks.

    Args:
        sources: the completed block summaries [S, *batch, d] (or a sequence of S tensors).
        queries: [Q, d] gain-folded queries (query * gain of each read).
        eps: RMS epsilon.
        return_logits: also return the logits over the S sources.
        inv_rms_cache: optional per-source inverse RMS (see ``depth_attn_reference``).

    Returns:
        (o_bar [Q, *batch, d] normalised partial mixture in the sources' dtype,
         lse [Q, *batch]) and, on request, logits [Q, *batch, S]; the weights are
        ``exp(logits - lse)``.
    """
    src = _as_list(sources)
    if queries.dim() != 2 or queries.shape[-1] != src[0].shape[-1]:
        raise ValueError(f"queries must be [Q, {src[0].shape[-1]}]; got {tuple(queries.shape)}")
    out_dtype = src[0].dtype
    cdt = compute_dtype(src[0], queries)
    q = queries.to(cdt)
    if inv_rms_cache is None:
        inv_rms_cache = [inv_rms(v, eps, cdt) for v in src]
    # [Q, *batch, S]
    logits = torch.stack(
        [torch.movedim(v.to(cdt) @ q.T, -1, 0) * r.to(cdt) for v, r in zip(src, inv_rms_cache)], dim=-1
    )
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - lse.unsqueeze(-1))
    o_bar = weighted_sum(weights, src, cdt).to(out_dtype)
    if return_logits:
        return o_bar, lse, logits
    return o_bar, lse


def phase2_reference(
    o_bar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    partial_inv_rms: torch.Tensor | None = None,
):
    """Phase 2: merge one read's phase-1 result with the current partial block.

    ``h = (1 - s) o_bar + s partial`` with ``s = sigmoid(z_p - lse)`` and ``1 - s =
    sigmoid(lse - z_p)``, ``z_p = (query*gain) . partial / rms(partial)``. Both weights are
    computed directly: the form ``o_bar + s (partial - o_bar)`` cancels in float32 when s is
    close to one and the partial is small (docs/design.md, "The math").

    Args:
        o_bar: [*batch, d] phase-1 mixture of this read.
        lse: [*batch] phase-1 log-sum-exp of this read.
        partial: [*batch, d] the partial sum of the current block.
        query, gain: [d] this read's pseudo-query and key gain.
        eps: RMS epsilon.
        partial_inv_rms: optional cached 1/rms(partial) [*batch].

    Returns:
        (h [*batch, d] in the partial's dtype, lse_total [*batch], z_p [*batch]): the
        log-sum-exp over all sources and the partial's logit. The partial's weight is
        ``exp(z_p - lse_total)`` and completed block i has ``exp(z_i - lse_total)``.
    """
    cdt = compute_dtype(partial, query, gain, o_bar)
    q = _folded_query(query, gain, cdt)
    r = partial_inv_rms if partial_inv_rms is not None else inv_rms(partial, eps, cdt)
    z_p = (partial.to(cdt) @ q) * r.to(cdt)
    lse_c = lse.to(cdt)
    s = torch.sigmoid(z_p - lse_c).unsqueeze(-1)
    s_rest = torch.sigmoid(lse_c - z_p).unsqueeze(-1)  # 1 - s, without cancellation
    h = s_rest * o_bar.to(cdt) + s * partial.to(cdt)
    lse_total = torch.logaddexp(lse_c, z_p)
    return h.to(partial.dtype), lse_total, z_p
