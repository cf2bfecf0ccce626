"""One folder per op. Each holds ``reference.py`` (PyTorch) and, where there are fused kernels,
``numba.py`` and ``triton.py``, all with one signature; the folder's ``__init__.py`` is the
public op (checks, then dispatch) with its docstring.

- ``depth_attn/``: depth attention, the op of every read (reference, numba, triton);
- ``phase1/``, ``phase2/``: the two-phase Block schedule (reference, triton);
- ``rms/``: ``inv_rms``, ``rms_norm`` (reference only);
- ``mixture/``: ``weighted_sum``, ``contribution_shares`` (reference only).

The package face, :mod:`attnres_probe.kernels`, re-exports the ops; this one does not (a folder
and its op share a name).
"""
