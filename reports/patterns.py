"""Attention patterns in the report's per-token explorer: the selected token's pattern for a chosen
layer and head, per model (``blocks.{layer}.attn.hook_pattern``).

Where they come from: a trace recorded with ``patterns=True`` holds them (``trace.patterns``);
otherwise :func:`attnres_probe.reports.recording.record_readings` records them with the logit
decomposition and the logit lens of a live model (one forward pass over the first tokens).

Size: the report stores them for the first :data:`PATTERN_TOKENS` tokens of sequence 0 that the
explorer holds (as the logit decomposition), every layer and head, each query row's weights over
the keys it sees (the lower triangle: ``n (n + 1) / 2`` values per layer and head) as integers in
thousandths (:data:`SCALE`), about 2.5 bytes each: 170 kB per model of 8 layers x 4 heads at 64
tokens (the demo models: 0.5 MB for three, beside the 7.4 MB of the report without them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnres_probe import figures

__all__ = ["PATTERN_TOKENS", "SCALE", "explorer_patterns", "pattern_source"]

PATTERN_TOKENS = 64  # tokens with a stored attention pattern (the explorer's first, in sequence 0)
SCALE = 1000  # weights are stored as round(w * SCALE): thousandths


def pattern_source(trace: Any, reading: Mapping[str, Any] | None) -> np.ndarray | None:
    """The patterns [layer, head, n, n] of sequence 0 the report can show for ``trace``: the trace's
    own (recorded with ``patterns=True``), else those :func:`record_readings` recorded; None if neither."""
    if getattr(trace, "patterns", None) is not None:
        n = int(trace.mask[0].sum())
        return np.asarray(trace.patterns[0, :, :, :n, :n], dtype=np.float32)
    if reading is not None and reading.get("patterns") is not None:
        return np.asarray(reading["patterns"], dtype=np.float32)
    return None


def _triangle_json(block: np.ndarray) -> str:
    """One layer-head pattern [n, n] as a JSON list of the lower triangle's rows, each rounded to
    integers of 1/SCALE (row p holds the p + 1 weights of the keys 0..p)."""
    n = block.shape[0]
    rows, cols = np.tril_indices(n)
    ints = np.rint(np.clip(block[rows, cols], 0.0, 1.0) * SCALE).astype(np.int64)
    return "[" + ",".join(map(str, ints.tolist())) + "]"


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
        {"plot": the chart's item, "data": JSON text of {name, div, L, H, n, keys, w}, "n": tokens stored};
        ``w[l][h]`` is the lower triangle of layer l, head h, row after row, in thousandths.
    """
    L, H = int(patterns.shape[0]), int(patterns.shape[1])
    in_explorer = sum(1 for b, _ in positions if b == 0)
    n = int(min(limit, patterns.shape[2], in_explorer))
    b0, p0 = positions[0]
    p0 = p0 if b0 == 0 and p0 < n else 0
    fig = figures.attention_pattern_chart(patterns[0, 0, p0], str_tokens, p0, 0, 0, name=name, color=color)
    item = plots.add(fig)
    keys = [figures.show_token(str(t)) for t in list(str_tokens)[:n]]
    head = {"name": name, "div": item["id"], "L": L, "H": H, "n": n, "scale": SCALE, "keys": keys,
            "color": color, "axis": figures.PATTERN_AXIS_TITLE}
    text = json.dumps({**head, "w": "__W__"}, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    w = "[" + ",".join("[" + ",".join(_triangle_json(patterns[l, h, :n, :n]) for h in range(H)) + "]" for l in range(L)) + "]"
    return {"plot": item, "data": text.replace('"__W__"', w), "n": n, "layers": L, "heads": H}


def explorer_pattern_items(traces: Sequence[Any], names: Sequence[str], readings: Mapping[str, Any] | None,
                           positions: Sequence[tuple[int, int]], plots: Any,
                           colors: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """:func:`explorer_patterns` of every trace of one explorer that has patterns to show (its own,
    or its readings'), in the explorer's order."""
    out = []
    for trace, name in zip(traces, names):
        reading = readings.get(trace.name) if readings else None
        patterns = pattern_source(trace, reading)
        if patterns is None:
            continue
        out.append(explorer_patterns(patterns, name, trace.str_tokens[0], positions, plots,
                                     color=(colors or {}).get(name)))
    return out
