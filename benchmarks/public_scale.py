"""Recording at the size of the public checkpoints, measured side by side in one run (issue #47).

Random-initialised models at the public configurations (the weights cannot be downloaded here),
with every depth query moved off zero so that routing is not uniform:

- ``nanogpt116m``: attnres4babylm's 116M model: 32 layers, d 512, 8 heads, vocab 16,000, context 512,
  Block AttnRes with 8 sublayers per block, the paper body (RMSNorm, SwiGLU 8/3, rotary, attention gate);
- ``qwen3_100m``: Qwen3-AttnRes 100M: 12 layers, d 512, 8 heads (4 KV heads, head 64), MLP 1,536, vocab
  151,936, ``attnres_num_blocks`` 4 (3 layers per kept state), gate ``bias``.

For each: the plain forward + backward of the training loss (``model(tokens, return_type="loss")`` then
``.backward()``) against ``Probe(model).run(tokens, backward=True)`` (the whole recording: weights,
shares, RMS, per-token gradient norms, parameter-gradient norms, the trace), interleaved, median of
``--reps``; and ``Probe.run_corpus`` tokens per second (forward and backward per window). Peak memory
(VmHWM) is measured for each in a fresh subprocess after building the model: the ratio of the peaks,
and of what each adds to the built model's resident memory. Targets: recording <= 1.10x the time and
<= 1.3x the peak memory of the plain forward + backward at 512 tokens.

    python benchmarks/public_scale.py                          # both models, 512 tokens, 3 reps
    python benchmarks/public_scale.py --models nanogpt116m --reps 5 --threads 2
    python benchmarks/public_scale.py --quick                  # small stand-ins (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from attnres_probe import AttnResTransformer, ModelConfig, Probe

CONFIGS = {
    "nanogpt116m": dict(d_model=512, n_layers=32, n_heads=8, d_mlp=1344, n_ctx=512, d_vocab=16000, residual="block",
                        block_size=8, norm="rms", norm_eps=1e-5, bias=False, attn_gate=True, mlp="swiglu",
                        positional="rope", tie_embeddings=True),
    "qwen3_100m": dict(d_model=512, n_layers=12, n_heads=8, n_kv_heads=4, d_head=64, d_mlp=1536, n_ctx=1024,
                       d_vocab=151936, residual="cumulative",
                       rule_options={"mode": "block", "layers_per_block": 3, "gate": "bias"}, qk_norm=True,
                       qk_norm_eps=1e-6, positional="rope", mlp="swiglu", tie_embeddings=True),
}
QUICK = {"d_model": 64, "n_layers": 4, "d_vocab": 512, "d_mlp": 128}


def build(name: str, quick: bool) -> AttnResTransformer:
    kw = dict(CONFIGS[name])
    if quick:
        kw.update(QUICK)
        kw.pop("d_head", None)
    model = AttnResTransformer(ModelConfig(**kw)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.mixers:
            for attr in ("query", "bias"):
                p = getattr(m, attr, None)
                if isinstance(p, torch.nn.Parameter):
                    p.copy_(torch.randn(p.shape, generator=g) * (0.5 if attr == "query" else 1.0))
    return model


def plain_step(model: AttnResTransformer, tokens: torch.Tensor) -> None:
    loss = model(tokens, return_type="loss")
    loss.backward()
    model.zero_grad(set_to_none=True)


def probe_step(probe: Probe, tokens: torch.Tensor) -> None:
    probe.run(tokens, backward=True)


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def vm_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure_memory(name: str, what: str, n_tokens: int, quick: bool, threads: int) -> dict:
    """In a fresh subprocess: the resident memory after building, then the peak after one step."""
    code = (
        "import json, sys, torch; sys.path.insert(0, %r)\n"
        "import public_scale as ps\n"
        "torch.set_num_threads(%d)\n"
        "model = ps.build(%r, %r); tokens = torch.randint(0, model.cfg.d_vocab, (1, %d), generator=torch.Generator().manual_seed(0))\n"
        "from attnres_probe import Probe\n"
        "probe = Probe(model)\n"
        "built = ps.vm_rss_mb()\n"
        "(ps.plain_step(model, tokens) if %r == 'plain' else ps.probe_step(probe, tokens))\n"
        "print(json.dumps({'built': built, 'peak': ps.vm_hwm_mb()}))\n"
    ) % (str(Path(__file__).resolve().parent), threads, name, quick, n_tokens, what)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--corpus-windows", type=int, default=4, help="windows of --tokens tokens for run_corpus tokens/s")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small stand-ins of the same rules (a smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        model = build(name, args.quick)
        n_params = sum(p.numel() for p in model.parameters())
        tokens = torch.randint(0, model.cfg.d_vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        probe = Probe(model, name=name)
        plain_step(model, tokens)  # warm-up (kernels compile, allocator grows)
        probe_step(probe, tokens)
        plain, rec = [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            plain_step(model, tokens)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            probe_step(probe, tokens)
            rec.append(time.perf_counter() - t)
        windows = [torch.randint(0, model.cfg.d_vocab, (args.tokens,), generator=torch.Generator().manual_seed(i + 1)).tolist()
                   for i in range(args.corpus_windows)]
        t = time.perf_counter()
        probe.run_corpus(windows, backward=True, progress=False)
        corpus_tps = args.corpus_windows * args.tokens / (time.perf_counter() - t)
        row = {"model": name, "params_M": round(n_params / 1e6, 1), "tokens": args.tokens, "threads": args.threads,
               "plain_s": statistics.median(plain), "record_s": statistics.median(rec),
               "time_ratio": statistics.median(rec) / statistics.median(plain), "corpus_tokens_per_s": corpus_tps}
        if not args.no_memory:
            mp = measure_memory(name, "plain", args.tokens, args.quick, args.threads)
            mr = measure_memory(name, "probe", args.tokens, args.quick, args.threads)
            row.update({"built_MB": mp["built"], "plain_peak_MB": mp["peak"], "record_peak_MB": mr["peak"],
                        "peak_ratio": mr["peak"] / mp["peak"],
                        "added_ratio": (mr["peak"] - mr["built"]) / max(mp["peak"] - mp["built"], 1e-9)})
        rows.append(row)
        del model, probe
    print(f"{'model':12s} {'params':>7s} {'plain s':>8s} {'record s':>8s} {'time x':>7s} {'tok/s':>7s} "
          f"{'plain MB':>9s} {'record MB':>9s} {'peak x':>7s} {'added x':>7s}")
    for r in rows:
        print(f"{r['model']:12s} {r['params_M']:6.1f}M {r['plain_s']:8.3f} {r['record_s']:8.3f} {r['time_ratio']:7.3f} "
              f"{r['corpus_tokens_per_s']:7.0f} {r.get('plain_peak_MB', float('nan')):9.0f} "
              f"{r.get('record_peak_MB', float('nan')):9.0f} {r.get('peak_ratio', float('nan')):7.3f} "
              f"{r.get('added_ratio', float('nan')):7.3f}")
    print("targets: time x <= 1.10, peak x <= 1.30 (plain forward + backward against Probe.run(backward=True))")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
