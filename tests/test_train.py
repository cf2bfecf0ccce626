"""Training: configs and their errors, schedule, decay groups, determinism, resume, log, CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnres_probe import AttnResTransformer, ConfigError, ModelConfig
from attnres_probe.cli.train import add_train_parser
from attnres_probe.data import DataError, validation_batches
from attnres_probe.training import (
    LOG_FILE,
    STATE_FILE,
    STATE_TENSORS_FILE,
    TrainConfig,
    TrainError,
    evaluate,
    learning_rate,
    lm_loss,
    make_optimizer,
    param_groups,
    read_run_configs,
    train,
)

from helpers import tiny_config, tiny_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest (and steadiest on a shared 2-core box) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_model(residual: str = "full", **kw) -> ModelConfig:
    return tiny_config(residual, n_ctx=32, **kw)


def small_train(**kw) -> TrainConfig:
    base = dict(steps=12, batch_size=4, eval_every=4, eval_batches=2, lr=3e-3)
    base.update(kw)
    return TrainConfig(**base)


def weights(out_dir) -> dict[str, torch.Tensor]:
    return load_file(str(out_dir / "model.safetensors"))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


# -- TrainConfig ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("steps", 0, r"steps must be an integer >= 1; got 0"),
        ("batch_size", 0, r"batch_size must be an integer >= 1; got 0"),
        ("seq_len", 0, r"seq_len must be an integer >= 1"),
        ("steps", 2.5, r"steps must be an integer"),
        ("lr", 0.0, r"lr must be a number in \(0, inf\); got 0.0"),
        ("lr", float("nan"), r"lr must be a number"),
        ("min_lr_ratio", 1.5, r"min_lr_ratio must be a number in \[0, 1\]"),
        ("val_fraction", 1.0, r"val_fraction must be a number in \(0, 1\)"),
        ("weight_decay", -0.1, r"weight_decay must be a number in \[0, inf\)"),
        ("grad_clip", -1, r"grad_clip"),
        ("beta2", 1.0, r"beta2 must be a number in \[0, 1\)"),
        ("eval_every", -1, r"eval_every must be an integer >= 0"),
        ("seed", True, r"seed must be an integer"),
        ("corpus", "", r"corpus must be 'pydoc', 'shakespeare' or a path"),
    ],
)
def test_train_config_rejects_bad_values_naming_field_and_range(field, value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{field: value})


def test_warmup_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError, match=r"warmup_steps=50 is more than steps=10; accepted: 0..10"):
        TrainConfig(steps=10, warmup_steps=50)


def test_seq_len_longer_than_the_context_is_refused():
    with pytest.raises(ConfigError, match=r"seq_len=64 is longer than the model's context n_ctx=32; accepted: 1..32"):
        TrainConfig(seq_len=64).resolved(small_model())


def test_resolved_fills_seq_len_from_the_model_and_a_default_warmup():
    cfg = TrainConfig(steps=300).resolved(small_model())
    assert cfg.seq_len == 32 and cfg.warmup_steps == 30
    assert TrainConfig(steps=5000).resolved(small_model()).warmup_steps == 100


def test_resolved_makes_a_corpus_path_absolute_and_keeps_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert TrainConfig(corpus="notes.txt").resolved(small_model()).corpus == str(tmp_path.resolve() / "notes.txt")
    assert TrainConfig(corpus="pydoc").resolved(small_model()).corpus == "pydoc"


def test_train_config_round_trips_and_rejects_unknown_keys():
    cfg = TrainConfig(steps=7, corpus="x.txt")
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match=r"unknown train config field\(s\) \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 3})


# -- schedule and optimizer groups ---------------------------------------------------------
def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert [learning_rate(s, cfg) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(10, cfg) == pytest.approx(1.0)
    assert learning_rate(59, cfg) == pytest.approx(0.55, abs=0.02)  # half way down the cosine
    assert learning_rate(109, cfg) == pytest.approx(0.1)
    lrs = [learning_rate(s, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_learning_rate_without_warmup_starts_at_the_peak():
    cfg = TrainConfig(steps=5, warmup_steps=0, lr=2.0, min_lr_ratio=0.0)
    assert learning_rate(0, cfg) == pytest.approx(2.0) and learning_rate(4, cfg) == pytest.approx(0.0)


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_weight_decay_skips_norms_biases_embeddings_and_depth_mixers(residual):
    model = AttnResTransformer(small_model(residual))
    decay, rest = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in rest["params"]}
    assert decayed | kept == set(names.values()) and not decayed & kept
    assert decayed == {n for n in names.values() if n.endswith(("W_QKV.weight", "W_O.weight", "W_in.weight", "W_out.weight"))} | {"W_U"}
    assert {"W_E", "W_pos", "ln_final.weight", "blocks.0.mlp.W_in.bias"} <= kept
    if residual != "prenorm":
        assert {"out_res.query", "out_res.norm.weight", "blocks.1.attn_res.query", "blocks.0.mlp_res.norm.weight"} <= kept


@pytest.mark.parametrize("residual", ["prenorm", "block"])
def test_the_trainers_multi_tensor_adamw_is_the_per_parameter_loop_bit_for_bit(residual):
    """make_optimizer uses AdamW's foreach update (no Python loop over parameters); the weights it
    produces equal those of torch's default per-parameter update exactly, so runs trained before
    the switch regenerate to the same bits."""
    cfg = TrainConfig(steps=8, warmup_steps=2, lr=3e-3)

    def weights(foreach: bool) -> torch.Tensor:
        model = AttnResTransformer(small_model(residual)).train()
        opt = make_optimizer(model, cfg)
        if not foreach:
            opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=learning_rate(0, cfg), betas=(cfg.beta1, cfg.beta2))
        assert opt.defaults["foreach"] is (True if foreach else None)
        g = torch.Generator().manual_seed(0)
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, cfg)
            loss = lm_loss(model, torch.randint(0, 256, (3, model.cfg.n_ctx + 1), generator=g))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(weights(True), weights(False))


def test_evaluate_is_the_token_mean_loss_over_all_batches():
    model = tiny_model("full", n_ctx=32)
    batches = validation_batches(torch.arange(300) % 256, seq_len=16, batch_size=3)  # 6 windows, batch 3 + 3
    windows = torch.cat(batches)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten())
    assert evaluate(model, batches) == pytest.approx(float(expected), rel=1e-5)


# -- training runs -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted 12-step run, shared by the tests that compare against it."""
    out = tmp_path_factory.mktemp("ref")
    return train(small_model("block"), small_train(), out, progress=False)


