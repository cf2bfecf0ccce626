"""Causal controls of depth routing (issue #49): what input-dependent routing and the older sources
are worth to the loss, measured by changing the recorded model's own forward through its hook points.

- :func:`static_routing`: each read's weights replaced by their mean over the corpus (every token of
  every window), one read at a time and all at once: the input dependence removed, everything else
  kept. The loss change is the value of input-dependent routing; a model whose routing is already
  static (PreNorm-like fixed weights, attnres4babylm's static control, a model forced to route
  uniformly) gets 0 exactly (its weights equal their mean, computed in float64).
- :func:`mask_sources`: attnres4babylm's masking (:mod:`attnres_probe.masking`: ``nonrecent``
  drops the completed blocks of age >= 2 at every read, ``random`` as many completed blocks drawn per
  read, ``embed`` the embedding), the loss change per window; ``nonrecent`` also gives the contrast
  nonrecent − random (count-matched random draws, repeated over seeds and averaged), paired by window.

Intervals are Student t intervals over the windows (each text is cut into windows of the model's
context); every number is a loss difference in nats per token (per byte for byte-level models).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from attnres_probe.losses import next_token_loss

__all__ = ["ControlResult", "mask_sources", "static_routing", "text_windows"]

LEVEL = 0.95


@dataclass
class ControlResult:
    """A control's loss changes (changed − unchanged), per window and summarised.

    Attributes:
        control: ``"static routing"``, ``"mask nonrecent"``, ``"mask random"`` or ``"mask embed"``.
        windows: one row per window: ``text``, ``window``, ``tokens``, ``loss`` (unchanged), ``delta``
            (all reads changed at once) and, for the contrast, ``delta_random`` and ``contrast``.
        total: {``mean``, ``low``, ``high``, ``n``}: the mean change over windows with its interval.
        reads: static routing only: one row per read (``read``, ``label``, ``mean``, ``low``, ``high``):
            the change with that read alone made static.
        contrast: ``mask nonrecent`` only: nonrecent − random, {``mean``, ``low``, ``high``, ``n``,
            ``repeats``}.
        unit: the unit of every number.
    """

    control: str
    windows: pd.DataFrame
    total: dict[str, float]
    reads: pd.DataFrame | None = None
    contrast: dict[str, float] | None = None
    unit: str = "nats per token"
    meta: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        """One line per number, with its interval and unit."""
        t = self.total
        lines = [f"{self.control}: loss change {t['mean']:+.4g} [{t['low']:+.4g}, {t['high']:+.4g}] {self.unit} "
                 f"({LEVEL:.0%} interval over {t['n']} windows)"]
        if self.contrast is not None:
            c = self.contrast
            lines.append(f"nonrecent − random ({c['repeats']} random draws): {c['mean']:+.4g} [{c['low']:+.4g}, "
                         f"{c['high']:+.4g}] {self.unit}")
        return "\n".join(lines)


def _interval(values: Sequence[float]) -> dict[str, float]:
    from attnres_probe.analysis.seed_tests import t_interval

    v = [float(x) for x in values]
    mean, low, high = t_interval(v, LEVEL) if len(v) > 1 else (v[0] if v else math.nan, math.nan, math.nan)
    return {"mean": float(mean), "low": float(low), "high": float(high), "n": len(v)}


def text_windows(probe: Any, texts: Any) -> list[tuple[int, torch.Tensor]]:
    """(text index, token window [1, <= n_ctx]) of every window of at least two tokens of ``texts``
    (a string or a list of strings / token-id sequences)."""
    if isinstance(texts, (str, torch.Tensor)):
        texts = [texts]
    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty: give at least one text")
    n_ctx = probe.spec.n_ctx
    out = []
    for i, text in enumerate(texts):
        if isinstance(text, str):
            ids = _ids(probe, text)
        else:
            ids = torch.as_tensor(text, dtype=torch.long).reshape(-1)
        for start in range(0, int(ids.numel()), n_ctx):
            piece = ids[start:start + n_ctx]
            if piece.numel() >= 2:
                out.append((i, piece.reshape(1, -1)))
    if not out:
        raise ValueError("no window of at least two tokens in texts")
    return out


def _ids(probe: Any, text: str) -> torch.Tensor:
    """The whole text as the probe's token ids (:func:`attnres_probe.tokenizer.text_ids`: the model's own
    tokenizer; bytes for a byte-level model)."""
    from attnres_probe.tokenizer import text_ids

    return torch.as_tensor(text_ids(probe.tokenizer, text), dtype=torch.long)


def _loss(probe: Any, tokens: torch.Tensor, hooks: Sequence[tuple[str, Any]] = ()) -> float:
    """The mean next-token loss of one window with ``hooks`` on (this thread's forward only)."""
    owner = threading.get_ident()
    handles = []
    try:
        for name, fn in hooks:
            hp = probe.model.hook_dict[name]

            def only_here(x, hook=None, fn=fn):
                return fn(x, hook) if threading.get_ident() == owner else None

            handles.append((hp, hp.add_hook(only_here, dir="fwd")))
        with torch.no_grad():
            return float(next_token_loss(probe.logits(tokens.to(probe.device)), tokens.to(probe.device)))
    finally:
        for hp, handle in handles:
            handle.hook.remove()
            if handle in hp.fwd_hooks:
                hp.fwd_hooks.remove(handle)


def _unit(probe: Any) -> str:
    return "nats per byte" if probe.tokenizer is None or type(probe.tokenizer).__name__ == "ByteTokenizer" else "nats per token"


def static_routing(probe: Any, texts: Any, reads: bool = True) -> ControlResult:
    """Each read's depth weights replaced by their mean over every token of ``texts`` (the corpus), one
    read at a time (with ``reads``) and all at once; the loss change per window, per read and in total,
    with intervals.

    Raises:
        ValueError: the model has no depth-weight hook points (``hook_weights``), or no window.
    """
    names = probe.spec.weight_hooks
    if not names:
        raise ValueError(f"{probe.name!r} has no depth-weight hook points (hook_weights): its routing has nothing to "
                         "make static (PreNorm's fixed sum is static already)")
    windows = text_windows(probe, texts)
    sums: dict[str, torch.Tensor] = {}
    counts = {n: 0 for n in names}

    def keep(w: torch.Tensor, hook: Any) -> None:
        flat = w.detach().reshape(-1, w.shape[-1]).to(torch.float64)
        sums[hook.name] = sums.get(hook.name, 0) + flat.sum(0)
        counts[hook.name] += flat.shape[0]
        return None

    base = [_loss(probe, t, [(n, keep) for n in names]) for _, t in windows]  # one pass: losses and the means
    means = {n: sums[n] / counts[n] for n in names}

    def fixed(name: str):
        def hook(w: torch.Tensor, hook: Any = None) -> torch.Tensor:
            return means[name].to(w.dtype).to(w.device).expand_as(w).clone()

        return hook

    total = [_loss(probe, t, [(n, fixed(n)) for n in names]) - b for (_, t), b in zip(windows, base)]
    rows = []
    labels = probe.spec.meta.get("read_labels") or [str(r) for r in range(len(names))]
    for r, name in enumerate(names if reads else []):
        delta = [_loss(probe, t, [(name, fixed(name))]) - b for (_, t), b in zip(windows, base)]
        rows.append({"read": r, "label": labels[r] if r < len(labels) else str(r), **_interval(delta)})
    table = pd.DataFrame({"text": [i for i, _ in windows], "window": range(len(windows)),
                          "tokens": [int(t.shape[1]) for _, t in windows], "loss": base, "delta": total})
    return ControlResult("static routing", table, _interval(total), reads=pd.DataFrame(rows) if reads else None, unit=_unit(probe),
                         meta={"means": {n: means[n].tolist() for n in names}})


def mask_sources(probe: Any, texts: Any, which: str = "nonrecent", seed: int | None = None,
                 repeats: int = 5) -> ControlResult:
    """attnres4babylm's masking of depth sources (``which``: ``"nonrecent"``, ``"random"``, ``"embed"``;
    :func:`attnres_probe.masking.masking_plan`), the loss change per window. ``"random"`` draws with seeds
    ``seed``, ``seed + 1``, ... (``repeats`` of them; upstream's first seed by default) and averages;
    ``"nonrecent"`` also gives the contrast nonrecent − random, paired by window.

    Raises:
        ValueError: an unknown ``which``, a rule without softmax depth routing, ``repeats`` < 1.
    """
    from attnres_probe.masking import DEFAULT_SEED, MASKS, masking_hooks

    if which not in MASKS:
        raise ValueError(f"which is {which!r}; accepted: {', '.join(MASKS)}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or not 1 <= repeats <= 100:
        raise ValueError(f"repeats is {repeats!r}; accepted: 1..100 random draws")
    seed = DEFAULT_SEED if seed is None else int(seed)
    model = probe.model
    if not masking_hooks(model, which, seed):  # refuses a rule without softmax routing before any forward
        raise ValueError(f"masking {which!r} drops nothing in this model: no read sees a completed block older than the "
                         f"newest ({model.axis.n_blocks if model.axis.residual == 'block' else model.axis.n_sublayers} "
                         "blocks); the loss change would be 0 by construction")
    windows = text_windows(probe, texts)
    base = [_loss(probe, t) for _, t in windows]

    def deltas(kind: str, s: int) -> list[float]:
        hooks = masking_hooks(model, kind, s)
        return [_loss(probe, t, hooks) - b for (_, t), b in zip(windows, base)]

    seeds = [seed + i for i in range(repeats)]
    randoms = np.mean([deltas("random", s) for s in seeds], axis=0) if which in ("random", "nonrecent") else None
    delta = list(randoms) if which == "random" else deltas(which, seed)
    table = pd.DataFrame({"text": [i for i, _ in windows], "window": range(len(windows)),
                          "tokens": [int(t.shape[1]) for _, t in windows], "loss": base, "delta": delta})
    contrast = None
    if which == "nonrecent":
        table["delta_random"] = randoms
        table["contrast"] = table["delta"] - table["delta_random"]
        contrast = {**_interval(table["contrast"].tolist()), "repeats": repeats}
    return ControlResult(f"mask {which}", table, _interval(delta), contrast=contrast, unit=_unit(probe),
                         meta={"seed": seed, "seeds": seeds if which != "embed" else [seed]})
