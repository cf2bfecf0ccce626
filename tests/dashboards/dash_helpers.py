"""Builders shared by the dashboard tests (tiny models: d_model 32, 2 layers, n_ctx 64)."""

from __future__ import annotations

import torch

from attnres_probe import AttnResTransformer, ModelConfig

TEXT = "The cat sat on the mat."
N_CTX = 64
NAMES = ("prenorm", "full", "block")


def make_model(residual: str, n_layers: int = 2, seed: int = 1) -> AttnResTransformer:
    """A tiny model with randomised depth queries and key gains, so routing is not uniform.

    The plain-PyTorch backend: the suite's conftest sets TRITON_INTERPRET=1 on CPU machines, and
    the Triton interpreter would make every recording slow; the kernels have their own tests.
    """
    kw = {"block_size": 2} if residual == "block" else {}
    cfg = ModelConfig(d_model=32, n_layers=n_layers, n_heads=2, n_ctx=N_CTX, residual=residual, seed=seed, **kw)
    model = AttnResTransformer(cfg, backend="torch")
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for m in model.mixers:
            m.query.copy_(torch.randn(m.query.shape, generator=g) * 0.8)
            m.norm.weight.copy_(1 + 0.3 * torch.randn(m.query.shape, generator=g))
    return model.eval()
