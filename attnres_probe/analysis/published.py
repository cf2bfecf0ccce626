"""Routing diagnostics others publish, computed with their definitions (issue #49).

LR-AttnRes (jon123boss/LR-AttnRes at efeb4cb, ``analyze_depthwise_routing.py``) reports, for its 0.5B
models over 1,007,616 validation tokens, a read's normalised entropy, effective number of sources, top-1
mass and input dependence, the attention-vs-MLP split of a read's mass
(``scripts/analyze_split_sublayer_evidence.py``) and the embedding's weight per read. Their definitions,
per read ("site") with at least two visible sources, one distribution p per token
(``RoutingRecorder.record_common``):

- normalised entropy ``H(p) / ln k`` with ``H(p) = -sum p ln p``: our ``mean_entropy`` is exactly this;
- effective sources ``exp H(p)`` (not ``1 / sum p^2``);
- top-1 mass ``max_i p_i``;
- input dependence, the generalised Jensen-Shannon divergence ``H(p_bar) - mean_t H(p_t)`` with
  ``p_bar`` the mean distribution over tokens (``summarize_recorder``'s ``js_generalized``), which is the
  mean over tokens of ``KL(p_t || p_bar)``: here ``p_bar`` is the mean over each window's tokens (theirs
  pools every validation token, which adds the variation between documents: ours is no larger);
- attention mass: the weight on attention sublayers' outputs (a block's weight split by the fraction of
  its members that are attention sublayers, ``block_type_makeup``);
- a site's value is the mean over tokens, the model's the unweighted mean over sites
  (``mean_attention_metrics``): here each token's value is the mean over its reads, then tokens.

Each is registered in the catalog (:func:`attnres_probe.analysis.catalog.register`), so every page,
``metrics.compare`` and ``comparison.csv`` show it beside its uniform reference on the model's own axis.
A model forced to route uniformly has effective sources k, top-1 mass 1/k and input dependence 0 at every
read (a test checks it). For signed coefficients (mHC, DenseFormer) p = |w| / sum |w|, as for the entropy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnres_probe.analysis.catalog import UNIFORM, Diagnostic, register

__all__ = ["LR_ATTNRES_REPORT", "PUBLISHED", "per_read"]

_SRC = "LR-AttnRes analyze_depthwise_routing.py"
_AXIS = "normalised weights on the model's own source axis (Block: blocks)"
# LR-AttnRes's published values (standard AttnRes, 0.5B, 1,007,616 validation tokens), for the study page
PUBLISHED = {
    "lr_effective_sources": 5.99, "lr_top1_mass": 0.5129, "lr_input_dependence": 0.043, "mean_entropy": 0.6705,
}


# Everything LR-AttnRes reports that a page sets beside ours (jon123boss/LR-AttnRes, its README's routing
# tables from analyze_depthwise_routing.py): its scale and data, so that a page labels both
LR_ATTNRES_REPORT = {
    "source": "jon123boss/LR-AttnRes, analyze_depthwise_routing.py",
    "scale": "0.5B-parameter", "tokens": 1007616, "data": "its own validation text",
    "standard": {"mean_entropy": 0.6705, "lr_effective_sources": 5.99, "lr_top1_mass": 0.5129, "lr_input_dependence": 0.043},
    "full_top1": 0.263,
    "block_top1": [{"blocks": 4, "top1": 0.741}, {"blocks": 8, "top1": 0.598}, {"blocks": 16, "top1": 0.450}],
    "embed_first_reads": [0.965, 0.269, 0.771, 0.153],
    "embed_late": {"reads": [20, 48], "low": 0.02, "high": 0.05},
}


def _probs(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p [B, P, R, S] with 0 where unavailable, k [B, P, R] visible sources)."""
    avail = ~np.isnan(w)
    a = np.abs(np.where(avail, w, 0.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        p = a / a.sum(-1, keepdims=True)
    return np.nan_to_num(p), avail.sum(-1)


def _entropy(p: np.ndarray) -> np.ndarray:
    return -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)).sum(-1)


