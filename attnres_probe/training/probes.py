"""Routing over training: a trace of fixed held-out windows every N steps (``train --probe-every N``).

The probe windows are the first ``probe_windows`` validation windows of the run (held out from
training, the same at every probe and across resumed sessions; their sha256 is in the log). At
each probe the model's current weights record a trace of them (forward and backward, through
the same :class:`~attnres_probe.Probe` a user calls; the optimizer and the parameters' ``.grad``
are untouched, so training stays bit-exact), and the run keeps a compact summary per probe
(token means per read, and the mean routing matrix) in its history. Only the latest full trace
is kept on disk (``RUN/probes/last``), so a run folder's size does not grow with its length.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnres_probe.axis import ATTNRES_RULES
from attnres_probe.model import AttnResTransformer

__all__ = ["PROBE_DIR", "load_history", "probe_tokens", "record_probe", "summarize", "tokens_sha256"]

PROBE_DIR = "probes/last"
# per-read series in a probe summary: metric name -> (function of the trace, column)
SERIES = ("embed_weight", "embed_contrib", "recent_mass", "distance", "entropy", "rms_in", "grad_in")


def load_history(run_dir: str | Path) -> list[dict[str, Any]] | None:
    """The routing probes of a training run (``train_log.json`` beside the checkpoint:
    ``probes.history``), or None when the folder has no log or the run recorded no probes."""
    from attnres_probe.io import read_json
    from attnres_probe.training.state import MAX_LOG_BYTES

    path = Path(run_dir) / "train_log.json"
    if not path.is_file():
        return None
    try:
        log = read_json(path, max_bytes=MAX_LOG_BYTES)  # bounded: size, regular file, nesting
    except ValueError:
        return None
    history = ((log.get("probes") or {}) if isinstance(log, dict) else {}).get("history")
    return list(history) if isinstance(history, list) and history else None


def probe_tokens(val_batches: list[torch.Tensor], n: int, seq_len: int) -> torch.Tensor:
    """The first ``n`` validation windows' inputs, [n, seq_len] (fewer if validation is shorter)."""
    windows = torch.cat(val_batches, dim=0)[:n]  # (n, seq_len + 1)
    return windows[:, :seq_len].long()


def tokens_sha256(tokens: torch.Tensor) -> str:
    """sha256 of the probe windows' bytes (uint8, row-major)."""
    return hashlib.sha256(tokens.to(torch.uint8).contiguous().numpy().tobytes()).hexdigest()


def record_probe(model: AttnResTransformer, tokens: torch.Tensor):
    """A trace of ``tokens`` [n, seq_len] through ``model`` as it is now (forward and backward)."""
    from attnres_probe.probe import Probe
    from attnres_probe.tokenizer import ByteTokenizer

    probe = Probe(model, name=model.cfg.residual)
    tok = ByteTokenizer()
    str_tokens = [tok.to_str_tokens(row) for row in tokens.cpu()]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    return probe.record(tokens.to(model.device), mask.to(model.device), str_tokens, backward=True)


def _floats(values: Any) -> list[float | None]:
    """A JSON-able list: NaN and inf become None."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    return [float(v) if np.isfinite(v) else None for v in arr]


def summarize(trace: Any, step: int) -> dict[str, Any]:
    """The compact record of one probe: per-read token means (:data:`SERIES`), the gradient
    spread, the mean loss, and the token-mean routing matrix [R, S] (``routing_kind``: AttnRes's
    weights; contribution shares for PreNorm; the normalised coefficients c / sum(c) for
    Hyper-Connections and DenseFormer)."""
    from attnres_probe import metrics
    from attnres_probe.numeric import token_mean

    loc = metrics.locality(trace)
    emb = metrics.embedding_retention(trace)
    prof = metrics.read_profile(trace)
    grad = metrics.gradient_uniformity(trace)
    kind = "weights" if trace.residual in ATTNRES_RULES else "contrib" if trace.residual == "prenorm" else "normalised"
    if kind == "normalised":  # Hyper-Connections, DenseFormer: coefficients over their sum (docs/depth_rules.md)
        from attnres_probe.analysis.windows import normalised_weights

        cube = normalised_weights(trace, trace.depth_weights)[np.asarray(trace.mask, dtype=bool)]
    else:
        cube = trace.cube(kind)[np.asarray(trace.mask, dtype=bool)]  # (tokens, R, S)
    return {
        "step": int(step),
        "loss": float(trace.meta["mean_loss"]),
        "embed_weight": _floats(emb["embed_weight"]),
        "embed_contrib": _floats(emb["embed_contrib"]),
        "recent_mass": _floats(loc["recent_mass"]),
        "distance": _floats(loc["distance"]),
        "entropy": _floats(metrics.entropy(trace)),
        "rms_in": _floats(prof["rms_in"]),
        "grad_in": _floats(prof["grad_in"]),
        "act_grad_cv": _floats([grad["act_grad_cv"]])[0],
        "param_grad_cv": _floats([grad["param_grad_cv"]])[0],
        "routing_kind": kind,
        "routing": [_floats(row) for row in token_mean(cube)],
    }


def save_last(trace: Any, out_dir: Path) -> None:
    """Keep the latest probe's full trace in ``out_dir/probes/last`` (replacing the previous one)."""
    path = Path(out_dir) / PROBE_DIR
    path.parent.mkdir(parents=True, exist_ok=True)
    trace.save(path, overwrite=True)
