"""Attention patterns: the explicit attention path against SDPA, side by side, on the CPU.

For each residual mode (``--rules``, default prenorm, full, block; any demo rule, e.g. mhc,
denseformer) at the demo size (d_model 64, 8 layers, 4 heads, n_ctx 128; batch 8 unless
asked), timed interleaved and repeated (median of ``--repeats``):

- ``sdpa``      the plain forward (no hook at hook_attn_scores / hook_pattern: SDPA in every layer);
- ``observe``   a forward with a hook that only looks at every layer's hook_pattern (what
                run_with_cache and ``Probe.run(patterns=True)`` attach): the scores and softmax are
                computed besides SDPA, whose output stays the forward's;
- ``explicit``  every layer computed as ``pattern @ v`` (a hook returning a copy of the pattern);
- the same three with a backward pass (``autograd.grad`` of the mean loss);
- ``Probe.run(backward=True)`` with and without ``patterns=True``.

    python benchmarks/attention_patterns.py              # demo size, batch 8
    python benchmarks/attention_patterns.py --batch 1 --n-ctx 1024 --layers 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from attnres_probe import AttnResTransformer, ModelConfig, Probe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rules import parse_rules, perturb_coefficients, rule_kwargs  # noqa: E402  (the rules by name)


def build(residual: str, args) -> AttnResTransformer:
    model = AttnResTransformer(ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                                           n_ctx=args.n_ctx, seed=0, **rule_kwargs(residual)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.mixers:
            if hasattr(m, "query"):  # AttnRes; HC / mHC and DenseFormer reads have none
                m.query.copy_(torch.randn(m.query.shape, generator=g) * 0.5)
    perturb_coefficients(model, g)  # HC / DWA weights instead (nothing for the other rules)
    return model.eval()


def hooks(model, kind: str) -> list:
    if kind == "sdpa":
        return []
    fn = (lambda x, hook: None) if kind == "observe" else (lambda x, hook: x.clone())
    return [(f"blocks.{i}.attn.hook_pattern", fn) for i in range(model.cfg.n_layers)]


def timed(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions interleaved round by round (after a warm-up)."""
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-ctx", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rules", nargs="+", default=["prenorm,full,block"],
                    help="comma-separated rules (default: prenorm,full,block; also mhc, denseformer, ...)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# attention patterns · CPU threads {torch.get_num_threads()} · d_model {args.d_model}, {args.layers} layers, "
          f"{args.heads} heads, batch {args.batch} x {args.n_ctx} tokens · median of {args.repeats}")
    rules = parse_rules(args.rules)
    w = max(9, *(len(r) + 1 for r in rules))
    print(f"{'model':<{w}}{'what':<24}{'sdpa ms':>9}{'observe ms':>12}{'explicit ms':>13}{'observe x':>11}{'explicit x':>12}")
    for residual in rules:
        model = build(residual, args)
        tokens = torch.randint(0, 256, (args.batch, args.n_ctx), generator=torch.Generator().manual_seed(0))
        params = [p for p in model.parameters() if p.requires_grad]

        def forward(kind):
            def run():
                with torch.no_grad(), model.hooks(fwd_hooks=hooks(model, kind)):
                    model(tokens)
            return run

        def backward(kind):
            def run():
                with model.hooks(fwd_hooks=hooks(model, kind)):
                    torch.autograd.grad(model(tokens, return_type="loss"), params)
            return run

        for what, make in (("forward", forward), ("forward + backward", backward)):
            t = timed({k: make(k) for k in ("sdpa", "observe", "explicit")}, args.repeats)
            print(f"{residual:<{w}}{what:<24}{t['sdpa'] * 1e3:>9.1f}{t['observe'] * 1e3:>12.1f}{t['explicit'] * 1e3:>13.1f}"
                  f"{t['observe'] / t['sdpa']:>10.2f}x{t['explicit'] / t['sdpa']:>11.2f}x")
        probe = Probe(model)
        t = timed({"plain": lambda: probe.run(tokens, backward=True),
                   "patterns": lambda: probe.run(tokens, backward=True, patterns=True)}, args.repeats)
        plain, with_patterns = t["plain"], t["patterns"]
        mib = 4 * args.batch * args.layers * args.heads * args.n_ctx**2 / 2**20
        print(f"{residual:<{w}}{'Probe.run(backward)':<24}{plain * 1e3:>9.1f}{with_patterns * 1e3:>12.1f}{'':>13}"
              f"{with_patterns / plain:>10.2f}x{'':>12}   (patterns=True keeps {mib:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
