"""Depth-attention ops, their backends and the dispatch between them.

This folder (``kernels/`` at the repository root) is imported as ``attnres_probe.kernels``,
through the folder map of setup.py (never as a top-level ``kernels``: see
``attnres_probe/_shadow.py``). It imports nothing from the rest of
``attnres_probe``.

Ops (``ops/<op>/``; the public function checks its arguments, then dispatches):

- :func:`depth_attn`: a softmax over depth sources scored by one pseudo-query (every read);
- :func:`phase1` / :func:`phase2`: the two-phase Block AttnRes schedule;
- :func:`sinkhorn`: mHC's projection of its residual mixing towards the doubly stochastic
  matrices (a Numba kernel with its own backward; the reference elsewhere);
- :func:`inv_rms`, :func:`rms_norm`, :func:`weighted_sum`, :func:`contribution_shares`:
  small ops in PyTorch only (no dispatch).

Backends (``backends.py``, chosen per call by :func:`resolve_backend`: the ``backend=``
argument, else ``ATTNRES_BACKEND``, else ``auto``):

- ``"torch"``: the plain-PyTorch reference, ``ops/<op>/reference.py`` (every device and dtype;
  the test oracle);
- ``"numba"``: fused CPU kernels, ``ops/depth_attn/numba.py`` (float32/float64 CPU tensors;
  ``phase1``/``phase2`` run the reference there);
- ``"triton"``: fused kernels, ``ops/<op>/triton.py`` (CUDA tensors, or CPU tensors under
  ``TRITON_INTERPRET=1``).

``dispatch.py`` holds the table op -> backend -> implementation (:data:`TABLE`, and
:func:`implementation` for a caller that resolved the backend once); ``utils.py`` and
``triton_utils.py`` what the implementations share.
"""

if not __name__.startswith("attnres_probe."):  # imported from the repository root under its bare name
    import runpy as _runpy
    from pathlib import Path as _Path

    _runpy.run_path(str(_Path(__file__).resolve().parents[1] / "attnres_probe" / "_shadow.py"))["hand_over"](__name__, __file__)
else:
    from .backends import BACKENDS, Backend, numba_available, requested_backend, resolve_backend, triton_available
    from .dispatch import TABLE, implementation
    from .ops.depth_attn import depth_attn
    from .ops.depth_attn.reference import depth_attn as depth_attn_reference
    from .ops.mixture import contribution_shares, weighted_sum
    from .ops.phase1 import phase1
    from .ops.phase2 import phase2
    from .ops.rms import inv_rms, rms_norm
    from .ops.sinkhorn import sinkhorn
    from .utils import Sources, compute_dtype

    __all__ = [
        "BACKENDS",
        "Backend",
        "Sources",
        "TABLE",
        "compute_dtype",
        "contribution_shares",
        "depth_attn",
        "depth_attn_reference",
        "implementation",
        "inv_rms",
        "numba_available",
        "phase1",
        "phase2",
        "requested_backend",
        "resolve_backend",
        "rms_norm",
        "sinkhorn",
        "triton_available",
        "weighted_sum",
    ]
