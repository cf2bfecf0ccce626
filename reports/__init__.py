"""attnres_probe.reports: self-contained HTML reports (see docs/design.md).

    from attnres_probe.reports import build_report, record_text
    traces = [record_text(model, text, name=n) for n, model in models.items()]
    build_report(traces, "report.html", title="AttnRes vs PreNorm")

The command line is ``attnres-probe report`` (:mod:`attnres_probe.cli.report`).
"""

from __future__ import annotations

if not __name__.startswith("attnres_probe."):  # imported from the repository root under its bare name
    import runpy as _runpy
    from pathlib import Path as _Path

    _runpy.run_path(str(_Path(__file__).resolve().parents[1] / "attnres_probe" / "_shadow.py"))["hand_over"](__name__, __file__)
else:
    from attnres_probe.reports.builder import SECTIONS, ReportWriteError, build_report, render_report, versions
    from attnres_probe.reports.recording import SAMPLE_TEXT, record_checkpoints, record_demos, record_text

    __all__ = [
        "SAMPLE_TEXT",
        "SECTIONS",
        "ReportWriteError",
        "build_report",
        "record_checkpoints",
        "record_demos",
        "record_text",
        "render_report",
        "versions",
    ]
