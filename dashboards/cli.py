"""``attnres-probe dash``: serve the dashboard with waitress (loopback by default).

    attnres-probe dash                                   # the three bundled demo models
    attnres-probe dash --models runs/prenorm runs/block  # checkpoint folders
    attnres-probe dash --traces traces/a traces/b        # saved DepthTraces (traces-only mode)
    attnres-probe dash --stats runs/corpus               # a recorded corpus: intervals and verdicts first

:func:`run_demo` is what ``attnres-probe demo`` (and ``make demo``) calls.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import webbrowser
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnres_probe.cli import unescape_text
from attnres_probe.dashboards.app import allowed_hosts_for, create_app, demo_entries, is_loopback
from attnres_probe.validate import arg_range

__all__ = ["add_dash_parser", "load_entries", "load_with_stats", "run_demo", "serve"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8050
DEFAULT_THREADS = 8
DEFAULT_TORCH_THREADS = 1  # small models, several request threads: intra-op threads only spin-wait on a busy CPU


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
    from attnres_probe.pretrained import load_model_folder, not_a_model_folder

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
        if not path.is_dir():
            raise NotADirectoryError(not_a_model_folder("--models", d))
        model, tokenizer = load_model_folder(path)
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
    from attnres_probe.corpus import CorpusRunError, check_models_match, load_model, load_stats_dir

    manifest, stats = load_stats_dir(stats_dir)
    if not models and not traces:
        from attnres_probe import Probe

        entries = {}
        for m in manifest["models"]:
            try:
                model, tokenizer = load_model(m["source"])
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
    """Open the dashboard on the three bundled demo models (``attnres-probe demo``, ``make demo``).

    Blocks until Ctrl+C. ``torch_threads`` sets torch's intra-op threads for this process (None: leave).
    """
    _set_torch_threads(torch_threads)
    t0 = time.perf_counter()
    app = demo_app(text, host)
    print(f"loaded the demo models in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return serve(app, host=host, port=port, threads=threads, open_browser=open_browser)


def demo_app(text: str | None = None, host: str = DEFAULT_HOST):
    """The dashboard app on the bundled demo models, with the study-v3 card they belong to."""
    from attnres_probe.seed_study import load_demo_summary

    return create_app(demo_entries(), text=text, allowed_hosts=allowed_hosts_for(host), study=load_demo_summary())


def _set_torch_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def add_dash_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "dash",
        help="open the interactive depth-routing explorer (Dash)",
        description="Serve the depth-routing dashboard: AttnRes models beside the PreNorm baseline. "
        "Binds to 127.0.0.1 by default; with no --models/--traces it loads the bundled demo models.",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=arg_range("int", 0, 65535), default=DEFAULT_PORT, help="port (default: %(default)s)")
    p.add_argument("--models", nargs="+", metavar="DIR", help="model folders, ours or flash-linear-attention checkpoints (default: the bundled demo models)")
    p.add_argument("--traces", nargs="+", metavar="DIR", help="saved DepthTrace folders (alone: traces-only mode)")
    p.add_argument("--stats", metavar="DIR",
                   help="a corpus run (attnres-probe corpus --out DIR): lead with its comparisons, intervals and verdicts "
                        "(models default to the ones it was recorded from; --models must be those models)")
    p.add_argument("--names", nargs="+", metavar="NAME",
                   help="panel names, one per folder: --models first, then --traces (default: folder or trace names)")
    p.add_argument("--text", help="initial prompt (default: a short sentence); \\n and \\t stand for a newline and a tab")
    p.add_argument("--threads", type=arg_range("int", 1, 256), default=DEFAULT_THREADS, help="waitress worker threads (default: %(default)s)")
    p.add_argument("--cache-size", type=arg_range("int", 1, 1024), default=16, help="recorded prompts kept on the server (default: %(default)s)")
    p.add_argument("--torch-threads", type=arg_range("int", 1, 256), default=DEFAULT_TORCH_THREADS,
                   help="torch intra-op threads (default: %(default)s; more only helps large models on an idle CPU)")
    p.add_argument("--open", action="store_true", help="open a browser tab")
    p.set_defaults(func=_run_dash)
    return p


def _run_dash(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port is {args.port}; choose 1..65535")
    if args.threads < 1:
        raise ValueError(f"--threads is {args.threads}; need at least 1")
    if args.torch_threads < 1:
        raise ValueError(f"--torch-threads is {args.torch_threads}; need at least 1")
    _set_torch_threads(args.torch_threads)
    t0 = time.perf_counter()
    if args.names and not (args.models or args.traces):
        raise ValueError("--names names the folders of --models and --traces; pass those too")
    entries, stats = load_with_stats(args.models, args.traces, args.stats, args.names)
    study = None
    if not (args.models or args.traces):  # the demo models: show the study they are seed 0 of
        from attnres_probe.seed_study import load_demo_summary

        study = load_demo_summary()
    app = create_app(entries, text=unescape_text(args.text), cache_size=args.cache_size, stats=stats,
                     allowed_hosts=allowed_hosts_for(args.host), study=study)
    print(f"loaded {len(entries)} entries in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return serve(app, host=args.host, port=args.port, threads=args.threads, open_browser=args.open)
