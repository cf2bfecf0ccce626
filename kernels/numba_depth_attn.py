"""Fused CPU kernels for depth attention, compiled with Numba (the ``"numba"`` backend).

The math is the reference's (``reference.py``; DESIGN.md, "The math"). With the gain folded
into the query, ``q = query * gain``, every token row and source ``v_i`` gives

    r_i = rsqrt(mean(v_i^2) + eps),   z_i = r_i (q . v_i),
    alpha = softmax(z),   lse = logsumexp(z),   h = sum_i alpha_i v_i.

Why a CPU kernel: on the CPU the reference is a chain of small PyTorch ops per source and
read (a dot product, a scale, an accumulate), and autograd doubles that chain in the
backward. At the demo models' width (d = 64) those ops, not the arithmetic, are the cost:
a Block AttnRes training step took 1.3x a PreNorm step with the reference. These kernels
do each read in two passes over its sources (one for norms and logits, one for the mixture)
and the backward in two more, with no intermediate tensor of the sources' size.

Forward (``_forward``), by tiles of 32 token rows: pass 1 walks each source row once and
computes its sum of squares and its dot product with q (they share the load). The tile's
norms, logits, softmax and lse are then computed on small source-major scratch arrays
([S, 32]), so that each step is a loop over rows that LLVM vectorises (square roots,
divisions, and exp through ``_exp_f32``, a Cephes-style float32 exp, since libm's ``expf``
is a scalar call; float64 uses libm's). Pass 2 reads the tile's source rows again, from
cache, for the mixture (two sources at a time). The logits and inverse RMS are kept ([M, S], small) for the
backward. The kernels use NumPy's error model: a division by zero gives inf/NaN, as in
PyTorch, instead of raising.

Backward (``_backward``), with upstream gradients ``dh`` (mixture), ``dlse`` and ``dw``
(weights, when they were returned):

    dalpha_i = dh . v_i + dw_i,          D = sum_j alpha_j dalpha_j,
    dz_i     = alpha_i (dalpha_i - D) + alpha_i dlse,
    dv_i     = alpha_i dh + dz_i r_i q - dz_i z_i r_i v_i / d,
    dq       = sum_rows sum_i dz_i r_i v_i.

The last two lines are ``dz_i`` times the derivative of ``z_i = r_i (q . v_i)`` through both
the dot product and the RMS (``dr_i/dv_i = -r_i^3 v_i / d``). The query gradient is summed
in the compute dtype over blocks of 256 rows and those sums are added in float64.

Conventions and limits:

- float32 and float64 only (float64 computes in float64); ``auto`` sends float16/bfloat16
  CPU tensors to the reference, and forcing this backend on them raises a ValueError.
- CPU tensors only. Sources are used in place when contiguous (each source is read through
  its data pointer, so a list of S tensors is never stacked); others are copied once.
- The gain is folded into the query inside the kernels, which also write the query and gain
  gradients, so a read is one autograd node and a handful of PyTorch calls.
- For the model's unhooked reads (``mixture``, ``fused_mixture``) the same kernels also form
  Block AttnRes's partial-block sum as they read it (``a + b`` as the last source), sum a
  shared source's gradient over its reads in place (``GradSlot``): the reads after the first
  add into one buffer and the first hands the sum to autograd, and apply the next sublayer's
  RMSNorm to the mixture as they write it (``norm``): the read returns
  ``x = h * rh * w``, ``rh = 1 / sqrt(mean(h^2) + eps)``, and its backward first turns dx into
  dh, ``rh w dx - (rh^3 / d) h sum(w dx h)``, per row (the gain's gradient ``sum_rows dx h
  rh``). A model's RMSNorm is half a dozen small PyTorch ops and twice as many in the backward,
  about 0.75 ms per sublayer in a demo-size training step. ``add_rms_norm`` gives the PreNorm
  baseline the same fusion: its residual add and the next pre-norm in one kernel.
- The kernels release the GIL. A call that touches at least ``PARALLEL_MIN_ELEMENTS`` source
  elements is split by token rows over Numba's threads (``prange``; up to
  ``torch.get_num_threads()`` ranges, each writing its own rows and its own float64 partial
  query gradient, added in a fixed order). One such call runs at a time; a concurrent
  caller that finds it busy runs on its own thread, as do smaller calls. With two threads a
  demo-size Block AttnRes training step is about 7 ms faster than on one
  (``benchmarks/numba_threads.py``). Concurrent callers (the dashboard's server threads)
  share no state.
- They are compiled on first use (a few seconds per kernel and dtype, more for the threaded
  versions) and Numba caches the machine code on disk, next to this module in ``__pycache__``
  (or under ``NUMBA_CACHE_DIR``), so later processes start in a fraction of a second. Like
  Python's own ``.pyc`` files, that cache is written and read only by this library on this
  machine (Numba's index format uses pickle); ``ATTNRES_NUMBA_CACHE=0`` compiles in memory
  in every process instead and never reads or writes it.
- Phase 1 and phase 2 of the two-phase Block schedule have no Numba kernels: on the CPU the
  model uses the sequential schedule, and ``phase1``/``phase2`` with this backend run the
  reference.
"""

from __future__ import annotations

import os
import threading

import numba as nb
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .reference import depth_attn_reference, graph_grads, rms_norm, validate_depth_attn_args

__all__ = ["SUPPORTED_DTYPES", "GradSlot", "add_rms_norm", "depth_attn_numba", "fused_mixture", "mixture"]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

# Reassociation lets LLVM vectorise the row reductions; no flag that assumes finite values,
# so NaN and inf propagate exactly as in the reference.
_FASTMATH = {"reassoc", "contract", "nsz"}
# Numba's on-disk cache of these kernels (see the module docstring); ATTNRES_NUMBA_CACHE=0 turns it off.
_CACHE = os.environ.get("ATTNRES_NUMBA_CACHE", "1").strip() not in ("0", "false", "no", "off")


@intrinsic
def _pointer(typingctx, address, scalar):
    """A pointer to ``scalar``'s type at integer ``address``."""
    ptr_t = types.CPointer(scalar)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_t))

    return ptr_t(types.int64, scalar), codegen


