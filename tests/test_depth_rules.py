"""Hyper-Connections / mHC and DenseFormer as effective depth weights (attnres_probe.depth_rules).

Three kinds of check (docs/depth_rules.md):

1. Bookkeeping, float64: on a small random stack (stand-in sublayers: a norm and a two-layer
   tanh MLP, random weights), every read's input equals its effective coefficients times the
   recorded sources. Both sides are sums of products of the same numbers in a different order,
   so they differ by at most ``(gamma_K1 + gamma_K2) * mag`` elementwise, ``gamma_k = k u / (1 -
   k u)``, ``u = 2^-53``: ``K1`` rounding steps along the longest path of the stack, ``K2`` along
   the coefficient recursion and the recombination over the sources, and ``mag`` the same
   recombination with every weight and source replaced by its absolute value (the standard
   bound for a computed sum of products, composed along the path).
2. Parity with the ``hyper-connections`` package (0.4.11; skipped when it is not installed, the
   ``dev`` extra installs it): our layers given the package's parameters reproduce its outputs
   and the gradients w.r.t. the inputs and every parameter. Both float32 results are held to the
   float64 truth (our module in float64) by ``C u G kappa`` as the kernel tests are
   (tests/kernels/closeness.py): normwise relative RMS error, ``u = 2^-24``, ``C = 8``, ``G`` the
   rounding steps along the longest path (``sqrt(d)`` for the norm and the d-term projections,
   ``n + 1`` for a stream sum, ``2 (n + 1) / (1 - tau^2)`` for mHC's Sinkhorn rounds, tau their
   Birkhoff contraction ratio), and ``kappa`` the condition of the result, from the float64
   Jacobian J of all outputs w.r.t. all inputs and parameters theta: ``rms(|J| |theta| + |f|) /
   rms(f)`` for an output f, ``rms(|J_p|^T |g|) / rms(J_p^T g)`` for the gradient w.r.t. p under
   the upstream g. This kappa sees the Jacobian's entries, not the terms each is a sum of, so a
   gradient that is structurally 0 (its terms cancel for every input) is outside it: the stack
   test's stand-in sublayers have no norm for that reason, and it leaves out mHC's first and
   last H_res gradients (see there). Measured errors are 1-4 % of the bounds. Dynamic HC is also compared in
   float64 (the package runs in float64 as given); the package's mHC cannot be (it computes its
   weights and mixing in float32 whatever the input dtype), nor can our mHC with
   ``dynamic_input="flat"`` (the mHC paper's form; the package's mHC uses the HC paper's
   per-stream form).
3. Constraints and known answers: mHC's H_res is doubly stochastic to the Sinkhorn tolerance
   (computed from Birkhoff's contraction ratio), H_pre and H_post non-negative; PreNorm is the
   trivial rule (HC and DenseFormer at init); DenseFormer's dilation/period index sets and a
   hand-expanded two-block example.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

from attnres_probe.depth_rules import (
    DepthWeightedAverage,
    HyperConnection,
    StreamWeights,
    denseformer_read_coefficients,
    dwa_after,
    dwa_sources,
    expand_streams,
    from_package_layout,
    hyper_read_coefficients,
    normalise_coefficients,
    package_to_ours,
    read_labels,
    reduce_streams,
    sinkhorn,
    source_labels,
    to_package_layout,
)

U64, U32 = 2.0**-53, 2.0**-24
C_BOUND = 8.0
B, P, D = 2, 3, 16


def gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u)


def rel_rms(actual: torch.Tensor, truth: torch.Tensor) -> float:
    a, t = actual.detach().double(), truth.detach().double()
    return ((a - t).pow(2).mean().sqrt() / t.pow(2).mean().sqrt().clamp_min(1e-300)).item()


class TinySublayer(nn.Module):
    """A stand-in sublayer: y = W2 tanh(W1 RMSNorm(h)), or without the norm (``norm=False``).

    The float32 parity test of a whole stack uses no norm: a PreNorm sublayer is invariant to
    the scale of its input, so the true gradient w.r.t. anything that only scales a read (the
    first layer's H_pre, whose streams are equal copies of the embedding) is 0 up to the norm's
    eps, computed as a difference of large terms inside the Jacobian, a cancellation that
    ``kappa`` (which sees the Jacobian's entries, not their terms) does not measure.
    """

    def __init__(self, d: int, gen: torch.Generator, norm: bool = True):
        super().__init__()
        self.norm = norm
        self.w1 = nn.Parameter(torch.randn(2 * d, d, generator=gen) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(d, 2 * d, generator=gen) / math.sqrt(2 * d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return torch.tanh(h @ self.w1.T) @ self.w2.T


def randomise_hc(module: HyperConnection, gen: torch.Generator, scale: float = 0.5) -> None:
    """Move every parameter of one of our layers off its init (the dynamic terms made large
    enough to matter: scales of order one, projections of order 1/sqrt(width))."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith("_proj"):
                p.copy_(noise / math.sqrt(p.shape[0]))
            elif name.endswith("_scale"):
                p.copy_(scale * (1 + 0.2 * noise))
            else:
                p.add_(0.3 * noise)


# -- 1. bookkeeping ------------------------------------------------------------------------
RULES = {
    "hc-static-n2": dict(n=2, dynamic=False, mhc=False),
    "hc-static-n3": dict(n=3, dynamic=False, mhc=False),
    "hc-dynamic-n4": dict(n=4, dynamic=True, mhc=False),
    "hc-dynamic-flat-n3": dict(n=3, dynamic=True, mhc=False, dynamic_input="flat"),
    "mhc-static-n4": dict(n=4, dynamic=False, mhc=True),
    "mhc-dynamic-stream-n4": dict(n=4, dynamic=True, mhc=True, dynamic_input="stream"),
    "mhc-dynamic-flat-n2": dict(n=2, dynamic=True, mhc=True, dynamic_input="flat"),
}


def hc_stack(rule: dict, n_layers: int, seed: int, dtype=torch.float64, randomise: bool = True):
    gen = torch.Generator().manual_seed(seed)
    kw = dict(rule)
    n = kw.pop("n")
    L = 2 * n_layers
    hcs = [HyperConnection(D, n, l, **kw) for l in range(L)]
    subs = [TinySublayer(D, gen) for _ in range(L)]
    if randomise:
        for hc in hcs:
            randomise_hc(hc, gen)
    for m in (*hcs, *subs):
        m.to(dtype)
    emb = torch.randn(B, P, D, generator=gen, dtype=dtype)
    return hcs, subs, emb


def run_hc_stack(hcs, subs, emb):
    """Reads [B, P, L+1, d] (each sublayer's input, then the sum of the streams), sources
    [B, P, L+1, d] (the embedding, then each sublayer's output) and the weights used."""
    X = expand_streams(emb, hcs[0].n_streams)
    reads, sources, steps = [], [emb], []
    for hc, f in zip(hcs, subs):
        h, w = hc.read(X)
        y = f(h)
        X = hc.write(X, y, w)
        reads.append(h)
        sources.append(y)
        steps.append(w)
    reads.append(reduce_streams(X))
    return torch.stack(reads, -2), torch.stack(sources, -2), steps


def assert_reads_rebuilt(reads, sources, coef, coef_abs, k_stack: int, k_coef: int) -> float:
    """Every read equals coef @ sources within (gamma_K1 + gamma_K2) * |coef| @ |sources|."""
    rebuilt = torch.einsum("bprs,bpsd->bprd", coef, sources)
    mag = torch.einsum("bprs,bpsd->bprd", coef_abs, sources.abs())
    bound = (gamma(k_stack, U64) + gamma(k_coef, U64)) * mag
    err = (rebuilt - reads).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert (err <= bound).all(), f"a read differs from its coefficients x sources by {worst:.3g} x the bound"
    return worst


@pytest.mark.parametrize("name", list(RULES))
def test_hyper_coefficients_rebuild_every_read(name):
    n_layers = 3
    hcs, subs, emb = hc_stack(RULES[name], n_layers, seed=11)
    n, L = hcs[0].n_streams, 2 * n_layers
    with torch.no_grad():
        reads, sources, steps = run_hc_stack(hcs, subs, emb)
        coef = hyper_read_coefficients(steps)
        coef_abs = hyper_read_coefficients([StreamWeights(w.pre.abs(), w.res.abs(), w.post.abs()) for w in steps])
    assert coef.shape == (B, P, L + 1, L + 1)
    # sources a read cannot see are exactly 0
    assert torch.equal(coef.triu(1), torch.zeros_like(coef))
    # the random parameters moved the rule well off PreNorm (else the test would prove little)
    prenorm = torch.ones(L + 1, L + 1, dtype=coef.dtype).tril()
    # (a read whose random coefficients cancel has no normalised weights: NaN, left out)
    assert (normalise_coefficients(coef) - normalise_coefficients(prenorm)).abs().nan_to_num(0.0).max() > 0.05
    if RULES[name]["dynamic"]:  # per-token weights differ between tokens
        assert (coef[0, 0] - coef[1, 2]).abs().max() > 1e-3
    S = L + 1
    k_stack = L * (n + 1) + n  # each write: n products + the output; each read: n products
    assert_reads_rebuilt(reads, sources, coef, coef_abs, k_stack, k_stack + S)


@pytest.mark.parametrize("dilation,period", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (4, 4)])
def test_denseformer_coefficients_rebuild_every_read(dilation, period):
    n_blocks = 4
    gen = torch.Generator().manual_seed(5 + 7 * dilation + period)
    dwa = DepthWeightedAverage(n_blocks, dilation, period).double()
    with torch.no_grad():
        for w in dwa.alphas.values():
            w.add_(0.5 * torch.randn(w.shape, generator=gen, dtype=w.dtype))
    subs = [TinySublayer(D, gen).double() for _ in range(2 * n_blocks)]
    emb = torch.randn(B, P, D, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        z, xs, reads, sources = emb, [emb], [], [emb]
        for i in range(n_blocks):
            reads.append(z)
            a = subs[2 * i](z)
            r = z + a
            reads.append(r)
            m = subs[2 * i + 1](r)
            x = r + m
            xs.append(x)
            sources += [a, m]
            z = dwa(xs, i)
        reads.append(z)
        reads, sources = torch.stack(reads, -2), torch.stack(sources, -2)
        coef = dwa.read_coefficients((B, P))
        alphas_abs = {int(k): v.abs() for k, v in dwa.alphas.items()}
        coef_abs = denseformer_read_coefficients(alphas_abs, n_blocks, dilation, period).expand(B, P, -1, -1)
    S = 2 * n_blocks + 1
    assert coef.shape == (B, P, S, S)
    assert torch.equal(coef.triu(1), torch.zeros_like(coef))
    prenorm = torch.ones(S, S, dtype=coef.dtype).tril()
    assert (coef[0, 0] - prenorm).abs().max() > 0.05
    k_stack = sum(2 + (len(dwa_sources(i, dilation)) if dwa_after(i, period) else 0) for i in range(n_blocks))
    assert_reads_rebuilt(reads, sources, coef, coef_abs, k_stack, k_stack + S)


# -- 3. known answers ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4])
def test_hc_at_init_is_prenorm(n):
    """Static and dynamic HC at init: every stream is the PreNorm running sum, every read the
    PreNorm read (all coefficients one); the final read sums n identical streams (n each)."""
    n_layers = 2
    L = 2 * n_layers
    for dynamic in (False, True):
        hcs, subs, emb = hc_stack(dict(n=n, dynamic=dynamic, mhc=False), n_layers, seed=3, randomise=False)
        with torch.no_grad():
            reads, sources, steps = run_hc_stack(hcs, subs, emb)
            coef = hyper_read_coefficients(steps)
        expected = torch.ones(L + 1, L + 1, dtype=torch.float64).tril()
        expected[L] = n
        assert torch.equal(coef, expected.expand(B, P, -1, -1))
        uniform = torch.full((L + 1,), 1.0 / (L + 1), dtype=torch.float64)
        assert torch.allclose(normalise_coefficients(coef)[..., L, :], uniform, rtol=0, atol=4 * U64)
        # and the forward is PreNorm's: h_l = sum_{j <= l} v_j
        prenorm = torch.cumsum(sources, dim=-2)
        bound = gamma(L * (n + 1) + n, U64) * torch.cumsum(sources.abs(), dim=-2) * n
        assert ((reads[..., :L, :] - prenorm[..., :L, :]).abs() <= bound[..., :L, :]).all()


def test_mhc_at_init_known_answer():
    """mHC at init (the package's init: logits e_k, I, 1): H_res = Sinkhorn(exp(I)) is symmetric,
    so the streams stay equal; each holds embed + 2 sigmoid(1) * every output, and the read
    multiplies by sum(H_pre) = sigmoid(1) + (n - 1) / 2."""
    n, n_layers = 4, 2
    L = 2 * n_layers
    hcs, subs, emb = hc_stack(dict(n=n, dynamic=True, mhc=True), n_layers, seed=4, randomise=False)
    with torch.no_grad():
        _, _, steps = run_hc_stack(hcs, subs, emb)
        coef = hyper_read_coefficients(steps)[0, 0]
    s1 = 1 / (1 + math.exp(-1.0))
    stream = torch.full((L + 1,), 2 * s1, dtype=torch.float64)
    stream[0] = 1.0
    expected = torch.stack([(s1 + (n - 1) / 2) * stream * (torch.arange(L + 1) <= r) for r in range(L)] + [n * stream])
    assert torch.allclose(coef, expected, rtol=64 * U64, atol=0)
    e = math.e
    res = steps[0].res[0, 0]
    expected_res = torch.full((n, n), 1 / (e + n - 1), dtype=torch.float64) + torch.eye(n, dtype=torch.float64) * (e - 1) / (e + n - 1)
    assert torch.allclose(res, expected_res, rtol=64 * U64, atol=0)


def test_denseformer_identity_init_is_prenorm():
    for dilation, period in [(1, 1), (2, 1), (2, 3)]:
        dwa = DepthWeightedAverage(5, dilation, period)
        coef = dwa.read_coefficients()
        assert torch.equal(coef, torch.ones(11, 11).tril())


def test_denseformer_index_sets_follow_the_authors_package():
    """DWAModules: the DWA after block i has (i + 1 + k) // k weights over the outputs of residue
    (i + 1) % k, the newest last, identity init; it runs when (i + 1) % p == 0."""
    assert [dwa_sources(i, 2) for i in range(4)] == [[1], [0, 2], [1, 3], [0, 2, 4]]
    assert [dwa_sources(i, 3) for i in range(5)] == [[1], [2], [0, 3], [1, 4], [2, 5]]
    for k in (1, 2, 3, 4):
        assert all(len(dwa_sources(i, k)) == (i + 1 + k) // k for i in range(12))
    assert [dwa_after(i, 3) for i in range(6)] == [False, False, True, False, False, True]
    dwa = DepthWeightedAverage(6, 2, 3)
    assert sorted(dwa.alphas) == ["2", "5"]
    assert dwa.alphas["2"].tolist() == [0.0, 1.0] and dwa.alphas["5"].tolist() == [0.0, 0.0, 0.0, 1.0]
    # without a DWA after block i, z_{i+1} is the block's output, whatever the earlier outputs
    xs = [torch.full((1, 1, 2), float(j)) for j in range(3)]
    assert torch.equal(dwa(xs, 1), xs[2])
    with pytest.raises(ValueError):
        dwa(xs, 0)


def test_denseformer_two_blocks_by_hand():
    a0, a1, b0, b1, b2 = 0.3, 0.9, -0.2, 0.5, 1.1
    alphas = {0: torch.tensor([a0, a1], dtype=torch.float64), 1: torch.tensor([b0, b1, b2], dtype=torch.float64)}
    coef = denseformer_read_coefficients(alphas, 2)
    z1 = [a0 + a1, a1, a1, 0, 0]  # a0 x0 + a1 (x0 + a_0 + m_0)
    x2 = [a0 + a1, a1, a1, 1, 1]
    z2 = [b0 + b1 + b2 * x2[0], b1 + b2 * a1, b1 + b2 * a1, b2, b2]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], z1, [a0 + a1, a1, a1, 1, 0], z2], dtype=torch.float64
    )
    assert torch.allclose(coef, expected, rtol=0, atol=8 * U64)
    with pytest.raises(ValueError):
        denseformer_read_coefficients({0: alphas[0]}, 2)  # the DWA after block 1 is missing


