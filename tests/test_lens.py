"""TransformerLens habits on our models, and the routing-aware residual readings (lens.py)."""

from __future__ import annotations

import pytest
import torch
from transformer_lens import ActivationCache

from attnres_probe import Probe

from helpers import sample_tokens, tiny_model

RESIDUALS = [("prenorm", {}), ("full", {}), ("block", {"block_size": 2}), ("block", {"block_boundaries": [1, 3]})]


@pytest.mark.parametrize("residual, kw", RESIDUALS)
def test_return_type_works_as_in_transformer_lens(residual, kw):
    model = tiny_model(residual, **kw)
    tokens = sample_tokens(9)
    logits = model(tokens)
    loss = model(tokens, return_type="loss")
    both = model(tokens, return_type="both")
    assert model(tokens, return_type=None) is None
    assert torch.equal(both[0], logits) and torch.equal(both[1], loss)
    torch.testing.assert_close(loss, model.loss(tokens), rtol=0, atol=0)
    per_token = model(tokens, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 8)
    torch.testing.assert_close(per_token.mean(), loss)
    assert torch.equal(model.run_with_hooks(tokens, return_type="loss"), loss)
    with pytest.raises(ValueError, match="return_type is 'probs'; accepted values are 'logits', 'loss', 'both', None"):
        model(tokens, return_type="probs")


@pytest.mark.parametrize("residual, kw", RESIDUALS)
def test_run_with_cache_incl_bwd_runs_backward_from_the_loss(residual, kw):
    model = tiny_model(residual, **kw)
    out, cache = model.run_with_cache(sample_tokens(9), incl_bwd=True)
    assert isinstance(cache, ActivationCache) and out.dim() == 0
    grad = cache["blocks.1.hook_resid_pre_grad"]
    assert grad.shape == cache["blocks.1.hook_resid_pre"].shape and grad.abs().sum() > 0
    with pytest.raises(ValueError, match="must be a scalar.*return_type='loss'"):
        model.run_with_cache(sample_tokens(9), incl_bwd=True, return_type="logits")


def test_prenorm_has_resid_post_and_its_accumulated_resid_works():
    model = tiny_model("prenorm")
    tokens = sample_tokens(7)
    _, cache = model.run_with_cache(tokens)
    post = cache["blocks.0.hook_resid_post"]
    torch.testing.assert_close(post, cache["blocks.1.hook_resid_pre"], rtol=0, atol=0)
    torch.testing.assert_close(cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"], cache["hook_resid_final"], rtol=0, atol=0)
    resid, labels = cache.accumulated_resid(return_labels=True)
    assert resid.shape[0] == model.cfg.n_layers + 1 and labels[-1] == "final_post"


@pytest.mark.parametrize("helper", ["accumulated_resid", "decompose_resid", "get_full_resid_decomposition", "logit_lens"])
@pytest.mark.parametrize("residual", ["full", "block"])
def test_attnres_caches_refuse_sum_based_residual_helpers_and_name_the_routing_aware_ones(residual, helper):
    model = tiny_model(residual)
    _, cache = model.run_with_cache(sample_tokens(7))
    assert not hasattr(model.blocks[0], "hook_resid_post")
    with pytest.raises(ValueError, match=r"weighted mixture.*logit_lens.*logit_contributions"):
        getattr(cache, helper)()


@pytest.mark.parametrize("residual, kw", RESIDUALS)
def test_direct_logit_contributions_sum_to_the_logits(residual, kw):
    """The final read's mixture through ln_final (scale from the run) and W_U, split by source:
    the contributions add up to the model's logits (float32 run, float64 sum: within 1e-5 of
    logits of order 10, i.e. a few float32 ulps per source)."""
    model = tiny_model(residual, **kw)
    tokens = sample_tokens(9)
    probe = Probe(model)
    for token in (0, 4, -1):
        lc = probe.logit_contributions(tokens, token=token, batch=1)
        want = model(tokens)[1, token].double().detach().numpy()
        assert abs(lc.contributions.sum(0) - want).max() <= 1e-5 * max(1.0, abs(want).max())
        assert lc.sources == model.source_labels[: len(lc.sources)]
        assert len(lc.sources) == model.axis.visible(model.cfg.n_sublayers)
    if residual == "prenorm":
        assert (lc.weights == 1).all()
    else:
        assert abs(lc.weights.sum() - 1) < 1e-6
    table = lc.frame(k=3)
    assert list(table.index) == lc.sources and table.shape == (len(lc.sources), 4)
    with pytest.raises(IndexError, match="position 9 is out of range; the sequence has 9 tokens"):
        probe.logit_contributions(tokens, token=9)


def test_contributions_follow_an_intervention_on_the_final_read():
    """Weights a hook sets are the weights the decomposition uses (it reads the forward's own)."""
    model = tiny_model("full")
    k = model.axis.visible(model.cfg.n_sublayers)

    def embed_only(w, hook):
        out = torch.full_like(w, float("nan"))
        out[..., :k] = 0.0
        out[..., 0] = 1.0
        return out

    model.out_res.hook_weights.add_hook(embed_only)
    lc = Probe(model).logit_contributions(sample_tokens(6), token=2)
    assert lc.weights[0] == 1 and (lc.weights[1:] == 0).all()
    assert abs(lc.contributions[1:]).max() == 0


@pytest.mark.parametrize("residual", ["prenorm", "block"])
def test_the_logit_lens_reports_every_read_and_ends_with_the_models_prediction(residual):
    model = tiny_model(residual)
    tokens = sample_tokens(6, batch=1)
    df = Probe(model).logit_lens(tokens, k=2)
    assert list(df["read"].unique()) == model.read_labels
    assert len(df) == model.cfg.n_reads * 6 * 2
    final = df[(df["read"] == "final") & (df["rank"] == 0)].sort_values("position")
    assert final["token_id"].tolist() == model(tokens)[0].argmax(-1).tolist()
    assert df["prob"].between(0, 1).all()
    nxt = df[(df["position"] == 0) & df["is_next"]]
    assert (nxt["token_id"] == int(tokens[0, 1])).all()


@pytest.mark.parametrize("residual, kw", RESIDUALS)
def test_token_readings_from_one_forward_equal_the_separate_calls(residual, kw):
    """The dashboard's and the report's per-token reading runs the model once for the logit
    decomposition and the logit lens together: exactly what the two calls give apart."""
    import numpy as np
    import pandas as pd

    model = tiny_model(residual, **kw)
    tokens = sample_tokens(7)
    probe = Probe(model)
    runs = []
    model.hook_embed.add_hook(lambda x, hook: runs.append(1) or x)
    contribs, lens = probe.token_readings(tokens, positions=[0, 3, -1], k=3, batch=1)
    assert len(runs) == 1  # one forward for everything
    assert [lc.position for lc in contribs] == [0, 3, 6]
    for lc in contribs:
        alone = probe.logit_contributions(tokens, token=lc.position, batch=1)
        np.testing.assert_array_equal(lc.contributions, alone.contributions)
        np.testing.assert_array_equal(lc.weights, alone.weights)
        np.testing.assert_array_equal(lc.logits, alone.logits)
    pd.testing.assert_frame_equal(lens, probe.logit_lens(tokens, k=3, positions=[0, 3, 6], batch=1))
    assert len(probe.token_readings(tokens, k=2)[0]) == tokens.shape[1]  # default: every position
    model.reset_hooks()
