"""Fuzz one file reader over mutations of a valid file (run by tests/test_fuzz_readers.py in a
subprocess under a memory limit).

    python tests/fuzz_worker.py READER FOLDER EXAMPLES MEMORY_BYTES

READER is stats, trace, checkpoint or fla-config; FOLDER holds a valid file of that kind (for
fla-config, a config.json). Every example mutates a copy (a JSON value replaced, removed or
nested; a binary file truncated or its bytes flipped; checksums recomputed half the time, so
the deeper checks are reached) and reads it. The reader must return, or raise the error it
documents; any other exception, or running out of the memory limit, fails the run (exit 1 and
the example on stderr).
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-3, 10**9), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    st.sampled_from([10**9, 10**12, -1, 0, 64.9, "../../outside", "/abs/path", [], {}, "", [[[[[[1]]]]]]]),
)


def _paths(doc, prefix=(), depth=0):
    out = [prefix] if prefix else []
    if depth >= 4:
        return out
    if isinstance(doc, dict):
        for k, v in list(doc.items())[:40]:
            out += _paths(v, prefix + (k,), depth + 1)
    elif isinstance(doc, list):
        for i, v in list(enumerate(doc))[:6]:
            out += _paths(v, prefix + (i,), depth + 1)
    return out


def mutate_json(doc, data):
    paths = _paths(doc)
    if not paths:
        return data.draw(VALUES)
    path = data.draw(st.sampled_from(paths))
    op = data.draw(st.sampled_from(["replace", "replace", "delete", "nest"]))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "delete":
        if isinstance(parent, dict):
            del parent[last]
        else:
            parent.pop(last)
    elif op == "nest":
        parent[last] = [[[parent[last]]]]
    else:
        parent[last] = data.draw(VALUES)
    return doc


def mutate_bytes(path: Path, data) -> None:
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans()) and raw:
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 8))):
            if raw:
                raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(raw))


def _resum_stats(folder: Path) -> None:
    from attnres_probe.io import sha256_file

    try:
        doc = json.loads((folder / "stats.json").read_text())
        if isinstance(doc, dict):
            doc["files"] = {n: sha256_file(folder / n) for n in ("arrays.npz", "windows.parquet") if (folder / n).is_file()}
            (folder / "stats.json").write_text(json.dumps(doc))
    except (ValueError, OSError, RecursionError):
        pass


READERS = {}


def reader(name):
    def register(fn):
        READERS[name] = fn
        return fn

    return register


@reader("stats")
def fuzz_stats(src: Path, data, work: Path):
    from attnres_probe.corpus.stats import CorpusStats, StatsError

    folder = work / "s"
    shutil.copytree(src, folder)
    target = data.draw(st.sampled_from(["stats.json", "stats.json", "arrays.npz", "windows.parquet"]))
    if target == "stats.json":
        doc = json.loads((folder / target).read_text())
        (folder / target).write_text(json.dumps(mutate_json(doc, data)))
    else:
        mutate_bytes(folder / target, data)
    if data.draw(st.booleans()):
        _resum_stats(folder)
    try:
        s = CorpusStats.load(folder)
        s.pooled()
    except StatsError:
        pass


@reader("trace")
def fuzz_trace(src: Path, data, work: Path):
    from attnres_probe.trace import DepthTrace, TraceError

    folder = work / "t"
    shutil.copytree(src, folder)
    files = sorted(p.name for p in folder.iterdir())
    target = data.draw(st.sampled_from(["trace.json", "trace.json", *files]))
    if target == "trace.json":
        doc = json.loads((folder / target).read_text())
        (folder / target).write_text(json.dumps(mutate_json(doc, data)))
    else:
        mutate_bytes(folder / target, data)
    try:
        DepthTrace.load(folder)
    except TraceError:
        pass


@reader("checkpoint")
def fuzz_checkpoint(src: Path, data, work: Path):
    from attnres_probe.checkpoint import CheckpointError, load_checkpoint

    folder = work / "c"
    shutil.copytree(src, folder)
    if data.draw(st.booleans()):
        doc = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(mutate_json(doc, data)))
    else:
        mutate_bytes(folder / "model.safetensors", data)
    try:
        load_checkpoint(folder)
    except CheckpointError:
        pass


@reader("fla-config")
def fuzz_fla_config(src: Path, data, work: Path):
    import warnings

    from attnres_probe.families.fla import config as config_from_fla
    from attnres_probe.families.fla import expected as _expected
    from attnres_probe.pretrained import PretrainedError

    doc = mutate_json(json.loads((src / "config.json").read_text()), data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = config_from_fla(doc) if isinstance(doc, dict) else config_from_fla({})
        _expected(cfg)
    except PretrainedError:
        pass


def main() -> int:
    name, src, examples, memory = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    fn = READERS[name]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        with tempfile.TemporaryDirectory() as tmp:
            fn(src, data, Path(tmp))

    run()
    print(f"{name}: {examples} examples, every one loaded or refused with the documented error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
