"""Reliability under faults (issue #18): saves that survive kills and full disks, one writer per
destination, bounded inputs, per-call recordings, validated metadata, one-line errors.

Every test carries ``@pytest.mark.faults(case, tried)``: ``python benchmarks/faults.py`` runs
them (``pytest -m faults``) and prints the outcome table that docs/reliability.md shows.

Kill tests fork a real child process that is SIGKILLed at a named point of the save
(``ATTNRES_PROBE_FAULT=kill@POINT``, see :func:`attnres_probe.io.fault_point`). Full-disk and
read-only tests mount a small tmpfs where the machine allows it (root), and otherwise make the
write fail with the same errno at the same point (``enospc@POINT`` / ``erofs@POINT``).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from attnres_probe import AttnResTransformer, CheckpointError, ConfigError, DepthTrace, ModelConfig, Probe, TraceError
from attnres_probe.cli import main
from attnres_probe.io import FAULT_ENV, DestinationBusyError, exclusive_lock, lock_path
from attnres_probe.trace import FILES, META_FILE
from attnres_probe.training import TrainConfig, TrainError, train

from helpers import tiny_config, tiny_model
from trace_factory import make_trace

TRACE_FILES = sorted([*FILES, META_FILE])


# -- helpers ---------------------------------------------------------------------------------
def in_child(fn, fault: str | None = None, timeout: float = 120.0) -> int:
    """Run ``fn()`` in a forked child process (with ``ATTNRES_PROBE_FAULT=fault``).

    Returns:
        its exit status, or minus the signal that ended it (-9 for SIGKILL).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            if fault:
                os.environ[FAULT_ENV] = fault
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if time.monotonic() > deadline:  # never hang the suite on a child that did not finish
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError(f"the child process did not finish within {timeout} s")
        time.sleep(0.01)


def hidden_leftovers(folder: Path) -> list[str]:
    """Names of hidden entries (staging folders, temporary files, locks) in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def small_disk(tmp_path, request):
    """``make(kb, readonly=False)``: a folder on a tmpfs of that size, or None where mounting is not allowed.

    Which one the test got is kept as its ``disk`` property (benchmarks/faults.py shows it).
    """
    mounted = []

    def make(kb: int, readonly: bool = False) -> Path | None:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        opts = f"size={kb}k" + (",ro" if readonly else "")
        ok = False
        if not os.environ.get("ATTNRES_PROBE_NO_TMPFS"):  # set it to test the injected errors instead
            try:
                ok = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True).returncode == 0
            except OSError:
                pass
        request.node.user_properties.append(("how", f"{kb} kB tmpfs" + (", read-only" if readonly else "") if ok else "errno injected"))
        if not ok:
            where.rmdir()
            return None
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path, leave: int = 4096) -> None:
    """Fill a tmpfs but for about ``leave`` bytes."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "m"
    tiny_model("block", n_ctx=128).save(path)
    return path


def one_line(err: str, command: str) -> bool:
    return err.startswith(f"attnres-probe {command}: error:") and err.count("\n") == 1 and "Traceback" not in err


# -- 1. a replaced trace is never lost --------------------------------------------------------
KILL_POINTS = [
    ("trace.save:cube.parquet", "exchange", "old"),  # between two tables of the new trace
    ("trace.save:written", "exchange", "old"),  # the new trace complete, not yet in place
    ("replace_directory:swapped", "exchange", "new"),  # swapped in, the old one not yet removed
    ("replace_directory:aside", "fallback", "old"),  # two-rename fallback: the old one set aside
]


@pytest.mark.faults("1", "SIGKILL during `save(overwrite=True)` at each point of the save", how="SIGKILL, forked child")
@pytest.mark.parametrize("point, swap, survivor", KILL_POINTS, ids=[p[0] for p in KILL_POINTS])
def test_a_killed_overwrite_leaves_the_old_or_the_new_trace(tmp_path, point, swap, survivor):
    old, new = make_trace("full"), make_trace("block")
    dest = tmp_path / "tr"
    old.save(dest)

    def overwrite():
        if swap == "fallback":
            import attnres_probe.io as io

            io._exchange = lambda a, b: False  # a system without renameat2(RENAME_EXCHANGE)
        new.save(dest, overwrite=True)

    assert in_child(overwrite, f"kill@{point}") == -9
    assert DepthTrace.load(dest).residual == {"old": "full", "new": "block"}[survivor]
    new.save(dest, overwrite=True)  # the next save clears what the killed one left
    assert DepthTrace.load(dest).residual == "block"
    assert hidden_leftovers(tmp_path) == [] and sorted(os.listdir(dest)) == TRACE_FILES


