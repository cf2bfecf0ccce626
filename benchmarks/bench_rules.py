"""The residual rules the benchmarks build, by name, and the perturbation that gives a fresh model
non-uniform routing (as a trained one has), for every rule.

Names are the demo rules' (:data:`attnres_probe.demo_recipe.DEMO_RULES`: ``prenorm``, ``full``,
``block`` (blocks of 4 sublayers), ``mhc`` (dynamic mHC, 4 streams), ``denseformer``); any other
name is taken as a ``ModelConfig.residual`` with that rule's defaults (``hyper``: dynamic HC).

A benchmark script imports this module from its own folder (``sys.path`` gets the folder of the
script first), so it also works when the script is loaded by path (the tests do).
"""

from __future__ import annotations

import math

import torch

from attnres_probe.demo_recipe import DEMO_RULES

__all__ = ["ALL_RULES", "parse_rules", "perturb_coefficients", "perturb_routing", "rule_kwargs"]

ALL_RULES = tuple(DEMO_RULES)  # prenorm, full, block, mhc, denseformer


def rule_kwargs(name: str) -> dict:
    """The ModelConfig fields of the rule called ``name`` (a demo rule, or a bare residual)."""
    return dict(DEMO_RULES.get(name, {"residual": name}))


def parse_rules(text: str | list[str]) -> list[str]:
    """``"prenorm,full,mhc"`` (or a list of such strings) -> the names, in order, without repeats."""
    parts = text if isinstance(text, list) else [text]
    out: list[str] = []
    for part in parts:
        for name in part.split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return out


@torch.no_grad()
def perturb_coefficients(model, generator: torch.Generator, scale: float = 0.5) -> int:
    """Perturb the depth rule's own parameters of a Hyper-Connection or DenseFormer model (their
    reads have no ``query``), so that its reads are not the identity-like ones of a fresh model:

    - HC / mHC (``blocks.{i}.{attn,mlp}_res.hc``, ``out_res`` has none): the biases get
      N(0, scale) noise for mHC (they are logits: sigmoid, Sinkhorn) and N(0, scale / 5) for HC
      (they are the weights themselves: a product of 2L noisy stream mixes must stay bounded);
      the dynamic projections get N(0, scale / sqrt(width)), so the per-token terms vary.
    - DenseFormer (``dwa.alphas``): each DWA's weights get N(0, scale / 5) noise.

    Returns the number of parameters perturbed (0 for the other rules: nothing to do)."""
    n = 0
    for read in model.mixers:
        hc = getattr(read, "hc", None)
        if hc is None:
            continue
        bias_std = scale if hc.mhc else scale / 5
        for name in ("pre_bias", "res_bias", "post_bias"):
            p = getattr(hc, name)
            p.add_(torch.randn(p.shape, generator=generator) * bias_std)
            n += 1
        for name in ("pre_proj", "res_proj", "post_proj"):
            p = getattr(hc, name, None)
            if p is not None:
                p.copy_(torch.randn(p.shape, generator=generator) * (scale / math.sqrt(p.shape[0])))
                n += 1
    dwa = getattr(model, "dwa", None)
    if dwa is not None:
        for p in dwa.alphas.values():
            p.add_(torch.randn(p.shape, generator=generator) * (scale / 5))
            n += 1
    return n


@torch.no_grad()
def perturb_routing(model, generator: torch.Generator, scale: float = 0.5) -> None:
    """Non-uniform routing for any rule: AttnRes's pseudo-queries ~ N(0, scale) (as the
    benchmarks always did), and :func:`perturb_coefficients` for HC/mHC and DenseFormer."""
    for m in model.mixers:
        if hasattr(m, "query"):
            m.query.normal_(0, scale, generator=generator)
    perturb_coefficients(model, generator, scale)
