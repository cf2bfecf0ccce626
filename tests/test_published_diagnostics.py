"""LR-AttnRes's routing diagnostics with their definitions (issue #49): exact on uniform routing, and what
they are on the normalised weights of a real read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnres_probe import AttnResTransformer, ModelConfig, Probe
from attnres_probe.analysis.catalog import CATALOG
from attnres_probe.analysis.published import per_read
from attnres_probe.analysis.windows import window_metrics


@pytest.mark.parametrize("residual", ["full", "block"])
def test_uniform_routing_gives_k_sources_one_over_k_and_no_input_dependence(residual):
    """Zero queries: every read's softmax is uniform over the k columns it sees."""
    model = AttnResTransformer(ModelConfig(d_model=16, n_layers=3, n_heads=2, n_ctx=16, residual=residual,
                                           **({"block_size": 2} if residual == "block" else {})))
    trace = Probe(model).run(torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0)))
    w = trace.normalised_weights().astype(np.float64)
    k = np.asarray(model.axis.counts)
    eff = per_read("lr_effective_sources", w, trace.mask, trace)
    top = per_read("lr_top1_mass", w, trace.mask, trace)
    dep = per_read("lr_input_dependence", w, trace.mask, trace)
    several = k >= 2
    np.testing.assert_allclose(eff[..., several], np.broadcast_to(k[several], eff[..., several].shape), rtol=1e-6)
    np.testing.assert_allclose(top[..., several], np.broadcast_to(1.0 / k[several], top[..., several].shape), rtol=1e-6)
    np.testing.assert_allclose(dep[..., several], 0.0, atol=1e-6)
    assert np.isnan(eff[..., ~several]).all()  # reads with one source are not sites (LR-AttnRes's rule)


def test_input_dependence_is_the_generalised_js_and_attention_mass_counts_attention_sources():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 50, 2, 4))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    w = np.concatenate([p, np.full((1, 50, 1, 4), np.nan)], axis=2)  # a third read with no source
    w[:, :, 2, 0] = 1.0
    mask = np.ones((1, 50), bool)
    dep = per_read("lr_input_dependence", w, mask)
    h = lambda q: -(q * np.log(q)).sum(-1)  # noqa: E731
    js = h(p.mean(1)) - h(p).mean(1)  # [1, R]: H(p_bar) - mean H(p_t)
    np.testing.assert_allclose(dep[:, :, :2].mean(1), js, rtol=1e-10)
    assert np.isnan(dep[:, :, 2]).all()


def test_the_published_diagnostics_are_in_the_catalog_and_every_window_table():
    for name in ("lr_effective_sources", "lr_top1_mass", "lr_input_dependence", "lr_attn_mass"):
        d = CATALOG[name]
        assert d.reference == "uniform" and d.direction is None and "LR-AttnRes" in d.formula
    model = AttnResTransformer(ModelConfig(d_model=16, n_layers=2, n_heads=2, n_ctx=16, residual="full"))
    wm = window_metrics(Probe(model).run(torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))))
    assert wm["lr_attn_mass@uniform"][0] == pytest.approx(np.mean([(r // 2 + r % 2) / (r + 1) for r in range(1, 5)]))
    assert math.isclose(wm["lr_effective_sources"][0], wm["lr_effective_sources@uniform"][0], rel_tol=1e-6)
