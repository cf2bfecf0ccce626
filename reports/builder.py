"""build_report: one self-contained HTML file per study, readable offline in any browser.

The file holds plotly.js once (from the installed plotly package), every chart as JSON drawn by
``Plotly.newPlot`` (charts come from :mod:`attnres_probe.figures`, the same as the dashboard's),
and a per-token explorer that swaps precomputed values into each model's token heatmap with a
few lines of inline JavaScript: no server, no request to any host.

Escaping: the Jinja2 template autoescapes every string; JSON inside ``<script>`` tags has
``<``, ``>`` and ``&`` written as ``\\u003c``, ``\\u003e``, ``\\u0026``, so no token (say
``</script>``) can end a script early.

Size: the explorer stores, for every token and model, the weight, logit and contribution of each
available cell rounded to ``explorer_digits`` significant digits (unavailable trailing cells are
left out). Three 17-read demo models on 256 tokens add about 2 MB to plotly.js's 4.8 MB; their
attention patterns at the first 64 tokens (every layer and head, each row to 4 significant
digits of its largest weight: :mod:`attnres_probe.reports.patterns`) about 0.7 MB more.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import json
import math
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import plotly.offline
from markupsafe import Markup

from attnres_probe import figures, metrics
from attnres_probe._version import __version__
from attnres_probe.analysis.windows import informative_token
from attnres_probe.axis import rule_settings, rule_title
from attnres_probe.io import atomic_write
from attnres_probe.reports.patterns import explorer_pattern_items
from attnres_probe.trace import DepthTrace, unique_names

__all__ = [
    "ReportWriteError",
    "SECTIONS",
    "STATS_SECTIONS",
    "build_report",
    "build_stats_report",
    "render_report",
    "render_stats_report",
    "versions",
]

# section id -> heading, in page order ("ablation" only when ablation results are given)
SECTIONS: dict[str, str] = {
    "models": "Models",
    "text": "Text and tokens",
    "metrics": "Metrics: each model against the baseline",
    "heatmaps": "Mean depth routing",
    "magnitudes": "Magnitudes by depth",
    "gradients": "Gradient norms by depth",  # the chart's own title, and the corpus report's heading
    "explorer": "Per-token explorer",
    "over-training": "Routing over training",
    "ablation": "Ablation",
    "weight-effect": "Weight beside effect",
    "formulas": "Metric formulas",
    "reproduce": "Reproduce: versions and provenance",
}
WEIGHTS_DIGEST = "weights sha256 (fp32 state dict)"  # what every page calls the one digest of a model
PLOT_CONFIG = {"displaylogo": False, "responsive": True, "typesetMath": False}
# distribution names whose versions every report records
VERSION_PACKAGES = ("torch", "transformer_lens", "numpy", "pandas", "plotly", "dash", "jinja2")
KIND_ORDER = ("weights", "logits", "contrib")  # index into the explorer's per-cell triples
# the same words as the dashboard's "colour by:" control, which the PreNorm panels' notes name
EXPLORER_KINDS = {"auto": "auto (depth weights; PreNorm's implied weights 1/k)", "weights": "depth weights (α, or c/Σc)",
                  "contrib": "contribution share", "logits": "depth logits z"}


class ReportWriteError(OSError):
    """The report could not be written at the requested path (missing or read-only directory, ...)."""


# -- public ---------------------------------------------------------------------------------
def build_report(
    traces: Sequence[DepthTrace],
    path: str | Path,
    title: str = "attnres-probe report",
    ablations: pd.DataFrame | Mapping[str, pd.DataFrame] | None = None,
    *,
    text: str | None = None,
    description: str | None = None,
    ablation_read: str | None = None,
    explorer_tokens: int | None = 1024,
    explorer_digits: int = 4,
    command: str | None = None,
    readings: Mapping[str, dict] | None = None,
    histories: Mapping[str, Sequence[dict]] | None = None,
    weight_effects: Mapping[str, pd.DataFrame] | None = None,
) -> Path:
    """Write one self-contained HTML report on ``traces`` to ``path``, atomically.

    Args:
        traces: one trace per model, all of the same text ideally (the per-token explorer
            groups traces by identical token ids); a PreNorm trace, if any, is the baseline of
            the metric table.
        path: the ``.html`` file to write. Its directory must exist. The file is written to a
            temporary file beside it and renamed over ``path``, so a failed or interrupted
            export leaves an earlier file there untouched.
        title: page title and heading.
        ablations: results of :func:`attnres_probe.ablation.ablate` (``Probe.ablate``): one
            DataFrame (split by its ``model`` column if it has one) or ``{model name: frame}``.
        text: the text shown in the report (default: ``meta["text"]`` of the first trace, else
            the decoded tokens).
        description: a paragraph under the title.
        ablation_read: which read the ablation charts show (default ``"final"`` if ablated,
            else the last ablated read); the table lists every read.
        explorer_tokens: at most this many tokens (in order over the sequences) in the per-token
            explorer; None keeps all. Bounds the file size.
        explorer_digits: significant digits of the explorer's values.
        command: the command line that produced the report, shown under "Reproduce".
        readings: model name -> :func:`attnres_probe.reports.recording.record_readings` (the
            logit decomposition and logit lens per token, shown in the per-token explorer, and the
            attention patterns of its first tokens); without them the explorer says that saved
            traces hold no activations (and shows the attention patterns of traces recorded with
            ``patterns=True``).
        histories: run name -> routing probes of its training (``train --probe-every``), drawn
            by :func:`attnres_probe.figures.over_training`.
        weight_effects: model name -> :func:`attnres_probe.ablation.weight_beside_effect` (routing
            weight beside the loss change of removing each source, deep reads): a section with a
            summary row per model and :func:`attnres_probe.figures.weight_effect_chart`.

    Returns:
        The path written.

    Raises:
        ValueError: no traces, or ablation frames that are not ablation results.
        ReportWriteError: ``path``'s directory is missing or not writable, or ``path`` is a
            directory (the message names the path and what to do); nothing is changed on disk.
    """
    path = Path(path).expanduser()
    page = render_report(
        traces,
        title=title,
        ablations=ablations,
        text=text,
        description=description,
        ablation_read=ablation_read,
        explorer_tokens=explorer_tokens,
        explorer_digits=explorer_digits,
        command=command,
        readings=readings,
        histories=histories,
        weight_effects=weight_effects,
    )
    _write(path, page)
    return path


def render_report(
    traces: Sequence[DepthTrace],
    title: str = "attnres-probe report",
    ablations: pd.DataFrame | Mapping[str, pd.DataFrame] | None = None,
    *,
    text: str | None = None,
    description: str | None = None,
    ablation_read: str | None = None,
    explorer_tokens: int | None = 1024,
    explorer_digits: int = 4,
    command: str | None = None,
    readings: Mapping[str, dict] | None = None,
    histories: Mapping[str, Sequence[dict]] | None = None,
    weight_effects: Mapping[str, pd.DataFrame] | None = None,
) -> str:
    """The report's HTML as a string (what :func:`build_report` writes); same arguments."""
    traces = list(traces)
    if not traces:
        raise ValueError("build_report() needs at least one DepthTrace")
    for t in traces:
        if not isinstance(t, DepthTrace):
            raise TypeError(f"traces must be DepthTrace objects; got {type(t).__name__}")
    if explorer_tokens is not None and explorer_tokens < 1:
        raise ValueError(f"explorer_tokens is {explorer_tokens}; pass a positive count or None for all tokens")
    if not 1 <= explorer_digits <= 17:
        raise ValueError(f"explorer_digits is {explorer_digits}; accepted range is 1..17")
    names = unique_names([t.name for t in traces])
    plots = _Plots()
    created = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    vers = versions()
    models = [_model_row(t, n) for t, n in zip(traces, names)]
    shown_text = text if text is not None else _text_of(traces[0])
    ablation = _ablation_context(ablations, plots, ablation_read)
    effect = _weight_effect_context(weight_effects, plots)
    sections = {k: v for k, v in SECTIONS.items() if (k != "ablation" or ablation) and (k != "weight-effect" or effect)
                and (k != "over-training" or histories)}
    if not any(t.residual == "prenorm" for t in traces):  # nothing is compared with a baseline
        sections["metrics"] = "Metrics"
    provenance = {
        "title": title,
        "created": created.isoformat(),
        "command": command,
        "versions": vers,
        "text": shown_text,
        "models": [m["provenance"] for m in models],
    }
    ctx = {
        "title": title,
        "description": description,
        "created": created.strftime("%Y-%m-%d %H:%M UTC"),
        "version": __version__,
        "sections": sections,
        "models": models,
        "text": shown_text,
        "sequences": _token_rows(traces[0]),
        "mode": "trace",
        "metrics": _metrics_context(metrics.compare(*traces, names=names)),
        "heatmaps": [
            plots.add(figures.side_by_side(traces, "mean_heatmap", names=names, kind="weights")),
            plots.add(figures.side_by_side(traces, "mean_heatmap", names=names, kind="contrib")),
        ],
        "difference": _difference_context(_renamed(traces, names), plots),
        "magnitudes": plots.add(figures.magnitudes(_renamed(traces, names))),
        "gradients": plots.add(figures.gradient_norms(_renamed(traces, names))),
        "explorers": _explorers(traces, names, plots, explorer_tokens, explorer_digits, readings),
        "over_training": plots.add(figures.over_training(dict(histories))) if histories else None,
        "no_activations": None if readings else figures.NO_ACTIVATIONS_NOTE,
        "vocab_note": figures.VOCAB_ID_NOTE,
        "explorer_kinds": EXPLORER_KINDS,
        "ablation": ablation,
        "weight_effect": effect,
        "formulas": metrics.FORMULAS,
        "metric_labels": _metric_labels(),
        "versions": vers,
        "command": command,
        "provenance": json.dumps(provenance, indent=1, ensure_ascii=False, default=str),
        "plots": plots.items,
        "plot_config": _script_json(PLOT_CONFIG),
        "plotlyjs": Markup(_plotlyjs()),
    }
    return _template().render(**ctx)


