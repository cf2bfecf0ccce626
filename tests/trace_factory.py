"""Synthetic DepthTraces with hand-checkable numbers, built directly with ``DepthTrace(...)``.

Every builder gives the same routing to every real token unless ``per_token`` overrides a
position, and fills padding positions with garbage (9.0) so a test sees if padding leaks in.
"""

from __future__ import annotations

import numpy as np

from attnres_probe.trace import DepthTrace

nan = np.nan

# Full, n_layers=1: reads L0.attn, L0.mlp, final; sources embed, L0.attn, L0.mlp.
FULL_W = [
    [1.0, nan, nan],
    [0.25, 0.75, nan],
    [0.2, 0.3, 0.5],
]
# Block, n_layers=2, block_size=2: reads L0.attn, L0.mlp, L1.attn, L1.mlp, final;
# sources embed, block1, block2 (L0.mlp sees block1's partial, L1.mlp block2's partial).
BLOCK_W = [
    [1.0, nan, nan],
    [0.5, 0.5, nan],
    [0.4, 0.6, nan],
    [0.1, 0.2, 0.7],
    [0.3, 0.3, 0.4],
]
# PreNorm, n_layers=1: contribution shares (may be negative), unit coefficients.
PRENORM_C = [
    [1.0, nan, nan],
    [0.6, 0.4, nan],
    [0.5, -0.1, 0.6],
]


def _labels(n_layers: int) -> list[str]:
    return [f"L{i}.{k}" for i in range(n_layers) for k in ("attn", "mlp")]


def make_trace(
    residual: str = "full",
    cube: list[list[float]] | None = None,
    *,
    n_layers: int | None = None,
    block_starts: list[int] | None = None,
    n_pos: int = 3,
    n_real: int | None = None,
    batch: int = 1,
    per_token: dict[int, list[list[float]]] | None = None,
    rms_in: list[float] | None = None,
    rms_out: list[float] | None = None,
    grad_in: list[float] | None = None,
    grad_out: list[float] | None = None,
    param_grad: list[float] | None = None,
    str_tokens: list[str] | None = None,
    name: str | None = None,
    flags: list[str] | None = None,
    loss: float = 2.0,
) -> DepthTrace:
    """A trace whose real tokens all carry ``cube`` (R x S); padding positions hold 9.0.

    ``cube`` is the depth weights for AttnRes (contrib = weights, logits = log weights) and the
    contribution shares for PreNorm (weights = 1 where available, logits NaN).
    """
    if cube is None:
        cube = {"full": FULL_W, "block": BLOCK_W, "prenorm": PRENORM_C}[residual]
    base = np.asarray(cube, dtype=np.float64)
    R, S = base.shape
    L = R - 1
    n_layers = n_layers or L // 2
    subs = _labels(n_layers)
    assert len(subs) == L
    if residual == "block":
        block_starts = block_starts if block_starts is not None else [0, 2]
        sources = ["embed", *(f"block{n}" for n in range(1, len(block_starts) + 1))]
    else:
        block_starts = []
        sources = ["embed", *subs]
    assert len(sources) == S
    n_real = n_pos if n_real is None else n_real
    P = n_pos
    mask = np.zeros((batch, P), bool)
    mask[:, :n_real] = True

    main = np.full((batch, P, R, S), 9.0)
    main[:, :n_real] = base
    for pos, c in (per_token or {}).items():
        main[:, pos] = np.asarray(c, dtype=np.float64)
    avail = ~np.isnan(main)
    if residual == "prenorm":
        weights = np.where(avail, 1.0, nan)
        logits = np.full_like(main, nan)
        contrib = main
    else:
        weights = main
        with np.errstate(divide="ignore"):
            logits = np.log(main)
        contrib = main * 1.0

    def per_read(values, default):
        v = np.asarray(values if values is not None else default, dtype=np.float64)
        return np.broadcast_to(v, (batch, P, len(v))).copy()

    rin = per_read(rms_in, [1.0] * R)
    rout = per_read(rms_out, [1.0] * (L + 1))
    gin = per_read(grad_in, [nan] * R)
    gout = per_read(grad_out, [nan] * (L + 1))
    toks = str_tokens or [chr(ord("a") + i) for i in range(n_real)]
    meta = {
        "name": name or residual,
        "residual": residual,
        "read_labels": [*subs, "final"],
        "source_labels": sources,
        "block_starts": block_starts,
        "str_tokens": [list(toks) for _ in range(batch)],
        "config": {"n_layers": n_layers, "residual": residual},
    }
    if flags is not None:
        meta["flags"] = flags
    loss_arr = np.where(mask, loss, nan)
    return DepthTrace(
        tokens=np.tile(np.arange(P), (batch, 1)),
        mask=mask,
        loss=loss_arr,
        depth_weights=weights,
        logits=logits,
        contrib=contrib,
        rms_in=rin,
        grad_in=gin,
        rms_out=rout,
        grad_out=gout,
        param_grad=np.asarray(param_grad if param_grad is not None else [nan] * L, dtype=np.float64),
        mixer_grad=np.full(R, nan),
        meta=meta,
    )
