"""Whole models on every backend and both Block schedules (Triton runs under TRITON_INTERPRET on CPU).

Every comparison is against the model's float64 twin on the reference backend, within
``model_bound`` (closeness.py): ``C u G kappa``, with G from the model's shape and kappa of
each result evaluated on the float64 twin (``model_conditions``) before any float32 run. The
float32 reference backend is held to the same bound as the others; no bound depends on another
float32 run's error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnres_probe import AttnResTransformer, Probe

from closeness import assert_bounded, model_bound, model_conditions, relative_rms
from helpers import sample_tokens, tiny_model

pytest.importorskip("triton")


def _twin(model: AttnResTransformer, dtype=torch.float32, **kw) -> AttnResTransformer:
    other = AttnResTransformer(model.cfg, **kw).to(dtype).eval()
    other.load_state_dict(model.state_dict())
    return other


def _loss_terms(tokens: torch.Tensor):
    """``fn(model) -> (logits, per-token losses)``: the next-token losses whose mean is the loss."""

    def fn(model: AttnResTransformer):
        logits = model(tokens)
        terms = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none"
        )
        return logits, terms

    return fn


def _results(model: AttnResTransformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits, loss and every parameter's gradient, by name."""
    params = dict(model.named_parameters())
    logits, terms = _loss_terms(tokens)(model)
    loss = terms.mean()
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    out = {"logits": logits.detach(), "loss": loss.detach()}
    out.update({n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)})
    return out


def _check_within_bounds(model64: AttnResTransformer, tokens: torch.Tensor, candidates: dict[str, AttnResTransformer]) -> None:
    """Every result of each float32 candidate within ``model_bound`` of the float64 model's,
    the bound computed from the float64 model alone (``model_conditions``)."""
    cond = model_conditions(model64, _loss_terms(tokens))
    truth = _results(model64, tokens)
    for label, candidate in candidates.items():
        got = _results(candidate, tokens)
        for name, t in truth.items():
            assert_bounded(relative_rms(got[name], t), model_bound(model64.cfg, cond[name]), f"{label}, {name}")


def _check_against_float64(model: AttnResTransformer, tokens: torch.Tensor, candidates: dict[str, dict]) -> None:
    """Each candidate configuration (kwargs of the model), and the float32 reference backend,
    within ``model_bound`` of the float64 twin on every result."""
    built = {"torch float32": _twin(model, backend="torch")} | {label: _twin(model, **kw) for label, kw in candidates.items()}
    _check_within_bounds(_twin(model, torch.float64, backend="torch"), tokens, built)


BLOCK_LAYOUTS = [{"block_size": 1}, {"block_size": 2}, {"block_size": 3}, {"block_boundaries": [1, 4]}, {"block_size": 6}]


