"""Whole models on every backend and both Block schedules (Triton runs under TRITON_INTERPRET on CPU)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from attnres_probe import AttnResTransformer, Probe
from helpers import sample_tokens, tiny_model

pytest.importorskip("triton")

ATOL = 1e-5  # fp32, whole model


def _twin(model: AttnResTransformer, **kw) -> AttnResTransformer:
    other = AttnResTransformer(model.cfg, **kw).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("kw", [{"block_size": 2}, {"block_size": 3}, {"block_boundaries": [1, 4]}, {"block_size": 6}])
@pytest.mark.parametrize("backend", ["torch", "triton", "numba"])
def test_two_phase_equals_sequential_block_attnres(kw, backend):
    model = tiny_model("block", n_layers=3, **kw)
    seq = _twin(model, backend=backend, schedule="sequential")
    two = _twin(model, backend=backend, schedule="two_phase")
    tokens = sample_tokens(7)
    with torch.no_grad():
        torch.testing.assert_close(two(tokens), seq(tokens), atol=ATOL, rtol=0)


def test_two_phase_gradients_equal_sequential():
    model = tiny_model("block", n_layers=2, block_size=3)
    tokens = sample_tokens(6, batch=1)
    grads = []
    for schedule in ("sequential", "two_phase"):
        m = _twin(model, backend="torch", schedule=schedule)
        loss = m.loss(tokens)
        grads.append(torch.autograd.grad(loss, list(m.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # fp32, different summation order


@pytest.mark.parametrize("backend", ["triton", "numba"])
@pytest.mark.parametrize("residual", ["full", "block"])
def test_fused_and_reference_models_agree_on_logits_weights_and_gradients(residual, backend):
    model = tiny_model(residual, n_layers=2)
    ref, tri = _twin(model, backend="torch"), _twin(model, backend=backend)
    tokens = sample_tokens(6, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(tri(tokens), ref(tokens), atol=ATOL, rtol=0)
    t_ref = Probe(ref).run(tokens, backward=True)
    t_tri = Probe(tri).run(tokens, backward=True)
    np.testing.assert_allclose(t_tri.depth_weights, t_ref.depth_weights, atol=ATOL, rtol=0)
    np.testing.assert_allclose(t_tri.grad_in, t_ref.grad_in, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(t_tri.mixer_grad, t_ref.mixer_grad, rtol=1e-4)


def test_default_schedule_is_sequential_on_cpu_and_two_phase_with_triton():
    model = tiny_model("block")
    v0 = torch.zeros(1, 1, model.cfg.d_model)
    assert model._resolve(v0) == ("numba", "sequential")
    assert _twin(model, backend="torch")._resolve(v0) == ("torch", "sequential")
    assert _twin(model, backend="triton")._resolve(v0) == ("triton", "two_phase")
    with pytest.raises(ValueError, match="schedule is 'parallel'"):
        _twin(model, schedule="parallel")(sample_tokens(3))


def _loss_and_grads(model: AttnResTransformer, tokens: torch.Tensor):
    loss = model.loss(tokens)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize(
    "residual, kw",
    [("prenorm", {}), ("full", {}), ("block", {"block_size": 1}), ("block", {"block_size": 2}),
     ("block", {"block_size": 3}), ("block", {"block_boundaries": [1, 4]}), ("block", {"block_size": 6})],
)
def test_the_numba_training_path_gives_the_references_loss_and_every_gradient(residual, kw):
    """Unhooked reads on the Numba backend take the lean op and apply the next pre-norm in
    their kernel (PreNorm: its residual add does), and Block AttnRes reads after a sublayer
    form the partial-block sum in their kernel: the loss and every parameter's gradient equal
    the reference backend's (fp32: atol 1e-5 on the loss, 1e-5 + 1e-4 rel on gradients)."""
    model = tiny_model(residual, n_layers=3, **kw)
    tokens = sample_tokens(6, batch=2)
    loss_ref, grads_ref = _loss_and_grads(_twin(model, backend="torch"), tokens)
    loss, grads = _loss_and_grads(_twin(model, backend="numba"), tokens)
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=0)
    names = [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def _grads_by_name(model: AttnResTransformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(model.loss(tokens), list(params.values()), allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)}


HOOKS = {
    "detach": lambda x, hook: x.detach(),  # patching: the read before it no longer reaches the loss
    "zero": lambda x, hook: torch.zeros_like(x),
    "mean": lambda x, hook: x.mean(1, keepdim=True).expand_as(x),  # mean ablation: a strided source
}


@pytest.mark.parametrize("hook", sorted(HOOKS))
@pytest.mark.parametrize("where", ["blocks.0.hook_mlp_out", "blocks.1.hook_resid_pre", "blocks.1.hook_attn_out"])
@pytest.mark.parametrize(
    "residual, kw",
    [("prenorm", {}), ("full", {}), ("block", {"block_size": 1}), ("block", {"block_size": 2}), ("block", {"block_size": 3})],
)
def test_hooks_that_replace_activations_give_the_references_gradients(residual, kw, where, hook):
    """A hooked model takes the ordinary reads (no fused sums, no gradient slots): activation
    patching and ablation give the reference's gradients on every parameter."""
    model = tiny_model(residual, n_layers=3, **kw)
    tokens = sample_tokens(6, batch=2)
    grads = {}
    for backend in ("torch", "numba"):
        m = _twin(model, backend=backend)
        dict(m.named_modules())[where].add_hook(HOOKS[hook])
        assert not m.unwatched()
        grads[backend] = _grads_by_name(m, tokens)
    for name, want in grads["torch"].items():
        torch.testing.assert_close(grads["numba"][name], want, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("inputs", ["all", "one"])
@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_second_order_gradients_on_the_numba_backend_equal_the_references(residual, inputs):
    """Gradients taken with ``create_graph=True`` (every parameter's, where later sources
    depend on earlier ones) and a gradient penalty (the gradient of |dL/dW|^2 for the last MLP's
    W_in; PyTorch's CPU attention is not twice differentiable) through the Numba training path
    equal the reference's, float64, also when ``autograd.grad`` asks for one parameter only."""
    model = tiny_model(residual, n_layers=2, **({"block_size": 2} if residual == "block" else {})).double()
    tokens = sample_tokens(6, batch=2)
    got = {}
    for backend in ("torch", "numba"):
        m = _twin(model, backend=backend).double()
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


def test_a_swapped_or_patched_norm_runs_as_a_module_and_prenorm_ignores_other_backends(monkeypatch):
    """The fused pre-norms stand in for the model's own RMSNorm only: a norm module swapped in,
    or a ``forward`` replaced on one, runs as itself on the Numba backend too. A PreNorm model
    (no depth attention) asked for Triton on CPU tensors, or any backend but auto/numba, runs its
    norms as modules instead of raising; an unknown name is still refused."""
    tokens = sample_tokens(6, batch=2)
    for residual in ("prenorm", "full", "block"):
        model = tiny_model(residual, n_layers=2)
        for patch in ("layernorm", "forward"):
            ref, fast = _twin(model, backend="torch"), _twin(model, backend="numba")
            for m in (ref, fast):
                if patch == "layernorm":
                    m.ln_final = torch.nn.LayerNorm(m.cfg.d_model)
                else:
                    m.blocks[1].ln1.forward = lambda x: x * 2
            with torch.no_grad():
                torch.testing.assert_close(fast(tokens), ref(tokens), atol=ATOL, rtol=0, msg=f"{residual}, {patch}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    prenorm = tiny_model("prenorm", n_layers=2)
    want = _twin(prenorm, backend="torch")(tokens)
    torch.testing.assert_close(_twin(prenorm, backend="triton")(tokens), want)
    monkeypatch.setenv("ATTNRES_BACKEND", "triton")
    torch.testing.assert_close(_twin(prenorm)(tokens), want)
    with pytest.raises(ValueError, match="accepted values are"):
        _twin(prenorm, backend="bogus")(tokens)


class _Zeros(torch.nn.Module):
    """Zeros of width d whatever the input: a sublayer (or its output projection) that ignores its input."""

    def __init__(self, d: int):
        super().__init__()
        self.d = d

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.d)


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_modules_swapped_in_after_construction_are_honoured(residual, monkeypatch):
    """The fast paths see the model as it is now: a hook on a norm module assigned after
    construction fires; a sublayer swapped for one that ignores its input (its reads then never
    reach the loss) gives the reference's gradients; a norm method patched on the class runs."""
    from attnres_probe.model import RMSNorm

    model = tiny_model(residual, n_layers=2, **({"block_size": 2} if residual == "block" else {}))
    tokens = sample_tokens(6, batch=2)
    ref, fast = _twin(model, backend="torch"), _twin(model, backend="numba")
    seen = []
    for m in (ref, fast):
        m.blocks[1].ln2 = RMSNorm(m.cfg.d_model, m.cfg.norm_eps)
        m.blocks[1].ln2.register_forward_hook(lambda mod, inp, out: seen.append(1) or out * 2)
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), ref(tokens), atol=ATOL, rtol=0)
    assert len(seen) == 2
    for m in (ref, fast):
        m.blocks[1].ln2._forward_hooks.clear()
    for swap in ("blocks.0.attn", "blocks.0.attn.W_O", "blocks.0.mlp.W_out"):  # sublayers that ignore their input
        ref_s, fast_s = copy.deepcopy(ref), copy.deepcopy(fast)
        for m in (ref_s, fast_s):
            parent, name = swap.rsplit(".", 1)
            setattr(m.get_submodule(parent), name, _Zeros(m.cfg.d_model))
        grads = [_grads_by_name(m, tokens) for m in (ref_s, fast_s)]
        for name, want in grads[0].items():
            torch.testing.assert_close(grads[1][name], want, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{swap}, {name}: {m}")
    for m in (ref, fast):
        m.blocks[0].hook_attn_out = _Double()  # a module the fast path would skip
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), ref(tokens), atol=ATOL, rtol=0)
    forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: forward(self, x) * 3)
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), ref(tokens), atol=ATOL, rtol=0)