@pytest.mark.faults("1", "`record --force` on a full disk")
def test_an_overwrite_on_a_full_disk_keeps_the_old_trace(tmp_path, small_disk, checkpoint, capsys, monkeypatch):
    disk = small_disk(2048) or tmp_path
    dest = disk / "tr"
    base = ["record", "--model", str(checkpoint), "--out", str(dest)]
    assert main([*base, "--text", "the first text"]) == 0
    before = {p: (dest / p).read_bytes() for p in os.listdir(dest)}
    if disk is tmp_path:
        monkeypatch.setenv(FAULT_ENV, "enospc@trace.save:reads.parquet")
    else:
        fill(disk)
    capsys.readouterr()
    assert main([*base, "--text", "a second, longer text to record", "--force"]) == 2
    err = capsys.readouterr().err
    assert one_line(err, "record") and "no space left" in err and str(dest) in err and "unchanged" in err
    assert {p: (dest / p).read_bytes() for p in os.listdir(dest)} == before
    assert DepthTrace.load(dest).str_tokens[0] == list("the first text")
    assert hidden_leftovers(disk) == []


# -- 2. one writer per destination ----------------------------------------------------------
def _hold_lock(path: Path, ready, release) -> None:
    with exclusive_lock(path):
        os.write(ready, b"x")
        os.read(release, 1)


@pytest.mark.faults("2", "a second process saving to an --out that another one is writing", how="lock held by a forked child")
def test_a_second_writer_is_refused_while_the_first_holds_the_destination(tmp_path, checkpoint, capsys):
    dest = tmp_path / "tr"
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    holder = threading.Thread(target=lambda: in_child(lambda: _hold_lock(dest, w1, r2)))
    holder.start()
    try:
        assert os.read(r1, 1) == b"x"  # the other process holds the lock now
        with pytest.raises(DestinationBusyError, match="being written by another process"):
            make_trace("full").save(dest)
        assert main(["record", "--model", str(checkpoint), "--text", "abc", "--out", str(dest)]) == 2
        err = capsys.readouterr().err
        assert one_line(err, "record") and "being written by another process" in err and "--out" in err
        with pytest.raises(TrainError, match="being written by another process"):
            train(tiny_config(), TrainConfig(steps=1, batch_size=2, eval_every=0), dest, progress=False)
    finally:
        os.write(w2, b"x")
        holder.join()
    assert not dest.exists() and not lock_path(dest).exists()
    make_trace("full").save(dest)  # free again, and no lock file is left behind
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.faults("2", "two threads saving different traces to one folder at once")
def test_concurrent_saves_give_one_complete_trace_never_a_mix(tmp_path):
    dest = tmp_path / "tr"
    traces = [make_trace("full", str_tokens=list("abc")), make_trace("block", str_tokens=list("xyz"))]
    results: list[str] = []
    barrier = threading.Barrier(2)

    def save(t):
        barrier.wait()
        for _ in range(20):
            try:
                t.save(dest, overwrite=True)
                results.append("saved")
            except DestinationBusyError:
                results.append("busy")

    threads = [threading.Thread(target=save, args=(t,)) for t in traces]
    [t.start() for t in threads]
    [t.join() for t in threads]
    loaded = DepthTrace.load(dest)
    assert (loaded.residual, "".join(loaded.str_tokens[0])) in {("full", "abc"), ("block", "xyz")}
    assert "saved" in results and hidden_leftovers(tmp_path) == []


# -- 3. a training checkpoint is one atomic unit --------------------------------------------
TRAIN_POINTS = [
    ("train.save:weights#2", 2),  # the new weights written, nothing committed
    ("train.save:staged#2", 2),  # the whole step written, not yet committed
    ("train.save:committed#2", 4),  # committed, nothing moved into place
    ("train.save:moved:model.safetensors#2", 4),  # new weights in place, train_state.json still the old one
    ("train.save:moved:train_state.safetensors#2", 4),
]


