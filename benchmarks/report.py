"""Size and build time of an HTML report on the bundled demo models (five) and a 256-token text.

    python benchmarks/report.py [--out report.html] [--repeat 3] [--threads 2] [--ablate embed]

The demo models' context is 128 tokens, so the 256-token text is recorded as two 128-token
windows in one batch (tokens [2, 128] per model; see attnres_probe.reports.recording). Recording
(forward + backward through the models) is timed separately from building the report (metrics,
figures, explorer data, template, atomic write), which is what the budget below is about:

    budget: file < 8 MB, build < 5 s on a 2-core CPU.

Uses the bundled demo models (``load_demo``); if they are missing it says so and falls back to
freshly initialised models of the same configurations (``demo_config(name)``), which have the
same shapes and therefore the same report size and build cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnres_probe.demo import DEMO_NAMES, demo_config, load_demo
from attnres_probe.model import AttnResTransformer
from attnres_probe.reports import SAMPLE_TEXT, build_report, record_text
from attnres_probe.tokenizer import ByteTokenizer

SIZE_BUDGET_MB = 8.0
BUILD_BUDGET_S = 5.0


def demo_models() -> tuple[dict[str, AttnResTransformer], str]:
    """The three demo models, or freshly initialised ones of the demo configs if they are missing."""
    models, missing = {}, []
    for name in DEMO_NAMES:
        try:
            models[name] = load_demo(name)[0]
        except FileNotFoundError:
            missing.append(name)
            torch.manual_seed(0)
            models[name] = AttnResTransformer(demo_config(name)).eval()
    source = "bundled demo models" if not missing else (
        f"demo models {', '.join(missing)} are missing: using freshly initialised models of demo_config(name) instead"
    )
    return models, source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="keep the report here (default: a temporary directory)")
    parser.add_argument("--repeat", type=int, default=3, help="build the report this many times; report the median")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads for recording (default 1: a 2-core machine shared with other work slows down badly when oversubscribed)",
    )
    parser.add_argument("--ablate", default=None, help="also ablate this source family in the AttnRes models (e.g. embed)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    models, source = demo_models()
    print(f"models: {source}")
    text = SAMPLE_TEXT
    n_tokens = len(ByteTokenizer().encode(text))
    t0 = time.perf_counter()
    traces = [record_text(m, text, name=n) for n, m in models.items()]
    record_s = time.perf_counter() - t0
    shapes = ", ".join(f"{t.name} {tuple(t.tokens.shape)}" for t in traces)
    print(f"text: {n_tokens} tokens, recorded as {shapes} (windows of n_ctx={traces[0].meta['windows']['n_ctx']})")
    print(f"recording (forward + backward, {len(traces)} models): {record_s:.2f} s")

    ablations = None
    if args.ablate:
        from attnres_probe.probe import Probe

        t0 = time.perf_counter()
        ablations = {
            n: Probe(m, name=n).ablate(text, sources=args.ablate, truncate=True) for n, m in models.items() if n != "prenorm"
        }
        print(f"ablation ({args.ablate}, first window): {time.perf_counter() - t0:.2f} s")

    with tempfile.TemporaryDirectory(prefix="attnres-report-bench-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "report.html"
        times = []
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            build_report(traces, out, title="attnres-probe benchmark report", ablations=ablations)
            times.append(time.perf_counter() - t0)
        size_mb = out.stat().st_size / 1e6
    build_s = statistics.median(times)
    print(f"report size: {size_mb:.2f} MB (budget {SIZE_BUDGET_MB:.0f} MB)")
    print(f"report build: {build_s:.2f} s median of {len(times)} (first {times[0]:.2f} s; budget {BUILD_BUDGET_S:.0f} s)")
    ok = size_mb < SIZE_BUDGET_MB and build_s < BUILD_BUDGET_S
    print("within budget" if ok else "OVER BUDGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
