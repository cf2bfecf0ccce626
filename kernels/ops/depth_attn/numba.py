"""Fused CPU kernels for depth attention, compiled with Numba (the ``"numba"`` backend).

The math is the reference's (``reference.py`` beside this file; docs/design.md, "The math").
With the gain folded into the query, ``q = query * gain``, every token row and source ``v_i`` gives

    r_i = rsqrt(mean(v_i^2) + eps),   z_i = r_i (q . v_i),
    alpha = softmax(z),   lse = logsumexp(z),   h = sum_i alpha_i v_i.

Why a CPU kernel: on the CPU the reference is a chain of small PyTorch ops per source and
read (a dot product, a scale, an accumulate), and autograd doubles that chain in the
backward. At the demo models' width (d = 64) those ops, not the arithmetic, are the cost.
These kernels do each read in two passes over its sources (one for norms and logits, one for
the mixture; a third, over rows still in cache, for the contribution shares when asked) and
the backward in two more, with no intermediate tensor of the sources' size.

Forward (``_forward_rows``), by tiles of 32 token rows: pass 1 walks each source row once and
computes its sum of squares and its dot product with q (they share the load). The tile's
norms, logits, softmax and lse are then computed on small source-major scratch arrays
([S, 32]), so that each step is a loop over rows that LLVM vectorises (square roots,
divisions, and exp through ``_exp_f32``, a Cephes-style float32 exp, since libm's ``expf``
is a scalar call; float64 uses libm's). Pass 2 reads the tile's source rows again, from
cache, for the mixture (two sources at a time); on request a third reads them once more, still
from cache, for the contribution shares.
The weights, logits and inverse RMS ([3, S, M], small) are kept for the backward; the
weights and logits the op returns are written from the same tile, already padded to the
caller's width (a read's row of the model's common source axis: 0, -inf for the logits),
so the model shows them to its hooks without a copy or a pad. The kernels use NumPy's error
model: a division by zero gives inf/NaN, as in PyTorch, instead of raising.

Backward (``_backward_rows``), with upstream gradients ``dh`` (mixture), ``dlse``, ``dw``
(weights) and ``dz`` (logits), each present only when that output reached the loss:

    dalpha_i = dh . v_i + dw_i,          D = sum_j alpha_j dalpha_j,
    dz_i     = alpha_i (dalpha_i - D) + alpha_i dlse + dz_i(upstream),
    dv_i     = alpha_i dh + dz_i r_i q - dz_i z_i r_i v_i / d,
    dq       = sum_rows sum_i dz_i r_i v_i.

The last two lines are ``dz_i`` times the derivative of ``z_i = r_i (q . v_i)`` through both
the dot product and the RMS (``dr_i/dv_i = -r_i^3 v_i / d``). The query gradient is summed
in the compute dtype over blocks of 256 rows and those sums are added in float64; the query
and gain gradients (``dq * gain``, ``dq * query``) are rounded once from that.

How the kernels see the sources: a read mixes S separate tensors, and stacking them would
copy every source at every read. A :class:`SourceTable` holds their addresses instead; it is
built only from tensors it has checked (CPU, one dtype, contiguous, one shape), so every
address points at ``n_rows * d`` elements of the kernels' dtype. Every other array reaches
the kernels as a NumPy array with its own shape. The op's outputs and the sources'
gradients are allocated as NumPy arrays and handed to torch without a copy
(``torch.from_numpy``); each source's gradient gets a storage of its own, so that autograd
adds a source's gradients from later reads into it in place.

Conventions and limits:

- float32 and float64 only (float64 computes in float64); ``auto`` sends float16/bfloat16
  CPU tensors to the reference, and forcing this backend on them raises a ValueError.
- CPU tensors only. Contiguous sources are used in place; others are copied once.
- The kernels release the GIL. A call that touches at least ``PARALLEL_MIN_ELEMENTS`` source
  elements is split by token rows over Numba's threads (``prange``; one range per thread,
  ``min(torch.get_num_threads(), NUMBA_NUM_THREADS)`` of them when there are at least two rows
  per range, each writing its own rows and its own float64 partial
  query gradient, added in a fixed order). One such call runs at a time; a concurrent
  caller that finds it busy runs on its own thread, as do smaller calls. Concurrent callers
  (the dashboard's server threads) share no state.
- They are compiled on first use (a few seconds per kernel and dtype, more for the threaded
  versions) and Numba caches the machine code on disk, next to this module in ``__pycache__``
  (or under ``NUMBA_CACHE_DIR``), so later processes start in a fraction of a second. Like
  Python's own ``.pyc`` files, that cache is written and read only by this library on this
  machine (Numba's index format uses pickle); ``ATTNRES_NUMBA_CACHE=0`` compiles in memory
  in every process instead and never reads or writes it.
- Phase 1 and phase 2 of the two-phase Block schedule have no Numba kernels: on the CPU the
  model uses the sequential schedule, and ``phase1``/``phase2`` with this backend run the
  reference (the dispatch table, ``kernels/dispatch.py``, says so).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numba as nb
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ...utils import check_width, graph_grads
from . import reference

__all__ = ["SUPPORTED_DTYPES", "SourceTable", "depth_attn"]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

# Reassociation lets LLVM vectorise the row reductions; no flag that assumes finite values,
# so NaN and inf propagate exactly as in the reference.
_FASTMATH = {"reassoc", "contract", "nsz"}
# Numba's on-disk cache of these kernels (see the module docstring); ATTNRES_NUMBA_CACHE=0 turns it off.
_CACHE = os.environ.get("ATTNRES_NUMBA_CACHE", "1").strip() not in ("0", "false", "no", "off")
_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}


class SourceTable:
    """The addresses of S tensors of one shape [*batch, d], for the kernels.

    Built only from tensors checked here: CPU, of ``dtype`` (float32 or float64), contiguous,
    all of one shape with ``d >= 1``. The kernels read ``n_rows * d`` elements at each
    address, which these checks keep in bounds; the table holds the tensors, so they live as
    long as it does.

    Args:
        tensors: the S tensors (S >= 1).
        dtype: the kernels' dtype.

    Raises:
        ValueError: naming the first tensor that is not as described, and why.
    """

    __slots__ = ("addresses", "tensors", "n_rows", "d")

    def __init__(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype):
        if dtype not in _NP_DTYPE:
            raise ValueError(f"a source table holds float32 or float64 tensors; got dtype {dtype}")
        tensors = tuple(tensors)
        if not tensors:
            raise ValueError("a source table needs at least one tensor; got none")
        first = tensors[0]
        shape = first.shape if isinstance(first, torch.Tensor) else None
        # one quick pass (this runs for every read); the slow pass below only names the culprit
        if shape is None or not all(
            isinstance(t, torch.Tensor) and t.is_cpu and t.dtype is dtype and t.shape == shape and t.is_contiguous()
            for t in tensors
        ):
            _explain_bad_sources(tensors, dtype)
        if first.dim() < 1 or first.shape[-1] < 1:
            raise ValueError(f"sources must have a last (feature) dimension d >= 1; got shape {tuple(first.shape)}")
        self.tensors = tensors
        self.d = int(first.shape[-1])
        self.n_rows = first.numel() // self.d
        self.addresses = np.array([t.data_ptr() for t in tensors], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tensors)


def _explain_bad_sources(tensors: tuple, dtype: torch.dtype) -> None:
    """Raise a ValueError naming the first tensor a :class:`SourceTable` cannot hold, and why."""
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"source {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.device.type != "cpu":
            raise ValueError(f"source {i} is on {t.device}; the numba kernels read CPU tensors")
        if t.dtype != dtype:
            raise ValueError(f"source {i} has dtype {t.dtype}; the table's dtype is {dtype}")
        if t.shape != first.shape:
            raise ValueError(f"source {i} has shape {tuple(t.shape)}; source 0 has {tuple(first.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"source {i} is not contiguous (strides {t.stride()}); make it contiguous first")


@intrinsic
def _pointer(typingctx, address, scalar):
    """A pointer to ``scalar``'s type at integer ``address``."""
    ptr_t = types.CPointer(scalar)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_t))

    return ptr_t(types.int64, scalar), codegen


