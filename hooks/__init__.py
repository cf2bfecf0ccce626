"""Hook-point names, the recorder that attaches to them, and adapters for other models."""

if not __name__.startswith("attnres_probe."):  # imported from the repository root under its bare name
    import runpy as _runpy
    from pathlib import Path as _Path

    _runpy.run_path(str(_Path(__file__).resolve().parents[1] / "attnres_probe" / "_shadow.py"))["hand_over"](__name__, __file__)
else:
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
