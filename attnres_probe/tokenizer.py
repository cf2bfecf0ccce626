"""ByteTokenizer: 256 ids, one per UTF-8 byte; nothing to download."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ByteTokenizer", "check_token_ids", "text_ids"]

_ESCAPES = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
CONTINUATION = "\u00b7"  # shown for the 2nd..nth byte of a multi-byte character
_ASCII = [_ESCAPES.get(b, chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}") for b in range(0x80)]


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value (vocabulary of 256)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text has a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}, which is not "
                "Unicode text (it has no UTF-8 bytes); decode the source with errors='replace' or remove it"
            ) from None

    def to_tokens(self, text: str, max_len: int | None = None, truncate: bool = False) -> torch.Tensor:
        """LongTensor [1, pos] of byte ids.

        Args:
            text: non-empty text.
            max_len: the longest allowed sequence (a model's n_ctx); None for no limit.
            truncate: keep the first ``max_len`` tokens instead of raising.

        Raises:
            ValueError: empty text, or more than ``max_len`` tokens without ``truncate``.
        """
        ids = self.encode(text)
        if not ids:
            raise ValueError("text is empty: need at least one character")
        if max_len is not None and len(ids) > max_len:
            if not truncate:
                raise ValueError(
                    f"text has {len(ids)} tokens; this model's context is {max_len} "
                    f"(pass truncate=True, or --truncate on the command line, to keep the first {max_len})"
                )
            ids = ids[:max_len]
        return torch.tensor([ids], dtype=torch.long)

    def decode(self, tokens: Any) -> str:
        """Text of token ids (a tensor [pos] / [1, pos] or a list); invalid UTF-8 becomes U+FFFD."""
        return bytes(self._ids(tokens)).decode("utf-8", errors="replace")

    def to_str_tokens(self, text_or_tokens: Any) -> list[str]:
        """One printable label per token.

        Printable ASCII shows as itself; tab, newline and carriage return as ``\\t``, ``\\n``,
        ``\\r``; other control bytes and bytes that are not valid UTF-8 as ``\\xNN``; a valid
        multi-byte character shows on its first byte, its other bytes as ``·``.
        """
        ids = self.encode(text_or_tokens) if isinstance(text_or_tokens, str) else self._ids(text_or_tokens)
        if all(b < 0x80 for b in ids):  # fast path: ASCII only
            return [_ASCII[b] for b in ids]
        out: list[str] = []
        i = 0
        while i < len(ids):
            b = ids[i]
            if b < 0x80:
                out.append(_ESCAPES.get(b, chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}"))
                i += 1
                continue
            n = 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0
            if n and i + n <= len(ids):
                try:
                    ch = bytes(ids[i : i + n]).decode("utf-8")
                except UnicodeDecodeError:
                    ch = None
                if ch is not None and ch.isprintable():
                    out.append(ch)
                    out.extend([CONTINUATION] * (n - 1))
                    i += n
                    continue
            out.append(f"\\x{b:02x}")
            i += 1
        return out

    @staticmethod
    def _ids(tokens: Any) -> list[int]:
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() == 2 and tokens.shape[0] == 1:
                tokens = tokens[0]
            if tokens.dim() != 1:
                raise ValueError(f"tokens must be [pos] or [1, pos]; got shape {tuple(tokens.shape)}")
            tokens = tokens.tolist()
        if not isinstance(tokens, Iterable):
            raise TypeError(f"tokens must be a tensor or a list of ids; got {type(tokens).__name__}")
        ids = tokens if isinstance(tokens, list) and all(type(t) is int for t in tokens) else [int(t) for t in tokens]
        if ids and not (0 <= min(ids) and max(ids) < 256):
            bad = next(t for t in ids if not 0 <= t < 256)
            raise ValueError(f"token id {bad} is not a byte; ByteTokenizer ids are 0..255")
        return ids


def check_token_ids(tokens: Any, n_ctx: int, d_vocab: int, truncate: bool = False, what: str = "input") -> torch.Tensor:
    """Validate token ids ([pos] or [batch, pos]) against a model's context and vocabulary.

    Args:
        tokens: a LongTensor or anything ``torch.as_tensor`` accepts (a list of ids).
        n_ctx: the longest sequence the model accepts.
        d_vocab: ids must lie in 0..d_vocab-1.
        truncate: keep the first ``n_ctx`` tokens of a longer input instead of raising.
        what: how the error messages call the input ("text", "input").

    Returns:
        LongTensor [batch, pos] (on the input's device).

    Raises:
        TypeError: not integer ids. ValueError: wrong shape, empty, too long, out of range.
    """
    if not isinstance(tokens, torch.Tensor):
        try:
            tokens = torch.as_tensor(tokens)
        except Exception:
            raise TypeError(
                f"{what} must be text, a LongTensor [batch, pos] or [pos], or a list of ids; got {type(tokens).__name__}"
            ) from None
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise TypeError(f"tokens must be integer ids; got dtype {tokens.dtype}")
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, pos] or [pos]; got shape {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        raise ValueError(f"{what} is empty: need at least one token")
    n = tokens.shape[1]
    if n > n_ctx:
        if not truncate:
            raise ValueError(
                f"{what} has {n} tokens; this model's context is {n_ctx} (pass truncate=True, or --truncate on the command line, "
                f"to keep the first {n_ctx})"
            )
        tokens = tokens[:, :n_ctx]
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= d_vocab:
        raise ValueError(f"token id {lo if lo < 0 else hi} is out of range; this model's vocabulary is 0..{d_vocab - 1}")
    return tokens.long()


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """The whole of ``text`` as ``tokenizer``'s ids, with no context limit (a corpus or a held-out text is
    cut into windows after): its ``encode`` (ours, a checkpoint's :class:`PretrainedTokenizer`), else
    its ``to_tokens``; UTF-8 bytes only where there is no tokenizer (the byte-level models).

    Raises:
        TypeError: a tokenizer with neither method.
    """
    if tokenizer is None:
        return list(text.encode("utf-8"))
    if hasattr(tokenizer, "encode"):
        ids = tokenizer.encode(text)
    elif hasattr(tokenizer, "to_tokens"):
        ids = tokenizer.to_tokens(text)
    else:
        raise TypeError(f"a tokenizer needs encode(text) or to_tokens(text); got {type(tokenizer).__name__}")
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    flat = ids[0] if ids and isinstance(ids[0], list) else ids
    return [int(i) for i in flat]