@nb.njit(nogil=True, cache=_CACHE)
def _source(table, i, n_rows, d, one):  # pragma: no cover - compiled
    """Source i of a :class:`SourceTable`'s addresses as an [n_rows, d] array of ``one``'s dtype."""
    return nb.carray(_pointer(table[i], one), (n_rows, d))


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bit pattern is the int32 ``bits``."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@nb.njit(nogil=True, fastmath={"nsz"}, error_model="numpy", cache=_CACHE)
def _exp_f32(x):  # pragma: no cover - compiled
    """exp for float32 that LLVM can vectorise (libm's ``expf`` is a scalar call).

    Cephes ``expf``: ``exp(x) = 2^n exp(r)`` with ``n = round(x / ln 2)``, ``|r| <= ln2 / 2``,
    ``r`` from a two-constant (Cody-Waite) split of ``n ln 2`` and ``exp(r)`` from a degree-6
    polynomial; relative error about 1e-7 (float32 rounding). Compiled without ``reassoc``,
    which would merge the split. Returns 0 below -87.34 (where float32 results are
    subnormal, below 1.2e-38, or 0), inf above 88.72 (beyond float32), NaN for NaN.
    """
    xc = min(max(x, np.float32(-87.33654)), np.float32(88.72283))
    n = np.floor(xc * np.float32(1.44269504088896341) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    e = np.int32(n)
    big = e > np.int32(127)  # n = 128 for x in (88.38, 88.72]: 2^128 is not a float32, 2 * 2^127 is
    y = p * _f32_from_bits((e - np.int32(1) if big else e) + np.int32(127) << np.int32(23))
    if big:
        y = y * np.float32(2.0)
    if x < np.float32(-87.33654):
        y = np.float32(0.0)
    if x > np.float32(88.72283):
        y = np.float32(np.inf)
    if np.isnan(x):
        y = x
    return y


def _exp(x):  # pragma: no cover - replaced by the overload inside compiled code
    return np.exp(x)


@overload(_exp)
def _exp_overload(x):
    """exp in the kernels: the vectorisable float32 version, libm's exp for float64."""
    if x == types.float32:
        return lambda x: _exp_f32(x)
    return lambda x: np.exp(x)


@nb.njit(nogil=True, cache=_CACHE)
def _fold(query, gain, has_gain):  # pragma: no cover - compiled
    """q = query * gain [d] (query alone without a gain)."""
    q = np.empty_like(query)
    for k in range(query.shape[0]):
        q[k] = query[k] * gain[k] if has_gain else query[k]
    return q


@nb.njit(nogil=True, cache=_CACHE)
def _store_padded(out, m0, T, tile, fill):  # pragma: no cover - compiled
    """Rows m0..m0+T-1 of ``out`` [n_rows, W] from a source-major tile [S, _TILE]: columns 0..S-1
    the tile's, the rest ``fill`` (the padding of the common source axis)."""
    S = tile.shape[0]
    for t in range(T):
        for i in range(S):
            out[m0 + t, i] = tile[i, t]
        for i in range(S, out.shape[1]):
            out[m0 + t, i] = fill


# Token rows per forward tile: the tile's scalars (norms, logits, softmax) are kept
# source-major in small [S, TILE] scratch arrays, so each scalar step is a loop over the
# tile's rows that LLVM vectorises (sqrt, divide, exp), instead of a chain of dependent
# scalar operations per row.
_TILE = 32


@nb.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=_CACHE)
def _forward_rows(src, n_rows, d, query, gain, has_gain, eps, one, h, lse, wzi, w_out, z_out, c, want, lo, hi):  # pragma: no cover
    """Token rows lo..hi-1 of the forward.

    Args:
        src: a :class:`SourceTable`'s addresses (S sources, [n_rows, d] each).
        query, gain: [d] (gain read only with ``has_gain``).
        eps, one: the RMS epsilon and 1, in the compute dtype (so nothing is promoted to float64).
        h: [n_rows, d] the mixture (written).
        lse: [n_rows] (written).
        wzi: [3, S, n_rows] weights, logits and inverse RMS, source-major like the tile, so that
            each is stored as contiguous runs of rows (written; the backward's).
        w_out, z_out, c: [n_rows, W] (W >= S) the weights, logits and contribution shares
            ``w_i <v_i, h> / |h|^2`` the op returns, each written when its bit of ``want`` is
            set (1, 2, 4); columns S..W-1 are padding: -inf for the logits, 0 for the others.
    """
    S = src.shape[0]
    q = _fold(query, gain, has_gain)
    zero = one - one
    inv_d = one / d
    want_w, want_z, want_c = want & 1, want & 2, want & 4
    minus_inf = one * -np.inf
    r_t = np.empty((S, _TILE), q.dtype)  # sum of squares, then 1/rms
    z_t = np.empty((S, _TILE), q.dtype)  # dot products, then logits
    e_t = np.empty((S, _TILE), q.dtype)  # exp(z - max), then weights
    z_max = np.empty(_TILE, q.dtype)
    total = np.empty(_TILE, q.dtype)
    for m0 in range(lo, hi, _TILE):
        T = min(_TILE, hi - m0)
        for i in range(S):  # pass 1: sum of squares and dot product share each load
            v = _source(src, i, n_rows, d, one)
            for t in range(T):
                ss = zero
                dot = zero
                for k in range(d):
                    x = v[m0 + t, k]
                    ss += x * x
                    dot += x * q[k]
                r_t[i, t] = ss
                z_t[i, t] = dot
        for i in range(S):
            for t in range(T):
                r = one / np.sqrt(r_t[i, t] * inv_d + eps)
                r_t[i, t] = r
                z_t[i, t] *= r
        for t in range(T):
            z_max[t] = z_t[0, t]
        for i in range(1, S):  # a NaN logit makes the row's max NaN, as in the reference
            for t in range(T):
                zi = z_t[i, t]
                z_max[t] = zi if (zi > z_max[t] or np.isnan(zi)) else z_max[t]
        for t in range(T):  # +-inf max: shift by 0 so exp/log give the reference's inf/nan
            z_max[t] = zero if np.isinf(z_max[t]) else z_max[t]
            total[t] = zero
        for i in range(S):
            for t in range(T):
                e = _exp(z_t[i, t] - z_max[t])
                e_t[i, t] = e
                total[t] += e
        for t in range(T):
            lse[m0 + t] = z_max[t] + np.log(total[t])
            total[t] = one / total[t]
        for i in range(S):
            for t in range(T):
                e_t[i, t] *= total[t]
        for i in range(S):
            for t in range(T):
                wzi[0, i, m0 + t] = e_t[i, t]
                wzi[1, i, m0 + t] = z_t[i, t]
                wzi[2, i, m0 + t] = r_t[i, t]
        if want_w:
            _store_padded(w_out, m0, T, e_t, zero)
        if want_z:
            _store_padded(z_out, m0, T, z_t, minus_inf)
        # pass 2, two sources at a time (half the stores into h); an odd source 0 goes alone
        first = 2 - S % 2
        va = _source(src, 0, n_rows, d, one)
        vb = _source(src, first - 1, n_rows, d, one)
        for t in range(T):
            m = m0 + t
            wa = e_t[0, t]
            if first == 1:
                for k in range(d):
                    h[m, k] = wa * va[m, k]
            else:
                wb = e_t[1, t]
                for k in range(d):
                    h[m, k] = wa * va[m, k] + wb * vb[m, k]
        for i in range(first, S, 2):
            va = _source(src, i, n_rows, d, one)
            vb = _source(src, i + 1, n_rows, d, one)
            for t in range(T):
                m = m0 + t
                wa = e_t[i, t]
                wb = e_t[i + 1, t]
                for k in range(d):
                    h[m, k] += wa * va[m, k] + wb * vb[m, k]
        if want_c:
            for t in range(T):
                m = m0 + t
                hh = zero
                for k in range(d):
                    hh += h[m, k] * h[m, k]
                for i in range(S):
                    v = _source(src, i, n_rows, d, one)
                    dot = zero
                    for k in range(d):
                        dot += v[m, k] * h[m, k]
                    c[m, i] = e_t[i, t] * dot / hh
                for i in range(S, c.shape[1]):
                    c[m, i] = zero


