"""Builders shared by the dashboard tests (tiny models: d_model 32, 2 layers, n_ctx 64 unless asked)."""

from __future__ import annotations

import torch

from attnres_probe import AttnResTransformer

from helpers import tiny_config

TEXT = "The cat sat on the mat."
N_CTX = 64
NAMES = ("prenorm", "full", "block")
CORPUS = [
    "The cat sat on the mat. The dog sat on the log. ",
    "Depth routing, token by token, window by window.",
    "A third document: short.",
    "def f(x):\n    return x + 1\n",
]


def make_model(residual: str, n_layers: int = 2, seed: int = 1, n_ctx: int = N_CTX, scale: float = 0.8) -> AttnResTransformer:
    """A tiny model (:func:`helpers.tiny_config`) with randomised depth queries and key gains, so routing is not uniform.

    The plain-PyTorch backend: the suite's conftest sets TRITON_INTERPRET=1 on CPU machines, and
    the Triton interpreter would make every recording slow; the kernels have their own tests.
    ``scale`` is the queries' standard deviation (larger: sharper routing).
    """
    model = AttnResTransformer(tiny_config(residual, n_layers=n_layers, n_ctx=n_ctx, seed=seed), backend="torch")
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for m in model.mixers:
            m.query.copy_(torch.randn(m.query.shape, generator=g) * scale)
            m.norm.weight.copy_(1 + 0.3 * torch.randn(m.query.shape, generator=g))
    return model.eval()
