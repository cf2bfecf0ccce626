"""The shipped demo models: they load, reproduce their logged loss, and match the study's signs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnres_probe import AttnResTransformer, load_demo
from attnres_probe.config import DENSEFORMER_DEFAULTS, HYPER_DEFAULTS
from attnres_probe.demo import DEMO_NAMES, demo_config, demo_dir, demo_log, demo_validation_batches
from attnres_probe.demo_recipe import DEMO_RULES
from attnres_probe.seed_study import MODELS as STUDY_MODELS
from attnres_probe.training import evaluate


@pytest.mark.parametrize("name", DEMO_NAMES)
def test_shipped_demo_loads_validates_and_is_small(name):
    model, tok = load_demo(name)
    assert isinstance(model, AttnResTransformer) and model.cfg == demo_config(name)
    assert tok.vocab_size == 256
    files = list(demo_dir(name).iterdir())
    assert {f.name for f in files} == {"config.json", "model.safetensors", "train_log.json"}
    assert (demo_dir(name) / "model.safetensors").stat().st_size <= 4 * 2**20


def test_demo_models_share_everything_but_the_residual_rule():
    logs = {n: demo_log(n) for n in DEMO_NAMES}
    train_cfgs = {json.dumps(log["train_config"], sort_keys=True) for log in logs.values()}
    hashes = {log["data_sha256"] for log in logs.values()}
    assert len(train_cfgs) == 1 and len(hashes) == 1
    cfgs = [demo_config(n).to_dict() for n in DEMO_RULES]  # every buildable demo, shipped or not
    rule_fields = {k for kw in DEMO_RULES.values() for k in kw} | set(HYPER_DEFAULTS) | set(DENSEFORMER_DEFAULTS)
    assert "residual" in rule_fields and "block_size" in rule_fields
    for c in cfgs:
        for k in rule_fields:
            c.pop(k)
    assert all(c == cfgs[0] for c in cfgs)


@pytest.mark.parametrize("name", DEMO_NAMES)
def test_shipped_demo_gives_the_validation_loss_in_its_log(name):
    log = demo_log(name)
    model, _ = load_demo(name)
    torch.set_num_threads(torch.get_num_threads())
    loss = evaluate(model, demo_validation_batches(log))
    assert loss == pytest.approx(log["shipped"]["val_loss"], abs=2e-4)
    assert log["shipped"]["val_loss"] < log["loss"][0] - 1.0, "the demo must have learned something"


def test_unknown_demo_name_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of prenorm, full, block"):
        load_demo("dense")


V3_RUNS = Path(__file__).resolve().parents[1] / "docs" / "study" / "v3" / "runs"


@pytest.mark.parametrize("name", [n for n in DEMO_NAMES if n in STUDY_MODELS])
def test_the_shipped_demo_models_are_seed_0_of_study_v3_in_float16(name):
    """#32: the shipped models are the v3 runs of seed 0 (docs/study/v3/runs/<name>/seed0), stored in
    float16: every tensor is the run's float32 tensor rounded to float16, and the log is the run's."""
    from safetensors.torch import load_file

    run = V3_RUNS / name / "seed0"
    full = load_file(run / "model.safetensors")
    shipped = load_file(demo_dir(name) / "model.safetensors")
    assert set(full) == set(shipped)
    for key, t in full.items():
        assert shipped[key].dtype == torch.float16 and torch.equal(shipped[key], t.to(torch.float16)), key
    log, run_log = demo_log(name), json.loads((run / "train_log.json").read_text())
    assert log["train_config"] == run_log["train_config"] and log["train_config"]["split"] == "plays"
    assert log["final_val_loss"] == run_log["final_val_loss"] and log["shipped"]["from_run"] == f"{name}/seed0"


def test_validation_batches_refuse_a_different_corpus():
    log = dict(demo_log("block"), data_sha256="0" * 64)
    with pytest.raises(ValueError, match="differs between CPython versions"):
        demo_validation_batches(log)
