"""``attnres-probe corpus``: record a corpus through several models and write the aggregates.

    attnres-probe corpus --demo --data notes/ --out runs/corpus
    attnres-probe corpus --models runs/prenorm runs/block --data book.txt --out runs/corpus

``--data`` is a UTF-8 text file (one document) or a folder (every non-hidden file below it, in
sorted order, one document each). Every file is checked first (a file that is not UTF-8 stops
the run before any model runs, naming the file and the byte offset). Each model then records
every document in ``n_ctx``-token windows (:meth:`Probe.run_corpus`: bounded memory, one
backward pass per window for per-window gradients) and its :class:`~attnres_probe.stats.CorpusStats`
go into ``OUT/models/<name>/``; ``OUT/corpus.json`` says what was recorded from what.

The run is resumable: stats are saved (atomically) every ``--save-every`` seconds and when a
model finishes; running the same command again continues where it stopped. A folder holding a
run over other data, other models or other settings is refused with the reason. When every
model is done, ``OUT/comparison.csv`` holds :func:`attnres_probe.metrics.compare` of them all.

``attnres-probe dash --stats OUT`` and ``attnres-probe report --stats OUT`` show the result.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnres_probe._version import __version__
from attnres_probe.io import atomic_write, clear_leftovers, exclusive_lock, set_aside
from attnres_probe.validate import MAX_RESAMPLES, arg_range

__all__ = [
    "CORPUS_FILE",
    "CorpusDataError",
    "CorpusRunError",
    "Document",
    "add_corpus_parser",
    "list_documents",
    "load_stats_dir",
    "StreamedDocument",
    "read_document",
    "record_corpus",
]

CORPUS_FILE = "corpus.json"
RANKS_DIR = ".ranks"  # under torchrun: each rank's progress, until the merged result is written
COMPARISON_FILE = "comparison.csv"
CORPUS_SCHEMA_VERSION = 1
DEMO_SOURCE = "demo:"
_CHUNK = 1 << 20


class CorpusDataError(ValueError):
    """The corpus data cannot be read: missing, empty, or not UTF-8 (the message names the file and offset)."""


class CorpusRunError(ValueError):
    """A corpus output folder that does not fit this run (other data, models or settings), or is incomplete."""


@dataclass(frozen=True)
class Document:
    """One file of the corpus: its path, its path relative to ``--data``, size and sha256."""

    path: Path
    name: str
    size: int
    sha256: str


# -- data --------------------------------------------------------------------------------------
def list_documents(data: str | Path) -> list[Document]:
    """The documents of ``data`` (a file, or every non-hidden file below a folder, sorted), each checked to be UTF-8.

    Raises:
        CorpusDataError: ``data`` does not exist, holds no file, or a file is not UTF-8 text
            (naming the file and the byte offset of the first bad byte).
    """
    root = Path(data)
    if not root.exists():
        raise CorpusDataError(f"--data {data}: no such file or folder")
    if root.is_file():
        files = [(root, root.name)]
    elif root.is_dir():
        files = sorted(
            ((p, p.relative_to(root).as_posix()) for p in root.rglob("*")
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)),
            key=lambda x: x[1],
        )
        if not files:
            raise CorpusDataError(f"--data {data}: the folder holds no files (hidden files are left out); the corpus is empty")
    else:
        raise CorpusDataError(f"--data {data}: not a regular file or folder")
    return [_check_utf8(p, name) for p, name in files]


def _check_utf8(path: Path, name: str) -> Document:
    """Read ``path`` in chunks: sha256, size, and a UTF-8 check that reports the offset of the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    h = hashlib.sha256()
    offset = 0
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK)
                final = not chunk
                try:
                    decoder.decode(chunk, final=final)
                except UnicodeDecodeError as exc:
                    # exc.object is the decoder's buffered bytes (end of the previous chunk) + this chunk
                    at = offset - (len(exc.object) - len(chunk)) + exc.start
                    bad = exc.object[exc.start] if exc.start < len(exc.object) else None
                    shown = f"byte 0x{bad:02x}" if bad is not None and exc.reason != "unexpected end of data" else "a truncated character"
                    raise CorpusDataError(
                        f"corpus file {str(path)!r} is not valid UTF-8 ({shown} at byte offset {at}); "
                        "only UTF-8 text is accepted (convert it first, e.g. iconv -f latin1 -t utf-8)"
                    ) from None
                if final:
                    break
                h.update(chunk)
                offset += len(chunk)
    except OSError as exc:
        raise CorpusDataError(f"corpus file {str(path)!r} cannot be read ({exc.strerror or exc})") from None
    return Document(path=path, name=name, size=offset, sha256=h.hexdigest())


