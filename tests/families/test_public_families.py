"""Public model families opened by load_pretrained, against what each upstream's own code computed.

The fixtures (tests/fixtures/families/README.md) are tiny random models built with the upstream code
and every depth parameter moved off its initialisation. Bounds follow docs/design.md's model bound
``C u G`` (C = 8, G = (L+1)(sqrt(d) + S), S the most sources a read sees) times the largest |logit|
(or the read's largest entry): ours in float32 against the upstream's float64 forward is within it,
doubled where the upstream's own float64 is float32-accurate (nanogpt's rotary casts to float32);
ours in float64 against the upstream's float64 within ``2 C u64 G``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from attnres_probe import Probe, load_pretrained
from attnres_probe.pretrained import PretrainedError

from helpers import model_bound_g as _G
from helpers import read_hook_names as _read_names

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "families"
U32, U64, C = 2.0**-24, 2.0**-53, 8
QWEN = ["baseline", "block-bias", "block-sigmoid_scalar", "full-bias", "full-learnable_alpha"]
NANO = ["baseline", "baseline_ln_bias_gelu_learned", "dynamic_bs4", "dynamic_bs2_ln_bias_gelu_learned",
        "dynamic_bs4_ln_swiglu_rope", "dynamic_bs2_rms_gelu_learned_gate_bias", "static_bs4_ln_bias_gelu_learned",
        "dynamic_bs4_l8", "static_bs2"]
CASES = [("qwen3", v) for v in QWEN] + [("nanogpt", v) for v in NANO]


def _load(family: str, variant: str, dtype=torch.float32):
    model, _ = load_pretrained(FIX / family / variant, tokenizer=False, dtype=dtype)
    return model




@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{v}" for f, v in CASES])
def case(request):
    family, variant = request.param
    exp = load_file(str(FIX / family / variant / "expected.safetensors"))
    return family, variant, exp


def test_the_logits_are_the_upstreams_to_float32_rounding(case):
    family, variant, exp = case
    model = _load(family, variant)
    ids, ref = exp["input_ids"], exp["logits_f64"]
    with torch.no_grad():
        ours = model(ids).double()
    rope_cast = family == "nanogpt" and model.cfg.positional == "rope"
    bound = (2 if rope_cast else 1) * C * U32 * _G(model) * float(ref.abs().max())
    err = float((ours - ref).abs().max())
    assert err <= bound, f"{family}/{variant}: max |logit error| {err:.3g} > bound {bound:.3g}"
    assert err > 0 or variant == "baseline"  # not the upstream file read back
    model64 = _load(family, variant, torch.float64)
    with torch.no_grad():
        ours64 = model64(ids)
    if not rope_cast:  # upstream's own float64 forward is float64 throughout
        bound64 = 2 * C * U64 * _G(model) * float(ref.abs().max())
        assert float((ours64 - ref).abs().max()) <= bound64


def test_every_read_and_its_own_weights_are_the_upstreams(case):
    family, variant, exp = case
    model = _load(family, variant, torch.float64)
    names = _read_names(model)
    reads = sorted(int(k.split(".")[1]) for k in exp if k.startswith("read.") and k.endswith(".input"))
    weight_names = [m.hook_native_weights.name if hasattr(m, "hook_native_weights") else m.hook_weights.name
                    for m in model.mixers]
    with torch.no_grad():
        _, cache = model.run_with_cache(exp["input_ids"], names_filter=lambda n: n in names or n in weight_names)
    G = _G(model)
    for r in reads:
        ref = exp[f"read.{r}.input"]
        err = float((cache[names[r]] - ref).abs().max())
        assert err <= 2 * C * 2**-23 * G * float(ref.abs().max()), f"read {r}: {err:.3g}"
        if f"read.{r}.weights" in exp:
            w = exp[f"read.{r}.weights"]
            ours = cache[weight_names[r]][..., : w.shape[-1]]
            assert float((ours - w).abs().max()) <= 2 * C * 2**-23 * G, f"read {r} weights"
    assert len(reads) == model.cfg.n_reads - (family == "qwen3")  # Qwen3-AttnRes has no final depth read


@pytest.mark.parametrize("variant", [v for v in QWEN if v != "baseline"])
def test_qwen3_attnres_coefficients_rebuild_every_read_and_match_the_upstream(variant):
    """sum_i c_i v_i over (embedding, sublayer outputs) is each read's input, in float64, within roundoff
    times sum_i |c_i| |v_i|; and c is what the upstream's own states and weights imply."""
    exp = load_file(str(FIX / "qwen3" / variant / "expected.safetensors"))
    model = _load("qwen3", variant, torch.float64)
    trace = Probe(model).run(exp["input_ids"])
    names = _read_names(model)
    n = model.cfg.n_layers
    outs = ["hook_embed"] + [f"blocks.{i}.hook_{w}_out" for i in range(n) for w in ("attn", "mlp")]
    with torch.no_grad():
        _, cache = model.run_with_cache(exp["input_ids"], names_filter=lambda x: x in names or x in outs)
    V = torch.stack([cache[o] for o in outs], dim=-2)  # [B, P, L+1, d]
    coef = torch.as_tensor(trace.depth_weights).double().nan_to_num(0.0)  # [B, P, R, S] (float32 in the trace)
    for r in range(2 * n):
        c = coef[:, :, r, : r + 1]
        assert torch.allclose(c, exp[f"read.{r}.coeffs"], rtol=0, atol=4 * U32 * (r + 2)), f"read {r}"
    # exact reconstruction from float64 coefficients (the hook, not the float32 trace)
    with torch.no_grad():
        _, wc = model.run_with_cache(exp["input_ids"], names_filter=lambda x: x.endswith("hook_weights"))
    for r, m in enumerate(model.mixers[:-1]):
        c = wc[m.hook_weights.name][..., : r + 1]
        rebuilt = torch.einsum("bps,bpsd->bpd", c, V[..., : r + 1, :])
        cond = torch.einsum("bps,bpsd->bpd", c.abs(), V[..., : r + 1, :].abs())
        assert ((rebuilt - cache[names[r]]).abs() <= C * U64 * (r + 3) * cond).all(), f"read {r}"
    assert trace.native["weights"].shape[:3] == (2, 12, 2 * n + 1)
    assert trace.meta["native_sources"][1] == ["P0", "P1", "P1 (running)"] if variant.startswith("full") else True