def test_a_short_run_lowers_the_loss(tmp_path):
    res = train(small_model("full"), small_train(steps=30, eval_every=10, lr=5e-3), tmp_path, progress=False)
    assert len(res.train_losses) == 30 and res.finished
    steps = [s for s, _ in res.val_losses]
    assert steps == [0, 10, 20, 30]
    assert res.final_val_loss == res.val_losses[-1][1]
    assert res.final_val_loss < res.val_losses[0][1] - 0.5
    assert sum(res.train_losses[-5:]) / 5 < res.train_losses[0] - 0.5


def test_the_checkpoint_loads_and_matches_the_returned_model(reference_run):
    loaded = AttnResTransformer.load(reference_run.out_dir)
    assert loaded.cfg == reference_run.model.cfg
    for k, v in reference_run.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_two_runs_with_the_same_seed_give_bit_identical_weights(reference_run, tmp_path):
    again = train(small_model("block"), small_train(), tmp_path, progress=False)
    assert again.train_losses == reference_run.train_losses
    assert_same_weights(reference_run.out_dir, tmp_path)


def test_another_batch_seed_gives_other_weights(reference_run, tmp_path):
    train(small_model("block"), small_train(seed=1), tmp_path, progress=False)
    assert not torch.equal(weights(tmp_path)["W_U"], weights(reference_run.out_dir)["W_U"])