@nb.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=_CACHE)
def _backward_rows(
    src, dv, n_rows, d, query, gain, has_gain, one, wzi, dh, has_dh, dlse, has_dlse, dw, has_dw, dz_up, has_dz, dq, lo, hi
):  # pragma: no cover - compiled
    """Gradients of :func:`_forward_rows` for token rows lo..hi-1.

    ``src`` is a :class:`SourceTable`'s addresses (the sources), ``dv`` [S, n_rows, d] their
    gradients (written). ``wzi`` is the forward's; ``dh`` [n_rows, d],
    ``dlse`` [n_rows], ``dw`` and ``dz_up`` [n_rows, W] (W >= S; the padding columns past S
    are never read) are the upstream gradients, read only with their flag. The gradient of
    q = query * gain for these rows is summed in the compute dtype over blocks of 256 rows
    into the float64 [d] array ``dq`` (zeroed here).
    """
    S = src.shape[0]
    q = _fold(query, gain, has_gain)
    zero = one - one
    inv_d = one / d
    w, z, inv = wzi[0], wzi[1], wzi[2]  # [S, n_rows] each
    dq[:] = 0.0
    da = np.empty(S, q.dtype)
    dq_part = np.zeros(d, q.dtype)
    for m in range(lo, hi):
        big_d = zero
        for i in range(S):  # dalpha_i = dh . v_i (+ dw_i)
            acc = zero
            if has_dh:
                v = _source(src, i, n_rows, d, one)
                for k in range(d):
                    acc += v[m, k] * dh[m, k]
            if has_dw:
                acc += dw[m, i]
            da[i] = acc
            big_d += w[i, m] * acc
        extra = dlse[m] if has_dlse else zero
        for i in range(S):
            wi = w[i, m]
            dzi = wi * (da[i] - big_d + extra)
            if has_dz:
                dzi += dz_up[m, i]
            a = dzi * inv[i, m]  # dz_i * r_i
            cc = -a * z[i, m] * inv[i, m] * inv_d
            v = _source(src, i, n_rows, d, one)
            out = dv[i]
            if has_dh:
                for k in range(d):
                    x = v[m, k]
                    out[m, k] = wi * dh[m, k] + a * q[k] + cc * x
                    dq_part[k] += a * x
            else:
                for k in range(d):
                    x = v[m, k]
                    out[m, k] = a * q[k] + cc * x
                    dq_part[k] += a * x
        if (m - lo) % 256 == 255 or m == hi - 1:
            for k in range(d):
                dq[k] += dq_part[k]
                dq_part[k] = zero


