"""Routing ablation: edit depth weights through the weight hooks and measure the change in loss.

For a read r with weights alpha over its k available sources, ablating a set A of sources sets

    alpha'_i = t_i                                         for i in A
    alpha'_j = alpha_j * (1 - sum_{i in A} t_i) / sum_{j not in A} alpha_j   otherwise

so the weights still sum to one, with the target t_i given by the mode:

- ``"zero"``: t_i = 0, the source is removed and the rest renormalised;
- ``"uniform"``: t_i = 1/k, the source loses its learned preference;
- ``"mean"``: t_i = the source's mean weight over the text's tokens at that read, the source
  loses its token dependence.

Hyper-Connections and DenseFormer reads have coefficients c that need not sum to one: the same edit
runs on their normalised weights w = c / sum(c) and is scaled back by sum(c) (the read's total gain
is kept; for a softmax sum(c) = 1 and nothing changes), so ``"zero"`` takes the source out and
rescales the rest by sum(c) / sum_{j not in A} c_j.

A PreNorm read has no weights to edit; its matched removal (``"zero"`` only) takes the source
out of the read's sum and rescales the rest as the renormalisation does, h' = (h - sum_{i in A}
v_i) k / (k - |A|), at that read alone (its sublayer's input; the residual stream goes on
unchanged).

The result sits beside each source's routing mass (its mean normalised weight, the catalog's
routing quantity) and contribution share, so mass and causal importance can be compared
(:func:`weight_beside_effect`: weight does not predict effect, arXiv 2606.13168, so pages show
both).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pandas as pd
import torch

from attnres_probe.analysis.windows import normalised_weights
from attnres_probe.axis import COEFFICIENT_RULES
from attnres_probe.losses import next_token_loss
from attnres_probe.numeric import CANCELLED

__all__ = ["FAMILIES", "MODES", "ablate", "weight_beside_effect"]

MODES = ("zero", "uniform", "mean")
FAMILIES = ("embed", "completed", "partial", "recent")


def _family(name: str, read: int, k: int, residual: str, partial: bool) -> list[int]:
    """Columns of a source family at a read with k available sources."""
    if name == "embed":
        return [0]
    if name == "recent":
        return [k - 1]
    if name == "partial":
        return [k - 1] if partial else []
    # completed: every earlier source but the embedding and the current partial / most recent source
    last = k - 1 if (partial or residual != "block") else k  # the sublayer axis: the most recent is its own family
    return list(range(1, last))


def ablate(
    probe: Any,
    text_or_tokens: Any,
    sources: Any = "all",
    reads: Any = None,
    mode: str = "zero",
    joint: bool = False,
    truncate: bool = False,
) -> pd.DataFrame:
    """Ablate sources from reads and report the loss change per (read, source).

    Args:
        probe: a :class:`~attnres_probe.Probe` on a model with depth weights (Full or Block AttnRes,
            Hyper-Connections, DenseFormer; PreNorm: mode "zero" only).
        text_or_tokens: the text (or tokens) to evaluate the loss on (>= 2 tokens).
        sources: ``"all"`` (each available source on its own); a family, ``"embed"``,
            ``"completed"`` (earlier blocks or sublayers but the embedding and the most
            recent), ``"partial"`` (the current partial block, Block AttnRes), ``"recent"``
            (the most recent source), ablated as one set per read; or a source label/index or
            a list of them (each on its own, or together with ``joint=True``).
        reads: read labels/indices (default: every read with more than one source).
        mode: ``"zero"`` | ``"uniform"`` | ``"mean"`` (see the module docstring).
        joint: ablate a list of sources together instead of one at a time.
        truncate: keep the first n_ctx tokens of a longer text.

    Returns:
        DataFrame with columns read, source, mode, mass, contrib, base_loss, loss, delta_loss
        (one row per read and ablated source or set; mass and contrib are the mean weight and
        contribution share of the ablated sources, summed over a set).

    Raises:
        ValueError: a PreNorm model (no softmax weights to edit), an unknown mode, source or
            read, or a text shorter than two tokens.
    """
    spec = probe.spec
    if mode not in MODES:
        raise ValueError(f"mode is {mode!r}; accepted values are {', '.join(MODES)}")
    prenorm = spec.residual == "prenorm" or not spec.weight_hooks
    if prenorm and mode != "zero":
        raise ValueError(
            f"{probe.name!r} is a PreNorm model: its sources all enter with coefficient 1, so only mode 'zero' "
            "(the source taken out of the read's sum) applies"
        )
    tokens, str_tokens = probe.tokenize(text_or_tokens, truncate=truncate)
    if tokens.shape[1] < 2:
        raise ValueError("ablation measures the next-token loss, which needs at least two tokens")
    base = probe.run(tokens, backward=False)
    base_loss = base.meta["mean_loss"]
    counts = spec.axis.counts
    read_ids = _resolve_reads(reads, spec, counts)
    mass = _mean(base, normalised_weights(base, base.depth_weights))  # (R, S) mean normalised weight over tokens
    share = base.weights(kind="contrib").to_numpy()
    # the weights the "mean" targets come from: the softmax weights; normalised coefficients for HC / DenseFormer
    raw = None if prenorm else mass if spec.residual in COEFFICIENT_RULES else base.weights().to_numpy()

    rows = []
    for r in read_ids:
        k = counts[r]
        has_partial = spec.axis.partial_column(r) is not None
        for label, cols in _ablation_sets(sources, r, k, spec, has_partial, joint):
            if not cols:
                continue
            if mode == "zero" and len(cols) == k:
                raise ValueError(
                    f"read {spec.read_labels[r]!r}: mode 'zero' cannot remove all {k} of its sources; "
                    "keep at least one"
                )
            if prenorm:
                loss = _loss_without(probe, tokens, r, k, cols)
            else:
                targets = {c: 0.0 if mode == "zero" else 1.0 / k if mode == "uniform" else float(raw[r, c]) for c in cols}
                loss = _loss_with(probe, tokens, spec.weight_hooks[r], k, targets)
            rows.append(
                {
                    "read": spec.read_labels[r],
                    "source": label,
                    "mode": mode,
                    "mass": float(np.nansum(mass[r, cols])),
                    "contrib": float(np.nansum(share[r, cols])),
                    "base_loss": base_loss,
                    "loss": loss,
                    "delta_loss": loss - base_loss,
                }
            )
    out = pd.DataFrame(rows, columns=["read", "source", "mode", "mass", "contrib", "base_loss", "loss", "delta_loss"])
    out.attrs["n_tokens"] = int(tokens.shape[1])  # the tokens the losses are over (after truncate)
    return out


def _mean(trace: Any, arr: np.ndarray) -> np.ndarray:
    """Mean over a trace's real tokens of a [B, P, R, S] array (NaN where no token has a value)."""
    from attnres_probe.numeric import token_mean

    return token_mean(np.asarray(arr, np.float64)[np.asarray(trace.mask, bool)])


