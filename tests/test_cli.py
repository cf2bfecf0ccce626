"""The attnres-probe command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnres_probe import DepthTrace, __version__
from attnres_probe.cli import main

from helpers import tiny_model


def test_help_and_version_work_from_the_console_script():
    out = subprocess.run([sys.executable, "-m", "attnres_probe.cli", "--help"], capture_output=True, text=True, check=True)
    for cmd in ("train", "record", "summary", "demo", "demo-models", "study"):
        assert cmd in out.stdout
    ver = subprocess.run([sys.executable, "-m", "attnres_probe.cli", "--version"], capture_output=True, text=True, check=True)
    assert ver.stdout.strip() == f"attnres-probe {__version__}"


def test_record_saves_a_loadable_trace(tmp_path, capsys):
    tiny_model("block").save(tmp_path / "m")
    assert main(["record", "--model", str(tmp_path / "m"), "--text", "hello <b>", "--out", str(tmp_path / "t")]) == 0
    trace = DepthTrace.load(tmp_path / "t")
    assert trace.str_tokens[0] == list("hello <b>") and trace.has_gradients
    assert "saved to" in capsys.readouterr().out
    from attnres_probe import AttnResTransformer
    from attnres_probe.io import weights_sha256

    # the model's one digest travels with the trace, so a report from it says which weights it came from
    assert trace.meta["weights_sha256"] == weights_sha256(AttnResTransformer.load(tmp_path / "m"))


def test_summary_prints_one_row_per_read(tmp_path, capsys):
    tiny_model("full").save(tmp_path / "m")
    assert main(["summary", "--model", str(tmp_path / "m"), "--text", "abcdef"]) == 0
    out = capsys.readouterr().out
    for label in ("L0.attn", "L1.mlp", "final", "rms_in", "embed_weight"):
        assert label in out
    assert "units, per read" in out and "fraction of ‖h‖²" in out and "uniform is 1/k" in out  # every column's unit


def test_user_errors_are_one_line_with_status_2(tmp_path, capsys):
    assert main(["record", "--model", str(tmp_path / "missing"), "--text", "x", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres-probe record: error:") and "Traceback" not in err
    assert f"--model {tmp_path / 'missing'}: not a folder" in err  # the flag named, as every other path error does
    tiny_model("full").save(tmp_path / "m")

    # a text longer than the context is recorded as report records it: in context-sized windows, and said (#50)
    assert main(["record", "--model", str(tmp_path / "m"), "--text", "x" * 100, "--out", str(tmp_path / "t")]) == 0
    assert "the text is 100 tokens, longer than the context (24): recorded as 5 windows" in capsys.readouterr().err
    from attnres_probe import DepthTrace

    trace = DepthTrace.load(tmp_path / "t")
    assert trace.tokens.shape == (5, 24) and trace.n_tokens == 100
    assert main(["record", "--model", str(tmp_path / "m"), "--text", "x" * 100, "--truncate", "--out", str(tmp_path / "t2")]) == 0
    assert DepthTrace.load(tmp_path / "t2").n_tokens == 24


def test_unknown_subcommand_exits_with_status_2_and_lists_the_commands(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "'frobnicate' is not a command" in err and "did you mean" not in err and "attnres-probe --help" in err


def test_summary_of_a_demo_model_with_the_default_text(capsys):
    """The built-in text fits the demo models' context (it used to be 138 bytes for 128)."""
    assert main(["summary", "--demo", "block"]) == 0
    out = capsys.readouterr().out
    assert "L0.attn" in out and "final" in out and "error" not in out


def test_output_into_a_closed_pipe_is_not_an_error():
    import subprocess
    import sys

    code = "import sys; from attnres_probe.cli import main; sys.exit(main(['summary', '--demo', 'block']))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything is written, like `| head -0`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "Traceback" not in err, err


def test_summary_of_a_one_character_text_without_backward(tmp_path, capsys):
    tiny_model("full").save(tmp_path / "m")
    assert main(["summary", "--model", str(tmp_path / "m"), "--text", "a"]) == 2
    assert "--no-backward" in capsys.readouterr().err
    assert main(["summary", "--model", str(tmp_path / "m"), "--text", "a", "--no-backward"]) == 0
    assert "final" in capsys.readouterr().out


