"""Reproduction study: do the small demo models show the paper's diagnostics?

Loads (or trains) the three demo models, records a fixed validation set with the probe
(forward + backward), and writes into ``--out``:

- ``results.json``: every number below, per model, plus the verdict of each finding;
- ``study.md``: the table and the findings, stating plainly which reproduce;
- figures (PNG when kaleido is installed, else self-contained HTML): RMS of mixed inputs by
  depth, gradient norms by layer, locality and embedding retention by read, mean weight heatmaps.

    attnres-probe study --out docs/study
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnres_probe import figures, metrics
from attnres_probe.demo import DEMO_NAMES, demo_log, demo_validation_batches, load_demo
from attnres_probe.io import atomic_write
from attnres_probe.probe import Probe
from attnres_probe.trace import DepthTrace

__all__ = ["FINDINGS", "record_validation", "run_study", "study_numbers"]

N_WINDOWS = 16  # validation windows recorded per model (16 x 128 tokens)


def record_validation(name: str, n_windows: int = N_WINDOWS) -> DepthTrace:
    """Record the fixed validation windows of the shipped demo model ``name`` (forward + backward)."""
    model, _ = load_demo(name)
    batches = demo_validation_batches(demo_log(name))
    windows = torch.cat(batches)[:n_windows, :-1]  # (n, n_ctx): the inputs of the first windows
    return Probe(model, name=name).run(windows, backward=True)


def study_numbers(traces: dict[str, DepthTrace]) -> dict[str, dict[str, float]]:
    """Per model: the headline metrics the study reports."""
    out: dict[str, dict[str, float]] = {}
    for name, t in traces.items():
        s = metrics.summary(t)
        prof = metrics.read_profile(t)
        grads = np.asarray(t.param_grad, np.float64)
        half = len(grads) // 2
        row = {k: float(v) for k, v in s.items()}
        row["val_loss_shipped"] = float(demo_log(name)["shipped"]["val_loss"])
        row["param_grad_early_late"] = float(grads[:half].mean() / grads[half:].mean())
        act = prof["grad_in"].to_numpy()[:-1]
        row["act_grad_first_last"] = float(act[0] / act[-1]) if np.isfinite(act).all() else float("nan")
        rms = prof["rms_in"].to_numpy()[:-1]
        row["rms_in_max_over_min"] = float(rms.max() / rms.min())
        out[name] = row
    return out


# finding -> (statement, test on the numbers). Criteria are fixed in advance and principled:
# a direction (> 1, < baseline) or a comparison with a uniform mixture over the same sources.
FINDINGS: list[tuple[str, str, Any]] = [
    ("prenorm_magnitude_grows",
     "PreNorm: the hidden-state magnitude grows with depth (RMS growth last/first sublayer read > 1 and a "
     "positive slope of log RMS)",
     lambda n: n["prenorm"]["rms_in_growth"] > 1 and n["prenorm"]["rms_in_log_slope"] > 0),
    ("attnres_magnitude_bounded",
     "AttnRes: magnitudes stay bounded (growth ratio below PreNorm's, for Full and Block)",
     lambda n: max(n["full"]["rms_in_growth"], n["block"]["rms_in_growth"]) < n["prenorm"]["rms_in_growth"]),
    ("prenorm_early_activation_gradients_largest",
     "PreNorm: the earliest layers get the largest gradients at their inputs (activation-gradient norm at the "
     "first read over the last sublayer read > 1)",
     lambda n: n["prenorm"]["act_grad_first_last"] > 1),
    ("prenorm_early_parameter_gradients_largest",
     "PreNorm: the earliest layers get the largest parameter gradients (mean parameter-gradient norm of the "
     "first half of sublayers over the second half > 1)",
     lambda n: n["prenorm"]["param_grad_early_late"] > 1),
    ("block_gradients_more_uniform",
     "Block AttnRes: parameter gradients are more uniform across layers than PreNorm's (lower coefficient of "
     "variation of the per-sublayer gradient norms)",
     lambda n: n["block"]["param_grad_cv"] < n["prenorm"]["param_grad_cv"]),
    ("full_gradients_more_uniform",
     "Full AttnRes: parameter gradients are more uniform across layers than PreNorm's",
     lambda n: n["full"]["param_grad_cv"] < n["prenorm"]["param_grad_cv"]),
    ("full_mostly_local",
     "Full AttnRes: depth weights are mostly local (more mass on the most recent source AND a smaller expected "
     "depth distance than a uniform mixture over the same sources)",
     lambda n: n["full"]["locality_distance"] < n["full"]["uniform_distance"]
     and n["full"]["locality_recent_mass"] > n["full"]["uniform_recent_mass"]),
    ("block_mostly_local",
     "Block AttnRes: depth weights are mostly local (as above, against a uniform mixture over its sources)",
     lambda n: n["block"]["locality_distance"] < n["block"]["uniform_distance"]
     and n["block"]["locality_recent_mass"] > n["block"]["uniform_recent_mass"]),
    ("embedding_retained",
     "AttnRes: the embedding keeps weight deep into the network (mean embedding weight over the deepest half of "
     "reads at least a uniform share of those reads, for Full and Block)",
     lambda n: all(n[m]["embed_weight_deep"] >= n[m]["uniform_embed_deep"] for m in ("full", "block"))),
    ("block_loss_not_worse",
     "Block AttnRes: validation loss no worse than PreNorm's",
     lambda n: n["block"]["val_loss_shipped"] <= n["prenorm"]["val_loss_shipped"]),
    ("full_loss_not_worse",
     "Full AttnRes: validation loss no worse than PreNorm's",
     lambda n: n["full"]["val_loss_shipped"] <= n["prenorm"]["val_loss_shipped"]),
]


def uniform_reference(trace: DepthTrace) -> dict[str, float]:
    """What a uniform mixture over each read's available sources would score (reads with k >= 2).

    Returns expected depth distance mean((k-1)/2), recent mass mean(1/k), and the embedding's
    share 1/k averaged over the deepest half of reads (r >= floor(R/2)), matching metrics.summary.
    """
    k_all = np.isfinite(trace.depth_weights[0, 0]).sum(-1).astype(float)  # sources per read
    k = k_all[k_all >= 2]
    deep = k_all[len(k_all) // 2 :]
    return {
        "uniform_distance": float(np.mean((k - 1) / 2)),
        "uniform_recent_mass": float(np.mean(1 / k)),
        "uniform_embed_deep": float(np.mean(1 / deep)),
    }


def run_study(out: str | Path, n_windows: int = N_WINDOWS, images: str = "auto") -> dict[str, Any]:
    """Record the demo models, compute the study's numbers and write results, page and figures."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    traces = {name: record_validation(name, n_windows) for name in DEMO_NAMES}
    numbers = study_numbers(traces)
    for name, t in traces.items():
        if t.residual != "prenorm":
            numbers[name].update(uniform_reference(t))
    verdicts = {key: bool(test(numbers)) for key, _, test in FINDINGS}
    results = {
        "n_windows": n_windows,
        "tokens_per_model": int(traces["block"].n_tokens),
        "numbers": numbers,
        "verdicts": verdicts,
        "findings": {key: text for key, text, _ in FINDINGS},
    }
    atomic_write(out / "results.json", lambda p: p.write_text(json.dumps(results, indent=1) + "\n"))
    figs = _figures(list(traces.values()))
    written = _write_figures(figs, out, images)
    page = _page(results, written)
    atomic_write(out / "study.md", lambda p: p.write_text(page))
    return results


