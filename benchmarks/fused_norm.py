"""What the fused pre-norm saves: paired A/B of training steps, fused vs norms applied afterwards.

On the Numba backend an unwatched model applies each sublayer's RMSNorm (and ln_final) in the
kernel that forms its input: the read (``mixture``, ``fused_mixture`` with ``norm=``) or, in
the PreNorm baseline, the residual add (``add_rms_norm``). This script times each model's
optimizer step (as ``benchmarks/train.py`` does) with those ops as shipped, and with stand-ins
that call the same kernels without the norm and then apply ``rms_norm`` with PyTorch ops (the
path before the fusion), alternating the two in one process. It prints the median per-pair
difference with a bootstrap 90% interval (this shared machine's speed drifts too much for two
separate medians).

    python benchmarks/fused_norm.py                 # demo size, 30 pairs per model
    python benchmarks/fused_norm.py --pairs 10 --models block
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train import SIZES, make_step  # noqa: E402  (benchmarks/train.py)

import attnres_probe.kernels.numba_depth_attn as nbk  # noqa: E402
from attnres_probe.kernels.reference import rms_norm  # noqa: E402
from attnres_probe.train import frozen_gc  # noqa: E402

FUSED = (nbk.mixture, nbk.fused_mixture, nbk.add_rms_norm)


def _mixture_then_norm(sources, query, gain, eps, slots=None, norm=None):
    h = FUSED[0](sources, query, gain, eps, slots)
    return h if norm is None else rms_norm(h, *norm)


def _fused_sum_then_norm(sources, a, b, query, gain, eps, slots=None, norm=None):
    h, total = FUSED[1](sources, a, b, query, gain, eps, slots)
    return (h if norm is None else rms_norm(h, *norm)), total


def _add_then_norm(a, b, weight, eps):
    if b is None:
        return rms_norm(a, weight, eps)
    s = a + b
    return s, rms_norm(s, weight, eps)


UNFUSED = (_mixture_then_norm, _fused_sum_then_norm, _add_then_norm)


def _use(fns) -> None:
    # the model imports these from the module at each call, so swapping the attributes switches it
    nbk.mixture, nbk.fused_mixture, nbk.add_rms_norm = fns


def measure(size: str, residual: str, pairs: int) -> tuple[float, float, float, float, float]:
    """(fused ms, unfused ms, median difference ms, 90% interval low, high)."""
    steps = {"fused": make_step(size, residual)[0], "unfused": make_step(size, residual)[0]}
    fns = {"fused": FUSED, "unfused": UNFUSED}

    def run(k: str) -> float:
        _use(fns[k])
        t = time.perf_counter()
        steps[k]()
        return time.perf_counter() - t

    try:
        for k in steps:  # warm-up
            run(k)
            run(k)
        times: dict[str, list[float]] = {k: [] for k in steps}
        with frozen_gc():
            for i in range(pairs):
                for k in ("fused", "unfused") if i % 2 else ("unfused", "fused"):
                    times[k].append(run(k))
    finally:
        _use(FUSED)
    diffs = [a - b for a, b in zip(times["fused"], times["unfused"])]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
    return (
        statistics.median(times["fused"]) * 1e3,
        statistics.median(times["unfused"]) * 1e3,
        statistics.median(diffs) * 1e3,
        boots[100] * 1e3,
        boots[1899] * 1e3,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="demo", choices=list(SIZES))
    ap.add_argument("--models", nargs="+", default=["prenorm", "block", "full"], choices=["prenorm", "full", "block"])
    ap.add_argument("--pairs", type=int, default=30)
    args = ap.parse_args(argv)
    print(f"{args.size} size, {args.pairs} alternating pairs per model")
    print(f"{'model':8s} {'fused ms':>9s} {'unfused ms':>10s} {'fused - unfused':>16s}  90% interval")
    for residual in args.models:
        fused, unfused, diff, lo, hi = measure(args.size, residual, args.pairs)
        print(f"{residual:8s} {fused:9.1f} {unfused:10.1f} {diff:+15.1f}   [{lo:+.1f}, {hi:+.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