@nb.njit(nogil=True, fastmath=_FASTMATH, cache=_CACHE)
def _row(address, m, n_rows, d, one):  # pragma: no cover - compiled
    """Row m ([d]) of a contiguous [n_rows, d] array at ``address``, in ``one``'s dtype."""
    return nb.carray(_pointer(address, one), (n_rows, d))[m]


@nb.njit(nogil=True, cache=_CACHE)
def _folded_query(table, n_src, d, has_gain, one):  # pragma: no cover - compiled
    """q = query * gain [d] (query at table entry S, gain at S+1 when ``has_gain``)."""
    query = nb.carray(_pointer(table[n_src], one), (d,))
    gain = nb.carray(_pointer(table[n_src + 1], one), (d if has_gain else 0,))
    q = np.empty(d, query.dtype)
    for k in range(d):
        q[k] = query[k] * gain[k] if has_gain else query[k]
    return q


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


@nb.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=_CACHE)
def _norm_row(h, w, x, eps, one, inv_d):  # pragma: no cover - compiled
    """x = h * r * w for one row, with r = 1 / sqrt(mean(h^2) + eps) (the model's RMSNorm); returns r."""
    ss = one - one
    for k in range(h.shape[0]):
        ss += h[k] * h[k]
    r = one / np.sqrt(ss * inv_d + eps)
    for k in range(h.shape[0]):
        x[k] = h[k] * r * w[k]
    return r


@nb.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=_CACHE)
def _norm_row_grad(h, r, w, dx, g, dw, inv_d):  # pragma: no cover - compiled
    """Backward of :func:`_norm_row` for one row: writes ``g = dL/dh``,
    ``r w dx - (r^3 / d) h sum_k(w_k dx_k h_k)``, and adds ``dx h r`` into ``dw`` (the gain's
    gradient, summed over rows)."""
    s = r - r
    for k in range(h.shape[0]):
        s += w[k] * dx[k] * h[k]
    c = r * r * r * inv_d * s
    for k in range(h.shape[0]):
        g[k] = r * w[k] * dx[k] - c * h[k]
        dw[k] += dx[k] * h[k] * r


# Token rows per forward tile: the tile's scalars (norms, logits, softmax) are kept
# source-major in small [S, TILE] scratch arrays, so each scalar step is a loop over the
# tile's rows that LLVM vectorises (sqrt, divide, exp), instead of a chain of dependent
# scalar operations per row.
_TILE = 32


@nb.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=_CACHE)
def _forward_rows(table, n_src, n_rows, d, has_gain, want_lse, want_contrib, eps, norm_eps, one, inv_d, lo, hi):  # pragma: no cover - compiled
    """Token rows lo..hi-1 of the forward.

    ``table`` holds addresses: the S sources ([M, d] each), then query [d], gain [d] (used
    with ``has_gain``), h [M, d], lse [M] (used with ``want_lse``), wzi [3, M, S] (weights, logits, inverse RMS) and
    (used with ``want_contrib``) c [M, S] (all contiguous, in the compute dtype). Tiles of
    rows: pass 1 reads each source row once for its sum of squares and its dot product with
    q = query * gain; the norms, logits and softmax follow on the tile's scratch; pass 2
    reads the tile's source rows again (from cache) for the mixture, two sources at a time, and, with
    ``want_contrib``, the shares c_i = w_i <v_i, h> / |h|^2. ``eps``, ``one`` and ``inv_d``
    (1/d) come in the compute dtype, so no arithmetic is promoted to float64.

    Entries S+6 and S+7, when not 0, are the addresses of two [M, d] arrays a and b whose sum
    is the last source: each tile first writes a + b into source S-1's array (the fused
    partial-block sum of Block AttnRes), then goes on as above.

    Entries S+8..S+10, when S+8 is not 0, are a norm gain w [d], x [M, d] and rh [M]: each
    tile ends by normalising its mixture rows, x = h * rh * w with rh = 1 / sqrt(mean(h^2) +
    norm_eps) (the next sublayer's pre-norm, fused into the read).
    """
    S = n_src
    q = _folded_query(table, S, d, has_gain, one)
    fuse = table[S + 6] != 0
    add_a = nb.carray(_pointer(table[S + 6], one), (n_rows if fuse else 0, d))
    add_b = nb.carray(_pointer(table[S + 7], one), (n_rows if fuse else 0, d))
    fused_sum = nb.carray(_pointer(table[S - 1], one), (n_rows, d))
    h = nb.carray(_pointer(table[S + 2], one), (n_rows, d))
    lse = nb.carray(_pointer(table[S + 3], one), (n_rows if want_lse else 0,))
    wzi = nb.carray(_pointer(table[S + 4], one), (3, n_rows, S))
    c = nb.carray(_pointer(table[S + 5], one), (n_rows if want_contrib else 0, S))
    has_norm = table[S + 8] != 0
    norm_w = nb.carray(_pointer(table[S + 8], one), (d if has_norm else 0,))
    x_out = nb.carray(_pointer(table[S + 9], one), (n_rows if has_norm else 0, d))
    rh = nb.carray(_pointer(table[S + 10], one), (n_rows if has_norm else 0,))
    zero = one - one
    r_t = np.empty((S, _TILE), q.dtype)  # sum of squares, then 1/rms
    z_t = np.empty((S, _TILE), q.dtype)  # dot products, then logits
    e_t = np.empty((S, _TILE), q.dtype)  # exp(z - max), then weights
    z_max = np.empty(_TILE, q.dtype)
    total = np.empty(_TILE, q.dtype)
    for m0 in range(lo, hi, _TILE):
        T = min(_TILE, hi - m0)
        if fuse:
            for t in range(T):
                for k in range(d):
                    fused_sum[m0 + t, k] = add_a[m0 + t, k] + add_b[m0 + t, k]
        for i in range(S):
            v = nb.carray(_pointer(table[i], one), (n_rows, d))
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
        if want_lse:
            for t in range(T):
                lse[m0 + t] = z_max[t] + np.log(total[t])
        for t in range(T):
            total[t] = one / total[t]
        for i in range(S):
            for t in range(T):
                e_t[i, t] *= total[t]
        for t in range(T):
            for i in range(S):
                wzi[0, m0 + t, i] = e_t[i, t]
                wzi[1, m0 + t, i] = z_t[i, t]
                wzi[2, m0 + t, i] = r_t[i, t]
        # pass 2, two sources at a time (half the stores into h); an odd source 0 goes alone
        first = 2 - S % 2
        va = nb.carray(_pointer(table[0], one), (n_rows, d))
        vb = nb.carray(_pointer(table[first - 1], one), (n_rows, d))
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
            va = nb.carray(_pointer(table[i], one), (n_rows, d))
            vb = nb.carray(_pointer(table[i + 1], one), (n_rows, d))
            for t in range(T):
                m = m0 + t
                wa = e_t[i, t]
                wb = e_t[i + 1, t]
                for k in range(d):
                    h[m, k] += wa * va[m, k] + wb * vb[m, k]
        if want_contrib:
            for t in range(T):
                m = m0 + t
                hh = zero
                for k in range(d):
                    hh += h[m, k] * h[m, k]
                for i in range(S):
                    v = nb.carray(_pointer(table[i], one), (n_rows, d))
                    dot = zero
                    for k in range(d):
                        dot += v[m, k] * h[m, k]
                    c[m, i] = e_t[i, t] * dot / hh
        if has_norm:
            for t in range(T):
                m = m0 + t
                rh[m] = _norm_row(h[m], norm_w, x_out[m], norm_eps, one, inv_d)