STREAM_CHUNK = 1 << 20  # bytes of a document read at a time when its windows are cut from bytes


@dataclass(frozen=True)
class StreamedDocument:
    """A checked document read in chunks (``iter_bytes``) when the model's tokens are its bytes, so a
    corpus run holds one chunk and one window of it, not the whole file; ``read_text`` for other tokenizers."""

    doc: Document

    def iter_bytes(self, size: int | None = None):
        import codecs

        size = size or STREAM_CHUNK
        check = codecs.getincrementaldecoder("utf-8")()
        at = 0
        try:
            with self.doc.path.open("rb") as f:
                while chunk := f.read(size):
                    try:
                        check.decode(chunk)
                    except UnicodeDecodeError as exc:  # changed since it was checked
                        raise CorpusDataError(f"corpus file {str(self.doc.path)!r} is not valid UTF-8 (byte offset "
                                              f"{at + exc.start})") from None
                    at += len(chunk)
                    yield chunk
        except OSError as exc:
            raise CorpusDataError(f"corpus file {str(self.doc.path)!r} cannot be read ({exc.strerror or exc})") from None

    def read_text(self) -> str:
        return read_document(self.doc)


def read_document(doc: Document) -> str:
    """The text of a checked document."""
    try:
        return doc.path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:  # changed since it was checked
        raise CorpusDataError(f"corpus file {str(doc.path)!r} is not valid UTF-8 (byte offset {exc.start})") from None


def _data_manifest(data: str | Path, docs: list[Document]) -> dict[str, Any]:
    h = hashlib.sha256()
    for d in docs:
        h.update(f"{d.name}\0{d.size}\0{d.sha256}\n".encode())
    return {
        "path": str(Path(data).resolve()),
        "kind": "file" if Path(data).is_file() else "folder",
        "documents": len(docs),
        "bytes": sum(d.size for d in docs),
        "sha256": h.hexdigest(),
        "files": [[d.name, d.size, d.sha256] for d in docs],
    }


# -- models ------------------------------------------------------------------------------------
def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def _model_specs(models: Sequence[str] | None, demo: Sequence[str] | None, names: Sequence[str] | None) -> list[dict[str, str]]:
    """[{"name", "source"}] for checkpoint folders or demo models, in order, names unique."""
    from attnres_probe.demo import DEMO_NAMES

    if demo is not None:
        asked = set(demo) or set(DEMO_NAMES)
        specs = [{"name": n, "source": DEMO_SOURCE + n} for n in DEMO_NAMES if n in asked]
    else:
        specs = []
        from attnres_probe.pretrained import not_a_model_folder

        for d in models or []:
            path = Path(d)
            if not path.is_dir():
                raise CorpusRunError(not_a_model_folder("--models", d))
            specs.append({"name": path.resolve().name, "source": str(path.resolve())})
    if not specs:
        raise CorpusRunError("no models: pass --models DIR … or --demo")
    if names is not None:
        if len(names) != len(specs):
            raise CorpusRunError(f"{len(names)} --names for {len(specs)} models: give one name per model")
        for s, n in zip(specs, names):
            s["name"] = n
    seen: dict[str, int] = {}
    for s in specs:
        base = s["name"]
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > 1:
            s["name"] = f"{base} ({seen[base]})"
    folders: dict[str, str] = {}  # each model's stats folder, case folded (one folder per name on any file system)
    for s in specs:
        folder = _safe(s["name"])
        other = folders.setdefault(folder.casefold(), s["name"])
        if other != s["name"]:
            raise CorpusRunError(
                f"model names {other!r} and {s['name']!r} would both be saved as models/{folder} (a folder name keeps "
                "letters, digits, '.', '_' and '-', and a file system may ignore case): pass --names that differ there"
            )
    return specs


def load_model(source: str):
    """(model, tokenizer or None) that a manifest's ``source`` names: ``demo:<name>`` or a model folder
    (one of ours, or an fla checkpoint with its tokenizer: :func:`attnres_probe.pretrained.load_model_folder`)."""
    from attnres_probe.demo import load_demo
    from attnres_probe.pretrained import load_model_folder

    if source.startswith(DEMO_SOURCE):
        return load_demo(source[len(DEMO_SOURCE):])[0], None
    return load_model_folder(source)


