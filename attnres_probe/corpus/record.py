"""Recording a corpus through several models into a run folder (``attnres-probe corpus``).

Every file of the data is checked first (:mod:`~attnres_probe.corpus.documents`: a file that is
not UTF-8 stops the run before any model runs). Each model then records every document in
``n_ctx``-token windows (:meth:`Probe.run_corpus <attnres_probe.probe.Probe.run_corpus>`: bounded
memory, one backward pass per window for per-window gradients) and its
:class:`~attnres_probe.corpus.stats.CorpusStats` go into ``OUT/models/<name>/``;
``OUT/corpus.json`` says what was recorded from what (:mod:`~attnres_probe.corpus.run` has the
folder's layout).

The run is resumable: stats are saved (atomically) every ``save_every`` seconds and when a model
finishes; recording into the same folder again continues where it stopped. A folder holding a run
over other data, other models or other settings is refused with the reason. When every model is
done, ``OUT/comparison.csv`` holds :func:`attnres_probe.metrics.compare` of them all and
``OUT/documents.csv`` which documents drive each of its verdicts
(:func:`attnres_probe.analysis.documents.document_breakdown`: each document's own value and the
verdict without it). Under ``torchrun`` the ranks share the documents
(:mod:`~attnres_probe.corpus.distributed`).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnres_probe._version import __version__
from attnres_probe.corpus.documents import CorpusDataError, Document, StreamedDocument, data_manifest, list_documents
from attnres_probe.corpus.run import (
    COMPARISON_FILE,
    CORPUS_SCHEMA_VERSION,
    DOCUMENTS_FILE,
    RANKS_DIR,
    CorpusRunError,
    check_resume,
    document_names,
    read_manifest,
    write_manifest,
)
from attnres_probe.io import atomic_write, clear_leftovers, exclusive_lock, set_aside

__all__ = ["record_corpus"]


# -- models ------------------------------------------------------------------------------------
def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def _model_specs(models: Sequence[str] | None, demo: Sequence[str] | None, names: Sequence[str] | None) -> list[dict[str, str]]:
    """[{"name", "source"}] for checkpoint folders or demo models, in order, names unique."""
    from attnres_probe.demo import DEMO_NAMES
    from attnres_probe.loading import demo_source, folder_source

    if demo is not None:
        asked = set(demo) or set(DEMO_NAMES)
        specs = [{"name": n, "source": demo_source(n)} for n in DEMO_NAMES if n in asked]
    else:
        specs = []
        for d in models or []:
            source = folder_source(d, "--models", CorpusRunError)
            specs.append({"name": Path(source).name, "source": source})
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


# -- the run -----------------------------------------------------------------------------------
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
    from attnres_probe.corpus.distributed import current_ranks

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
    from attnres_probe.corpus.stats import CorpusStats
    from attnres_probe.loading import load_model
    from attnres_probe.probe import Probe

    def setup() -> tuple[list[Document], dict[str, Any]]:
        return _setup(out, data, models, demo, names, batch_size, backward, resume, main)

    docs, manifest = together(setup)

    def start() -> None:
        if main:
            out.mkdir(parents=True, exist_ok=True)
            write_manifest(out, manifest)

    together(start)
    for entry in manifest["models"]:
        if entry["complete"]:
            if main:
                print(f"{entry['name']}: already recorded ({entry['windows']} windows)", file=sys.stderr)
            continue
        loaded = load_model(entry["source"])
        model, tokenizer = loaded.model, loaded.tokenizer
        if ranks is not None and ranks.device.type == "cuda":  # NCCL: each rank records on its own GPU
            model = model.to(ranks.device)
        probe = Probe(model, tokenizer=tokenizer, name=entry["name"])
        byte_tokens = tokenizer is None and probe.spec.d_vocab == 256
        # where this process keeps its progress: the model's stats folder, or under torchrun its rank's own
        stats_dir = out / entry["dir"] if ranks is None else out / RANKS_DIR / f"of{ranks.world}" / f"rank{ranks.rank}" / entry["dir"]
        stats, resume_after = together(lambda probe=probe: _partial_stats(stats_dir, probe, entry))
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
        del model, probe, tokenizer, loaded

    def conclude() -> None:
        if main:
            loaded = {m["name"]: CorpusStats.load(out / m["dir"]) for m in manifest["models"]}
            frame = metrics.compare(*loaded.values(), names=list(loaded), n_resamples=n_resamples, seed=seed)
            atomic_write(out / COMPARISON_FILE, lambda p: frame.to_csv(p, index=False))
            from attnres_probe.analysis.documents import LOO_RESAMPLES, document_breakdown

            docs_frame = document_breakdown(*loaded.values(), names=list(loaded), documents=document_names(manifest),
                                            n_resamples=n_resamples, loo_resamples=min(LOO_RESAMPLES, n_resamples),
                                            seed=seed)
            atomic_write(out / DOCUMENTS_FILE, lambda p: docs_frame.to_csv(p, index=False))
            manifest["complete"] = True
            from attnres_probe.analysis.display import page_warnings

            manifest["comparison"] = {"n_resamples": n_resamples, "seed": seed, "file": COMPARISON_FILE,
                                      "note": " ".join(page_warnings(frame)), "documents_file": DOCUMENTS_FILE,
                                      "documents_loo_resamples": docs_frame.attrs["loo_resamples"]}
            write_manifest(out, manifest)

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
    from attnres_probe.loading import load_model

    for s in specs:  # load each model once to fingerprint it; runs below reload one at a time
        s["weights_sha256"] = load_model(s["source"]).digest
        s["dir"] = f"models/{_safe(s['name'])}"
    settings = {"batch_size": batch_size, "backward": bool(backward), "window_grads": True, "min_tokens": 2}
    manifest = {
        "schema_version": CORPUS_SCHEMA_VERSION,
        "attnres_probe": __version__,
        "data": data_manifest(data, docs),
        "settings": settings,
        "models": [{**s, "complete": False, "progress": None, "windows": 0, "tokens": 0} for s in specs],
        "complete": False,
    }
    old = read_manifest(out) if out.is_dir() else None
    if out.is_dir() and old is None and any(p for p in out.iterdir() if not p.name.startswith(".")):
        raise CorpusRunError(f"--out {out} is not empty and holds no corpus run; choose a new or empty folder")
    if resume and old is None:
        raise CorpusRunError(f"--resume: {out} holds no corpus run to continue; leave out --resume to start one")
    if old is not None:
        check_resume(old, manifest, out)
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
    from attnres_probe.corpus.stats import CorpusStats

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
    write_manifest(out, manifest)