@nb.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=_CACHE)
def _backward_rows(
    table, n_src, n_rows, d, has_gain, has_dh, has_dlse, has_dw, one, inv_d, dq, lo, hi
):  # pragma: no cover - compiled
    """Gradients of :func:`_forward` for token rows lo..hi-1.

    ``table`` holds addresses: the S sources, then query [d], gain [d] (used with
    ``has_gain``), wzi [3, M, S] (saved by the forward), the upstream dh [M, d], dlse [M],
    dw [M, S] (0 where absent), the S outputs dv_i [M, d] (written) and dqg [2, d] (see
    :func:`_finish_dq`), then, when not 0, the address of an [M, d] gradient added into
    dv_{S-1} (the fused partial-block sum's gradient from its other uses), then S flags: where
    flag i is not 0, dv_i already holds a gradient and this read's is added to it, then (the
    fused pre-norm, when entry 3S+8 is not 0) the norm gain w [d], the saved mixture h [M, d]
    and its rh [M]: the upstream gradient at S+3 is then dx, for x = h * rh * w, and each row
    first forms its dh from it. The gradients of q = query * gain (and of w) for these rows
    are summed in the compute dtype over chunks of rows into the float64 [2d] array ``dq``
    (zeroed here): q's in the first half, w's in the second.
    """
    S = n_src
    has_extra = table[2 * S + 7] != 0
    extra_dv = nb.carray(_pointer(table[2 * S + 7], one), (n_rows if has_extra else 0, d))
    q = _folded_query(table, S, d, has_gain, one)
    wzi = nb.carray(_pointer(table[S + 2], one), (3, n_rows, S))
    w, z, inv = wzi[0], wzi[1], wzi[2]
    dh = nb.carray(_pointer(table[S + 3], one), (n_rows if has_dh else 0, d))
    dlse = nb.carray(_pointer(table[S + 4], one), (n_rows if has_dlse else 0,))
    dw = nb.carray(_pointer(table[S + 5], one), (n_rows if has_dw else 0, S))
    has_norm = table[3 * S + 8] != 0
    norm_w = nb.carray(_pointer(table[3 * S + 8], one), (d if has_norm else 0,))
    h_saved = nb.carray(_pointer(table[3 * S + 9], one), (n_rows if has_norm else 0, d))
    rh = nb.carray(_pointer(table[3 * S + 10], one), (n_rows if has_norm else 0,))
    zero = one - one
    dq[:] = 0.0
    dz = np.empty(S, q.dtype)
    dq_part = np.zeros(2 * d, q.dtype)  # q's gradient, then the norm gain's
    dn_part = dq_part[d:]
    g = np.zeros(d, q.dtype)  # this row's dh
    for m in range(lo, hi):
        if has_norm:
            _norm_row_grad(h_saved[m], rh[m], norm_w, dh[m], g, dn_part, inv_d)
        elif has_dh:
            for k in range(d):
                g[k] = dh[m, k]
        big_d = zero
        for i in range(S):  # dalpha_i = dh . v_i (+ dw_i)
            acc = zero
            if has_dh:
                v = _row(table[i], m, n_rows, d, one)
                for k in range(d):
                    acc += v[k] * g[k]
            if has_dw:
                acc += dw[m, i]
            dz[i] = acc
            big_d += w[m, i] * acc
        extra = dlse[m] if has_dlse else zero
        for i in range(S):
            wi = w[m, i]
            a = wi * (dz[i] - big_d + extra) * inv[m, i]  # dz_i * r_i
            c = -a * z[m, i] * inv[m, i] * inv_d
            v = _row(table[i], m, n_rows, d, one)
            out = _row(table[S + 6 + i], m, n_rows, d, one)  # dv_i, written
            if table[2 * S + 8 + i] != 0:  # add into dv_i (a gradient other reads of v_i started)
                if has_dh:
                    for k in range(d):
                        x = v[k]
                        out[k] += wi * g[k] + a * q[k] + c * x
                        dq_part[k] += a * x
                else:
                    for k in range(d):
                        x = v[k]
                        out[k] += a * q[k] + c * x
                        dq_part[k] += a * x
            elif has_dh:
                for k in range(d):
                    x = v[k]
                    out[k] = wi * g[k] + a * q[k] + c * x
                    dq_part[k] += a * x
            else:
                for k in range(d):
                    x = v[k]
                    out[k] = a * q[k] + c * x
                    dq_part[k] += a * x
            if has_extra and i == S - 1:
                for k in range(d):
                    out[k] += extra_dv[m, k]
        if (m - lo) % 256 == 255 or m == hi - 1:
            for k in range(2 * d):
                dq[k] += dq_part[k]
                dq_part[k] = zero