@pytest.mark.parametrize("stop_at", [5, 8])  # between validations, and on one
def test_resume_equals_the_uninterrupted_run(reference_run, tmp_path, stop_at):
    part = train(small_model("block"), small_train(), tmp_path, progress=False, stop_at=stop_at)
    assert part.step == stop_at and not part.finished and part.final_val_loss is None
    assert json.loads((tmp_path / LOG_FILE).read_text())["finished"] is False
    done = train(None, None, tmp_path, resume=True, progress=False)
    assert done.step == 12 and done.finished
    assert_same_weights(reference_run.out_dir, tmp_path)
    assert done.train_losses == reference_run.train_losses
    assert done.val_losses == reference_run.val_losses
    assert done.log["resumed_at"] == [stop_at]
    # every session records the code it ran: the commit of this checkout and whether it was dirty
    import subprocess

    from attnres_probe.training.state import code_version

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parents[1]).stdout.strip()
    assert [c["step"] for c in done.log["code"]] == [0, stop_at]
    assert {c["commit"] for c in done.log["code"]} == {code_version()["commit"]} == {head or None}
    assert all(c["dirty"] in (True, False) for c in done.log["code"]) or head == ""


def test_resume_with_explicit_equal_configs_and_more_steps(tmp_path):
    train(small_model("prenorm"), small_train(steps=10), tmp_path, progress=False)
    res = train(small_model("prenorm"), small_train(steps=20), tmp_path, resume=True, progress=False)
    assert res.step == 20 and len(res.train_losses) == 20
    assert res.log["train_config"]["warmup_steps"] == 1  # the saved warm-up (10 // 10), not 20 // 10


def test_a_run_saved_before_the_split_field_existed_resumes_with_the_tail_split(tmp_path):
    """Runs saved before ``TrainConfig.split`` have no such key: they resume as what they were,
    the split by tokens ("tail"), and the log then names it."""
    train(small_model("prenorm"), small_train(steps=4), tmp_path, progress=False)
    state_path = tmp_path / "train_state.json"
    state = json.loads(state_path.read_text())
    del state["train_config"]["split"]
    state_path.write_text(json.dumps(state))
    res = train(small_model("prenorm"), small_train(steps=6), tmp_path, resume=True, progress=False)
    assert res.step == 6 and res.log["train_config"]["split"] == "tail"


def test_the_play_split_trains_on_the_plays_and_validates_on_the_held_out_ones(tmp_path):
    from attnres_probe.data import load_corpus

    res = train(small_model("prenorm"), small_train(steps=2, corpus="shakespeare", split="plays"), tmp_path, progress=False)
    assert res.log["train_config"]["split"] == "plays"
    _, val = load_corpus("shakespeare").split(split="plays", seq_len=res.log["train_config"]["seq_len"])
    assert val.numel() == 1_518_272  # the six held-out plays, every edition


def test_train_log_records_curves_configs_data_and_versions(reference_run):
    log = json.loads((reference_run.out_dir / LOG_FILE).read_text())
    assert log == reference_run.log
    assert len(log["loss"]) == 12 and len(log["lr"]) == 12 and len(log["grad_norm"]) == 12
    assert log["val"] == [{"step": s, "loss": v} for s, v in reference_run.val_losses]
    assert [v["step"] for v in log["val"]] == [0, 4, 8, 12]
    assert log["final_val_loss"] == log["val"][-1]["loss"]
    assert log["model_config"] == small_model("block").to_dict()
    assert log["train_config"]["seq_len"] == 32 and log["train_config"]["steps"] == 12
    assert log["corpus_name"] == "pydoc" and log["corpus"]["name"] == "pydoc"
    assert log["data_sha256"] == log["corpus"]["sha256"] and len(log["data_sha256"]) == 64
    assert log["torch"] == torch.__version__ and log["attnres_probe"]
    assert log["wall_time_s"] > 0 and log["finished"] is True and log["step"] == 12
    assert log["corpus"]["n_train"] + log["corpus"]["n_val"] == log["corpus"]["n_tokens"]
    assert log["backend"] == "numba"  # auto on the CPU


