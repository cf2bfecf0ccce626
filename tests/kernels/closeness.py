"""Tolerances from the arithmetic, shared by the kernel tests (docs/design.md, "Kernels and backends").

Every kernel test compares a backend's result with the float64 reference on the same inputs
(the truth; a float32 reference rounds too) and accepts a normwise relative error

    rms(result - truth) / rms(truth)  <=  C * u * G * kappa

stated once here, for every output and gradient of depth attention:

- ``u`` is the unit roundoff of the compute dtype (2^-24 for float32, 2^-53 for float64).
- ``G = (1 + z_max) * (sqrt(d) + S)``: a logit ``z_i = r_i (q . v_i)`` is a d-term dot product
  scaled by an inverse RMS, whose rounding error grows like ``sqrt(d) u`` times the logit's
  scale, and ``exp`` turns an absolute logit error ``e`` into a relative weight error ``e``, so
  the weights, lse and mixture carry ``u (1 + z_max)`` per term; a row of S sources adds up to
  S such terms (softmax normaliser, mixture, the backward's ``D = sum_j alpha_j dalpha_j``).
  ``z_max`` is the largest |logit| of the inputs: logits of order 100 (near one-hot weights)
  are a hundred times as sensitive as logits of order one, on every machine.
- ``kappa`` is the condition number of the sum that forms the quantity: the sum of the
  magnitudes of its terms over the magnitude of the sum (:func:`conditions`). It is 1 for
  the forward outputs; for a source's gradient, ``alpha dh + dz r q - dz z r v / d`` nearly
  cancels when d is small (the RMS makes the logit scale-invariant); the query and gain
  gradients are sums over every row and source with mixed signs.
- ``C = 8`` covers the constants of these first-order bounds. Measured over the Numba test
  grid (S 1..33, d 1..384, logits of order 1 and 100), the float32 reference itself reaches
  at most a third of the bound and the Numba kernels the same, on the host CPU target and
  with ``NUMBA_CPU_NAME=generic``: the worst case is d = 1, where the RMS leaves only the
  logit's sign and a source's gradient cancels to ``eps / (v^2 + eps)`` of its terms (kappa
  about 10^6); every other quantity stays below a tenth of its bound.

A test passes only when the float32 reference also meets the bound (so the bound is what the
arithmetic allows, not what one kernel happens to reach).
"""

from __future__ import annotations

import json
import math
import os

