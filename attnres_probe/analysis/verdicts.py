"""The paper's expected directions and the one function that turns an interval into a verdict.

Every AttnRes-vs-baseline comparison (and every study finding) has an expected direction taken
from the paper (Kimi Team, "Attention Residuals", arXiv 2603.15031): the model's value should be
lower (or higher) than the reference. Given the comparison's confidence interval:

- ``"consistent"``: the interval excludes "no difference" (0 for a difference, 1 for a ratio,
  or the reference value) on the paper's side;
- ``"contrary"``: it excludes it on the other side;
- ``"inconclusive"``: it contains it, touches it, or there is no interval (fewer than two
  windows, values missing).

:func:`verdict` is the only place this decision is made: ``metrics.compare``, the dashboard,
the report and the study all show its output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["EXPECTED", "VERDICTS", "Expectation", "comparison_kind", "no_difference", "verdict"]

VERDICTS = ("consistent", "contrary", "inconclusive")
Direction = Literal["lower", "higher"]


@dataclass(frozen=True)
class Expectation:
    """What the paper reports for one metric, AttnRes against the PreNorm baseline.

    Attributes:
        direction: ``"lower"`` or ``"higher"``: where the paper puts AttnRes relative to PreNorm.
        kind: how the two are compared: ``"ratio"`` (model / baseline; for spreads, growths and
            peaks) or ``"difference"`` (model − baseline).
        claim: the paper's statement, in words (shown beside the verdict).
    """

    direction: Direction
    kind: Literal["ratio", "difference"]
    claim: str


_LOCAL = "The paper reports mostly local depth weights: each read puts most of its weight on the nearest sources."
_EMBED = ("The paper reports that AttnRes keeps the embedding within reach of deep layers, where PreNorm dilutes it "
          "in a growing sum.")
_SHARP = ("The paper's depth-weight maps concentrate on a few sources (nearest ones and the embedding); entropy is "
          "this toolkit's measure of that, not a number the paper reports.")
_GRAD = ("The paper reports that AttnRes spreads gradient norms more evenly over depth than PreNorm, whose earliest "
         "layers get the largest gradients.")
_MAG = ("The paper reports that PreNorm's hidden-state magnitude grows with depth while AttnRes keeps it bounded.")
_LOSS = "The paper reports lower loss for AttnRes than for a PreNorm baseline of the same size."

EXPECTED: dict[str, Expectation] = {
    "locality_distance": Expectation("lower", "difference", _LOCAL),
    "locality_recent_mass": Expectation("higher", "difference", _LOCAL),
    "embed_contrib_deep": Expectation("higher", "difference", _EMBED),
    "mean_entropy": Expectation("lower", "difference", _SHARP),
    "act_grad_cv": Expectation("lower", "ratio", _GRAD),
    "act_grad_max_min": Expectation("lower", "ratio", _GRAD),
    "param_grad_cv": Expectation("lower", "ratio", _GRAD),
    "param_grad_max_min": Expectation("lower", "ratio", _GRAD),
    "rms_in_growth": Expectation("lower", "ratio", _MAG),
    "rms_in_log_slope": Expectation("lower", "difference", _MAG),
    "rms_in_max_min": Expectation("lower", "ratio", _MAG),
    "rms_in_peak": Expectation("lower", "ratio", _MAG),
    "rms_out_growth": Expectation("lower", "ratio", _MAG),
    "rms_out_log_slope": Expectation("lower", "difference", _MAG),
    "mean_loss": Expectation("lower", "difference", _LOSS),
}


def comparison_kind(metric: str) -> str:
    """``"ratio"`` or ``"difference"``: how ``metric`` is set against the baseline (difference if unlisted)."""
    exp = EXPECTED.get(metric)
    return exp.kind if exp is not None else "difference"


def no_difference(kind: str) -> float:
    """The value meaning "no difference": 1 for a ratio, 0 for a difference."""
    return 1.0 if kind == "ratio" else 0.0


def verdict(low: float, high: float, expected: Direction, null: float = 0.0) -> str:
    """Consistent, contrary or inconclusive: where the interval [low, high] lies against ``null``.

    Args:
        low, high: the confidence interval of the comparison (NaN: no interval).
        expected: the paper's direction, ``"lower"`` or ``"higher"`` than ``null``.
        null: the value meaning no difference (0 for a difference, 1 for a ratio, or a
            reference value such as a uniform mixture's).

    Returns:
        ``"consistent"`` if the whole interval lies strictly on the paper's side of ``null``,
        ``"contrary"`` if strictly on the other side, else ``"inconclusive"`` (the interval
        contains or touches ``null``, or is missing).
    """
    if expected not in ("lower", "higher"):
        raise ValueError(f"expected is {expected!r}; accepted values are 'lower' and 'higher'")
    if not (_finite(low) and _finite(high)):
        return "inconclusive"
    if low > high:
        raise ValueError(f"interval [{low}, {high}] has low > high")
    if low > null:
        side = "higher"
    elif high < null:
        side = "lower"
    else:
        return "inconclusive"
    return "consistent" if side == expected else "contrary"


def _finite(x: float) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False
