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
- Kernels run single-threaded and release the GIL, so concurrent callers (the dashboard's
  server threads) run in parallel without sharing state.
- They are compiled on first use in each process (about a second per dtype; nothing is
  cached to disk, so no compiled artefact is ever loaded from a file).
- Phase 1 and phase 2 of the two-phase Block schedule have no Numba kernels: on the CPU the
  model uses the sequential schedule, and ``phase1``/``phase2`` with this backend run the
  reference.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from .reference import depth_attn_reference, validate_depth_attn_args

__all__ = ["SUPPORTED_DTYPES", "depth_attn_numba"]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

# Reassociation lets LLVM vectorise the row reductions; no flag that assumes finite values,
# so NaN and inf propagate exactly as in the reference.
_FASTMATH = {"reassoc", "contract", "nsz"}


@intrinsic
def _pointer_like(typingctx, address, like):
    """A typed pointer to ``like``'s element type at integer ``address``."""
    ptr_t = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_t))

    return ptr_t(types.int64, like), codegen


@nb.njit(nogil=True, fastmath=_FASTMATH)
def _row(address, m, d, like):  # pragma: no cover - compiled
    """Row m ([d]) of a contiguous [M, d] tensor at ``address``."""
    return nb.carray(_pointer_like(address + m * d * like.itemsize, like), (d,))


@nb.njit(nogil=True, fastmath=_FASTMATH)
def _forward(addresses, q, eps, one, inv_d, h, lse, w, z, inv, lo, hi):  # pragma: no cover - compiled
    """Rows lo..hi-1 of: sources at ``addresses`` (each [M, d]) -> h [M, d], lse [M], w/z/inv [M, S].

    One token row at a time: its S source rows are read for the norms and logits and read
    again, from cache, for the mixture. ``eps``, ``one`` and ``inv_d`` (1/d) come in the
    compute dtype, so no arithmetic is promoted to float64.
    """
    n_src = addresses.shape[0]
    d = h.shape[1]
    zero = one - one
    for m in range(lo, hi):
        z_max = zero
        for i in range(n_src):
            v = _row(addresses[i], m, d, q)
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
        v = _row(addresses[0], m, d, q)
        for k in range(d):
            out[k] = wi * v[k]
        for i in range(1, n_src):
            wi = w[m, i]
            v = _row(addresses[i], m, d, q)
            for k in range(d):
                out[k] += wi * v[k]


@nb.njit(nogil=True, fastmath=_FASTMATH)
def _backward(addresses, q, w, z, inv, dh, dlse, dw, has_dh, has_dlse, has_dw, zero, inv_d, dv, dq, lo, hi):  # pragma: no cover
    """Gradients of :func:`_forward` for rows lo..hi-1: dv [S, M, d] (written), dq [d] float64 (added to).

    ``zero`` (0) and ``inv_d`` (1/d) come in the compute dtype, so nothing is promoted to
    float64 (``zero`` types the accumulators). The query gradient is
    summed in the compute dtype over chunks of rows and added to ``dq`` in float64.
    """
    n_src = addresses.shape[0]
    d = q.shape[0]
    dz = np.empty(n_src, w.dtype)
    dq_part = np.zeros(d, w.dtype)
    for m in range(lo, hi):
        big_d = zero
        for i in range(n_src):  # dalpha_i = dh . v_i (+ dw_i)
            acc = zero
            if has_dh:
                v = _row(addresses[i], m, d, q)
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
            v = _row(addresses[i], m, d, q)
            out = dv[i, m]
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


def _pointers(tensors: list[torch.Tensor]) -> np.ndarray:
    return np.array([t.data_ptr() for t in tensors], dtype=np.int64)


