"""Dashboard under load: waitress (one process, 8 threads) driven by concurrent HTTP clients.

    python benchmarks/dashboard_load.py                      # 24 clients for 15 s
    python benchmarks/dashboard_load.py --clients 32 --seconds 30 --demo

The server runs in a child process (this script with ``--serve``) on a free loopback port, with
three demo-sized models (random weights; ``--demo`` loads the bundled ones). Each client thread
loops over ``GET /``, ``GET /_dash-layout``, ``GET /_dash-dependencies`` and a token-selection
``POST /_dash-update-component`` built from the served dependencies, exactly as the browser
sends it. With ``--prompt-every N`` one request in N runs a new prompt instead (40 distinct texts, so the
server's bounded trace cache keeps evicting). Reported: requests/s, p50/p95 latency per request
kind, errors (targeted: zero), and the server's RSS at start, after warm-up, and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TEXTS = [f"Prompt {i}: the with statement wraps a block of code in methods of a context manager #{i * 7919 % 1000}." for i in range(40)]


# -- server (child process) ---------------------------------------------------------------------
def serve(threads: int, demo: bool) -> None:
    import logging

    import torch
    import waitress

    logging.getLogger("waitress.queue").setLevel(logging.ERROR)  # "task queue depth" notes are expected under load

    from attnres_probe.dashboards import create_app

    torch.set_num_threads(1)  # the server's threads share two cores with the clients
    if demo:
        from attnres_probe.dashboards.app import demo_entries

        models = demo_entries()
    else:
        sys.path.insert(0, str(HERE))
        from dashboard import build_model

        models = {n: build_model(n, 8, 128, 64) for n in ("prenorm", "full", "block")}
    app = create_app(models)
    server = waitress.create_server(app.server, host="127.0.0.1", port=0, threads=threads, ident="attnres-probe")
    print(json.dumps({"port": server.effective_port, "pid": os.getpid()}), flush=True)
    server.run()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- clients --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--threads", type=int, default=8, help="waitress threads")
    ap.add_argument("--prompt-every", type=int, default=0, help="one request in N runs a new prompt (default 0: never; try 25)")
    ap.add_argument("--demo", action="store_true", help="use the bundled demo models instead of random ones")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.threads, args.demo)
        return 0

    import requests

    from attnres_probe.dashboards.wire import update_payload

    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--threads", str(args.threads)] + (["--demo"] if args.demo else [])
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        base = f"http://127.0.0.1:{info['port']}"
        started = time.perf_counter() - t0
        rss_start = rss_mb(child.pid)
        layout = requests.get(base + "/_dash-layout", timeout=30).json()
        deps = requests.get(base + "/_dash-dependencies", timeout=30).json()
        key = _find_prop(layout, "trace-key", "data")
        n_tokens = len(_find_prop_list(requests.post(base + "/_dash-update-component", timeout=60,
                                                     json=update_payload(deps, "token-strip.children", {"trace-key.data": key})).json()))

        def token_body(rng: random.Random) -> dict:
            values = {"token.data": {"key": key, "token": rng.randrange(n_tokens)},
                      "kind.value": rng.choice(["weights", "contrib", "logits"]), "expanded.value": rng.choice([[], ["expanded"]])}
            return update_payload(deps, "token-info.children", values)

        def prompt_body(rng: random.Random) -> dict:
            return update_payload(deps, "trace-key.data", {"run.n_clicks": 1, "prompt.value": rng.choice(TEXTS)})

        # warm-up: every request kind once, every prompt text once (fills the cache to its bound)
        s = requests.Session()
        rng = random.Random(0)
        for path in ("/", "/_dash-layout", "/_dash-dependencies"):
            s.get(base + path, timeout=30)
        for _ in range(5):
            s.post(base + "/_dash-update-component", json=token_body(rng), timeout=30)
        for text in TEXTS:
            s.post(base + "/_dash-update-component", json=update_payload(deps, "trace-key.data", {"run.n_clicks": 1, "prompt.value": text}),
                   timeout=60)
        rss_warm = rss_mb(child.pid)

        lat: dict[str, list[float]] = defaultdict(list)
        errors: dict[str, int] = defaultdict(int)
        samples: list[str] = []
        lock = threading.Lock()
        stop = time.perf_counter() + args.seconds
        kinds = [("GET /", "get", "/"), ("GET /_dash-layout", "get", "/_dash-layout"),
                 ("GET /_dash-dependencies", "get", "/_dash-dependencies"), ("POST token selection", "token", None)]

        def client(seed: int) -> None:
            rng = random.Random(seed)
            sess = requests.Session()
            i = seed
            while time.perf_counter() < stop:
                i += 1
                if args.prompt_every and i % args.prompt_every == 0:
                    name, how, path = "POST run prompt", "prompt", None
                else:
                    name, how, path = kinds[i % len(kinds)]
                t = time.perf_counter()
                try:
                    if how == "get":
                        r = sess.get(base + path, timeout=30)
                        ok = r.status_code == 200 and len(r.content) > 0
                    else:
                        body = token_body(rng) if how == "token" else prompt_body(rng)
                        r = sess.post(base + "/_dash-update-component", json=body, timeout=60)
                        resp = r.json().get("response", {}) if r.status_code == 200 else {}
                        ok = ("token-graph-0" in resp) if how == "token" else ("trace-key" in resp)
                    why = f"{r.status_code} {r.text[:120]!r}"
                except Exception as exc:  # a dropped connection counts as an error
                    ok, why = False, repr(exc)
                dt = time.perf_counter() - t
                with lock:
                    lat[name].append(dt)
                    if not ok:
                        errors[name] += 1
                        if len(samples) < 5:
                            samples.append(f"{name}: {why}")

        rss_series: list[float] = []

        def sampler() -> None:
            while time.perf_counter() < stop:
                rss_series.append(rss_mb(child.pid))
                time.sleep(0.5)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)] + [threading.Thread(target=sampler)]
        t_run = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t_run
        rss_end = rss_mb(child.pid)
    finally:
        child.terminate()
        child.wait(timeout=10)

    total = sum(len(v) for v in lat.values())
    n_err = sum(errors.values())
    print(f"# dashboard load · waitress threads {args.threads} · {args.clients} clients · {wall:.1f} s · "
          f"load average {os.getloadavg()[0]:.2f} · server ready in {started:.1f} s")
    print(f"{'request':<26}{'count':>7}{'p50 ms':>9}{'p95 ms':>9}{'errors':>8}")
    for name in [k[0] for k in kinds] + ["POST run prompt"]:
        if name not in lat:
            continue
        a = np.asarray(lat[name]) * 1e3
        print(f"{name:<26}{a.size:>7}{np.percentile(a, 50):>9.1f}{np.percentile(a, 95):>9.1f}{errors[name]:>8}")
    all_ms = np.concatenate([np.asarray(v) for v in lat.values()]) * 1e3
    print(f"{'all':<26}{total:>7}{np.percentile(all_ms, 50):>9.1f}{np.percentile(all_ms, 95):>9.1f}{n_err:>8}")
    print(f"\nthroughput {total / wall:.1f} requests/s · errors {n_err}")
    print(f"server RSS: start {rss_start:.0f} MB · after warm-up {rss_warm:.0f} MB · end {rss_end:.0f} MB · "
          f"max during run {max(rss_series, default=float('nan')):.0f} MB")
    for line in samples:
        print("error sample:", line)
    return 1 if n_err else 0


def _find_prop(node, cid: str, prop: str):
    """Value of ``prop`` of the component with id ``cid`` in a serialised layout."""
    if isinstance(node, dict):
        props = node.get("props", {})
        if props.get("id") == cid:
            return props.get(prop)
        for v in props.values():
            found = _find_prop(v, cid, prop)
            if found is not None:
                return found
    elif isinstance(node, list):
        for v in node:
            found = _find_prop(v, cid, prop)
            if found is not None:
                return found
    return None


def _find_prop_list(strip_response: dict) -> list:
    return strip_response["response"]["token-strip"]["children"]


if __name__ == "__main__":
    sys.exit(main())
