"""Depth-attention ops and their backend dispatch.

One public op, :func:`depth_attn`, plus the two-phase pair :func:`phase1` / :func:`phase2`
used by Block AttnRes. Each runs on one of three backends:

- ``"triton"``: the fused kernels in :mod:`attnres_probe.kernels.triton_depth_attn`
  (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``);
- ``"numba"``: the fused CPU kernels in :mod:`attnres_probe.kernels.numba_depth_attn`
  (float32/float64 CPU tensors; ``phase1``/``phase2`` run the reference there);
- ``"torch"``: the plain-PyTorch reference in :mod:`attnres_probe.kernels.reference`
  (every device and dtype; the test oracle).

Choice, first match wins: the ``backend=`` argument; the ``ATTNRES_BACKEND`` environment
variable (``torch`` | ``triton`` | ``numba`` | ``auto``); otherwise ``auto``: Triton for CUDA
tensors, Numba for float32/float64 CPU tensors, the reference for everything else. Forcing
``triton`` on CPU tensors works only under ``TRITON_INTERPRET=1`` (Triton's interpreter; this
is how CI tests the kernels).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from .reference import (
    Sources,
    check_width,
    contribution_shares,
    depth_attn_reference,
    inv_rms,
    phase1_reference,
    phase2_reference,
    validate_depth_attn_args,
)

Backend = Literal["auto", "torch", "triton", "numba"]
BACKENDS = ("auto", "torch", "triton", "numba")

__all__ = [
    "BACKENDS",
    "Backend",
    "contribution_shares",
    "depth_attn",
    "depth_attn_reference",
    "inv_rms",
    "phase1",
    "phase2",
    "requested_backend",
    "resolve_backend",
    "numba_available",
    "triton_available",
]


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        from . import triton_depth_attn  # noqa: F401
    except Exception as exc:  # triton missing, or not importable on this platform
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    """Whether the Triton kernels can be imported here."""
    return _triton_import_error() is None


@functools.lru_cache(maxsize=None)
def _numba_import_error() -> str | None:
    """Why the Numba kernels cannot be imported (None if they can); warns once, the first time."""
    try:
        from . import numba_depth_attn  # noqa: F401
    except Exception as exc:  # numba missing or broken (e.g. no writable cache folder)
        reason = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"the Numba CPU kernels could not be imported ({reason}); depth attention on the CPU uses the "
            "slower PyTorch reference instead (set ATTNRES_BACKEND=torch to choose it and silence this, or "
            "NUMBA_CACHE_DIR to a writable folder if the cache is the cause)",
            RuntimeWarning,
            stacklevel=3,
        )
        return reason
    return None


def numba_available() -> bool:
    """Whether the Numba CPU kernels can be imported here."""
    return _numba_import_error() is None


def _numba_takes(dtypes: tuple[torch.dtype | None, ...]) -> bool:
    return all(dt is None or dt in (torch.float32, torch.float64) for dt in dtypes)


def _triton_takes(dtypes: tuple[torch.dtype | None, ...], d: int | None) -> bool:
    from .triton_depth_attn import MAX_D, SUPPORTED_DTYPES

    return (d is None or d <= MAX_D) and all(dt is None or dt in SUPPORTED_DTYPES for dt in dtypes)


def requested_backend(backend: str | None = None) -> tuple[str, str]:
    """The backend asked for, and where: ``(backend, "backend argument")``, or, for None,
    ``ATTNRES_BACKEND`` (default ``"auto"``; its value is read case-insensitively).

    Raises:
        ValueError: for a name not in :data:`BACKENDS` (saying which are accepted).
    """
    source = "backend argument"
    if backend is None:
        backend = os.environ.get("ATTNRES_BACKEND", "auto").strip().lower() or "auto"
        source = "ATTNRES_BACKEND"
    if backend not in BACKENDS:
        raise ValueError(f"{source} is {backend!r}; accepted values are {', '.join(BACKENDS)}")
    return backend, source


def resolve_backend(
    device: torch.device | str,
    backend: str | None = None,
    *,
    dtypes: tuple[torch.dtype | None, ...] = (),
    d: int | None = None,
) -> Literal["torch", "triton", "numba"]:
    """Pick the backend for tensors on ``device``.

    Args:
        device: where the op's tensors live.
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"numba"`` or None (read
            ``ATTNRES_BACKEND``).
        dtypes, d: optionally, the op's input dtypes and width; ``auto`` then sends inputs the
            fused kernels do not take (float64 or d above the limit on CUDA, float16/bfloat16
            on the CPU) to the reference.

    Raises:
        ValueError: for an unknown backend name, or when a backend is asked for where it
            cannot run (Triton on CPU tensors without ``TRITON_INTERPRET=1``, Numba on
            non-CPU tensors, either not importable).
    """
    device = torch.device(device)
    backend, source = requested_backend(backend)
    on_gpu_or_interp = device.type == "cuda" or (device.type == "cpu" and _interpret_mode())
    if backend == "auto":
        if device.type == "cuda" and triton_available() and _triton_takes(tuple(dtypes), d):
            return "triton"
        if device.type == "cpu" and numba_available() and _numba_takes(tuple(dtypes)):
            return "numba"
        return "torch"
    if backend == "numba":
        if device.type != "cpu":
            raise ValueError(f"{source} asks for the numba backend, which runs on CPU tensors; the tensors are on {device}")
        err = _numba_import_error()
        if err is not None:
            raise ValueError(f"{source} asks for the numba backend, but it cannot be imported ({err})")
    if backend == "triton":
        if not on_gpu_or_interp:
            raise ValueError(
                f"{source} asks for the Triton backend, but the tensors are on {device}; "
                "Triton runs on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 is set"
            )
        err = _triton_import_error()
        if err is not None:
            raise ValueError(f"{source} asks for the Triton backend, but it cannot be imported ({err})")
    return backend  # type: ignore[return-value]


def _device_of(sources: Sources) -> torch.device:
    return sources.device if isinstance(sources, torch.Tensor) else sources[0].device


def depth_attn(
    sources: Sources,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
    *,
    inv_rms_cache=None,
    backend: str | None = None,
    trusted: bool = False,
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
        inv_rms_cache: reference backend only: per-source cached ``1/rms`` (ignored by the
            fused backends, which normalise inside the kernel at no extra memory traffic).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` | ``"numba"``; None reads
            ``ATTNRES_BACKEND``.
        trusted: for callers that already checked the arguments and resolved ``backend``
            with :func:`resolve_backend` (the model does, once per forward): skip both.
            This op runs once per read, so the checks are a real share of a small model's
            time.
        return_logits: also return the logits z [*batch, S] the op computed (its own: the
            weights are ``exp(z - lse)``; never rebuilt as ``log(weights) + lse``, which
            turns an underflowed weight into -inf).
        return_contrib: also return each source's contribution share in the mixture,
            ``w_i <v_i, h> / |h|^2`` [*batch, S] (no gradient; see
            :func:`~attnres_probe.kernels.reference.contribution_shares`). The Numba backend
            computes them in the forward pass itself, the others afterwards.
        width: give the weights, logits and shares this many columns (at least S; None:
            S), the columns past S padded with NaN (-inf for the logits): a read's row of the
            model's common source axis, as its hooks show it. The Numba kernels write the
            padded rows themselves; the padding has no gradient. With a width, these outputs
            are the caller's own (fresh tensors, safe to edit in place).

    Returns:
        (mixture [*batch, d] in the sources' dtype, lse [*batch]), then, each on request and
        in this order, the weights, the logits and the shares [*batch, width]. lse and these
        are float32, or float64 when the inputs are float64 (the reference and Numba compute
        in float64 then; the Triton backend rejects float64 and ``auto`` sends it to the
        reference).

    Raises:
        ValueError: for a bad argument (named in the message) or an unusable backend.
    """
    if trusted and backend in ("torch", "triton", "numba"):
        chosen = backend
    else:
        _, _, d = validate_depth_attn_args(sources, query, gain, eps)
        dtypes = (sources[0].dtype, query.dtype, None if gain is None else gain.dtype)
        chosen = resolve_backend(_device_of(sources), backend, dtypes=dtypes, d=d)
    if chosen == "numba":
        from .numba_depth_attn import depth_attn_numba

        return depth_attn_numba(
            sources, query, gain, eps, return_weights, validate=False, return_contrib=return_contrib,
            return_logits=return_logits, width=width,
        )
    n_src = len(sources)
    if width is not None:
        check_width(width, n_src)
    want_w = return_weights or return_contrib
    if chosen == "triton":
        from .triton_depth_attn import depth_attn_triton

        stacked = sources if isinstance(sources, torch.Tensor) else torch.stack(list(sources))
        outs = depth_attn_triton(stacked, query, gain, eps, want_w, return_logits)
    else:
        outs = depth_attn_reference(
            sources, query, gain, eps, want_w, inv_rms_cache=inv_rms_cache, validate=False, return_logits=return_logits
        )
    if return_contrib:
        mix, lse, w, *logits = outs
        outs = (mix, lse, *((w,) if return_weights else ()), *logits, contribution_shares(sources, mix, w))
    if width is None:
        return outs
    # padded copies, also at width == S: the caller (a model's hooks) may edit them in place, and
    # the reference's own weights and logits are saved for its backward
    pad = (0, width - n_src)
    mix, lse, *rest = outs
    fills = [float("nan")] * return_weights + [float("-inf")] * return_logits + [float("nan")] * return_contrib
    return (mix, lse, *(F.pad(t, pad, value=v) if pad[1] else t.clone() for t, v in zip(rest, fills)))


