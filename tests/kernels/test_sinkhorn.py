"""The Numba Sinkhorn kernel (kernels/ops/sinkhorn/numba.py) against the PyTorch reference.

Bounds (computed before the run, from float64 inputs):

- Each of the 2 iters normalisations perturbs every entry by a relative error at most
  gamma_{n+1}(eps) (a sum of n terms and a division); exp adds at most 2 eps. Normalisations do
  not expand Hilbert's projective metric and the last one turns a projective error delta into a
  relative entry error at most e^{2 delta} - 1, so one float64 implementation is within
  K/2 |P| of the exact P, K = 2 (2 iters gamma_{n+1} + 2 eps) to first order; two
  implementations within K |P|.
- The backward through Y = X / s is dX = (dY - <dY, Y>) / s per row or column: G = 2 (2 iters + 1)
  (n + 2) roundings on the longest path, each a relative eps of what flows through it, and the
  iterates' own errors (K). With mag = |J|^T |dP| (J the float64 Jacobian of the reference, per
  token: the gradient's condition entry by entry, as closeness.py's kappa), two float64
  implementations differ by at most C (G eps + K) mag, C = 8 as in closeness.py.
- float32 inputs: the kernel computes in float64 from the exactly representable float32 values
  and rounds once, so its float32 outputs and gradients equal its float64 ones rounded to
  float32, bit for bit (checked exactly, no tolerance).
"""

from __future__ import annotations

import pytest
import torch

from attnres_probe import kernels
from attnres_probe.kernels.ops.sinkhorn.reference import sinkhorn as reference

from closeness import assert_bounded

EPS = 2.0**-53


def gamma(k: int, u: float = EPS) -> float:
    return k * u / (1 - k * u)


def forward_k(n: int, iters: int) -> float:
    return 2 * (2 * iters * gamma(n + 1) + 2 * EPS)


def magnitudes(logits: torch.Tensor, dP: torch.Tensor, iters: int) -> torch.Tensor:
    """|J|^T |dP| per token: J the float64 Jacobian of the reference's P w.r.t. its logits (the
    gradient's condition, as closeness.py's kappa, entry by entry)."""
    n = logits.shape[-1]
    flat = logits.reshape(-1, n * n)
    J = torch.autograd.functional.jacobian(lambda x: reference(x.view(-1, n, n), iters).reshape(-1, n * n), flat,
                                           vectorize=True)  # [T, nn, T, nn]
    T = flat.shape[0]
    Jt = J[torch.arange(T), :, torch.arange(T), :]  # each token's own [nn (out), nn (in)] block
    return torch.einsum("toi,to->ti", Jt.abs(), dP.reshape(T, n * n).abs()).view(logits.shape)


def cases():
    g = torch.Generator().manual_seed(5)
    for n, iters, scale in ((2, 20, 1.0), (4, 20, 1.0), (4, 20, 4.0), (4, 3, 1.0), (3, 7, 2.0), (8, 20, 1.0)):
        yield n, iters, scale * torch.randn(2, 3, n, n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("n, iters, logits", list(cases()), ids=lambda v: None if isinstance(v, torch.Tensor) else str(v))
def test_numba_matches_the_reference_in_value_and_gradient(n, iters, logits):
    g = torch.Generator().manual_seed(n * 100 + iters)
    dP = torch.randn(logits.shape, generator=g, dtype=torch.float64)
    results = {}
    for backend in ("numba", "torch"):
        L = logits.clone().requires_grad_()
        P = kernels.sinkhorn(L, iters, backend=backend)
        (P * dP).sum().backward()
        results[backend] = (P.detach(), L.grad)
    (P, dL), (P_ref, dL_ref) = results["numba"], results["torch"]
    K = forward_k(n, iters)
    fwd = ((P - P_ref).abs() / (K * P_ref.abs())).max().item()
    assert_bounded(fwd, 1.0, f"sinkhorn n={n} iters={iters}: value / bound")
    mag = magnitudes(logits, dP, iters)
    G = 2 * (2 * iters + 1) * (n + 2)
    bound = 8 * (G * EPS + K) * mag
    grad = ((dL - dL_ref).abs() / bound).max().item()
    assert_bounded(grad, 1.0, f"sinkhorn n={n} iters={iters}: gradient / bound")
    # the bound is tight enough to see a wrong gradient: an error of 1e-9 of the gradient's scale breaks it
    assert (1e-9 * dL_ref.abs().max() / bound).max() > 1
    # the result is doubly stochastic: columns to rounding
    assert ((P.sum(-2) - 1).abs() <= gamma(2 * n + 2)).all()


def test_float32_is_the_float64_result_rounded_once():
    g = torch.Generator().manual_seed(9)
    L32 = (2 * torch.randn(7, 4, 4, generator=g)).requires_grad_()
    dP32 = torch.randn(7, 4, 4, generator=g)
    P32 = kernels.sinkhorn(L32, 20, backend="numba")
    (P32 * dP32).sum().backward()
    L64 = L32.detach().double().requires_grad_()
    P64 = kernels.sinkhorn(L64, 20, backend="numba")
    (P64 * dP32.double()).sum().backward()
    assert P32.dtype == torch.float32 and L32.grad.dtype == torch.float32
    assert torch.equal(P32, P64.float()) and torch.equal(L32.grad, L64.grad.float())
    # and a float32 reference is not that: the test would see a kernel computing in float32
    assert not torch.equal(reference(L32.detach(), 20), P32)


def test_row_maximum_and_clamped_sums_behave_as_the_reference():
    # a row far below the others: its exp underflows only after the max is subtracted per row
    L = torch.tensor([[[0.0, -800.0], [5.0, 4.0]]], dtype=torch.float64, requires_grad=True)
    P = kernels.sinkhorn(L, 20, backend="numba")
    P_ref = reference(L.detach(), 20)
    assert torch.isfinite(P).all() and torch.allclose(P, P_ref, rtol=0, atol=4 * 20 * gamma(3))
    P.sum().backward()
    assert torch.isfinite(L.grad).all()


def test_empty_batches_and_bad_arguments():
    out = kernels.sinkhorn(torch.zeros(0, 3, 3), 5, backend="numba")
    assert out.shape == (0, 3, 3)
    with pytest.raises(ValueError, match=r"\[\.\.\., n, n\]"):
        kernels.sinkhorn(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="iters must be a positive integer"):
        kernels.sinkhorn(torch.zeros(3, 3), 0)
    with pytest.raises(ValueError, match="floating point"):
        kernels.sinkhorn(torch.zeros(3, 3, dtype=torch.int64), 2)


def test_auto_picks_numba_for_cpu_floats_and_the_reference_for_half(monkeypatch):
    monkeypatch.delenv("ATTNRES_BACKEND", raising=False)
    L = torch.randn(4, 3, 3, requires_grad=True)
    P = kernels.sinkhorn(L, 4)
    assert type(P.grad_fn).__name__.startswith("SinkhornNumbaFunction")
    P16 = kernels.sinkhorn(L.detach().bfloat16(), 4)
    assert P16.dtype == torch.bfloat16
