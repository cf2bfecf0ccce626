"""watch(model): record a live flash-linear-attention (fla) AttnRes model of any family.

fla 0.6 models call ``fla.ops.attnres.fused_attnres`` at every AttnRes read (docs/design.md, "Models
from elsewhere"); their modules import it by name. Inside ``with watch(model) as session:``
every fla model module's ``fused_attnres`` is replaced by a recorder that calls the op itself
with ``return_weights=True`` and keeps what a :class:`~attnres_probe.DepthTrace` holds:

- each read's depth weights, from the op's own output (on the CPU, where fla's fused op
  needs CUDA, fla's ``naive_attnres`` stands in for it, and the trace says so in
  ``meta["op"]``); the op is called without its fused output norm, which the recorder then
  applies exactly as fla's ``naive_attnres`` does (``F.rms_norm`` in float32), so that the
  mixture itself is seen;
- the RMS of every mixture, every sublayer output (the layers' ``attn``/``mlp`` modules) and
  the embedding; each source's contribution share in the mixture;
- when a backward runs, the gradient norm at every mixture and every parameter group's
  gradient norm (from ``.grad``);
- the tokens and the model's logits (for the per-token loss).

Sources are labelled from fla's block bookkeeping (``attnres_block_size`` counts sublayers:
1 is Full AttnRes, an even S puts a new block at every multiple of S), which gives the same
common source axis as our own models; every call is checked against it. fla skips the op at
the very first read (the embedding alone), which the trace records with weight 1 (its
gradient is taken at an alias of the embedding that only the first pre-norm reads). fla's op
returns weights only, so a watched trace has no logits (NaN: unavailable). Leaving the
context restores fla's functions exactly.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from attnres_probe.axis import SourceAxis
from attnres_probe.depth_rules.watch_streams import WatchError, is_stream_model, watch_streams  # WatchError lives there: both raise it
from attnres_probe.model import AttnResTransformer

__all__ = ["WatchError", "WatchSession", "watch"]




WATCH_ACCEPTS = (
    "watch() records a live flash-linear-attention AttnRes model (an fla ...ForCausalLM or its base model: a "
    "torch.nn.Module whose .config has attnres_block_size and num_hidden_layers) or a transformers model with "
    "DeepSeek-V4's hyper-connections (DeepseekV4ForCausalLM: layers with attn_hc/ffn_hc and an hc_head)"
)


def check_watchable(model: Any) -> None:
    """Raise :class:`TypeError` naming what :func:`watch` accepts unless ``model`` is a module
    with an fla-style config (attnres-probe's own models are recorded by ``Probe`` instead)."""
    if isinstance(model, AttnResTransformer):
        raise TypeError(
            f"{WATCH_ACCEPTS}; got attnres-probe's own {type(model).__name__}, which records itself: use "
            "Probe(model).run(text) (or model.run_with_cache)"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{WATCH_ACCEPTS}; got {model!r:.80} ({type(model).__name__})")
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise TypeError(f"{WATCH_ACCEPTS}; got a {type(model).__name__} without such a config")


def _rms(x: torch.Tensor) -> torch.Tensor:
    xf = x.detach().float()
    return xf.pow(2).mean(-1).sqrt()


def _axis_of(config: Any) -> SourceAxis:
    block = getattr(config, "attnres_block_size", None)
    n_layers = getattr(config, "num_hidden_layers", None)
    if block is None:
        raise WatchError("this fla model has no AttnRes (config.attnres_block_size is None): there are no depth weights to watch")
    if not isinstance(n_layers, int):
        raise WatchError("the model's config has no integer num_hidden_layers")
    L = 2 * n_layers
    if block == 1:
        return SourceAxis("full", n_layers)
    return SourceAxis("block", n_layers, tuple(range(0, L, block)))


def _layers(model: Any) -> list[Any]:
    for path in ("model.layers", "layers", "backbone.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return list(obj)
    raise WatchError(f"cannot find the decoder layers of {type(model).__name__} (looked for model.layers, layers)")


class WatchSession:
    """What one ``watch`` context recorded; :meth:`trace` turns the last forward into a DepthTrace."""

    def __init__(self, model: Any, tokenizer: Any = None, name: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.axis = _axis_of(self.config)
        self.name = name or f"fla-{getattr(self.config, 'model_type', 'model')}"
        self.layers = _layers(model)
        self.op_names: set[str] = set()
        self._error: str | None = None
        self._reset()

    # -- per forward ---------------------------------------------------------------------
    def _reset(self) -> None:
        self.read = 1  # fla skips the op at read 0 (the embedding alone)
        self.tokens: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.store: dict[str, torch.Tensor] | None = None

    def _alloc(self, v0: torch.Tensor) -> None:
        B, P = v0.shape[:2]
        R, S, L = self.axis.n_reads, self.axis.n_sources, self.axis.n_sublayers
        nan = float("nan")
        self.store = {
            "depth_weights": torch.full((B, P, R, S), nan),
            "logits": torch.full((B, P, R, S), nan),
            "contrib": torch.full((B, P, R, S), nan),
            "rms_in": torch.full((B, P, R), nan),
            "grad_in": torch.full((B, P, R), nan),
            "rms_out": torch.full((B, P, L + 1), nan),
            "grad_out": torch.full((B, P, L + 1), nan),
        }
        s = self.store
        s["depth_weights"][:, :, 0, 0] = 1.0  # read 0: the embedding alone, weight 1
        s["contrib"][:, :, 0, 0] = 1.0
        s["rms_in"][:, :, 0] = _rms(v0).cpu()
        s["rms_out"][:, :, 0] = _rms(v0).cpu()

    def on_model_input(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._reset()
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens = ids.detach().cpu() if isinstance(ids, torch.Tensor) else None

    def on_model_output(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            logits = output[0]
        self.logits = logits.detach().float().cpu() if isinstance(logits, torch.Tensor) else None

    def on_first_layer_input(self, module: Any, args: tuple, kwargs: dict) -> None:
        v0 = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(v0, torch.Tensor):
            self._alloc(v0)
            self._grad_out_hook(0, v0)  # the embedding's gradient gathers every read of it

    def _grad_out_hook(self, index: int, v: torch.Tensor) -> None:
        """In the backward, the norm of dLoss/dv per token into ``grad_out[:, :, index]``."""
        if not v.requires_grad or self.store is None:
            return
        grad_out = self.store["grad_out"]

        def store(g: torch.Tensor) -> None:
            grad_out[:, :, index] = g.detach().float().norm(dim=-1).cpu()

        v.register_hook(store)

    def on_first_norm_input(self, module: Any, args: tuple, kwargs: dict):
        """fla skips the op at read 0 and pre-norms the embedding itself: the norm gets an
        alias of it, so that the gradient at read 0's input is that read's alone (the
        embedding's own gradient also gathers every later read's)."""
        x = kwargs.get("x", kwargs.get("hidden_states", args[0] if args else None))
        if not isinstance(x, torch.Tensor) or not x.requires_grad or self.store is None:
            return None
        alias = x.view_as(x)
        grad_in = self.store["grad_in"]

        def store(g: torch.Tensor) -> None:
            grad_in[:, :, 0] = g.detach().float().norm(dim=-1).cpu()

        alias.register_hook(store)
        if args:
            return (alias, *args[1:]), kwargs
        key = "x" if "x" in kwargs else "hidden_states"
        return args, {**kwargs, key: alias}

    def on_sublayer_output(self, sublayer: int):
        def hook(module: Any, args: tuple, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if self.store is not None and isinstance(out, torch.Tensor) and out.dim() == 3:
                self.store["rms_out"][:, :, sublayer + 1] = _rms(out).cpu()
                self._grad_out_hook(sublayer + 1, out)

        return hook

    def on_op(self, op, label: str):
        """The stand-in for ``fused_attnres`` at the module where fla imported it."""

        def fused_attnres(query, residuals, rms_weight, output_rms_weight=None, rms_eps=1e-6, scale=1.0, return_weights=False, **kwargs):
            h, p = op(
                query=query, residuals=residuals, rms_weight=rms_weight, output_rms_weight=None,
                rms_eps=rms_eps, scale=scale, return_weights=True, **kwargs,
            )
            self.op_names.add(label)
            self._record(list(residuals), h, p)
            out = h
            if output_rms_weight is not None:  # the fused pre-norm, exactly as fla's naive op applies it
                D = h.shape[-1]
                out = F.rms_norm(h.float(), (D,), output_rms_weight.float(), rms_eps).to(h.dtype)
            return (out, p) if return_weights else out

        return fused_attnres

    def _record(self, residuals: list[torch.Tensor], h: torch.Tensor, p: torch.Tensor) -> None:
        r = self.read
        self.read += 1
        if self.store is None or self._error is not None:
            return
        if r >= self.axis.n_reads:
            self._error = f"the model made more AttnRes calls ({r + 1}) than its {self.axis.n_reads} reads"
            return
        k = len(residuals)
        if k != self.axis.visible(r):
            self._error = (
                f"read {self.axis.read_labels[r]} mixed {k} sources; attnres_block_size={self.config.attnres_block_size} "
                f"implies {self.axis.visible(r)}"
            )
            return
        with torch.no_grad():
            w = p.detach().float().movedim(0, -1).reshape(*h.shape[:-1], k)  # (B, P, k)
            s = self.store
            s["depth_weights"][:, :, r, :k] = w.cpu()
            from attnres_probe.kernels import contribution_shares

            s["contrib"][:, :, r, :k] = contribution_shares([v.float() for v in residuals], h.float(), w).cpu()
            s["rms_in"][:, :, r] = _rms(h).cpu()
        if h.requires_grad:
            grad_in = s["grad_in"]

            def store(g: torch.Tensor, r: int = r) -> None:
                grad_in[:, :, r] = g.detach().float().norm(dim=-1).cpu()

            h.register_hook(store)

    # -- the trace -----------------------------------------------------------------------
    def _param_groups(self) -> tuple[list[list[torch.nn.Parameter]], list[list[torch.nn.Parameter]]]:
        sub, mix = [], []
        for layer in self.layers:
            for part, norm in (("attn", "attn_norm"), ("mlp", "mlp_norm")):
                params = [*getattr(getattr(layer, norm, None), "parameters", lambda: [])()]
                params += [*getattr(getattr(layer, part, None), "parameters", lambda: [])()]
                sub.append(params)
            for m in ("attn", "mlp"):
                mix.append([q for n in (f"{m}_res_proj", f"{m}_res_norm") for q in getattr(getattr(layer, n, None), "parameters", lambda: [])()])
        top = getattr(self.model, "model", self.model)
        mix.append([q for n in ("res_proj", "res_norm") for q in getattr(getattr(top, n, None), "parameters", lambda: [])()])
        return sub, mix

    def trace(self):
        """The last watched forward (and backward, if one ran) as a DepthTrace.

        Raises:
            WatchError: nothing was recorded, or the model's calls did not follow its config.
        """
        from attnres_probe.losses import trace_loss
        from attnres_probe.trace import DepthTrace

        if self._error is not None:
            raise WatchError(self._error)
        if self.store is None or self.tokens is None:
            raise WatchError("nothing was recorded: run the model on input_ids inside the watch context")
        if self.read != self.axis.n_reads:
            raise WatchError(f"the forward made {self.read - 1} AttnRes calls; this model has {self.axis.n_reads - 1} (a partial forward?)")
        tokens = self.tokens
        mask = torch.ones_like(tokens, dtype=torch.bool)
        if self.logits is not None and self.logits.shape[:2] == tokens.shape:
            per_tok, mean = trace_loss(self.logits, tokens, mask)
            loss, mean_loss = per_tok.numpy(), float(mean)
        else:
            loss, mean_loss = np.full(tokens.shape, np.nan, np.float32), float("nan")
        sub, mix = self._param_groups()

        def norm(params: list[torch.nn.Parameter]) -> float:
            grads = [q.grad.detach().float() for q in params if q.grad is not None]
            return float(torch.sqrt(sum(g.pow(2).sum() for g in grads))) if grads else float("nan")

        tok = self.tokenizer
        if tok is not None and hasattr(tok, "decode"):
            str_tokens = [[str(tok.decode([int(t)])) for t in row] for row in tokens.tolist()]
        else:
            str_tokens = [[str(int(t)) for t in row] for row in tokens.tolist()]
        cfg = {k: v for k, v in self.config.to_dict().items() if isinstance(v, (int, float, str, bool)) or v is None}
        cfg["n_layers"] = self.axis.n_layers
        on_cpu = any("naive" in n for n in self.op_names)
        meta = {
            "name": self.name,
            **self.axis.to_meta(),
            "config": cfg,
            "n_params": int(sum(q.numel() for q in self.model.parameters())),
            "model_class": type(self.model).__name__,
            "source": "flash-linear-attention, watched",
            "op": "fla naive_attnres (stand-in for fused_attnres on the CPU)" if on_cpu else "fla fused_attnres",
            "logits_available": False,
            "str_tokens": str_tokens,
            "backward": bool(np.isfinite(self.store["grad_in"].numpy()).any()),
            "mean_loss": mean_loss,
        }
        arrays = {k: v.numpy() for k, v in self.store.items()}
        return DepthTrace(
            tokens=tokens.numpy(),
            mask=mask.numpy(),
            loss=loss,
            param_grad=np.array([norm(g) for g in sub], dtype=np.float32),
            mixer_grad=np.array([norm(g) for g in mix], dtype=np.float32),
            meta=meta,
            **arrays,
        )


@contextlib.contextmanager
def watch(model: Any, tokenizer: Any = None, name: str | None = None) -> Iterator[WatchSession]:
    """Record a live fla AttnRes model (any family), or a transformers model with DeepSeek-V4's
    hyper-connections (:mod:`attnres_probe.depth_rules.watch_streams`), while the context is open.

    Args:
        model: an fla model (``...ForCausalLM`` or its base model) whose config has
            ``attnres_block_size`` and ``num_hidden_layers``; or a ``DeepseekV4ForCausalLM`` (any
            model whose layers have ``attn_hc``/``ffn_hc`` and whose base model has ``hc_head``).
        tokenizer: optional, for the trace's token strings.
        name: the trace's name (default ``fla-<model_type>``).

    Yields:
        A :class:`WatchSession`; after a forward (and optionally a backward) call
        ``session.trace()``.

    Raises:
        TypeError: ``model`` is not such a model (the message says what is accepted).
        WatchError: the model has no AttnRes, or fla is not installed.
    """
    check_watchable(model)

    if is_stream_model(model):  # DeepSeek-V4's mHC (transformers): recorded at its own modules
        with watch_streams(model, tokenizer, name) as streams:
            yield streams
        return
    try:
        import fla.ops.attnres as ops  # noqa: F401
        from fla.ops.attnres import fused_attnres, naive_attnres
    except ImportError as exc:
        raise WatchError(f"watch() needs flash-linear-attention ({exc}); pip install 'attnres-probe[fla]'") from None
    session = WatchSession(model, tokenizer, name)
    on_cuda = any(q.is_cuda for q in model.parameters())
    op, label = (fused_attnres, "fused_attnres") if on_cuda else (naive_attnres, "naive_attnres")
    recorder_op = session.on_op(op, label)
    patched = [(m, getattr(m, "fused_attnres")) for n, m in list(sys.modules.items())
               if n.startswith("fla.") and n != "fla.ops.attnres" and not n.startswith("fla.ops.") and hasattr(m, "fused_attnres")]
    handles = [
        model.register_forward_pre_hook(session.on_model_input, with_kwargs=True),
        model.register_forward_hook(session.on_model_output, with_kwargs=True),
        session.layers[0].register_forward_pre_hook(session.on_first_layer_input, with_kwargs=True),
    ]
    first_norm = getattr(session.layers[0], "attn_norm", None)
    if isinstance(first_norm, torch.nn.Module):
        handles.append(first_norm.register_forward_pre_hook(session.on_first_norm_input, with_kwargs=True))
    for i, layer in enumerate(session.layers):
        for j, part in enumerate(("attn", "mlp")):
            sub = getattr(layer, part, None)
            if isinstance(sub, torch.nn.Module):
                handles.append(sub.register_forward_hook(session.on_sublayer_output(2 * i + j)))
    try:
        for m, _ in patched:
            m.fused_attnres = recorder_op
        yield session
    finally:
        for m, original in patched:
            m.fused_attnres = original
        for h in handles:
            h.remove()
