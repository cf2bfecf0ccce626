"""Corpus recording over several processes with ``torch.distributed`` (started by ``torchrun``).

Under ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` > 1 in the environment),
:meth:`Probe.run_corpus <attnres_probe.probe.Probe.run_corpus>` and ``attnres-probe corpus``
split the documents between the ranks and combine what each recorded:

- **Shards.** Document ``i`` (in the corpus's order, counting from 0) belongs to rank
  ``i % N``. Every rank numbers documents the same way, so a window's key (document, offset)
  is the same whichever rank records it. A rank without documents (N larger than the corpus)
  records nothing and still takes part.
- **Lock step.** After each recorded batch every rank joins one ``all_reduce`` of a few
  integers: the tokens recorded so far (rank 0's progress bar shows the sum), whether it has
  finished its shard, and whether it failed. It runs in the background while the rank records
  its next batch (its result is read at the following tick), so ranks wait for each other only
  when one runs a whole batch ahead. A rank that finished keeps answering until all have. So a
  rank that raises is known to all within two batches, and a rank that dies breaks the
  collective on every other rank (gloo notices a closed connection at once; otherwise the
  process-group timeout, ``ATTNRES_DIST_TIMEOUT`` seconds, default 1800, bounds the wait).
- **Merge.** Each rank's :class:`~attnres_probe.corpus.stats.CorpusStats` travels as bytes (JSON, an
  ``.npz`` read with ``allow_pickle=False``, a Parquet window table: no pickle) through one
  ``all_gather``; every rank merges them in rank order (Chan's update), so every rank returns
  the same result, equal to one process's over the same documents to float rounding (the
  per-window values are identical).

The process group is the caller's when one is initialised; otherwise it is created from the
``torchrun`` environment: NCCL when CUDA is available (each rank on ``cuda:LOCAL_RANK``),
gloo on CPUs.
"""

from __future__ import annotations

import datetime
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

__all__ = [
    "DistributedRunError",
    "Ranks",
    "current_ranks",
    "in_torchrun",
    "is_mine",
    "merge_all",
]

T = TypeVar("T")
_MESSAGE_BYTES = 1024
_SEP = "\x1f"  # between an exception's type and its message in what ranks exchange
DEFAULT_TIMEOUT_S = 1800.0
RECORDING_STOPPED = "; the run stopped before its result was written: rerun with --resume to continue"


class DistributedRunError(RuntimeError):
    """A rank of a distributed run failed or vanished; the message names the rank and the cause."""


