"""``attnres-probe`` under torchrun with a fault injected into one rank (for the distributed tests).

``ATTNRES_TEST_FAULT=kind:rank:n`` makes rank ``rank`` fail when it records its (n+1)-th window:
``kill`` sends itself SIGKILL (a rank that dies), ``raise`` raises RuntimeError("injected fault").
"""

import os
import signal
import sys

from attnres_probe import probe as probe_module
from attnres_probe.cli import main

fault = os.environ.get("ATTNRES_TEST_FAULT")
if fault:
    kind, rank, after = fault.split(":")
    if int(os.environ.get("RANK", "0")) == int(rank):
        record, calls = probe_module.Probe.record, [0]

        def failing_record(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] > int(after):
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected fault")
            return record(self, *args, **kwargs)

        probe_module.Probe.record = failing_record

sys.exit(main())
