"""Stream many texts through one probe into running aggregates: the work of :meth:`Probe.run_corpus
<attnres_probe.probe.Probe.run_corpus>`, in one process or in lock step under ``torchrun``.

Each text (a *document*) is cut into ``n_ctx``-token windows (``Probe._corpus_windows``: a
:class:`~attnres_probe.corpus.documents.StreamedDocument` of a byte-token model is cut chunk by
chunk); windows are recorded in right-padded batches, or one by one for per-window gradients,
and folded into a :class:`~attnres_probe.corpus.stats.CorpusStats`. Under ``torchrun`` (or in a
process group the caller initialised) each rank records its shard of the texts, ticks the others
after every batch, and every rank returns the merged stats (:mod:`attnres_probe.corpus.distributed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from attnres_probe.corpus.distributed import RECORDING_STOPPED, DistributedRunError, current_ranks, merge_all
from attnres_probe.corpus.stats import CorpusStats

__all__ = ["run_corpus"]


def run_corpus(
    probe: Any,
    texts: Iterable[str | Sequence[int] | torch.Tensor],
    batch_size: int = 8,
    backward: bool = False,
    contributions: bool = True,
    progress: bool = True,
    keep_traces: bool = False,
    *,
    min_tokens: int = 2,
    window_grads: bool = True,
    stats: Any = None,
    first_doc: int = 0,
    resume_after: tuple[int, int] | None = None,
    on_batch: Any = None,
    on_progress: Any = None,
):
    """:meth:`Probe.run_corpus <attnres_probe.probe.Probe.run_corpus>` of ``probe`` (its docstring has the arguments)."""
    from tqdm.auto import tqdm

    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"min_tokens must be a positive integer; got {min_tokens!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
    if stats is None:
        stats = CorpusStats.empty(probe.spec.meta)
    else:
        stats.check_same_model(probe.spec.meta, what="continue these stats with this model")
    per_window = backward and window_grads
    need = max(min_tokens, 2) if backward else min_tokens
    traces = []
    ranks = current_ranks()
    if ranks is not None:
        if isinstance(texts, (str, torch.Tensor)):
            texts = [texts]
        texts = ranks.shard(texts, empty="")
    bar = tqdm(desc=f"recording {probe.name}", unit="window", total=_expected_windows(probe, texts),
               disable=not progress or (ranks is not None and not ranks.is_main))

    def flush(rows: list[tuple[int, int, torch.Tensor]]) -> None:
        groups = [[r] for r in rows] if per_window else [rows]
        for group in groups:
            tokens, mask, str_tokens = probe._pad([r[2] for r in group])
            trace = probe.record(tokens, mask, str_tokens, backward=backward, contributions=contributions)
            stats.update(trace, docs=[r[0] for r in group], starts=[r[1] for r in group])
            if keep_traces:
                traces.append(trace)
        if on_batch is not None:
            on_batch(stats, (rows[-1][0], rows[-1][1]))
        seen = (stats.n_tokens, 0) if ranks is None else ranks.tick(stats.n_tokens, done=False)
        bar.update(len(rows))
        if seen is not None:  # under torchrun: all ranks' tokens as of the previous batch
            bar.set_postfix(tokens=seen[0])
            if on_progress is not None:
                on_progress(seen[0])

    try:
        pending: list[tuple[int, int, torch.Tensor]] = []
        for doc, start, ids in probe._corpus_windows(texts, first_doc):
            if resume_after is not None and (doc, start) <= tuple(resume_after):
                continue
            if ids.shape[0] < need:
                stats.n_skipped += 1
                continue
            pending.append((doc, start, ids))
            if len(pending) == batch_size:
                flush(pending)
                pending = []
        if pending:
            flush(pending)
    except Exception as exc:
        if ranks is None or isinstance(exc, DistributedRunError):
            raise
        ranks.fail(exc, RECORDING_STOPPED)  # every rank raises one error naming this rank and the cause
    bar.close()
    if ranks is not None:
        while True:  # answer the others' ticks until every rank has finished its shard
            seen = ranks.tick(stats.n_tokens, done=True)
            if seen is not None and on_progress is not None:
                on_progress(seen[0])
            if seen is not None and seen[1] == ranks.world:
                break
        parts = [CorpusStats.from_bytes(b) for b in ranks.all_gather_bytes(stats.to_bytes())]
        stats = merge_all(parts, stats.meta)
    if stats.n_windows == 0:
        if stats.n_skipped:
            raise ValueError(
                f"the corpus produced no window of at least {need} tokens ({stats.n_skipped} shorter windows were "
                "left out: the next-token loss needs two tokens)"
            )
        raise ValueError("the corpus produced no tokens: every text was empty")
    return (stats, traces) if keep_traces else stats


def _expected_windows(probe: Any, texts: Any) -> int | None:
    """How many context windows ``texts`` will give, for the progress bar's total and time left: known
    ahead for a list of token-id sequences, and of strings for a byte-level model (one token per byte);
    None otherwise (another tokenizer would have to run twice; the bar then counts without a total)."""
    if isinstance(texts, (str, torch.Tensor)):
        texts = [texts]
    if not isinstance(texts, (list, tuple)):
        return None
    n_ctx = probe.spec.n_ctx
    byte_level = probe.tokenizer is None or type(probe.tokenizer).__name__ == "ByteTokenizer"
    total = 0
    for t in texts:
        if isinstance(t, str):
            if not byte_level:
                return None
            n = len(t.encode("utf-8", "surrogatepass"))
        elif isinstance(t, torch.Tensor):
            n = int(t.numel())
        elif isinstance(t, (list, tuple)):
            n = len(t)
        else:
            return None
        total += -(-n // n_ctx) if n else 0
    return total
