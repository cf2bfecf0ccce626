"""Record the traces a report needs: one text through several models, with provenance in ``meta``.

A text longer than a model's context is cut into ``n_ctx``-token windows, recorded as one
right-padded batch (sequence b holds tokens b·n_ctx … (b+1)·n_ctx − 1), with one backward pass
of the mean next-token loss over all windows. Each trace's ``meta`` gets:

- ``text``: the text as given (the report shows it as written, not re-assembled from tokens);
- ``windows``: ``{"n_ctx": …, "count": …}``;
- ``checkpoint_dir`` for a model loaded from a checkpoint directory or a bundled demo, and always
  ``weights_sha256`` (the one digest of a model, :func:`attnres_probe.io.weights_sha256`, the
  same a corpus run records): sha256 of the in-memory fp32 state dict (tensor names, shapes and
  bytes in name order).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnres_probe.demo_recipe import DEMO_NAMES
from attnres_probe.io import weights_sha256
from attnres_probe.probe import Probe
from attnres_probe.texts import REPORT_TEXT
from attnres_probe.trace import DepthTrace

__all__ = ["MAX_TOKENS", "SAMPLE_TEXT", "record_checkpoints", "record_demos", "record_text"]

# A report records its text as one batch with one backward pass: memory grows with the text
# (about 60 kB per token at the demo size). 8192 tokens stay under about half a gigabyte.
MAX_TOKENS = 8192

# 256 ASCII bytes = 256 tokens of the byte tokenizer = two windows of the demo models' 128: a held-out
# passage of a play the demo models never trained on (attnres_probe.texts)
SAMPLE_TEXT = REPORT_TEXT


def record_text(
    model: Any,
    text: str,
    *,
    tokenizer: Any = None,
    name: str | None = None,
    checkpoint_dir: str | Path | None = None,
    backward: bool = True,
) -> DepthTrace:
    """Record ``text`` through ``model`` in ``n_ctx``-token windows, as one batch.

    Args:
        model: an AttnResTransformer (or TransformerLens-style model, see :class:`~attnres_probe.Probe`).
        text: the text; a text longer than the context becomes ⌈n/n_ctx⌉ sequences [B, n_ctx]
            (the last right-padded).
        tokenizer: as for :class:`~attnres_probe.Probe` (default: bytes for a 256-token vocabulary).
        name: the model's label in the report (default: its residual mode).
        checkpoint_dir: where the model was loaded from; its ``model.safetensors`` is hashed.
            Models from :func:`~attnres_probe.load_demo` are recognised without it.
        backward: record gradient norms (skipped automatically for a one-token text).

    Returns:
        The trace, tokens [B, P], with ``meta`` extended as the module docstring says.

    Raises:
        ValueError: an empty text, or one of more than :data:`MAX_TOKENS` tokens.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("text is empty: a report needs at least one character of text")
    probe = Probe(model, tokenizer=tokenizer, name=name)
    n = int(probe.encode(text).numel())
    if n > MAX_TOKENS:
        raise ValueError(
            f"the text has {n} tokens; a report records at most {MAX_TOKENS} (it records the whole text as one batch, "
            "whose memory grows with its length): pass a shorter text"
        )
    tokens, mask, str_tokens = next(probe.batches([text], batch_size=sys.maxsize))
    use_backward = backward and bool(mask[:, 1:].any())
    meta: dict[str, Any] = {"text": text, "windows": {"n_ctx": int(probe.spec.n_ctx), "count": int(tokens.shape[0])}}
    demo = getattr(model, "demo_name", None)
    if checkpoint_dir is None and demo is not None:
        from attnres_probe.demo import demo_dir

        checkpoint_dir = demo_dir(demo)
    weights = None
    if checkpoint_dir is not None:
        from attnres_probe.checkpoint import WEIGHTS_FILE  # checkpoint imports the model (and TransformerLens)

        weights = Path(checkpoint_dir) / WEIGHTS_FILE
    if weights is not None and weights.is_file():
        meta["checkpoint_dir"] = str(checkpoint_dir)
    meta["weights_sha256"] = weights_sha256(model)  # the one digest of a model, on every page and file
    return probe.record(tokens, mask, str_tokens, backward=use_backward, extra_meta=meta)


def record_checkpoints(
    dirs: Sequence[str | Path], text: str, names: Sequence[str] | None = None, backward: bool = True
) -> list[DepthTrace]:
    """Load each checkpoint directory and :func:`record_text` through it.

    Names default to the directory names (made unique by the comparison code if they repeat).

    Raises:
        CheckpointError: a directory is not a readable checkpoint (the message names it).
    """
    from attnres_probe.loading import load_model

    if names is not None and len(names) != len(dirs):
        raise ValueError(f"{len(names)} names for {len(dirs)} model directories: give one name per directory")
    traces = []
    for i, d in enumerate(dirs):
        d = Path(d)
        loaded = load_model(d)
        model, tokenizer = loaded.model, loaded.tokenizer
        name = names[i] if names is not None else (d.resolve().name or model.cfg.residual)
        traces.append(record_text(model, text, tokenizer=tokenizer, name=name, checkpoint_dir=d, backward=backward))
    return traces


def record_demos(text: str, names: Sequence[str] = DEMO_NAMES, backward: bool = True) -> list[DepthTrace]:
    """:func:`record_text` through the bundled demo models (default: every shipped one,
    :data:`~attnres_probe.demo_recipe.DEMO_NAMES`; raises FileNotFoundError if one is missing)."""
    from attnres_probe.loading import demo_source, load_model

    traces = []
    for name in names:
        loaded = load_model(demo_source(name))
        traces.append(record_text(loaded.model, text, tokenizer=loaded.tokenizer, name=name, backward=backward))
    return traces


READING_TOKENS = 64  # tokens with a precomputed logit decomposition and logit lens in a report


def record_readings(model, trace: DepthTrace, tokenizer=None, n_tokens: int = READING_TOKENS, k: int = 5) -> dict:
    """The routing-aware logit decomposition and the logit lens of ``model`` at the first
    ``n_tokens`` tokens of the trace's first sequence, and its attention patterns there, for the
    report's per-token explorer.

    Returns:
        {"name", "positions": [int], "contribs": [LogitContributions], "lens": DataFrame, "k": k,
        "patterns": [layer, head, n, n] float32 (one more forward pass, without gradients; None for
        a model without ``hook_pattern`` points)}
    """
    import torch

    from attnres_probe.probe import Probe

    probe = Probe(model, tokenizer=tokenizer, name=trace.name)
    n = min(int(trace.mask[0].sum()), n_tokens)
    # causal: what the model does at positions < n + 1 depends on those tokens only
    tokens = torch.from_numpy(trace.tokens[:1, : min(int(trace.mask[0].sum()), n + 1)].astype("int64"))
    positions = list(range(n))
    contribs, lens = probe.token_readings(tokens, positions=positions, k=k)
    patterns = probe.attention_patterns(tokens[:, :n])[0] if probe.spec.pattern_hooks else None
    return {"name": trace.name, "positions": positions, "contribs": contribs, "lens": lens, "k": k, "patterns": patterns}
