"""The shipped demo models: they load, reproduce their logged loss, and match the study's signs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnres_probe import AttnResTransformer, load_demo
from attnres_probe.demo import DEMO_NAMES, demo_config, demo_dir, demo_log, demo_validation_batches
from attnres_probe.training import evaluate

STUDY = Path(__file__).resolve().parents[1] / "docs" / "study" / "results.json"


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
    cfgs = [demo_config(n).to_dict() for n in DEMO_NAMES]
    for c in cfgs:
        c.pop("residual"), c.pop("block_size")
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


@pytest.fixture(scope="module")
def study_traces():
    from attnres_probe.study import record_validation

    results = json.loads(STUDY.read_text())
    return results, {n: record_validation(n, results["n_windows"]) for n in DEMO_NAMES}


def test_magnitude_growth_has_the_signs_the_study_reports(study_traces):
    from attnres_probe import metrics

    results, traces = study_traces
    growth = {n: metrics.magnitude_growth(t) for n, t in traces.items()}
    for n in DEMO_NAMES:
        assert growth[n]["rms_in_growth"] == pytest.approx(results["numbers"][n]["rms_in_growth"], rel=1e-3)
    pre = growth["prenorm"]
    assert results["verdicts"]["prenorm_magnitude_grows"] == (pre["rms_in_growth"] > 1 and pre["rms_in_log_slope"] > 0)
    bounded = max(growth["full"]["rms_in_growth"], growth["block"]["rms_in_growth"]) < pre["rms_in_growth"]
    assert results["verdicts"]["attnres_magnitude_bounded"] == bounded


def test_gradient_uniformity_has_the_signs_the_study_reports(study_traces):
    from attnres_probe import metrics

    results, traces = study_traces
    cv = {n: metrics.gradient_uniformity(t)["param_grad_cv"] for n, t in traces.items()}
    for n in DEMO_NAMES:
        assert cv[n] == pytest.approx(results["numbers"][n]["param_grad_cv"], rel=1e-3)
    assert results["verdicts"]["block_gradients_more_uniform"] == (cv["block"] < cv["prenorm"])
    assert results["verdicts"]["full_gradients_more_uniform"] == (cv["full"] < cv["prenorm"])


def test_every_study_verdict_holds_on_the_shipped_files(study_traces):
    from attnres_probe.study import FINDINGS, study_numbers, uniform_reference

    results, traces = study_traces
    numbers = study_numbers(traces)
    for name in ("full", "block"):
        numbers[name].update(uniform_reference(traces[name]))
    assert {key: bool(test(numbers)) for key, _, test in FINDINGS} == results["verdicts"]


def test_validation_batches_refuse_a_different_corpus():
    log = dict(demo_log("block"), data_sha256="0" * 64)
    with pytest.raises(ValueError, match="differs between CPython versions"):
        demo_validation_batches(log)
