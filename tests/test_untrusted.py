"""#37: every file the toolkit reads is untrusted. One named test per class of the adversarial
catalogue: a folder's code never runs, paths never lead out of their folder, ``--force`` replaces
only regular files, sizes are bounded before anything is allocated, malformed documents give one
line naming the file and key, and CLI numbers are checked with their accepted range."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from attnres_probe.cli import main
from attnres_probe.corpus import CorpusRunError, load_stats_dir
from attnres_probe.corpus.stats import CorpusStats, StatsError

from helpers import tiny_model

ROOT = Path(__file__).resolve().parents[1]


# -- fla / HF folders ------------------------------------------------------------------------
@pytest.fixture
def fla_folder(tmp_path):
    pytest.importorskip("fla")
    from test_pretrained import _saved

    folder = tmp_path / "fla"
    folder.mkdir()
    _saved(folder, 2)
    return folder


def _edit(path: Path, **changes):
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_a_model_folder_asking_for_its_own_code_is_refused_and_none_of_it_runs(fla_folder, tmp_path, where):
    from attnres_probe.pretrained import PretrainedError, load_pretrained

    marker = tmp_path / "ran"
    (fla_folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nclass Evil: pass\n")
    _edit(fla_folder / where, auto_map={"AutoTokenizer": ["evil.Evil", None], "AutoConfig": "evil.Evil"})
    with pytest.raises(PretrainedError, match="never runs code from a model folder") as err:
        load_pretrained(fla_folder)
    assert "\n" not in str(err.value) and not marker.exists()


def _index(folder: Path, weight_map: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(fla_folder, tmp_path):
    from safetensors import safe_open

    from attnres_probe.pretrained import PretrainedError, load_pretrained

    with safe_open(str(fla_folder / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    shutil.move(fla_folder / "model.safetensors", tmp_path / "_outside.safetensors")
    _index(fla_folder, {k: "../_outside.safetensors" for k in keys})
    with pytest.raises(PretrainedError, match="leads out of"):
        load_pretrained(fla_folder, tokenizer=False)
    _index(fla_folder, {k: str(tmp_path / "_outside.safetensors") for k in keys})  # an absolute path
    with pytest.raises(PretrainedError, match="leads out of"):
        load_pretrained(fla_folder, tokenizer=False)
    (fla_folder / "shard.safetensors").symlink_to(tmp_path / "_outside.safetensors")  # a link leading out
    _index(fla_folder, {k: "shard.safetensors" for k in keys})
    with pytest.raises(PretrainedError, match="outside"):
        load_pretrained(fla_folder, tokenizer=False)


def test_a_shard_index_must_map_each_tensor_to_the_file_that_holds_it(fla_folder):
    from safetensors.torch import load_file, save_file

    from attnres_probe.pretrained import PretrainedError, load_pretrained

    tensors = load_file(fla_folder / "model.safetensors")
    (fla_folder / "model.safetensors").unlink()
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[::2]}, str(fla_folder / "a.safetensors"))
    save_file({k: tensors[k] for k in keys[1::2]}, str(fla_folder / "b.safetensors"))
    good = {k: ("a.safetensors" if i % 2 == 0 else "b.safetensors") for i, k in enumerate(keys)}
    _index(fla_folder, good)
    load_pretrained(fla_folder, tokenizer=False)  # the honest index loads
    wrong = dict(good, **{keys[0]: "b.safetensors"})
    _index(fla_folder, wrong)
    with pytest.raises(PretrainedError, match="disagree"):
        load_pretrained(fla_folder, tokenizer=False)
    save_file({k: tensors[k] for k in keys}, str(fla_folder / "b.safetensors"))  # a second copy of every tensor
    _index(fla_folder, good)
    with pytest.raises(PretrainedError, match="stored twice|disagree"):
        load_pretrained(fla_folder, tokenizer=False)


def test_integer_or_bool_weights_of_the_right_shape_are_refused(fla_folder):
    from safetensors.torch import load_file, save_file

    from attnres_probe.pretrained import PretrainedError, load_pretrained

    tensors = load_file(fla_folder / "model.safetensors")
    key = next(k for k in tensors if k.endswith("attn.q_proj.weight"))
    for dtype in (torch.int32, torch.uint8, torch.bool):
        save_file({**tensors, key: tensors[key].to(dtype)}, str(fla_folder / "model.safetensors"))
        with pytest.raises(PretrainedError, match="floating point"):
            load_pretrained(fla_folder, tokenizer=False)


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 10**6}, "'num_hidden_layers' is 1000000; accepted in 1..1024"),
    ({"num_hidden_layers": 10**8}, "accepted in 1..1024"),
    ({"max_position_embeddings": 10**9}, "'max_position_embeddings' is 1000000000; accepted in 1..1048576"),
    ({"hidden_size": 64.9}, "'hidden_size' is 64.9; it must be an integer"),
    ({"hidden_size": float("inf")}, "'hidden_size' is inf; it must be an integer"),
    ({"num_heads": "4"}, "'num_heads' is '4'; it must be an integer"),
    ({"norm_eps": -1}, "'norm_eps' is -1; accepted in 0..1"),
])
def test_an_fla_config_is_bounded_before_anything_is_built_from_it(fla_folder, change, message):
    from attnres_probe.pretrained import PretrainedError, load_pretrained

    _edit(fla_folder / "config.json", **change)
    with pytest.raises(PretrainedError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_pretrained(fla_folder, tokenizer=False)
    assert "\n" not in str(err.value)


def test_a_config_implying_more_weights_than_the_files_hold_is_refused_before_reading_them(fla_folder):
    from attnres_probe.pretrained import PretrainedError, load_pretrained

    _edit(fla_folder / "config.json", vocab_size=4_000_000)
    with pytest.raises(PretrainedError, match="implies .* parameters .* the weight files hold"):
        load_pretrained(fla_folder, tokenizer=False)


def test_a_rotary_table_larger_than_the_memory_bound_is_refused(fla_folder, monkeypatch):
    from attnres_probe.pretrained import PretrainedError, load_pretrained

    monkeypatch.setenv("ATTNRES_MEMORY_CAP", "1e6")
    _edit(fla_folder / "config.json", max_position_embeddings=1 << 20)
    with pytest.raises(PretrainedError, match="rotary table .* more than the 1.0 MB"):
        load_pretrained(fla_folder, tokenizer=False)


# -- stats folders ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    for r in ("prenorm", "block"):
        tiny_model(r).save(root / "ckpt" / r)
    data = root / "data"
    data.mkdir()
    for i in range(3):
        (data / f"d{i}.txt").write_text(f"document {i} with a few words in it, enough for a window or two " * 2)
    out = root / "out"
    assert main(["corpus", "--models", str(root / "ckpt" / "prenorm"), str(root / "ckpt" / "block"), "--data", str(data),
                 "--out", str(out), "--no-progress", "--resamples", "50"]) == 0
    return out


@pytest.fixture
def run(corpus_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(corpus_run, copy, symlinks=True)
    return copy


def _manifest(run: Path) -> dict:
    return json.loads((run / "corpus.json").read_text())


def test_a_stats_folder_naming_a_model_folder_outside_it_is_refused(run, tmp_path):
    other = tmp_path / "_other_run"
    shutil.copytree(run, other)
    for bad in ("../_other_run/models/block", str(other / "models" / "block")):
        m = _manifest(run)
        m["models"][1]["dir"] = bad
        (run / "corpus.json").write_text(json.dumps(m))
        with pytest.raises(CorpusRunError, match="leads out of"):
            load_stats_dir(run)
    m = _manifest(run)
    m["models"][1]["dir"] = "models/block"
    (run / "corpus.json").write_text(json.dumps(m))
    shutil.rmtree(run / "models" / "block")
    (run / "models" / "block").symlink_to(other / "models" / "block")  # a link to another run's stats
    with pytest.raises(CorpusRunError, match="outside"):
        load_stats_dir(run)


def test_a_complete_run_with_a_model_missing_duplicated_or_half_saved_is_refused(run):
    m = _manifest(run)
    m["models"][1]["name"] = m["models"][0]["name"]
    (run / "corpus.json").write_text(json.dumps(m))
    with pytest.raises(CorpusRunError, match="given twice"):
        load_stats_dir(run)
    m["models"][1]["name"] = "block"
    (run / "corpus.json").write_text(json.dumps(m))
    stats_json = run / "models" / "block" / "stats.json"
    doc = json.loads(stats_json.read_text())
    doc["meta"]["progress"] = [1, 0]  # a save from the middle of the run
    stats_json.write_text(json.dumps(doc))
    with pytest.raises(CorpusRunError, match="middle of the run"):
        load_stats_dir(run)
    shutil.rmtree(run / "models" / "block")
    with pytest.raises(CorpusRunError, match="holds no stats"):
        load_stats_dir(run)


def _resum(folder: Path, doc: dict) -> None:
    from attnres_probe.io import sha256_file

    for name in ("arrays.npz", "windows.parquet"):
        doc.setdefault("files", {})[name] = sha256_file(folder / name)
    (folder / "stats.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("meta"), "key 'meta' is missing"),
    (lambda d: d["meta"].update(read_labels="L0.attn"), "'read_labels' is 'L0.attn'; it must be a list"),
    (lambda d: d["meta"].update(block_starts=[0, "x"]), "'block_starts' must be a list of sublayer indices"),
    (lambda d: d["meta"].update(source_labels=[1, 2]), "'source_labels' must be a list of strings"),
    (lambda d: d.update(n_tokens="many"), "'n_tokens' is 'many'; it must be an integer"),
    (lambda d: d.update(n_tokens=-5), "'n_tokens' is -5; accepted"),
    (lambda d: d.update(n_windows=1_000_000), "holds .* rows, but stats.json says 1000000 windows"),
])
def test_a_stats_document_with_missing_keys_wrong_types_or_counts_is_one_line(run, mutate, message):
    folder = run / "models" / "block"
    doc = json.loads((folder / "stats.json").read_text())
    mutate(doc)
    _resum(folder, doc)
    with pytest.raises(StatsError, match=message) as err:
        CorpusStats.load(folder)
    assert "\n" not in str(err.value)


def test_deeply_nested_json_is_refused_without_a_recursion_traceback(run):
    folder = run / "models" / "block"
    (folder / "stats.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StatsError, match="nested too deeply|not valid JSON"):
        CorpusStats.load(folder)


def test_negative_counts_in_the_arrays_are_refused(run):
    folder = run / "models" / "block"
    with np.load(folder / "arrays.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    key = next(k for k in arrays if k.endswith(".count"))
    arrays[key] = arrays[key] - 10**6
    np.savez(folder / "arrays.npz", **arrays)
    _resum(folder, json.loads((folder / "stats.json").read_text()))
    with pytest.raises(StatsError, match="negative counts"):
        CorpusStats.load(folder)


def test_arrays_that_inflate_past_the_memory_bound_are_refused_before_inflating(run, monkeypatch):
    folder = run / "models" / "block"
    _resum(folder, json.loads((folder / "stats.json").read_text()))
    monkeypatch.setenv("ATTNRES_MEMORY_CAP", str(2**10))  # the real arrays are a few KB
    with pytest.raises(StatsError, match=r"the arrays once inflated would need .* more than the 1.0 KB allowed for one "
                                         r"file \(\$ATTNRES_MEMORY_CAP"):
        CorpusStats.load(folder)


def test_an_array_header_declaring_another_shape_is_refused_before_inflating(run):
    """The issue's 4 MB npz that inflates to 4 GiB: here 32 MiB of zeros in a few KB, refused on the
    shape its header declares, before numpy allocates it (tracemalloc sees numpy's allocations)."""
    import tracemalloc

    folder = run / "models" / "block"
    with np.load(folder / "arrays.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    key = next(k for k in arrays if k.startswith("token.depth_weights.") and k.endswith(".mean"))
    arrays[key] = np.zeros(4 * 2**20)  # 32 MiB of zeros: a few KB compressed
    np.savez_compressed(folder / "arrays.npz", **arrays)
    assert (folder / "arrays.npz").stat().st_size < 2**20
    _resum(folder, json.loads((folder / "stats.json").read_text()))
    tracemalloc.start()
    try:
        with pytest.raises(StatsError, match=r"aggregate 'token.depth_weights.mean' has shape \[4194304\]; a model of"):
            CorpusStats.load(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak


@pytest.mark.parametrize("declared", ["more", "objects"])
def test_an_npy_header_that_lies_about_its_data_or_holds_objects_is_refused(tmp_path, declared):
    from numpy.lib import format as npy

    from attnres_probe.validate import npz_headers

    member = io.BytesIO()
    if declared == "more":  # a header for 10**12 float64 over 8 bytes of data
        npy.write_array_header_1_0(member, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
        member.write(b"\0" * 8)
    else:
        np.save(member, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with zipfile.ZipFile(tmp_path / "a.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", member.getvalue())
    message = "declares shape \\[1000000000000\\] of float64" if declared == "more" else "holds Python objects"
    with pytest.raises(ValueError, match=f"member 'x.npy' {message}"):
        npz_headers(tmp_path / "a.npz")


def test_a_window_table_with_more_rows_than_the_document_says_is_refused(run):
    folder = run / "models" / "block"
    table = pd.read_parquet(folder / "windows.parquet")
    pd.concat([table] * 50, ignore_index=True).to_parquet(folder / "windows.parquet")
    _resum(folder, json.loads((folder / "stats.json").read_text()))
    with pytest.raises(StatsError, match="holds .* rows, but stats.json says"):
        CorpusStats.load(folder)


# -- writes ----------------------------------------------------------------------------------
def test_force_replaces_only_a_regular_file_never_a_fifo_or_a_folder(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    trace = tmp_path / "t"
    from attnres_probe.reports import record_text

    record_text(tiny_model("full"), "abc", name="full").save(trace)
    assert main(["report", "--traces", str(trace), "--out", str(fifo), "--force"]) == 2
    assert "is a FIFO, not a regular file" in capsys.readouterr().err
    assert fifo.is_fifo()
    from attnres_probe.io import atomic_write

    with pytest.raises(FileExistsError, match="FIFO, not a regular file; it is never replaced"):
        atomic_write(fifo, lambda p: p.write_text("x"))
    assert fifo.is_fifo()
    regular = tmp_path / "r.html"
    regular.write_text("old")
    assert main(["report", "--traces", str(trace), "--out", str(regular), "--force"]) == 0  # a regular file: replaced
    assert regular.read_text() != "old"


# -- the command line -------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["report", "--stats", "x", "--out", "y.html", "--resamples", "1000000000"], "--resamples: 1000000000 is out of range; accepted 1..100000"),
    (["corpus", "--demo", "--data", "x", "--out", "y", "--save-every", "nan"], "--save-every: nan is out of range"),
    (["corpus", "--demo", "--data", "x", "--out", "y", "--batch-size", "0"], "--batch-size: 0 is out of range; accepted 1..4096"),
    (["dash", "--port", "70000"], "--port: 70000 is out of range; accepted 0..65535"),
])
def test_numeric_flags_are_checked_with_their_range(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_python_dash_m_cli_gives_the_same_one_line_errors(tmp_path):
    cmd = [sys.executable, "-m", "attnres_probe.cli", "report", "--models", str(tmp_path / "missing"), "--text", "x",
           "--out", str(tmp_path / "r.html")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "error:" in out.stderr


def test_record_truncate_reads_only_the_start_of_a_long_file(tmp_path, monkeypatch):
    """#37: `record --file BIG --truncate` keeps n_ctx tokens, so it reads about that much, not the file."""
    import argparse

    from attnres_probe.cli import record as commands

    big = tmp_path / "big.txt"
    big.write_bytes(("é" * 1000 + "\n").encode() * 4000)  # 8 MB, two-byte characters across every read boundary
    read = []
    real_open = Path.open

    def counting_open(self, mode="r", *a, **k):
        f = real_open(self, mode, *a, **k)
        if self == big:
            orig = f.read
            f.read = lambda n=-1: (read.append(n), orig(n))[1]
        return f

    monkeypatch.setattr(Path, "open", counting_open)
    text = commands._text(argparse.Namespace(file=str(big), truncate=True, text=None), n_ctx=128)
    assert read == [commands.TRUNCATE_READ] and len(text.encode()) <= commands.TRUNCATE_READ and text.startswith("éé")
    whole = commands._text(argparse.Namespace(file=str(big), truncate=False, text=None), n_ctx=128)
    assert len(whole) == 4000 * 1001


def test_a_file_that_is_not_utf8_is_named_with_its_byte_offset_and_a_fix(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert main(["record", "--demo", "full", "--file", str(bad), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text: invalid continuation byte at byte 3" in err and "iconv -f latin1" in err


def test_corpus_cuts_a_long_documents_windows_from_chunks_not_from_the_whole_file(tmp_path, monkeypatch):
    """#37: a corpus run holds one chunk of a document (and one window), not the document: the
    windows from streamed chunks equal those of the whole text, across chunk boundaries that fall
    inside a window and inside a character."""
    from attnres_probe import Probe
    from attnres_probe.corpus import StreamedDocument, list_documents
    from attnres_probe.corpus import documents as corpus

    path = tmp_path / "long.txt"
    path.write_text("ünïcode text, " * 3000, encoding="utf-8")  # 45 kB
    doc = list_documents(path)[0]
    monkeypatch.setattr(corpus, "STREAM_CHUNK", 1000)  # chunks much smaller than the document, not multiples of n_ctx
    probe = Probe(tiny_model("full", n_ctx=24), name="full")
    streamed = list(probe._corpus_windows([StreamedDocument(doc)]))
    whole = list(probe._corpus_windows([path.read_text(encoding="utf-8")]))
    assert [(d, s) for d, s, _ in streamed] == [(d, s) for d, s, _ in whole]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(streamed, whole))
    reads = []
    real = StreamedDocument.iter_bytes

    def spy(self, size=None):
        for chunk in real(self, corpus.STREAM_CHUNK):
            reads.append(len(chunk))
            yield chunk

    monkeypatch.setattr(StreamedDocument, "iter_bytes", spy)
    list(probe._corpus_windows([StreamedDocument(doc)]))
    assert max(reads) == 1000 and sum(reads) == path.stat().st_size