@nb.njit(nogil=True, error_model="numpy", cache=_CACHE)
def _finish_dq(table, n_src, d, has_gain, one, dq):  # pragma: no cover - compiled
    """Write the query and gain gradients into dqg [2, d] (table entry 2S+6) from the float64
    gradient ``dq`` of q = query * gain: ``dq * gain`` and ``dq * query``, rounded once; with
    the fused pre-norm, dqg is [3, d] and its last row the norm gain's gradient."""
    S = n_src
    query = nb.carray(_pointer(table[S], one), (d,))
    gain = nb.carray(_pointer(table[S + 1], one), (d if has_gain else 0,))
    has_norm = table[3 * S + 8] != 0
    dqg = nb.carray(_pointer(table[2 * S + 6], one), (3 if has_norm else 2, d))
    for k in range(d):
        dqg[0, k] = dq[k] * gain[k] if has_gain else dq[k]
        dqg[1, k] = dq[k] * query[k] if has_gain else 0.0
        if has_norm:
            dqg[2, k] = dq[d + k]


@nb.njit(nogil=True, cache=_CACHE)
def _chunk(ci, n_chunks, n_rows):  # pragma: no cover - compiled
    """Row range (lo, hi) of chunk ``ci`` when n_rows rows are split into ``n_chunks`` (may be empty)."""
    step = (n_rows + n_chunks - 1) // n_chunks
    lo = min(ci * step, n_rows)
    return lo, min(lo + step, n_rows)


@nb.njit(nogil=True, error_model="numpy", cache=_CACHE)
def _forward(table, n_src, n_rows, d, has_gain, want_lse, want_contrib, eps, norm_eps, one, inv_d):  # pragma: no cover - compiled
    """:func:`_forward_rows` over every row, on the caller's thread."""
    _forward_rows(table, n_src, n_rows, d, has_gain, want_lse, want_contrib, eps, norm_eps, one, inv_d, 0, n_rows)


@nb.njit(nogil=True, parallel=True, cache=_CACHE)
def _forward_parallel(table, n_src, n_rows, d, has_gain, want_lse, want_contrib, eps, norm_eps, one, inv_d, n_chunks):  # pragma: no cover
    """:func:`_forward_rows` over every row, split into ``n_chunks`` row ranges run by Numba's threads."""
    for ci in nb.prange(n_chunks):
        lo, hi = _chunk(ci, n_chunks, n_rows)
        if lo < hi:
            _forward_rows(table, n_src, n_rows, d, has_gain, want_lse, want_contrib, eps, norm_eps, one, inv_d, lo, hi)


@nb.njit(nogil=True, error_model="numpy", cache=_CACHE)
def _backward(table, n_src, n_rows, d, has_gain, has_dh, has_dlse, has_dw, one, inv_d):  # pragma: no cover
    """:func:`_backward_rows` over every row on the caller's thread, then :func:`_finish_dq`."""
    dq = np.empty(2 * d, np.float64)
    _backward_rows(table, n_src, n_rows, d, has_gain, has_dh, has_dlse, has_dw, one, inv_d, dq, 0, n_rows)
    _finish_dq(table, n_src, d, has_gain, one, dq)


@nb.njit(nogil=True, parallel=True, cache=_CACHE)
def _backward_parallel(table, n_src, n_rows, d, has_gain, has_dh, has_dlse, has_dw, one, inv_d, n_chunks):  # pragma: no cover
    """:func:`_backward_rows` in ``n_chunks`` row ranges run by Numba's threads.

    Each range sums its query gradient into its own float64 row; the rows are then added in
    a fixed order and the gradients written.
    """
    dq = np.zeros((n_chunks, 2 * d), np.float64)
    for ci in nb.prange(n_chunks):
        lo, hi = _chunk(ci, n_chunks, n_rows)
        if lo < hi:
            _backward_rows(table, n_src, n_rows, d, has_gain, has_dh, has_dlse, has_dw, one, inv_d, dq[ci], lo, hi)
    for ci in range(1, n_chunks):
        for k in range(2 * d):
            dq[0, k] += dq[ci, k]
    _finish_dq(table, n_src, d, has_gain, one, dq[0])


# PreNorm's residual step fused with the next sublayer's pre-norm (the baseline's counterpart
# of a read that ends in the pre-norm): s = a + b, x = s * rh * w, rh = 1 / sqrt(mean(s^2) + eps).


@nb.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=_CACHE)
def _add_norm_rows(table, n_rows, d, eps, one, inv_d, lo, hi):  # pragma: no cover - compiled
    """Rows lo..hi-1 of s = a + b and x = s * rh * w. ``table``: a, b (0: no b, and s is a),
    w [d], s, x [M, d], rh [M]."""
    has_b = table[1] != 0
    a = nb.carray(_pointer(table[0], one), (n_rows, d))
    b = nb.carray(_pointer(table[1], one), (n_rows if has_b else 0, d))
    w = nb.carray(_pointer(table[2], one), (d,))
    s = nb.carray(_pointer(table[3], one), (n_rows, d))
    x = nb.carray(_pointer(table[4], one), (n_rows, d))
    rh = nb.carray(_pointer(table[5], one), (n_rows,))
    for m in range(lo, hi):
        if has_b:
            for k in range(d):
                s[m, k] = a[m, k] + b[m, k]
        rh[m] = _norm_row(s[m], w, x[m], eps, one, inv_d)


@nb.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=_CACHE)
def _add_norm_grad_rows(table, n_rows, d, has_ds, one, inv_d, dw, lo, hi):  # pragma: no cover - compiled
    """Gradients of :func:`_add_norm_rows` for rows lo..hi-1: g = ds + (dx through the norm),
    the gradient of both a and b, and the gain's, summed in the compute dtype over chunks of
    rows into the float64 [d] array ``dw`` (zeroed here). ``table``: s, w, rh, dx, ds (0:
    absent), g, and (for :func:`_finish_norm_grad`) the gain's gradient [d]."""
    s = nb.carray(_pointer(table[0], one), (n_rows, d))
    w = nb.carray(_pointer(table[1], one), (d,))
    rh = nb.carray(_pointer(table[2], one), (n_rows,))
    dx = nb.carray(_pointer(table[3], one), (n_rows, d))
    ds = nb.carray(_pointer(table[4], one), (n_rows if has_ds else 0, d))
    g = nb.carray(_pointer(table[5], one), (n_rows, d))
    dw[:] = 0.0
    part = np.zeros(d, w.dtype)
    for m in range(lo, hi):
        _norm_row_grad(s[m], rh[m], w, dx[m], g[m], part, inv_d)
        if has_ds:
            for k in range(d):
                g[m, k] += ds[m, k]
        if (m - lo) % 256 == 255 or m == hi - 1:
            for k in range(d):
                dw[k] += part[k]
                part[k] = 0.0