def test_backends_train_alike_and_the_log_names_the_one_used(reference_run, tmp_path):
    ref = train(small_model("block"), small_train(), tmp_path, progress=False, backend="torch")
    assert ref.log["backend"] == "torch"
    # same math, different float rounding: the curves agree closely, not to the bit
    for a, b in zip(ref.train_losses, reference_run.train_losses):
        assert abs(a - b) < 1e-3
    assert abs(ref.final_val_loss - reference_run.final_val_loss) < 1e-3


def test_an_unusable_backend_is_a_train_error_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(TrainError, match="accepted values are auto, torch, triton, numba"):
        train(small_model(), small_train(), tmp_path, progress=False, backend="fast")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(TrainError, match="Triton backend, but the tensors are on cpu"):
        train(small_model(), small_train(), tmp_path, progress=False, backend="triton")
    assert not any(tmp_path.iterdir())


def test_resumable_state_is_safetensors_and_json_only(reference_run):
    names = {p.name for p in reference_run.out_dir.iterdir()}
    assert names == {"config.json", "model.safetensors", LOG_FILE, STATE_FILE, STATE_TENSORS_FILE}
    tensors = load_file(str(reference_run.out_dir / STATE_TENSORS_FILE))
    assert tensors["rng.batches"].dtype == torch.uint8
    assert any(k.endswith(".exp_avg_sq") for k in tensors)
    state = json.loads((reference_run.out_dir / STATE_FILE).read_text())
    assert state["step"] == 12
    model_cfg, train_cfg = read_run_configs(reference_run.out_dir)
    assert model_cfg == small_model("block") and train_cfg.steps == 12


# -- errors --------------------------------------------------------------------------------
def test_missing_corpus_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="nope.txt"):
        train(small_model(), small_train(corpus=str(tmp_path / "nope.txt")), tmp_path / "out", progress=False)


def test_empty_corpus_is_a_data_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"empty \(0 bytes\)"):
        train(small_model(), small_train(corpus=str(tmp_path / "empty.txt")), tmp_path / "out", progress=False)


def test_corpus_too_short_for_one_sequence_is_a_data_error(tmp_path):
    (tmp_path / "short.txt").write_text("x" * 50)
    with pytest.raises(DataError, match=r"each needs at least seq_len \+ 1 = 33"):
        train(small_model(), small_train(corpus=str(tmp_path / "short.txt")), tmp_path / "out", progress=False)


def test_seq_len_beyond_context_fails_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="seq_len=33 is longer than the model's context n_ctx=32"):
        train(small_model(), small_train(seq_len=33), tmp_path, progress=False)
    assert not any(tmp_path.iterdir())


def test_a_folder_holding_a_run_is_not_overwritten_by_accident(reference_run):
    with pytest.raises(TrainError, match=r"already holds a training run.*resume=True.*overwrite=True"):
        train(small_model("block"), small_train(), reference_run.out_dir, progress=False)


def test_resume_without_a_saved_run_says_so(tmp_path):
    with pytest.raises(TrainError, match=r"holds no resumable run \(train_state.json is missing\)"):
        train(None, None, tmp_path, resume=True, progress=False)


def test_resume_with_a_different_model_names_the_field(tmp_path):
    train(small_model("full"), small_train(steps=4), tmp_path, progress=False, stop_at=2)
    with pytest.raises(TrainError, match=r"model config differs \(d_mlp: .*n_layers: saved 2, given 3"):
        train(small_model("full", n_layers=3, d_mlp=64), small_train(steps=4), tmp_path, resume=True, progress=False)
    with pytest.raises(TrainError, match=r"train config \(all but steps\) differs \(lr: saved 0.003, given 0.01\)"):
        train(small_model("full"), small_train(steps=4, lr=0.01), tmp_path, resume=True, progress=False)


