"""What the ops share in plain PyTorch: the argument checks, the dtype rule, gradients as a graph.

Every implementation of every op (``ops/<op>/reference.py``, ``numba.py``, ``triton.py``) and
the backend selection use these; none of them imports an op. Pure PyTorch: no Numba, no Triton.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple, Union

import torch

Sources = Union[torch.Tensor, Sequence[torch.Tensor]]

__all__ = [
    "Sources",
    "Where",
    "as_list",
    "check_width",
    "compute_dtype",
    "device_of",
    "folded_query",
    "graph_grads",
    "interpret_mode",
    "to_dtype",
    "validate_depth_attn_args",
]


def interpret_mode() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET`` set and not 0): on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Where(NamedTuple):
    """What choosing a backend needs to know about a call: where its tensors live, their dtypes
    (None for an absent optional tensor) and the feature width d."""

    device: torch.device
    dtypes: tuple[torch.dtype | None, ...]
    d: int


def device_of(sources: Sources) -> torch.device:
    """The device of a stacked sources tensor or of the first tensor of a sequence."""
    return sources.device if isinstance(sources, torch.Tensor) else sources[0].device


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def check_width(width: int, n_sources: int) -> int:
    """``width`` for an op's padded outputs (see :func:`attnres_probe.kernels.depth_attn`):
    an int no smaller than the number of sources, else a ValueError saying so."""
    if isinstance(width, bool) or not isinstance(width, int) or width < n_sources:
        raise ValueError(f"width is {width!r}; it must be an int >= the number of sources ({n_sources})")
    return width


def as_list(sources: Sources) -> list[torch.Tensor]:
    """The S sources as a list of [*batch, d] tensors (a stacked tensor is unbound, not copied)."""
    if isinstance(sources, torch.Tensor):
        return list(sources.unbind(0))
    return list(sources)


def to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (no call at all when it already is: this runs once per source per read)."""
    return t if t.dtype == dtype else t.to(dtype)


def folded_query(query: torch.Tensor, gain: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """query * gain in ``dtype`` (the query alone without a gain)."""
    q = query.to(dtype)
    return q * gain.to(dtype) if gain is not None else q


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
