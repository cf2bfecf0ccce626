"""``attnres-probe report``: record a text through models (or load saved traces) and export one HTML file.

    attnres-probe report --demo --out report.html
    attnres-probe report --models runs/prenorm runs/full --text "The cat sat" --out report.html
    attnres-probe report --traces traces/prenorm traces/full --out report.html
    attnres-probe report --stats runs/corpus --out corpus.html

The report itself is :mod:`attnres_probe.reports` (recording, building the page).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from attnres_probe.cli import UserError, add_placement_args, arg_range, unescape_text
from attnres_probe.demo_recipe import DEMO_NAMES
from attnres_probe.validate import MAX_RESAMPLES

__all__ = ["add_report_parser"]

ABLATE_CHOICES = ("all", "embed", "completed", "partial", "recent")


def add_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``report`` subcommand (sets ``func``)."""
    from attnres_probe.ablation import MODES

    p = subparsers.add_parser(
        "report",
        help="export a self-contained HTML report (opens offline)",
        description=(
            "Record one text through several models (or load saved traces) and write a single HTML file with "
            "the model summary, metrics against the PreNorm baseline, heatmaps, magnitudes, gradients, a per-token "
            "explorer and the versions needed to reproduce it. A text longer than a model's context is recorded "
            "in context-sized windows as one batch."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--models", nargs="+", metavar="DIR",
                     help="model folders: ours (config.json + model.safetensors) or checkpoints of the families of README's Model families table "
                          "(fla, Qwen3-AttnRes, nanogpt, LR-AttnRes)")
    src.add_argument("--traces", nargs="+", metavar="DIR", help="saved DepthTrace directories (DepthTrace.save)")
    src.add_argument(
        "--demo",
        nargs="*",
        choices=DEMO_NAMES,
        metavar="NAME",
        help=f"bundled demo models: {', '.join(DEMO_NAMES)} (bare --demo: all of them)",
    )
    src.add_argument("--stats", metavar="DIR",
                     help="a corpus run (attnres-probe corpus --out DIR): comparisons with intervals and verdicts, "
                          "mean heatmaps with spread, profiles with bands")
    p.add_argument("--resamples", type=arg_range("int", 1, MAX_RESAMPLES), default=1000,
                   help="bootstrap resamples with --stats (default: %(default)s)")
    p.add_argument("--seed", type=arg_range("int", 0, 2**32 - 1), default=0, help="bootstrap seed with --stats (default: %(default)s)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", help="the text to record (with --models / --demo; --demo defaults to a 256-token sample); "
                                     "\\n and \\t stand for a newline and a tab")
    text.add_argument("--text-file", "--file", dest="text_file", metavar="FILE",
                      help="read the text from FILE (UTF-8); --file is the same flag, as record and summary spell it")
    p.add_argument("--out", required=True, metavar="FILE", help="a new .html file to write (its directory must exist)")
    p.add_argument("--force", action="store_true", help="replace the file already at --out")
    p.add_argument("--title", default=None, help="report title (default: 'attnres-probe report: <model names>')")
    p.add_argument("--names", nargs="+", metavar="NAME", help="one label per model / trace (default: directory names)")
    p.add_argument("--no-backward", action="store_true", help="skip the backward pass (no gradient norms)")
    p.add_argument(
        "--ablate", choices=ABLATE_CHOICES, default=None,
        help="also ablate these sources in every AttnRes model (on its first context window) and add the results",
    )
    p.add_argument("--ablate-mode", choices=MODES, default="zero", help="ablation mode (default: %(default)s)")
    p.add_argument("--weight-effect", action="store_true",
                   help="also remove each source from each deep read of every model (PreNorm too) and show the loss "
                        "change beside the routing weight (one forward pass per source and read)")
    p.add_argument("--explorer-tokens", type=arg_range("int", 1, 10**6), default=1024, metavar="N",
                   help="tokens in the per-token explorer (default: %(default)s)")
    add_placement_args(p)
    p.set_defaults(func=run_report)
    return p


def _user_error(msg: str) -> Exception:
    return UserError(msg)


def _text(args: argparse.Namespace) -> str | None:
    from attnres_probe.reports.recording import MAX_TOKENS

    if args.text_file:
        path = Path(args.text_file)
        if not path.exists():
            raise _user_error(f"--text-file {path} does not exist")
        if not path.is_file():
            raise _user_error(f"--text-file {path} is not a regular file (a folder, device or pipe); pass a UTF-8 text file")
        size = path.stat().st_size
        if size > 4 * MAX_TOKENS:  # more bytes than any tokenizer turns into MAX_TOKENS tokens
            raise _user_error(
                f"--text-file {path} is {size} bytes; a report records at most {MAX_TOKENS} tokens of text "
                f"(cut it first, e.g. `head -c {MAX_TOKENS} {shlex.quote(str(path))} > short.txt`)"
            )
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise _user_error(f"--text-file {path} is not UTF-8 text (byte {exc.start})") from None
    return unescape_text(args.text)


def _check_out(out: Path, force: bool) -> None:
    """Refuse an --out that exists (without --force) or whose folder is missing, before any recording."""
    from attnres_probe.io import special_kind

    kind = special_kind(out)
    if kind == "folder":
        raise _user_error(f"--out {out} is a folder; pass a file path such as {out / 'report.html'}")
    if kind is not None:
        raise _user_error(f"--out {out} is a {kind}, not a regular file; --force replaces only a regular file "
                          "(choose a file path)")
    if out.exists() and not force:
        raise _user_error(
            f"--out {out} already exists; pass --force to replace it, or choose another --out (nothing was written)"
        )
    if not out.parent.is_dir():
        raise _user_error(
            f"cannot write the report to {out}: the directory {out.parent} does not exist "
            f"(create it first, e.g. `mkdir -p {out.parent}`, or choose another --out)"
        )


def run_report(args: argparse.Namespace) -> int:
    """Body of ``attnres-probe report``; returns the exit status."""
    from attnres_probe.reports import SAMPLE_TEXT, ReportWriteError, build_report
    from attnres_probe.reports.recording import record_checkpoints, record_demos

    if args.stats:
        return _run_stats_report(args)
    text = _text(args)
    backward = not args.no_backward
    out = Path(args.out)
    _check_out(out, args.force)  # fail before spending time on recording
    t0 = time.perf_counter()
    models = None
    from attnres_probe.io import say
    if not args.traces:
        n = len(args.demo or DEMO_NAMES) if args.demo is not None else len(args.models or [])
        say(f"recording the text through {n} model{'s' if n != 1 else ''} (a few seconds each) ...")
    if args.traces:
        if text is not None:
            print("note: --text is ignored with --traces (the traces carry their own tokens)", file=sys.stderr)
        traces = _load_traces(args.traces, args.names)
    elif args.demo is not None:
        if args.names:
            raise _user_error(f"--names does not apply to --demo (the demo models are {', '.join(DEMO_NAMES)})")
        text = text if text is not None else SAMPLE_TEXT
        traces = record_demos(text, names=_demo_names(args), backward=backward)
    else:
        if text is None:
            raise _user_error("--models needs the text to record: pass --text TEXT or --text-file FILE")
        traces = record_checkpoints(args.models, text, names=args.names, backward=backward)
        models = args.models
    if not args.traces:
        say("the logit decomposition and the logit lens of the first tokens, for the per-token explorer ...")
    readings, histories = _readings_and_histories(args, traces)
    t_record = time.perf_counter() - t0
    ablations = _ablations(args, traces, text, models) if args.ablate else None
    t_effect = time.perf_counter()
    effects = _weight_effects(args, traces, text, models) if args.weight_effect else None
    t_effect = time.perf_counter() - t_effect
    from attnres_probe.trace import unique_names

    title = args.title or f"attnres-probe report: {', '.join(unique_names([t.name for t in traces]))}"  # as the page labels them
    command = _command(args)
    t1 = time.perf_counter()
    say("building the page ...")
    from attnres_probe.io import exclusive_lock

    try:
        with exclusive_lock(out):  # one writer per --out; the check again, now that no one else writes it
            _check_out(out, args.force)
            path = build_report(
                traces, out, title=title, ablations=ablations, explorer_tokens=args.explorer_tokens, command=command,
                readings=readings, histories=histories, weight_effects=effects,
            )
    except ReportWriteError as exc:
        raise _user_error(str(exc)) from None
    size = path.stat().st_size / 1e6
    effect = f", weight beside effect in {t_effect:.1f} s" if effects else ""
    print(f"wrote {path} ({size:.2f} MB; recorded in {t_record:.1f} s{effect}, built in {time.perf_counter() - t1:.1f} s)")
    return 0


def _readings_and_histories(args: argparse.Namespace, traces: list) -> tuple[dict | None, dict | None]:
    """With models (--demo, --models): each model's logit decomposition and logit lens for the
    explorer, and the routing-over-training history of run folders that recorded one. Saved
    traces hold no activations: (None, None)."""
    if args.traces:
        return None, None
    from attnres_probe.reports.recording import record_readings
    from attnres_probe.training.probes import load_history

    readings, histories = {}, {}
    from attnres_probe.loading import demo_source, load_model

    if args.demo is not None:
        from attnres_probe.demo import demo_dir

        for t in traces:
            loaded = load_model(demo_source(t.name))
            readings[t.name] = record_readings(loaded.model, t, tokenizer=loaded.tokenizer)
            history = load_history(demo_dir(t.name))  # the demo models record routing over training
            if history:
                histories[t.name] = history
        return readings, histories or None
    for d, t in zip(args.models, traces):
        loaded = load_model(Path(d))
        readings[t.name] = record_readings(loaded.model, t, tokenizer=loaded.tokenizer)
        history = load_history(d)
        if history:
            histories[t.name] = history
    return readings, histories or None


def _run_stats_report(args: argparse.Namespace) -> int:
    """``report --stats DIR``: the corpus report of a finished ``attnres-probe corpus`` run."""
    from attnres_probe.corpus.run import load_stats_dir
    from attnres_probe.reports import ReportWriteError
    from attnres_probe.reports.builder import build_stats_report

    for flag in ("text", "text_file", "ablate", "weight_effect", "names"):
        if getattr(args, flag, None):
            raise _user_error(f"--{flag.replace('_', '-')} does not apply to --stats (the corpus run holds its own data and names)")
    if args.resamples < 1:
        raise _user_error(f"--resamples is {args.resamples}; need at least 1")
    out = Path(args.out)
    _check_out(out, args.force)
    manifest, stats = load_stats_dir(args.stats)
    title = args.title or f"attnres-probe corpus report: {', '.join(stats)}"
    from attnres_probe.reports.builder import public_path

    parts = ["attnres-probe", "report", "--stats", public_path(args.stats), "--resamples", str(args.resamples), "--seed", str(args.seed)]
    if args.title:
        parts += ["--title", args.title]
    parts += ["--out", public_path(args.out)]
    t0 = time.perf_counter()
    try:
        path = build_stats_report(stats, out, title=title, manifest=manifest, command=" ".join(shlex.quote(p) for p in parts),
                                  n_resamples=args.resamples, seed=args.seed)
    except ReportWriteError as exc:
        raise _user_error(str(exc)) from None
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB; built in {time.perf_counter() - t0:.1f} s)")
    return 0


