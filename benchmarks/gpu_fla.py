"""Models from elsewhere on a GPU: load_pretrained and watch against fla's real CUDA model (issue #19).

Builds a small fla ``TransformerForCausalLM`` on CUDA with fla's own fused kernels (its fused
``fused_attnres``, rotary, norms and SwiGLU; flash-attn when it is installed, else an
SDPA stand-in for ``flash_attn_func``), for ``attnres_block_size`` 1, 2 and 4 with grouped KV
heads and q/k norm, saves it with ``save_pretrained``, and checks in float32 and bfloat16:

- ``load_pretrained`` gives fla's logits (relative RMS error, float32: 1e-4, bf16: 8 bf16
  roundoffs per layer pass; fla's fused kernels and ours round in different orders, and the CPU
  tests hold 1e-5 with exact stand-ins);
- ``watch`` records, read by read, the weights fla's fused op returns, and they equal the
  weights of the loaded model's own trace (max abs error, float32: 1e-4, bf16: 8 * 2^-8).

One markdown table; exit status 0 when every check passed. ``--dry-run`` runs the same
checks on the CPU with the test suite's exact stand-ins (tests/fla_standins.py).

    python benchmarks/gpu_fla.py [--out results.md] [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
# (logits: relative RMS error, weights: max abs error). bf16: 8 units of bf16 roundoff (2^-8) per
# layer pass of the 3-layer model for the logits, the weights' own rounding times 8 for them.
BOUNDS = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (8 * 3 * 2**-8, 8 * 2**-8)}


def _standins():
    spec = importlib.util.spec_from_file_location("fla_standins", ROOT / "tests" / "fla_standins.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fla_standins"] = mod
    spec.loader.exec_module(mod)
    return mod


def _sdpa_flash_attn(q, k, v, causal=True, window_size=(-1, -1), **kwargs):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=k.shape[2] != q.shape[2]
    )
    return out.transpose(1, 2)


def run(dry_run: bool) -> list[dict]:
    import contextlib

    import fla.layers.attn as attn

    from attnres_probe import Probe, load_pretrained, watch

    st = _standins() if dry_run else None
    device = "cpu" if dry_run else "cuda"
    env = st.fla_on_cpu if dry_run else contextlib.nullcontext
    if not dry_run and attn.flash_attn_func is None:
        attn.flash_attn_func = _sdpa_flash_attn  # flash-attn not installed: SDPA with the same layout
    rows = []
    for block in (1, 2, 4):
        for dtype in (torch.float32, torch.bfloat16):
            t0 = time.perf_counter()
            with env():
                if dry_run:
                    model = st.fla_transformer(block, kv_heads=2, qk_norm=True)
                else:
                    model = _standins_free_model(block)
                model = model.to(device=device, dtype=dtype)
                tokens = torch.randint(0, model.config.vocab_size, (2, 64), device=device)
                with torch.no_grad():
                    want = model(tokens).logits.float()
                with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model.save_pretrained(d)
                    ours, _ = load_pretrained(d, device=device, dtype=dtype, tokenizer=False)
                with torch.no_grad():
                    got = ours(tokens).float()
                logit_err = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()  # relative RMS
                with watch(model) as session:
                    model(tokens)
                watched = session.trace()
            mine = Probe(ours).run(tokens, backward=False)
            w_err = float(np.nanmax(np.abs(watched.depth_weights - mine.depth_weights)))
            lb, wb = BOUNDS[dtype]
            rows.append({
                "block": block, "dtype": str(dtype).replace("torch.", ""), "logits rel err": f"{logit_err:.2e}",
                "weights abs err": f"{w_err:.2e}", "op": watched.meta["op"], "s": f"{time.perf_counter() - t0:.1f}",
                "ok": logit_err <= lb and w_err <= wb,
            })
    return rows


def _standins_free_model(block: int):
    """The fla model of the CPU tests, built without stand-ins (fla's real kernels on CUDA)."""
    st = _standins()
    import contextlib

    st.fla_on_cpu = contextlib.nullcontext  # fla_transformer builds under this; on CUDA nothing is replaced
    return st.fla_transformer(block, kv_heads=2, qk_norm=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="the same checks on the CPU with the tests' stand-ins")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_fla.py: no CUDA device; pass --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    rows = run(args.dry_run)
    device = "CPU (dry run, exact stand-ins)" if args.dry_run else torch.cuda.get_device_name()
    import fla

    lines = [f"### fla models on {device} (fla {fla.__version__}, torch {torch.__version__})", "",
             "| attnres_block_size | dtype | logits rel RMS err | weights max abs err | op | s | ok |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['block']} | {r['dtype']} | {r['logits rel err']} | {r['weights abs err']} | {r['op']} | {r['s']} | "
              f"{'yes' if r['ok'] else 'NO'} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
