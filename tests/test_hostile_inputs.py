"""Issue #51, second part: the hostile cases of the reliability catalogue that remained (readers'
bounds, training logs, symlink loops, non-numeric columns, NaN literals, duplicate names, missing
digests, full disks, ``--out`` naming a file), each one line or working, nothing lost."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from attnres_probe.cli import main
from attnres_probe.io import sha256_file

from helpers import tiny_model

DEMO = Path(__file__).resolve().parents[1] / "attnres_probe" / "demo_models"


def _one_line(err: str) -> str:
    """The one error line of a refused command (no traceback)."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- training logs (study --runs) --------------------------------------------------------------
def _runs_with_log(tmp_path: Path, log: object | bytes | None) -> Path:
    runs = tmp_path / "runs"
    folder = runs / "prenorm" / "seed0"
    folder.mkdir(parents=True)
    shutil.copy(DEMO / "prenorm" / "model.safetensors", folder / "model.safetensors")
    shutil.copy(DEMO / "prenorm" / "config.json", folder / "config.json")
    if isinstance(log, bytes):
        (folder / "train_log.json").write_bytes(log)
    elif log is not None:
        (folder / "train_log.json").write_text(json.dumps(log))
    return runs


def _shipped_log() -> dict:
    return json.loads((DEMO / "prenorm" / "train_log.json").read_text())


def _set(doc: dict, path: str, value: object) -> dict:
    *parents, key = path.split(".")
    at = doc
    for p in parents:
        at = at[p]
    if value is KeyError:
        del at[key]
    else:
        at[key] = value
    return doc