def _demo_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The demo models asked for, in the canonical order, each once (bare --demo: all of them)."""
    asked = set(args.demo) or set(DEMO_NAMES)
    return tuple(n for n in DEMO_NAMES if n in asked)


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this report (rebuilt from the parsed arguments)."""
    from attnres_probe.reports.builder import public_path

    parts = ["attnres-probe", "report"]
    for flag in ("models", "traces"):
        if getattr(args, flag):
            parts += [f"--{flag}", *(public_path(p) for p in getattr(args, flag))]
    if args.names:
        parts += ["--names", *map(str, args.names)]
    if args.demo is not None:
        parts += ["--demo", *args.demo]
    if args.text_file:
        parts += ["--text-file", public_path(args.text_file)]
    elif args.text is not None:
        parts += ["--text", args.text]
    if args.no_backward:
        parts.append("--no-backward")
    if args.ablate:
        parts += ["--ablate", args.ablate, "--ablate-mode", args.ablate_mode]
    if args.weight_effect:
        parts += ["--weight-effect"]
    if args.title:
        parts += ["--title", args.title]
    parts += ["--explorer-tokens", str(args.explorer_tokens), "--out", public_path(args.out)]
    if args.force:
        parts.append("--force")
    return " ".join(shlex.quote(p) for p in parts)


