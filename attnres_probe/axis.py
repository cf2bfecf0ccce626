"""SourceAxis: the one owner of the common source axis (docs/design.md, "The common source axis").

Every trace, chart and hook speaks of reads (rows) and sources (columns). Which sources a read
sees, which column holds a partial block, the labels, the expanded sublayer view and what a
source is made of are worked out here, once, from the residual rule and the block layout; the
model, the recorder, the ablation, the trace and the figures ask this object.

- Full, PreNorm, Hyper-Connections and DenseFormer: L+1 columns ``[embed, L0.attn, L0.mlp, L1.attn, ...]``; read r sees
  columns 0..r.
- Block: N+1 columns ``[embed, block1, ..., blockN]``; the read at sublayer l in block n at
  offset i sees the embedding, the n-1 completed blocks and, when i > 0, the partial block
  b_n^i in column n. The final read sees every block, all of them complete.
- Rows are the L+1 reads ``[L0.attn, L0.mlp, ..., final]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ATTNRES_RULES", "COEFFICIENT_RULES", "RESIDUALS", "RULE_TITLES", "SourceAxis", "fixed_routing", "rule_settings", "rule_title"]

from attnres_probe.rules import RULES

# every residual rule; "hyper" (Hyper-Connections / mHC), "denseformer" and the rules of attnres_probe.rules
# (unless their RuleInfo says block_axis) use the Full/PreNorm axis
RESIDUALS = ("prenorm", "full", "block", "hyper", "denseformer", *RULES)
# the rules whose reads are softmax mixtures scored by a learned query (depth attention, logits)
ATTNRES_RULES = ("full", "block")
# the rules whose recorded weights are coefficients c of h = sum_j c_j v_j that need not sum to one
# (PreNorm's all one; HC's and DenseFormer's may be negative): pages show them as c / sum(c)
COEFFICIENT_RULES = ("prenorm", "hyper", "denseformer", *(n for n, r in RULES.items() if r.coefficients))
# the human title of each rule, as pages and reports name a model (see rule_title: "hyper" is mHC or HC)
RULE_TITLES = {
    "prenorm": "PreNorm baseline",
    "full": "Full AttnRes",
    "block": "Block AttnRes",
    "hyper": "Hyper-Connections",
    "denseformer": "DenseFormer",
    **{n: r.title for n, r in RULES.items()},
}


def fixed_routing(residual: str, config: Mapping[str, Any] | None = None) -> bool:
    """Whether a rule's depth weights are the same for every input: PreNorm's (all one), DenseFormer's
    (its DWA weights are parameters) and static Hyper-Connections' (``hc_dynamic`` false). There is
    nothing to patch in them, and their routing is the same in every window."""
    if residual in ("prenorm", "denseformer"):
        return True
    if residual == "block" and isinstance(config, Mapping) and config.get("static_routing"):
        return True  # attnres4babylm's static-routing control: learned logits, no query
    if residual in RULES:
        return RULES[residual].fixed(config if isinstance(config, Mapping) else {})
    return residual == "hyper" and isinstance(config, Mapping) and config.get("hc_dynamic") is False


def rule_settings(residual: str, config: Mapping[str, Any] | None = None) -> str:
    """A rule's own settings in words, for a models table: "4 streams, dynamic with flat input,
    Sinkhorn 20 rounds" (mHC), "4 streams, static" (HC), "a DWA after every block, dilation 1,
    period 1" (DenseFormer); "" for the other rules or without a config."""
    if not isinstance(config, Mapping):
        return ""
    if residual in RULES:
        return RULES[residual].settings(config)
    if residual == "hyper" and config.get("n_streams"):
        dynamic = (f"dynamic with {config.get('hc_dynamic_input') or 'stream'} input"
                   + (", no tanh" if config.get("hc_tanh") is False and not config.get("mhc") else "")
                   if config.get("hc_dynamic", True) else "static")
        sinkhorn = f", Sinkhorn {config.get('sinkhorn_iters')} rounds" if config.get("mhc") and config.get("sinkhorn_iters") else ""
        return f"{config['n_streams']} streams, {dynamic}{sinkhorn}"
    if residual == "denseformer" and config.get("dwa_dilation"):
        period = config.get("dwa_period") or 1
        every = "every block" if period == 1 else f"every {period} blocks"
        return f"a DWA after {every}, dilation {config['dwa_dilation']}, period {period}"
    return ""


