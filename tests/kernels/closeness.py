"""Closeness checks shared by the kernel tests (tolerances are stated in each test module)."""

from __future__ import annotations

import torch

FP32_ATOL = 1e-5
FP32_RRMS = 1e-5


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    diff = a - e
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    rrms = (diff.pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30)).item() if diff.numel() else 0.0
    return max_abs, rrms


def assert_close(actual, expected, name, atol=FP32_ATOL, rrms=FP32_RRMS):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    max_abs, rel = _errors(actual, expected)
    assert max_abs <= atol or rel <= rrms, f"{name}: max abs error {max_abs:.3g} (limit {atol:g}), relative RMS {rel:.3g} (limit {rrms:g})"


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _grads(outs, inputs, upstream):
    wanted = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(outs, wanted, upstream)
    return list(grads)
