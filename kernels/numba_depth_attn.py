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

Forward (``_forward``): pass 1 walks each source once and computes its RMS and logit per row
(the sum of squares and the dot product share the load); a per-row softmax gives the weights
and the lse; pass 2 accumulates the mixture. The logits and inverse RMS are kept ([M, S],
small) for the backward.

Backward (``_backward``), with upstream gradients ``dh`` (mixture), ``dlse`` and ``dw``
(weights, when they were returned):

    dalpha_i = dh . v_i + dw_i,          D = sum_j alpha_j dalpha_j,
    dz_i     = alpha_i (dalpha_i - D) + alpha_i dlse,
    dv_i     = alpha_i dh + dz_i r_i q - dz_i z_i r_i v_i / d,
    dq       = sum_rows sum_i dz_i r_i v_i.

The last two lines are ``dz_i`` times the derivative of ``z_i = r_i (q . v_i)`` through both
the dot product and the RMS (``dr_i/dv_i = -r_i^3 v_i / d``). The query gradient is
accumulated in float64.

Conventions and limits:

- float32 and float64 only (float64 computes in float64); ``auto`` sends float16/bfloat16
  CPU tensors to the reference, and forcing this backend on them raises a ValueError.
- CPU tensors only. Sources are used in place when contiguous (each source is read through
  its data pointer, so a list of S tensors is never stacked); others are copied once.
