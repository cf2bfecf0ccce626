"""The plain-PyTorch depth-attention op: worked example, conventions, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from attnres_probe import ModelConfig
from attnres_probe.kernels import depth_attn, inv_rms
from attnres_probe.model import DepthMixer

EXAMPLE = [torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.0, 2.0]]]), torch.tensor([[[1.0, 1.0]]])]


def test_worked_example_from_the_attnres_description():
    """Sources (1,0), (0,2), (1,1) scored (0, log 2, 0): weights (1/4, 1/2, 1/4), mixture (0.5, 1.25)."""
    mixer = DepthMixer(ModelConfig(d_model=2, n_heads=1, n_layers=1, residual="full"))
    seen = {}

    def set_scores(logits, hook):
        return torch.tensor([0.0, math.log(2.0), 0.0]).expand_as(logits).clone()

    def record(weights, hook):
        seen["w"] = weights.clone()

    mixer.hook_logits.add_hook(set_scores)
    mixer.hook_weights.add_hook(record)
    h = mixer(EXAMPLE)
    torch.testing.assert_close(seen["w"][0, 0], torch.tensor([0.25, 0.5, 0.25]), atol=1e-7, rtol=0)
    torch.testing.assert_close(h[0, 0], torch.tensor([0.5, 1.25]), atol=1e-7, rtol=0)
    torch.testing.assert_close(sum(EXAMPLE)[0, 0], torch.tensor([2.0, 3.0]))


def test_logits_follow_the_design_formula():
    """z_i = (w * gain) . v_i / sqrt(mean(v_i^2) + eps); no temperature, no 1/sqrt(d). float64,
    so any difference beyond a few ulps (1e-12 relative) is a different formula."""
    torch.manual_seed(0)
    src = torch.randn(4, 3, 5, 16, dtype=torch.float64)
    q, g = torch.randn(16, dtype=torch.float64), torch.rand(16, dtype=torch.float64) + 0.5
    mix, lse, w, logits = depth_attn(src, q, g, eps=1e-6, return_weights=True, return_logits=True)
    z = torch.einsum("sbpd,d->bps", src / torch.sqrt(src.pow(2).mean(-1, keepdim=True) + 1e-6), q * g)
    torch.testing.assert_close(logits, z, atol=0, rtol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), atol=0, rtol=1e-12)
    torch.testing.assert_close(w, torch.softmax(z, -1), atol=1e-15, rtol=1e-12)
    torch.testing.assert_close(mix, torch.einsum("bps,sbpd->bpd", w, src), atol=1e-15, rtol=1e-12)


def test_list_and_stacked_sources_agree_and_cache_is_equivalent():
    src = torch.randn(3, 2, 4, 8)
    q = torch.randn(8)
    a = depth_attn(src, q, return_weights=True)
    b = depth_attn(list(src), q, return_weights=True, inv_rms_cache=[inv_rms(s, 1e-6) for s in src])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_low_precision_inputs_compute_in_fp32():
    src = torch.randn(3, 4, 8)
    q = torch.randn(8)
    mix16, lse16, w16 = depth_attn(src.bfloat16(), q.bfloat16(), return_weights=True)
    assert mix16.dtype == torch.bfloat16 and lse16.dtype == torch.float32 and w16.dtype == torch.float32
    mix32, lse32, _ = depth_attn(src.bfloat16().float(), q.bfloat16().float(), return_weights=True)
    torch.testing.assert_close(lse16, lse32)
    torch.testing.assert_close(mix16.float(), mix32, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: depth_attn(torch.ones(2, 3, 4, dtype=torch.long), torch.zeros(4)), "sources must be a floating-point"),
        (lambda: depth_attn(torch.ones(2, 3, 4), torch.zeros(5)), "query must have shape [4]"),
        (lambda: depth_attn(torch.ones(2, 3, 4), torch.zeros(4, dtype=torch.long)), "query must be a floating-point"),
        (lambda: depth_attn(torch.ones(2, 3, 4), torch.zeros(4), torch.ones(3)), "gain must have shape [4]"),
        (lambda: depth_attn(torch.ones(4), torch.zeros(4)), "sources must be [S, *batch, d]"),
        (lambda: depth_attn([], torch.zeros(4)), "non-empty sequence"),
        (lambda: depth_attn([torch.ones(3, 4), torch.ones(2, 4)], torch.zeros(4)), "sources[1] has shape"),
        (lambda: depth_attn([torch.ones(3, 4), torch.ones(3, 4).double()], torch.zeros(4)), "sources[1] has dtype"),
        (lambda: depth_attn(torch.ones(2, 3, 4), torch.zeros(4), eps=-1.0), "eps must be a non-negative"),
        (lambda: depth_attn(torch.ones(2, 3, 4), torch.zeros(4), backend="cuda"), "accepted values are auto, torch, triton"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError) as err:
        call()
    assert name in str(err.value)
