"""The ``attnres-probe train`` command: flags -> (ModelConfig, TrainConfig) -> :func:`~attnres_probe.training.train`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from attnres_probe.axis import rule_title
from attnres_probe.checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError
from attnres_probe.config import DENSEFORMER_DEFAULTS, DYNAMIC_INPUTS, HYPER_DEFAULTS, RESIDUALS, ConfigError, ModelConfig
from attnres_probe.data import SPLITS, DataError
from attnres_probe.kernels import BACKENDS
from attnres_probe.training.config import TrainConfig, TrainError
from attnres_probe.training.loop import train
from attnres_probe.training.state import LOG_FILE, read_run_configs

__all__ = ["add_train_parser"]

_MODEL_FLAGS = {  # flag dest -> ModelConfig field
    "residual": "residual",
    "n_layers": "n_layers",
    "d_model": "d_model",
    "n_heads": "n_heads",
    "n_ctx": "n_ctx",
    "block_size": "block_size",
    # the rule fields (ModelConfig: each belongs to one rule, None elsewhere)
    "n_streams": "n_streams",
    "mhc": "mhc",
    "hc_dynamic": "hc_dynamic",
    "hc_dynamic_input": "hc_dynamic_input",
    "hc_tanh": "hc_tanh",
    "sinkhorn_iters": "sinkhorn_iters",
    "dwa_dilation": "dwa_dilation",
    "dwa_period": "dwa_period",
}
# the rule each rule field belongs to, and the flag that sets it (for the error naming both)
_RULE_OF_FIELD = {**dict.fromkeys(HYPER_DEFAULTS, "hyper"), **dict.fromkeys(DENSEFORMER_DEFAULTS, "denseformer")}
_FLAG_OF_FIELD = {
    "n_streams": "--n-streams",
    "mhc": "--mhc/--no-mhc",
    "hc_dynamic": "--static-hc",
    "hc_dynamic_input": "--hc-dynamic-input",
    "hc_tanh": "--no-hc-tanh",
    "sinkhorn_iters": "--sinkhorn-iters",
    "dwa_dilation": "--dwa-dilation",
    "dwa_period": "--dwa-period",
}
_TRAIN_FLAGS = (
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "eval_every",
    "eval_batches",
    "corpus",
    "val_fraction",
    "split",
    "probe_every",
    "probe_windows",
)


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand; its ``func(args)`` returns an exit code.

    Flags left out keep the defaults of ModelConfig / TrainConfig (or, with ``--config``, the
    file's model config; with ``--resume``, the saved run's configs).
    """
    p = subparsers.add_parser(
        "train",
        help="train a model on an offline byte corpus",
        description="Train a PreNorm / Full AttnRes / Block AttnRes / Hyper-Connections (mHC) / DenseFormer model "
        "on an offline corpus. Writes the checkpoint, train_log.json and resumable state into --out. Without "
        "--config the model has the demo models' size; after the first steps the command prints how long the run "
        "will take.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (checkpoint, log, resumable state)")
    p.add_argument("--config", metavar="JSON", help="model config file (ModelConfig fields); flags below override it")
    m = p.add_argument_group("model")
    m.add_argument("--residual", choices=RESIDUALS, help="residual rule (default full)")
    m.add_argument("--n-layers", type=int, help="transformer blocks, 2 sublayers each (default 8, as the demo models)")
    m.add_argument("--d-model", type=int, help="residual stream width (default 64, as the demo models)")
    m.add_argument("--n-heads", type=int, help="attention heads (default 4)")
    m.add_argument("--n-ctx", type=int, help="context length (default 128)")
    m.add_argument("--block-size", type=int, help="sublayers per block with --residual block (default 4)")
    h = p.add_argument_group("Hyper-Connections / mHC (--residual hyper only)")
    h.add_argument("--n-streams", type=int, help=f"residual streams (default {HYPER_DEFAULTS['n_streams']})")
    h.add_argument(
        "--mhc", action=argparse.BooleanOptionalAction, default=None,
        help="manifold-constrained HC (mHC: Sinkhorn H_res, sigmoid H_pre/H_post); --no-mhc: plain HC (the default)",
    )
    h.add_argument(
        "--static-hc", dest="hc_dynamic", action="store_const", const=False, default=None,
        help="static weights (SHC) instead of per-token ones from the state (DHC, the default)",
    )
    h.add_argument(
        "--hc-dynamic-input", choices=DYNAMIC_INPUTS,
        help="what the dynamic weights read: stream (HC paper) or flat (mHC paper); default flat with --mhc, else stream",
    )
    h.add_argument(
        "--no-hc-tanh", dest="hc_tanh", action="store_const", const=False, default=None,
        help="HC only: no tanh on the dynamic terms (default: tanh)",
    )
    h.add_argument("--sinkhorn-iters", type=int, help=f"mHC: Sinkhorn rounds (default {HYPER_DEFAULTS['sinkhorn_iters']})")
    d = p.add_argument_group("DenseFormer (--residual denseformer only)")
    d.add_argument(
        "--dwa-dilation", type=int,
        help=f"a DWA averages the block outputs j = i+1 (mod dilation) (default {DENSEFORMER_DEFAULTS['dwa_dilation']})",
    )
    d.add_argument(
        "--dwa-period", type=int,
        help=f"a DWA follows every period-th block (default {DENSEFORMER_DEFAULTS['dwa_period']}: every block)",
    )
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, help="optimizer updates (default 2000)")
    t.add_argument("--batch-size", type=int, help="windows per update (default 16)")
    t.add_argument("--seq-len", type=int, help="tokens per window (default: n_ctx)")
    t.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    t.add_argument("--min-lr-ratio", type=float, help="final lr / peak lr (default 0.1)")
    t.add_argument("--warmup-steps", type=int, help="linear warm-up updates (default min(100, steps/10))")
    t.add_argument("--weight-decay", type=float, help="AdamW decay on matrices (default 0.1)")
    t.add_argument("--grad-clip", type=float, help="max gradient norm, 0 = off (default 1.0)")
    t.add_argument("--eval-every", type=int, help="validate and save every N steps, 0 = only at the end (default 200)")
    t.add_argument("--eval-batches", type=int, help="validation batches (default 8)")
    t.add_argument("--corpus", help="pydoc (default) | shakespeare | path to a UTF-8 text file")
    t.add_argument("--val-fraction", type=float, help="held-out share at the end of the corpus (default 0.1)")
    t.add_argument(
        "--split", choices=SPLITS,
        help="tail: the last --val-fraction of the tokens (default); plays: with --corpus shakespeare, whole plays "
        "(every edition) held out, the poems and the encyclopedia article in neither side (docs/study/plan-v3.md)",
    )
    t.add_argument("--seed", type=int, help="seed of the model init and the batch order (default 0)")
    t.add_argument(
        "--probe-every", type=int,
        help="record the routing of held-out probe windows every N steps into the run (0 = never, the default)",
    )
    t.add_argument("--probe-windows", type=int, help="validation windows a routing probe records (default 4)")
    r = p.add_argument_group("run")
    r.add_argument("--resume", action="store_true", help="continue the run saved in --out up to --steps")
    r.add_argument("--overwrite", action="store_true", help="replace a run already saved in --out")
    r.add_argument("--device", default="cpu", help="torch device (default cpu)")
    r.add_argument(
        "--backend",
        choices=BACKENDS,
        help="depth-attention backend (default: ATTNRES_BACKEND, else auto: numba on CPU, triton on CUDA)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_train)
    return p


def _configs_from_args(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig]:
    """Model and train configs: a base (defaults, the --config file, or the saved run), then flags."""
    saved = read_run_configs(args.out) if args.resume else None
    if args.config:
        base = _read_model_config(args.config).to_dict()
    elif saved:
        base = saved[0].to_dict()
    else:  # a new run without a config file: the demo models' size (64 wide, 8 layers, context 128)
        from attnres_probe.demo import DEMO_MODEL
        from attnres_probe.demo_recipe import DEMO_BLOCK_SIZE

        residual = args.residual or "full"
        shape = dict(block_size=DEMO_BLOCK_SIZE) if residual == "block" else {}
        base = dataclasses.replace(DEMO_MODEL, residual=residual, **shape).to_dict()
        for name in _RULE_OF_FIELD:  # the rule's defaults, derived again after the flags (--mhc: flat input)
            base[name] = None
    model_dict = dict(base)
    train_dict = saved[1].to_dict() if saved else {}
    for dest, field in _MODEL_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            model_dict[field] = value
    for name in _TRAIN_FLAGS:
        value = getattr(args, name)
        if value is not None:
            train_dict[name] = value
    if args.seed is not None:
        model_dict["seed"] = train_dict["seed"] = args.seed
    if args.residual not in (None, "block") and args.block_size is None:  # an explicit non-block residual
        model_dict.pop("block_size", None)
        model_dict.pop("block_boundaries", None)
    _check_rule_flags(args, model_dict)
    if args.residual is not None:  # an explicit residual: the base's fields of another rule go
        for name, rule in _RULE_OF_FIELD.items():
            if rule != args.residual:
                model_dict.pop(name, None)
    if args.mhc is not None and base.get("mhc") is not None:
        # --mhc / --no-mhc over a base whose input and tanh were its variant's defaults: the new variant's
        if args.hc_dynamic_input is None and base.get("hc_dynamic_input") == ("flat" if base["mhc"] else "stream"):
            model_dict.pop("hc_dynamic_input", None)
        if args.hc_tanh is None and base.get("hc_tanh") == (not base["mhc"]):
            model_dict.pop("hc_tanh", None)
    if base and (model_dict["d_model"], model_dict["n_heads"]) != (base["d_model"], base["n_heads"]):
        # the width changed: re-derive the sizes the base had derived from the old width
        if base["d_head"] == base["d_model"] // base["n_heads"]:
            model_dict.pop("d_head")
        if base["d_mlp"] == 4 * base["d_model"]:
            model_dict.pop("d_mlp")
        if base.get("n_kv_heads") == base["n_heads"] and model_dict["n_heads"] != base["n_heads"]:
            model_dict.pop("n_kv_heads", None)  # plain multi-head attention stays plain
    return ModelConfig.from_dict(model_dict), TrainConfig.from_dict(train_dict)


def _check_rule_flags(args: argparse.Namespace, model_dict: dict) -> None:
    """A flag of another rule than the run's residual: a ConfigError naming the flag, its field and the rule."""
    residual = model_dict.get("residual", "full")
    if args.block_size is not None and residual != "block":
        raise ConfigError(f"--block-size (block_size) applies only to --residual block; this run's residual is {residual!r}")
    for name, rule in _RULE_OF_FIELD.items():
        if getattr(args, name, None) is not None and residual != rule:
            raise ConfigError(
                f"{_FLAG_OF_FIELD[name]} ({name}) applies only to --residual {rule}; this run's residual is {residual!r}"
            )
    if residual != "hyper":
        return
    # flags of one Hyper-Connections variant given to another: they would change nothing, so say so
    mhc = bool(model_dict.get("mhc"))
    dynamic = model_dict.get("hc_dynamic") is not False
    if args.sinkhorn_iters is not None and not mhc:
        raise ConfigError("--sinkhorn-iters (sinkhorn_iters) applies only with --mhc (Sinkhorn projects mHC's H_res); "
                          "this run is plain Hyper-Connections")
    if args.hc_tanh is not None and (mhc or not dynamic):
        raise ConfigError("--no-hc-tanh (hc_tanh) applies only to dynamic Hyper-Connections without --mhc (the tanh "
                          f"acts on HC's dynamic terms); this run is {'mHC, whose gates are sigmoids' if mhc else 'static (--static-hc)'}")
    if args.hc_dynamic_input is not None and not dynamic:
        raise ConfigError("--hc-dynamic-input (hc_dynamic_input) applies only to dynamic Hyper-Connections; this run "
                          "is static (--static-hc)")


def _read_model_config(path: str) -> ModelConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file (expected a JSON file of ModelConfig fields)")
    try:
        return ModelConfig.from_json(p)
    except (TypeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None


def _run_train(args: argparse.Namespace) -> int:
    """Handler of ``attnres-probe train``: 0 on success, 2 on a usage/data error, 130 on Ctrl-C."""
    try:
        model_cfg, train_cfg = _configs_from_args(args)
        result = train(
            model_cfg,
            train_cfg,
            args.out,
            resume=args.resume,
            progress=not args.quiet,
            overwrite=args.overwrite,
            device=args.device,
            backend=args.backend,
        )
    except (ConfigError, DataError, TrainError, CheckpointError, OSError, RuntimeError, TypeError) as exc:
        print(f"attnres-probe train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"attnres-probe train: interrupted; rerun with --resume --out {args.out} to continue from the last "
            "saved step",
            file=sys.stderr,
        )
        return 130
    print(
        f"trained {result.step} steps ({rule_title(result.model.cfg.residual, result.model.cfg.to_dict())}); final validation loss "
        f"{result.final_val_loss:.4f}; wrote {result.out_dir}/{{{CONFIG_FILE},{WEIGHTS_FILE},{LOG_FILE}}}"
    )
    return 0
