"""Masking depth sources as attnres4babylm does (``analysis/masking/modeling_nanogpt.py`` and
``analysis/mask.py`` of YpLarryWang/attnres4babylm2026 at 785492a), on any AttnRes model here.

For each read before a sublayer (never the final read), with the read's k visible columns on the
common axis (the embedding first, the partial or just-completed block last), the *completed* blocks are
columns 1..k-2 (the embedding and the last column are never eligible). Block age: at the attention read of
a layer that opens a block, the last column is the block just completed (age 1), so every completed
block is of age >= 2; at every other read the newest completed block (column k-2) is of age 1 and kept.

- ``"nonrecent"`` drops every completed block of age >= 2;
- ``"random"`` drops as many completed blocks, drawn per read (the age-1 block may be drawn) with
  upstream's generator: ``random.Random(int.from_bytes(sha256(f"{seed}:{layer}:{site}:{block_start}")[:8], "big"))
  .sample(completed, count)``, ``site`` "q1" (attention) or "q2" (MLP), ``block_start`` 1 when the layer's
  attention sublayer opens a block (upstream's ``(2 * layer) % block_size == 0``); the same draw for every
  token and input (the paper used seeds 20260718-20260722);
- ``"embed"`` drops the embedding (column 0) wherever another source is visible.

A dropped column's logit becomes -inf before the softmax, so the kept weights renormalise (upstream's
rule). Full AttnRes is treated as Block with one sublayer per block. :func:`masking_hooks` gives the
``(hook name, function)`` pairs for ``model.run_with_hooks`` / ``model.hooks``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MASKS", "masking_hooks", "masking_plan"]

MASKS = ("nonrecent", "random", "embed")
DEFAULT_SEED = 20260718


def _draw(seed: int, layer: int, site: str, block_start: bool, completed: list[int], count: int) -> list[int]:
    key = hashlib.sha256(f"{seed}:{layer}:{site}:{int(block_start)}".encode()).digest()[:8]
    return sorted(random.Random(int.from_bytes(key, "big")).sample(completed, count))


def masking_plan(axis: Any, which: str, seed: int = DEFAULT_SEED) -> list[list[int]]:
    """Per read of ``axis`` (a :class:`~attnres_probe.axis.SourceAxis`; the final read included, never
    masked), the columns it keeps, in order.

    Raises:
        ValueError: an unknown ``which`` (the accepted names listed), or a rule without depth routing.
    """
    if which not in MASKS:
        raise ValueError(f"which is {which!r}; accepted: {', '.join(MASKS)}")
    if axis.residual not in ("full", "block"):
        raise ValueError(f"masking sources needs softmax depth routing (Full or Block AttnRes); this model's rule is {axis.residual!r}")
    starts = set(axis.block_starts) if axis.residual == "block" else set(range(axis.n_sublayers))
    plan = []
    for r, k in enumerate(axis.counts):
        keep = list(range(k))
        if r < axis.n_sublayers:
            layer, site = r // 2, ("q1" if r % 2 == 0 else "q2")
            block_start = 2 * layer in starts
            completed = list(range(1, k - 1))
            old = completed if (site == "q1" and block_start) else completed[:-1]
            if which == "embed":
                drop = [0] if k > 1 else []
            elif which == "nonrecent":
                drop = old
            else:
                drop = _draw(seed, layer, site, block_start, completed, len(old)) if old else []
            keep = [c for c in keep if c not in drop]
        plan.append(keep)
    return plan


def masking_hooks(model: Any, which: str, seed: int = DEFAULT_SEED) -> list[tuple[str, Callable]]:
    """``(hook name, hook)`` pairs that apply :func:`masking_plan` through each read's ``hook_logits``."""
    plan = masking_plan(model.axis, which, seed)
    hooks = []
    for r, mixer in enumerate(model.mixers):
        keep = plan[r]
        k = model.axis.counts[r]
        drop = [c for c in range(k) if c not in keep]
        if not drop or not hasattr(mixer, "hook_logits"):
            continue

        def hook(z: torch.Tensor, hook: Any = None, drop: list[int] = drop) -> torch.Tensor:
            z = z.clone()
            z[..., drop] = float("-inf")
            return z

        hooks.append((mixer.hook_logits.name, hook))
    return hooks
