"""Exports are atomic: a failed, refused or interrupted write leaves the earlier file intact."""

from __future__ import annotations

import os
import pathlib

import pytest

from attnres_probe.reports import ReportWriteError, build_report

from trace_factory import make_trace

OLD = "<html>the earlier report</html>"


@pytest.fixture
def trace():
    return make_trace("full")


@pytest.fixture
def earlier(tmp_path):
    path = tmp_path / "report.html"
    path.write_text(OLD)
    return path


def _leftovers(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_a_new_export_replaces_the_earlier_file(trace, earlier):
    build_report([trace], earlier)
    assert earlier.read_text().startswith("<!DOCTYPE html>")
    assert _leftovers(earlier.parent) == []


def test_missing_directory_gives_a_clear_error_naming_the_path(trace, tmp_path):
    target = tmp_path / "no" / "such" / "dir" / "report.html"
    with pytest.raises(ReportWriteError) as info:
        build_report([trace], target)
    msg = str(info.value)
    assert str(target) in msg and "does not exist" in msg and "mkdir -p" in msg
    assert not (tmp_path / "no").exists()


def test_read_only_directory_gives_a_clear_error_and_keeps_the_earlier_file(trace, earlier, monkeypatch):
    directory = earlier.parent
    if os.geteuid() == 0:  # root writes anyway: make creating the temporary file fail as EACCES would
        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied", str(directory))

        monkeypatch.setattr("tempfile.mkstemp", refuse)
    else:
        directory.chmod(0o555)
    try:
        with pytest.raises(ReportWriteError) as info:
            build_report([trace], earlier)
    finally:
        directory.chmod(0o755)
    msg = str(info.value)
    assert str(earlier) in msg and "Permission denied" in msg and "writable" in msg
    assert earlier.read_text() == OLD
    assert _leftovers(directory) == []


def test_failed_rename_keeps_the_earlier_file_and_removes_the_temporary(trace, earlier, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ReportWriteError, match="Permission denied"):
        build_report([trace], earlier)
    assert earlier.read_text() == OLD
    assert _leftovers(earlier.parent) == []


def test_interrupted_write_keeps_the_earlier_file(trace, earlier, monkeypatch):
    real = pathlib.Path.write_text

    def interrupted(self, data, *a, **k):
        real(self, data[: len(data) // 2], *a, **k)  # half written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_report([trace], earlier)
    monkeypatch.undo()
    assert earlier.read_text() == OLD
    assert _leftovers(earlier.parent) == []


def test_full_disk_keeps_the_earlier_file(trace, earlier, monkeypatch):
    def full(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(ReportWriteError, match="No space left on device"):
        build_report([trace], earlier)
    monkeypatch.undo()
    assert earlier.read_text() == OLD
    assert _leftovers(earlier.parent) == []


def test_failure_while_building_never_touches_the_file(earlier):
    with pytest.raises(ValueError):
        build_report([make_trace("full")], earlier, explorer_tokens=0)
    assert earlier.read_text() == OLD


def test_a_directory_as_the_path_is_refused(trace, tmp_path):
    with pytest.raises(ReportWriteError, match="is a directory"):
        build_report([trace], tmp_path)