@pytest.mark.parametrize("change, message", [
    (("train_config", 5), r"'train_config' is 5; it must be an object"),
    (("train_config", KeyError), r"key 'train_config' is missing; it must be an object"),
    (("train_config.val_fraction", "lots"), r"'train_config' is not a valid training recipe \(val_fraction"),
    (("train_config.unknown_knob", 1), r"'train_config' is not a valid training recipe \(.*unknown_knob"),
    (("step", "8000"), r"'step' is '8000'; it must be an integer"),
    (("finished", "yes"), r"'finished' is 'yes'; it must be true or false"),
    (("final_val_loss", "low"), r"'final_val_loss' is 'low'; it must be a finite number"),
])
def test_a_training_log_with_wrong_keys_is_one_line_naming_the_key(tmp_path, capsys, change, message):
    runs = _runs_with_log(tmp_path, _set(_shipped_log(), *change))
    assert main(["study", "--runs", str(runs), "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "train_log.json" in line
    import re

    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()


def test_a_training_log_that_is_huge_deep_or_not_a_file_is_refused_before_reading(tmp_path, capsys):
    runs = _runs_with_log(tmp_path, None)
    log = runs / "prenorm" / "seed0" / "train_log.json"
    with open(log, "wb") as f:  # a 2 GB sparse file: nothing of it is read
        f.truncate(2 * 10**9)
    assert main(["study", "--runs", str(runs), "--out", str(tmp_path / "out")]) == 2
    assert "is 2000000000 bytes; at most" in _one_line(capsys.readouterr().err)
    log.unlink()
    log.symlink_to("/dev/zero")
    assert main(["study", "--runs", str(runs), "--out", str(tmp_path / "out")]) == 2
    assert "is not a regular file" in _one_line(capsys.readouterr().err)
    log.unlink()
    log.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["study", "--runs", str(runs), "--out", str(tmp_path / "out")]) == 2
    assert "nested too deeply" in _one_line(capsys.readouterr().err)


def test_the_shipped_and_study_logs_pass_the_schema():
    from attnres_probe.training.state import read_train_log

    for folder in [*(p for p in DEMO.iterdir() if p.is_dir()), *sorted(Path(DEMO.parents[1], "docs/study/v3/runs").glob("*/seed*"))]:
        assert read_train_log(folder)["train_config"]["steps"] > 0


# -- stats folders -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stats_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    for r in ("prenorm", "block"):
        tiny_model(r).save(root / "ckpt" / r)
    data = root / "data"
    data.mkdir()
    for i in range(3):
        (data / f"d{i}.txt").write_text(f"document {i} with a few words in it, enough for a window or two " * 2)
    assert main(["corpus", "--models", str(root / "ckpt" / "prenorm"), str(root / "ckpt" / "block"), "--data", str(data),
                 "--out", str(root / "out"), "--no-progress", "--resamples", "50"]) == 0
    return root


@pytest.fixture
def run(stats_run, tmp_path):
    shutil.copytree(stats_run, tmp_path / "root", symlinks=True)
    return tmp_path / "root" / "out"


def test_a_stats_folder_whose_model_is_a_symlink_loop_is_one_line(run, tmp_path, capsys):
    block = run / "models" / "block"
    shutil.rmtree(block)
    os.symlink("block", block)  # block -> block
    assert main(["report", "--stats", str(run), "--out", str(tmp_path / "r.html")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "symlink loop" in line and "models/block" in line
    assert not (tmp_path / "r.html").exists()


def test_a_nan_literal_for_a_count_is_refused(run):
    from attnres_probe.corpus.stats import CorpusStats, StatsError

    path = run / "models" / "block" / "stats.json"
    text = path.read_text()
    doc = json.loads(text)
    path.write_text(text.replace(f'"n_tokens": {doc["n_tokens"]}', '"n_tokens": NaN', 1))
    assert "NaN" in path.read_text()
    with pytest.raises(StatsError, match=r"'n_tokens' is nan; it must be an integer"):
        CorpusStats.load(run / "models" / "block")


def test_stats_without_a_weights_digest_warn_that_the_pairing_cannot_be_checked(run, capsys, monkeypatch):
    """The catalogue's case: corpus.json's source swapped to another model and the digest removed."""
    from attnres_probe.dashboards.serving import load_with_stats

    path = run / "models" / "block" / "stats.json"
    doc = json.loads(path.read_text())
    del doc["meta"]["weights_sha256"]
    path.write_text(json.dumps(doc))
    manifest = json.loads((run / "corpus.json").read_text())
    other = run.parent / "ckpt" / "other"
    tiny_model("block", seed=7).save(other)
    for m in manifest["models"]:
        m.pop("weights_sha256", None)
        if m["name"] == "block":
            m["source"] = str(other)
    (run / "corpus.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=r"the stats of 'block' carry no weights digest .* cannot be checked"):
        entries, stats = load_with_stats(None, None, str(run))
    assert set(entries) == {"prenorm", "block"}
    # and on the command line, one line (the dashboard is built, not served: serve() is replaced)
    from attnres_probe.dashboards import serving

    served = []
    monkeypatch.setattr(serving, "serve", lambda app, *a, **k: served.append(app) or 0)
    assert main(["dash", "--stats", str(run)]) == 0 and served
    err = capsys.readouterr().err
    assert err.count("attnres-probe: warning: the stats of 'block' carry no weights digest") == 1


# -- traces ------------------------------------------------------------------------------------
def test_a_trace_table_with_a_text_column_is_a_trace_error_naming_the_file(tmp_path):
    from attnres_probe import DepthTrace, Probe
    from attnres_probe.trace import TraceError

    folder = tmp_path / "t"
    Probe(tiny_model("full")).run(torch_tokens(), backward=False).save(folder)
    table = pd.read_parquet(folder / "reads.parquet")
    column = table.columns[0]
    table[column] = table[column].astype(str)
    table.to_parquet(folder / "reads.parquet", index=False)
    doc = json.loads((folder / "trace.json").read_text())
    doc["files"]["reads.parquet"] = sha256_file(folder / "reads.parquet")
    (folder / "trace.json").write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=rf"reads.parquet: column '{column}' holds (object|str) values, not numbers"):
        DepthTrace.load(folder)


def test_a_trace_table_with_more_rows_than_its_shapes_is_refused_before_reading(tmp_path):
    from attnres_probe import DepthTrace, Probe
    from attnres_probe.trace import TraceError

    folder = tmp_path / "t"
    Probe(tiny_model("full")).run(torch_tokens(), backward=False).save(folder)
    table = pd.read_parquet(folder / "cube.parquet")
    pd.concat([table] * 3).to_parquet(folder / "cube.parquet", index=False)
    doc = json.loads((folder / "trace.json").read_text())
    doc["files"]["cube.parquet"] = sha256_file(folder / "cube.parquet")
    (folder / "trace.json").write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"cube.parquet holds \d+ rows; the shapes in trace.json need \d+"):
        DepthTrace.load(folder)


def torch_tokens():
    import torch

    return torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


# -- the command line: --out, --names, full disks ----------------------------------------------
OUT_COMMANDS = {
    "record": ["record", "--demo", "full", "--text", "ab"],
    "report": ["report", "--demo", "full"],
    "corpus": ["corpus", "--demo", "full", "--data", "DATA"],
    "figures": ["figures", "--demo", "full"],
    "study": ["study", "--demo"],
    "train": ["train", "--residual", "full", "--steps", "2"],
    "demo-models": ["demo-models", "--only", "full"],
    "controls": ["controls", "--demo", "full"],
}


@pytest.mark.parametrize("command", sorted(OUT_COMMANDS))
def test_out_naming_a_file_or_under_a_file_is_one_line_and_the_file_is_kept(tmp_path, capsys, command):
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    argv = [str(tmp_path) if a == "DATA" else a for a in OUT_COMMANDS[command]]
    targets = [keep / "sub"] if command in ("report", "controls") else [keep, keep / "sub"]
    for out in targets:
        assert main([*argv, "--out", str(out)]) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"attnres-probe {command}: error: --out {out}") and "nothing was written" in line, line
    assert keep.read_text() == "mine"


def test_report_out_naming_a_folder_is_one_line(tmp_path, capsys):
    assert main(["report", "--demo", "full", "--out", str(tmp_path)]) == 2
    assert "is a folder; `attnres-probe report` writes one file" in _one_line(capsys.readouterr().err)


TWO = [str(DEMO / "full"), str(DEMO / "block")]


@pytest.mark.parametrize("argv", [
    ["report", "--models", *TWO, "--names", "a", "a", "--text", "ab"],
    ["dash", "--models", *TWO, "--names", "a", "a"],
    ["corpus", "--models", *TWO, "--names", "a", "a", "--data", str(DEMO)],
    ["figures", "--models", *TWO, "--names", "a", "a"],
    ["study", "--demo", "--names", "prenorm", "full", "full"],
])
def test_a_label_given_twice_is_refused_by_every_command(tmp_path, capsys, argv):
    out = [] if argv[0] == "dash" else ["--out", str(tmp_path / ("o.html" if argv[0] == "report" else "o"))]
    code = main([*argv, *out])
    assert code == 2
    line = _one_line(capsys.readouterr().err)
    assert "--names gives 'a' more than once" in line or "--names gives 'full' more than once" in line, line
    assert not any(tmp_path.iterdir())


def test_figures_on_a_full_disk_leave_no_folder_and_no_half_written_figures(tmp_path, capsys, monkeypatch):
    from attnres_probe.io import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "enospc@atomic_write:magnitudes.svg")
    out = tmp_path / "new" / "figs"
    assert main(["figures", "--demo", "full", "--text", "ROMEO: hi", "--out", str(out)]) == 2
    line = _one_line("\n".join(x for x in capsys.readouterr().err.splitlines() if not x.startswith("note: ")))
    assert "No space left on device" in line and "nothing was kept" in line
    assert not (tmp_path / "new").exists()


