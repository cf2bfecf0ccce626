"""``attnres-probe study``: study v3 over the seeds of ``docs/study/v3/runs`` (:mod:`attnres_probe.seed_study`),
or the single-model study of the demo models (:mod:`attnres_probe.study`).

    attnres-probe study                                                       # study v3: docs/study/v3
    attnres-probe study --demo --out study-demo                               # the shipped demo models
    attnres-probe study --models study_models/seed1 --out study-seed1         # another seed's models
    attnres-probe study --demo --names prenorm full denseformer --out s       # some of them (PreNorm always)
    attnres-probe study --seeds study-seed0 study-seed1 study-seed2 --out study-seeds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnres_probe.cli import UserError, add_placement_args, arg_range
from attnres_probe.demo_recipe import DEMO_RULES
from attnres_probe.study import N_RESAMPLES, N_WINDOWS, SEED, run_seed_study, run_study
from attnres_probe.validate import MAX_RESAMPLES

__all__ = ["add_study_parser"]


def add_study_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "study", help="regenerate the study pages (v3: the seeds of docs/study/v3/runs)",
        description="Study v3 (docs/study/plan-v3.md): `attnres-probe study --runs docs/study/v3/runs` measures every "
                    "finished run on the held-out plays and writes results.json, windows.csv and study.md (primary "
                    "endpoints over seeds with Holm's correction, per-play tables, exploratory diagnostics). Without "
                    "--runs: the earlier single-model study of the demo models.")
    p.add_argument("--runs", metavar="DIR", default=None,
                   help="the runs of plan-v3 (DIR/{prenorm,full,block}/seed{s}, written by docs/study/v3/train_runs.sh; "
                        "default docs/study/v3/runs); the pages go to --out (default docs/study/v3)")
    p.add_argument("--pages-only", action="store_true",
                   help="with the v3 runs: write study.md again from results.json without measuring (the "
                        "learning-rate rows read again from their runs' logs)")
    p.add_argument("--demo", action="store_true",
                   help="instead: the single-model study of the shipped demo models (or --models DIR), intervals over "
                        "texts only; needs --out")
    p.add_argument("--out", default=None, help="output folder (default with the runs: docs/study/v3)")
    p.add_argument("--windows", type=int, default=N_WINDOWS, help="validation windows per model (default: %(default)s, all)")
    p.add_argument("--resamples", type=arg_range("int", 1, MAX_RESAMPLES), default=N_RESAMPLES, help="bootstrap resamples (default: %(default)s)")
    p.add_argument("--seed", type=arg_range("int", 0, 2**32 - 1), default=SEED, help="bootstrap seed (default: %(default)s)")
    p.add_argument("--images", choices=("auto", "png", "html"), default="auto",
                   help="figure format of the demo-model study: png (needs kaleido and Chromium), html, or auto (png "
                        "when it can be written)")
    p.add_argument("--models", nargs="+", metavar="DIR",
                   help="with --baseline: plan v3's protocol on any checkpoints, each DIR one model holding one folder per "
                        "seed (seed0, seed1, ...; ours, or a public family's); e.g. --models docs/study/v3/runs/block "
                        "docs/study/v3/runs/full --baseline docs/study/v3/runs/prenorm. Without --baseline: the demo "
                        "models in one DIR (written by `attnres-probe demo-models --out DIR`) for the single-model study")
    p.add_argument("--baseline", metavar="DIR", help="the baseline's seed folders (paired with the models' by seed number)")
    p.add_argument("--data", metavar="PATH", help="with --baseline: the held-out text (a file or a folder of files, one "
                   "document each); default: the held-out windows the runs' own training logs name")
    p.add_argument("--train-data", metavar="PATH", help="with --data: the training corpus, to check the held-out text "
                   "against it (verbatim chunks of 64 characters)")
    p.add_argument("--no-controls", action="store_true",
                   help="with --baseline: leave out the causal controls (static routing, masking), which cost about "
                        "eight forward passes per window and model")
    p.add_argument("--seq-len", type=arg_range("int", 2, 1 << 20), default=None,
                   help="with --data: tokens per window (default: the model's context, at most 1024)")
    p.add_argument("--names", nargs="+", metavar="NAME",
                   help=f"with --baseline: one name per --models folder (default: the folders' names). Otherwise the "
                        f"demo models the single-model study sets side by side ({', '.join(DEMO_RULES)}; prenorm, the "
                        "baseline, among them); default: every shipped one, or every one --models DIR holds. Models other "
                        "than Full and Block get estimates and intervals against PreNorm, no verdict")
    p.add_argument("--seeds", nargs="+", metavar="FOLDER", help="combine the study folders of several seeds of one recipe "
                   "(each the --out of `study --models`) into seeds.md: intervals over seeds and windows")
    add_placement_args(p)
    p.set_defaults(func=lambda a: _run(a))
    return p


def _run(args: argparse.Namespace) -> int:
    if args.pages_only and (args.demo or args.models or args.seeds or args.baseline):
        raise UserError("--pages-only rewrites study v3's pages (--runs, --out); it does not apply to the other studies")
    if args.baseline or args.data or args.train_data or args.seq_len or args.no_controls:
        return _run_checkpoints(args)
    if args.models and len(args.models) > 1:
        raise UserError(f"--models gives {len(args.models)} folders: several models are studied against a baseline "
                        "(add --baseline DIR); the single-model study takes one folder of demo models")
    if args.models:
        args.models = args.models[0]
    if args.names:
        bad = [n for n in args.names if n not in DEMO_RULES]
        if bad:
            raise UserError(f"--names {bad[0]!r}: the single-model study sets demo models side by side "
                            f"({', '.join(DEMO_RULES)}); --names with --baseline names checkpoint folders")
    single = args.demo or args.models or args.seeds
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} is a file; the study writes a folder of pages: give a folder path")
    if args.names and args.seeds:
        raise UserError("--names picks the models a single-model study records (--demo or --models DIR); --seeds combines "
                        "study folders and takes the models every one of them holds")
    if args.names and not (args.demo or args.models):
        raise UserError("--names picks the models of the single-model study (--demo or --models DIR); study v3 "
                        "(--runs) is pre-registered on PreNorm, Full and Block")
    if single and args.runs:
        raise UserError("--runs is the study over seeds; --demo, --models and --seeds are the single-model study: pick one")
    if not single:
        from attnres_probe.demo import demo_root
        from attnres_probe.seed_study import SUMMARY_FILE, run_v3_study

        out = Path(args.out or "docs/study/v3")
        runs = Path(args.runs or "docs/study/v3/runs")
        # the pages of the shipped runs also refresh the summary the dashboard shows beside the demo models
        shipped = runs.resolve() == Path("docs/study/v3/runs").resolve() and out.resolve() == Path("docs/study/v3").resolve()
        try:
            if args.pages_only:
                from attnres_probe.seed_study import refresh_v3_pages

                results = refresh_v3_pages(runs, out, summary_to=demo_root() / SUMMARY_FILE if shipped else None)
            else:
                results = run_v3_study(runs, out, summary_to=demo_root() / SUMMARY_FILE if shipped else None)
        except (FileNotFoundError, ValueError) as exc:
            raise UserError(str(exc)) from None
        return _print_primaries(results, out)
    if not args.out:
        raise UserError("the single-model study needs --out FOLDER (docs/study holds study v3: `attnres-probe study`)")
    if args.seeds:
        summary = run_seed_study(args.out, args.seeds, args.resamples, args.seed)
        width = max((len(f["key"]) for f in summary["findings"]), default=0)
        for f in summary["findings"]:
            print(f"{f['verdict']:<13} {f['key']:<{width}}  consistent in {f['seeds_consistent']} of {len(summary['seeds'])} seeds")
        print(f"wrote {Path(args.out) / 'seeds.md'}")
        return 0
    if not 1 <= args.windows <= N_WINDOWS:
        raise ValueError(f"--windows is {args.windows}; the demo models have {N_WINDOWS} validation windows (1..{N_WINDOWS})")
    from attnres_probe.study import study_names

    try:
        names = study_names(args.names, args.models)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    results = run_study(args.out, args.windows, args.images, args.resamples, args.seed, progress=True, models=args.models,
                        names=names)
    width = max((len(f["key"]) for f in results["findings"]), default=0)
    for f in results["findings"]:
        print(f"{f['verdict']:<13} {f['key']:<{width}}  holds: {f['holds']}")
    others = [n for n in names if n != "prenorm" and not any(f["model"] == n for f in results["findings"])]
    if others:
        print(f"exploratory   {', '.join(others)}: estimates and intervals against PreNorm in study.md, no verdict "
              "(the paper's claims are about AttnRes)")
    print(f"wrote {Path(args.out) / 'study.md'}")
    return 0


def _run_checkpoints(args: argparse.Namespace) -> int:
    """``study --models DIR... --baseline DIR [--data PATH]``: plan v3's protocol on any checkpoints."""
    from attnres_probe.seed_study import run_checkpoint_study

    if not (args.models and args.baseline):
        raise UserError("a study of checkpoints takes --models DIR... and --baseline DIR (each a folder of seed folders); "
                        "--data, --train-data and --seq-len belong to it")
    if args.runs or args.demo or args.seeds:
        raise UserError("--baseline is the study of checkpoints; --runs, --demo and --seeds are other studies: pick one")
    if not args.out:
        raise UserError("a study of checkpoints needs --out FOLDER for its pages")
    if args.seq_len and not args.data:
        raise UserError("--seq-len sets the windows of --data; without --data the runs' own held-out windows are used")
    windows = None if args.windows == N_WINDOWS else args.windows
    try:
        results = run_checkpoint_study(args.models, args.baseline, args.out, data=args.data, train_data=args.train_data,
                                       names=args.names, seq_len=args.seq_len, n_windows=windows, controls=not args.no_controls,
                                       progress=lambda line: print(line, file=sys.stderr))
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from None
    return _print_primaries(results, Path(args.out))


def _print_primaries(results: dict, out: Path) -> int:
    """One line per primary endpoint of a seed study (v3's or any checkpoints'), then where the page went."""
    for p in results["primaries"]:
        print(f"{p['verdict']:<13} {p['key']} {p['title']}: mean {p['mean']:+.3g} {p['unit']}, "
              f"{p['paper_way']} of {p['n']} seeds on the paper's side, Holm p {p['p_holm']:.2g}"
              if p["p_holm"] is not None else f"{p['verdict']:<13} {p['key']} {p['title']}: not enough seeds")
    print(f"wrote {out / 'study.md'}")
    return 0
