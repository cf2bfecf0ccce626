"""attnres_probe.dashboards: the Dash depth-routing explorer (see docs/design.md).

    from attnres_probe.dashboards import create_app, create_server
    app = create_app({"prenorm": base, "block": model})   # or saved DepthTraces
    app.run()                                              # http://127.0.0.1:8050

``attnres-probe dash`` serves it with waitress; :func:`run_demo` opens it on the bundled demo
models. Modules: ``state`` (models, trace cache, validation), ``layout`` (the page),
``callbacks`` (plain functions, registered per app), ``app`` (factory), ``serving`` (entries from
folders, waitress); the command is :mod:`attnres_probe.cli.dash`.
"""

from __future__ import annotations

if not __name__.startswith("attnres_probe."):  # imported from the repository root under its bare name
    import runpy as _runpy
    from pathlib import Path as _Path

    _runpy.run_path(str(_Path(__file__).resolve().parents[1] / "attnres_probe" / "_shadow.py"))["hand_over"](__name__, __file__)
else:
    import importlib
    from typing import Any

    __all__ = ["Explorer", "PromptError", "create_app", "create_server", "run_demo", "serve"]

    # imported on first use (PEP 562): Dash and torch cost seconds, and the command line reads
    # attnres_probe.dashboards.defaults before it knows whether it will serve anything
    _HOMES = {"create_app": "app", "create_server": "app", "run_demo": "serving", "serve": "serving",
              "Explorer": "state", "PromptError": "state"}

    def __getattr__(name: str) -> Any:
        if name in _HOMES:
            return getattr(importlib.import_module(f"attnres_probe.dashboards.{_HOMES[name]}"), name)
        raise AttributeError(f"module 'attnres_probe.dashboards' has no attribute {name!r}")
