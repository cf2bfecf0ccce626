"""Writing the paper figures: one kaleido process for the whole set vs one ``write_image`` per figure.

    python benchmarks/exports.py [--size double|single] [--format svg|png|pdf] [--reps 1]

Records the default text through the three demo models, builds the standard set of
``attnres-probe figures`` (:func:`attnres_probe.exports.standard_figures`) and writes it twice
into a temporary folder, side by side in one run:

- ``one process``: :func:`attnres_probe.exports.write_images`, one kaleido (one Chromium) for every
  image, as the command does;
- ``one kaleido per figure``: ``write_images`` called once per figure, so a kaleido (a Chromium) is
  started and stopped for every image;
- ``plotly write_image``: plotly's ``fig.write_image(path, width=, height=, scale=)`` for each (also
  a kaleido per call, and its page asks for MathJax from a CDN: on a machine without network that
  request fails, and now and then the render with it, "kaleido_scopes is not defined"; such a
  failure is counted, and the figure written again).

Prints seconds per image (and in all) for each; with ``--reps N`` the order alternates and the
medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from attnres_probe import exports
from attnres_probe.cli.record import DEFAULT_TEXT
from attnres_probe.loading import demo_source, load_model

RENDERS: list[float] = []  # one process: each image's own time (the rest of the total is starting kaleido)


def one_process(figs: dict, out: Path, fmt: str) -> float:
    t = time.perf_counter()
    exports.write_images({out / f"{n}.{fmt}": f for n, f in figs.items()}, fmt,
                         progress=lambda line: RENDERS.append(float(line.rsplit("(", 1)[1].split(" ")[0])))
    return time.perf_counter() - t


def kaleido_each(figs: dict, out: Path, fmt: str) -> float:
    t = time.perf_counter()
    for n, f in figs.items():
        exports.write_images({out / f"{n}.{fmt}": f}, fmt)
    return time.perf_counter() - t


FAILURES = [0]


def plotly_each(figs: dict, out: Path, fmt: str) -> float:
    t = time.perf_counter()
    for n, f in figs.items():
        scale = exports.DPI / exports.CSS_DPI if fmt == "png" else 1
        for attempt in range(3):
            try:
                f.write_image(out / f"{n}.{fmt}", width=f.layout.width, height=f.layout.height, scale=scale)
                break
            except Exception as exc:  # noqa: BLE001  (kaleido's JavascriptError)
                FAILURES[0] += 1
                print(f"  plotly write_image of {n} failed ({type(exc).__name__}); again", file=sys.stderr)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=exports.SIZES, default="double")
    parser.add_argument("--format", choices=exports.FORMATS, default="svg", dest="fmt")
    parser.add_argument("--reps", type=int, default=1, help="runs of each way, alternating (default: %(default)s)")
    args = parser.parse_args(argv)
    t = time.perf_counter()
    traces = [load_model(demo_source(n)).probe().run(DEFAULT_TEXT, backward=True, truncate=True)
              for n in ("prenorm", "full", "block")]
    t_record = time.perf_counter() - t
    t = time.perf_counter()
    figs = exports.standard_figures(traces, args.size)
    t_layout = time.perf_counter() - t
    n = len(figs)
    print(f"{n} figures ({args.size} column, {args.fmt}); recorded in {t_record:.1f} s, built and laid out in {t_layout:.2f} s",
          flush=True)
    ways = {"one process": one_process, "one kaleido per figure": kaleido_each, "plotly write_image": plotly_each}
    times: dict[str, list[float]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = list(ways) if rep % 2 == 0 else list(ways)[::-1]
            for name in order:
                out = Path(tmp) / f"{name.replace(' ', '_')}_{rep}"
                out.mkdir()
                times[name].append(ways[name](figs, out, args.fmt))
                print(f"  rep {rep + 1} {name}: {times[name][-1]:.2f} s", file=sys.stderr)
    print(f"{'way':24s} {'total (s)':>10s} {'per image (s)':>14s}")
    for name, ts in times.items():
        total = statistics.median(ts)
        print(f"{name:24s} {total:10.2f} {total / n:14.2f}")
    runs = len(times["one process"])
    each = sum(RENDERS) / len(RENDERS)
    start = statistics.median(times["one process"]) - each * n
    print(f"one process: {start:.1f} s to start kaleido, then {each:.2f} s per image ({runs} run(s))")
    if FAILURES[0]:
        print(f"plotly write_image failed {FAILURES[0]} time(s) and was run again (counted in its time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
