"""The LR-AttnRes family (jon123boss/LR-AttnRes at efeb4cb; its ``model.py`` at fad9768 and
``checkpoint_config.py``; the public checkpoints ``Jonnester/LR-AttnRes-*``): the baseline
transformer and standard AttnRes, Full and Block, built as our model from ``final_model.pt``.

The folders hold ``final_model.pt`` (train.py's whole training checkpoint: ``model`` the state dict,
``model_args`` the upstream ``ModelConfig`` as a plain dict, ``config`` the training settings,
optimiser and rng states) and a README.md model card, no config.json and no tokenizer (upstream
reads text with tiktoken's ``cl100k_base``). The checkpoint is read with
``torch.load(weights_only=True)`` only: PyTorch's weights-only unpickler, which builds tensors and
plain containers and refuses every other global. Checkpoints of the newer train.py also pickle
numpy's rng state (``np.random.get_state()``) and ``torch.__version__``; for those, exactly these
globals are allowed on top (still the weights-only unpickler, nothing executes): numpy's array
reconstruction (``numpy._core.multiarray._reconstruct``, ``ndarray``, ``dtype`` and the plain
numeric dtype classes, no object arrays) and ``torch.torch_version.TorchVersion`` (a ``str``).
Anything else is refused in one line that says how to strip the checkpoint to its weights.

What the model is (upstream's ``norm_pos="before"`` body):

- every norm is ``F.rms_norm(x, (d,), eps=None)``: no gain anywhere (pre-norms, final norm, q/k
  norm, the depth keys) and torch's default eps, ``finfo`` of the compute dtype (our
  ``norm_gain=False``, ``eps_from_dtype=True``; the depth reads' key gain is loaded as ones);
- attention ``c_attn`` (q, k, v; no GQA, no bias), per-head q/k norm before rotary, rotary in the
  interleaved GPT-J layout (``rope_layout="interleaved"``) with the checkpoint's own tables: upstream
  keeps ``attn.rope.sin``/``cos`` as state-dict buffers, saved in bf16, and rotates with those
  rounded values (up to 2^-9 off the exact angles, far above float32 rounding), so our model takes
  them too (``rope_stored_tables``), after checking they are the tables ``rope_theta`` implies;
- MLP ``fc1`` [2H, d] split into value (first half, our ``W_in``) and gate (second half,
  ``W_gate``), ``silu(gate) * value``, ``fc2``; an untied ``lm_head`` (``weight_tying`` ties it);
- depth mixing (``use_attnres``): read r >= 1 scores its sources with the static query
  ``transformer.attn_residuals.{r-1}.query`` against ``rms_norm(V_s)`` (no scale), softmax over
  the sources; read 0 is the embedding (our read 0 sees the embedding alone, its query is zero).
  ``attnres_type="full"`` is our Full AttnRes; ``"block"`` with ``attnres_num_blocks`` N ends its
  blocks at ``ceil(2L i / N')`` (N' = min(N, 2L)), our ``block_boundaries``, with block summaries the
  sums of their members (the public-era n4/n8/n16 setting: ``attnres_block_average`` false, no prior).

Refused, in one line naming the key: ``use_lrid`` (the low-rank "LR" keys), count-averaged block
summaries (``attnres_block_average`` / a non-zero ``attnres_block_alpha``), the count prior
(``attnres_block_count_prior`` / ``attnres_block_beta``), learned block powers, scales, value norms
or split sublayers, ``attnres_key_norm`` false, ``attn_res_query_norm``, ``norm_pos`` other than
"before", ``clip_qkv``, an unknown ``attnres_type`` / ``attnres_backend``, unknown keys. Accepted as
the same function: ``use_fused_attnres``, ``attnres_backend`` "fast"/"auto" (kernels only),
``flash_attention`` and the init and training-path settings.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.families.common import FLOAT_DTYPES, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, PretrainedError, getter
from attnres_probe.validate import check_bytes

NAME = "lr_attnres"
MODEL_TYPES = ("final_model.pt",)  # no config.json: a folder holding train.py's final_model.pt
TITLE = "LR-AttnRes"
SOURCE = ("jon123boss/LR-AttnRes@efeb4cb9e29187a348f2ed74f94d67e7da791fb5, model.py (fad9768ce71ca3f37a22afa94f3e71e610f9a1e7) "
          "and checkpoint_config.py")
CHECKPOINT = "final_model.pt"
PREFIX = "_orig_mod."  # torch.compile's module prefix, in checkpoints saved before 2026-06-04
ROPE_TOLERANCE = 2.0**-7  # a stored table against the exact one: bf16 rounding (<= 2^-9) plus float32 angles

# upstream's ModelConfig fields and defaults (model.py at fad9768): a missing field takes its default
DEFAULTS: dict[str, Any] = dict(
    block_size=1024, vocab_size=100277, n_layer=12, n_head=12, n_embd=768, mlp_hidden_dim=None, mlp_ratio=4.0,
    weight_tying=False, rope_theta=500000.0, norm_pos="after", qk_norm=True, clip_qkv=None, flash_attention=False,
    init_std=0.02, init_cutoff_factor=None, attnres_type=None, use_attnres=False, use_fused_attnres=False,
    attnres_num_blocks=8, attnres_block_average=True, attnres_block_average_mode="count", attnres_block_count_prior=True,
    attnres_block_alpha="legacy", attnres_block_beta="legacy", attnres_block_alpha_learned=False,
    attnres_block_beta_learned=False, attnres_block_alpha_scope="shared", attnres_block_beta_scope="shared",
    attnres_block_split_sublayers=False, attnres_block_learned_scale=False, attnres_block_learned_scale_init="count",
    attnres_block_value_norm=False, attnres_key_norm=True, attn_res_query_norm=False, attn_res_query_init="zero",
    attnres_training_cache_phase1=True, attnres_training_torch_phase2=True, attnres_fuse_read_norm=True,
    use_lrid=False, lrid_rank=64, lrid_projection_rank=None, lrid_num_heads=1, lrid_input_dependent_query=False,
    lrid_static_embedding_key=False, lrid_add_static_embedding_key=False, lrid_add_static_source_key=False,
    lrid_key_from_value=False, lrid_key_from_value_shared=False, lrid_key_from_output_tail=False,
    lrid_key_value_norm=True, lrid_query_from_value=False, lrid_query_from_value_shared=False,
    lrid_use_logit_scale=True, lrid_logit_scale=None, attnres_backend="legacy",
)
SUPPORTED = ("supported: the baseline (use_attnres false) and standard AttnRes (use_lrid false), attnres_type full, or "
             "block with summed blocks and no count prior")
# flags that must be false (the value true changes the function in a way this model does not represent)
_MUST_BE_FALSE = {
    "attnres_block_alpha_learned": "learned block-summary powers",
    "attnres_block_beta_learned": "learned count-prior strengths",
    "attnres_block_split_sublayers": "separate attention and MLP partial blocks",
    "attnres_block_learned_scale": "learned block-summary scales",
    "attnres_block_value_norm": "normalised block summaries",
}
# numpy dtypes an rng state or a data manifest may hold (no object arrays: their items would be pickles)
_NUMPY_DTYPES = ("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Float16", "Float32",
                 "Float64")


def recognises(data: dict[str, Any]) -> bool:
    """False: these checkpoints have no config.json (:func:`recognises_folder` finds them)."""
    return False


def recognises_folder(directory: str | Path) -> bool:
    """A folder holding ``final_model.pt`` and no config.json (the public repos: the checkpoint and a model card)."""
    d = Path(directory)
    return (d / CHECKPOINT).is_file() and not (d / "config.json").exists()


# -- the checkpoint file ------------------------------------------------------------------
def _allowed_globals() -> list[Any]:
    """The globals allowed on top of torch's weights-only defaults: numpy's array reconstruction (the
    rng state of the newer checkpoints) and ``TorchVersion`` (a str; ``training_runtime.torch_version``)."""
    from torch.torch_version import TorchVersion

    out: list[Any] = [TorchVersion]
    try:
        import numpy as np
        try:
            from numpy._core.multiarray import _reconstruct  # numpy 2
        except ImportError:  # pragma: no cover - numpy 1
            from numpy.core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy is installed with torch
        return out
    # under both names numpy pickles it by (numpy 1: numpy.core, numpy 2: numpy._core)
    out += [(_reconstruct, "numpy.core.multiarray._reconstruct"), (_reconstruct, "numpy._core.multiarray._reconstruct"),
            np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    out += [getattr(dtypes, f"{n}DType") for n in _NUMPY_DTYPES if dtypes is not None and hasattr(dtypes, f"{n}DType")]
    return out


def _strip_hint(path: Path) -> str:
    return (f"if you trust the file, keep only its weights and settings: ck = torch.load({str(path)!r}, weights_only=False); "
            "torch.save({'model': ck['model'], 'model_args': dict(ck['model_args']), 'config': ck.get('config', {})}, "
            f"{str(path)!r}")


def load_checkpoint(path: Path) -> dict[str, Any]:
    """``final_model.pt`` as a dict, read by ``torch.load(map_location="cpu", weights_only=True, mmap=True)``
    (memory-mapped: the optimiser states it also holds are never read into memory) with exactly
    :func:`_allowed_globals` allowed besides torch's weights-only defaults. Bounded first: a file larger
    than the memory bound (:func:`~attnres_probe.validate.check_bytes`) is refused unread.

    Raises:
        PretrainedError: too large, not a torch checkpoint, or pickling anything else (one line, saying how to
            strip it to its weights).
    """
    check_bytes(path.stat().st_size, f"the training checkpoint {CHECKPOINT} (weights, optimiser and rng states)", str(path),
                PretrainedError)
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler and the zip reader raise many types; each becomes one line
        text = str(exc)
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"but got <class '([\w.]+)'>", text)
        if found:
            raise PretrainedError(
                f"{path}: it pickles {found[1]}, which attnres-probe does not unpickle (torch.load(weights_only=True) builds "
                f"tensors, plain containers and numpy's arrays only, so no code in a file runs); {_strip_hint(path)}") from None
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        raise PretrainedError(f"{path}: not a readable torch checkpoint ({type(exc).__name__}: {first[:200]})") from None
    if not isinstance(data, dict):
        raise PretrainedError(f"{path}: holds a {type(data).__name__}, not train.py's checkpoint dict ('model', 'model_args')")
    return data


# -- the config ---------------------------------------------------------------------------
def _flag(args: dict[str, Any], key: str, where: str) -> bool:
    value = args[key]
    if not isinstance(value, bool):
        raise PretrainedError(f"{where}: {key!r} is {value!r}; it must be true or false")
    return value


def _powers(value: Any, key: str, where: str) -> list[float] | None:
    """A block power field: None for "legacy", else its values (upstream's parsing: a number, a comma list, a list)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "legacy":
            return None
        try:
            return [float(p) for p in text.split(",")]
        except ValueError:
            raise PretrainedError(f"{where}: {key!r} is {value!r}; upstream accepts 'legacy', a number or comma-separated numbers") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    raise PretrainedError(f"{where}: {key!r} is {value!r}; upstream accepts 'legacy', a number or a list of numbers")


def _check_block_summaries(args: dict[str, Any], where: str) -> None:
    """Block AttnRes is represented with summed blocks and no count prior (upstream's alpha = 0, beta = 0)."""
    for key, what in _MUST_BE_FALSE.items():
        if _flag(args, key, where):
            raise PretrainedError(f"{where}: {key!r} = true ({what}) is not supported; {SUPPORTED}")
    alpha = _powers(args["attnres_block_alpha"], "attnres_block_alpha", where)
    if alpha is None:  # legacy: attnres_block_average (mode count: 1, sqrt: 0.5), else 0
        if _flag(args, "attnres_block_average", where):
            mode = str(args["attnres_block_average_mode"] or "count").lower()
            raise PretrainedError(
                f"{where}: 'attnres_block_average' = true (block summaries scaled by n^-{'0.5' if mode == 'sqrt' else '1'}, "
                f"attnres_block_average_mode {mode!r}) is not supported; attnres-probe's Block AttnRes sums its blocks "
                f"('attnres_block_average' false); {SUPPORTED}")
    elif any(a != 0.0 for a in alpha):
        raise PretrainedError(f"{where}: 'attnres_block_alpha' = {args['attnres_block_alpha']!r} (block summaries scaled by "
                              f"n^-alpha) is not supported; only 0 (summed blocks); {SUPPORTED}")
    beta = _powers(args["attnres_block_beta"], "attnres_block_beta", where)
    if beta is None:  # legacy: attnres_block_count_prior gives beta 1
        if _flag(args, "attnres_block_count_prior", where):
            raise PretrainedError(f"{where}: 'attnres_block_count_prior' = true (a beta * ln(n) logit bias per block) is not "
                                  f"supported; {SUPPORTED}")
    elif any(b != 0.0 for b in beta):
        raise PretrainedError(f"{where}: 'attnres_block_beta' = {args['attnres_block_beta']!r} (a beta * ln(n) logit bias per "
                              f"block) is not supported; only 0 (no count prior); {SUPPORTED}")


def block_ends(n_sublayers: int, n_blocks: int) -> list[int]:
    """Upstream's block ends ``ceil(2L i / N')`` for i = 1..N', N' = min(N, 2L) (``_make_attnres_block_ends``)."""
    n = min(n_blocks, n_sublayers)
    return sorted({-(-n_sublayers * i // n) for i in range(1, n + 1)})


def resolve_args(model_args: Any, train_config: Any, where: str) -> dict[str, Any]:
    """``model_args`` with upstream's defaults for the missing fields (``checkpoint_config``'s rule: a missing
    ``attnres_block_count_prior`` takes the training ``config``'s value, else False). Unknown keys are refused."""
    if not isinstance(model_args, dict):
        raise PretrainedError(f"{where}: 'model_args' is a {type(model_args).__name__}; train.py saves a dict "
                              "(asdict(ModelConfig)), and a pickled ModelConfig instance is never unpickled")
    unknown = sorted(str(k) for k in model_args if k not in DEFAULTS)
    if unknown:
        raise PretrainedError(f"{where}: 'model_args' has keys this loader does not know, {unknown[:5]}: a newer upstream than "
                              f"{SOURCE.split(',')[0]}, whose options might change the model")
    args = {**DEFAULTS, **model_args}
    if "attnres_block_count_prior" not in model_args:
        prior = train_config.get("attnres_block_count_prior") if isinstance(train_config, dict) else None
        args["attnres_block_count_prior"] = prior if prior is not None else False
    return args


def config(model_args: Any, where: str = CHECKPOINT, train_config: Any = None) -> ModelConfig:
    """Our :class:`ModelConfig` for a checkpoint's ``model_args`` (and its training ``config``, for the
    count-prior migration)."""
    args = resolve_args(model_args, train_config, where)
    get = getter(args, where)
    for key in ("use_lrid", "use_attnres", "weight_tying", "qk_norm", "attnres_key_norm", "attn_res_query_norm"):
        _flag(args, key, where)
    if args["use_lrid"]:
        raise PretrainedError(f"{where}: 'use_lrid' = true (LR-AttnRes's low-rank keys, read per routing head) is not "
                              f"supported; {SUPPORTED}")
    if args["norm_pos"] != "before":
        raise PretrainedError(f"{where}: 'norm_pos' = {args['norm_pos']!r} is not supported; only 'before' (pre-norm sublayers)")
    if args["clip_qkv"] is not None:
        raise PretrainedError(f"{where}: 'clip_qkv' = {args['clip_qkv']!r} (clamped q, k, v) is not supported; only null")
    backend = str(args["attnres_backend"] or "legacy").lower()
    if backend not in ("auto", "legacy", "fast"):
        raise PretrainedError(f"{where}: 'attnres_backend' = {args['attnres_backend']!r}; upstream accepts auto, legacy, fast")
    d = get("n_embd", "int", 768, 1, MAX_WIDTH)
    heads = get("n_head", "int", 12, 1, 1024)
    n_layers = get("n_layer", "int", 12, 1, MAX_LAYERS)
    n_ctx = get("block_size", "int", 1024, 1, MAX_POSITIONS)
    vocab = get("vocab_size", "int", 100277, 1, MAX_VOCAB)
    theta = get("rope_theta", "number", 500000.0, 1 + 1e-9, 1e12)
    if d % heads or (d // heads) % 2:
        raise PretrainedError(f"{where}: 'n_embd' {d} / 'n_head' {heads} must be an even head width (rotary pairs)")
    if args["mlp_hidden_dim"] is not None:
        hidden = get("mlp_hidden_dim", "int", None, 1, 64 * MAX_WIDTH)
    else:
        ratio = get("mlp_ratio", "number", None, 1e-6, 1024)
        if ratio is None:
            raise PretrainedError(f"{where}: 'mlp_hidden_dim' and 'mlp_ratio' are both null; upstream needs one")
        hidden = int(d * ratio)
        if hidden < 1:
            raise PretrainedError(f"{where}: 'mlp_ratio' = {ratio} gives an MLP width {hidden}")
    residual, boundaries, kind, blocks = "prenorm", None, None, None
    if args["use_attnres"]:
        kind = str(args["attnres_type"] or "block").lower()
        if kind not in ("full", "block"):
            raise PretrainedError(f"{where}: 'attnres_type' = {args['attnres_type']!r}; upstream accepts full, block")
        if not args["attnres_key_norm"]:
            raise PretrainedError(f"{where}: 'attnres_key_norm' = false (unnormalised keys) is not supported; {SUPPORTED}")
        if args["attn_res_query_norm"]:
            raise PretrainedError(f"{where}: 'attn_res_query_norm' = true (normalised depth queries) is not supported; {SUPPORTED}")
        residual = kind
        if kind == "block":
            blocks = get("attnres_num_blocks", "int", 8, 1, MAX_LAYERS * 2)
            _check_block_summaries(args, where)
            boundaries = [e for e in block_ends(2 * n_layers, blocks) if e < 2 * n_layers]
    d_head = d // heads
    check_bytes(n_layers * 2 * 8 * n_ctx * d_head, f"the rotary tables for 'block_size' {n_ctx}", where, PretrainedError)
    try:
        return ModelConfig(
            d_model=d, n_layers=n_layers, n_heads=heads, n_ctx=n_ctx, d_vocab=vocab, d_mlp=hidden, mlp="swiglu",
            residual=residual, block_boundaries=boundaries, norm="rms", norm_gain=False, eps_from_dtype=True,
            qk_norm=bool(args["qk_norm"]), positional="rope", rope_theta=float(theta), rope_layout="interleaved",
            rope_stored_tables=True, bias=False, tie_embeddings=bool(args["weight_tying"]),
            extra={"source": TITLE, "family": NAME, "attnres_type": kind, "attnres_num_blocks": blocks},
        )
    except (ConfigError, TypeError, ValueError) as exc:
        raise PretrainedError(f"{where}: {exc}") from None


# -- the weights --------------------------------------------------------------------------
def expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint's ``model`` tensor names and shapes (the rotary buffers included)."""
    d, V, F, n, dh = cfg.d_model, cfg.d_vocab, cfg.d_mlp, cfg.n_layers, cfg.d_head
    out: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (V, d)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    for i in range(n):
        p = f"transformer.layers.{i}."
        out.update({
            p + "attn.rope.sin": (1, 1, cfg.n_ctx, dh // 2), p + "attn.rope.cos": (1, 1, cfg.n_ctx, dh // 2),
            p + "attn.c_attn.weight": (3 * d, d), p + "attn.c_proj.weight": (d, d),
            p + "mlp.fc1.weight": (2 * F, d), p + "mlp.fc2.weight": (d, F),
        })
    if cfg.residual in ("full", "block"):
        out.update({f"transformer.attn_residuals.{i}.query": (d,) for i in range(2 * n)})
    return out


def check_weights(state: Any, cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """The checkpoint's ``model`` dict with ``_orig_mod.`` stripped, checked against :func:`expected` (names,
    shapes, floating dtypes) and its rotary tables against ``rope_theta``."""
    if not isinstance(state, dict):
        raise PretrainedError(f"{where}: 'model' is a {type(state).__name__}; train.py saves the state dict there")
    found: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = str(key).removeprefix(PREFIX)
        if name in found:
            raise PretrainedError(f"{where}: tensor {name!r} is stored twice (with and without {PREFIX!r})")
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            kind = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise PretrainedError(f"{where}: {name!r} is {kind}; weights are floating point ({', '.join(FLOAT_DTYPES)})")
        found[name] = value
    want = expected(cfg)
    missing = [n for n in want if n not in found]
    if missing:
        raise PretrainedError(f"{where}: the weights lack {len(missing)} tensor(s) 'model_args' implies, e.g. {missing[:3]} "
                              "(config/weights mismatch)")
    extra = sorted(n for n in found if n not in want)
    if extra:
        raise PretrainedError(f"{where}: the weights hold {len(extra)} tensor(s) 'model_args' does not explain, e.g. {extra[:3]} "
                              "(config/weights mismatch)")
    for name, shape in want.items():
        if tuple(found[name].shape) != shape:
            raise PretrainedError(f"{where}: tensor {name!r} has shape {list(found[name].shape)}; 'model_args' implies "
                                  f"{list(shape)} (config/weights mismatch)")
    # the tables upstream computes (float32) from rope_theta; the stored ones are these rounded to the checkpoint's dtype
    dh = cfg.d_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh))
    angles = torch.outer(torch.arange(cfg.n_ctx, dtype=torch.float64), inv_freq)
    for i in range(cfg.n_layers):
        for part, exact in (("cos", angles.cos()), ("sin", angles.sin())):
            name = f"transformer.layers.{i}.attn.rope.{part}"
            err = float((found[name].reshape(exact.shape).double() - exact).abs().max())
            if not err <= ROPE_TOLERANCE:
                raise PretrainedError(f"{where}: {name!r} is not the rotary table 'rope_theta' {cfg.rope_theta} implies (max "
                                      f"|difference| {err:.3g} > 2^-7): config/weights mismatch")
    return found


def read_folder(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(our config, the checkpoint's tensors by upstream name, as stored) from a folder's ``final_model.pt``."""
    path = Path(directory) / CHECKPOINT
    data = load_checkpoint(path)
    for key in ("model", "model_args"):
        if key not in data:
            raise PretrainedError(f"{path}: has no {key!r} entry; train.py's checkpoint holds 'model' and 'model_args'")
    where = f"{path} 'model_args'"
    cfg = config(data["model_args"], where, data.get("config"))
    step = data.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        cfg.extra["step"] = step
    return cfg, check_weights(data["model"], cfg, f"{path} 'model'")


def state_dict(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Upstream names -> ours. Every tensor is its own (no two parameters share storage); the reads' key gains
    are ones (upstream's keys have none) and read 0's query is zero (it sees the embedding alone)."""
    F, n, dh = cfg.d_mlp, cfg.n_layers, cfg.d_head
    sd: dict[str, torch.Tensor] = {"W_E": w["transformer.wte.weight"]}
    if not cfg.tie_embeddings:
        sd["W_U"] = w["lm_head.weight"].T.contiguous()
    for i in range(n):
        p, b = f"transformer.layers.{i}.", f"blocks.{i}."
        sd[b + "attn.W_QKV.weight"] = w[p + "attn.c_attn.weight"]
        sd[b + "attn.W_O.weight"] = w[p + "attn.c_proj.weight"]
        sd[b + "attn.rotary.cos"] = w[p + "attn.rope.cos"].reshape(cfg.n_ctx, dh // 2)
        sd[b + "attn.rotary.sin"] = w[p + "attn.rope.sin"].reshape(cfg.n_ctx, dh // 2)
        fc1 = w[p + "mlp.fc1.weight"]
        sd[b + "mlp.W_in.weight"], sd[b + "mlp.W_gate.weight"] = fc1[:F].clone(), fc1[F:].clone()  # value, gate
        sd[b + "mlp.W_out.weight"] = w[p + "mlp.fc2.weight"]
    if cfg.residual in ("full", "block"):
        reads = [f"blocks.{i}.{m}_res" for i in range(n) for m in ("attn", "mlp")] + ["out_res"]
        like = w["transformer.wte.weight"]
        for r, read in enumerate(reads):
            sd[read + ".query"] = (w[f"transformer.attn_residuals.{r - 1}.query"] if r else
                                   torch.zeros(cfg.d_model, dtype=like.dtype, device=like.device))
            sd[read + ".norm.weight"] = torch.ones(cfg.d_model, dtype=like.dtype, device=like.device)
    return sd


def tokenizer(directory: Path):
    """The folder's tokenizer (:func:`~attnres_probe.families.common.tokenizer`); without tokenizer files the
    error says that upstream reads text with tiktoken's cl100k_base, which the public folders do not hold."""
    from attnres_probe.families.common import tokenizer as read_tokenizer

    return read_tokenizer(Path(directory), hint=(" (LR-AttnRes reads text with tiktoken's cl100k_base: save a "
                                                  "transformers tokenizer of it, e.g. Xenova/gpt-4's, beside final_model.pt)"))
