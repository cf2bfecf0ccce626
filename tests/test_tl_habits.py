"""TransformerLens habits (issue #50): weight attributes and factored circuits, stop_at_layer,
ln_final.hook_normalized, and cache keys that do not exist under AttnRes answered with the hook to use."""

from __future__ import annotations

import pytest
import torch

from attnres_probe import AttnResTransformer, ModelConfig


@pytest.fixture(scope="module")
def gqa():
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_ctx=16, residual="full", positional="rope",
                      mlp="swiglu")
    return AttnResTransformer(cfg).eval()


def test_weight_attributes_reproduce_the_attention_and_mlp(gqa):
    cfg = gqa.cfg
    x = torch.randn(1, 5, cfg.d_model)
    attn = gqa.blocks[1].attn
    q, k, v = attn.W_QKV(x).split([cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head], -1)
    torch.testing.assert_close(torch.einsum("bpd,hde->bphe", x, gqa.W_Q[1]), q.view(1, 5, cfg.n_heads, cfg.d_head))
    k_heads = k.view(1, 5, cfg.n_kv_heads, cfg.d_head).repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=2)
    torch.testing.assert_close(torch.einsum("bpd,hde->bphe", x, gqa.W_K[1]), k_heads)
    assert gqa.W_V.shape == (2, 4, 32, 8) and gqa.W_O.shape == (2, 4, 8, 32)
    z = torch.randn(1, 5, cfg.n_heads, cfg.d_head)
    torch.testing.assert_close(torch.einsum("bphe,hed->bpd", z, gqa.W_O[1]), attn.W_O(z.reshape(1, 5, -1)))
    mlp = gqa.blocks[0].mlp
    torch.testing.assert_close(x @ gqa.W_in[0], mlp.W_in(x))
    torch.testing.assert_close(x @ gqa.W_gate[0], mlp.W_gate(x))
    assert gqa.W_out.shape == (2, cfg.d_mlp, 32) and torch.equal(gqa.b_U, torch.zeros(cfg.d_vocab))
    assert gqa.OV.shape == (2, 4, 32, 32) and gqa.QK.shape == (2, 4, 32, 32)
    torch.testing.assert_close(gqa.OV.AB, gqa.W_V @ gqa.W_O)


def test_stop_at_layer_returns_what_that_block_reads(gqa):
    tokens = torch.randint(0, 256, (2, 7))
    _, cache = gqa.run_with_cache(tokens)
    assert torch.equal(gqa(tokens, stop_at_layer=1), cache["blocks.1.hook_resid_pre"])
    assert torch.equal(gqa(tokens, stop_at_layer=2), cache["hook_resid_final"])
    assert torch.equal(gqa(tokens, stop_at_layer=-1), cache["blocks.1.hook_resid_pre"])
    with pytest.raises(ValueError, match=r"stop_at_layer is 3; accepted values are integers in -2..2"):
        gqa(tokens, stop_at_layer=3)


def test_hook_normalized_is_the_normed_input_before_the_gain(gqa):
    tokens = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        gqa.ln_final.weight.mul_(3.0)
    try:
        plain = gqa(tokens)
        logits, cache = gqa.run_with_cache(tokens, names_filter=lambda n: n in ("ln_final.hook_normalized", "hook_resid_final"))
        assert torch.equal(plain, logits)  # looking changes nothing
        h = cache["hook_resid_final"]
        torch.testing.assert_close(cache["ln_final.hook_normalized"], h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + gqa.cfg.norm_eps))
    finally:
        with torch.no_grad():
            gqa.ln_final.weight.div_(3.0)


def test_a_residual_stream_key_under_attnres_names_the_hook_to_use(gqa):
    _, cache = gqa.run_with_cache(torch.randint(0, 256, (1, 4)))
    with pytest.raises(KeyError, match="no residual stream after a block .*hook_resid_pre .*hook_resid_mid .*hook_resid_final"):
        cache["resid_post", 1]
    assert cache["resid_pre", 1].shape == (1, 4, 32)
