"""Routing patching: does a read's routing matter for a behaviour? (issue #34, item 5)

Activation patching (as TransformerLens's ``patching`` does for the residual stream) applied to
the depth weights of an AttnRes model. A *clean* and a *corrupted* prompt of the same token
length run through the model; one read's depth weights from the clean run are written into the
corrupted run through the read's ``hook_weights``, and the fraction of a metric recovered is

    recovered = (m_patched - m_corrupted) / (m_clean - m_corrupted)

0: the patched routing changes nothing; 1: it alone turns the corrupted behaviour into the clean
one (it can be negative or above one).

**The metric.** Default: the logit difference at ``position`` between the clean run's and the
corrupted run's predicted next tokens, ``logits[position, clean_top] - logits[position,
corrupted_top]``, where ``clean_top`` and ``corrupted_top`` are the argmax next tokens of the two
runs there (TransformerLens's "correct minus wrong answer", with each prompt's own prediction as
its answer). ``position=None`` (default) picks the **last position where the two runs' top
predictions differ**: two prompts that differ in a middle word often predict the same next token
at the end (on the byte-level demo models, usually the same next byte), where the metric would be
identically 0. The chosen position is in ``attrs["position"]`` (``attrs["position_auto"]`` True)
and in the figures' titles. When no position differs, or an explicit ``position`` has the same
prediction in both runs, :func:`patch` raises :class:`SamePrediction` (a ValueError naming what
each run predicts and the positions where they differ). A user metric is any callable
``logits [pos, d_vocab] -> scalar`` (a tensor of one element or a float), called on one run's
logits at every position; ``position`` then only matters to the default metric.

**The denominator.** ``m_clean - m_corrupted`` is set against the float32 roundoff of the metric
(:func:`metric_roundoff`): where it is no larger than twice that bound the two runs are
indistinguishable, every ``recovered`` is NaN and a :class:`RuntimeWarning` says why
(``metric_patched`` is still reported). With the default metric the denominator is positive
(``clean_top`` is the clean argmax, ``corrupted_top`` the corrupted one), so this happens only
for ties or user metrics.

**What is patched** (``what``):

- ``"weights"``: read r's depth weights, the ``k`` columns it sees (:meth:`SourceAxis.columns
  <attnres_probe.axis.SourceAxis.columns>`), set to the clean run's; the *sources* stay the
  corrupted run's, so the read mixes the corrupted sources with the clean routing. The columns a
  read cannot see are never touched (whether the model marks them NaN or 0).
- ``"input"``: read r's whole mixed input (its weights and its sources: ``hook_resid_pre``,
  ``hook_resid_mid`` or ``hook_resid_final``), as TransformerLens's residual-stream patching.
  This is the honest "everything": patching every read's weights alone does *not* make the
  corrupted run clean, because the sources it mixes are still the corrupted run's.

**Per source** (``per_source=True``, weights only): source s's weight at read r is set to its
clean value and the read's other weights are kept **as given** (the corrupted run's). The row
then need not sum to one, and the mixer uses it as given (:meth:`DepthMixer.observe
<attnres_probe.model.DepthMixer.observe>`: weights a hook returns are not renormalised). This is
chosen over patching the source's logit and letting the softmax renormalise because the mixture
is linear in the weights: the per-source patch changes the read's input by exactly
``(a_clean_s - a_corrupt_s) v_s``, one source's term and nothing else, and the per-source patches
of a read compose: patching all of read r's sources jointly *is* the per-read patch (the same
weight tensor, bit for bit; a test checks it). A patched logit would move every other weight of
the read through the shared normaliser, so a cell would mix the effect of s with those of the
others and the cells would not add up to the row.

**Positions.** ``positions=None`` patches every position (default); a list of positions patches
only those (the model is causal: a patch after the metric's position changes nothing).

**Sanity checks** (tests/test_patching.py, on the demo models; "exactly" means within
:func:`metric_roundoff`'s bound, the frame's ``attrs["tolerance"]``):

- patching nothing (``positions=[]``) recovers 0, and patching the corrupted run's own weights
  into itself (:func:`patched_metrics` with the corrupted run as donor) recovers 0;
- patching the final read's whole input (``what="input", reads=["final"]``) recovers 1, and so
  does patching every read's input together (``what="input", joint=True``: weights and sources).

**Speed.** One batched forward runs up to ``batch_size`` patched runs (the batch dimension is the
patch index; each row's hooks edit that row only).

PreNorm has no depth weights (every read is the plain sum of earlier sources, coefficient 1):
:func:`patch` refuses it and points to TransformerLens's residual patching.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

__all__ = [
    "C_ROUNDOFF",
    "Donor",
    "Patch",
    "SamePrediction",
    "WHATS",
    "logit_difference",
    "metric_roundoff",
    "patch",
    "patched_metrics",
    "patching_bars",
    "patching_heatmap",
    "record_donor",
]

WHATS = ("weights", "input")
# The constant of the first-order roundoff bound C u G of a whole model's float32 logits
# (docs/design.md, "Kernels and backends"; tests/kernels/closeness.py uses the same C = 8).
C_ROUNDOFF = 8.0
FRAME_COLUMNS = ["read", "read_label", "source", "source_label", "what", "metric_patched", "recovered",
                 "metric_clean", "metric_corrupted"]
UNIT = "fraction of the metric recovered"


@dataclass(frozen=True)
class Patch:
    """One intervention inside a patched run.

    Attributes:
        read: the read index (0..L; L is the final read).
        what: ``"weights"`` (the read's depth weights) or ``"input"`` (its whole mixed input).
        columns: ``"weights"`` only: the source columns to patch (None: every column the read
            sees); columns the read cannot see are refused.
        positions: the positions to patch (None: all).
    """

    read: int
    what: str = "weights"
    columns: tuple[int, ...] | None = None
    positions: tuple[int, ...] | None = None


@dataclass
class Donor:
    """What a patch copies from: one run's logits [pos, vocab], and per read its depth weights
    [pos, k] (the k columns it sees) and its mixed input [pos, d_model]."""

    tokens: torch.Tensor
    logits: torch.Tensor
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)


class SamePrediction(ValueError):
    """The default metric is identically 0: the clean and corrupted runs predict the same next token at
    the metric's position (an explicit ``position``), or at every position (``position=None``).

    Attributes:
        position: the position asked for (0..n-1), or None when it was to be picked.
        token, token_text: what both runs predict there (at the last position when none was asked
            for); ``token_text`` None without a tokenizer.
        differ: the positions where the two runs' predictions differ (may be empty).
        n_tokens: the prompts' token length.
    """

    def __init__(self, message: str, *, position: int | None, token: int, token_text: str | None,
                 differ: Sequence[int], n_tokens: int) -> None:
        super().__init__(message)
        self.position, self.token, self.token_text = position, token, token_text
        self.differ, self.n_tokens = list(differ), n_tokens


# -- checks -----------------------------------------------------------------------------------
def _check_attnres(probe: Any) -> None:
    spec = probe.spec
    if spec.residual == "prenorm" or not spec.weight_hooks:
        raise ValueError(
            f"{probe.name!r} is a PreNorm model: its routing is fixed (every read is the plain sum of the earlier "
            "sources, each with coefficient 1), so it has no depth weights to patch. Routing patching needs a model with "
            "depth weights (Full or Block AttnRes, Hyper-Connections, DenseFormer); for PreNorm, patch the residual stream itself "
            "(TransformerLens's patching module)"
        )


def _one_sequence(probe: Any, text_or_tokens: Any, which: str, truncate: bool) -> torch.Tensor:
    tokens, _ = probe.tokenize(text_or_tokens, truncate=truncate)
    if tokens.shape[0] != 1:
        raise ValueError(f"the {which} prompt is a batch of {tokens.shape[0]} sequences; pass one sequence")
    return tokens


def _positions(positions: Any, n: int) -> tuple[int, ...] | None:
    """None, or sorted distinct positions in 0..n-1 (negative ones count from the end)."""
    if positions is None:
        return None
    items = [positions] if isinstance(positions, (int, np.integer)) else list(positions)
    out = set()
    for p in items:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not -n <= int(p) < n:
            raise ValueError(f"position {p!r} is out of range; the prompts have {n} tokens (positions 0..{n - 1}, "
                             "or negative from the end)")
        out.add(int(p) % n)
    return tuple(sorted(out))


def _reads(reads: Any, labels: Sequence[str]) -> list[int]:
    if reads is None:
        return list(range(len(labels)))
    items = [reads] if isinstance(reads, (str, int, np.integer)) else list(reads)
    out: list[int] = []
    for item in items:
        if isinstance(item, str):
            if item not in labels:
                raise ValueError(f"read {item!r} is not one of {list(labels)}")
            r = list(labels).index(item)
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool) and -len(labels) <= item < len(labels):
            r = int(item) % len(labels)
        else:
            raise ValueError(f"read {item!r} is out of range; reads are 0..{len(labels) - 1} or labels {list(labels)}")
        if r not in out:
            out.append(r)
    return out


def _check_patch(p: Patch, counts: Sequence[int], n_pos: int, labels: Sequence[str]) -> None:
    if p.what not in WHATS:
        raise ValueError(f"what is {p.what!r}; accepted values are {', '.join(WHATS)}")
    if not 0 <= p.read < len(counts):
        raise ValueError(f"read {p.read} is out of range; reads are 0..{len(counts) - 1}")
    if p.columns is not None:
        if p.what != "weights":
            raise ValueError("columns apply to what='weights' only; what='input' patches the whole mixed input")
        k = counts[p.read]
        bad = [c for c in p.columns if not 0 <= c < k]
        if bad:
            raise ValueError(f"read {labels[p.read]!r} sees columns 0..{k - 1}; columns {bad} are not among them")
    if p.positions is not None and any(not 0 <= q < n_pos for q in p.positions):
        raise ValueError(f"positions {list(p.positions)} are not all in 0..{n_pos - 1}")


# -- hooks ------------------------------------------------------------------------------------
def _attach(model: Any, plan: list[tuple[str, Callable]]) -> list:
    handles = []
    try:
        for name, fn in plan:
            hp = model.hook_dict[name]
            handles.append((hp, hp.add_hook(fn, dir="fwd")))
    except BaseException:
        _detach(handles)
        raise
    return handles


def _detach(handles: list) -> None:
    for hp, handle in handles:
        handle.hook.remove()
        if handle in hp.fwd_hooks:
            hp.fwd_hooks.remove(handle)


def _forward(probe: Any, tokens: torch.Tensor, plan: list[tuple[str, Callable]]) -> torch.Tensor:
    """Logits [batch, pos, vocab] of one forward with the hooks of ``plan`` attached (no grad)."""
    import warnings

    from attnres_probe.layers import WeightSumWarning

    handles = _attach(probe.model, plan)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", WeightSumWarning)  # per-source patches need not sum to one, on purpose
            return probe.logits(tokens).detach()
    finally:
        _detach(handles)


def record_donor(probe: Any, text_or_tokens: Any, truncate: bool = False) -> Donor:
    """Run one prompt and keep what a patch copies: every read's depth weights (the columns it sees)
    and mixed input, and the logits. Hooks act only on this thread's forward (as the probe's)."""
    _check_attnres(probe)
    tokens = _one_sequence(probe, text_or_tokens, "donor", truncate)
    spec, owner = probe.spec, threading.get_ident()
    counts = spec.axis.counts
    donor = Donor(tokens=tokens, logits=torch.empty(0))

    def keep_weights(r: int):
        def hook(w: torch.Tensor, hook: Any = None) -> None:
            if threading.get_ident() == owner:
                donor.weights[r] = w[0, :, : counts[r]].detach().clone()

        return hook

    def keep_input(r: int):
        def hook(h: torch.Tensor, hook: Any = None) -> None:
            if threading.get_ident() == owner:
                donor.inputs[r] = h[0].detach().clone()

        return hook

    plan = [(name, keep_weights(r)) for r, name in enumerate(spec.weight_hooks)]
    plan += [(name, keep_input(r)) for r, name in enumerate(spec.read_hooks) if name is not None]
    donor.logits = _forward(probe, tokens, plan)[0]
    return donor


def _chunk_plan(runs: Sequence[Sequence[Patch]], donor: Donor, n_pos: int, counts: Sequence[int], spec: Any,
                device: torch.device) -> list[tuple[str, Callable]]:
    """The hooks of one batched forward: row i of the batch carries run i's patches."""
    n = len(runs)
    w_masks: dict[int, torch.Tensor] = {}
    h_masks: dict[int, torch.Tensor] = {}
    for i, run in enumerate(runs):
        for p in run:
            pos = torch.zeros(n_pos, dtype=torch.bool)
            pos[list(p.positions) if p.positions is not None else slice(None)] = True
            if not pos.any():
                continue  # nothing to patch: no hook, the read computes as it would
            if p.what == "weights":
                k = counts[p.read]
                cols = torch.zeros(k, dtype=torch.bool)
                cols[list(p.columns) if p.columns is not None else slice(None)] = True
                m = w_masks.setdefault(p.read, torch.zeros(n, n_pos, k, dtype=torch.bool))
                m[i] |= pos[:, None] & cols[None, :]
            else:
                m = h_masks.setdefault(p.read, torch.zeros(n, n_pos, 1, dtype=torch.bool))
                m[i] |= pos[:, None]
    owner = threading.get_ident()

    def set_weights(mask: torch.Tensor, clean: torch.Tensor):
        k = mask.shape[-1]

        def hook(w: torch.Tensor, hook: Any = None) -> torch.Tensor | None:
            if threading.get_ident() != owner:
                return None  # another thread's forward through the same model: left as it is
            out = w.clone()
            out[..., :k] = torch.where(mask, clean.to(w.dtype), w[..., :k])  # only the columns the read sees
            return out

        return hook

    def set_input(mask: torch.Tensor, clean: torch.Tensor):
        def hook(h: torch.Tensor, hook: Any = None) -> torch.Tensor | None:
            if threading.get_ident() != owner:
                return None
            return torch.where(mask, clean.to(h.dtype), h)

        return hook

    plan: list[tuple[str, Callable]] = []
    for r, m in w_masks.items():
        plan.append((spec.weight_hooks[r], set_weights(m.to(device), donor.weights[r].unsqueeze(0))))
    for r, m in h_masks.items():
        if spec.read_hooks[r] is None:
            raise ValueError(f"read {spec.read_labels[r]!r} has no mixed-input hook point to patch")
        plan.append((spec.read_hooks[r], set_input(m.to(device), donor.inputs[r].unsqueeze(0))))
    return plan


