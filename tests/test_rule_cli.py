"""The residual rules beyond AttnRes on the command line and in titles: rule_title, ``train --residual
hyper`` and the rule flags, and ``summary``'s weights for DenseFormer (coefficients shown as shares)."""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import pytest
import torch

from attnres_probe import AttnResTransformer, ModelConfig
from attnres_probe.axis import RESIDUALS, rule_title
from attnres_probe.cli.train import add_train_parser
from attnres_probe.config import ConfigError


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


# the smallest train run of tests/test_train.py (TINY_FLAGS)
TINY_FLAGS = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--n-ctx", "32", "--batch-size", "4",
              "--eval-every", "4", "--quiet"]  # fmt: skip


def test_rule_title_names_every_rule_once():
    titles = {r: rule_title(r) for r in RESIDUALS}
    assert titles == {
        "prenorm": "PreNorm baseline",
        "full": "Full AttnRes",
        "block": "Block AttnRes",
        "hyper": "Hyper-Connections",
        "denseformer": "DenseFormer",
        "cumulative": "AttnRes over cumulative states",
    }
    assert rule_title("block", {"static_routing": True}) == "Block AttnRes (static routing)"
    # a config says which Hyper-Connections: mHC when its mhc is true
    assert rule_title("hyper", {"mhc": True, "n_streams": 4}) == "mHC"
    assert rule_title("hyper", {"mhc": False}) == "Hyper-Connections"
    assert rule_title("hyper", ModelConfig(residual="hyper", mhc=True, d_model=16, n_heads=2).to_dict()) == "mHC"
    assert rule_title("full", {"mhc": True}) == "Full AttnRes"  # mhc means nothing to another rule
    assert rule_title("something-new") == "something-new"


def test_the_dashboard_and_the_report_title_a_model_by_rule_title():
    """The dashboard's one-line description and the report's architecture column use rule_title
    (an mHC model is called mHC, not 'hyper')."""
    from attnres_probe.dashboards.state import Explorer
    from attnres_probe.reports.builder import _model_row

    model = AttnResTransformer(ModelConfig(d_model=16, n_layers=2, n_heads=2, n_ctx=32, residual="hyper", mhc=True,
                                           n_streams=2)).eval()
    ex = Explorer({"m": model}, text="abcdef")
    assert ex.describe("m").startswith("mHC · 2 layers")
    trace = ex.traces(ex.run("abcdefgh"))["m"]
    assert _model_row(trace, "m")["architecture"] == "mHC (2 streams, dynamic with flat input, Sinkhorn 20 rounds)"


