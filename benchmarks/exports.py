"""Writing the paper figures: one kaleido process for the whole set vs one ``write_image`` per figure.

    python benchmarks/exports.py [--size double|single] [--format svg|png|pdf] [--reps 1]

Records the default text through the three demo models, builds the standard set of
``attnres-probe figures`` (:func:`attnres_probe.exports.standard_figures`) and writes it twice
into a temporary folder, side by side in one run:

- ``one process``: :func:`attnres_probe.exports.write_images`, one kaleido (one Chromium) for every
  image, as the command does;
- ``one call per figure``: plotly's ``fig.write_image(path, width=, height=, scale=)`` for each,
  which starts and stops a kaleido (a Chromium) every call.

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


def one_process(figs: dict, out: Path, fmt: str) -> float:
    t = time.perf_counter()
    exports.write_images({out / f"{n}.{fmt}": f for n, f in figs.items()}, fmt)
    return time.perf_counter() - t


def one_call_each(figs: dict, out: Path, fmt: str) -> float:
    t = time.perf_counter()
    for n, f in figs.items():
        scale = exports.DPI / exports.CSS_DPI if fmt == "png" else 1
        f.write_image(out / f"{n}.{fmt}", width=f.layout.width, height=f.layout.height, scale=scale)
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
    print(f"{n} figures ({args.size} column, {args.fmt}); recorded in {t_record:.1f} s, built and laid out in {t_layout:.2f} s")
    times: dict[str, list[float]] = {"one process": [], "one call per figure": []}
    ways = {"one process": one_process, "one call per figure": one_call_each}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = list(ways) if rep % 2 == 0 else list(ways)[::-1]
            for name in order:
                out = Path(tmp) / f"{name.replace(' ', '_')}_{rep}"
                out.mkdir()
                times[name].append(ways[name](figs, out, args.fmt))
                print(f"  rep {rep + 1} {name}: {times[name][-1]:.2f} s", file=sys.stderr)
    print(f"{'way':22s} {'total (s)':>10s} {'per image (s)':>14s}")
    for name, ts in times.items():
        total = statistics.median(ts)
        print(f"{name:22s} {total:10.2f} {total / n:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
