"""The Numba CPU kernels agree with the PyTorch reference, outputs and every gradient.

Each test runs the same inputs and the same random upstream gradients (for the mixture, the
lse and the weights) through ``backend="numba"`` and ``backend="torch"``.

Tolerance, stated once:

- float32: an output or gradient passes when its max abs error <= 1e-5 OR its relative RMS
  error (RMS of the difference / RMS of the reference) <= 1e-5 (as for the Triton kernels).
- float64: max abs error <= 1e-12 OR relative RMS <= 1e-12; and ``torch.autograd.gradcheck``
  on the kernels themselves.
"""

from __future__ import annotations

import pytest
import torch

from attnres_probe.kernels import depth_attn
from attnres_probe.kernels.numba_depth_attn import depth_attn_numba

from closeness import _grads, _leaves, assert_close

M = 37
S_GRID = [1, 2, 3, 9, 17, 33]
D_GRID = [1, 16, 48, 64, 384]
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}
NAMES = ("mix", "lse", "weights", "d sources", "d query", "d gain")


def _inputs(n_src, d, batch=(M,), dtype=torch.float32, gain=True):
    sources = torch.randn(n_src, *batch, d, dtype=dtype)
    query = torch.randn(d, dtype=dtype) / d**0.5 * 2  # logits of order one
    g = 1 + 0.2 * torch.randn(d, dtype=dtype) if gain else None
    return sources, query, g


def _both(sources, query, gain, upstream_for=("mix", "lse", "weights"), as_list=False):
    """(numba, reference) results: each (outputs, gradients wrt sources/query/gain)."""
    results, ups = {}, None
    for backend in ("numba", "torch"):
        x, q, g = _leaves(sources, query, gain)
        arg = list(x.unbind(0)) if as_list and backend == "numba" else x
        outs = depth_attn(arg, q, g, return_weights=True, backend=backend)
        if ups is None:
            ups = [torch.randn_like(o) if n in upstream_for else torch.zeros_like(o) for o, n in zip(outs, NAMES)]
        results[backend] = (outs, _grads(outs, [x, q, g], ups))
    return results["numba"], results["torch"]


def _check(numba, ref, dtype=torch.float32):
    atol, rrms = TOL[dtype]
    (outs_n, grads_n), (outs_r, grads_r) = numba, ref
    for name, a, b in zip(NAMES, [*outs_n, *grads_n], [*outs_r, *grads_r]):
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        assert_close(a, b, name, atol=atol, rrms=rrms)