def rule_title(residual: str, config: Mapping[str, Any] | None = None) -> str:
    """The human title of a residual rule: "PreNorm baseline", "Full AttnRes", "Block AttnRes",
    "Hyper-Connections" (or "mHC" when ``config["mhc"]`` is true), "DenseFormer".

    ``config`` is a model config as a mapping (a trace's ``meta["config"]``, a spec's
    ``meta["config"]``, :meth:`ModelConfig.to_dict`), or None (then "hyper" is "Hyper-Connections");
    an unknown rule is returned as given.
    """
    if residual == "hyper" and isinstance(config, Mapping) and config.get("mhc"):
        return "mHC"
    if residual == "block" and isinstance(config, Mapping) and config.get("static_routing"):
        return "Block AttnRes (static routing)"
    return RULE_TITLES.get(residual, residual)


@dataclass(frozen=True)
class SourceAxis:
    """The common source axis of one model.

    Attributes:
        residual: ``"prenorm"``, ``"full"``, ``"block"``, ``"hyper"`` or ``"denseformer"``.
        n_layers: transformer blocks; L = 2 * n_layers sublayers and L+1 reads.
        block_starts: block mode only: the sublayer index where each block starts,
            ``(0, b_1, ..., b_{N-1})``, strictly increasing and below L; empty otherwise.
    """

    residual: str
    n_layers: int
    block_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual is {self.residual!r}; accepted values are {', '.join(RESIDUALS)}")
        if not isinstance(self.n_layers, int) or isinstance(self.n_layers, bool) or self.n_layers < 1:
            raise ValueError(f"n_layers must be a positive integer; got {self.n_layers!r}")
        starts = tuple(self.block_starts)
        object.__setattr__(self, "block_starts", starts)
        if self.residual != "block":
            if starts:
                raise ValueError(f"block_starts {list(starts)} given for residual {self.residual!r}; only 'block' has blocks")
            return
        L = 2 * self.n_layers
        ok = bool(starts) and starts[0] == 0 and all(isinstance(s, int) for s in starts)
        ok = ok and all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < L
        if not ok:
            raise ValueError(
                f"block_starts must be increasing sublayer indices starting at 0 and below {L}; got {list(starts)}"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> SourceAxis:
        """The axis of a :class:`~attnres_probe.ModelConfig` (or anything with ``residual``,
        ``n_layers`` and ``block_starts``)."""
        return cls(cfg.residual, int(cfg.n_layers), tuple(cfg.block_starts))

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SourceAxis:
        """The axis a trace's metadata describes (``residual``, ``block_starts`` and the
        number of layers, from ``config.n_layers`` or the read labels)."""
        n_layers = (meta.get("config") or {}).get("n_layers")
        if not isinstance(n_layers, int):
            n_layers = (len(meta["read_labels"]) - 1) // 2
        return cls(meta["residual"], n_layers, tuple(meta.get("block_starts") or ()))

    # -- sizes and labels ----------------------------------------------------------------
    @property
    def n_sublayers(self) -> int:
        """L = 2 * n_layers."""
        return 2 * self.n_layers

    @property
    def n_reads(self) -> int:
        """L + 1: one read per sublayer and the final read."""
        return self.n_sublayers + 1

    @property
    def n_blocks(self) -> int:
        """N, the number of blocks (block mode), else 0."""
        return len(self.block_starts)

    @property
    def n_sources(self) -> int:
        """Columns of the common axis: N+1 (block) or L+1."""
        return self.n_blocks + 1 if self.residual == "block" else self.n_sublayers + 1

    @property
    def sublayer_labels(self) -> list[str]:
        """``["L0.attn", "L0.mlp", "L1.attn", ...]`` (L entries)."""
        return [f"L{i}.{kind}" for i in range(self.n_layers) for kind in ("attn", "mlp")]

    @property
    def read_labels(self) -> list[str]:
        """Rows: one read per sublayer, then ``"final"`` (L+1 entries)."""
        return [*self.sublayer_labels, "final"]

    @property
    def source_labels(self) -> list[str]:
        """Columns: ``["embed", "L0.attn", ...]`` or ``["embed", "block1", ...]``."""
        if self.residual == "block":
            return ["embed", *(f"block{n}" for n in range(1, self.n_blocks + 1))]
        return ["embed", *self.sublayer_labels]

    # -- blocks --------------------------------------------------------------------------
    def _check_read(self, read: int) -> int:
        if isinstance(read, bool) or not isinstance(read, int) or not 0 <= read <= self.n_sublayers:
            raise IndexError(f"read {read!r} is out of range; this model has reads 0..{self.n_sublayers} (sublayers, then final)")
        return read

    def block_of(self, sublayer: int) -> int:
        """1-based block that ``sublayer`` writes into (block mode)."""
        if self.residual != "block":
            raise ValueError(f"a {self.residual!r} model has no blocks")
        return sum(1 for s in self.block_starts if s <= sublayer)

    def starts_block(self, sublayer: int) -> bool:
        """Whether ``sublayer`` starts a new block after a completed one (block mode; never sublayer 0)."""
        return self.residual == "block" and sublayer > 0 and sublayer in self.block_starts

    def block_reads(self, start: int) -> list[int]:
        """The reads of the block starting at sublayer ``start`` (block mode)."""
        later = [s for s in self.block_starts if s > start]
        return list(range(start, later[0] if later else self.n_sublayers))

    # -- what a read sees ----------------------------------------------------------------
    def visible(self, read: int) -> int:
        """How many sources read ``read`` sees: columns 0..k-1 of the common axis."""
        return len(self.members(read))

    @property
    def counts(self) -> list[int]:
        """:meth:`visible` for every read."""
        return [self.visible(r) for r in range(self.n_reads)]

    def partial_column(self, read: int) -> int | None:
        """The column holding the current partial block that ``read`` sees (block mode,
        a read inside a block after its first sublayer), else None."""
        self._check_read(read)
        if self.residual != "block":
            return None
        completed = sum(1 for e in self._block_ends if e <= read)
        return completed + 1 if completed < self.n_blocks and read > self.block_starts[completed] else None

    @property
    def _block_ends(self) -> list[int]:
        return [*self.block_starts[1:], self.n_sublayers]

    def members(self, read: int) -> list[tuple[str, ...]]:
        """What each source visible to ``read`` is made of, in column order.

        Each entry is the tuple of labels summed into that source: ``("embed",)`` for the
        embedding, ``("L0.attn",)`` for a Full source, the sublayers of a completed block or of
        the current partial block for Block AttnRes, and every earlier sublayer for PreNorm
        (whose single mixed input is the sum of all of them, listed as separate sources).
        """
        self._check_read(read)
        subs = self.sublayer_labels
        if self.residual != "block":
            return [("embed",), *((s,) for s in subs[:read])]
        out: list[tuple[str, ...]] = [("embed",)]
        for a, b in zip(self.block_starts, self._block_ends):
            if b <= read:
                out.append(tuple(subs[a:b]))  # completed block
            elif a < read:
                out.append(tuple(subs[a:read]))  # current partial block
        return out

    def columns(self, read: int) -> list[int]:
        """Common-axis columns of the sources visible to ``read``."""
        return list(range(self.visible(read)))

    # -- the expanded sublayer view ------------------------------------------------------
    @property
    def expanded_labels(self) -> list[str]:
        """``["embed", "L0.attn", ...]``: one column per source of the Full axis (L+1)."""
        return ["embed", *self.sublayer_labels]

    @property
    def expanded_columns(self) -> list[int]:
        """For each column of the expanded view, the common-axis column it takes its value
        from: itself for Full and PreNorm, the sublayer's block for Block (embed: 0)."""
        if self.residual != "block":
            return list(range(self.n_sublayers + 1))
        return [0, *(self.block_of(j) for j in range(self.n_sublayers))]

    def to_meta(self) -> dict[str, Any]:
        """The labels and block layout as stored in a trace's metadata."""
        return {
            "residual": self.residual,
            "read_labels": self.read_labels,
            "source_labels": self.source_labels,
            "sublayer_labels": self.sublayer_labels,
            "block_starts": list(self.block_starts),
        }