# section id -> heading of a corpus report (build_stats_report)
STATS_SECTIONS: dict[str, str] = {
    "models": "Models and corpus",
    "metrics": "Comparisons: each model against the baseline, window by window",
    "heatmaps": "Mean depth routing over the corpus",
    "magnitudes": "Magnitudes by depth",
    "gradients": "Gradient norms by depth",
    "formulas": "Metric formulas",
    "reproduce": "Reproduce: versions and provenance",
}


def build_stats_report(
    stats: Mapping[str, Any],
    path: str | Path,
    title: str = "attnres-probe corpus report",
    *,
    description: str | None = None,
    manifest: Mapping[str, Any] | None = None,
    command: str | None = None,
    n_resamples: int = 1000,
    seed: int = 0,
) -> Path:
    """Write one self-contained HTML report on a recorded corpus (``attnres-probe corpus``), atomically.

    The page holds the headline comparisons (locality, embedding retention, gradient
    uniformity, magnitude growth: estimate, 95% interval over windows, the paper's direction
    and the verdict, exactly as :func:`attnres_probe.metrics.compare` gives them), every metric
    with its interval, mean heatmaps with per-cell spread, and depth profiles with bands.

    Args:
        stats: model name -> :class:`~attnres_probe.corpus.stats.CorpusStats`, in display order.
        path: the ``.html`` file to write (its directory must exist).
        manifest: the run's corpus.json (data and settings, shown under "Reproduce").
        n_resamples, seed: the bootstrap of the comparisons.

    Raises:
        ValueError: no stats.
        ReportWriteError: as :func:`build_report`.
    """
    path = Path(path).expanduser()
    page = render_stats_report(stats, title, description=description, manifest=manifest, command=command,
                               n_resamples=n_resamples, seed=seed)
    _write(path, page)
    return path