def model_digest(model) -> str:
    """sha256 of the model's weights (the same digest reports record as ``weights_sha256``)."""
    from attnres_probe.reports.recording import weights_sha256

    return weights_sha256(model)


# -- the run -----------------------------------------------------------------------------------
def _read_manifest(out: Path) -> dict[str, Any] | None:
    path = out / CORPUS_FILE
    if not path.is_file():
        return None
    from attnres_probe.io import read_json

    doc = read_json(path, CorpusRunError, max_bytes=16 * 2**20)
    if not isinstance(doc, dict) or not isinstance(doc.get("schema_version"), int):
        raise CorpusRunError(f"{path} has no integer schema_version; it is not a corpus run")
    if doc["schema_version"] > CORPUS_SCHEMA_VERSION:
        raise CorpusRunError(f"{path} is a schema-version {doc['schema_version']} corpus run; upgrade attnres-probe")
    _check_manifest(doc, out, str(path))
    return doc


def _check_manifest(doc: dict[str, Any], out: Path, where: str) -> None:
    """The manifest's models: a list of {name, dir, complete, source}, names unique, each dir inside ``out``."""
    from attnres_probe.validate import field, inside

    field(doc, "complete", "bool", where, CorpusRunError, required=False)
    models = field(doc, "models", "list", where, CorpusRunError, lo=1, hi=64)
    seen = set()
    for i, m in enumerate(models):
        at = f"{where} models[{i}]"
        name = field(m, "name", "str", at, CorpusRunError, lo=1, hi=256)
        field(m, "dir", "str", at, CorpusRunError, lo=1, hi=1024)
        field(m, "complete", "bool", at, CorpusRunError, required=False)
        field(m, "source", "str", at, CorpusRunError, lo=1)
        if name in seen:
            raise CorpusRunError(f"{at}: the name {name!r} is given twice; each model of a run has its own name")
        seen.add(name)
        inside(out, m["dir"], f"{at} 'dir'", CorpusRunError)
    field(doc, "data", "dict", where, CorpusRunError, required=False)


def _write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    atomic_write(out / CORPUS_FILE, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))


def _check_resume(old: dict[str, Any], new: dict[str, Any], out: Path) -> None:
    """Refuse to continue a run in ``out`` that recorded other data, models or settings (say which)."""
    data = old.get("data")
    if not isinstance(data, dict) or not all(isinstance(data.get(k), (str, int)) for k in ("sha256", "path", "documents")):
        raise CorpusRunError(f"{out / CORPUS_FILE} does not say which data it recorded ('data' with sha256, path and "
                             "documents): it cannot be resumed; choose another --out")
    if old["data"]["sha256"] != new["data"]["sha256"]:
        raise CorpusRunError(
            f"{out} holds a corpus run over other data ({old['data']['path']}, {old['data']['documents']} documents, "
            f"sha256 {old['data']['sha256'][:12]}…; this run: {new['data']['path']}, {new['data']['documents']} documents, "
            f"sha256 {new['data']['sha256'][:12]}…): choose another --out"
        )
    olds = [(m["name"], m["source"], m.get("weights_sha256")) for m in old["models"]]
    news = [(m["name"], m["source"], m.get("weights_sha256")) for m in new["models"]]
    if olds != news:
        for o, n in zip(olds + [None] * len(news), news + [None] * len(olds)):
            if o != n:
                break
        what = (f"model {o[0]!r} from {o[1]} (weights sha256 {str(o[2])[:12]}…)" if o else "no model")
        want = (f"model {n[0]!r} from {n[1]} (weights sha256 {str(n[2])[:12]}…)" if n else "no model")
        raise CorpusRunError(f"{out} holds stats of another model: it has {what} where this run has {want}; choose another --out")
    if old["settings"] != new["settings"]:
        diff = {k: (old["settings"].get(k), v) for k, v in new["settings"].items() if old["settings"].get(k) != v}
        raise CorpusRunError(f"{out} was recorded with other settings {diff} (old, new): rerun with the same options or choose another --out")


