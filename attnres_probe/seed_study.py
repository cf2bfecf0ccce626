"""Study v3: five training seeds of PreNorm, Full and Block, judged on pre-registered endpoints.

docs/study/plan-v3.md fixed the design before any run: the runs (``docs/study/v3/runs/{model}/
seed{s}``, 8,000 steps each on the play split), six primary endpoints with the paper's
direction, a paired test over seeds for each (a t-test and an exact sign test) and Holm's
correction across the six; everything else exploratory. This module measures every finished run
on the validation windows (the 128 windows of 128 tokens spread over the held-out plays, the same
for every run; one forward and one backward pass each, the run's own backend) and writes:

- ``results.json``: every number the pages show (per run: pooled values of every diagnostic,
  over all windows and per held-out play; per endpoint: per-seed values, tests, verdicts);
- ``windows.csv``: every window's value of every diagnostic, per run (with its play and file);
- ``study.md``: the pages, generated from results.json alone (:func:`render_page`), so the
  text cannot drift from the numbers (a test regenerates it and checks every number).

    attnres-probe study --runs docs/study/v3/runs --out docs/study/v3
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch

from attnres_probe.analysis.catalog import CATALOG, UNIFORM
from attnres_probe.analysis.seed_tests import holm, holm_verdict, seed_test, t_interval
from attnres_probe.analysis.windows import reference_column
from attnres_probe.io import atomic_write

__all__ = ["MODELS", "PRIMARIES", "Primary", "SUMMARY_FILE", "demo_summary", "find_runs", "load_demo_summary", "measure_run",
           "render_page", "run_v3_study", "seed_values"]

MODELS = ("prenorm", "full", "block")
STEPS = 8000  # the plan's recipe: a run counts once its log says it finished at this step
SEEDS = range(5)  # the plan's seeds: a run without a folder yet is listed as not started
PLAN = "docs/study/plan-v3.md"
COMMAND = "attnres-probe study --runs docs/study/v3/runs --out docs/study/v3"
WINDOWS_FILE = "windows.csv"
SUMMARY_FILE = "study_v3.json"  # beside the shipped demo models (seed 0 of the runs): what the dashboard shows
LEVEL = 0.95
ALPHA = 0.05


@dataclass(frozen=True)
class Primary:
    """One pre-registered endpoint (docs/study/plan-v3.md, "Primary endpoints").

    Attributes:
        key: P1 .. P6.
        title: the plan's name for it.
        model: the AttnRes model it is about.
        metric: the catalog diagnostic (:data:`~attnres_probe.analysis.catalog.CATALOG`).
        against: ``"baseline"`` (PreNorm of the same seed) or ``"uniform"`` (the model's own uniform
            reference on the same windows).
        kind: ``"difference"`` (model - reference) or ``"log ratio"`` (log(model / reference)).
        expected: the paper's direction of the per-seed value: ``"lower"`` (< 0) or ``"higher"``.
        unit: the unit of one per-seed value.
    """

    key: str
    title: str
    model: str
    metric: str
    against: str
    kind: str
    expected: str
    unit: str


PRIMARIES: tuple[Primary, ...] = (
    Primary("P1", "validation loss, Block", "block", "mean_loss", "baseline", "difference", "lower", "nats per byte"),
    Primary("P2", "validation loss, Full", "full", "mean_loss", "baseline", "difference", "lower", "nats per byte"),
    Primary("P3", "locality, Full", "full", "locality_distance", "uniform", "difference", "lower", "sublayers back"),
    Primary("P4", "embedding kept, Full", "full", "embed_vs_old_deep", "uniform", "difference", "higher",
            "fraction of the read"),
    Primary("P5", "output magnitude growth, Block", "block", "rms_out_growth", "baseline", "log ratio", "lower",
            "natural log of a ratio"),
    Primary("P6", "gradient uniformity, Block", "block", "act_grad_cv", "baseline", "log ratio", "lower",
            "natural log of a ratio"),
)


# -- the runs ----------------------------------------------------------------------------------
def _log(folder: Path, name: str = "train_log.json") -> dict[str, Any] | None:
    try:
        log = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None
    return log if isinstance(log, dict) else None


def find_runs(runs_dir: str | Path, steps: int = STEPS) -> tuple[dict[tuple[str, int], Path], list[str]]:
    """({(model, seed): folder} of every finished run, [what is missing or unfinished, in words]).

    A run is ``runs_dir/{model}/seed{s}`` whose train_log.json says it finished at step ``steps``
    (the plan's 8,000).
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"--runs {runs_dir}: no such folder (the runs of plan-v3 are in docs/study/v3/runs)")
    done, missing = {}, []
    for model in MODELS:
        for folder in sorted((runs_dir / model).glob("seed*")):
            if not folder.name[4:].isdigit():
                continue
            seed = int(folder.name[4:])
            log = _log(folder)
            if log and log.get("finished") and log.get("step") == steps and (folder / "model.safetensors").is_file():
                done[(model, seed)] = folder
            else:
                step = (log or _log(folder, "train_state.json") or {}).get("step")  # a run in flight saves its state
                missing.append(f"{model} seed {seed}: " + (f"at step {step} of {steps}" if step else "not started"))
    if not done:
        raise ValueError(f"--runs {runs_dir}: no finished run ({steps} steps) under {{{','.join(MODELS)}}}/seed*")
    seen = {key for key in done} | {(m, int(x.split(" seed ")[1].split(":")[0])) for x in missing for m in [x.split(" seed ")[0]]}
    for seed in SEEDS:  # the plan's runs that have no folder yet
        for model in MODELS:
            if (model, seed) not in seen:
                missing.append(f"{model} seed {seed}: not started")
    missing.sort(key=lambda x: (int(x.split(" seed ")[1].split(":")[0]), MODELS.index(x.split(" seed ")[0])))
    return done, missing