def _figures(traces: list[DepthTrace]) -> dict[str, Any]:
    return {
        "magnitudes": figures.magnitudes(traces),
        "gradients": figures.gradient_norms(traces),
        "mean_weights": figures.side_by_side([t for t in traces if t.residual != "prenorm"], "mean_heatmap"),
        "mean_contrib": figures.side_by_side(traces, "mean_heatmap", kind="contrib"),
        "embedding_per_token": figures.side_by_side([t for t in traces if t.residual != "prenorm"], "source_heatmap"),
    }


def _write_figures(figs: dict[str, Any], out: Path, images: str) -> dict[str, str]:
    use_png = images == "png"
    if images == "auto":
        try:
            import kaleido  # noqa: F401

            use_png = True
        except ImportError:
            use_png = False
    written = {}
    for name, fig in figs.items():
        if use_png:
            fig.write_image(out / f"{name}.png", width=1100, height=520, scale=1)
            written[name] = f"{name}.png"
        else:
            fig.write_html(out / f"{name}.html", include_plotlyjs=True, full_html=True)
            written[name] = f"{name}.html"
    return written


ROWS = [
    ("val_loss_shipped", "validation loss (shipped fp16 weights)"),
    ("rms_in_growth", "RMS growth of mixed inputs, last/first sublayer read"),
    ("rms_in_log_slope", "slope of log RMS per read"),
    ("rms_in_max_over_min", "max/min RMS over sublayer reads"),
    ("param_grad_cv", "parameter-gradient CV across sublayers"),
    ("param_grad_max_min", "parameter-gradient max/min"),
    ("param_grad_early_late", "parameter-gradient first half / second half"),
    ("act_grad_cv", "activation-gradient CV across reads"),
    ("act_grad_first_last", "activation gradient, first read / last sublayer read"),
    ("locality_distance", "expected depth distance (mean over reads)"),
    ("locality_recent_mass", "mass on the most recent source"),
    ("embed_weight_deep", "embedding weight, deepest half of reads"),
    ("embed_contrib_deep", "embedding contribution share, deepest half"),
    ("mean_entropy", "normalised entropy of the routing"),
]


