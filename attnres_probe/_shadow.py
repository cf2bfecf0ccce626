"""Keep the repository's top-level folders from shadowing installed distributions.

``kernels/``, ``hooks/``, ``dashboards/`` and ``reports/`` at the repository root are the packages
``attnres_probe.kernels``, ``attnres_probe.hooks``, ... (``setup.py`` maps them). Python started in
the repository root (a notebook, ``python -c``, ``python -m pytest``) also finds them as top-level
packages, ``kernels`` first of all, before an installed distribution of the same name (Hugging
Face's ``kernels``, which transformers imports). Each folder's ``__init__.py`` therefore hands an
import under its bare name to :func:`hand_over`: the installed distribution is imported in its place,
and without one the import fails as if the folder were not there. This module imports nothing of the
package (it runs before the package can be imported).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def hand_over(name: str, init_file: str) -> None:
    """Replace the half-made top-level module ``name`` (the folder ``init_file`` opens) with the
    installed distribution of that name, found on ``sys.path`` without the repository root.

    Raises:
        ModuleNotFoundError: no distribution of that name is installed (the message names the
            package the folder is).
    """
    root = Path(init_file).resolve().parents[1]
    sys.modules.pop(name, None)
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        raise ModuleNotFoundError(
            f"No module named {name!r}: the repository's {name}/ folder is the package attnres_probe.{name} "
            f"(import it under that name)", name=name) from None
    finally:
        sys.path[:] = saved
    sys.modules[name] = module
