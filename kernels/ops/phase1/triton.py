"""Fused Triton kernels for phase 1 of the two-phase Block schedule (the ``"triton"`` backend of
``phase1``).

Phase 1 (``phase1_fwd_kernel`` / ``phase1_bwd_kernel``) is the depth-attention computation for
Q queries at once: a program owns one token row and a [BLOCK_Q, BLOCK_D] tile of queries, reads
each source row once and scores it against every query. The math is the reference's
(``reference.py`` beside this file).

Limits: see ``triton_utils``; one launch holds BLOCK_Q queries with
``BLOCK_Q * BLOCK_D <= 16384``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...triton_utils import check_supported, grads_or, persistent_programs, warps_for
from ...utils import Sources, graph_grads, validate_depth_attn_args
from . import reference

__all__ = ["Phase1Function", "phase1", "phase1_max_queries"]

_PHASE1_TILE = 16384  # BLOCK_Q * BLOCK_D elements per program (phase 1)


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


def _phase1_tiles(n_q: int, d: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(d)
    block_q = triton.next_power_of_2(n_q)
    return block_q, block_d, warps_for(block_q * block_d)


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
    n_prog = persistent_programs(x.device, n_rows)
    dq = torch.empty((n_prog, n_q, d), device=x.device, dtype=torch.float32)
    phase1_bwd_kernel[(n_prog,)](
        x, q, lse, do, *grads_or(lse, dlse, dz), dx, dq, n_rows, d, n_src, n_q, n_rows * d, eps,
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
            dx, dq = graph_grads(lambda x, q: reference.phase1(x, q, ctx.eps, return_logits=True), [x, q], [do, dlse, dz])
            return dx, dq, None, None
        dx, dq = phase1_bwd(x, q, lse, do, dlse, dz, ctx.eps)
        return dx, dq, None, None


def phase1(
    sources: Sources,
    queries: torch.Tensor,
    eps: float = 1e-6,
    return_logits: bool = False,
):
    """Phase 1 with the fused Triton kernels, Q queries against S completed blocks at once: see
    :func:`attnres_probe.kernels.phase1`.

    A sequence of sources is stacked into one buffer first; more queries than one launch holds
    (:func:`phase1_max_queries`) are split into several launches.

    Raises:
        ValueError: as the depth-attention kernels (``triton_utils``), or queries not [Q, d].
    """
    if not isinstance(sources, torch.Tensor):
        sources = torch.stack(list(sources))
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2 or queries.shape[-1] != sources.shape[-1]:
        raise ValueError(
            f"queries must be [Q, {sources.shape[-1]}]; got {tuple(getattr(queries, 'shape', ()))}"
        )
    n_q = queries.shape[0]
    if n_q == 0 or sources[0].numel() == 0:  # nothing to launch
        return reference.phase1(sources, queries, eps, return_logits)
    n_src, batch, d = validate_depth_attn_args(sources, queries[0], None, eps)
    check_supported("phase1", sources.device, d, sources, queries)
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