def in_torchrun() -> bool:
    """Whether this process is one of several started by ``torchrun`` (``WORLD_SIZE`` > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def is_mine(index: int, rank: int, world: int) -> bool:
    """Whether document ``index`` belongs to ``rank`` of ``world``: document i goes to rank i % world."""
    return index % world == rank


def _timeout() -> datetime.timedelta:
    raw = os.environ.get("ATTNRES_DIST_TIMEOUT", "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"ATTNRES_DIST_TIMEOUT={raw!r}: expected a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"ATTNRES_DIST_TIMEOUT={raw!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def current_ranks() -> Ranks | None:
    """The ranks of this run, or None in a single process.

    Uses the process group the caller initialised; under ``torchrun`` without one, initialises
    it (NCCL with CUDA, gloo otherwise).
    """
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if not in_torchrun():
            return None
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=_timeout())
    world = dist.get_world_size()
    if world == 1:
        return None
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return Ranks(rank=dist.get_rank(), world=world, device=device)


@dataclass
class Ranks:
    """This process's place in a distributed run, and the few collectives the corpus needs."""

    rank: int
    world: int
    device: torch.device
    _pending: tuple[Any, torch.Tensor] | None = field(default=None, repr=False)  # the tick running in the background

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, index: int) -> bool:
        """Whether document ``index`` is this rank's (see :func:`is_mine`)."""
        return is_mine(index, self.rank, self.world)

    def shard(self, texts: Iterable[T], empty: T) -> Iterator[T]:
        """``texts`` with every other rank's document replaced by ``empty`` (keeps the numbering)."""
        for i, text in enumerate(texts):
            yield text if self.mine(i) else empty

    # -- collectives ------------------------------------------------------------------------
    def _collective(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except DistributedRunError:
            raise
        except Exception as exc:  # gloo / NCCL: a peer closed its connection, or the timeout passed
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DistributedRunError(
                f"rank {self.rank} lost contact with the other ranks ({cause[:200]}): a rank stopped "
                "(torchrun's report names it)" + RECORDING_STOPPED
            ) from None

    def _vector(self, tokens: int = 0, done: bool = False, failed: bool = False) -> torch.Tensor:
        v = torch.zeros(2 + self.world, dtype=torch.int64, device=self.device)
        v[0], v[1] = int(tokens), int(done)
        v[2 + self.rank] = int(failed)
        return v

    def _result(self, v: torch.Tensor) -> tuple[int, int, list[int]]:
        """(tokens over all ranks, ranks done, failed ranks) of a finished all_reduce."""
        flags = v[2:].tolist()
        return int(v[0].item()), int(v[1].item()), [r for r, f in enumerate(flags) if f]

    def _finish_pending(self) -> tuple[int, int, list[int]] | None:
        if self._pending is None:
            return None
        work, v = self._pending
        self._pending = None
        self._collective(work.wait)
        return self._result(v)

    def tick(self, tokens: int, done: bool) -> tuple[int, int] | None:
        """One step of the lock step: (tokens over all ranks, ranks done) as of the previous tick, or
        None at the first. Raises :class:`DistributedRunError` once a rank has failed.

        The all_reduce runs in the background while this rank records its next batch (the
        result is read at the next tick), so a rank waits only when it runs a whole tick ahead.
        When the previous tick showed every rank done, no new one starts: every rank stops at
        the same tick.
        """
        import torch.distributed as dist

        previous = self._finish_pending()
        if previous is not None:
            total, n_done, failed = previous
            if failed:
                self._raise_failure(failed, "", RECORDING_STOPPED)
            if n_done == self.world:
                return total, n_done
        v = self._vector(tokens, done)
        work = self._collective(lambda: dist.all_reduce(v, async_op=True))
        self._pending = (work, v)
        return None if previous is None else previous[:2]

    def _sync(self, failed: bool, own: str, suffix: str) -> None:
        """A synchronous round after any pending tick: raises if any rank failed."""
        import torch.distributed as dist

        previous = self._finish_pending()
        if previous is not None and previous[2]:  # a rank failed at the last tick, before this one failed too
            self._raise_failure(previous[2], own, suffix)
        v = self._vector(failed=failed)
        self._collective(lambda: dist.all_reduce(v))
        failed_ranks = self._result(v)[2]
        if failed_ranks:
            self._raise_failure(failed_ranks, own, suffix)

    def fail(self, exc: BaseException, suffix: str = "") -> None:
        """This rank failed: tell the others (at their next tick) and raise the run's error everywhere."""
        self._sync(True, f"{type(exc).__name__}{_SEP}{exc}", suffix)

    def _raise_failure(self, failed_ranks: list[int], own: str, suffix: str) -> None:
        causes = [c.partition(_SEP) for c in self.messages(own)]  # (type, sep, message)
        shared = {causes[r] for r in failed_ranks}
        if len(failed_ranks) == self.world and len(shared) == 1:  # every rank found the same: say it as one process would
            raise DistributedRunError(causes[0][2] + suffix)
        first = failed_ranks[0]
        kind, _, text = causes[first]
        more = f" (and rank{'s' if len(failed_ranks) > 2 else ''} {', '.join(map(str, failed_ranks[1:]))})" if len(failed_ranks) > 1 else ""
        raise DistributedRunError(f"rank {first} failed{more}: {f'{kind}: {text}' if kind else 'no cause given'}{suffix}")

    def agree(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this rank, then learn whether it succeeded on every rank.

        Every rank must call ``agree`` at the same point. If ``fn`` raised on any rank, every
        rank raises one :class:`DistributedRunError` naming the first failing rank and its cause
        (or, when every rank found the same, the cause alone).
        """
        try:
            result = fn()
        except DistributedRunError:
            raise
        except Exception as exc:
            self.fail(exc)
            raise  # not reached: fail raises
        self._sync(False, "", "")
        return result

    def messages(self, text: str) -> list[str]:
        """Every rank's ``text`` (at most 1 KiB of UTF-8 each), in rank order."""
        import torch.distributed as dist

        raw = text.encode("utf-8")[:_MESSAGE_BYTES]
        buf = torch.zeros(_MESSAGE_BYTES + 2, dtype=torch.uint8, device=self.device)
        buf[:2] = torch.tensor(list(struct.pack("<H", len(raw))), dtype=torch.uint8)
        if raw:
            buf[2 : 2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(out, buf))
        texts = []
        for t in out:
            b = bytes(t.cpu().tolist())
            (n,) = struct.unpack("<H", b[:2])
            texts.append(b[2 : 2 + n].decode("utf-8", errors="replace"))
        return texts

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (sizes first, then one padded all_gather)."""
        import torch.distributed as dist

        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(sizes, size))
        n = [int(s.item()) for s in sizes]
        buf = torch.zeros(max(n), dtype=torch.uint8, device=self.device)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = [torch.empty_like(buf) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(out, buf))
        return [out[r][: n[r]].cpu().numpy().tobytes() for r in range(self.world)]


def merge_all(parts: list[Any], meta: dict[str, Any]) -> Any:
    """One CorpusStats from the ranks' parts, merged in rank order (empty parts add nothing)."""
    from attnres_probe.corpus.stats import CorpusStats

    merged = CorpusStats.empty(meta)
    for part in parts:
        if part.n_windows or part.n_skipped:
            merged = merged.merge(part)
    merged.meta = {k: v for k, v in meta.items() if k != "progress"}
    return merged
