"""watch_hyper_connections: effective depth weights of a model built with the `hyper-connections` package.

A small model (d 16, 3 layers of two sublayers each, stand-in Linear+tanh branches) built with
the package's ``get_init_and_expand_reduce_stream_functions``, run in float64. Every branch's input
(what ``width_connection`` returned) and the model's output (the package's reduce) must equal
the recorded coefficients times the recorded sources within the bound of tests/test_depth_rules.py:
``(gamma_K1(u1) + gamma_K2(u64)) * mag``, ``mag`` the same recombination with every weight and
source replaced by its absolute value, ``K1`` the rounding steps along the model's longest path,
``K2`` those of the coefficient recursion and recombination. Static and dynamic HC run wholly in
float64 (u1 = 2^-53); mHC computes its weights and mixing in float32 whatever the input dtype, so
u1 = 2^-24 with K1 counting the float32 steps (the casts of the state and the branch output to
float32, the mix, the beta product and the addition back).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

hc_pkg = pytest.importorskip("hyper_connections")

from attnres_probe.depth_rules import StreamWeights, hyper_read_coefficients, watch_hyper_connections  # noqa: E402

U64, U32 = 2.0**-53, 2.0**-24
B, P, D, N_LAYERS = 2, 3, 16, 3


def gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u)


class Branch(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return torch.tanh(self.lin(h))


class Model(nn.Module):
    """Embedding -> expand -> per layer two hyper-connected branches -> reduce -> head.

    The first sublayer of each layer is given to the HC module as ``branch=`` (its forward runs
    it); the second is used the package's other way (``branch_input, add_residual = hc(x)``).
    """

    def __init__(self, n: int, kind: str, n_layers: int = N_LAYERS, **hc_kwargs):
        super().__init__()
        if kind == "mhc":
            init_hc, self.expand, self.reduce = hc_pkg.mc_get_init_and_expand_reduce_stream_functions(n, dim=D)
        else:
            init_hc, self.expand, self.reduce = hc_pkg.get_init_and_expand_reduce_stream_functions(n, dim=D)
        self.embed = nn.Linear(5, D)
        self.attn = nn.ModuleList(
            [init_hc(branch=Branch(D), layer_index=2 * i, **hc_kwargs) for i in range(n_layers)]
        )
        self.mlp_hc = nn.ModuleList([init_hc(layer_index=2 * i + 1, **hc_kwargs) for i in range(n_layers)])
        self.mlp = nn.ModuleList([Branch(D) for _ in range(n_layers)])

    def forward(self, x):
        h = self.expand(self.embed(x))
        for attn, hc, mlp in zip(self.attn, self.mlp_hc, self.mlp):
            h = attn(h)
            branch_input, add_residual = hc(h)
            h = add_residual(mlp(branch_input))
        return self.reduce(h)


def randomise(model: Model, gen: torch.Generator, dynamic: bool) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("dynamic_alpha_fn", "dynamic_beta_fn"):
                p.copy_(noise / math.sqrt(D) if dynamic else torch.zeros_like(p))
            elif "scale" in leaf:
                p.copy_(0.5 * (1 + 0.2 * noise))
            elif leaf in ("static_alpha", "static_beta", "gamma"):
                p.add_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


VARIANTS = {
    "hc-static-n2": dict(n=2, kind="hc", dynamic=False),
    "hc-dynamic-n3": dict(n=3, kind="hc", dynamic=True),
    "mhc-dynamic-n4": dict(n=4, kind="mhc", dynamic=True),
}


def build(variant: str, seed: int = 5):
    v = VARIANTS[variant]
    torch.manual_seed(seed)
    model = Model(v["n"], v["kind"])
    randomise(model, torch.Generator().manual_seed(seed), v["dynamic"])
    model.double().eval()
    x = torch.randn(B, P, 5, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return model, x, v


def rebuild_error(coef, coef_abs, sources, truth, k1, u1, k2):
    """(max err / bound, bound) of truth vs coef @ sources; bound = (gamma_k1(u1) + gamma_k2(u64)) mag."""
    rebuilt = torch.einsum("bprs,bpsd->bprd", coef.double(), sources)
    mag = torch.einsum("bprs,bpsd->bprd", coef_abs.double(), sources.abs())
    bound = (gamma(k1, u1) + gamma(k2, U64)) * mag
    err = (rebuilt - truth).abs()
    return (err / bound.clamp_min(1e-300)).max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_coefficients_rebuild_every_branch_input_and_the_output(variant):
    model, x, v = build(variant)
    n, L = v["n"], 2 * N_LAYERS
    with torch.no_grad(), watch_hyper_connections(model) as watch:
        out = model(x)
        coef = watch.read_coefficients()
        steps = watch.steps()
        sources = watch.sources()
        inputs = watch.branch_inputs()
        final_state = watch.final_state()
    assert watch.call_names == [f"{k}.{i}" for i in range(N_LAYERS) for k in ("attn", "mlp_hc")]
    assert coef.shape == (B, P, L + 1, L + 1) and sources.shape == (B, P, L + 1, D)
    assert torch.equal(coef.triu(1), torch.zeros_like(coef))
    assert torch.equal(final_state.sum(-2), out)  # the package's reduce is the sum of the streams
    # the random parameters moved the rule well off PreNorm (all-ones coefficients)
    assert (coef - torch.ones_like(coef).tril()).abs().max() > 0.1
    if v["dynamic"]:
        assert (coef[0, 0] - coef[1, 2]).abs().max() > 1e-3
    else:
        assert torch.equal(coef[0, 0], coef[1, 2])
    if v["kind"] == "mhc":
        assert steps[0].pre.dtype == torch.float32  # the package's float32 weights, as recorded
        # H_res's columns (sources) sum to one after the last Sinkhorn step
        assert (steps[2].res.sum(-2) - 1).abs().max() < 1e-5
    coef_abs = hyper_read_coefficients([StreamWeights(w.pre.abs(), w.res.abs(), w.post.abs()) for w in steps])
    truth = torch.cat([inputs, out.unsqueeze(-2)], dim=-2)
    S = L + 1
    k_chain = L * (n + 1) + n  # each write: n products + the output; each read: n products
    if v["kind"] == "mhc":
        k1, u1 = L * (n + 4) + n, U32  # + casts of state and output, beta product, addition
    else:
        k1, u1 = k_chain, U64
    worst = rebuild_error(coef, coef_abs, sources, truth, k1, u1, k_chain + S)
    assert worst <= 1.0, f"{variant}: a read differs from coefficients x sources by {worst:.3g} x the bound"

    # the check can fail: the residual mix left in the package's [source, target] orientation
    wrong = hyper_read_coefficients([StreamWeights(w.pre, w.res.transpose(-1, -2), w.post) for w in steps])
    assert not torch.allclose(wrong, coef)
    assert rebuild_error(wrong, coef_abs, sources, truth, k1, u1, k_chain + S) > 10.0


def methods_are_original(model) -> bool:
    mods = [m for m in model.modules() if isinstance(m, (hc_pkg.HyperConnections, hc_pkg.mHC))]
    return bool(mods) and all(
        "width_connection" not in m.__dict__
        and "depth_connection" not in m.__dict__
        and not m.split_fracs._forward_hooks
        for m in mods
    ) and not model._forward_pre_hooks


def test_methods_restored_after_the_context_and_on_error():
    model, x, _ = build("hc-dynamic-n3")
    with torch.no_grad():
        ref = model(x)
        with watch_hyper_connections(model) as watch:
            assert not methods_are_original(model)
            assert torch.equal(model(x), ref)  # watching does not change the forward
            assert len(watch.calls) == 2 * N_LAYERS
            model(x)  # a new forward replaces the record
            assert len(watch.calls) == 2 * N_LAYERS
        assert methods_are_original(model)
        with pytest.raises(RuntimeError, match="boom"):
            with watch_hyper_connections(model):
                model(x)
                raise RuntimeError("boom")
        assert methods_are_original(model)
        assert torch.equal(model(x), ref)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        init_hc, self.expand, self.reduce = hc_pkg.get_init_and_expand_reduce_stream_functions(2, dim=D)
        self.hc = init_hc(branch=Branch(D), layer_index=0)

    def forward(self, x):
        return self.reduce(self.hc(self.hc(self.expand(x))))


def test_a_module_called_twice_is_refused_and_methods_restored():
    model = Twice().double()
    x = torch.randn(B, P, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"hc was called twice in one forward"):
        with watch_hyper_connections(model):
            model(x)
    assert methods_are_original(model)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_fracs=2), "num_fracs = 2"),
        (dict(num_input_views=2), "num_input_views = 2"),
        (dict(channel_first=True), "channel_first"),
    ],
)
@pytest.mark.parametrize("kind", ["hc", "mhc"])
def test_unsupported_variants_are_refused(kind, kwargs, message):
    model = Model(2, kind, n_layers=1, **kwargs)
    with pytest.raises(ValueError, match=rf"attn\.0 \(\w+\) is not supported.*{message}"):
        with watch_hyper_connections(model):
            pass
    assert methods_are_original(model)


def test_no_module_and_stream_embed_are_refused():
    with pytest.raises(ValueError, match="no HyperConnections"):
        with watch_hyper_connections(nn.Sequential(nn.Linear(4, 4))):
            pass
    model, x, _ = build("hc-static-n2")
    with torch.no_grad():
        model.expand = hc_pkg.StreamEmbed(2, D, expand_to_streams=True).double()
        with torch.no_grad():
            model.expand.stream_embed.normal_()
        with watch_hyper_connections(model) as watch:
            model(x)
            with pytest.raises(ValueError, match="not n copies"):
                watch.read_coefficients()


def test_import_works_without_the_package_and_the_call_says_why():
    code = (
        "import sys; sys.modules['hyper_connections'] = None\n"
        "import torch\n"
        "from attnres_probe.depth_rules import watch_hyper_connections\n"
        "try:\n"
        "    with watch_hyper_connections(torch.nn.Linear(2, 2)): pass\n"
        "except ImportError as e:\n"
        "    assert 'pip install hyper-connections' in str(e), e\n"
        "    print('refused')\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and "refused" in res.stdout, res.stderr


@pytest.mark.parametrize("variant", ["hc-dynamic-n3", "mhc-dynamic-n4"])
def test_a_watched_forward_becomes_a_trace_the_pages_take(variant, tmp_path):
    from attnres_probe import DepthTrace, figures, metrics

    model, x, v = build(variant)
    with torch.no_grad(), watch_hyper_connections(model) as watch:
        model(x)
        coef = watch.read_coefficients()
        trace = watch.trace(name=variant)
    L = 2 * N_LAYERS
    assert trace.residual == "hyper" and trace.meta["config"]["mhc"] == (v["kind"] == "mhc")
    assert trace.meta["call_names"] == watch.call_names and len(trace.read_labels) == L + 1
    W = trace.depth_weights.astype(np.float64)
    seen = np.tril(np.ones((L + 1, L + 1), bool))
    assert np.isnan(W[..., ~seen]).all()
    np.testing.assert_allclose(W[..., seen], coef.double().numpy()[..., seen], rtol=1e-6)  # float32 storage
    np.testing.assert_allclose(np.nansum(trace.contrib, -1), 1.0, atol=1e-4)  # shares of the actual reads
    assert np.isnan(trace.logits).all() and np.isnan(trace.grad_in).all()
    assert np.isfinite(metrics.locality(trace)["recent_mass"].to_numpy()).all()
    figures.mean_heatmap(trace, kind="weights")
    trace.save(tmp_path / "t")
    assert DepthTrace.load(tmp_path / "t").meta["call_names"] == watch.call_names