@pytest.mark.parametrize("d", D_GRID, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("n_src", S_GRID, ids=lambda s: f"S{s}")
def test_matches_reference_forward_and_every_gradient_fp32(n_src, d):
    _check(*_both(*_inputs(n_src, d)))


@pytest.mark.parametrize("n_src, d", [(1, 16), (5, 64), (17, 48)], ids=["S1-D16", "S5-D64", "S17-D48"])
def test_matches_reference_in_float64(n_src, d):
    _check(*_both(*_inputs(n_src, d, dtype=torch.float64)), dtype=torch.float64)


@pytest.mark.parametrize("upstream", [("mix",), ("lse",), ("weights",)], ids=lambda u: "only-" + u[0])
def test_gradient_of_each_output_alone(upstream):
    numba, ref = _both(*_inputs(9, 48), upstream_for=upstream)
    for name, a, b in zip(NAMES[3:], numba[1], ref[1]):
        assert_close(a, b, name)


def test_gradcheck_in_float64():
    x = torch.randn(3, 2, 5, 7, dtype=torch.float64, requires_grad=True)
    q = torch.randn(7, dtype=torch.float64, requires_grad=True)
    g = (1 + 0.3 * torch.randn(7, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, q, g: depth_attn_numba(x, q, g, 1e-6, True), (x, q, g))
    assert torch.autograd.gradcheck(lambda x, q: depth_attn_numba(list(x.unbind(0)), q, None, 1e-6), (x, q))


def test_a_list_of_sources_batch_shapes_and_no_gain():
    _check(*_both(*_inputs(4, 48, batch=(2, 3, 7), gain=False), as_list=True))
    sources, query, _ = _inputs(5, 64, batch=(2, 3, 7))
    mix, lse = depth_attn(sources, query, backend="numba")
    assert mix.shape == (2, 3, 7, 64) and lse.shape == (2, 3, 7)


def test_non_contiguous_sources_and_empty_batches():
    sources = torch.randn(48, M, 5).permute(2, 1, 0)  # [5, M, 48], strided
    assert not sources.is_contiguous()
    _check(*_both(sources, torch.randn(48) / 4, 1 + 0.2 * torch.randn(48)))
    mix, lse, w = depth_attn(torch.randn(3, 0, 8), torch.randn(8), return_weights=True, backend="numba")
    assert mix.shape == (0, 8) and lse.shape == (0,) and w.shape == (0, 3)


def test_mixed_precision_inputs_compute_in_float64_like_the_reference():
    sources = torch.randn(3, M, 16)
    query = torch.randn(16, dtype=torch.float64)
    got = depth_attn(sources, query, return_weights=True, backend="numba")
    want = depth_attn(sources, query, return_weights=True, backend="torch")
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        assert_close(a, b, name)


def test_returned_weights_are_the_ones_the_mixture_used_and_editing_them_is_safe():
    sources, query, gain = _inputs(9, 48)
    x = sources.clone().requires_grad_()
    mix, lse, weights = depth_attn(x, query, gain, return_weights=True, backend="numba")
    assert_close(weights.sum(-1), torch.ones_like(lse), "sum of weights")
    assert_close(torch.einsum("ms,smd->md", weights, sources), mix, "weights @ sources")
    up = torch.randn_like(mix)
    before = torch.autograd.grad(mix, x, up, retain_graph=True)[0]
    with torch.no_grad():
        weights.zero_()  # a caller editing its copy must not change the saved state
    assert torch.equal(torch.autograd.grad(mix, x, up)[0], before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_refused_with_a_clear_error(dtype):
    with pytest.raises(ValueError, match="float32 or float64.*backend='torch'"):
        depth_attn(torch.randn(2, 3, 8).to(dtype), torch.randn(8).to(dtype), backend="numba")


def test_concurrent_callers_get_their_own_results():
    from concurrent.futures import ThreadPoolExecutor

    cases = [_inputs(s, 64, batch=(300,)) for s in (2, 5, 9, 3)]
    want = [depth_attn(*c, backend="torch")[0] for c in cases]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: depth_attn(*c, backend="numba")[0], cases * 3))
    for i, g in enumerate(got):
        assert_close(g, want[i % len(cases)], f"call {i}")


@pytest.mark.parametrize("cache", ["1", "0"])
def test_the_on_disk_kernel_cache_is_used_or_switched_off(tmp_path, cache):
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from attnres_probe.kernels import depth_attn\n"
        "x = torch.randn(3, 5, 8, requires_grad=True)\n"
        "depth_attn(x, torch.randn(8), backend='numba')[0].sum().backward()\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "nb"), "ATTNRES_NUMBA_CACHE": cache}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    written = sorted(p.suffix for p in (tmp_path / "nb").rglob("*") if p.is_file())
    if cache == "1":
        assert ".nbi" in written and ".nbc" in written
    else:
        assert written == []


def test_nan_inf_zero_rows_and_saturated_logits_match_the_reference():
    """NaN/inf in a source row poison that row only, as in the reference; a zero row and
    logits large enough that most weights underflow (the float32 exp is the kernels' own)
    agree with the reference."""
    sources, query, gain = _inputs(5, 64, batch=(70,))
    sources[1, 3, 7] = float("nan")
    sources[2, 40, 0] = float("inf")
    sources[:, 11] = 0.0
    numba, ref = _both(sources, query, gain, upstream_for=("mix", "lse"))
    for name, a, b in zip(NAMES, [*numba[0], *numba[1]], [*ref[0], *ref[1]]):
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN positions differ"
        keep = ~b.isnan()
        assert_close(a[keep], b[keep], name)
    assert numba[0][0][3].isnan().all() and not numba[0][0][2].isnan().any()
    big = _inputs(9, 64, batch=(70,))
    _check(*_both(big[0], big[1] * 60, big[2]))  # logits of order +-100: near one-hot weights


def test_rows_split_over_threads_match_the_reference(monkeypatch):
    """Big calls run on Numba's threads (row ranges, per-range float64 query-gradient sums);
    a caller that finds the threaded path busy runs on its own thread. Both match the reference."""
    import attnres_probe.kernels.numba_depth_attn as nbk

    calls = []
    for name in ("_forward_parallel", "_backward_parallel"):
        kernel = getattr(nbk, name)
        monkeypatch.setattr(nbk, name, lambda *a, _k=kernel, _n=name: calls.append((_n, a[-1])) or _k(*a))
    monkeypatch.setattr(nbk, "PARALLEL_MIN_ELEMENTS", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        n = nbk._n_chunks(301, 10**9)
        assert n == min(2, nbk.nb.config.NUMBA_NUM_THREADS)
        inputs = _inputs(6, 48, batch=(301,))
        _check(*_both(*inputs))
        assert calls == ([("_forward_parallel", 2), ("_backward_parallel", 2)] if n == 2 else [])
        with nbk._parallel_lock:  # busy: the same call runs on the caller's thread
            _check(*_both(*inputs))
        _check(*_both(*_inputs(3, 16, batch=(3,))))  # fewer rows than two per thread: one range
        assert len(calls) == (2 if n == 2 else 0)
    finally:
        torch.set_num_threads(threads)


def test_the_models_direct_path_equals_the_op_and_falls_back_for_other_layouts():
    """``mixture`` (what an unhooked model read calls) gives the op's mixture and gradients for
    contiguous sources, copies strided ones, and refuses mixed dtypes and half precision."""
    from attnres_probe.kernels.numba_depth_attn import mixture

    sources, query, gain = _inputs(4, 48)
    cases = {
        "contiguous": list(sources.unbind(0)),
        "strided": [s.t().contiguous().t() for s in sources.unbind(0)],
    }
    for name, srcs in cases.items():
        leaves = [s.detach().clone().requires_grad_() for s in srcs]
        q, g = _leaves(query, gain)
        got = mixture(leaves, q, g, 1e-6)
        ref_leaves = [s.detach().double().requires_grad_() for s in srcs]
        rq, rg = _leaves(query.double(), gain.double())
        want = depth_attn(ref_leaves, rq, rg, backend="torch")[0]
        assert_close(got, want, f"{name}: mixture")
        up = torch.randn_like(want)
        grads = torch.autograd.grad(got, [*leaves, q, g], up.to(got.dtype))
        ref_grads = torch.autograd.grad(want, [*ref_leaves, rq, rg], up)
        for i, (a, b) in enumerate(zip(grads, ref_grads)):
            what = f"d source {i}" if i < len(leaves) else ("d query", "d gain")[i - len(leaves)]
            assert_close(a, b, f"{name}: {what}")
    with pytest.raises(ValueError, match="every source must be"):
        mixture([sources[0].double(), *sources[1:].unbind(0)], query, gain, 1e-6)
    with pytest.raises(ValueError, match="float32 or float64"):
        mixture([s.half() for s in sources.unbind(0)], query.half(), gain.half(), 1e-6)


def test_the_kernels_float32_exp_matches_exp_over_the_whole_range():
    """``_exp_f32`` (the vectorisable exp of the float32 kernels): relative error <= 3e-7 from
    the smallest normal result to the largest finite one (x = 88.5 needs 2 * 2^127), 0 below,
    inf above, NaN for NaN."""
    import numpy as np

    from attnres_probe.kernels.numba_depth_attn import _exp_f32

    xs = np.concatenate([np.linspace(-87.33, 88.72, 20001), [-1e-7, 0.0, 1e-7, 88.5, 88.7228]]).astype(np.float32)
    got = np.array([_exp_f32(x) for x in xs], dtype=np.float64)
    want = np.exp(xs.astype(np.float64))
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - want) / want) <= 3e-7
    assert _exp_f32(np.float32(-90.0)) == 0.0 and _exp_f32(np.float32(-np.inf)) == 0.0
    assert _exp_f32(np.float32(88.8)) == np.inf and _exp_f32(np.float32(np.inf)) == np.inf
    assert np.isnan(_exp_f32(np.float32(np.nan)))