def record_corpus(
    data: str | Path,
    out: str | Path,
    models: Sequence[str] | None = None,
    demo: Sequence[str] | None = None,
    names: Sequence[str] | None = None,
    batch_size: int = 8,
    backward: bool = True,
    save_every: float = 30.0,
    progress: bool = True,
    n_resamples: int = 1000,
    seed: int = 0,
    resume: bool = False,
) -> dict[str, Any]:
    """Record ``data`` through every model into ``out`` (resuming a run already there); return the manifest.

    See the module docstring for the folder's layout.

    Raises:
        CorpusDataError: unreadable, empty or non-UTF-8 data.
        CorpusRunError: ``out`` holds a run over other data, models or settings.
    """
    from attnres_probe.distributed import current_ranks

    ranks = current_ranks()
    main = ranks is None or ranks.is_main
    together = ranks.agree if ranks is not None else (lambda fn: fn())  # a step that fails on one rank fails on all

    out = Path(out)
    with contextlib.ExitStack() as held:
        if main:  # one writer per --out for the whole run (under torchrun rank 0 holds it for all)
            together(lambda: held.enter_context(exclusive_lock(out, "--out")))
        else:
            together(lambda: None)
        return _record_locked(out, data, models, demo, names, batch_size, backward, save_every, progress,
                              n_resamples, seed, resume, ranks, main, together)


def _record_locked(out, data, models, demo, names, batch_size, backward, save_every, progress, n_resamples, seed,
                   resume, ranks, main, together) -> dict[str, Any]:
    """The body of :func:`record_corpus`, with ``out`` locked by the main process."""
    from attnres_probe import metrics
    from attnres_probe.probe import Probe
    from attnres_probe.stats import CorpusStats

    def setup() -> tuple[list[Document], dict[str, Any]]:
        return _setup(out, data, models, demo, names, batch_size, backward, resume, main)

    docs, manifest = together(setup)

    def start() -> None:
        if main:
            out.mkdir(parents=True, exist_ok=True)
            _write_manifest(out, manifest)

    together(start)
    for entry in manifest["models"]:
        if entry["complete"]:
            if main:
                print(f"{entry['name']}: already recorded ({entry['windows']} windows)", file=sys.stderr)
            continue
        model, tokenizer = load_model(entry["source"])
        if ranks is not None and ranks.device.type == "cuda":  # NCCL: each rank records on its own GPU
            model = model.to(ranks.device)
        probe = Probe(model, tokenizer=tokenizer, name=entry["name"])
        byte_tokens = tokenizer is None and probe.spec.d_vocab == 256
        # where this process keeps its progress: the model's stats folder, or under torchrun its rank's own
        stats_dir = out / entry["dir"] if ranks is None else out / RANKS_DIR / f"of{ranks.world}" / f"rank{ranks.rank}" / entry["dir"]
        stats, resume_after = together(lambda: _partial_stats(stats_dir, probe, entry))
        _say_where_it_resumes(out, entry, stats, ranks)
        from tqdm.auto import tqdm

        total = manifest["data"]["bytes"] if byte_tokens else None
        bar = tqdm(total=total, desc=f"corpus {entry['name']}", unit="tok", unit_scale=True, disable=not (progress and main),
                   initial=stats.n_tokens if stats is not None and ranks is None else 0, file=sys.stderr)
        last = {"saved": time.monotonic(), "tokens": bar.n}

        def on_progress(tokens, bar=bar, last=last):
            bar.update(tokens - last["tokens"])
            last["tokens"] = tokens

        def on_batch(st, key, entry=entry, stats_dir=stats_dir, last=last):
            if time.monotonic() - last["saved"] >= save_every:
                if ranks is None:
                    _save_progress(out, manifest, entry, st, stats_dir, key)
                else:
                    _save_rank_progress(entry, st, stats_dir, key)
                last["saved"] = time.monotonic()

        start_doc = resume_after[0] if resume_after is not None else 0
        texts = ("" if i < start_doc or (ranks is not None and not ranks.mine(i)) else StreamedDocument(d) for i, d in enumerate(docs))
        stats = probe.run_corpus(
            texts, batch_size=batch_size, backward=backward, progress=False, stats=stats,
            resume_after=resume_after, on_batch=on_batch, on_progress=on_progress,
        )
        bar.close()
        entry["complete"] = True

        def finish(entry=entry, stats=stats) -> None:
            if main:
                _save_progress(out, manifest, entry, stats, out / entry["dir"], None)

        together(finish)
        del model, probe, tokenizer

    def conclude() -> None:
        if main:
            loaded = {m["name"]: CorpusStats.load(out / m["dir"]) for m in manifest["models"]}
            frame = metrics.compare(*loaded.values(), names=list(loaded), n_resamples=n_resamples, seed=seed)
            atomic_write(out / COMPARISON_FILE, lambda p: frame.to_csv(p, index=False))
            manifest["complete"] = True
            from attnres_probe.analysis.display import documents_warning

            manifest["comparison"] = {"n_resamples": n_resamples, "seed": seed, "file": COMPARISON_FILE,
                                      "note": documents_warning(frame)}
            _write_manifest(out, manifest)

    together(conclude)
    if ranks is not None:  # the result is written: each rank's progress is no longer needed
        shutil.rmtree(out / RANKS_DIR / f"of{ranks.world}" / f"rank{ranks.rank}", ignore_errors=True)
        together(lambda: None)
        if main:
            for folder in (out / RANKS_DIR / f"of{ranks.world}", out / RANKS_DIR):
                try:
                    folder.rmdir()  # only when empty (other machines' ranks keep theirs elsewhere)
                except OSError:
                    pass
    manifest["complete"] = True
    return manifest


