"""Hook tensors follow TransformerLens's masking (issue #34, item 1): the columns a read cannot see
are 0 in ``hook_weights`` and ``hook_contrib`` and -inf in ``hook_logits``; weights a hook returns
are used as given; a forward that turns non-finite under hooks warns once, naming the hook point."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from attnres_probe import AttnResTransformer, Probe
from attnres_probe.hook_checks import NonFiniteWarning

from helpers import sample_tokens, tiny_model

U64 = 2.0**-52

CASES = [
    ("full", "torch", None, {}),
    ("full", "numba", None, {}),
    ("block", "torch", "sequential", {"block_size": 3}),
    ("block", "torch", "two_phase", {"block_size": 3}),
    ("block", "numba", "sequential", {"block_size": 3}),
]


def _model(residual, backend, schedule, kw, n_layers=3, dtype=torch.float32):
    base = tiny_model(residual, n_layers=n_layers, **kw)
    model = AttnResTransformer(base.cfg, backend=backend, schedule=schedule).to(dtype).eval()
    model.load_state_dict(base.state_dict())
    return model


@pytest.mark.parametrize("residual, backend, schedule, kw", CASES)
def test_unseen_columns_are_zero_in_weights_and_shares_and_minus_inf_in_logits(residual, backend, schedule, kw):
    model = _model(residual, backend, schedule, kw)
    seen = {}
    for r, m in enumerate(model.mixers):
        for kind in ("weights", "logits", "contrib"):
            getattr(m, f"hook_{kind}").add_hook(lambda t, hook, r=r, kind=kind: seen.__setitem__((r, kind), t.detach().clone()))
    with torch.no_grad():
        model(sample_tokens(7))
    padded = 0
    for r, m in enumerate(model.mixers):
        k = m.visible
        assert k == model.axis.counts[r]
        w, z, c = seen[r, "weights"], seen[r, "logits"], seen[r, "contrib"]
        padded += w.shape[-1] - k
        assert (w[..., k:] == 0).all() and (c[..., k:] == 0).all(), f"read {r}: unseen columns must be 0"
        assert torch.isneginf(z[..., k:]).all(), f"read {r}: unseen logits must be -inf"
        assert torch.isfinite(w[..., :k]).all() and (w[..., :k] > 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), atol=4 * k * 2.0**-24, rtol=0)
    assert padded > 0  # the case has reads that do not see every column


def test_traces_keep_nan_for_unavailable():
    model = tiny_model("block", n_layers=3, block_size=3)
    trace = Probe(model).run(sample_tokens(7), backward=False)
    for r, k in enumerate(model.axis.counts):
        assert np.isnan(trace.depth_weights[:, :, r, k:]).all() and np.isnan(trace.contrib[:, :, r, k:]).all()
        assert np.isfinite(trace.depth_weights[:, :, r, :k]).all()


def _zero_and_renormalise(j):
    def hook(w, hook):
        w = w.clone()
        w[..., j] = 0.0
        return w / w.sum(-1, keepdim=True)

    return hook


def _drop_logit(j):
    def hook(z, hook):
        z = z.clone()
        z[..., j] = float("-inf")
        return z

    return hook


@pytest.mark.parametrize("residual, backend, schedule, kw", CASES)
def test_renormalising_hook_gives_the_finite_loss_of_dropping_the_source(residual, backend, schedule, kw):
    """The issue's hook: zero a source and divide by the row's sum. Before the masking change
    this gave NaN; now it gives the loss of the same read with that source's logit at -inf
    (softmax over the others), an independent route to the same weights w_i / (1 - w_j)."""
    tokens = sample_tokens(9)
    name, j = "blocks.1.attn_res.hook_weights", 1
    model = _model(residual, backend, schedule, kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)
        with torch.no_grad():
            got = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(name, _zero_and_renormalise(j))])
            base = model(tokens, return_type="loss")
    assert torch.isfinite(got) and abs(float(got - base)) > 1e-5  # the edit took effect

    # the hand route in float64: the source's logit at -inf, softmaxed again by the read
    m64 = _model(residual, "torch", schedule, kw, dtype=torch.float64)
    with torch.no_grad():
        want = m64.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(name.replace("weights", "logits"), _drop_logit(j))])
    # bound: float32 roundoff of a forward, u32 * (terms per dot product) * (reads + 2), times the loss' scale
    cfg = model.cfg
    bound = 2.0**-24 * (cfg.d_model + cfg.d_mlp) * (cfg.n_reads + 2) * max(1.0, abs(want.item()))
    assert abs(float(got) - float(want)) <= bound, (float(got), float(want), bound)
    # and in float64 the two routes agree to float64 roundoff
    with torch.no_grad():
        got64 = m64.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(name, _zero_and_renormalise(j))])
    assert abs(float(got64) - float(want)) <= 2.0**-52 * (cfg.d_model + cfg.d_mlp) * (cfg.n_reads + 2) * max(1.0, abs(want.item()))


@pytest.mark.parametrize("residual, backend, schedule, kw", CASES)
def test_weights_are_used_as_given_not_renormalised(residual, backend, schedule, kw):
    """Doubling every weight doubles the read exactly (x2 is exact in binary floating point). The
    baseline returns a copy of the weights, so both mixtures are recomputed the same way (the
    two-phase schedule's own mixture is merged differently, equal only to roundoff)."""
    model = _model(residual, backend, schedule, kw)
    tokens = sample_tokens(6)
    with torch.no_grad():
        with model.hooks(fwd_hooks=[("blocks.1.attn_res.hook_weights", lambda w, hook: w.clone())]):
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == "blocks.1.hook_resid_pre")
        with model.hooks(fwd_hooks=[("blocks.1.attn_res.hook_weights", lambda w, hook: w * 2)]):
            _, doubled = model.run_with_cache(tokens, names_filter=lambda n: n == "blocks.1.hook_resid_pre")
    torch.testing.assert_close(doubled["blocks.1.hook_resid_pre"], 2 * cache["blocks.1.hook_resid_pre"], atol=0, rtol=0)