import torch

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
C = 8.0
OUTPUTS = ("mix", "lse", "weights", "logits")
GRADS = ("d sources", "d query", "d gain")


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """rms(actual - expected) / rms(expected), in float64 (0 for empty tensors)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if e.numel() == 0:
        return 0.0
    diff = (a - e).pow(2).mean().sqrt()
    return (diff / e.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def growth(z_max: float, n_src: int, d: int) -> float:
    """G = (1 + z_max) (sqrt(d) + S): how the rounding of one read grows (module docstring)."""
    return (1.0 + z_max) * (math.sqrt(d) + n_src)


def conditions(sources, query, gain, upstream, eps: float = 1e-6) -> dict[str, float]:
    """Condition numbers ``kappa`` of every output and gradient of depth attention, in float64.

    Args:
        sources: [S, *batch, d]; query, gain: [d] (gain may be None).
        upstream: the upstream gradients of (mix, lse, weights, logits), None where absent.

    Returns:
        kappa per quantity name (:data:`OUTPUTS`, :data:`GRADS`), and ``"z_max"``.
    """
    v = sources.detach().double().flatten(1, -2)  # (S, M, d)
    S, M, d = v.shape
    q = query.detach().double() * (1 if gain is None else gain.detach().double())
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # (S, M)
    dot = v @ q  # (S, M)
    z = dot * r
    alpha = torch.softmax(z, 0)
    ups = [None if u is None else u.detach().double() for u in upstream]
    dh = ups[0].reshape(M, d) if ups[0] is not None else torch.zeros(M, d, dtype=torch.float64)
    dlse = ups[1].reshape(M) if ups[1] is not None else torch.zeros(M, dtype=torch.float64)
    dw = ups[2].reshape(M, S).T if ups[2] is not None else torch.zeros(S, M, dtype=torch.float64)
    dz_up = ups[3].reshape(M, S).T if ups[3] is not None else torch.zeros(S, M, dtype=torch.float64)
    da = (v * dh).sum(-1) + dw  # (S, M)
    D = (alpha * da).sum(0)
    dz = alpha * (da - D + dlse) + dz_up
    dz_mag = alpha * (da.abs() + D.abs() + dlse.abs()) + dz_up.abs()  # magnitude of dz's terms
    # dv_i = alpha_i dh + dz_i r_i q - dz_i z_i r_i v_i / d
    dv = alpha[..., None] * dh + (dz * r)[..., None] * q - (dz * z * r / d)[..., None] * v
    dv_mag = (alpha[..., None] * dh).abs() + (dz_mag * r)[..., None] * q.abs() + (dz_mag * (z * r).abs() / d)[..., None] * v.abs()
    # dq = sum over rows and sources of (dz r v) (the chain rule through r adds nothing to q)
    dq = ((dz * r)[..., None] * v).sum((0, 1))
    dq_mag = ((dz_mag * r)[..., None] * v.abs()).sum((0, 1))

    def kappa(mag: torch.Tensor, val: torch.Tensor) -> float:
        return max(1.0, (mag.pow(2).mean().sqrt() / val.pow(2).mean().sqrt().clamp_min(1e-300)).item())

    out = {name: 1.0 for name in OUTPUTS}
    finite = torch.isfinite(z)
    out["z_max"] = z[finite].abs().max().item() if finite.any() else 0.0
    out["d sources"] = kappa(dv_mag[torch.isfinite(dv_mag)], dv[torch.isfinite(dv)])
    out["d query"] = out["d gain"] = kappa(dq_mag[torch.isfinite(dq_mag)], dq[torch.isfinite(dq)])
    return out


def tolerance(dtype: torch.dtype, name: str, cond: dict[str, float], n_src: int, d: int) -> float:
    """The bound ``C u G kappa`` for quantity ``name`` computed in ``dtype`` (module docstring)."""
    return C * UNIT_ROUNDOFF[dtype] * growth(cond["z_max"], n_src, d) * cond[name]


def assert_within(actual: torch.Tensor, truth: torch.Tensor, bound: float, name: str) -> None:
    """Shapes equal, NaN at the same places, and the relative RMS error of the rest within ``bound``."""
    assert actual.shape == truth.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(truth.shape)}"
    a, t = actual.detach().double().cpu(), truth.detach().double().cpu()
    assert torch.equal(a.isnan(), t.isnan()), f"{name}: NaN positions differ"
    keep = torch.isfinite(t)
    assert torch.equal(a[~keep & ~t.isnan()], t[~keep & ~t.isnan()]), f"{name}: infinities differ"
    err = relative_rms(a[keep], t[keep])
    record_margin(name, err, bound)
    assert err <= bound, f"{name}: relative RMS error {err:.3g} exceeds the bound {bound:.3g} (C u G kappa)"


def record_margin(name: str, err: float, bound: float) -> None:
    """Append (test, quantity, error, bound) to the JSON-lines file named by
    ``ATTNRES_NUMERICS_LOG``, if set: ``benchmarks/numerics_matrix.py`` collects the margins
    (error / bound) of every checked quantity over CPU targets and thread counts."""
    path = os.environ.get("ATTNRES_NUMERICS_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"test": test, "quantity": name, "error": err, "bound": bound}) + "\n")


def assert_bounded(err: float, bound: float, name: str) -> None:
    """``err <= bound``, with the margin recorded (:func:`record_margin`)."""
    record_margin(name, err, bound)
    assert err <= bound, f"{name}: relative RMS error {err:.3g} exceeds the bound {bound:.3g} (C u G kappa)"


def check_outputs_consistent(sources, query, gain, mix, lse, weights, logits, eps: float = 1e-6) -> None:
    """The float32 outputs of one call agree with each other within the op's a-priori bounds:
    ``weights = exp(logits - lse)`` (the weights' bound) and ``sum_i weights_i v_i = mix`` (the
    mixture's bound), kappa and z_max from the float64 inputs."""
    cond = conditions(sources, query, gain, [None] * 4, eps)
    S, d = sources.shape[0], sources.shape[-1]
    assert_within(torch.exp(logits - lse.unsqueeze(-1)), weights, tolerance(torch.float32, "weights", cond, S, d), "exp(logits - lse) vs weights")
    rebuilt = torch.einsum("...s,s...d->...d", weights, sources)
    assert_within(rebuilt, mix, tolerance(torch.float32, "mix", cond, S, d), "weights . sources vs mix")


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _grads(outs, inputs, upstream):
    wanted = [t for t in inputs if t is not None]
    pairs = [(o, u) for o, u in zip(outs, upstream) if u is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], wanted, [u.to(o.dtype) for o, u in pairs])
    return list(grads)


def upstream_for(sources, wanted=OUTPUTS, seed: int = 1) -> list[torch.Tensor | None]:
    """Random float64 upstream gradients for the outputs named in ``wanted`` (None for the others)."""
    g = torch.Generator().manual_seed(seed)
    S, batch = sources.shape[0], tuple(sources.shape[1:-1])
    shapes = {"mix": (*batch, sources.shape[-1]), "lse": batch, "weights": (*batch, S), "logits": (*batch, S)}
    return [torch.randn(shapes[n], generator=g, dtype=torch.float64) if n in wanted else None for n in OUTPUTS]


