"""A hook's return value is checked at its hook point (issue #51): None, or a tensor of the shape, dtype and
device it received; anything else one line naming the point and both shapes. And the knobs that size memory
or time are bounded, naming the knob."""

from __future__ import annotations

import pytest
import torch

from attnres_probe import ModelConfig
from attnres_probe.config import ConfigError
from attnres_probe.demo import load_demo
from attnres_probe.hook_checks import HookReturnError


@pytest.fixture(scope="module")
def block():
    return load_demo("block")[0]


@pytest.mark.parametrize("point, fn, message", [
    ("blocks.1.attn_res.hook_weights", lambda t, hook: t[..., :1], r"returned \[1, 5, 1\] .* received \[1, 5, 5\]"),
    ("blocks.1.attn_res.hook_weights", lambda t, hook: t[:, :1, :], r"returned \[1, 1, 5\]"),
    ("blocks.1.attn_res.hook_weights", lambda t, hook: t[..., :2], r"returned \[1, 5, 2\]"),  # once silently ignored
    ("blocks.1.attn_res.hook_weights", lambda t, hook: 3.0, "returned float; it must return None or a tensor"),
    ("blocks.1.attn_res.hook_logits", lambda t, hook: t.double(), "torch.float64 .* received .* torch.float32"),
    ("blocks.0.attn.hook_pattern", lambda t, hook: t[..., :1], r"returned \[1, 4, 5, 1\]"),
    ("blocks.0.attn.hook_pattern", lambda t, hook: "x", "returned str"),
    ("blocks.0.hook_resid_pre", lambda t, hook: t[0], r"returned \[5, 64\]"),
])
def test_a_wrong_return_is_refused_at_the_hook_point(block, point, fn, message):
    with pytest.raises(HookReturnError, match=message) as err:
        block.run_with_hooks("ROMEO", fwd_hooks=[(point, fn)])
    assert point in str(err.value) and "\n" not in str(err.value)


def test_returns_of_the_right_form_still_intervene(block):
    plain = block("ROMEO")
    doubled = block.run_with_hooks("ROMEO", fwd_hooks=[("blocks.1.attn_res.hook_weights", lambda t, hook: t * 2)])
    assert not torch.equal(plain, doubled)
    looked = block.run_with_hooks("ROMEO", fwd_hooks=[("blocks.1.attn_res.hook_weights", lambda t, hook: None)])
    assert torch.equal(plain, looked)


def test_knobs_that_size_memory_or_time_are_bounded(block):
    with pytest.raises(ValueError, match=r"max_new_tokens is 1000000000; accepted values are integers in 0..100,000"):
        block.generate("ROMEO:", max_new_tokens=10**9)
    with pytest.raises(ConfigError, match=r"n_streams must be an integer in 1..64 .*got 1000000"):
        ModelConfig(d_model=16, n_heads=2, residual="hyper", n_streams=10**6)
    with pytest.raises(ConfigError, match=r"sinkhorn_iters must be an integer in 1..1000 .*got 1000000000"):
        ModelConfig(d_model=16, n_heads=2, residual="hyper", mhc=True, sinkhorn_iters=10**9)


def test_weights_that_no_longer_sum_to_one_are_noted_once_naming_the_hook(block):
    """The idiom from before unavailable columns were 0 (finding them with isnan) now drops mass silently: noted."""
    import warnings

    from attnres_probe.layers import WeightSumWarning

    def old_idiom(w, hook):
        w = w.clone()
        w[..., 0] = 0.0  # "zero the embedding", without renormalising
        return w

    with pytest.warns(WeightSumWarning, match=r"blocks.1.attn_res.hook_weights .*sum to .*not 1"):
        block.run_with_hooks("ROMEO", fwd_hooks=[("blocks.1.attn_res.hook_weights", old_idiom)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightSumWarning)
        block.run_with_hooks("ROMEO", fwd_hooks=[("blocks.1.attn_res.hook_weights", lambda w, hook: w / w.sum(-1, keepdim=True))])


def test_figures_refuses_a_label_given_twice(tmp_path, capsys):
    from attnres_probe.cli import main

    status = main(["figures", "--models", str(tmp_path), str(tmp_path), "--names", "a", "a", "--out", str(tmp_path / "f")])
    err = capsys.readouterr().err
    assert status == 2 and "--names gives 'a' more than once" in err and err.count("\n") == 1
    assert not (tmp_path / "f").exists()
