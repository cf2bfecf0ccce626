"""Probe and recorder: recorded numbers equal the forward's, gradients, persistence, ablation, corpus."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from attnres_probe import DepthTrace, Probe, TraceError
from attnres_probe.hooks import MissingHooksError, RecorderError

from helpers import mixed_input_names, sample_tokens, sources_of_reads, tiny_model, weight_hook_names

TEXT = "The cat sat on the mat."


def _hook_count(model) -> int:
    return sum(len(hp._forward_hooks) for hp in model.hook_dict.values())


@pytest.mark.parametrize("residual, kw", [("full", {}), ("block", {"block_size": 3}), ("block", {"block_size": 2, "schedule": "two_phase"})])
def test_recorded_weights_are_the_weights_the_forward_used(residual, kw):
    schedule = kw.pop("schedule", None)
    model = tiny_model(residual, n_layers=3, **kw)
    model.schedule = schedule
    tokens = sample_tokens(10)
    trace = Probe(model).run(tokens, backward=False)
    _, cache = model.run_with_cache(tokens)
    srcs = sources_of_reads(model, cache)
    for r, (wname, hname) in enumerate(zip(weight_hook_names(model), mixed_input_names(model))):
        w = torch.from_numpy(trace.depth_weights[:, :, r])
        k = len(srcs[r])
        torch.testing.assert_close(w[..., :k], cache[wname][..., :k], atol=0, rtol=0)
        assert w[..., k:].isnan().all() and (cache[wname][..., k:] == 0).all()  # unavailable: NaN in traces, 0 at the hook
        mix = sum(w[..., i, None] * s for i, s in enumerate(srcs[r]))
        torch.testing.assert_close(mix, cache[hname], atol=1e-6, rtol=0)
        logits = trace.logits[:, :, r]
        assert np.isnan(logits[..., k:]).all() and np.isfinite(logits[..., :k]).all()


def test_recorded_weights_match_on_the_triton_backend():
    pytest.importorskip("triton")
    model = tiny_model("block", n_layers=2, block_size=2)
    tokens = sample_tokens(6, batch=1)
    ref = Probe(model).run(tokens, backward=False)
    model.backend = "triton"
    tri = Probe(model).run(tokens, backward=False)
    np.testing.assert_allclose(tri.depth_weights, ref.depth_weights, atol=1e-5, rtol=0)
    np.testing.assert_allclose(tri.contrib, ref.contrib, atol=1e-5, rtol=0)
    _, cache = model.run_with_cache(tokens)
    srcs = sources_of_reads(model, cache)
    for r, (wname, hname) in enumerate(zip(weight_hook_names(model), mixed_input_names(model))):
        k = len(srcs[r])
        np.testing.assert_array_equal(tri.depth_weights[:, :, r, :k], cache[wname][..., :k].numpy())
        w = torch.from_numpy(tri.depth_weights[:, :, r])
        mix = sum(w[..., i, None] * s for i, s in enumerate(srcs[r]))
        torch.testing.assert_close(mix, cache[hname], atol=1e-6, rtol=0)


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_gradient_norms_match_autograd(residual):
    model = tiny_model(residual, n_layers=2)
    tokens = sample_tokens(9)
    trace = Probe(model).run(tokens, backward=True)
    captured = {}

    def keep(x, hook):
        captured[hook.name] = x

    names = mixed_input_names(model)
    logits = model.run_with_hooks(tokens, fwd_hooks=[(n, keep) for n in names])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    params = [p for blk in model.blocks for p in [*blk.ln1.parameters(), *blk.attn.parameters()]]
    grads = torch.autograd.grad(loss, [captured[n] for n in names] + params[:3])
    for r, g in enumerate(grads[: len(names)]):
        np.testing.assert_allclose(trace.grad_in[:, :, r], g.norm(dim=-1).numpy(), rtol=1e-5, atol=1e-9)
    block0_attn = [*model.blocks[0].ln1.parameters(), *model.blocks[0].attn.parameters()]
    g0 = torch.autograd.grad(
        torch.nn.functional.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()), block0_attn
    )
    expected = float(torch.sqrt(sum(g.pow(2).sum() for g in g0)))
    assert trace.param_grad[0] == pytest.approx(expected, rel=1e-5)
    assert all(p.grad is None for p in model.parameters()), "the probe must not touch .grad"
    assert trace.meta["mean_loss"] == pytest.approx(float(loss), rel=1e-6)


@pytest.mark.parametrize("backend", ["numba", "torch", "triton"])
@pytest.mark.parametrize("residual, kw", [("full", {}), ("block", {"block_size": 3}), ("prenorm", {})])
def test_contribution_shares_equal_the_definition(residual, kw, backend):
    """c_ri = w_ri <v_i, h_r> / |h_r|^2 with sources and mixed inputs rebuilt from the cache."""
    model = tiny_model(residual, n_layers=3, **kw)
    model.backend = backend
    tokens = sample_tokens(10)
    trace = Probe(model).run(tokens, backward=False)
    model.backend = "torch"
    _, cache = model.run_with_cache(tokens)
    srcs = sources_of_reads(model, cache)
    for r, hname in enumerate(mixed_input_names(model)):
        h = cache[hname] if hname in cache else sum(srcs[r])  # the PreNorm final read is the sum
        w = torch.ones(len(srcs[r])) if residual == "prenorm" else torch.from_numpy(trace.depth_weights[:, :, r, : len(srcs[r])])
        dots = torch.stack([torch.linalg.vecdot(v, h) for v in srcs[r]], -1)
        want = w * dots / torch.linalg.vecdot(h, h).unsqueeze(-1)
        got = torch.from_numpy(trace.contrib[:, :, r])
        torch.testing.assert_close(got[..., : len(srcs[r])], want, atol=2e-5, rtol=1e-4)
        assert torch.isnan(got[..., len(srcs[r]) :]).all()


def test_contribution_shares_describe_the_mixture_after_an_intervention():
    model = tiny_model("full", n_layers=2)
    tokens = sample_tokens(9)
    seen = {}

    def keep_embed_only(w, hook):
        out = torch.zeros_like(w)
        out[..., 0] = 1.0
        return out

    name = weight_hook_names(model)[3]
    cname = name.replace("hook_weights", "hook_contrib")
    model.add_hook(name, keep_embed_only)
    model.add_hook(cname, lambda c, hook: seen.setdefault("c", c.clone()))
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        model.reset_hooks()
    c = seen["c"]
    torch.testing.assert_close(c[..., 0], torch.ones_like(c[..., 0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(c[..., 1:4], torch.zeros_like(c[..., 1:4]), atol=1e-6, rtol=0)
    assert (c[..., 4:] == 0).all()  # unavailable: 0 at the hook (TransformerLens's masking), NaN in traces


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_contribution_shares_sum_to_one_per_read(residual):
    trace = Probe(tiny_model(residual, n_layers=3)).run(sample_tokens(11), backward=False)
    sums = np.nansum(trace.contrib, axis=-1)
    np.testing.assert_allclose(sums, 1.0, atol=1e-5)
    assert np.isnan(trace.contrib[:, :, 0, 1:]).all()


def test_prenorm_magnitudes_match_the_transformerlens_cache():
    model = tiny_model("prenorm", n_layers=2)
    tokens = sample_tokens(7)
    trace = Probe(model).run(tokens, backward=False)
    _, cache = model.run_with_cache(tokens)

    def rms(x):
        return x.pow(2).mean(-1).sqrt().numpy()

    for r, name in enumerate(mixed_input_names(model)):
        np.testing.assert_allclose(trace.rms_in[:, :, r], rms(cache[name]), rtol=1e-6)
    np.testing.assert_allclose(trace.rms_out[:, :, 0], rms(cache["hook_embed"] + cache["hook_pos_embed"]), rtol=1e-6)
    np.testing.assert_allclose(trace.rms_out[:, :, 2], rms(cache["blocks.0.hook_mlp_out"]), rtol=1e-6)
    assert (trace.depth_weights[:, :, 3, :4] == 1).all() and np.isnan(trace.logits).all()


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_grad_out_is_the_norm_of_the_gradient_at_every_sublayer_output(residual):
    """||dL/dv_j|| at the embedding and every sublayer output, through every read of it: equal
    to autograd's gradient with respect to those very tensors (captured by plain hooks), and for
    PreNorm equal to the residual-stream gradient at the read after it (grad_in)."""
    from attnres_probe.losses import trace_loss

    model = tiny_model(residual, n_layers=3).double()
    tokens = sample_tokens(9, batch=2)
    trace = Probe(model).run(tokens, backward=True)
    names = ["hook_embed"] + [f"blocks.{i}.hook_{part}_out" for i in range(3) for part in ("attn", "mlp")]
    captured: dict[str, torch.Tensor] = {}

    def keep(x, hook):
        captured[hook.name] = x
        return x

    logits = model.run_with_hooks(tokens, fwd_hooks=[(n, keep) for n in names])
    _, loss = trace_loss(logits, tokens, torch.ones_like(tokens, dtype=torch.bool))
    grads = torch.autograd.grad(loss, [captured[n] for n in names])
    want = np.stack([g.norm(dim=-1).numpy() for g in grads], axis=-1)  # [B, P, L+1]
    np.testing.assert_allclose(trace.grad_out, want, rtol=1e-5)  # the trace stores float32
    if residual == "prenorm":
        np.testing.assert_allclose(trace.grad_out, trace.grad_in, rtol=1e-6)
    else:  # under AttnRes the gradient at a read covers one path only: not the same quantity
        with np.errstate(invalid="ignore", divide="ignore"):
            assert np.nanmax(np.abs(trace.grad_out[..., 1:] / trace.grad_in[..., 1:] - 1)) > 0.01


def test_a_version_1_trace_without_grad_out_loads_with_it_all_nan(tmp_path):
    import json as _json

    Probe(tiny_model("full")).run("an older trace", backward=True).save(tmp_path / "t")
    meta_path = tmp_path / "t" / "trace.json"
    doc = _json.loads(meta_path.read_text())
    doc["schema_version"] = 1
    del doc["shapes"]["grad_out"]
    table = pd.read_parquet(tmp_path / "t" / "sources.parquet").drop(columns=["grad_out"])
    table.to_parquet(tmp_path / "t" / "sources.parquet", index=False)
    from attnres_probe.io import sha256_file

    doc["files"]["sources.parquet"] = sha256_file(tmp_path / "t" / "sources.parquet")
    meta_path.write_text(_json.dumps(doc))
    back = DepthTrace.load(tmp_path / "t")
    assert np.isnan(back.grad_out).all() and back.grad_out.shape == back.rms_out.shape
    assert np.isfinite(back.rms_out).all()


def test_trace_round_trips_exactly(tmp_path):
    trace = Probe(tiny_model("block")).run("round trip <b>&\"'", backward=True)
    trace.save(tmp_path / "t")
    back = DepthTrace.load(tmp_path / "t")
    assert np.isfinite(trace.grad_out).all()
    for name in ("tokens", "mask", "loss", "depth_weights", "logits", "contrib", "rms_in", "grad_in", "rms_out", "grad_out",
                 "param_grad", "mixer_grad"):
        a, b = getattr(trace, name), getattr(back, name)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert back.meta == trace.meta
    assert back.str_tokens == trace.str_tokens


def test_corrupted_or_future_trace_gives_clear_error(tmp_path):
    trace = Probe(tiny_model("full")).run(TEXT, backward=False)
    trace.save(tmp_path / "t")
    cube = tmp_path / "t" / "cube.parquet"
    data = bytearray(cube.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cube.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="corrupt"):
        DepthTrace.load(tmp_path / "t")
    trace.save(tmp_path / "u")
    meta = tmp_path / "u" / "trace.json"
    doc = json.loads(meta.read_text())
    doc["schema_version"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match="schema-version 99 trace.*upgrade"):
        DepthTrace.load(tmp_path / "u")
    with pytest.raises(TraceError, match="not a saved DepthTrace"):
        DepthTrace.load(tmp_path / "nothing")


def test_weights_frame_is_labelled_and_tidy_frame_drops_unavailable_cells():
    model = tiny_model("full")
    trace = Probe(model).run(TEXT, backward=False)
    df = trace.weights(token=4)
    assert list(df.index) == model.read_labels and list(df.columns) == model.source_labels
    one = trace.weights(token=4, read="L1.attn")
    assert one.shape == (1, 5) and one.index[0] == "L1.attn"
    np.testing.assert_allclose(one.to_numpy()[0], trace.depth_weights[0, 4, 2])
    tidy = trace.to_frame()
    R = len(model.read_labels)
    assert len(tidy) == len(TEXT) * sum(r + 1 for r in range(R))
    row = tidy[(tidy.pos == 4) & (tidy.read == "L1.attn") & (tidy.source == "L0.mlp")].iloc[0]
    assert row.weight == pytest.approx(float(trace.depth_weights[0, 4, 2, 2]))
    assert row.str_token == TEXT[4]
    with pytest.raises(IndexError, match="out of range"):
        trace.weights(token=len(TEXT))


def test_recorder_removes_its_hooks_also_when_the_forward_raises():
    model = tiny_model("full")
    before = _hook_count(model)
    Probe(model).run(TEXT)
    assert _hook_count(model) == before

    def boom(x, hook):
        raise RuntimeError("user hook failed")

    model.blocks[1].hook_attn_out.add_hook(boom)
    with pytest.raises(RuntimeError, match="user hook failed"):
        Probe(model).run(TEXT)
    assert _hook_count(model) == before + 1  # the user's hook stays, the recorder's are gone
    model.reset_hooks()


def test_nan_activations_are_recorded_and_flagged_not_raised():
    model = tiny_model("block")

    def poison(x, hook):
        x = x.clone()
        x[:, 2] = float("nan")
        return x

    with model.hooks(fwd_hooks=[("blocks.0.hook_attn_out", poison)]):
        trace = Probe(model).run(TEXT, backward=True)
    assert trace.flags, "non-finite values must be flagged"
    assert np.isnan(trace.rms_out[0, 2, 1])
    assert "non-finite" in trace._repr_html_()


def test_bad_input_errors():
    probe = Probe(tiny_model("full"))
    with pytest.raises(ValueError, match="empty"):
        probe.run("")
    with pytest.raises(ValueError, match="text has 30 tokens; this model's context is 24"):
        probe.run("x" * 30)
    assert probe.run("x" * 30, truncate=True, backward=False).tokens.shape == (1, 24)
    with pytest.raises(ValueError, match="at least two tokens"):
        probe.run("x", backward=True)
    with pytest.raises(MissingHooksError, match="not a TransformerLens-style model"):
        Probe(torch.nn.Linear(2, 2))


def test_missing_hook_points_are_listed():
    from transformer_lens import HookedRootModule
    from transformer_lens.hook_points import HookPoint

    class Half(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.cfg = type("C", (), {"n_layers": 1})()
            self.hook_embed = HookPoint()
            self.setup()

    with pytest.raises(MissingHooksError) as err:
        Probe(Half())
    for name in ("hook_pos_embed", "blocks.0.hook_resid_pre", "blocks.0.hook_mlp_out"):
        assert name in str(err.value)


def test_a_hook_failure_inside_the_recorder_is_reported_after_the_forward(monkeypatch):
    from attnres_probe.hooks import recorder

    model = tiny_model("full")

    def broken(x):
        raise ZeroDivisionError("bad reduction")

    monkeypatch.setattr(recorder, "_rms", broken)
    with pytest.raises(RecorderError, match="hook_pos_embed.*ZeroDivisionError"):
        Probe(model).run(TEXT, backward=False)
    assert _hook_count(model) == 0


def test_ablating_a_source_with_zero_mass_changes_nothing():
    model = tiny_model("full", n_layers=2)
    probe = Probe(model)

    def silence_l0_attn(z, hook):
        z = z.clone()
        z[..., 1] = float("-inf")
        return z

    with model.hooks(fwd_hooks=[("blocks.1.attn_res.hook_logits", silence_l0_attn)]):
        df = probe.ablate(TEXT, sources="L0.attn", reads="L1.attn")
    assert len(df) == 1 and df.mass[0] == 0.0
    assert abs(df.delta_loss[0]) < 1e-6


def test_ablating_all_but_one_source_equals_that_source_alone():
    model = tiny_model("block", n_layers=2, block_size=2)
    probe = Probe(model)
    tokens = probe.tokenize(TEXT)[0]
    df = probe.ablate(tokens, sources=["embed"], reads="final", joint=True)
    # final read sees [embed, block1, block2]; ablate all but block2
    df2 = probe.ablate(tokens, sources=["embed", "block1"], reads="final", joint=True)
    _, cache = model.run_with_cache(tokens)
    block2 = cache["blocks.1.hook_attn_out"] + cache["blocks.1.hook_mlp_out"]
    logits = model.run_with_hooks(tokens, fwd_hooks=[("hook_resid_final", lambda x, hook: block2)])
    expected = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:])
    assert df2.loss[0] == pytest.approx(float(expected), abs=1e-5)
    assert df2.source[0] == "embed+block1"
    assert df.delta_loss[0] != 0


def test_ablation_modes_and_errors():
    probe = Probe(tiny_model("full", n_layers=2))
    df = probe.ablate(TEXT, sources="embed", mode="mean")
    assert list(df.read) == ["L0.mlp", "L1.attn", "L1.mlp", "final"]
    uni = probe.ablate(TEXT, sources="all", reads=["L1.attn"], mode="uniform")
    assert list(uni.source) == ["embed", "L0.attn", "L0.mlp"]
    with pytest.raises(ValueError, match="accepted values are zero, uniform, mean"):
        probe.ablate(TEXT, mode="drop")
    with pytest.raises(ValueError, match="cannot remove all"):
        probe.ablate(TEXT, sources=["embed", "L0.attn"], reads="L0.mlp", joint=True)
    with pytest.raises(ValueError, match="PreNorm model: .* only mode 'zero'"):
        Probe(tiny_model("prenorm")).ablate(TEXT, mode="mean")


def test_corpus_aggregates_equal_individual_traces():
    probe = Probe(tiny_model("block", n_layers=2))
    texts = ["first text, long enough to split into two windows!", "second", "", "third one"]
    stats, traces = probe.run_corpus(texts, batch_size=2, backward=True, progress=False, keep_traces=True)
    singles = [probe.run(t, backward=False) for text in texts if text for t in _windows(text, 24)]
    pooled = np.concatenate([t.depth_weights[t.mask] for t in singles])
    np.testing.assert_allclose(stats.mean("depth_weights"), np.nanmean(pooled, 0), atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(stats.var("depth_weights"), np.nanvar(pooled, 0), atol=1e-6, equal_nan=True)
    rms = np.concatenate([t.rms_in[t.mask] for t in singles])
    np.testing.assert_allclose(stats.mean("rms_in"), rms.mean(0), rtol=1e-5)
    assert stats.n_tokens == sum(t.n_tokens for t in singles) == len("".join(texts))
    grads = np.stack([t.param_grad for t in traces])
    np.testing.assert_allclose(stats.mean("param_grad"), grads.mean(0), rtol=1e-6)
    assert stats.to_trace().weights().shape == (5, 3)


def _windows(text: str, n: int) -> list[str]:
    b = text.encode()
    return [b[i : i + n].decode() for i in range(0, len(b), n)]


def test_foreign_transformerlens_model_is_recorded_as_a_prenorm_baseline():
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (registers boot_native)
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(d_model=32, d_head=8, n_layers=2, n_ctx=16, n_heads=4, d_vocab=256, act_fn="gelu", seed=0)
    bridge = TransformerBridge.boot_native(cfg)
    probe = Probe(bridge, name="tl-native")
    tokens = sample_tokens(8, batch=1)
    trace = probe.run(tokens, backward=True)
    assert trace.residual == "prenorm" and trace.meta["foreign"]
    np.testing.assert_allclose(np.nansum(trace.contrib, -1), 1.0, atol=1e-4)
    _, cache = bridge.run_with_cache(tokens)
    rms = cache["blocks.1.hook_resid_mid"].pow(2).mean(-1).sqrt().numpy()
    np.testing.assert_allclose(trace.rms_in[:, :, 3], rms, rtol=1e-5)
    assert np.isfinite(trace.grad_in[:, :, :4]).all() and np.isfinite(trace.param_grad).all()


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_recording_without_contributions_keeps_everything_else(residual):
    model = tiny_model(residual, n_layers=2)
    tokens = sample_tokens(8)
    full = Probe(model).run(tokens, backward=True)
    no_contrib = Probe(model).run(tokens, backward=True, contributions=False)
    assert np.isnan(no_contrib.contrib).all()
    for name in ("depth_weights", "logits", "rms_in", "rms_out", "grad_in", "param_grad", "loss"):
        np.testing.assert_array_equal(getattr(no_contrib, name), getattr(full, name))


def test_run_corpus_takes_a_single_string_as_one_text():
    probe = Probe(tiny_model("block", n_layers=2))
    one = probe.run_corpus("The cat sat on the mat.", batch_size=4, progress=False)
    listed = probe.run_corpus(["The cat sat on the mat."], batch_size=4, progress=False)
    assert one.n_sequences == 1 and one.n_tokens == len("The cat sat on the mat.")
    np.testing.assert_array_equal(one.mean("depth_weights"), listed.mean("depth_weights"))
    text = repr(one)
    assert text.startswith("CorpusStats(") and "tokens=23" in text and len(text) < 300


def test_saving_a_trace_onto_a_file_says_it_needs_a_folder(tmp_path):
    trace = Probe(tiny_model("full", n_layers=1)).run(TEXT, backward=False)
    target = tmp_path / "trace.json"
    target.write_text("keep me")
    with pytest.raises(NotADirectoryError, match="is a file; a DepthTrace is saved as a folder"):
        trace.save(target)
    assert target.read_text() == "keep me"


def test_saving_never_replaces_a_trace_or_writes_into_a_foreign_folder(tmp_path):
    first = Probe(tiny_model("full", n_layers=1)).run("first", backward=False)
    second = Probe(tiny_model("full", n_layers=1)).run("second", backward=False)
    (tmp_path / "empty").mkdir()
    first.save(tmp_path / "empty")  # an existing empty folder is fine
    with pytest.raises(FileExistsError, match="already holds a saved DepthTrace; pass overwrite=True"):
        second.save(tmp_path / "empty")
    assert DepthTrace.load(tmp_path / "empty").str_tokens[0] == list("first")
    second.save(tmp_path / "empty", overwrite=True)
    assert DepthTrace.load(tmp_path / "empty").str_tokens[0] == list("second")
    (tmp_path / "empty" / ".DS_Store").write_text("")  # hidden files do not count
    first.save(tmp_path / "empty", overwrite=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "cube.parquet").write_text("not a trace")
    (tmp_path / "mine" / "notes.md").write_text("keep")
    with pytest.raises(FileExistsError, match="not empty and does not hold a saved DepthTrace"):
        first.save(tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "cube.parquet").read_text() == "not a trace"


def test_every_trace_records_the_kernels_and_schedule_that_computed_it(tmp_path, monkeypatch):
    """What you record is what the forward used: the backend and the Block schedule, resolved as
    the model's forward resolves them, in the trace's metadata (and through save/load)."""
    from attnres_probe import AttnResTransformer

    monkeypatch.delenv("ATTNRES_BACKEND", raising=False)  # auto: Numba for float32 CPU tensors

    block = tiny_model("block", block_size=2)
    cases = {
        "auto": (block, {"backend": "numba", "schedule": "sequential"}),
        "forced": (AttnResTransformer(block.cfg, backend="torch", schedule="two_phase"), {"backend": "torch", "schedule": "two_phase"}),
        "full": (tiny_model("full"), {"backend": "numba", "schedule": None}),
        "prenorm": (tiny_model("prenorm"), {"backend": None, "schedule": None}),
    }
    for label, (model, want) in cases.items():
        trace = Probe(model).run(TEXT, backward=False)
        assert {k: trace.meta[k] for k in want} == want, label
        assert ("depth mixing" in trace._repr_html_()) == (want["backend"] is not None), label
    assert "numba kernels, sequential schedule" in Probe(block).run(TEXT, backward=False)._repr_html_()
    trace.save(tmp_path / "t")
    assert DepthTrace.load(tmp_path / "t").meta["backend"] is None


def test_a_prenorm_read_loses_a_source_from_its_sum_alone_and_a_silent_source_changes_nothing():
    """#31 item 3: PreNorm's matched removal takes the source out of the read's sum (the rest rescaled
    as renormalised weights would be); a sublayer whose output is exactly zero changes no loss."""
    model = tiny_model("prenorm", n_layers=2)
    with torch.no_grad():
        model.blocks[0].mlp.W_out.weight.zero_()  # L0.mlp writes nothing
        if model.blocks[0].mlp.W_out.bias is not None:
            model.blocks[0].mlp.W_out.bias.zero_()
    probe = Probe(model, name="prenorm")
    frame = probe.ablate("the quick brown fox", reads=["final"])
    deltas = frame.set_index("source")["delta_loss"]
    assert abs(deltas["L0.mlp"]) < 1e-6 and deltas.drop("L0.mlp").abs().max() > 1e-4
    np.testing.assert_allclose(frame["mass"], 1 / 5)  # PreNorm's normalised weights: uniform over the five sources
    with pytest.raises(ValueError, match="only mode 'zero'"):
        probe.ablate("the quick brown fox", mode="uniform")


@pytest.mark.parametrize("residual", ["prenorm", "full", "block"])
def test_weight_beside_effect_sets_each_deep_reads_weights_beside_the_loss_change_of_removing_them(residual):
    from attnres_probe.ablation import weight_beside_effect

    probe = Probe(tiny_model(residual, n_layers=2), name=residual)
    text = "the quick brown fox"
    table = weight_beside_effect(probe, text)
    assert list(table.index) == ["L1.attn", "L1.mlp", "final"]  # the deep half of the five reads
    alone = probe.ablate(text, sources="embed", reads=["final"]).iloc[0]
    assert table.loc["final", "embed_delta"] == pytest.approx(alone["delta_loss"])
    assert table.loc["final", "embed_weight"] == pytest.approx(alone["mass"])
    if residual == "prenorm":  # equal weights: no rank to correlate
        assert table["rank_correlation"].isna().all()
    else:
        assert table["rank_correlation"].between(-1, 1).all()
    assert set(table.attrs["summary"]) == {"embed_weight", "embed_delta", "recent_weight", "recent_delta", "rank_correlation",
                                           "embed_uniform", "recent_uniform"}
    if residual != "block":  # one column per written source: the uniform share is 1/k
        np.testing.assert_allclose(table["embed_uniform"], 1.0 / table["sources"])
    if residual == "prenorm":  # its weights are the uniform reference
        np.testing.assert_allclose(table["embed_weight"], table["embed_uniform"], rtol=1e-6)