def patched_metrics(
    probe: Any,
    corrupted: torch.Tensor,
    donor: Donor,
    runs: Sequence[Sequence[Patch]],
    metric: Callable[[torch.Tensor], Any],
    batch_size: int = 32,
) -> np.ndarray:
    """The metric of each patched run: run i is the corrupted tokens [1, pos] with every patch of
    ``runs[i]`` applied together, copying from ``donor`` (:func:`record_donor`). The runs go
    ``batch_size`` at a time through one batched forward (the batch dimension is the run).

    Returns:
        float64 array [len(runs)].
    """
    _check_attnres(probe)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
    spec = probe.spec
    counts, n_pos = spec.axis.counts, int(corrupted.shape[1])
    if tuple(donor.tokens.shape) != tuple(corrupted.shape):
        raise ValueError(f"the donor run has {donor.tokens.shape[1]} tokens and the patched run {n_pos}; "
                         "patching needs prompts of the same token length")
    for run in runs:
        for p in run:
            _check_patch(p, counts, n_pos, spec.read_labels)
    out = np.empty(len(runs), dtype=np.float64)
    for start in range(0, len(runs), batch_size):
        chunk = runs[start: start + batch_size]
        plan = _chunk_plan(chunk, donor, n_pos, counts, spec, corrupted.device)
        logits = _forward(probe, corrupted.expand(len(chunk), n_pos), plan)
        for i in range(len(chunk)):
            out[start + i] = _scalar(metric(logits[i]))
    return out


