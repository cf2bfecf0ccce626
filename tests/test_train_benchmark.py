"""benchmarks/train.py's stand-in for the Numba op (``--stand-in``): it replaces the op only
inside its context, gives the read the shapes and padding the real op gives, and restores the
real op afterwards, also when the step raises."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from attnres_probe.kernels import depth_attn
from attnres_probe.kernels.ops.depth_attn.numba import DepthAttnNumbaFunction

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_benchmark", ROOT / "benchmarks" / "train.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_stand_in_replaces_the_op_only_inside_its_context():
    sources = [torch.randn(2, 5, 8, requires_grad=True) for _ in range(3)]
    query = torch.randn(8)
    real = depth_attn(sources, query, return_weights=True, return_logits=True, backend="numba", width=6)
    with bench.stand_in_op():
        mix, lse, w, z = depth_attn(sources, query, return_weights=True, return_logits=True, backend="numba", width=6)
        assert torch.equal(mix, sources[-1]) and w.shape == z.shape == (2, 5, 6)
        assert torch.isnan(w[..., 3:]).all() and (z[..., 3:] == float("-inf")).all()
        grads = torch.autograd.grad(mix.sum(), sources, allow_unused=True)
        assert grads[0] is None and grads[1] is None and torch.equal(grads[2], torch.ones_like(mix))
    with pytest.raises(RuntimeError, match="inside"):
        with bench.stand_in_op():
            raise RuntimeError("a step failing inside the context")
    assert DepthAttnNumbaFunction.forward.__name__ == "forward" and DepthAttnNumbaFunction.backward.__name__ == "backward"
    again = depth_attn(sources, query, return_weights=True, return_logits=True, backend="numba", width=6)
    for a, b in zip(real, again):
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def test_the_ratio_comes_with_an_interval_and_an_honest_verdict():
    rng = np.random.default_rng(0)
    noisy = 1.20 + 0.03 * rng.standard_normal(40)
    med, lo, hi = bench.ratio_interval(noisy)
    assert lo < med < hi and med == pytest.approx(np.median(noisy))
    assert bench.ratio_interval(noisy) == (med, lo, hi)  # seeded
    assert bench.verdict(lo, hi, 1.20) == "within noise"  # a run on the target cannot say met or missed
    assert bench.verdict(*bench.ratio_interval(noisy - 0.1)[1:], 1.20) == "met"
    assert bench.verdict(*bench.ratio_interval(noisy + 0.1)[1:], 1.20) == "missed"
    assert bench.ratio_interval([1.1] * 5) == (1.1, 1.1, 1.1)
