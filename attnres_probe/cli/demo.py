"""``attnres-probe demo`` (the dashboard on the bundled demo models, or ``--summary`` tables) and
``attnres-probe demo-models`` (regenerate them: :mod:`attnres_probe.demo`).

    attnres-probe demo                      # http://127.0.0.1:8050
    attnres-probe demo --summary
    attnres-probe demo-models --from-runs docs/study/v3/runs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnres_probe.cli import UserError, arg_range
from attnres_probe.demo_recipe import BACKEND_NAMES as BACKENDS
from attnres_probe.demo_recipe import DEMO_NAMES, DEMO_RULES, DEMO_THREADS, DEMO_TRAIN

__all__ = ["add_demo_models_parser", "add_demo_parser"]


def _run_demo(args: argparse.Namespace) -> int:
    if args.summary:
        import pandas as pd

        from attnres_probe import metrics
        from attnres_probe.cli.record import DEFAULT_TEXT, layer_summary
        from attnres_probe.loading import demo_source, load_model

        traces = []
        for name in DEMO_NAMES:
            probe = load_model(demo_source(name)).probe()
            traces.append(probe.run(DEFAULT_TEXT, backward=True, truncate=True))
        for t in traces:
            print(f"\n== {t.name}")
            with pd.option_context("display.width", 120, "display.float_format", "{:.4g}".format):
                print(layer_summary(t).to_string())
        from attnres_probe.analysis.display import BASIS_NOTE, table_rows

        t = table_rows(metrics.compare(*traces))
        n = len(t["models"])
        table = pd.DataFrame([[*r["cells"], *(f"{v} ({c})" if c else v for v, c in zip(r["verdicts"], r["caveats"]))]
                              for r in t["rows"]], index=[r["metric"] for r in t["rows"]],
                             columns=[*t["columns"], *[f"verdict: {c}" for c in t["comparisons"]]])
        with pd.option_context("display.width", 200, "display.max_columns", 2 * n + 2, "display.max_colwidth", 60):
            print("\n== metrics (one text = one window: no intervals, every verdict inconclusive)\n" + table.to_string())
        print("\n" + BASIS_NOTE)
        return 0
    from attnres_probe.dashboards.serving import run_demo

    return run_demo(host=args.host, port=args.port, open_browser=args.open)


def add_demo_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo", help="open the dashboard on the bundled demo models",
        description="Serve the dashboard on the five bundled demo models (PreNorm, Full and Block AttnRes: seed 0 of "
                    "study v3; mHC and DenseFormer: the same recipe and seed; 8 layers, 64 wide, byte tokens, trained on "
                    "Shakespeare with whole plays held out), with what five training seeds show beside them. --summary "
                    "prints per-layer tables instead.")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    p.add_argument("--port", type=arg_range("int", 0, 65535), default=8050, help="port to serve on (default: %(default)s)")
    p.add_argument("--open", action="store_true", help="also open the page in a browser")
    p.add_argument("--summary", action="store_true", help="print per-layer summaries and metrics instead")
    p.set_defaults(func=_run_demo)
    return p


def add_demo_models_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo-models",
        help="regenerate the bundled demo models (PreNorm, Full, Block, mHC, DenseFormer)",
        description="Train the demo models with identical settings (only the residual rule differs) and write them as "
                    "fp16 safetensors.",
    )
    p.add_argument("--out", default="attnres_probe/demo_models", help="destination folder (default: %(default)s)")
    p.add_argument("--only", nargs="+", choices=list(DEMO_RULES), default=list(DEMO_RULES), help="build only these")
    p.add_argument("--threads", type=arg_range("int", 1, 256), default=DEMO_THREADS, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="another step count (the study's 2000, or a smoke run)")
    p.add_argument("--seed", type=int, default=0, help="model and run seed (default: %(default)s, the shipped models)")
    p.add_argument("--work", default=".demo-work", metavar="DIR",
                   help="resumable run folders; rerunning the command continues unfinished runs (default: %(default)s)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="numba",
        help="depth-attention backend; the shipped models (study v3's seed 0) were trained with Numba at one thread "
             "(default: %(default)s)",
    )
    p.add_argument("--from-runs", metavar="DIR",
                   help="ship finished runs instead of training: DIR/<name>/seed<seed> (e.g. docs/study/v3/runs, whose "
                        "seed 0 the shipped models are)")
    p.set_defaults(func=_run_demo_models)
    return p


def _built_steps(folder: Path) -> int | None:
    """The step count of the demo model built in ``folder`` (shipped or rebuilt), or None if there is none."""
    try:
        steps = json.loads((folder / "train_log.json").read_text())["train_config"]["steps"]
        return int(steps)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _run_demo_models(args: argparse.Namespace) -> int:
    from attnres_probe.demo import (  # torch: only once the arguments parsed
        build_demo_models,
        ship_run,
    )

    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps is {args.steps}; it must be a positive step count")
    steps = args.steps or DEMO_TRAIN["steps"]
    longer = {n: k for n in args.only if (k := _built_steps(Path(args.out) / n)) is not None and k > steps}
    if longer:
        held = ", ".join(f"{n}: {k} steps" for n, k in longer.items())
        raise UserError(
            f"--steps {steps} trains shorter models than --out {args.out} holds ({held}), which they would replace: "
            "give --out a folder of your own"
        )
    overrides = {}
    if args.steps:  # the demo recipe at another length: saves and probes as often, while the run is long enough
        overrides = {"steps": args.steps, "warmup_steps": min(DEMO_TRAIN["warmup_steps"], args.steps // 10)}
        for key in ("eval_every", "probe_every"):
            if DEMO_TRAIN[key] > args.steps:
                overrides[key] = 0
    if args.seed < 0:
        raise UserError(f"--seed is {args.seed}; it must be 0 or more")
    if args.from_runs:
        losses = {}
        for name in args.only:
            run = Path(args.from_runs) / name / f"seed{args.seed}"
            if not (run / "train_log.json").is_file():
                raise UserError(f"--from-runs {args.from_runs}: {run} holds no training run (train_log.json)")
            try:
                losses[name] = ship_run(run, Path(args.out) / name, backend=args.backend, threads=args.threads)
            except ValueError as exc:
                raise UserError(str(exc)) from None
        for name, loss in losses.items():
            print(f"{name:8s} val loss of the fp16 weights {loss:.4f}  -> {Path(args.out) / name}")
        return 0
    losses = build_demo_models(args.out, tuple(args.only), threads=args.threads, backend=args.backend, seed=args.seed,
                               work=args.work, **overrides)
    for name, loss in losses.items():
        print(f"{name:8s} val loss of the fp16 weights {loss:.4f}  -> {Path(args.out) / name}")
    return 0
