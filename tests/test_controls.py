"""Issue #49 item 3: the causal controls (Probe.static_routing, Probe.mask_sources) against the same
forward changed by hand, and their exact values where the answer is known."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnres_probe import Probe
from attnres_probe.losses import next_token_loss
from attnres_probe.masking import DEFAULT_SEED, masking_hooks

from helpers import route, tiny_model, uniform_routing

TEXTS = ["The quick brown fox jumps over the lazy dog, twice over. " * 2, "Pack my box with five dozen liquor jugs."]
FAMILIES = Path(__file__).resolve().parent / "fixtures" / "families"


def _model(residual="full", **kw):
    return tiny_model(residual, d_vocab=256, n_layers=3, n_ctx=32, **kw)


def _loss(model, tokens, hooks=()):
    with torch.no_grad():
        return float(next_token_loss(model.run_with_hooks(tokens, fwd_hooks=list(hooks)), tokens))


def test_static_routing_is_zero_exactly_where_routing_is_uniform_or_static():
    forced = route(_model("full"), uniform_routing)  # a model forced to route uniformly
    res = Probe(forced).static_routing(TEXTS)
    assert (res.windows["delta"] == 0).all() and res.total["mean"] == 0
    assert (res.reads["mean"] == 0).all() and len(res.reads) == 7
    from attnres_probe.pretrained import load_pretrained

    static, tok = load_pretrained(FAMILIES / "nanogpt" / "static_bs2")  # attnres4babylm's static-routing control
    text = "".join(chr(33 + i % 60) for i in range(100))
    res = Probe(static, tokenizer=tok).static_routing([text])
    assert (res.windows["delta"] == 0).all()


def test_static_routing_is_the_forward_with_each_reads_mean_weights_by_hand():
    model = _model("block")
    probe = Probe(model)
    res = probe.static_routing(TEXTS)
    names = probe.spec.weight_hooks
    # the means over every token of every window, by hand (float64)
    tokens = [torch.tensor(list(t.encode())) for t in TEXTS]
    pieces = [p.reshape(1, -1) for t in tokens for p in t.split(32) if p.numel() >= 2]
    _, caches = zip(*[model.run_with_cache(p, names_filter=lambda n: n in names) for p in pieces])
    means = {n: torch.cat([c[n].reshape(-1, c[n].shape[-1]).double() for c in caches]).mean(0) for n in names}
    for n in names:
        np.testing.assert_allclose(res.meta["means"][n], means[n].numpy(), rtol=1e-12)
    fixed = [(n, lambda w, hook, n=n: means[n].to(w.dtype).expand_as(w).clone()) for n in names]
    by_hand = [_loss(model, p, fixed) - _loss(model, p) for p in pieces]
    np.testing.assert_allclose(res.windows["delta"], by_hand, rtol=1e-6, atol=1e-7)
    assert res.total["mean"] == pytest.approx(np.mean(by_hand)) and res.total["low"] < res.total["mean"] < res.total["high"]
    one = [(names[2], fixed[2][1])]
    assert res.reads.loc[2, "mean"] == pytest.approx(np.mean([_loss(model, p, one) - _loss(model, p) for p in pieces]), abs=1e-7)
    assert res.unit == "nats per byte" and "static routing: loss change" in res.summary()


def test_masking_nonrecent_random_and_their_contrast_are_the_masked_forwards_by_hand():
    model = _model("block", block_size=2)
    probe = Probe(model)
    res = probe.mask_sources(TEXTS, which="nonrecent", repeats=3)
    pieces = [p.reshape(1, -1) for t in TEXTS for p in torch.tensor(list(t.encode())).split(32) if p.numel() >= 2]
    nonrecent = [_loss(model, p, masking_hooks(model, "nonrecent")) - _loss(model, p) for p in pieces]
    randoms = np.mean([[_loss(model, p, masking_hooks(model, "random", DEFAULT_SEED + i)) - _loss(model, p) for p in pieces]
                       for i in range(3)], axis=0)
    np.testing.assert_allclose(res.windows["delta"], nonrecent, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(res.windows["delta_random"], randoms, rtol=1e-6, atol=1e-7)
    assert res.contrast["mean"] == pytest.approx(np.mean(np.array(nonrecent) - randoms), abs=1e-7)
    assert res.contrast["repeats"] == 3 and "nonrecent − random (3 random draws)" in res.summary()
    embed = probe.mask_sources(TEXTS, which="embed")
    assert embed.contrast is None and embed.total["n"] == len(pieces)


@pytest.mark.parametrize("call, error, message", [
    (lambda p: p.static_routing(TEXTS), ValueError, "has no depth-weight hook points"),
    (lambda p: p.mask_sources(TEXTS), ValueError, "needs softmax depth routing"),
])
def test_a_model_without_depth_routing_is_refused_in_one_line(call, error, message):
    with pytest.raises(error, match=message):
        call(Probe(_model("prenorm")))


@pytest.mark.parametrize("kw, message", [({"which": "old"}, "accepted: nonrecent, random, embed"),
                                         ({"repeats": 0}, "accepted: 1..100")])
def test_masking_arguments_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        Probe(_model("full")).mask_sources(TEXTS, **kw)


def test_the_controls_command_prints_each_control_with_its_interval_and_writes_the_windows(tmp_path, capsys):
    import pandas as pd

    from attnres_probe.cli import main

    folder = tmp_path / "m"
    _model("block", block_size=2).save(folder)
    (tmp_path / "text.txt").write_text(TEXTS[0] * 3)
    out = tmp_path / "w.csv"
    assert main(["controls", "--model", str(folder), "--data", str(tmp_path / "text.txt"), "--control", "static",
                 "nonrecent", "embed", "--repeats", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "static routing: loss change" in printed and "nonrecent − random (2 random draws)" in printed
    assert "mask embed: loss change" in printed and "(95% interval over" in printed
    frame = pd.read_csv(out)
    assert set(frame["control"]) == {"static routing", "mask nonrecent", "mask embed"} and (frame["unit"] == "nats per byte").all()
    assert main(["controls", "--model", str(folder), "--data", str(tmp_path / "text.txt"), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    _model("prenorm").save(tmp_path / "p")
    assert main(["controls", "--model", str(tmp_path / "p"), "--data", str(tmp_path / "text.txt")]) == 2
    assert "--control static: " in capsys.readouterr().err
    assert main(["controls", "--model", str(folder)]) == 2
    assert "--model needs --data" in capsys.readouterr().err


def test_masking_that_drops_nothing_says_so_instead_of_a_zero(tmp_path):
    model = _model("block", block_size=6)  # 3 layers, one block: no completed block older than the newest
    with pytest.raises(ValueError, match="masking 'nonrecent' drops nothing in this model"):
        Probe(model).mask_sources(TEXTS)