def test_labels_and_normalisation():
    assert source_labels(2) == ["embed", "L0.attn", "L0.mlp", "L1.attn", "L1.mlp"]
    assert read_labels(2) == ["L0.attn", "L0.mlp", "L1.attn", "L1.mlp", "final"]
    c = torch.tensor([[2.0, 0.0, 0.0], [1.0, -1.0, 0.0], [1.0, 2.0, 1.0]])
    w = normalise_coefficients(c)
    assert torch.equal(w[0], torch.tensor([1.0, 0.0, 0.0]))
    assert w[1].isnan().all()
    assert torch.allclose(w[2], torch.tensor([0.25, 0.5, 0.25]))


def test_layout_round_trip_and_state_check():
    X = torch.arange(B * P * 3 * D, dtype=torch.float32).reshape(B, P, 3, D)
    packed = to_package_layout(X)
    assert packed.shape == (B * 3, P, D)
    assert torch.equal(packed[1 * 3 + 2], X[1, :, 2])  # '(b s)': batch-major
    assert torch.equal(from_package_layout(packed, 3), X)
    with pytest.raises(ValueError):
        HyperConnection(D, 4, 0).weights(X)


# -- 3. mHC's constraints ----------------------------------------------------------------------
def birkhoff_tau(log_k: torch.Tensor) -> torch.Tensor:
    """Birkhoff's contraction ratio tanh(Delta / 4) of each positive matrix exp(log_k) [..., n, n],
    Delta = max over i, j, k, l of log(K_ik K_jl / (K_jk K_il)). Row and column scalings leave it
    unchanged, so Sinkhorn's input and output have the same ratio."""
    L = log_k.double()
    cross = L[..., :, None, :, None] + L[..., None, :, None, :] - L[..., None, :, :, None] - L[..., :, None, None, :]
    return torch.tanh(cross.flatten(-4).amax(-1) / 4)


