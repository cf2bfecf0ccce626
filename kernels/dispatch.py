"""The dispatch table, op -> backend -> implementation, and the decorator that makes a public op.

Every public op that has fused kernels is one function decorated with :func:`dispatch`: its
body checks the call's arguments and says where the tensors live (a :class:`~.utils.Where`);
the decorator resolves the backend from that (:func:`~.backends.resolve_backend`) and calls
the implementation :data:`TABLE` names, with the same arguments. An implementation has the
public op's signature less ``backend``, and trusts its arguments. The modules are imported on
first use (Triton may be missing; the Numba kernels' module needs its cache folder), then kept.

The small ops (``ops/rms``, ``ops/mixture``) have one implementation, in PyTorch, and no entry.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

from .backends import resolve_backend
from .utils import Where

__all__ = ["TABLE", "dispatch", "implementation"]

# op -> backend -> the module (under ops/) whose function of the op's name implements it.
# phase1 and phase2 have no Numba kernels: the "numba" backend runs their reference.
TABLE: dict[str, dict[str, str]] = {
    "depth_attn": {"torch": "depth_attn.reference", "numba": "depth_attn.numba", "triton": "depth_attn.triton"},
    "phase1": {"torch": "phase1.reference", "numba": "phase1.reference", "triton": "phase1.triton"},
    "phase2": {"torch": "phase2.reference", "numba": "phase2.reference", "triton": "phase2.triton"},
    # mHC's [..., n, n] projection: no GPU kernel (n is a handful of streams), the reference there
    "sinkhorn": {"torch": "sinkhorn.reference", "numba": "sinkhorn.numba", "triton": "sinkhorn.reference"},
}

_modules: dict[str, ModuleType] = {}


def implementation(op: str, backend: str) -> Callable:
    """The function that implements ``op`` on ``backend`` (``"torch"``, ``"numba"`` or
    ``"triton"``, as :func:`~.backends.resolve_backend` returns it): the public op's
    signature less ``backend``, and no argument checks.

    For a caller that has checked its arguments and resolved the backend once for many calls:
    the model does so once per forward. A read's checks and backend choice cost about 80 us of
    a 500 us forward read on the Numba backend (S=5 sources [8, 128, 64]; an A/B of the call in
    one process, 300 interleaved rounds, 2026-12-03), 2-4 % of a demo-size model's forward.

    Raises:
        KeyError: for an op or backend not in :data:`TABLE`.
        ImportError: when the backend's module cannot be imported here (resolve first).
    """
    name = TABLE[op][backend]
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(f"{__package__}.ops.{name}")
    return getattr(module, op)  # looked up on every call: a patched module attribute is used


def dispatch(op: str) -> Callable[[Callable[..., Where]], Callable]:
    """Make the public op ``op`` of a function that checks a call's arguments.

    The decorated function takes the op's arguments (``backend`` keyword-only among them,
    for its signature and docstring), raises a ValueError for a bad one and returns the
    call's :class:`~.utils.Where`. The public op pops ``backend``, runs the checks, resolves
    the backend and returns what :func:`implementation` of that backend returns for the
    other arguments.
    """

    def decorate(checks: Callable[..., Where]) -> Callable:
        @functools.wraps(checks)
        def public_op(*args, backend: str | None = None, **kwargs):
            where = checks(*args, **kwargs)
            chosen = resolve_backend(where.device, backend, dtypes=where.dtypes, d=where.d)
            return implementation(op, chosen)(*args, **kwargs)

        return public_op

    return decorate
