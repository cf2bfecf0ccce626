"""Text in and out of a model as TransformerLens users write it: ``model.tokenizer``,
``model.to_tokens``, ``model.to_str_tokens``, ``model.to_string``, ``model.to_single_token``.

The model's methods are thin wrappers over the functions here (``attnres_probe.model`` imports
this module, never the other way round). A tokenizer is duck-typed: the byte-level
:class:`~attnres_probe.tokenizer.ByteTokenizer` (the default for a 256-token vocabulary), the
:class:`~attnres_probe.pretrained.PretrainedTokenizer` that ``load_pretrained`` returns (its
Hugging Face tokenizer is ``.hf``), a Hugging Face tokenizer itself, or any object with
``encode``/``to_tokens`` and ``decode``.

Choices, where TransformerLens has one our models cannot follow:

- **No padding.** The model's forward takes no attention mask, so a right-padded batch would put
  pad tokens into the loss and into generation, and a left-padded one would shift every
  position. ``to_tokens`` of a list of texts therefore stacks texts of equal token length and
  refuses unequal lengths with an error saying so (``padding_side`` is accepted for
  TransformerLens's signature and has nothing to pad).
- **BOS.** ``prepend_bos=None`` (the default) and ``False`` add nothing; ``True`` prepends the
  tokenizer's BOS token and is refused when it has none (the byte tokenizer has none: the byte
  models start from the first byte).
- **Context.** ``to_tokens`` refuses text longer than the model's context unless
  ``truncate=True`` (TransformerLens truncates silently by default); ``to_str_tokens`` and
  ``to_single_token`` only tokenize, so length does not matter to them.
- **Labels.** ``to_str_tokens`` uses the tokenizer's own ``to_str_tokens`` where it has one: for
  bytes, printable labels (``\\n``, ``\\x00``, a multi-byte character on its first byte and ``·``
  on the others), the labels every trace and chart of this toolkit shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from attnres_probe.tokenizer import ByteTokenizer, check_token_ids

__all__ = [
    "PADDING_SIDES",
    "encode",
    "model_tokenizer",
    "set_model_tokenizer",
    "special_token_id",
    "to_single_token",
    "to_str_tokens",
    "to_string",
    "to_tokens",
    "tokenize_texts",
    "usable_tokenizer",
]

PADDING_SIDES = (None, "left", "right")
_UNSET = object()


# -- the model's tokenizer ---------------------------------------------------------------
def model_tokenizer(model: Any) -> Any:
    """``model.tokenizer``: the one set on it, else a :class:`ByteTokenizer` for a 256-token
    vocabulary and None for any other."""
    tok = model.__dict__.get("_tokenizer", _UNSET)
    if tok is _UNSET:
        tok = ByteTokenizer() if model.cfg.d_vocab == ByteTokenizer.vocab_size else None
        model.__dict__["_tokenizer"] = tok
    return tok


def set_model_tokenizer(model: Any, tokenizer: Any) -> None:
    """Set ``model.tokenizer`` (None: no tokenizer; a 256-token model then still reads bytes)."""
    if tokenizer is not None and not any(hasattr(tokenizer, m) for m in ("encode", "to_tokens")):
        raise TypeError(
            f"model.tokenizer must be a tokenizer (with encode or to_tokens, and decode) or None; got {type(tokenizer).__name__}"
        )
    model.__dict__["_tokenizer"] = tokenizer


def usable_tokenizer(model: Any, what: str) -> Any:
    """The tokenizer ``what`` (a method name, for the message) works with: ``model.tokenizer``,
    or bytes when it is None and the vocabulary has 256 tokens.

    Raises:
        ValueError: no tokenizer, and a vocabulary the byte tokenizer cannot serve.
    """
    tok = model.tokenizer
    if tok is not None:
        return tok
    if model.cfg.d_vocab == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    raise ValueError(
        f"{what} needs a tokenizer, and this model has none (its vocabulary has {model.cfg.d_vocab} tokens, not the "
        "byte tokenizer's 256): set model.tokenizer (the tokenizer load_pretrained returns, or a Hugging Face "
        "tokenizer), or pass token ids"
    )


def _hf(tok: Any) -> Any:
    """The Hugging Face tokenizer behind ``tok`` (a PretrainedTokenizer's ``.hf``, or ``tok``
    itself), or None."""
    inner = getattr(tok, "hf", None)
    if inner is not None:
        return inner
    if all(hasattr(tok, m) for m in ("convert_ids_to_tokens", "encode", "decode")):
        return tok
    return None


def special_token_id(tok: Any, name: str) -> int | None:
    """The tokenizer's ``"bos"``, ``"eos"`` or ``"pad"`` token id, or None (the byte tokenizer has none)."""
    if tok is None or isinstance(tok, ByteTokenizer):
        return None
    hf = _hf(tok)
    value = getattr(hf if hf is not None else tok, f"{name}_token_id", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def encode(tok: Any, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""
    if isinstance(tok, ByteTokenizer):
        return tok.encode(text)
    hf = _hf(tok)
    if hf is not None:
        return [int(i) for i in hf.encode(text, add_special_tokens=False)]
    if hasattr(tok, "to_tokens"):
        ids = torch.as_tensor(tok.to_tokens(text))
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise ValueError(f"tokenizer {type(tok).__name__}.to_tokens gave a batch of {ids.shape[0]} for one text")
        return [int(i) for i in ids.reshape(-1).tolist()]
    if hasattr(tok, "encode"):
        return [int(i) for i in tok.encode(text)]
    raise TypeError(f"tokenizer {type(tok).__name__} has neither encode nor to_tokens")


def decode(tok: Any, ids: list[int], skip_special_tokens: bool = False) -> str:
    """Text of ``ids``."""
    hf = _hf(tok)
    if hf is not None:
        return hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    return str(tok.decode(ids))


def _str_tokens(tok: Any, ids: list[int]) -> list[str]:
    if hasattr(tok, "to_str_tokens"):  # ByteTokenizer (printable labels), PretrainedTokenizer
        return [str(s) for s in tok.to_str_tokens(torch.tensor(ids, dtype=torch.long))]
    return [decode(tok, [i]) for i in ids]  # as TransformerLens: each token decoded on its own


# -- text -> ids ---------------------------------------------------------------------------
def _check_options(prepend_bos: Any, padding_side: Any) -> None:
    if prepend_bos not in (None, True, False):
        raise ValueError(f"prepend_bos is {prepend_bos!r}; accepted values are None (the default: no BOS), False, True")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side is {padding_side!r}; accepted values are None, 'left', 'right'")


def _texts(input: Any, what: str) -> list[str]:
    if isinstance(input, str):
        return [input]
    if isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input):
        return list(input)
    if isinstance(input, (list, tuple)) and not input:
        raise ValueError(f"{what} got an empty list: pass a text or a list of texts")
    raise TypeError(f"{what} takes a str or a list of str; got {type(input).__name__}")


def tokenize_texts(model: Any, texts: Sequence[str], prepend_bos: bool | None, what: str) -> list[list[int]]:
    """Each text's token ids (a BOS first with ``prepend_bos=True``), unchecked for length.

    Raises:
        ValueError: an empty text; ``prepend_bos=True`` with a tokenizer without BOS; no tokenizer.
    """
    tok = usable_tokenizer(model, what)
    prefix: list[int] = []
    if prepend_bos:
        bos = special_token_id(tok, "bos")
        if bos is None:
            raise ValueError(
                f"prepend_bos=True, but this model's tokenizer ({type(tok).__name__}) has no BOS token: pass "
                "prepend_bos=False or None (byte-level models start from the first byte)"
            )
        prefix = [bos]
    rows = []
    for i, text in enumerate(texts):
        ids = prefix + encode(tok, text)
        if not ids:
            where = f" (text {i} of the list)" if len(texts) > 1 else ""
            raise ValueError(f"text is empty{where}: need at least one character")
        rows.append(ids)
    return rows


def equal_lengths(rows: list[list[int]], what: str) -> None:
    lengths = [len(r) for r in rows]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"{what} got {len(rows)} texts of different token lengths ({', '.join(map(str, lengths))}); this model's "
            "forward takes no attention mask, so a padded batch would put the pad tokens into the logits, the loss and "
            "generation: pass texts of equal token length, or one text at a time"
        )


