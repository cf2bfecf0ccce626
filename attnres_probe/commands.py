"""CLI subcommands that drive the probe: ``record``, ``summary`` and ``demo``."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from attnres_probe.validate import arg_range

# Short enough (under 128 bytes) for the demo models' context; with another model the default
# is cut to its context, while a text the user gives is never cut without --truncate.
DEFAULT_TEXT = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="a model folder: ours (config.json + model.safetensors) or a flash-linear-attention checkpoint")
    src.add_argument("--demo", choices=("prenorm", "full", "block"), help="a bundled demo model (default: block)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", help="the text to record (default: a short Python function); \\n and \\t stand for a newline and a tab")
    text.add_argument("--file", metavar="PATH", help="read the text from a UTF-8 file")
    p.add_argument("--truncate", action="store_true", help="keep the first n_ctx tokens of a longer text")


def _load(args: argparse.Namespace):
    from attnres_probe import Probe
    from attnres_probe.demo import load_demo
    from attnres_probe.pretrained import load_model_folder, not_a_model_folder

    tokenizer = None
    if args.model:
        if not Path(args.model).is_dir():
            raise NotADirectoryError(not_a_model_folder("--model", args.model))
        model, tokenizer = load_model_folder(args.model)
        name = Path(args.model).name or model.cfg.residual
    else:
        name = args.demo or "block"
        model, _ = load_demo(name)
    return Probe(model, tokenizer=tokenizer, name=name)


TRUNCATE_READ = 1 << 20  # bytes of --file read with --truncate: far more than any context holds (64 bytes a token)


def _text(args: argparse.Namespace, n_ctx: int | None = None) -> str:
    if getattr(args, "file", None):
        path = Path(args.file)
        if not path.is_file():
            raise FileNotFoundError(f"--file {path} does not exist or is not a file")
        # with --truncate only the start is kept: read no more of the file than the context can hold
        limit = max(TRUNCATE_READ, 64 * n_ctx) if (getattr(args, "truncate", False) and n_ctx) else None
        with path.open("rb") as f:
            raw = f.read() if limit is None else f.read(limit)
        cut = limit is not None and len(raw) == limit
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if cut and exc.start >= len(raw) - 3:  # the read stopped inside a character
                return raw[: exc.start].decode("utf-8")
            raise ValueError(f"--file {path} is not UTF-8 text: {exc.reason} at byte {exc.start}; convert it first, e.g. "
                             f"`iconv -f latin1 -t utf-8 {path} > converted.txt`") from None
    from attnres_probe.cli import unescape_text

    return unescape_text(args.text) if args.text is not None else DEFAULT_TEXT


def _truncate(args: argparse.Namespace) -> bool:
    """Cut the text to the context: on request, or when it is the built-in default."""
    return bool(args.truncate) or (args.text is None and not getattr(args, "file", None))


def layer_summary(trace) -> pd.DataFrame:
    """One row per read: RMS of the mixed input, gradient norm, embedding weight/share, top source."""
    w = trace.weights().to_numpy()  # (R, S) mean over tokens
    c = trace.weights(kind="contrib").to_numpy()
    use = c if trace.residual == "prenorm" else w
    top = [trace.source_labels[int(np.nanargmax(row))] if np.isfinite(row).any() else "" for row in use]
    m = trace.mask
    return pd.DataFrame(
        {
            "rms_in": np.nanmean(np.where(m[..., None], trace.rms_in, np.nan), axis=(0, 1)),
            "grad_in": np.nanmean(np.where(m[..., None], trace.grad_in, np.nan), axis=(0, 1)) if trace.has_gradients else np.nan,
            "embed_weight": w[:, 0] if trace.residual != "prenorm" else np.nan,
            "embed_share": c[:, 0],
            "top_source": top,
        },
        index=pd.Index(trace.read_labels, name="read"),
    )


def _say(msg: str) -> None:
    """A step that takes seconds says so on stderr where a person watches (:func:`attnres_probe.io.say`)."""
    from attnres_probe.io import say

    say(msg)


def _run_record(args: argparse.Namespace) -> int:
    from attnres_probe.trace import check_save_target

    check_save_target(args.out, overwrite=args.force)  # before the model runs: fail fast
    probe = _load(args)
    _say(f"recording the text through {probe.name} (one forward and backward pass) ...")
    trace = probe.run(_text(args, probe.spec.n_ctx), backward=not args.no_backward, truncate=_truncate(args))
    from attnres_probe.reports.recording import weights_sha256

    trace.meta["weights_sha256"] = weights_sha256(probe.model)  # the model's one digest, as reports show it
    out = trace.save(args.out, overwrite=args.force)
    print(repr(trace))
    print(f"saved to {out}")
    return 0


def _run_summary(args: argparse.Namespace) -> int:
    probe = _load(args)
    _say(f"recording the text through {probe.name} (one forward and backward pass) ...")
    trace = probe.run(_text(args, probe.spec.n_ctx), backward=not args.no_backward, truncate=_truncate(args))
    print(repr(trace))
    with pd.option_context("display.width", 120, "display.float_format", "{:.4g}".format):
        print(layer_summary(trace).to_string())
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    if args.summary:
        from attnres_probe import metrics
        from attnres_probe.demo import DEMO_NAMES, load_demo
        from attnres_probe import Probe

        traces = []
        for name in DEMO_NAMES:
            model, _ = load_demo(name)
            traces.append(Probe(model, name=name).run(DEFAULT_TEXT, backward=True, truncate=True))
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
    from attnres_probe.dashboards.cli import run_demo

    return run_demo(host=args.host, port=args.port, open_browser=args.open)


def add_record_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("record", help="record a text through a model and save the DepthTrace")
    _add_model_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder for the trace (Parquet + JSON)")
    p.add_argument("--force", action="store_true", help="replace the trace already saved in --out")
    p.add_argument("--no-backward", action="store_true", help="skip the backward pass (no gradient norms)")
    p.set_defaults(func=_run_record)
    return p


def add_summary_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("summary", help="print a per-layer summary of a model on a text")
    _add_model_args(p)
    p.add_argument("--no-backward", action="store_true", help="skip the backward pass (no gradient norms; allows 1-token texts)")
    p.set_defaults(func=_run_summary)
    return p


def add_demo_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo", help="open the dashboard on the bundled demo models",
        description="Serve the dashboard on the three bundled demo models (PreNorm, Full and Block AttnRes: seed 0 of "
                    "study v3, 8 layers, 64 wide, byte tokens, trained on Shakespeare with whole plays held out), with "
                    "what five training seeds show beside them. --summary prints per-layer tables instead.")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    p.add_argument("--port", type=arg_range("int", 0, 65535), default=8050, help="port to serve on (default: %(default)s)")
    p.add_argument("--open", action="store_true", help="also open the page in a browser")
    p.add_argument("--summary", action="store_true", help="print per-layer summaries and metrics instead")
    p.set_defaults(func=_run_demo)
    return p
