"""AttnResTransformer: the math of docs/design.md, hooks, causality, bookkeeping, input errors."""

from __future__ import annotations

import pytest
import torch

from attnres_probe import AttnResTransformer, ModelConfig

from helpers import mixed_input_names, sample_tokens, sources_of_reads, tiny_model, weight_hook_names


def _final_norm_out(model, tokens):
    _, cache = model.run_with_cache(tokens, names_filter="hook_resid_final")
    return model.ln_final(cache["hook_resid_final"])


@pytest.mark.parametrize("n_layers, block_size", [(1, 1), (2, 2), (3, 4), (4, 3), (6, 4)])
def test_zero_init_attnres_equals_prenorm_as_eps_goes_to_zero(n_layers, block_size):
    kw = dict(d_model=32, n_heads=4, n_layers=n_layers, n_ctx=16, seed=3, norm_eps=1e-12)
    tokens = sample_tokens(10)
    pre = AttnResTransformer(ModelConfig(residual="prenorm", **kw)).eval()
    full = AttnResTransformer(ModelConfig(residual="full", **kw)).eval()
    block = AttnResTransformer(ModelConfig(residual="block", block_size=block_size, **kw)).eval()
    with torch.no_grad():
        ref = _final_norm_out(pre, tokens)
        for other in (full, block):
            torch.testing.assert_close(_final_norm_out(other, tokens), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_layers, block_size", [(2, 2), (4, 3)])
def test_zero_init_attnres_logits_match_prenorm_at_default_eps(n_layers, block_size):
    kw = dict(d_model=32, n_heads=4, n_layers=n_layers, n_ctx=16, seed=5)
    tokens = sample_tokens(10)
    with torch.no_grad():
        ref = AttnResTransformer(ModelConfig(residual="prenorm", **kw))(tokens)
        for residual, extra in (("full", {}), ("block", {"block_size": block_size})):
            out = AttnResTransformer(ModelConfig(residual=residual, **kw, **extra))(tokens)
            torch.testing.assert_close(out, ref, atol=1e-3, rtol=0)


def test_block_with_a_boundary_after_every_sublayer_equals_full_exactly():
    full = tiny_model("full", n_layers=3)
    block = AttnResTransformer(tiny_model("block", n_layers=3, block_size=1).cfg).eval()
    block.load_state_dict(full.state_dict())
    tokens = sample_tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(block(tokens), full(tokens), atol=0, rtol=0)
    explicit = AttnResTransformer(tiny_model("block", n_layers=3, block_boundaries=[1, 2, 3, 4, 5]).cfg).eval()
    explicit.load_state_dict(full.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(explicit(tokens), full(tokens), atol=0, rtol=0)


@pytest.mark.parametrize("residual, kw", [("full", {}), ("block", {"block_size": 3}), ("block", {"block_boundaries": [1, 4]})])
def test_weights_times_sources_equal_the_mixed_input_at_every_read(residual, kw):
    model = tiny_model(residual, n_layers=3, **kw)
    _, cache = model.run_with_cache(sample_tokens(9))
    srcs = sources_of_reads(model, cache)
    for r, (wname, hname) in enumerate(zip(weight_hook_names(model), mixed_input_names(model))):
        w = cache[wname]  # [batch, pos, n_src]
        assert w.shape[-1] == model.cfg.n_sources
        k = len(srcs[r])
        torch.testing.assert_close(w[..., :k].sum(-1), torch.ones(w.shape[:-1]), atol=1e-6, rtol=0)
        assert (w[..., k:] == 0).all(), f"read {r}: unavailable columns must be 0 (TransformerLens's masked pattern)"
        assert model.mixers[r].visible == k
        assert torch.isfinite(w[..., :k]).all()
        mix = sum(w[..., i, None] * s for i, s in enumerate(srcs[r]))
        torch.testing.assert_close(mix, cache[hname], atol=1e-6, rtol=0)
        logits = cache[wname.replace("hook_weights", "hook_logits")]
        assert torch.isneginf(logits[..., k:]).all()
        torch.testing.assert_close(torch.softmax(logits[..., :k], -1), w[..., :k], atol=1e-6, rtol=0)


def test_routing_is_not_uniform_after_queries_are_set():
    model = tiny_model("full")
    _, cache = model.run_with_cache(sample_tokens(9))
    w = cache["blocks.1.mlp_res.hook_weights"][..., :4]
    assert (w.max(-1).values - w.min(-1).values).min() > 1e-3


@pytest.mark.parametrize("residual", ["full", "block"])
def test_weight_hook_intervention_reroutes_the_read(residual):
    model = tiny_model(residual, n_layers=2)
    tokens = sample_tokens(8)

    def embed_only(w, hook):
        out = torch.zeros_like(w)
        out[..., 0] = 1.0
        return out

    with torch.no_grad():
        base = model(tokens)
        logits, cache = model.run_with_cache(tokens)
        with model.hooks(fwd_hooks=[("blocks.1.attn_res.hook_weights", embed_only)]):
            _, cache_iv = model.run_with_cache(tokens)
            changed = model(tokens)
    v0 = cache["hook_embed"] + cache["hook_pos_embed"]
    torch.testing.assert_close(cache_iv["blocks.1.hook_resid_pre"], v0, atol=1e-6, rtol=0)
    assert (changed - base).abs().max() > 1e-4
    torch.testing.assert_close(cache_iv["blocks.1.attn_res.hook_weights"][..., 0], torch.ones(v0.shape[:2]))


def test_logit_hook_intervention_is_softmaxed():
    model = tiny_model("full", n_layers=1)
    tokens = sample_tokens(6)

    def prefer_embed(z, hook):
        z = z.clone()
        z[..., 0] = 1e4
        return z

    _, cache = model.run_with_cache(tokens)
    with model.hooks(fwd_hooks=[("blocks.0.mlp_res.hook_logits", prefer_embed)]):
        _, cache_iv = model.run_with_cache(tokens)
    w = cache_iv["blocks.0.mlp_res.hook_weights"]
    torch.testing.assert_close(w[..., 0], torch.ones(w.shape[:2]))
    v0 = cache["hook_embed"] + cache["hook_pos_embed"]
    torch.testing.assert_close(cache_iv["blocks.0.hook_resid_mid"], v0)


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_causality_changing_token_t_never_changes_earlier_positions(residual):
    model = tiny_model(residual, n_layers=2)
    tokens = sample_tokens(12, batch=1)
    t = 7
    other = tokens.clone()
    other[0, t] = (other[0, t] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(other)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=0, rtol=0)
    assert (a[:, t:] - b[:, t:]).abs().max() > 0


def test_block_bookkeeping_follows_the_paper_rule():
    """4 transformer layers = 8 sublayers, block_size 4: blocks [L0.attn..L1.mlp], [L2.attn..L3.mlp]."""
    model = AttnResTransformer(ModelConfig(d_model=16, n_heads=2, n_layers=4, residual="block", block_size=4))
    b1 = ("L0.attn", "L0.mlp", "L1.attn", "L1.mlp")
    expected = {
        0: [("embed",)],  # L0.attn: the embedding alone, weight 1
        1: [("embed",), ("L0.attn",)],  # L0.mlp: partial of block 1
        2: [("embed",), ("L0.attn", "L0.mlp")],
        3: [("embed",), ("L0.attn", "L0.mlp", "L1.attn")],
        4: [("embed",), b1],  # L2.attn: block 1 complete, block 2 empty
        5: [("embed",), b1, ("L2.attn",)],
        6: [("embed",), b1, ("L2.attn", "L2.mlp")],
        7: [("embed",), b1, ("L2.attn", "L2.mlp", "L3.attn")],
        8: [("embed",), b1, ("L2.attn", "L2.mlp", "L3.attn", "L3.mlp")],  # final read
    }
    assert {r: model.source_members(r) for r in range(9)} == expected
    assert model.source_labels == ["embed", "block1", "block2"]
    assert model.read_labels == ["L0.attn", "L0.mlp", "L1.attn", "L1.mlp", "L2.attn", "L2.mlp", "L3.attn", "L3.mlp", "final"]


def test_first_read_has_one_source_with_weight_one():
    model = tiny_model("block", n_layers=2)
    _, cache = model.run_with_cache(sample_tokens(5))
    w = cache["blocks.0.attn_res.hook_weights"]
    torch.testing.assert_close(w[..., 0], torch.ones(w.shape[:2]))
    assert (w[..., 1:] == 0).all()  # unseen columns: 0 at the hook


def test_every_design_hook_point_exists_and_fires():
    for residual in ("prenorm", "full", "block"):
        model = tiny_model(residual, n_layers=2)
        names = ["hook_embed", "hook_pos_embed", "hook_resid_final"]
        for i in range(2):
            names += [f"blocks.{i}.hook_{n}" for n in ("resid_pre", "attn_out", "resid_mid", "mlp_out")]
            if residual != "prenorm":
                names += [f"blocks.{i}.{m}.hook_{k}" for m in ("attn_res", "mlp_res") for k in ("logits", "weights")]
        if residual != "prenorm":
            names += ["out_res.hook_logits", "out_res.hook_weights"]
        _, cache = model.run_with_cache(sample_tokens(4))
        missing = [n for n in names if n not in cache]
        assert not missing, f"{residual}: {missing}"
        assert cache["resid_pre", 1].shape == (2, 4, 32)  # TransformerLens-style key lookup


def test_mixer_parameters_are_zero_query_and_unit_gain():
    model = AttnResTransformer(ModelConfig(d_model=16, n_heads=2, n_layers=2, residual="full"))
    assert len(model.mixers) == 5
    for m in model.mixers:
        assert torch.equal(m.query, torch.zeros(16)) and torch.equal(m.norm.weight, torch.ones(16))


def test_run_with_hooks_and_backward_gradients_reach_queries():
    model = tiny_model("block", n_layers=2)
    model.train()
    loss = model.loss(sample_tokens(8))
    loss.backward()
    for m in model.mixers[1:]:
        assert m.query.grad is not None and m.query.grad.abs().sum() > 0
        assert m.norm.weight.grad is not None and m.norm.weight.grad.abs().sum() > 0
    seen = []
    model.run_with_hooks(sample_tokens(4), fwd_hooks=[("blocks.0.hook_mlp_out", lambda x, hook: seen.append(x.shape))])
    assert seen == [(2, 4, 32)]


def test_input_errors_are_clear():
    model = tiny_model("full")
    with pytest.raises(ValueError, match="input has 30 tokens; this model's context is 24 \\(pass truncate=True"):
        model(torch.zeros(1, 30, dtype=torch.long))
    assert model(torch.zeros(1, 30, dtype=torch.long), truncate=True).shape == (1, 24, 256)
    assert model("hi").shape == (1, 2, 256)
    with pytest.raises(ValueError, match="empty"):
        model("")
    with pytest.raises(ValueError, match="empty"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="token id 300 is out of range"):
        model(torch.tensor([[1, 300]]))
    with pytest.raises(TypeError, match="integer ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="\\[batch, pos\\]"):
        model(torch.zeros(1, 2, 3, dtype=torch.long))


def test_same_seed_gives_same_shared_weights_across_modes():
    kw = dict(d_model=16, n_heads=2, n_layers=2, seed=11)
    a = AttnResTransformer(ModelConfig(residual="prenorm", **kw)).state_dict()
    b = AttnResTransformer(ModelConfig(residual="block", block_size=2, **kw)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert set(b) - set(a) and all("_res." in k or k.startswith("out_res") for k in set(b) - set(a))