def _windows(log: dict[str, Any]) -> tuple[torch.Tensor, list[str], list[str]]:
    """The validation windows' inputs [W, seq_len], each window's file and its play (work)."""
    from attnres_probe.data import load_corpus
    from attnres_probe.demo import demo_validation_batches, demo_validation_documents

    windows = torch.cat(demo_validation_batches(log))[:, :-1]
    files = demo_validation_documents(log)
    corpus = load_corpus(log["train_config"]["corpus"])
    return windows, files, [corpus.work_of(f) for f in files]


def measure_run(folder: str | Path, model_name: str, windows: torch.Tensor, plays: list[str],
                backend: str | None = None) -> tuple[Any, dict[str, Any], pd.DataFrame]:
    """One run on the validation windows, play by play (one forward and one backward pass per window).

    Returns:
        (CorpusStats of every window, {play: CorpusStats of its windows}, the window table with a
        ``window`` column: each row's index into ``windows``).
    """
    from attnres_probe.model import AttnResTransformer
    from attnres_probe.placement import current
    from attnres_probe.probe import Probe

    model = AttnResTransformer.load(folder, backend=backend, device=current().device).eval()  # study --device
    if current().dtype is not None:
        model = model.to(current().dtype)
    probe = Probe(model, name=model_name)
    by_play: dict[str, Any] = {}
    order = list(dict.fromkeys(plays))
    rows, merged, first = [], None, 0
    for play in order:
        idx = [i for i, p in enumerate(plays) if p == play]
        stats = probe.run_corpus([windows[i] for i in idx], backward=True, progress=False, first_doc=first)
        table = stats.window_table().sort_values("doc", kind="stable").reset_index(drop=True)
        table.insert(0, "window", [idx[int(d) - first] for d in table["doc"]])
        rows.append(table)
        by_play[play] = stats
        merged = stats if merged is None else merged.merge(stats)
        first += len(idx)
    return merged, by_play, pd.concat(rows, ignore_index=True).sort_values("window", kind="stable").reset_index(drop=True)


def _numbers(series: pd.Series) -> dict[str, float | None]:
    return {str(k): _num(v) for k, v in series.items()}


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _embed_vs_old_by_read(stats: Any) -> list[float | None]:
    """Per read of a Full model: the embedding's mean weight minus the mean weight of the other
    non-recent sources (reads with at least 3 sources). Linear in the weights, and a Full read always
    sees the same sources, so the mean over tokens is this function of the mean weights."""
    w = np.asarray(stats.mean("depth_weights"), np.float64)  # [R, S], NaN where a read cannot see a source
    out = []
    for row in w:
        avail = row[np.isfinite(row)]
        out.append(_num(avail[0] - avail[1:-1].mean()) if avail.size >= 3 else None)
    return out