class _Double(torch.nn.Module):
    def forward(self, x):
        return 2 * x


def test_the_fast_paths_survive_copies_and_casts_and_a_subclass_that_overrides_the_forward_does_not_lose_it(tmp_path):
    """Models built, loaded, copied, pickled or cast take the fast paths; a subclass that
    overrides a method the forward relies on runs the ordinary path and gives its own result."""
    import pickle

    from attnres_probe import AttnResTransformer

    model = tiny_model("block", n_layers=2, block_size=2)
    model.save(tmp_path / "m")
    variants = {
        "built": model,
        "loaded": AttnResTransformer.load(tmp_path / "m"),
        "deepcopy": copy.deepcopy(model),
        "pickled": pickle.loads(pickle.dumps(model)),
        "double": copy.deepcopy(model).double(),
        "eval": copy.deepcopy(model).eval(),
    }
    for name, m in variants.items():
        assert m._fusable(), name

    class Scaled(AttnResTransformer):
        def _final(self, h):
            return 2 * super()._final(h)

    tokens = sample_tokens(6, batch=2)
    logits = {}
    for backend in ("torch", "numba"):
        sub = Scaled(model.cfg, backend=backend)
        sub.load_state_dict(model.state_dict())
        assert not sub._fusable()
        with torch.no_grad():
            logits[backend] = sub(tokens)
    torch.testing.assert_close(logits["numba"], logits["torch"], atol=ATOL, rtol=0)
    with torch.no_grad():
        plain = _twin(model, backend="torch")(tokens)
    assert (logits["torch"] - plain).abs().max() > 0.01  # the override does change the result