def test_memory_limits_include_the_process_address_space_and_the_cgroup(tmp_path):
    import resource
    import subprocess
    import sys

    from attnres_probe.resources import cgroup_room

    # a cgroup v2 and a v1 hierarchy as files: the least room of the group and its parents
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "memory.max").write_text("1000000\n")
    (tmp_path / "a" / "memory.current").write_text("400000\n")
    (tmp_path / "a" / "b" / "memory.max").write_text("max\n")
    (tmp_path / "cg").write_text("0::/a/b\n")
    assert cgroup_room(str(tmp_path), str(tmp_path / "cg")) == 600_000
    (tmp_path / "memory" / "x").mkdir(parents=True)
    (tmp_path / "memory" / "x" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1: no limit
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("5000\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text("1000\n")
    (tmp_path / "cg").write_text("4:memory:/x\n")
    assert cgroup_room(str(tmp_path), str(tmp_path / "cg")) == 4000
    (tmp_path / "cg").write_text("4:cpu:/x\n")
    assert cgroup_room(str(tmp_path), str(tmp_path / "cg")) is None
    # RLIMIT_AS, in a child process under a 6 GiB limit: the bound names it
    code = ("from attnres_probe.validate import check_bytes, memory_cap\n"
            "from attnres_probe.resources import memory_limits\n"
            "lim = memory_limits(); assert 'RLIMIT_AS' in lim and lim['RLIMIT_AS'] < 6 * 2**30, lim\n"
            "assert memory_cap() <= lim['RLIMIT_AS'] // 2 + 1\n"
            "try:\n    check_bytes(4 * 2**30, 'x', 'f', ValueError)\nexcept ValueError as e:\n    print(e)\n")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    env = {k: v for k, v in os.environ.items() if k != "ATTNRES_MEMORY_CAP"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=limit, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "left under RLIMIT_AS" in out.stdout, out.stdout


def test_a_warning_on_the_command_line_is_one_line(capsys):
    from attnres_probe.cli import _one_line_warning

    _one_line_warning(UserWarning("careful"), UserWarning, "x.py", 3)
    assert capsys.readouterr().err == "attnres-probe: warning: careful\n"


# -- the headline cases under a 6 GiB address-space limit --------------------------------------
def _limited(argv: list[str], cwd: Path, timeout: int = 300):
    """``attnres-probe ARGV`` in a child process whose address space is limited to 6 GiB."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))

    env = {k: v for k, v in os.environ.items() if k != "ATTNRES_MEMORY_CAP"}
    return subprocess.run([sys.executable, "-m", "attnres_probe.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          preexec_fn=limit, env=env, timeout=timeout)


@pytest.mark.slow
def test_the_headline_cases_are_one_line_under_a_6_gib_address_space_limit(run, tmp_path):
    import zipfile

    # a stats folder whose arrays.npz declares 1 GiB in 1 MB (the catalogue's 4 GiB in 4 MB, smaller to stay
    # quick): the shape is read from the header and refused before anything is inflated
    folder = run / "models" / "block"
    with zipfile.ZipFile(folder / "arrays.npz") as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    import io

    from numpy.lib import format as npy

    name = next(n for n in members if n.startswith("token.depth_weights.") and n.endswith(".mean.npy"))
    with zipfile.ZipFile(folder / "arrays.npz", "w", zipfile.ZIP_DEFLATED) as z:
        for n, data in members.items():
            if n != name:
                z.writestr(n, data)
        with z.open(name, "w", force_zip64=True) as f:
            head = io.BytesIO()
            npy.write_array_header_1_0(head, {"descr": "<f8", "fortran_order": False, "shape": (2**27,)})
            f.write(head.getvalue())
            zeros = bytes(2**24)
            for _ in range(2**30 // 2**24):
                f.write(zeros)
    assert (folder / "arrays.npz").stat().st_size < 4 * 2**20
    doc = json.loads((folder / "stats.json").read_text())
    doc["files"]["arrays.npz"] = sha256_file(folder / "arrays.npz")
    (folder / "stats.json").write_text(json.dumps(doc))
    runs = _runs_with_log(tmp_path, None)
    with open(runs / "prenorm" / "seed0" / "train_log.json", "wb") as f:
        f.truncate(2 * 10**9)
    cases = [
        (["report", "--stats", str(run), "--out", str(tmp_path / "r.html")], "has shape [134217728]"),
        (["study", "--runs", str(runs), "--out", str(tmp_path / "s")], "is 2000000000 bytes"),
        (["train", "--residual", "hyper", "--n-streams", "1000000", "--steps", "1", "--out", str(tmp_path / "t")],
         "n_streams"),
        (["train", "--residual", "hyper", "--mhc", "--sinkhorn-iters", "1000000000", "--steps", "1", "--out",
          str(tmp_path / "t")], "sinkhorn_iters"),
    ]
    for argv, message in cases:
        out = _limited(argv, tmp_path)
        assert out.returncode == 2, (argv, out.stderr[-2000:])
        line = _one_line(out.stderr)
        assert message in line, (argv, line)
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "s").exists() and not (tmp_path / "t").exists()


# -- property: any JSON as a training log is accepted or refused in one line --------------------
def test_any_json_training_log_is_read_or_refused_in_one_line(tmp_path_factory):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from attnres_probe.training.state import read_train_log

    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                                 max_size=3), max_leaves=8)
    base = {k: v for k, v in _shipped_log().items() if not isinstance(v, (list, dict)) or k == "train_config"}
    keys = st.sampled_from(["train_config", "step", "finished", "data_sha256", "backend", "final_val_loss", "wall_time_s",
                            "probes", *(f"train_config.{k}" for k in base["train_config"])])
    folder = tmp_path_factory.mktemp("log")

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(keys, values, max_size=3) | values)
    def check(change):
        if isinstance(change, dict) and all(k in keys_list for k in change):
            doc = json.loads(json.dumps(base))
            for key, value in change.items():
                try:
                    _set(doc, key, value)
                except TypeError:  # train_config replaced by a non-object earlier in this change
                    pass
        else:
            doc = change
        (folder / "train_log.json").write_text(json.dumps(doc))
        try:
            log = read_train_log(folder)
        except ValueError as exc:
            assert "\n" not in str(exc) and "train_log.json" in str(exc)
        else:
            assert isinstance(log["train_config"], dict) and isinstance(log["step"], int)

    keys_list = ["train_config", "step", "finished", "data_sha256", "backend", "final_val_loss", "wall_time_s", "probes",
                 *(f"train_config.{k}" for k in base["train_config"])]
    check()
