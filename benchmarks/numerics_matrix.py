"""The kernel and whole-model numerics tests over a matrix of CPU targets and thread counts.

Every tolerance in ``tests/kernels`` is an a-priori bound ``C u G kappa`` (``tests/kernels/
closeness.py``). This script reruns the tests that check the kernels and the whole models
against their float64 twins under every Numba CPU target this machine can execute (``generic``,
``nehalem``, ``haswell``, ``skylake-avx512`` and the host's own), with ``NUMBA_NUM_THREADS`` 1
and 2 and torch threads 1 and 2, collects each checked quantity's margin (error / bound) and
prints the worst margin per quantity over the whole matrix: a bound holds with room to spare
when every margin is at most 0.3.

    python benchmarks/numerics_matrix.py                 # the whole matrix (about 30-40 min on 2 cores)
    python benchmarks/numerics_matrix.py --targets generic host --threads 1
    python benchmarks/numerics_matrix.py --markdown docs/numerics.md   # rewrite the table there

A target the CPU cannot execute is skipped with the reason printed (its instructions would
fault). Exit status 1 if any test fails or any margin exceeds ``--limit`` (0.3).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ("tests/kernels/test_numba_depth_attn.py", "tests/kernels/test_model_backends.py",
         "tests/kernels/test_reference_and_dispatch.py")
# CPU flags (as /proc/cpuinfo names them) each LLVM target may use
TARGET_FLAGS = {
    "generic": (),
    "nehalem": ("sse4_2", "popcnt"),
    "haswell": ("avx2", "fma", "bmi2"),
    "skylake-avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
}
BEGIN, END = "<!-- numerics-matrix:begin -->", "<!-- numerics-matrix:end -->"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    return set(m.group(1).split()) if m else set()


def quantity_class(test: str, quantity: str) -> str:
    """Group a checked quantity: op outputs and gradients by name, model results by kind."""
    q = re.sub(r"^(reference |[a-z0-9 _-]+ float32, |[a-z_0-9-]+, )", "", quantity)
    if "test_model_backends" not in test:
        return f"op: {q}"
    if q in ("logits", "loss"):
        return f"model: {q}"
    if q.endswith(("_res.query", "out_res.query")):
        return "model: d mixer query"
    if q.endswith("_res.norm.weight"):
        return "model: d mixer gain"
    if "_res.hc." in q:  # Hyper-Connections / mHC: their reads have no query (issue #36)
        return "model: d hyper-connection weights"
    if "dwa.alphas" in q:  # DenseFormer's depth-weighted averages
        return "model: d DWA weights"
    if re.search(r"(ln\d?|ln_final|norm)\.weight$", q):
        return "model: d norm gains"
    if q in ("depth_weights", "contrib", "grad_in", "mixer_grad", "saturated logits"):
        return f"trace: {q}"
    return "model: d weight matrices and embeddings"


def run_cell(target: str, numba_threads: int, torch_threads: int, log: Path) -> tuple[int, str]:
    env = dict(os.environ, ATTNRES_NUMERICS_LOG=str(log), ATTNRES_NUMBA_CACHE="0",
               NUMBA_NUM_THREADS=str(numba_threads), OMP_NUM_THREADS=str(torch_threads),
               MKL_NUM_THREADS=str(torch_threads))
    if target != "host":
        env["NUMBA_CPU_NAME"] = target
    else:
        env.pop("NUMBA_CPU_NAME", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    tail = (run.stdout.strip().splitlines() or [""])[-1]
    return run.returncode, tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=[*TARGET_FLAGS, "host"],
                    help="Numba CPU targets (default: generic nehalem haswell skylake-avx512 host)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="thread counts for Numba and torch (default 1 2)")
    ap.add_argument("--limit", type=float, default=0.3, help="largest accepted margin (default 0.3)")
    ap.add_argument("--markdown", type=Path, help="rewrite the table between the matrix markers of this file")
    ap.add_argument("--json", type=Path, help="write every cell's worst margins as JSON here")
    ap.add_argument("--from-json", type=Path, help="render the table from a --json file of an earlier run instead of running")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        failures = sum(c["returncode"] != 0 for c in saved["cells"])
        return report(saved["cells"], {k: tuple(v) for k, v in saved["worst"].items()}, failures, args)
    flags = cpu_flags()
    import llvmlite.binding as llvm

    host = llvm.get_host_cpu_name()
    worst: dict[str, tuple[float, str]] = {}
    cells, failures = [], 0
    for target in args.targets:
        missing = [f for f in TARGET_FLAGS.get(target, ()) if f not in flags]
        if missing:
            print(f"skip {target}: this CPU lacks {', '.join(missing)} (its code would fault)", flush=True)
            continue
        for nt in args.threads:
            for tt in args.threads:
                with tempfile.TemporaryDirectory() as tmp:
                    log = Path(tmp) / "margins.jsonl"
                    t0 = time.perf_counter()
                    rc, tail = run_cell(target, nt, tt, log)
                    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
                label = f"{target if target != 'host' else 'host (' + host + ')'}, numba {nt}, torch {tt}"
                cell_worst = max((r["error"] / r["bound"] for r in rows if r["bound"] > 0), default=float("nan"))
                print(f"{label}: {tail} ({len(rows)} checks, worst margin {cell_worst:.3f}, {time.perf_counter() - t0:.0f} s)", flush=True)
                failures += rc != 0
                cells.append({"cell": label, "returncode": rc, "checks": len(rows), "worst": cell_worst})
                for r in rows:
                    m = r["error"] / r["bound"] if r["bound"] > 0 else 0.0
                    key = quantity_class(r["test"], r["quantity"])
                    if m > worst.get(key, (-1.0, ""))[0]:
                        worst[key] = (m, f"{label}; {r['test'].split('::')[-1]}; {r['quantity']}")
    return report(cells, worst, failures, args)


def report(cells: list[dict], worst: dict[str, tuple[float, str]], failures: int, args: argparse.Namespace) -> int:
    """Print the table of worst margins (and write it where asked); the exit status."""
    lines = ["| quantity | worst error / bound | where |", "|---|---|---|"]
    for key in sorted(worst):
        m, where = worst[key]
        lines.append(f"| {key} | {m:.3f} | {where.replace('|', '/')} |")
    table = "\n".join(lines)
    print(table)
    over = [k for k, (m, _) in worst.items() if m > args.limit]
    if args.markdown:
        text = args.markdown.read_text() if args.markdown.exists() else f"{BEGIN}\n{END}\n"
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        summary = (f"{len(cells)} cells ({'; '.join(c['cell'] for c in cells)}), "
                   f"{sum(c['checks'] for c in cells)} checked quantities in all; failed cells: {failures}.\n\n")
        args.markdown.write_text(f"{head}{BEGIN}\n{summary}{table}\n{END}{tail}")
    if args.json:
        args.json.write_text(json.dumps({"cells": cells, "worst": worst}, indent=1))
    if over:
        print(f"margins above {args.limit}: {', '.join(over)}: re-derive those bounds", file=sys.stderr)
    return 1 if failures or over else 0


if __name__ == "__main__":
    sys.exit(main())
