"""The demo models' recipe as plain values: the command line's parser reads them without importing
torch (``attnres-probe demo --help`` answers at once); :mod:`attnres_probe.demo` builds from them."""

from __future__ import annotations

__all__ = ["BACKEND_NAMES", "DEMO_BLOCK_SIZE", "DEMO_NAMES", "DEMO_RULES", "DEMO_THREADS", "DEMO_TRAIN"]

DEMO_BLOCK_SIZE = 4  # 4 sublayers = 2 transformer layers per block -> 4 blocks
# the demo models' residual rules, beside the shared shape (attnres_probe.demo.DEMO_MODEL): what
# `attnres-probe demo-models` can build
DEMO_RULES = {
    "prenorm": dict(residual="prenorm"),
    "full": dict(residual="full"),
    "block": dict(residual="block", block_size=DEMO_BLOCK_SIZE),
    "mhc": dict(residual="hyper", mhc=True, n_streams=4),  # dynamic mHC, the paper's whole-state input
    "denseformer": dict(residual="denseformer"),  # a DWA after every block, no dilation
}
# the demo models shipped in the package (what the pages open): every rule above
DEMO_NAMES = ("prenorm", "full", "block", "mhc", "denseformer")

DEMO_TRAIN = dict(
    steps=8000,
    batch_size=16,
    lr=3e-3,
    warmup_steps=100,
    eval_every=500,  # validation, and a resumable save
    eval_batches=8,
    seed=0,
    corpus="shakespeare",
    split="plays",  # whole plays held out (docs/study/plan-v3.md): the shipped models are seed 0 of study v3
    probe_every=250,  # routing over training (the over-training view)
)
DEMO_THREADS = 1  # part of what makes a rebuild bit-exact (docs/study/plan-v3.md says why one)
BACKEND_NAMES = ("auto", "torch", "triton", "numba")  # attnres_probe.kernels.BACKENDS (a test keeps them equal)