def test_a_norm_gain_in_another_dtype_is_applied_after_the_kernel():
    """A pre-norm gain the kernel does not take (float64 in a float32 model) is applied with
    PyTorch ops after the read; training still matches the reference."""
    model = tiny_model("block", n_layers=2, block_size=2)
    tokens = sample_tokens(6, batch=2)
    results = []
    for backend in ("torch", "numba"):
        m = _twin(model, backend=backend)
        m.ln_final.double()
        m.blocks[1].ln2.double()
        results.append(_loss_and_grads(m, tokens))
    (loss, grads), (loss_ref, grads_ref) = results[1], results[0]
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=0)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_a_read_given_a_norm_returns_the_normed_mixture_hooked_or_not(backend):
    model = tiny_model("full", n_layers=2)
    mixer, ln = model.blocks[1].attn_res, model.blocks[1].ln1
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        mixer.query.normal_()
    sources = [torch.randn(2, 5, model.cfg.d_model) for _ in range(3)]
    want = ln(mixer(sources, backend=backend))
    torch.testing.assert_close(mixer(sources, backend=backend, norm=ln), want, atol=ATOL, rtol=0)
    mixer.hook_weights.add_hook(lambda w, hook: w)
    torch.testing.assert_close(mixer(sources, backend=backend, norm=ln), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_the_fused_pre_norms_run_only_while_nothing_watches(residual, monkeypatch):
    """On the Numba backend an unwatched model runs no RMSNorm module (the reads, or PreNorm's
    residual adds, apply them in their kernels) and gives the reference's logits in a forward
    without gradients too; a hooked one runs every norm and its hooks see every sublayer's input."""
    from attnres_probe.kernels import reference

    calls = []
    norm = reference.rms_norm  # what an RMSNorm module calls (the Numba ops hold their own reference)
    monkeypatch.setattr(reference, "rms_norm", lambda *a: calls.append(a) or norm(*a))
    model = tiny_model(residual, n_layers=3, **({"block_size": 3} if residual == "block" else {}))
    tokens = sample_tokens(6, batch=2)
    fast, ref = _twin(model, backend="numba"), _twin(model, backend="torch")
    with torch.no_grad():
        want = ref(tokens)
        calls.clear()
        torch.testing.assert_close(fast(tokens), want, atol=ATOL, rtol=0)
    assert calls == []
    seen = []
    for name in ("hook_resid_pre", "hook_resid_mid"):
        for block in fast.blocks:
            getattr(block, name).add_hook(lambda x, hook: seen.append(hook.name))
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), want, atol=ATOL, rtol=0)
    assert len(calls) == 2 * model.cfg.n_layers + 1 and len(seen) == 2 * model.cfg.n_layers