def sinkhorn_row_tolerance(logits: torch.Tensor, iters: int, u: float) -> torch.Tensor:
    """Per matrix [...]: how far a row sum of :func:`sinkhorn`'s result may be from one.

    With K = exp(logits), b_0 = 1, a_k = 1 / (K b_{k-1}) (row step), b_k = 1 / (K^T a_k) (column
    step), the result diag(a_k) K diag(b_k) has columns summing to one and rows r = K b_k / K
    b_{k-1}. K contracts Hilbert's projective metric d_H by tau = tanh(Delta / 4), Delta =
    max log(K_ik K_jl / (K_jk K_il)) (Birkhoff), and x -> 1/x is an isometry, so d_H(r, 1) <=
    tau^(2k - 1) d_H(b_1, 1) =: delta; the r average to one, so |r_i - 1| <= exp(delta) - 1.
    Rounding adds gamma_{2 iters (n + 1)}.
    """
    L = logits.double()
    n = L.shape[-1]
    tau = birkhoff_tau(L)
    K = L.exp()
    a1 = 1 / K.sum(-1)
    b1 = 1 / torch.einsum("...ts,...t->...s", K, a1)
    d_h = b1.log().amax(-1) - b1.log().amin(-1)
    delta = tau ** (2 * iters - 1) * d_h
    return torch.expm1(delta) + gamma(2 * iters * (n + 1), u)


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_sinkhorn_is_doubly_stochastic_to_its_tolerance(iters):
    gen = torch.Generator().manual_seed(iters)
    n = 4
    logits = 1.5 * torch.randn(64, n, n, generator=gen, dtype=torch.float64)
    for dtype, u in ((torch.float64, U64), (torch.float32, U32)):
        m = sinkhorn(logits.to(dtype), iters).double()
        assert (m > 0).all()
        col = (m.sum(-2) - 1).abs()
        assert (col <= gamma(2 * n + 1, u)).all(), f"{dtype}: column sums off by {col.max():.3g}"
        rows = (m.sum(-1) - 1).abs().amax(-1)
        tol = sinkhorn_row_tolerance(logits, iters, u)
        assert (rows <= tol).all(), f"{dtype}: row sums off by {(rows / tol).max():.3g} x the Sinkhorn tolerance"
    if iters == 1:  # one round leaves the rows visibly off: the check above is not vacuous
        assert (sinkhorn(logits, 1).sum(-1) - 1).abs().max() > 1e-2


