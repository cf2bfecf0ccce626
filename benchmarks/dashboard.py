"""Dashboard speed: the token-selection callback and the time to first render, on CPU.

    python benchmarks/dashboard.py                 # 1024 tokens, 12 layers, prenorm + full + block
    python benchmarks/dashboard.py --models full,prenorm --calls 100

What is measured (all in this process, no browser):

- token selection, three ways, p50 / p95 over ``--calls`` calls on random tokens:
  ``callback``  the registered callback function itself (callbacks.token_views, what the app runs);
  ``+ json``    the same plus serialising its outputs the way Dash does (plotly JSON encoder);
  ``http``      a real ``POST /_dash-update-component`` through Flask's test client.
- first render: app creation (models record the initial text), ``GET /``, ``GET /_dash-layout``,
  ``GET /_dash-dependencies`` and every callback the page fires on load, for the large config
  and for the demo-sized one (8 layers, n_ctx 128, as ``make demo`` opens).

Models are random (queries randomised so routing is not uniform; for mHC / DenseFormer, ``--models
mhc,denseformer``, their HC / DWA weights instead): speed does not depend on training.
Targets (issue #35): token-selection p95 <= 50 ms over HTTP; first render of the 1024-token trace (every request of the
page once the app has recorded the text) <= 1 s and <= 1.5 MB.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from attnres_probe import AttnResTransformer, ModelConfig
from attnres_probe.dashboards import callbacks, create_app
from attnres_probe.dashboards.wire import update_payload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rules import perturb_coefficients, rule_kwargs  # noqa: E402  (the rules by name)

TARGET_P95_MS = 50.0
TARGET_FIRST_RENDER_S, TARGET_FIRST_RENDER_MB = 1.0, 1.5  # the 1024-token trace, after the app has recorded it
TEXT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
    "or other iterable object. The with statement is used to wrap the execution of a block with methods "
    "defined by a context manager. "
)


def build_model(residual: str, n_layers: int, n_ctx: int, d_model: int, seed: int = 0) -> AttnResTransformer:
    """A model of the rule called ``residual`` (a demo rule: prenorm, full, block, mhc, denseformer;
    or a bare ModelConfig residual) with non-uniform routing, as a trained one has."""
    model = AttnResTransformer(ModelConfig(d_model=d_model, n_layers=n_layers, n_heads=4, n_ctx=n_ctx, seed=seed,
                                           **rule_kwargs(residual)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.mixers:
            if hasattr(m, "query"):  # AttnRes; HC / mHC and DenseFormer reads have none
                m.query.copy_(torch.randn(m.query.shape, generator=g) * 0.5)
    perturb_coefficients(model, g)  # HC / DWA weights instead (nothing for the other rules)
    return model.eval()


def text_of(n_tokens: int) -> str:
    return (TEXT * (n_tokens // len(TEXT) + 1))[:n_tokens]


def pct(samples: list[float]) -> tuple[float, float]:
    a = np.asarray(samples) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 95))


def token_values(app, token: int, kind: str, expanded: bool) -> dict:
    key = app.explorer.initial.key
    return {"token.data": {"key": key, "token": token}, "kind.value": kind, "expanded.value": ["expanded"] if expanded else []}


def bench_token_selection(app, calls: int, kind: str, expanded: bool, seed: int = 0) -> dict[str, tuple[float, float]]:
    from dash._utils import to_json

    ex = app.explorer
    n = ex.initial.first.n_tokens
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, n, size=calls).tolist()
    exp = ["expanded"] if expanded else []
    # warm-up (first plotly figure builds import validators)
    for t in toks[:3]:
        callbacks.token_views(ex, {"key": ex.initial.key, "token": t}, kind, exp)
    direct, with_json, http = [], [], []
    for t in toks:
        t0 = time.perf_counter()
        callbacks.token_views(ex, {"key": ex.initial.key, "token": t}, kind, exp)
        direct.append(time.perf_counter() - t0)
    for t in toks:
        t0 = time.perf_counter()
        out = callbacks.token_views(ex, {"key": ex.initial.key, "token": t}, kind, exp)
        to_json({k: v for k, v in out.items()})
        with_json.append(time.perf_counter() - t0)
    client = app.server.test_client()
    for t in toks:  # a click sends two requests: the views, and the view's query for the address bar
        body = update_payload(app, "token-info.children", token_values(app, t, kind, expanded))
        query = update_payload(app, "view-query.data", token_values(app, t, kind, expanded))
        t0 = time.perf_counter()
        r = client.post("/_dash-update-component", json=body)
        q = client.post("/_dash-update-component", json=query)
        http.append(time.perf_counter() - t0)
        assert r.status_code == 200 and q.status_code in (200, 204), (r.data[:200], q.data[:200])
    return {"callback": pct(direct), "+ json": pct(with_json), "http": pct(http)}


def initial_callbacks(app) -> list[tuple[str, dict]]:
    """The server callbacks the page fires on load, with the values the layout starts with."""
    ex = app.explorer
    key = ex.initial.key
    calls = [
        ("kind.value", {"url.search": ""}),  # a link's view (none here)
        ("token-strip.children", {"trace-key.data": key, "url.search": ""}),
        ("view-query.data", {"token.data": {"key": key, "token": 0}, "kind.value": "weights", "expanded.value": []}),
        ("token-info.children", {"token.data": {"key": key, "token": 0}, "kind.value": "weights", "expanded.value": []}),
        ("decomp-graph-0.figure", {"token.data": {"key": key, "token": 0}}),
        ("pattern-graph-0.figure", {"token.data": {"key": key, "token": 0}, "pattern-layer.value": 0,
                                    "pattern-head.value": 0}),  # attention patterns: one forward up to layer 0 per model
        ("mean-graph-0.figure", {"trace-key.data": key, "kind.value": "weights", "expanded.value": []}),
        ("source-graph-0.figure", {"trace-key.data": key, "source.value": "embed", "kind.value": "weights"}),
        ("magnitudes.figure", {"trace-key.data": key}),
        ("metric-cards.children", {"trace-key.data": key}),
    ]
    if not ex.stats and not (ex.study and ex.study.get("primaries")):
        calls.append(("glance.children", {"trace-key.data": key}))  # the first screen's headline for this text
    if ex.attnres_probes:
        model = ex.attnres_probes[0]
        calls.append(("ablation-graph.figure", {"trace-key.data": key, "ablation-model.value": model,
                                                 "ablation-read.value": ex.read_options(model)[-1], "ablation-mode.value": "zero"}))
    return calls


def bench_first_render(models: dict, text: str) -> list[tuple[str, float, int]]:
    rows = []
    t0 = time.perf_counter()
    app = create_app(models, text=text)
    rows.append(("create_app (records the initial text)", time.perf_counter() - t0, 0))
    client = app.server.test_client()
    for path in ("/", "/_dash-layout", "/_dash-dependencies"):
        t = time.perf_counter()
        r = client.get(path)
        assert r.status_code == 200
        rows.append((f"GET {path}", time.perf_counter() - t, len(r.data)))
    for out, values in initial_callbacks(app):
        t = time.perf_counter()
        # changedPropIds empty: what dash-renderer sends for the callbacks it fires on page load
        r = client.post("/_dash-update-component", json=update_payload(app, out, values, changed=[]))
        assert r.status_code == 200, (out, r.data[:300])
        rows.append((f"POST {out.split('.')[0]}", time.perf_counter() - t, len(r.data)))
    page = rows[1:]  # what the browser waits for once the server is up: every request of the first page
    rows.append(("first render (every request above but create_app)", sum(r[1] for r in page), sum(r[2] for r in page)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--models", default="prenorm,full,block", help="comma-separated residual modes (one panel each)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1, as `attnres-probe dash` uses)")
    ap.add_argument("--skip-demo-size", action="store_true", help="skip the demo-sized first-render row")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    print(f"# dashboard benchmark · CPU threads {torch.get_num_threads()} · load average {os.getloadavg()[0]:.2f}")
    print(f"# models {', '.join(names)}: {args.layers} layers, d_model {args.d_model}, n_ctx {args.tokens}; trace of {args.tokens} tokens")

    big = {n: build_model(n, args.layers, args.tokens, args.d_model) for n in names}
    text = text_of(args.tokens)
    first = bench_first_render(big, text)
    app = create_app(big, text=text)

    print(f"\n## token-selection callback ({args.calls} calls, {len(names)} panels)")
    print(f"{'view':<26}{'path':<10}{'p50 ms':>9}{'p95 ms':>9}")
    worst = 0.0
    for kind, expanded in (("weights", False), ("contrib", False), ("weights", True)):
        res = bench_token_selection(app, args.calls, kind, expanded)
        label = kind + (" expanded" if expanded else "")
        for path, (p50, p95) in res.items():
            print(f"{label:<26}{path:<10}{p50:>9.1f}{p95:>9.1f}")
        worst = max(worst, res["http"][1])

    print(f"\n## first render, {args.tokens}-token trace ({len(names)} models, {args.layers} layers)")
    print(f"{'step':<46}{'ms':>9}{'bytes':>10}")
    for step, dt, size in first:
        print(f"{step:<46}{dt * 1e3:>9.1f}{size:>10}")
    if not args.skip_demo_size:
        demo = {n: build_model(n, 8, 128, 64) for n in ("prenorm", "full", "block")}
        rows = bench_first_render(demo, TEXT[:100])
        print("\n## first render, demo size (prenorm + full + block, 8 layers, n_ctx 128, 100-token prompt)")
        print(f"{'step':<46}{'ms':>9}{'bytes':>10}")
        for step, dt, size in rows:
            print(f"{step:<46}{dt * 1e3:>9.1f}{size:>10}")
    verdict = "meets" if worst <= TARGET_P95_MS else "MISSES"
    print(f"\ntoken selection over HTTP, worst p95 {worst:.1f} ms: {verdict} the {TARGET_P95_MS:.0f} ms target")
    _, secs, size = first[-1]
    ok = secs <= TARGET_FIRST_RENDER_S and size / 1e6 <= TARGET_FIRST_RENDER_MB
    print(f"first render of the {args.tokens}-token trace {secs:.2f} s, {size / 1e6:.2f} MB: {'meets' if ok else 'MISSES'} "
          f"the targets (<= {TARGET_FIRST_RENDER_S:g} s, <= {TARGET_FIRST_RENDER_MB:g} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
