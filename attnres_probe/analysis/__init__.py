"""Statistics over windows: per-window metrics, bootstrap intervals, paired comparisons and verdicts.

- :mod:`~attnres_probe.analysis.windows`: every headline metric for each window of a trace;
- :mod:`~attnres_probe.analysis.bootstrap`: vectorised percentile-bootstrap intervals (by document);
- :mod:`~attnres_probe.analysis.verdicts`: the paper's expected directions and :func:`verdict`;
- :mod:`~attnres_probe.analysis.compare`: models side by side (behind ``metrics.compare``);
- :mod:`~attnres_probe.analysis.documents`: which documents drive a verdict (each one's own value, the
  verdict without it: ``documents.csv``);
- :mod:`~attnres_probe.analysis.display`: the strings every page shows for those numbers.
"""

from __future__ import annotations

from attnres_probe.analysis import display  # noqa: F401  (analysis.display.readable in a notebook)
from attnres_probe.analysis.bootstrap import cluster_counts, mean_interval, paired_interval, resample_counts
from attnres_probe.analysis.compare import Windows, compare_windows
from attnres_probe.analysis.verdicts import EXPECTED, VERDICTS, Expectation, verdict
from attnres_probe.analysis.windows import WINDOW_METRICS, window_metrics

__all__ = [
    "EXPECTED",
    "VERDICTS",
    "WINDOW_METRICS",
    "Expectation",
    "Windows",
    "cluster_counts",
    "compare_windows",
    "mean_interval",
    "paired_interval",
    "resample_counts",
    "verdict",
    "window_metrics",
]
