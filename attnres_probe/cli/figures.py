"""``attnres-probe figures``: the standard figures of a paper, as SVG, PDF or 300 dpi PNG at a column's width.

    attnres-probe figures --demo --out figs                         # 7 in wide SVGs
    attnres-probe figures --demo --size single --format pdf --out figs
    attnres-probe figures --models runs/prenorm runs/full runs/block --text "The cat sat" --out figs

One text is recorded through every model (one backward pass each) and the set of
:func:`attnres_probe.exports.standard_figures` is laid out for print (:func:`~attnres_probe.exports.for_print`)
and written with one kaleido process (:func:`~attnres_probe.exports.write_images`). Each file
written is printed on its own line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from attnres_probe.cli import UserError, add_placement_args, arg_range
from attnres_probe.demo_recipe import DEMO_NAMES

__all__ = ["add_figures_parser"]


def add_figures_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``figures`` subcommand (sets ``func``)."""
    from attnres_probe.exports import FORMATS, PAPER_WIDTH_IN, SIZES

    p = subparsers.add_parser(
        "figures",
        help="write the standard figures for a paper (SVG, PDF or 300 dpi PNG at a column's width)",
        description=(
            "Record one text through the models and write the figures of a paper into a folder: mean routing weights "
            "and mean contribution shares side by side, each model's shares minus the PreNorm baseline's, magnitudes "
            "and gradient norms by depth, and one token's routing. They are laid out for print at a single column "
            f"({PAPER_WIDTH_IN['single']} in, one model per heatmap) or across the page ({PAPER_WIDTH_IN['double']} in, "
            "the models side by side, three to a row from four models on: six fit within 9 in): fonts in points, every label measured "
            "so that none overlaps another."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--demo", nargs="*", choices=DEMO_NAMES, metavar="NAME",
                     help=f"bundled demo models: {', '.join(DEMO_NAMES)} (bare --demo: all of them)")
    src.add_argument("--models", nargs="+", metavar="DIR",
                     help="model folders: ours (config.json + model.safetensors) or checkpoints of the families of README's Model families table "
                          "(fla, Qwen3-AttnRes, nanogpt, LR-AttnRes)")
    p.add_argument("--names", nargs="+", metavar="NAME", help="one label per --models folder (default: the folders' names)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", help="the text to record (default: a held-out passage of a play, the one `record` uses); \\n and \\t stand for a "
                                     "newline and a tab")
    text.add_argument("--file", metavar="PATH", help="read the text from a UTF-8 file")
    p.add_argument("--truncate", action="store_true", help="keep the first n_ctx tokens of a longer text")
    p.add_argument("--token", type=arg_range("int", -10**6, 10**6), default=None, metavar="N",
                   help="the token whose routing the last figure shows (negative counts from the end; default: the one "
                        "whose depth weights depart furthest from uniform, as the dashboard opens on)")
    p.add_argument("--size", choices=SIZES, default="double",
                   help=f"single: one column, {PAPER_WIDTH_IN['single']} in wide; double: the page, "
                        f"{PAPER_WIDTH_IN['double']} in wide (default: %(default)s)")
    p.add_argument("--format", choices=FORMATS, default="svg", dest="fmt",
                   help="svg and pdf (vector, the size in inches) or png (300 dpi) (default: %(default)s)")
    p.add_argument("--no-title", action="store_true", help="leave each figure's title out (for a caption instead)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write into (created if missing)")
    p.add_argument("--force", action="store_true", help="replace figures already in --out (default: refuse)")
    add_placement_args(p)
    p.set_defaults(func=run_figures)
    return p


def _check_out(out: Path) -> None:
    """--out must be a folder or not exist yet."""
    from attnres_probe.io import special_kind

    kind = special_kind(out)
    if out.exists() and kind != "folder":
        what = "a file" if kind is None else f"a {kind}"
        raise UserError(f"--out {out} is {what}; pass a folder for the figures (it is created if missing)")


def _load(args: argparse.Namespace) -> tuple[list, list[str]]:
    """The models of --demo or --models, loaded, and their names."""
    from attnres_probe.loading import demo_source, load_model
    from attnres_probe.trace import unique_names

    if args.demo is not None:
        if args.names:
            raise UserError(f"--names applies to --models (the demo models are {', '.join(DEMO_NAMES)})")
        demo = list(args.demo or DEMO_NAMES)
        return [load_model(demo_source(n)) for n in demo], demo
    if args.names is not None and len(args.names) != len(args.models):
        raise UserError(f"--names gives {len(args.names)} names for {len(args.models)} --models folders: give one per folder")
    loaded = [load_model(d, flag="--models") for d in args.models]
    return loaded, unique_names(list(args.names) if args.names else [m.name for m in loaded])


def _refuse_existing(paths: list[Path], out: Path, force: bool) -> None:
    there = [p for p in paths if p.exists()]
    if there and not force:
        shown = ", ".join(str(p) for p in there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
        raise UserError(f"--out {out} already holds {shown}; pass --force to replace them, or choose another --out "
                        "(nothing was written)")


def _undo(files: list[Path], folders: list[Path]) -> None:
    """Remove the new ``files`` of a failed run, then the ``folders`` it made (deepest first) where empty."""
    for path in files:
        path.unlink(missing_ok=True)
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def run_figures(args: argparse.Namespace) -> int:
    """Body of ``attnres-probe figures``; returns the exit status."""
    from attnres_probe import exports
    from attnres_probe.cli.record import _text, _truncate
    from attnres_probe.io import say

    out = Path(args.out)
    _check_out(out)  # before the models run
    t0 = time.perf_counter()
    text = _text(args)
    loaded, names = _load(args)
    _refuse_existing([out / f"{stem}.{args.fmt}" for stem in exports.standard_stems(names, args.size)], out, args.force)
    say(f"recording the text through {len(loaded)} model{'s' if len(loaded) != 1 else ''} ...")
    traces = [m.probe(name).run(text, backward=True, truncate=_truncate(args)) for m, name in zip(loaded, names)]
    try:
        figs = exports.standard_figures(traces, args.size, token=args.token, title=not args.no_title,
                                        notes=lambda line: print(f"note: {line}", file=sys.stderr))
    except IndexError as exc:  # the --token: its message says the text's length
        raise UserError(f"--token {args.token}: {exc}") from None
    paths = {out / f"{name}.{args.fmt}": fig for name, fig in figs.items()}
    _refuse_existing(list(paths), out, args.force)
    made = [p for p in (out, *out.parents) if not p.exists()]  # the folders this run creates
    out.mkdir(parents=True, exist_ok=True)
    t1 = time.perf_counter()
    total = len(paths)
    done = [0]

    def progress(line: str) -> None:
        done[0] += 1
        say(f"figure {done[0]}/{total}: {line}")

    new = [p for p in paths if not p.exists()]
    try:
        written = exports.write_images(paths, args.fmt, progress=progress)
    except BaseException as exc:  # a full disk, no Chromium, Ctrl+C: nothing half-made stays
        _undo(new, made)
        if isinstance(exc, RuntimeError):  # no Chromium for kaleido
            raise UserError(str(exc)) from None
        if isinstance(exc, OSError):
            raise UserError(f"--out {out}: {exc.strerror or exc} while writing the figures; the ones this run wrote were "
                            f"removed{' with the folder it made' if made else ''} (nothing was kept)") from None
        raise
    for path in written:
        print(path)
    say(f"{len(written)} figures ({args.size} column, {args.fmt}) in {time.perf_counter() - t1:.1f} s "
        f"after recording for {t1 - t0:.1f} s")
    return 0