def _loss_without(probe, tokens: torch.Tensor, r: int, k: int, cols: list[int]) -> float:
    """The loss with sources ``cols`` taken out of PreNorm read ``r``'s sum (the rest rescaled by k / (k - |A|))."""
    spec = probe.spec
    owner = threading.get_ident()
    sources: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(x: torch.Tensor, hook: Any = None) -> None:
            if threading.get_ident() == owner:
                sources[index] = x + sources[index] if index == 0 and 0 in sources else x  # token + position
            return None

        return hook

    def edit(h: torch.Tensor, hook: Any = None) -> torch.Tensor | None:
        if threading.get_ident() != owner:
            return None
        removed = sum(sources[c] for c in cols)
        return (h - removed) * (k / (k - len(cols)))

    plan = [("hook_embed", keep(0))] + ([("hook_pos_embed", keep(0))] if spec.pos_embed else [])
    plan += [(name, keep(j + 1)) for j, name in enumerate(spec.output_hooks)]
    if spec.read_hooks[r] is None:
        raise ValueError(f"read {spec.read_labels[r]!r} of {probe.name!r} has no hook point to edit")
    plan.append((spec.read_hooks[r], edit))
    handles = []
    try:
        for name, fn in plan:
            hp = probe.model.hook_dict[name]
            handles.append((hp, hp.add_hook(fn, dir="fwd")))
        with torch.no_grad():
            ce = next_token_loss(probe.logits(tokens), tokens)
    finally:
        for hp, handle in handles:
            handle.hook.remove()
            if handle in hp.fwd_hooks:
                hp.fwd_hooks.remove(handle)
    return float(ce)