def _train_cfgs():
    return tiny_config("block", n_ctx=32), TrainConfig(steps=6, batch_size=4, eval_every=2, eval_batches=2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "ref"
    return train(*_train_cfgs(), out, progress=False)


@pytest.mark.faults("3", "SIGKILL during a training save, then `train --resume`", how="SIGKILL, forked child")
@pytest.mark.parametrize("point, resumed_from", TRAIN_POINTS, ids=[p[0] for p in TRAIN_POINTS])
def test_a_run_killed_while_saving_resumes_from_the_last_complete_step(tmp_path, uninterrupted, point, resumed_from):
    out = tmp_path / "run"
    assert in_child(lambda: train(*_train_cfgs(), out, progress=False), f"kill@{point}") == -9
    done = train(None, None, out, resume=True, progress=False)
    assert done.step == 6 and done.log["resumed_at"] == [resumed_from]
    assert done.train_losses == uninterrupted.train_losses
    ref = uninterrupted.model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in done.model.state_dict().items())
    assert hidden_leftovers(out) == [] and hidden_leftovers(tmp_path) == []


# -- 4. untrusted sizes are checked against the file before anything is built ----------------
def _hostile_checkpoint(folder: Path, weights: bytes | None = None, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if weights is None:
        tiny_model("full").save(folder)
    else:
        (folder / "model.safetensors").write_bytes(weights)
        (folder / "config.json").write_text(json.dumps({"format": "attnres-probe-checkpoint", "format_version": 1, "config": {}}))
    doc = json.loads((folder / "config.json").read_text())
    doc["config"] = {**(doc["config"] or tiny_config("full").to_dict()), **config}
    (folder / "config.json").write_text(json.dumps(doc))
    return folder


EMPTY_SAFETENSORS = struct.pack("<Q", 8) + b"{}      "
HOSTILE = {
    "16-byte weights, d_model 2048 x 16 layers": dict(weights=EMPTY_SAFETENSORS, d_model=2048, n_layers=16, n_heads=16, d_head=128, d_mlp=8192),
    "n_layers 1000000": dict(n_layers=1_000_000),
    "d_model 1e9": dict(d_model=10**9, d_head=None, d_mlp=None),
    "d_vocab 1e8": dict(d_vocab=10**8),
    "n_ctx 1e9": dict(n_ctx=10**9),
    "n_ctx 1e9 sinusoidal": dict(n_ctx=10**9, positional="sinusoidal"),
    "n_heads 1e6": dict(n_heads=10**6, d_head=1),
    "d_mlp 1e12": dict(d_mlp=10**12),
}


@pytest.mark.faults("4", "config.json with huge sizes beside a small model.safetensors")
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_config_the_weights_do_not_hold_is_refused_before_allocating(tmp_path, case, capsys):
    spec = dict(HOSTILE[case])
    folder = _hostile_checkpoint(tmp_path / "m", **spec)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="does not belong to these weights|needs .* available|holds no tensors"):
        AttnResTransformer.load(folder)
    assert time.perf_counter() - t0 < 2.0
    assert main(["summary", "--model", str(folder), "--no-backward"]) == 2
    assert one_line(capsys.readouterr().err, "summary")


@pytest.mark.faults("4", "a safetensors header that lies about its size or byte ranges")
@pytest.mark.parametrize(
    "raw",
    [struct.pack("<Q", 10**15) + b"{}", struct.pack("<Q", 2) + b"[]", b"\x05\x00",
     struct.pack("<Q", 60) + json.dumps({"W_E": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4]}}).encode().ljust(60)],
    ids=["header-length-1e15", "header-not-an-object", "3-bytes", "shape-beyond-the-file"],
)
def test_a_lying_safetensors_header_is_refused_without_reading_further(tmp_path, raw):
    folder = _hostile_checkpoint(tmp_path / "m", weights=raw)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        AttnResTransformer.load(folder)


