"""Does threading the Numba kernels speed up training? A paired A/B of training steps.

Each round times one training step of the same model twice, once with the depth-attention
kernels on Numba's threads (calls from ``PARALLEL_MIN_ELEMENTS`` source elements up) and once
with every call on the caller's thread, in alternating order. The median of the per-round
differences (threaded minus one thread) and a bootstrap 90% interval are printed: on a shared
machine whose speed drifts within minutes, paired differences are far steadier than two
separate medians.

    python benchmarks/numba_threads.py                      # Block AttnRes, demo size
    python benchmarks/numba_threads.py --model full --rounds 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from attnres_probe.kernels.ops.depth_attn import numba as numba_depth_attn
from attnres_probe.training import frozen_gc

sys.path.insert(0, str(Path(__file__).parent))
from train import SIZES, make_step  # the training benchmark's step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="demo", choices=list(SIZES))
    ap.add_argument("--model", default="block", choices=["full", "block"])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    threaded = numba_depth_attn.PARALLEL_MIN_ELEMENTS
    modes = {"threaded": threaded, "one thread": 1 << 62}
    step, _ = make_step(args.size, args.model)
    for limit in modes.values():  # warm-up, and compile both kernel versions
        numba_depth_attn.PARALLEL_MIN_ELEMENTS = limit
        step()
        step()
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        with frozen_gc():  # as the trainer's loop runs
            for r in range(args.rounds):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for mode in order:
                    numba_depth_attn.PARALLEL_MIN_ELEMENTS = modes[mode]
                    t = time.perf_counter()
                    step()
                    times[mode].append(time.perf_counter() - t)
    finally:
        numba_depth_attn.PARALLEL_MIN_ELEMENTS = threaded
    diffs = [a - b for a, b in zip(times["threaded"], times["one thread"])]
    rng = random.Random(0)
    boot = sorted(
        statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000)
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model} at the {args.size} size, {args.rounds} rounds"
    )
    for mode, v in times.items():
        print(f"{mode:10s} step {statistics.median(v) * 1e3:7.1f} ms (median)")
    print(
        f"threaded - one thread: {statistics.median(diffs) * 1e3:+.2f} ms per step "
        f"(90% interval [{boot[100] * 1e3:+.2f}, {boot[1900] * 1e3:+.2f}])"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
