"""The reference's gradients, edge cases in both backends, and the backend dispatch rules."""

from __future__ import annotations

import pytest
import torch

from attnres_probe.kernels import depth_attn, depth_attn_reference, phase1, phase2, resolve_backend
from attnres_probe.kernels import triton_utils as tda
from attnres_probe.kernels.ops.phase1.reference import phase1 as phase1_reference
from attnres_probe.kernels.ops.phase2.reference import phase2 as phase2_reference
from attnres_probe.kernels.utils import interpret_mode

from closeness import UNIT_ROUNDOFF, C

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton", "numba"]


# --- gradcheck of the reference in float64 ------------------------------------------------


@pytest.mark.parametrize("n_src", [1, 3])
def test_reference_gradcheck_sources_query_gain(n_src):
    x = torch.randn(n_src, 2, 3, 5, dtype=torch.float64, requires_grad=True)
    q = torch.randn(5, dtype=torch.float64, requires_grad=True)
    g = (1 + 0.3 * torch.randn(5, dtype=torch.float64)).requires_grad_()
    fn = lambda x, q, g: depth_attn_reference(x, q, g, 1e-6, True, return_logits=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, q, g))


def test_reference_gradcheck_phase1():
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    qs = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, qs: phase1_reference(x, qs, 1e-6, True), (x, qs))