# -- 5. bounded training and report inputs ----------------------------------------------------
@pytest.mark.faults("5", "`train --corpus /dev/zero`")
def test_a_corpus_that_is_not_a_regular_file_is_refused(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--corpus", "/dev/zero", "--steps", "5", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert one_line(err, "train") and "not a regular file" in err
    assert not (tmp_path / "run").exists() and hidden_leftovers(tmp_path) == []


@pytest.mark.faults("5", "`train --batch-size 100000000`")
def test_a_batch_that_cannot_fit_in_memory_is_refused_with_the_estimate(tmp_path, capsys):
    t0 = time.perf_counter()
    assert main(["train", "--out", str(tmp_path / "run"), "--batch-size", "100000000", "--steps", "5", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert one_line(err, "train") and "training needs about" in err and "available" in err and "--batch-size" in err
    assert time.perf_counter() - t0 < 5 and not (tmp_path / "run").exists()


@pytest.mark.faults("5", "`report --text-file` with a 1 MB text")
def test_a_report_text_beyond_the_cap_is_refused_before_recording(tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text("abcdefgh " * 120_000)
    t0 = time.perf_counter()
    assert main(["report", "--demo", "block", "--text-file", str(big), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert one_line(err, "report") and "at most 8192 tokens" in err and time.perf_counter() - t0 < 2
    from attnres_probe.reports.recording import MAX_TOKENS, record_text

    with pytest.raises(ValueError, match=f"has {MAX_TOKENS + 1} tokens; a report records at most {MAX_TOKENS}"):
        record_text(tiny_model("full"), "x" * (MAX_TOKENS + 1))
    assert main(["report", "--demo", "block", "--text-file", "/dev/zero", "--out", str(tmp_path / "r.html")]) == 2
    assert "not a regular file" in capsys.readouterr().err


# -- 6. recordings are per call --------------------------------------------------------------
def _same(a: DepthTrace, b: DepthTrace) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n), equal_nan=True) for n in ("depth_weights", "contrib", "rms_in", "grad_in", "param_grad"))


@pytest.mark.faults("6", "`Probe.run` from 6 threads on one model, plain forwards on a 7th")
@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_threads_recording_through_one_model_get_the_sequential_traces(residual):
    model = tiny_model(residual)
    probe = Probe(model)
    texts = [f"text number {i:02d} of six" for i in range(6)]  # equal lengths: a mixed-up trace would fit
    expected = [probe.run(t) for t in texts]
    got: list = [None] * len(texts)
    errors: list = []
    stop = threading.Event()

    def plain_forwards():
        x = torch.randint(0, 256, (3, 9))
        while not stop.is_set():
            with torch.no_grad():
                model(x)

    def record(i):
        try:
            for _ in range(3):
                got[i] = probe.run(texts[i])
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    bg = threading.Thread(target=plain_forwards)
    bg.start()
    workers = [threading.Thread(target=record, args=(i,)) for i in range(len(texts))]
    [w.start() for w in workers]
    [w.join() for w in workers]
    stop.set()
    bg.join()
    assert errors == []
    assert all(_same(a, b) and not b.flags for a, b in zip(expected, got))


@pytest.mark.faults("6", "a plain forward on another thread during an ablation")
def test_an_ablation_changes_only_its_own_threads_forward():
    model = tiny_model("block")
    probe = Probe(model)
    tokens = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        clean = model(tokens)
    seen, stop = [], threading.Event()

    def plain():
        while not stop.is_set():
            with torch.no_grad():
                seen.append(torch.equal(model(tokens), clean))

    t = threading.Thread(target=plain)
    t.start()
    for _ in range(3):
        probe.ablate("some text to ablate", sources="embed")
    stop.set()
    t.join()
    assert seen and all(seen)


# -- 7. trace metadata is checked against a schema on load ------------------------------------
def _corrupt(folder: Path, edit) -> None:
    doc = json.loads((folder / META_FILE).read_text())
    edit(doc)
    (folder / META_FILE).write_text(json.dumps(doc))


CORRUPT = {
    "no shapes": (lambda d: d.pop("shapes"), "'shapes' is missing"),
    "no meta": (lambda d: d.pop("meta"), "'meta' is missing"),
    "no read_labels": (lambda d: d["meta"].pop("read_labels"), "meta.read_labels is missing"),
    "shapes a list": (lambda d: d.__setitem__("shapes", []), "'shapes' is a list"),
    "files a list": (lambda d: d.__setitem__("files", ["x"]), "'files' is a list"),
    "meta a list": (lambda d: d.__setitem__("meta", [1]), "'meta' is a list"),
    "document a list": (lambda d: (d.clear(), d.update({"schema_version": 1})) and None, "'shapes' is missing"),
    "shape a string": (lambda d: d["shapes"].__setitem__("tokens", "12"), "shapes.tokens must be a list"),
    "shapes disagree": (lambda d: d["shapes"].__setitem__("rms_in", [1, 3, 7]), "shapes.rms_in is"),
    "read_labels a dict": (lambda d: d["meta"].__setitem__("read_labels", {"a": 1}), "meta.read_labels must be a list"),
    "too few source labels": (lambda d: d["meta"]["source_labels"].pop(), "meta.source_labels has 2 labels"),
    "str_tokens for 1 token": (lambda d: d["meta"].__setitem__("str_tokens", [["a"]]), "str_tokens\\[0\\] has 1 strings"),
    "residual full on a block trace": (lambda d: d["meta"].__setitem__("residual", "full"), "block_starts \\[0, 2\\] given for residual 'full'"),
    "residual full, no block_starts": (
        lambda d: d["meta"].update(residual="full", block_starts=[]), "the arrays have 5 reads and 3 sources"
    ),
    "flags a string": (lambda d: d["meta"].__setitem__("flags", "oops"), "meta.flags must be a list of strings"),
    "unknown residual": (lambda d: d["meta"].__setitem__("residual", "magic"), "meta.residual is 'magic'"),
    "config.n_layers wrong": (lambda d: d["meta"]["config"].__setitem__("n_layers", 10**9), "reads and 3 sources"),
    "negative schema_version": (lambda d: d.__setitem__("schema_version", -5), "no valid schema_version"),
    "block_starts not increasing": (lambda d: d["meta"].__setitem__("block_starts", [0, 0]), "does not describe a source axis"),
}


@pytest.mark.faults("7", "corrupt or inconsistent trace.json (19 kinds)")
@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_trace_metadata_is_one_trace_error_naming_the_violation(tmp_path, case):
    edit, message = CORRUPT[case]
    make_trace("block", n_pos=4, str_tokens=list("abcd")).save(tmp_path / "t")
    _corrupt(tmp_path / "t", edit)
    with pytest.raises(TraceError, match=message) as info:
        DepthTrace.load(tmp_path / "t")
    assert "\n" not in str(info.value)


@pytest.mark.faults("7", "trace.json and config.json nested 100000 deep")
def test_deeply_nested_json_is_a_clear_error_not_a_recursion_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    make_trace("full").save(tmp_path / "t")
    (tmp_path / "t" / META_FILE).write_text(deep)
    with pytest.raises(TraceError, match="nested too deeply"):
        DepthTrace.load(tmp_path / "t")
    folder = _hostile_checkpoint(tmp_path / "m")
    (folder / "config.json").write_text(deep)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        AttnResTransformer.load(folder)
    (tmp_path / "model.json").write_text(deep)
    with pytest.raises(ConfigError, match="nested too deeply"):
        ModelConfig.from_json(tmp_path / "model.json")


# -- 8. output errors are one line, nothing partial is left, overwrites are consistent --------
@pytest.mark.faults("8", "`record --out` on a read-only file system")
def test_record_onto_a_read_only_file_system_is_one_line(tmp_path, small_disk, checkpoint, capsys, monkeypatch):
    disk = small_disk(256, readonly=True)
    if disk is None:
        disk = tmp_path
        monkeypatch.setenv(FAULT_ENV, "erofs@trace.save:tokens.parquet")
    assert main(["record", "--model", str(checkpoint), "--text", "abc", "--out", str(disk / "tr")]) == 2
    err = capsys.readouterr().err
    assert one_line(err, "record") and "read-only" in err and str(disk / "tr") in err and "nothing was written" in err
    assert sorted(os.listdir(disk)) == []


@pytest.mark.faults("8", "`record` and `train` on a full disk")
def test_saves_on_a_full_disk_are_one_line_and_leave_nothing(tmp_path, small_disk, checkpoint, capsys, monkeypatch):
    disk = small_disk(64)
    if disk is None:
        disk = tmp_path
    else:
        fill(disk, leave=16 * 1024)
    monkeypatch.setenv(FAULT_ENV, "") if disk is not tmp_path else monkeypatch.setenv(FAULT_ENV, "enospc@trace.save:cube.parquet")
    assert main(["record", "--model", str(checkpoint), "--text", "a text to record " * 4, "--out", str(disk / "tr")]) == 2
    err = capsys.readouterr().err
    assert one_line(err, "record") and "no space left" in err and "nothing was written" in err
    if disk is tmp_path:
        monkeypatch.setenv(FAULT_ENV, "enospc@train.save:weights")
    flags = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--n-ctx", "32", "--batch-size", "2", "--steps", "2",
             "--eval-every", "0", "--quiet"]  # fmt: skip
    assert main(["train", "--out", str(disk / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert one_line(err, "train") and "no space left" in err and "nothing was saved" in err
    assert sorted(p for p in os.listdir(disk) if p != "filler") == []


@pytest.mark.faults("8", "`report --out` onto an existing file")
def test_report_refuses_an_existing_out_unless_forced(tmp_path, capsys):
    out = tmp_path / "r.html"
    out.write_text("mine")
    argv = ["report", "--demo", "block", "--text", "x = 1\n", "--no-backward", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert one_line(err, "report") and "already exists" in err and "--force" in err and out.read_text() == "mine"
    assert main([*argv, "--force"]) == 0 and "<!DOCTYPE html>" in out.read_text()
    assert hidden_leftovers(tmp_path) == []


# -- 9. loopback is decided from the resolved address -----------------------------------------
@pytest.mark.faults("9", "`dash --host 127.1` and a request with `Host: evil.com`")
def test_a_loopback_address_in_any_spelling_refuses_foreign_host_headers(tmp_path, monkeypatch):
    import attnres_probe.dashboards.serving as dash_cli

    make_trace("full").save(tmp_path / "t")
    apps = []
    monkeypatch.setattr(dash_cli, "serve", lambda app, **kw: apps.append(app) or 0)
    for host in ("127.1", "127.0.0.1", "localhost", "0x7f.0.0.1"):
        assert main(["dash", "--host", host, "--traces", str(tmp_path / "t")]) == 0
        client = apps[-1].server.test_client()
        assert client.get("/", headers={"Host": "evil.com"}).status_code == 421, host
        assert client.get("/", headers={"Host": f"{host}:8050"}).status_code == 200, host
    assert main(["dash", "--host", "0.0.0.0", "--traces", str(tmp_path / "t")]) == 0
    assert apps[-1].server.test_client().get("/", headers={"Host": "box.lan"}).status_code == 200


# -- 10. smaller ones ---------------------------------------------------------------------------
@pytest.mark.faults("10", "the Numba kernels fail to import (read-only package folder and HOME)")
def test_a_broken_numba_import_warns_once_and_falls_back(monkeypatch):
    from attnres_probe import kernels
    from attnres_probe.kernels import backends
    from attnres_probe.kernels.ops import depth_attn as depth_attn_folder

    monkeypatch.setitem(sys.modules, "attnres_probe.kernels.ops.depth_attn.numba", None)  # the import fails
    monkeypatch.delattr(depth_attn_folder, "numba", raising=False)
    backends._numba_import_error.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kernels.resolve_backend("cpu", "auto") == "torch"
            assert kernels.resolve_backend("cpu", "auto") == "torch"
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "Numba CPU kernels could not be imported" in msgs[0] and "ATTNRES_BACKEND=torch" in msgs[0]
    finally:
        monkeypatch.undo()
        backends._numba_import_error.cache_clear()


@pytest.mark.faults("10", "`trace.weights(read=1.5)`, `token=True`")
def test_trace_selection_takes_integers_only():
    t = make_trace("full")
    for kwargs in (dict(read=1.5), dict(token=True), dict(token=1.0), dict(token=0, batch=0.0)):
        with pytest.raises(TypeError, match="must be"):
            t.weights(**kwargs)
    with pytest.raises(TypeError):
        t.source_index(True)
    assert t.weights(token=np.int64(1), read=np.int32(1)).shape == (1, 3)


@pytest.mark.faults("10", "`init_std=inf`, `format_version=-5`")
def test_infinite_init_std_and_negative_format_version_are_refused(tmp_path):
    for field in ("init_std", "embed_std"):
        with pytest.raises(ConfigError, match=f"{field} must be a positive number"):
            ModelConfig(**{field: float("inf")})
    folder = _hostile_checkpoint(tmp_path / "m")
    doc = json.loads((folder / "config.json").read_text())
    doc["format_version"] = -5
    (folder / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="format_version -5"):
        AttnResTransformer.load(folder)


@pytest.mark.faults("10", "a folder of trace files without trace.json")
def test_a_partial_trace_folder_is_called_incomplete(tmp_path):
    make_trace("full").save(tmp_path / "t")
    (tmp_path / "t" / META_FILE).unlink()
    with pytest.raises(FileExistsError, match="holds an incomplete DepthTrace"):
        make_trace("full").save(tmp_path / "t")
    make_trace("full").save(tmp_path / "t", overwrite=True)
    assert DepthTrace.load(tmp_path / "t").residual == "full"


@pytest.mark.faults("10", "temporary files left by a SIGKILLed writer", how="SIGKILL, forked child")
def test_temporary_files_of_killed_writers_are_cleared_by_the_next_save(tmp_path):
    from attnres_probe.io import atomic_write

    target = tmp_path / "report.html"
    assert in_child(lambda: atomic_write(target, lambda p: p.write_text("x")), "kill@atomic_write:report.html") == -9
    assert len(hidden_leftovers(tmp_path)) == 1  # the killed writer's .report.html.PID.*.tmp
    atomic_write(target, lambda p: p.write_text("y"))
    assert hidden_leftovers(tmp_path) == [] and target.read_text() == "y"
    folder = tmp_path / "t"
    make_trace("full").save(folder)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = folder / f".tokens.parquet.{dead.stdout.strip()}.abc.tmp"
    stale.write_text("x")
    make_trace("full").save(folder, overwrite=True)
    assert hidden_leftovers(folder) == []


@pytest.mark.faults("10", "`run_corpus([None, 3])`, a lone surrogate")
def test_bad_corpus_entries_and_lone_surrogates_get_clear_messages():
    probe = Probe(tiny_model("full"))
    with pytest.raises(TypeError, match="text 0 of the corpus is NoneType"):
        probe.run_corpus([None, 3], progress=False)
    with pytest.raises(TypeError, match="text 1 of the corpus is int 3"):
        probe.run_corpus(["ok text", 3], progress=False)
    with pytest.raises(ValueError, match="lone surrogate U\\+D800 at character 2"):
        probe.run("ab\ud800")


@pytest.mark.faults("10", "sha256 of checkpoints saved from identical models")
def test_identical_models_give_byte_identical_checkpoints(tmp_path):
    import hashlib

    model = tiny_model("block")
    digests = set()
    for i in range(6):  # safetensors' metadata order changes from save to save without sorting
        model.save(tmp_path / str(i))
        digests.add(hashlib.sha256((tmp_path / str(i) / "model.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1
    loaded = AttnResTransformer.load(tmp_path / "0")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


# -- 11. writers that share a folder (issue #38) ------------------------------------------------
CORPUS_DOCS = {f"d{i}.txt": f"Document {i} of the corpus, long enough for a few windows of the tiny model. " * 3 for i in range(4)}


@pytest.fixture(scope="module")
def corpus_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus-in")
    for name, text in CORPUS_DOCS.items():
        (root / "data").mkdir(exist_ok=True)
        (root / "data" / name).write_text(text)
    for r in ("prenorm", "block"):
        tiny_model(r).save(root / r)
    return root / "data", [str(root / "prenorm"), str(root / "block")]


@pytest.mark.faults("11", "two `corpus` runs with different settings started at the same instant on one --out, 20 times",
                    how="two threads, one barrier")
def test_two_corpus_runs_on_one_out_never_both_succeed_nor_mix(tmp_path, corpus_inputs):
    from attnres_probe.corpus import CorpusRunError, load_stats_dir, record_corpus

    data, ckpts = corpus_inputs
    for attempt in range(20):
        out = tmp_path / f"out{attempt}"
        barrier = threading.Barrier(2)
        results: dict[int, object] = {}

        def run(batch_size: int) -> None:
            barrier.wait()
            try:
                results[batch_size] = record_corpus(data, out, models=ckpts, batch_size=batch_size, progress=False,
                                                    n_resamples=20, save_every=0.0)
            except (DestinationBusyError, CorpusRunError) as exc:
                results[batch_size] = exc

        threads = [threading.Thread(target=run, args=(b,)) for b in (2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [b for b, r in results.items() if isinstance(r, dict)]
        assert len(won) == 1, f"attempt {attempt}: {results}"
        lost = results[5 - won[0]]
        assert "being written by another process (PID" in str(lost) or "other settings" in str(lost)
        manifest, stats = load_stats_dir(out)  # one run's settings, every model's stats from it
        assert manifest["settings"]["batch_size"] == won[0] and manifest["complete"]
        assert {m["name"]: m["windows"] for m in manifest["models"]} == {n: s.n_windows for n, s in stats.items()}
        assert hidden_leftovers(tmp_path) == []


@pytest.mark.faults("11", "`corpus --out` while another process holds it")
def test_a_corpus_run_on_a_held_out_is_refused_at_once_naming_the_holder(tmp_path, corpus_inputs, capsys):
    data, ckpts = corpus_inputs
    out = tmp_path / "out"
    with exclusive_lock(out):
        started = time.monotonic()
        assert main(["corpus", "--models", *ckpts, "--data", str(data), "--out", str(out), "--no-progress"]) == 2
        assert time.monotonic() - started < 5  # refused before any model is loaded
    err = capsys.readouterr().err
    assert one_line(err, "corpus") and f"PID {os.getpid()}" in err and "--out" in err
    assert not out.exists()


STATS_KILL_POINTS = ["stats.save:arrays#2", "stats.save:windows#2", "write_directory:written#2",
                     "replace_directory:swapped#2", "replace_directory:aside#2"]


@pytest.mark.faults("11", "SIGKILL at each step of a corpus stats save, then `corpus --resume`", how="SIGKILL, forked child")
@pytest.mark.parametrize("point", STATS_KILL_POINTS)
def test_a_corpus_run_killed_while_saving_leaves_no_staging_folder_after_the_resume(tmp_path, corpus_inputs, point):
    from attnres_probe.corpus import load_stats_dir, record_corpus

    data, ckpts = corpus_inputs
    out = tmp_path / "out"

    def run():
        if point.startswith("replace_directory:aside"):
            import attnres_probe.io as io

            io._exchange = lambda a, b: False  # a system without renameat2(RENAME_EXCHANGE)
        record_corpus(data, out, models=ckpts, batch_size=1, progress=False, n_resamples=20, save_every=0.0)

    assert in_child(run, f"kill@{point}") == -9
    models = out / "models"
    assert any(p.name.startswith(".") for p in models.iterdir())  # the kill left something behind ...
    record_corpus(data, out, models=ckpts, batch_size=1, progress=False, n_resamples=20, save_every=0.0, resume=True)
    assert sorted(p.name for p in models.iterdir()) == ["block", "prenorm"]  # ... which the resume removed
    manifest, stats = load_stats_dir(out)
    assert manifest["complete"] and all(s.n_windows > 0 for s in stats.values())
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.faults("11", "`corpus --names` that become one folder name: \"a b\" and \"a_b\", \"A\" and \"a\"")
@pytest.mark.parametrize("names", [["a b", "a_b"], ["Block", "block"]])
def test_model_names_that_would_share_a_folder_are_refused_naming_both(tmp_path, corpus_inputs, capsys, names):
    data, ckpts = corpus_inputs
    out = tmp_path / "out"
    assert main(["corpus", "--models", *ckpts, "--names", *names, "--data", str(data), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert one_line(err, "corpus") and all(repr(n) in err for n in names) and "models/" in err
    assert not out.exists()


@pytest.mark.faults("11", "`watch()` given None, a string, an nn.Linear, attnres-probe's own model")
def test_watch_given_the_wrong_object_says_what_it_accepts():
    from attnres_probe.watch import watch

    for wrong in (None, "model", torch.nn.Linear(2, 2), tiny_model("block")):
        with pytest.raises(TypeError, match=r"watch\(\) records a live flash-linear-attention AttnRes model"):
            with watch(wrong):
                pass
    with pytest.raises(TypeError, match="use Probe\\(model\\).run"):
        with watch(tiny_model("full")):
            pass
