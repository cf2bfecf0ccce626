"""Sinkhorn-Knopp on the CPU, compiled with Numba (the ``"numba"`` backend of
:func:`~attnres_probe.kernels.sinkhorn`).

Why a kernel: mHC projects one n x n matrix per token and sublayer (n = 4 streams), 20 rounds
of a row and a column normalisation. In PyTorch that is about 80 small ops per sublayer in the
forward and as many again in autograd's backward, each touching a few kilobytes: at the demo
size they made an mHC training step six times a PreNorm step. Here each token's matrix stays in
registers and local arrays: one pass forward, one pass backward, split over Numba's threads
by tokens.

Math (per token; ``M_0 = exp(L - rowmax L)``, then for k = 1..iters ``A_k = M_{k-1} / r_k``
with row sums ``r_k``, ``M_k = A_k / c_k`` with column sums ``c_k``; each sum clamped at the
smallest normal number ``tiny`` of the input dtype, as the reference):

    forward:   P = M_iters
    backward:  through  Y = X / s  (s the row or column sum of X):
               dX = (dY - sum(dY * Y) over the same row or column) / s   (s > tiny)
               dX = dY / tiny                                           (s clamped)
               and finally dL = dM_0 * M_0 (the detached maximum contributes nothing).

The backward recomputes the iterates from the logits (2 iters + 1 small matrices per token, in
a scratch array per thread) instead of keeping them: the op keeps only its input. Everything is
computed in float64 and the results are rounded once to the input dtype (float32 or float64).
"""

from __future__ import annotations

import os

import numba as nb
import numpy as np
import torch

__all__ = ["sinkhorn"]

_CACHE = os.environ.get("ATTNRES_NUMBA_CACHE", "1").strip() not in ("0", "false", "no", "off")


@nb.njit(nogil=True, error_model="numpy", cache=_CACHE)
def _iterates(L, k, n, iters, tiny, M):  # pragma: no cover - compiled
    """Fill M [2 iters + 1, n, n] with M_0, A_1, M_1, ..., A_iters, M_iters of token k."""
    for i in range(n):
        mx = L[k, i, 0]
        for j in range(1, n):
            if L[k, i, j] > mx:
                mx = L[k, i, j]
        for j in range(n):
            M[0, i, j] = np.exp(np.float64(L[k, i, j]) - np.float64(mx))
    for it in range(iters):
        src, dst = 2 * it, 2 * it + 1
        for i in range(n):
            s = 0.0
            for j in range(n):
                s += M[src, i, j]
            s = max(s, tiny)
            for j in range(n):
                M[dst, i, j] = M[src, i, j] / s
        src, dst = dst, dst + 1
        for j in range(n):
            s = 0.0
            for i in range(n):
                s += M[src, i, j]
            s = max(s, tiny)
            for i in range(n):
                M[dst, i, j] = M[src, i, j] / s


@nb.njit(nogil=True, parallel=True, error_model="numpy", cache=_CACHE)
def _forward(L, iters, tiny, out, n_chunks):  # pragma: no cover - compiled
    N, n = L.shape[0], L.shape[1]
    for c in nb.prange(n_chunks):
        M = np.empty((2 * iters + 1, n, n), np.float64)
        for k in range(c * N // n_chunks, (c + 1) * N // n_chunks):
            _iterates(L, k, n, iters, tiny, M)
            for i in range(n):
                for j in range(n):
                    out[k, i, j] = M[2 * iters, i, j]


@nb.njit(nogil=True, parallel=True, error_model="numpy", cache=_CACHE)
def _backward(L, dP, iters, tiny, dL, n_chunks):  # pragma: no cover - compiled
    N, n = L.shape[0], L.shape[1]
    for c in nb.prange(n_chunks):
        M = np.empty((2 * iters + 1, n, n), np.float64)
        g = np.empty((n, n), np.float64)
        for k in range(c * N // n_chunks, (c + 1) * N // n_chunks):
            _iterates(L, k, n, iters, tiny, M)
            for i in range(n):
                for j in range(n):
                    g[i, j] = dP[k, i, j]
            for it in range(iters - 1, -1, -1):
                Y, X = 2 * it + 2, 2 * it + 1  # column step: M[Y] = M[X] / colsum(M[X])
                for j in range(n):
                    s = 0.0
                    dot = 0.0
                    for i in range(n):
                        s += M[X, i, j]
                        dot += g[i, j] * M[Y, i, j]
                    if s > tiny:
                        for i in range(n):
                            g[i, j] = (g[i, j] - dot) / s
                    else:
                        for i in range(n):
                            g[i, j] = g[i, j] / tiny
                Y, X = 2 * it + 1, 2 * it  # row step: M[Y] = M[X] / rowsum(M[X])
                for i in range(n):
                    s = 0.0
                    dot = 0.0
                    for j in range(n):
                        s += M[X, i, j]
                        dot += g[i, j] * M[Y, i, j]
                    if s > tiny:
                        for j in range(n):
                            g[i, j] = (g[i, j] - dot) / s
                    else:
                        for j in range(n):
                            g[i, j] = g[i, j] / tiny
            for i in range(n):
                for j in range(n):
                    dL[k, i, j] = g[i, j] * M[0, i, j]


def _chunks(n_tokens: int) -> int:
    """Token ranges, one per thread: min(torch's threads, Numba's), at least 64 tokens each."""
    return max(1, min(torch.get_num_threads(), nb.config.NUMBA_NUM_THREADS, n_tokens // 64))


class SinkhornNumbaFunction(torch.autograd.Function):
    """Autograd for the kernels: keeps the logits, recomputes the iterates in the backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int) -> torch.Tensor:
        shape, dtype = logits.shape, logits.dtype
        n = shape[-1]
        L = logits.detach().reshape(-1, n, n).contiguous().numpy()
        tiny = float(torch.finfo(dtype).tiny)
        out = np.empty(L.shape, np.float64)
        if L.shape[0]:
            _forward(L, iters, tiny, out, _chunks(L.shape[0]))
        ctx.save_for_backward(logits)
        ctx.iters, ctx.tiny = iters, tiny
        return torch.from_numpy(out).to(dtype).reshape(shape)

    @staticmethod
    def backward(ctx, dP: torch.Tensor):
        (logits,) = ctx.saved_tensors
        n = logits.shape[-1]
        L = logits.detach().reshape(-1, n, n).contiguous().numpy()
        G = dP.detach().reshape(-1, n, n).contiguous().numpy()
        dL = np.empty(L.shape, np.float64)
        if L.shape[0]:
            _backward(L, G, ctx.iters, ctx.tiny, dL, _chunks(L.shape[0]))
        return torch.from_numpy(dL).to(logits.dtype).reshape(logits.shape), None


def sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """The Numba kernel of :func:`~attnres_probe.kernels.sinkhorn` (float32/float64 CPU tensors;
    computes in float64, rounds the result once to the input dtype)."""
    if logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the numba sinkhorn takes float32 or float64 logits; got {logits.dtype} (use the torch backend)")
    return SinkhornNumbaFunction.apply(logits, iters)