def op_results(op, sources, query, gain, upstream, dtype: torch.dtype | None = None):
    """(mix, lse, weights, logits, d sources, d query[, d gain]) of ``op(sources, query, gain)``
    (which returns the four outputs), with the inputs cast to ``dtype`` (default: as given)."""
    cast = [None if t is None else (t if dtype is None else t.to(dtype)) for t in (sources, query, gain)]
    x, q, g = _leaves(*cast)
    outs = op(x, q, g)
    return [*outs, *_grads(outs, [x, q, g], upstream)]


def check_op(op, sources, query, gain, upstream, eps: float = 1e-6, reference_op=None) -> dict[str, float]:
    """Check ``op`` (float32 or float64 inputs, as given) against the float64 reference.

    Every output and gradient must be within ``C u G kappa`` of the truth (:func:`tolerance`),
    with u the unit roundoff of the compute dtype; for inputs stored in float16/bfloat16 the
    rounding of a low-precision output (mixture, source gradients) is added. ``reference_op``
    (the reference in the same dtype) must meet the same bound. Returns each error as a
    fraction of its bound.
    """
    from attnres_probe.kernels import depth_attn

    def truth_op(x, q, g):
        return depth_attn(x, q, g, eps, return_weights=True, return_logits=True, backend="torch")

    truth = op_results(truth_op, sources, query, gain, upstream, torch.float64)
    cond = conditions(sources, query, gain, upstream, eps)
    names = [*OUTPUTS, *GRADS[: 2 + (gain is not None)]]
    S, d = sources.shape[0], sources.shape[-1]
    store = sources.dtype
    compute = torch.float64 if torch.float64 in (store, query.dtype) else torch.float32
    errors = {}
    for candidate in [op] + ([reference_op] if reference_op is not None else []):
        got = op_results(candidate, sources, query, gain, upstream)
        for name, a, t in zip(names, got, truth):
            bound = tolerance(compute, name, cond, S, d)
            if store in (torch.float16, torch.bfloat16):
                # a low-precision output is rounded to its storage dtype, and so is the upstream
                # gradient of the mixture, which every gradient then carries (times its kappa)
                bound += C * UNIT_ROUNDOFF[store] * (cond[name] if name in GRADS else float(a.dtype == store))
            label = name if candidate is op else f"reference {name}"
            assert_within(a, t, bound, label)
            errors[label] = relative_rms(a[torch.isfinite(t)], t[torch.isfinite(t)]) / bound
    return errors


def check_fn(candidate, reference, inputs, upstream, names, bounds) -> None:
    """Check a kernel function against its float64 reference: ``candidate(*inputs)`` and
    ``reference(*inputs)`` (same dtype) must both be within ``bounds[name]`` of
    ``reference(*inputs in float64)``, every output (``names[:n_out]``) and every gradient
    (the rest, for the inputs that are tensors), with the same float64 upstream gradients."""

    def run(fn, dtype=None):
        leaves = _leaves(*[t if dtype is None or t is None else t.to(dtype) for t in inputs])
        outs = fn(*leaves)
        return [*outs, *_grads(outs, leaves, upstream)]

    truth = run(reference, torch.float64)
    for who, fn in (("", candidate), ("reference ", reference)):
        for name, a, t in zip(names, run(fn), truth):
            assert_within(a, t, bounds[name], who + name)


def mixer_condition(sources, query, gain, upstream, eps: float = 1e-6) -> float:
    """kappa of a depth mixer's query (and gain) gradient inside a whole model, in float64.

    The op's gradient is ``dq = sum_rows sum_i dz_i r_i v_i`` with ``dz_i = alpha_i (da_i - D)``,
    ``da_i = v_i . dh`` and ``D = sum_j alpha_j da_j``. Inside a model the upstream ``dh`` is
    itself a float32 result (the backward of every later layer) with a normwise relative error,
    so the error of ``da_i`` scales with the dot product's absolute terms ``|v_i| . |dh|``, not
    with ``|v_i . dh|`` as for the op alone (:func:`conditions`, where the upstream is exact).
    This matters because ``dh`` is nearly orthogonal to what the read mixes (every consumer of a
    read is an RMSNorm, whose gradient is orthogonal to its input): ``da_i`` cancels and the
    query's gradient is small against its terms. Returns ``rms(sum |terms|) / rms(sum terms)``.

    Args:
        sources: [S, *batch, d]; query, gain: [d]; upstream: dL/dmix [*batch, d].
    """
    v = sources.detach().double().flatten(1, -2)  # (S, M, d)
    S, M, d = v.shape
    q = query.detach().double() * (1 if gain is None else gain.detach().double())
    dh = upstream.detach().double().reshape(M, d)
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # (S, M)
    alpha = torch.softmax((v @ q) * r, 0)
    da = (v * dh).sum(-1)
    dz = alpha * (da - (alpha * da).sum(0))
    da_abs = (v.abs() * dh.abs()).sum(-1)
    dz_abs = alpha * (da_abs + (alpha * da_abs).sum(0))
    dq = ((dz * r)[..., None] * v).sum((0, 1))
    dq_abs = ((dz_abs * r)[..., None] * v.abs()).sum((0, 1))
    return max(1.0, (dq_abs.pow(2).mean().sqrt() / dq.pow(2).mean().sqrt().clamp_min(1e-300)).item())


