"""LR-AttnRes checkpoints (jon123boss/LR-AttnRes; tests/fixtures/families/lr) opened by load_pretrained,
against what the upstream's own code computed.

Bounds follow tests/families/test_public_families.py: ``C u G`` (C = 8, G = (L+1)(sqrt(d) + S)) times the
largest |logit| (or the read's largest entry). Ours in float32 against the upstream's float64 forward is within
``C u32 G`` (measured: 0.11 of it for the baseline, 0.20 Full, 0.41 Block, 0.20 the public-era Block). The
upstream's float64 forward keeps its depth softmax in float32 (``F.softmax(logits.float())``), so ours in float64
agrees with it to float32 rounding of the depth weights only: held to a hundredth of the float32 bound where a depth
read mixes (measured: 0.12-0.28 % of it), and to ``2 C u64 G`` for the baseline, which has no depth softmax.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnres_probe import load_pretrained
from attnres_probe.config import ConfigError, ModelConfig
from attnres_probe.families import lr_attnres
from attnres_probe.layers import GainlessRMSNorm, Rotary
from attnres_probe.model import AttnResTransformer
from attnres_probe.pretrained import PretrainedError, is_pretrained_folder

from helpers import model_bound_g as _G
from helpers import read_hook_names as _read_names

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "families" / "lr"
U32, U64, C = 2.0**-24, 2.0**-53, 8
VARIANTS = ["baseline", "full", "block2", "block2_legacy"]


def _load(variant: str, dtype=torch.float32, **kwargs):
    model, _ = load_pretrained(FIX / variant, tokenizer=False, dtype=dtype, **kwargs)
    return model




def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.fixture(scope="module", params=VARIANTS)
def case(request):
    return request.param, load_file(str(FIX / request.param / "expected.safetensors"))


def test_the_logits_are_the_upstreams_to_float32_rounding(case):
    variant, exp = case
    model = _load(variant)
    ids, ref = exp["input_ids"], exp["logits_f64"]
    bound = C * U32 * _G(model) * float(ref.abs().max())
    err = float((_logits(model, ids).double() - ref).abs().max())
    assert 0 < err <= bound, f"{variant}: max |logit error| {err:.3g}, bound {bound:.3g} (ratio {err / bound:.3f})"
    err64 = float((_logits(_load(variant, torch.float64), ids) - ref).abs().max())
    bound64 = 2 * C * U64 * _G(model) * float(ref.abs().max()) if variant == "baseline" else bound / 100
    assert err64 <= bound64, f"{variant}: float64 error {err64:.3g} > {bound64:.3g}"


def test_every_read_and_its_own_weights_are_the_upstreams(case):
    variant, exp = case
    model = _load(variant, torch.float64)
    names = _read_names(model)
    weight_names = [m.hook_weights.name for m in model.mixers]
    with torch.no_grad():
        _, cache = model.run_with_cache(exp["input_ids"], names_filter=lambda n: n in names or n in weight_names)
    G = _G(model)
    reads = sorted(int(k.split(".")[1]) for k in exp if k.startswith("read.") and k.endswith(".input"))
    assert reads == list(range(model.cfg.n_reads))  # 2L + 1 reads, the final one included
    for r in reads:
        ref = exp[f"read.{r}.input"]
        err = float((cache[names[r]] - ref).abs().max())
        assert err <= 2 * C * 2**-23 * G * float(ref.abs().max()), f"read {r}: {err:.3g}"
        if variant == "baseline":
            assert f"read.{r}.weights" not in exp and not weight_names
            continue
        w = exp[f"read.{r}.weights"].permute(1, 2, 0)  # upstream [S, B, T] -> ours [B, T, S]
        ours = cache[weight_names[r]]
        assert torch.all(ours[..., w.shape[-1]:] == 0)  # the columns this read cannot see
        assert float((ours[..., : w.shape[-1]] - w).abs().max()) <= 2 * C * 2**-23 * G, f"read {r} weights"
    if variant.startswith("block2"):  # blocks end at ceil(2L i / 2) = 4, 8: sources embed, block1, block2
        assert model.cfg.block_boundaries == [4] and model.cfg.n_sources == 3


def test_only_the_weights_only_unpickler_reads_the_checkpoint(monkeypatch):
    calls, real = [], torch.load

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording)
    for variant in ("block2", "block2_legacy"):  # the pinned layout (numpy rng state) and the public-era one
        _load(variant)
    assert len(calls) == 2
    for args, kwargs in calls:
        assert kwargs.get("weights_only") is True and str(args[0]).endswith("final_model.pt")


CANARY: list[str] = []


def _canary():
    CANARY.append("ran")  # pragma: no cover - must never run
    return {}


class Payload:
    def __reduce__(self):
        return (_canary, ())


def _resave(tmp_path: Path, variant: str, change=None, name: str = "copy") -> Path:
    """A copy of a fixture whose checkpoint ``change(ckpt)`` edited (read weights-only: its test data)."""
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(FIX / variant / "README.md", folder / "README.md")
    ckpt = torch.load(FIX / variant / "final_model.pt", map_location="cpu", weights_only=True)
    if change is not None:
        change(ckpt)
    torch.save(ckpt, folder / "final_model.pt")
    return folder


def test_a_checkpoint_pickling_anything_else_is_refused_unrun(tmp_path):
    folder = _resave(tmp_path, "block2_legacy", lambda ck: ck.update(extra=Payload()))
    with pytest.raises(PretrainedError, match=r"_canary, which attnres-probe does not unpickle.*weights_only=False") as err:
        load_pretrained(folder, tokenizer=False)
    assert "\n" not in str(err.value) and not CANARY
    (folder / "final_model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(PretrainedError, match="not a readable torch checkpoint") as err:
        load_pretrained(folder, tokenizer=False)
    assert "\n" not in str(err.value)


def test_a_checkpoint_larger_than_the_memory_bound_is_refused_unread(monkeypatch):
    monkeypatch.setenv("ATTNRES_MEMORY_CAP", "100000")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(PretrainedError, match="training checkpoint final_model.pt .*would need"):
        load_pretrained(FIX / "full", tokenizer=False)


@pytest.mark.parametrize("change, message", [
    ({"attnres_block_average": True}, "'attnres_block_average' = true .*n\\^-1.*sums its blocks"),
    ({"attnres_block_average": True, "attnres_block_average_mode": "sqrt"}, "n\\^-0.5"),
    ({"attnres_block_count_prior": True}, "'attnres_block_count_prior' = true"),
    ({"attnres_block_alpha": "0.5"}, "'attnres_block_alpha' = '0.5'"),
    ({"attnres_block_beta": 1.0}, "'attnres_block_beta' = 1.0"),
    ({"attnres_block_alpha_learned": True}, "'attnres_block_alpha_learned' = true"),
    ({"attnres_block_split_sublayers": True}, "'attnres_block_split_sublayers' = true"),
    ({"attnres_key_norm": False}, "'attnres_key_norm' = false"),
    ({"attn_res_query_norm": True}, "'attn_res_query_norm' = true"),
    ({"attnres_type": "diagonal"}, "'attnres_type' = 'diagonal'; upstream accepts full, block"),
    ({"attnres_backend": "turbo"}, "'attnres_backend' = 'turbo'"),
    ({"norm_pos": "after"}, "'norm_pos' = 'after' is not supported; only 'before'"),
    ({"clip_qkv": 5.0}, "'clip_qkv' = 5.0"),
    ({"use_attnres": "yes"}, "'use_attnres' is 'yes'; it must be true or false"),
    ({"a_newer_option": 1}, "keys this loader does not know, \\['a_newer_option'\\]"),
    ({"n_embd": 128}, "config/weights mismatch"),
    ({"rope_theta": 10000.0}, "not the rotary table 'rope_theta' 10000.0 implies"),
])
def test_variants_that_cannot_be_represented_are_refused_naming_the_key(tmp_path, change, message):
    folder = _resave(tmp_path, "block2_legacy", lambda ck: ck["model_args"].update(change))
    with pytest.raises(PretrainedError, match=message) as err:
        load_pretrained(folder, tokenizer=False)
    assert "\n" not in str(err.value)


def test_the_low_rank_lr_variants_are_refused():
    with pytest.raises(PretrainedError, match="'use_lrid' = true .*supported: the baseline .*standard AttnRes") as err:
        load_pretrained(FIX / "lr_full", tokenizer=False)
    assert "\n" not in str(err.value)


def test_a_missing_count_prior_takes_the_training_configs_value(tmp_path):
    """checkpoint_config's migration: block2_legacy has no attnres_block_count_prior (so False); a training
    config that set it True makes it a count-prior model, which is refused."""
    folder = _resave(tmp_path, "block2_legacy", lambda ck: ck["config"].update(attnres_block_count_prior=True))
    assert "attnres_block_count_prior" not in torch.load(folder / "final_model.pt", weights_only=True)["model_args"]
    with pytest.raises(PretrainedError, match="'attnres_block_count_prior' = true"):
        load_pretrained(folder, tokenizer=False)


def test_kernel_only_options_compiled_prefixes_and_tied_heads_load(tmp_path):
    ids = load_file(str(FIX / "block2_legacy" / "expected.safetensors"))["input_ids"]
    base = _load("block2_legacy", torch.float64)
    ref = _logits(base, ids)

    def fast_and_compiled(ck):
        ck["model_args"].update(attnres_backend="fast", use_fused_attnres=True)
        ck["model"] = {"_orig_mod." + k: v for k, v in ck["model"].items()}

    other, _ = load_pretrained(_resave(tmp_path, "block2_legacy", fast_and_compiled), tokenizer=False, dtype=torch.float64)
    assert torch.equal(_logits(other, ids), ref)

    def tied(ck):
        ck["model_args"]["weight_tying"] = True
        del ck["model"]["lm_head.weight"]

    model, _ = load_pretrained(_resave(tmp_path, "block2_legacy", tied, "tied"), tokenizer=False, dtype=torch.float64)
    assert model.cfg.tie_embeddings
    with torch.no_grad():
        base.W_U.copy_(base.W_E.T)
    assert torch.allclose(_logits(model, ids), _logits(base, ids), rtol=0, atol=1e-12)


def test_folders_are_recognised_and_the_family_is_recorded(tmp_path):
    from attnres_probe.loading import load_model_folder

    folder = FIX / "full"
    assert not (folder / "config.json").exists() and is_pretrained_folder(folder)
    with pytest.raises(PretrainedError, match="has no tokenizer files .*tiktoken's cl100k_base"):
        load_model_folder(folder)  # the commands read text: upstream's tiktoken tokenizer is not in the folder
    model, tok = load_pretrained(folder, tokenizer=False)
    assert tok is None
    assert {"source": "LR-AttnRes", "family": "lr_attnres"}.items() <= model.cfg.extra.items()
    cfg = model.cfg
    assert (cfg.residual, cfg.norm_gain, cfg.eps_from_dtype, cfg.rope_layout, cfg.rope_stored_tables, cfg.qk_norm) == (
        "full", False, True, "interleaved", True, True)
    norms = [n for n, _ in model.named_parameters() if "norm" in n or n.startswith("ln") or ".ln" in n]
    assert cfg.normalization_type == "RMSPre" and all(n.endswith("_res.norm.weight") for n in norms)  # the reads' key gains
    assert all(bool((p.detach() == 1).all()) for n, p in model.named_parameters() if n in norms)
    assert _load("baseline").cfg.residual == "prenorm"
    (tmp_path / "config.json").write_text("{}")
    shutil.copy(folder / "final_model.pt", tmp_path / "final_model.pt")
    assert not lr_attnres.recognises_folder(tmp_path)  # a config.json decides for itself


def test_our_own_save_keeps_the_stored_rotary_tables_and_both_block_schedules_agree(tmp_path):
    exp = load_file(str(FIX / "block2" / "expected.safetensors"))
    model = _load("block2", torch.float64)
    ref = _logits(model, exp["input_ids"])
    model.save(tmp_path / "ours")
    again = AttnResTransformer.load(tmp_path / "ours").double()
    assert torch.equal(again.blocks[0].attn.rotary.cos, model.blocks[0].attn.rotary.cos)
    assert torch.equal(_logits(again, exp["input_ids"]), ref)
    two = AttnResTransformer(model.cfg, schedule="two_phase").double()
    two.load_state_dict(model.state_dict())
    assert torch.allclose(_logits(two, exp["input_ids"]), ref, rtol=0, atol=1e-12)


# -- the model options these checkpoints need -------------------------------------------------
def test_the_new_options_default_to_the_old_model_and_are_checked():
    cfg = ModelConfig()
    assert (cfg.norm_gain, cfg.eps_from_dtype, cfg.rope_layout, cfg.rope_stored_tables) == (True, False, "neox", False)
    for bad, message in [
        (dict(norm="layernorm", norm_gain=False), "norm_gain=False applies to norm='rms' only"),
        (dict(residual="hyper", eps_from_dtype=True), "eps_from_dtype=True applies to norm='rms' with residual"),
        (dict(positional="rope", rope_layout="gptj"), "rope_layout is 'gptj'; accepted values are neox, interleaved"),
        (dict(rope_layout="interleaved"), "apply to positional='rope' only"),
        (dict(positional="rope", rope_stored_tables=1), "rope_stored_tables must be true or false"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            ModelConfig(**bad)
        assert "\n" not in str(err.value)


def test_gainless_norms_use_torchs_eps_of_the_compute_dtype():
    norm = GainlessRMSNorm(8, None)
    assert not list(norm.parameters()) and not norm.state_dict() and norm.eps == torch.finfo(torch.float32).eps
    x = torch.randn(3, 8, dtype=torch.float64) * 1e-5
    assert torch.allclose(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2.0**-52), rtol=1e-14, atol=0)
    assert norm.double().eps == 2.0**-52


def test_interleaved_rotary_rotates_pairs_of_neighbouring_dimensions():
    rot = Rotary(8, 5, 100.0, layout="interleaved")
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    pos = torch.arange(5, dtype=torch.float64)[:, None] * 100.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    c, s = pos.cos()[None, :, None], pos.sin()[None, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    want = torch.stack([c * x1 - s * x2, s * x1 + c * x2], -1).flatten(-2)
    assert torch.allclose(rot(x), want, rtol=0, atol=1e-14)
    stored = Rotary(8, 5, 100.0, layout="interleaved", stored=True)
    assert set(stored.state_dict()) == {"cos", "sin"} and not Rotary(8, 5, 100.0).state_dict()