@pytest.mark.parametrize("dynamic_input", ["stream", "flat"])
def test_mhc_weights_obey_the_manifold(dynamic_input):
    gen = torch.Generator().manual_seed(8)
    n = 4
    hc = HyperConnection(D, n, 2, dynamic=True, mhc=True, dynamic_input=dynamic_input).double()
    randomise_hc(hc, gen, scale=2.0)
    X = 2 * torch.randn(B, P, n, D, generator=gen, dtype=torch.float64)
    w = hc.weights(X)
    assert ((w.pre > 0) & (w.pre < 1)).all() and ((w.post > 0) & (w.post < 2)).all() and (w.res > 0).all()
    assert w.pre.std() > 0.05 and w.post.std() > 0.05  # per-token weights that vary
    col = (w.res.sum(-2) - 1).abs()
    assert (col <= gamma(2 * n + 1, U64)).all()
    # the logits Sinkhorn saw, rebuilt: they are the pre-activations of H_res
    pre_d, res_d, post_d = hc._dynamic_terms(X, torch.float64)
    logits = res_d * hc.res_scale + hc.res_bias
    rows = (w.res.sum(-1) - 1).abs().amax(-1)
    assert (rows <= sinkhorn_row_tolerance(logits.detach(), hc.sinkhorn_iters, U64)).all()


