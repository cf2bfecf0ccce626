"""ByteTokenizer: ids are bytes, labels are printable, nothing crashes on bad UTF-8."""

from __future__ import annotations

import pytest
import torch

from attnres_probe import ByteTokenizer


def test_tokens_are_utf8_bytes_and_decode_round_trips():
    tok = ByteTokenizer()
    text = "héllo\n€ world"
    ids = tok.to_tokens(text)
    assert ids.shape == (1, len(text.encode()))
    assert ids.dtype == torch.long
    assert tok.decode(ids) == text


def test_str_tokens_are_printable_one_per_token():
    tok = ByteTokenizer()
    labels = tok.to_str_tokens("a\tb\né\x01")
    assert labels == ["a", "\\t", "b", "\\n", "é", "·", "\\x01"]
    assert all(s.isprintable() for s in labels)


def test_invalid_utf8_bytes_do_not_crash():
    tok = ByteTokenizer()
    ids = torch.tensor([[0xFF, 0xC3, 0x41, 0xE2, 0x82]])  # stray, truncated sequences
    labels = tok.to_str_tokens(ids)
    assert labels == ["\\xff", "\\xc3", "A", "\\xe2", "\\x82"]
    assert tok.decode(ids).count("\ufffd") >= 3


def test_empty_and_too_long_text_raise_clear_errors():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="empty"):
        tok.to_tokens("")
    with pytest.raises(ValueError, match="text has 10 tokens; this model's context is 4"):
        tok.to_tokens("0123456789", max_len=4)
    assert tok.to_tokens("0123456789", max_len=4, truncate=True).tolist() == [[48, 49, 50, 51]]


def test_out_of_range_ids_are_rejected():
    with pytest.raises(ValueError, match="not a byte"):
        ByteTokenizer().decode([300])