def _p4_reads(runs: dict[str, dict[str, Any]], reads: range) -> dict[str, float]:
    """P4 per seed over the given reads only (its uniform reference is 0)."""
    out = {}
    for seed, run in runs.get("full", {}).items():
        by_read = run.get("embed_vs_old_by_read") or []
        vals = [by_read[r] for r in reads if r < len(by_read) and by_read[r] is not None]
        if vals:
            out[seed] = float(np.mean(vals))
    return out


# -- endpoints ---------------------------------------------------------------------------------
def seed_values(runs: dict[str, dict[str, Any]], model: str, metric: str, against: str, kind: str,
                play: str | None = None) -> dict[str, float]:
    """{seed: x_s} for one comparison over the seeds where both sides exist: ``kind`` "difference"
    (model - reference) or "log ratio"; the reference is PreNorm's same seed (``against`` "baseline")
    or the model's own uniform reference (``"uniform"``). ``play``: that play's windows only."""
    out = {}
    for seed, run in runs.get(model, {}).items():
        mine = run["pooled"] if play is None else run["plays"].get(play, {})
        if against == "baseline":
            base = runs.get("prenorm", {}).get(seed)
            if base is None:
                continue
            ref = (base["pooled"] if play is None else base["plays"].get(play, {})).get(metric)
        else:
            ref = mine.get(reference_column(metric))
        a = mine.get(metric)
        if a is None or ref is None:
            continue
        if kind == "log ratio":
            if a <= 0 or ref <= 0:
                continue
            out[seed] = math.log(a / ref)
        else:
            out[seed] = a - ref
    return out


def _primaries(runs: dict[str, dict[str, Any]], plays: list[str]) -> list[dict[str, Any]]:
    rows = []
    for p in PRIMARIES:
        per_seed = seed_values(runs, p.model, p.metric, p.against, p.kind)
        test = seed_test(list(per_seed.values()), p.expected, LEVEL)
        per_play = {play: seed_values(runs, p.model, p.metric, p.against, p.kind, play) for play in plays}
        rows.append({**asdict(p), "per_seed": per_seed, **{k: _num(v) if isinstance(v, float) else v for k, v in test.items()},
                     "per_play": per_play,
                     "per_play_mean": {play: _num(np.mean(list(v.values()))) if v else None for play, v in per_play.items()}})
    adjusted = holm([r["p"] if r["p"] is not None else math.nan for r in rows])
    for r, q in zip(rows, adjusted):
        r["p_holm"] = _num(q)
        r["verdict"] = holm_verdict(r["mean"] if r["mean"] is not None else math.nan,
                                    q if math.isfinite(q) else math.nan, r["expected"], ALPHA)
    return rows


