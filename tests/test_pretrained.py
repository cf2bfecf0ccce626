"""Models from elsewhere: fla checkpoints through load_pretrained, live fla models through watch.

fla's CUDA-only pieces run as exact PyTorch stand-ins here (fla_standins.py). Logits are
compared in float32 against fla's own model; the bound 1e-5 relative (max abs difference over
max abs logit) is a few hundred float32 ulps: the two models compute the same function with
their operations in a different order (our QKV is one projection, our RMSNorm and rotary
are our own), through 3 layers of width 64.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from attnres_probe import Probe, load_pretrained, watch
from attnres_probe.loading import load_model_folder
from attnres_probe.pretrained import PretrainedError

from fla_standins import fla_on_cpu, fla_transformer

LOGIT_RTOL = 1e-5

CASES = [
    pytest.param(1, {}, id="full"),
    pytest.param(2, {"kv_heads": 2, "qk_norm": True}, id="block2-gqa-qknorm"),
    pytest.param(4, {"tied": True, "qkv_bias": True, "rope_theta": 500.0}, id="block4-tied-bias-theta500"),
    pytest.param(None, {"kv_heads": 1}, id="prenorm-mqa"),
    pytest.param(2, {"fuse_norm": False, "fuse_swiglu": False}, id="block2-unfused"),
]


def _tokenizer_files(directory, vocab_size: int) -> None:
    """A tiny word-level tokenizer saved beside the weights (tokenizer.json + config)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "def", "return", "x", "y", "(", ")", ":", "+", "=", "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words[:vocab_size])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(directory))


def _saved(tmp_path, block, **kw):
    model = fla_transformer(block, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(tmp_path))
    _tokenizer_files(tmp_path, model.config.vocab_size)
    return model


def _fla_logits(model, tokens):
    with fla_on_cpu(), torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("block, kw", CASES)
