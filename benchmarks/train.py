"""Training throughput of PreNorm vs Full AttnRes vs Block AttnRes vs mHC vs DenseFormer, side by
side in one run.

One optimizer step (AdamW, forward + backward + clip + update) of each architecture is timed in
turn (the order rotating from round to round), repeatedly (with Python's collector set up as in the trainer's loop, see
``attnres_probe.training.frozen_gc``), so that machine noise hits them all alike. The median step time gives
tokens/s; the ratio to PreNorm is the median over rounds of each round's ratio (the steps of
one round run back to back, so a slow spell of the shared machine cancels out of it). Targets:
Block <= 1.20x PreNorm's step time at the demo size and <= 1.10x at d=256 / 12 layers / 256
tokens (Full is reported). mHC (``residual="hyper", mhc=True, n_streams=4``, the demo's) and
DenseFormer (a DWA after every block) are reported beside them, without a target (issue #36);
the rules are the demo rules (``attnres_probe.demo_recipe.DEMO_RULES``). Every model runs its one
forward, through its hook points and norm modules; only the depth-attention op differs by backend.

Each ratio comes with a 95 % bootstrap interval of that median (the rounds resampled; rounds
close in time share the machine's mood, so it is if anything too narrow), and Block's verdict
says "met" only when the whole interval is below the target, "missed" when it is all
above, and "within noise" otherwise: one run on a shared machine cannot tell those apart.

    python benchmarks/train.py                  # demo size, and d=256 / 12 layers / 256 tokens
    python benchmarks/train.py --quick
    python benchmarks/train.py --sizes demo --threads 1 --backend torch   # as the demo models are trained
    python benchmarks/train.py --sizes demo --stand-in   # also Block with a stand-in for the Numba op
    python benchmarks/train.py --rules prenorm,mhc,denseformer --reps 8   # some rules (PreNorm always runs)

``--stand-in`` adds a row, ``block-s``: the Block model with the Numba op's forward and
backward swapped, for its steps only, for a stand-in that moves almost nothing (the last source
as the mixture, uniform weights, a gradient for the last source only) while every other part of
a read runs as usual (the wrappers, the autograd node, the hook points). Its ratio is what a read
costs besides the kernels and their memory traffic.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from attnres_probe import AttnResTransformer, ModelConfig
from attnres_probe.analysis import verdicts
from attnres_probe.analysis.bootstrap import resample_counts
from attnres_probe.training import TrainConfig, frozen_gc, lm_loss, make_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rules import ALL_RULES, parse_rules, rule_kwargs  # noqa: E402  (the rules by name)

SIZES = {
    "demo": dict(d_model=64, n_layers=8, n_heads=4, n_ctx=128, batch=16),
    "large": dict(d_model=256, n_layers=12, n_heads=8, n_ctx=256, batch=8),
    "quick": dict(d_model=32, n_layers=2, n_heads=2, n_ctx=64, batch=4),
}
RESIDUALS = ALL_RULES  # prenorm, full, block, mhc, denseformer (the demo rules)
TARGETS = {"demo": 1.20, "large": 1.10, "quick": 1.20}  # Block / PreNorm step time


def make_step(size: str, residual: str, backend: str = "auto"):
    s = dict(SIZES[size])
    batch = s.pop("batch")
    model = AttnResTransformer(ModelConfig(seed=0, **s, **rule_kwargs(residual)), backend=backend).train()
    opt = make_optimizer(model, TrainConfig(lr=1e-3, warmup_steps=0))  # the trainer's AdamW
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 256, (batch, s["n_ctx"] + 1), generator=g)

    def step() -> None:
        loss = lm_loss(model, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, batch * s["n_ctx"]


def _stand_in_forward(ctx, table, query, gain, options, *sources):
    S, batch, width = len(sources), sources[0].shape[:-1], options.width
    w = torch.full((*batch, width), float("nan"))
    w[..., :S] = 1.0 / S
    z = torch.full((*batch, width), float("-inf"))
    z[..., :S] = 0.0
    ctx.n_sources = S
    outs = [sources[-1].clone(), torch.zeros(batch)]
    return tuple(outs + [t for k, t in enumerate((w, z, w.clone())) if options.want >> k & 1])


def _stand_in_backward(ctx, dh, *rest):
    return (None,) * (4 + ctx.n_sources - 1) + (dh,)


@contextlib.contextmanager
def stand_in_op():
    """The Numba op's forward and backward replaced by the stand-in while the block runs."""
    from attnres_probe.kernels.ops.depth_attn.numba import DepthAttnNumbaFunction as F

    saved = F.__dict__["forward"], F.__dict__["backward"]
    F.forward, F.backward = staticmethod(_stand_in_forward), staticmethod(_stand_in_backward)
    try:
        yield
    finally:
        F.forward, F.backward = saved