- The kernels release the GIL. A call that touches at least ``PARALLEL_MIN_ELEMENTS`` source
  elements is split by token rows over ``torch.get_num_threads()`` threads (each range writes
  its own rows and its own partial query gradient); smaller calls run on the caller's
  thread. Concurrent callers (the dashboard's server threads) share no state.
- They are compiled on first use (about two seconds for the forward and the backward per
  dtype) and Numba caches the machine code on disk, next to this module in ``__pycache__``
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
from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from .reference import validate_depth_attn_args

__all__ = ["SUPPORTED_DTYPES", "depth_attn_numba"]

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


@nb.njit(nogil=True, fastmath=_FASTMATH, cache=_CACHE)
def _forward(table, n_src, n_rows, d, want_contrib, eps, one, inv_d, lo, hi):  # pragma: no cover - compiled
    """Token rows lo..hi-1 of the forward.

    ``table`` holds addresses: the S sources ([M, d] each), then q [d], h [M, d], lse [M],
    w, z, inv [M, S] and (used with ``want_contrib``) c [M, S] (all contiguous, in the compute
    dtype). One token row at a time: its S source rows are read for the norms and logits and
    read again, from cache, for the mixture and (``want_contrib``) for the contribution
    shares c_i = w_i <v_i, h> / |h|^2. ``eps``, ``one`` and ``inv_d`` (1/d) come in the
    compute dtype, so no arithmetic is promoted to float64.
    """
    q = nb.carray(_pointer(table[n_src], one), (d,))
    h = nb.carray(_pointer(table[n_src + 1], one), (n_rows, d))
    lse = nb.carray(_pointer(table[n_src + 2], one), (n_rows,))
    w = nb.carray(_pointer(table[n_src + 3], one), (n_rows, n_src))
    z = nb.carray(_pointer(table[n_src + 4], one), (n_rows, n_src))
    inv = nb.carray(_pointer(table[n_src + 5], one), (n_rows, n_src))
    c = nb.carray(_pointer(table[n_src + 6], one), (n_rows if want_contrib else 0, n_src))
    zero = one - one
    for m in range(lo, hi):
        z_max = zero
        for i in range(n_src):
            v = _row(table[i], m, n_rows, d, one)
            ss = zero
            dot = zero
            for k in range(d):
                x = v[k]
                ss += x * x
                dot += x * q[k]
            r = one / np.sqrt(ss * inv_d + eps)
            inv[m, i] = r
            zi = dot * r
            z[m, i] = zi
            if i == 0 or zi > z_max or np.isnan(zi):
                z_max = zi
        if np.isinf(z_max):  # +-inf logits: shift by 0 so exp/log give the reference's inf/nan
            z_max = zero
        total = zero
        for i in range(n_src):
            e = np.exp(z[m, i] - z_max)
            w[m, i] = e
            total += e
        scale = one / total
        for i in range(n_src):
            w[m, i] *= scale
        lse[m] = z_max + np.log(total)
        out = h[m]
        wi = w[m, 0]
        v = _row(table[0], m, n_rows, d, one)
        for k in range(d):
            out[k] = wi * v[k]
        for i in range(1, n_src):
            wi = w[m, i]
            v = _row(table[i], m, n_rows, d, one)
            for k in range(d):
                out[k] += wi * v[k]
        if want_contrib:
            hh = zero
            for k in range(d):
                hh += out[k] * out[k]
            for i in range(n_src):
                v = _row(table[i], m, n_rows, d, one)
                dot = zero
                for k in range(d):
                    dot += v[k] * out[k]
                c[m, i] = w[m, i] * dot / hh


@nb.njit(nogil=True, fastmath=_FASTMATH, cache=_CACHE)
def _backward(table, n_src, n_rows, d, has_dh, has_dlse, has_dw, one, inv_d, dq_address, lo, hi):  # pragma: no cover
    """Gradients of :func:`_forward` for token rows lo..hi-1.

    ``table`` holds addresses: the S sources, then q [d], w, z, inv [M, S] (saved by the
    forward), the upstream dh [M, d], dlse [M], dw [M, S] (0 where absent) and the S
    outputs dv_i [M, d], which are written. The query gradient of these rows is summed in the
    compute dtype over chunks of rows and added to the float64 [d] array at ``dq_address``.
    """
    q = nb.carray(_pointer(table[n_src], one), (d,))
    w = nb.carray(_pointer(table[n_src + 1], one), (n_rows, n_src))
    z = nb.carray(_pointer(table[n_src + 2], one), (n_rows, n_src))
    inv = nb.carray(_pointer(table[n_src + 3], one), (n_rows, n_src))
    dh = nb.carray(_pointer(table[n_src + 4], one), (n_rows if has_dh else 0, d))
    dlse = nb.carray(_pointer(table[n_src + 5], one), (n_rows if has_dlse else 0,))
    dw = nb.carray(_pointer(table[n_src + 6], one), (n_rows if has_dw else 0, n_src))
    dq = nb.carray(_pointer(dq_address, np.float64(0.0)), (d,))
    zero = one - one
    dz = np.empty(n_src, w.dtype)
    dq_part = np.zeros(d, w.dtype)
    for m in range(lo, hi):
        big_d = zero
        for i in range(n_src):  # dalpha_i = dh . v_i (+ dw_i)
            acc = zero
            if has_dh:
                v = _row(table[i], m, n_rows, d, one)
                for k in range(d):
                    acc += v[k] * dh[m, k]
            if has_dw:
                acc += dw[m, i]
            dz[i] = acc
            big_d += w[m, i] * acc
        extra = dlse[m] if has_dlse else zero
        for i in range(n_src):
            wi = w[m, i]
            a = wi * (dz[i] - big_d + extra) * inv[m, i]  # dz_i * r_i
            c = -a * z[m, i] * inv[m, i] * inv_d
            v = _row(table[i], m, n_rows, d, one)
            out = _row(table[n_src + 7 + i], m, n_rows, d, one)  # dv_i, written
            if has_dh:
                for k in range(d):
                    x = v[k]
                    out[k] = wi * dh[m, k] + a * q[k] + c * x
                    dq_part[k] += a * x
            else:
                for k in range(d):
                    x = v[k]
                    out[k] = a * q[k] + c * x
                    dq_part[k] += a * x
        if (m - lo) % 256 == 255 or m == hi - 1:
            for k in range(d):
                dq[k] += dq_part[k]
                dq_part[k] = zero


def _table(tensors) -> np.ndarray:
    """Addresses of tensors (0 for None), for a kernel's pointer table."""
    return np.array([0 if t is None else t.data_ptr() for t in tensors], dtype=np.int64)


# Calls that touch at least this many source elements are split by rows over up to
# torch.get_num_threads() threads (the kernels release the GIL); smaller ones are not worth
# a thread hand-off.
PARALLEL_MIN_ELEMENTS = 1 << 20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _row_chunks(n_rows: int, work: int) -> list[tuple[int, int]]:
    """Row ranges to run in parallel: one per thread for big calls, else one."""
    threads = torch.get_num_threads()
    if threads < 2 or work < PARALLEL_MIN_ELEMENTS or n_rows < 2 * threads:
        return [(0, n_rows)]
    step = -(-n_rows // threads)
    return [(lo, min(lo + step, n_rows)) for lo in range(0, n_rows, step)]


def _run_chunks(kernel, args: tuple, chunks: list[tuple[int, int]], dq: torch.Tensor | None = None) -> None:
    """Run ``kernel(*args, [address of dq[i]], lo, hi)`` for every chunk i; the first on this thread."""
    global _pool

    def call(i: int, lo: int, hi: int):
        extra = () if dq is None else (dq[i].data_ptr(),)
        return kernel(*args, *extra, lo, hi)

    if len(chunks) == 1:
        call(0, *chunks[0])
        return
    with _pool_lock:
        if _pool is None or _pool._max_workers < len(chunks) - 1:
            _pool = ThreadPoolExecutor(max_workers=len(chunks) - 1, thread_name_prefix="attnres-numba")
        pool = _pool
    futures = [pool.submit(call, i, lo, hi) for i, (lo, hi) in enumerate(chunks[1:], start=1)]
    call(0, *chunks[0])
    for f in futures:
        f.result()


class DepthAttnNumbaFunction(torch.autograd.Function):
    """Autograd join of the Numba forward and backward.

    Inputs are (query, gain, eps, return_weights, return_contrib, *sources): ``query`` and
    ``gain`` [d] (gain may be None), every source [*batch, d], all contiguous in one dtype.
    Outputs are (h, lse), then the weights with ``return_weights`` and the contribution
    shares with ``return_contrib`` (an observation: no gradient flows through them).
    Gradients flow to every source, the query and the gain; the gain is folded into the
    query here (``q = query * gain``), so a read adds one autograd node, not three.
    """

    @staticmethod
    def forward(ctx, query, gain, eps, return_weights, return_contrib, *rows):
        q = (query if gain is None else query * gain).contiguous()
        first = rows[0]
        batch, d = first.shape[:-1], first.shape[-1]
        n_rows, n_src = first.numel() // d, len(rows)
        dt = q.dtype
        one = np.float32(1) if dt == torch.float32 else np.float64(1)
        h = torch.empty_like(first, dtype=dt)
        lse = torch.empty(batch, dtype=dt)
        wzi = torch.empty((3, *batch, n_src), dtype=dt)  # weights, logits, inverse RMS
        w, z, inv = wzi.unbind(0)
        c = torch.empty((*batch, n_src), dtype=dt) if return_contrib else None
        table = _table([*rows, q, h, lse, w, z, inv, c])
        chunks = _row_chunks(n_rows, n_rows * n_src * d)
        _run_chunks(_forward, (table, n_src, n_rows, d, bool(return_contrib), one * eps, one, one / d), chunks)
        ctx.save_for_backward(query, gain, q, wzi, *rows)
        ctx.set_materialize_grads(False)
        ctx.return_weights = return_weights
        outs = [h, lse]
        if return_weights:
            outs.append(w.clone())  # the saved weights stay private: a caller may edit the returned ones
        if return_contrib:
            ctx.mark_non_differentiable(c)
            outs.append(c)
        return tuple(outs)

    @staticmethod
    def backward(ctx, dh, dlse, *rest):
        dw = rest[0] if ctx.return_weights else None
        query, gain, q, wzi, *rows = ctx.saved_tensors
        if dh is None and dlse is None and dw is None:
            return (None, None, None, None, None, *([None] * len(rows)))
        first = rows[0]
        d, n_src = first.shape[-1], len(rows)
        n_rows = first.numel() // d
        dt = q.dtype
        one = np.float32(1) if dt == torch.float32 else np.float64(1)
        # one buffer per source: autograd can then accumulate into it in place (views of one
        # shared buffer would force an out-of-place add for every later read of the source)
        dv = [torch.empty_like(first, dtype=dt) for _ in range(n_src)]
        chunks = _row_chunks(n_rows, n_rows * n_src * d)
        dq = torch.zeros((len(chunks), d), dtype=torch.float64)  # one partial sum per chunk
        up = [None if t is None else t.contiguous() for t in (dh, dlse, dw)]
        table = _table([*rows, q, *wzi.unbind(0), *up, *dv])
        flags = tuple(t is not None for t in up)
        _run_chunks(_backward, (table, n_src, n_rows, d, *flags, one, one / d), chunks, dq)
        dq = dq[0] if len(chunks) == 1 else dq.sum(0)  # float64 [d], gradient of q = query * gain
        d_query = (dq if gain is None else dq * gain).to(dt)
        d_gain = None if gain is None else (dq * query).to(dt)
        return (d_query, d_gain, None, None, None, *dv)


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
    _check_supported(first, query, gain)
    dt = torch.float64 if torch.float64 in (first.dtype, query.dtype, None if gain is None else gain.dtype) else torch.float32
    query = query.to(dt).contiguous()
    gain = None if gain is None else gain.to(dt).contiguous()
    if first.dtype != dt or not all(s.is_contiguous() for s in src):
        src = [s.to(dt).contiguous() for s in src]  # no reshape: a view would add an autograd node per source
    outs = DepthAttnNumbaFunction.apply(query, gain, float(eps), bool(return_weights), bool(return_contrib), *src)
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