def test_the_direct_path_checks_the_query_and_gain_too():
    from attnres_probe.kernels.numba_depth_attn import mixture

    sources, query, gain = _inputs(3, 8)
    strided_query = torch.stack([torch.zeros(8), query], 1)[:, 1]  # [8] with stride 2
    want = depth_attn(sources, query, gain, backend="torch")[0]
    assert_close(mixture(list(sources.unbind(0)), strided_query, gain, 1e-6), want, "strided query")
    with pytest.raises(ValueError):
        mixture(list(sources.unbind(0)), query[:4], gain, 1e-6)
    with pytest.raises(ValueError):
        mixture([sources[0], sources[1][:, :4]], query, gain, 1e-6)


def test_second_order_gradients_are_exact():
    """Under ``create_graph=True`` every Numba op's backward builds its gradients from the
    reference ops, so gradients of gradients are right: ``gradgradcheck`` in float64 on the
    general op, the lean read (plain, with the fused pre-norm, with the fused partial sum) and
    PreNorm's add-norm."""
    import attnres_probe.kernels.numba_depth_attn as nbk

    def leaves(*shape_scales):
        return [(torch.randn(*shape, dtype=torch.float64) * sc + off).requires_grad_() for shape, sc, off in shape_scales]

    x, q, g, w, a, b = leaves(((3, 2, 4, 6), 1, 0), ((6,), 0.5, 0), ((6,), 0.2, 1), ((6,), 0.3, 1), ((2, 4, 6), 1, 0), ((2, 4, 6), 1, 0))
    cases = {
        "general op (mixture, lse, weights)": (lambda x, q, g: depth_attn_numba(x, q, g, 1e-6, True), (x, q, g)),
        "lean read": (lambda x, q, g: nbk.mixture(list(x.unbind(0)), q, g, 1e-6), (x, q, g)),
        "lean read + norm": (lambda x, q, g, w: nbk.mixture(list(x.unbind(0)), q, g, 1e-6, norm=(w, 1e-5)), (x, q, g, w)),
        "fused sum + norm": (
            lambda x, a, b, q, g, w: nbk.fused_mixture(list(x.unbind(0)), a, b, q, g, 1e-6, norm=(w, 1e-5)), (x, a, b, q, g, w)
        ),
        "add-norm": (lambda a, b, w: nbk.add_rms_norm(a, b, w, 1e-5), (a, b, w)),
        "norm": (lambda a, w: nbk.add_rms_norm(a, None, w, 1e-5), (a, w)),
    }
    for name, (fn, args) in cases.items():
        assert torch.autograd.gradgradcheck(fn, args), name
    # inputs that depend on one another (as a model's later sources do on earlier ones): the op's
    # create_graph gradients are its own partial derivatives, as the reference's
    from attnres_probe.kernels.reference import rms_norm

    y = torch.tanh(x[0])
    got = []
    for make in (
        lambda: nbk.mixture([x[0], y, x[0] * w], q, g, 1e-6, norm=(w, 1e-5)),
        lambda: nbk.fused_mixture([x[0], y], y, x[1] * w, q, g, 1e-6, norm=(w, 1e-5))[0],
        lambda: nbk.add_rms_norm(a, a * w, w, 1e-5)[1],
    ):
        out = make()
        got.append(torch.autograd.grad(out, [x, q, g, w, a], torch.ones_like(out), create_graph=True, allow_unused=True))
    want = []
    for make in (
        lambda: rms_norm(depth_attn([x[0], y, x[0] * w], q, g, backend="torch")[0], w, 1e-5),
        lambda: rms_norm(depth_attn([x[0], y, y + x[1] * w], q, g, backend="torch")[0], w, 1e-5),
        lambda: rms_norm(a + a * w, w, 1e-5),
    ):
        out = make()
        want.append(torch.autograd.grad(out, [x, q, g, w, a], torch.ones_like(out), retain_graph=True, allow_unused=True))
    for case, (gs, ws) in enumerate(zip(got, want)):
        for i, (a_, b_) in enumerate(zip(gs, ws)):
            assert (a_ is None) == (b_ is None), f"case {case}, input {i}"
            if a_ is not None:
                assert_close(a_, b_, f"case {case}, input {i}", atol=1e-12, rrms=1e-12)