def test_values_written_into_unseen_columns_are_ignored():
    model = _model("full", "torch", None, {})
    tokens = sample_tokens(6)
    k = model.mixers[2].visible

    def scribble(w, hook):
        w = w.clone()
        w[..., k:] = 5.0
        return w

    with torch.no_grad():
        base = model(tokens)
        scribbled = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn_res.hook_weights", scribble)])
    assert k < model.cfg.n_sources
    torch.testing.assert_close(scribbled, base, atol=0, rtol=0)


def test_a_non_finite_loss_under_hooks_warns_once_naming_the_hook_point():
    model = _model("full", "torch", None, {})
    tokens = sample_tokens(6)

    def everything_zero(w, hook):  # divides 0 by 0: the read turns NaN
        w = torch.zeros_like(w)
        return w / w.sum(-1, keepdim=True)

    with pytest.warns(NonFiniteWarning) as rec:
        loss = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[("blocks.1.mlp_res.hook_weights", everything_zero)])
    assert not torch.isfinite(loss)
    mine = [w for w in rec if issubclass(w.category, NonFiniteWarning)]
    assert len(mine) == 1
    msg = str(mine[0].message)
    assert "'blocks.1.mlp_res.hook_weights'" in msg and "(hooks are attached there)" in msg and "loss" in msg


def test_the_warning_names_the_first_non_finite_point_when_it_has_no_hook():
    """An inf written into an attention output: the first non-finite value is there, and every later hook point
    inherits it; the warning names the first one."""
    model = _model("block", "torch", "sequential", {"block_size": 3})
    tokens = sample_tokens(6)
    with pytest.warns(NonFiniteWarning, match=r"'blocks\.0\.hook_attn_out' \(hooks are attached there\)"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", lambda x, hook: x * float("inf"))])
    # hooks that only look (return None) do not warn when everything is finite, and a hookless forward never checks
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)
        with torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", lambda x, hook: None)])
            model(tokens)


def test_the_warning_says_why_for_a_read_that_sees_one_source_and_points_at_the_users_line():
    """The walkthrough's case: renormalising after zeroing the only source of L0.attn is 0/0."""
    model = _model("full", "torch", None, {})

    def renormalise_without_embedding(w, hook):
        w = w.clone()
        w[..., 0] = 0.0
        return w / w.sum(-1, keepdim=True)

    with pytest.warns(NonFiniteWarning) as rec:
        model.run_with_hooks(sample_tokens(5), return_type="loss", fwd_hooks=[("blocks.0.attn_res.hook_weights", renormalise_without_embedding)])
    (w,) = [w for w in rec if issubclass(w.category, NonFiniteWarning)]
    msg = str(w.message)
    assert "This read sees 1 source (columns 0..0" in msg and "sum to 0 gives 0/0" in msg and "100% of its entries" in msg
    assert w.filename == __file__  # the user's line, not transformer_lens's or torch's


def test_generate_refuses_non_finite_logits_instead_of_emitting_token_zero():
    model = _model("full", "torch", None, {})

    def poison(x, hook):
        return x * float("nan")

    with pytest.warns(NonFiniteWarning), model.hooks(fwd_hooks=[("blocks.1.hook_mlp_out", poison)]):
        with pytest.raises(ValueError, match="logits at step 0 are not finite"):
            model.generate("ab", max_new_tokens=3, do_sample=False, verbose=False)
