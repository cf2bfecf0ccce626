"""ModelConfig: one dataclass for every residual rule: the PreNorm baseline, Full and Block AttnRes,
Hyper-Connections / mHC and DenseFormer."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from attnres_probe.axis import RESIDUALS
from attnres_probe.rules import RULES

Residual = Literal["prenorm", "full", "block", "hyper", "denseformer", "cumulative"]
POSITIONALS = ("learned", "sinusoidal", "rope")
MLPS = ("gelu", "swiglu")
NORMS = ("rms", "layernorm")
MAX_STREAMS = 64  # Hyper-Connections' streams: the papers use 2 to 8; memory and time grow with n^2 per token
MAX_SINKHORN_ITERS = 1000  # mHC uses 20; each round is two normalisations of every n x n matrix
ROPE_LAYOUTS = ("neox", "interleaved")
DEFAULT_BLOCK_SIZE = 4
DYNAMIC_INPUTS = ("stream", "flat")
# each rule's own fields and their defaults (None in the dataclass: "not this rule's")
HYPER_DEFAULTS = dict(n_streams=4, hc_dynamic=True, mhc=False, hc_dynamic_input=None, hc_tanh=None, sinkhorn_iters=20)
DENSEFORMER_DEFAULTS = dict(dwa_dilation=1, dwa_period=1)


class ConfigError(ValueError):
    """A ModelConfig field has a value the model cannot be built with."""


@dataclass
class ModelConfig:
    """Shape and residual mode of an :class:`~attnres_probe.AttnResTransformer`.

    A model of ``n_layers`` transformer blocks has ``L = 2 * n_layers`` sublayers
    (attention, MLP, attention, ...), so L AttnRes reads plus one final read.
    """

    d_model: int = 128  # width of the residual stream / every depth source
    n_layers: int = 4  # transformer blocks (each = one attention + one MLP sublayer)
    n_heads: int = 4
    d_head: int | None = None  # None: d_model // n_heads (d_model must then divide evenly)
    d_mlp: int | None = None  # None: 4 * d_model
    n_ctx: int = 256  # longest sequence the model accepts
    d_vocab: int = 256  # 256 = the byte tokenizer
    residual: Residual = "full"  # "prenorm" | "full" | "block" | "hyper" | "denseformer"
    block_size: int | None = None  # block mode: sublayers per block (None and no boundaries: 4)
    block_boundaries: list[int] | None = None  # block mode: sublayer indices where blocks 2..N start
    static_routing: bool = False  # block mode: every read's weights are softmax(learned logits), the same for every input
    # residual="hyper" (Hyper-Connections, arXiv 2409.19606; mHC, arXiv 2512.24880); None elsewhere
    n_streams: int | None = None  # n residual streams (hyper: default 4)
    hc_dynamic: bool | None = None  # per-token weights from the state (DHC) rather than static (SHC); default true
    mhc: bool | None = None  # manifold-constrained: Sinkhorn H_res, sigmoid H_pre, 2 sigmoid H_post; default false
    hc_dynamic_input: str | None = None  # "stream" (HC paper, the package) | "flat" (mHC paper); None: flat for mHC, stream for HC
    hc_tanh: bool | None = None  # HC only: tanh on the dynamic terms (default true; false for mHC)
    sinkhorn_iters: int | None = None  # mHC: Sinkhorn rounds (default 20)
    # residual="denseformer" (depth-weighted averaging, arXiv 2402.02622); None elsewhere
    dwa_dilation: int | None = None  # a DWA averages the block outputs j = i+1 (mod dilation) (default 1)
    dwa_period: int | None = None  # a DWA follows every period-th block (default 1: every block)
    # the options of a rule built by a file of attnres_probe.rules (e.g. "cumulative": mode, layers_per_block,
    # gate); None for every other rule
    rule_options: dict[str, Any] | None = None
    norm_eps: float = 1e-6  # shared by every RMSNorm, the depth keys' included (not the q/k norm)
    positional: str = "learned"  # "learned" | "sinusoidal" (added to the embedding) | "rope" (rotary q, k)
    # Llama-style parts (models from flash-linear-attention; the byte-level demo uses none of them)
    n_kv_heads: int | None = None  # grouped key/value heads; None: n_heads (must divide n_heads)
    mlp: str = "gelu"  # "gelu": W_in + bias -> GELU -> W_out + bias; "swiglu": silu(W_gate x) * W_in x -> W_out, no biases
    qk_norm: bool = False  # RMSNorm over each head's queries and keys (before rotary)
    qk_norm_eps: float = 1e-5  # its epsilon (fla fixes it at 1e-5 whatever norm_eps says)
    qkv_bias: bool = False  # biases on the query, key and value projections
    rope_theta: float = 10000.0  # rotary base (positional="rope")
    tie_embeddings: bool = False  # the unembedding is W_E transposed
    norm: str = "rms"  # the pre-norms and the final norm: "rms" (RMSNorm) | "layernorm" (nanoGPT-style models)
    norm_bias: bool = False  # norm="layernorm": with a bias
    bias: bool | None = None  # None: GELU MLP biased, the rest not; True/False: every attention and MLP Linear
    attn_gate: bool = False  # attention output gate: z * sigmoid(W_G x) before W_O
    norm_gain: bool = True  # False: the pre-norms, the final norm and the q/k norms are RMSNorms without a gain (no parameters)
    # True: every RMSNorm (pre-norms, final, q/k, the depth keys) uses torch's default eps, finfo(compute dtype).eps
    # (F.rms_norm(eps=None): 1.19e-7 in float32/bf16/fp16, 2.2e-16 in float64); norm_eps and qk_norm_eps are then unused
    eps_from_dtype: bool = False
    rope_layout: str = "neox"  # rotary pairs: "neox" (the two halves of a head) | "interleaved" (GPT-J: dims 2i, 2i+1)
    # True: each attention rotates with cos/sin tables kept as buffers of the state dict (blocks.{i}.attn.rotary.cos|sin,
    # [n_ctx, d_head / 2]) that a checkpoint provides (LR-AttnRes stores bf16-rounded tables and rotates with them)
    rope_stored_tables: bool = False
    seed: int = 0  # parameter initialisation seed
    init_std: float = 0.02  # std of the attention, MLP and unembedding weights
    embed_std: float = 1.0  # std of the token and learned position embeddings (unit-scale source 0)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form metadata (kept in JSON)

    def __post_init__(self) -> None:
        if self.block_boundaries is not None and not isinstance(self.block_boundaries, list):
            try:
                self.block_boundaries = list(self.block_boundaries)
            except TypeError:
                raise ConfigError(
                    f"block_boundaries must be a list of sublayer indices; got {self.block_boundaries!r}"
                ) from None
        if self.d_head is None and _is_pos_int(self.d_model) and _is_pos_int(self.n_heads):
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "choose n_heads dividing d_model, or set d_head explicitly"
                )
            self.d_head = self.d_model // self.n_heads
        if self.d_mlp is None and _is_pos_int(self.d_model):
            self.d_mlp = 4 * self.d_model
        if self.n_kv_heads is None and _is_pos_int(self.n_heads):
            self.n_kv_heads = self.n_heads
        if self.residual in RULES and isinstance(self.rule_options, dict | type(None)):
            self.rule_options = {**RULES[self.residual].options, **(self.rule_options or {})}
        own = {"hyper": HYPER_DEFAULTS, "denseformer": DENSEFORMER_DEFAULTS}.get(self.residual, {})
        for name, default in own.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if self.residual == "hyper" and self.hc_dynamic_input is None:
            self.hc_dynamic_input = "flat" if self.mhc else "stream"
        if self.residual == "hyper" and self.hc_tanh is None:
            self.hc_tanh = not self.mhc  # HC's dynamic terms pass a tanh; mHC's gates are sigmoids
        self.validate()

    # -- derived -------------------------------------------------------------------------
    @property
    def n_sublayers(self) -> int:
        """L = 2 * n_layers."""
        return 2 * self.n_layers

    @property
    def n_reads(self) -> int:
        """L + 1: one read before every sublayer and the final read."""
        return self.n_sublayers + 1

    @property
    def block_starts(self) -> list[int]:
        """Sublayer index where each block starts, [0, b_1, ..., b_{N-1}] (block mode only)."""
        if self.residual != "block":
            return []
        if self.block_boundaries is not None:
            return [0, *self.block_boundaries]
        size = self.block_size or DEFAULT_BLOCK_SIZE
        return list(range(0, self.n_sublayers, size))

    @property
    def n_blocks(self) -> int:
        """N, the number of blocks (block mode), else 0."""
        return len(self.block_starts)

    @property
    def n_sources(self) -> int:
        """Columns of the common source axis: N+1 for block, L+1 otherwise (the source axis answers)."""
        from attnres_probe.axis import SourceAxis

        return SourceAxis.from_config(self).n_sources

    # what TransformerLens's ActivationCache helpers read off a model's config
    @property
    def normalization_type(self) -> str:
        """``"RMS"``: every norm is an RMSNorm with a learned gain, not folded into the weights (``"LN"``
        for ``norm="layernorm"``; ``"RMSPre"``, TransformerLens's RMSNorm without a gain, for ``norm_gain=False``)."""
        if self.norm == "layernorm":
            return "LN"
        return "RMS" if self.norm_gain else "RMSPre"

    @property
    def attn_only(self) -> bool:
        """False: every block has an MLP."""
        return False

    # -- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field and the accepted values."""
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_mlp", "n_ctx", "d_vocab"):
            value = getattr(self, name)
            if not _is_pos_int(value):
                raise ConfigError(f"{name} must be a positive integer; got {value!r}")
        if self.residual not in RESIDUALS:
            raise ConfigError(f"residual is {self.residual!r}; accepted values are {', '.join(RESIDUALS)}")
        if self.positional not in POSITIONALS:
            raise ConfigError(f"positional is {self.positional!r}; accepted values are {', '.join(POSITIONALS)}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"positional='sinusoidal' needs an even d_model; got d_model={self.d_model}")
        if self.positional == "rope" and self.d_head % 2:
            raise ConfigError(f"positional='rope' rotates pairs of head dimensions: d_head must be even; got d_head={self.d_head}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (each key/value head serves a group)")
        if self.mlp not in MLPS:
            raise ConfigError(f"mlp is {self.mlp!r}; accepted values are {', '.join(MLPS)}")
        if self.norm not in NORMS:
            raise ConfigError(f"norm is {self.norm!r}; accepted values are {', '.join(NORMS)}")
        if self.bias is not None and not isinstance(self.bias, bool):
            raise ConfigError(f"bias must be true, false or null; got {self.bias!r}")
        if self.norm_bias and self.norm != "layernorm":
            raise ConfigError("norm_bias applies to norm='layernorm' only (an RMSNorm has no bias)")
        for name in ("norm_gain", "eps_from_dtype", "rope_stored_tables"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false; got {getattr(self, name)!r}")
        if not self.norm_gain and self.norm != "rms":
            raise ConfigError(f"norm_gain=False applies to norm='rms' only (an RMSNorm without a gain); this config has norm={self.norm!r}")
        if self.eps_from_dtype and (self.norm != "rms" or self.residual not in ("prenorm", "full", "block")):
            raise ConfigError(f"eps_from_dtype=True applies to norm='rms' with residual 'prenorm', 'full' or 'block'; this config has "
                              f"norm={self.norm!r}, residual={self.residual!r}")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ConfigError(f"rope_layout is {self.rope_layout!r}; accepted values are {', '.join(ROPE_LAYOUTS)}")
        if (self.rope_layout != "neox" or self.rope_stored_tables) and self.positional != "rope":
            raise ConfigError(f"rope_layout={self.rope_layout!r} / rope_stored_tables={self.rope_stored_tables!r} apply to "
                              f"positional='rope' only; this config has positional={self.positional!r}")
        if self.static_routing is not False and self.residual != "block":
            raise ConfigError(f"static_routing applies to residual='block' only; this config has residual={self.residual!r}")
        for name in ("qk_norm", "qkv_bias", "tie_embeddings", "norm_bias", "attn_gate", "static_routing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false; got {getattr(self, name)!r}")
        for name in ("qk_norm_eps",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise ConfigError(f"{name} must be a number in (0, 1); got {value!r}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or not 1 < self.rope_theta < math.inf:
            raise ConfigError(f"rope_theta must be a finite number above 1; got {self.rope_theta!r}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not (
            0 < self.norm_eps < 1
        ):
            raise ConfigError(f"norm_eps must be a number in (0, 1); got {self.norm_eps!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer; got {self.seed!r}")
        for name in ("init_std", "embed_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a positive number (finite); got {value!r}")
        if not isinstance(self.extra, dict):
            raise ConfigError(f"extra must be a dict; got {type(self.extra).__name__}")
        self._validate_rule_fields()
        L = self.n_sublayers
        if self.block_size is not None and not _is_pos_int(self.block_size):
            raise ConfigError(f"block_size must be a positive integer (sublayers per block); got {self.block_size!r}")
        if self.residual != "block":
            if self.block_size is not None or self.block_boundaries is not None:
                raise ConfigError(
                    f"block_size/block_boundaries apply only to residual='block'; this config has residual={self.residual!r}"
                )
            return
        if self.block_size is not None and self.block_boundaries is not None:
            raise ConfigError("give either block_size or block_boundaries, not both")
        if self.block_size is not None and self.block_size > L:
            raise ConfigError(
                f"block_size={self.block_size} is larger than the model's {L} sublayers (2 * n_layers); "
                f"accepted: 1..{L}"
            )
        if self.block_boundaries is not None:
            b = self.block_boundaries
            for x in b:
                if not _is_pos_int(x) or x >= L:
                    raise ConfigError(
                        f"block_boundaries entry {x!r} is out of range; each must be an integer in 1..{L - 1} "
                        f"(a sublayer index where a new block starts; the model has {L} sublayers)"
                    )
            if any(b2 <= b1 for b1, b2 in zip(b, b[1:])):
                raise ConfigError(f"block_boundaries must be strictly increasing; got {b}")

    def _validate_rule_fields(self) -> None:
        """Hyper-Connections' and DenseFormer's own fields: set only for their rule, and valid."""
        for rule, fields in (("hyper", HYPER_DEFAULTS), ("denseformer", DENSEFORMER_DEFAULTS)):
            if self.residual == rule:
                continue
            given = [f"{name}={getattr(self, name)!r}" for name in fields if getattr(self, name) is not None]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} apply only to residual={rule!r}; this config has residual={self.residual!r} "
                    f"(leave them unset)"
                )
        if self.residual == "hyper":
            for name, top, why in (("n_streams", MAX_STREAMS, "the state is n_streams copies of every token's residual"),
                                   ("sinkhorn_iters", MAX_SINKHORN_ITERS, "every read runs them, forward and backward")):
                value = getattr(self, name)
                if not _is_pos_int(value) or value > top:
                    raise ConfigError(f"{name} must be an integer in 1..{top} ({why}); got {value!r}")
            for name in ("hc_dynamic", "mhc", "hc_tanh"):
                if not isinstance(getattr(self, name), bool):
                    raise ConfigError(f"{name} must be true or false; got {getattr(self, name)!r}")
            if self.mhc and self.hc_tanh:
                raise ConfigError(
                    "hc_tanh=True applies only to Hyper-Connections without mhc (mHC's gates are sigmoids and a "
                    "Sinkhorn projection, with no tanh); leave it unset or false"
                )
            if self.hc_dynamic_input not in DYNAMIC_INPUTS:
                raise ConfigError(
                    f"hc_dynamic_input is {self.hc_dynamic_input!r}; accepted values are {', '.join(DYNAMIC_INPUTS)} "
                    "(or unset: flat for mHC, stream for HC)"
                )
        if self.residual == "denseformer":
            for name in ("dwa_dilation", "dwa_period"):
                if not _is_pos_int(getattr(self, name)):
                    raise ConfigError(f"{name} must be a positive integer; got {getattr(self, name)!r}")
        if self.residual in RULES:
            if not isinstance(self.rule_options, dict):
                raise ConfigError(f"rule_options must be a dict of the {self.residual!r} rule's options; got {self.rule_options!r}")
            problem = RULES[self.residual].check(self.rule_options, self.n_layers)
            if problem:
                raise ConfigError(problem)
        elif self.rule_options is not None:
            raise ConfigError(f"rule_options apply only to the rules {', '.join(RULES)}; this config has residual={self.residual!r} "
                              "(leave them unset)")

    @property
    def rule_label(self) -> str:
        """A short name of the residual rule with its variant: "PreNorm", "Full AttnRes",
        "Block AttnRes", "mHC (4 streams)", "HC (static, 2 streams)", "DenseFormer" ..."""
        if self.residual == "hyper":
            kind = "mHC" if self.mhc else "HC"
            static = "" if self.hc_dynamic else "static, "
            return f"{kind} ({static}{self.n_streams} streams)"
        if self.residual == "denseformer":
            opts = [f"{k} {v}" for k, v in (("dilation", self.dwa_dilation), ("period", self.dwa_period)) if v != 1]
            return "DenseFormer" + (f" ({', '.join(opts)})" if opts else "")
        if self.residual in RULES:
            settings = RULES[self.residual].settings(self.to_dict())
            return RULES[self.residual].title + (f" ({settings})" if settings else "")
        if self.static_routing:
            return "Block AttnRes (static routing)"
        return {"prenorm": "PreNorm", "full": "Full AttnRes", "block": "Block AttnRes"}[self.residual]

    # -- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise a ConfigError listing the known ones."""
        return dataclass_from_dict(cls, data, "config", "model config")

    def to_json(self, path: str | Path | None = None) -> str:
        """JSON text of the config; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> ModelConfig:
        """Config from JSON text or from a file path."""
        p = Path(text_or_path) if not str(text_or_path).lstrip().startswith("{") else None
        text = p.read_text() if p is not None else str(text_or_path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            where = f"{p}" if p is not None else "config text"
            raise ConfigError(f"{where} is not valid JSON: {exc}") from None
        except RecursionError:
            where = f"{p}" if p is not None else "config text"
            raise ConfigError(f"{where} is nested too deeply to be a model config") from None
        return cls.from_dict(data)


# what a model's residual rule sets (and its seed): everything else is the model's shape
RULE_FIELDS = frozenset({"residual", "block_size", "block_boundaries", "rule_options", "static_routing", *HYPER_DEFAULTS, *DENSEFORMER_DEFAULTS})


def shape_of(config: Any) -> dict[str, Any]:
    """A model config (a :class:`ModelConfig` or its dict) without its residual rule's fields and
    its seed: what two models must share for their difference to be the rule's alone."""
    d = config.to_dict() if isinstance(config, ModelConfig) else dict(config or {})
    out = {k: v for k, v in d.items() if k not in RULE_FIELDS and k not in ("seed", "extra")}
    extra = d.get("extra") if isinstance(d.get("extra"), dict) else {}
    if extra.get("family"):  # free-form metadata, but for the family a model was built from (its rule's keys differ)
        out["family"] = extra["family"]
    return out


def shape_difference(configs: dict[str, Any]) -> str:
    """"" when the models of ``configs`` (name -> config or None) share one shape, else a sentence
    naming the first model that differs and how (fields ``name value vs first's value``). Models
    without a config are left out."""
    shapes = {name: shape_of(c) for name, c in configs.items() if c}
    if len(shapes) < 2:
        return ""
    (first, a), *rest = shapes.items()
    for name, b in rest:
        diff = [f"{k} {b.get(k)!r} vs {a.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if diff:
            return (f"These models differ in more than the residual rule: {name} against {first}, "
                    f"{', '.join(diff)}. Their differences are not the rule's alone.")
    return ""


def dataclass_from_dict(cls, data: Any, field_word: str, what: str):
    """``cls(**data)`` after checking ``data`` is a dict of known fields (ConfigError otherwise)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a {what} must be a JSON object; got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {field_word} field(s) {unknown}; known fields are {sorted(known)}")
    return cls(**data)


def _is_pos_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