class DepthAttnNumbaFunction(torch.autograd.Function):
    """Autograd join of the Numba forward and backward; inputs are (q, eps, return_weights, *rows).

    ``q`` is the gain-folded query [d]; every row tensor is one source [M, d], contiguous, in
    q's dtype. Gradients flow to every source and to q (the gain gets its gradient from
    autograd through ``q = query * gain``).
    """

    @staticmethod
    def forward(ctx, q, eps, return_weights, *rows):
        n_rows, d = rows[0].shape
        n_src = len(rows)
        dt = q.dtype
        npdt = np.float32 if dt == torch.float32 else np.float64
        h = torch.empty((n_rows, d), dtype=dt)
        lse = torch.empty((n_rows,), dtype=dt)
        w, z, inv = (torch.empty((n_rows, n_src), dtype=dt) for _ in range(3))
        if n_rows:
            _forward(_pointers(rows), q.detach().numpy(), npdt(eps), npdt(1), npdt(1 / d), h.numpy(), lse.numpy(), w.numpy(), z.numpy(), inv.numpy(), 0, n_rows)
        ctx.save_for_backward(q, w, z, inv, *rows)
        ctx.set_materialize_grads(False)
        if return_weights:
            return h, lse, w.clone()  # the saved weights stay private: a caller may edit the returned ones
        return h, lse

    @staticmethod
    def backward(ctx, dh, dlse, dw=None):
        q, w, z, inv, *rows = ctx.saved_tensors
        n_rows, d = rows[0].shape
        dt = q.dtype
        npdt = np.float32 if dt == torch.float32 else np.float64
        dv = torch.empty((len(rows), n_rows, d), dtype=dt)
        dq = torch.zeros(d, dtype=torch.float64)
        if dh is None and dlse is None and dw is None:
            return (None, None, None, *([None] * len(rows)))
        if n_rows:
            empty = np.empty((0, 0), npdt)
            _backward(
                _pointers(rows),
                q.detach().numpy(),
                w.numpy(),
                z.numpy(),
                inv.numpy(),
                dh.detach().contiguous().numpy() if dh is not None else empty,
                dlse.detach().contiguous().numpy() if dlse is not None else np.empty(0, npdt),
                dw.detach().contiguous().numpy() if dw is not None else empty,
                dh is not None,
                dlse is not None,
                dw is not None,
                npdt(0),
                npdt(1 / d),
                dv.numpy(),
                dq.numpy(),
                0,
                n_rows,
            )
        else:
            dv.zero_()
        return (dq.to(dt), None, None, *dv.unbind(0))


def depth_attn_numba(
    sources,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
):
    """Depth attention with the fused Numba CPU kernels (forward and backward).

    Args:
        sources: [S, *batch, d] tensor or a sequence of S tensors [*batch, d]; CPU,
            float32 or float64.
        query: [d] pseudo-query.
        gain: [d] key-norm gain, or None for ones.
        eps: RMS epsilon.
        return_weights: also return the softmax weights the kernel used.

    Returns:
        As :func:`~attnres_probe.kernels.depth_attn`: (mixture [*batch, d], lse [*batch]) or,
        with ``return_weights``, (mixture, lse, weights [*batch, S]), in the compute dtype
        (float64 if any input is float64, else float32).

    Raises:
        ValueError: non-CPU tensors, or a dtype other than float32/float64 (named).
    """
    n_src, batch, d = validate_depth_attn_args(sources, query, gain, eps)
    src = list(sources.unbind(0)) if isinstance(sources, torch.Tensor) else list(sources)
    _check_supported(src[0], query, gain)
    dt = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in (src[0], query, gain)) else torch.float32
    q = query.to(dt)
    if gain is not None:
        q = q * gain.to(dt)
    rows = [s.to(dt).reshape(-1, d).contiguous() for s in src]
    if rows[0].shape[0] == 0:
        return depth_attn_reference(sources, query, gain, eps, return_weights, validate=False)
    outs = DepthAttnNumbaFunction.apply(q.contiguous(), float(eps), bool(return_weights), *rows)
    h = outs[0].view(*batch, d).to(src[0].dtype)  # the mixture in the sources' dtype, as the reference
    lse = outs[1].view(batch)
    if return_weights:
        return h, lse, outs[2].view(*batch, n_src)
    return h, lse


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
