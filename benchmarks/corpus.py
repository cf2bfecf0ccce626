"""Corpus recording and the bootstrap, measured side by side in one run.

1. Throughput of ``Probe.run_corpus`` (what ``attnres-probe corpus`` runs: every window's
   metrics, one forward and one backward pass per window, aggregates folded in) against a plain
   forward + backward (``torch.autograd.grad`` of the mean next-token loss) over the same
   windows, interleaved and repeated (median). The plain pass is timed two ways:
   one window at a time (the same passes the corpus runs: per-window parameter gradients need a
   backward pass per window) and in batches of ``--batch`` windows (how one would train).
   ``run_corpus(window_grads=False)`` (one backward per batch, parameter-gradient metrics only
   pooled) is timed against the batched plain pass. Target: corpus <= 1.25x plain at d=256,
   12 layers.
2. The bootstrap: ``metrics.compare``'s engine on three models x 1,000 windows x every
   headline metric, 1,000 resamples (and the bare resampling of one metric pair). Target <= 2 s.

3. With ``--procs 1 2``: ``Probe.run_corpus`` under torchrun (gloo), each process on one torch
   thread, over the same documents (``--docs``, one window each at the model's context): tokens/s
   with each process count, timed inside the processes from a barrier to the merged result
   (start-up left out), repeated and interleaved (median). Target: >= 1.7x with 2 processes on
   a 2-core machine.

    python benchmarks/corpus.py              # d=256, 12 layers, n_ctx 256, 16 windows
    python benchmarks/corpus.py --quick      # tiny model, for a smoke run
    python benchmarks/corpus.py --procs 1 2 --size demo --docs 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from attnres_probe import AttnResTransformer, ModelConfig, Probe
from attnres_probe.analysis import bootstrap
from attnres_probe.analysis.compare import Windows, compare_windows
from attnres_probe.analysis.windows import REFERENCE_COLUMNS, WINDOW_METRICS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rules import perturb_routing, rule_kwargs  # noqa: E402  (the rules by name: also mhc, denseformer)

SIZES = {
    "large": dict(d_model=256, n_layers=12, n_heads=8, n_ctx=256),
    "demo": dict(d_model=64, n_layers=8, n_heads=4, n_ctx=128),
    "quick": dict(d_model=32, n_layers=2, n_heads=2, n_ctx=64),
}


def build(size: str, residual: str) -> AttnResTransformer:
    model = AttnResTransformer(ModelConfig(seed=0, **SIZES[size], **rule_kwargs(residual))).eval()
    g = torch.Generator().manual_seed(0)
    perturb_routing(model, g)  # non-uniform routing, as in a trained model (queries, or HC / DWA weights)
    return model


def corpus_timings(size: str, residual: str, n_windows: int, batch: int, reps: int) -> dict[str, float]:
    model = build(size, residual)
    n_ctx = SIZES[size]["n_ctx"]
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 256, (n_windows, n_ctx), generator=g)
    docs = [w for w in windows]  # one document per window: the corpus records exactly these windows
    params = [p for p in model.parameters() if p.requires_grad]
    probe = Probe(model)

    def loss(tokens):
        logits = model(tokens)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    def plain_each():
        for w in windows:
            torch.autograd.grad(loss(w[None]), params)

    def plain_batched():
        for i in range(0, n_windows, batch):
            torch.autograd.grad(loss(windows[i : i + batch]), params)

    def corpus():
        probe.run_corpus(docs, batch_size=batch, backward=True, progress=False)

    def corpus_pooled_grads():
        probe.run_corpus(docs, batch_size=batch, backward=True, progress=False, window_grads=False)

    fns = dict(plain_each=plain_each, plain_batched=plain_batched, corpus=corpus, corpus_batched=corpus_pooled_grads)
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):  # interleaved so machine noise hits every variant alike
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def bootstrap_timings(n_windows: int, n_resamples: int, reps: int) -> dict[str, float]:
    rng, ref_rng = np.random.default_rng(0), np.random.default_rng(1)
    items = []
    for name, residual in (("prenorm", "prenorm"), ("full", "full"), ("block", "block")):
        table = pd.DataFrame({"doc": np.arange(n_windows), "start": 0, "n_tokens": 256,
                              "digest": [f"{i:016x}" for i in range(n_windows)]})
        for m in WINDOW_METRICS:
            table[m] = rng.gamma(4.0, 0.25, n_windows)
        for c in REFERENCE_COLUMNS:  # the routing diagnostics' uniform references, which compare reads too
            table[c] = ref_rng.gamma(4.0, 0.25, n_windows)
        items.append(Windows(name, residual, table, table[list(WINDOW_METRICS)].mean()))
    a, b = rng.normal(size=n_windows), rng.normal(size=n_windows)
    out: dict[str, list[float]] = {"compare": [], "one_pair": []}
    for _ in range(reps):
        t = time.perf_counter()
        compare_windows(items, n_resamples=n_resamples, seed=0)
        out["compare"].append(time.perf_counter() - t)
        t = time.perf_counter()
        bootstrap.paired_interval(a, b, bootstrap.resample_counts(n_windows, n_resamples, 0), "ratio")
        out["one_pair"].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in out.items()}


def procs_worker(size: str, residual: str, n_docs: int) -> None:
    """One process of the --procs timing (started by torchrun, or alone for 1 process)."""
    import json
    import os

    import torch.distributed as dist

    from attnres_probe.corpus.distributed import current_ranks

    torch.set_num_threads(1)
    model = build(size, residual)
    g = torch.Generator().manual_seed(2)
    docs = [t for t in torch.randint(0, 256, (n_docs, SIZES[size]["n_ctx"]), generator=g)]
    probe = Probe(model)
    ranks = current_ranks()
    probe.run_corpus(docs[: max(2, ranks.world if ranks else 1)], backward=True, progress=False)  # warm-up
    if ranks is not None:
        dist.barrier()
    t = time.perf_counter()
    stats = probe.run_corpus(docs, backward=True, progress=False)
    seconds = time.perf_counter() - t
    if ranks is None or ranks.is_main:
        print(json.dumps({"tokens": stats.n_tokens, "seconds": seconds, "procs": ranks.world if ranks else 1}), flush=True)
    if ranks is not None:
        dist.destroy_process_group()
    os._exit(0)


def procs_timings(procs: list[int], size: str, residual: str, n_docs: int, reps: int) -> dict[int, float]:
    """tokens/s of run_corpus with each process count: median of ``reps`` interleaved runs."""
    import json
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = [__file__, "--worker", "--size", size, "--residuals", residual, "--docs", str(n_docs)]
    rates: dict[int, list[float]] = {p: [] for p in procs}
    for _ in range(reps):
        for p in procs:
            cmd = [sys.executable, *worker] if p == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}", *worker]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            line = json.loads([x for x in run.stdout.splitlines() if x.startswith("{")][-1])
            rates[p].append(line["tokens"] / line["seconds"])
    return {p: statistics.median(v) for p, v in rates.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="large", choices=list(SIZES))
    ap.add_argument("--residuals", nargs="+", default=["prenorm", "full", "block"])
    ap.add_argument("--windows", type=int, default=16, help="windows per timed pass (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="windows per batch for the batched passes (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 windows, 2 reps")
    ap.add_argument("--bootstrap-only", action="store_true", help="only the bootstrap timing")
    ap.add_argument("--procs", nargs="+", type=int, help="time run_corpus with these numbers of gloo processes instead")
    ap.add_argument("--docs", type=int, default=64, help="documents (one window each) of the --procs timing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        procs_worker(args.size, args.residuals[0], args.docs)
    if args.procs:
        residual = args.residuals[0] if args.residuals != ["prenorm", "full", "block"] else "block"
        s = SIZES[args.size]
        print(f"run_corpus under torchrun (gloo), 1 torch thread per process, {residual} d={s['d_model']}, "
              f"{s['n_layers']} layers, {args.docs} windows x {s['n_ctx']} tokens, backward per window; "
              f"median of {args.reps} interleaved runs\n")
        rates = procs_timings(args.procs, args.size, residual, args.docs, args.reps)
        base = rates.get(1)
        for p, r in rates.items():
            speed = f"{r / base:.2f}x" if base else ""
            verdict = ("ok" if r / base >= 1.7 else "MISSES TARGET (>= 1.7x)") if base and p == 2 else ""
            print(f"{p} process{'es' if p > 1 else '  '}  {r:9.0f} tokens/s  {speed:>6s}  {verdict}")
        return 0
    if args.quick:
        args.size, args.windows, args.reps = "quick", 4, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    s = SIZES[args.size]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.reps} interleaved reps; "
          f"d={s['d_model']}, {s['n_layers']} layers, {args.windows} windows x {s['n_ctx']} tokens\n")
    width = max(8, *(len(r) for r in args.residuals))
    head = (f"{'model':{width}s} {'plain/window tok/s':>18s} {'corpus tok/s':>12s} {'corpus/plain':>12s} "
            f"{'plain b{0} tok/s'.format(args.batch):>16s} {'corpus/plain b':>14s} {'pooled-grad corpus/plain b':>26s}  verdict")
    print(head)
    print("-" * len(head))
    ok_all = True
    n_tok = args.windows * s["n_ctx"]
    for residual in args.residuals if not args.bootstrap_only else []:
        t = corpus_timings(args.size, residual, args.windows, args.batch, args.reps)
        r_each, r_batch, r_pooled = t["corpus"] / t["plain_each"], t["corpus"] / t["plain_batched"], t["corpus_batched"] / t["plain_batched"]
        ok = r_each <= 1.25
        ok_all &= ok
        print(f"{residual:{width}s} {n_tok / t['plain_each']:18.0f} {n_tok / t['corpus']:12.0f} {r_each:12.3f} "
              f"{n_tok / t['plain_batched']:16.0f} {r_batch:14.3f} {r_pooled:26.3f}  {'ok' if ok else 'MISSES TARGET'}")
    bt = bootstrap_timings(1000, 1000, max(args.reps, 3))
    ok_boot = bt["compare"] <= 2.0
    print(f"\nbootstrap, 1000 resamples over 1000 windows: compare of 3 models x {len(WINDOW_METRICS)} metrics "
          f"{bt['compare']:.3f} s, one paired ratio {bt['one_pair'] * 1e3:.1f} ms  {'ok' if ok_boot else 'MISSES TARGET'}")
    print("\nall targets met" if ok_all and ok_boot else "\nsome targets missed (see verdicts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
