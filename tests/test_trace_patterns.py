"""Attention patterns in traces on request: ``Probe.run(..., patterns=True)``, ``trace.pattern``,
``Probe.attention_patterns``, and the patterns' save and load (trace schema 3)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from attnres_probe import DepthTrace, Probe
from attnres_probe.io import sha256_file
from attnres_probe.trace_store import SCHEMA_VERSION, TraceError

from helpers import sample_tokens, tiny_model

ARRAYS = ("depth_weights", "logits", "contrib", "rms_in", "grad_in", "rms_out", "grad_out", "param_grad", "mixer_grad", "loss")
CONFIGS = [("prenorm", {}), ("full", {}), ("block", {"n_heads": 4, "n_kv_heads": 2, "positional": "rope", "qk_norm": True})]


def hooked(model, tokens) -> np.ndarray:
    """[batch, layer, head, query, key] of every hook_pattern (TransformerLens's run_with_cache)."""
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    return np.stack([cache["pattern", i].numpy() for i in range(model.cfg.n_layers)], axis=1)


@pytest.mark.parametrize("residual, kw", CONFIGS)
def test_patterns_on_request_are_the_models_hook_patterns_and_change_nothing_else(residual, kw):
    model = tiny_model(residual, n_layers=2, **kw)
    tokens = sample_tokens(9, batch=2)
    plain = Probe(model).run(tokens, backward=True)
    trace = Probe(model).run(tokens, backward=True, patterns=True)
    assert plain.patterns is None and not plain.has_patterns and trace.has_patterns
    assert trace.patterns.dtype == np.float32 and trace.patterns.shape == (2, 2, model.cfg.n_heads, 9, 9)
    np.testing.assert_allclose(trace.patterns, hooked(model, tokens), rtol=1e-6, atol=1e-7)
    for name in ARRAYS:  # the recorded forward and backward are the plain ones, bit for bit
        np.testing.assert_array_equal(getattr(trace, name), getattr(plain, name), err_msg=name)


def test_patterns_cost_nothing_unless_asked(monkeypatch):
    from attnres_probe.model import Attention

    calls = []
    original = Attention.explicit_attention
    monkeypatch.setattr(Attention, "explicit_attention", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    model = tiny_model("full")
    Probe(model).run("The cat sat.", backward=True)
    assert calls == []
    Probe(model).run("The cat sat.", backward=True, patterns=True)
    assert len(calls) == model.cfg.n_layers  # in the recorded forward itself: every layer once


def test_the_pattern_accessor():
    model = tiny_model("block", n_layers=2, n_heads=4, n_kv_heads=2, positional="rope")
    trace = Probe(model).run("The cat sat on the mat.", patterns=True)
    n = trace.n_tokens
    row = trace.pattern(1, 2, token=5)
    assert row.shape == (n,) and abs(row.sum() - 1) < 1e-5 and (row[6:] == 0).all()
    np.testing.assert_array_equal(row, trace.patterns[0, 1, 2, 5, :n])
    np.testing.assert_array_equal(trace.pattern(-1, -2, token=-1), trace.patterns[0, 1, 2, n - 1, :n])
    assert trace.pattern(0, token=3).shape == (4, n)
    assert trace.pattern(0, 1).shape == (n, n)
    assert trace.pattern(0).shape == (4, n, n)
    for bad in ({"layer": 2, "head": 0}, {"layer": 0, "head": 4}, {"layer": 0, "head": 0, "token": n}, {"layer": 0, "batch": 1}):
        with pytest.raises(IndexError):
            trace.pattern(**bad)
    with pytest.raises(TypeError):
        trace.pattern(0.5)
    with pytest.raises(ValueError, match="patterns=True"):
        Probe(model).run("abc").pattern(0, 0, token=1)


def test_padded_batches_keep_every_sequences_patterns_over_its_real_tokens():
    model = tiny_model("full", n_layers=2)
    probe = Probe(model)
    tokens, mask, str_tokens = next(probe.batches(["The cat sat on the mat.", "A dog."], batch_size=2))
    trace = probe.record(tokens, mask, str_tokens, backward=False, patterns=True)
    assert trace.patterns.shape[0] == 2
    short = trace.pattern(0, 1, batch=1)
    assert short.shape == (6, 6)
    np.testing.assert_allclose(short, hooked(model, tokens[1:2, :6])[0, 0, 1], rtol=1e-6, atol=1e-7)  # causal: padding unseen


def test_attention_patterns_of_some_layers_and_positions_stop_after_the_last_layer():
    model = tiny_model("full", n_layers=3)
    probe = Probe(model)
    tokens = sample_tokens(7, batch=1)
    reached = []
    model.blocks[2].hook_attn_out.add_hook(lambda x, hook: reached.append(1))
    try:
        got = probe.attention_patterns(tokens, layers=[1, 0], positions=[6, 2])
        assert reached == []  # the forward ended after layer 1's attention
        assert got.shape == (1, 2, model.cfg.n_heads, 2, 7)
        want = hooked(model, tokens)
        np.testing.assert_allclose(got[0, 0], want[0, 1][:, [6, 2]], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got[0, 1], want[0, 0][:, [6, 2]], rtol=1e-6, atol=1e-7)
        assert all(not b.attn.hook_pattern._forward_hooks for b in model.blocks)  # the recorder's hooks are removed
    finally:
        model.reset_hooks()
    with pytest.raises(ValueError, match="out of range"):
        probe.attention_patterns(tokens, layers=[3])


def test_a_foreign_transformerlens_model_records_its_patterns_too():
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (registers boot_native)
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(d_model=32, d_head=8, n_layers=2, n_ctx=16, n_heads=4, d_vocab=256, act_fn="gelu", seed=0)
    bridge = TransformerBridge.boot_native(cfg)
    tokens = sample_tokens(8, batch=1)
    trace = Probe(bridge, name="tl").run(tokens, backward=False, patterns=True)
    _, cache = bridge.run_with_cache(tokens)
    np.testing.assert_allclose(trace.patterns[0, 1], cache["blocks.1.attn.hook_pattern"][0].numpy(), rtol=1e-6, atol=1e-7)


# -- save and load -------------------------------------------------------------------------------
def test_patterns_are_saved_as_lower_triangles_and_loaded_back(tmp_path):
    model = tiny_model("block", n_layers=2, n_heads=4, n_kv_heads=2, positional="rope")
    trace = Probe(model).run("The cat sat on the mat.", patterns=True)
    trace.save(tmp_path / "t")
    doc = json.loads((tmp_path / "t" / "trace.json").read_text())
    assert doc["schema_version"] == 3 and SCHEMA_VERSION == 4  # 4 only with native arrays
    assert doc["shapes"]["patterns"] == list(trace.patterns.shape) and "patterns.parquet" in doc["files"]
    P = trace.patterns.shape[-1]
    assert len(pd.read_parquet(tmp_path / "t" / "patterns.parquet")) == trace.patterns[..., 0, 0].size * P * (P + 1) // 2
    back = DepthTrace.load(tmp_path / "t")
    np.testing.assert_array_equal(back.patterns, trace.patterns)
    np.testing.assert_array_equal(back.pattern(1, 3, token=7), trace.pattern(1, 3, token=7))


def test_traces_without_patterns_save_and_load_as_before(tmp_path):
    trace = Probe(tiny_model("full")).run("The cat sat.")
    trace.save(tmp_path / "t")
    assert not (tmp_path / "t" / "patterns.parquet").exists()
    doc = json.loads((tmp_path / "t" / "trace.json").read_text())
    assert "patterns" not in doc["shapes"] and "patterns.parquet" not in doc["files"]
    assert DepthTrace.load(tmp_path / "t").patterns is None
    # a schema-2 trace (written before patterns existed) loads, without patterns
    doc["schema_version"] = 2
    (tmp_path / "t" / "trace.json").write_text(json.dumps(doc))
    old = DepthTrace.load(tmp_path / "t")
    assert old.patterns is None and np.array_equal(old.depth_weights, trace.depth_weights, equal_nan=True)


def test_a_saved_trace_with_patterns_can_be_replaced_by_one_without(tmp_path):
    model = tiny_model("full")
    Probe(model).run("The cat sat.", patterns=True).save(tmp_path / "t")
    Probe(model).run("A dog.").save(tmp_path / "t", overwrite=True)
    assert DepthTrace.load(tmp_path / "t").patterns is None


@pytest.mark.parametrize("damage", ["hash", "shape", "missing", "values"])
def test_damaged_patterns_are_refused_in_one_line(tmp_path, damage):
    trace = Probe(tiny_model("full")).run("The cat sat.", patterns=True)
    folder = tmp_path / "t"
    trace.save(folder)
    meta_path, table = folder / "trace.json", folder / "patterns.parquet"
    doc = json.loads(meta_path.read_text())
    if damage == "hash":
        pd.DataFrame({"patterns": np.zeros(len(pd.read_parquet(table)), np.float32)}).to_parquet(table, index=False)
    elif damage == "shape":
        doc["shapes"]["patterns"][3] += 1
    elif damage == "missing":
        table.unlink()
    else:
        pd.DataFrame({"patterns": np.zeros(5, np.float32)}).to_parquet(table, index=False)
        doc["files"]["patterns.parquet"] = sha256_file(table)
    meta_path.write_text(json.dumps(doc))
    with pytest.raises(TraceError) as err:
        DepthTrace.load(folder)
    assert "\n" not in str(err.value) and ("patterns" in str(err.value))


def test_a_trace_refuses_patterns_of_the_wrong_shape():
    trace = Probe(tiny_model("full")).run("The cat sat.")
    arrays = {n: getattr(trace, n) for n in ("tokens", "mask", "loss", *ARRAYS[:-1])}
    with pytest.raises(TraceError, match="patterns"):
        DepthTrace(**arrays, meta=trace.meta, patterns=np.zeros((1, 2, 2, 5, 5)))
    ok = DepthTrace(**arrays, meta=trace.meta, patterns=torch.zeros(1, 2, 2, 12, 12).numpy())
    assert ok.patterns.shape == (1, 2, 2, 12, 12)


def test_models_from_fla_record_the_patterns_flas_attention_computes(tmp_path):
    """An fla checkpoint (grouped KV heads, q/k norms, rotary) loaded into our model: the recorded
    patterns are the softmax of fla's own causal scores (q and k as fla hands them to its attention
    kernel, the CPU stand-in here), and the explicit path gives fla's logits."""
    import warnings

    from fla_standins import fla_on_cpu, fla_transformer  # skips without fla (so first, before fla itself)

    # isort: split
    import fla.layers.attn as fla_attn

    from attnres_probe import load_pretrained

    fla_model = fla_transformer(2, kv_heads=2, qk_norm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fla_model.save_pretrained(str(tmp_path))
    ours, _ = load_pretrained(tmp_path, tokenizer=False)
    tokens = torch.randint(0, fla_model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    seen = []
    with fla_on_cpu(), torch.no_grad():
        kernel = fla_attn.flash_attn_func

        def capture(q, k, v, *args, **kw):  # [batch, pos, heads, d_head], after rotary
            seen.append((q, k))
            return kernel(q, k, v, *args, **kw)

        fla_attn.flash_attn_func = capture
        want_logits = fla_model(tokens).logits
    trace = Probe(ours).run(tokens, backward=False, patterns=True)
    assert len(seen) == ours.cfg.n_layers
    for layer, (q, k) in enumerate(seen):
        q, k = q.transpose(1, 2).double(), k.transpose(1, 2).double().repeat_interleave(q.shape[2] // k.shape[2], 1)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        want = torch.softmax(scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf")), -1)
        np.testing.assert_allclose(trace.patterns[0, layer], want[0].numpy(), atol=1e-5)
    copy = [(f"blocks.{i}.attn.hook_pattern", lambda x, hook: x.clone()) for i in range(ours.cfg.n_layers)]
    with torch.no_grad(), ours.hooks(fwd_hooks=copy):
        got = ours(tokens)  # the explicit path in every layer
    assert ((got - want_logits).abs().max() / want_logits.abs().max()).item() <= 1e-5


def test_one_tokens_pattern_chart_from_a_trace():
    from attnres_probe import figures

    trace = Probe(tiny_model("full", n_layers=2)).run("The cat sat on the mat.", patterns=True)
    fig = figures.token_pattern(trace, layer=-1, head=1, token=-1)
    n = trace.n_tokens
    np.testing.assert_array_equal(fig.data[0].y, trace.pattern(1, 1, token=n - 1).astype(np.float64))
    assert list(fig.data[0].x) == list(range(n)) and fig.data[0].customdata[-1] == "."
    assert fig.layout.title.text == f"full<br>token {n - 1} '.' · layer 1 head 1<br>attention weight (softmax over key positions)"
    assert fig.layout.yaxis.title.text == "attention weight" and fig.layout.yaxis.range[0] == 0
    short = figures.token_pattern(trace, 0, 0, token=0)  # the first token sees itself only: weight 1
    assert list(short.data[0].y) == [1.0]


# -- chosen layers and heads only (issue #47: a large model at a long context) --------------------
def test_patterns_of_chosen_layers_and_heads_are_the_full_ones_sliced_and_run_only_those_layers(monkeypatch, tmp_path):
    from attnres_probe.model import Attention

    model = tiny_model("block", n_layers=3, n_heads=4, n_kv_heads=2, positional="rope")
    tokens = sample_tokens(9, batch=2)
    every = Probe(model).run(tokens, backward=True, patterns=True)
    calls = []
    original = Attention.explicit_attention
    monkeypatch.setattr(Attention, "explicit_attention", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    some = Probe(model).run(tokens, backward=True, patterns=[-1, 0], pattern_heads=[3, 1])
    assert len(calls) == 2  # only the chosen layers run the explicit attention
    assert some.pattern_layers == [0, 2] and some.pattern_heads == [1, 3] and some.patterns.shape == (2, 2, 2, 9, 9)
    np.testing.assert_array_equal(some.patterns, every.patterns[:, [0, 2]][:, :, [1, 3]])
    for name in ARRAYS:  # everything else is the recording without patterns, bit for bit
        np.testing.assert_array_equal(getattr(some, name), getattr(every, name), err_msg=name)
    np.testing.assert_array_equal(some.pattern(2, 3, token=4), every.pattern(2, 3, token=4))
    np.testing.assert_array_equal(some.pattern(-1, -1), every.pattern(2, 3))  # the model's last layer and head
    with pytest.raises(ValueError, match=r"layer 1's attention patterns were not recorded; this trace holds layers 0, 2 "
                                         r"\(record it with patterns=\[1, \.\.\.\]\)"):
        some.pattern(1, 1)
    with pytest.raises(ValueError, match=r"head 2's attention patterns were not recorded; this trace holds heads 1, 3"):
        some.pattern(0, 2)
    with pytest.raises(IndexError, match="head 4 is out of range; this trace has heads 0..3"):
        some.pattern(0, 4)
    some.save(tmp_path / "t")  # saved and loaded with its layers and heads
    back = DepthTrace.load(tmp_path / "t")
    assert back.pattern_layers == [0, 2] and back.pattern_heads == [1, 3]
    np.testing.assert_array_equal(back.patterns, some.patterns)
    from attnres_probe import figures

    fig = figures.token_pattern(back, layer=2, head=3, token=5)  # titled with the model's own numbers
    assert "layer 2 head 3" in fig.layout.title.text


@pytest.mark.parametrize("kw, error, message", [
    ({"patterns": [3]}, ValueError, r"patterns: layer 3 is out of range; the model has layers 0..1"),
    ({"patterns": []}, ValueError, r"patterns is empty"),
    ({"patterns": "0"}, TypeError, r"patterns must be True, False or a list of layers"),
    ({"patterns": [0.5]}, TypeError, r"patterns holds 0.5; layers are integers"),
    ({"patterns": True, "pattern_heads": [9]}, ValueError, r"pattern_heads: head 9 is out of range; the model has heads 0..1"),
    ({"pattern_heads": [0]}, TypeError, r"pattern_heads chooses heads of the recorded patterns"),
])
def test_a_choice_of_layers_or_heads_out_of_range_is_one_line(kw, error, message):
    with pytest.raises(error, match=message):
        Probe(tiny_model("full", n_layers=2)).run("The cat sat.", **kw)


def test_the_memory_estimate_counts_only_the_chosen_layers_and_heads():
    probe = Probe(tiny_model("full", n_layers=2, n_heads=2))
    every = probe.memory_estimate(100, patterns=True)["patterns"]
    assert every == 4 * 2 * 2 * 100 * 100
    assert probe.memory_estimate(100, patterns=[1], pattern_heads=[0])["patterns"] == every // 4
    assert probe.memory_estimate(100)["patterns"] == 0
