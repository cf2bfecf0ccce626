"""DenseFormer (arXiv 2402.02622): depth-weighted averaging (DWA) of block outputs.

A DenseFormer is a PreNorm transformer whose residual stream, after some blocks, is replaced by
a learned weighted average of the embedding and the earlier blocks' outputs. With block i
(0-based) taking ``z_i`` and returning ``x_{i+1} = z_i + a_i + m_i`` (its PreNorm attention and
MLP outputs added to its input), and ``x_0 = z_0`` the embedding::

    z_{i+1} = sum_{j in J(i)} alpha_{i,j} x_j     if (i + 1) % period == 0   (a DWA after block i)
    z_{i+1} = x_{i+1}                              otherwise

    J(i) = {j <= i + 1 : j = i + 1 (mod dilation)}     (increasing j; i + 1 itself always in it)

The final read (the input of the final norm and unembedding) is ``z_n`` for n blocks. Every
block output is kept, whether or not a DWA follows its block. At init ``alpha_{i,i+1} = 1`` and
every other weight is 0, so a fresh DenseFormer is its PreNorm baseline. These are the
conventions of the authors' ``denseformer`` package (``DWAModules``: the weights of the DWA after
block i have ``(i + 1 + dilation) // dilation`` entries over the kept outputs of residue
``(i + 1) % dilation``, the last one the newest; a DWA runs when ``(i + 1) % period == 0``). The
authors' experiments code (``experiments/models/denseformer.py``) keeps only every
``period``-th block output and dilates over those: its (dilation k, period p) is the package's
and this module's (dilation k * p, period p); see docs/depth_rules.md.

Effective depth weights (:func:`denseformer_read_coefficients`): on the common source axis of
sublayer outputs ``[embed, L0.attn, L0.mlp, ...]`` every read is a fixed linear combination: the
attention read of block i is ``z_i``, its MLP read ``z_i + a_i`` and the final read ``z_n``,
expanded through the DWA weights and the PreNorm sums. The weights are learned constants, the
same for every token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = ["DepthWeightedAverage", "denseformer_read_coefficients", "dwa_after", "dwa_sources"]


def dwa_after(block_index: int, period: int = 1) -> bool:
    """Whether a DWA follows block ``block_index`` (0-based)."""
    return (block_index + 1) % period == 0


def dwa_sources(block_index: int, dilation: int = 1) -> list[int]:
    """J(i): the block outputs (0 = embedding, j = output of block j-1) the DWA after block i
    averages, increasing; the last is i + 1."""
    i1 = block_index + 1
    return list(range(i1 % dilation, i1 + 1, dilation))


def _check(n_blocks: int, dilation: int, period: int) -> None:
    for name, v in (("n_blocks", n_blocks), ("dilation", dilation), ("period", period)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer; got {v!r}")


class DepthWeightedAverage(nn.Module):
    """The DWA modules of an n-block DenseFormer (``alphas[str(i)]``: the weights after block i,
    over :func:`dwa_sources`, identity at init)."""

    def __init__(self, n_blocks: int, dilation: int = 1, period: int = 1):
        super().__init__()
        _check(n_blocks, dilation, period)
        self.n_blocks, self.dilation, self.period = n_blocks, dilation, period
        alphas = {}
        for i in range(n_blocks):
            if dwa_after(i, period):
                w = torch.zeros(len(dwa_sources(i, dilation)))
                w[-1] = 1.0
                alphas[str(i)] = nn.Parameter(w)
        self.alphas = nn.ParameterDict(alphas)

    def extra_repr(self) -> str:
        return f"n_blocks={self.n_blocks}, dilation={self.dilation}, period={self.period}"

    def forward(self, outputs: Sequence[torch.Tensor], block_index: int) -> torch.Tensor:
        """``z_{i+1}`` from the block outputs ``outputs = [x_0, ..., x_{i+1}]`` (i = block_index)."""
        i = block_index
        if len(outputs) != i + 2:
            raise ValueError(f"block {i} needs the outputs x_0..x_{i + 1} ({i + 2}); got {len(outputs)}")
        if not dwa_after(i, self.period):
            return outputs[i + 1]
        w = self.alphas[str(i)]
        srcs = torch.stack([outputs[j] for j in dwa_sources(i, self.dilation)])
        dtype = torch.promote_types(srcs.dtype, w.dtype)
        return torch.tensordot(w.to(dtype), srcs.to(dtype), dims=1).to(outputs[-1].dtype)

    def read_coefficients(self, batch_shape: Sequence[int] = ()) -> torch.Tensor:
        """Every read's coefficients [*batch_shape, 2n+1, 2n+1] (see
        :func:`denseformer_read_coefficients`)."""
        alphas = {int(k): v for k, v in self.alphas.items()}
        c = denseformer_read_coefficients(alphas, self.n_blocks, self.dilation, self.period)
        return c.expand(*batch_shape, *c.shape)


def denseformer_read_coefficients(
    alphas: Mapping[int, torch.Tensor],
    n_blocks: int,
    dilation: int = 1,
    period: int = 1,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The coefficients of every read over the sublayer sources, [2n+1 reads, 2n+1 sources].

    Reads ``[L0.attn, L0.mlp, ..., final]``, sources ``[embed, L0.attn, L0.mlp, ...]``: source
    0 is the embedding, 2i+1 block i's attention output, 2i+2 its MLP output. With ``B_j`` the
    coefficients of block output ``x_j`` and ``c_i`` those of the block input ``z_i``::

        c_0 = B_0 = e_0
        attention read of block i: c_i;   MLP read: c_i + e_{2i+1}
        B_{i+1} = c_i + e_{2i+1} + e_{2i+2}
        c_{i+1} = sum_{j in J(i)} alpha_{i,j} B_j   (DWA after block i)   or B_{i+1}
        final read: c_n

    Args:
        alphas: block index -> its DWA weights over :func:`dwa_sources` (every block a DWA follows).
        dtype: of the result (default: the weights' promoted type and float32).

    Columns a read cannot see (j > read) are 0.
    """
    _check(n_blocks, dilation, period)
    want = [i for i in range(n_blocks) if dwa_after(i, period)]
    if sorted(alphas) != want:
        raise ValueError(f"DWA weights are needed after blocks {want}; got {sorted(alphas)}")
    if dtype is None:
        dtype = torch.float32
        for w in alphas.values():
            dtype = torch.promote_types(dtype, w.dtype)
    device = next(iter(alphas.values())).device if alphas else None
    S = 2 * n_blocks + 1
    eye = torch.eye(S, dtype=dtype, device=device)
    B = [eye[0]]  # block outputs' coefficients
    c = eye[0]  # the current block input's
    reads = []
    for i in range(n_blocks):
        reads.append(c)
        reads.append(c + eye[2 * i + 1])
        B.append(c + eye[2 * i + 1] + eye[2 * i + 2])
        if dwa_after(i, period):
            w = alphas[i].to(dtype)
            js = dwa_sources(i, dilation)
            if w.shape != (len(js),):
                raise ValueError(f"the DWA after block {i} averages {len(js)} outputs; its weights are {tuple(w.shape)}")
            c = torch.einsum("m,mj->j", w, torch.stack([B[j] for j in js]))
        else:
            c = B[-1]
    reads.append(c)
    return torch.stack(reads)