def weight_beside_effect(probe: Any, text_or_tokens: Any, truncate: bool = False) -> pd.DataFrame:
    """Routing weight beside causal effect in the deep half of reads (r >= floor(R/2)), one row per read.

    Each source is removed from the read on its own (``mode="zero"``: AttnRes its weight zeroed and
    the rest renormalised; PreNorm the source taken out of the sum, rescaled the same way) and the
    loss change is set beside its mean normalised weight.

    Returns:
        DataFrame indexed by read: ``embed_weight``, ``embed_delta`` (the embedding's weight and
        loss change), ``recent_weight``, ``recent_delta`` (the most recent source's),
        ``rank_correlation`` (Spearman's, over the read's sources, of weight against loss change;
        NaN where the weights are all equal, as PreNorm's are), ``sources`` (the read's columns),
        ``embed_uniform``, ``recent_uniform`` (their shares under the uniform reference on the
        model's own axis, :func:`~attnres_probe.analysis.windows.uniform_weights`: 1/k for Full and
        PreNorm, a block's members over k for Block). ``attrs["summary"]`` holds their means over
        the deep reads, ``attrs["n_tokens"]`` the tokens the losses are over.
    """
    from attnres_probe.analysis.windows import uniform_weights

    spec = probe.spec
    R = len(spec.read_labels)
    deep = [r for r in range(R // 2, R) if spec.axis.counts[r] > 1]
    frame = ablate(probe, text_or_tokens, sources="all", reads=deep, mode="zero", truncate=truncate)
    uniform = uniform_weights(spec)
    rows = {}
    for read, group in frame.groupby("read", sort=False):
        r = spec.read_labels.index(read)
        w, d = group["mass"].to_numpy(float), group["delta_loss"].to_numpy(float)
        rank = pd.Series(w).rank().corr(pd.Series(d).rank()) if np.ptp(w) > 1e-9 and np.ptp(d) > 0 else float("nan")
        rows[read] = {"embed_weight": w[0], "embed_delta": d[0], "recent_weight": w[-1], "recent_delta": d[-1],
                      "rank_correlation": rank, "sources": len(w), "embed_uniform": float(uniform[r, 0]),
                      "recent_uniform": float(uniform[r, len(w) - 1])}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index.name = "read"
    out.attrs["n_tokens"] = frame.attrs.get("n_tokens")
    out.attrs["summary"] = {c: float(out[c].mean()) for c in out.columns if c != "sources"} if len(out) else {}
    return out


def _resolve_reads(reads: Any, spec, counts: list[int]) -> list[int]:
    labels = spec.read_labels
    if reads is None:
        return [r for r in range(len(labels)) if counts[r] > 1]
    items = [reads] if isinstance(reads, (str, int)) else list(reads)
    out = []
    for item in items:
        if isinstance(item, str):
            if item not in labels:
                raise ValueError(f"read {item!r} is not one of {labels}")
            out.append(labels.index(item))
        elif isinstance(item, (int, np.integer)) and -len(labels) <= item < len(labels):
            out.append(int(item) % len(labels))
        else:
            raise ValueError(f"read {item!r} is out of range; reads are 0..{len(labels) - 1} or labels {labels}")
    return out


def _ablation_sets(sources: Any, r: int, k: int, spec, has_partial: bool, joint: bool) -> list[tuple[str, list[int]]]:
    labels = spec.source_labels
    if isinstance(sources, str) and sources == "all":
        return [(labels[c], [c]) for c in range(k)]
    if isinstance(sources, str) and sources in FAMILIES:
        return [(sources, _family(sources, r, k, spec.residual, has_partial))]
    items = [sources] if isinstance(sources, (str, int)) else list(sources)
    cols = []
    for item in items:
        if isinstance(item, str):
            if item not in labels:
                raise ValueError(
                    f"source {item!r} is not one of {labels} or the families {', '.join(FAMILIES)} or 'all'"
                )
            c = labels.index(item)
        elif isinstance(item, (int, np.integer)) and 0 <= item < len(labels):
            c = int(item)
        else:
            raise ValueError(f"source {item!r} is out of range; sources are 0..{len(labels) - 1} or labels {labels}")
        if c < k:  # a source this read cannot see is skipped
            cols.append(c)
    if joint:
        return [("+".join(labels[c] for c in cols), cols)] if cols else []
    return [(labels[c], [c]) for c in cols]


def _loss_with(probe, tokens: torch.Tensor, hook_name: str, k: int, targets: dict[int, float]) -> float:
    cols = sorted(targets)
    owner = threading.get_ident()

    def edit(w: torch.Tensor, hook: Any = None) -> torch.Tensor | None:
        if threading.get_ident() != owner:
            return None  # another thread's forward through the same model: left as it is
        w = w.clone()
        avail = w[..., :k]
        keep = torch.ones(k, dtype=torch.bool, device=w.device)
        keep[cols] = False
        fixed = sum(targets.values())
        gain = avail.sum(-1, keepdim=True)  # 1 for a softmax; sum(c) for coefficients (kept by the edit)
        rest = torch.where(keep, avail, torch.zeros_like(avail))
        total = rest.sum(-1, keepdim=True)
        # rescale the kept sources to fill 1 - sum(targets) of the gain; uniform among them if they had no mass
        uniform = keep.to(avail.dtype) / max(int(keep.sum()), 1)
        # ... and where the kept coefficients cancel (attnres_probe.numeric.CANCELLED): their shares would be unbounded
        fills = (total != 0) & (total.abs() >= CANCELLED * rest.abs().sum(-1, keepdim=True))
        scaled = torch.where(fills, rest / torch.where(fills, total, 1.0), uniform) * (1.0 - fixed) * gain
        for c in cols:
            scaled[..., c] = targets[c] * gain[..., 0]
        w[..., :k] = scaled
        return w

    hp = probe.model.hook_dict[hook_name]
    handle = hp.add_hook(edit, dir="fwd")
    try:
        with torch.no_grad():
            ce = next_token_loss(probe.logits(tokens), tokens)
    finally:
        handle.hook.remove()
        if handle in hp.fwd_hooks:
            hp.fwd_hooks.remove(handle)
    return float(ce)