def test_module_backward_hooks_see_every_read_and_unwatched_follows_the_hooks():
    model = tiny_model("block", n_layers=3, block_size=3)
    tokens = sample_tokens(6, batch=2)
    fast = _twin(model, backend="numba")
    assert fast.unwatched()
    seen = []
    for i, mixer in enumerate(fast.mixers):
        mixer.register_full_backward_hook(lambda mod, gin, gout, i=i: seen.append(i))
    assert not fast.unwatched()
    fast.loss(tokens).backward()
    assert sorted(seen) == list(range(len(fast.mixers)))
    for mixer in fast.mixers:
        mixer._backward_hooks.clear()
    assert fast.unwatched()
    fast.blocks[0].hook_attn_out.add_hook(lambda x, hook: x)
    assert not fast.unwatched()
    fast.reset_hooks()
    assert fast.unwatched()


@pytest.mark.parametrize("residual", ["full", "block"])
def test_two_threads_backpropagating_one_graph_get_the_references_gradients(residual):
    """Gradient slots keep one buffer per autograd pass: concurrent passes do not mix."""
    import threading

    model = tiny_model(residual, n_layers=3, **({"block_size": 2} if residual == "block" else {}))
    tokens = sample_tokens(12, batch=8)
    _, want = _loss_and_grads(_twin(model, backend="torch"), tokens)
    fast = _twin(model, backend="numba")
    params = list(fast.parameters())
    for _ in range(3):
        loss = fast.loss(tokens)
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
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("residual, kw", [("full", {}), ("block", {"block_size": 2}), ("block", {"block_boundaries": [1, 4]})])
def test_gradient_slots_sum_in_the_kernels_across_repeated_and_partial_backward_passes(residual, kw, monkeypatch):
    """Reads of a shared source add its gradient inside their kernels (a spy sees accumulating
    backward calls); a second backward over the same graph, and a backward after a partial
    one (autograd.grad of one parameter), still give the reference's gradients."""
    import attnres_probe.kernels.numba_depth_attn as nbk

    accumulating = []
    kernel = nbk._backward

    def spy(table, n_src, *rest):
        accumulating.append(int(table[2 * n_src + 8 : 3 * n_src + 8].sum()))
        return kernel(table, n_src, *rest)

    monkeypatch.setattr(nbk, "_backward", spy)
    monkeypatch.setattr(nbk, "PARALLEL_MIN_ELEMENTS", 1 << 62)  # every call through the spied serial kernel
    model = tiny_model(residual, n_layers=3, **kw)
    tokens = sample_tokens(6, batch=2)
    _, want = _loss_and_grads(_twin(model, backend="torch"), tokens)
    fast = _twin(model, backend="numba")
    params = list(fast.parameters())
    loss = fast.loss(tokens)
    mid = params[len(params) // 2]
    torch.autograd.grad(loss, [mid], retain_graph=True)  # a partial pass: some owners do not run
    for _ in range(2):
        got = torch.autograd.grad(loss, params, retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert sum(accumulating) > 0
