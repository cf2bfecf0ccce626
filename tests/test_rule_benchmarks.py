"""The benchmarks with the rules of issue #36 (mHC, DenseFormer), on a tiny size: benchmarks/train.py
times their optimizer step beside PreNorm's, benchmarks/probe.py their recording overhead and what
the effective-weight bookkeeping adds, and the scripts that randomise ``query`` to mimic trained
routing build models whose reads have none (they perturb the HC / DWA weights instead)."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(d_model=16, n_layers=2, n_heads=2, n_ctx=16, batch=2)
NEW_RULES = ("mhc", "denseformer")


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _load("train_benchmark_rules", "train.py")
probe = _load("probe_benchmark_rules", "probe.py")


def _positive_finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(train.SIZES, "tiny", dict(TINY))
    monkeypatch.setitem(train.TARGETS, "tiny", 1.20)
    monkeypatch.setitem(probe.SIZES, "tiny", dict(TINY))
    return "tiny"


def test_the_training_benchmark_has_rows_for_the_new_rules(tiny, capsys):
    assert {"mhc", "denseformer"} <= set(train.RESIDUALS) and train.RESIDUALS[:3] == ("prenorm", "full", "block")
    rows = train.measure(tiny, NEW_RULES, reps=2)
    assert list(rows) == ["prenorm", *NEW_RULES]  # PreNorm always runs: the ratios are to it
    for r, row in rows.items():
        assert all(_positive_finite(v) for v in (row.step_s, row.ratio, row.low, row.high, row.tokens_per_s)), (r, row)
        assert row.low <= row.ratio <= row.high and row.tokens == TINY["batch"] * TINY["n_ctx"]
    assert rows["prenorm"].ratio == 1.0
    assert train.main(["--sizes", tiny, "--rules", "denseformer,mhc", "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("tiny ")] == ["prenorm", "denseformer", "mhc"]


def test_the_probe_benchmark_measures_the_new_rules_and_their_bookkeeping(tiny, capsys):
    for rule in NEW_RULES:
        t = probe.timings(tiny, rule, reps=1)
        assert {"rec_fwd_nobook", "rec_fwd_nocontrib"} <= set(t) and all(_positive_finite(v) for v in t.values())
        q = probe.ratios(t)
        for k in ("rec_f", "run_f", "cache_f", "rec_b", "cache_b", "grad_out"):
            assert _positive_finite(q[k]), (rule, k, q)
        assert q["book"] == pytest.approx(q["weights"] + q["shares"])
        for k in ("book", "weights", "shares"):  # fractions of the recorded forward: noisy, so only finite and < 1
            assert math.isfinite(q[k]) and q[k] < 1, (rule, k, q)
    assert "book" not in probe.ratios(probe.timings(tiny, "full", reps=1))  # softmax reads: no bookkeeping
    assert probe.book_verdict("large", 0.05) == (True, "ok (target <= 10%)")
    assert probe.book_verdict("large", 0.15)[0] is False
    assert probe.book_verdict(tiny, 0.5)[0] is True  # the target is for d=256
    assert probe.main(["--sizes", tiny, "--rules", "mhc", "--reps", "1", "--no-memory"]) == 0
    out = capsys.readouterr().out
    assert "effective-weight bookkeeping" in out and "target" in out
    assert sum(line.startswith("tiny   mhc") for line in out.splitlines()) == 2  # the overhead and bookkeeping rows


def test_routing_is_perturbed_for_every_rule_and_unchanged_for_attnres():
    from attnres_probe import AttnResTransformer, ModelConfig

    import bench_rules  # importable once a benchmark script is loaded (its folder is on sys.path)

    full, _ = probe.build("quick", "full")
    g = torch.Generator().manual_seed(0)
    for m in full.mixers:  # the queries probe.py and corpus.py always drew
        assert torch.equal(m.query, torch.empty_like(m.query).normal_(0, 0.5, generator=g))
    s = {k: v for k, v in TINY.items() if k != "batch"}
    for rule in ("mhc", "denseformer", "hyper"):
        model = AttnResTransformer(ModelConfig(seed=0, **s, **bench_rules.rule_kwargs(rule)))
        assert not any(hasattr(m, "query") for m in model.mixers)
        before = {n: p.clone() for n, p in model.named_parameters()}
        bench_rules.perturb_routing(model, torch.Generator().manual_seed(0))
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert moved and all(".hc." in n or n.startswith("dwa.") for n in moved), (rule, moved)
    assert bench_rules.parse_rules(["prenorm,mhc", "mhc", "denseformer"]) == ["prenorm", "mhc", "denseformer"]


@pytest.mark.parametrize("rule", NEW_RULES)
def test_the_other_benchmarks_build_the_new_rules(rule):
    attention = _load("attention_patterns_benchmark", "attention_patterns.py")
    corpus = _load("corpus_benchmark", "corpus.py")
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    models = [
        attention.build(rule, argparse.Namespace(d_model=16, layers=2, heads=2, n_ctx=16)),
        corpus.build("quick", rule),
    ]
    if importlib.util.find_spec("dash") is not None:
        models.append(_load("dashboard_benchmark", "dashboard.py").build_model(rule, 2, 16, 16))
    for model in models:
        with torch.no_grad():
            assert torch.isfinite(model(tokens)).all()
