"""The ``attnres-probe`` command line: ``train``, ``record``, ``summary``, ``dash``, ``report``, ``corpus``,
``demo``, ``demo-models``, ``study``, ``figures``.

Every command is a module of this package (``cli/<command>.py``) holding its parser and its
handler; the library never imports this package. This module assembles them (:data:`SUBCOMMANDS`)
and runs one. Errors a user can fix print one line to stderr and exit with status 2. A new
command is one module here and one row of :data:`SUBCOMMANDS` (and its line in README.md's table).
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from attnres_probe._version import __version__

# (name, module, function, help): each function adds its subcommand to the parser. Only the
# module of the command being run is imported (the others cost seconds: torch, Dash); the
# top-level --help lists every command from this table.
SUBCOMMANDS: list[tuple[str, str, str, str]] = [
    ("train", "attnres_probe.cli.train", "add_train_parser", "train a model on an offline byte corpus"),
    ("record", "attnres_probe.cli.record", "add_record_parser", "record a text through a model and save the DepthTrace"),
    ("summary", "attnres_probe.cli.record", "add_summary_parser", "print a per-layer summary of a model on a text"),
    ("dash", "attnres_probe.cli.dash", "add_dash_parser", "open the interactive depth-routing explorer (Dash)"),
    ("report", "attnres_probe.cli.report", "add_report_parser", "export a self-contained HTML report (opens offline)"),
    ("corpus", "attnres_probe.cli.corpus", "add_corpus_parser", "record a corpus through models: per-window metrics, intervals, verdicts"),
    ("demo", "attnres_probe.cli.demo", "add_demo_parser", "open the dashboard on the bundled demo models"),
    ("demo-models", "attnres_probe.cli.demo", "add_demo_models_parser",
     "regenerate the bundled demo models (PreNorm, Full, Block, mHC, DenseFormer)"),
    ("study", "attnres_probe.cli.study", "add_study_parser", "regenerate the study pages (v3: the seeds of docs/study/v3/runs)"),
    ("figures", "attnres_probe.cli.figures", "add_figures_parser",
     "write the standard figures for a paper (SVG, PDF or 300 dpi PNG at a column's width)"),
    ("controls", "attnres_probe.cli.controls", "add_controls_parser",
     "causal controls of routing: static weights, masking old sources (loss changes with intervals)"),
]

# packages a build may leave out; the commands that need them (dash, report) are then not offered
OPTIONAL_PACKAGES = ("attnres_probe.dashboards", "attnres_probe.reports")


class UserError(Exception):
    """An error caused by the command's arguments; printed without a traceback."""