def per_read(name: str, w: np.ndarray, mask: np.ndarray, trace: Any = None) -> np.ndarray:
    """[B, P, R] the diagnostic ``name`` at every token and read (NaN at reads with fewer than two
    sources), from normalised weights ``w`` [B, P, R, S]."""
    p, k = _probs(w)
    if name == "lr_effective_sources":
        v = np.exp(_entropy(p))
    elif name == "lr_top1_mass":
        v = p.max(-1)
    elif name == "lr_input_dependence":
        m = mask[..., None, None].astype(np.float64)
        n = np.maximum(m.sum(1, keepdims=True), 1.0)
        pbar = (p * m).sum(1, keepdims=True) / n  # [B, 1, R, S] the window's mean distribution
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(p > 0, p / np.where(pbar > 0, pbar, 1.0), 1.0)
        v = np.maximum((np.where(p > 0, p * np.log(ratio), 0.0)).sum(-1), 0.0)
    elif name == "lr_attn_mass":
        v = (p * _attention_fraction(trace, w.shape[-2:])).sum(-1)
    else:
        raise ValueError(f"{name!r} is not one of the published diagnostics")
    return np.where(k >= 2, v, np.nan)


def _attention_fraction(trace: Any, shape: tuple[int, int]) -> np.ndarray:
    """[R, S] the fraction of each column's members that are attention sublayers' outputs."""
    out = np.zeros(shape)
    axis = trace.axis
    for r in range(min(shape[0], axis.n_reads)):
        for s, members in enumerate(axis.members(r)):
            out[r, s] = sum(m.endswith(".attn") for m in members) / max(len(members), 1)
    return out


def _token_mean(name: str):
    def fn(w: np.ndarray, ctx: dict[str, Any]) -> np.ndarray:
        v = per_read(name, w, ctx["mask"], ctx["trace"])
        with np.errstate(invalid="ignore"):
            cnt = (~np.isnan(v)).sum(-1)
            return np.where(cnt > 0, np.nansum(v, -1) / np.maximum(cnt, 1), np.nan)
    return fn


for _d in (
    Diagnostic(
        "lr_effective_sources", "routing", "effective number of sources",
        f"exp of the entropy of a read's {_AXIS} (LR-AttnRes's definition)", "sources",
        f"exp(-sum_i p_i ln p_i), p = w over the k_r >= 2 sources read r sees; mean over reads, then tokens ({_SRC}, "
        "record_common)", UNIFORM, "difference", None, "", pooling="tokens"),
    Diagnostic(
        "lr_top1_mass", "routing", "top-1 mass",
        f"the largest weight of a read's {_AXIS} (LR-AttnRes's definition)", "fraction of the read (0-1)",
        f"max_i p_i over the k_r >= 2 sources; mean over reads, then tokens ({_SRC}, record_common)",
        UNIFORM, "difference", None, "", pooling="tokens"),
    Diagnostic(
        "lr_input_dependence", "routing", "input dependence (generalised JS)",
        f"how much a read's {_AXIS} vary across the window's tokens (LR-AttnRes's definition)", "nats",
        f"mean over tokens of KL(p_t || p_bar) = H(p_bar) - mean_t H(p_t), p_bar the mean over the window's tokens; "
        f"mean over reads with k_r >= 2 ({_SRC}, summarize_recorder js_generalized; theirs pools p_bar over every token)",
        UNIFORM, "difference", None, "", pooling="tokens"),
    Diagnostic(
        "lr_attn_mass", "routing", "weight on attention outputs",
        f"the weight of a read's {_AXIS} on attention sublayers' outputs (a block's split by its members)",
        "fraction of the read (0-1)",
        "sum of p over attention sources (blocks: times the fraction of attention members); mean over reads with "
        "k_r >= 2, then tokens (LR-AttnRes scripts/analyze_split_sublayer_evidence.py, full/block_type_makeup)",
        UNIFORM, "difference", None, "", pooling="tokens"),
):
    register(_d, _token_mean(_d.name))
