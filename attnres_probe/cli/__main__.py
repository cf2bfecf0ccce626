"""``python -m attnres_probe.cli`` (the form torchrun takes): the console script's :func:`~attnres_probe.cli.main`."""

import sys

from attnres_probe.cli import main

sys.exit(main())
