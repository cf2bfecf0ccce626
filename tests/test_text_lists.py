"""Lists of equal-length texts wherever a text is taken, as TransformerLens takes them (issue #50)."""

from __future__ import annotations

import pytest

from attnres_probe import Probe
from attnres_probe.demo import load_demo


@pytest.fixture(scope="module")
def full():
    return load_demo("full")


def test_forward_cache_and_hooks_take_a_list_of_texts(full):
    model, _ = full
    batch = model(["ab", "cd"])
    assert batch.shape[:2] == (2, 2)
    single = model("cd")
    cfg = model.cfg  # two float32 runs of one function: within 2 C u G max|logit| of each other (docs/design.md)
    bound = 2 * 8 * 2.0**-24 * cfg.n_reads * (cfg.d_model**0.5 + cfg.n_sources) * float(single.abs().max())
    assert float((batch[1:] - single).abs().max()) <= bound
    _, cache = model.run_with_cache(["ab", "cd"])
    assert cache["hook_embed"].shape[:2] == (2, 2)
    seen = []
    model.run_with_hooks(["ab", "cd"], fwd_hooks=[("hook_embed", lambda x, hook: seen.append(x.shape[0]))])
    assert seen == [2]
    assert len(model.generate(["ab", "cd"], max_new_tokens=2, do_sample=False)) == 2


def test_probe_run_and_patch_take_lists(full):
    model, tok = full
    probe = Probe(model, tokenizer=tok)
    trace = probe.run(["abc", "xyz"])
    assert trace.tokens.shape == (2, 3) and trace.meta["str_tokens"][1] == ["x", "y", "z"]
    frame = probe.patch(["ROMEO: I love", "JULIET: I hate"], ["ROMEO: I hate", "JULIET: I love"])
    assert sorted(frame["pair"].unique()) == [0, 1] and len(frame.attrs["pairs"]) == 2
    one = probe.patch("JULIET: I hate", "JULIET: I love")
    assert frame[frame.pair == 1]["recovered"].tolist() == pytest.approx(one["recovered"].tolist(), nan_ok=True)


def test_unequal_lengths_are_refused_naming_them(full):
    model, tok = full
    with pytest.raises(ValueError, match=r"different token lengths \(2, 3\)"):
        model(["ab", "cde"])
    with pytest.raises(ValueError, match=r"\[2, 3\] tokens long"):
        Probe(model, tokenizer=tok).run(["ab", "cde"])
    with pytest.raises(ValueError, match="lists of texts of the same length"):
        Probe(model, tokenizer=tok).patch(["ab", "cd"], ["ab"])


def test_the_memory_estimate_adds_up_and_counts_patterns(full):
    model, tok = full
    probe = Probe(model, tokenizer=tok)
    a, b = probe.memory_estimate(64), probe.memory_estimate(128, patterns=True)
    assert a["total"] == sum(v for k, v in a.items() if k != "total")
    assert a["weights"] == sum(p.numel() for p in model.parameters()) * 4 and a["gradients"] == a["weights"]
    cfg = model.cfg
    assert b["patterns"] == 4 * cfg.n_layers * cfg.n_heads * 128 * 128
    R, S = cfg.n_reads, cfg.n_sources
    assert b["trace"] >= 12 * R * S * 128 and b["activations"] > 2 * a["activations"]
    assert probe.memory_estimate(64, backward=False)["gradients"] == 0
