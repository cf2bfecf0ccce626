"""Every diagnostic the toolkit compares, defined once.

Each :class:`Diagnostic` says what it measures (the quantity, on which axis and in which unit),
its formula, a plain label and group for pages, the reference it is set against, how (a
difference or a ratio), and the paper's direction only where the paper states one. Everything
that shows or compares a diagnostic reads this table: the per-window implementation
(:mod:`attnres_probe.analysis.windows`), the comparison engine
(:func:`attnres_probe.analysis.compare.compare_windows`, behind ``metrics.compare`` and
``comparison.csv``), the verdicts, the dashboard, the report and the study. Adding a
diagnostic is one entry here and one function in ``windows.py``.

Matched quantities (docs/design.md, "Statistics"): a comparison across models sets the same
quantity, in the same unit, on the same axis.

- **Routing** reads the *normalised weights* w = c / sum(c) of every read on the model's own
  source axis: AttnRes its softmax weights; PreNorm its implied weights, uniform 1/k (every
  consumer of a read is an RMSNorm, so the sum and the uniform mixture are the same input).
  Block is measured in block units; its reference is the uniform weights grouped into the same
  blocks (a block of m sublayers gets m/k). Every routing diagnostic is compared with that
  *uniform reference on the model's own axis*, which is exactly what a PreNorm read gives when
  its sources are grouped as the model groups them: a model forced to route uniformly equals its
  reference and gets no verdict.
- **Shares** (the contribution share of a source, one definition for every model) are compared
  with shares.
- **Magnitudes** are what deeper layers *write*: the RMS of the sublayer outputs v_j for every
  model; and what a read *sees*: the mixture h_r / sum(c) (PreNorm's sum divided by k).
- **Gradients** are taken at every sublayer output, ||dL/dv_j|| (``grad_out``), for every model,
  and per transformer block for the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CATALOG", "COMPUTE", "GROUPS", "Diagnostic", "LiveList", "LiveMapping", "diagnostic", "names", "register",
    "routing_names", "unregister",
]

UNIFORM, BASELINE = "uniform", "baseline"


@dataclass(frozen=True)
class Diagnostic:
    """One diagnostic (see the module docstring).

    Attributes:
        name: its key in every frame and file.
        group: "routing", "embedding", "magnitude", "gradients" or "loss".
        label: plain words for a page.
        quantity: what is measured, on which axis.
        unit: the unit of one value.
        formula: how one window's value is computed (the pooled value is the same function over
            every token).
        reference: ``"uniform"`` (the model's own uniform weights on its own source axis) or
            ``"baseline"`` (the baseline model's value of the same quantity).
        compare: ``"difference"`` (model - reference) or ``"ratio"`` (model / reference).
        direction: ``"lower"`` / ``"higher"`` where the paper states where AttnRes falls against
            the reference; None where it states nothing (no verdict is given then).
        paper: what the paper reports, quoted from the seed texts (``../shared/seeds``) or its
            figures; "" where it says nothing.
        pooling: how the pooled value (every token of every window together) follows from the
            windows: ``"tokens"`` (a mean over tokens: the windows' values weighted by their
            tokens), ``"targets"`` (weighted by their tokens with a next token), or ``"profile"``
            (the same function of the depth profiles averaged over every token).
        headline: shown in the headline panel of every page.
    """

    name: str
    group: str
    label: str
    quantity: str
    unit: str
    formula: str
    reference: Literal["uniform", "baseline"]
    compare: Literal["difference", "ratio"]
    direction: Literal["lower", "higher"] | None
    paper: str
    headline: bool = False
    pooling: Literal["tokens", "targets", "profile"] = "profile"


_LOCAL = "\"Mostly local. Layers still leaned hardest on their immediate predecessors.\""
_EMBED = "\"The original embedding retained weight deep into the network.\""
_OUT = ("\"Deeper baseline layers must produce larger outputs to remain influential\"; Block AttnRes \"produced a "
        "bounded, repeating magnitude pattern\".")
_GRAD = ("The baseline's \"earliest layers took disproportionately large gradients\"; Block AttnRes \"spread "
         "gradients more uniformly\" (the paper's gradient figure: per transformer block).")
_LOSS = "AttnRes reaches a lower loss than a PreNorm baseline of the same size and recipe."
_AXIS = "normalised weights on the model's own source axis (Block: blocks)"
# the unit of a normalised weight: a fraction of the read, 0..1 for AttnRes's and PreNorm's; another
# rule's normalised coefficients c/sum(c) may be negative or above one (they still sum to one)
_SHARE = "fraction of the read (0-1; c/Σc may leave it)"
_SHARE_DIFF = "fraction of the read (-1 to 1; c/Σc may leave it)"

GROUPS = ("routing", "embedding", "magnitude", "gradients", "loss")

CATALOG: dict[str, Diagnostic] = {d.name: d for d in (
    Diagnostic(
        "locality_distance", "routing", "mean depth distance E[d]",
        f"expected distance back in depth of a read's {_AXIS}", "sources back (sublayers; blocks for Block)",
        "E[d] = sum_i w_i (k_r - 1 - i), w = c / sum(c) over the k_r sources read r sees (most recent: 0); "
        "mean over tokens, then over reads with k_r >= 2",
        UNIFORM, "difference", "lower", _LOCAL, headline=True, pooling="tokens"),
    Diagnostic(
        "locality_recent_mass", "routing", "weight on the most recent source",
        f"the most recent source's share of a read's {_AXIS}", _SHARE,
        "w_{k_r - 1}; mean over tokens, then over reads with k_r >= 2",
        UNIFORM, "difference", "higher", _LOCAL, headline=True, pooling="tokens"),
    Diagnostic(
        "mean_entropy", "routing", "normalised routing entropy",
        f"entropy of a read's {_AXIS} over log k_r", "fraction of the maximum (0-1)",
        "H(p) / log k_r, H(p) = -sum_i p_i log p_i with p = w (p = |w| / sum|w| where another rule's "
        "normalised coefficients are signed); mean over tokens, then over reads with k_r >= 2",
        UNIFORM, "difference", None, "", pooling="tokens"),
    Diagnostic(
        "embed_weight_deep", "embedding", "embedding weight, deep half",
        f"the embedding's share of the deep reads' {_AXIS}", _SHARE,
        "w_0 at reads r >= floor(R/2); mean over tokens, then over those reads",
        UNIFORM, "difference", "higher", _EMBED + " Read as: more than the uniform share 1/k a PreNorm read gives it.",
        headline=True, pooling="tokens"),
    Diagnostic(
        "embed_vs_old_deep", "embedding", "embedding against other old sources, deep half",
        f"the embedding's weight minus the mean weight of the other non-recent sources, deep reads, {_AXIS}",
        _SHARE_DIFF,
        "w_0 - mean(w_1 .. w_{k_r - 2}) at reads r >= floor(R/2) with k_r >= 3; mean over tokens, then reads",
        UNIFORM, "difference", "higher", _EMBED, pooling="tokens"),
    Diagnostic(
        "embed_weight_deep_attn", "embedding", "embedding weight, deep attention reads",
        f"the embedding's share of the deep reads before attention, {_AXIS}", _SHARE,
        "w_0 at reads r >= floor(R/2) that feed an attention sublayer; mean over tokens, then over those reads",
        UNIFORM, "difference", None, "", pooling="tokens"),
    Diagnostic(
        "embed_weight_deep_mlp", "embedding", "embedding weight, deep MLP reads",
        f"the embedding's share of the deep reads before the MLP, {_AXIS}", _SHARE,
        "w_0 at reads r >= floor(R/2) that feed an MLP sublayer; mean over tokens, then over those reads",
        UNIFORM, "difference", None, "", pooling="tokens"),
    Diagnostic(
        "embed_contrib_deep", "embedding", "embedding share c₀, deep half",
        "the embedding's contribution share of the deep reads' input (the same definition for every model)",
        "fraction of ‖h‖²", "c_0 = <c_0 v_0, h> / ‖h‖² at reads r >= floor(R/2); mean over tokens, then reads",
        BASELINE, "difference", "higher", _EMBED + " Under PreNorm the embedding is diluted in a growing sum.", pooling="tokens"),
    Diagnostic(
        "rms_out_growth", "magnitude", "sublayer-output RMS, last/first quarter",
        "RMS of what each sublayer writes, v_j, over depth", "ratio (dimensionless)",
        "mean of o_j over the last quarter of sublayers / mean over the first quarter, o_j = mean over tokens "
        "of rms(v_j)",
        BASELINE, "ratio", "lower", _OUT, headline=True),
    Diagnostic(
        "rms_out_log_slope", "magnitude", "slope of log sublayer-output RMS",
        "RMS of what each sublayer writes, v_j, over depth", "natural log per sublayer",
        "least-squares slope of log o_j against j = 1 .. L",
        BASELINE, "difference", "lower", _OUT),
    Diagnostic(
        "rms_mix_growth", "magnitude", "read-mixture RMS, last/first quarter",
        "RMS of what each read sees as a mixture, h_r / sum(c) (PreNorm: its sum over k)", "ratio (dimensionless)",
        "mean of m_r over the last quarter of sublayer reads / mean over the first quarter, m_r = mean over "
        "tokens of rms(h_r) / sum_i c_i",
        BASELINE, "ratio", None, ""),
    Diagnostic(
        "act_grad_cv", "gradients", "CV of ||dL/dv|| over sublayer outputs",
        "the gradient at each sublayer output v_j (through every read of it; PreNorm: the residual-stream gradient)",
        "coefficient of variation (dimensionless)",
        "std/mean over j = 1 .. L of g_j = mean over tokens of ||dL/dv_j||",
        BASELINE, "ratio", "lower", _GRAD, headline=True),
    Diagnostic(
        "act_grad_max_min", "gradients", "max/min of ||dL/dv|| over sublayer outputs",
        "the gradient at each sublayer output v_j", "ratio (dimensionless)", "max_j g_j / min_j g_j",
        BASELINE, "ratio", "lower", _GRAD),
    Diagnostic(
        "act_grad_early_late", "gradients", "||dL/dv||, first/last quarter",
        "the gradient at each sublayer output v_j", "ratio (dimensionless)",
        "mean of g_j over the first quarter of sublayers / mean over the last quarter",
        BASELINE, "ratio", "lower", _GRAD),
    Diagnostic(
        "param_grad_cv", "gradients", "CV of parameter-gradient norms per transformer block",
        "the norm of each transformer block's parameter gradient (attention and MLP together)",
        "coefficient of variation (dimensionless)",
        "std/mean over blocks i of sqrt(|dL/dθ_attn,i|^2 + |dL/dθ_mlp,i|^2)",
        BASELINE, "ratio", "lower", _GRAD, headline=True),
    Diagnostic(
        "param_grad_max_min", "gradients", "max/min of parameter-gradient norms per transformer block",
        "the norm of each transformer block's parameter gradient", "ratio (dimensionless)",
        "max_i / min_i of the per-block parameter-gradient norms",
        BASELINE, "ratio", "lower", _GRAD),
    Diagnostic(
        "param_grad_attn_cv", "gradients", "CV of attention parameter-gradient norms",
        "the norm of each attention sublayer's parameter gradient", "coefficient of variation (dimensionless)",
        "std/mean over layers of |dL/dθ_attn,i|",
        BASELINE, "ratio", None, ""),
    Diagnostic(
        "param_grad_mlp_cv", "gradients", "CV of MLP parameter-gradient norms",
        "the norm of each MLP sublayer's parameter gradient", "coefficient of variation (dimensionless)",
        "std/mean over layers of |dL/dθ_mlp,i|",
        BASELINE, "ratio", None, ""),
    Diagnostic(
        "mean_loss", "loss", "next-token loss", "next-token cross-entropy", "nats per token",
        "mean over tokens with a target of -log p(next token)",
        BASELINE, "difference", "lower", _LOSS, headline=True, pooling="targets"),
)}


def names() -> tuple[str, ...]:
    """Every diagnostic's name, in display order."""
    return tuple(CATALOG)


def routing_names() -> tuple[str, ...]:
    """The diagnostics compared with the uniform reference on the model's own axis."""
    return tuple(n for n, d in CATALOG.items() if d.reference == UNIFORM)


def diagnostic(name: str) -> Diagnostic:
    """The catalog entry ``name``.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a diagnostic; the catalog holds {', '.join(CATALOG)}") from None


# diagnostics added with register: name -> fn(w, ctx) giving a value per token [B, P] from the
# normalised weights w [B, P, R, S] (the model's, or for the reference column the uniform ones)
COMPUTE: dict[str, Callable[..., Any]] = {}


class LiveList(Sequence):
    """A read-only list built from the catalog each time it is read.

    The tables derived from the catalog (window columns, findings) are views of this kind, so a
    diagnostic added with :func:`register` appears in every one of them, and the catalog needs to
    know none of the modules that derive them (imports point one way: they read the catalog).
    """

    def __init__(self, build: Callable[[], list]):
        self._build = build

    def __getitem__(self, i):
        return self._build()[i]

    def __len__(self) -> int:
        return len(self._build())

    def __iter__(self) -> Iterator:
        return iter(self._build())

    def __add__(self, other) -> list:
        return [*self, *other]

    def __radd__(self, other) -> list:
        return [*other, *self]

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, LiveList)) else NotImplemented

    def __repr__(self) -> str:
        return repr(self._build())


class LiveMapping(Mapping):
    """A read-only dict built from the catalog each time it is read (see :class:`LiveList`)."""

    def __init__(self, build: Callable[[], dict]):
        self._build = build

    def __getitem__(self, key):
        return self._build()[key]

    def __len__(self) -> int:
        return len(self._build())

    def __iter__(self) -> Iterator:
        return iter(self._build())

    def __repr__(self) -> str:
        return repr(self._build())


def register(d: Diagnostic, compute) -> None:
    """Add a diagnostic: its catalog entry and its function, and it appears everywhere (the window
    tables, ``metrics.compare`` and ``comparison.csv``, the dashboard, the report, verdicts, the study).

    Args:
        d: the entry (``pooling`` must be ``"tokens"``: its value is a mean over tokens).
        compute: ``fn(w, ctx) -> [B, P]`` the value at each token from the normalised weights
            ``w`` [B, P, R, S] (NaN where a read cannot see a source; for a uniform-referenced
            diagnostic it is called again with the uniform weights), ``ctx`` holding ``trace``,
            ``mask`` and the trace's ``arrays``.

    Raises:
        ValueError: the name is taken, or the pooling is not over tokens.
    """
    if d.name in CATALOG:
        raise ValueError(f"{d.name!r} is already a diagnostic; choose another name")
    if d.pooling != "tokens":
        raise ValueError(f"a registered diagnostic is a mean over tokens (pooling='tokens'); got {d.pooling!r}")
    if d.group not in GROUPS:
        raise ValueError(f"group {d.group!r} is not one of {', '.join(GROUPS)}")
    CATALOG[d.name] = d
    COMPUTE[d.name] = compute


def unregister(name: str) -> None:
    """Remove a diagnostic added with :func:`register` (the built-in ones stay)."""
    if name not in COMPUTE:
        raise ValueError(f"{name!r} was not added with register(); built-in diagnostics cannot be removed")
    del CATALOG[name]
    del COMPUTE[name]