def _setup(out: Path, data, models, demo, names, batch_size, backward, resume, main: bool = True) -> tuple[list[Document], dict[str, Any]]:
    """The documents and the manifest of a run (a resumed run's models and progress); what
    killed saves left beside the models' stats folders is cleared (the caller holds the lock)."""
    if out.exists() and not out.is_dir():
        raise CorpusRunError(f"--out {out} is a file; the corpus run is written into a folder")
    docs = list_documents(data)
    if sum(d.size for d in docs) == 0:
        raise CorpusDataError(f"--data {data}: every document is empty; the corpus has no tokens")
    specs = _model_specs(models, demo, names)
    for s in specs:  # load each model once to fingerprint it; runs below reload one at a time
        model, _ = load_model(s["source"])
        s["weights_sha256"] = model_digest(model)
        s["dir"] = f"models/{_safe(s['name'])}"
        del model
    settings = {"batch_size": batch_size, "backward": bool(backward), "window_grads": True, "min_tokens": 2}
    manifest = {
        "schema_version": CORPUS_SCHEMA_VERSION,
        "attnres_probe": __version__,
        "data": _data_manifest(data, docs),
        "settings": settings,
        "models": [{**s, "complete": False, "progress": None, "windows": 0, "tokens": 0} for s in specs],
        "complete": False,
    }
    old = _read_manifest(out) if out.is_dir() else None
    if out.is_dir() and old is None and any(p for p in out.iterdir() if not p.name.startswith(".")):
        raise CorpusRunError(f"--out {out} is not empty and holds no corpus run; choose a new or empty folder")
    if resume and old is None:
        raise CorpusRunError(f"--resume: {out} holds no corpus run to continue; leave out --resume to start one")
    if old is not None:
        _check_resume(old, manifest, out)
        manifest["models"] = old["models"]
        for entry in manifest["models"] if main else ():  # staging folders of saves a kill interrupted
            clear_leftovers(out / entry["dir"], lambda p: (p / "stats.json").is_file())
    return docs, manifest


def _say_where_it_resumes(out: Path, entry: dict[str, Any], stats, ranks) -> None:
    """One line (from rank 0) on what a resumed model continues from, and on saved progress this run cannot use."""
    if ranks is None:
        saved = stats.n_windows if stats is not None else 0
        if saved:
            print(f"{entry['name']}: resuming after {saved} windows ({stats.n_tokens} tokens) saved before", file=sys.stderr)
    else:
        counts = [int(x) for x in ranks.messages(str(stats.n_windows if stats is not None else 0))]
        if ranks.is_main and sum(counts):
            print(f"{entry['name']}: resuming after {sum(counts)} windows the {ranks.world} ranks saved before "
                  f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(counts))})", file=sys.stderr)
    if ranks is not None and not ranks.is_main:
        return
    here = f"of{ranks.world}" if ranks is not None else None
    unused = sorted(p.name for p in (out / RANKS_DIR).glob("of*") if p.name != here and any(p.glob(f"rank*/{entry['dir']}")))
    if unused:
        now = f"{ranks.world} ranks" if ranks is not None else "one process"
        print(f"{entry['name']}: progress saved by {', '.join(u[2:] for u in unused)} ranks (in {out / RANKS_DIR}) is not used "
              f"by a run of {now}; rerun with that many ranks to continue it", file=sys.stderr)