def test_the_static_control_is_routed_the_same_for_every_input():
    model = _load("nanogpt", "static_bs4_ln_bias_gelu_learned")
    assert model.cfg.static_routing and model.cfg.residual == "block"
    torch.manual_seed(3)
    a, b = Probe(model).run(torch.randint(0, 96, (1, 10))), Probe(model).run(torch.randint(0, 96, (1, 10)))
    assert (a.depth_weights[0, 0] == b.depth_weights[0, -1]).all() or torch.equal(
        torch.as_tensor(a.depth_weights).nan_to_num(-1), torch.as_tensor(b.depth_weights).nan_to_num(-1))
    from attnres_probe.axis import fixed_routing, rule_title

    assert fixed_routing("block", a.meta["config"]) and rule_title("block", a.meta["config"]) == "Block AttnRes (static routing)"


def test_folder_code_never_runs_and_the_family_is_recorded():
    """The nanogpt folders' config.json names modeling_nanogpt.py in auto_map; here that file raises if imported."""
    folder = FIX / "nanogpt" / "dynamic_bs4_ln_swiglu_rope"
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    model, tok = load_pretrained(folder)
    assert tok is not None and model.cfg.extra["family"] == "nanogpt"
    assert model.cfg.positional == "rope" and not model.cfg.attn_gate and model.cfg.mlp == "swiglu" and model.cfg.norm == "layernorm"
    assert model.cfg.block_size == 4 and model.cfg.n_sources == 3
    gated, _ = load_pretrained(FIX / "nanogpt" / "dynamic_bs2_rms_gelu_learned_gate_bias", tokenizer=False)
    assert gated.cfg.attn_gate and gated.cfg.norm == "rms" and gated.cfg.bias and gated.cfg.positional == "learned"


