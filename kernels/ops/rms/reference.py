"""RMS in plain PyTorch (this op has no fused version): a source's inverse RMS, as the depth
ops normalise their keys, and the models' RMSNorm."""

from __future__ import annotations

import torch

__all__ = ["inv_rms", "rms_norm"]


def inv_rms(v: torch.Tensor, eps: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """1 / sqrt(mean(v^2, -1) + eps) in ``dtype``: [*batch, d] -> [*batch]."""
    v = v.to(dtype)
    return torch.rsqrt(v.pow(2).mean(-1) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The models' RMSNorm: ``x / sqrt(mean(x^2, -1) + eps) * weight``, computed in float32
    (float64 stays float64) and returned in x's dtype."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight).to(x.dtype)
