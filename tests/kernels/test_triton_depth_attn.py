"""The Triton depth-attention kernels agree with the PyTorch reference.

Every test runs the same inputs and the same random upstream gradients (for the mixture, the
lse and the weights) through both backends and compares the outputs AND every gradient.

Tolerance, stated once:

- float32: an output or gradient passes when its max abs error <= 1e-5 OR its relative RMS
  error (RMS of the difference / RMS of the reference) <= 1e-5.
- bfloat16 / float16 sources: the Triton result is compared with the float32 reference run on
  the same rounded inputs and the same rounded upstream gradients. Tensors the kernel returns
  in the sources' dtype (mixture, source gradients) pass at relative RMS <= 1e-2 (bf16) or
  2e-3 (fp16), i.e. output rounding; float32 outputs (lse, weights, query and gain gradients)
  pass at relative RMS <= 1e-4.

On a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes are kept small: M = 37 rows, which no block size divides.
"""

from __future__ import annotations

import pytest
import torch

from attnres_probe.kernels import depth_attn, phase1, phase2
from attnres_probe.kernels import triton_depth_attn as tda
from closeness import _grads, _leaves, assert_close

LOWP_RRMS = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
LOWP_FP32_RRMS = 1e-4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M = 37
S_GRID = [1, 2, 3, 9, 17, 33]
D_GRID = [16, 48, 64, 384]


def _inputs(n_src, d, batch=(M,), dtype=torch.float32, gain=True):
    sources = torch.randn(n_src, *batch, d, device=DEVICE).to(dtype)
    query = torch.randn(d, device=DEVICE) / d**0.5 * 2  # logits of order one
    g = 1 + 0.2 * torch.randn(d, device=DEVICE) if gain else None
    return sources, query, g


def _shape_id(n_src, d, m=M):
    return f"M{m}-S{n_src}-D{d}"


GRID = [pytest.param(s, d, id=_shape_id(s, d)) for s in S_GRID for d in D_GRID]


# --- depth_attn ---------------------------------------------------------------------------


def _depth_attn_both(sources, query, gain, upstream_for=("mix", "lse", "weights"), batch_ref_dtype=None):
    """Run both backends with shared upstream gradients; return (triton, reference) results."""
    results = {}
    ups = None
    for backend in ("triton", "torch"):
        x, q, g = _leaves(sources, query, gain)
        if backend == "torch" and batch_ref_dtype is not None:
            x = x.detach().to(batch_ref_dtype).requires_grad_(True)
        outs = depth_attn(x, q, g, return_weights=True, backend=backend)
        if ups is None:
            ups = [torch.randn_like(o) if name in upstream_for else torch.zeros_like(o) for o, name in zip(outs, ("mix", "lse", "weights"))]
        used = [u.to(o.dtype) for u, o in zip(ups, outs)]
        results[backend] = (outs, _grads(outs, [x, q, g], used))
    return results["triton"], results["torch"]


@pytest.mark.parametrize("n_src, d", GRID)
def test_depth_attn_matches_reference_forward_and_backward(n_src, d):
    sources, query, gain = _inputs(n_src, d)
    (outs_t, grads_t), (outs_r, grads_r) = _depth_attn_both(sources, query, gain)
    for name, a, b in zip(("mix", "lse", "weights"), outs_t, outs_r):
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        assert_close(a, b, name)
    for name, a, b in zip(("d sources", "d query", "d gain"), grads_t, grads_r):
        assert_close(a, b, name)


@pytest.mark.parametrize("upstream", [("mix",), ("lse",), ("weights",)], ids=lambda u: "only-" + u[0])
def test_depth_attn_gradient_of_each_output_alone(upstream):
    sources, query, gain = _inputs(9, 48)
    (_, grads_t), (_, grads_r) = _depth_attn_both(sources, query, gain, upstream_for=upstream)
    for name, a, b in zip(("d sources", "d query", "d gain"), grads_t, grads_r):
        assert_close(a, b, name)


