"""Checkpoints: bit-identical round trip, clear errors, never unpickled."""

from __future__ import annotations

import json

import pytest
import torch

from attnres_probe import AttnResTransformer, CheckpointError

from helpers import sample_tokens, tiny_model


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_round_trip_is_bit_identical(tmp_path, residual):
    model = tiny_model(residual)
    model.save(tmp_path / "ckpt")
    loaded = AttnResTransformer.load(tmp_path / "ckpt").eval()
    assert loaded.cfg == model.cfg
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    tokens = sample_tokens(6)
    with torch.no_grad():
        assert torch.equal(model(tokens), loaded(tokens))


def test_fp16_storage_loads_into_fp32_model(tmp_path):
    model = tiny_model("full")
    model.save(tmp_path / "c", dtype=torch.float16)
    loaded = AttnResTransformer.load(tmp_path / "c")
    assert loaded.W_E.dtype == torch.float32
    torch.testing.assert_close(loaded.W_E, model.W_E.half().float())


def test_corrupted_weights_file_raises_clear_error(tmp_path):
    tiny_model("full").save(tmp_path / "c")
    w = tmp_path / "c" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        AttnResTransformer.load(tmp_path / "c")


def test_config_that_disagrees_with_tensors_names_the_first_mismatch(tmp_path):
    tiny_model("full").save(tmp_path / "c")
    p = tmp_path / "c" / "config.json"
    doc = json.loads(p.read_text())
    doc["config"]["n_layers"] = 3
    p.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="has no tensor 'blocks.2"):
        AttnResTransformer.load(tmp_path / "c")
    doc["config"]["n_layers"] = 2
    doc["config"]["d_mlp"] = 64
    p.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="has shape \\(128, 32\\); the config needs \\(64, 32\\)"):
        AttnResTransformer.load(tmp_path / "c")
    doc["config"]["d_mlp"] = 128
    doc["config"]["residual"] = "prenorm"
    p.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="does not define"):
        AttnResTransformer.load(tmp_path / "c")


def test_missing_pieces_and_future_versions_are_reported(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        AttnResTransformer.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        AttnResTransformer.load(tmp_path / "empty")
    tiny_model("full").save(tmp_path / "c")
    p = tmp_path / "c" / "config.json"
    doc = json.loads(p.read_text())
    doc["format_version"] = 99
    p.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="format_version 99"):
        AttnResTransformer.load(tmp_path / "c")


def test_load_never_unpickles(tmp_path, monkeypatch):
    import pickle

    tiny_model("full").save(tmp_path / "c")

    def boom(*a, **k):
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)
    AttnResTransformer.load(tmp_path / "c")