def test_resume_refuses_changed_data(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefgh" * 100)
    out = tmp_path / "run"
    train(small_model(), small_train(steps=4, corpus=str(corpus)), out, progress=False, stop_at=2)
    corpus.write_text("hgfedcba" * 100)
    with pytest.raises(TrainError, match=r"changed since the run .* resume needs the same data"):
        train(None, None, out, resume=True, progress=False)


def test_resume_refuses_weights_that_do_not_belong_to_the_saved_state(tmp_path):
    train(small_model(), small_train(steps=4), tmp_path, progress=False, stop_at=2)
    AttnResTransformer(small_model()).save(tmp_path)  # e.g. a crash between the two writes
    with pytest.raises(TrainError, match=r"model.safetensors does not match train_state.json"):
        train(None, None, tmp_path, resume=True, progress=False)


def test_diverging_loss_stops_with_advice(tmp_path):
    with pytest.raises(TrainError, match=r"loss became (nan|inf) at step \d+ .*lower lr"):
        train(small_model(), small_train(steps=4, lr=1e30, warmup_steps=0, grad_clip=0), tmp_path, progress=False)


# -- command line --------------------------------------------------------------------------
def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="attnres-probe")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


TINY_FLAGS = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--n-ctx", "32", "--batch-size", "4",
              "--eval-every", "4", "--quiet"]  # fmt: skip


def test_cli_trains_and_resumes(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert cli("train", "--out", out, "--residual", "block", "--block-size", "2", "--steps", "4", "--backend", "torch", *TINY_FLAGS) == 0
    assert "trained 4 steps (Block AttnRes)" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / LOG_FILE).read_text())["backend"] == "torch"
    cfg = AttnResTransformer.load(out).cfg
    assert (cfg.residual, cfg.block_size, cfg.d_model, cfg.d_head, cfg.d_mlp) == ("block", 2, 32, 16, 128)
    assert cli("train", "--out", out, "--resume", "--steps", "6", "--quiet") == 0
    log = json.loads((tmp_path / "run" / LOG_FILE).read_text())
    assert log["step"] == 6 and log["resumed_at"] == [4]