# -- 2. parity with the hyper-connections package ----------------------------------------------
def conditions(fn, inputs: dict[str, torch.Tensor], upstream: dict[str, torch.Tensor]):
    """kappa of every output of ``fn(inputs) -> dict`` and of the gradient w.r.t. every input
    under ``upstream``, from the float64 Jacobian (module docstring)."""
    names = list(inputs)
    shapes = [inputs[k].shape for k in names]
    sizes = [inputs[k].numel() for k in names]
    theta = torch.cat([inputs[k].detach().double().reshape(-1) for k in names])
    out_names: list[str] = []

    def flat(th):
        parts = {k: p.view(s) for k, p, s in zip(names, th.split(sizes), shapes)}
        out = fn(parts)
        out_names[:] = list(out)
        return torch.cat([out[k].reshape(-1) for k in out_names])

    f = flat(theta).detach()
    # vectorised (vmap) Jacobian: through the PyTorch Sinkhorn (the Numba kernel's own backward
    # is checked against it in tests/kernels/test_sinkhorn.py); the same function in float64
    saved = os.environ.get("ATTNRES_BACKEND")
    os.environ["ATTNRES_BACKEND"] = "torch"
    try:
        J = torch.autograd.functional.jacobian(flat, theta, vectorize=True)
    finally:
        if saved is None:
            del os.environ["ATTNRES_BACKEND"]
        else:
            os.environ["ATTNRES_BACKEND"] = saved
    out_sizes = [upstream[k].numel() for k in out_names]
    gbar = torch.cat([upstream[k].double().reshape(-1) for k in out_names])

    def rms(t):
        return t.pow(2).mean().sqrt().item()

    kappa = {}
    row = 0
    for k, s in zip(out_names, out_sizes):
        rows = slice(row, row + s)
        mag = J[rows].abs() @ theta.abs() + f[rows].abs()
        kappa[k] = max(1.0, rms(mag) / max(rms(f[rows]), 1e-300))
        row += s
    g = J.T @ gbar
    g_mag = J.T.abs() @ gbar.abs()
    col = 0
    for k, s in zip(names, sizes):
        cols = slice(col, col + s)
        kappa["d " + k] = max(1.0, rms(g_mag[cols]) / max(rms(g[cols]), 1e-300))
        col += s
    return kappa


