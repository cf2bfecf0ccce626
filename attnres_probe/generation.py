"""``model.generate``: greedy or sampled continuation, as TransformerLens's ``generate``.

Every step runs the model's own forward (``model(tokens)``) on the sequence so far, so every
hook point fires at every step and a hook attached with ``model.hooks(fwd_hooks=...)``,
``add_hook`` or inside ``run_with_hooks``-style contexts changes what is generated. There is no
KV cache (``use_past_kv_cache`` is accepted for TransformerLens's signature and changes
nothing). Sampling draws from a local ``torch.Generator`` (seeded with ``seed``), never from the
global RNG.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attnres_probe.text_api import (
    PADDING_SIDES,
    decode,
    equal_lengths,
    special_token_id,
    tokenize_texts,
    usable_tokenizer,
)
from attnres_probe.tokenizer import check_token_ids

__all__ = ["RETURN_TYPES", "generate", "sample_logits"]

RETURN_TYPES = ("input", "str", "tokens")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# the most tokens one generate() call writes: each new token is one forward over the model's context, so a call
# past this runs for hours on a CPU (and its token list alone grows without bound); call again to continue
MAX_NEW_TOKENS = 100_000


def _check(max_new_tokens, temperature, top_k, top_p, seed, do_sample, return_type, eos_token_id, prepend_bos, padding_side):
    if not _is_int(max_new_tokens) or not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens is {max_new_tokens!r}; accepted values are integers in 0..{MAX_NEW_TOKENS:,} "
                         "(each token is one forward; call generate again on its output to continue)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature is {temperature!r}; accepted values are finite numbers >= 0 (0: greedy)")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k is {top_k!r}; accepted values are None (every token) or integers >= 1")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p is {top_p!r}; accepted values are None (every token) or numbers in (0, 1]")
    if seed is not None and not _is_int(seed):
        raise ValueError(f"seed is {seed!r}; accepted values are None or an integer")
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample is {do_sample!r}; accepted values are True, False")
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type is {return_type!r}; accepted values are 'input', 'str', 'tokens'")
    ids = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if ids is not None and (not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) for i in ids)):
        raise ValueError(f"eos_token_id is {eos_token_id!r}; accepted values are None, a token id or a list of token ids")
    if prepend_bos not in (None, True, False):
        raise ValueError(f"prepend_bos is {prepend_bos!r}; accepted values are None (no BOS), False, True")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side is {padding_side!r}; accepted values are None, 'left', 'right'")


def sample_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` [batch, vocab]: argmax at ``temperature`` 0, else a draw
    from softmax(logits / temperature) restricted to the ``top_k`` most likely tokens and the
    smallest set of them holding ``top_p`` of the probability (the most likely token always
    stays). Returns LongTensor [batch]."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the mass before a token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def generate(
    model: Any,
    input: Any = "",
    max_new_tokens: int = 10,
    stop_at_eos: bool = True,
    eos_token_id: int | list[int] | None = None,
    do_sample: bool = True,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    seed: int | None = None,
    use_past_kv_cache: bool = True,
    prepend_bos: bool | None = None,
    padding_side: str | None = None,
    return_type: str = "input",
    verbose: bool = False,
) -> Any:
    """Continue ``input`` by up to ``max_new_tokens`` tokens (see ``AttnResTransformer.generate``)."""
    _check(max_new_tokens, temperature, top_k, top_p, seed, do_sample, return_type, eos_token_id, prepend_bos, padding_side)
    cfg = model.cfg
    if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input)):
        input_type = "str" if isinstance(input, str) else "list"
        rows = tokenize_texts(model, [input] if input_type == "str" else list(input), prepend_bos, "generate")
        equal_lengths(rows, "generate")
        tokens = torch.tensor(rows, dtype=torch.long)
    else:
        input_type = "tokens"
        tokens = check_token_ids(input, 2**62, cfg.d_vocab, what="input")  # no length limit: the window slides
    tokens = tokens.to(model.device)

    eos: list[int] = []
    if stop_at_eos:
        if eos_token_id is not None:
            eos = [eos_token_id] if _is_int(eos_token_id) else list(eos_token_id)
        else:
            found = special_token_id(model.tokenizer, "eos")
            eos = [] if found is None else [found]
    eos_t = torch.tensor(eos, dtype=torch.long, device=tokens.device)

    generator = None
    greedy = not do_sample or temperature == 0
    if not greedy:
        generator = torch.Generator(device=tokens.device)
        if seed is None:
            generator.seed()  # a fresh, unrecorded seed: the global RNG is not touched
        else:
            generator.manual_seed(seed)

    steps: Any = range(max_new_tokens)
    if verbose:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="generate")
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    with torch.no_grad():
        for step in steps:
            window = tokens[:, -cfg.n_ctx :]  # the last n_ctx tokens, positions counted from the window's start
            logits = model(window, return_type="logits")[:, -1, :]
            if not bool(torch.isfinite(logits).all()):  # argmax of NaN is token 0: say so instead of emitting it
                rows = (~torch.isfinite(logits)).any(-1).nonzero().flatten().tolist()
                raise ValueError(
                    f"generate: the next-token logits at step {step} are not finite (rows {rows}); nothing is "
                    "generated from them. A hook attached to the model likely produced NaN or inf (the model's "
                    "NonFiniteWarning names the first hook point with a non-finite value)"
                )
            nxt = sample_logits(logits, 0.0 if greedy else temperature, top_k, top_p, generator)
            if eos:
                nxt = torch.where(finished, eos_t[0], nxt)  # finished rows are filled with EOS, as TransformerLens
                finished = finished | torch.isin(nxt, eos_t)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            if eos and bool(finished.all()):
                break

    if return_type == "tokens" or (return_type == "input" and input_type == "tokens"):
        return tokens
    tok = usable_tokenizer(model, "generate(return_type='str')")
    texts = [decode(tok, row, skip_special_tokens=True) for row in tokens.tolist()]
    return texts if input_type == "list" or len(texts) > 1 else texts[0]  # as TransformerLens
