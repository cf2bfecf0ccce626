"""``attnres-probe record`` and ``attnres-probe summary``: one text through one model.

    attnres-probe record --model runs/block --text "The cat sat" --out traces/block
    attnres-probe summary --demo full
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from attnres_probe.cli import add_placement_args, unescape_text
from attnres_probe.demo_recipe import DEMO_NAMES
from attnres_probe.texts import SHORT_TEXT

# the rules whose depth weights are free coefficients (signed, not summing to one): the summary shows
# them normalised, as shares of the read (attnres_probe.analysis.windows.normalised_weights)
COEFFICIENT_RULES = ("hyper", "denseformer")

# Short enough (under 128 bytes) for the demo models' context; with another model the default
# is cut to its context, while a text the user gives is never cut without --truncate.
DEFAULT_TEXT = SHORT_TEXT  # a held-out passage of a play (attnres_probe.texts): in the demo models' domain, unseen


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR",
                     help="a model folder: ours (config.json + model.safetensors) or a checkpoint of a public family "
                          "(fla, Qwen3-AttnRes, nanogpt, LR-AttnRes)")
    src.add_argument("--demo", choices=DEMO_NAMES, help="a bundled demo model (default: block)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", help="the text to record (default: a short held-out passage of a play, in the demo models' domain); "
                                     "\\n and \\t stand for a newline and a tab")
    text.add_argument("--file", metavar="PATH", help="read the text from a UTF-8 file")
    p.add_argument("--truncate", action="store_true", help="keep the first n_ctx tokens of a longer text")


def _load(args: argparse.Namespace):
    """The model of ``--model DIR`` or ``--demo NAME`` (default: the block demo model) as a loaded model."""
    from attnres_probe.loading import demo_source, load_model

    if args.model:
        return load_model(args.model, flag="--model")
    return load_model(demo_source(args.demo or "block"))


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
    return unescape_text(args.text) if args.text is not None else DEFAULT_TEXT


def _truncate(args: argparse.Namespace) -> bool:
    """Cut the text to the context: on request, or when it is the built-in default."""
    return bool(args.truncate) or (args.text is None and not getattr(args, "file", None))


def layer_summary(trace) -> pd.DataFrame:
    """One row per read: RMS of the mixed input, gradient norm, embedding weight/share, top source.

    The weights are the depth weights averaged over the real tokens; for Hyper-Connections and
    DenseFormer, whose coefficients need not sum to one, each token's coefficients are first
    normalised to shares of its read (so every read's weights sum to one)."""
    w = trace.weights().to_numpy()  # (R, S) the normalised weights (c / sum c for coefficients), mean over tokens
    c = trace.weights(kind="contrib").to_numpy()
    use = c if trace.residual == "prenorm" else w
    top = [trace.source_labels[int(np.nanargmax(row))] if np.isfinite(row).any() else "" for row in use]
    m = trace.mask
    return pd.DataFrame(
        {
            "rms_in": np.nanmean(np.where(m[..., None], trace.rms_in, np.nan), axis=(0, 1)),
            "grad_in": np.nanmean(np.where(m[..., None], trace.grad_in, np.nan), axis=(0, 1)) if trace.has_gradients else np.nan,
            "embed_weight": w[:, 0],  # the normalised weight every page shows (PreNorm: its implied 1/k)
            "embed_share": c[:, 0],
            "top_source": top,
        },
        index=pd.Index(trace.read_labels, name="read"),
    )


def _say_memory(probe, text: str, backward: bool, threshold: float = 256e6) -> None:
    """Before a recording that needs more than ``threshold`` bytes, say about how much, by part."""
    try:
        n = min(int(probe.encode(text).numel()), probe.spec.n_ctx)
    except Exception:  # the recording itself reports an unreadable text
        return
    est = probe.memory_estimate(n, backward=backward)
    if est["total"] >= threshold:
        parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in est.items() if k != "total" and v)
        _say(f"this recording needs about {est['total'] / 1e9:.1f} GB ({parts} GB; {n} tokens)")


def _say(msg: str) -> None:
    """A step that takes seconds says so on stderr where a person watches (:func:`attnres_probe.io.say`)."""
    from attnres_probe.io import say

    say(msg)


