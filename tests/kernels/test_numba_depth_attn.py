"""The Numba CPU kernels agree with the float64 reference, outputs and every gradient.

Each test runs the same inputs and the same random upstream gradients (for the mixture, the
lse, the weights and the logits) through ``backend="numba"`` and checks every output and
gradient against the float64 reference within the bound ``C u G kappa`` derived in
``closeness.py`` (the float32 reference must meet the same bound). float64 inputs are also
checked with ``torch.autograd.gradcheck``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnres_probe.kernels import depth_attn
from attnres_probe.kernels.ops.depth_attn.numba import SourceTable
from attnres_probe.kernels.ops.depth_attn.numba import depth_attn as depth_attn_numba

from closeness import OUTPUTS, check_op, check_outputs_consistent, upstream_for

M = 37
S_GRID = [1, 2, 3, 9, 17, 33]
D_GRID = [1, 16, 48, 64, 384]


def _inputs(n_src, d, batch=(M,), dtype=torch.float32, gain=True, logit_scale=2.0):
    sources = torch.randn(n_src, *batch, d, dtype=dtype)
    query = torch.randn(d, dtype=dtype) / d**0.5 * logit_scale  # logits of order logit_scale
    g = 1 + 0.2 * torch.randn(d, dtype=dtype) if gain else None
    return sources, query, g


def _op(backend, as_list=False):
    def op(x, q, g):
        arg = list(x.unbind(0)) if as_list else x
        return depth_attn(arg, q, g, return_weights=True, return_logits=True, backend=backend)

    return op


def _check(sources, query, gain, wanted=OUTPUTS, as_list=False):
    return check_op(_op("numba", as_list), sources, query, gain, upstream_for(sources, wanted), reference_op=_op("torch"))


@pytest.mark.parametrize("d", D_GRID, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("n_src", S_GRID, ids=lambda s: f"S{s}")
def test_matches_reference_forward_and_every_gradient_fp32(n_src, d):
    _check(*_inputs(n_src, d))


@pytest.mark.parametrize("n_src, d", [(1, 16), (5, 64), (17, 48)], ids=["S1-D16", "S5-D64", "S17-D48"])
def test_matches_reference_in_float64(n_src, d):
    _check(*_inputs(n_src, d, dtype=torch.float64))


@pytest.mark.parametrize("wanted", [(n,) for n in OUTPUTS], ids=lambda u: "only-" + u[0])
def test_gradient_of_each_output_alone(wanted):
    _check(*_inputs(9, 48), wanted=wanted)


def test_gradcheck_in_float64():
    x = torch.randn(3, 2, 5, 7, dtype=torch.float64, requires_grad=True)
    q = torch.randn(7, dtype=torch.float64, requires_grad=True)
    g = (1 + 0.3 * torch.randn(7, dtype=torch.float64)).requires_grad_()
    fn = lambda x, q, g: depth_attn_numba(x, q, g, 1e-6, True, return_logits=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, q, g))
    assert torch.autograd.gradcheck(lambda x, q: depth_attn_numba(list(x.unbind(0)), q, None, 1e-6), (x, q))


def test_a_list_of_sources_batch_shapes_and_no_gain():
    _check(*_inputs(4, 48, batch=(2, 3, 7), gain=False), as_list=True)
    sources, query, _ = _inputs(5, 64, batch=(2, 3, 7))
    mix, lse = depth_attn(sources, query, backend="numba")
    assert mix.shape == (2, 3, 7, 64) and lse.shape == (2, 3, 7)


def test_non_contiguous_sources_and_empty_batches():
    sources = torch.randn(48, M, 5).permute(2, 1, 0)  # [5, M, 48], strided
    assert not sources.is_contiguous()
    _check(sources, torch.randn(48) / 4, 1 + 0.2 * torch.randn(48))
    mix, lse, w, z = depth_attn(torch.randn(3, 0, 8), torch.randn(8), return_weights=True, return_logits=True, backend="numba")
    assert mix.shape == (0, 8) and lse.shape == (0,) and w.shape == (0, 3) and z.shape == (0, 3)


def test_mixed_precision_inputs_compute_in_float64_like_the_reference():
    sources = torch.randn(3, M, 16)
    query = torch.randn(16, dtype=torch.float64)
    got = depth_attn(sources, query, return_weights=True, return_logits=True, backend="numba")
    want = depth_attn(sources, query, return_weights=True, return_logits=True, backend="torch")
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=0, rtol=1e-12)  # both float64: 1e-12 >> 2^-53 G


def test_returned_weights_and_logits_are_the_ones_the_mixture_used_and_editing_them_is_safe():
    sources, query, gain = _inputs(9, 48)
    x = sources.clone().requires_grad_()
    mix, lse, weights, logits = depth_attn(x, query, gain, return_weights=True, return_logits=True, backend="numba")
    check_outputs_consistent(sources, query, gain, mix, lse, weights, logits)
    up = torch.randn_like(mix)
    before = torch.autograd.grad(mix, x, up, retain_graph=True)[0]
    with torch.no_grad():
        weights.zero_()  # a caller editing its copies must not change the saved state
        logits.zero_()
    assert torch.equal(torch.autograd.grad(mix, x, up)[0], before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_refused_with_a_clear_error(dtype):
    with pytest.raises(ValueError, match="float32 or float64.*backend='torch'"):
        depth_attn(torch.randn(2, 3, 8).to(dtype), torch.randn(8).to(dtype), backend="numba")


def test_concurrent_callers_get_their_own_results():
    from concurrent.futures import ThreadPoolExecutor

    cases = [_inputs(s, 64, batch=(300,)) for s in (2, 5, 9, 3)]
    want = [depth_attn(*c, backend="numba")[0] for c in cases]  # one caller at a time
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: depth_attn(*c, backend="numba")[0], cases * 3))
    for i, g in enumerate(got):  # the same kernel on the same inputs: bit for bit, whoever else runs
        assert torch.equal(g, want[i % len(cases)])


@pytest.fixture(scope="module")
def cache_runs(tmp_path_factory):
    """cache -> (its NUMBA_CACHE_DIR, its process): a fresh interpreter that compiles the kernels with
    ATTNRES_NUMBA_CACHE=cache. Both are started at once (each compiles on one core for seconds);
    each test below waits for its own."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from attnres_probe.kernels import depth_attn\n"
        "x = torch.randn(3, 5, 8, requires_grad=True)\n"
        "depth_attn(x, torch.randn(8), backend='numba')[0].sum().backward()\n"
    )
    runs = {}
    for cache in ("1", "0"):
        folder = tmp_path_factory.mktemp(f"cache{cache}") / "nb"
        env = {**os.environ, "NUMBA_CACHE_DIR": str(folder), "ATTNRES_NUMBA_CACHE": cache}
        runs[cache] = (folder, subprocess.Popen([sys.executable, "-c", code], env=env))
    yield runs
    for _, proc in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("cache", ["1", "0"])
