"""Fused Triton kernels for phase 2 of the two-phase Block schedule (the ``"triton"`` backend of
``phase2``).

Phase 2 (``phase2_fwd_kernel`` / ``phase2_bwd_kernel``) fuses the partial block's key norm and
logit with the merge ``h = (1 - s) o_bar + s partial``, ``s = sigmoid(z_p - lse)``, with
``1 - s = sigmoid(lse - z_p)`` computed directly (``o_bar + s (partial - o_bar)`` cancels in
float32 when s is close to one and the partial is small), and ``lse_total = logaddexp(lse, z_p)``.
The math is the reference's (``reference.py`` beside this file).

Limits: see ``triton_utils``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...triton_utils import check_supported, fp32_query, grads_or, persistent_programs, row_tiles
from ...utils import graph_grads, validate_depth_attn_args
from . import reference

__all__ = ["Phase2Function", "phase2"]


@triton.jit
def _sigmoid(x):
    # sigmoid without overflow for large |x|: exp(-|x|) <= 1
    b_e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + b_e), b_e / (1.0 + b_e))


@triton.jit
def phase2_fwd_kernel(
    ob,  # [M, D] phase-1 mixture
    lse,  # [M] phase-1 lse
    p,  # [M, D] partial block
    q,  # [D] gain-folded query, fp32
    h,  # [M, D] merged mixture (partial's dtype)
    lse_t,  # [M] fp32 total lse
    zp,  # [M] fp32 partial's logit
    M,
    D,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < M
    m_d = o_d < D
    m_md = m_m[:, None] & m_d[None, :]
    o_md = o_m.to(tl.int64)[:, None] * D + o_d[None, :]

    b_q = tl.load(q + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_p = tl.load(p + o_md, mask=m_md, other=0.0).to(tl.float32)
    b_o = tl.load(ob + o_md, mask=m_md, other=0.0).to(tl.float32)
    b_lse = tl.load(lse + o_m, mask=m_m, other=0.0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_p * b_p, 1) / D + eps)
    b_zp = tl.sum(b_p * b_q[None, :], 1) * b_r
    b_s = _sigmoid(b_zp - b_lse)
    b_t = _sigmoid(b_lse - b_zp)  # 1 - s without cancellation (docs/design.md, "The math")
    b_h = b_t[:, None] * b_o + b_s[:, None] * b_p
    b_mx = tl.maximum(b_lse, b_zp)
    b_lt = b_mx + tl.log(tl.exp(b_lse - b_mx) + tl.exp(b_zp - b_mx))
    b_lt = tl.where(b_mx == float("-inf"), b_mx, b_lt)  # logaddexp(-inf, -inf) = -inf
    tl.store(h + o_md, b_h.to(h.dtype.element_ty), mask=m_md)
    tl.store(lse_t + o_m, b_lt, mask=m_m)
    tl.store(zp + o_m, b_zp, mask=m_m)


@triton.jit
def phase2_bwd_kernel(
    ob,  # [M, D]
    lse,  # [M]
    p,  # [M, D]
    q,  # [D] fp32
    dh,  # [M, D] gradient of h
    dlt,  # [M] gradient of lse_total (HAS_DLT)
    dzp,  # [M] gradient of the partial's logit z_p (HAS_DZP)
    dob,  # [M, D] (o_bar's dtype)
    dlse,  # [M] (lse's dtype)
    dp,  # [M, D] (partial's dtype)
    dq,  # [n_programs, D] fp32 partial sums
    M,
    D,
    eps,
    HAS_DLT: tl.constexpr,
    HAS_DZP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_q = tl.load(q + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dq = tl.zeros([BLOCK_D], dtype=tl.float32)

    for i_m in range(i_p, tl.cdiv(M, BLOCK_M), n_p):
        o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_m = o_m < M
        m_md = m_m[:, None] & m_d[None, :]
        o_md = o_m.to(tl.int64)[:, None] * D + o_d[None, :]
        b_p = tl.load(p + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_o = tl.load(ob + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_dh = tl.load(dh + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_lse = tl.load(lse + o_m, mask=m_m, other=0.0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_p * b_p, 1) / D + eps)
        b_dot = tl.sum(b_p * b_q[None, :], 1)
        b_s = _sigmoid(b_dot * b_r - b_lse)
        b_t = _sigmoid(b_lse - b_dot * b_r)  # 1 - s

        # h = (1 - s) o_bar + s p, s = sigmoid(z_p - lse): ds/dz_p = s (1 - s) = -ds/dlse
        b_ds = tl.sum(b_dh * (b_p - b_o), 1)
        b_dx = b_ds * b_s * b_t
        b_dzp = b_dx
        b_dl = -b_dx
        if HAS_DLT:  # lse_total = logaddexp(lse, z_p): d/dz_p = s, d/dlse = 1 - s
            b_dlt = tl.load(dlt + o_m, mask=m_m, other=0.0).to(tl.float32)
            b_dzp += b_dlt * b_s
            b_dl += b_dlt * b_t
        if HAS_DZP:  # the partial's logit is an output too
            b_dzp += tl.load(dzp + o_m, mask=m_m, other=0.0).to(tl.float32)

        b_g = tl.where(m_m, b_dzp * b_r, 0.0)
        b_c = tl.where(m_m, b_g * b_r * b_r * b_dot / D, 0.0)
        b_dp = b_s[:, None] * b_dh + b_g[:, None] * b_q[None, :] - b_c[:, None] * b_p
        b_dob = b_t[:, None] * b_dh
        tl.store(dp + o_md, b_dp.to(dp.dtype.element_ty), mask=m_md)
        tl.store(dob + o_md, b_dob.to(dob.dtype.element_ty), mask=m_md)
        tl.store(dlse + o_m, b_dl.to(dlse.dtype.element_ty), mask=m_m)
        b_dq += tl.sum(b_g[:, None] * b_p, 0)

    tl.store(dq + tl.cast(i_p, tl.int64) * D + o_d, b_dq, mask=m_d)


def phase2_fwd(ob, lse, p, q, eps: float):
    """ob, p [M, d], lse [M], q [d] fp32 -> (h [M, d], lse_total [M], z_p [M])."""
    n_rows, d = p.shape
    block_m, block_d, num_warps = row_tiles(d)
    h = torch.empty_like(p)
    lse_t = torch.empty((n_rows,), device=p.device, dtype=torch.float32)
    zp = torch.empty((n_rows,), device=p.device, dtype=torch.float32)
    phase2_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        ob, lse, p, q, h, lse_t, zp, n_rows, d, eps,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    return h, lse_t, zp


def phase2_bwd(ob, lse, p, q, dh, dlt, dzp, eps: float):
    """Gradients (dob, dlse, dp, dq [d] fp32) of the phase-2 forward."""
    n_rows, d = p.shape
    block_m, block_d, num_warps = row_tiles(d)
    dh = torch.zeros_like(p) if dh is None else dh.contiguous()
    dob = torch.empty_like(ob)
    dlse = torch.empty_like(lse)
    dp = torch.empty_like(p)
    n_prog = persistent_programs(p.device, triton.cdiv(n_rows, block_m))
    dq = torch.empty((n_prog, d), device=p.device, dtype=torch.float32)
    phase2_bwd_kernel[(n_prog,)](
        ob, lse, p, q, dh, *grads_or(lse, dlt, dzp), dob, dlse, dp, dq, n_rows, d, eps,
        HAS_DLT=dlt is not None, HAS_DZP=dzp is not None,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    return dob, dlse, dp, dq.sum(0)


class Phase2Function(torch.autograd.Function):
    """Autograd join of :func:`phase2_fwd` and :func:`phase2_bwd`."""

    @staticmethod
    def forward(ctx, ob, lse, p, q, eps):
        h, lse_t, zp = phase2_fwd(ob, lse, p, q, eps)
        ctx.save_for_backward(ob, lse, p, q)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        return h, lse_t, zp

    @staticmethod
    def backward(ctx, dh, dlt, dzp):
        ob, lse, p, q = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, from the reference
            def ref(ob, lse, p, q):
                return reference.phase2(ob, lse, p, q, None, ctx.eps)

            dob, dlse, dp, dq = graph_grads(ref, [ob, lse, p, q], [dh, dlt, dzp])
            return dob, dlse, dp, dq, None
        dob, dlse, dp, dq = phase2_bwd(ob, lse, p, q, dh, dlt, dzp, ctx.eps)
        return dob, dlse, dp, dq, None


def phase2(
    o_bar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
):
    """Phase 2 with the fused Triton kernels, a read's phase-1 result merged with the partial
    block: see :func:`attnres_probe.kernels.phase2`.

    Raises:
        ValueError: as the depth-attention kernels (``triton_utils``), or mismatched shapes.
    """
    _, batch, d = validate_depth_attn_args([partial], query, gain, eps)
    if not isinstance(o_bar, torch.Tensor) or o_bar.shape != partial.shape:
        raise ValueError(f"o_bar must match partial's shape {tuple(partial.shape)}; got {tuple(getattr(o_bar, 'shape', ()))}")
    if not isinstance(lse, torch.Tensor) or lse.shape != partial.shape[:-1]:
        raise ValueError(f"lse must have shape {tuple(partial.shape[:-1])}; got {tuple(getattr(lse, 'shape', ()))}")
    check_supported("phase2", partial.device, d, partial, o_bar, lse, query, gain)
    n_rows = partial.numel() // d
    if n_rows == 0:
        return reference.phase2(o_bar, lse, partial, query, gain, eps)
    h, lse_t, zp = Phase2Function.apply(
        o_bar.reshape(n_rows, d).contiguous(),
        lse.reshape(n_rows).contiguous(),
        partial.reshape(n_rows, d).contiguous(),
        fp32_query(query, gain),
        float(eps),
    )
    return h.view(*batch, d), lse_t.view(batch), zp.view(batch)
