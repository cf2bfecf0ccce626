"""Attention scores and patterns (``hook_attn_scores``, ``hook_pattern``; issue #34 item 2).

The explicit attention (scores, softmax, pattern @ v) runs only while one of the two hook points
has a hook; it must equal SDPA's within rounding. Every float32 result (SDPA's and the explicit
path's) is compared with the float64 truth and held to ``C u G kappa`` (closeness.py), with the
condition numbers computed from the float64 inputs before any float32 run:

- one attention op: ``G = (1 + s_abs) (sqrt(d_head) + P)``, where ``s_abs`` is the largest
  ``sum_d |q_d k_d| / sqrt(d_head)`` (a score's rounding is ``u sqrt(d_head)`` of that, and exp
  turns an absolute score error into a relative weight error) and P terms enter the softmax's
  normaliser and every ``pattern @ v`` sum; ``kappa`` is the condition of the sum that forms each
  result (sum of the terms' magnitudes over the magnitude of the sum: :func:`attention_magnitudes`,
  checked normwise as ``rms(error) <= C u G rms(magnitudes)``, the same where a result is zero);
- a whole model: ``model_bound`` (closeness.py), kappa from ``model_conditions`` of its float64 twin.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnres_probe import AttnResTransformer
from attnres_probe.model import Attention

from closeness import UNIT_ROUNDOFF, C, assert_bounded, model_bound, model_conditions, relative_rms
from helpers import sample_tokens, tiny_model


# -- one attention op ----------------------------------------------------------------------
def attention_magnitudes(q, k, v, dz) -> dict:
    """The magnitudes of the terms that form z and the gradients dq, dk, dv of causal attention
    (each result with every term replaced by its absolute value), and ``s_abs``, in float64.

    q [B, H, P, dh]; k, v [B, Hkv, P, dh]; dz [B, H, P, dh] the upstream gradient of z. A result's
    error is bounded normwise by these: ``rms(err) <= C u G rms(magnitudes)``, which is
    ``relative error <= C u G kappa`` with ``kappa = rms(magnitudes) / rms(result)``, and stays
    meaningful where the result itself is zero (one position: the scores' gradient vanishes).
    """
    q, k, v, dz = (t.detach().double() for t in (q, k, v, dz))
    H, Hkv, P, dh = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    g = H // Hkv
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = 1.0 / math.sqrt(dh)
    causal = torch.ones(P, P, dtype=torch.bool).triu(1)
    p = torch.softmax((q @ ke.transpose(-1, -2) * scale).masked_fill(causal, float("-inf")), -1)
    s_abs = (q.abs() @ ke.abs().transpose(-1, -2) * scale).masked_fill(causal, 0.0)

    def groups(t):  # the expanded kv heads' gradients summed back over each group
        return t.unflatten(1, (Hkv, g)).sum(2)

    dp_abs = dz.abs() @ ve.abs().transpose(-1, -2)
    ds_abs = p * (dp_abs + (p * dp_abs).sum(-1, keepdim=True))  # bounds |p (dp - sum p dp)|
    return {
        "z": p @ ve.abs(),
        "dq": ds_abs @ ke.abs() * scale,
        "dk": groups(ds_abs.transpose(-1, -2) @ q.abs() * scale),
        "dv": groups(p.transpose(-1, -2) @ dz.abs()),
        "s_abs": float(s_abs.max()),
    }


def attention_growth(mag: dict, dh: int, P: int) -> float:
    """G of one attention op: ``(1 + s_abs) (sqrt(d_head) + P)`` (module docstring)."""
    return (1.0 + mag["s_abs"]) * (math.sqrt(dh) + P)


def normwise_error(actual: torch.Tensor, truth: torch.Tensor, magnitudes: torch.Tensor) -> float:
    """rms(actual - truth) / rms(magnitudes), in float64."""
    diff = (actual.detach().double() - truth.detach().double()).pow(2).mean().sqrt()
    return (diff / magnitudes.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def _hooked_attention(n_heads: int, n_kv_heads: int, d_head: int):
    """An Attention module whose pattern hook is attached (the explicit path) and one without."""
    from attnres_probe import ModelConfig

    cfg = ModelConfig(d_model=n_heads * d_head, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, n_ctx=64)
    attn = Attention(cfg)
    seen = {}
    attn.hook_pattern.register_forward_hook(lambda mod, args, out: seen.__setitem__("pattern", out))
    return attn, seen


def _run(fn, q, k, v, dz):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    z = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(z, (q, k, v), dz.to(z.dtype))
    return {"z": z.detach(), "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("sharp", [1.0, 6.0], ids=["scores~1", "sharp"])
@pytest.mark.parametrize("P", [1, 7, 33])
@pytest.mark.parametrize("H, Hkv, dh", [(4, 4, 8), (4, 2, 16), (6, 1, 8)])
def test_explicit_attention_equals_sdpa_within_the_bound(H, Hkv, dh, P, sharp):
    """Output and every input gradient of the explicit path and of SDPA (float32) within
    ``C u G kappa`` of the float64 truth, so within the sum of both bounds of each other;
    the float64 explicit path equals float64 SDPA to float64 rounding."""
    g = torch.Generator().manual_seed(P * 100 + H * 10 + Hkv)
    B = 2
    q = torch.randn(B, H, P, dh, generator=g, dtype=torch.float64) * sharp
    k = torch.randn(B, Hkv, P, dh, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, P, dh, generator=g, dtype=torch.float64)
    dz = torch.randn(B, H, P, dh, generator=g, dtype=torch.float64)
    mag = attention_magnitudes(q, k, v, dz)  # from the float64 inputs, before any float32 run
    G = attention_growth(mag, dh, P)
    attn, seen = _hooked_attention(H, Hkv, dh)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)

    truth = _run(sdpa, q, k, v, dz)
    explicit64 = _run(attn.explicit_attention, q, k, v, dz)
    for name in truth:
        assert normwise_error(explicit64[name], truth[name], mag[name]) <= C * UNIT_ROUNDOFF[torch.float64] * G, name
    f32 = [t.float() for t in (q, k, v, dz)]
    got = {"sdpa": _run(sdpa, *f32), "explicit": _run(attn.explicit_attention, *f32)}
    bound = C * UNIT_ROUNDOFF[torch.float32] * G
    for name in truth:
        for label, res in got.items():
            assert_bounded(normwise_error(res[name], truth[name], mag[name]), bound, f"{label} H={H} Hkv={Hkv} P={P}, {name}")
        assert normwise_error(got["explicit"][name], got["sdpa"][name], mag[name]) <= 2 * bound * (1 + 1e-6), name
    # the pattern the hook saw: rows sum to one, zero above the diagonal
    pattern = seen["pattern"]
    assert pattern.shape == (B, H, P, P) and pattern.dtype == torch.float32
    assert (pattern.triu(1) == 0).all()
    torch.testing.assert_close(pattern.sum(-1), torch.ones(B, H, P), rtol=0, atol=4 * P * 2.0**-24)


# -- whole models ---------------------------------------------------------------------------
CONFIGS = [
    ("prenorm", {}),
    ("full", {}),
    ("block", {"block_size": 2}),
    ("prenorm", {"n_heads": 4, "n_kv_heads": 2, "positional": "rope", "qk_norm": True}),
    ("full", {"n_heads": 4, "n_kv_heads": 1, "positional": "rope", "qk_norm": True, "mlp": "swiglu"}),
    ("block", {"n_heads": 4, "n_kv_heads": 2, "positional": "rope", "qk_norm": True, "block_size": 3}),
]


def _twin(model: AttnResTransformer, dtype=torch.float32) -> AttnResTransformer:
    other = AttnResTransformer(model.cfg, backend="torch").to(dtype).eval()
    other.load_state_dict(model.state_dict())
    return other


def _loss_terms(tokens):
    def fn(model):
        logits = model(tokens)
        terms = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
        return logits, terms

    return fn


def _results(model, tokens) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    logits, terms = _loss_terms(tokens)(model)
    loss = terms.mean()
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    out = {"logits": logits.detach(), "loss": loss.detach()}
    out.update({n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)})
    return out


def _explicit_everywhere(model) -> list:
    """Attach to every layer's hook_pattern a hook that returns a copy of the pattern: an intervention
    that changes no value, so the output is ``pattern @ v``, the explicit path (an observing hook
    would leave the output SDPA's)."""
    seen = []

    def copy(x, hook):
        seen.append(hook.name)
        return x.clone()

    for block in model.blocks:
        block.attn.hook_pattern.add_hook(copy)
    return seen


@pytest.mark.parametrize("residual, kw", CONFIGS, ids=[f"{r}-{'gqa-rope-qknorm' if kw.get('positional') else 'mha'}" for r, kw in CONFIGS])
def test_models_with_pattern_hooks_give_sdpas_logits_loss_and_every_gradient(residual, kw):
    """PreNorm, Full and Block, with grouped-query heads, rotary positions and q/k norms: the
    float32 model computing every attention explicitly (pattern @ v) and the one on SDPA are each
    within ``model_bound`` of the float64 twin on the logits, the loss and every parameter's
    gradient, so within twice that bound of each other."""
    model = tiny_model(residual, n_layers=3, **kw)
    tokens = sample_tokens(9, batch=2)
    model64 = _twin(model, torch.float64)
    cond = model_conditions(model64, _loss_terms(tokens))
    truth = _results(model64, tokens)
    sdpa, explicit = _twin(model), _twin(model)
    seen = _explicit_everywhere(explicit)
    got_sdpa, got_explicit = _results(sdpa, tokens), _results(explicit, tokens)
    assert len(seen) == model.cfg.n_layers  # the explicit path ran in every layer
    for name, t in truth.items():
        bound = model_bound(model.cfg, cond[name])
        assert_bounded(relative_rms(got_sdpa[name], t), bound, f"sdpa, {name}")
        assert_bounded(relative_rms(got_explicit[name], t), bound, f"explicit, {name}")
        assert relative_rms(got_explicit[name], got_sdpa[name]) <= 2 * bound * (1 + 1e-6), name


# -- hook semantics --------------------------------------------------------------------------
@pytest.mark.parametrize("residual, kw", CONFIGS[:3] + CONFIGS[4:5])
def test_hooks_that_only_look_leave_the_forward_and_its_gradients_bit_for_bit(residual, kw):
    """A cache of every scores and pattern (TransformerLens's run_with_cache) does not change one
    bit of the logits, the loss or any gradient: the output stays SDPA's unless a hook changes the
    scores or the pattern (or a backward hook needs the pattern in the graph)."""
    model = tiny_model(residual, n_layers=2, **kw)
    tokens = sample_tokens(9, batch=2)
    plain = _results(model, tokens)
    looked = []
    for block in model.blocks:
        for hp in (block.attn.hook_attn_scores, block.attn.hook_pattern):
            hp.add_hook(lambda x, hook: looked.append(x.detach().clone()))
    try:
        hooked = _results(model, tokens)
    finally:
        model.reset_hooks()
    assert len(looked) == 2 * model.cfg.n_layers  # every layer's scores and pattern
    for name, t in plain.items():
        torch.testing.assert_close(hooked[name], t, rtol=0, atol=0, msg=name)


@pytest.fixture
def count_explicit(monkeypatch):
    calls = []
    original = Attention.explicit_attention

    def counted(self, *args, **kw):
        calls.append(self)
        return original(self, *args, **kw)

    monkeypatch.setattr(Attention, "explicit_attention", counted)
    return calls


def test_without_pattern_hooks_the_forward_is_sdpa(count_explicit):
    model = tiny_model("full")
    tokens = sample_tokens(8)
    model(tokens)
    model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_weights") or n.endswith("hook_z"))
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: None)]):
        model(tokens)
    assert count_explicit == []


