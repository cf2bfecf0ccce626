"""Serving the dashboard: its entries from folders (:func:`load_entries`, :func:`load_with_stats`)
and waitress on loopback by default (:func:`serve`, :func:`run_demo`).

``attnres-probe dash`` (:mod:`attnres_probe.cli.dash`) drives it; :func:`run_demo` is what
``attnres-probe demo`` (and ``make demo``) calls.
"""

from __future__ import annotations

import sys
import threading
import time
import webbrowser
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnres_probe.dashboards.app import allowed_hosts_for, create_app, demo_entries, is_loopback
from attnres_probe.dashboards.defaults import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_THREADS, DEFAULT_TORCH_THREADS

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "DEFAULT_THREADS", "DEFAULT_TORCH_THREADS", "demo_app", "load_entries",
           "load_with_stats", "run_demo", "serve", "set_torch_threads"]



def _unique(name: str, taken: dict[str, Any]) -> str:
    out, i = name, 2
    while out in taken:
        out, i = f"{name} ({i})", i + 1
    return out


def load_entries(
    models: Sequence[str] | None = None, traces: Sequence[str] | None = None, names: Sequence[str] | None = None
) -> dict[str, Any]:
    """name -> model / DepthTrace from checkpoint and trace folders.

    Checkpoints are named by folder; saved traces by their own name, or by folder when several
    carry the same name (``block``, ``block``, ...). ``names`` (``--names``) names every entry,
    models first, then traces, in the order given. With neither folder list, the bundled demo models.

    Raises:
        FileNotFoundError / NotADirectoryError: a folder is missing.
        ValueError: a folder is not a checkpoint / saved trace.
    """
    from attnres_probe import DepthTrace, Probe
    from attnres_probe.loading import load_model

    if not models and not traces:
        return demo_entries()
    given = [*(models or []), *(traces or [])]
    if names is not None and len(names) != len(given):
        raise ValueError(f"--names gives {len(names)} names for {len(given)} folders (--models then --traces); give one per folder")
    if names is not None and len(set(names)) != len(names):
        raise ValueError("--names has a name twice; give every folder its own name")
    own = iter(names) if names is not None else None
    entries: dict[str, Any] = {}
    for d in models or []:
        path = Path(d)
        loaded = load_model(d, flag="--models")
        model, tokenizer = loaded.model, loaded.tokenizer
        from attnres_probe.training.probes import load_history

        model.train_history = load_history(path)  # routing over training (train --probe-every), if recorded
        name = next(own) if own is not None else _unique(path.resolve().name, entries)
        entries[name] = Probe(model, tokenizer=tokenizer, name=name) if tokenizer is not None else model
    loaded = []
    for d in traces or []:
        path = Path(d)
        if not path.is_dir():
            raise NotADirectoryError(f"--traces {d}: not a folder (pass folders written by DepthTrace.save)")
        loaded.append((path, DepthTrace.load(path)))
    counts: dict[str, int] = {}
    for _, t in loaded:
        counts[t.name] = counts.get(t.name, 0) + 1
    for path, trace in loaded:
        if own is not None:
            name = next(own)
        elif trace.name and counts[trace.name] == 1 and trace.name not in entries:
            name = trace.name
        else:  # several traces of one name: their folders tell them apart
            name = _unique(path.resolve().name, entries)
        entries[name] = trace
    return entries


def load_with_stats(
    models: Sequence[str] | None, traces: Sequence[str] | None, stats_dir: str | None, names: Sequence[str] | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(entries, stats): :func:`load_entries`, plus the CorpusStats of ``stats_dir`` when given.

    With ``stats_dir`` and neither ``models`` nor ``traces``, the models are the ones the corpus
    was recorded from (bundled demo models, or checkpoint folders named in its corpus.json).

    Raises:
        ValueError: not a corpus run folder; models the stats were not recorded from (the reason named).
    """
    if not stats_dir:
        return load_entries(models, traces, names), None
    from attnres_probe.corpus.run import CorpusRunError, check_models_match, load_stats_dir
    from attnres_probe.loading import load_model

    manifest, stats = load_stats_dir(stats_dir)
    if not models and not traces:
        from attnres_probe import Probe

        entries = {}
        for m in manifest["models"]:
            try:
                loaded = load_model(m["source"])
                model, tokenizer = loaded.model, loaded.tokenizer
                entries[m["name"]] = Probe(model, tokenizer=tokenizer, name=m["name"]) if tokenizer is not None else model
            except (OSError, ValueError) as exc:
                raise CorpusRunError(
                    f"--stats {stats_dir}: model {m['name']!r} was recorded from {m['source']}, which cannot be loaded "
                    f"({exc}); pass --models DIR … (named as in the corpus run)"
                ) from None
    else:
        entries = load_entries(models, traces, names)
    check_models_match(stats, {n: e for n, e in entries.items() if hasattr(e, "parameters") or hasattr(e, "model")})
    return entries, stats


def serve(app, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, threads: int = DEFAULT_THREADS, open_browser: bool = False) -> int:
    """Serve a dashboard app with waitress (Flask's threaded server if waitress is missing) until Ctrl+C."""
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    names = ", ".join(app.explorer.names)
    print(f"attnres-probe dash: {names} on {url}  (Ctrl+C to stop)", file=sys.stderr)
    if not is_loopback(host):
        print(f"warning: listening on {host}: anyone who can reach this port can run text through the models", file=sys.stderr)
    if open_browser:
        threading.Thread(target=lambda: (time.sleep(1.0), webbrowser.open(url)), daemon=True).start()
    try:
        import waitress
    except ModuleNotFoundError:
        print("waitress is not installed; using Flask's development server (pip install waitress)", file=sys.stderr)
        app.server.run(host=host, port=port, threaded=True)
        return 0
    try:
        waitress.serve(app.server, host=host, port=port, threads=threads, ident="attnres-probe")
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pass another --port") from None
    return 0


def run_demo(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, text: str | None = None, threads: int = DEFAULT_THREADS,
             open_browser: bool = False, torch_threads: int | None = DEFAULT_TORCH_THREADS) -> int:
    """Open the dashboard on the bundled demo models (``attnres-probe demo``, ``make demo``).

    Blocks until Ctrl+C. ``torch_threads`` sets torch's intra-op threads for this process (None: leave).
    """
    set_torch_threads(torch_threads)
    t0 = time.perf_counter()
    app = demo_app(text, host)
    print(f"loaded the demo models in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return serve(app, host=host, port=port, threads=threads, open_browser=open_browser)


def demo_app(text: str | None = None, host: str = DEFAULT_HOST):
    """The dashboard app on the bundled demo models, with the study-v3 card they belong to."""
    from attnres_probe.seed_study import load_demo_summary

    return create_app(demo_entries(), text=text, allowed_hosts=allowed_hosts_for(host), study=load_demo_summary())


def set_torch_threads(n: int | None) -> None:
    """Set torch's intra-op threads for this process (None or 0: leave them)."""
    if n:
        import torch

        torch.set_num_threads(n)
