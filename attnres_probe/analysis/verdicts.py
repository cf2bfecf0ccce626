"""The paper's expected directions and the one function that turns an interval into a verdict.

Every comparison of a diagnostic whose paper direction the catalog
(:mod:`attnres_probe.analysis.catalog`) records has an expected direction taken from the paper
(Kimi Team, "Attention Residuals", arXiv 2603.15031): the model's value should be lower (or
higher) than the reference. Diagnostics without one get no verdict. Given the comparison's confidence interval:

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from attnres_probe.analysis.catalog import CATALOG, LiveMapping

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


# from the catalog, read afresh: every diagnostic with a direction the paper states
EXPECTED: Mapping[str, Expectation] = LiveMapping(lambda: {
    name: Expectation(d.direction, d.compare, f"The paper reports: {d.paper}") for name, d in CATALOG.items()
    if d.direction is not None
})


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
