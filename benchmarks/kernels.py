"""Depth-attention speed: the Triton op (GPU) or the Numba op (CPU) vs the eager reference vs torch.compile(reference).

For every shape (M token rows, S sources, width d) it measures, in one run:

- forward time (no autograd) and forward+backward time (gradients of sources, query, gain for
  a fixed upstream gradient of the mixture), median over repeats after a warm-up, timed with
  CUDA events on a GPU and ``time.perf_counter`` on the CPU;
- achieved bandwidth = algorithmic bytes / time, where the forward moves (S + 1)·M·d
  activations (read every source once, write the mixture) plus the lse, and the backward adds
  (2S + 1)·M·d (read the sources and the mixture's gradient, write the sources' gradients).
  This is the traffic of an ideal kernel: the Triton backward actually reads the sources
  twice, so its bandwidth column understates the hardware's traffic;
- a device-to-device copy bandwidth measured in the same run, and the ratios
  fwd-bandwidth / copy-bandwidth, eager / triton and compiled / triton.

Before timing a shape it checks that the Triton result (mixture, lse, gradients of sources,
query and gain) matches the reference; a mismatching shape gets "MISMATCH" instead of timings
and ratios, so no speed-up is ever reported for a wrong kernel.

Without CUDA, the Numba kernels (the CPU backend; float32 only), the eager and the compiled
reference are measured on a small grid, and the script says so ("GPU rows not measured: no CUDA
device"). The Numba rows are checked against the reference the same way.

Usage:
    python benchmarks/kernels.py                                  # default grid for the device
    python benchmarks/kernels.py --M 16384 --S 5 9 17 --d 1024 2048 --dtype bf16 --out r.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnres_probe.kernels import depth_attn, depth_attn_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative RMS error allowed against the reference on the same inputs (rounding of outputs).
CHECK_RRMS = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
CHECK_RRMS_FP32_OUT = 1e-3  # lse and query/gain gradients, computed in fp32 by both sides


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, warmup: int, reps: int) -> float:
    """Bandwidth of a large same-device copy: (read + write bytes) / time, in GB/s."""
    numel = (256 if device.type == "cuda" else 32) * 2**20  # 1 GiB / 128 MiB of fp32
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup, reps)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def _rrms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def check_backend(x, q, g, dmix, fused: str = "triton") -> str | None:
    """None when the fused backend matches the reference on these inputs, else what mismatched."""
    results = []
    for backend in (fused, "torch"):
        xs, qs, gs = (t.detach().clone().requires_grad_(True) for t in (x, q, g))
        mix, lse = depth_attn(xs, qs, gs, backend=backend)
        grads = torch.autograd.grad(mix, (xs, qs, gs), dmix)
        results.append((mix, lse, *grads))
    lowp = CHECK_RRMS[x.dtype]
    tols = (lowp, CHECK_RRMS_FP32_OUT, lowp, CHECK_RRMS_FP32_OUT, CHECK_RRMS_FP32_OUT)
    bad = []
    for name, a, b, tol in zip(("mix", "lse", "d sources", "d query", "d gain"), *results, tols):
        err = _rrms(a, b)
        if not err <= tol:  # NaN fails too
            bad.append(f"{name} rel RMS {err:.2e} > {tol:.0e}")
    return "; ".join(bad) or None


def bench_shape(m: int, s: int, d: int, dtype: torch.dtype, device: torch.device, compiled, warmup: int, reps: int, copy_gbs: float) -> dict:
    x = torch.randn(s, m, d, device=device, dtype=dtype)
    q = torch.randn(d, device=device) / d**0.5
    g = 1 + 0.1 * torch.randn(d, device=device)
    dmix = torch.randn(m, d, device=device, dtype=dtype)
    es = x.element_size()
    fwd_bytes = (s + 1) * m * d * es + 4 * m
    bwd_bytes = (2 * s + 1) * m * d * es
    row: dict = {"M": m, "S": s, "d": d, "dtype": str(dtype).removeprefix("torch."), "copy GB/s": copy_gbs}

    impls: dict[str, Callable] = {"eager": lambda *a: depth_attn_reference(*a)}
    if compiled is not None:
        impls["compiled"] = compiled
    fused = "triton" if device.type == "cuda" else "numba" if dtype in (torch.float32, torch.float64) else None
    if fused is not None:
        problem = check_backend(x, q, g, dmix, fused)
        row["check"] = f"{fused} ok" if problem is None else f"{fused} MISMATCH: {problem}"
        if problem is None:
            impls = {fused: lambda *a: depth_attn(*a, backend=fused), **impls}
    else:
        row["check"] = "n/a (no fused backend for this dtype here)"

    xg, qg, gg = (t.detach().clone().requires_grad_(True) for t in (x, q, g))

    def fwd(fn):
        with torch.no_grad():
            return fn(x, q, g)

    def fwd_bwd(fn):
        mix = fn(xg, qg, gg)[0]
        return torch.autograd.grad(mix, (xg, qg, gg), dmix)

    # Run every implementation once before timing any: compiling (Triton JIT, Inductor and its
    # worker processes) must not overlap another implementation's timed loop.
    for name, fn in list(impls.items()):
        try:
            fwd(fn), fwd_bwd(fn)
        except Exception as exc:  # e.g. torch.compile unavailable on this machine
            row[f"{name} error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            del impls[name]
    _sync(device)

    for name, fn in impls.items():
        t_f = time_ms(lambda: fwd(fn), device, warmup, reps)
        t_fb = time_ms(lambda: fwd_bwd(fn), device, warmup, reps)
        row[f"{name} fwd ms"] = t_f
        row[f"{name} fwd GB/s"] = fwd_bytes / (t_f * 1e-3) / 1e9
        row[f"{name} fwd+bwd ms"] = t_fb
        row[f"{name} fwd+bwd GB/s"] = (fwd_bytes + bwd_bytes) / (t_fb * 1e-3) / 1e9

    def ratio(key: str, num: str, den: str) -> None:
        a, b = row.get(num), row.get(den)
        if a is not None and b is not None:
            row[key] = a / b

    ratio("triton fwd BW / copy BW", "triton fwd GB/s", "copy GB/s")
    ratio("eager fwd BW / copy BW", "eager fwd GB/s", "copy GB/s")
    ratio("compiled fwd BW / copy BW", "compiled fwd GB/s", "copy GB/s")
    ratio("eager/triton fwd", "eager fwd ms", "triton fwd ms")
    ratio("eager/triton fwd+bwd", "eager fwd+bwd ms", "triton fwd+bwd ms")
    ratio("compiled/triton fwd+bwd", "compiled fwd+bwd ms", "triton fwd+bwd ms")
    ratio("eager/compiled fwd+bwd", "eager fwd+bwd ms", "compiled fwd+bwd ms")
    ratio("numba fwd BW / copy BW", "numba fwd GB/s", "copy GB/s")
    ratio("eager/numba fwd", "eager fwd ms", "numba fwd ms")
    ratio("eager/numba fwd+bwd", "eager fwd+bwd ms", "numba fwd+bwd ms")
    ratio("compiled/numba fwd+bwd", "compiled fwd+bwd ms", "numba fwd+bwd ms")
    return row


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if v < 1000 else f"{v:.0f}"
    return str(v)


def render(rows: list[dict], fmt: str) -> str:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    if fmt == "csv":
        lines = [",".join(keys)] + [",".join(_fmt(r.get(k, "")).replace(",", ";") for k in keys) for r in rows]
    else:
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--M", type=int, nargs="+", default=[16384] if cuda else [2048], help="token rows (batch*pos)")
    p.add_argument("--S", type=int, nargs="+", default=[5, 9, 17] if cuda else [5, 9], help="number of sources")
    p.add_argument("--d", type=int, nargs="+", default=[1024, 2048] if cuda else [256], help="feature width")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--out", type=Path, default=None, help="write the results table here (.csv for CSV, else markdown)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20 if cuda else 5)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd reference")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (a busy shared CPU times more steadily with 1)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    compiled = None
    if not args.no_compile:
        compiled = torch.compile(lambda x, q, g: depth_attn_reference(x, q, g))

    where = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    header = f"device: {where}; torch {torch.__version__}; dtype {args.dtype}"
    print(header)
    if not cuda:
        print("GPU rows not measured: no CUDA device (Numba kernels vs eager and compiled reference)")
    copy_gbs = copy_bandwidth_gbs(device, args.warmup, args.reps)
    print(f"{'device-to-device' if cuda else 'host'} copy bandwidth: {copy_gbs:.1f} GB/s")

    rows = []
    fmt = "csv" if args.out is not None and args.out.suffix == ".csv" else "md"
    for m in args.M:
        for s in args.S:
            for d in args.d:
                row = bench_shape(m, s, d, dtype, device, compiled, args.warmup, args.reps, copy_gbs)
                rows.append(row)
                print(f"M{m}-S{s}-D{d}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k not in ("M", "S", "d", "dtype")), flush=True)
                if args.out is not None:  # rewrite after each shape, so a cut-off run still leaves a table
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    notes = [header, f"copy bandwidth: {copy_gbs:.1f} GB/s"]
                    if not cuda:
                        notes.append("GPU rows not measured: no CUDA device")
                    prefix = "" if fmt == "csv" else "".join(f"{n}  \n" for n in notes) + "\n"
                    args.out.write_text(prefix + render(rows, fmt))
    print()
    print(render(rows, "md"))
    mismatched = [r for r in rows if str(r.get("check", "")).startswith("MISMATCH")]
    if mismatched:
        print(f"{len(mismatched)} shape(s) mismatched the reference; no speed-up reported for them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