def test_cli_model_config_file_with_flag_overrides(tmp_path):
    small_model("full", d_model=16).to_json(tmp_path / "model.json")
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--config", str(tmp_path / "model.json"), "--d-model", "32", "--steps", "2",
            "--batch-size", "2", "--quiet", "--seed", "5"]  # fmt: skip
    assert cli(*args) == 0
    cfg = AttnResTransformer.load(out).cfg
    assert (cfg.d_model, cfg.d_head, cfg.d_mlp, cfg.n_ctx, cfg.seed) == (32, 16, 128, 32, 5)
    assert json.loads((out / LOG_FILE).read_text())["train_config"]["seed"] == 5


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seq-len", "64"], "seq_len=64 is longer than the model's context n_ctx=32"),
        (["--batch-size", "0"], "batch_size must be an integer >= 1; got 0"),
        (["--steps", "0"], "steps must be an integer >= 1; got 0"),
        (["--corpus", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
        (["--config", "/no/such/model.json"], "--config /no/such/model.json: no such file"),
        (["--n-heads", "3"], "d_model=32 is not divisible by n_heads=3"),
        (["--resume"], "holds no resumable run"),
    ],
)
def test_cli_errors_are_one_line_on_stderr_with_exit_code_2(tmp_path, capsys, extra, message):
    code = cli("train", "--out", str(tmp_path / "run"), "--steps", "2", *TINY_FLAGS, *extra)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("attnres-probe train: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_training_loop_sets_the_collectors_old_objects_aside_only_while_it_runs(tmp_path, monkeypatch):
    """Python's collector skips the objects that predate the loop while it runs (frozen_gc);
    afterwards they are collectable again, and a process that froze objects itself is left alone."""
    import gc

    import attnres_probe.training.loop as train_module

    seen = []
    real = train_module.lm_loss
    monkeypatch.setattr(train_module, "lm_loss", lambda *a, **k: seen.append(gc.get_freeze_count()) or real(*a, **k))
    assert gc.get_freeze_count() == 0
    train(small_model("block"), small_train(steps=2, eval_every=0), tmp_path / "a", progress=False)
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
    with pytest.raises(TrainError):  # a failing run unfreezes too
        monkeypatch.setattr(train_module, "lm_loss", lambda *a, **k: torch.tensor(float("nan"), requires_grad=True))
        train(small_model("block"), small_train(steps=2, eval_every=0), tmp_path / "b", progress=False)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        monkeypatch.setattr(train_module, "lm_loss", real)
        train(small_model("block"), small_train(steps=2, eval_every=0), tmp_path / "c", progress=False)
        assert gc.get_freeze_count() > 0  # still frozen (a count only drops as frozen objects are freed)
    finally:
        gc.unfreeze()


def test_routing_probes_are_recorded_over_training_and_survive_a_resume(tmp_path):
    """train --probe-every N: a summary of the held-out probe windows' routing at step 0, every
    N steps and at the end, the latest full trace in the run folder, the windows' hash in the log;
    a run stopped and resumed records the same probes (and losses) bit for bit."""
    import json

    from attnres_probe import DepthTrace, ModelConfig
    from attnres_probe.figures import over_training
    from attnres_probe.training import TrainConfig, train

    mc = ModelConfig(residual="block", d_model=32, n_layers=2, n_heads=2, n_ctx=32, block_size=2)
    tc = TrainConfig(steps=10, batch_size=4, eval_every=5, probe_every=4, probe_windows=2)
    train(mc, tc, tmp_path / "a", progress=False)
    train(mc, tc, tmp_path / "b", progress=False, stop_at=6)
    train(None, None, tmp_path / "b", resume=True, progress=False)
    logs = [json.loads((tmp_path / r / "train_log.json").read_text()) for r in ("a", "b")]
    history = logs[0]["probes"]["history"]
    assert [h["step"] for h in history] == [0, 4, 8, 10]
    assert logs[0]["probes"] == logs[1]["probes"] and logs[0]["loss"] == logs[1]["loss"]
    assert len(logs[0]["probes"]["windows_sha256"]) == 64 and logs[0]["probes"]["windows"] == 2
    assert history[0]["embed_weight"][1] == pytest.approx(0.5)  # zero queries at step 0: uniform over 2 sources
    last = DepthTrace.load(tmp_path / "a" / "probes" / "last")
    assert last.tokens.shape == (2, 32) and last.has_gradients
    fig = over_training({"block": history})
    assert len(fig.data) == 4 * 5 + 1  # four per-read rows of 5 reads, and the gradient spread


def test_cli_defaults_to_the_demo_models_size(tmp_path):
    """#17 item 10: without --config the model is the demo models' (d_model 64, 8 layers, n_ctx 128)."""
    from attnres_probe.cli.train import _configs_from_args

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    model_cfg, _ = _configs_from_args(parser.parse_args(["train", "--out", str(tmp_path / "r"), "--residual", "block"]))
    assert (model_cfg.d_model, model_cfg.n_layers, model_cfg.n_ctx, model_cfg.n_heads) == (64, 8, 128, 4)
    assert model_cfg.residual == "block" and model_cfg.block_size == 4
    full, _ = _configs_from_args(parser.parse_args(["train", "--out", str(tmp_path / "r"), "--d-model", "32"]))
    assert (full.residual, full.d_model, full.d_head, full.d_mlp) == ("full", 32, 8, 128)


def test_progress_shows_the_latest_validation_loss_and_an_estimate(tmp_path, capsys):
    """#17 item 10: the bar's val is the one just measured (with its step); a time estimate after the first steps."""
    from attnres_probe.training.loop import progress_postfix, time_estimate

    assert progress_postfix(1.23456, [(0, 5.589), (4, 3.21)]) == {"loss": "1.235", "val": "3.210 (step 4)"}
    assert progress_postfix(1.0, []) == {"loss": "1.000"}
    line = time_estimate(10.0, 5, 1995)
    assert "2.00 s/step" in line and " min " in line and "1995" in line
    train(small_model("full"), small_train(steps=7, eval_every=3), tmp_path / "a", progress=True)
    err = capsys.readouterr().err
    assert "s/step over 5 steps after the first (which compiles kernels)" in err and "(step 6)" in err
