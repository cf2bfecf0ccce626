"""Fused Triton kernels for depth attention and the two-phase Block AttnRes merge.

The math is the reference's (``reference.py``; docs/design.md, "The math"). With the gain folded
into the query, ``q = query * gain``, every source ``v_i`` of a token row gives

    r_i = rsqrt(mean(v_i^2) + eps),   z_i = r_i (q . v_i),
    alpha = softmax(z),   lse = logsumexp(z),   h = sum_i alpha_i v_i.

Forward (``depth_attn_fwd_kernel``). One program owns a block of BLOCK_M token rows (the batch
dims flattened to M rows; M need not be a multiple of BLOCK_M) and walks the S sources once.
Each source row is loaded once and used three times: its sum of squares (the RMS), its dot
product with the query (the logit) and, through an online softmax (running max ``b_max``,
running sum ``b_sum``, rescaled accumulator ``b_acc``), the mixture. No normalised key is
ever written out. With ``return_logits`` or ``return_weights`` the logits are stored in the same
loop, and the weights are ``exp(z - lse)`` of them, written at the end of the same program
(after a barrier): logits and weights are exactly the kernel's own.

Backward (``depth_attn_bwd_kernel``). With upstream gradients ``dh`` (mixture), ``dlse``,
``dw`` and ``dz`` (weights and logits, when they were returned):

    dalpha_i = dh . v_i + dw_i,          D = sum_j alpha_j dalpha_j,
    dz_i     = alpha_i (dalpha_i - D) + alpha_i dlse + dz_i(upstream),
    dv_i     = alpha_i dh + dz_i (r_i q - r_i^3 (q . v_i) v_i / d),
    dq       = sum_rows sum_i dz_i r_i v_i.

Each program makes two passes over the sources of its rows: the first accumulates ``D``
exactly in fp32 (not from the rounded mixture), the second recomputes ``alpha_i`` from the
saved lse and writes ``dv_i``. The backward grid is persistent (at most a few programs per
SM, each looping over row blocks), so the query gradient is a per-program partial sum
``[n_programs, d]`` that torch reduces; the gain and the unfolded query get their gradients
from autograd through ``q = query * gain``.

Phase 1 (``phase1_fwd_kernel`` / ``phase1_bwd_kernel``) is the same computation for Q queries
at once: a program owns one token row and a [BLOCK_Q, BLOCK_D] tile of queries, reads each
source row once and scores it against every query. Phase 2 (``phase2_fwd_kernel`` /
``phase2_bwd_kernel``) fuses the partial block's key norm and logit with the merge
``h = (1 - s) o_bar + s partial``, ``s = sigmoid(z_p - lse)``, with ``1 - s = sigmoid(lse - z_p)``
computed directly (``o_bar + s (partial - o_bar)`` cancels in float32 when s is close to one
and the partial is small), and ``lse_total = logaddexp(lse, z_p)``.

Limits and conventions:

- Sources may be float32, float16 or bfloat16; everything is computed in float32 inside the
  kernels. The mixture (and its gradient) comes back in the sources' dtype, lse and weights
  in float32. **float64 is rejected** with a ValueError (use ``backend="torch"``, which
  computes in float64).
- The feature width d must satisfy ``1 <= d <= MAX_D`` (8192): a row is held in one tile
  ``BLOCK_D = next_power_of_2(d)`` with masking. Wider rows raise a ValueError.
- Phase 1 holds BLOCK_Q queries per launch with ``BLOCK_Q * BLOCK_D <= 16384`` (e.g. 16
  queries at d = 1024, 4 at d = 4096); more queries are split into several launches, which
  is exact because queries are independent.
- Tensors must be on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .reference import (
    depth_attn_reference,
    graph_grads,
    phase1_reference,
    phase2_reference,
    validate_depth_attn_args,
)

__all__ = [
    "MAX_D",
    "SUPPORTED_DTYPES",
    "depth_attn_triton",
    "phase1_triton",
    "phase2_triton",
]

MAX_D = 8192
_ROW_TILE = 4096  # BLOCK_M * BLOCK_D elements per program (depth_attn, phase 2)
_PHASE1_TILE = 16384  # BLOCK_Q * BLOCK_D elements per program (phase 1)
_MAX_BLOCK_M = 64
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def depth_attn_fwd_kernel(
    x,  # [S, M, D] sources
    q,  # [D] gain-folded query, fp32
    h,  # [M, D] mixture (sources' dtype)
    lse,  # [M] fp32
    z,  # [M, S] fp32 logits (only touched when STORE_Z)
    w,  # [M, S] fp32 weights (only touched when STORE_W, which needs STORE_Z)
    M,
    D,
    S,
    stride_s,  # M * D
    eps,
    STORE_Z: tl.constexpr,
    STORE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < M
    m_d = o_d < D
    m_md = m_m[:, None] & m_d[None, :]
    o_m64 = o_m.to(tl.int64)
    o_md = o_m64[:, None] * D + o_d[None, :]

    b_q = tl.load(q + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    p_x = x + o_md
    for i in range(S):
        b_v = tl.load(p_x, mask=m_md, other=0.0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_v * b_v, 1) / D + eps)
        b_z = tl.sum(b_v * b_q[None, :], 1) * b_r
        if STORE_Z:
            tl.store(z + o_m64 * S + i, b_z, mask=m_m)
        b_new = tl.maximum(b_max, b_z)
        b_scale = tl.exp(b_max - b_new)
        b_p = tl.exp(b_z - b_new)
        b_sum = b_sum * b_scale + b_p
        b_acc = b_acc * b_scale[:, None] + b_p[:, None] * b_v
        b_max = b_new
        p_x += stride_s

    b_lse = b_max + tl.log(b_sum)
    tl.store(h + o_md, (b_acc / b_sum[:, None]).to(h.dtype.element_ty), mask=m_md)
    tl.store(lse + o_m, b_lse, mask=m_m)
    if STORE_W:
        tl.debug_barrier()  # the logits above were written by other threads of this program
        for i in range(S):
            b_z = tl.load(z + o_m64 * S + i, mask=m_m, other=0.0)
            tl.store(w + o_m64 * S + i, tl.exp(b_z - b_lse), mask=m_m)


@triton.jit
def depth_attn_bwd_kernel(
    x,  # [S, M, D] sources
    q,  # [D] gain-folded query, fp32
    lse,  # [M] fp32
    dh,  # [M, D] gradient of the mixture
    dlse,  # [M] gradient of lse (HAS_DLSE)
    dw,  # [M, S] gradient of the weights (HAS_DW)
    dzu,  # [M, S] gradient of the logits (HAS_DZ)
    dx,  # [S, M, D] gradient of the sources (sources' dtype)
    dq,  # [n_programs, D] fp32 partial sums of the folded query's gradient
    M,
    D,
    S,
    stride_s,  # M * D
    eps,
    HAS_DLSE: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DZ: tl.constexpr,
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
        o_m64 = o_m.to(tl.int64)
        o_md = o_m64[:, None] * D + o_d[None, :]
        b_dh = tl.load(dh + o_md, mask=m_md, other=0.0).to(tl.float32)
        b_lse = tl.load(lse + o_m, mask=m_m, other=0.0)

        # pass 1: D = sum_j alpha_j dalpha_j, exactly, in fp32
        b_D = tl.zeros([BLOCK_M], dtype=tl.float32)
        p_x = x + o_md
        for i in range(S):
            b_v = tl.load(p_x, mask=m_md, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_v * b_v, 1) / D + eps)
            b_a = tl.exp(tl.sum(b_v * b_q[None, :], 1) * b_r - b_lse)
            b_da = tl.sum(b_v * b_dh, 1)
            if HAS_DW:
                b_da += tl.load(dw + o_m64 * S + i, mask=m_m, other=0.0).to(tl.float32)
            b_D += tl.where(m_m, b_a * b_da, 0.0)
            p_x += stride_s

        if HAS_DLSE:
            b_dl = tl.load(dlse + o_m, mask=m_m, other=0.0).to(tl.float32)

        # pass 2: recompute alpha_i, write dv_i, accumulate dq
        p_x = x + o_md
        p_dx = dx + o_md
        for i in range(S):
            b_v = tl.load(p_x, mask=m_md, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_v * b_v, 1) / D + eps)
            b_dot = tl.sum(b_v * b_q[None, :], 1)
            b_a = tl.exp(b_dot * b_r - b_lse)
            b_da = tl.sum(b_v * b_dh, 1)
            if HAS_DW:
                b_da += tl.load(dw + o_m64 * S + i, mask=m_m, other=0.0).to(tl.float32)
            b_dz = b_a * (b_da - b_D)
            if HAS_DLSE:
                b_dz += b_a * b_dl
            if HAS_DZ:
                b_dz += tl.load(dzu + o_m64 * S + i, mask=m_m, other=0.0).to(tl.float32)
            b_g = tl.where(m_m, b_dz * b_r, 0.0)  # dz_i r_i
            b_c = tl.where(m_m, b_g * b_r * b_r * b_dot / D, 0.0)  # dz_i r_i^3 (q.v_i) / d
            b_dv = b_a[:, None] * b_dh + b_g[:, None] * b_q[None, :] - b_c[:, None] * b_v
            tl.store(p_dx, b_dv.to(dx.dtype.element_ty), mask=m_md)
            b_dq += tl.sum(b_g[:, None] * b_v, 0)
            p_x += stride_s
            p_dx += stride_s

    tl.store(dq + tl.cast(i_p, tl.int64) * D + o_d, b_dq, mask=m_d)


@triton.jit
def phase1_fwd_kernel(
    x,  # [S, M, D] completed block summaries
    q,  # [Q, D] gain-folded queries, fp32
    o,  # [Q, M, D] o_bar (sources' dtype)
    lse,  # [Q, M] fp32
    z,  # [Q, M, S] fp32 logits (STORE_Z)
    M,
    D,
    S,
    Q,
    stride_s,  # M * D
    eps,
    STORE_Z: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)  # one token row per program
    o_q = tl.arange(0, BLOCK_Q)
    o_d = tl.arange(0, BLOCK_D)
    m_q = o_q < Q
    m_d = o_d < D
    m_qd = m_q[:, None] & m_d[None, :]
    o_qm = o_q.to(tl.int64) * M + i_m  # [BLOCK_Q] index into [Q, M]

    b_q = tl.load(q + o_q[:, None] * D + o_d[None, :], mask=m_qd, other=0.0).to(tl.float32)
    b_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_Q], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

    p_x = x + tl.cast(i_m, tl.int64) * D + o_d
    for i in range(S):
        b_v = tl.load(p_x, mask=m_d, other=0.0).to(tl.float32)  # read once, scored Q times
        b_r = tl.rsqrt(tl.sum(b_v * b_v, 0) / D + eps)
        b_z = tl.sum(b_q * b_v[None, :], 1) * b_r
        if STORE_Z:
            tl.store(z + o_qm * S + i, b_z, mask=m_q)
        b_new = tl.maximum(b_max, b_z)
        b_scale = tl.exp(b_max - b_new)
        b_p = tl.exp(b_z - b_new)
        b_sum = b_sum * b_scale + b_p
        b_acc = b_acc * b_scale[:, None] + b_p[:, None] * b_v[None, :]
        b_max = b_new
        p_x += stride_s

    b_lse = b_max + tl.log(b_sum)
    o_o = o_qm[:, None] * D + o_d[None, :]
    tl.store(o + o_o, (b_acc / b_sum[:, None]).to(o.dtype.element_ty), mask=m_qd)
    tl.store(lse + o_qm, b_lse, mask=m_q)


@triton.jit
def phase1_bwd_kernel(
    x,  # [S, M, D]
    q,  # [Q, D] fp32
    lse,  # [Q, M] fp32
    do,  # [Q, M, D] gradient of o_bar
    dlse,  # [Q, M] (HAS_DLSE)
    dzu,  # [Q, M, S] gradient of the logits (HAS_DZ)
    dx,  # [S, M, D]
    dq,  # [n_programs, Q, D] fp32 partial sums
    M,
    D,
    S,
    Q,
    stride_s,
    eps,
    HAS_DLSE: tl.constexpr,
    HAS_DZ: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_q = tl.arange(0, BLOCK_Q)
    o_d = tl.arange(0, BLOCK_D)
    m_q = o_q < Q
    m_d = o_d < D
    m_qd = m_q[:, None] & m_d[None, :]
    o_qd = o_q[:, None] * D + o_d[None, :]
    b_q = tl.load(q + o_qd, mask=m_qd, other=0.0).to(tl.float32)
    b_dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

    for i_m in range(i_p, M, n_p):
        o_qm = o_q.to(tl.int64) * M + i_m  # [BLOCK_Q] index into [Q, M]
        o_x = tl.cast(i_m, tl.int64) * D + o_d  # [BLOCK_D] row of source 0
        b_do = tl.load(do + o_qm[:, None] * D + o_d[None, :], mask=m_qd, other=0.0).to(tl.float32)
        b_lse = tl.load(lse + o_qm, mask=m_q, other=0.0)

        # pass 1: D_q = sum_j alpha_qj dalpha_qj
        b_D = tl.zeros([BLOCK_Q], dtype=tl.float32)
        p_x = x + o_x
        for i in range(S):
            b_v = tl.load(p_x, mask=m_d, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_v * b_v, 0) / D + eps)
            b_a = tl.exp(tl.sum(b_q * b_v[None, :], 1) * b_r - b_lse)
            b_da = tl.sum(b_do * b_v[None, :], 1)
            b_D += tl.where(m_q, b_a * b_da, 0.0)
            p_x += stride_s

        if HAS_DLSE:
            b_dl = tl.load(dlse + o_qm, mask=m_q, other=0.0).to(tl.float32)

        # pass 2: dv_i = sum_q [alpha_qi do_q + dz_qi (r_i q_q - r_i^3 (q_q.v_i) v_i / d)]
        p_x = x + o_x
        p_dx = dx + o_x
        for i in range(S):
            b_v = tl.load(p_x, mask=m_d, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_v * b_v, 0) / D + eps)
            b_dot = tl.sum(b_q * b_v[None, :], 1)
            b_a = tl.where(m_q, tl.exp(b_dot * b_r - b_lse), 0.0)
            b_da = tl.sum(b_do * b_v[None, :], 1)
            b_dz = b_a * (b_da - b_D)
            if HAS_DLSE:
                b_dz += b_a * b_dl
            if HAS_DZ:
                b_dz += tl.load(dzu + o_qm * S + i, mask=m_q, other=0.0).to(tl.float32)
            b_g = tl.where(m_q, b_dz * b_r, 0.0)  # [BLOCK_Q] dz_qi r_i
            b_c = tl.sum(b_g * b_dot, 0) * b_r * b_r / D  # scalar sum_q dz_qi r_i^3 (q_q.v_i) / d
            b_dv = tl.sum(b_a[:, None] * b_do + b_g[:, None] * b_q, 0) - b_c * b_v
            tl.store(p_dx, b_dv.to(dx.dtype.element_ty), mask=m_d)
            b_dq += b_g[:, None] * b_v[None, :]
            p_x += stride_s
            p_dx += stride_s

    tl.store(dq + tl.cast(i_p, tl.int64) * Q * D + o_qd, b_dq, mask=m_qd)


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


# --------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_supported(what: str, device: torch.device, d: int, *tensors: torch.Tensor | None) -> None:
    """Raise a ValueError for a dtype, width or device the kernels do not handle."""
    for t in tensors:
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{what}: the Triton backend takes float32, float16 or bfloat16 tensors; got {t.dtype} "
                "(use backend='torch' for float64, which computes in float64)"
            )
    if not 1 <= d <= MAX_D:
        raise ValueError(
            f"{what}: the Triton backend handles feature width 1 <= d <= {MAX_D}; got d = {d} "
            "(use backend='torch' for wider rows)"
        )
    if device.type != "cuda" and not (device.type == "cpu" and _interpret_mode()):
        raise ValueError(
            f"{what}: the Triton backend needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1; "
            f"got tensors on {device}"
        )


def _row_tiles(d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps) for kernels that tile [rows, d]."""
    block_d = triton.next_power_of_2(d)
    block_m = max(1, min(_MAX_BLOCK_M, _ROW_TILE // block_d))
    return block_m, block_d, _num_warps(block_m * block_d)


def _num_warps(elements: int) -> int:
    return min(16, max(4, elements // 512))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _persistent_programs(device: torch.device, n_blocks: int) -> int:
    """Programs of a persistent backward grid: a few per SM (a handful in the interpreter)."""
    if device.type == "cuda":
        cap = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        cap = 4
    return max(1, min(n_blocks, cap))


# depth attention ----------------------------------------------------------------------


def depth_attn_fwd(x: torch.Tensor, q: torch.Tensor, eps: float, return_weights: bool, return_logits: bool):
    """x [S, M, d] contiguous, q [d] fp32 -> (h [M, d], lse [M], weights [M, S] or None,
    logits [M, S] or None)."""
    n_src, n_rows, d = x.shape
    block_m, block_d, num_warps = _row_tiles(d)
    h = torch.empty((n_rows, d), device=x.device, dtype=x.dtype)
    lse = torch.empty((n_rows,), device=x.device, dtype=torch.float32)
    store_z = return_weights or return_logits  # the weights are exp(z - lse) of the stored logits
    z = torch.empty((n_rows, n_src), device=x.device, dtype=torch.float32) if store_z else lse
    w = torch.empty((n_rows, n_src), device=x.device, dtype=torch.float32) if return_weights else lse
    grid = (triton.cdiv(n_rows, block_m),)
    depth_attn_fwd_kernel[grid](
        x, q, h, lse, z, w, n_rows, d, n_src, n_rows * d, eps,
        STORE_Z=store_z, STORE_W=return_weights, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    return h, lse, (w if return_weights else None), (z if return_logits else None)


def depth_attn_bwd(x, q, lse, dh, dlse, dw, dz, eps: float):
    """Gradients (dx [S, M, d] in x's dtype, dq [d] fp32) of the depth-attention forward."""
    n_src, n_rows, d = x.shape
    block_m, block_d, num_warps = _row_tiles(d)
    dh = torch.zeros((n_rows, d), device=x.device, dtype=x.dtype) if dh is None else dh.contiguous()
    dx = torch.empty_like(x)
    n_prog = _persistent_programs(x.device, triton.cdiv(n_rows, block_m))
    dq = torch.empty((n_prog, d), device=x.device, dtype=torch.float32)
    depth_attn_bwd_kernel[(n_prog,)](
        x, q, lse, dh, *_or(lse, dlse, dw, dz), dx, dq, n_rows, d, n_src, n_rows * d, eps,
        HAS_DLSE=dlse is not None, HAS_DW=dw is not None, HAS_DZ=dz is not None,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    return dx, dq.sum(0)


def _or(placeholder: torch.Tensor, *grads: torch.Tensor | None) -> list[torch.Tensor]:
    """Optional upstream gradients for a kernel: contiguous, or a placeholder the kernel never reads."""
    return [placeholder if g is None else g.contiguous() for g in grads]


class DepthAttnFunction(torch.autograd.Function):
    """Autograd join of :func:`depth_attn_fwd` and :func:`depth_attn_bwd`; outputs h, lse,
    then the weights and the logits on request."""

    @staticmethod
    def forward(ctx, x, q, eps, return_weights, return_logits):
        h, lse, w, z = depth_attn_fwd(x, q, eps, return_weights, return_logits)
        ctx.save_for_backward(x, q, lse)
        ctx.eps, ctx.flags = eps, (return_weights, return_logits)
        ctx.set_materialize_grads(False)
        return (h, lse, *(t for t in (w, z) if t is not None))

    @staticmethod
    def backward(ctx, dh, dlse, *rest):
        return_weights, return_logits = ctx.flags
        dw = rest[0] if return_weights else None
        dz = rest[int(return_weights)] if return_logits else None
        x, q, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, from the reference
            def ref(x, q):
                return depth_attn_reference(x, q, None, ctx.eps, return_weights=True, validate=False, return_logits=True)

            dx, dq = graph_grads(ref, [x, q], [dh, dlse, dw, dz])
            return dx, dq, None, None, None
        dx, dq = depth_attn_bwd(x, q, lse, dh, dlse, dw, dz, ctx.eps)
        return dx, dq, None, None, None


def _folded_query(query: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    q = query.float()
    return (q * gain.float() if gain is not None else q).contiguous()


def depth_attn_triton(
    sources: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
    return_logits: bool = False,
):
    """Depth attention with the fused Triton kernels (forward and backward).

    Args:
        sources: [S, *batch, d] stacked sources, float32 / float16 / bfloat16, 1 <= d <= 8192.
        query: [d] pseudo-query.
        gain: [d] key-norm gain, or None for ones.
        eps: RMS epsilon.
        return_weights: also return the softmax weights the kernel used.
        return_logits: also return the logits the kernel computed.

    Returns:
        (mixture [*batch, d] in the sources' dtype, lse [*batch] float32), then the weights
        and the logits [*batch, S] float32, each on request.

    Raises:
        ValueError: float64 inputs (use ``backend="torch"``), d > 8192, or a device the
            kernels cannot run on; bad shapes as in ``validate_depth_attn_args``.
    """
    if not isinstance(sources, torch.Tensor):
        raise ValueError("depth_attn_triton takes one stacked sources tensor [S, *batch, d]")
    n_src, batch, d = validate_depth_attn_args(sources, query, gain, eps)
    _check_supported("depth_attn", sources.device, d, sources, query, gain)
    n_rows = sources[0].numel() // d
    if n_rows == 0:  # nothing to launch; the reference handles empty batches
        return depth_attn_reference(sources, query, gain, eps, return_weights, validate=False, return_logits=return_logits)
    x = sources.reshape(n_src, n_rows, d).contiguous()
    outs = DepthAttnFunction.apply(x, _folded_query(query, gain), float(eps), bool(return_weights), bool(return_logits))
    return (outs[0].view(*batch, d), outs[1].view(batch), *(t.view(*batch, n_src) for t in outs[2:]))


# phase 1 --------------------------------------------------------------------------------


def _phase1_tiles(n_q: int, d: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(d)
    block_q = triton.next_power_of_2(n_q)
    return block_q, block_d, _num_warps(block_q * block_d)


def phase1_max_queries(d: int) -> int:
    """How many queries one phase-1 launch holds at width d (more are split into launches)."""
    return max(1, _PHASE1_TILE // triton.next_power_of_2(d))


def phase1_fwd(x: torch.Tensor, q: torch.Tensor, eps: float, return_logits: bool):
    """x [S, M, d], q [Q, d] fp32 -> (o [Q, M, d], lse [Q, M], logits [Q, M, S] or None)."""
    n_src, n_rows, d = x.shape
    n_q = q.shape[0]
    block_q, block_d, num_warps = _phase1_tiles(n_q, d)
    o = torch.empty((n_q, n_rows, d), device=x.device, dtype=x.dtype)
    lse = torch.empty((n_q, n_rows), device=x.device, dtype=torch.float32)
    z = torch.empty((n_q, n_rows, n_src), device=x.device, dtype=torch.float32) if return_logits else lse
    phase1_fwd_kernel[(n_rows,)](
        x, q, o, lse, z, n_rows, d, n_src, n_q, n_rows * d, eps,
        STORE_Z=return_logits, BLOCK_Q=block_q, BLOCK_D=block_d, num_warps=num_warps,
    )
    return o, lse, (z if return_logits else None)


def phase1_bwd(x, q, lse, do, dlse, dz, eps: float):
    """Gradients (dx [S, M, d], dq [Q, d] fp32) of the phase-1 forward."""
    n_src, n_rows, d = x.shape
    n_q = q.shape[0]
    block_q, block_d, num_warps = _phase1_tiles(n_q, d)
    do = torch.zeros((n_q, n_rows, d), device=x.device, dtype=x.dtype) if do is None else do.contiguous()
    dx = torch.empty_like(x)
    n_prog = _persistent_programs(x.device, n_rows)
    dq = torch.empty((n_prog, n_q, d), device=x.device, dtype=torch.float32)
    phase1_bwd_kernel[(n_prog,)](
        x, q, lse, do, *_or(lse, dlse, dz), dx, dq, n_rows, d, n_src, n_q, n_rows * d, eps,
        HAS_DLSE=dlse is not None, HAS_DZ=dz is not None,
        BLOCK_Q=block_q, BLOCK_D=block_d, num_warps=num_warps,
    )
    return dx, dq.sum(0)


class Phase1Function(torch.autograd.Function):
    """Autograd join of :func:`phase1_fwd` and :func:`phase1_bwd`."""

    @staticmethod
    def forward(ctx, x, q, eps, return_logits):
        o, lse, z = phase1_fwd(x, q, eps, return_logits)
        ctx.save_for_backward(x, q, lse)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        return (o, lse, z) if return_logits else (o, lse)

    @staticmethod
    def backward(ctx, do, dlse, dz=None):
        x, q, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, from the reference
            dx, dq = graph_grads(lambda x, q: phase1_reference(x, q, ctx.eps, return_logits=True), [x, q], [do, dlse, dz])
            return dx, dq, None, None
        dx, dq = phase1_bwd(x, q, lse, do, dlse, dz, ctx.eps)
        return dx, dq, None, None


def phase1_triton(
    sources: torch.Tensor,
    queries: torch.Tensor,
    eps: float = 1e-6,
    return_logits: bool = False,
):
    """Phase 1 with the fused Triton kernels: Q queries against S completed blocks at once.

    Args:
        sources: [S, *batch, d] completed block summaries (float32 / float16 / bfloat16).
        queries: [Q, d] gain-folded queries.
        eps: RMS epsilon.
        return_logits: also return the logits [Q, *batch, S].

    Returns:
        (o_bar [Q, *batch, d] in the sources' dtype, lse [Q, *batch] float32) and, on request,
        logits [Q, *batch, S] float32.

    Raises:
        ValueError: as :func:`depth_attn_triton`, or queries not [Q, d].
    """
    if not isinstance(sources, torch.Tensor):
        raise ValueError("phase1_triton takes one stacked sources tensor [S, *batch, d]")
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2 or queries.shape[-1] != sources.shape[-1]:
        raise ValueError(
            f"queries must be [Q, {sources.shape[-1]}]; got {tuple(getattr(queries, 'shape', ()))}"
        )
    n_q = queries.shape[0]
    if n_q == 0 or sources[0].numel() == 0:  # nothing to launch
        return phase1_reference(sources, queries, eps, return_logits)
    n_src, batch, d = validate_depth_attn_args(sources, queries[0], None, eps)
    _check_supported("phase1", sources.device, d, sources, queries)
    n_rows = sources[0].numel() // d
    x = sources.reshape(n_src, n_rows, d).contiguous()
    q = queries.float().contiguous()
    chunk = phase1_max_queries(d)
    parts = [
        Phase1Function.apply(x, q[j : j + chunk], float(eps), bool(return_logits))
        for j in range(0, n_q, chunk)
    ]
    outs = parts[0] if len(parts) == 1 else tuple(torch.cat(t, 0) for t in zip(*parts))
    o = outs[0].view(n_q, *batch, d)
    lse = outs[1].view(n_q, *batch)
    if return_logits:
        return o, lse, outs[2].view(n_q, *batch, n_src)
    return o, lse


# phase 2 --------------------------------------------------------------------------------


def phase2_fwd(ob, lse, p, q, eps: float):
    """ob, p [M, d], lse [M], q [d] fp32 -> (h [M, d], lse_total [M], z_p [M])."""
    n_rows, d = p.shape
    block_m, block_d, num_warps = _row_tiles(d)
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
    block_m, block_d, num_warps = _row_tiles(d)
    dh = torch.zeros_like(p) if dh is None else dh.contiguous()
    dob = torch.empty_like(ob)
    dlse = torch.empty_like(lse)
    dp = torch.empty_like(p)
    n_prog = _persistent_programs(p.device, triton.cdiv(n_rows, block_m))
    dq = torch.empty((n_prog, d), device=p.device, dtype=torch.float32)
    phase2_bwd_kernel[(n_prog,)](
        ob, lse, p, q, dh, *_or(lse, dlt, dzp), dob, dlse, dp, dq, n_rows, d, eps,
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
                return phase2_reference(ob, lse, p, q, None, ctx.eps)

            dob, dlse, dp, dq = graph_grads(ref, [ob, lse, p, q], [dh, dlt, dzp])
            return dob, dlse, dp, dq, None
        dob, dlse, dp, dq = phase2_bwd(ob, lse, p, q, dh, dlt, dzp, ctx.eps)
        return dob, dlse, dp, dq, None


def phase2_triton(
    o_bar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    eps: float = 1e-6,
):
    """Phase 2 with the fused Triton kernels: merge a read's phase-1 result with the partial.

    ``h = (1 - s) o_bar + s partial``, ``s = sigmoid(z_p - lse)``, ``1 - s = sigmoid(lse - z_p)``,
    ``lse_total = logaddexp(lse, z_p)``, ``z_p = (query*gain) . partial / rms(partial)``.

    Args:
        o_bar: [*batch, d] phase-1 mixture.
        lse: [*batch] phase-1 log-sum-exp.
        partial: [*batch, d] partial sum of the current block (float32 / float16 / bfloat16).
        query, gain: [d] pseudo-query and key gain (None for ones).
        eps: RMS epsilon.

    Returns:
        (h [*batch, d] in the partial's dtype, lse_total [*batch] float32, z_p [*batch]
        float32, the partial's logit).

    Raises:
        ValueError: as :func:`depth_attn_triton`, or mismatched shapes.
    """
    _, batch, d = validate_depth_attn_args([partial], query, gain, eps)
    if not isinstance(o_bar, torch.Tensor) or o_bar.shape != partial.shape:
        raise ValueError(f"o_bar must match partial's shape {tuple(partial.shape)}; got {tuple(getattr(o_bar, 'shape', ()))}")
    if not isinstance(lse, torch.Tensor) or lse.shape != partial.shape[:-1]:
        raise ValueError(f"lse must have shape {tuple(partial.shape[:-1])}; got {tuple(getattr(lse, 'shape', ()))}")
    _check_supported("phase2", partial.device, d, partial, o_bar, lse, query, gain)
    n_rows = partial.numel() // d
    if n_rows == 0:
        return phase2_reference(o_bar, lse, partial, query, gain, eps)
    h, lse_t, zp = Phase2Function.apply(
        o_bar.reshape(n_rows, d).contiguous(),
        lse.reshape(n_rows).contiguous(),
        partial.reshape(n_rows, d).contiguous(),
        _folded_query(query, gain),
        float(eps),
    )
    return h.view(*batch, d), lse_t.view(batch), zp.view(batch)
