"""App factory: :func:`create_app` builds the Dash app, :func:`create_server` its WSGI server.

    from attnres_probe.dashboards import create_app
    app = create_app({"prenorm": base, "block": model}, text="The cat sat on the mat.")
    app.run(port=8050)                       # or serve app.server with waitress

Callbacks are registered on the app itself (never the module-level ``dash.callback``), so
several apps live side by side in one process. Everything is served locally
(``serve_locally=True``, assets from ``dashboards/assets``): the page makes no external request.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dash
import flask

from attnres_probe.dashboards import callbacks
from attnres_probe.dashboards.layout import build_layout
from attnres_probe.dashboards.state import Explorer

__all__ = ["ASSETS", "LOOPBACK_HOSTS", "allowed_hosts_for", "create_app", "create_server", "demo_entries", "is_loopback"]

ASSETS = Path(__file__).resolve().parent / "assets"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
MAX_REQUEST_BYTES = 2 * 2**20  # callback payloads are a few kB; prompts are length-limited


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (127.0.0.0/8 or ::1).

    Decided from the resolved addresses, not the spelling: ``127.1``, ``0x7f.1`` and
    ``localhost`` are loopback; ``0.0.0.0``, a LAN name or an unresolvable name are not.
    """
    name = host.strip().strip("[]")
    if not name:
        return False
    try:
        infos = socket.getaddrinfo(name, None)
    except (OSError, UnicodeError, ValueError):
        return False
    try:
        addrs = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    except ValueError:
        return False
    return bool(addrs) and all(a.is_loopback for a in addrs)


def allowed_hosts_for(host: str) -> tuple[str, ...] | None:
    """The Host headers to answer when listening on ``host`` (``create_app``'s ``allowed_hosts``).

    A loopback address (decided by :func:`is_loopback`) answers the loopback names and ``host``
    as written; any other address answers every Host (None), as a server meant for the network.
    """
    if not is_loopback(host):
        return None
    return tuple(dict.fromkeys([*LOOPBACK_HOSTS, host.strip().lower()]))


def demo_entries() -> dict[str, Any]:
    """The bundled demo models (:data:`~attnres_probe.demo_recipe.DEMO_NAMES`), name -> model, each with the
    routing recorded over its training (``train_history``, the "over training" view).

    Raises:
        FileNotFoundError: the demo models are not in this installation.
    """
    from attnres_probe.demo import DEMO_NAMES, demo_dir, load_demo
    from attnres_probe.training.probes import load_history

    models = {name: load_demo(name)[0] for name in DEMO_NAMES}
    for name, model in models.items():
        model.train_history = load_history(demo_dir(name))
    return models


def create_app(
    models_or_traces: Mapping[str, Any] | Sequence[Any] | None = None,
    text: str | None = None,
    *,
    cache_size: int = 16,
    allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
    title: str = "attnres-probe · depth routing",
    stats: Mapping[str, Any] | None = None,
    study: Mapping[str, Any] | None = None,
) -> dash.Dash:
    """Build the dashboard.

    Args:
        models_or_traces: name -> AttnResTransformer / Probe (live: new prompts are recorded)
            and/or name -> DepthTrace (saved traces; with no model at all the page is in
            traces-only mode and says so). A sequence is named by residual / trace name.
            None: the bundled demo models.
        text: the initial prompt (default: a short sentence cut to the models' context).
        cache_size: recorded prompts kept on the server (LRU; the initial one is always kept).
        allowed_hosts: answer only requests whose Host header names one of these (port
            ignored); the loopback names by default, which blocks DNS-rebinding pages. None
            allows every host (for ``--host 0.0.0.0``).
        title: the browser tab's title.
        stats: name -> CorpusStats of a recorded corpus (``attnres-probe corpus``); the page then
            leads with their comparisons: headline panel, metric table with intervals and
            verdicts, mean heatmaps with spread, profiles with bands.
        study: a study-v3 summary (:func:`attnres_probe.seed_study.demo_summary`) for the card
            "What five seeds show"; with the demo models (None) the one shipped beside them.

    Returns:
        The ``dash.Dash`` app; ``app.explorer`` is its :class:`Explorer` (models, cache).
    """
    entries = demo_entries() if models_or_traces is None else models_or_traces
    explorer = Explorer(entries, text=text, cache_size=cache_size, stats=stats)
    if study is None and models_or_traces is None:  # the demo models are seed 0 of study v3: show what five seeds say
        from attnres_probe.seed_study import load_demo_summary

        study = load_demo_summary()
    explorer.study = dict(study) if study else None
    app = dash.Dash(
        "attnres_probe.dashboards",
        assets_folder=str(ASSETS),
        serve_locally=True,
        title=title,
        update_title=None,
        external_scripts=[],
        external_stylesheets=[],
        compress=False,
    )
    app.layout = build_layout(explorer)
    callbacks.register(app, explorer)
    app.explorer = explorer
    _warm_up()
    _harden(app.server, allowed_hosts)
    return app


def _warm_up() -> None:
    """Build and serialise one tiny figure of each kind the first page load draws, so plotly's
    validators are loaded when the server starts, not during the first render (~0.3 s)."""
    import numpy as np
    import plotly.graph_objects as go
    from dash._utils import to_json

    for fig in (go.Figure(go.Heatmap(z=np.zeros((2, 2)), customdata=np.zeros((2, 2, 3)), text=[["a", "b"], ["c", "d"]])),
                go.Figure(go.Scatter(x=[0, 1], y=[1, 2])), go.Figure(go.Bar(x=["a"], y=[1]))):
        fig.update_layout(title={"text": "warm-up"}, annotations=[{"text": "x"}], shapes=[{"type": "line"}], meta={"a": 1})
        to_json(fig)


def create_server(
    models_or_traces: Mapping[str, Any] | Sequence[Any] | None = None, text: str | None = None, **kw: Any
) -> flask.Flask:
    """The Flask (WSGI) server of :func:`create_app`, for waitress: one process, several threads.

        waitress.serve(create_server(), host="127.0.0.1", port=8050, threads=8)
    """
    return create_app(models_or_traces, text, **kw).server


def _harden(server: flask.Flask, allowed_hosts: Sequence[str] | None) -> None:
    server.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    allowed = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    @server.before_request
    def _check_host():
        if allowed is None:
            return None
        host = (flask.request.host or "").lower()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        if name not in allowed and host not in allowed:
            return flask.Response(f"host {host!r} is not served here (allowed: {', '.join(sorted(allowed))})\n",
                                  status=421, mimetype="text/plain")
        return None

    @server.after_request
    def _headers(resp: flask.Response) -> flask.Response:
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("X-Frame-Options", "DENY")
        resp.headers.setdefault("Referrer-Policy", "no-referrer")
        return resp