def test_the_on_disk_kernel_cache_is_used_or_switched_off(cache_runs, cache):
    folder, proc = cache_runs[cache]
    assert proc.wait(timeout=300) == 0
    written = sorted(p.suffix for p in folder.rglob("*") if p.is_file())
    if cache == "1":
        assert ".nbi" in written and ".nbc" in written
    else:
        assert written == []


def test_nan_inf_and_zero_rows_poison_only_their_row_as_in_the_reference():
    """NaN/inf in a source row poison that row only, at the same places as in the reference;
    a zero row is fine. Finite values are within the bound."""
    sources, query, gain = _inputs(5, 64, batch=(70,))
    sources[1, 3, 7] = float("nan")
    sources[2, 40, 0] = float("inf")
    sources[:, 11] = 0.0
    _check(sources, query, gain, wanted=("mix", "lse"))
    mix = depth_attn(sources, query, gain, backend="numba")[0]
    assert mix[3].isnan().all() and not mix[2].isnan().any() and not mix[11].isnan().any()


def test_saturated_logits_stay_within_the_bound_for_their_scale():
    """Logits of order +-100 (near one-hot weights, most underflowing in float32): every output
    and gradient within ``C u G kappa`` with G = (1 + z_max)(sqrt(d) + S), z_max about 100:
    an absolute logit error of u z_max is a relative weight error of u z_max, on any machine.
    A bound of 1e-5 independent of z_max is what failed on another CPU (1.02e-5 on d gain)."""
    sources, query, gain = _inputs(9, 64, batch=(70,), logit_scale=120.0)
    z = depth_attn(sources, query, gain, return_logits=True, backend="torch")[2]
    assert z.abs().max() > 80  # saturated indeed
    _check(sources, query, gain)


