"""Issue #49 item 5: plan v3's protocol on any checkpoints (``attnres-probe study --models DIR...
--baseline DIR [--data PATH] [--train-data PATH]``), by the same engine as study v3."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnres_probe import seed_study
from attnres_probe.cli import main
from attnres_probe.seed_study import PRIMARIES, assign_primaries, run_checkpoint_study, run_v3_study, seed_folders

from helpers import tiny_model

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "study" / "v3" / "runs"
FAMILIES = ROOT / "tests" / "fixtures" / "families"


def test_the_endpoint_templates_give_plan_v3s_primaries_for_block_and_full():
    assert assign_primaries([("block", "block"), ("full", "full")]) == PRIMARIES
    # other rules: Qwen3-AttnRes's cumulative states route over depth; mHC and DenseFormer get the loss only
    keys = [(p.key, p.model, p.metric) for p in assign_primaries([("qwen", "cumulative"), ("mhc", "hyper")], "nats per token")]
    assert keys == [("P1", "qwen", "mean_loss"), ("P2", "mhc", "mean_loss"), ("P3", "qwen", "locality_distance"),
                    ("P4", "qwen", "embed_vs_old_deep")]
    assert assign_primaries([("q", "cumulative")], "nats per token")[0].unit == "nats per token"


@pytest.mark.slow
def test_study_models_gives_the_v3_engines_numbers_on_the_v3_run_folders(tmp_path, monkeypatch):
    """The same runs (seeds 0 and 1 of the v3 run folders), the same windows (the first 6, to stay quick):
    the checkpoint study and study v3 give the same per-seed values, tests and verdicts."""
    runs = tmp_path / "runs"
    for model in ("prenorm", "full", "block"):
        for seed in (0, 1):
            (runs / model).mkdir(parents=True, exist_ok=True)
            (runs / model / f"seed{seed}").symlink_to(RUNS / model / f"seed{seed}")
    original = seed_study._windows

    def first_six(log):
        windows, files, plays = original(log)
        return windows[:6], files[:6], plays[:6]

    monkeypatch.setattr(seed_study, "_windows", first_six)
    v3 = run_v3_study(runs, tmp_path / "v3", progress=None)
    ours = run_checkpoint_study([runs / "block", runs / "full"], runs / "prenorm", tmp_path / "ours", progress=None)
    assert [p["key"] for p in ours["primaries"]] == [p["key"] for p in v3["primaries"]] == [f"P{i}" for i in range(1, 7)]
    for a, b in zip(ours["primaries"], v3["primaries"]):
        assert a["title"] == b["title"] and a["per_seed"] == b["per_seed"] and a["verdict"] == b["verdict"]
        assert a["p_holm"] == b["p_holm"] and a["per_play"] == b["per_play"]
    page = (tmp_path / "ours" / "study.md").read_text()
    assert page.startswith("# A seed study of block, full against prenorm")
    assert "nothing here was registered before these checkpoints were trained" in page
    assert "at this scale" not in page and "not of the models' size" in page or "consistent" in page


def _seeds(root: Path, name: str, folders: dict[int, Path]) -> Path:
    for seed, folder in folders.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / f"seed{seed}").symlink_to(folder)
    return root / name


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """Three seeds of a tiny Full model and of a tiny PreNorm model (ours, no training log), and a held-out text."""
    root = tmp_path_factory.mktemp("ckpt")
    for seed in range(3):
        tiny_model("full", seed=seed + 1, d_vocab=256).save(root / "full" / f"seed{seed}")
        tiny_model("prenorm", seed=seed + 1, d_vocab=256).save(root / "base" / f"seed{seed}")
    data = root / "heldout"
    data.mkdir()
    (data / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 8)
    words = "pack my box with five dozen liquor jugs said the sphinx of black quartz".split()
    rng = np.random.default_rng(0)  # not periodic: a chunk occurs in the training text only where it was copied
    (data / "b.txt").write_text(" ".join(rng.choice(words, 160)))
    return root


def test_a_study_of_checkpoints_on_a_held_out_text_with_a_leakage_check(ours, tmp_path, capsys):
    train = tmp_path / "train.txt"
    train.write_text("unrelated training text " * 50 + (ours / "heldout" / "b.txt").read_text()[:400])
    assert main(["study", "--models", str(ours / "full"), "--baseline", str(ours / "base"), "--data", str(ours / "heldout"),
                 "--train-data", str(train), "--seq-len", "24", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "P1 validation loss, Full" in out and "P3 embedding kept, Full" in out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["baseline"] == "base" and results["seeds"] == [0, 1, 2]
    assert set(results["windows"]["plays"]) == {"a.txt", "b.txt"} and results["windows"]["seq_len"] == 24
    leak = {d["document"]: d for d in results["leakage"]}
    assert leak["a.txt"]["found"] == 0 and leak["b.txt"]["found"] == 6 and leak["b.txt"]["checked"] > 6
    page = (tmp_path / "out" / "study.md").read_text()
    assert "## Per document" in page and "| a.txt |" in page and "the held-out text overlaps the training data" in page
    p1 = results["primaries"][0]
    assert len(p1["per_seed"]) == 3 and np.isfinite(p1["mean"])
    # the causal controls of each seed of the model (not of the baseline), and their mean over seeds
    assert [(c["model"], c["seed"]) for c in results["controls"]] == [("full", 0), ("full", 1), ("full", 2)]
    assert set(results["controls_over_seeds"]["full"]) == {"static", "nonrecent", "random", "contrast"}
    assert "## Causal controls (exploratory)" in page and "mean over seeds (95% t interval)" in page


def test_no_controls_leaves_them_out(ours, tmp_path, capsys):
    assert main(["study", "--models", str(ours / "full"), "--baseline", str(ours / "base"), "--data", str(ours / "heldout"),
                 "--seq-len", "24", "--windows", "3", "--no-controls", "--out", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["controls"] == [] and "Causal controls" not in (tmp_path / "out" / "study.md").read_text()


def test_seeds_without_a_baseline_are_left_out_and_said(ours, tmp_path):
    extra = tmp_path / "full"
    for seed in range(3):
        (extra).mkdir(exist_ok=True)
        (extra / f"seed{seed}").symlink_to(ours / "full" / f"seed{seed}")
    tiny_model("full", seed=9, d_vocab=256).save(extra / "seed7")
    results = run_checkpoint_study([extra], ours / "base", tmp_path / "o", data=ours / "heldout", seq_len=24, n_windows=4,
                                   progress=None)
    assert results["missing"] == ["full seed 7: the baseline has no seed 7 (left out)"] and "7" not in results["runs"]["full"]
    assert "full seed 7: the baseline has no seed 7" in (tmp_path / "o" / "study.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--models", "{full}", "{full}"], "several models are studied against a baseline (add --baseline DIR)"),
    (["--models", "{full}", "--data", "{data}"], "a study of checkpoints takes --models DIR... and --baseline DIR"),
    (["--models", "{full}", "--baseline", "{base}", "--train-data", "{data}"], "--train-data checks a held-out text given with --data"),
    (["--models", "{full}", "--baseline", "{base}"], "--data is needed: these checkpoints carry no training log of ours"),
    (["--models", "{data}", "--baseline", "{base}", "--data", "{data}"], "no checkpoint in it"),
    (["--models", "{full}", "--baseline", "{full}", "--data", "{data}"], "must differ"),
    (["--models", "{full}", "{full}", "--names", "a", "b", "c", "--baseline", "{base}", "--data", "{data}"], "3 names for 2"),
])
def test_a_study_of_checkpoints_says_what_is_wrong_in_one_line(ours, tmp_path, capsys, argv, message):
    argv = [a.format(full=ours / "full", base=ours / "base", data=ours / "heldout") for a in argv]
    assert main(["study", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_models_that_read_other_tokens_are_refused(ours, tmp_path):
    nanogpt = FAMILIES / "nanogpt" / "dynamic_bs4"
    models = _seeds(tmp_path, "dyn", {0: nanogpt})
    with pytest.raises(ValueError, match="tokenizes the held-out text differently|dyn's vocabulary is 0..95, but the "
                                         "held-out text has token id"):
        run_checkpoint_study([models], ours / "base", tmp_path / "o", data=ours / "heldout", progress=None)


@pytest.mark.slow
def test_public_family_folders_open_in_a_study(tmp_path, ours):
    """attnres4babylm folders (the dynamic Block model against its baseline), laid out as their public seeds."""
    dyn = _seeds(tmp_path, "dynamic", {0: FAMILIES / "nanogpt" / "dynamic_bs4"})
    base = _seeds(tmp_path, "baseline", {0: FAMILIES / "nanogpt" / "baseline"})
    text = tmp_path / "text.txt"  # within the fixture's 96-token vocabulary
    text.write_text("".join(chr(33 + i % 60) for i in range(400)))
    results = run_checkpoint_study([dyn], base, tmp_path / "o", data=text, seq_len=16, n_windows=4, progress=None)
    assert [p["metric"] for p in results["primaries"]] == ["mean_loss", "rms_out_growth", "act_grad_cv"]
    assert results["primaries"][0]["unit"] == "nats per token"
    assert set(results["runs"]) == {"baseline", "dynamic"} and len(results["runs"]["dynamic"]) == 1
    assert (tmp_path / "o" / "study.md").read_text().count("| dynamic | 0 |") >= 1
    _seeds(tmp_path, "twice", {0: FAMILIES / "nanogpt" / "dynamic_bs4", 1: FAMILIES / "nanogpt" / "dynamic_bs4"})
    with pytest.raises(ValueError, match="twice: seed 0 and seed 1 hold identical weights"):
        run_checkpoint_study([tmp_path / "twice"], base, tmp_path / "o2", data=text, progress=None)


def test_seed_folders_reads_seed_numbers_from_the_folder_names(tmp_path):
    for name in ("seed0", "run-3", "notes"):
        (tmp_path / "m" / name).mkdir(parents=True)
    for name in ("seed0", "run-3"):
        (tmp_path / "m" / name / "config.json").write_text("{}")
    assert seed_folders(tmp_path / "m", "--models") == {0: tmp_path / "m" / "seed0", 3: tmp_path / "m" / "run-3"}
    (tmp_path / "m" / "s3").mkdir()
    (tmp_path / "m" / "s3" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="run-3 and s3 both end in seed number 3"):
        seed_folders(tmp_path / "m", "--models")
    assert seed_folders(tmp_path / "m" / "seed0", "--models") == {0: tmp_path / "m" / "seed0"}