def test_run_with_cache_names_filter_and_hooks_use_the_explicit_path_where_asked(count_explicit):
    model = tiny_model("block", n_layers=3)
    tokens = sample_tokens(8)
    plain = model(tokens)
    logits, cache = model.run_with_cache(tokens, names_filter="blocks.1.attn.hook_pattern")
    assert count_explicit == [model.blocks[1].attn]  # that layer only; the others stay on SDPA
    assert list(cache.keys()) == ["blocks.1.attn.hook_pattern"]
    assert cache["pattern", 1].shape == (2, model.cfg.n_heads, 8, 8)
    torch.testing.assert_close(logits, plain, rtol=0, atol=0)  # hooks that only look: SDPA's output, bit for bit
    count_explicit.clear()
    _, cache = model.run_with_cache(tokens)  # everything: every layer's scores and pattern
    assert len(count_explicit) == model.cfg.n_layers
    assert cache["attn_scores", 0].shape == cache["pattern", 0].shape == (2, model.cfg.n_heads, 8, 8)
    count_explicit.clear()
    with model.hooks(bwd_hooks=[("blocks.2.attn.hook_attn_scores", lambda g, hook: None)]):
        model(tokens, return_type="loss").backward()  # a backward hook alone needs the scores too
    assert count_explicit == [model.blocks[2].attn]
    count_explicit.clear()
    model(tokens)
    assert count_explicit == []  # hooks removed: back to SDPA