def model_conditions(model64, loss_terms) -> dict[str, float]:
    """kappa of every result of a whole model, evaluated on its float64 twin before any float32 run.

    Args:
        model64: the float64 model (hooks and all, as the candidates run).
        loss_terms: ``fn(model) -> (logits, per-term losses [N])``; the loss is their mean.

    Returns:
        kappa per result name: ``"logits"`` and ``"loss"`` 1 (elementwise results, and a mean
        of positive terms); for every parameter, the sum of the absolute per-term gradients
        over the absolute gradient, ``rms(sum_t |g_t|) / rms(sum_t g_t)`` with ``g_t`` the
        gradient of loss term t / N (how much the mean over tokens cancels); for a depth
        mixer's query and gain, the larger of that and :func:`mixer_condition` at its read (how
        much the sum over rows and sources inside the op cancels); ``"mixer"``, the largest
        mixer kappa (for per-read norms of the mixers' gradients).
    """
    from attnres_probe.model import DepthMixer

    params = dict(model64.named_parameters())
    reads: dict = {}

    def capture(mixer, args, out):  # the sources the op mixes and, in the backward, dL/dmix
        entry = reads.setdefault(mixer, {"sources": torch.stack([s.detach() for s in args[0]])})
        if out.requires_grad:
            out.register_hook(lambda g: entry.__setitem__("upstream", g.detach()))

    handles = [m.register_forward_hook(capture) for m in model64.modules() if isinstance(m, DepthMixer)]
    try:
        _, terms = loss_terms(model64)
        n = terms.numel()
        total = {k: torch.zeros_like(p) for k, p in params.items()}
        absolute = {k: torch.zeros_like(p) for k, p in params.items()}
        for t in range(n):
            grads = torch.autograd.grad(terms[t] / n, list(params.values()), retain_graph=True, allow_unused=True)
            for k, g in zip(params, grads):
                if g is not None:
                    total[k] += g
                    absolute[k] += g.abs()
        terms.mean().backward(inputs=list(params.values()))  # fills each read's upstream
    finally:
        for h in handles:
            h.remove()
    out = {"logits": 1.0, "loss": 1.0, "mixer": 1.0}
    for k in params:
        den = total[k].pow(2).mean().sqrt().item()
        out[k] = max(1.0, absolute[k].pow(2).mean().sqrt().item() / den) if den > 0 else 1.0
    names = {m: n for n, m in model64.named_modules()}
    for mixer, entry in reads.items():
        if "upstream" not in entry:
            continue
        kappa = mixer_condition(entry["sources"], mixer.query, mixer.norm.weight, entry["upstream"], mixer.eps)
        for p in ("query", "norm.weight"):
            key = f"{names[mixer]}.{p}"
            out[key] = max(out[key], kappa)
            out["mixer"] = max(out["mixer"], out[key])
    return out


def model_growth(cfg) -> float:
    """G of a whole model: one read's ``sqrt(d) + S`` for each of its L+1 reads.

    A model's float32 result carries the rounding of every sublayer and read before it (and,
    for a gradient, after it): each read adds at most one op's ``u (sqrt(d) + S)`` (the op's G
    at logits of order one, :func:`growth`), and its attention and MLP sublayers, the same
    PyTorch ops for every backend, add rounding of the same order, which ``C`` covers.
    """
    return cfg.n_reads * (math.sqrt(cfg.d_model) + cfg.n_sources)


def model_bound(cfg, kappa: float, dtype: torch.dtype = torch.float32) -> float:
    """The bound on a whole model's result computed in ``dtype`` against its float64 twin:
    ``C u G kappa`` with ``G`` from :func:`model_growth` and ``kappa`` from
    :func:`model_conditions`. Both come from the configuration and the float64 twin, before
    any float32 run: the float32 reference backend is a second candidate held to the same
    bound, not the yardstick."""
    return C * UNIT_ROUNDOFF[dtype] * model_growth(cfg) * kappa
