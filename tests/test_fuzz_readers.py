"""#37: property-based fuzzing of every file reader (hypothesis, tests/fuzz_worker.py).

Each reader runs in its own subprocess under ``RLIMIT_AS`` over mutated copies of a valid file: it
must load the file or refuse it with its documented error (StatsError, TraceError,
CheckpointError, PretrainedError), never another exception, never past the memory limit. The
examples are derandomized, so a run is reproducible; the four readers take well under 2 minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnres_probe import Probe

from helpers import sample_tokens, tiny_model

WORKER = Path(__file__).with_name("fuzz_worker.py")
MEMORY = 6 * 2**30  # address space of a worker: torch's own mappings take about 3 GiB of it
EXAMPLES = {"stats": 200, "trace": 200, "checkpoint": 200, "fla-config": 400}
FLA_CONFIG = {
    "model_type": "transformer", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "num_kv_heads": 2,
    "vocab_size": 96, "max_position_embeddings": 64, "attnres_block_size": 2, "hidden_ratio": 2, "norm_eps": 1e-6,
    "rope_theta": 10000.0, "qk_norm": False, "qkv_bias": False, "tie_word_embeddings": False, "hidden_act": "swish",
}


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    root = tmp_path_factory.mktemp("valid")
    model = tiny_model("block", n_layers=2, n_ctx=32)
    probe = Probe(model, name="block")
    probe.run_corpus(["a first text of a few words", "and a second one, longer than the first one is"], backward=True,
                     progress=False).save(root / "stats")
    probe.run(sample_tokens(12, batch=2), backward=True).save(root / "trace")
    model.save(root / "checkpoint")
    (root / "fla-config").mkdir()
    (root / "fla-config" / "config.json").write_text(json.dumps(FLA_CONFIG))
    return root


@pytest.fixture(scope="module")
def workers(valid, tmp_path_factory):
    """reader -> (its worker process, the files its stdout and stderr go to). The four workers, each
    a process of its own, start at once and share the machine's cores; each test below waits for
    its reader's."""
    logs = tmp_path_factory.mktemp("fuzz-logs")
    running = {}
    for reader in EXAMPLES:
        cmd = [sys.executable, str(WORKER), reader, str(valid / reader), str(EXAMPLES[reader]), str(MEMORY)]
        out, err = logs / f"{reader}.out", logs / f"{reader}.err"
        with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: no worker blocks on a full pipe
            running[reader] = (subprocess.Popen(cmd, stdout=o, stderr=e, cwd=WORKER.parent), out, err)
    yield running
    for proc, _, _ in running.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("reader", list(EXAMPLES))
def test_every_reader_loads_or_refuses_mutated_files_with_its_documented_error(workers, reader):
    proc, out, err = workers[reader]
    returncode = proc.wait(timeout=600)
    assert returncode == 0, err.read_text()[-3000:]
    assert "every one loaded or refused" in out.read_text()
