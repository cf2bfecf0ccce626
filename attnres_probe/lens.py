"""Reading the residual stream under AttnRes: direct logit contributions and a logit lens.

In a PreNorm model the final residual stream is a sum, so its logits split into one piece per
source. Under AttnRes the final read is a weighted mixture ``h = sum_i alpha_i v_i`` (docs/design.md,
"Reading the residual stream under AttnRes"); with the final norm's scale taken from the run
(``s = 1 / rms(h)``, as TransformerLens's ``apply_ln_to_stack`` takes it from the cache), the
logits are linear in the mixture, so

    logits = sum_i (alpha_i v_i * s * gamma) @ W_U

splits them into one direct contribution per source that adds up to the model's logits.
The same projection at any read (its mixed input through the final norm and W_U) is a logit
lens: what each read "predicts" before the rest of the network has run.

Both run the model once through its hook points (the forward that trains) and read the
weights the forward used, an intervention included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

__all__ = ["LogitContributions", "logit_contributions", "logit_lens", "token_readings"]


@dataclass
class LogitContributions:
    """Each source's direct contribution to the logits of one token (float64).

    Attributes:
        sources: the final read's source labels (the common source axis).
        weights: [S] the final read's weight of each source (1 for PreNorm).
        contributions: [S, vocab]; they sum over sources to ``logits``.
        logits: [vocab] the model's logits at this token.
        position: the token's position; ``str_tokens``: the sequence's tokens as text.
    """

    sources: list[str]
    weights: np.ndarray
    contributions: np.ndarray
    logits: np.ndarray
    position: int
    str_tokens: list[str]
    decode: Any = None

    def frame(self, k: int = 5, targets: list[int] | None = None) -> pd.DataFrame:
        """Contributions to the model's top-``k`` predictions (or to ``targets``), one row per
        source: columns ``weight`` and one per target token (labelled by its text)."""
        ids = list(targets) if targets is not None else [int(i) for i in np.argsort(-self.logits)[:k]]
        names = [self._name(i) for i in ids]
        df = pd.DataFrame(self.contributions[:, ids], index=pd.Index(self.sources, name="source"), columns=names)
        df.insert(0, "weight", self.weights)
        return df

    def _name(self, token_id: int) -> str:
        if self.decode is None:
            return str(token_id)
        return f"{self.decode([token_id])!r} ({token_id})"


def _final_scale(h: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms(h) over the last axis (the final RMSNorm's scale), float64."""
    return torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps)


def _sources(model: Any, cache: Any, read: int) -> list[torch.Tensor]:
    """The sources ``read`` mixes, rebuilt from the cache's sublayer outputs (the common axis)."""
    outs = {"embed": cache["hook_embed"] + cache["hook_pos_embed"] if "hook_pos_embed" in cache else cache["hook_embed"]}
    for i, block in enumerate(model.blocks):
        outs[f"L{i}.attn"] = cache[block.hook_attn_out.name]
        outs[f"L{i}.mlp"] = cache[block.hook_mlp_out.name]
    return [sum(outs[m] for m in members) for members in model.axis.members(read)]


def _contribution_hooks(model: Any) -> set[str]:
    names = {"hook_embed", "hook_pos_embed", "hook_resid_final"}
    names |= {hp.name for b in model.blocks for hp in (b.hook_attn_out, b.hook_mlp_out)}
    if model.axis.residual != "prenorm":
        names.add(model.out_res.hook_weights.name)
    return names


def _lens_hooks(model: Any) -> list[str]:
    return [*(hp.name for b in model.blocks for hp in (b.hook_resid_pre, b.hook_resid_mid)), model.hook_resid_final.name]


def _run(model: Any, tokens: torch.Tensor, names: set[str]) -> tuple[torch.Tensor, Any]:
    with torch.no_grad():
        return model.run_with_cache(tokens, names_filter=lambda n: n in names)