@nb.njit(nogil=True, error_model="numpy", cache=_CACHE)
def _finish_dq(query, gain, has_gain, dq, dqg):  # pragma: no cover - compiled
    """dqg [2, d] = (dq * gain, dq * query) from the float64 gradient ``dq`` of q = query * gain,
    rounded once (without a gain: dq, and zeros)."""
    for k in range(query.shape[0]):
        dqg[0, k] = dq[k] * gain[k] if has_gain else dq[k]
        dqg[1, k] = dq[k] * query[k] if has_gain else 0.0


@nb.njit(nogil=True, cache=_CACHE)
def _chunk(ci, n_chunks, n_rows):  # pragma: no cover - compiled
    """Row range (lo, hi) of chunk ``ci`` when n_rows rows are split into ``n_chunks`` (may be empty)."""
    step = (n_rows + n_chunks - 1) // n_chunks
    lo = min(ci * step, n_rows)
    return lo, min(lo + step, n_rows)


@nb.njit(nogil=True, error_model="numpy", cache=_CACHE)
def _forward(src, n_rows, d, query, gain, has_gain, eps, one, h, lse, wzi, w_out, z_out, c, want):  # pragma: no cover - compiled
    """:func:`_forward_rows` over every row, on the caller's thread."""
    _forward_rows(src, n_rows, d, query, gain, has_gain, eps, one, h, lse, wzi, w_out, z_out, c, want, 0, n_rows)


