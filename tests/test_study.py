"""The study page (study.md) says what its comparisons set side by side (#16); the study of another seed's
models and across seeds (#21)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnres_probe.analysis.compare import Windows, compare_windows
from attnres_probe.analysis.windows import WINDOW_COLUMNS
from attnres_probe.study import FINDINGS, _page, run_seed_study, run_study, study_model

STUDY = Path(__file__).resolve().parents[1] / "docs" / "study"


def test_the_study_page_compares_like_with_like_and_warns_of_few_documents(seed_studies):
    """The demo-model study's page (``study --demo``): twelve windows of v3's seed-0 runs from three
    documents, set side by side by the one comparison engine."""
    _, (one, _) = seed_studies
    results = json.loads((one / "results.json").read_text())
    table = pd.read_csv(STUDY / "v3" / "windows.csv")
    items = []
    for name, t in table[table["seed"] == 0].groupby("model", sort=False):
        t = t.reset_index(drop=True).iloc[:12]
        keys = pd.DataFrame({"doc": np.arange(len(t)) // 4, "start": np.arange(len(t)) % 4 * 128,
                             "n_tokens": 128, "digest": [f"w{i}" for i in range(len(t))]})
        cols = t.reindex(columns=list(WINDOW_COLUMNS))
        items.append(Windows(name, name, pd.concat([keys, cols], axis=1), cols.mean()))
    frame = compare_windows(items, n_resamples=200)  # twelve windows from three documents
    page = _page(results, frame, {})
    every = page[page.index("## Every metric"):]
    assert "the same quantity, in the same unit, on the same axis" in every
    assert "weights vs shares" not in page and "contribution shares (its coefficients" not in page
    top = page[: page.index("## Findings")]  # said once, above every table
    assert "Only 3 documents: intervals are rough" in top and page.count("Only 3 documents") == 1
    loc = next(line for line in every.splitlines() if "`locality_distance`" in line)
    assert loc.count("|") > 6  # values, comparisons with uniform and with PreNorm, verdicts
    assert "(uniform " in loc  # each routing number beside its uniform reference, in its cell
    assert "log scale" in page[page.index("## Figures"):]


# -- the study of another seed's models, and across seeds (#21) --------------------------------------------


@pytest.fixture(scope="module")
def seed_studies(tmp_path_factory):
    """Two seeds of a 2-step demo recipe, each studied on 3 validation windows (the whole pipeline, tiny).

    Each seed builds the demo models the study reads (DEMO_NAMES), not every buildable one
    (DEMO_RULES): a model run_study never opens would only add its training time."""
    from attnres_probe.demo import DEMO_NAMES, build_demo_models

    root = tmp_path_factory.mktemp("seeds")
    folders = []
    for s in (1, 2):
        build_demo_models(root / f"models{s}", names=DEMO_NAMES, seed=s, work=root / "work", progress=False, steps=2,
                          warmup_steps=0, eval_every=0, probe_every=1)
        run_study(root / f"study{s}", n_windows=3, images="html", n_resamples=50, models=root / f"models{s}")
        folders.append(root / f"study{s}")
    return root, folders


def test_a_study_of_another_seeds_models_says_which_models_and_recipe(seed_studies):
    root, (one, _) = seed_studies
    results = json.loads((one / "results.json").read_text())
    assert results["training"]["seed"] == 1 and results["training"]["steps"] == 2
    page = (one / "study.md").read_text()
    assert f"--models {(root / 'models1').as_posix()}" in page and "2 steps of 16 x 128 tokens on `shakespeare`, seed 1" in page
    assert (one / "over_training.html").is_file()  # the runs' probes drawn against the training step


def test_the_study_across_seeds_draws_seeds_and_windows_and_lists_each_seeds_verdict(seed_studies, tmp_path):
    _, folders = seed_studies
    summary = run_seed_study(tmp_path / "across", folders, n_resamples=200)
    assert summary["seeds"] == [1, 2] and summary["bootstrap"]["unit"] == "seed x document (crossed)"
    assert [f["key"] for f in summary["findings"]] == [f.key for f in FINDINGS]
    for f in summary["findings"]:
        assert set(f["per_seed"]) == {"1", "2"}
        assert f["verdict"] in ("consistent", "contrary", "inconclusive")
        if f["low"] is not None:
            assert f["low"] <= f["high"]
    page = (tmp_path / "across" / "seeds.md").read_text()
    assert "1: " in page and "2: " in page and "seeds *and* documents" in page


def test_a_study_resamples_the_documents_its_windows_come_from(seed_studies):
    """Each window carries the play it was cut from (windows.csv, results.json), and the bootstrap
    draws plays: windows of one play are alike, so they must not count as independent."""
    from attnres_probe.demo import demo_validation_documents

    root, (one, _) = seed_studies
    results = json.loads((one / "results.json").read_text())
    table = pd.read_csv(one / "windows.csv")
    from attnres_probe.study import study_window_indices

    log = json.loads((root / "models1" / "block" / "train_log.json").read_text())
    every = demo_validation_documents(log)
    picked = study_window_indices(log, 3)
    assert results["bootstrap"]["unit"] == "document" and sum(results["documents"].values()) == 3
    for _, t in table.groupby("model"):
        assert t["window"].tolist() == picked.tolist()
        assert t["document"].tolist() == [every[i] for i in picked]
    # three windows of a short study come from three documents, not the first play's first three windows
    assert len(set(every[i] for i in picked)) == 3 and len(set(every[:3])) == 1
    assert study_window_indices(log, len(every)).tolist() == list(range(len(every)))


def test_findings_resample_whole_documents():
    """Twelve windows, three documents whose windows are identical: resampling windows gives a
    narrow interval that the data do not support; resampling documents (what evaluate_findings
    draws with, through the one comparison engine) gives the honest, wider one."""
    from attnres_probe.analysis.windows import WINDOW_COLUMNS
    from attnres_probe.study import evaluate_findings

    def table(loss):
        t = pd.DataFrame({c: np.full(12, np.nan) for c in WINDOW_COLUMNS})
        t["mean_loss"] = loss
        return t

    a = 2.0 + np.repeat([0.0, -0.2, 0.1], 4)  # model, per window
    windows = {"prenorm": table(np.full(12, 2.0)), "full": table(a), "block": table(a)}
    pooled = {n: {"mean_loss": float(t["mean_loss"].mean())} for n, t in windows.items()}
    docs = [f"play{i}" for i in np.repeat([0, 1, 2], 4)]

    def width(documents):
        f = next(f for f in evaluate_findings(windows, pooled, 400, 0, documents=documents) if f["key"] == "full_mean_loss")
        return f["high"] - f["low"]

    assert width(docs) > 1.5 * width(None)
    # windows from one document: no interval, so nothing is tested, however the windows and the pool point
    one = next(f for f in evaluate_findings(windows, {**pooled, "full": {"mean_loss": 1.0}}, 400, 0,
                                            documents=["play0"] * 12) if f["key"] == "full_mean_loss")
    assert (one["holds"], one["verdict"]) == ("untested", "inconclusive") and np.isnan(one["low"])
    with pytest.raises(ValueError, match="11 document labels for 12 windows"):
        evaluate_findings(windows, pooled, 400, 0, documents=docs[:11])


def test_the_study_across_seeds_refuses_mixed_recipes_and_single_seeds(seed_studies, tmp_path):
    _, (one, two) = seed_studies
    with pytest.raises(ValueError, match="at least two seeds"):
        run_seed_study(tmp_path / "x", [one])
    other = tmp_path / "other"
    other.mkdir()
    results = json.loads((two / "results.json").read_text())
    results["training"]["steps"] = 8000
    (other / "results.json").write_text(json.dumps(results))
    (other / "windows.csv").write_text((two / "windows.csv").read_text())
    with pytest.raises(ValueError, match="another recipe"):
        run_seed_study(tmp_path / "x", [one, other])
    with pytest.raises(ValueError, match="same seed"):
        run_seed_study(tmp_path / "x", [two, two])
    with pytest.raises(FileNotFoundError, match="holds no demo model"):
        study_model("block", tmp_path)


# -- any set of demo models against the baseline (#36 item 4) ------------------------------------------------


def test_a_study_sets_every_model_it_holds_against_prenorm_and_judges_only_attnres(seed_studies):
    """The seeds' folders hold DenseFormer beside PreNorm, Full and Block: the study compares it with PreNorm
    like the others (estimates, intervals) but makes no finding or verdict about it; the page says why."""
    _, (one, two) = seed_studies
    results = json.loads((one / "results.json").read_text())
    assert results["names"][0] == "prenorm" and "denseformer" in results["names"]
    assert {f["model"] for f in results["findings"]} == {"full", "block"}
    rows = [c for c in results["comparisons"] if c["model"] == "denseformer" and c["comparison"] != "value"]
    assert rows and all(r["verdict"] in (None, "") for r in rows)  # compared, not judged
    assert any(r["estimate"] is not None for r in rows)
    assert results["numbers"]["denseformer"]["val_loss_shipped"] > 0
    page = (one / "study.md").read_text()
    assert "DenseFormer: set against PreNorm like the AttnRes models" in page and "**exploratory**" in page
    assert "PreNorm baseline, Full AttnRes, Block AttnRes, mHC and DenseFormer; the same width, depth, data and steps" in page
    assert f"mhc {results['n_params']['mhc']:,}" in page  # mHC's streams add parameters: the page says so
    assert "DenseFormer's depth weights do not depend on the input (fixed parameters)" in page  # no-width intervals, said
    summary = run_seed_study(one.parent / "across-all", [one, two], n_resamples=50)
    assert "denseformer" in summary["val_loss"] and {f["model"] for f in summary["findings"]} == {"full", "block"}


def test_a_study_of_some_models_names_them_and_needs_the_baseline(seed_studies, tmp_path):
    from attnres_probe.study import study_names

    root, _ = seed_studies
    models = root / "models1"
    results = run_study(tmp_path / "s", n_windows=2, images="html", n_resamples=20, models=models,
                        names=["denseformer", "prenorm"])
    assert results["names"] == ["prenorm", "denseformer"] and results["findings"] == []
    page = (tmp_path / "s" / "study.md").read_text()
    assert "Summary, of 0 findings" in page and "(PreNorm baseline and DenseFormer; the same width, depth" in page
    assert set(pd.read_csv(tmp_path / "s" / "windows.csv")["model"]) == {"prenorm", "denseformer"}
    with pytest.raises(ValueError, match="no prenorm .*every comparison is set against the PreNorm baseline"):
        study_names(["full", "block"])
    with pytest.raises(ValueError, match="unknown demo model 'fulll'; the demo models are prenorm, full, block, mhc"):
        study_names(["prenorm", "fulll"])
    with pytest.raises(ValueError, match="named twice"):
        study_names(["prenorm", "full", "full"])
    with pytest.raises(ValueError, match="only prenorm: name at least one model"):
        study_names(["prenorm"])
    assert study_names(None, models) == [n for n in ("prenorm", "full", "block", "mhc", "denseformer")
                                         if (models / n / "model.safetensors").is_file()]
    import shutil

    two = tmp_path / "two"
    for n in ("prenorm", "full"):
        shutil.copytree(models / n, two / n)
    assert study_names(None, two) == ["prenorm", "full"]
    with pytest.raises(FileNotFoundError, match="holds no demo model"):  # named, but not in the folder
        run_study(tmp_path / "t", n_windows=2, images="html", n_resamples=20, models=two, names=["prenorm", "block"])
    assert not (tmp_path / "t").exists()  # refused before anything was written


def test_a_study_refuses_models_of_different_recipes(seed_studies, tmp_path):
    import shutil

    root, _ = seed_studies
    mixed = tmp_path / "mixed"
    for n in ("prenorm", "full"):
        shutil.copytree(root / "models1" / n, mixed / n)
    log = json.loads((mixed / "full" / "train_log.json").read_text())
    log["train_config"]["steps"] = 3
    (mixed / "full" / "train_log.json").write_text(json.dumps(log))
    with pytest.raises(ValueError, match="full was trained with another recipe than prenorm \\(steps 3 vs 2\\)"):
        run_study(tmp_path / "out", n_windows=2, images="html", n_resamples=20, models=mixed)
    assert not (tmp_path / "out").exists()


def test_the_study_command_takes_names_for_the_single_model_study_only(seed_studies, tmp_path, capsys):
    from attnres_probe.cli import main

    root, _ = seed_studies
    assert main(["study", "--runs", "x", "--names", "prenorm", "full"]) == 2
    assert "--names picks the models of the single-model study" in capsys.readouterr().err
    assert main(["study", "--models", str(root / "models1"), "--names", "full", "--out", str(tmp_path / "o")]) == 2
    assert "no prenorm" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert main(["study", "--models", str(root / "models1"), "--names", "prenorm", "denseformer", "--windows", "2",
                 "--resamples", "20", "--images", "html", "--out", str(tmp_path / "o")]) == 0
    assert "exploratory   denseformer" in capsys.readouterr().out


def test_a_study_says_what_was_wrong_with_the_models_it_was_given(seed_studies, tmp_path, capsys):
    import shutil

    from attnres_probe.cli import main
    from attnres_probe.demo import DEMO_NAMES
    from attnres_probe.study import study_names

    root, (one, two) = seed_studies
    with pytest.raises(ValueError, match="--models .*nowhere: not a folder"):
        study_names(None, tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="it holds no demo model"):
        study_names(None, empty)
    if "mhc" not in DEMO_NAMES:  # a buildable demo model not shipped: how to build it
        with pytest.raises(ValueError, match="mhc: not shipped with this version .*demo-models --only prenorm mhc --out DIR"):
            study_names(["prenorm", "mhc"])
    assert main(["study", "--seeds", str(one), str(two), "--names", "prenorm", "--out", str(tmp_path / "s")]) == 2
    assert "--seeds combines study folders" in capsys.readouterr().err
    # another shape (d_model) with the same recipe: refused, naming the field
    other = tmp_path / "shape"
    shutil.copytree(root / "models1" / "prenorm", other / "prenorm")
    shutil.copytree(root / "models1" / "full", other / "full")
    from attnres_probe import AttnResTransformer
    from attnres_probe.config import ModelConfig
    from attnres_probe.loading import load_model

    cfg = load_model(other / "full").model.cfg.to_dict()
    cfg["d_mlp"] = cfg["d_mlp"] * 2
    AttnResTransformer(ModelConfig.from_dict(cfg)).save(other / "full")  # its train_log.json stays
    with pytest.raises(ValueError, match="full has another shape than prenorm \\(d_mlp"):
        run_study(tmp_path / "o", n_windows=2, images="html", n_resamples=20, models=other)
    # a log without its train_config
    old = tmp_path / "old"
    shutil.copytree(root / "models1" / "prenorm", old / "prenorm")
    shutil.copytree(root / "models1" / "full", old / "full")
    log = json.loads((old / "full" / "train_log.json").read_text())
    del log["train_config"]
    (old / "full" / "train_log.json").write_text(json.dumps(log))
    with pytest.raises(ValueError, match="full/train_log.json: key 'train_config' is missing; it must be an object"):
        run_study(tmp_path / "o", n_windows=2, images="html", n_resamples=20, models=old)


def test_a_seed_study_without_an_attnres_model_says_there_is_no_finding(seed_studies, tmp_path, capsys):
    from attnres_probe.cli import main

    root, _ = seed_studies
    folders = []
    for s in (1, 2):
        run_study(tmp_path / f"s{s}", n_windows=2, images="html", n_resamples=20, models=root / f"models{s}",
                  names=["prenorm", "denseformer"])
        folders.append(str(tmp_path / f"s{s}"))
    assert main(["study", "--seeds", *folders, "--resamples", "50", "--out", str(tmp_path / "across")]) == 0
    assert "wrote" in capsys.readouterr().out
    page = (tmp_path / "across" / "seeds.md").read_text()
    assert "No finding: the paper's claims are about AttnRes" in page and "PreNorm baseline and DenseFormer per seed" in page