@nb.njit(nogil=True, cache=_CACHE)
def _finish_norm_grad(table, d, one, dw):  # pragma: no cover - compiled
    out = nb.carray(_pointer(table[6], one), (d,))
    for k in range(d):
        out[k] = dw[k]


@nb.njit(nogil=True, cache=_CACHE)
def _add_norm(table, n_rows, d, eps, one, inv_d):  # pragma: no cover - compiled
    _add_norm_rows(table, n_rows, d, eps, one, inv_d, 0, n_rows)


@nb.njit(nogil=True, parallel=True, cache=_CACHE)
def _add_norm_parallel(table, n_rows, d, eps, one, inv_d, n_chunks):  # pragma: no cover - compiled
    for ci in nb.prange(n_chunks):
        lo, hi = _chunk(ci, n_chunks, n_rows)
        if lo < hi:
            _add_norm_rows(table, n_rows, d, eps, one, inv_d, lo, hi)


@nb.njit(nogil=True, cache=_CACHE)
def _add_norm_grad(table, n_rows, d, has_ds, one, inv_d):  # pragma: no cover - compiled
    dw = np.empty(d, np.float64)
    _add_norm_grad_rows(table, n_rows, d, has_ds, one, inv_d, dw, 0, n_rows)
    _finish_norm_grad(table, d, one, dw)


@nb.njit(nogil=True, parallel=True, cache=_CACHE)
def _add_norm_grad_parallel(table, n_rows, d, has_ds, one, inv_d, n_chunks):  # pragma: no cover - compiled
    dw = np.zeros((n_chunks, d), np.float64)
    for ci in nb.prange(n_chunks):
        lo, hi = _chunk(ci, n_chunks, n_rows)
        if lo < hi:
            _add_norm_grad_rows(table, n_rows, d, has_ds, one, inv_d, dw[ci], lo, hi)
    for ci in range(1, n_chunks):  # a fixed order: the same sums on every run
        for k in range(d):
            dw[0, k] += dw[ci, k]
    _finish_norm_grad(table, d, one, dw[0])


def _table(entries) -> np.ndarray:
    """A kernel's pointer table: tensors' addresses (0 for None); ints (flags) as they are."""
    return np.array([0 if t is None else t if isinstance(t, int) else t.data_ptr() for t in entries], dtype=np.int64)


# Calls that touch at least this many source elements run on Numba's threads (row ranges
# in a prange, one per thread, up to torch.get_num_threads()); smaller ones on the
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


def _launch(serial, parallel, args: tuple, n_chunks: int) -> None:
    """Run a kernel over every row: ``parallel(*args, n_chunks)`` on Numba's threads, or ``serial(*args)``."""
    if n_chunks > 1 and _parallel_lock.acquire(blocking=False):
        try:
            if nb.get_num_threads() != n_chunks:
                nb.set_num_threads(n_chunks)
            parallel(*args, n_chunks)
        finally:
            _parallel_lock.release()
        return
    serial(*args)


_ONE = {torch.float32: np.float32(1), torch.float64: np.float64(1)}


def _run_forward(rows, query, gain, eps: float, h, lse, wzi, c, add=(None, None), norm=(None, None, None), norm_eps=0.0) -> None:
    """The forward kernel over every row, with :func:`_forward_rows`'s table: sources, query,
    gain, h, lse, wzi, c, then the fused sum's a and b (None: not fused; the sum's buffer is
    the last source), then the fused pre-norm's gain, x and rh (None: no norm). None marks an
    output not wanted."""
    first = rows[0]
    d, n_src = first.shape[-1], len(rows)
    n_rows = first.numel() // d
    one = _ONE[query.dtype]
    table = _table([*rows, query, gain, h, lse, wzi, c, *add, *norm])
    args = (table, n_src, n_rows, d, gain is not None, lse is not None, c is not None, one * eps, one * norm_eps, one, one / d)
    _launch(_forward, _forward_parallel, args, _n_chunks(n_rows, n_rows * n_src * d))


def _run_backward(rows, query, gain, wzi, dh, dlse, dw, dv, dqg, extra=None, add=None, norm=(None, None, None)) -> None:
    """The backward kernel over every row, with :func:`_backward_rows`'s table: sources, query,
    gain, wzi, the upstream dh/dlse/dw (None: absent), the outputs dv, dqg [2, d] ([3, d] with
    a norm), the gradient ``extra`` added into the last source's, per source whether dv_i is
    added to (``add``), then the fused pre-norm's gain, saved h and rh (None: no norm; with
    one, ``dh`` is the gradient of the normalised x)."""
    first = rows[0]
    d, n_src = first.shape[-1], len(rows)
    n_rows = first.numel() // d
    one = _ONE[query.dtype]
    table = _table([*rows, query, gain, wzi, dh, dlse, dw, *dv, dqg, extra, *(add or [0] * n_src), *norm])
    flags = (gain is not None, dh is not None, dlse is not None, dw is not None)
    _launch(_backward, _backward_parallel, (table, n_src, n_rows, d, *flags, one, one / d), _n_chunks(n_rows, n_rows * n_src * d))


def _run_add_norm(a, b, weight, eps: float, s, x, rh) -> None:
    """The add-norm kernel over every row (table: :func:`_add_norm_rows`)."""
    d = a.shape[-1]
    n_rows = a.numel() // d
    one = _ONE[weight.dtype]
    table = _table([a, b, weight, s, x, rh])
    _launch(_add_norm, _add_norm_parallel, (table, n_rows, d, one * eps, one, one / d), _n_chunks(n_rows, 2 * n_rows * d))


def _run_add_norm_grad(s, weight, rh, dx, ds, g, dw) -> None:
    """The add-norm backward over every row (table: :func:`_add_norm_grad_rows`)."""
    d = s.shape[-1]
    n_rows = s.numel() // d
    one = _ONE[weight.dtype]
    table = _table([s, weight, rh, dx, ds, g, dw])
    args = (table, n_rows, d, ds is not None, one, one / d)
    _launch(_add_norm_grad, _add_norm_grad_parallel, args, _n_chunks(n_rows, 2 * n_rows * d))