def test_record_onto_an_existing_file_is_a_one_line_error(tmp_path, capsys):
    tiny_model("full").save(tmp_path / "m")
    (tmp_path / "t.json").write_text("x")
    assert main(["record", "--model", str(tmp_path / "m"), "--text", "abc", "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres-probe record: error:") and "give a folder path" in err and "Traceback" not in err


def test_top_level_help_is_fast_and_lists_what_each_command_says_of_itself():
    """--help imports no subcommand module; its one-line helps match the commands' own."""
    import argparse

    from attnres_probe.cli import SUBCOMMANDS, build_parser

    probe = (
        "import sys\n"
        "from attnres_probe.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m in ('torch', 'dash', 'transformer_lens')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("[]"), out.stdout[-200:] + out.stderr[-500:]
    full = build_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    own = {a.dest: a.help for a in sub._choices_actions}
    assert own == {name: help_text for name, _, _, help_text in SUBCOMMANDS}


def test_record_never_overwrites_what_is_already_in_out(tmp_path, capsys):
    """A second record into the same folder is refused before the model runs; --force replaces
    the trace; a folder holding anything else is never written into."""
    tiny_model("full").save(tmp_path / "m")
    base = ["record", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "t")]
    assert main([*base, "--text", "first"]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()}
    capsys.readouterr()
    assert main([*base, "--text", "second"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnres-probe record: error:") and "already holds a saved DepthTrace" in err and "--force" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()} == before
    assert main([*base, "--text", "second", "--force"]) == 0
    assert DepthTrace.load(tmp_path / "t").str_tokens[0] == list("second")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["record", "--model", str(tmp_path / "m"), "--text", "x", "--out", str(other), "--force"]) == 2
    assert "not empty and does not hold a saved DepthTrace" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"] and (other / "keep.txt").read_text() == "mine"


def test_demo_models_smoke_runs_never_replace_the_shipped_models(tmp_path, capsys):
    from attnres_probe.demo import demo_dir

    shipped = demo_dir("block") / "model.safetensors"
    before = shipped.read_bytes()
    assert main(["demo-models", "--steps", "3", "--only", "block", "--out", str(demo_dir("block").parent)]) == 2
    err = capsys.readouterr().err
    assert "would replace" in err and "--out a folder of your own" in err and "Traceback" not in err
    assert shipped.read_bytes() == before
    assert main(["demo-models", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "positive step count" in capsys.readouterr().err
    assert main(["demo-models", "--steps", "2", "--only", "block", "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert "val loss of the fp16 weights" in out and "shipped" not in out
    assert (tmp_path / "block" / "model.safetensors").is_file()


def test_demo_models_smoke_runs_never_replace_a_full_build_anywhere(tmp_path, capsys):
    """A checkout's models (or any full rebuild) are recognised by their log, wherever --out points."""
    import shutil

    from attnres_probe.demo import demo_dir

    shutil.copytree(demo_dir("full"), tmp_path / "full")
    before = (tmp_path / "full" / "model.safetensors").read_bytes()
    assert main(["demo-models", "--steps", "2", "--only", "full", "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert "trains shorter models than" in err and "(full: " in err
    assert (tmp_path / "full" / "model.safetensors").read_bytes() == before


def test_cli_errors_name_the_flag_not_the_python_argument(tmp_path, capsys):
    """#17 item 11: `pass overwrite=True (attnres-probe record --force)` becomes `pass --force` on the command line."""
    from attnres_probe.cli import cli_message

    tiny_model("full").save(tmp_path / "m")
    base = ["record", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "t"), "--text", "ab"]
    assert main(base) == 0
    capsys.readouterr()
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "pass --force to replace it" in err and "overwrite=True" not in err and "attnres-probe record --force" not in err
    assert cli_message("pass resume=True (--resume) to continue it, overwrite=True (--overwrite) to replace it") == (
        "pass --resume to continue it, --overwrite to replace it")


def test_notebook_save_into_a_used_folder_says_what_to_do(tmp_path):
    """#17 item 8: re-running trace.save(path) names overwrite=True."""
    from attnres_probe import Probe

    trace = Probe(tiny_model("full"), name="full").run("ab", backward=False)
    trace.save(tmp_path / "t")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        trace.save(tmp_path / "t")
    trace.save(tmp_path / "t", overwrite=True)


def test_text_flag_reads_backslash_n_as_a_newline(tmp_path):
    """#17 item 5: a shell's literal \\n in --text is a newline, not two characters."""
    from attnres_probe.cli import unescape_text

    assert unescape_text("a\\nb\\tc\\\\n") == "a\nb\tc\\n"
    tiny_model("full").save(tmp_path / "m")
    assert main(["record", "--model", str(tmp_path / "m"), "--text", "x\\ny", "--out", str(tmp_path / "t"), "--no-backward"]) == 0
    assert DepthTrace.load(tmp_path / "t").tokens[0, :3].tolist() == [ord("x"), 10, ord("y")]  # a newline byte


def test_readme_command_table_lists_every_command():
    """#17 item 11: the README's CLI table names every subcommand (study and corpus included)."""
    from pathlib import Path

    from attnres_probe.cli import SUBCOMMANDS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## Command line"): readme.index("## Layout")]
    for name, *_ in SUBCOMMANDS:
        assert f"`attnres-probe {name}" in table, name


def test_readme_notebook_quick_start_runs_as_written(tmp_path, monkeypatch):
    """The README's first code block, pasted as it stands into a fresh namespace, runs (it once used
    names it never defined); its last line compares the corpus runs."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("```python", readme.index("## Notebook quick-start")) + len("```python")
    code = readme[start: readme.index("```", start)]
    monkeypatch.chdir(tmp_path)  # it saves traces/block and t.png
    namespace: dict = {}
    exec(compile(code, "README.md quick-start", "exec"), namespace)
    assert (tmp_path / "traces" / "block").is_dir() and (tmp_path / "t.png").stat().st_size > 0
    assert len(namespace["metrics"].compare(namespace["base"], namespace["stats"])) > 0


@pytest.mark.parametrize("argv, hint", [
    (["report", "--demo", "--input", "f.txt", "--out", "x.html"], "--input: did you mean --file or --text-file?"),
    (["record", "--demo", "full", "--txt", "hi", "--out", "t"], "--txt: did you mean --text?"),
    (["record", "--demo", "full", "--txet", "hi", "--out", "t"], "--txet: did you mean --text?"),
])
def test_an_unknown_flag_gets_the_commands_usage_and_the_nearest_flags(argv, hint, capsys):
    """#35 item 7: the top-level usage and no suggestion did not help."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and hint in err
    assert f"usage: attnres-probe {argv[0]}" in err and f"see `attnres-probe {argv[0]} --help`" in err


@pytest.mark.parametrize("argv, said", [
    (["report", "--txet", "hi"], "--txet: did you mean --text?"),  # was hidden behind "--out is required"
    (["report", "--out", "x.html", "--txet", "hi"], "--txet: did you mean --text?"),  # ... or "one of --models ... is required"
])
def test_a_typo_is_named_before_the_required_arguments_are_checked(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_a_mistyped_command_gets_the_nearest_command(capsys):
    assert main(["dahs"]) == 2
    err = capsys.readouterr().err
    assert "'dahs' is not a command; did you mean `attnres-probe dash`?" in err and "demo-models" in err


def test_the_demo_parsers_name_the_kernels_backends_without_importing_torch():
    from attnres_probe.demo_recipe import BACKEND_NAMES
    from attnres_probe.kernels import BACKENDS

    assert BACKEND_NAMES == BACKENDS
    code = ("import sys\nfrom attnres_probe.cli import build_parser\nbuild_parser('demo'); build_parser('demo-models'); "
            "build_parser('dash')\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False"], done.stdout + done.stderr


def test_a_flag_near_none_gets_no_suggestion_and_dash_refuses_it_before_importing_dash():
    """The shared leading "--" made "--bogus" look like "--host"; and the dash command imported Dash
    and torch (seconds) before telling a user about a typo."""
    code = ("import sys\nfrom attnres_probe.cli import main\ntry:\n    main(['dash', '--bogus'])\nexcept SystemExit as e:\n"
            "    print(e.code, 'dash' in sys.modules, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert "unrecognized arguments: --bogus;" in done.stderr and "did you mean" not in done.stderr


def test_slow_steps_are_said_where_a_person_watches_and_nowhere_else(tmp_path, capsys, monkeypatch):
    """#35 item 5: record said nothing for seconds; a pipe or a log gets only results and errors."""
    tiny_model("full").save(tmp_path / "m")
    argv = ["record", "--model", str(tmp_path / "m"), "--text", "hi there", "--out"]
    monkeypatch.setenv("ATTNRES_PROGRESS", "1")
    assert main([*argv, str(tmp_path / "a")]) == 0
    assert "recording the text through m" in capsys.readouterr().err
    monkeypatch.delenv("ATTNRES_PROGRESS")  # stderr is captured here, not a terminal
    assert main([*argv, str(tmp_path / "b")]) == 0
    assert capsys.readouterr().err == ""
