"""The shipped demo models: they load, reproduce their logged loss, and match the study's signs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attnres_probe import AttnResTransformer, load_demo
from attnres_probe.demo import DEMO_NAMES, demo_config, demo_dir, demo_log, demo_validation_batches, demo_validation_documents
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


def _study():
    import pandas as pd

    results = json.loads(STUDY.read_text())
    table = pd.read_csv(STUDY.parent / "windows.csv")
    windows = {n: t.drop(columns=["model", "window", "document"]).reset_index(drop=True) for n, t in table.groupby("model", sort=False)}
    documents = table[table["model"] == "prenorm"].sort_values("window")["document"].tolist()
    return results, windows, documents


def test_the_study_findings_follow_from_its_windows_and_pool():
    """Every verdict in results.json is recomputed from windows.csv (per-window values) and the pooled numbers."""
    from attnres_probe.study import evaluate_findings

    results, windows, documents = _study()
    boot = results["bootstrap"]
    assert boot["unit"] == "document" and len(set(documents)) == len(results["documents"]) > 1
    got = evaluate_findings(windows, results["pooled"], boot["n_resamples"], boot["seed"], documents=documents)
    assert {f["key"]: f["verdict"] for f in got} == results["verdicts"]
    for f, shipped in zip(got, results["findings"]):
        assert f["held"] == shipped["held"] and f["holds"] == shipped["holds"]
        if shipped["estimate"] is None:
            assert not np.isfinite(f["estimate"])
        else:
            assert f["estimate"] == pytest.approx(shipped["estimate"], rel=1e-6)
    assert all(len(w) == results["n_windows"] for w in windows.values())


def test_the_study_windows_are_what_the_shipped_models_record():
    """The first windows, recorded again (one forward and backward pass each), give the values in windows.csv."""
    from attnres_probe.analysis.windows import LATER_COLUMNS
    from attnres_probe.study import record_validation, study_windows

    _, windows, documents = _study()
    assert documents == demo_validation_documents(demo_log("block"), len(documents))
    for name in DEMO_NAMES:
        _, traces = record_validation(name, 3)
        fresh = study_windows(traces)
        cols = [c for c in fresh.columns if c in windows[name].columns]  # the shipped study predates LATER_COLUMNS
        assert len(cols) >= len(fresh.columns) - len(LATER_COLUMNS)
        shipped = windows[name].iloc[:3][cols]
        np.testing.assert_allclose(fresh[cols].to_numpy(float), shipped.to_numpy(float), rtol=2e-4, atol=1e-7, equal_nan=True)


def test_validation_batches_refuse_a_different_corpus():
    log = dict(demo_log("block"), data_sha256="0" * 64)
    with pytest.raises(ValueError, match="differs between CPython versions"):
        demo_validation_batches(log)