def _windowed(probe, text: str, args: argparse.Namespace):
    """A text longer than the context recorded as ``report`` records it: in context-sized windows, one
    sequence each (``reports.recording.record_text``), and said; None for a text that fits, with
    ``--truncate``, or where the report package is not installed (the length is then refused)."""
    if _truncate(args):
        return None
    try:
        n = int(probe.encode(text).numel())
    except Exception:  # the recording itself reports an unreadable text
        return None
    if n <= probe.spec.n_ctx:
        return None
    try:
        from attnres_probe.reports.recording import MAX_TOKENS, record_text
    except ImportError:
        return None
    if n > MAX_TOKENS:
        return None  # the recording refuses it with its own message (and --truncate)
    k = -(-n // probe.spec.n_ctx)
    print(f"the text is {n} tokens, longer than the context ({probe.spec.n_ctx}): recorded as {k} windows of up to "
          f"{probe.spec.n_ctx} tokens, one sequence each, as `report` does (--truncate keeps the first {probe.spec.n_ctx})",
          file=sys.stderr)
    return record_text(probe.model, text, tokenizer=probe.tokenizer, name=probe.name, backward=not args.no_backward)


def _run_record(args: argparse.Namespace) -> int:
    from attnres_probe.trace import check_save_target

    check_save_target(args.out, overwrite=args.force)  # before the model runs: fail fast
    loaded = _load(args)
    probe = loaded.probe()
    text = _text(args, probe.spec.n_ctx)
    _say_memory(probe, text, not args.no_backward)
    _say(f"recording the text through {probe.name} (one forward and backward pass) ...")
    trace = _windowed(probe, text, args) or probe.run(text, backward=not args.no_backward, truncate=_truncate(args))
    trace.meta["weights_sha256"] = loaded.digest  # the model's one digest, as reports show it
    out = trace.save(args.out, overwrite=args.force)
    print(repr(trace))
    print(f"saved to {out}")
    return 0


def _run_summary(args: argparse.Namespace) -> int:
    probe = _load(args).probe()
    _say(f"recording the text through {probe.name} (one forward and backward pass) ...")
    trace = probe.run(_text(args, probe.spec.n_ctx), backward=not args.no_backward, truncate=_truncate(args))
    print(repr(trace))
    with pd.option_context("display.width", 120, "display.float_format", "{:.4g}".format):
        print(layer_summary(trace).to_string())
    print(SUMMARY_UNITS)
    return 0


SUMMARY_UNITS = ("units, per read (mean over the text's tokens): rms_in = RMS of the mixed input h (model units); grad_in = "
                 "‖dL/dh‖ (loss per unit of h); embed_weight = the embedding's normalised weight (fraction of the read; "
                 "uniform is 1/k); embed_share = its contribution share (fraction of ‖h‖²); top_source = the source with "
                 "the largest weight")


def add_record_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("record", help="record a text through a model and save the DepthTrace")
    _add_model_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder for the trace (Parquet + JSON)")
    p.add_argument("--force", action="store_true", help="replace the trace already saved in --out")
    p.add_argument("--no-backward", action="store_true", help="skip the backward pass (no gradient norms)")
    add_placement_args(p)
    p.set_defaults(func=_run_record)
    return p


def add_summary_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "summary", help="print a per-layer summary of a model on a text",
        description="Print one row per read (L0.attn ... final), averaged over the text's tokens: rms_in, the RMS of "
                    "the read's mixed input h; grad_in, the norm of the loss gradient at h; embed_weight, the "
                    "embedding's normalised depth weight (AttnRes: its softmax weight α; mHC, DenseFormer: its "
                    "coefficient over the read's sum, c/Σc; empty for PreNorm, whose weights are 1/k); embed_share, "
                    "the embedding's contribution share of h; top_source, the source with the most weight (PreNorm: "
                    "the largest share).")
    _add_model_args(p)
    p.add_argument("--no-backward", action="store_true", help="skip the backward pass (no gradient norms; allows 1-token texts)")
    add_placement_args(p)
    p.set_defaults(func=_run_summary)
    return p