def test_train_builds_a_hyper_connections_model_from_the_flags(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli("train", "--out", str(out), "--residual", "hyper", "--n-streams", "2", "--steps", "2", *TINY_FLAGS) == 0
    assert "trained 2 steps (Hyper-Connections)" in capsys.readouterr().out
    cfg = AttnResTransformer.load(out).cfg
    assert (cfg.residual, cfg.n_streams, cfg.mhc, cfg.hc_dynamic, cfg.hc_dynamic_input) == ("hyper", 2, False, True, "stream")
    assert (cfg.d_model, cfg.n_layers, cfg.block_size, cfg.dwa_period) == (32, 2, None, None)


def test_train_flags_of_the_rules_reach_the_model_config(tmp_path):
    from attnres_probe.cli.train import _configs_from_args

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command", required=True))

    def config(*flags: str) -> ModelConfig:
        return _configs_from_args(parser.parse_args(["train", "--out", str(tmp_path / "r"), *flags]))[0]

    hyper = config("--residual", "hyper")  # the demo shape with the rule's defaults
    assert (hyper.d_model, hyper.n_layers, hyper.n_streams, hyper.mhc, hyper.hc_dynamic_input) == (64, 8, 4, False, "stream")
    mhc = config("--residual", "hyper", "--mhc", "--sinkhorn-iters", "5")
    assert (mhc.mhc, mhc.hc_dynamic_input, mhc.sinkhorn_iters) == (True, "flat", 5)  # mHC's own default input
    static = config("--residual", "hyper", "--static-hc", "--no-mhc")
    assert (static.hc_dynamic, static.hc_dynamic_input, static.mhc) == (False, "stream", False)
    dense = config("--residual", "denseformer", "--dwa-dilation", "2", "--dwa-period", "2")
    assert (dense.residual, dense.dwa_dilation, dense.dwa_period, dense.n_streams) == ("denseformer", 2, 2, None)
    # a config file of one rule, another rule on the command line: the file's fields of its rule go
    ModelConfig(residual="hyper", mhc=True, d_model=16, n_heads=2).to_json(tmp_path / "hc.json")
    full = config("--config", str(tmp_path / "hc.json"), "--residual", "full")
    assert (full.residual, full.n_streams, full.mhc) == ("full", None, None)
    # --no-mhc over an mHC file whose input was mHC's default: HC's default input
    hc = config("--config", str(tmp_path / "hc.json"), "--no-mhc")
    assert (hc.mhc, hc.hc_dynamic_input) == (False, "stream")
    # the tanh belongs to HC's dynamic terms: on by default for HC, off for mHC, and refused with mHC
    assert (hc.hc_tanh, config("--residual", "hyper", "--mhc").hc_tanh) == (True, False)
    with pytest.raises(ConfigError, match="hc_tanh=True applies only to Hyper-Connections without mhc"):
        ModelConfig(residual="hyper", mhc=True, hc_tanh=True)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--residual", "full", "--dwa-period", "2"], "--dwa-period (dwa_period) applies only to --residual denseformer"),
        (["--n-streams", "2"], "--n-streams (n_streams) applies only to --residual hyper; this run's residual is 'full'"),
        (["--residual", "denseformer", "--mhc"], "--mhc/--no-mhc (mhc) applies only to --residual hyper"),
        (["--residual", "hyper", "--n-streams", "0"], "n_streams must be an integer in 1..64"),
        (["--residual", "hyper", "--block-size", "2"], "--block-size (block_size) applies only to --residual block"),
        # a flag of one Hyper-Connections variant given to another would change nothing
        (["--residual", "hyper", "--mhc", "--no-hc-tanh"], "--no-hc-tanh (hc_tanh) applies only to dynamic Hyper-Connections without --mhc"),
        (["--residual", "hyper", "--static-hc", "--no-hc-tanh"], "this run is static (--static-hc)"),
        (["--residual", "hyper", "--sinkhorn-iters", "5"], "--sinkhorn-iters (sinkhorn_iters) applies only with --mhc"),
        (["--residual", "hyper", "--static-hc", "--hc-dynamic-input", "flat"], "--hc-dynamic-input (hc_dynamic_input) applies only to dynamic"),
    ],
)
def test_a_rule_flag_the_residual_does_not_take_is_a_one_line_error(tmp_path, capsys, flags, message):
    code = cli("train", "--out", str(tmp_path / "run"), "--steps", "2", *TINY_FLAGS, *flags)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("attnres-probe train: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_summary_shows_denseformer_coefficients_as_shares_that_sum_to_one():
    from attnres_probe import Probe
    from attnres_probe.cli.record import layer_summary

    model = AttnResTransformer(ModelConfig(d_model=16, n_layers=2, n_heads=2, n_ctx=32, residual="denseformer"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # DWA weights away from the identity init (which reads as PreNorm: every coefficient 1)
        for p in model.dwa.alphas.values():
            p.copy_(torch.rand(p.shape, generator=g) + 0.2)
    trace = Probe(model.eval()).run("abcdefghij", backward=False)
    raw = trace.coefficients().to_numpy()
    assert not np.allclose(np.nansum(raw, axis=1), 1.0)  # the raw coefficients are not shares
    table = layer_summary(trace)
    from attnres_probe.analysis.windows import normalised_weights

    shares = normalised_weights(trace, trace.depth_weights)[trace.mask]  # [N, R, S]
    assert np.allclose(np.nansum(shares, axis=-1), 1.0)  # every token's read sums to one
    with warnings.catch_warnings():  # the sources a read does not see are NaN in every token
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(shares, axis=0)
    assert np.allclose(np.nansum(mean, axis=1), 1.0)
    np.testing.assert_allclose(table["embed_weight"].to_numpy(), mean[:, 0])
    assert list(table["top_source"]) == [trace.source_labels[int(np.nanargmax(row))] for row in mean]
    embed = table["embed_weight"].to_numpy()
    assert embed[0] == pytest.approx(1.0)  # the first read sees the embedding alone
    assert ((embed[1:] < 1) & (embed[1:] > 0)).all()  # later reads share it (raw: a coefficient of 1 or more)


def test_summary_keeps_the_attnres_weights_and_prenorms_implied_embed_weight():
    from attnres_probe import Probe
    from attnres_probe.cli.record import layer_summary

    from helpers import tiny_model

    for residual in ("full", "prenorm"):
        trace = Probe(tiny_model(residual)).run("abcdefghij", backward=False)
        table = layer_summary(trace)
        np.testing.assert_allclose(table["embed_weight"].to_numpy(), trace.weights().to_numpy()[:, 0])
        if residual == "prenorm":  # its implied weight: 1/k for the k sources a read sees
            np.testing.assert_allclose(table["embed_weight"].to_numpy(), 1.0 / np.arange(1, len(table) + 1), rtol=1e-6)
