"""The next-token loss: one cross-entropy for the model, training, the probe and the ablation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnres_probe.losses import next_token_loss, trace_loss

B, P, V = 3, 7, 50


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, P, V, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.bool)
    mask[1, 4:] = False  # right padding
    mask[2, 1:] = False  # one real token: nothing to predict
    return logits, tokens, mask


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_loss_is_torchs_cross_entropy_of_position_t_against_token_t_plus_1(batch, reduction):
    logits, tokens, _ = batch
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction=reduction)
    got = next_token_loss(logits, tokens, reduction=reduction)
    assert torch.equal(got, expected.view(B, P - 1) if reduction == "none" else expected)


def test_logits_of_the_first_p_minus_1_positions_give_the_same_loss(batch):
    """A training window of P tokens runs the model on its first P-1: the logits stop one short."""
    logits, tokens, _ = batch
    assert torch.equal(next_token_loss(logits[:, :-1], tokens), next_token_loss(logits, tokens))


def test_a_mask_counts_only_targets_whose_predictor_and_target_are_real(batch):
    logits, tokens, mask = batch
    counted = mask[:, 1:] & mask[:, :-1]
    every = next_token_loss(logits, tokens, reduction="none")
    per_target = next_token_loss(logits, tokens, reduction="none", mask=mask)
    assert torch.equal(per_target[counted], every[counted]) and per_target[~counted].isnan().all()
    torch.testing.assert_close(next_token_loss(logits, tokens, mask=mask), every[counted].mean())
    torch.testing.assert_close(next_token_loss(logits, tokens, reduction="sum", mask=mask), every[counted].sum())


def test_a_masked_mean_with_nothing_to_count_is_nan(batch):
    logits, tokens, _ = batch
    assert next_token_loss(logits, tokens, mask=torch.zeros(B, P, dtype=torch.bool)).isnan()


def test_the_trace_loss_sits_at_the_predicting_position_and_its_mean_is_differentiable(batch):
    logits, tokens, mask = batch
    per_token, mean = trace_loss(logits, tokens, mask)
    assert per_token.shape == (B, P) and not per_token.requires_grad
    assert per_token[:, -1].isnan().all() and per_token[1, 3:].isnan().all() and per_token[2].isnan().all()
    torch.testing.assert_close(per_token[0, :-1], next_token_loss(logits, tokens, reduction="none")[0].detach())
    assert torch.equal(mean, next_token_loss(logits, tokens, mask=mask))
    (grad,) = torch.autograd.grad(mean, logits)
    assert grad[2].abs().sum() == 0 and grad[0].abs().sum() > 0  # only counted targets pull on the logits


def test_one_token_has_no_trace_loss():
    per_token, mean = trace_loss(torch.zeros(1, 1, V), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    assert per_token.isnan().all() and mean.isnan()


def test_an_unknown_reduction_names_the_accepted_ones(batch):
    logits, tokens, _ = batch
    with pytest.raises(ValueError, match="accepted values are mean, sum, none"):
        next_token_loss(logits, tokens, reduction="avg")