@pytest.mark.parametrize("change, message", [
    ({"attnres_gate_type": "sigmoid_vector"}, "'attnres_gate_type' = 'sigmoid_vector' .*supported gates: bias, sigmoid_scalar, learnable_alpha"),
    ({"attnres_mode": "diagonal"}, "'attnres_mode' = 'diagonal'; supported: block, full"),
    ({"use_sliding_window": True}, "'use_sliding_window' = true"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rotary scaling"),
    ({"model_type": "llama"}, "model_type is 'llama' .*which attnres-probe does not build; supported families"),
])
def test_variants_that_cannot_be_represented_are_refused_naming_the_key(tmp_path, change, message):
    src = FIX / "qwen3" / "block-bias"
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    data = json.loads((tmp_path / "config.json").read_text())
    data.update(change)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(PretrainedError, match=message) as err:
        load_pretrained(tmp_path, tokenizer=False)
    assert "\n" not in str(err.value)


def test_the_upstream_sigmoid_vector_export_is_refused():
    with pytest.raises(PretrainedError, match="sigmoid_vector"):
        load_pretrained(FIX / "qwen3" / "block-sigmoid_vector", tokenizer=False)


def test_nanogpt_options_outside_the_model_are_refused(tmp_path):
    src = FIX / "nanogpt" / "dynamic_bs4"
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    for change, message in [({"bidirectional": True}, "'bidirectional'"), ({"attn_res_block_size": 3}, "'attn_res_block_size' = 3"),
                            ({"layer_norm_epsilon": 1e-6}, "'layer_norm_epsilon'")]:
        data = json.loads((src / "config.json").read_text())
        data.update(change)
        (tmp_path / "config.json").write_text(json.dumps(data))
        with pytest.raises(PretrainedError, match=message):
            load_pretrained(tmp_path, tokenizer=False)


def test_expected_files_name_their_upstream_commit():
    with safe_open(str(FIX / "qwen3" / "block-bias" / "expected.safetensors"), "pt") as f:
        assert f.metadata()["commit"].startswith("7fa43ed")
    with safe_open(str(FIX / "nanogpt" / "dynamic_bs4" / "expected.safetensors"), "pt") as f:
        assert f.metadata()["upstream"].endswith("785492ad3dbb8d4195583e82cc2aed303f2e058a")


@pytest.mark.parametrize("variant", ["dynamic_bs4", "dynamic_bs4_l8", "dynamic_bs2_ln_bias_gelu_learned"])
def test_attnres4babylm_masking_is_reproduced(variant):
    """The kept sources per read and the masked logits equal what attnres4babylm's masking code gave."""
    from attnres_probe.masking import masking_hooks, masking_plan

    folder = FIX / "nanogpt" / variant
    with safe_open(str(folder / "expected.safetensors"), "pt") as f:
        masks = json.loads(f.metadata()["masks"])
    exp = load_file(str(folder / "expected.safetensors"))
    model = _load("nanogpt", variant)
    modes = {"nonrecent": ("nonrecent", None), "embed": ("embed", None),
             "random_count_matched.s20260718": ("random", 20260718), "random_count_matched.s20260722": ("random", 20260722)}
    for key, (which, seed) in modes.items():
        plan = masking_plan(model.axis, which, **({"seed": seed} if seed else {}))
        assert [[int(c in kept) for c in range(k)] for kept, k in zip(plan, model.axis.counts)] == masks[key], key
        with torch.no_grad():
            ours = model.run_with_hooks(exp["input_ids"], fwd_hooks=masking_hooks(model, which, **({"seed": seed} if seed else {}))).double()
        ref = exp[f"mask.{key}.logits"].double()
        bound = 2 * C * U32 * _G(model) * float(ref.abs().max())
        assert float((ours - ref).abs().max()) <= bound, key


def test_a_family_is_compared_with_its_baseline_and_the_static_control_gets_no_verdict():
    """The family's baseline and AttnRes folders share a shape (the rule's own keys are not the shape), and a
    model with input-independent routing gets estimates but no verdict."""
    from attnres_probe.analysis.compare import judged_direction
    from attnres_probe.config import shape_difference

    cfgs = {v: _load("nanogpt", v).cfg.to_dict() for v in ("baseline", "dynamic_bs4", "static_bs2")}
    assert shape_difference(cfgs) == ""
    assert shape_difference({v: _load("qwen3", v).cfg.to_dict() for v in ("baseline", "block-bias")}) == ""
    assert judged_direction("locality_distance", "block", cfgs["dynamic_bs4"]) == "lower"
    assert judged_direction("locality_distance", "block", cfgs["static_bs2"]) == ""
    assert judged_direction("mean_loss", "block", cfgs["static_bs2"]) == ""
