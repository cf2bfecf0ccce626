"""Corpora: many documents through models, into mergeable aggregates with every window's metrics.

One idea per module:

- :mod:`~attnres_probe.corpus.documents`: the documents of ``--data`` (listed, checked to be
  UTF-8, read whole or streamed in chunks) and the manifest of the data;
- :mod:`~attnres_probe.corpus.stream`: texts through one probe into running aggregates, the work
  of :meth:`Probe.run_corpus <attnres_probe.probe.Probe.run_corpus>`;
- :mod:`~attnres_probe.corpus.distributed`: the same under ``torchrun`` (shards, lock step, merge);
- :mod:`~attnres_probe.corpus.record`: a corpus through several models into a resumable run
  folder (:func:`record_corpus`, what ``attnres-probe corpus`` runs);
- :mod:`~attnres_probe.corpus.run`: the run folder (``corpus.json``) and reading a finished one
  (:func:`load_stats_dir`).
- :mod:`~attnres_probe.corpus.stats`: :class:`~attnres_probe.corpus.stats.CorpusStats`, the
  mergeable aggregates with every window's metrics.

    from attnres_probe.corpus import load_stats_dir, record_corpus
    manifest = record_corpus("notes/", "runs/corpus", demo=[])   # every shipped demo model
    manifest, stats = load_stats_dir("runs/corpus")              # {model name: CorpusStats}
"""

from __future__ import annotations

from attnres_probe.corpus.documents import CorpusDataError, Document, StreamedDocument, list_documents, read_document
from attnres_probe.corpus.record import record_corpus
from attnres_probe.corpus.run import (
    COMPARISON_FILE,
    CORPUS_FILE,
    DOCUMENTS_FILE,
    RANKS_DIR,
    CorpusRunError,
    check_models_match,
    load_stats_dir,
)

__all__ = [
    "COMPARISON_FILE",
    "CORPUS_FILE",
    "DOCUMENTS_FILE",
    "RANKS_DIR",
    "CorpusDataError",
    "CorpusRunError",
    "Document",
    "StreamedDocument",
    "check_models_match",
    "list_documents",
    "load_stats_dir",
    "read_document",
    "record_corpus",
]