class DepthAttnNumbaFunction(torch.autograd.Function):
    """Autograd join of the Numba forward and backward.

    Inputs are (query, gain, eps, return_lse, return_weights, return_contrib, *sources):
    ``query`` and ``gain`` [d] (gain may be None), every source [*batch, d], all contiguous in
    one dtype. Outputs are h, then the lse with ``return_lse``, the weights with
    ``return_weights`` and the contribution shares with ``return_contrib`` (an observation:
    no gradient flows through them). Gradients flow to every source, the query and the gain.
    The kernels fold the gain into the query themselves (``q = query * gain``) and write the
    query and gain gradients, so a read costs one autograd node and few PyTorch calls (at the
    demo models' size those calls, not the arithmetic, are most of a read's time).
    """

    @staticmethod
    def forward(ctx, query, gain, eps, return_lse, return_weights, return_contrib, *rows):
        first = rows[0]
        batch, n_src, dt = first.shape[:-1], len(rows), query.dtype
        h = torch.empty_like(first)
        lse = torch.empty(batch, dtype=dt) if return_lse else None
        wzi = torch.empty((3, *batch, n_src), dtype=dt)  # weights, logits, inverse RMS
        c = torch.empty((*batch, n_src), dtype=dt) if return_contrib else None
        _run_forward(rows, query, gain, eps, h, lse, wzi, c)
        ctx.save_for_backward(query, gain, wzi, *rows)
        ctx.set_materialize_grads(False)
        ctx.return_lse, ctx.return_weights, ctx.eps = return_lse, return_weights, eps
        outs = [h]
        if return_lse:
            outs.append(lse)
        if return_weights:
            outs.append(wzi[0].clone())  # the saved weights stay private: a caller may edit the returned ones
        if return_contrib:
            ctx.mark_non_differentiable(c)
            outs.append(c)
        return tuple(outs)

    @staticmethod
    def backward(ctx, dh, *rest):
        dlse = rest[0] if ctx.return_lse else None
        dw = rest[int(ctx.return_lse)] if ctx.return_weights else None
        query, gain, wzi, *rows = ctx.saved_tensors
        if dh is None and dlse is None and dw is None:
            return (None,) * (6 + len(rows))
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, from the reference
            def ref(query, gain, *rows):
                return depth_attn_reference(list(rows), query, gain, ctx.eps, return_weights=True, validate=False)

            dq, dg, *dv = graph_grads(ref, [query, gain, *rows], [dh, dlse, dw])
            return (dq, dg, None, None, None, None, *dv)
        first = rows[0]
        # one buffer per source: autograd can then accumulate into it in place (views of one
        # shared buffer would force an out-of-place add for every later read of the source)
        dv = [torch.empty_like(first) for _ in rows]
        dqg = torch.empty((2, first.shape[-1]), dtype=query.dtype)  # written by the kernel
        up = [None if t is None else t.contiguous() for t in (dh, dlse, dw)]
        _run_backward(rows, query, gain, wzi, *up, dv, dqg)
        return (dqg[0], None if gain is None else dqg[1], None, None, None, None, *dv)


class GradSlot:
    """One source's gradient, shared by the Numba reads of that source in a model nothing
    watches (see ``AttnResTransformer.unwatched``).

    The read that mixes the source first (in the forward) owns the slot. In the backward,
    every later read adds its gradient for the source into the slot's buffer inside its
    kernel and gives autograd nothing for it; the owner runs last (every later read depends
    on its output), adds its own and returns the sum. That replaces a fresh buffer per read
    and autograd's add for every later read with one accumulation in the kernels. Buffers are
    kept per autograd pass, so repeated, partial and concurrent backward passes over one
    graph do not mix; a read that runs after the owner in the same pass (which the model's
    graphs do not produce) returns its gradient to autograd as usual.
    """

    __slots__ = ("grads", "closed")

    def __init__(self) -> None:
        self.grads: dict[int, torch.Tensor] = {}  # autograd pass -> the gradient summed so far
        self.closed: set[int] = set()  # passes whose owner has run


def _mixture_backward(ctx, dh, d_total=None):
    query, gain, wzi, norm_w, h, rh, *rows = ctx.saved_tensors
    first = rows[0]
    dh = torch.zeros_like(first) if dh is None else dh.contiguous()  # with a norm: the gradient of x
    slots = ctx.slots
    if slots is None:
        dv = [torch.empty_like(first) for _ in rows]  # one buffer per source (see DepthAttnNumbaFunction)
        add, grads = None, dv
    else:
        dv, add, grads = [], [], []
        task = torch._C._current_graph_task_id()
        for entry in slots:
            slot, owner = entry if entry is not None else (None, False)
            if slot is None or task in slot.closed:  # no slot, or its owner already ran: autograd adds
                buf = torch.empty_like(first)
                dv.append(buf)
                add.append(0)
                grads.append(buf)
                continue
            held = slot.grads.pop(task, None)
            buf = torch.empty_like(first) if held is None else held
            dv.append(buf)
            add.append(int(held is not None))
            if owner:  # every later read has added its share: hand the sum to autograd
                slot.closed.add(task)
                grads.append(buf)
            else:
                slot.grads[task] = buf
                grads.append(None)
    dqg = torch.empty((2 if norm_w is None else 3, first.shape[-1]), dtype=query.dtype)
    extra = None if d_total is None else d_total.contiguous()
    _run_backward(rows, query, gain, wzi, dh, None, None, dv, dqg, extra, add, (norm_w, h, rh))
    d_norm = None if norm_w is None else dqg[2]
    if ctx.fused:  # the last source is a + b: both get its gradient
        return (dqg[0], dqg[1], d_norm, None, None, None, None, *grads, grads[-1])
    return (dqg[0], dqg[1], d_norm, None, None, None, None, *grads)


