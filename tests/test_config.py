"""ModelConfig: JSON round trip and one clear error per bad field."""

from __future__ import annotations

import pytest

from attnres_probe import ConfigError, ModelConfig


def test_json_round_trip_preserves_every_field(tmp_path):
    cfg = ModelConfig(d_model=48, n_layers=3, n_heads=4, residual="block", block_boundaries=[2, 5], seed=7)
    path = tmp_path / "cfg.json"
    cfg.to_json(path)
    assert ModelConfig.from_json(path) == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_derived_sizes():
    cfg = ModelConfig(d_model=64, n_heads=8, n_layers=3, residual="block", block_size=4)
    assert (cfg.d_head, cfg.d_mlp, cfg.n_sublayers, cfg.n_reads) == (8, 256, 6, 7)
    assert cfg.block_starts == [0, 4] and cfg.n_sources == 3
    assert ModelConfig(n_layers=3, residual="full").n_sources == 7
    assert ModelConfig(n_layers=4, residual="block").block_starts == [0, 4]  # default block size 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=0), "d_model must be a positive integer"),
        (dict(d_model=-8), "d_model must be a positive integer"),
        (dict(n_layers=0), "n_layers must be a positive integer"),
        (dict(n_heads=0), "n_heads must be a positive integer"),
        (dict(d_head=-1), "d_head must be a positive integer"),
        (dict(d_mlp=0), "d_mlp must be a positive integer"),
        (dict(n_ctx=0), "n_ctx must be a positive integer"),
        (dict(d_vocab=0), "d_vocab must be a positive integer"),
        (dict(d_model=30, n_heads=4), "d_model=30 is not divisible by n_heads=4"),
        (dict(residual="dense"), "residual is 'dense'; accepted values are prenorm, full, block"),
        (dict(positional="rotary"), "positional is 'rotary'"),
        (dict(norm_eps=0), "norm_eps must be a number in (0, 1)"),
        (dict(seed=-1), "seed must be a non-negative integer"),
        (dict(init_std=0), "init_std must be a positive number"),
        (dict(residual="block", block_size=0), "block_size must be a positive integer"),
        (dict(residual="block", block_size=9, n_layers=4), "block_size=9 is larger than the model's 8 sublayers"),
        (dict(residual="block", block_boundaries=[0, 4]), "block_boundaries entry 0 is out of range"),
        (dict(residual="block", block_boundaries=[2, 8], n_layers=4), "block_boundaries entry 8 is out of range"),
        (dict(residual="block", block_boundaries=[4, 2]), "block_boundaries must be strictly increasing"),
        (dict(residual="block", block_boundaries=[2, 2]), "block_boundaries must be strictly increasing"),
        (dict(residual="block", block_size=2, block_boundaries=[2]), "either block_size or block_boundaries"),
        (dict(residual="full", block_size=2), "apply only to residual='block'"),
    ],
)
def test_bad_field_raises_clear_error(kwargs, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kwargs)
    assert message in str(err.value)


def test_unknown_json_field_lists_known_fields():
    with pytest.raises(ConfigError, match="unknown config field"):
        ModelConfig.from_dict({"d_model": 32, "n_layer": 2})


def test_invalid_json_text_is_reported(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(p)