def test_depth_attn_without_weights_or_gain_keeps_batch_shape():
    sources, query, _ = _inputs(5, 64, batch=(2, 3, 7))
    x_t, q_t = _leaves(sources, query)
    x_r, q_r = _leaves(sources, query)
    mix_t, lse_t = depth_attn(x_t, q_t, backend="triton")
    mix_r, lse_r = depth_attn(x_r, q_r, backend="torch")
    assert mix_t.shape == (2, 3, 7, 64) and lse_t.shape == (2, 3, 7)
    assert_close(mix_t, mix_r, "mix")
    assert_close(lse_t, lse_r, "lse")
    up = torch.randn_like(mix_r)
    for name, a, b in zip(("d sources", "d query"), torch.autograd.grad(mix_t, (x_t, q_t), up), torch.autograd.grad(mix_r, (x_r, q_r), up)):
        assert_close(a, b, name)


def test_depth_attn_accepts_a_sequence_of_sources():
    sources, query, gain = _inputs(4, 48)
    mix_t, lse_t = depth_attn(list(sources.unbind(0)), query, gain, backend="triton")
    mix_r, lse_r = depth_attn(sources, query, gain, backend="torch")
    assert_close(mix_t, mix_r, "mix")
    assert_close(lse_t, lse_r, "lse")


def test_depth_attn_non_contiguous_sources():
    sources = torch.randn(48, M, 5, device=DEVICE).permute(2, 1, 0)  # [5, M, 48], strided
    query, gain = torch.randn(48, device=DEVICE) / 4, 1 + 0.2 * torch.randn(48, device=DEVICE)
    assert not sources.is_contiguous()
    (outs_t, grads_t), (outs_r, grads_r) = _depth_attn_both(sources, query, gain)
    for name, a, b in zip(("mix", "lse", "weights", "d sources", "d query", "d gain"), [*outs_t, *grads_t], [*outs_r, *grads_r]):
        assert_close(a, b, name)


def test_depth_attn_weights_are_the_ones_the_mixture_used():
    sources, query, gain = _inputs(9, 48)
    mix, lse, weights = depth_attn(sources, query, gain, return_weights=True, backend="triton")
    assert_close(weights.sum(-1), torch.ones_like(lse), "sum of weights")
    assert_close(torch.einsum("ms,smd->md", weights, sources), mix, "weights @ sources")