def growth(n: int, d: int, tau: float | None = None) -> float:
    """G of one hyper-connection: ``sqrt(d)`` for the norm and the d-term projections, ``n + 1``
    for a stream sum (and the output's term); for mHC, Sinkhorn: each round's two normalisations
    commit ``2 (n + 1)`` roundings, and every later round contracts them by ``tau^2`` (Birkhoff's
    ratio of the H_res the layer used, :func:`birkhoff_tau`), so all rounds together add at most
    ``2 (n + 1) / (1 - tau^2)``."""
    return math.sqrt(d) + n + 1 + (0.0 if tau is None else 2 * (n + 1) / (1 - tau**2))


def check_against_truth(results: dict[str, dict[str, torch.Tensor]], truth, kappa, G, u, label, skip=()):
    """Every result set meets C u G kappa against the float64 truth, quantity by quantity."""
    margins = {}
    for who, res in results.items():
        for q, t in truth.items():
            if q in skip:
                continue
            bound = C_BOUND * u * G * kappa[q]
            err = rel_rms(res[q], t)
            margins[(who, q)] = err / bound
            assert err <= bound, f"{label}: {who} {q}: relative RMS error {err:.3g} > C u G kappa = {bound:.3g}"
    return margins


def report_margins(margins) -> None:
    """With ATTNRES_DEPTH_RULES_MARGINS set, print the largest error / bound of each party."""
    if os.environ.get("ATTNRES_DEPTH_RULES_MARGINS"):
        for who in sorted({w for w, _ in margins}):
            q, m = max(((q, m) for (w, q), m in margins.items() if w == who), key=lambda t: t[1])
            print(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}: {who}: max error/bound {m:.3f} ({q})")


def package_module(mhc: bool, n: int, layer_index: int, tanh: bool = True):
    hc_pkg = pytest.importorskip("hyper_connections")
    if mhc:
        return hc_pkg.ManifoldConstrainedHyperConnections(n, dim=D, layer_index=layer_index)
    return hc_pkg.HyperConnections(n, dim=D, layer_index=layer_index, tanh=tanh)


def randomise_package(pkg, gen: torch.Generator, dynamic: bool) -> None:
    """Random parameters in the package's module; a static comparison keeps its dynamic
    projections at 0, which makes its weights static (tanh(0) = 0, 0 * scale = 0)."""
    with torch.no_grad():
        for name, p in pkg.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name in ("dynamic_alpha_fn", "dynamic_beta_fn"):
                p.copy_(noise / math.sqrt(D) if dynamic else torch.zeros_like(p))
            elif "scale" in name:
                p.copy_(0.5 * (1 + 0.2 * noise))
            elif name == "norm.gamma":  # on a 2^-10 grid: gamma + 1 is exact in float32, so the
                p.copy_(torch.round(0.3 * noise * 1024) / 1024)  # float64 runs see the same gain
            else:
                p.add_(0.3 * noise)


def ours_from_package(pkg, n, layer_index, dynamic, mhc, tanh=True) -> HyperConnection:
    ours = HyperConnection(D, n, layer_index, dynamic, mhc, dynamic_input="stream", tanh=tanh, norm_eps=0.0)
    mapped = package_to_ours({k: v.detach() for k, v in pkg.named_parameters()}, n, mhc)
    keep = dict(ours.named_parameters())
    dropped = set(mapped) - set(keep)
    assert dropped == (set() if dynamic else {"norm_weight", "pre_proj", "res_proj", "post_proj", *(
        ("pre_scale", "res_scale", "post_scale") if mhc else ("alpha_scale", "beta_scale"))})
    with torch.no_grad():
        for k, p in keep.items():
            assert mapped[k].shape == p.shape, k
            p.copy_(mapped[k])
    return ours


LAYER_VARIANTS = {
    "hc-static": dict(dynamic=False, mhc=False),
    "hc-dynamic": dict(dynamic=True, mhc=False),
    "hc-dynamic-no-tanh": dict(dynamic=True, mhc=False, tanh=False),
    "mhc-static": dict(dynamic=False, mhc=True),
    "mhc-dynamic": dict(dynamic=True, mhc=True),
}


