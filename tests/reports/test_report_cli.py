"""``attnres-probe report``: from checkpoint directories, from saved traces, and its errors."""

from __future__ import annotations

import pytest

from attnres_probe.cli import main
from attnres_probe.reports import record_text

from helpers import tiny_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    for r in ("prenorm", "block"):
        tiny_model(r).save(root / r)
    return [str(root / "prenorm"), str(root / "block")]


def test_report_from_model_directories_writes_the_file(checkpoints, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", "--models", *checkpoints, "--text", "The cat sat on the mat.", "--out", str(out)]) == 0
    html = out.read_text()
    assert "The cat sat on the mat." in html and "weights sha256 (fp32 state dict)" in html
    assert "attnres-probe report --models" in html  # the reproducing command
    assert f"wrote {out}" in capsys.readouterr().out


def test_report_with_ablation_adds_the_ablation_section(checkpoints, tmp_path):
    out = tmp_path / "r.html"
    argv = ["report", "--models", *checkpoints, "--text", "abc abc abc", "--ablate", "embed", "--out", str(out)]
    assert main(argv) == 0
    assert 'id="ablation"' in out.read_text()


def test_report_with_weight_effect_adds_its_section_for_every_model(checkpoints, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNRES_PROGRESS", "1")  # say each slow step, as in a terminal
    out = tmp_path / "r.html"
    argv = ["report", "--models", *checkpoints, "--text", "abc abc abc abc", "--weight-effect", "--out", str(out)]
    assert main(argv) == 0
    html = out.read_text()
    assert 'id="weight-effect"' in html and "--weight-effect" in html  # the section, and the reproducing command
    err = capsys.readouterr().err
    assert err.count("weight beside effect:") == len(checkpoints) and "recording the text through 2 models" in err
    assert "building the page ..." in err


def test_weight_effect_with_traces_exits_2(tmp_path, capsys):
    d = record_text(tiny_model("full"), "abc", name="full").save(tmp_path / "t")
    assert main(["report", "--traces", str(d), "--weight-effect", "--out", str(tmp_path / "r.html")]) == 2
    assert "--weight-effect needs the models" in capsys.readouterr().err


def test_report_from_saved_traces(tmp_path):
    dirs = []
    for r in ("prenorm", "full"):
        dirs.append(str(record_text(tiny_model(r), "saved traces", name=r).save(tmp_path / r)))
    out = tmp_path / "r.html"
    assert main(["report", "--traces", *dirs, "--names", "base", "attn", "--out", str(out)]) == 0
    html = out.read_text()
    assert "saved traces" in html and "attn vs base" in html


def test_missing_output_directory_exits_2_with_the_path(checkpoints, tmp_path, capsys):
    out = tmp_path / "missing" / "r.html"
    assert main(["report", "--models", *checkpoints, "--text", "x y", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "does not exist" in err


def test_models_without_text_exits_2(checkpoints, tmp_path, capsys):
    assert main(["report", "--models", *checkpoints, "--out", str(tmp_path / "r.html")]) == 2
    assert "--text" in capsys.readouterr().err


def test_ablate_with_traces_exits_2(tmp_path, capsys):
    d = record_text(tiny_model("full"), "abc", name="full").save(tmp_path / "t")
    assert main(["report", "--traces", str(d), "--ablate", "embed", "--out", str(tmp_path / "r.html")]) == 2
    assert "--ablate needs the models" in capsys.readouterr().err


def test_a_source_is_required():
    with pytest.raises(SystemExit):
        main(["report", "--out", "r.html"])


def test_demo_takes_names_like_the_other_commands(tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", "--demo", "block", "prenorm", "--text", "x = 1\n", "--out", str(out), "--no-backward"]) == 0
    html = out.read_text()
    assert "attnres-probe report --demo block prenorm" in html  # the reproducing command keeps the choice
    assert "attnres-probe report: prenorm, block" in html  # two models, in the canonical order
    assert 'id="over-training"' in html  # the demo models recorded their routing over training
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["report", "--demo", "nope", "--out", str(out)])
    assert exc.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_report_carries_no_absolute_local_path(checkpoints, tmp_path):
    """#17 item 6: checkpoint folders and --out appear relative or by name, never as this machine's absolute paths."""
    out = tmp_path / "r.html"
    assert main(["report", "--models", *checkpoints, "--text", "abc abc", "--no-backward", "--out", str(out)]) == 0
    html = out.read_text()
    assert str(tmp_path) not in html
    for d in checkpoints:
        assert d not in html


@pytest.mark.parametrize("flag", ["--text-file", "--file"])
def test_the_text_file_flag_is_spelled_as_record_spells_it_too(checkpoints, tmp_path, flag):
    """``report`` reads a text file under --text-file and under --file (record's and summary's spelling)."""
    text = tmp_path / "t.txt"
    text.write_text("The dog sat on the log.", encoding="utf-8")
    out = tmp_path / "r.html"
    assert main(["report", "--models", *checkpoints, flag, str(text), "--no-backward", "--out", str(out)]) == 0
    assert "The dog sat on the log." in out.read_text()


def test_the_reproducing_command_keeps_the_texts_spaces_and_newlines(checkpoints, tmp_path):
    """#50: copying the "Command:" line reproduces the same text (the page does not collapse its indentation)."""
    import shlex

    from bs4 import BeautifulSoup

    text = "def f():\n    return  1"
    out = tmp_path / "r.html"
    assert main(["report", "--models", *checkpoints, "--text", text, "--out", str(out)]) == 0
    html = out.read_text()
    code = BeautifulSoup(html, "html.parser").find("code", class_="command")
    assert code is not None and "code.command { white-space: pre-wrap" in html
    argv = shlex.split(code.get_text())
    assert argv[argv.index("--text") + 1] == text


def test_the_title_names_a_folder_given_twice_as_the_page_labels_it(checkpoints, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", "--models", checkpoints[1], checkpoints[1], "--text", "The cat sat.", "--out", str(out)]) == 0
    assert "<title>attnres-probe report: block, block (2)</title>" in out.read_text()