def render_stats_report(
    stats: Mapping[str, Any],
    title: str = "attnres-probe corpus report",
    *,
    description: str | None = None,
    manifest: Mapping[str, Any] | None = None,
    command: str | None = None,
    n_resamples: int = 1000,
    seed: int = 0,
) -> str:
    """The corpus report's HTML as a string (what :func:`build_stats_report` writes); same arguments."""
    if not stats:
        raise ValueError("build_stats_report() needs the stats of at least one model")
    names = list(stats)
    items = list(stats.values())
    plots = _Plots()
    created = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    vers = versions()
    frame = metrics.compare(*items, names=names, n_resamples=n_resamples, seed=seed)
    models = [_stats_model_row(s, n) for n, s in zip(names, items)]
    data = {k: public_path(v) if isinstance(v, str) and Path(v).is_absolute() else v
            for k, v in dict((manifest or {}).get("data") or {}).items()}
    data.pop("files", None)
    provenance = {"title": title, "created": created.isoformat(), "command": command, "versions": vers, "data": data,
                  "settings": (manifest or {}).get("settings"), "bootstrap": {"n_resamples": n_resamples, "seed": seed},
                  "models": [m["provenance"] for m in models]}
    ctx = {
        "mode": "corpus",
        "title": title,
        "description": description,
        "created": created.strftime("%Y-%m-%d %H:%M UTC"),
        "version": __version__,
        "sections": STATS_SECTIONS,
        "models": models,
        "corpus": data,
        "metrics": _metrics_context(frame),
        "documents": _documents_context(items, names, manifest, n_resamples, seed),
        "heatmaps": [
            plots.add(figures.corpus_side_by_side(items, "weights", names=names)),  # PreNorm's implied weights 1/k
            plots.add(figures.corpus_side_by_side(items, "contrib", names=names)),
            plots.add(figures.corpus_side_by_side(items, "contrib", names=names, value="sd")),
        ],
        "difference": _difference_context(_renamed([s.to_trace() for s in items], names), plots),
        "magnitudes": plots.add(figures.magnitude_bands(items, names)),
        "gradients": plots.add(figures.gradient_bands(items, names)),
        "formulas": metrics.FORMULAS,
        "metric_labels": _metric_labels(),
        "versions": vers,
        "command": command,
        "provenance": json.dumps(provenance, indent=1, ensure_ascii=False, default=str),
        "plots": plots.items,
        "plot_config": _script_json(PLOT_CONFIG),
        "plotlyjs": Markup(_plotlyjs()),
    }
    return _template().render(**ctx)