def phase1(
    sources: Sources,
    queries: torch.Tensor,
    eps: float = 1e-6,
    return_logits: bool = False,
    *,
    inv_rms_cache=None,
    backend: str | None = None,
):
    """Phase 1 of the two-phase Block AttnRes schedule (one launch for a whole block).

    Args:
        sources: completed block summaries [S, *batch, d] or a sequence of S [*batch, d].
        queries: [Q, d] gain-folded pseudo-queries of the Q reads of the block.
        eps: RMS epsilon.
        return_logits: also return the logits [Q, *batch, S] (the weights are
            ``exp(logits - lse)``).
        inv_rms_cache: reference backend only, as in :func:`depth_attn`.
        backend: as in :func:`depth_attn`.

    Returns:
        (o_bar [Q, *batch, d], lse [Q, *batch]) and, on request, logits [Q, *batch, S].
    """
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2 or queries.shape[0] == 0:
        raise ValueError(f"queries must be a [Q, d] tensor; got {getattr(queries, 'shape', type(queries))}")
    _, _, d = validate_depth_attn_args(sources, queries[0], None, eps)
    chosen = resolve_backend(_device_of(sources), backend, dtypes=(sources[0].dtype, queries.dtype), d=d)
    if chosen == "triton":
        from .triton_depth_attn import phase1_triton

        stacked = sources if isinstance(sources, torch.Tensor) else torch.stack(list(sources))
        return phase1_triton(stacked, queries, eps, return_logits)
    return phase1_reference(sources, queries, eps, return_logits, inv_rms_cache=inv_rms_cache)