@pytest.mark.parametrize("norm", [False, True], ids=["mixture", "normed"])
@pytest.mark.parametrize("upstream", ["both", "mixture", "sum"])
@pytest.mark.parametrize("n_src, d, threaded", [(1, 16, False), (3, 64, False), (5, 48, True), (9, 64, True)])
def test_the_fused_partial_sum_read_matches_the_reference(n_src, d, threaded, upstream, norm, monkeypatch):
    """``fused_mixture(sources, a, b, ...)`` (a Block AttnRes read that forms the partial-block
    sum a + b itself) gives the reference's mixture over [*sources, a + b], the sum, and every
    gradient: sources, a, b, query and gain, with upstream gradients on either output or both,
    on the caller's thread and on Numba's threads. With ``norm`` the first output is the
    reference's ``rms_norm(mixture) * w`` and the norm gain w gets its gradient too."""
    import attnres_probe.kernels.numba_depth_attn as nbk
    from attnres_probe.kernels.reference import rms_norm

    if threaded:
        monkeypatch.setattr(nbk, "PARALLEL_MIN_ELEMENTS", 0)
    sources, query, gain = _inputs(n_src + 1, d, batch=(3, 29))
    a, b = sources[-1], torch.randn_like(sources[-1])
    norm_w = 1 + 0.3 * torch.randn(d)
    up_h, up_t = torch.randn_like(a), torch.randn_like(a)
    results = []
    for fused in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (*sources[:-1].unbind(0), a, b)]
        q, g, w = _leaves(query, gain, norm_w)
        if fused:
            h, total = nbk.fused_mixture(leaves[:-2], leaves[-2], leaves[-1], q, g, 1e-6, norm=(w, 1e-5) if norm else None)
        else:
            total = leaves[-2] + leaves[-1]
            h = depth_attn([*leaves[:-2], total], q, g, backend="torch")[0]
            h = rms_norm(h, w, 1e-5) if norm else h
        outs = {"both": [(h, up_h), (total, up_t)], "mixture": [(h, up_h)], "sum": [(total, up_t)]}[upstream]
        wrt = [*leaves, q, g, w]
        grads = torch.autograd.grad([o for o, _ in outs], wrt, [u for _, u in outs], allow_unused=True)
        results.append(([h, total], [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, wrt)]))
    (outs_f, grads_f), (outs_r, grads_r) = results
    names = ["mix", "sum", *[f"d source {i}" for i in range(n_src - 1)], "d a", "d b", "d query", "d gain", "d norm gain"]
    for name, x, y in zip(names, [*outs_f, *grads_f], [*outs_r, *grads_r]):
        assert_close(x, y, name, atol=1e-5, rrms=1e-5)


