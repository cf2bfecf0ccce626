"""Depth attention, the op of every AttnRes read: ``reference.py`` (PyTorch), ``numba.py`` (fused
CPU kernels), ``triton.py`` (fused GPU kernels), one signature; the public op is here."""

from __future__ import annotations

import torch

from ...dispatch import dispatch
from ...utils import Sources, Where, device_of, validate_depth_attn_args

__all__ = ["depth_attn"]


@dispatch("depth_attn")
def depth_attn(
    sources: Sources,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
    *,
    inv_rms_cache=None,
    backend: str | None = None,
    return_logits: bool = False,
    return_contrib: bool = False,
    width: int | None = None,
):
    """Depth attention: a softmax over depth sources scored by one pseudo-query.

    ``z_i = (query * gain) . v_i / rms(v_i)``, ``alpha = softmax(z)``,
    ``mixture = sum_i alpha_i v_i``, ``lse = logsumexp(z)``.

    Args:
        sources: [S, *batch, d], or a sequence of S tensors [*batch, d] (the Triton
            backend stacks a sequence into one buffer first).
        query: [d] pseudo-query.
        gain: [d] key-norm gain, or None for ones.
        eps: RMS epsilon, ``rms(v) = sqrt(mean(v^2) + eps)``.
        return_weights: also return the softmax weights the op used.
        inv_rms_cache: reference backend only: per-source ``1/rms``, each
            ``inv_rms(v_i, eps, compute dtype)`` [*batch], for a caller that reads the same
            sources many times (the model: every read of a Full or Block model). Ignored by the
            fused backends, which normalise inside the kernel at no extra memory traffic. Kept
            for speed: without it a training step (forward + backward) on the reference backend
            took 1.32x as long for Full and 1.12x for Block, at the demo size of
            ``benchmarks/probe.py`` (d=64, 8 layers, 8 x 128 tokens; an A/B of the model in one
            process, 25 interleaved rounds, median of per-round ratios, 2026-12-03).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` | ``"numba"``; None reads
            ``ATTNRES_BACKEND`` (``attnres_probe.kernels.backends``).
        return_logits: also return the logits z [*batch, S] the op computed (its own: the
            weights are ``exp(z - lse)``; never rebuilt as ``log(weights) + lse``, which
            turns an underflowed weight into -inf).
        return_contrib: also return each source's contribution share in the mixture,
            ``w_i <v_i, h> / |h|^2`` [*batch, S] (no gradient; see
            :func:`~attnres_probe.kernels.contribution_shares`). The Numba backend computes
            them in the forward pass itself, the others afterwards.
        width: give the weights, logits and shares this many columns (at least S; None: S), the
            columns past S padded with 0 (-inf for the logits): a read's row of the model's
            common source axis, as its hooks show them (TransformerLens's masking: a masked
            pattern entry is 0, a masked score -inf). With a width, these outputs are the
            caller's own (fresh tensors, safe to edit in place); the padding has no gradient.
            Kept for speed: the Numba kernels write the padded rows themselves, where padding
            afterwards costs a copy per output, about 90 us of a 500 us forward read (S=5
            sources [8, 128, 64], width 17; an A/B of this call in one process, 300 interleaved
            rounds, 2026-12-03), 2-5 % of a demo-size model's forward (docs/benchmarks.md,
            "Training throughput", session 4, has the history). The other backends pad
            afterwards, as a caller would.

    Returns:
        (mixture [*batch, d] in the sources' dtype, lse [*batch]), then, each on request and
        in this order, the weights, the logits and the shares [*batch, width]. lse and these
        are float32, or float64 when the inputs are float64 (the reference and Numba compute
        in float64 then; the Triton backend rejects float64 and ``auto`` sends it to the
        reference).

    Raises:
        ValueError: for a bad argument (named in the message) or an unusable backend.
    """
    # the checks: @dispatch resolves the backend from where they say the call runs, then calls it
    _, _, d = validate_depth_attn_args(sources, query, gain, eps)
    return Where(device_of(sources), (sources[0].dtype, query.dtype, None if gain is None else gain.dtype), d)
