"""Effective depth weights of a model built with the ``hyper-connections`` package (issue #36, item 5).

:func:`watch_hyper_connections` wraps, for the duration of a ``with`` block, the
``width_connection`` and ``depth_connection`` methods of every ``HyperConnections`` /
``ManifoldConstrainedHyperConnections`` instance in an ordinary PyTorch model (found with
``model.modules()``), without touching the model's code. Per forward it records, in call order,
what each wrapped module computed: its ``alpha`` (H_pre and the residual mix), its ``beta``
(H_post), the sublayer's input and output and the states entering and leaving. After a forward,
:meth:`HCWatch.read_coefficients` composes them with
:func:`~attnres_probe.depth_rules.hyper_read_coefficients` into every read's coefficients
``[batch, pos, n_reads, n_sources]``: reads = one per wrapped call, then the final read;
sources = the embedding, then one per wrapped call (its branch output). :meth:`HCWatch.sources`
stacks those sources, so ``coef @ sources`` rebuilds every read.

Assumptions (the package's defaults, ``get_init_and_expand_reduce_stream_functions`` without
``add_stream_embed``): the model expands the embedding into ``n`` copies and its final read is the
**sum** of the streams. The first is checked (the state entering the first call must hold ``n``
equal streams, else :meth:`~HCWatch.read_coefficients` refuses); the second cannot be seen from
the wrapped methods: a model that reduces otherwise (e.g. ``AttentionPoolReduceStream``) has a
different final row, which ``final=`` lets the caller give. The state entering each call must be
the one the previous call left (checked, exactly), every wrapped module must run at most once per
forward, and each ``width_connection`` must be followed by its own ``depth_connection`` before the
next one starts (both checked during the forward).

How alpha is obtained: ``width_connection`` returns beta but not alpha; both classes (package
0.4.11, ``hyper_connections.py`` 263-337 and ``manifold_constrained_hyper_connections.py``
328-432) pass the final alpha through ``self.split_fracs`` (its second call, after the state's),
so a forward hook on that submodule, active only inside the wrapped call, records it. Its shape
is checked, so a package whose internals moved fails loudly rather than silently.

Orientation (as :mod:`.hyper` documents): the package's alpha is ``[..., source s, 1 + n]`` with
column 0 = H_pre and columns 1.. the residual mix indexed [source s, target t]; ours is
``pre = alpha[..., 0]``, ``res = alpha[..., 1:]`` transposed to [target, source], ``post = beta``.

Refused (``ValueError`` naming the module): ``num_fracs > 1``, ``num_input_views > 1``,
``channel_first``, ``add_branch_out_to_residual=False``, a ``depth_residual_fn`` other than the
package's addition, a non-identity ``residual_transform`` (mHC), dropout active in training mode,
a module called twice in one forward, and a model with no such module. mHC computes its weights
and mixing in float32 whatever the input dtype; the recorded alpha is that float32 tensor.

The package is imported lazily: importing this module works without it, and
:func:`watch_hyper_connections` raises ``ImportError`` when it is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .hyper import StreamWeights, hyper_read_coefficients

__all__ = ["HCCall", "HCWatch", "coefficient_trace", "watch_hyper_connections"]


@dataclass
class HCCall:
    """One wrapped module's call in one forward (tensors detached, ``[batch, pos, ...]`` layout).

    ``alpha`` [b, pos, n, 1 + n] and ``beta`` [b, pos, n] as the package computed them;
    ``weights`` the same in our orientation; ``state_in`` / ``state_out`` [b, pos, n, d];
    ``branch_input`` / ``branch_output`` [b, pos, d].
    """

    name: str
    alpha: torch.Tensor
    beta: torch.Tensor
    weights: StreamWeights
    state_in: torch.Tensor
    branch_input: torch.Tensor
    branch_output: torch.Tensor | None = None
    state_out: torch.Tensor | None = None


def _unfold_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """The package's [(b n), *rest, d] -> [b, *rest, n, d] (batch-major)."""
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).movedim(1, -2)


