"""Residual rules as objects: what the rest of the toolkit asks a rule instead of testing its name.

A rule built here is one file of this package (its reads, its forward over the sources, its
effective-coefficient bookkeeping) and one :class:`RuleInfo` in :data:`RULES` (its name, title,
settings, whether its routing is fixed, whether its recorded weights are coefficients, whether the
AttnRes paper's directions apply, and the native weights it keeps beside the common axis). This
module holds the descriptions only and imports nothing of the model, so that the axis and the pages
can read them; :func:`implementation` imports a rule's file when a model is built.

Rules so far: ``cumulative`` (AttnRes over cumulative residual states, the Qwen3-AttnRes family:
:mod:`attnres_probe.rules.cumulative`). PreNorm, Full and Block AttnRes (with its static-routing
variant, ``static_routing``), Hyper-Connections and DenseFormer are still forwards of
:mod:`attnres_probe.model` (issue #48 moves them here).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["RULES", "RuleInfo", "implementation", "rule_info"]


@dataclass(frozen=True)
class RuleInfo:
    """A residual rule as the pages, the axis and the recorder see it.

    Attributes:
        name: the ``residual`` value of a config.
        title: how pages name a model of this rule.
        module: its file in this package (``implementation`` imports it).
        coefficients: its recorded weights are coefficients c of h = sum_j c_j v_j that need not sum to
            one (pages show c / sum c, and shares come from the sources' Gram matrix).
        block_axis: its sources are Block AttnRes's blocks (else the Full axis, one column per sublayer).
        paper_directions: the AttnRes paper's expected directions apply to its routing (verdicts).
        options: defaults of ``ModelConfig.rule_options``.
        native: the family's own weights kept beside the common axis (name -> what it is), recorded
            from each read's ``hook_native_<name>``.
        fixed: whether its weights are the same for every input, given a config mapping.
        settings: its settings in words for a models table, given a config mapping.
        check: a one-line problem with ``rule_options`` (given the number of layers), or None.
    """

    name: str
    title: str
    module: str
    coefficients: bool
    block_axis: bool = False
    paper_directions: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    native: Mapping[str, str] = field(default_factory=dict)
    fixed: Callable[[Mapping[str, Any]], bool] = lambda config: False
    settings: Callable[[Mapping[str, Any]], str] = lambda config: ""
    check: Callable[[Mapping[str, Any], int], str | None] = lambda options, n_layers: None


def _options(config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    opts = (config or {}).get("rule_options") if isinstance(config, Mapping) else None
    return opts if isinstance(opts, Mapping) else {}


def _cumulative_check(options: Mapping[str, Any], n_layers: int) -> str | None:
    unknown = sorted(set(options) - {"mode", "layers_per_block", "gate"})
    if unknown:
        return f"rule_options has unknown key(s) {unknown}; the cumulative rule takes mode, layers_per_block, gate"
    if options.get("mode") not in ("full", "block"):
        return f"rule_options mode is {options.get('mode')!r}; accepted values are full, block"
    if options.get("gate") not in ("bias", "sigmoid_scalar", "learnable_alpha"):
        return f"rule_options gate is {options.get('gate')!r}; accepted values are bias, sigmoid_scalar, learnable_alpha"
    per = options.get("layers_per_block")
    if not isinstance(per, int) or isinstance(per, bool) or not 1 <= per <= n_layers:
        return f"rule_options layers_per_block must be an integer in 1..{n_layers} (layers between kept states); got {per!r}"
    return None


def _cumulative_settings(config: Mapping[str, Any]) -> str:
    o = _options(config)
    mode = o.get("mode")
    where = "every cumulative state" if mode == "full" else f"a state every {o.get('layers_per_block')} layers"
    return f"{where}, recency bias, gate {o.get('gate')}" if mode else ""


RULES: dict[str, RuleInfo] = {
    "cumulative": RuleInfo(
        name="cumulative",
        title="AttnRes over cumulative states",
        module="cumulative",
        coefficients=True,
        paper_directions=False,
        options={"mode": "block", "layers_per_block": 1, "gate": "bias"},
        native={
            "weights": "softmax over the read's own sources, the cumulative states P_k (the last is the running sum)",
            "logits": "the read's scores over those sources (recency bias included)",
        },
        settings=_cumulative_settings,
        check=_cumulative_check,
    ),
}


def rule_info(name: str) -> RuleInfo | None:
    """The :class:`RuleInfo` of a rule built by a file of this package, or None."""
    return RULES.get(name)


def implementation(name: str) -> ModuleType | None:
    """The file of rule ``name`` (its ``make_read``, ``make_final``, ``forward``), or None for the rules
    :mod:`attnres_probe.model` still runs itself."""
    info = RULES.get(name)
    return None if info is None else importlib.import_module(f"attnres_probe.rules.{info.module}")
