"""attnres-probe: see how Attention Residuals transformers route information across depth.

Public surface: ModelConfig, AttnResTransformer, ByteTokenizer, kernels.depth_attn,
Probe, DepthTrace, metrics, load_demo, load_pretrained and watch (models from elsewhere),
dashboards.create_app, reports.build_report.
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
    "load_pretrained": "attnres_probe.pretrained",
    "PretrainedError": "attnres_probe.pretrained",
    "watch": "attnres_probe.watch",
}
# names that hand out traces: getting one imports attnres_probe.figures too, which binds the
# trace's figure methods (trace.heatmap(...), the Jupyter card); trace.py never imports figures
_WITH_FIGURES = {"DepthTrace", "Probe", "watch"}

__all__ = [
    "AttnResTransformer",
    "ByteTokenizer",
    "CheckpointError",
    "ConfigError",
    "DepthTrace",
    "Probe",
    "TraceError",
    "load_demo",
    "load_pretrained",
    "metrics",
    "PretrainedError",
    "watch",
    "ModelConfig",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnres_probe' has no attribute {name!r}")
    mod = importlib.import_module(module)
    if name in _WITH_FIGURES:
        importlib.import_module("attnres_probe.figures")
    value = getattr(mod, name) if hasattr(mod, name) else mod  # a module named like its function gives the function
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