def _documents_context(items: list, names: list[str], manifest: Mapping[str, Any] | None, n_resamples: int,
                       seed: int) -> dict[str, Any] | None:
    """Which documents drive the verdicts (:func:`attnres_probe.analysis.documents.document_table` of
    :func:`~attnres_probe.analysis.documents.document_breakdown`, with the comparisons' resamples and seed, so its
    "every document" row holds their verdicts), documents named as corpus.json names them; None without comparisons."""
    from attnres_probe.analysis.documents import document_breakdown, document_table
    from attnres_probe.corpus.run import document_names

    frame = document_breakdown(*items, names=names, documents=document_names(dict(manifest)) if manifest else None,
                               n_resamples=n_resamples, seed=seed)
    table = document_table(frame)
    return table if table["columns"] else None


def _stats_model_row(stats: Any, name: str) -> dict[str, Any]:
    meta, cfg = stats.meta, dict(stats.meta.get("config") or {})
    residual = meta.get("residual", "?")
    arch = rule_title(residual, cfg)
    if residual == "block" and meta.get("block_starts"):
        arch += f" (blocks start at sublayers {', '.join(map(str, meta['block_starts']))})"
    if rule_settings(residual, cfg):
        arch += f" ({rule_settings(residual, cfg)})"
    keys = ("d_model", "n_layers", "n_heads", "n_ctx", "d_vocab")
    loss = metrics.summary(stats.to_trace())["mean_loss"]
    has_grads = bool(np.isfinite(stats.mean("grad_in")).any())
    n_params = meta.get("n_params")
    skipped = f"; {stats.n_skipped} shorter than two tokens left out" if stats.n_skipped else ""
    return {
        "name": name,
        "residual": residual,
        "architecture": arch,
        "shape": ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg),
        "n_params": f"{n_params:,}" if isinstance(n_params, int) else "—",
        "digest": meta.get("weights_sha256"),
        "digest_kind": WEIGHTS_DIGEST,
        "checkpoint_dir": public_path(meta.get("source")),
        "tokens": f"{stats.n_tokens} in {stats.n_windows} windows{skipped}",
        "mean_loss": "—" if not np.isfinite(loss) else f"{loss:.4f}",
        "gradients": "recorded (one backward pass per window)" if has_grads else "not recorded",
        "flags": [],
        "config_json": json.dumps(cfg, indent=1, sort_keys=True, default=str),
        "provenance": {"name": name, "residual": residual, "config": cfg, "source": public_path(meta.get("source")),
                       "weights_sha256": meta.get("weights_sha256"), "windows": stats.n_windows, "tokens": stats.n_tokens,
                       "skipped_windows": stats.n_skipped},
    }


def versions() -> dict[str, str]:
    """Versions of the toolkit, Python, plotly.js (embedded) and the libraries it runs on."""
    out = {"attnres_probe": __version__, "python": platform.python_version()}
    for name in VERSION_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["plotly.js (embedded)"] = plotly.offline.get_plotlyjs_version()
    return out