@pytest.mark.parametrize("threaded", [False, True], ids=["serial", "threaded"])
@pytest.mark.parametrize("n_src, d", [(1, 16), (4, 48), (9, 64)])
def test_a_read_with_the_next_pre_norm_matches_the_reference(n_src, d, threaded, monkeypatch):
    """``mixture(..., norm=(w, eps))`` (an unhooked model read that applies the next sublayer's
    RMSNorm in its kernel) gives ``rms_norm(mixture) * w`` and every gradient: sources, query,
    gain and w (float32, the stated tolerance); and passes gradcheck in float64."""
    import attnres_probe.kernels.numba_depth_attn as nbk
    from attnres_probe.kernels.reference import rms_norm

    if threaded:
        monkeypatch.setattr(nbk, "PARALLEL_MIN_ELEMENTS", 0)
    sources, query, gain = _inputs(n_src, d, batch=(5, 23))
    norm_w = 1 + 0.3 * torch.randn(d)
    up = torch.randn_like(sources[0])
    results = []
    for fast in (True, False):
        leaves = _leaves(*sources.unbind(0), query, gain, norm_w)
        srcs, q, g, w = leaves[:n_src], *leaves[n_src:]
        if fast:
            x = nbk.mixture(srcs, q, g, 1e-6, norm=(w, 1e-5))
        else:
            x = rms_norm(depth_attn(srcs, q, g, backend="torch")[0], w, 1e-5)
        results.append([x, *torch.autograd.grad(x, leaves, up)])
    names = ["x", *[f"d source {i}" for i in range(n_src)], "d query", "d gain", "d norm gain"]
    for name, a, b in zip(names, *results):
        assert_close(a, b, name)
    leaves = _leaves(*sources[:, :2, :5].double().unbind(0), query.double(), gain.double(), norm_w.double())
    assert torch.autograd.gradcheck(lambda *t: nbk.mixture(list(t[:n_src]), *t[n_src:-1], 1e-6, norm=(t[-1], 1e-5)), leaves)
    # the validated path (a strided query) applies the same norm outside the kernel
    strided = torch.stack([torch.zeros(d), query], 1)[:, 1]
    want = rms_norm(depth_attn(sources, query, gain, backend="torch")[0], norm_w, 1e-5)
    assert_close(nbk.mixture(list(sources.unbind(0)), strided, gain, 1e-6, norm=(norm_w, 1e-5)), want, "strided query")


