"""``attnres-probe corpus``: record a corpus through several models and write the aggregates.

    attnres-probe corpus --demo --data notes/ --out runs/corpus
    attnres-probe corpus --models runs/prenorm runs/block --data book.txt --out runs/corpus

``--data`` is a UTF-8 text file (one document) or a folder (every non-hidden file below it, in
sorted order, one document each); every file is checked before any model runs. Each model
records every document in ``n_ctx``-token windows and its aggregates go into
``OUT/models/<name>/``; ``OUT/corpus.json`` says what was recorded from what
(:mod:`attnres_probe.corpus.record`, :mod:`attnres_probe.corpus.run`).

The run is resumable: progress is saved every ``--save-every`` seconds and when a model
finishes; running the same command again continues where it stopped. A folder holding a run
over other data, other models or other settings is refused with the reason. When every model is
done, ``OUT/comparison.csv`` holds :func:`attnres_probe.metrics.compare` of them all and
``OUT/documents.csv`` which documents drive its verdicts. Under
``torchrun -m attnres_probe.cli corpus`` the ranks share the documents.

``attnres-probe dash --stats OUT`` and ``attnres-probe report --stats OUT`` show the result.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from attnres_probe.cli import add_placement_args, arg_range
from attnres_probe.corpus.run import COMPARISON_FILE, DOCUMENTS_FILE
from attnres_probe.demo_recipe import DEMO_NAMES
from attnres_probe.validate import MAX_RESAMPLES

__all__ = ["add_corpus_parser"]


def add_corpus_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "corpus",
        help="record a corpus through models: per-window metrics, intervals, verdicts",
        description=(
            "Record every document of --data through each model (n_ctx-token windows, one backward pass per window) "
            "and write mergeable aggregates plus every window's headline metrics into --out. Resumable: run the "
            "same command again to continue. Show the result with `attnres-probe dash --stats OUT` or "
            "`attnres-probe report --stats OUT --out report.html`."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--models", nargs="+", metavar="DIR",
                     help="model folders: ours (config.json + model.safetensors) or checkpoints of the families of README's Model families table "
                          "(fla, Qwen3-AttnRes, nanogpt, LR-AttnRes)")
    src.add_argument("--demo", nargs="*", choices=DEMO_NAMES, metavar="NAME",
                     help=f"bundled demo models: {', '.join(DEMO_NAMES)} (bare --demo: all of them)")
    p.add_argument("--data", required=True, metavar="FILE|DIR", help="a UTF-8 text file, or a folder of them (one document per file)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the run (new, empty, or an unfinished run to resume)")
    p.add_argument("--names", nargs="+", metavar="NAME", help="one label per model (default: folder names)")
    p.add_argument("--batch-size", type=arg_range("int", 1, 4096), default=8,
                   help="windows per forward pass without gradients (default: %(default)s)")
    p.add_argument("--no-backward", action="store_true", help="skip the backward passes (no gradient metrics)")
    p.add_argument("--save-every", type=arg_range("float", 0, 1e6), default=30.0, metavar="SECONDS",
                   help="save progress this often (default: %(default)s)")
    p.add_argument("--resamples", type=arg_range("int", 1, MAX_RESAMPLES), default=1000,
                   help="bootstrap resamples of comparison.csv and of documents.csv's verdicts over every "
                        "document (default: %(default)s; each leave-one-document-out interval uses at most 200)")
    p.add_argument("--seed", type=arg_range("int", 0, 2**32 - 1), default=0, help="bootstrap seed (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (running the same command again does too; this flag also refuses to start a new one)")
    add_placement_args(p)
    p.set_defaults(func=_run_corpus)
    return p


def _stopped_by_torchrun(rank: int) -> None:
    """torchrun stops the other ranks when one fails: say so once (rank 0), then exit as SIGTERM would."""
    if rank == 0:
        print("attnres-probe corpus: error: stopped by torchrun because another rank stopped (its report below names "
              "the rank and the cause); no result was written (rerun with --resume to continue)", file=sys.stderr, flush=True)
    os._exit(143)


def _run_corpus(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size is {args.batch_size}; need at least 1")
    if args.resamples < 1:
        raise ValueError(f"--resamples is {args.resamples}; need at least 1")
    from attnres_probe.corpus.distributed import DistributedRunError, in_torchrun
    from attnres_probe.corpus.record import record_corpus

    t0 = time.perf_counter()
    rank = int(os.environ.get("RANK", "0")) if in_torchrun() else 0
    if in_torchrun():
        signal.signal(signal.SIGTERM, lambda *_: _stopped_by_torchrun(rank))
    try:
        manifest = record_corpus(
            args.data, args.out, models=args.models, demo=args.demo, names=args.names, batch_size=args.batch_size,
            backward=not args.no_backward, save_every=args.save_every, progress=not args.no_progress,
            n_resamples=args.resamples, seed=args.seed, resume=args.resume,
        )
    except DistributedRunError as exc:  # every rank raises it; rank 0 says it, once
        if rank == 0:
            print(f"attnres-probe corpus: error: {exc}", file=sys.stderr)
        return 1
    except ValueError:  # found alike on every rank after the merge (e.g. no window at all): rank 0 says it
        if rank == 0:
            raise
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return 0
    plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
    for m in manifest["models"]:
        skipped = f", {plural(m['skipped'], 'window')} under two tokens left out" if m.get("skipped") else ""
        print(f"{m['name']}: {plural(m['windows'], 'window')}, {plural(m['tokens'], 'token')}{skipped}")
    print(f"wrote {Path(args.out) / COMPARISON_FILE}, {DOCUMENTS_FILE} beside it and the aggregates in {args.out} "
          f"({time.perf_counter() - t0:.1f} s)")
    note = manifest.get("comparison", {}).get("note")
    if note:
        print(f"note: {note}", file=sys.stderr)
    return 0