# -- writing --------------------------------------------------------------------------------
def _write(path: Path, page: str) -> None:
    parent = path.parent
    if path.is_dir():
        raise ReportWriteError(f"cannot write the report to {path}: it is a directory; pass a file path such as {path / 'report.html'}")
    if not parent.is_dir():
        raise ReportWriteError(
            f"cannot write the report to {path}: the directory {parent} does not exist "
            f"(create it first, e.g. `mkdir -p {parent}`, or choose another path)"
        )
    try:
        atomic_write(path, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ReportWriteError(
            f"cannot write the report to {path}: {reason} while writing in {parent} "
            "(make the directory writable or choose another path); any earlier file at that path is unchanged"
        ) from exc


# -- template and embedding -----------------------------------------------------------------
_ENV = None


def _template():
    global _ENV
    if _ENV is None:
        import jinja2

        _ENV = jinja2.Environment(
            loader=jinja2.PackageLoader("attnres_probe.reports", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
    return _ENV.get_template("report.html.j2")


_PLOTLYJS: str | None = None


def _plotlyjs() -> str:
    global _PLOTLYJS
    if _PLOTLYJS is None:
        js = plotly.offline.get_plotlyjs()
        if "</script" in js.lower():  # would end the inline script early
            raise RuntimeError("the installed plotly.js contains '</script'; it cannot be inlined")
        _PLOTLYJS = js
    return _PLOTLYJS


def _script_json(obj: Any) -> Markup:
    """JSON safe inside ``<script type="application/json">``: <, >, & and line separators escaped."""
    s = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        s = s.replace(ch, esc)
    return Markup(s)


class _Plots:
    """Collects figures as embeddable JSON; ``add`` returns the item ({id, json, height}) a div draws."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(self, fig: go.Figure) -> dict[str, Any]:
        item = {
            "id": f"plot-{len(self.items)}",
            "json": _script_json(pio.to_json(fig, validate=False, remove_uids=True)),
            "height": int(fig.layout.height or 450),
        }
        self.items.append(item)
        return item


# -- sections -------------------------------------------------------------------------------
def _renamed(traces: list[DepthTrace], names: list[str]) -> list[DepthTrace]:
    """Traces whose ``name`` is the report's unique label (shallow copies; arrays shared)."""
    return [t if t.name == n else dataclasses.replace(t, meta={**t.meta, "name": n}) for t, n in zip(traces, names)]


def _difference_context(traces: list[DepthTrace], plots: _Plots) -> dict[str, Any] | None:
    """Each AttnRes model minus the baseline (the first PreNorm trace), mean contribution shares cell by
    cell (:func:`figures.difference_side_by_side`); None without a baseline or another model."""
    base = next((t for t in traces if t.residual == "prenorm"), None)
    others = [t for t in traces if t.residual != "prenorm"]
    if base is None or not others:
        return None
    same = [t for t in others if list(t.read_labels) == list(base.read_labels)]
    skipped = [t.name for t in others if t not in same]
    plot = plots.add(figures.difference_side_by_side(same, base, "contrib")) if same else None
    return {"baseline": base.name, "models": [t.name for t in same], "plot": plot, "skipped": skipped}


def _model_row(trace: DepthTrace, name: str) -> dict[str, Any]:
    meta, cfg = trace.meta, dict(trace.meta.get("config") or {})
    residual = trace.residual
    arch = rule_title(residual, cfg)
    if residual == "block" and trace.block_starts:
        arch += f" (blocks start at sublayers {', '.join(map(str, trace.block_starts))})"
    if rule_settings(residual, cfg):
        arch += f" ({rule_settings(residual, cfg)})"
    if meta.get("foreign"):
        arch += f" · {meta.get('model_class', 'external model')}"
    keys = ("d_model", "n_layers", "n_heads", "n_ctx", "d_vocab")
    shape = ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)
    if "weights_sha256" in meta:
        digest, digest_kind = meta["weights_sha256"], WEIGHTS_DIGEST
    elif "checkpoint_sha256" in meta:  # a trace recorded before the one digest: its file's hash
        digest, digest_kind = meta["checkpoint_sha256"], "model.safetensors file (older trace)"
    else:
        digest, digest_kind = None, "not recorded"
    s = trace.summary()
    n_params = meta.get("n_params")
    return {
        "name": name,
        "residual": residual,
        "architecture": arch,
        "shape": shape,
        "n_params": f"{n_params:,}" if isinstance(n_params, int) else "—",
        "digest": digest,
        "digest_kind": digest_kind,
        "checkpoint_dir": public_path(meta.get("checkpoint_dir")),
        "tokens": f"{s['tokens']} in {s['sequences']} sequence{'s' if s['sequences'] != 1 else ''}",
        "mean_loss": "—" if math.isnan(s["mean_loss"]) else f"{s['mean_loss']:.4f}",
        "gradients": "recorded" if s["gradients"] else "not recorded",
        "flags": list(s["flags"]),
        "config_json": json.dumps(cfg, indent=1, sort_keys=True, default=str),
        "provenance": {
            "name": name,
            "residual": residual,
            "config": cfg,
            "n_params": n_params,
            "checkpoint_dir": public_path(meta.get("checkpoint_dir")),
            "weights_sha256": meta.get("weights_sha256"),
            "windows": meta.get("windows"),
            "backward": meta.get("backward"),
            "depth_mixing": {"backend": meta.get("backend"), "schedule": meta.get("schedule")},
            "sequences": s["sequences"],
            "tokens": s["tokens"],
        },
    }


def _text_of(trace: DepthTrace) -> str:
    if isinstance(trace.meta.get("text"), str):
        return trace.meta["text"]
    cfg = trace.meta.get("config") or {}
    if cfg.get("d_vocab") == 256 and not trace.meta.get("foreign"):
        from attnres_probe.tokenizer import ByteTokenizer

        ids = [int(i) for row, m in zip(trace.tokens, trace.mask) for i in row[m]]
        return ByteTokenizer().decode(ids)
    return "".join(t for row in trace.str_tokens for t in row)


def _token_rows(trace: DepthTrace) -> list[list[dict[str, Any]]]:
    """Per sequence, one chip per real token: its explorer index, position and visible label."""
    rows, k = [], 0
    for b, toks in enumerate(trace.str_tokens):
        row = []
        for p, tok in enumerate(toks[: int(trace.mask[b].sum())]):
            row.append({"index": k, "pos": p, "label": figures.show_token(tok), "repr": repr(tok)})
            k += 1
        rows.append(row)
    return rows


METRICS_NOTE = (
    "Each model's value is the mean over windows with its 95% bootstrap interval (resampled {n_resamples} times, "
    "seed {seed}; the bootstrap resamples whole documents, since windows of one document are alike)."
)
COMPARISON_NOTE = (
    "Each model's routing is set against the uniform weights on its own sources (PreNorm's implied weights, "
    "grouped as the model groups them), and every other diagnostic against the PreNorm baseline's same quantity, on the "
    "same windows: a ratio (×) for spreads and growths, a difference (±) otherwise, with its interval. The verdict sets "
    "that interval against the paper's direction: consistent (the whole interval lies on the paper's side of no "
    "difference: zero for ±, one for ×), contrary (it lies wholly on the other side), inconclusive (it contains no "
    "difference, or there is no interval); no verdict "
    "where the paper states no direction, nor for Hyper-Connections or DenseFormer models (the paper's claims are about "
    "AttnRes; their estimates and intervals are shown)."
)
NO_BASELINE_NOTE = (
    "No PreNorm model is in this report, so nothing is compared with a baseline; routing is still set against the "
    "uniform weights on each model's own sources."
)


POOLED_REASON = "pooled value only"  # compare's note on a value with no per-window values (parameter gradients of one text)
POOLED_MARK = "†"
POOLED_TABLE_NOTE = ("(pooled): one value for the whole text, from one backward pass of the mean loss over all its windows; "
                     "per-window values need one backward pass per window.")


def _footnote_pooled(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The headline panel with the "pooled value only: …" reason said once per metric: each cell that
    gave it as its interval gets a :data:`POOLED_MARK` instead, and the metric a ``footnotes`` list
    with the reason once (the page shows it under that metric's table)."""
    for g in groups:
        for m in g["metrics"]:
            notes: list[str] = []
            for row in m["rows"]:
                for cell in (row, row.get("comparison")):
                    if cell is None:
                        continue
                    cell.setdefault("mark", "")
                    reason = str(cell.get("interval") or "")
                    if reason.startswith(POOLED_REASON):
                        cell["interval"], cell["mark"] = "", POOLED_MARK
                        if reason not in notes:
                            notes.append(reason)
            m["footnotes"] = [f"{POOLED_MARK} {n}" for n in notes]
    return groups


def _metrics_context(frame: pd.DataFrame) -> dict[str, Any]:
    """The headline panel and the full metric table of a :func:`metrics.compare` frame, as strings."""
    from attnres_probe.analysis.display import BASIS_NOTE, documents_warning, headline, shape_warning, table_rows, verdict_scope_note

    windows = {str(r["model"]): int(r["windows"])
               for _, r in frame[frame["comparison"] == "value"].groupby("model", sort=False).max().reset_index().iterrows()}
    has_baseline = frame.attrs.get("baseline") is not None
    note = METRICS_NOTE.format(n_resamples=frame.attrs.get("n_resamples", "?"), seed=frame.attrs.get("seed", "?"))
    table = table_rows(frame)
    return {
        "headline": _footnote_pooled(headline(frame)),
        "table": table,
        "pooled_note": POOLED_TABLE_NOTE if any("(pooled)" in c for r in table["rows"] for c in r["cells"]) else "",
        "has_baseline": has_baseline,
        "note": f"{note} {COMPARISON_NOTE if has_baseline else NO_BASELINE_NOTE}",
        "basis_note": " ".join(x for x in (BASIS_NOTE, verdict_scope_note(frame)) if x)
        if (frame["comparison"] != "value").any() else "",
        "documents": documents_warning(frame),
        "shape": shape_warning(frame),
        "one_window": max(windows.values(), default=0) <= 1,
    }


def _ablation_context(ablations: Any, plots: _Plots, read: str | None) -> list[dict[str, Any]]:
    if ablations is None:
        return []
    if isinstance(ablations, pd.DataFrame):
        if "model" in ablations.columns:
            frames = {str(k): v.drop(columns="model") for k, v in ablations.groupby("model", sort=False)}
        else:
            frames = {"ablation": ablations}
    elif isinstance(ablations, Mapping):
        frames = {str(k): v for k, v in ablations.items()}
    else:
        raise TypeError(f"ablations must be a DataFrame or a {{model name: DataFrame}} mapping; got {type(ablations).__name__}")
    out = []
    for name, frame in frames.items():
        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"ablations[{name!r}] is a {type(frame).__name__}; expected the DataFrame Probe.ablate returns")
        missing = [c for c in figures.ABLATION_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"ablations[{name!r}] lacks columns {missing}; pass what Probe.ablate returns")
        reads = list(dict.fromkeys(frame["read"]))
        chosen = read if read in reads else ("final" if "final" in reads else (reads[-1] if reads else None))
        fig = figures.ablation_chart(frame, read=chosen)
        fig.update_layout(title={"text": f"{name} · {fig.layout.title.text}"})
        cols = [str(c) for c in frame.columns]
        body = [[figures.format_value(v) for v in rec] for rec in frame.itertuples(index=False)]
        out.append({"name": name, "read": chosen, "plot": plots.add(fig), "columns": cols, "rows": body})
    return out


def _weight_effect_context(effects: Mapping[str, pd.DataFrame] | None, plots: _Plots) -> dict[str, Any] | None:
    if not effects:
        return None
    from attnres_probe.analysis.display import WEIGHT_EFFECT_NOTE, weight_effect_rows

    if not isinstance(effects, Mapping):
        raise TypeError(f"weight_effects must be a {{model name: DataFrame}} mapping; got {type(effects).__name__}")
    frames = {str(k): v for k, v in effects.items()}
    tokens = sorted({int(n) for f in frames.values() if (n := f.attrs.get("n_tokens"))})
    said = ("the first " + (f"{tokens[0]} tokens" if len(tokens) == 1 else " / ".join(map(str, tokens)) + " tokens")
            + " of the text (one context window)") if tokens else ""
    return {"note": WEIGHT_EFFECT_NOTE, "rows": weight_effect_rows(frames), "tokens": said,
            "plot": plots.add(figures.weight_effect_chart(frames))}


# -- per-token explorer ---------------------------------------------------------------------
def _num(v: float, digits: int) -> str:
    return f"{v:.{digits}g}" if math.isfinite(v) else "null"


def _explorers(
    traces: list[DepthTrace], names: list[str], plots: _Plots, limit: int | None, digits: int,
    readings: Mapping[str, dict] | None = None,
) -> list[dict[str, Any]]:
    """One explorer per group of traces with identical tokens; usually one for the whole report."""
    groups: dict[bytes, list[int]] = {}
    for i, t in enumerate(traces):
        key = t.mask.tobytes() + repr(t.mask.shape).encode() + np.where(t.mask, t.tokens, -1).tobytes()
        groups.setdefault(key, []).append(i)
    out = []
    for g, members in enumerate(groups.values()):
        first = traces[members[0]]
        positions = [(b, p) for b in range(first.tokens.shape[0]) for p in range(int(first.mask[b].sum()))]
        total = len(positions)
        if limit is not None:
            positions = positions[:limit]
        tokens = []
        for b, p in positions:
            tok = first.str_tokens[b][p] if p < len(first.str_tokens[b]) else ""
            tokens.append([b, p, repr(tok), figures.show_token(tok)])
        models = [_explorer_model(traces[i], names[i], positions, plots, digits) for i in members]
        reads = [_explorer_reading(readings[traces[i].name], names[i], positions, plots)
                 for i in members if readings and traces[i].name in readings]
        pats = explorer_pattern_items([traces[i] for i in members], [names[i] for i in members], readings, positions, plots,
                                      colors=figures.model_colors(names))  # attention patterns (reports/patterns.py)
        # open on the informative token of sequence 0 (as the dashboard does), among the tokens whose
        # readings are stored when there are readings (positions list sequence 0 first)
        stored = max((sum(t is not None for t in r["data"]["tokens"]) for r in reads), default=0)
        in_seq0 = sum(1 for b, _ in positions if b == 0)
        start, why = informative_token([traces[i] for i in members], limit=min(in_seq0, stored) if reads else in_seq0)
        data = (
            '{"start":' + str(start) + ',"tokens":' + json.dumps(tokens, ensure_ascii=False, separators=(",", ":"))
            + ',"kinds":' + json.dumps(list(KIND_ORDER), separators=(",", ":"))
            + ',"models":[' + ",".join(m["data"] for m in models) + "]"
            + ',"readings":' + json.dumps([r["data"] for r in reads], ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            + ',"patterns":[' + ",".join(p["data"] for p in pats) + "]}"
        )
        out.append(
            {
                "id": f"explorer-{g}",
                "names": [names[i] for i in members],
                "tokens": tokens,
                "total": total,
                "shown": len(positions),
                "plots": [m["plot"] for m in models],
                "reading_plots": [p for r in reads for p in r["plots"]],
                "reading_tokens": stored,
                "pattern_plots": [p["plot"] for p in pats],
                "pattern_tokens": max((p["n"] for p in pats), default=0),
                "pattern_layers": max((p["layers"] for p in pats), default=0),
                "pattern_heads": max((p["heads"] for p in pats), default=0),
                "start": start,
                "why": why,
                "data": _script_json(data),
            }
        )
    return out


def _r3(x: float) -> float | None:
    return float(f"{x:.3g}") if math.isfinite(x) else None


def _explorer_reading(reading: dict, name: str, positions: list[tuple[int, int]], plots: _Plots) -> dict:
    """The logit decomposition and logit lens of one model in the explorer: two plots drawn for the
    first token by :mod:`attnres_probe.figures`, and per token the values the page swaps in."""
    k, lens = reading["k"], reading["lens"]
    by_pos = dict(zip(reading["positions"], reading["contribs"]))
    first = reading["positions"][0]
    tok0 = by_pos[first].str_tokens[first] if first < len(by_pos[first].str_tokens) else None
    cfig = figures.logit_contributions_chart(by_pos[first], k=k, name=name)
    lfig = figures.logit_lens_chart(lens, first, name=name, token=tok0)
    cplot, lplot = plots.add(cfig), plots.add(lfig)
    reads = list(dict.fromkeys(lens["read"]))
    per_token = []
    for b, p in positions:
        if b != 0 or p not in by_pos:
            per_token.append(None)
            continue
        one = figures.logit_contributions_chart(by_pos[p], k=k, name=name).data[0]
        sub = lens[lens["position"] == p]
        lz = [[None] * k for _ in reads]
        lt = [[""] * k for _ in reads]
        for row in sub.itertuples(index=False):
            r = reads.index(row.read)
            lz[r][row.rank] = _r3(float(row.prob))
            lt[r][row.rank] = figures._vocab_label(str(row.token), int(row.token_id)) + (" ✓" if row.is_next else "")
        z = [[_r3(float(v)) for v in rowv] for rowv in np.asarray(one.z, dtype=float)]
        w = [_r3(float(v)) for v in np.asarray(by_pos[p].weights, dtype=float)]
        per_token.append({"x": list(one.x), "z": z, "w": w, "zmax": _r3(float(one.zmax)), "lz": lz, "lt": lt})
    data = {"name": name, "cdiv": cplot["id"], "ldiv": lplot["id"], "k": k, "tokens": per_token}
    return {"plots": [cplot, lplot], "data": data}


def _explorer_model(trace: DepthTrace, name: str, positions: list[tuple[int, int]], plots: _Plots, digits: int) -> dict:
    auto = "weights"  # every model's weights; PreNorm's are its implied weights 1/k (figures.implied_weights)
    b0, p0 = positions[0]
    fig = figures.token_heatmap(trace, token=p0, batch=b0, kind=auto)
    fig.update_layout(title={"text": fig.layout.title.text.replace(trace.name, name, 1)})
    item = plots.add(fig)
    pid = item["id"]
    styles = {}
    for kind in KIND_ORDER:
        hm_fig = fig if kind == auto else figures.token_heatmap(trace, token=p0, batch=b0, kind=kind)
        hm = hm_fig.data[0]
        styles[kind] = {
            "colorscale": [list(c) for c in hm.colorscale],
            "symmetric": kind in ("logits", "contrib"),
            "floor": 1.0 if kind == "contrib" else 1e-6,  # shares: at least -1..1, as figures._color_range
            "title_parts": list((hm_fig.layout.meta or {}).get("title_parts") or []),
            "zmin": hm.zmin,
            "zmax": hm.zmax,
            "colorbar": kind,
            "title": figures.kind_title(trace, kind),
            "annotations": [a.to_plotly_json() for a in hm_fig.layout.annotations],
        }
    cells, _ = figures.cell_values(trace, expanded=False)  # {kind: [B, P, R, S]}, -inf -> NaN
    b_idx = np.asarray([b for b, _ in positions])
    p_idx = np.asarray([p for _, p in positions])
    picked = np.stack([cells[k][b_idx, p_idx] for k in KIND_ORDER], axis=1)  # (N, 3, R, S)
    N, K, R, S = picked.shape
    finite = np.isfinite(picked)
    # length of each row once trailing unavailable cells are dropped
    last = np.where(finite.any(-1), S - np.argmax(finite[..., ::-1], axis=-1), 0)  # (N, 3, R)
    flat = [_num(v, digits) for v in picked.ravel().tolist()]
    lens = last.ravel().tolist()

    def rows_of(n: int, k: int) -> str:
        rows = []
        for r in range(R):
            i = (n * K + k) * R + r
            rows.append("[" + ",".join(flat[i * S : i * S + lens[i]]) + "]")
        return "[" + ",".join(rows) + "]"

    # a kind the same at every token (PreNorm's implied weights, DenseFormer's coefficients) is stored
    # once, in "fixed"; each token then holds 0 in its place (the page reads the fixed rows)
    same = [bool(np.array_equal(picked[:, k], np.broadcast_to(picked[:1, k], picked[:, k].shape), equal_nan=True))
            for k in range(K)]
    fixed_json = "[" + ",".join(rows_of(0, k) if same[k] else "null" for k in range(K)) + "]"
    cells_json = "[" + ",".join("[" + ",".join("0" if same[k] else rows_of(n, k) for k in range(K)) + "]"
                                for n in range(N)) + "]"
    head = {"name": name, "div": pid, "R": R, "S": S, "auto": auto, "styles": styles}
    data = json.loads(json.dumps(head, default=_json_default))  # plain JSON types only
    data["fixed"], data["cells"] = "__FIXED__", "__CELLS__"
    text = (json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            .replace('"__FIXED__"', fixed_json).replace('"__CELLS__"', cells_json))
    return {"plot": item, "data": text}


def public_path(path: Any) -> str | None:
    """A path as a report may show it: relative to the working directory when under it, the bundled
    demo models as ``demo:<name>``, anything else by its folder name only (a report is shared: it
    must not carry the local layout of the machine that built it)."""
    if path is None:
        return None
    text = str(path)
    if "://" in text or text.startswith("demo:"):
        return text
    p = Path(text)
    if not p.is_absolute():
        return text
    try:
        from attnres_probe.demo import demo_dir

        if p.resolve().parent == demo_dir("block").resolve().parent:
            return f"demo:{p.name}"
    except Exception:  # noqa: BLE001 - a missing demo folder only skips this case
        pass
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return p.name or text


def _metric_labels() -> dict[str, str]:
    from attnres_probe.analysis.display import LABELS

    return dict(LABELS)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in the report")