@pytest.mark.parametrize("d", [4096, 8192], ids=lambda d: f"M3-S3-D{d}")
def test_depth_attn_wide_rows(d):
    sources, query, gain = _inputs(3, d, batch=(3,))
    (outs_t, grads_t), (outs_r, grads_r) = _depth_attn_both(sources, query, gain)
    for name, a, b in zip(("mix", "lse", "weights", "d sources", "d query", "d gain"), [*outs_t, *grads_t], [*outs_r, *grads_r]):
        assert_close(a, b, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n_src, d", [(3, 48), (9, 384)], ids=[_shape_id(3, 48), _shape_id(9, 384)])
def test_depth_attn_low_precision_sources(dtype, n_src, d):
    sources, query, gain = _inputs(n_src, d, dtype=dtype)
    (outs_t, grads_t), (outs_r, grads_r) = _depth_attn_both(sources, query, gain, batch_ref_dtype=torch.float32)
    assert outs_t[0].dtype == dtype and grads_t[0].dtype == dtype
    assert outs_t[1].dtype == torch.float32 and outs_t[2].dtype == torch.float32
    lowp = LOWP_RRMS[dtype]
    assert_close(outs_t[0], outs_r[0], "mix", atol=0, rrms=lowp)
    assert_close(grads_t[0], grads_r[0], "d sources", atol=0, rrms=lowp)
    for name, a, b in (("lse", outs_t[1], outs_r[1]), ("weights", outs_t[2], outs_r[2]), ("d query", grads_t[1], grads_r[1]), ("d gain", grads_t[2], grads_r[2])):
        assert_close(a, b, name, atol=0, rrms=LOWP_FP32_RRMS)


# --- phase 1 ------------------------------------------------------------------------------


def _phase1_both(sources, queries, ref_dtype=None):
    results = {}
    ups = None
    for backend in ("triton", "torch"):
        x, q = _leaves(sources, queries)
        if backend == "torch" and ref_dtype is not None:
            x = x.detach().to(ref_dtype).requires_grad_(True)
        outs = phase1(x, q, return_weights=True, backend=backend)
        if ups is None:
            ups = [torch.randn_like(o) for o in outs]
        results[backend] = (outs, _grads(outs, [x, q], [u.to(o.dtype) for u, o in zip(ups, outs)]))
    return results["triton"], results["torch"]


PHASE1_GRID = [
    pytest.param(s, d, n_q, id=f"{_shape_id(s, d)}-Q{n_q}")
    for s, d, n_q in [(1, 48, 5), (2, 16, 1), (3, 384, 5), (9, 48, 5), (9, 384, 3), (17, 64, 4)]
]


@pytest.mark.parametrize("n_src, d, n_q", PHASE1_GRID)
def test_phase1_matches_reference_forward_and_backward(n_src, d, n_q):
    sources = torch.randn(n_src, M, d, device=DEVICE)
    queries = torch.randn(n_q, d, device=DEVICE) / d**0.5 * 2
    (outs_t, grads_t), (outs_r, grads_r) = _phase1_both(sources, queries)
    for name, a, b in zip(("o_bar", "lse", "weights", "d sources", "d queries"), [*outs_t, *grads_t], [*outs_r, *grads_r]):
        assert_close(a, b, name)


def test_phase1_splits_many_queries_into_launches(monkeypatch):
    monkeypatch.setattr(tda, "_PHASE1_TILE", 128)  # two queries per launch at d = 48
    assert tda.phase1_max_queries(48) == 2
    sources = torch.randn(3, 2, 5, 48, device=DEVICE)  # batch (2, 5)
    queries = torch.randn(5, 48, device=DEVICE) / 4
    (outs_t, grads_t), (outs_r, grads_r) = _phase1_both(sources, queries)
    assert outs_t[0].shape == (5, 2, 5, 48) and outs_t[2].shape == (5, 2, 5, 3)
    for name, a, b in zip(("o_bar", "lse", "weights", "d sources", "d queries"), [*outs_t, *grads_t], [*outs_r, *grads_r]):
        assert_close(a, b, name)


def test_phase1_bf16_sources():
    sources = torch.randn(5, M, 64, device=DEVICE).bfloat16()
    queries = torch.randn(4, 64, device=DEVICE) / 4
    (outs_t, grads_t), (outs_r, grads_r) = _phase1_both(sources, queries, ref_dtype=torch.float32)
    assert outs_t[0].dtype == torch.bfloat16 and grads_t[0].dtype == torch.bfloat16
    assert_close(outs_t[0], outs_r[0], "o_bar", atol=0, rrms=LOWP_RRMS[torch.bfloat16])
    assert_close(grads_t[0], grads_r[0], "d sources", atol=0, rrms=LOWP_RRMS[torch.bfloat16])
    for name, a, b in zip(("lse", "weights"), outs_t[1:], outs_r[1:]):
        assert_close(a, b, name, atol=0, rrms=LOWP_FP32_RRMS)
    assert_close(grads_t[1], grads_r[1], "d queries", atol=0, rrms=LOWP_FP32_RRMS)


# --- phase 2 ------------------------------------------------------------------------------


def _phase2_both(o_bar, lse, partial, query, gain, ref_dtype=None):
    results = {}
    ups = None
    for backend in ("triton", "torch"):
        ob, l, p, q, g = _leaves(o_bar, lse, partial, query, gain)
        if backend == "torch" and ref_dtype is not None:
            ob = ob.detach().to(ref_dtype).requires_grad_(True)
            p = p.detach().to(ref_dtype).requires_grad_(True)
        outs = phase2(ob, l, p, q, g, backend=backend)
        if ups is None:
            ups = [torch.randn_like(o) for o in outs]
        results[backend] = (outs, _grads(outs, [ob, l, p, q, g], [u.to(o.dtype) for u, o in zip(ups, outs)]))
    return results["triton"], results["torch"]


@pytest.mark.parametrize("d", D_GRID, ids=lambda d: f"M{M}-D{d}")
def test_phase2_matches_reference_forward_and_backward(d):
    o_bar, partial = torch.randn(2, M, d, device=DEVICE).unbind(0)
    lse = torch.randn(M, device=DEVICE)
    query = torch.randn(d, device=DEVICE) / d**0.5 * 2
    gain = 1 + 0.2 * torch.randn(d, device=DEVICE)
    (outs_t, grads_t), (outs_r, grads_r) = _phase2_both(o_bar, lse, partial, query, gain)
    names = ("h", "lse_total", "s", "d o_bar", "d lse", "d partial", "d query", "d gain")
    for name, a, b in zip(names, [*outs_t, *grads_t], [*outs_r, *grads_r]):
        assert_close(a, b, name)


def test_phase2_bf16_activations():
    o_bar, partial = torch.randn(2, M, 64, device=DEVICE).bfloat16().unbind(0)
    lse = torch.randn(M, device=DEVICE)
    query, gain = torch.randn(64, device=DEVICE) / 4, 1 + 0.2 * torch.randn(64, device=DEVICE)
    (outs_t, grads_t), (outs_r, grads_r) = _phase2_both(o_bar, lse, partial, query, gain, ref_dtype=torch.float32)
    lowp = LOWP_RRMS[torch.bfloat16]
    for name, a, b, tol in zip(
        ("h", "lse_total", "s", "d o_bar", "d lse", "d partial", "d query", "d gain"),
        [*outs_t, *grads_t],
        [*outs_r, *grads_r],
        (lowp, LOWP_FP32_RRMS, LOWP_FP32_RRMS, lowp, LOWP_FP32_RRMS, lowp, LOWP_FP32_RRMS, LOWP_FP32_RRMS),
    ):
        assert_close(a, b, name, atol=0, rrms=tol)


def test_phase1_then_phase2_equals_depth_attn_over_all_sources():
    sources, query, gain = _inputs(6, 48)
    completed, partial = sources[:5], sources[5]
    o_bar, lse = phase1(completed, (query * gain)[None], backend="triton")
    h, lse_total, s = phase2(o_bar[0], lse[0], partial, query, gain, backend="triton")
    mix, lse_all, weights = depth_attn(sources, query, gain, return_weights=True, backend="torch")
    assert_close(h, mix, "h")
    assert_close(lse_total, lse_all, "lse_total")
    assert_close(s, weights[..., -1], "s")


def test_second_order_gradients_match_the_reference():
    """Under ``create_graph=True`` the Triton ops' backward builds its gradients from the
    reference ops, so a gradient of a gradient (of |dL/dinputs|^2, L a random weighting of
    every output) equals the reference's, for depth_attn, phase 1 and phase 2 (float32, the
    stated tolerance)."""
    sources, query, gain = _inputs(3, 16)
    o_bar, lse = torch.randn(M, 16, device=DEVICE), torch.randn(M, device=DEVICE)
    ops = {
        "depth_attn": (lambda b, x, q, g: depth_attn(x, q, g, return_weights=True, backend=b), (sources, query, gain)),
        "phase1": (lambda b, x, q: phase1(x, q, return_weights=True, backend=b), (sources, torch.stack([query, -query]))),
        "phase2": (lambda b, ob, l, p, q, g: phase2(ob, l, p, q, g, backend=b), (o_bar, lse, sources[0], query, gain)),
    }
    for name, (op, args) in ops.items():
        results, ups = {}, None
        for backend in ("triton", "torch"):
            leaves = _leaves(*args)
            outs = op(backend, *leaves)
            ups = ups or [torch.randn_like(o) for o in outs]
            first = torch.autograd.grad(outs, leaves, ups, create_graph=True)
            results[backend] = torch.autograd.grad(sum(g.pow(2).sum() for g in first), leaves, allow_unused=True)
        for i, (a, b) in enumerate(zip(results["triton"], results["torch"])):
            assert (a is None) == (b is None), f"{name}: input {i}"
            if a is not None:
                assert_close(a, b, f"{name}: d input {i}")