def logit_contributions(model: Any, tokens: torch.Tensor, position: int = -1, batch: int = 0, decode: Any = None,
                        run: tuple[torch.Tensor, Any] | None = None) -> LogitContributions:
    """Split the logits at one token into the direct contribution of every source of the final read.

    Args:
        model: an :class:`~attnres_probe.AttnResTransformer` (any residual rule).
        tokens: [batch, pos] token ids.
        position: the token (negative counts from the end).
        batch: the sequence.
        decode: optional ``list[int] -> str`` for labels (a tokenizer's ``decode``).
        run: ``(logits, cache)`` of a ``run_with_cache`` of these tokens that kept the hooks
            this needs (:func:`token_reading` shares one run with the logit lens); default: run now.

    Returns:
        :class:`LogitContributions`; ``contributions.sum(0)`` equals the logits to float64
        rounding of the float32 run.
    """
    axis = model.axis
    final = axis.n_sublayers
    logits, cache = run if run is not None else _run(model, tokens, _contribution_hooks(model))
    P = tokens.shape[-1]
    if isinstance(position, bool) or not isinstance(position, int) or not -P <= position < P:
        raise IndexError(f"position {position!r} is out of range; the sequence has {P} tokens (0..{P - 1}, or negative from the end)")
    pos = position % P
    sources = [v[batch, pos].double() for v in _sources(model, cache, final)]  # S x [d]
    if axis.residual == "prenorm":
        weights = torch.ones(len(sources), dtype=torch.float64)
    else:
        weights = cache[model.out_res.hook_weights.name][batch, pos, : len(sources)].double()
    h = cache["hook_resid_final"][batch, pos]
    scale = _final_scale(h, model.ln_final.eps)  # [1]
    gamma = model.ln_final.weight.detach().double()
    W_U = model.unembed.detach().double()
    contrib = torch.stack([(w * v * scale * gamma) @ W_U for w, v in zip(weights, sources)])  # (S, vocab)
    labels = axis.source_labels[: len(sources)]
    str_tokens = [decode([int(t)]) if decode else str(int(t)) for t in tokens[batch]]
    return LogitContributions(
        sources=labels,
        weights=weights.numpy(),
        contributions=contrib.numpy(),
        logits=logits[batch, pos].double().numpy(),
        position=pos,
        str_tokens=str_tokens,
        decode=decode,
    )


def logit_lens(model: Any, tokens: torch.Tensor, k: int = 5, batch: int = 0, positions: list[int] | None = None, decode: Any = None,
               run: tuple[torch.Tensor, Any] | None = None) -> pd.DataFrame:
    """What each read predicts: its mixed input through the final norm and the unembedding.

    Args:
        model: an :class:`~attnres_probe.AttnResTransformer`.
        tokens: [batch, pos] token ids.
        k: predictions kept per read and position.
        batch: the sequence.
        positions: positions to report (default: all).
        decode: optional ``list[int] -> str`` for the predicted tokens' text.
        run: ``(logits, cache)`` of a ``run_with_cache`` of these tokens that kept the reads'
            hooks (as :func:`logit_contributions`); default: run now.

    Returns:
        Long DataFrame: read, position, rank (0 = top), token_id, token, prob (softmax of that
        read's projected logits), and ``is_next``: whether it is the token that follows.
    """
    read_names = _lens_hooks(model)
    _, cache = run if run is not None else _run(model, tokens, set(read_names))
    with torch.no_grad():
        P = tokens.shape[-1]
        pos = list(range(P)) if positions is None else [p % P for p in positions]
        rows = []
        for r, (label, name) in enumerate(zip(model.axis.read_labels, read_names)):
            h = cache[name][batch, pos]  # (n_pos, d)
            probs = torch.softmax(model.ln_final(h).float() @ model.unembed.float(), dim=-1)  # (n_pos, vocab)
            top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
            for j, p in enumerate(pos):
                nxt = int(tokens[batch, p + 1]) if p + 1 < P else -1
                for rank, (tid, pr) in enumerate(zip(top.indices[j].tolist(), top.values[j].tolist())):
                    rows.append((label, p, rank, tid, decode([tid]) if decode else str(tid), pr, tid == nxt))
    return pd.DataFrame(rows, columns=["read", "position", "rank", "token_id", "token", "prob", "is_next"])


def token_readings(model: Any, tokens: torch.Tensor, positions: list[int] | None = None, k: int = 5, batch: int = 0,
                   decode: Any = None) -> tuple[list[LogitContributions], pd.DataFrame]:
    """:func:`logit_contributions` at each of ``positions`` (default: every token) and
    :func:`logit_lens` of those positions, all from one forward: the same results as the separate
    calls (a test), with one model run instead of one per call.

    Returns:
        ([LogitContributions per position], the logit-lens frame of those positions)
    """
    run = _run(model, tokens, _contribution_hooks(model) | set(_lens_hooks(model)))
    P = tokens.shape[-1]
    positions = list(range(P)) if positions is None else list(positions)
    contribs = [logit_contributions(model, tokens, position=p, batch=batch, decode=decode, run=run) for p in positions]
    lens = logit_lens(model, tokens, k=k, batch=batch, positions=[lc.position for lc in contribs], decode=decode, run=run)
    return contribs, lens