@dataclass
class HCWatch:
    """What :func:`watch_hyper_connections` yields; ``calls`` holds the latest forward's calls."""

    names: dict[int, str]
    calls: list[HCCall] = field(default_factory=list)
    module_classes: tuple[str, ...] = ()  # class names of the watched modules
    _pending: HCCall | None = None

    def reset(self) -> None:
        """Forget the recorded calls (done automatically when ``model`` is called)."""
        self.calls, self._pending = [], None

    # -- recording (called by the wrappers) -----------------------------------------------
    def _on_width(self, module, residuals, alpha, out) -> None:
        name = self.names[id(module)]
        if self._pending is not None:
            raise ValueError(
                f"{name}.width_connection ran before {self._pending.name}.depth_connection: interleaved "
                "hyper-connection calls are not supported"
            )
        if any(c.name == name for c in self.calls):
            raise ValueError(f"{name} was called twice in one forward: each module must run at most once")
        n = module.num_residual_streams
        branch_input, _, kwargs = out
        beta = kwargs.get("beta")
        lead = branch_input.shape[:-1]
        if alpha.shape != (*lead, 1, n, 1, 1 + n) or beta is None or beta.shape != (*lead, 1, n, 1):
            raise ValueError(
                f"{name}: alpha {tuple(alpha.shape)} / beta {None if beta is None else tuple(beta.shape)} do "
                f"not have the shapes expected from hyper-connections 0.4.11 ({(*lead, 1, n, 1, 1 + n)}, "
                f"{(*lead, 1, n, 1)}); this package version is not supported"
            )
        a = alpha.detach()[..., 0, :, 0, :]
        b = beta.detach()[..., 0, :, 0]
        self._pending = HCCall(
            name=name,
            alpha=a,
            beta=b,
            weights=StreamWeights(a[..., 0], a[..., 1:].transpose(-1, -2), b),
            state_in=_unfold_streams(residuals.detach(), n),
            branch_input=branch_input.detach(),
        )

    def _on_depth(self, module, branch_output, out) -> None:
        name = self.names[id(module)]
        call = self._pending
        if call is None or call.name != name:
            raise ValueError(f"{name}.depth_connection ran without its own width_connection just before it")
        call.branch_output = branch_output.detach()
        call.state_out = _unfold_streams(out.detach(), module.num_residual_streams)
        self.calls.append(call)
        self._pending = None

    # -- results ----------------------------------------------------------------------------
    def _checked_calls(self) -> list[HCCall]:
        if self._pending is not None:
            raise ValueError(f"{self._pending.name}.depth_connection has not run yet")
        if not self.calls:
            raise ValueError("no hyper-connection call was recorded: run a forward inside the `with` block")
        first = self.calls[0].state_in
        if not torch.equal(first, first[..., :1, :].expand_as(first)):
            raise ValueError(
                f"the state entering {self.calls[0].name} is not n copies of one vector: the embedding was "
                "not expanded with the package's default expand (e.g. add_stream_embed=True); not supported"
            )
        for prev, nxt in zip(self.calls, self.calls[1:]):
            if prev.state_out.shape != nxt.state_in.shape or not torch.equal(prev.state_out, nxt.state_in):
                raise ValueError(
                    f"the state entering {nxt.name} is not the state {prev.name} left: the model changes the "
                    "streams between hyper-connections, which the coefficients cannot follow"
                )
        return self.calls

    @property
    def call_names(self) -> list[str]:
        """The wrapped modules' names in call order (reads 0..L-1 and sources 1..L)."""
        return [c.name for c in self.calls]

    def steps(self) -> list[StreamWeights]:
        """Every call's weights in our orientation (pre [b, pos, n], res [.., n(t), n(s)], post)."""
        return [c.weights for c in self._checked_calls()]

    def read_coefficients(self, final: torch.Tensor | None = None, return_streams: bool = False):
        """Every read's coefficients [batch, pos, L + 1 reads, L + 1 sources] for the latest forward.

        Assumes the package's expand (n copies of the embedding, checked) and reduce (the sum of
        the streams, ``final=None``; pass ``final`` [..., n] for another linear reduce). Computed
        by :func:`hyper_read_coefficients` in the promoted dtype of the recorded weights (float32
        for mHC under a float32 or float64 model, whose weights the package computes in float32).
        """
        return hyper_read_coefficients(self.steps(), final=final, return_streams=return_streams)

    def sources(self) -> torch.Tensor:
        """[batch, pos, L + 1, d]: the embedding (stream 0 of the first state), then every branch output."""
        calls = self._checked_calls()
        srcs = [calls[0].state_in[..., 0, :], *(c.branch_output for c in calls)]
        dtype = srcs[0].dtype
        for s in srcs[1:]:
            dtype = torch.promote_types(dtype, s.dtype)
        return torch.stack([s.to(dtype) for s in srcs], dim=-2)

    def branch_inputs(self) -> torch.Tensor:
        """[batch, pos, L, d]: what each ``width_connection`` returned as the branch input."""
        return torch.stack([c.branch_input for c in self._checked_calls()], dim=-2)

    def trace(self, tokens: Any = None, logits: torch.Tensor | None = None, name: str = "hc-watched",
              str_tokens: list[list[str]] | None = None, final: torch.Tensor | None = None):
        """The latest forward as a :class:`~attnres_probe.DepthTrace` (see :func:`watch_trace`): pages,
        metrics and figures take it like any trace."""
        return watch_trace(self, tokens, logits, name, str_tokens, final)

    def final_state(self) -> torch.Tensor:
        """[batch, pos, n, d]: the state the last call left (its sum is the package's final read)."""
        return self._checked_calls()[-1].state_out


