"""attnres-probe: see how Attention Residuals transformers route information across depth.

Public surface (DESIGN.md): ModelConfig, AttnResTransformer, ByteTokenizer, kernels.depth_attn,
Probe, DepthTrace, metrics, load_demo, dashboards.create_app, reports.build_report.
"""

from __future__ import annotations

import importlib
from typing import Any

from attnres_probe._version import __version__

# The public names are imported on first use (PEP 562), so that `import attnres_probe` and the
# command line's --help and --version do not pay for torch and TransformerLens up front.
_LAZY = {
    "ConfigError": "attnres_probe.config",
    "ModelConfig": "attnres_probe.config",
    "AttnResTransformer": "attnres_probe.model",
    "ByteTokenizer": "attnres_probe.tokenizer",
    "CheckpointError": "attnres_probe.checkpoint",
    "DepthTrace": "attnres_probe.trace",
    "TraceError": "attnres_probe.trace",
    "Probe": "attnres_probe.probe",
    "load_demo": "attnres_probe.demo",
    "metrics": "attnres_probe.metrics",
}

__all__ = [
    "AttnResTransformer",
    "ByteTokenizer",
    "CheckpointError",
    "ConfigError",
    "DepthTrace",
    "Probe",
    "TraceError",
    "load_demo",
    "metrics",
    "ModelConfig",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnres_probe' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if module.endswith("." + name) else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