@nb.njit(nogil=True, parallel=True, cache=_CACHE)
def _forward_parallel(src, n_rows, d, query, gain, has_gain, eps, one, h, lse, wzi, w_out, z_out, c, want, n_chunks):  # pragma: no cover
    """:func:`_forward_rows` over every row, split into ``n_chunks`` row ranges run by Numba's threads."""
    for ci in nb.prange(n_chunks):
        lo, hi = _chunk(ci, n_chunks, n_rows)
        if lo < hi:
            _forward_rows(src, n_rows, d, query, gain, has_gain, eps, one, h, lse, wzi, w_out, z_out, c, want, lo, hi)


@nb.njit(nogil=True, error_model="numpy", cache=_CACHE)
def _backward(
    src, dv, n_rows, d, query, gain, has_gain, one, wzi, dh, has_dh, dlse, has_dlse, dw, has_dw, dz_up, has_dz, dqg
):  # pragma: no cover - compiled
    """:func:`_backward_rows` over every row on the caller's thread, then :func:`_finish_dq`."""
    dq = np.empty(d, np.float64)
    _backward_rows(src, dv, n_rows, d, query, gain, has_gain, one, wzi, dh, has_dh, dlse, has_dlse, dw, has_dw, dz_up, has_dz, dq, 0, n_rows)
    _finish_dq(query, gain, has_gain, dq, dqg)


