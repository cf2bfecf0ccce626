"""The Triton depth-attention kernels agree with the float64 reference.

Every test runs the same inputs and the same random upstream gradients (for the mixture, the
lse, the weights and the logits) and checks the outputs AND every gradient against the float64
reference within the bound ``C u G kappa`` derived once in ``closeness.py`` (the float32
reference must meet it too). Sources stored in bfloat16/float16 are compared on the same
rounded inputs; an output the kernel returns in that dtype (mixture, source gradients) may
add its own rounding, ``C u_storage``.

On a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes are kept small: M = 37 rows, which no block size divides.
"""

from __future__ import annotations

import pytest
import torch

from attnres_probe.kernels import depth_attn, phase1, phase2
from attnres_probe.kernels.ops.phase1 import triton as tda

from closeness import (
    OUTPUTS,
    UNIT_ROUNDOFF,
    C,
    assert_within,
    check_fn,
    check_op,
    check_outputs_consistent,
    conditions,
    growth,
    tolerance,
    upstream_for,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M = 37
S_GRID = [1, 2, 3, 9, 17, 33]
D_GRID = [16, 48, 64, 384]


def _inputs(n_src, d, batch=(M,), dtype=torch.float32, gain=True, logit_scale=2.0):
    sources = torch.randn(n_src, *batch, d, device=DEVICE).to(dtype)
    query = torch.randn(d, device=DEVICE) / d**0.5 * logit_scale  # logits of order logit_scale
    g = 1 + 0.2 * torch.randn(d, device=DEVICE) if gain else None
    return sources, query, g


def _shape_id(n_src, d, m=M):
    return f"M{m}-S{n_src}-D{d}"


GRID = [pytest.param(s, d, id=_shape_id(s, d)) for s in S_GRID for d in D_GRID]


# --- depth_attn ---------------------------------------------------------------------------


def _op(backend, as_list=False):
    def op(x, q, g):
        arg = list(x.unbind(0)) if as_list else x
        return depth_attn(arg, q, g, return_weights=True, return_logits=True, backend=backend)

    return op


def _check(sources, query, gain, wanted=OUTPUTS, as_list=False):
    ups = [None if u is None else u.to(DEVICE) for u in upstream_for(sources.cpu(), wanted)]
    check_op(_op("triton", as_list), sources, query, gain, ups, reference_op=_op("torch"))


@pytest.mark.parametrize("n_src, d", GRID)
def test_depth_attn_matches_reference_forward_and_backward(n_src, d):
    _check(*_inputs(n_src, d))


@pytest.mark.parametrize("wanted", [(n,) for n in OUTPUTS], ids=lambda u: "only-" + u[0])
def test_depth_attn_gradient_of_each_output_alone(wanted):
    _check(*_inputs(9, 48), wanted=wanted)


def test_depth_attn_without_gain_keeps_batch_shape_and_takes_a_sequence():
    sources, query, _ = _inputs(5, 64, batch=(2, 3, 7))
    mix, lse = depth_attn(sources, query, backend="triton")
    assert mix.shape == (2, 3, 7, 64) and lse.shape == (2, 3, 7)
    _check(sources, query, None)
    _check(*_inputs(4, 48), as_list=True)


def test_depth_attn_non_contiguous_sources():
    sources = torch.randn(48, M, 5, device=DEVICE).permute(2, 1, 0)  # [5, M, 48], strided
    assert not sources.is_contiguous()
    _check(sources, torch.randn(48, device=DEVICE) / 4, 1 + 0.2 * torch.randn(48, device=DEVICE))


def test_depth_attn_weights_are_exp_of_its_logits_and_mix_the_sources():
    sources, query, gain = _inputs(9, 48)
    mix, lse, weights, logits = depth_attn(sources, query, gain, return_weights=True, return_logits=True, backend="triton")
    check_outputs_consistent(sources, query, gain, mix, lse, weights, logits)


def test_depth_attn_saturated_logits():
    """Logits of order +-100: within the bound for that scale (G grows with z_max)."""
    _check(*_inputs(9, 64, logit_scale=120.0))


@pytest.mark.parametrize("d", [4096, 8192], ids=lambda d: f"M3-S3-D{d}")
def test_depth_attn_wide_rows(d):
    _check(*_inputs(3, d, batch=(3,)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n_src, d", [(3, 48), (9, 384)], ids=[_shape_id(3, 48), _shape_id(9, 384)])
def test_depth_attn_low_precision_sources(dtype, n_src, d):
    sources, query, gain = _inputs(n_src, d, dtype=dtype)
    mix, lse, w, z = _op("triton")(sources, query, gain)
    assert mix.dtype == dtype and lse.dtype == w.dtype == z.dtype == torch.float32
    _check(sources, query, gain)


# --- phase 1 and phase 2 ------------------------------------------------------------------


def _phase_bounds(sources, queries, names, storage=torch.float32) -> dict[str, float]:
    """The bound of every quantity of the two-phase ops: that of depth attention over the same
    sources (G from the largest logit of any query, kappa the largest over the queries),
    plus the rounding of low-precision outputs and upstream gradients."""
    conds = [conditions(sources, q, None, upstream_for(sources.cpu())) for q in queries]
    cond = {k: max(c[k] for c in conds) for k in conds[0]}
    S, d = sources.shape[0], sources.shape[-1]
    worst = max(tolerance(torch.float32, k, cond, S, d) for k in ("mix", "d sources", "d query"))
    kappa = max(cond[k] for k in ("d sources", "d query"))
    lowp = C * UNIT_ROUNDOFF[storage] * kappa if storage in (torch.float16, torch.bfloat16) else 0.0
    return {n: worst + lowp for n in names}


PHASE1_NAMES = ("o_bar", "lse", "logits", "d sources", "d queries")


def _phase1(backend):
    return lambda x, q: phase1(x, q, return_logits=True, backend=backend)


def _check_phase1(sources, queries):
    ups = [torch.randn(queries.shape[0], *sources.shape[1:-1], *s, device=DEVICE, dtype=torch.float64)
           for s in ((sources.shape[-1],), (), (sources.shape[0],))]
    bounds = _phase_bounds(sources.float(), queries, PHASE1_NAMES, sources.dtype)
    check_fn(_phase1("triton"), _phase1("torch"), (sources, queries), ups, PHASE1_NAMES, bounds)


PHASE1_GRID = [
    pytest.param(s, d, n_q, id=f"{_shape_id(s, d)}-Q{n_q}")
    for s, d, n_q in [(1, 48, 5), (2, 16, 1), (3, 384, 5), (9, 48, 5), (9, 384, 3), (17, 64, 4)]
]


@pytest.mark.parametrize("n_src, d, n_q", PHASE1_GRID)
def test_phase1_matches_reference_forward_and_backward(n_src, d, n_q):
    _check_phase1(torch.randn(n_src, M, d, device=DEVICE), torch.randn(n_q, d, device=DEVICE) / d**0.5 * 2)


def test_phase1_splits_many_queries_into_launches(monkeypatch):
    monkeypatch.setattr(tda, "_PHASE1_TILE", 128)  # two queries per launch at d = 48
    assert tda.phase1_max_queries(48) == 2
    sources = torch.randn(3, 2, 5, 48, device=DEVICE)  # batch (2, 5)
    queries = torch.randn(5, 48, device=DEVICE) / 4
    o, lse, z = _phase1("triton")(sources, queries)
    assert o.shape == (5, 2, 5, 48) and z.shape == (5, 2, 5, 3)
    _check_phase1(sources, queries)


def test_phase1_bf16_sources():
    sources = torch.randn(5, M, 64, device=DEVICE).bfloat16()
    queries = torch.randn(4, 64, device=DEVICE) / 4
    assert _phase1("triton")(sources, queries)[0].dtype == torch.bfloat16
    _check_phase1(sources, queries)


PHASE2_NAMES = ("h", "lse_total", "z_p", "d o_bar", "d lse", "d partial", "d query", "d gain")


def _phase2(backend):
    return lambda ob, l, p, q, g: phase2(ob, l, p, q, g, backend=backend)


def _check_phase2(o_bar, lse, partial, query, gain):
    ups = [torch.randn(partial.shape, device=DEVICE, dtype=torch.float64)] + [
        torch.randn(lse.shape, device=DEVICE, dtype=torch.float64) for _ in range(2)
    ]
    both = torch.stack([o_bar.float(), partial.float()])
    bounds = _phase_bounds(both, [query * gain], PHASE2_NAMES, partial.dtype)
    check_fn(_phase2("triton"), _phase2("torch"), (o_bar, lse, partial, query, gain), ups, PHASE2_NAMES, bounds)


@pytest.mark.parametrize("d", D_GRID, ids=lambda d: f"M{M}-D{d}")
def test_phase2_matches_reference_forward_and_backward(d):
    o_bar, partial = torch.randn(2, M, d, device=DEVICE).unbind(0)
    _check_phase2(o_bar, torch.randn(M, device=DEVICE), partial, torch.randn(d, device=DEVICE) / d**0.5 * 2, 1 + 0.2 * torch.randn(d, device=DEVICE))


def test_phase2_bf16_activations():
    o_bar, partial = torch.randn(2, M, 64, device=DEVICE).bfloat16().unbind(0)
    _check_phase2(o_bar, torch.randn(M, device=DEVICE), partial, torch.randn(64, device=DEVICE) / 4, 1 + 0.2 * torch.randn(64, device=DEVICE))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_phase1_then_phase2_equals_depth_attn_over_all_sources(backend):
    """Two-phase is exact: o_bar, lse, logits of the completed blocks and the partial's logit
    give the mixture, lse and logits of depth attention over all sources (float32, against
    the float64 one-pass op within the op's bound)."""
    sources, query, gain = _inputs(6, 48)
    completed, partial = sources[:5], sources[5]
    o_bar, lse, z = phase1(completed, (query * gain)[None], return_logits=True, backend=backend)
    h, lse_total, z_p = phase2(o_bar[0], lse[0], partial, query, gain, backend=backend)
    truth = depth_attn(sources.double(), query.double(), gain.double(), return_logits=True, backend="torch")
    cond = conditions(sources, query, gain, upstream_for(sources.cpu()))
    bound = tolerance(torch.float32, "mix", cond, 6, 48)
    for name, a, t in (("h", h, truth[0]), ("lse", lse_total, truth[1]), ("logits", torch.cat([z[0], z_p[:, None]], -1), truth[2])):
        err = (a.double() - t).pow(2).mean().sqrt() / t.pow(2).mean().sqrt()
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_merge_keeps_float32_accuracy_when_a_small_partial_dominates(backend):
    """Reads whose partial block is small but takes almost all the weight (s = 0.9999997, as
    in the issue's measurement): ``h = (1 - s) o_bar + s partial`` with both weights computed
    directly stays within the op's float32 bound ``C u G`` (G for logits of order 25, d = 64,
    two sources) of the float64 truth. The form ``o_bar + s (partial - o_bar)`` rounds
    ``partial - o_bar`` at the scale of o_bar and loses the partial's digits: about
    u |o_bar| / |partial| = 6e-4 relative here, which this bound rejects."""
    d = 64
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(d, generator=g)
    direction /= direction.norm()
    partial = 0.1 * (direction + 0.05 * torch.randn(M, d, generator=g))  # small, aligned with the query
    z_unit = (partial @ direction) * torch.rsqrt(partial.pow(2).mean(-1) + 1e-6)
    query = 25.0 * direction / z_unit.mean()  # z_p about 25
    o_bar = 1000.0 * torch.randn(M, d, generator=g)  # the completed blocks' mixture: much larger values
    lse = torch.full((M,), 10.0)  # s = sigmoid(z_p - lse), about sigmoid(15) = 0.9999997
    partial, query, o_bar, lse = (t.to(DEVICE) for t in (partial, query, o_bar, lse))
    h, lse_total, z_p = phase2(o_bar, lse, partial, query, torch.ones(d, device=DEVICE), backend=backend)
    s = torch.sigmoid(z_p.double() - lse.double())
    assert 1 - 1e-5 < s.min() and s.max() < 1 - 1e-8  # the partial dominates every read
    truth = (1 - s)[:, None] * o_bar.double() + s[:, None] * partial.double()
    bound = C * UNIT_ROUNDOFF[torch.float32] * growth(float(z_p.abs().max()), 2, d)

    def error(x: torch.Tensor) -> float:
        return ((x.double() - truth).pow(2).mean().sqrt() / truth.pow(2).mean().sqrt()).item()

    assert error(h) <= bound, f"merged mixture: relative RMS error {error(h):.3g} > {bound:.3g}"
    old = o_bar + s.float()[:, None] * (partial - o_bar)  # the cancelling form, in float32
    assert error(old) > 4 * bound, f"the old form's error {error(old):.3g} should exceed the bound {bound:.3g}"


def test_second_order_gradients_match_the_reference():
    """Under ``create_graph=True`` the Triton ops' backward builds its gradients from the
    reference ops, so a gradient of a gradient (of |dL/dinputs|^2, L a random weighting of
    every output) equals the reference's, for depth_attn, phase 1 and phase 2 (both backends
    take the same reference graph in float32: equal to a few ulps)."""
    sources, query, gain = _inputs(3, 16)
    o_bar, lse = torch.randn(M, 16, device=DEVICE), torch.randn(M, device=DEVICE)
    ops = {
        "depth_attn": (lambda b, x, q, g: depth_attn(x, q, g, return_weights=True, return_logits=True, backend=b), (sources, query, gain)),
        "phase1": (lambda b, x, q: phase1(x, q, return_logits=True, backend=b), (sources, torch.stack([query, -query]))),
        "phase2": (lambda b, ob, l, p, q, g: phase2(ob, l, p, q, g, backend=b), (o_bar, lse, sources[0], query, gain)),
    }
    for name, (op, args) in ops.items():
        results, ups = {}, None
        for backend in ("triton", "torch"):
            leaves = [t.detach().clone().requires_grad_() for t in args]
            outs = op(backend, *leaves)
            ups = ups or [torch.randn_like(o) for o in outs]
            first = torch.autograd.grad(outs, leaves, ups, create_graph=True)
            results[backend] = torch.autograd.grad(sum(g.pow(2).sum() for g in first), leaves, allow_unused=True)
        # the two take the same reference graph for the second order and differ only by the
        # first-order outputs they start from, each within the op's bound: the second-order
        # gradients differ by at most twice the source gradients' bound (two passes through it)
        cond = conditions(sources, query, gain, [None] * 4)
        bound = 2 * tolerance(torch.float32, "d sources", cond, sources.shape[0], sources.shape[-1])
        for i, (a, b) in enumerate(zip(results["triton"], results["torch"])):
            assert (a is None) == (b is None), f"{name}: input {i}"
            if a is not None:
                assert_within(a, b, bound, f"{name}: second-order d input {i}")