def _partial_stats(stats_dir: Path, probe, entry: dict[str, Any]):
    """(stats, key of the last recorded window) saved in ``stats_dir`` by an interrupted run, or (None, None)."""
    from attnres_probe.stats import CorpusStats

    # the stats folder is saved as a whole, so its own progress (not the manifest's) says what it holds
    if not ((stats_dir / "stats.json").is_file() or set_aside(stats_dir) or stats_dir.with_name(f".{stats_dir.name}.old").is_dir()):
        return None, None
    stats = CorpusStats.load(stats_dir)
    stats.check_same_model({**probe.spec.meta, "weights_sha256": entry["weights_sha256"]}, what=f"resume {entry['name']!r}")
    key = tuple(stats.meta["progress"]) if stats.meta.get("progress") else None
    return (stats, key) if key is not None else (None, None)


def _save_rank_progress(entry: dict, stats, stats_dir: Path, key) -> None:
    """Save one rank's stats of its shard (under torchrun), with the key of its last window."""
    stats.meta["weights_sha256"] = entry["weights_sha256"]
    stats.meta["source"] = entry["source"]
    stats.meta["progress"] = list(key) if key is not None else None
    stats.save(stats_dir)


def _save_progress(out: Path, manifest: dict, entry: dict, stats, stats_dir: Path, key) -> None:
    """Save the model's stats, then the manifest that points at them (the stats first: a crash between leaves older progress)."""
    _save_rank_progress(entry, stats, stats_dir, key)
    entry["progress"] = stats.meta["progress"]
    entry["windows"], entry["tokens"], entry["skipped"] = stats.n_windows, stats.n_tokens, stats.n_skipped
    _write_manifest(out, manifest)