def test_rows_split_over_threads_match_the_reference(monkeypatch):
    """Big calls run on Numba's threads (row ranges, per-range float64 query-gradient sums);
    a caller that finds the threaded path busy runs on its own thread. Both match the reference."""
    import attnres_probe.kernels.ops.depth_attn.numba as nbk

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
        _check(*inputs)
        per_check = 2 if n == 2 else 0  # each check runs the op once (forward, backward) in float32
        assert calls == [("_forward_parallel", 2), ("_backward_parallel", 2)] * (per_check // 2)
        with nbk._parallel_lock:  # busy: the same call runs on the caller's thread
            _check(*inputs)
        _check(*_inputs(3, 16, batch=(3,)))  # fewer rows than two per thread: one range
        assert len(calls) == per_check
    finally:
        torch.set_num_threads(threads)


def test_the_kernels_float32_exp_matches_exp_over_the_whole_range():
    """``_exp_f32`` (the vectorisable exp of the float32 kernels): relative error <= 3e-7 from
    the smallest normal result to the largest finite one (x = 88.5 needs 2 * 2^127), 0 below,
    inf above, NaN for NaN."""
    from attnres_probe.kernels.ops.depth_attn.numba import _exp_f32

    xs = np.concatenate([np.linspace(-87.33, 88.72, 20001), [-1e-7, 0.0, 1e-7, 88.5, 88.7228]]).astype(np.float32)
    got = np.array([_exp_f32(x) for x in xs], dtype=np.float64)
    want = np.exp(xs.astype(np.float64))
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - want) / want) <= 3e-7  # 2.5 float32 ulps: the polynomial's rounding
    assert _exp_f32(np.float32(-90.0)) == 0.0 and _exp_f32(np.float32(-np.inf)) == 0.0
    assert _exp_f32(np.float32(88.8)) == np.inf and _exp_f32(np.float32(np.inf)) == np.inf
    assert np.isnan(_exp_f32(np.float32(np.nan)))


def test_second_order_gradients_are_exact():
    """Under ``create_graph=True`` the op's backward builds its gradients from the reference
    ops, so gradients of gradients are right (``gradgradcheck``, float64), and they are the
    op's own partial derivatives when its inputs depend on one another (as a model's later
    sources do on earlier ones)."""
    x = torch.randn(3, 2, 4, 6, dtype=torch.float64, requires_grad=True)
    q = (0.5 * torch.randn(6, dtype=torch.float64)).requires_grad_()
    g = (1 + 0.2 * torch.randn(6, dtype=torch.float64)).requires_grad_()
    fn = lambda x, q, g: depth_attn_numba(x, q, g, 1e-6, True, return_logits=True)  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (x, q, g))
    got = []
    for backend in ("numba", "torch"):
        y = torch.tanh(x[0])
        mix = depth_attn([x[0], y, x[0] * g], q, g, backend=backend)[0]
        first = torch.autograd.grad(mix.pow(2).sum(), [x, q, g], create_graph=True)
        got.append(torch.autograd.grad(sum(f.pow(2).sum() for f in first), [x, q, g]))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)  # float64: many ulps of 2^-53 G