def _mixture_graph_backward(ctx, dh, d_total):
    """:class:`_MixtureFunction`'s gradients under ``create_graph=True`` (see :func:`~attnres_probe.kernels.reference.graph_grads`).
    The pass returns every read's gradients to autograd (no slots); a fused read's sum gets
    its gradient through the mixture plus ``d_total``, for a and b alike."""
    query, gain, _, norm_w, _, _, *rows = ctx.saved_tensors

    def ref(query, gain, norm_w, *rows):
        h = depth_attn_reference(list(rows), query, gain, ctx.eps, validate=False)[0]
        return (h if norm_w is None else rms_norm(h, norm_w, ctx.norm_eps),)

    dq, dg, dn, *dv = graph_grads(ref, [query, gain, norm_w, *rows], [dh])
    if ctx.fused:
        d_sum = _plus(dv[-1], d_total)
        return (dq, dg, dn, None, None, None, None, *dv[:-1], d_sum, d_sum)
    return (dq, dg, dn, None, None, None, None, *dv)


class _MixtureFunction(torch.autograd.Function):
    """The model's unhooked read: the mixture alone, for inputs :func:`mixture` has checked.

    Inputs are (query, gain, norm_w, eps, norm_eps, fused, slots, *sources), all contiguous
    CPU tensors of one dtype, with a gain. With ``norm_w`` (a [d] gain) the op returns the
    next sublayer's pre-norm input ``x = rms_norm(h) * norm_w`` instead of the mixture h
    (kept for the backward): the read and the norm in one kernel. With ``fused`` the last two
    inputs are a and b and the last source is their sum, formed inside the kernel (Block
    AttnRes's partial-block sum, which the next read uses anyway); the op then returns
    (output, a + b) instead of the output alone. ``slots`` is None or, per source (the sum
    counting as one), None or a (:class:`GradSlot`, owner) pair. The same kernels as
    :class:`DepthAttnNumbaFunction`, with as little Python around them as a read allows: at
    the demo models' size the Python of a read costs as much as its kernels.
    """

    @staticmethod
    def forward(ctx, query, gain, norm_w, eps, norm_eps, fused, slots, *rows):
        first = rows[0]
        n_inputs = 7 + len(rows)
        add = (None, None)
        if fused:
            total = torch.empty_like(first)
            add, rows = rows[-2:], (*rows[:-2], total)
        n_rows = first.numel() // first.shape[-1]
        h = torch.empty_like(first)
        wzi = torch.empty((3, n_rows, len(rows)), dtype=query.dtype)  # weights, logits, inverse RMS
        norm, out = (None, None, None), h
        if norm_w is not None:
            out = torch.empty_like(first)
            norm = (norm_w, out, torch.empty(first.shape[:-1], dtype=query.dtype))
        _run_forward(rows, query, gain, eps, h, None, wzi, None, add, norm, norm_eps)
        ctx.save_for_backward(query, gain, wzi, norm_w, *((None, None) if norm_w is None else (h, norm[2])), *rows)
        ctx.fused, ctx.slots, ctx.n_inputs, ctx.eps, ctx.norm_eps = fused, slots, n_inputs, eps, norm_eps
        if fused:
            ctx.set_materialize_grads(False)
            return out, total
        return out

    @staticmethod
    def backward(ctx, dh, d_total=None):
        if dh is None and d_total is None and ctx.slots is None:
            return (None,) * ctx.n_inputs
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, from the reference
            return _mixture_graph_backward(ctx, dh, d_total)
        return _mixture_backward(ctx, dh, d_total)


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b, where None is no gradient."""
    return b if a is None else a if b is None else a + b


def _add_norm_backward(ctx, *grads):
    ds, dx = grads if ctx.has_b else (None, grads[0])
    weight, s, rh = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, from PyTorch ops
        dw, d_s = graph_grads(lambda w, s: (rms_norm(s, w, ctx.eps),), [weight, s], [dx])
        g = _plus(d_s, ds)
        return dw, None, g, g if ctx.has_b else None
    if dx is None:  # only the sum reaches the loss
        return None, None, ds, ds
    g = torch.empty_like(s)
    dw = torch.empty_like(weight)
    _run_add_norm_grad(s, weight, rh, dx.contiguous(), None if ds is None else ds.contiguous(), g, dw)
    return dw, None, g, g if ctx.has_b else None


class _AddNormFunction(torch.autograd.Function):
    """PreNorm's residual step and the next pre-norm in one kernel, for inputs
    :func:`add_rms_norm` has checked: (weight, eps, a, b) -> (s = a + b, x = rms_norm(s) *
    weight), or x alone for a when b is None."""

    @staticmethod
    def forward(ctx, weight, eps, a, b):
        s = a if b is None else torch.empty_like(a)
        x = torch.empty_like(a)
        rh = torch.empty(a.shape[:-1], dtype=a.dtype)
        _run_add_norm(a, b, weight, eps, s, x, rh)
        ctx.save_for_backward(weight, s, rh)
        ctx.has_b, ctx.eps = b is not None, eps
        if b is None:
            return x
        ctx.set_materialize_grads(False)
        return s, x

    backward = staticmethod(_add_norm_backward)


def depth_attn_numba(
    sources,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
    validate: bool = True,
    return_contrib: bool = False,
):
    """Depth attention with the fused Numba CPU kernels (forward and backward).

    Args:
        sources: [S, *batch, d] tensor or a sequence of S tensors [*batch, d]; CPU,
            float32 or float64.
        query: [d] pseudo-query.
        gain: [d] key-norm gain, or None for ones.
        eps: RMS epsilon.
        return_weights: also return the softmax weights the kernel used.
        validate: check the arguments (callers that already did may skip it).
        return_contrib: also return each source's contribution share
            ``w_i <v_i, h> / |h|^2`` [*batch, S], computed in the same pass (no gradient).

    Returns:
        As :func:`~attnres_probe.kernels.depth_attn`: (mixture [*batch, d] in the sources'
        dtype, lse [*batch]), then the weights [*batch, S] with ``return_weights``, then the
        shares with ``return_contrib``; lse, weights and shares in the compute dtype (float64
        if any input is float64, else float32).

    Raises:
        ValueError: non-CPU tensors, or a dtype other than float32/float64 (named).
    """
    if validate:
        validate_depth_attn_args(sources, query, gain, eps)
    src = list(sources.unbind(0)) if isinstance(sources, torch.Tensor) else list(sources)
    first = src[0]
    _check_supported(*src, query, gain)
    dtypes = {s.dtype for s in src} | {query.dtype, None if gain is None else gain.dtype}
    dt = torch.float64 if torch.float64 in dtypes else torch.float32
    query = query.to(dt).contiguous()
    gain = None if gain is None else gain.to(dt).contiguous()
    if any(s.dtype != dt or not s.is_contiguous() for s in src):
        src = [s.to(dt).contiguous() for s in src]  # no reshape: a view would add an autograd node per source
    outs = DepthAttnNumbaFunction.apply(query, gain, float(eps), True, bool(return_weights), bool(return_contrib), *src)
    h = outs[0] if first.dtype == dt else outs[0].to(first.dtype)  # the mixture in the sources' dtype
    return (h, *outs[1:])


def mixture(sources, query: torch.Tensor, gain: torch.Tensor | None, eps: float, slots=None, norm=None) -> torch.Tensor:
    """The mixture alone, for a caller that already resolved this backend (the model's unhooked reads).

    Goes straight to a lean autograd op (one output, no options) when the sources are CPU
    tensors of one shape [*batch, d] (strided ones are copied) and the query and gain
    contiguous [d], all in one dtype (float32 or float64), as a model's are; anything else (no
    gain included) takes
    :func:`depth_attn_numba`'s validated path (conversion, or a clear error). At the demo
    models' size the argument checks, options and dispatch this skips are a measurable part of
    a training step.

    ``slots`` (the model's, one entry per source: None or a (:class:`GradSlot`, owner) pair)
    lets the reads of a source sum its gradient inside their kernels; it needs the lean op.
    ``norm``, a (weight [d], eps) pair, returns ``rms_norm(h) * weight`` instead of the
    mixture h: the next sublayer's pre-norm, which the lean op's kernel applies as it writes
    h when the weight is a contiguous [d] tensor of the sources' dtype (else PyTorch ops apply
    it afterwards); gradients flow to the weight too.
    """
    if _plain(sources, query, gain):
        _check_slots(slots, len(sources))
        if not all(s.is_contiguous() for s in sources):
            sources = [s.contiguous() for s in sources]
        norm_w, norm_eps, after = _kernel_norm(sources, norm)
        out = _MixtureFunction.apply(query, gain, norm_w, float(eps), norm_eps, False, slots, *sources)
        return out if after is None else rms_norm(out, *after)
    _no_slots(slots)
    h = depth_attn_numba(sources, query, gain, eps)[0]  # checks everything; converts or explains
    return h if norm is None else rms_norm(h, *norm)


def fused_mixture(
    sources, a: torch.Tensor, b: torch.Tensor, query: torch.Tensor, gain: torch.Tensor | None, eps: float, slots=None,
    norm=None,
):
    """The mixture over ``[*sources, a + b]`` and the sum ``a + b``: a Block AttnRes read after
    a sublayer, whose partial-block sum (previous partial ``a`` plus the sublayer's output
    ``b``) the kernel forms as it reads it, instead of a separate add. Returns (mixture,
    a + b); gradients flow to every source, a, b, the query and the gain. Takes the lean op
    under :func:`mixture`'s conditions (a and b included), else adds and calls :func:`mixture`.
    ``slots`` and ``norm`` as for :func:`mixture` (the sum a + b counting as the last source;
    with ``norm`` the first output is the normalised mixture).
    """
    srcs = [*sources, a, b]
    if _plain(srcs, query, gain):
        _check_slots(slots, len(sources) + 1)
        if not all(s.is_contiguous() for s in srcs):
            srcs = [s.contiguous() for s in srcs]
        norm_w, norm_eps, after = _kernel_norm(srcs, norm)
        out, total = _MixtureFunction.apply(query, gain, norm_w, float(eps), norm_eps, True, slots, *srcs)
        return (out if after is None else rms_norm(out, *after)), total
    _no_slots(slots)
    total = a + b
    return mixture([*sources, total], query, gain, eps, norm=norm), total


def add_rms_norm(a: torch.Tensor, b: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """PreNorm's residual step and the next sublayer's pre-norm in one kernel: ``(s, x)`` with
    ``s = a + b`` and ``x = rms_norm(s) * weight``; with b None, ``x`` alone for ``a``.

    Takes the kernel when a (and b) are CPU tensors of one shape [*batch, d] and the weight a
    contiguous [d], all float32 or all float64; anything else is computed with PyTorch ops.
    """
    ts = [a] if b is None else [a, b]
    if _plain(ts, weight):
        if not all(t.is_contiguous() for t in ts):
            ts = [t.contiguous() for t in ts]
        return _AddNormFunction.apply(weight, float(eps), *ts, *([None] if b is None else []))
    if b is None:
        return rms_norm(a, weight, eps)
    s = a + b
    return s, rms_norm(s, weight, eps)


def _kernel_norm(sources, norm):
    """(norm weight, eps) for the lean op's kernel, or the norm to apply afterwards with
    PyTorch ops instead, for a weight the kernel does not take (another dtype, strided, not
    [d]: PyTorch's broadcasting then applies it, or refuses it, as the norm module would)."""
    if norm is None:
        return None, 0.0, None
    if _plain(sources, norm[0]):
        return norm[0], float(norm[1]), None
    return None, 0.0, norm


def _check_slots(slots, n_src: int) -> None:
    if slots is not None and len(slots) != n_src:
        raise ValueError(f"slots has {len(slots)} entries for {n_src} sources (a + b counts as one); give one per source")


def _no_slots(slots) -> None:
    if slots is not None and any(s is not None for s in slots):
        raise ValueError(
            "gradient slots need the lean op's inputs: CPU sources of one shape and dtype "
            "(float32 or float64), with a query and gain [d] of that dtype"
        )


def _plain(sources, *params: torch.Tensor | None) -> bool:
    """Whether the lean ops take these inputs: CPU sources of one shape [*batch, d] (made
    contiguous), and contiguous [d] CPU parameters (query, gain, norm weight; None is not
    taken), all float32 or all float64."""
    dt = params[0].dtype if params[0] is not None else None
    shape = sources[0].shape
    return (
        dt in _ONE
        and all(p is not None and p.dtype == dt and p.shape == shape[-1:] and p.is_contiguous() and p.is_cpu for p in params)
        and all(s.dtype == dt and s.shape == shape and s.is_cpu for s in sources)
    )


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
