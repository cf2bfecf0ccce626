"""Plain-PyTorch stand-ins for the pieces of flash-linear-attention that need CUDA (tests only).

fla 0.6 runs its models through flash-attn and Triton kernels. On a CPU test machine each is
replaced, inside :func:`fla_on_cpu`, by an exact PyTorch equivalent with the same signature:

- ``flash_attn_func`` (``fla.layers.attn``): causal SDPA over [batch, pos, heads, d_head]
  tensors, grouped KV heads included;
- ``fused_attnres`` (every fla model module that imported it): fla's own ``naive_attnres``;
- the rotary kernel (``fla.modules.rotary.ops.rotary_embedding``): fla's ``rotary_embedding_ref``
  on the positions of the input;
- the fused RMSNorm (``fla.modules.norm.layernorm.rms_norm``; the q/k norm, and the pre-norms
  with ``fuse_norm``): ``F.rms_norm`` in float32, with fla's residual/prenorm arguments;
- SwiGLU (``fla.modules.mlp.swiglu`` and ``swiglu_linear``): ``silu(gate) * up`` (then the
  down projection).
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F

fla = pytest.importorskip("fla")


def _flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), **kwargs):
    assert tuple(window_size) == (-1, -1), "the stand-in has no sliding window"
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=k.shape[2] != q.shape[2]
    )
    return out.transpose(1, 2)


def _rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, **kwargs):
    from fla.modules.rotary.ops import rotary_embedding_ref

    assert cu_seqlens is None and isinstance(seqlen_offsets, int)
    P = x.shape[1]
    return rotary_embedding_ref(x, cos[seqlen_offsets : seqlen_offsets + P], sin[seqlen_offsets : seqlen_offsets + P], interleaved)


def _rms_norm(x, weight, bias=None, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, **kwargs):
    if residual is not None:
        x = x + residual
    out = F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps)
    if bias is not None:
        out = out + bias.float()
    out = out.to(x.dtype)
    return (out, x) if prenorm else out


def _swiglu(gate, up):
    return F.silu(gate) * up


def _swiglu_linear(gate, up, weight, bias):
    return F.linear(_swiglu(gate, up), weight, bias)


@contextlib.contextmanager
def fla_on_cpu():
    """Patch fla's CUDA-only pieces with the stand-ins above; restore them on exit."""
    import fla.layers.attn as attn
    import fla.modules.mlp as mlp
    import fla.modules.norm.layernorm as layernorm
    import fla.modules.rotary.ops as rotary
    from fla.ops.attnres import naive_attnres

    patches = [(attn, "flash_attn_func", _flash_attn_func), (rotary, "rotary_embedding", _rotary),
               (layernorm, "rms_norm", _rms_norm), (mlp, "swiglu", _swiglu), (mlp, "swiglu_linear", _swiglu_linear)]
    patches += [(m, "fused_attnres", naive_attnres) for name, m in list(sys.modules.items())
                if name.startswith("fla.models") and hasattr(m, "fused_attnres")]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    try:
        for m, n, f in patches:
            setattr(m, n, f)
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


def fla_transformer(block_size, *, d=64, layers=3, heads=4, kv_heads=None, qk_norm=False, tied=False, qkv_bias=False,
                    vocab=96, seed=0, rope_theta=10000.0, fuse_norm=True, fuse_swiglu=True):
    """A small fla TransformerForCausalLM (float32, eval) with random non-zero queries and gains."""
    import fla.models.transformer.modeling_transformer  # noqa: F401 - registers the model's module
    from fla.models import TransformerConfig, TransformerForCausalLM

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        hidden_size=d, num_hidden_layers=layers, num_heads=heads, num_kv_heads=kv_heads, qk_norm=qk_norm,
        qkv_bias=qkv_bias, max_position_embeddings=64, vocab_size=vocab, tie_word_embeddings=tied,
        attnres_block_size=block_size, rope_theta=rope_theta, fuse_norm=fuse_norm, fuse_swiglu=fuse_swiglu,
        fuse_cross_entropy=False, hidden_ratio=2,
    )
    with fla_on_cpu():
        model = TransformerForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)  # non-zero queries: non-uniform routing
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))  # non-unit gains
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model