def test_a_source_table_is_built_only_from_tensors_it_can_read():
    """The kernels read raw addresses; the table that holds them refuses anything that would
    make a read go out of bounds or misread, with an error naming the source."""
    good = [torch.randn(4, 8) for _ in range(3)]
    table = SourceTable(good, torch.float32)
    assert len(table) == 3 and table.n_rows == 4 and table.d == 8
    assert table.addresses.tolist() == [t.data_ptr() for t in good]
    bad = {
        "shape": ([good[0], torch.randn(5, 8)], "source 1 has shape"),
        "width": ([good[0], torch.randn(4, 7)], "source 1 has shape"),
        "dtype": ([good[0], good[1].double()], "source 1 has dtype"),
        "strided": ([good[0], torch.randn(8, 4).t()], "source 1 is not contiguous"),
        "not a tensor": ([good[0], np.zeros((4, 8), np.float32)], "source 1 is a ndarray"),
        "empty": ([], "at least one tensor"),
        "no width": ([torch.randn(4, 0)], "d >= 1"),
    }
    for case, (tensors, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            SourceTable(tensors, torch.float32)
    with pytest.raises(ValueError, match="float32 or float64"):
        SourceTable(good, torch.float16)


@pytest.mark.parametrize("width", [5, 8], ids=["W=S", "W>S"])
def test_padded_outputs_match_the_reference_padding_and_gradients(width):
    """``width=`` gives the weights, logits and shares the model's common source axis: the
    kernel writes the padding itself (NaN, -inf for the logits), the other backends pad after;
    upstream gradients arrive padded too, and the padding's part is ignored (also under
    ``create_graph=True``, second-order gradients included). float64 on both
    sides, so the values agree to a few ulps of the sums (1e-10 relative is far above that)."""
    sources, query, gain = _inputs(5, 16, batch=(3, 7), dtype=torch.float64)
    ups = None
    got = {}
    for backend in ("numba", "torch"):
        x, q, g = (t.clone().requires_grad_() for t in (sources, query, gain))
        outs = depth_attn(list(x.unbind(0)), q, g, return_weights=True, return_logits=True, return_contrib=True,
                          backend=backend, width=width)
        mix, lse, w, z, c = outs
        assert w.shape == z.shape == c.shape == (3, 7, width)
        assert (w[..., 5:] == 0).all() and (c[..., 5:] == 0).all() and (z[..., 5:] == float("-inf")).all()
        if ups is None:
            ups = [torch.randn_like(t) for t in (mix, lse, w, z)]
        grads = torch.autograd.grad([mix, lse, w, z], [x, q, g], ups, create_graph=True)
        second = torch.autograd.grad(sum(t.pow(2).sum() for t in grads), [x, q, g])  # the padding has no part here either
        got[backend] = [t[..., :5] if t.shape[-1] == width else t for t in outs] + list(grads) + list(second)
    for a, b in zip(got["numba"], got["torch"]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_a_bad_width_is_refused():
    sources, query, _ = _inputs(4, 8)
    for backend in ("numba", "torch"):
        for bad in (3, 2.5, True):
            with pytest.raises(ValueError, match="width"):
                depth_attn(sources, query, return_weights=True, backend=backend, width=bad)


def test_each_source_gradient_has_a_storage_of_its_own():
    """Autograd adds a source's gradients from later reads into the first one in place only
    when that tensor owns its storage; views of one shared buffer would cost a copy per read."""
    sources, query, gain = _inputs(4, 16)
    x = [s.clone().requires_grad_() for s in sources]
    mix = depth_attn(x, query, gain, backend="numba")[0]
    grads = torch.autograd.grad(mix, x, torch.randn_like(mix))
    for grad in grads:
        assert grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()


def test_a_read_does_not_keep_its_sources_alive_after_the_backward():
    """The op keeps its sources only as saved tensors, which autograd frees after the backward,
    even while the loss (and so the op's node) is still held, as in a notebook."""
    import gc
    import weakref

    x = torch.randn(4, 16, requires_grad=True)
    sources = [x * (i + 1) for i in range(3)]  # intermediates: only the graph could keep them
    refs = [weakref.ref(s) for s in sources]
    loss = depth_attn(sources, torch.randn(16), backend="numba")[0].sum()
    del sources
    loss.backward()
    gc.collect()
    assert all(r() is None for r in refs)
    assert loss.grad_fn is not None  # the graph itself is still there
