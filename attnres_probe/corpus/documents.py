"""The documents of a corpus: what ``--data`` names, as files checked to be UTF-8, read whole or in chunks.

``--data`` is a UTF-8 text file (one document) or a folder (every non-hidden file below it, in
sorted order, one document each). :func:`list_documents` checks every file before anything runs
(a file that is not UTF-8 is named with the byte offset of its first bad byte);
:class:`StreamedDocument` reads a checked file in chunks, so a corpus run over byte tokens holds
one chunk and one window of a document, not the whole file (:meth:`Probe.run_corpus
<attnres_probe.probe.Probe.run_corpus>` takes them); :func:`data_manifest` is what a run's
``corpus.json`` records of its data (each file's name, size and sha256, and one digest of them all).
"""

from __future__ import annotations

import codecs
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CorpusDataError", "Document", "StreamedDocument", "data_manifest", "list_documents", "read_document"]

_CHUNK = 1 << 20  # bytes read at a time when a document is checked


class CorpusDataError(ValueError):
    """The corpus data cannot be read: missing, empty, or not UTF-8 (the message names the file and offset)."""


@dataclass(frozen=True)
class Document:
    """One file of the corpus: its path, its path relative to ``--data``, size and sha256."""

    path: Path
    name: str
    size: int
    sha256: str



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


def data_manifest(data: str | Path, docs: list[Document]) -> dict[str, Any]:
    """What a run records of its data: where it is, its documents (name, size, sha256) and one sha256 of them all."""
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
