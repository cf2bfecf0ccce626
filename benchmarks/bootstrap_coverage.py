"""Coverage of the cluster-bootstrap intervals `compare` gives, by number of documents (issue #50).

A paired difference per window is simulated as document effect + window noise (windows of one document
correlated, as in a corpus), with a known true mean; the percentile interval of
`attnres_probe.analysis.bootstrap` (documents resampled, windows kept together) is drawn for each of
many simulated corpora, and the share of intervals that hold the true mean is its coverage. The
minimum number of documents at which `compare` hands out verdicts (`bootstrap.MIN_VERDICT_DOCUMENTS`)
is chosen from this table: the fewest documents whose coverage of a nominal 95% interval is at least
90% in every setting here.

    python benchmarks/bootstrap_coverage.py            # about a minute on one core
"""

from __future__ import annotations

import argparse

import numpy as np

from attnres_probe.analysis.bootstrap import cluster_counts, mean_interval


def coverage(n_docs: int, windows_per_doc: int, doc_sd: float, reps: int, resamples: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    hits = 0
    for r in range(reps):
        docs = np.repeat(np.arange(n_docs), windows_per_doc)
        effects = rng.standard_t(4, size=n_docs) * doc_sd  # heavy-tailed document effects
        values = 0.1 + effects[docs] + rng.normal(0.0, 1.0, size=docs.size)
        true = 0.1  # the mean of the document effects is 0: the population mean
        _, lo, hi = mean_interval(values, cluster_counts(docs, resamples, seed=r), 0.95)
        hits += lo <= true <= hi
    return hits / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--resamples", type=int, default=500)
    args = ap.parse_args()
    docs = (2, 3, 5, 8, 10, 15, 20, 40)
    settings = [(4, 0.5), (16, 0.5), (4, 1.0), (16, 1.0)]
    print(f"coverage of a nominal 95% cluster-bootstrap interval ({args.reps} simulated corpora each, "
          f"{args.resamples} resamples)")
    print("| windows per document, document sd | " + " | ".join(f"{d} docs" for d in docs) + " |")
    print("|---|" + "---|" * len(docs))
    for w, sd in settings:
        cells = [f"{coverage(d, w, sd, args.reps, args.resamples, seed=d * 100 + w):.3f}" for d in docs]
        print(f"| {w}, {sd} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