def _scalar(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"the metric returned a tensor of shape {tuple(value.shape)}; it must return a scalar")
        return float(value.detach().double().item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"the metric returned {type(value).__name__}; it must return a scalar (tensor or float)") from None


# -- the metric and its roundoff ---------------------------------------------------------------
def logit_difference(position: int, clean_top: int, corrupted_top: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The default metric: ``logits[position, clean_top] - logits[position, corrupted_top]``
    of one run's logits [pos, vocab]."""

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[position, clean_top] - logits[position, corrupted_top]

    metric.__name__ = "logit_difference"
    return metric


def metric_roundoff(probe: Any, scale: float, n_terms: int = 1) -> float:
    """A bound on the float32 roundoff of a metric computed from one forward's logits.

    A whole model's float32 logits carry a relative error of at most ``C u G`` against exact
    arithmetic (docs/design.md, "Kernels and backends"; the bound the model tests hold every
    backend to): ``u`` the unit roundoff of the logits' dtype (2^-24 for float32), ``G = (L+1)
    (sqrt(d_model) + n_sources)`` (each of the L+1 reads adds one depth attention's ``sqrt(d) +
    S``, and its sublayer rounding of the same order) and ``C = 8`` (:data:`C_ROUNDOFF`). Taken
    per logit, with the largest logit magnitude as the scale, a metric that adds ``n_terms``
    logits with coefficients +-1 is off by at most ``n_terms * C u G * scale``: the default
    logit difference has ``n_terms = 2`` and ``scale = max |logits|`` at its position. For a user
    metric the metric's own magnitude stands in for the scale (an assumption: a metric that
    magnifies logit differences, such as a probability ratio, needs its own tolerance).

    Two runs that should agree (a patch of nothing against the corrupted run, a patch of
    everything against the clean run) differ by at most twice this; the fraction recovered is
    therefore exact within ``2 * metric_roundoff / |m_clean - m_corrupted|`` (``attrs["tolerance"]``).
    """
    axis = probe.spec.axis
    d = int(probe.model.cfg.d_model)
    dtype = next(probe.model.parameters()).dtype
    u = torch.finfo(dtype).eps / 2
    growth = axis.n_reads * (math.sqrt(d) + axis.n_sources)
    return n_terms * C_ROUNDOFF * u * growth * float(scale)


# -- the public function ----------------------------------------------------------------------
def patch(
    probe: Any,
    clean: Any,
    corrupted: Any,
    metric: Callable[[torch.Tensor], Any] | None = None,
    *,
    position: int | None = None,
    reads: Any = None,
    per_source: bool = False,
    what: str = "weights",
    positions: Any = None,
    joint: bool = False,
    batch_size: int = 32,
    truncate: bool = False,
) -> pd.DataFrame:
    """Patch routing from a clean run into a corrupted run and measure the fraction of the metric recovered.

    See the module docstring for the conventions (metric, denominator, per-source weights as given,
    sanity checks).

    Args:
        probe: a :class:`~attnres_probe.Probe` on a model with depth weights (Full or Block AttnRes,
            Hyper-Connections, DenseFormer).
        clean, corrupted: the two prompts (texts or token ids of one sequence), of the same token length.
        metric: ``logits [pos, d_vocab] -> scalar``; default the logit difference of the two runs'
            predicted next tokens at ``position`` (:func:`logit_difference`).
        position: the position of the default metric (negative counts from the end). Default None:
            with the default metric, the last position where the two runs' predicted next tokens
            differ (``attrs["position_auto"]`` True); with a user metric, unused.
        reads: read labels or indices to patch (default: every read, "final" included).
        per_source: one patch per read and source (``what="weights"`` only): that source's clean
            weight, the read's other weights kept as given.
        what: ``"weights"`` (the read's depth weights) or ``"input"`` (its whole mixed input:
            weights and sources).
        positions: the positions to patch (default: all); an empty list patches nothing.
        joint: one patched run with every selected patch applied together (one row,
            ``read_label`` "joint"), instead of one run per patch.
        batch_size: patched runs per batched forward.
        truncate: keep the first n_ctx tokens of longer prompts.

    Returns:
        A tidy DataFrame, one row per patched run, with columns ``read`` (index; <NA> for a joint
        run), ``read_label``, ``source`` (column index; <NA> when the whole row or input is
        patched), ``source_label`` ("all" then), ``what``, ``metric_patched``, ``recovered``,
        ``metric_clean``, ``metric_corrupted``. ``attrs`` holds ``metric_clean``,
        ``metric_corrupted``, ``denominator``, ``tolerance`` (the bound on |recovered - exact|
        from float32 roundoff, :func:`metric_roundoff`), ``metric`` (its name), ``position`` (the
        default metric's position, 0..n-1; None for a user metric without one), ``position_auto``
        (True when it was picked), ``differ`` (the positions where the two runs' predictions differ),
        ``clean_top``/``corrupted_top`` (ids and, with a tokenizer, ``*_text``), ``clean_text`` /
        ``corrupted_text`` (the prompts; None without a tokenizer for token ids), ``positions``,
        ``read_labels``, ``source_labels``, ``counts`` (sources each read sees), ``name``,
        ``n_tokens``, ``what``, ``per_source``, ``joint``.

    Raises:
        ValueError: a PreNorm model; prompts of different token lengths (both lengths named), or
            not one sequence each; an unknown ``what``, read or position; ``per_source`` with
            ``what="input"``. :class:`SamePrediction` (a ValueError) for the default metric when both
            runs predict the same token at ``position``, or at every position when none is given.

    Warns:
        RuntimeWarning: ``|m_clean - m_corrupted|`` is within roundoff (every ``recovered`` NaN).
    """
    _check_attnres(probe)
    spec = probe.spec
    if what not in WHATS:
        raise ValueError(f"what is {what!r}; accepted values are {', '.join(WHATS)}")
    if per_source and what != "weights":
        raise ValueError("per_source patches one source's weight at a read (what='weights'); what='input' patches the "
                         "read's whole mixed input, which has no per-source part")
    if metric is not None and not callable(metric):
        raise TypeError(f"metric must be a callable logits [pos, d_vocab] -> scalar; got {type(metric).__name__}")
    clean_t = _one_sequence(probe, clean, "clean", truncate)
    corrupt_t = _one_sequence(probe, corrupted, "corrupted", truncate)
    n_clean, n_corrupt = int(clean_t.shape[1]), int(corrupt_t.shape[1])
    if n_clean != n_corrupt:
        raise ValueError(f"the clean prompt has {n_clean} tokens and the corrupted prompt {n_corrupt}; routing patching "
                         "needs prompts of the same token length (position by position)")
    n = n_clean
    if position is not None:
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not -n <= int(position) < n:
            raise ValueError(f"position {position!r} is out of range; the prompts have {n} tokens")
        position = int(position) % n
    pos = _positions(positions, n)
    read_ids = _reads(reads, spec.read_labels)
    counts = spec.axis.counts

    donor = record_donor(probe, clean_t)
    corrupt_logits = _forward(probe, corrupt_t, [])[0]
    decode = _decoder(probe)
    clean_pred, corrupt_pred = donor.logits.argmax(-1), corrupt_logits.argmax(-1)
    differ = [int(i) for i in torch.nonzero(clean_pred != corrupt_pred).flatten()]
    attrs: dict[str, Any] = {"position": position, "position_auto": False, "differ": differ,
                             "clean_text": _prompt_text(clean, clean_t, decode),
                             "corrupted_text": _prompt_text(corrupted, corrupt_t, decode)}
    if metric is None:
        if position is None:
            if not differ:
                raise _same_everywhere(int(clean_pred[-1]), n, decode)
            position = differ[-1]
            attrs.update(position=position, position_auto=True)
        clean_top = int(clean_pred[position])
        corrupted_top = int(corrupt_pred[position])
        if clean_top == corrupted_top:
            raise _same_at(position, clean_top, differ, n, decode)
        metric = logit_difference(position, clean_top, corrupted_top)
        attrs.update(clean_top=clean_top, corrupted_top=corrupted_top)
        if decode:
            attrs.update(clean_top_text=decode(clean_top), corrupted_top_text=decode(corrupted_top))
        scale = max(float(donor.logits[position].abs().max()), float(corrupt_logits[position].abs().max()))
        roundoff = metric_roundoff(probe, scale, n_terms=2)
    m_clean, m_corrupt = _scalar(metric(donor.logits)), _scalar(metric(corrupt_logits))
    if "clean_top" not in attrs:
        roundoff = metric_roundoff(probe, max(abs(m_clean), abs(m_corrupt)))
    denominator = m_clean - m_corrupt

    labels = spec.source_labels
    rows: list[dict[str, Any]] = []
    runs: list[list[Patch]] = []
    for r in read_ids:
        if per_source:
            for c in range(counts[r]):
                runs.append([Patch(r, "weights", (c,), pos)])
                rows.append({"read": r, "read_label": spec.read_labels[r], "source": c, "source_label": labels[c]})
        else:
            runs.append([Patch(r, what, None, pos)])
            rows.append({"read": r, "read_label": spec.read_labels[r], "source": None, "source_label": "all"})
    if joint:
        runs = [[p for run in runs for p in run]]
        rows = [{"read": None, "read_label": "joint", "source": None, "source_label": "all"}]
    values = patched_metrics(probe, corrupt_t, donor, runs, metric, batch_size=batch_size)

    indistinct = not abs(denominator) > 2 * roundoff
    if indistinct:
        warnings.warn(
            f"the clean and corrupted metrics differ by {denominator:.3g}, within the float32 roundoff of the metric "
            f"(2 x {roundoff:.3g}): no fraction can be recovered, every 'recovered' is NaN", RuntimeWarning, stacklevel=3
        )
    for row, value in zip(rows, values):
        row.update(what=what, metric_patched=float(value),
                   recovered=float("nan") if indistinct else (float(value) - m_corrupt) / denominator,
                   metric_clean=m_clean, metric_corrupted=m_corrupt)
    frame = pd.DataFrame(rows, columns=FRAME_COLUMNS)
    frame["read"] = frame["read"].astype("Int64")
    frame["source"] = frame["source"].astype("Int64")
    attrs.update(
        metric_clean=m_clean, metric_corrupted=m_corrupt, denominator=denominator,
        tolerance=float("nan") if indistinct else 2 * roundoff / abs(denominator), roundoff=roundoff,
        metric=getattr(metric, "__name__", type(metric).__name__), positions=None if pos is None else list(pos),
        read_labels=list(spec.read_labels), source_labels=list(labels), counts=list(counts), name=probe.name,
        n_tokens=n, what=what, per_source=bool(per_source), joint=bool(joint),
    )
    frame.attrs.update(attrs)
    return frame


def _decoder(probe: Any) -> Callable[[int], str] | None:
    tok = getattr(probe, "tokenizer", None)
    if tok is None or not hasattr(tok, "decode"):
        return None
    return lambda i: str(tok.decode([int(i)]))


def _prompt_text(given: Any, tokens: torch.Tensor, decode: Callable[[int], str] | None) -> str | None:
    """The prompt as text: as given, or decoded token by token (None for token ids without a tokenizer)."""
    if isinstance(given, str):
        return given
    if decode is None:
        return None
    return "".join(decode(int(t)) for t in tokens[0])


def _shown(token: int, decode: Callable[[int], str] | None) -> str:
    return f"token {token} ({decode(token)!r})" if decode else f"token {token}"


def _listed(positions: Sequence[int], most: int = 12) -> str:
    if len(positions) <= most:
        return ", ".join(map(str, positions))
    return f"{len(positions)} positions, the last {most} of them " + ", ".join(map(str, positions[-most:]))


def _same_everywhere(token: int, n: int, decode: Callable[[int], str] | None) -> SamePrediction:
    return SamePrediction(
        f"the clean and corrupted runs predict the same next token at every one of the {n} positions (at the last "
        f"position, {n - 1}, both predict {_shown(token, decode)}), so the default metric logit[clean_top] - "
        "logit[corrupted_top] is identically 0 wherever it is taken. Try prompts that end where the next token "
        "(a byte, on the byte-level demo models) differs, e.g. \"I pray you, sir\" and \"I pray you, lad\", or "
        "pass metric=... (a callable logits [pos, d_vocab] -> scalar)",
        position=None, token=token, token_text=decode(token) if decode else None, differ=[], n_tokens=n)


def _same_at(position: int, token: int, differ: Sequence[int], n: int,
             decode: Callable[[int], str] | None) -> SamePrediction:
    where = (f"the two runs' predictions differ at positions {_listed(differ)} (position=None picks the last of them)"
             if differ else "the two runs' predictions differ at no position")
    return SamePrediction(
        f"the clean and corrupted runs both predict {_shown(token, decode)} at position {position}, so the default "
        f"metric logit[clean_top] - logit[corrupted_top] is identically 0 there; {where}. Choose another position, "
        "prompts whose next tokens differ, or pass metric=...",
        position=position, token=token, token_text=decode(token) if decode else None, differ=differ, n_tokens=n)


# -- figures ----------------------------------------------------------------------------------
def _labels(frame: pd.DataFrame, key: str, given: Sequence[str] | None) -> list[str]:
    if given is not None:
        return list(given)
    if key in frame.attrs:
        return list(frame.attrs[key])
    raise ValueError(f"the frame has no attrs[{key!r}]: pass {key}= (the frame of patch() carries them)")


PROMPT_CHARS = 28  # a prompt in a figure's title is cut to about this many characters


def _short_pair(a: str, b: str, width: int = PROMPT_CHARS) -> tuple[str, str]:
    """Two prompts cut to ``width`` characters each around where they first differ (a few characters
    of context before it), with "…" where text was cut."""
    if len(a) <= width and len(b) <= width:
        return a, b
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, min(first - width // 3, max(len(a), len(b)) - width))

    def cut(t: str) -> str:
        return ("…" if start > 0 else "") + t[start: start + width] + ("…" if start + width < len(t) else "")

    return cut(a), cut(b)


def _context_parts(frame: pd.DataFrame) -> list[str]:
    """Title lines naming the run: the two prompts (shortened) with their predicted tokens, and the
    metric's position (and whether it was picked), from ``frame.attrs``. Escaped for plotly's HTML."""
    import html

    a = frame.attrs
    texts = (a.get("clean_text"), a.get("corrupted_text"))
    if not all(isinstance(t, str) for t in texts):
        texts = (None, None)
    else:
        texts = _short_pair(*texts)
    tops = [a.get(f"{k}_text", a.get(k)) for k in ("clean_top", "corrupted_top")]
    sides = []
    for which, text, top in zip(("clean", "corrupted"), texts, tops):
        side = which + (f" {text!r}" if text is not None else "")
        if top is not None:
            side += f" → {top!r}"
        sides.append(side)
    parts = [" vs ".join(sides)] if any(t is not None for t in (*texts, *tops)) else []
    position = a.get("position")
    if position is not None and "clean_top" in a:
        where = f"next token at position {position}"
        if a.get("position_auto"):
            where += " (picked: the last position where the two predictions differ)"
        parts.append(where)
    elif a.get("metric"):
        parts.append(f"metric: {a['metric']}")
    return [html.escape(p, quote=False) for p in parts]


def patching_heatmap(frame: pd.DataFrame, read_labels: Sequence[str] | None = None,
                     source_labels: Sequence[str] | None = None) -> Any:
    """Reads (y, first at the top) x sources (x): the fraction of the metric recovered by patching one
    source's clean weight at one read (a frame of ``patch(..., per_source=True)``).

    Follows :mod:`attnres_probe.figures`: a diverging scale centred on 0 and symmetric to the largest
    |value| (stated in the title: real per-source effects are often a few tenths or less, which a fixed
    -1..1 scale would leave blank), blank (NaN, no hover) cells for the sources a read cannot see, the
    unit, the two prompts with their predicted tokens and the metric's position in the title.
    """
    import plotly.graph_objects as go

    from attnres_probe import figures

    reads, sources = _labels(frame, "read_labels", read_labels), _labels(frame, "source_labels", source_labels)
    cells = frame[frame["source"].notna() & frame["read"].notna()] if len(frame) else frame
    if len(frame) and cells.empty:
        raise ValueError("this frame has no per-source rows: run patch(..., per_source=True) for the heatmap")
    z = np.full((len(reads), len(sources)), np.nan)
    m = np.full_like(z, np.nan)
    for row in cells.itertuples(index=False):
        z[int(row.read), int(row.source)] = row.recovered
        m[int(row.read), int(row.source)] = row.metric_patched
    finite = np.abs(z[np.isfinite(z)])
    top = float(finite.max()) if finite.size else 0.0
    scale = f"colour scale ±{top:.3g} (the largest |value|; white is 0)" if top > 0 else "every cell is 0"
    top = top if top > 0 else 1.0
    name = frame.attrs.get("name", "")
    parts = [p for p in (name, f"routing patching: one source's clean depth weight at one read · {UNIT}") if p]
    parts += _context_parts(frame) + [scale]
    heat = go.Heatmap(
        z=z, x=sources, y=reads, customdata=m, hoverongaps=False, colorscale=figures.DIVERGING_COLORSCALE,
        zmin=-top, zmax=top, zmid=0.0, colorbar={"title": {"text": UNIT, "side": "right"}},
        hovertemplate="read %{y}<br>source %{x}<br>recovered %{z:.4~g}<br>metric %{customdata:.4~g}<extra></extra>",
    )
    return go.Figure(data=[heat], layout=dict(
        title=figures._title_layout(parts), meta={"title_parts": parts, "unit": UNIT}, margin=figures._title_margin(parts),
        plot_bgcolor="white", height=max(320, 24 * len(reads) + 140 + 20 * len(parts)),
        xaxis={"title": {"text": "source"}, "tickangle": figures.source_tickangle(len(sources)), "showgrid": False},
        yaxis={"title": {"text": "read"}, "autorange": "reversed", "showgrid": False},
    ))


PATCH_COLORS = {"weights": "#1F77B4", "input": "#7F7F7F"}


def patching_bars(frame: pd.DataFrame, *more: pd.DataFrame) -> Any:
    """The fraction of the metric recovered by patching each read (one bar per read; one colour per
    ``what`` when several per-read frames are given, e.g. weights beside whole inputs), with the
    lines 0 (nothing recovered) and 1 (all of it). The title names the two prompts, their predicted
    tokens and the metric's position (from the first frame's ``attrs``)."""
    import plotly.graph_objects as go

    from attnres_probe import figures

    data = []
    reads: list[str] = []
    for f in (frame, *more):
        rows = f[f["source"].isna()] if len(f) else f
        if len(f) and rows.empty:
            raise ValueError("this frame has per-source rows only: run patch(...) without per_source for the per-read bars")
        what = f.attrs.get("what") or (str(rows["what"].iloc[0]) if len(rows) else "weights")
        label = {"weights": "depth weights (clean routing, corrupted sources)",
                 "input": "whole input (weights and sources)"}.get(what, what)
        x = [str(v) for v in rows["read_label"]]
        reads += [r for r in x if r not in reads]
        data.append(go.Bar(x=x, y=rows["recovered"].to_numpy(float), name=label, marker_color=PATCH_COLORS.get(what),
                           customdata=rows["metric_patched"].to_numpy(float),
                           hovertemplate=f"read %{{x}}<br>{label}<br>recovered %{{y:.4~g}}<br>metric %{{customdata:.4~g}}"
                                         "<extra></extra>"))
    name = frame.attrs.get("name", "")
    parts = [" · ".join(p for p in (name, f"routing patching per read: {UNIT}") if p)] + _context_parts(frame)
    lines = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": v, "y1": v,
              "line": {"color": "#999" if v == 0 else "black", "width": 1, "dash": "solid" if v == 0 else "dash"}}
             for v in (0.0, 1.0)]
    return go.Figure(data=data, layout=dict(
        title=figures._title_layout(parts), margin=figures._title_margin(parts), barmode="group", shapes=lines,
        height=400 + figures.TITLE_LINE_PX * len(parts), plot_bgcolor="white", meta={"title_parts": parts, "unit": UNIT},
        xaxis={"title": {"text": "read"}, "categoryorder": "array", "categoryarray": reads, "tickangle": -45},
        yaxis={"title": {"text": "recovered"}, "zeroline": False, "tickformat": ".2~f"},
        legend={"orientation": "h", "y": -0.3},
    ))