# -- reading a finished run --------------------------------------------------------------------
def load_stats_dir(directory: str | Path, allow_incomplete: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, {model name: CorpusStats}) of a corpus run folder written by ``attnres-probe corpus``.

    Raises:
        CorpusRunError: not a corpus run folder, or an unfinished run (unless ``allow_incomplete``).
    """
    from attnres_probe.stats import CorpusStats

    directory = Path(directory)
    if not directory.is_dir():
        raise CorpusRunError(f"--stats {directory}: not a folder (pass the --out folder of `attnres-probe corpus`)")
    manifest = _read_manifest(directory)
    if manifest is None:
        raise CorpusRunError(f"--stats {directory}: {CORPUS_FILE} is missing; this is not a folder written by `attnres-probe corpus`")
    if not manifest.get("complete") and not allow_incomplete:
        done = ", ".join(f"{m['name']} {'done' if m['complete'] else 'unfinished'}" for m in manifest["models"])
        raise CorpusRunError(
            f"--stats {directory}: the corpus run is unfinished ({done}); run the same `attnres-probe corpus` command "
            "again to complete it (it resumes)"
        )
    from attnres_probe.stats import StatsError

    stats = {}
    for m in manifest["models"]:
        folder = directory / m["dir"]
        if not (folder / "stats.json").is_file():
            if m.get("complete") or manifest.get("complete"):
                raise CorpusRunError(f"--stats {directory}: {CORPUS_FILE} says {m['name']!r} is complete, but {folder} holds "
                                     "no stats: the run folder is damaged (record the corpus again)")
            continue
        try:
            s = CorpusStats.load(folder)
        except StatsError as exc:
            raise CorpusRunError(f"--stats {directory}: the stats of {m['name']!r} cannot be used: {exc}") from None
        if (m.get("complete") or manifest.get("complete")) and s.meta.get("progress"):
            raise CorpusRunError(f"--stats {directory}: {CORPUS_FILE} says {m['name']!r} is complete, but its stats are a "
                                 "save from the middle of the run: the run folder is damaged (run the corpus command again)")
        s.meta["name"] = m["name"]
        stats[m["name"]] = s
    return manifest, stats


def check_models_match(stats: dict[str, Any], models: dict[str, Any]) -> None:
    """Refuse models the stats were not recorded from: each model (or Probe) must match the stats of its name.

    Raises:
        CorpusRunError: a model without stats of its name, or whose weights differ (the reason named).
    """
    for name, model in models.items():
        if name not in stats:
            raise CorpusRunError(f"model {name!r} has no stats in this folder (it holds {', '.join(stats)}); "
                                 "name the models as in the corpus run (--names)")
        want = stats[name].meta.get("weights_sha256")
        got = model_digest(getattr(model, "model", model))  # a Probe carries its model
        if want and want != got:
            raise CorpusRunError(
                f"the stats of {name!r} were recorded from another model (weights sha256 {want[:12]}…, "
                f"from {stats[name].meta.get('source', '?')}); this {name!r} has weights sha256 {got[:12]}…"
            )


# -- command line ------------------------------------------------------------------------------
def add_corpus_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "corpus",
        help="record a corpus through models: per-window metrics, intervals, verdicts",
        description=(
            "Record every document of --data through each model (n_ctx-token windows, one backward pass per window) "
            "and write mergeable aggregates plus every window's headline metrics into --out. Resumable: run the "
            "same command again to continue. Show the result with `attnres-probe dash --stats OUT` or "
            "`attnres-probe report --stats OUT --out report.html`."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--models", nargs="+", metavar="DIR", help="model folders: ours (config.json + model.safetensors) or flash-linear-attention checkpoints")
    src.add_argument("--demo", nargs="*", choices=("prenorm", "full", "block"), metavar="NAME",
                     help="bundled demo models: prenorm, full, block (bare --demo: all three)")
    p.add_argument("--data", required=True, metavar="FILE|DIR", help="a UTF-8 text file, or a folder of them (one document per file)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the run (new, empty, or an unfinished run to resume)")
    p.add_argument("--names", nargs="+", metavar="NAME", help="one label per model (default: folder names)")
    p.add_argument("--batch-size", type=arg_range("int", 1, 4096), default=8, help="windows per forward pass without gradients (default: %(default)s)")
    p.add_argument("--no-backward", action="store_true", help="skip the backward passes (no gradient metrics)")
    p.add_argument("--save-every", type=arg_range("float", 0, 1e6), default=30.0, metavar="SECONDS", help="save progress this often (default: %(default)s)")
    p.add_argument("--resamples", type=arg_range("int", 1, MAX_RESAMPLES), default=1000, help="bootstrap resamples of comparison.csv (default: %(default)s)")
    p.add_argument("--seed", type=arg_range("int", 0, 2**32 - 1), default=0, help="bootstrap seed (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (running the same command again does too; this flag also refuses to start a new one)")
    p.set_defaults(func=_run_corpus)
    return p


def _stopped_by_torchrun(rank: int) -> None:
    """torchrun stops the other ranks when one fails: say so once (rank 0), then exit as SIGTERM would."""
    if rank == 0:
        print("attnres-probe corpus: error: stopped by torchrun because another rank stopped (its report below names "
              "the rank and the cause); no result was written (rerun with --resume to continue)", file=sys.stderr, flush=True)
    os._exit(143)


def _run_corpus(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size is {args.batch_size}; need at least 1")
    if args.resamples < 1:
        raise ValueError(f"--resamples is {args.resamples}; need at least 1")
    from attnres_probe.distributed import DistributedRunError, in_torchrun

    t0 = time.perf_counter()
    rank = int(os.environ.get("RANK", "0")) if in_torchrun() else 0
    if in_torchrun():
        signal.signal(signal.SIGTERM, lambda *_: _stopped_by_torchrun(rank))
    try:
        manifest = record_corpus(
            args.data, args.out, models=args.models, demo=args.demo, names=args.names, batch_size=args.batch_size,
            backward=not args.no_backward, save_every=args.save_every, progress=not args.no_progress,
            n_resamples=args.resamples, seed=args.seed, resume=args.resume,
        )
    except DistributedRunError as exc:  # every rank raises it; rank 0 says it, once
        if rank == 0:
            print(f"attnres-probe corpus: error: {exc}", file=sys.stderr)
        return 1
    except ValueError:  # found alike on every rank after the merge (e.g. no window at all): rank 0 says it
        if rank == 0:
            raise
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return 0
    plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
    for m in manifest["models"]:
        skipped = f", {plural(m['skipped'], 'window')} under two tokens left out" if m.get("skipped") else ""
        print(f"{m['name']}: {plural(m['windows'], 'window')}, {plural(m['tokens'], 'token')}{skipped}")
    print(f"wrote {Path(args.out) / COMPARISON_FILE} and the aggregates in {args.out} ({time.perf_counter() - t0:.1f} s)")
    note = manifest.get("comparison", {}).get("note")
    if note:
        print(f"note: {note}", file=sys.stderr)
    return 0
