"""The ``attnres-probe`` command line: ``train``, ``record``, ``summary``, ``dash``, ``report``, ``demo``.

Each subcommand lives beside the code it drives and registers itself through an
``add_*_parser(subparsers)`` function; this module only assembles them. Errors a user can fix
print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from attnres_probe._version import __version__

# (module, function) pairs that each add one subcommand; optional ones are skipped if absent.
SUBCOMMANDS: list[tuple[str, str]] = [
    ("attnres_probe.train", "add_train_parser"),
    ("attnres_probe.commands", "add_record_parser"),
    ("attnres_probe.commands", "add_summary_parser"),
    ("attnres_probe.dashboards.cli", "add_dash_parser"),
    ("attnres_probe.reports.cli", "add_report_parser"),
    ("attnres_probe.commands", "add_demo_parser"),
    ("attnres_probe.demo", "add_demo_models_parser"),
    ("attnres_probe.study", "add_study_parser"),
]


class UserError(Exception):
    """An error caused by the command's arguments; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnres-probe",
        description="See how Attention Residuals transformers route information across depth.",
    )
    parser.add_argument("--version", action="version", version=f"attnres-probe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, func in SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue  # this subcommand's module is not part of this build
            raise
        add = getattr(mod, func, None)
        if add is not None:
            add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at exit
        return status
    except (UserError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        print(f"attnres-probe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