def test_scores_and_pattern_follow_transformer_lens_conventions():
    model = tiny_model("full", n_heads=4, n_kv_heads=2, positional="rope")
    tokens = sample_tokens(7, batch=1)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "attn.hook_" in n)
    q, k = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_k"]  # [batch, pos, head, d_head], before rotary
    rot = model.blocks[0].attn.rotary
    q, k = rot(q).transpose(1, 2), rot(k).transpose(1, 2).repeat_interleave(2, 1)
    want = (q @ k.transpose(-1, -2)) / math.sqrt(model.cfg.d_head)
    scores, pattern = cache["blocks.0.attn.hook_attn_scores"], cache["blocks.0.attn.hook_pattern"]
    above = torch.ones(7, 7, dtype=torch.bool).triu(1)
    assert torch.isneginf(scores[..., above]).all() and (pattern[..., above] == 0).all()
    torch.testing.assert_close(scores[..., ~above], want[..., ~above], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pattern, torch.softmax(scores, -1))
    z = cache["blocks.0.attn.hook_z"]  # [batch, pos, head, d_head]
    v = cache["blocks.0.attn.hook_v"].transpose(1, 2).repeat_interleave(2, 1)
    torch.testing.assert_close(z, (pattern @ v).transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_hooks_that_return_scores_or_patterns_are_interventions():
    model = tiny_model("full", n_layers=2)
    tokens = sample_tokens(6, batch=1)
    uniform = lambda x, hook: torch.ones_like(x).tril() / torch.arange(1, x.shape[-1] + 1, dtype=x.dtype)[:, None]  # noqa: E731
    flat = lambda x, hook: torch.where(torch.isinf(x), x, torch.zeros_like(x))  # noqa: E731  (zero scores: uniform)
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", uniform)]):
        a, cache_a = model.run_with_cache(tokens, names_filter="blocks.1.attn.hook_z")
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_attn_scores", flat)]):
        b, cache_b = model.run_with_cache(tokens, names_filter=["blocks.1.attn.hook_z", "blocks.1.attn.hook_pattern"])
    plain = model(tokens)
    assert (a - plain).abs().max() > 1e-4  # the output changed
    torch.testing.assert_close(a, b)  # uniform pattern, directly or from zero scores
    torch.testing.assert_close(cache_b["blocks.1.attn.hook_pattern"], uniform(cache_b["blocks.1.attn.hook_pattern"], None))
    # z is the running mean of the values under the uniform pattern
    z = cache_a["blocks.1.attn.hook_z"][0]  # [pos, head, d_head]
    _, cache_v = model.run_with_cache(tokens, names_filter="blocks.1.attn.hook_v")
    v = cache_v["blocks.1.attn.hook_v"][0]
    torch.testing.assert_close(z, v.cumsum(0) / torch.arange(1, 7)[:, None, None], rtol=1e-5, atol=1e-6)


def test_hook_points_are_listed_in_the_hook_dict():
    model = tiny_model("prenorm", n_layers=2)
    for i in range(2):
        assert f"blocks.{i}.attn.hook_attn_scores" in model.hook_dict
        assert f"blocks.{i}.attn.hook_pattern" in model.hook_dict


def test_scores_a_hook_masks_entirely_give_a_zero_pattern_row_not_nan():
    """As TransformerLens: a row the scores hook sets to -inf everywhere softmaxes to NaN, which the
    pattern shows as 0 (that query then reads nothing: z is 0 there)."""
    model = tiny_model("full", n_layers=1)
    tokens = sample_tokens(5, batch=1)

    def mask_row(x, hook):
        x = x.clone()
        x[:, :, 3, :] = float("-inf")
        return x

    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_attn_scores", mask_row)]):
        logits, cache = model.run_with_cache(tokens, names_filter=["blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z"])
    pattern, z = cache["blocks.0.attn.hook_pattern"], cache["blocks.0.attn.hook_z"]
    assert (pattern[:, :, 3] == 0).all() and torch.isfinite(pattern).all() and torch.isfinite(logits).all()
    assert (z[:, 3] == 0).all() and (z[:, 2] != 0).any()