@pytest.mark.parametrize("threaded", [False, True], ids=["serial", "threaded"])
@pytest.mark.parametrize("upstream", ["both", "x", "sum"])
def test_prenorms_fused_residual_add_and_norm_match_pytorch(upstream, threaded, monkeypatch):
    """``add_rms_norm(a, b, w, eps)`` (PreNorm's residual step with the next pre-norm) gives
    ``(a + b, rms_norm(a + b) * w)`` and the gradients of a, b and w, with upstream gradients
    on either output or both; ``add_rms_norm(a, None, w, eps)`` gives ``rms_norm(a) * w``.
    float32 at the stated tolerance; gradcheck in float64; other layouts and dtypes are
    computed with PyTorch ops."""
    import attnres_probe.kernels.numba_depth_attn as nbk
    from attnres_probe.kernels.reference import rms_norm

    if threaded:
        monkeypatch.setattr(nbk, "PARALLEL_MIN_ELEMENTS", 0)
    a, b, w = torch.randn(4, 37, 48), torch.randn(4, 37, 48), 1 + 0.3 * torch.randn(48)
    up_s, up_x = torch.randn_like(a), torch.randn_like(a)
    results = []
    for fast in (True, False):
        la, lb, lw = _leaves(a, b, w)
        if fast:
            s, x = nbk.add_rms_norm(la, lb, lw, 1e-5)
            x1 = nbk.add_rms_norm(la, None, lw, 1e-5)
        else:
            s = la + lb
            x, x1 = rms_norm(s, lw, 1e-5), rms_norm(la, lw, 1e-5)
        outs = {"both": [(s, up_s), (x, up_x)], "x": [(x, up_x)], "sum": [(s, up_s)]}[upstream]
        grads = torch.autograd.grad([o for o, _ in outs], [la, lb, lw], [u for _, u in outs], allow_unused=True)
        grads = [torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, (a, b, w))]
        results.append([s, x, x1, *grads, *torch.autograd.grad(x1, [la, lw], up_x)])
    names = ["sum", "x", "x of a alone", "d a", "d b", "d w", "d a (alone)", "d w (alone)"]
    for name, got, want in zip(names, *results):
        assert_close(got, want, name)
    la, lb, lw = _leaves(a[:2, :3, :6].double(), b[:2, :3, :6].double(), w[:6].double())
    assert torch.autograd.gradcheck(lambda a, b, w: nbk.add_rms_norm(a, b, w, 1e-5), (la, lb, lw))
    assert torch.autograd.gradcheck(lambda a, w: nbk.add_rms_norm(a, None, w, 1e-5), (la, lw))
    strided = a.transpose(0, 1).contiguous().transpose(0, 1)
    s, x = nbk.add_rms_norm(strided, b, w, 1e-5)
    assert_close(x, rms_norm(a + b, w, 1e-5), "strided a")
    s, x = nbk.add_rms_norm(a.half(), b.half(), w.half(), 1e-5)  # not the kernel's dtypes: PyTorch ops
    assert x.dtype == torch.float16 and torch.equal(x, rms_norm(a.half() + b.half(), w.half(), 1e-5))


def test_the_fused_read_takes_the_plain_path_for_other_layouts_and_refuses_bad_input():
    from attnres_probe.kernels.numba_depth_attn import fused_mixture

    sources, query, gain = _inputs(3, 16)
    a = sources[2].t().contiguous().t()  # strided: a + b is formed outside the kernel
    h, total = fused_mixture(list(sources[:2].unbind(0)), a, sources[1], query, gain, 1e-6)
    want = depth_attn([*sources[:2].unbind(0), a + sources[1]], query, gain, backend="torch")[0]
    assert_close(h, want, "mixture")
    assert torch.equal(total, a + sources[1])
    with pytest.raises(ValueError, match="float32 or float64"):
        fused_mixture([s.half() for s in sources[:2].unbind(0)], a.half(), a.half(), query.half(), gain.half(), 1e-6)


def test_gradient_slots_must_match_the_sources():
    from attnres_probe.kernels.numba_depth_attn import GradSlot, fused_mixture, mixture

    sources, query, gain = _inputs(3, 16)
    with pytest.raises(ValueError, match="slots has 1 entries for 3 sources"):
        mixture(list(sources.unbind(0)), query, gain, 1e-6, slots=[None])
    with pytest.raises(ValueError, match="slots has 3 entries for 2 sources"):
        fused_mixture([sources[0]], sources[1], sources[2], query, gain, 1e-6, slots=[None, None, (GradSlot(), True)])
    with pytest.raises(ValueError, match="gradient slots need"):
        mixture([s.double() for s in sources.unbind(0)], query, gain, 1e-6, slots=[(GradSlot(), True), None, None])
