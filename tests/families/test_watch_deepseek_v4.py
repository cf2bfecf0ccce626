"""watch() on transformers' own DeepseekV4ForCausalLM (mHC): a tiny one built from the class, its
hyper-connection parameters moved off their initialisation (at init pre ~ 0.5 and comb ~ uniform, which
would hide a transposed or misplaced matrix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from attnres_probe import DepthTrace, watch  # noqa: E402
from attnres_probe.watch import WatchError  # noqa: E402

U64 = 2.0**-53
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            partial_rotary_factor=0.5, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, index_n_heads=4, index_head_dim=16,
            index_topk=8, num_nextn_predict_layers=0, sliding_window=8, max_position_embeddings=256,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = DeepseekV4Config(**TINY, attn_implementation="eager", experts_implementation="eager")
    m = DeepseekV4ForCausalLM(cfg).to(torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("_hc.fn", "hc_head.hc_fn")):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
            elif name.endswith(("_hc.base", "hc_head.hc_base")):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):
                p.copy_(1 + 0.3 * torch.rand(p.shape, generator=g, dtype=p.dtype))
    return m


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def recorded(model, ids):
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    with watch(model, name="dsv4") as session:
        with torch.no_grad():
            hooked = model(input_ids=ids, use_cache=False).logits
        trace = session.trace()
        coef, V, reads = session.coefficients(), session.sources(), session.read_inputs()
    return plain, hooked, trace, coef, V, reads


def test_watching_leaves_the_logits_bit_for_bit(recorded):
    plain, hooked, *_ = recorded
    assert torch.equal(plain, hooked)


def test_the_coefficients_rebuild_every_read_and_the_final_collapse(recorded):
    """sum_i c_i v_i = the read, for the L sublayer reads and hc_head's collapse, within float64 roundoff
    times the condition of the sum (sum_i |c_i| |v_i|, elementwise), G = (L+1)(n+2) terms along the way."""
    *_, coef, V, reads = recorded
    L1 = coef.shape[-1]
    rebuilt = torch.einsum("bprs,bpsd->bprd", coef, V)
    cond = torch.einsum("bprs,bpsd->bprd", coef.abs(), V.abs())
    G = L1 * (4 + 2)
    assert coef.shape == (2, 10, L1, L1) and L1 == 2 * TINY["num_hidden_layers"] + 1
    assert ((rebuilt - reads).abs() <= 8 * U64 * G * cond).all()
    assert (coef.triu(1) == 0).all()  # a read sees only the sources written before it
    # not PreNorm in disguise: the coefficients vary over tokens and are not all one
    assert coef[..., 1:, 0].std() > 0.01 and (coef[..., -1, :] - 1).abs().max() > 0.1


def test_the_trace_is_on_the_common_axis_and_keeps_the_native_weights(recorded, tmp_path):
    *_, trace, coef, _, _ = recorded
    assert trace.residual == "hyper" and trace.meta["config"]["mhc"] and trace.meta["config"]["n_streams"] == 4
    assert trace.meta["config"]["family"] == "deepseek_v4"
    assert trace.meta["reconstruction_error"] < 1e-12
    w = trace.depth_weights
    assert np.allclose(np.nan_to_num(w), coef.numpy(), rtol=1e-6, atol=1e-6)
    assert np.isnan(w[0, 0, 0, 1])  # unavailable, not 0
    nat = trace.native
    assert nat["pre"].shape == (2, 10, 7, 4) and nat["post"].shape == (2, 10, 6, 4) and nat["comb"].shape == (2, 10, 6, 4, 4)
    assert (nat["sinkhorn_col_error"] < 1e-5).all()  # Sinkhorn ends on a column step
    assert nat["sinkhorn_row_error"].max() > nat["sinkhorn_col_error"].max()
    # read 0's coefficient on the embedding is the sum of pre (every stream holds the embedding)
    assert np.allclose(coef[:, :, 0, 0].numpy(), nat["pre"][:, :, 0].sum(-1), rtol=1e-6)
    saved = DepthTrace.load(trace.save(tmp_path / "t"))
    assert set(saved.native) == set(nat) and all(np.array_equal(saved.native[k], nat[k]) for k in nat)
    assert np.array_equal(saved.depth_weights, trace.depth_weights, equal_nan=True)
    assert np.isfinite(trace.summary()["mean_loss"] if isinstance(trace.summary(), dict) else 0.0)


def test_a_backward_gives_gradient_norms_at_every_source(model, ids):
    with watch(model) as session:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        trace = session.trace()
    model.zero_grad(set_to_none=True)
    assert trace.meta["backward"] and np.isfinite(trace.grad_out).all() and np.isfinite(trace.grad_in).all()
    assert np.isfinite(trace.loss[:, :-1]).all()


def test_a_module_that_breaks_the_contract_is_refused(model, ids):
    hc = model.model.layers[1].ffn_hc
    original = hc.forward

    def other(streams):
        post, comb, read = original(streams)
        return post * 0.5, comb, read

    hc.forward = other
    try:
        with watch(model) as session, torch.no_grad():
            model(input_ids=ids, use_cache=False)
            with pytest.raises(WatchError, match="layers.1.ffn_hc.*not DeepSeek-V4"):
                session.trace()
    finally:
        del hc.forward
    head = model.model.hc_head
    del model.model.hc_head
    try:
        with pytest.raises(WatchError, match="lacks hc_head"), watch(model):
            pass
    finally:
        model.model.hc_head = head