@nb.njit(nogil=True, parallel=True, cache=_CACHE)
def _backward_parallel(
    src, dv, n_rows, d, query, gain, has_gain, one, wzi, dh, has_dh, dlse, has_dlse, dw, has_dw, dz_up, has_dz, dqg, n_chunks
):  # pragma: no cover - compiled
    """:func:`_backward_rows` in ``n_chunks`` row ranges run by Numba's threads.

    Each range sums its query gradient into its own float64 row; the rows are then added in
    a fixed order (the same sums on every run) and the gradients written.
    """
    dq = np.zeros((n_chunks, d), np.float64)
    for ci in nb.prange(n_chunks):
        lo, hi = _chunk(ci, n_chunks, n_rows)
        if lo < hi:
            _backward_rows(
                src, dv, n_rows, d, query, gain, has_gain, one, wzi, dh, has_dh, dlse, has_dlse, dw, has_dw, dz_up, has_dz, dq[ci], lo, hi
            )
    for ci in range(1, n_chunks):
        for k in range(d):
            dq[0, k] += dq[ci, k]
    _finish_dq(query, gain, has_gain, dq[0], dqg)


# Calls that touch at least this many source elements run on Numba's threads (row ranges
# in a prange, one per thread: min(torch.get_num_threads(), NUMBA_NUM_THREADS)); smaller ones on the
# caller's thread, where a thread hand-off would cost about what it saves.
PARALLEL_MIN_ELEMENTS = 1 << 16
# One threaded call at a time (Numba's "workqueue" threading layer, its fallback when neither
# TBB nor OpenMP is present, must not be entered from two threads at once); a caller that
# finds it taken runs on its own thread instead of waiting.
_parallel_lock = threading.Lock()


def _n_chunks(n_rows: int, work: int) -> int:
    """How many row ranges to run in parallel (1: run on the caller's thread)."""
    threads = min(torch.get_num_threads(), nb.config.NUMBA_NUM_THREADS)
    if threads < 2 or work < PARALLEL_MIN_ELEMENTS or n_rows < 2 * threads:
        return 1
    return threads


# The Numba thread count this thread last set (Numba keeps one per calling thread); asking
# Numba for it on every call costs about as much as a small kernel's hand-off.
_thread_setting = threading.local()


def _launch(serial, parallel, args: tuple, n_chunks: int) -> None:
    """Run a kernel over every row: ``parallel(*args, n_chunks)`` on Numba's threads, or ``serial(*args)``."""
    if n_chunks > 1 and _parallel_lock.acquire(blocking=False):
        try:
            if getattr(_thread_setting, "n", None) != n_chunks:
                nb.set_num_threads(n_chunks)
                _thread_setting.n = n_chunks
            parallel(*args, n_chunks)
        finally:
            _parallel_lock.release()
        return
    serial(*args)


