"""Attention patterns on request: keep ``blocks.{i}.attn.hook_pattern`` of one forward.

The depth recorder (:mod:`attnres_probe.hooks.recorder`) keeps reductions only; attention
patterns are [batch, head, query_pos, key_pos] per layer, quadratic in the length, so they are
kept only when asked (``Probe.run(..., patterns=True)``, :meth:`Probe.attention_patterns`) and
only for the layers asked. A hook on ``hook_pattern`` makes our model's attention run its
explicit path in that layer (``Attention``: SDPA elsewhere); the hooks here only observe.

Memory: 4 bytes per entry, ``4 B n_layers H P^2`` for every layer (float32), on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PatternRecorder", "PatternsComplete"]


class PatternsComplete(Exception):
    """Raised by a :class:`PatternRecorder` with ``stop=True`` once it holds every layer asked for:
    it ends the forward there (the layers after it are not run); the caller catches it."""


class PatternRecorder:
    """Context manager that keeps the attention patterns of the forward passes run inside it.

    Args:
        model: a hooked model (``hook_dict``) holding the hook points ``names``.
        names: the ``hook_pattern`` points to keep, in the order of the result's layer axis.
        rows: keep only these query positions (None: all), to bound memory when one token is asked.
        heads: keep only these heads (None: all).
        stop: end the forward (raise :class:`PatternsComplete`) as soon as every layer asked for
            is recorded, so the layers after the last of them cost nothing; only for a forward
            whose output is not needed.
        this_thread: observe only forwards of the thread that creates the recorder (as
            :class:`~attnres_probe.hooks.Recorder`): another thread's forward through the model
            still runs the explicit attention in these layers while the hooks are attached (the
            same values within rounding), but writes nothing here.

    After the forward, :meth:`result` is [batch, len(names), head, query_pos, key_pos] float32 on
    the CPU (query_pos: ``rows`` when given).
    """

    def __init__(self, model: Any, names: Sequence[str], rows: Sequence[int] | None = None, stop: bool = False,
                 this_thread: bool = True, heads: Sequence[int] | None = None):
        self.model = model
        self.stop = stop
        self.names = list(names)
        self.rows = None if rows is None else torch.as_tensor(list(rows), dtype=torch.long)
        self.heads = None if heads is None else torch.as_tensor(list(heads), dtype=torch.long)
        self._owner = threading.get_ident() if this_thread else None
        self._handles: list[tuple[Any, Any]] = []
        self._out: torch.Tensor | None = None
        self._seen: set[int] = set()

    def __enter__(self) -> PatternRecorder:
        hd = self.model.hook_dict
        missing = [n for n in self.names if n not in hd]
        if missing:
            raise ValueError(f"the model has no attention-pattern hook point {missing[0]!r}")
        try:
            for i, name in enumerate(self.names):
                hp = hd[name]
                self._handles.append((hp, hp.add_hook(self._hook(i), dir="fwd")))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for hp, handle in self._handles:
            handle.hook.remove()
            if handle in hp.fwd_hooks:
                hp.fwd_hooks.remove(handle)
        self._handles.clear()

    def _hook(self, i: int):
        def keep(pattern: torch.Tensor, hook: Any = None) -> None:
            if self._owner is not None and threading.get_ident() != self._owner:
                return None
            with torch.no_grad():
                p = pattern.detach()
                if self.heads is not None:
                    p = p.index_select(1, self.heads.to(p.device))
                if self.rows is not None:
                    p = p.index_select(2, self.rows.to(p.device))
                if self._out is None:
                    B, H, Q, K = p.shape
                    self._out = torch.zeros(B, len(self.names), H, Q, K, dtype=torch.float32)
                self._out[:, i] = p.float().cpu()
                self._seen.add(i)
            if self.stop and len(self._seen) == len(self.names):
                raise PatternsComplete()
            return None

        return keep

    def result(self) -> torch.Tensor:
        """[batch, layer, head, query_pos, key_pos] of the forward run inside the context.

        Raises:
            RuntimeError: a layer's hook never ran (no forward, or the model skipped it).
        """
        if self._out is None or len(self._seen) != len(self.names):
            absent = [n for i, n in enumerate(self.names) if i not in self._seen]
            raise RuntimeError(f"no attention pattern was recorded at {absent[0]!r}: the forward never reached it")
        return self._out