def phase2(
    o_bar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    partial_inv_rms: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Phase 2: merge a read's phase-1 result with the current partial block.

    ``h = (1 - s) o_bar + s partial`` with ``s = sigmoid(z_p - lse)`` and ``1 - s =
    sigmoid(lse - z_p)`` (each computed directly: no cancellation when s is close to one),
    fused with the partial's key norm and logit ``z_p``.

    Returns:
        (h [*batch, d], lse_total [*batch], z_p [*batch]): the partial's weight is
        ``exp(z_p - lse_total)`` and a completed block's ``exp(z_i - lse_total)``.
    """
    validate_depth_attn_args([partial], query, gain, eps)
    if o_bar.shape != partial.shape:
        raise ValueError(f"o_bar has shape {tuple(o_bar.shape)}; it must match partial {tuple(partial.shape)}")
    if lse.shape != partial.shape[:-1]:
        raise ValueError(f"lse has shape {tuple(lse.shape)}; it must be {tuple(partial.shape[:-1])}")
    dtypes = (o_bar.dtype, lse.dtype, partial.dtype, query.dtype, None if gain is None else gain.dtype)
    chosen = resolve_backend(partial.device, backend, dtypes=dtypes, d=partial.shape[-1])
    if chosen == "triton":
        from .triton_depth_attn import phase2_triton

        return phase2_triton(o_bar, lse, partial, query, gain, eps)
    return phase2_reference(o_bar, lse, partial, query, gain, eps, partial_inv_rms=partial_inv_rms)