def _fmt(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.4g}"


def _page(results: dict[str, Any], figs: dict[str, str]) -> str:
    n = results["numbers"]
    lines = [
        "# Reproduction study: the paper's diagnostics on the demo models",
        "",
        "Generated by `attnres-probe study --out docs/study` from the shipped demo models "
        f"(PreNorm, Full, Block; identical config, seed, data and steps), recording {results['n_windows']} fixed "
        f"validation windows ({results['tokens_per_model']} tokens) per model with forward and backward passes. "
        "For PreNorm, routing metrics use contribution shares (its coefficients are all 1).",
        "",
        "| metric | " + " | ".join(DEMO_NAMES) + " |",
        "|---|" + "---|" * len(DEMO_NAMES),
    ]
    for key, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(_fmt(n[m].get(key)) for m in DEMO_NAMES) + " |")
    lines += [
        "",
        "A uniform mixture over each read's sources would give: "
        + "; ".join(
            f"{m}: expected distance {_fmt(n[m]['uniform_distance'])}, recent mass "
            f"{_fmt(n[m]['uniform_recent_mass'])}, embedding share (deepest half) {_fmt(n[m]['uniform_embed_deep'])}"
            for m in ("full", "block")
        )
        + ".",
        "",
        "## Findings",
        "",
    ]
    for key, text in results["findings"].items():
        mark = "reproduced" if results["verdicts"][key] else "NOT reproduced"
        lines.append(f"- **{mark}**: {text}.")
    lines += ["", "## Figures", ""]
    for name, file in figs.items():
        title = name.replace("_", " ")
        lines.append(f"![{title}]({file})" if file.endswith(".png") else f"- [{title}]({file})")
        lines.append("")
    return "\n".join(lines) + "\n"


def add_study_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("study", help="run the reproduction study on the bundled demo models")
    p.add_argument("--out", default="docs/study", help="output folder (default: %(default)s)")
    p.add_argument("--windows", type=int, default=N_WINDOWS, help="validation windows per model")
    p.add_argument("--images", choices=("auto", "png", "html"), default="auto")
    p.set_defaults(func=lambda a: _run(a))
    return p


def _run(args: argparse.Namespace) -> int:
    results = run_study(args.out, args.windows, args.images)
    for key, ok in results["verdicts"].items():
        print(f"{'reproduced    ' if ok else 'NOT reproduced'}  {key}")
    print(f"wrote {Path(args.out) / 'study.md'}")
    return 0