def ratio_interval(ratios, level: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median of per-round ratios and its percentile bootstrap interval
    over rounds (seeded: the same ratios give the same interval)."""
    r = np.asarray(list(ratios), dtype=float)
    counts = resample_counts(len(r), n_resamples, seed)  # (n_resamples, rounds)
    medians = np.array([np.median(np.repeat(r, c)) for c in counts])
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(r)), float(lo), float(hi)


def verdict(low: float, high: float, target: float) -> str:
    """"met" (the interval below the target), "missed" (above it) or "within noise": the project's
    one interval-to-verdict rule (:func:`attnres_probe.analysis.verdicts.verdict`), in a benchmark's words."""
    said = verdicts.verdict(low, high, "lower", null=target)
    return {"consistent": "met", "contrary": "missed", "inconclusive": "within noise"}[said]


class Row(NamedTuple):
    """One model's line of the table: median step seconds, tokens per step, and the median
    per-round step-time ratio to PreNorm with its 95 % bootstrap interval."""

    step_s: float
    tokens: int
    ratio: float
    low: float
    high: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s


def measure(size: str, rules=RESIDUALS, reps: int = 24, backend: str = "auto", stand_in: bool = False) -> dict[str, Row]:
    """Time one optimizer step of every rule in ``rules`` (PreNorm is added first if missing: the
    ratios are to it), interleaved over ``reps`` rounds; ``stand_in`` adds ``block-s``."""
    rules = ["prenorm", *(r for r in rules if r != "prenorm")]
    steps = {r: make_step(size, r, backend) for r in rules}
    if stand_in:
        block_step, tokens = make_step(size, "block", backend)

        def stand_in_step(step=block_step):
            with stand_in_op():
                step()

        steps["block-s"] = (stand_in_step, tokens)
    models = list(steps)
    for fn, _ in steps.values():  # warm-up
        fn()
        fn()
    times: dict[str, list[float]] = {r: [] for r in models}
    with frozen_gc():  # as the trainer's loop runs
        for rep in range(reps):
            k = rep % len(models)
            for r in models[k:] + models[:k]:  # each model first, second, ... in turn
                fn = steps[r][0]
                t = time.perf_counter()
                fn()
                times[r].append(time.perf_counter() - t)
    rows = {}
    for r in models:
        ratio, lo, hi = ratio_interval(a / b for a, b in zip(times[r], times["prenorm"]))
        rows[r] = Row(statistics.median(times[r]), steps[r][1], ratio, lo, hi)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["demo", "large"], choices=list(SIZES))
    ap.add_argument("--rules", nargs="+", default=[",".join(RESIDUALS)],
                    help=f"comma-separated rules to time (default: {','.join(RESIDUALS)}; PreNorm always runs, "
                         "the ratios are to it); a name not a demo rule is a ModelConfig residual with its defaults")
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's, here the machine's cores)")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "numba"],
                    help="depth-attention backend (the demo models are trained on 'torch' with --threads 1)")
    ap.add_argument("--stand-in", action="store_true",
                    help="also time Block with a stand-in for the Numba op (what a read costs besides the kernels)")
    args = ap.parse_args(argv)
    rules = parse_rules(args.rules)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.sizes, args.reps = ["quick"], 5
    width = max(8, *(len(r) for r in rules))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {args.backend}; median of {args.reps} interleaved steps\n")
    print(f"{'size':6s} {'model':{width}s} {'step ms':>8s} {'tokens/s':>9s} {'x prenorm':>9s}  {'95% interval':>14s}")
    said: dict[str, str] = {}
    for size in args.sizes:
        rows = measure(size, rules, args.reps, args.backend, args.stand_in)
        for r, row in rows.items():
            note = ""
            if r == "block":
                target = TARGETS[size]
                said[size] = verdict(row.low, row.high, target)
                note = f"  {said[size]} (target <= {target:.2f})"
            print(f"{size:6s} {r:{width}s} {row.step_s * 1e3:8.1f} {row.tokens_per_s:9.0f} {row.ratio:9.3f}  "
                  f"[{row.low:.3f}, {row.high:.3f}]{note}")
    if said:
        print("\nBlock target: " + ", ".join(f"{v} at {size}" for size, v in said.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
