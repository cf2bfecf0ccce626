"""A corpus run folder: what ``attnres-probe corpus`` writes and ``dash``/``report --stats`` read.

    OUT/corpus.json            what was recorded from what (data, models, settings, progress)
    OUT/models/<name>/         each model's CorpusStats (attnres_probe.corpus.stats)
    OUT/comparison.csv         metrics.compare of them all, once every model is done
    OUT/documents.csv          which documents drive each verdict (analysis.documents.document_breakdown)
    OUT/.ranks/of<N>/rank<r>/  under torchrun: each rank's progress until the merged result is written

:func:`load_stats_dir` reads a finished run; :func:`check_models_match` refuses models the stats
were not recorded from (the weights digest, :func:`attnres_probe.io.weights_sha256`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from attnres_probe.io import atomic_write, weights_sha256

__all__ = [
    "COMPARISON_FILE",
    "CORPUS_FILE",
    "CORPUS_SCHEMA_VERSION",
    "RANKS_DIR",
    "DOCUMENTS_FILE",
    "CorpusRunError",
    "UnpairedStatsWarning",
    "check_models_match",
    "document_names",
    "check_resume",
    "load_stats_dir",
    "read_manifest",
    "write_manifest",
]

CORPUS_FILE = "corpus.json"
RANKS_DIR = ".ranks"  # under torchrun: each rank's progress, until the merged result is written
COMPARISON_FILE = "comparison.csv"
DOCUMENTS_FILE = "documents.csv"  # per document: its own value and its leave-one-out influence on each verdict
CORPUS_SCHEMA_VERSION = 1


class CorpusRunError(ValueError):
    """A corpus output folder that does not fit this run (other data, models or settings), or is incomplete."""



def read_manifest(out: Path) -> dict[str, Any] | None:
    """The run's ``corpus.json`` in ``out`` (checked), or None when there is none."""
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


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Write ``corpus.json`` into ``out`` (atomically: a reader sees the old or the new one)."""
    atomic_write(out / CORPUS_FILE, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))


def check_resume(old: dict[str, Any], new: dict[str, Any], out: Path) -> None:
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


def document_names(manifest: dict[str, Any] | None) -> list[str] | None:
    """The run's document names in document order (the windows' ``doc`` ids index it): each file's path
    relative to ``--data``, from corpus.json's ``data.files``; None when the manifest does not list them."""
    files = ((manifest or {}).get("data") or {}).get("files")
    if not isinstance(files, list) or not all(isinstance(f, (list, tuple)) and f and isinstance(f[0], str) for f in files):
        return None
    return [f[0] for f in files]


# -- reading a finished run --------------------------------------------------------------------
def load_stats_dir(directory: str | Path, allow_incomplete: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, {model name: CorpusStats}) of a corpus run folder written by ``attnres-probe corpus``.

    Each CorpusStats's ``meta`` gets the run's ``name`` for it and the data's ``documents`` (file
    names by document id, :func:`document_names`), which pages label documents with.

    Raises:
        CorpusRunError: not a corpus run folder, or an unfinished run (unless ``allow_incomplete``).
    """
    from attnres_probe.corpus.stats import CorpusStats, StatsError

    directory = Path(directory)
    if not directory.is_dir():
        raise CorpusRunError(f"--stats {directory}: not a folder (pass the --out folder of `attnres-probe corpus`)")
    manifest = read_manifest(directory)
    if manifest is None:
        raise CorpusRunError(f"--stats {directory}: {CORPUS_FILE} is missing; this is not a folder written by `attnres-probe corpus`")
    if not manifest.get("complete") and not allow_incomplete:
        done = ", ".join(f"{m['name']} {'done' if m['complete'] else 'unfinished'}" for m in manifest["models"])
        raise CorpusRunError(
            f"--stats {directory}: the corpus run is unfinished ({done}); run the same `attnres-probe corpus` command "
            "again to complete it (it resumes)"
        )
    stats = {}
    doc_names = document_names(manifest)
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
        if doc_names is not None:
            s.meta["documents"] = doc_names
        stats[m["name"]] = s
    return manifest, stats


class UnpairedStatsWarning(UserWarning):
    """Stats without a weights digest: which model they were recorded from cannot be checked."""


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
        if not want:
            warnings.warn(UnpairedStatsWarning(
                f"the stats of {name!r} carry no weights digest (weights_sha256): that they were recorded from this "
                f"model ({stats[name].meta.get('source', '?')}) cannot be checked; record the corpus again to pair them"),
                stacklevel=2)
            continue
        got = weights_sha256(getattr(model, "model", model))  # a Probe carries its model
        if want != got:
            raise CorpusRunError(
                f"the stats of {name!r} were recorded from another model (weights sha256 {want[:12]}…, "
                f"from {stats[name].meta.get('source', '?')}); this {name!r} has weights sha256 {got[:12]}…"
            )
