"""Hook-point names, the recorder that attaches to them, and adapters for other models."""

from attnres_probe.hooks.names import mixed_input_hook_names, output_hook_names
from attnres_probe.hooks.recorder import Recorder, RecorderError
from attnres_probe.hooks.spec import MissingHooksError, ModelSpec, spec_for

__all__ = [
    "MissingHooksError",
    "ModelSpec",
    "Recorder",
    "RecorderError",
    "mixed_input_hook_names",
    "output_hook_names",
    "spec_for",
]
