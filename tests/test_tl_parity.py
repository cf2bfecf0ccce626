"""TransformerLens calls where users reach first (issue #34, items 3 and 4).

Text in and out (``model.tokenizer``, ``to_tokens``, ``to_str_tokens``, ``to_string``,
``generate``) on the byte-level demo and tiny models and on an fla checkpoint with its own
tokenizer; and every public helper of TransformerLens's ``ActivationCache``: it works and
matches a hand computation in float64, or it raises one error naming the routing-aware
alternative (``Probe.logit_lens``, ``Probe.logit_contributions``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformer_lens import ActivationCache

from attnres_probe import ByteTokenizer, Probe, load_demo
from attnres_probe.activation_cache import AttnResCache

from helpers import sample_tokens, sources_of_reads, tiny_model

ROUTING_AWARE = r"Probe\(model\)\.logit_lens.*Probe\(model\)\.logit_contributions"


@pytest.fixture(scope="module")
def demo():
    return load_demo("block")[0]


def _gains(model, seed: int = 7):
    """Non-unit norm gains everywhere, so that a helper that forgets one is caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "ln_final.weight":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def _hf_tokenizer(words, **special):
    """A word-level Hugging Face tokenizer built in memory (nothing downloaded)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **special)


# -- model.tokenizer, to_tokens, to_str_tokens, to_string -----------------------------------
def test_the_tokenizer_is_bytes_for_a_256_vocabulary_settable_and_none_safe():
    model = tiny_model("prenorm")
    assert isinstance(model.tokenizer, ByteTokenizer) and model.tokenizer is model.tokenizer
    model.tokenizer = None
    assert model.tokenizer is None
    assert model.to_tokens("ab").tolist() == [[97, 98]]  # a 256-token model still reads bytes
    other = tiny_model("prenorm", d_vocab=100)
    assert other.tokenizer is None
    with pytest.raises(ValueError, match="to_tokens needs a tokenizer.*100 tokens.*set model.tokenizer"):
        other.to_tokens("ab")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        other.to_string([1, 2])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        other.generate("ab", max_new_tokens=1)
    assert other.generate(torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=False).shape == (1, 4)  # ids need none
    with pytest.raises(TypeError, match="must be a tokenizer"):
        model.tokenizer = 42


def test_to_tokens_as_transformer_lens_users_write_it(demo):
    tokens = demo.to_tokens("To be")
    assert tokens.tolist() == [[84, 111, 32, 98, 101]]
    assert tokens.dtype == torch.long and tokens.device == demo.device
    assert torch.equal(demo.to_tokens("To be", prepend_bos=False), tokens)
    assert torch.equal(demo.to_tokens("To be", prepend_bos=None, padding_side="right"), tokens)
    assert demo.to_tokens(["abc", "xyz"]).tolist() == [[97, 98, 99], [120, 121, 122]]
    with pytest.raises(ValueError, match=r"2 texts of different token lengths \(2, 3\).*no attention mask"):
        demo.to_tokens(["ab", "xyz"])
    with pytest.raises(ValueError, match=r"prepend_bos=True.*ByteTokenizer.*has no BOS token.*prepend_bos=False or None"):
        demo.to_tokens("To be", prepend_bos=True)
    with pytest.raises(ValueError, match="text is empty"):
        demo.to_tokens("")
    with pytest.raises(ValueError, match="padding_side is 'middle'"):
        demo.to_tokens("ab", padding_side="middle")
    long = "x" * (demo.cfg.n_ctx + 5)
    with pytest.raises(ValueError, match=f"{demo.cfg.n_ctx + 5} tokens.*context is {demo.cfg.n_ctx}.*truncate=True"):
        demo.to_tokens(long)
    assert demo.to_tokens(long, truncate=True).shape == (1, demo.cfg.n_ctx)
    assert torch.equal(demo(long, truncate=True), demo(demo.to_tokens(long, truncate=True)))  # the forward reads text the same way


def test_to_str_tokens_and_to_string(demo):
    assert demo.to_str_tokens("To be\n") == ["T", "o", " ", "b", "e", "\\n"]  # the toolkit's byte labels
    assert demo.to_str_tokens("é") == ["é", "·"]
    ids = demo.to_tokens("To be")
    want = ["T", "o", " ", "b", "e"]
    assert demo.to_str_tokens(ids) == want  # [1, pos]
    assert demo.to_str_tokens(ids[0]) == want  # [pos]
    assert demo.to_str_tokens(ids[0].tolist()) == want  # list of ids
    assert demo.to_str_tokens(torch.tensor(84)) == ["T"]
    assert demo.to_str_tokens(["ab", "c"]) == [["a", "b"], ["c"]]
    assert demo.to_str_tokens(torch.tensor([[97, 98], [99, 100]])) == [["a", "b"], ["c", "d"]]
    assert demo.to_str_tokens([[97], [98, 99]]) == [["a"], ["b", "c"]]
    with pytest.raises(ValueError, match=r"token id 300 is out of range.*0\.\.255"):
        demo.to_str_tokens([97, 300])

    assert demo.to_string(ids[0]) == "To be"
    assert demo.to_string(ids) == ["To be"]  # [batch, pos] -> one str per row, as TransformerLens
    assert demo.to_string([72, 105]) == "Hi"
    assert demo.to_string(demo.to_tokens(["abc", "xyz"])) == ["abc", "xyz"]
    text = "Ünïcode\tand bytes"
    assert demo.to_string(demo.to_tokens(text)[0]) == text
    with pytest.raises(TypeError, match="takes token ids; for text use to_tokens"):
        demo.to_string("abc")
    with pytest.raises(TypeError, match="integer token ids"):
        demo.to_string(torch.tensor([1.0, 2.0]))
    assert demo.to_single_token("a") == 97
    with pytest.raises(ValueError, match="'ab' is 2 tokens, not one"):
        demo.to_single_token("ab")


def test_a_hugging_face_tokenizer_set_on_the_model_gives_bos_labels_and_eos():
    model = tiny_model("prenorm")
    words = ["[UNK]", "<s>", "</s>", "to", "be", "or", "not"]
    model.tokenizer = _hf_tokenizer(words, bos_token="<s>", eos_token="</s>")
    assert model.to_tokens("to be or").tolist() == [[3, 4, 5]]
    assert model.to_tokens("to be or", prepend_bos=True).tolist() == [[1, 3, 4, 5]]
    assert model.to_str_tokens("to be", prepend_bos=True) == ["<s>", "to", "be"]
    assert model.to_string([3, 4, 6]) == "to be not"
    assert model.to_single_token("not") == 6
    # stop_at_eos: a hook that makes </s> the only likely token stops generation after one step
    force = _force_token_hook(model, 2)
    with model.hooks(fwd_hooks=[("hook_resid_final", force)]):
        out = model.generate("to be", max_new_tokens=5, do_sample=False, return_type="tokens")
        assert out.tolist() == [[3, 4, 2]]
        full = model.generate("to be", max_new_tokens=5, do_sample=False, stop_at_eos=False, return_type="tokens")
        assert full.tolist() == [[3, 4, 2, 2, 2, 2, 2]]
        assert model.generate("to be", max_new_tokens=5, do_sample=False) == "to be"  # special tokens skipped


# -- generate --------------------------------------------------------------------------------
def _greedy_by_hand(model, tokens: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            logits = model(tokens[:, -model.cfg.n_ctx :])[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


def _force_token_hook(model, token: int):
    """A hook on hook_resid_final that makes ``token`` the argmax wherever its unembedding
    column is the longest (Cauchy-Schwarz): h = U[:, t] / gain, so ln_final(h) is parallel to U[:, t]."""

    def hook(h, hook):
        return (model.unembed[:, token] / model.ln_final.weight).expand_as(h).clone()

    return hook


def _longest_column(model) -> int:
    return int(model.unembed.norm(dim=0).argmax())


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_greedy_generation_is_the_argmax_loop(residual):
    model = tiny_model(residual)
    prompt = sample_tokens(5, batch=2)
    want = _greedy_by_hand(model, prompt, 6)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), want)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, temperature=0, seed=3), want)  # temperature 0 is greedy
    assert torch.equal(model.generate(prompt, max_new_tokens=6, top_k=1, seed=4), want)  # one candidate left
    assert torch.equal(model.generate(prompt, max_new_tokens=6, top_p=1e-9, seed=5), want)  # the likeliest stays
    assert torch.equal(model.generate(prompt, max_new_tokens=0), prompt)


def test_sampling_is_softmax_over_temperature_from_a_local_seeded_generator():
    model = tiny_model("full")
    prompt = sample_tokens(4, batch=1)
    g = torch.Generator().manual_seed(11)
    tokens = prompt
    with torch.no_grad():
        for _ in range(8):
            probs = torch.softmax(model(tokens)[:, -1] / 0.7, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)], dim=1)
    state = torch.random.get_rng_state()
    got = model.generate(prompt, max_new_tokens=8, temperature=0.7, seed=11)
    assert torch.equal(got, tokens)
    model.generate(prompt, max_new_tokens=3)  # unseeded sampling: a fresh local generator
    assert torch.equal(torch.random.get_rng_state(), state), "generate disturbed the global RNG"


def test_a_seed_reproduces_a_sample_and_other_seeds_differ(demo):
    a = demo.generate("ROMEO:", max_new_tokens=16, seed=1)
    assert isinstance(a, str) and a.startswith("ROMEO:") and len(demo.to_tokens(a)[0]) == 6 + 16
    assert demo.generate("ROMEO:", max_new_tokens=16, seed=1) == a
    others = {demo.generate("ROMEO:", max_new_tokens=16, seed=s) for s in (2, 3)}
    assert others - {a}, "different seeds gave the same sample"
    greedy = demo.generate("ROMEO:", max_new_tokens=16, do_sample=False)
    assert demo.generate("ROMEO:", max_new_tokens=16, do_sample=False, seed=9) == greedy  # the seed does not matter


def test_return_types(demo):
    ids = demo.to_tokens("To be")
    assert isinstance(demo.generate("To be", max_new_tokens=3, do_sample=False), str)
    out = demo.generate("To be", max_new_tokens=3, do_sample=False, return_type="tokens")
    assert out.shape == (1, 8) and torch.equal(out[:, :5], ids)
    assert torch.equal(demo.generate(ids, max_new_tokens=3, do_sample=False), out)  # ids in, ids out
    assert torch.equal(demo.generate(ids[0], max_new_tokens=3, do_sample=False), out)  # [pos] in, [1, pos] out
    assert demo.generate(ids, max_new_tokens=3, do_sample=False, return_type="str") == demo.to_string(out[0])
    texts = demo.generate(["To be", "ROMEO"], max_new_tokens=3, do_sample=False)
    assert isinstance(texts, list) and texts[0] == demo.to_string(out[0])
    with pytest.raises(ValueError, match="different token lengths"):
        demo.generate(["To be", "or"], max_new_tokens=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens is -1; accepted values are integers in 0..100,000"),
        ({"max_new_tokens": 2.5}, "max_new_tokens is 2.5"),
        ({"temperature": -0.5}, r"temperature is -0.5; accepted values are finite numbers >= 0 \(0: greedy\)"),
        ({"top_k": 0}, r"top_k is 0; accepted values are None \(every token\) or integers >= 1"),
        ({"top_p": 0.0}, r"top_p is 0.0; accepted values are None \(every token\) or numbers in \(0, 1\]"),
        ({"return_type": "logits"}, "return_type is 'logits'; accepted values are 'input', 'str', 'tokens'"),
        ({"seed": "1"}, "seed is '1'"),
        ({"eos_token_id": "x"}, "eos_token_id is 'x'"),
        ({"prepend_bos": True}, "has no BOS token"),
    ],
)
def test_bad_generate_arguments_say_what_is_accepted(kwargs, message):
    model = tiny_model("prenorm")
    with pytest.raises(ValueError, match=message):
        model.generate("ab", **kwargs)


def test_hooks_act_at_every_generation_step():
    model = tiny_model("block")
    prompt = sample_tokens(5, batch=1)
    target = _longest_column(model)
    plain = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert (plain[0, 5:] != target).any(), "pick another target: the model already generates it"
    force = _force_token_hook(model, target)
    with model.hooks(fwd_hooks=[("hook_resid_final", force)]):
        forced = model.generate(prompt, max_new_tokens=6, do_sample=False)
        sampled = model.generate(prompt, max_new_tokens=6, seed=0, temperature=0.05)
    assert forced[0, 5:].tolist() == [target] * 6
    assert sampled[0, 5:].tolist() == [target] * 6
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), plain)  # the context removed them

    seen = []
    model.add_hook("blocks.0.attn_res.hook_weights", lambda w, hook: seen.append((w.shape[1], torch.is_grad_enabled())))
    try:
        model.generate(prompt, max_new_tokens=4, do_sample=False)
    finally:
        model.reset_hooks()
    assert seen == [(5, False), (6, False), (7, False), (8, False)]  # one full forward per step, no KV cache, no grad


def test_the_context_window_slides_over_the_last_n_ctx_tokens():
    model = tiny_model("full")  # n_ctx 24
    n_ctx = model.cfg.n_ctx
    prompt = sample_tokens(n_ctx - 3, batch=1)
    lengths = []
    model.add_hook("hook_embed", lambda e, hook: lengths.append(e.shape[1]))
    try:
        out = model.generate(prompt, max_new_tokens=7, do_sample=False)
    finally:
        model.reset_hooks()
    assert lengths == [21, 22, 23, 24, 24, 24, 24]
    assert torch.equal(out, _greedy_by_hand(model, prompt, 7))
    longer = sample_tokens(n_ctx + 6, batch=1)  # a prompt longer than the context: its last n_ctx tokens
    out = model.generate(longer, max_new_tokens=2, do_sample=False)
    assert torch.equal(out[:, -2:], _greedy_by_hand(model, longer[:, -n_ctx:], 2)[:, -2:])


@pytest.mark.parametrize("train", [True, False])
def test_generate_keeps_the_mode_and_needs_no_grad(train):
    model = tiny_model("prenorm").train(train)
    out = model.generate(sample_tokens(3, batch=1), max_new_tokens=2, seed=0)
    assert model.training is train and not out.requires_grad


# -- a model loaded from an fla checkpoint folder ----------------------------------------------
def test_an_fla_checkpoint_reads_and_writes_text_with_its_own_tokenizer(tmp_path):
    pytest.importorskip("fla")
    from attnres_probe import load_pretrained

    from test_pretrained import _saved  # the tiny fla checkpoint of tests/test_pretrained.py

    _saved(tmp_path, 2)
    model, tokenizer = load_pretrained(tmp_path)
    assert model.tokenizer is tokenizer
    tokens = model.to_tokens("def x ( y )")
    assert torch.equal(tokens, tokenizer.to_tokens("def x ( y )"))
    assert model.to_str_tokens("def x ( y )") == ["def", "x", "(", "y", ")"]
    assert model.to_string(tokens[0]) == "def x ( y )"
    assert model.to_string(tokens) == ["def x ( y )"]
    out = model.generate("def x", max_new_tokens=4, do_sample=False, return_type="tokens")
    assert torch.equal(out, _greedy_by_hand(model, tokens[:, :2], 4))
    assert model.generate("def x", max_new_tokens=4, do_sample=False) == model.to_string(out[0])
    with pytest.raises(ValueError, match="has no BOS token"):
        model.to_tokens("def", prepend_bos=True)
    bare, none = load_pretrained(tmp_path, tokenizer=False)
    assert none is None and bare.tokenizer is None  # a 96-token vocabulary: bytes cannot serve it
    with pytest.raises(ValueError, match="to_tokens needs a tokenizer.*96 tokens"):
        bare.to_tokens("def x")


# -- ActivationCache helpers ---------------------------------------------------------------------
def _run(model, tokens):
    with torch.no_grad():
        return model.run_with_cache(tokens)


def _scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.double().pow(2).mean(-1, keepdim=True) + eps).sqrt()


def test_apply_ln_to_stack_divides_by_the_scale_of_the_norm_that_reads_it():
    model = _gains(tiny_model("prenorm", norm_eps=0.1))  # an eps large enough to matter
    assert model.cfg.normalization_type == "RMS" and model.cfg.attn_only is False
    tokens = sample_tokens(7)
    _, cache = _run(model, tokens)
    eps = model.cfg.norm_eps
    stack = torch.randn(3, *cache["hook_embed"].shape)
    for layer, mlp_input, read in [(None, False, "hook_resid_final"), (1, False, "blocks.1.hook_resid_pre"),
                                   (0, True, "blocks.0.hook_resid_mid")]:
        got = cache.apply_ln_to_stack(stack, layer, mlp_input=mlp_input)
        want = stack.double() / _scale(cache[read], eps)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    # the model's own final norm is that scale times its gain
    h = cache["hook_resid_final"]
    torch.testing.assert_close(cache.apply_ln_to_stack(h[None])[0] * model.ln_final.weight, model.ln_final(h), rtol=1e-5, atol=1e-6)
    # pos and batch slices, and a cache without its batch dimension
    got = cache.apply_ln_to_stack(stack[:, :, 2:5], pos_slice=[2, 3, 4], batch_slice=[1])  # the batch slice cuts both
    torch.testing.assert_close(got.double(), stack[:, 1:, 2:5].double() / _scale(h[1:, 2:5], eps), rtol=1e-6, atol=0)
    _, single = _run(model, tokens[:1])
    single.remove_batch_dim()
    got = single.apply_ln_to_stack(stack[:, 0], has_batch_dim=False)
    torch.testing.assert_close(got.double(), stack[:, 0].double() / _scale(single["hook_resid_final"], eps), rtol=1e-6, atol=0)


def test_apply_ln_to_stack_names_the_cached_input_it_needs():
    model = tiny_model("prenorm")
    with torch.no_grad():
        _, cache = model.run_with_cache(sample_tokens(5), names_filter=lambda n: n == "hook_embed")
    with pytest.raises(KeyError, match="apply_ln needs hook_resid_final in the cache"):
        cache.apply_ln_to_stack(cache["hook_embed"][None])


def test_logit_attrs_on_prenorm_add_up_to_the_logits_by_hand_in_float64():
    model = _gains(tiny_model("prenorm"))
    tokens = sample_tokens(7)
    logits, cache = _run(model, tokens)
    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed", "pos_embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    targets = tokens[:, 1:]  # the next token at every position but the last
    attrs = cache.logit_attrs(stack[:, :, :-1], targets, pos_slice=slice(0, -1))
    assert attrs.shape == (6, 2, 6)
    # by hand, float64: each piece over the final norm's scale, dotted with gain * W_U[:, token]
    s = _scale(cache["hook_resid_final"][:, :-1], model.cfg.norm_eps)
    directions = (model.ln_final.weight.double()[:, None] * model.unembed.double())[:, targets].movedim(0, -1)
    want = ((stack[:, :, :-1].double() / s) * directions).sum(-1)
    torch.testing.assert_close(attrs.double(), want, rtol=1e-5, atol=1e-6)
    got_logits = logits[:, :-1].gather(-1, targets[..., None])[..., 0].double()
    torch.testing.assert_close(attrs.double().sum(0), got_logits, rtol=1e-5, atol=1e-5)
    # one token for every position (an int, a one-token str), and a logit difference
    a, b = 97, 98
    one = cache.logit_attrs(stack, a)
    torch.testing.assert_close(one.sum(0).double(), logits[..., a].double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.logit_attrs(stack, "a"), one)
    diff = cache.logit_attrs(stack, a, incorrect_tokens=b)
    torch.testing.assert_close(diff.sum(0).double(), (logits[..., a] - logits[..., b]).double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual", ["full", "block"])
def test_logit_attrs_of_the_final_reads_weighted_sources_are_probes_logit_contributions(residual):
    """Under AttnRes logit_attrs is well defined for a stack that adds up to the final read:
    its sources times their weights. That is Probe.logit_contributions."""
    model = _gains(tiny_model(residual))
    tokens = sample_tokens(7)
    _, cache = _run(model, tokens)
    sources = sources_of_reads(model, cache)[-1]
    weights = cache["out_res.hook_weights"]
    stack = torch.stack([weights[..., i : i + 1] * v for i, v in enumerate(sources)])
    torch.testing.assert_close(stack.sum(0), cache["hook_resid_final"], rtol=1e-5, atol=1e-5)
    target = 65
    attrs = cache.logit_attrs(stack, target)  # (sources, batch, pos)
    lc = Probe(model).logit_contributions(tokens, token=4, batch=1)
    torch.testing.assert_close(attrs[:, 1, 4].double(), torch.from_numpy(lc.contributions[:, target]), rtol=1e-5, atol=1e-6)


def test_tokens_to_residual_directions_fold_the_final_gain_into_the_unembedding():
    model = _gains(tiny_model("full"))
    folded = model.ln_final.weight[:, None] * model.unembed
    torch.testing.assert_close(model.tokens_to_residual_directions(5), folded[:, 5])
    torch.testing.assert_close(model.tokens_to_residual_directions("a"), folded[:, 97])
    torch.testing.assert_close(model.tokens_to_residual_directions(torch.tensor(7)), folded[:, 7])
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert model.tokens_to_residual_directions(ids).shape == (2, 3, model.cfg.d_model)
    torch.testing.assert_close(model.tokens_to_residual_directions(ids)[1, 2], folded[:, 6])
    with pytest.raises(ValueError, match="token id 256 is out of range"):
        model.tokens_to_residual_directions(torch.tensor([1, 256]))


@pytest.mark.parametrize("residual", ["prenorm", "full"])
def test_head_and_neuron_results_are_the_sublayer_outputs_by_hand(residual):
    model = tiny_model(residual, qkv_bias=True)
    _, cache = _run(model, sample_tokens(6))
    cache.compute_head_results()
    H, dh = model.cfg.n_heads, model.cfg.d_head
    for layer, block in enumerate(model.blocks):
        result = cache[f"blocks.{layer}.attn.hook_result"]  # (batch, pos, head, d_model)
        assert result.shape[-2:] == (H, model.cfg.d_model)
        z, W = cache[f"blocks.{layer}.attn.hook_z"].double(), block.attn.W_O.weight.double()  # W: (d_model, H*dh)
        for h in range(H):
            torch.testing.assert_close(result[..., h, :].double(), z[..., h, :] @ W[:, h * dh : (h + 1) * dh].T, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result.sum(-2), cache[f"blocks.{layer}.hook_attn_out"], rtol=1e-5, atol=1e-5)
        neurons = cache.get_neuron_results(layer)  # (batch, pos, d_mlp, d_model)
        torch.testing.assert_close(neurons.sum(-2) + block.mlp.W_out.bias, cache[f"blocks.{layer}.hook_mlp_out"], rtol=1e-5, atol=1e-5)
        p = torch.randn(model.cfg.d_model)
        torch.testing.assert_close(cache.get_neuron_results(layer, project_output_onto=p), neurons @ p, rtol=1e-5, atol=1e-5)
        some = cache.get_neuron_results(layer, neuron_slice=[3, 5], pos_slice=-1)
        torch.testing.assert_close(some, neurons[:, -1, [3, 5]])


def test_prenorm_stacks_and_the_full_decomposition_add_up_to_the_stream():
    model = _gains(tiny_model("prenorm"))
    logits, cache = _run(model, sample_tokens(6))
    final = cache["hook_resid_final"]
    heads, labels = cache.stack_head_results(return_labels=True, incl_remainder=True)
    assert labels[:3] == ["L0H0", "L0H1", "L1H0"] and labels[-1] == "remainder"
    torch.testing.assert_close(heads.sum(0), final, rtol=1e-5, atol=1e-5)
    for expand in (True, False):
        stack, labels = cache.get_full_resid_decomposition(expand_neurons=expand, return_labels=True)
        assert labels[-3:] == ["embed", "pos_embed", "bias"]
        torch.testing.assert_close(stack.sum(0), final, rtol=1e-5, atol=1e-4)
    mid, _ = cache.get_full_resid_decomposition(layer=1, mlp_input=True, return_labels=True)
    torch.testing.assert_close(mid.sum(0), cache["blocks.1.hook_resid_mid"], rtol=1e-5, atol=1e-4)
    bias = model.blocks[0].mlp.W_out.bias + model.blocks[1].mlp.W_out.bias
    torch.testing.assert_close(model.accumulated_bias(2), bias)
    torch.testing.assert_close(model.accumulated_bias(2, include_mlp_biases=False), torch.zeros_like(bias))
    p = torch.randn(model.cfg.d_model, 3)
    folded = cache.stack_neuron_results(2, apply_ln=True, project_output_onto=p)
    unfolded = cache.apply_ln_to_stack(cache.stack_neuron_results(2), 2) @ p
    torch.testing.assert_close(folded, unfolded, rtol=1e-5, atol=1e-6)
    # the logit lens recipe cache.logit_lens's refusal names: its last row is the model's logits
    accum = cache.accumulated_resid(apply_ln=True)
    torch.testing.assert_close(accum[-1] @ model.unembed, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "helper, args",
    [("accumulated_resid", ()), ("decompose_resid", ()), ("get_full_resid_decomposition", ()), ("logit_lens", ()),
     ("stack_head_results", ()), ("stack_neuron_results", (1,))],
)
@pytest.mark.parametrize("residual", ["full", "block"])
def test_attnres_caches_refuse_residual_sums_naming_the_routing_aware_helpers(residual, helper, args):
    model = tiny_model(residual)
    _, cache = _run(model, sample_tokens(5))
    with pytest.raises(ValueError, match=f"cache.{helper}.*weighted mixture.*" + ROUTING_AWARE):
        getattr(cache, helper)(*args)
    with pytest.raises(ValueError, match=ROUTING_AWARE):
        getattr(cache.apply_slice_to_batch_dim(0), helper)(*args)  # a slice is an AttnResCache too
    with pytest.raises(ValueError, match="accumulated_bias.*" + ROUTING_AWARE):
        model.accumulated_bias(1)


def test_prenorm_logit_lens_and_ssm_helpers_refuse_with_the_alternative():
    model = tiny_model("prenorm")
    _, cache = _run(model, sample_tokens(5))
    with pytest.raises(ValueError, match=r"Probe\(model\)\.logit_lens.*accumulated_resid\(apply_ln=True\) @ model.unembed"):
        cache.logit_lens()
    assert cache.ssm_layers() == []
    for helper in ("compute_ssm_state", "compute_ssm_effective_attention"):
        with pytest.raises(RuntimeError, match="has none.*Probe\\(model\\)\\.run"):
            getattr(cache, helper)()


# every public helper of TransformerLens's ActivationCache, called as a user would
CALLS = {
    "accumulated_resid": lambda c, t: c.accumulated_resid(apply_ln=True),
    "apply_ln_to_stack": lambda c, t: c.apply_ln_to_stack(c["hook_embed"][None]),
    "apply_slice_to_batch_dim": lambda c, t: c.apply_slice_to_batch_dim(0),
    "compute_head_results": lambda c, t: c.compute_head_results(),
    "compute_ssm_effective_attention": lambda c, t: c.compute_ssm_effective_attention(),
    "compute_ssm_state": lambda c, t: c.compute_ssm_state(),
    "decompose_resid": lambda c, t: c.decompose_resid(apply_ln=True),
    "get_full_resid_decomposition": lambda c, t: c.get_full_resid_decomposition(apply_ln=True),
    "get_neuron_results": lambda c, t: c.get_neuron_results(0),
    "items": lambda c, t: list(c.items()),
    "keys": lambda c, t: list(c.keys()),
    "logit_attrs": lambda c, t: c.logit_attrs(c["hook_embed"][None], t[:, -1]),
    "logit_lens": lambda c, t: c.logit_lens(),
    "remove_batch_dim": lambda c, t: c.apply_slice_to_batch_dim([0]).remove_batch_dim(),
    "ssm_layers": lambda c, t: c.ssm_layers(),
    "stack_activation": lambda c, t: c.stack_activation("attn_out"),
    "stack_head_results": lambda c, t: c.stack_head_results(apply_ln=True),
    "stack_neuron_results": lambda c, t: c.stack_neuron_results(1, apply_ln=True),
    "to": lambda c, t: c.to("cpu"),
    "toggle_autodiff": lambda c, t: None,  # global autograd state: nothing model-specific to check
    "values": lambda c, t: list(c.values()),
}
REFUSED_UNDER_ATTNRES = {"accumulated_resid", "decompose_resid", "get_full_resid_decomposition", "logit_lens",
                         "stack_head_results", "stack_neuron_results"}


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_every_activation_cache_helper_works_or_raises_one_clear_error(residual):
    public = {n for n, _ in inspect.getmembers(ActivationCache, callable) if not n.startswith("_")}
    assert public == set(CALLS), f"TransformerLens's ActivationCache changed: review {sorted(public ^ set(CALLS))}"
    model = tiny_model(residual)
    tokens = sample_tokens(5)
    _, cache = _run(model, tokens)
    assert isinstance(cache, AttnResCache)
    for name, call in CALLS.items():
        expected_refusal = name == "logit_lens" or (residual != "prenorm" and name in REFUSED_UNDER_ATTNRES)
        try:
            call(cache, tokens)
        except (ValueError, RuntimeError) as exc:
            if name.startswith("compute_ssm"):
                assert "has none" in str(exc)
            else:
                assert expected_refusal, f"cache.{name} raised {exc!r}"
                assert "Probe(model).logit_lens" in str(exc), f"cache.{name}: {exc}"
        else:
            assert not expected_refusal and not name.startswith("compute_ssm"), f"cache.{name} should have refused"