_ABSENT = {(dt, n): np.empty((0,) * n, npdt) for dt, npdt in _NP_DTYPE.items() for n in (1, 2)}


def _grad_view(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[np.ndarray, bool]:
    """An upstream gradient as the kernels see it: (its NumPy array of ``shape``, True), or for
    None (no gradient reached that output) (an empty array the kernels never read, False)."""
    if t is None:
        return _ABSENT[dtype, len(shape)], False
    return t.detach().contiguous().numpy().reshape(shape), True


class Options(NamedTuple):
    """What a call of :class:`DepthAttnNumbaFunction` asks for besides its tensors."""

    eps: float  # the RMS epsilon
    width: int  # columns of the weights, logits and shares (>= the number of sources)
    want: int  # bit 1: the weights, 2: the logits, 4: the contribution shares


class DepthAttnNumbaFunction(torch.autograd.Function):
    """Autograd join of the Numba forward and backward.

    Inputs are (table, query, gain, options, *sources): ``table`` the :class:`SourceTable` of
    ``sources`` (which checked them), ``query`` and ``gain`` [d] (gain may be None),
    contiguous CPU tensors of the table's dtype, ``options`` an :class:`Options`, every source
    [*batch, d]. Outputs are h and lse, then, each on request, the weights, the logits and
    the contribution shares [*batch, width] (columns S..width-1 padding: 0, -inf for the
    logits; the shares are an observation: no gradient flows through them). Gradients flow
    to every source, the query and the gain, from every output but the shares. The kernels
    fold the gain into the query themselves (``q = query * gain``) and write the query and
    gain gradients, so a read is one autograd node; the weights, logits and inverse RMS the
    backward needs stay private to it (a caller may edit the returned ones).
    """

    @staticmethod
    def forward(ctx, table, query, gain, options, *sources):
        npdt = _NP_DTYPE[query.dtype]
        S, M, d, width, want = len(sources), table.n_rows, table.d, options.width, options.want
        batch = sources[0].shape[:-1]
        # outputs are allocated as NumPy arrays (the kernels' view of them) and shared with torch
        h, lse = np.empty((*batch, d), npdt), np.empty(batch, npdt)
        wzi = np.empty((3, S, M), npdt)  # weights, logits, inverse RMS: the backward's
        shown = np.empty((3, *batch, width), npdt)  # weights, logits, shares: written as asked
        q = query.detach().numpy()
        g = q if gain is None else gain.detach().numpy()  # (unread without a gain)
        rows = shown.reshape(3, M, width)
        args = (
            table.addresses, M, d, q, g, gain is not None, npdt(options.eps), npdt(1),
            h.reshape(M, d), lse.reshape(M), wzi, rows[0], rows[1], rows[2], want,
        )
        _launch(_forward, _forward_parallel, args, _n_chunks(M, M * S * d))
        ctx.save_for_backward(query, gain, *sources)
        # the sources' addresses stay valid while the saved sources do (the backward unpacks them
        # first); the table itself is not kept, so that the sources are freed with the saved tensors
        ctx.addresses, ctx.wzi, ctx.options = table.addresses, wzi, options
        ctx.set_materialize_grads(False)
        outs = [torch.from_numpy(h), torch.from_numpy(lse)]
        outs += [torch.from_numpy(shown[k]) for k in range(3) if want >> k & 1]
        if want & 4:
            ctx.mark_non_differentiable(outs[-1])
        return tuple(outs)

    @staticmethod
    def backward(ctx, dh, dlse, *rest):
        eps, width, want = ctx.options
        dw = rest[0] if want & 1 else None
        dz = rest[want & 1] if want & 2 else None
        query, gain, *sources = ctx.saved_tensors
        no_grads = (None,) * 4
        if dh is None and dlse is None and dw is None and dz is None:
            return (*no_grads, *(None for _ in sources))
        S = len(sources)
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, from the reference
            def ref(query, gain, *sources):
                return reference.depth_attn(list(sources), query, gain, eps, return_weights=True, return_logits=True)

            dw, dz = (None if t is None else t[..., :S] for t in (dw, dz))  # the padding has no gradient
            dq, dg, *dv = graph_grads(ref, [query, gain, *sources], [dh, dlse, dw, dz])
            return (None, dq, dg, None, *dv)
        dt, npdt = query.dtype, _NP_DTYPE[query.dtype]
        M, d = ctx.wzi.shape[2], query.shape[0]
        dv = np.empty((S, *sources[0].shape), npdt)  # the sources' gradients, written by the kernel
        dqg = np.empty((2, d), npdt)  # the query's and the gain's
        q = query.detach().numpy()
        g = q if gain is None else gain.detach().numpy()
        args = (
            ctx.addresses, dv.reshape(S, M, d), M, d, q, g, gain is not None, npdt(1), ctx.wzi,
            *_grad_view(dh, (M, d), dt), *_grad_view(dlse, (M,), dt),
            *_grad_view(dw, (M, width), dt), *_grad_view(dz, (M, width), dt), dqg,
        )
        _launch(_backward, _backward_parallel, args, _n_chunks(M, M * S * d))
        # each gradient a tensor with its own storage (over its slice of dv), so that autograd
        # adds a source's later gradients into it in place
        dg = None if gain is None else torch.from_numpy(dqg[1])
        return (None, torch.from_numpy(dqg[0]), dg, None, *map(torch.from_numpy, dv))


def depth_attn(
    sources,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
    *,
    inv_rms_cache=None,
    return_logits: bool = False,
    return_contrib: bool = False,
    width: int | None = None,
):
    """Depth attention with the fused Numba CPU kernels (forward and backward): see
    :func:`attnres_probe.kernels.depth_attn`.

    The arguments are not checked here (the public op checks them); ``width`` is, and the
    tensors' device and dtype are (CPU, float32 or float64). ``inv_rms_cache`` is ignored: the
    kernels normalise inside their first pass. The contribution shares are computed in the same
    kernel call, and the padding past S of the weights, logits and shares is written by the
    kernel.

    Raises:
        ValueError: non-CPU tensors, or a dtype other than float32/float64 (named).
    """
    src = list(sources.unbind(0)) if isinstance(sources, torch.Tensor) else list(sources)
    width = len(src) if width is None else check_width(width, len(src))
    options = Options(float(eps), width, bool(return_weights) | 2 * bool(return_logits) | 4 * bool(return_contrib))
    dt = query.dtype
    if (
        dt in SUPPORTED_DTYPES and query.is_cpu and query.is_contiguous()
        and (gain is None or (gain.dtype is dt and gain.is_cpu and gain.is_contiguous()))
    ):
        try:  # the common case, one check of every source: all CPU, contiguous, of the query's dtype
            table = SourceTable(src, dt)
        except ValueError:
            table = None  # mixed dtypes, non-contiguous sources, or an unusable tensor: sorted out (or named) below
        if table is not None:
            return DepthAttnNumbaFunction.apply(table, query, gain, options, *src)
    first = src[0]
    _check_supported(*src, query, gain)
    dtypes = {s.dtype for s in src} | {query.dtype, None if gain is None else gain.dtype}
    dt = torch.float64 if torch.float64 in dtypes else torch.float32
    query = query.to(dt).contiguous()
    gain = None if gain is None else gain.to(dt).contiguous()
    if any(s.dtype != dt or not s.is_contiguous() for s in src):
        src = [s.to(dt).contiguous() for s in src]  # no reshape: a view would add an autograd node per source
    outs = DepthAttnNumbaFunction.apply(SourceTable(src, dt), query, gain, options, *src)
    h = outs[0] if first.dtype == dt else outs[0].to(first.dtype)  # the mixture in the sources' dtype
    return (h, *outs[1:])


def _check_supported(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu":
            raise ValueError(f"the numba backend runs on CPU tensors; got a tensor on {t.device} (use backend='auto')")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"the numba backend takes float32 or float64 tensors; got {t.dtype} "
                "(use backend='torch', which computes low-precision inputs in float32)"
            )
