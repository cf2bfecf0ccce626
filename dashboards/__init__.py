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

from attnres_probe.dashboards.app import create_app, create_server
from attnres_probe.dashboards.serving import run_demo, serve
from attnres_probe.dashboards.state import Explorer, PromptError

__all__ = ["Explorer", "PromptError", "create_app", "create_server", "run_demo", "serve"]