@pytest.mark.parametrize("kw", BLOCK_LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
@pytest.mark.parametrize("backend", ["torch", "triton", "numba"])
def test_two_phase_equals_sequential_block_attnres_logits_loss_and_every_gradient(kw, backend):
    model = tiny_model("block", n_layers=3, **kw)
    candidates = {s: {"backend": backend, "schedule": s} for s in ("sequential", "two_phase")}
    _check_against_float64(model, sample_tokens(7, batch=2), candidates)


@pytest.mark.parametrize(
    "residual, kw",
    [("prenorm", {}), ("full", {}), ("block", {"block_size": 2}), ("block", {"block_boundaries": [1, 4]})],
)
def test_every_backend_gives_the_references_logits_loss_and_every_gradient(residual, kw):
    model = tiny_model(residual, n_layers=3, **kw)
    _check_against_float64(model, sample_tokens(6, batch=2), {b: {"backend": b} for b in ("torch", "numba", "triton")})


@pytest.mark.parametrize("backend", ["triton", "numba"])
@pytest.mark.parametrize("residual", ["full", "block"])
def test_fused_and_reference_traces_agree_on_weights_logits_and_gradient_norms(residual, backend):
    model = tiny_model(residual, n_layers=2)
    tokens = sample_tokens(6, batch=1)
    t64 = Probe(_twin(model, torch.float64, backend="torch")).run(tokens, backward=True)
    traces = {b: Probe(_twin(model, backend=b)).run(tokens, backward=True) for b in ("torch", backend)}
    # per-token arrays are elementwise results (kappa 1, as logits); the mixers' gradient norms
    # carry the largest mixer kappa of the float64 twin
    cond = model_conditions(_twin(model, torch.float64, backend="torch"), _loss_terms(tokens))
    for field in ("depth_weights", "logits", "contrib", "grad_in", "mixer_grad"):
        truth = torch.as_tensor(np.nan_to_num(np.asarray(getattr(t64, field), dtype=np.float64), neginf=0.0))
        bound = model_bound(model.cfg, cond["mixer"] if field == "mixer_grad" else 1.0)
        for b in ("torch", backend):
            got = torch.as_tensor(np.nan_to_num(np.asarray(getattr(traces[b], field), dtype=np.float64), neginf=0.0))
            assert_bounded(relative_rms(got, truth), bound, f"{b}, {field}")


def test_default_schedule_is_sequential_on_cpu_and_two_phase_with_triton():
    model = tiny_model("block")
    v0 = torch.zeros(1, 1, model.cfg.d_model)
    assert model.resolve(v0) == ("numba", "sequential")
    assert _twin(model, backend="torch").resolve(v0) == ("torch", "sequential")
    assert _twin(model, backend="triton").resolve(v0) == ("triton", "two_phase")
    with pytest.raises(ValueError, match="schedule is 'parallel'"):
        _twin(model, schedule="parallel")
    with pytest.raises(ValueError, match="accepted values are auto, torch, triton, numba"):
        _twin(model, backend="bogus")
    for residual in ("prenorm", "full"):  # only Block has schedules: refused, not ignored
        with pytest.raises(ValueError, match=f"applies to Block AttnRes only; this model's residual is '{residual}'"):
            AttnResTransformer(tiny_model(residual).cfg, schedule="sequential")


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_a_recorded_forward_is_the_forward_that_trains(residual, backend):
    """One forward per residual rule: with a recording Probe's hooks attached, the loss and
    every parameter's gradient are bit for bit those of the plain training forward, and the
    trace's mean loss is that loss."""
    model = _twin(tiny_model(residual, n_layers=2), backend=backend)
    tokens = sample_tokens(9, batch=1)
    plain = _results(model, tokens)
    probe = Probe(model)
    from attnres_probe.hooks import Recorder

    with Recorder(model, probe.spec, contributions=True, gradients=True):
        recorded = _results(model, tokens)
    for name, want in plain.items():
        assert torch.equal(recorded[name], want), name
    trace = probe.run(tokens, backward=True)
    assert trace.meta["mean_loss"] == pytest.approx(plain["loss"].item(), rel=1e-6)


@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
@pytest.mark.parametrize("residual", ["full", "block"])
def test_a_saturated_read_records_the_ops_own_finite_logits(residual, backend):
    """Queries scaled 30x: most weights underflow in float32, yet every available logit a trace
    records is finite and equals the float64 model's within the bound for its scale. Rebuilding
    logits as log(weights) + lse (the old way) turned 715 of 1080 such cells into -inf."""
    model = tiny_model(residual, n_layers=2)
    with torch.no_grad():
        for m in model.mixers:
            m.query.mul_(30.0)
    tokens = sample_tokens(10, batch=1)
    t64 = Probe(_twin(model, torch.float64, backend="torch")).run(tokens)
    trace = Probe(_twin(model, backend=backend)).run(tokens)
    z, z64, w = (np.asarray(x, dtype=np.float64) for x in (trace.logits, t64.logits, trace.depth_weights))
    available = ~np.isnan(w)
    assert (w[available] == 0).sum() > 0.2 * available.sum()  # saturated: many weights underflow
    assert np.isfinite(z[available]).all() and np.isfinite(z64[available]).all()
    assert np.isneginf(z[~available]).all() or np.isnan(z[~available]).all()
    cfg = model.cfg
    z_max = float(np.abs(z64[available]).max())
    bound = 8 * 2.0**-24 * (1 + z_max) * (cfg.d_model**0.5 + cfg.n_sources) * cfg.n_reads  # C u G per read, L+1 reads
    assert_bounded(relative_rms(torch.as_tensor(z[available]), torch.as_tensor(z64[available])), bound, "saturated logits")


HOOKS = {
    "detach": lambda x, hook: x.detach(),  # patching: the read before it no longer reaches the loss
    "zero": lambda x, hook: torch.zeros_like(x),
    "mean": lambda x, hook: x.mean(1, keepdim=True).expand_as(x),  # mean ablation: a strided source
}


@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("where", ["blocks.0.hook_mlp_out", "blocks.1.hook_resid_pre", "blocks.1.hook_attn_out"])
@pytest.mark.parametrize("residual, kw", [("prenorm", {}), ("full", {}), ("block", {"block_size": 1}), ("block", {"block_size": 3})])
def test_hooks_that_replace_activations_give_the_references_gradients(residual, kw, where, hook):
    """Activation patching and ablation through the hook points: every backend's loss and
    gradients stay within the bound of the float64 model patched the same way."""
    model = tiny_model(residual, n_layers=3, **kw)
    tokens = sample_tokens(6, batch=2)
    hooked = {}
    for label, dtype, backend in (("f64", torch.float64, "torch"), ("torch", torch.float32, "torch"), ("numba", torch.float32, "numba")):
        hooked[label] = _twin(model, dtype, backend=backend)
        dict(hooked[label].named_modules())[where].add_hook(HOOKS[hook])
    _check_within_bounds(hooked.pop("f64"), tokens, hooked)


ROUTING_HOOKS = {  # the final read (out_res) sees every source: its rows have no padding
    "halve weights in place": ("blocks.1.attn_res.hook_weights", lambda w, hook: w.mul_(0.5)),
    "halve the final weights in place": ("out_res.hook_weights", lambda w, hook: w.mul_(0.5)),
    "sharpen logits": ("blocks.1.mlp_res.hook_logits", lambda z, hook: z * 3.0),  # softmaxed again by the read
    "sharpen the final logits in place": ("out_res.hook_logits", lambda z, hook: z.mul_(3.0)),
    "embedding only": ("blocks.1.attn_res.hook_weights", lambda w, hook: torch.zeros_like(w).index_fill(-1, torch.tensor([0]), 1.0)),
}


@pytest.mark.parametrize("hook", sorted(ROUTING_HOOKS))
@pytest.mark.parametrize("residual, kw", [("full", {}), ("block", {"block_size": 3})])
def test_hooks_that_edit_routing_give_the_references_gradients(residual, kw, hook):
    """Interventions on a read's weights or logits, in place or not (the op returns them padded
    to the common source axis, as the caller's own tensors, and the gradients reach them
    through that padding): on the reference and the Numba backend, every parameter's gradient
    within the bound of the float64 model edited the same way."""
    model = tiny_model(residual, n_layers=3, **kw)
    tokens = sample_tokens(6, batch=2)
    where, fn = ROUTING_HOOKS[hook]
    hooked = {}
    for label, dtype, backend in (("f64", torch.float64, "torch"), ("torch", torch.float32, "torch"), ("numba", torch.float32, "numba")):
        hooked[label] = _twin(model, dtype, backend=backend)
        dict(hooked[label].named_modules())[where].add_hook(fn)
    unedited = _results(_twin(model, torch.float64, backend="torch"), tokens)["logits"]
    edited = _results(hooked["f64"], tokens)["logits"]
    assert (edited - unedited).abs().max() > 1e-8  # the edit changed the model (float64: rounding is ~1e-15)
    _check_within_bounds(hooked.pop("f64"), tokens, hooked)


@pytest.mark.parametrize("inputs", ["all", "one"])
@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_second_order_gradients_on_the_numba_backend_equal_the_references(residual, inputs):
    """Gradients taken with ``create_graph=True`` (every parameter's, where later sources
    depend on earlier ones) and a gradient penalty (the gradient of |dL/dW|^2 for the last MLP's
    W_in; PyTorch's CPU attention is not twice differentiable) through the Numba backend equal
    the reference's, float64 (both build the reference graph; only summation order differs:
    1e-9 relative is a million float64 ulps), also when ``autograd.grad`` asks for one
    parameter only."""
    model = tiny_model(residual, n_layers=2, **({"block_size": 2} if residual == "block" else {}))
    tokens = sample_tokens(6, batch=2)
    got = {}
    for backend in ("torch", "numba"):
        m = _twin(model, torch.float64, backend=backend)
        params = dict(m.named_parameters())
        first = torch.autograd.grad(m.loss(tokens), list(params.values()), create_graph=True)
        wrt = list(params.values()) if inputs == "all" else [params["blocks.0.mlp.W_out.weight"]]
        penalty = first[list(params).index("blocks.1.mlp.W_in.weight")].pow(2).sum()
        got[backend] = [g.detach() for g in first], torch.autograd.grad(penalty, wrt, allow_unused=True)
    names = list(dict(model.named_parameters()))
    for a, b, name in zip(got["numba"][0], got["torch"][0], names):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9, msg=lambda m, name=name: f"first order, {name}: {m}")
    for a, b in zip(got["numba"][1], got["torch"][1]):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("residual", ["full", "block"])
def test_two_threads_backpropagating_one_graph_get_the_same_gradients(residual):
    """The Numba backward keeps no shared state: concurrent passes over one graph give each
    thread the gradients a single pass gives, bit for bit."""
    import threading

    model = _twin(tiny_model(residual, n_layers=3, **({"block_size": 2} if residual == "block" else {})), backend="numba")
    tokens = sample_tokens(12, batch=8)
    params = list(model.parameters())
    loss = model.loss(tokens)
    want = torch.autograd.grad(loss, params, retain_graph=True)
    results: list = [None, None]

    def work(i: int) -> None:
        results[i] = torch.autograd.grad(loss, params, retain_graph=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_the_model_repr_names_its_backend_and_schedule():
    model = AttnResTransformer(tiny_model("block").cfg, backend="numba", schedule="sequential")
    assert "backend='numba'" in repr(model) and "schedule='sequential'" in repr(model)