def test_load_pretrained_gives_flas_logits(tmp_path, block, kw):
    fla_model = _saved(tmp_path, block, **kw)
    ours, tokenizer = load_pretrained(tmp_path)
    tokens = torch.randint(0, fla_model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    want = _fla_logits(fla_model, tokens)
    with torch.no_grad():
        got = ours(tokens)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= LOGIT_RTOL, f"logits differ by {err:.3g} relative (limit {LOGIT_RTOL})"
    expected = "prenorm" if block is None else "full" if block == 1 else "block"
    assert ours.cfg.residual == expected and ours.cfg.positional == "rope" and ours.cfg.mlp == "swiglu"
    if block not in (None, 1):
        assert ours.block_starts == list(range(0, ours.cfg.n_sublayers, block))
    assert tokenizer.to_tokens("def x ( y )").shape == (1, 5)


@pytest.mark.parametrize("block, kw", [c for c in CASES if c.values[0] is not None])
def test_every_reads_weights_equal_the_weights_flas_op_returns(tmp_path, block, kw):
    """watch() records fla's own op output (naive_attnres standing in on the CPU); the same
    model loaded with load_pretrained records the same weights through our op, read by read
    (float32, weights within 1e-5: one softmax of the same logits computed in another order)."""
    fla_model = _saved(tmp_path, block, **kw)
    ours, _ = load_pretrained(tmp_path, tokenizer=False)
    tokens = torch.randint(0, fla_model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    ours_trace = Probe(ours).run(tokens, backward=True)
    with fla_on_cpu():
        with watch(fla_model) as session:
            out = fla_model(tokens, labels=tokens)
            out.loss.backward()
    watched = session.trace()
    assert watched.read_labels == ours_trace.read_labels and watched.source_labels == ours_trace.source_labels
    np.testing.assert_allclose(watched.depth_weights, ours_trace.depth_weights, atol=1e-5, rtol=0, equal_nan=True)
    np.testing.assert_allclose(watched.rms_in, ours_trace.rms_in, rtol=1e-5)
    np.testing.assert_allclose(watched.rms_out, ours_trace.rms_out, rtol=1e-5)
    np.testing.assert_allclose(watched.grad_in, ours_trace.grad_in, rtol=1e-4)  # a gradient through 3 layers
    np.testing.assert_allclose(watched.contrib, ours_trace.contrib, atol=1e-4, equal_nan=True)
    assert watched.meta["mean_loss"] == pytest.approx(ours_trace.meta["mean_loss"], rel=1e-6)
    assert "naive_attnres" in watched.meta["op"] and np.isnan(watched.logits).all()
    assert not watched.flags


def test_leaving_watch_restores_fla_exactly():
    import sys

    fla_model = fla_transformer(2)
    with fla_on_cpu():
        before = {n: m.fused_attnres for n, m in sys.modules.items() if n.startswith("fla.") and hasattr(m, "fused_attnres")}
        hooks_before = {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in fla_model.modules()}
        with pytest.raises(RuntimeError, match="boom"):
            with watch(fla_model):
                fla_model(torch.zeros(1, 3, dtype=torch.long))
                raise RuntimeError("boom")
        after = {n: m.fused_attnres for n, m in sys.modules.items() if n.startswith("fla.") and hasattr(m, "fused_attnres")}
        assert after == before
        assert {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in fla_model.modules()} == hooks_before


def test_watch_refuses_a_model_without_attnres_and_says_what_it_needs():
    from attnres_probe.watch import WatchError

    with pytest.raises(WatchError, match="no AttnRes"):
        with watch(fla_transformer(None)):
            pass
    with fla_on_cpu(), watch(fla_transformer(2)) as session:
        pass
    with pytest.raises(WatchError, match="nothing was recorded"):
        session.trace()


def test_a_watched_trace_works_with_metrics_figures_and_saving(tmp_path):
    from attnres_probe import DepthTrace, metrics

    fla_model = fla_transformer(2)
    with fla_on_cpu(), watch(fla_model) as session:
        fla_model(torch.randint(0, 96, (1, 8)))
    trace = session.trace()
    trace.save(tmp_path / "tr")
    again = DepthTrace.load(tmp_path / "tr")
    np.testing.assert_array_equal(again.depth_weights, trace.depth_weights)
    assert trace.heatmap(token=3).data and trace.mean_heatmap().data
    assert np.isfinite(metrics.embedding_retention(trace)["embed_weight"].to_numpy()).any()


def test_cli_folders_of_fla_checkpoints_load_with_their_tokenizer(tmp_path):
    _saved(tmp_path, 2)
    model, tokenizer = load_model_folder(tmp_path)
    trace = Probe(model, tokenizer=tokenizer).run("def x ( y ) : return x + y")
    assert trace.str_tokens[0][:3] == ["def", "x", "("]


def _edit_config(directory, **changes):
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gated_deltanet"}, "model_type is 'gated_deltanet' .*, which attnres-probe does not build; "
                                           "supported families: flash-linear-attention 'transformer' .*Qwen3-AttnRes .*nanogpt"),
        ({"attnres_block_size": 3}, "'attnres_block_size' = 3; fla accepts None .* or an even number"),
        ({"window_size": 8}, "'window_size' = 8 .* not supported"),
        ({"hidden_size": 32}, "config/weights mismatch"),
        ({"num_hidden_layers": 2}, "config/weights mismatch"),
    ],
)
def test_bad_checkpoints_are_refused_in_one_line_naming_the_cause(tmp_path, change, message):
    _saved(tmp_path, 2)
    _edit_config(tmp_path, **change)
    with pytest.raises(PretrainedError, match=message) as err:
        load_pretrained(tmp_path)
    assert "\n" not in str(err.value)


def test_a_missing_tokenizer_or_weights_file_is_named(tmp_path):
    _saved(tmp_path, 2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).unlink(missing_ok=True)
    with pytest.raises(PretrainedError, match=r"has no tokenizer files .*load_pretrained\(folder, tokenizer=False\)"):
        load_pretrained(tmp_path)
    model, tok = load_pretrained(tmp_path, tokenizer=False)
    assert tok is None
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(PretrainedError, match="has no model.safetensors"):
        load_pretrained(tmp_path, tokenizer=False)


def test_loading_an_fla_folder_prints_no_transformers_notice(tmp_path):
    """In a process that has not imported fla (a CLI run), transformers does not know the model
    type 'transformer' and prints a registry notice ("a model of type `transformer` to
    instantiate a model of type ``") about its own classes, not this load: none must show."""
    import subprocess
    import sys

    _saved(tmp_path, 2)
    code = f"from attnres_probe.pretrained import load_pretrained; load_pretrained({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "instantiate a model of type" not in done.stdout + done.stderr