def _load_traces(dirs: list[str], names: list[str] | None):
    import dataclasses

    from attnres_probe.trace import DepthTrace

    if names is not None and len(names) != len(dirs):
        raise _user_error(f"{len(names)} --names for {len(dirs)} --traces: give one name per trace")
    traces = []
    for i, d in enumerate(dirs):
        t = DepthTrace.load(d)
        if names is not None:
            t = dataclasses.replace(t, meta={**t.meta, "name": names[i]})
        traces.append(t)
    return traces


def _live_models(args: argparse.Namespace, traces, model_dirs: list[str] | None, flag: str):
    """(trace, Probe) of every model the traces were recorded from (--demo or --models)."""
    if args.traces:
        raise _user_error(f"{flag} needs the models: use it with --models or --demo, not --traces")
    from attnres_probe.loading import demo_source, load_model

    for i, t in enumerate(traces):
        yield t, load_model(demo_source(t.name) if args.demo is not None else model_dirs[i]).probe(t.name)


def _weight_effects(args: argparse.Namespace, traces, text: str | None, model_dirs: list[str] | None):
    """{model name: ablation.weight_beside_effect} for every model (first context window of the text)."""
    from attnres_probe.ablation import weight_beside_effect

    out = {}
    for t, probe in _live_models(args, traces, model_dirs, "--weight-effect"):
        from attnres_probe.io import say

        say(f"weight beside effect: {t.name} (one forward pass per source of each deep read) ...")
        out[t.name] = weight_beside_effect(probe, text, truncate=True)
    return out


def _ablations(args: argparse.Namespace, traces, text: str | None, model_dirs: list[str] | None):
    """Ablation frames {model name: frame} for the AttnRes models (first context window of the text)."""
    out = {}
    for t, probe in _live_models(args, traces, model_dirs, "--ablate"):
        if t.residual == "prenorm":
            continue  # no softmax weights to ablate
        out[t.name] = probe.ablate(text, sources=args.ablate, mode=args.ablate_mode, truncate=True)
    return out