def watch_trace(watch: HCWatch, tokens: Any = None, logits: torch.Tensor | None = None, name: str = "hc-watched",
                str_tokens: list[list[str]] | None = None, final: torch.Tensor | None = None):
    """A :class:`~attnres_probe.DepthTrace` of the latest watched forward (``HCWatch.trace``).

    The depth weights are the coefficients (:meth:`HCWatch.read_coefficients`), NaN past each
    read; the contribution shares, ``<c_j v_j, h> / |h|^2``, and the RMS of every read and source
    come from the recorded branch inputs and outputs (read L is the reduced final state). The L
    wrapped calls must be an even number: the trace puts them on the common axis as L / 2 layers
    of two sublayers, labelled ``L{i}.attn`` / ``L{i}.mlp`` whatever the branches are
    (``meta["call_names"]`` keeps the module names). No gradients and no depth logits are
    recorded (NaN); ``tokens`` [batch, pos] and ``logits`` [batch, pos, vocab] give the per-token
    loss, else it is NaN.
    """
    calls = watch._checked_calls()
    L = len(calls)
    if L % 2:
        raise ValueError(
            f"the watched forward made {L} hyper-connection calls; a trace needs an even number (L / 2 layers of two "
            f"sublayers on the common axis): {', '.join(watch.call_names)}"
        )
    state = watch.final_state().detach().double().cpu()
    fin = torch.ones(state.shape[-2], dtype=state.dtype) if final is None else final.detach().double().cpu()
    reads = torch.cat([watch.branch_inputs().detach().double().cpu(), torch.einsum("...s,...sd->...d", fin, state).unsqueeze(-2)], -2)
    n = calls[0].state_in.shape[-2]
    config = {"residual": "hyper", "n_layers": L // 2, "n_streams": int(n), "mhc": any("Manifold" in c for c in watch.module_classes)}
    meta = {
        "model_class": "watched hyper-connections model",
        "source": "hyper-connections package, watched (depth_rules.watch_hyper_connections)",
        "call_names": watch.call_names,
    }
    return coefficient_trace(watch.read_coefficients(final=final), watch.sources(), reads, tokens=tokens, logits=logits,
                             name=name, str_tokens=str_tokens, config=config, meta=meta)


def coefficient_trace(coef: torch.Tensor, sources: torch.Tensor, reads: torch.Tensor, *, tokens: Any = None,
                      logits: torch.Tensor | None = None, name: str, str_tokens: list[list[str]] | None = None,
                      config: dict[str, Any], meta: dict[str, Any], grad_in: torch.Tensor | None = None,
                      grad_out: torch.Tensor | None = None, native: dict[str, Any] | None = None):
    """A :class:`~attnres_probe.DepthTrace` of a watched forward of a rule whose reads are linear in
    the sources (Hyper-Connections / mHC): ``coef`` [B, P, R, S] every read's coefficients,
    ``sources`` [B, P, S, d] the embedding and the sublayer outputs, ``reads`` [B, P, R, d] what
    every read gave its sublayer (and the final read). Shares ``<c_j v_j, h> / |h|^2`` and RMS
    values come from them; ``grad_in`` [B, P, R] / ``grad_out`` [B, P, S] are per-token gradient
    norms when a backward ran (else NaN); ``config`` the model's (``residual`` and ``n_layers`` at
    least), ``meta`` more of the trace's metadata; ``native`` the family's own weights
    (:attr:`DepthTrace.native`)."""
    import numpy as np

    from attnres_probe.axis import SourceAxis
    from attnres_probe.losses import trace_loss
    from attnres_probe.trace import DepthTrace

    # a trace holds numpy arrays: everything moves to the CPU first (the model may run on a GPU)
    coef, V, reads = (t.detach().double().cpu() for t in (coef, sources, reads))
    B, P, R, S = coef.shape
    seen = torch.ones(R, S, dtype=torch.bool).tril()
    dots = torch.einsum("bpsd,bprd->bprs", V, reads)
    shares = coef * dots / reads.pow(2).sum(-1, keepdim=True)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    tok = torch.zeros(B, P, dtype=torch.int64) if tokens is None else torch.as_tensor(tokens).reshape(B, P).long().cpu()
    mask = torch.ones(B, P, dtype=torch.bool)
    loss = torch.full((B, P), float("nan"))
    mean_loss = float("nan")
    if logits is not None and tokens is not None:
        per, m = trace_loss(logits.detach().float().cpu(), tok, mask)
        loss, mean_loss = per, float(m)
    axis = SourceAxis(config["residual"], int(config["n_layers"]))
    nanf = lambda *shape: np.full(shape, np.nan, np.float32)  # noqa: E731
    meta = {
        "name": name,
        **axis.to_meta(),
        "config": {"d_model": int(V.shape[-1]), **config},
        "logits_available": False,
        "str_tokens": str_tokens or [[str(int(t)) for t in row] for row in tok.tolist()],
        "backward": grad_out is not None,
        "mean_loss": mean_loss,
        **meta,
    }
    return DepthTrace(
        tokens=tok.numpy(), mask=mask.numpy(), loss=loss.numpy(),
        depth_weights=torch.where(seen, coef, nan).numpy(), logits=nanf(B, P, R, S),
        contrib=torch.where(seen, shares, nan).numpy(), rms_in=rms(reads).numpy(),
        grad_in=nanf(B, P, R) if grad_in is None else grad_in.float().cpu().numpy(),
        rms_out=rms(V).numpy(), grad_out=nanf(B, P, S) if grad_out is None else grad_out.float().cpu().numpy(),
        param_grad=nanf(R - 1), mixer_grad=nanf(R), meta=meta, native=native,
    )


def _import_package():
    try:
        from hyper_connections.hyper_connections import HyperConnections
        from hyper_connections.hyper_connections import add as hc_add
        from hyper_connections.manifold_constrained_hyper_connections import ManifoldConstrainedHyperConnections
        from hyper_connections.manifold_constrained_hyper_connections import add as mhc_add
    except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
        raise ImportError(
            "watch_hyper_connections needs the `hyper-connections` package (pip install hyper-connections, "
            "or this project's `dev` extra)"
        ) from exc
    return (HyperConnections, ManifoldConstrainedHyperConnections), (hc_add, mhc_add)


def _check_supported(name: str, m: nn.Module, adds) -> None:
    problems = []
    if getattr(m, "num_fracs", 1) != 1:
        problems.append(f"num_fracs = {m.num_fracs} (Frac-Connections)")
    if getattr(m, "num_input_views", 1) != 1:
        problems.append(f"num_input_views = {m.num_input_views} (multiple input views)")
    if getattr(m, "channel_first", False):
        problems.append("channel_first = True")
    if not getattr(m, "add_branch_out_to_residual", True):
        problems.append("add_branch_out_to_residual = False")
    if getattr(m, "depth_residual_fn", adds[0]) not in adds:
        problems.append("a custom depth_residual_fn")
    if not isinstance(getattr(m, "residual_transform", nn.Identity()), nn.Identity):
        problems.append("a residual_transform")
    drop = getattr(m, "dropout", None)
    if isinstance(drop, nn.Dropout) and drop.p > 0 and m.training:
        problems.append(f"dropout p = {drop.p} in training mode (call model.eval())")
    if problems:
        raise ValueError(f"{name} ({type(m).__name__}) is not supported by watch_hyper_connections: " + "; ".join(problems))


@contextlib.contextmanager
def watch_hyper_connections(model: nn.Module) -> Iterator[HCWatch]:
    """Record every hyper-connection call of ``model``'s forwards; yields an :class:`HCWatch`.

    Wraps ``width_connection`` / ``depth_connection`` on each ``HyperConnections`` /
    ``ManifoldConstrainedHyperConnections`` instance (instance attributes, removed on exit, also
    on error) and hooks its ``split_fracs`` to see alpha. Calling ``model`` starts a new record
    (a forward pre-hook on it); call :meth:`HCWatch.reset` when running parts of the model by hand.

    Raises ValueError when the model has no such module or one uses a variant not supported
    (see the module docstring), ImportError when the package is not installed.
    """
    classes, adds = _import_package()
    found = [(name or type(m).__name__, m) for name, m in model.named_modules() if isinstance(m, classes)]
    if not found:
        raise ValueError(
            f"no HyperConnections / ManifoldConstrainedHyperConnections module found in {type(model).__name__}"
        )
    for name, m in found:
        _check_supported(name, m, adds)
    watch = HCWatch(names={id(m): name for name, m in found}, module_classes=tuple({type(m).__name__ for _, m in found}))
    undo: list = []

    def wrap(m: nn.Module) -> None:
        width, depth = m.width_connection, m.depth_connection
        capture: list[torch.Tensor] = []
        active = [False]

        def hook(_mod, _args, output):
            if active[0]:
                capture.append(output)

        handle = m.split_fracs.register_forward_hook(hook)
        undo.append(handle.remove)

        def width_connection(residuals, *args, **kwargs):
            capture.clear()
            active[0] = True
            try:
                out = width(residuals, *args, **kwargs)
            finally:
                active[0] = False
            if len(capture) < 2:
                raise ValueError(f"{watch.names[id(m)]}: alpha was not seen (unsupported package version)")
            watch._on_width(m, residuals, capture[1], out)
            return out

        def depth_connection(branch_output, residuals, *args, **kwargs):
            out = depth(branch_output, residuals, *args, **kwargs)
            watch._on_depth(m, branch_output, out)
            return out

        for attr, fn in (("width_connection", width_connection), ("depth_connection", depth_connection)):
            had = attr in m.__dict__
            old = m.__dict__.get(attr)
            object.__setattr__(m, attr, fn)
            undo.append(lambda m=m, attr=attr, had=had, old=old: (
                object.__setattr__(m, attr, old) if had else m.__dict__.pop(attr, None)))

    try:
        handle = model.register_forward_pre_hook(lambda _mod, _args: watch.reset())
        undo.append(handle.remove)
        for _, m in found:
            wrap(m)
        yield watch
    finally:
        for fn in reversed(undo):
            fn()