def test_reference_gradcheck_phase2():
    ob, p = (torch.randn(4, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    lse = torch.randn(4, dtype=torch.float64, requires_grad=True)
    q = torch.randn(5, dtype=torch.float64, requires_grad=True)
    g = (1 + 0.3 * torch.randn(5, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: phase2_reference(*a, 1e-6), (ob, lse, p, q, g))


# --- extreme logits and NaN, both backends -------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_logits_stay_finite(backend):
    x = torch.randn(9, 37, 48, device=DEVICE, requires_grad=True)
    q = torch.randn(48, device=DEVICE)
    q = (q / q.norm() * 1e4).requires_grad_()
    mix, lse, w, z = depth_attn(x, q, return_weights=True, return_logits=True, backend=backend)
    for name, t in (("mix", mix), ("lse", lse), ("weights", w), ("logits", z)):
        assert torch.isfinite(t).all(), f"{name} is not finite"
    # each weight rounds once and the sum of S of them S times: C u S
    assert (w.sum(-1) - 1).abs().max().item() <= C * UNIT_ROUNDOFF[torch.float32] * w.shape[-1]
    assert (w == 0).any() and z.abs().max() > 1e3  # underflowed weights, yet finite logits
    ups = [torch.randn_like(t) for t in (mix, lse, w, z)]
    grads = torch.autograd.grad((mix, lse, w, z), (x, q), ups)
    for name, t in zip(("d sources", "d query"), grads):
        assert torch.isfinite(t).all(), f"{name} is not finite"


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_logits_stay_finite_in_the_two_phases(backend):
    x = torch.randn(5, 37, 48, device=DEVICE)
    q = torch.randn(3, 48, device=DEVICE)
    q = q / q.norm(dim=-1, keepdim=True) * 1e4
    o_bar, lse = phase1(x, q, backend=backend)
    h, lse_t, z_p = phase2(o_bar[0], lse[0], torch.randn(37, 48, device=DEVICE), q[0], backend=backend)
    for name, t in (("o_bar", o_bar), ("lse", lse), ("h", h), ("lse_total", lse_t), ("z_p", z_p)):
        assert torch.isfinite(t).all(), f"{name} is not finite"


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_source_propagates_to_that_row_only(backend):
    x = torch.randn(5, 37, 48, device=DEVICE)
    x[2, 11, 7] = float("nan")
    q = torch.randn(48, device=DEVICE) / 7
    mix, lse, w = depth_attn(x, q, return_weights=True, backend=backend)
    assert torch.isnan(mix[11]).all() and torch.isnan(lse[11]) and torch.isnan(w[11]).any()
    others = torch.arange(37, device=DEVICE) != 11
    assert torch.isfinite(mix[others]).all() and torch.isfinite(lse[others]).all() and torch.isfinite(w[others]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_propagates_through_the_two_phases(backend):
    x = torch.randn(3, 37, 48, device=DEVICE)
    x[0, 4, 0] = float("nan")
    partial = torch.randn(37, 48, device=DEVICE)
    partial[20, 3] = float("nan")
    q = torch.randn(2, 48, device=DEVICE) / 7
    o_bar, lse = phase1(x, q, backend=backend)
    assert torch.isnan(o_bar[:, 4]).all() and torch.isnan(lse[:, 4]).all()
    h, lse_t, z_p = phase2(o_bar[0], lse[0], partial, q[0], backend=backend)
    for row in (4, 20):
        assert torch.isnan(h[row]).all() and torch.isnan(lse_t[row])
    assert torch.isnan(z_p[20]) and not torch.isnan(z_p[4])  # the partial's logit is the partial's alone
    assert torch.isfinite(h[5]).all() and torch.isfinite(lse_t[5])


# --- dispatch -----------------------------------------------------------------------------


def test_auto_picks_numba_on_cpu_and_the_reference_for_what_numba_refuses(monkeypatch):
    monkeypatch.delenv("ATTNRES_BACKEND", raising=False)
    assert resolve_backend("cpu") == "numba"
    assert resolve_backend("cpu", "auto", dtypes=(torch.float32, torch.float64)) == "numba"
    assert resolve_backend("cpu", "auto", dtypes=(torch.bfloat16,)) == "torch"
    assert resolve_backend("cpu", "auto", dtypes=(torch.float32, torch.float16)) == "torch"


def test_auto_falls_back_to_the_reference_without_numba(monkeypatch):
    import attnres_probe.kernels.backends as k

    monkeypatch.delenv("ATTNRES_BACKEND", raising=False)
    monkeypatch.setattr(k, "_numba_import_error", lambda: "ModuleNotFoundError: No module named 'numba'")
    assert resolve_backend("cpu") == "torch"
    with pytest.raises(ValueError, match="numba backend, but it cannot be imported.*No module named 'numba'"):
        resolve_backend("cpu", "numba")


def test_forced_numba_needs_cpu_tensors():
    with pytest.raises(ValueError, match="numba backend, which runs on CPU tensors; the tensors are on cuda"):
        resolve_backend("cuda", "numba")


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("cpu", "triton")
    monkeypatch.setenv("ATTNRES_BACKEND", "triton")
    with pytest.raises(ValueError, match="ATTNRES_BACKEND.*TRITON_INTERPRET"):
        resolve_backend("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("cpu") == "triton"


def test_environment_variable_selects_the_backend(monkeypatch):
    monkeypatch.setenv("ATTNRES_BACKEND", "torch")
    assert resolve_backend("cpu") == "torch"
    assert resolve_backend("cpu", "auto") == "numba"  # the argument wins over the variable
    monkeypatch.setenv("ATTNRES_BACKEND", "numba")
    assert resolve_backend("cpu") == "numba"


@pytest.mark.parametrize("name", ["cuda", "Triton", "pytorch", ""])
def test_bad_backend_names_raise(name):
    with pytest.raises(ValueError, match="accepted values are auto, torch, triton, numba"):
        resolve_backend("cpu", name)


def test_bad_backend_name_in_the_environment_raises(monkeypatch):
    monkeypatch.setenv("ATTNRES_BACKEND", "fast")
    with pytest.raises(ValueError, match="ATTNRES_BACKEND is 'fast'"):
        resolve_backend("cpu")


# --- what the Triton backend refuses ------------------------------------------------------


@pytest.mark.skipif(not interpret_mode() and DEVICE == "cpu", reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_rejects_float64_with_a_clear_error():
    x = torch.randn(2, 3, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="float64.*backend='torch'"):
        depth_attn(x, torch.randn(8, dtype=torch.float64, device=DEVICE), backend="triton")


@pytest.mark.skipif(not interpret_mode() and DEVICE == "cpu", reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_rejects_rows_wider_than_its_limit():
    d = tda.MAX_D + 1
    with pytest.raises(ValueError, match=f"d <= {tda.MAX_D}; got d = {d}"):
        depth_attn(torch.randn(2, 1, d, device=DEVICE), torch.randn(d, device=DEVICE), backend="triton")


def test_auto_on_cuda_sends_what_triton_cannot_take_to_the_reference(monkeypatch):
    monkeypatch.delenv("ATTNRES_BACKEND", raising=False)
    assert resolve_backend("cuda", "auto", dtypes=(torch.bfloat16, torch.float32), d=2048) == "triton"
    assert resolve_backend("cuda", "auto", dtypes=(torch.float32, torch.float64), d=64) == "torch"
    assert resolve_backend("cuda", "auto", dtypes=(torch.float32,), d=tda.MAX_D + 1) == "torch"