@pytest.mark.parametrize("layer_index", [0, 5])
@pytest.mark.parametrize("mhc", [False, True])
def test_init_matches_package(mhc, layer_index):
    n = 4
    pkg = package_module(mhc, n, layer_index)
    ours = HyperConnection(D, n, layer_index, dynamic=True, mhc=mhc, dynamic_input="stream")
    mapped = package_to_ours(dict(pkg.named_parameters()), n, mhc)
    mine = dict(ours.named_parameters())
    assert set(mapped) == set(mine)
    for k, v in mapped.items():
        assert torch.equal(v.detach(), mine[k].detach()), k
    assert mine["pre_bias"].argmax().item() == layer_index % n


def layer_outputs(module, X, y, params=None):
    """(h, X') of one of our layers, optionally with the parameters given (functional)."""
    if params is not None:
        step = torch.func.functional_call(module, params, (X, lambda h: y))
    else:
        step = module(X, lambda h: y)
    return {"h": step.read, "X'": step.state}


def package_outputs(pkg, X, y, n):
    h, add = pkg(to_package_layout(X))
    return {"h": h, "X'": from_package_layout(add(y), n)}


def with_grads(outs, inputs: dict[str, torch.Tensor], upstream):
    grads = torch.autograd.grad([outs[k] for k in upstream], list(inputs.values()),
                                [upstream[k].to(outs[k].dtype) for k in upstream], allow_unused=True)
    res = {k: v.detach() for k, v in outs.items()}
    for k, g in zip(inputs, grads):
        res["d " + k] = torch.zeros_like(inputs[k]) if g is None else g
    return res


@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_layer_matches_package(variant):
    """One layer, float32: outputs, input gradients and every parameter's gradient, ours and the
    package's, each within C u G kappa of the float64 truth; HC also in float64 against the
    package in float64 (mHC's package code computes in float32 even then)."""
    cfg = LAYER_VARIANTS[variant]
    dynamic, mhc, tanh = cfg["dynamic"], cfg["mhc"], cfg.get("tanh", True)
    n, layer_index = 4, 2
    gen = torch.Generator().manual_seed(21)
    pkg = package_module(mhc, n, layer_index, tanh)
    randomise_package(pkg, gen, dynamic)
    ours = ours_from_package(pkg, n, layer_index, dynamic, mhc, tanh)
    X = torch.randn(B, P, n, D, generator=gen)
    y = torch.randn(B, P, D, generator=gen)
    up = {"h": torch.randn(B, P, D, generator=gen, dtype=torch.float64),
          "X'": torch.randn(B, P, n, D, generator=gen, dtype=torch.float64)}

    def run_ours(module, dtype):
        Xl, yl = X.to(dtype).requires_grad_(), y.to(dtype).requires_grad_()
        params = dict(module.named_parameters())
        return with_grads(layer_outputs(module, Xl, yl), {"X": Xl, "y": yl, **params}, up)

    def run_package(module, dtype):
        Xl, yl = X.to(dtype).requires_grad_(), y.to(dtype).requires_grad_()
        params = dict(module.named_parameters())
        res = with_grads(package_outputs(module, Xl, yl, n), {"X": Xl, "y": yl, **params}, up)
        mapped = package_to_ours({k[2:]: v for k, v in res.items() if k[2:] in params}, n, mhc, grads=True)
        out = {k: v for k, v in res.items() if k in ("h", "X'", "d X", "d y")}
        out.update({"d " + k: v for k, v in mapped.items() if hasattr(ours, k)})
        return out

    ours64 = copy.deepcopy(ours).double()
    truth = run_ours(ours64, torch.float64)
    inputs = {"X": X.double(), "y": y.double(), **{k: v.detach() for k, v in ours64.named_parameters()}}

    def fn(parts):
        params = {k: v for k, v in parts.items() if k not in ("X", "y")}
        return layer_outputs(ours64, parts["X"], parts["y"], params)

    kappa = conditions(fn, inputs, up)
    tau = birkhoff_tau(ours64.weights(X.double()).res.log()).max().item() if mhc else None
    G = growth(n, D, tau)
    results = {"ours": run_ours(ours, torch.float32), "package": run_package(pkg, torch.float32)}
    assert set(results["package"]) == set(truth)
    margins = check_against_truth(results, truth, kappa, G, U32, variant + " float32")
    report_margins(margins)
    # the comparison is not vacuous: the two float32 runs are not bit-identical to the truth
    assert max(margins.values()) > 0
    if not mhc:
        pkg64 = copy.deepcopy(pkg).double()
        check_against_truth({"package": run_package(pkg64, torch.float64)}, truth, kappa, G, U64, variant + " float64")


