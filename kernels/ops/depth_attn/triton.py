"""Fused Triton kernels for depth attention (the ``"triton"`` backend of ``depth_attn``).

The math is the reference's (``reference.py`` beside this file; docs/design.md, "The math").
With the gain folded into the query, ``q = query * gain``, every source ``v_i`` of a token row gives

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

Limits (float32/float16/bfloat16, ``1 <= d <= MAX_D``, CUDA tensors or the interpreter): see
``triton_utils``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...triton_utils import check_supported, fp32_query, grads_or, persistent_programs, row_tiles
from ...utils import Sources, check_width, graph_grads, validate_depth_attn_args
from . import reference

__all__ = ["DepthAttnFunction", "depth_attn"]


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


def depth_attn_fwd(x: torch.Tensor, q: torch.Tensor, eps: float, return_weights: bool, return_logits: bool):
    """x [S, M, d] contiguous, q [d] fp32 -> (h [M, d], lse [M], weights [M, S] or None,
    logits [M, S] or None)."""
    n_src, n_rows, d = x.shape
    block_m, block_d, num_warps = row_tiles(d)
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
    block_m, block_d, num_warps = row_tiles(d)
    dh = torch.zeros((n_rows, d), device=x.device, dtype=x.dtype) if dh is None else dh.contiguous()
    dx = torch.empty_like(x)
    n_prog = persistent_programs(x.device, triton.cdiv(n_rows, block_m))
    dq = torch.empty((n_prog, d), device=x.device, dtype=torch.float32)
    depth_attn_bwd_kernel[(n_prog,)](
        x, q, lse, dh, *grads_or(lse, dlse, dw, dz), dx, dq, n_rows, d, n_src, n_rows * d, eps,
        HAS_DLSE=dlse is not None, HAS_DW=dw is not None, HAS_DZ=dz is not None,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
    )
    return dx, dq.sum(0)


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
                return reference.depth_attn(x, q, None, ctx.eps, return_weights=True, return_logits=True)

            dx, dq = graph_grads(ref, [x, q], [dh, dlse, dw, dz])
            return dx, dq, None, None, None
        dx, dq = depth_attn_bwd(x, q, lse, dh, dlse, dw, dz, ctx.eps)
        return dx, dq, None, None, None


def _fused(
    sources: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None,
    eps: float,
    return_weights: bool,
    return_logits: bool,
):
    """The kernels on stacked sources [S, *batch, d]: (mixture [*batch, d] in the sources'
    dtype, lse [*batch] float32), then the weights and the logits [*batch, S] float32, each on
    request."""
    n_src, batch, d = validate_depth_attn_args(sources, query, gain, eps)
    check_supported("depth_attn", sources.device, d, sources, query, gain)
    n_rows = sources[0].numel() // d
    if n_rows == 0:  # nothing to launch; the reference handles empty batches
        return reference.depth_attn(sources, query, gain, eps, return_weights, return_logits=return_logits)
    x = sources.reshape(n_src, n_rows, d).contiguous()
    outs = DepthAttnFunction.apply(x, fp32_query(query, gain), float(eps), bool(return_weights), bool(return_logits))
    return (outs[0].view(*batch, d), outs[1].view(batch), *(t.view(*batch, n_src) for t in outs[2:]))


def depth_attn(
    sources: Sources,
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
    """Depth attention with the fused Triton kernels (forward and backward): see
    :func:`attnres_probe.kernels.depth_attn`.

    A sequence of sources is stacked into one buffer first. The arguments are checked again
    here, with the kernels' limits (``triton_utils``); ``inv_rms_cache`` is ignored (the
    kernels normalise inside their loop at no extra memory traffic). The contribution shares
    are computed after the kernel and the padding added by :func:`.reference.finish`.

    Raises:
        ValueError: float64 inputs (use ``backend="torch"``), d > ``MAX_D``, or a device the
            kernels cannot run on; bad shapes as in ``validate_depth_attn_args``.
    """
    if width is not None:
        check_width(width, len(sources))
    want_w = return_weights or return_contrib
    stacked = sources if isinstance(sources, torch.Tensor) else torch.stack(list(sources))
    outs = _fused(stacked, query, gain, eps, want_w, return_logits)
    return reference.finish(outs, sources, return_weights, return_logits, return_contrib, width)
