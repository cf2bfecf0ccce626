"""Recording overhead of the probe, measured side by side in one run.

For each size and residual mode it times, interleaved and repeated (median):
  - plain forward vs the forward with the recorder attached (``Recorder``: every hook and
    reduction of a full recording: weights, logits, contribution shares, RMS in and out),
    and vs ``Probe.run(backward=False)`` end to end (also tokens' labels, the per-token loss
    and building the DepthTrace)
  - plain forward + backward (autograd.grad) vs ``Probe.run(backward=True)`` (gradient
    recording, end to end), and ``Probe.run(backward=True)`` against itself without the
    gradient norms at the sublayer outputs (``grad_out``: target at most 1.05x)
  - TransformerLens run_with_cache (all hooks; with incl_bwd for the backward case)
and prints the ratios. Targets: recording <= 1.10x forward, <= 1.15x forward+backward, and below
run_with_cache on both (the forward target is judged on the recorder, run_with_cache's
counterpart; the end-to-end Probe.run ratio is printed beside it).

The rules are the demo rules (``attnres_probe.demo_recipe.DEMO_RULES``): PreNorm, Full, Block and
(issue #36) mHC (``residual="hyper", mhc=True, n_streams=4``) and DenseFormer. The reads of the
last two are coefficient reads: while a hook is attached to a read's weights or shares the forward
carries the effective-depth-weight bookkeeping (mHC: a coefficient matrix per token, updated at
every sublayer), else it skips it. For them a second table gives what the bookkeeping adds: the
recorded forward (``Recorder``, everything) against the same recorded forward without the weight
and share hooks (no bookkeeping, no shares), as a fraction of the recorded forward, and the part
of it the shares take (the recorder with ``contributions=False`` keeps the weights and so the
bookkeeping): ``adds`` = ``weights`` (the coefficients alone) + ``shares``. Target (issue #36): the
bookkeeping adds <= 10 % of the recorded forward at d=256 (judged on ``adds``).

Memory: each configuration's peak resident memory (VmHWM) is measured in a fresh subprocess for the plain forward and
for the recorded forward, each after one small recorded forward (8 tokens) that loads the code a recording uses; the
difference (the recording's memory) is compared with the size of the recorded arrays (target: at most 2x).

    python benchmarks/probe.py                 # demo size and d=256 / 12 layers / 512 tokens / batch 8
    python benchmarks/probe.py --quick         # small sizes, for a smoke run
    python benchmarks/probe.py --sizes large --rules mhc,denseformer --reps 3 --no-memory
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from attnres_probe import AttnResTransformer, ModelConfig, Probe
from attnres_probe.hooks import Recorder

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_rules import ALL_RULES, parse_rules, perturb_routing, rule_kwargs  # noqa: E402  (the rules by name)

SIZES = {
    "demo": dict(d_model=64, n_layers=8, n_heads=4, n_ctx=128, batch=8),
    "large": dict(d_model=256, n_layers=12, n_heads=8, n_ctx=512, batch=8),
    "quick": dict(d_model=32, n_layers=2, n_heads=2, n_ctx=64, batch=2),
}
COEFFICIENT_RULES = ("hyper", "denseformer")  # residuals whose reads carry the effective-weight bookkeeping
BOOK_TARGET, BOOK_TARGET_D = 0.10, 256  # the bookkeeping adds <= 10 % of the recorded forward at d=256 (issue #36)


def build(size: str, residual: str) -> tuple[AttnResTransformer, torch.Tensor]:
    s = dict(SIZES[size])
    batch = s.pop("batch")
    model = AttnResTransformer(ModelConfig(seed=0, **s, **rule_kwargs(residual))).eval()
    g = torch.Generator().manual_seed(0)
    perturb_routing(model, g)  # non-uniform routing, as in a trained model (queries, or HC / DWA weights)
    tokens = torch.randint(0, 256, (batch, s["n_ctx"]), generator=g)
    return model, tokens


def _loss(model, tokens):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def has_bookkeeping(model) -> bool:
    """Whether the model's reads are coefficient reads (HC / mHC, DenseFormer), whose forward
    carries the effective-weight bookkeeping while their weights or shares are hooked."""
    return model.cfg.residual in COEFFICIENT_RULES


def timings(size: str, residual: str, reps: int) -> dict[str, float]:
    """Median seconds of every variant (see the module's docstring); for coefficient-read rules
    also ``rec_fwd_nobook`` (the recorder without the weight and share hooks) and
    ``rec_fwd_nocontrib`` (the recorder without the shares)."""
    model, tokens = build(size, residual)
    probe = Probe(model)
    params = [p for p in model.parameters() if p.requires_grad]
    no_book = dataclasses.replace(probe.spec, weight_hooks=None, contrib_hooks=None)

    def plain_fwd():
        with torch.no_grad():
            model(tokens)

    def rec_fwd(spec=probe.spec, contributions=True):
        rec = Recorder(model, spec, contributions=contributions)
        with torch.no_grad(), rec:
            model(tokens)
        rec.finish()
        rec.arrays()

    def rec_fwd_nobook():  # the same recording without the weight and share hooks: no bookkeeping
        rec_fwd(no_book)

    def rec_fwd_nocontrib():  # the weights (and so the bookkeeping) without the shares
        rec_fwd(contributions=False)

    def run_fwd():
        probe.run(tokens, backward=False)

    def cache_fwd():
        with torch.no_grad():
            model.run_with_cache(tokens)

    def plain_bwd():
        torch.autograd.grad(_loss(model, tokens), params)

    def rec_bwd():
        probe.run(tokens, backward=True)

    def rec_bwd_no_gout():  # the same recording without the gradient norms at the sublayer outputs
        original = Recorder._grad_norm_into

        def skip_grad_out(self, name, index, x):
            if name != "grad_out":
                original(self, name, index, x)

        Recorder._grad_norm_into = skip_grad_out
        try:
            probe.run(tokens, backward=True)
        finally:
            Recorder._grad_norm_into = original

    def cache_bwd():
        cache = model.add_caching_hooks(incl_bwd=True)
        try:
            with warnings.catch_warnings():
                # HC's stream hook points warn when a hook replaces the stream state while weights are
                # recorded; the backward caching hooks hand back a wrapped tensor of the same values
                warnings.filterwarnings("ignore", message="a hook changed the stream state", category=UserWarning)
                torch.autograd.grad(_loss(model, tokens), params)
        finally:
            model.reset_hooks()
        del cache

    fns = dict(
        plain_fwd=plain_fwd, rec_fwd=rec_fwd, run_fwd=run_fwd, cache_fwd=cache_fwd,
        plain_bwd=plain_bwd, rec_bwd=rec_bwd, rec_bwd_no_gout=rec_bwd_no_gout, cache_bwd=cache_bwd,
    )  # fmt: skip
    if has_bookkeeping(model):
        fns.update(rec_fwd_nobook=rec_fwd_nobook, rec_fwd_nocontrib=rec_fwd_nocontrib)
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):  # interleaved so machine noise hits every variant alike
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def ratios(t: dict[str, float]) -> dict[str, float]:
    """The table's numbers from :func:`timings`: rec/fwd, run/fwd, cache/fwd, rec/f+b, cache/f+b,
    grad_out (rec f+b / the same without grad_out) and, for coefficient-read rules, ``book``
    (what the weight and share hooks add to a recorded forward, as a fraction of it) = ``weights``
    (the coefficients alone: the recorder without shares against the one without either) +
    ``shares`` (the contribution shares: the full recorder against the one without shares)."""
    out = dict(
        rec_f=t["rec_fwd"] / t["plain_fwd"], run_f=t["run_fwd"] / t["plain_fwd"], cache_f=t["cache_fwd"] / t["plain_fwd"],
        rec_b=t["rec_bwd"] / t["plain_bwd"], cache_b=t["cache_bwd"] / t["plain_bwd"],
        grad_out=t["rec_bwd"] / t["rec_bwd_no_gout"],  # what recording grad_out adds to a recorded forward + backward
    )  # fmt: skip
    if "rec_fwd_nobook" in t:
        out["book"] = (t["rec_fwd"] - t["rec_fwd_nobook"]) / t["rec_fwd"]  # = weights + shares
        out["weights"] = (t["rec_fwd_nocontrib"] - t["rec_fwd_nobook"]) / t["rec_fwd"]
        out["shares"] = (t["rec_fwd"] - t["rec_fwd_nocontrib"]) / t["rec_fwd"]
    return out


def book_verdict(size: str, book: float) -> tuple[bool, str]:
    """(met, words): the bookkeeping target applies at d=256 only."""
    if SIZES[size]["d_model"] != BOOK_TARGET_D:
        return True, f"(target <= {BOOK_TARGET:.0%} is for d={BOOK_TARGET_D})"
    ok = book <= BOOK_TARGET
    return ok, f"{'ok' if ok else 'MISSES TARGET'} (target <= {BOOK_TARGET:.0%})"


def _peak_rss(size: str, residual: str, mode: str) -> dict[str, float]:
    """Run in a subprocess: peak RSS (MB) after one plain or recorded forward, and the arrays' size."""
    code = f"""
import json, torch, sys
sys.path.insert(0, {json.dumps(str(HERE))})
from probe import build
from attnres_probe import Probe
torch.set_num_threads(1)
model, tokens = build({size!r}, {residual!r})
probe = Probe(model)
def hwm():  # peak resident memory of this process (MB); unlike ru_maxrss it restarts at exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
# one small recorded forward first, in both modes: the code a recording loads on first use (Numba's
# kernels for the shares, which DenseFormer's plain forward never touches) is not the recording's memory
probe.run(tokens[:1, :8], backward=False)
base = hwm()
arrays = 0
if {mode!r} == "plain":
    with torch.no_grad():
        model(tokens)
else:
    t = probe.run(tokens, backward=False, contributions={mode!r} == "record")
    arrays = sum(getattr(t, n).nbytes for n in ("depth_weights", "logits", "contrib", "rms_in", "grad_in", "rms_out", "grad_out")
                 if getattr(t, n, None) is not None) / 2**20
peak = hwm()
print(json.dumps(dict(base=base, peak=peak, arrays=arrays)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["demo", "large"], choices=list(SIZES))
    ap.add_argument("--rules", "--residuals", dest="residuals", nargs="+", default=[",".join(ALL_RULES)],
                    help=f"rules, comma- or space-separated (default: {','.join(ALL_RULES)}); a name not a demo "
                         "rule is a ModelConfig residual with its defaults")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="only the tiny size, 3 reps")
    ap.add_argument("--no-memory", action="store_true", help="skip the subprocess memory measurement")
    ap.add_argument("--memory-only", action="store_true", help="only the memory measurement")
    args = ap.parse_args(argv)
    args.residuals = parse_rules(args.residuals)
    if args.quick:
        args.sizes, args.reps = ["quick"], 3
    width = max(8, *(len(r) for r in args.residuals))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.reps} interleaved reps\n")
    head = (f"{'size':6s} {'model':{width}s} {'fwd ms':>8s} {'rec/fwd':>8s} {'run/fwd':>8s} {'cache/fwd':>9s} {'f+b ms':>8s} "
            f"{'rec/f+b':>8s} {'cache/f+b':>9s} {'grad_out':>8s}  verdict")
    print(head)
    print("-" * len(head))
    ok_all = True
    book_rows = []
    for size in args.sizes if not args.memory_only else []:
        for residual in args.residuals:
            t = timings(size, residual, args.reps)
            q = ratios(t)
            r_f, p_f, c_f, r_b, c_b, g_o = (q[k] for k in ("rec_f", "run_f", "cache_f", "rec_b", "cache_b", "grad_out"))
            ok = (r_f <= 1.10 and r_b <= 1.15 and t["rec_fwd"] < t["cache_fwd"] and t["rec_bwd"] < t["cache_bwd"]
                  and g_o <= 1.05)
            ok_all &= ok
            print(
                f"{size:6s} {residual:{width}s} {t['plain_fwd'] * 1e3:8.1f} {r_f:8.3f} {p_f:8.3f} {c_f:9.3f} "
                f"{t['plain_bwd'] * 1e3:8.1f} {r_b:8.3f} {c_b:9.3f} {g_o:8.3f}  {'ok' if ok else 'MISSES TARGET'}"
            )
            if "book" in q:
                book_rows.append((size, residual, t, q))
    if book_rows:
        print(f"\neffective-weight bookkeeping: a recorded forward with vs without the weight and share hooks, "
              f"adds = weights + shares (target: adds <= {BOOK_TARGET:.0%} of the recorded forward at d={BOOK_TARGET_D})")
        head = (f"{'size':6s} {'model':{width}s} {'rec ms':>8s} {'no-book ms':>10s} {'adds':>7s} "
                f"{'weights':>8s} {'shares':>7s}  verdict")
        print(head)
        print("-" * len(head))
        for size, residual, t, q in book_rows:
            ok, words = book_verdict(size, q["book"])
            ok_all &= ok
            print(f"{size:6s} {residual:{width}s} {t['rec_fwd'] * 1e3:8.1f} {t['rec_fwd_nobook'] * 1e3:10.1f} "
                  f"{q['book']:7.1%} {q['weights']:8.1%} {q['shares']:7.1%}  {words}")
    if not args.no_memory:
        print(f"\n{'size':6s} {'model':{width}s} {'contrib':7s} {'plain MB':>9s} {'recorded MB':>12s} {'recording MB':>13s} "
              f"{'arrays MB':>10s} {'ratio':>6s}")
        for size in args.sizes:
            for residual in args.residuals:
                plain = _peak_rss(size, residual, "plain")
                for mode in ("record", "record-no-contrib"):
                    rec = _peak_rss(size, residual, mode)
                    extra = max(rec["peak"] - plain["peak"], 0.0)
                    ratio = extra / rec["arrays"] if rec["arrays"] else float("nan")
                    flag = "yes" if mode == "record" else "no"
                    print(f"{size:6s} {residual:{width}s} {flag:7s} {plain['peak']:9.1f} {rec['peak']:12.1f} {extra:13.1f} "
                          f"{rec['arrays']:10.1f} {ratio:6.2f}")
    if not args.memory_only:
        print("\nall timing targets met" if ok_all else "\nsome timing targets missed (see verdicts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
