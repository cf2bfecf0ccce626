"""Attention patterns in the report's per-token explorer: the selected token's pattern for a chosen
layer and head, per model (``blocks.{layer}.attn.hook_pattern``).

Where they come from: a trace recorded with ``patterns=True`` holds them (``trace.patterns``);
otherwise :func:`attnres_probe.reports.recording.record_readings` records them with the logit
decomposition and the logit lens of a live model (one forward pass over the first tokens).

Size: the report stores them for the first :data:`PATTERN_TOKENS` tokens of sequence 0 that the
explorer holds (as the logit decomposition), every layer and head, each query row's weights over
the keys it sees (the lower triangle: ``n (n + 1) / 2`` values per layer and head) as integers
scaled per row so that the row's largest weight has :data:`DIGITS` significant digits (``w =
int / 10**e``, one exponent ``e`` per row). The chart's y axis runs from 0 to that largest weight,
so every bar is drawn to 1/1000 of the axis or better: a near-uniform head at token 63 (weights
0.0155..0.0157) keeps its shape, where thousandths stored every weight as 16 (a flat staircase).

Measured on the demo models (8 layers x 4 heads, 64 tokens of a validation document, three
models): 0.50 MB of pattern text in thousandths, 0.68 MB now (+35%, the row exponents included);
``"%.4g"`` per value would be 1.75 MB (+246%), fixed 1/10000 0.63 MB (+25%, but near-uniform rows
still get only 3 digits). The rest of the report without patterns is about 7.4 MB.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnres_probe import figures

__all__ = ["DIGITS", "PATTERN_BUDGET", "PATTERN_TOKENS", "explorer_patterns", "pattern_source", "row_exponents"]

PATTERN_TOKENS = 64  # tokens with a stored attention pattern (the explorer's first, in sequence 0)
# tokens x models with stored patterns in one explorer: 64 tokens for up to two models, fewer each
# beyond (three: 53, five demo models: 32 each), so a report of every demo model on a text of a
# whole context (128 tokens) stays under its 8 MB budget
PATTERN_BUDGET = 160
DIGITS = 4  # significant digits of each query row's largest weight (the others share its exponent)


def pattern_source(trace: Any, reading: Mapping[str, Any] | None) -> np.ndarray | None:
    """The patterns [layer, head, n, n] of sequence 0 the report can show for ``trace``: the trace's
    own (recorded with ``patterns=True``, every layer and head: the explorer numbers layers and heads
    by position), else those :func:`record_readings` recorded; None if neither (a trace holding some
    layers or heads only, ``patterns=[...]``, shows none here: ``trace.pattern`` reads it)."""
    if getattr(trace, "patterns", None) is not None and _every_layer_and_head(trace):
        n = int(trace.mask[0].sum())
        return np.asarray(trace.patterns[0, :, :, :n, :n], dtype=np.float32)
    if reading is not None and reading.get("patterns") is not None:
        return np.asarray(reading["patterns"], dtype=np.float32)
    return None


def _every_layer_and_head(trace: Any) -> bool:
    if not hasattr(trace, "pattern_layers"):  # an object holding patterns of every layer and head only
        return True
    n_layers = (len(trace.read_labels) - 1) // 2
    n_heads = int(trace.meta.get("pattern_n_heads") or trace.patterns.shape[2])
    return trace.pattern_layers == list(range(n_layers)) and trace.pattern_heads == list(range(n_heads))


def row_exponents(block: np.ndarray, digits: int = DIGITS) -> np.ndarray:
    """Per query row p of a pattern [n, n], the exponent e with which the row is stored as integers
    ``round(w * 10**e)``: the one that gives the row's largest weight (over keys 0..p) ``digits``
    significant digits. A row of zeros (not a softmax) gets 0."""
    tri = np.tril(np.clip(np.asarray(block, dtype=np.float64), 0.0, 1.0))
    top = tri.max(axis=1)
    with np.errstate(divide="ignore"):
        e = digits - 1 - np.floor(np.log10(top))
    return np.where(top > 0, e, 0).astype(np.int64)


def _triangle_json(block: np.ndarray, exponents: np.ndarray) -> str:
    """One layer-head pattern [n, n] as a JSON list of the lower triangle's rows, row p as the
    integers ``round(w * 10**exponents[p])`` of the weights of the keys 0..p."""
    n = block.shape[0]
    rows, cols = np.tril_indices(n)
    values = np.clip(np.asarray(block, dtype=np.float64)[rows, cols], 0.0, 1.0)
    ints = np.rint(values * 10.0 ** exponents[rows]).astype(np.int64)
    return "[" + ",".join(map(str, ints.tolist())) + "]"


def _pattern_json(block: np.ndarray) -> tuple[str, str]:
    """(weights, exponents) of one layer-head pattern [n, n] as JSON lists."""
    e = row_exponents(block)
    return _triangle_json(block, e), "[" + ",".join(map(str, e.tolist())) + "]"


def explorer_patterns(
    patterns: np.ndarray, name: str, str_tokens: Sequence[str], positions: Sequence[tuple[int, int]], plots: Any,
    color: str | None = None, limit: int = PATTERN_TOKENS,
) -> dict[str, Any]:
    """One model's attention patterns in the explorer: a chart drawn for the first token by
    :func:`attnres_probe.figures.attention_pattern_chart`, and the values the page swaps in.

    Args:
        patterns: [layer, head, n, n] of sequence 0 (:func:`pattern_source`).
        name: the model's label in the report.
        str_tokens: sequence 0's tokens (the key labels).
        positions: the explorer's (sequence, position) of every token it holds, in order.
        plots: the report's plot collector (``add(fig) -> item``).
        color: the bars' colour.
        limit: store patterns for at most this many tokens.

    Returns:
        {"plot": the chart's item, "data": JSON text of {name, div, L, H, n, keys, w, e}, "n": tokens stored};
        ``w[l][h]`` is the lower triangle of layer l, head h, row after row, as integers, and
        ``e[l][h][p]`` the exponent of row p: a weight is ``w / 10**e`` (:func:`row_exponents`).
    """
    L, H = int(patterns.shape[0]), int(patterns.shape[1])
    in_explorer = sum(1 for b, _ in positions if b == 0)
    n = int(min(limit, patterns.shape[2], in_explorer))
    b0, p0 = positions[0]
    p0 = p0 if b0 == 0 and p0 < n else 0
    fig = figures.attention_pattern_chart(patterns[0, 0, p0], str_tokens, p0, 0, 0, name=name, color=color)
    item = plots.add(fig)
    keys = [figures.show_token(str(t)) for t in list(str_tokens)[:n]]
    head = {"name": name, "div": item["id"], "L": L, "H": H, "n": n, "digits": DIGITS, "keys": keys,
            "color": color, "axis": figures.PATTERN_AXIS_TITLE}
    text = json.dumps({**head, "w": "__W__", "e": "__E__"}, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    parts = [[_pattern_json(patterns[l, h, :n, :n]) for h in range(H)] for l in range(L)]
    w = "[" + ",".join("[" + ",".join(t for t, _ in layer) + "]" for layer in parts) + "]"
    e = "[" + ",".join("[" + ",".join(x for _, x in layer) + "]" for layer in parts) + "]"
    return {"plot": item, "data": text.replace('"__W__"', w).replace('"__E__"', e), "n": n, "layers": L, "heads": H}


def explorer_pattern_items(traces: Sequence[Any], names: Sequence[str], readings: Mapping[str, Any] | None,
                           positions: Sequence[tuple[int, int]], plots: Any,
                           colors: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """:func:`explorer_patterns` of every trace of one explorer that has patterns to show (its own,
    or its readings'), in the explorer's order: :data:`PATTERN_TOKENS` tokens each, or an equal
    share of :data:`PATTERN_BUDGET` when more models have patterns than that allows."""
    found = []
    for trace, name in zip(traces, names):
        reading = readings.get(trace.name) if readings else None
        patterns = pattern_source(trace, reading)
        if patterns is not None:
            found.append((trace, name, patterns))
    limit = min(PATTERN_TOKENS, PATTERN_BUDGET // max(1, len(found)))
    return [explorer_patterns(patterns, name, trace.str_tokens[0], positions, plots, color=(colors or {}).get(name),
                              limit=limit) for trace, name, patterns in found]