def _sensitivity(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """P4 on the reads the plan's parenthesis names: "reads 9..16" counted from 1 are reads 8..15 counted
    from 0 (the final read left out); the catalog's deep half, which P4 uses, is reads 8..16."""
    by_read = next((r["embed_vs_old_by_read"] for r in runs.get("full", {}).values() if r.get("embed_vs_old_by_read")), None)
    if not by_read:
        return []
    R = len(by_read)
    per_seed = _p4_reads(runs, range(R // 2, R - 1))
    test = seed_test(list(per_seed.values()), "higher", LEVEL)
    return [{"key": "P4 without the final read", "reads": [R // 2, R - 2], "per_seed": per_seed,
             **{k: _num(v) if isinstance(v, float) else v for k, v in test.items()}}]


def _exploratory(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every catalog diagnostic of each AttnRes model against its reference over seeds: t intervals,
    no correction, no verdict (the plan: "in this sample")."""
    primary = {(p.model, p.metric) for p in PRIMARIES}
    rows = []
    for model in ("full", "block"):
        for name, d in CATALOG.items():
            kind = "log ratio" if d.compare == "ratio" else "difference"
            against = "uniform" if d.reference == UNIFORM else "baseline"
            per_seed = seed_values(runs, model, name, against, kind)
            if not per_seed:
                continue
            mean, low, high = t_interval(list(per_seed.values()), LEVEL)
            way = None
            if d.direction:
                way = sum((v < 0) if d.direction == "lower" else (v > 0) for v in per_seed.values())
            rows.append({"model": model, "metric": name, "label": d.label, "unit": d.unit, "against": against,
                         "kind": kind, "direction": d.direction, "primary": (model, name) in primary,
                         "per_seed": per_seed, "mean": _num(mean), "low": _num(low), "high": _num(high), "paper_way": way})
    return rows


# -- the study ---------------------------------------------------------------------------------
def demo_summary(results: dict[str, Any]) -> dict[str, Any]:
    """The primary endpoints of results.json, as the dashboard's study card shows them beside the demo models."""
    keep = ("key", "title", "model", "against", "unit", "expected", "per_seed", "mean", "low", "high", "p", "p_holm", "paper_way", "n",
            "sign_p", "verdict")
    return {"plan": results["plan"], "command": results["command"], "seeds": results["seeds"], "missing": results["missing"],
            "planned_seeds": len(SEEDS), "level": results["level"],
            "primaries": [{k: p[k] for k in keep} for p in results["primaries"]]}


def load_demo_summary() -> dict[str, Any] | None:
    """The study-v3 summary shipped beside the demo models, or None when this installation lacks it."""
    from attnres_probe.demo import demo_root

    try:
        return json.loads((demo_root() / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None


def run_v3_study(runs_dir: str | Path, out: str | Path, progress: Callable[[str], None] | None = print,
                 steps: int = STEPS, summary_to: str | Path | None = None) -> dict[str, Any]:
    """Measure every finished run of ``runs_dir`` and write results.json, windows.csv and study.md to
    ``out`` (``steps``: the length of a finished run, the plan's 8,000); ``summary_to``: also write
    :func:`demo_summary` there (the shipped demo models' folder, for the dashboard).

    Raises:
        FileNotFoundError / ValueError: no runs folder, no finished run, or runs of different
            recipes or data (the message names the run).
    """
    found, missing = find_runs(runs_dir, steps)
    say = progress or (lambda s: None)
    logs = {key: _log(folder) for key, folder in found.items()}
    first = next(iter(logs.values()))
    recipe = {k: v for k, v in first["train_config"].items() if k != "seed"}
    for (model, seed), log in logs.items():
        other = {k: v for k, v in log["train_config"].items() if k != "seed"}
        if other != recipe or log.get("data_sha256") != first.get("data_sha256"):
            raise ValueError(f"{found[(model, seed)]}: another recipe or corpus than the other runs; every run of the study "
                             "must differ only in its seed and model")
        if log["train_config"]["seed"] != seed:
            raise ValueError(f"{found[(model, seed)]}: its log says seed {log['train_config']['seed']}, its folder seed {seed}")
    windows, files, plays = _windows(first)
    play_names = list(dict.fromkeys(plays))
    runs: dict[str, dict[str, Any]] = {}
    tables = []
    for (model, seed), folder in sorted(found.items(), key=lambda kv: (kv[0][1], MODELS.index(kv[0][0]))):
        log = logs[(model, seed)]
        say(f"measuring {model} seed {seed} ({folder}) on {len(windows)} windows ...")
        stats, by_play, table = measure_run(folder, model, windows, plays, backend=log.get("backend"))
        runs.setdefault(model, {})[str(seed)] = {
            "folder": Path(folder).as_posix(), "backend": log.get("backend"), "steps": log.get("step"),
            "final_val_loss": _num(log.get("final_val_loss")), "wall_time_s": _num(log.get("wall_time_s")),
            "pooled": _numbers(stats.pooled()), "plays": {p: _numbers(s.pooled()) for p, s in by_play.items()},
            "embed_vs_old_by_read": _embed_vs_old_by_read(stats) if model == "full" else None,
        }
        table.insert(0, "seed", seed)
        table.insert(0, "model", model)
        table.insert(3, "play", [plays[i] for i in table["window"]])
        table.insert(4, "file", [files[i] for i in table["window"]])
        tables.append(table)
    results = {
        "plan": PLAN, "command": COMMAND, "recipe": recipe, "data_sha256": first.get("data_sha256"),
        "models": [m for m in MODELS if m in runs], "seeds": sorted({int(s) for r in runs.values() for s in r}),
        "missing": missing, "level": LEVEL, "alpha": ALPHA,
        "windows": {"n": int(len(windows)), "seq_len": int(windows.shape[1]),
                    "plays": {p: plays.count(p) for p in play_names}},
        "runs": runs,
        "primaries": _primaries(runs, play_names),
        "exploratory": _exploratory(runs),
        "sensitivity": _sensitivity(runs),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.concat(tables, ignore_index=True).drop(columns=["doc", "start", "digest"])
    atomic_write(out / WINDOWS_FILE, lambda p: frame.to_csv(p, index=False, float_format="%.9g"))
    atomic_write(out / "results.json", lambda p: p.write_text(json.dumps(results, indent=1) + "\n"))
    atomic_write(out / "study.md", lambda p: p.write_text(render_page(results)))
    if summary_to is not None:
        atomic_write(Path(summary_to), lambda p: p.write_text(json.dumps(demo_summary(results), indent=1) + "\n"))
    return results


# -- the page ----------------------------------------------------------------------------------
def fmt(x: Any, spec: str = ".4g") -> str:
    """A number of results.json as the page prints it ("—" when missing); the number-checking test
    formats results.json's numbers the same way."""
    return "—" if x is None else format(float(x), spec)


SIGNED = "+.3g"  # per-seed values and means of a comparison
VALUE = ".4g"  # a model's own value
P_SPEC = ".2g"  # p-values


def _seed_cells(per_seed: dict[str, float], seeds: list[int], spec: str = SIGNED) -> list[str]:
    return [fmt(per_seed.get(str(s)), spec) for s in seeds]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def render_page(results: dict[str, Any]) -> str:
    """docs/study/v3/study.md from results.json alone (every number on it is one of results.json's)."""
    seeds = list(results["seeds"])
    n_seeds = len(seeds)
    level = results["level"]
    lines = [
        "# Study v3: five seeds, pre-registered endpoints",
        "",
        f"Generated by `{results['command']}` from `results.json` (every number below is one of its numbers; "
        "`tests/test_seed_study.py` regenerates this page and checks each). The design, the six primary endpoints "
        f"and the tests were fixed in [plan-v3.md](../plan-v3.md) before the first run. Seeds measured: "
        f"{', '.join(str(s) for s in seeds)}.",
        "",
    ]
    if results["missing"]:
        lines += ["**Not finished yet** (left out of every number below): " + "; ".join(results["missing"]) + ".", ""]
    w = results["windows"]
    lines += [
        f"Each run is measured on the same {w['n']} validation windows of {w['seq_len']} tokens, spread over the "
        f"held-out plays ({', '.join(f'{p}: {n}' for p, n in w['plays'].items())} windows), with one forward and one "
        "backward pass per window on the run's final weights and its own backend. A run's value of a diagnostic is "
        "pooled over all its windows' tokens (the catalog's definition); the unit of inference is the training seed.",
        "",
        "## Primary endpoints",
        "",
        f"Per seed s: the endpoint's value x_s (AttnRes seed s against PreNorm seed s, or against its own uniform "
        f"reference); mean over seeds with its {level:.0%} t interval; a two-sided one-sample t-test of mean = 0 "
        f"({n_seeds - 1} degrees of freedom); Holm's correction across the six; the count of seeds on the paper's side "
        "of 0 with the exact two-sided sign test. Consistent / contrary: Holm-adjusted p < "
        f"{results['alpha']} with the mean on / against the paper's side; inconclusive otherwise.",
        "",
    ]
    header = ["id", "endpoint", "unit", "paper", *[f"seed {s}" for s in seeds], f"mean [{level:.0%} CI]", "p", "Holm p",
              "paper's side (sign p)", "verdict"]
    rows = []
    for p in results["primaries"]:
        side = "< 0" if p["expected"] == "lower" else "> 0"
        rows.append([p["key"], p["title"], p["unit"], side, *_seed_cells(p["per_seed"], seeds),
                     f"{fmt(p['mean'], SIGNED)} [{fmt(p['low'], SIGNED)}, {fmt(p['high'], SIGNED)}]",
                     fmt(p["p"], P_SPEC), fmt(p["p_holm"], P_SPEC), f"{p['paper_way']} of {p['n']} ({fmt(p['sign_p'], P_SPEC)})",
                     f"**{p['verdict']}**"])
    lines += _table(header, rows) + [""]
    lines += ["### What each primary row says", ""]
    for p in results["primaries"]:
        lines.append(_sentence(p))
    lines += ["", "## Per play", "",
              "Each primary endpoint on one held-out play's windows only (both editions of a play together), per seed "
              "and as the mean over seeds: which plays drive a verdict. Exploratory (no test).", ""]
    plays = list(w["plays"])
    for p in results["primaries"]:
        lines += [f"**{p['key']}: {p['title']}** ({p['unit']})", ""]
        rows = [[play, *_seed_cells(p["per_play"].get(play, {}), seeds), fmt(p["per_play_mean"].get(play), SIGNED)]
                for play in plays]
        lines += _table(["play", *[f"seed {s}" for s in seeds], "mean"], rows) + [""]
    lines += ["## The runs", "",
              "Each run's own values (pooled over the validation windows). The loss the trainer logged is over each "
              "window's full target (128 next bytes); the measured one leaves out each window's last target, as a "
              "recording of the window's 128 inputs does.", ""]
    rows = []
    for model in results["models"]:
        for s in seeds:
            run = results["runs"][model].get(str(s))
            if run is None:
                continue
            pooled = run["pooled"]
            rows.append([model, str(s), fmt(run["final_val_loss"], VALUE), fmt(pooled.get("mean_loss"), VALUE),
                         fmt(pooled.get("locality_distance"), VALUE), fmt(pooled.get(reference_column("locality_distance")), VALUE),
                         fmt(pooled.get("embed_vs_old_deep"), VALUE), fmt(pooled.get("rms_out_growth"), VALUE),
                         fmt(pooled.get("act_grad_cv"), VALUE)])
    lines += _table(["model", "seed", "logged val loss", "measured loss", "E[d] (sources back)", "E[d] uniform",
                     "embedding - old sources", "output RMS growth", "CV of ||dL/dv||"], rows) + [""]
    lines += ["## Exploratory", "",
              "Every other diagnostic of the catalog (and the primaries again on their own reference), each AttnRes "
              f"model against its reference per seed: mean with its {level:.0%} t interval over seeds, and the seeds on "
              "the paper's side where the paper states a direction. No correction and no verdict: these describe this "
              "sample only.", ""]
    rows = []
    for e in results["exploratory"]:
        ref = "uniform" if e["against"] == "uniform" else "prenorm"
        op = "−" if e["kind"] == "difference" else "log ÷"
        way = "" if e["paper_way"] is None else f"{e['paper_way']} of {len(e['per_seed'])} ({e['direction']})"
        rows.append([e["model"], e["label"] + (" (primary)" if e["primary"] else ""), e["unit"], f"{op} {ref}",
                     *_seed_cells(e["per_seed"], seeds),
                     f"{fmt(e['mean'], SIGNED)} [{fmt(e['low'], SIGNED)}, {fmt(e['high'], SIGNED)}]", way])
    lines += _table(["model", "diagnostic", "unit", "against", *[f"seed {s}" for s in seeds], f"mean [{level:.0%} CI]",
                     "paper's side"], rows) + [""]
    for sens in results.get("sensitivity", []):
        lo, hi = sens["reads"]
        lines += ["## Afterwards: the reads of P4", "",
                  "The plan describes P4 as the catalog's embedding-against-old-sources diagnostic over \"the deep half of "
                  "reads (reads 9..16)\". The catalog's deep half, which P4 uses above, is the reads from floor(R/2) on, "
                  f"counted from 0: reads {lo}..{hi + 1}, the final read included. Counted from 1, the plan's \"9..16\" are "
                  f"reads {lo}..{hi} counted from 0, without the final read. On those reads (not a primary, no correction): "
                  f"per seed {', '.join(f's{s} {fmt(v, SIGNED)}' for s, v in sens['per_seed'].items())}; mean "
                  f"{fmt(sens['mean'], SIGNED)} [{fmt(sens['low'], SIGNED)}, {fmt(sens['high'], SIGNED)}], t-test p = "
                  f"{fmt(sens['p'], P_SPEC)}, {sens['paper_way']} of {sens['n']} seeds on the paper's side.", ""]
    return "\n".join(lines) + "\n"


def _sentence(p: dict[str, Any]) -> str:
    """One finding sentence for a primary row, naming the row; causal words never appear."""
    ref = "PreNorm of the same seed" if p["against"] == "baseline" else "its uniform reference on the same sources"
    side = "below 0" if p["expected"] == "lower" else "above 0"
    what = {"consistent": "the seeds bear out the paper's direction after Holm's correction",
            "contrary": "the seeds go against the paper's direction after Holm's correction",
            "inconclusive": f"{p['n']} seeds cannot tell the direction at this scale after Holm's correction"}[p["verdict"]]
    return (f"- Row {p['key']} ({p['title']}, {p['model'].title()} against {ref}; the paper expects x {side}): mean "
            f"{fmt(p['mean'], SIGNED)} {p['unit']}, {p['paper_way']} of {p['n']} seeds on the paper's side, t-test p = "
            f"{fmt(p['p'], P_SPEC)}, Holm-adjusted p = {fmt(p['p_holm'], P_SPEC)}: **{p['verdict']}**; {what}.")
