"""RMS: :func:`inv_rms` (1 / rms per row, the depth ops' key norm, which the reference reuses
across reads through ``inv_rms_cache``) and :func:`rms_norm` (the models' RMSNorm). PyTorch
only (``reference.py``): the fused depth kernels compute the norm inside their own loops."""

from .reference import inv_rms, rms_norm

__all__ = ["inv_rms", "rms_norm"]
