"""``attnres-probe dash``: serve the dashboard with waitress (loopback by default).

    attnres-probe dash                                   # the bundled demo models
    attnres-probe dash --models runs/prenorm runs/block  # checkpoint folders
    attnres-probe dash --traces traces/a traces/b        # saved DepthTraces (traces-only mode)
    attnres-probe dash --stats runs/corpus               # a recorded corpus: intervals and verdicts first

The serving itself is :mod:`attnres_probe.dashboards.serving`.
"""

from __future__ import annotations

import argparse
import sys
import time

from attnres_probe.cli import add_placement_args, arg_range, unescape_text
from attnres_probe.dashboards.defaults import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_THREADS,
    DEFAULT_TORCH_THREADS,
)

__all__ = ["add_dash_parser"]


def add_dash_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "dash",
        help="open the interactive depth-routing explorer (Dash)",
        description="Serve the depth-routing dashboard: AttnRes models beside the PreNorm baseline. "
        "Binds to 127.0.0.1 by default; with no --models/--traces it loads the bundled demo models.",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=arg_range("int", 0, 65535), default=DEFAULT_PORT, help="port (default: %(default)s)")
    p.add_argument("--models", nargs="+", metavar="DIR",
                   help="model folders, ours or checkpoints of the public families (fla, Qwen3-AttnRes, nanogpt, LR-AttnRes; "
                        "default: the bundled demo models)")
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
    add_placement_args(p)
    p.set_defaults(func=_run_dash)
    return p


def _run_dash(args: argparse.Namespace) -> int:
    from attnres_probe.dashboards import (
        serving,  # Dash and torch: seconds, so only once the arguments parsed
    )
    from attnres_probe.dashboards.app import allowed_hosts_for, create_app

    if not 0 < args.port < 65536:
        raise ValueError(f"--port is {args.port}; choose 1..65535")
    if args.threads < 1:
        raise ValueError(f"--threads is {args.threads}; need at least 1")
    if args.torch_threads < 1:
        raise ValueError(f"--torch-threads is {args.torch_threads}; need at least 1")
    serving.set_torch_threads(args.torch_threads)
    t0 = time.perf_counter()
    if args.names and not (args.models or args.traces):
        raise ValueError("--names names the folders of --models and --traces; pass those too")
    entries, stats = serving.load_with_stats(args.models, args.traces, args.stats, args.names)
    study = None
    if not (args.models or args.traces):  # the demo models: show the study they are seed 0 of
        from attnres_probe.seed_study import load_demo_summary

        study = load_demo_summary()
    app = create_app(entries, text=unescape_text(args.text), cache_size=args.cache_size, stats=stats,
                     allowed_hosts=allowed_hosts_for(args.host), study=study)
    print(f"loaded {len(entries)} entries in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return serving.serve(app, host=args.host, port=args.port, threads=args.threads, open_browser=args.open)