def build_parser(command: str | None = None, *, every: bool = True) -> argparse.ArgumentParser:
    """The command-line parser.

    Args:
        command: build this subcommand's full parser (importing its module).
        every: with no ``command``, build every subcommand's full parser (importing them
            all); ``every=False`` lists them by name and help only, which is what the
            top-level ``--help`` needs.
    """
    parser = argparse.ArgumentParser(
        prog="attnres-probe",
        description="See how Attention Residuals transformers route information across depth.",
    )
    parser.add_argument("--version", action="version", version=f"attnres-probe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, func, help_text in SUBCOMMANDS:
        if name != command and not (command is None and every):
            sub.add_parser(name, help=help_text)  # listed only; never parsed
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module.startswith(exc.name) or exc.name.startswith(OPTIONAL_PACKAGES)):
                continue  # this subcommand's module, or the package it drives, is not part of this build
            raise
        add = getattr(mod, func, None)
        if add is not None:
            add(sub)
    return parser


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` for a command that loads models (:mod:`attnres_probe.placement`)."""
    from attnres_probe.placement import DTYPES

    group = parser.add_argument_group("placement")
    group.add_argument("--device", default=None, help="torch device to load the models on: cpu (default), cuda, cuda:1 ...")
    group.add_argument("--dtype", default=None, choices=DTYPES,
                       help="dtype of the weights and the computation (default float32; bfloat16 halves a large model's memory)")


def arg_range(kind: str, lo: float, hi: float):
    """An argparse ``type`` for a number flag: ``kind`` "int" or "float", finite, in ``lo``..``hi``;
    a bad value is refused by argparse with the accepted range in the message
    ("argument --resamples: 1000000000 is out of range; accepted 1..1000000")."""

    def convert(text: str):
        try:
            v = float(text) if kind == "float" else int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a number' if kind == 'float' else 'an integer'}; "
                                             f"accepted {_number(lo)}..{_number(hi)}") from None
        if not math.isfinite(v) or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text} is out of range; accepted {_number(lo)}..{_number(hi)}")
        return v

    convert.__name__ = f"{kind} in {_number(lo)}..{_number(hi)}"
    return convert


def _number(v: float) -> str:
    """A bound as the messages show it (its repr, cut at 40 characters)."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# what people type for our flags (checked against the command's own flags before any spelling match)
SYNONYMS = {
    "--input": ("--file", "--text-file", "--data"), "--in": ("--file", "--text-file", "--data"),
    "--txt": ("--text",), "--prompt": ("--text",), "--output": ("--out",), "-o": ("--out",),
    "--model-dir": ("--model", "--models"), "--checkpoint": ("--model", "--models"), "--overwrite": ("--force",),
    "--n-resamples": ("--resamples",), "--bootstrap": ("--resamples",),
}


def _refuse_unknown(parser: argparse.ArgumentParser, command: str | None, extras: list[str]) -> None:
    """Unrecognised arguments: the command's own usage and the closest flags it has (exits 2)."""
    import difflib

    sub = parser
    if command:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        sub = action.choices.get(command, parser) if action is not None else parser
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extras:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            # compared without the leading "--", which every flag shares ("--bogus" is not near "--host")
            bare = {f[2:]: f for f in flags}
            near = [f for f in SYNONYMS.get(flag, ()) if f in flags] or [
                bare[m] for m in difflib.get_close_matches(flag.lstrip("-"), list(bare), n=2, cutoff=0.6)]
            if near:
                hints.append(f"{arg}: did you mean {' or '.join(near)}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    if hints:
        message += " (" + "; ".join(hints) + ")"
    sub.error(message + f"; see `attnres-probe {command} --help`" if command else message)


def _unknown_flags(parser: argparse.ArgumentParser, command: str | None, argv: Sequence[str]) -> list[str]:
    """The ``--flags`` in ``argv`` that the command does not have (nor abbreviate, as argparse allows)."""
    sub = parser
    if command:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        sub = action.choices.get(command, parser) if action is not None else parser
    known = [o for a in sub._actions for o in a.option_strings]
    out = []
    for arg in argv:
        if arg == "--":
            break
        if arg.startswith("--") and len(arg) > 2:
            flag = arg.split("=", 1)[0]
            if flag not in known and not any(k.startswith(flag) for k in known):
                out.append(arg)
    return out


def _command_of(argv: Sequence[str]) -> str | None:
    """The first word of ``argv`` that is not an option: the subcommand, if the line names one."""
    return next((a for a in argv if not a.startswith("-")), None)


_PY_FLAG = re.compile(r"\b[a-z_]+=(?:True|False|'[^']*'|\"[^\"]*\"|[\w.]+) \((?:attnres-probe [\w-]+ )?(--[\w-]+(?: [^()]*)?)\)")


def unescape_text(text: str | None) -> str | None:
    """A --text as typed in a shell: ``\\n`` and ``\\t`` stand for a newline and a tab (``\\\\`` for a backslash)."""
    if text is None:
        return None
    table = {"n": "\n", "t": "\t", "\\": "\\"}
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in table:
            out.append(table[text[i + 1]])
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def cli_message(message: str) -> str:
    """An error message for the command line: a Python argument given with its flag in brackets
    (``overwrite=True (attnres-probe record --force)``) becomes the flag alone (``--force``)."""
    return _PY_FLAG.sub(lambda m: m.group(1), str(message))


_FILE_OUT = {"report", "controls"}  # commands whose --out is one file; the others write a folder


def _check_out(args: argparse.Namespace) -> None:
    """Every command's ``--out``, before any work: a folder output is not an existing file, a file
    output not an existing folder, and no part of the path above it is a file (one line each)."""
    out = getattr(args, "out", None)
    if not out:
        return
    out, command = Path(out), args.command
    if command in _FILE_OUT:
        if out.is_dir():
            raise UserError(f"--out {out} is a folder; `attnres-probe {command}` writes one file: give a file path "
                            "(nothing was written)")
    elif out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; `attnres-probe {command}` writes a folder: give a folder path "
                        "(nothing was written)")
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"--out {out}: {parent} is a file, so nothing can be written under it; choose another "
                                "--out (nothing was written)")
            break


def _check_names(args: argparse.Namespace) -> None:
    """Every command's ``--names``: each label once (two models shown under one label would be
    indistinguishable on every page), before any work."""
    names = getattr(args, "names", None) or []
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"--names gives {', '.join(repr(n) for n in twice)} more than once: every model needs its own "
                        "label (nothing was written)")


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as the CLI shows it: one line, ``attnres-probe: warning: ...`` (no source line)."""
    print(f"attnres-probe: warning: {message}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status. Warnings are one line each."""
    import warnings

    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        return _main(argv)


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    names = [row[0] for row in SUBCOMMANDS]
    if command is not None and command not in names:  # argparse lists the choices but suggests none
        import difflib

        near = difflib.get_close_matches(command, names, n=1, cutoff=0.6)
        hint = f"; did you mean `attnres-probe {near[0]}`?" if near else ""
        print(f"attnres-probe: error: {command!r} is not a command{hint} (commands: {', '.join(names)}; "
              "see `attnres-probe --help`)", file=sys.stderr)
        return 2
    parser = build_parser(command, every=False)
    unknown = _unknown_flags(parser, command, argv)
    if unknown:  # before the required-argument checks, which would otherwise hide a typo
        _refuse_unknown(parser, command, unknown)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _refuse_unknown(parser, getattr(args, "command", None), extras)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        _check_out(args)
        _check_names(args)
        device, dtype = getattr(args, "device", None), getattr(args, "dtype", None)
        if device is None and dtype is None:
            status = int(args.func(args) or 0)
        else:
            from attnres_probe import placement

            with placement.use(device, dtype):  # --device / --dtype for every model the command loads
                status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at exit
        return status
    except (UserError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError) as exc:
        print(f"attnres-probe {args.command}: error: {cli_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except OSError as exc:  # a full or read-only disk, a locked destination: one line, no traceback
        print(f"attnres-probe {args.command}: error: {cli_message(exc)}", file=sys.stderr)
        return 2