def is_text_list(x: Any) -> bool:
    """Whether ``x`` is a non-empty list (or tuple) of texts: a batch of prompts."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, str) for t in x)


def to_tokens(
    model: Any,
    input: str | list[str],
    prepend_bos: bool | None = None,
    padding_side: str | None = None,
    move_to_device: bool = True,
    truncate: bool = False,
) -> torch.Tensor:
    """``model.to_tokens``: LongTensor [batch, pos] of a text (batch 1) or of a list of texts of
    equal token length, checked against the model's context and vocabulary (see the module
    docstring for BOS, padding and truncation)."""
    _check_options(prepend_bos, padding_side)
    rows = tokenize_texts(model, _texts(input, "to_tokens"), prepend_bos, "to_tokens")
    if truncate:
        rows = [r[: model.cfg.n_ctx] for r in rows]
    equal_lengths(rows, "to_tokens")
    tokens = check_token_ids(torch.tensor(rows, dtype=torch.long), model.cfg.n_ctx, model.cfg.d_vocab, truncate, "text")
    return tokens.to(model.device) if move_to_device else tokens


def to_single_token(model: Any, string: str) -> int:
    """The id of a string that is exactly one token (no BOS)."""
    if not isinstance(string, str):
        raise TypeError(f"to_single_token takes a str; got {type(string).__name__}")
    ids = encode(usable_tokenizer(model, "to_single_token"), string)
    if len(ids) != 1:
        raise ValueError(f"{string!r} is {len(ids)} tokens, not one: {ids}")
    _in_vocab(model, ids)
    return ids[0]


# -- ids -> text -------------------------------------------------------------------------
def _in_vocab(model: Any, ids: list[int]) -> list[int]:
    bad = next((i for i in ids if not 0 <= i < model.cfg.d_vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of range; this model's vocabulary is 0..{model.cfg.d_vocab - 1}")
    return ids


def _id_tensor(tokens: Any, what: str) -> torch.Tensor:
    if isinstance(tokens, str):
        raise TypeError(f"{what} takes token ids; for text use to_tokens")
    try:
        t = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{what} takes a tensor or a (nested) list of integer token ids; got {type(tokens).__name__}") from None
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{what} takes integer token ids; got dtype {t.dtype}")
    return t.long().cpu()


def to_str_tokens(model: Any, input: Any, prepend_bos: bool | None = None, padding_side: str | None = None) -> Any:
    """``model.to_str_tokens``: one label per token.

    A str, a 1-D or [1, pos] tensor, or a list of ids gives ``list[str]``; a list of texts, a
    [batch, pos] tensor with batch > 1, or a list of id lists gives a list of such lists (as
    TransformerLens). ``prepend_bos`` applies to text only.
    """
    _check_options(prepend_bos, padding_side)
    if isinstance(input, (list, tuple)) and not input:
        return []
    if isinstance(input, str):
        tok = usable_tokenizer(model, "to_str_tokens")
        return _str_tokens(tok, tokenize_texts(model, [input], prepend_bos, "to_str_tokens")[0])
    if isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input):
        return [to_str_tokens(model, t, prepend_bos) for t in input]
    if isinstance(input, (list, tuple)) and input and not all(isinstance(t, int) for t in input):
        if all(isinstance(t, (list, tuple, torch.Tensor)) for t in input):
            return [to_str_tokens(model, t) for t in input]
    t = _id_tensor(input, "to_str_tokens")
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() == 0:
        t = t.unsqueeze(0)
    tok = usable_tokenizer(model, "to_str_tokens")
    if t.dim() == 1:
        return _str_tokens(tok, _in_vocab(model, t.tolist()))
    if t.dim() == 2:
        return [_str_tokens(tok, _in_vocab(model, row)) for row in t.tolist()]
    raise ValueError(f"to_str_tokens takes token ids [pos] or [batch, pos]; got shape {tuple(t.shape)}")


def to_string(model: Any, tokens: Any, skip_special_tokens: bool = False) -> str | list[str]:
    """``model.to_string``: the text of token ids [pos] (a str) or [batch, pos] (a list of str,
    one per row, as TransformerLens: a [1, pos] tensor gives a list of one)."""
    t = _id_tensor(tokens, "to_string")
    tok = usable_tokenizer(model, "to_string")
    if t.dim() <= 1:
        return decode(tok, _in_vocab(model, t.reshape(-1).tolist()), skip_special_tokens)
    if t.dim() == 2:
        return [decode(tok, _in_vocab(model, row), skip_special_tokens) for row in t.tolist()]
    raise ValueError(f"to_string takes token ids [pos] or [batch, pos]; got shape {tuple(t.shape)}")
