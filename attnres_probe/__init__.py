"""attnres-probe: see how Attention Residuals transformers route information across depth.

Public surface (DESIGN.md): ModelConfig, AttnResTransformer, ByteTokenizer, kernels.depth_attn,
Probe, DepthTrace, metrics, load_demo, dashboards.create_app, reports.build_report.
"""

from __future__ import annotations

from attnres_probe._version import __version__
from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.model import AttnResTransformer
from attnres_probe.tokenizer import ByteTokenizer
from attnres_probe.checkpoint import CheckpointError
from attnres_probe.trace import DepthTrace, TraceError
from attnres_probe.probe import Probe
from attnres_probe.demo import load_demo
from attnres_probe import metrics

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