@pytest.mark.parametrize("mhc", [False, True])
def test_stack_matches_package(mhc):
    """A 4-sublayer stack with the package's expand and reduce (n copies in, sum out) against
    ours: the final read and the gradients w.r.t. the embedding, every hyper-connection
    parameter and every stand-in sublayer's, float32 against our float64 truth, G summed along
    the stack."""
    hc_pkg = pytest.importorskip("hyper_connections")
    n, L = 4, 4
    gen = torch.Generator().manual_seed(31 + mhc)
    pkgs = [package_module(mhc, n, l) for l in range(L)]
    for p in pkgs:
        randomise_package(p, gen, dynamic=True)
    ours = nn.ModuleList([ours_from_package(p, n, l, True, mhc) for l, p in enumerate(pkgs)])
    subs = nn.ModuleList([TinySublayer(D, gen, norm=False) for _ in range(L)])
    emb = torch.randn(B, P, D, generator=gen)
    up = {"out": torch.randn(B, P, D, generator=gen, dtype=torch.float64)}
    getter = hc_pkg.mc_get_expand_reduce_stream_functions if mhc else hc_pkg.get_expand_reduce_stream_functions
    expand, reduce = getter(n)

    def forward_ours(hcs, sl, e):
        X = expand_streams(e, n)
        for hc, f in zip(hcs, sl):
            X = hc(X, f).state
        return {"out": reduce_streams(X)}

    def forward_package(hcs, sl, e):
        r = expand(e)
        for hc, f in zip(hcs, sl):
            h, add = hc(r)
            r = add(f(h))
        return {"out": reduce(r)}

    def param_dict(hcs, sl):
        return {
            **{f"{l}.{k}": v for l, hc in enumerate(hcs) for k, v in hc.named_parameters()},
            **{f"s{l}.{k}": v for l, f in enumerate(sl) for k, v in f.named_parameters()},
        }

    def run(forward, hcs, sl, dtype, package):
        e = emb.to(dtype).requires_grad_()
        res = with_grads(forward(hcs, sl, e), {"emb": e, **param_dict(hcs, sl)}, up)
        if not package:
            return res
        out = {k: v for k, v in res.items() if not k[2:3].isdigit()}  # output, d emb, d s{l}.*
        for l in range(L):
            g = {k[len(f"d {l}."):]: v for k, v in res.items() if k.startswith(f"d {l}.")}
            for k, v in package_to_ours(g, n, mhc, grads=True).items():
                out[f"d {l}.{k}"] = v
        return out

    ours64, subs64 = copy.deepcopy(ours).double(), copy.deepcopy(subs).double()
    truth = run(forward_ours, ours64, subs64, torch.float64, False)
    inputs = {"emb": emb.double(), **{k: v.detach() for k, v in param_dict(ours64, subs64).items()}}

    def fn(parts):
        X = expand_streams(parts["emb"], n)
        for l, (hc, f) in enumerate(zip(ours64, subs64)):
            mine = {k[len(f"{l}."):]: v for k, v in parts.items() if k.startswith(f"{l}.")}
            sub = {k[len(f"s{l}."):]: v for k, v in parts.items() if k.startswith(f"s{l}.")}
            X = torch.func.functional_call(hc, mine, (X, lambda h: torch.func.functional_call(f, sub, (h,)))).state
        return {"out": reduce_streams(X)}

    kappa = conditions(fn, inputs, up)
    tau = None
    if mhc:
        with torch.no_grad():
            X, taus = expand_streams(emb.double(), n), []
            for hc, f in zip(ours64, subs64):
                step = hc(X, f)
                X = step.state
                taus.append(birkhoff_tau(step.weights.res.log()).max().item())
        tau = max(taus)
    G = L * (growth(n, D, tau) + 2 * math.sqrt(D)) + n  # each layer, each stand-in sublayer, the reduce
    pkg_res = run(forward_package, pkgs, subs, torch.float32, True)
    results = {"ours": run(forward_ours, ours, subs, torch.float32, False), "package": pkg_res}
    assert set(pkg_res) == set(truth), sorted(set(pkg_res) ^ set(truth))
    # mHC: the first layer's and the last layer's H_res gradients are structurally 0 and
    # float32 returns rounding noise for them (both implementations alike), so they are left out.
    # The first layer's streams are equal copies of the embedding, so only the row sums of its
    # H_res matter, and Sinkhorn makes those 1 up to its residual (about 1e-18 relative here);
    # the last layer feeds the sum of the streams, which sees only the column sums of its
    # H_res, which the final column normalisation makes 1 for any logits.
    skip = {f"d {l}.{k}" for l in (0, L - 1) for k in ("res_bias", "res_proj", "res_scale")} if mhc else set()
    scale = truth["d emb"].pow(2).mean().sqrt()
    for q in skip:
        assert truth[q].pow(2).mean().sqrt() <= 1e-12 * scale, q
    margins = check_against_truth(results, truth, kappa, G, U32, ("mhc" if mhc else "hc") + " stack float32", skip)
    report_margins(margins)
