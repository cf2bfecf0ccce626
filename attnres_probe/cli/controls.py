"""``attnres-probe controls``: the causal controls of depth routing on a model and a held-out text
(issue #49): static routing (the value of input-dependent routing) and attnres4babylm's masking
contrasts, with intervals over windows; a CSV of every window with ``--out``."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnres_probe.cli import UserError, add_placement_args, arg_range
from attnres_probe.demo_recipe import DEMO_RULES

__all__ = ["add_controls_parser"]

CONTROLS = ("static", "nonrecent", "random", "embed")


def add_controls_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "controls", help="causal controls of routing: static weights, masking old sources (loss changes with intervals)",
        description="Change the model's own forward and measure the loss on a held-out text: static (each read's "
                    "weights replaced by their mean over the text: the value of input-dependent routing; 0 exactly "
                    "where routing is static), nonrecent (attnres4babylm: drop the completed blocks of age >= 2 at every "
                    "read, with the contrast against as many random blocks), random, embed (drop the embedding). "
                    "Each number is a loss change (changed - unchanged) with its 95% interval over the text's windows.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--demo", choices=list(DEMO_RULES), metavar="NAME", help=f"a bundled demo model: {', '.join(DEMO_RULES)}")
    src.add_argument("--model", metavar="DIR", help="a model folder: ours or a checkpoint of a public family")
    p.add_argument("--data", metavar="PATH", help="the held-out text: a UTF-8 file or a folder of files (default for --demo: "
                   "the demo model's held-out validation text)")
    p.add_argument("--control", nargs="+", choices=CONTROLS, default=["static", "nonrecent"], metavar="NAME",
                   help=f"which controls ({', '.join(CONTROLS)}; default: static nonrecent)")
    p.add_argument("--repeats", type=arg_range("int", 1, 100), default=5, help="random draws for random and the contrast (default: %(default)s)")
    p.add_argument("--seed", type=arg_range("int", 0, 2**63 - 1), default=None, help="first random seed (default: upstream's 20260718)")
    p.add_argument("--max-windows", type=arg_range("int", 1, 100_000), default=64,
                   help="at most this many windows of the text, spread over it (default: %(default)s)")
    p.add_argument("--out", metavar="FILE", help="also write every window's loss changes as CSV")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (a regular file only)")
    add_placement_args(p)
    p.set_defaults(func=_run)
    return p


def _texts(args: argparse.Namespace, probe) -> list:
    """The held-out texts (strings), or for a demo model without --data its validation windows (token ids)."""
    from attnres_probe.corpus.documents import list_documents, read_document

    if args.data:
        return [read_document(d) for d in list_documents(args.data)]
    if not args.demo:
        raise UserError("--model needs --data: the held-out text to measure on (a file or a folder of files)")
    import torch

    from attnres_probe.demo import demo_log, demo_validation_batches

    return [w[:-1] for w in torch.cat(demo_validation_batches(demo_log(args.demo)))]


def _run(args: argparse.Namespace) -> int:
    import numpy as np
    import pandas as pd

    from attnres_probe.loading import demo_source, load_model
    from attnres_probe.probe import Probe

    if args.out and Path(args.out).exists() and not args.force:
        raise UserError(f"--out {args.out} already exists; pass --force to replace it, or choose another file (nothing was written)")
    loaded = load_model(demo_source(args.demo) if args.demo else args.model, flag=None if args.demo else "--model")
    probe = Probe(loaded.model, tokenizer=loaded.tokenizer, name=loaded.name)
    from attnres_probe.controls import text_windows

    windows = [w.reshape(-1) for _, w in text_windows(probe, _texts(args, probe))]  # each text cut at the context
    if len(windows) > args.max_windows:  # spread over the text
        keep = np.unique(np.linspace(0, len(windows) - 1, args.max_windows).round().astype(int))
        windows = [windows[i] for i in keep]
    texts = windows
    frames = []
    for control in args.control:
        try:
            res = probe.static_routing(texts) if control == "static" else probe.mask_sources(
                texts, which=control, seed=args.seed, repeats=args.repeats)
        except ValueError as exc:
            raise UserError(f"--control {control}: {exc}") from None
        print(res.summary())
        if res.reads is not None:
            worst = res.reads.reindex(res.reads["mean"].abs().sort_values(ascending=False).index).head(3)
            print("  the reads that change the loss most alone: " + ", ".join(f"{r.label} {r.mean:+.4g} [{r.low:+.4g}, {r.high:+.4g}]"
                                                              for r in worst.itertuples()))
        frames.append(res.windows.assign(control=res.control, unit=res.unit))
    if args.out:
        from attnres_probe.io import atomic_write

        frame = pd.concat(frames, ignore_index=True)
        atomic_write(Path(args.out), lambda p: frame.to_csv(p, index=False, float_format="%.9g"))
        print(f"wrote {args.out}")
    return 0
