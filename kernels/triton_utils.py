"""What the Triton kernels share: their limits, the checks of them, and the launch geometry.

The kernels of each op live beside its reference (``ops/<op>/triton.py``); the math is the
reference's (docs/design.md, "The math"). Importing this module imports Triton: the backend
selection (``backends.py``) does so to learn whether the Triton backend is available.

Limits and conventions:

- Sources may be float32, float16 or bfloat16; everything is computed in float32 inside the
  kernels. The mixture (and its gradient) comes back in the sources' dtype, lse and weights
  in float32. **float64 is rejected** with a ValueError (use ``backend="torch"``, which
  computes in float64).
- The feature width d must satisfy ``1 <= d <= MAX_D`` (8192): a row is held in one tile
  ``BLOCK_D = next_power_of_2(d)`` with masking. Wider rows raise a ValueError.
- Phase 1 holds BLOCK_Q queries per launch with ``BLOCK_Q * BLOCK_D <= 16384`` (e.g. 16
  queries at d = 1024, 4 at d = 4096); more queries are split into several launches, which
  is exact because queries are independent.
- Tensors must be on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools

import torch
import triton

from .utils import interpret_mode

__all__ = [
    "MAX_D",
    "SUPPORTED_DTYPES",
    "check_supported",
    "fp32_query",
    "grads_or",
    "warps_for",
    "persistent_programs",
    "row_tiles",
]

MAX_D = 8192
_ROW_TILE = 4096  # BLOCK_M * BLOCK_D elements per program (depth_attn, phase 2)
_MAX_BLOCK_M = 64
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_supported(what: str, device: torch.device, d: int, *tensors: torch.Tensor | None) -> None:
    """Raise a ValueError for a dtype, width or device the kernels do not handle."""
    for t in tensors:
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{what}: the Triton backend takes float32, float16 or bfloat16 tensors; got {t.dtype} "
                "(use backend='torch' for float64, which computes in float64)"
            )
    if not 1 <= d <= MAX_D:
        raise ValueError(
            f"{what}: the Triton backend handles feature width 1 <= d <= {MAX_D}; got d = {d} "
            "(use backend='torch' for wider rows)"
        )
    if device.type != "cuda" and not (device.type == "cpu" and interpret_mode()):
        raise ValueError(
            f"{what}: the Triton backend needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1; "
            f"got tensors on {device}"
        )


def row_tiles(d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps) for kernels that tile [rows, d]."""
    block_d = triton.next_power_of_2(d)
    block_m = max(1, min(_MAX_BLOCK_M, _ROW_TILE // block_d))
    return block_m, block_d, warps_for(block_m * block_d)


def warps_for(elements: int) -> int:
    return min(16, max(4, elements // 512))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, n_blocks: int) -> int:
    """Programs of a persistent backward grid: a few per SM (a handful in the interpreter)."""
    if device.type == "cuda":
        cap = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        cap = 4
    return max(1, min(n_blocks, cap))


def grads_or(placeholder: torch.Tensor, *grads: torch.Tensor | None) -> list[torch.Tensor]:
    """Optional upstream gradients for a kernel: contiguous, or a placeholder the kernel never reads."""
    return [placeholder if g is None else g.contiguous() for g in grads]


def fp32_query(query: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """query * gain in float32, contiguous: the kernels' folded query (the query alone without a gain)."""
    q = query.float()
    return (q * gain.float() if gain is not None else q).contiguous()
