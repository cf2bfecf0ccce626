"""Record a live transformers model with manifold-constrained Hyper-Connections (DeepSeek-V4's mHC).

transformers 5.x ships ``DeepseekV4ForCausalLM`` (``models/deepseek_v4``), far too large to load
into our own model. :func:`watch_streams` records it where it runs, with forward hooks only (the
model's computation is untouched: the logits are bit for bit those without hooks, a test checks it).

The contract (read from ``modeling_deepseek_v4.py`` of transformers 5.25; any model whose modules
follow it is accepted, anything else is refused naming what is missing):

- the base model (``model.model``) has ``embed_tokens``, ``layers`` and ``hc_head``; the embedding
  is copied into ``hc_mult`` streams, ``H = e`` in every stream;
- every layer has ``attn_hc`` / ``self_attn`` and ``ffn_hc`` / ``mlp``. A hyper-connection module
  (``hc_mult``, ``fn`` [(2+n)n, n d], ``base`` [(2+n)n], ``scale`` [3], ``input_norm``, ``hc_eps``,
  ``hc_sinkhorn_iters``) maps the streams ``H`` [batch, pos, n, d] to ``(post, comb, read)``: per
  token, with ``x = input_norm(vec H)`` and ``(p, q, m) = split(fn x)``::

      pre  = sigmoid(p * scale[0] + base_pre) + hc_eps            (n; not normalised)
      post = 2 sigmoid(q * scale[1] + base_post)                   (n)
      comb = Sinkhorn(softmax(m * scale[2] + base_comb) + hc_eps)  (n x n; a column step first,
             then hc_sinkhorn_iters - 1 rounds of rows then columns, each + hc_eps)
      read = sum_s pre[s] H_s

  the sublayer reads ``norm(read)`` and writes ``y``; the streams become
  ``H'_k = sum_j comb[j, k] H_j + post[k] y`` (comb transposed: our ``res = comb^T``);
- ``hc_head`` (``hc_fn`` [n, n d], ``hc_base``, ``hc_scale``, ``input_norm``, ``eps``) collapses the
  streams before the final norm: ``pre_h = sigmoid(hc_fn x * hc_scale + hc_base) + eps``,
  ``out = sum_s pre_h[s] H_s``.

The module returns ``post`` and ``comb`` but not ``pre``: the recorder recomputes all three from
the module's own parameters and input, checks that its ``post`` and ``comb`` equal the module's
exactly and that its ``pre`` rebuilds the module's read (a model whose formula differs is refused,
not misread), and composes every read's **effective coefficients** over (embedding, sublayer
outputs) with :func:`~attnres_probe.depth_rules.hyper_read_coefficients`, as for our own mHC.
The trace keeps the native weights too (``trace.native``): ``pre`` [B, P, R, n] (the final read's
is ``pre_h``), ``post`` [B, P, L, n], ``comb`` [B, P, L, n, n] and the Sinkhorn errors of every
``comb`` (``sinkhorn_row_error``, ``sinkhorn_col_error`` [B, P, L]: max |row / column sum - 1|).
``meta["reconstruction_error"]`` is the largest |sum_i c_i v_i - read| over every read, relative
to the read's RMS (float64 arithmetic on the recorded tensors; in a bf16 model the streams
themselves are rounded to bf16 at every step, which this error then shows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hyper import StreamWeights, hyper_read_coefficients

__all__ = ["StreamsWatch", "WatchError", "is_stream_model", "watch_streams"]


class WatchError(RuntimeError):
    """The watched model did something the recorder could not follow (the message says what);
    :func:`attnres_probe.watch` raises it for every family it records."""

HC_PARTS = ("hc_mult", "fn", "base", "scale", "input_norm", "hc_eps", "hc_sinkhorn_iters")
HEAD_PARTS = ("hc_fn", "hc_base", "hc_scale", "input_norm", "eps")
LAYER_PARTS = ("attn_hc", "self_attn", "ffn_hc", "mlp")


def _base(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and hasattr(inner, "layers") else model


def is_stream_model(model: Any) -> bool:
    """Whether ``model`` (a ``...ForCausalLM`` or its base model) has DeepSeek-V4-style hyper-connections."""
    if not isinstance(model, nn.Module):
        return False
    base = _base(model)
    layers = getattr(base, "layers", None)
    return isinstance(layers, nn.ModuleList) and len(layers) > 0 and hasattr(layers[0], "attn_hc")


def check_stream_model(model: nn.Module) -> list[str]:
    """What ``model`` lacks of the contract (empty when it follows it)."""
    base = _base(model)
    missing = [n for n in ("embed_tokens", "layers", "hc_head") if not hasattr(base, n)]
    if missing:
        return missing
    for i, layer in enumerate(base.layers):
        missing += [f"layers.{i}.{n}" for n in LAYER_PARTS if not hasattr(layer, n)]
        for n in ("attn_hc", "ffn_hc"):
            hc = getattr(layer, n, None)
            if hc is not None:
                missing += [f"layers.{i}.{n}.{a}" for a in HC_PARTS if not hasattr(hc, a)]
    missing += [f"hc_head.{a}" for a in HEAD_PARTS if not hasattr(base.hc_head, a)]
    return missing


def _flat(module: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    return module.input_norm(streams.flatten(2).float())


def hc_weights(hc: nn.Module, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) of one hyper-connection module for the streams [B, P, n, d], by the contract."""
    n = int(hc.hc_mult)
    mixes = F.linear(_flat(hc, streams), hc.fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
    pre_s, post_s, comb_s = hc.scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc.hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.hc_eps)
    for _ in range(int(hc.hc_sinkhorn_iters) - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.hc_eps)
    return pre, post, comb


def head_weights(head: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """``pre_h`` [B, P, n] of the final collapse, by the contract."""
    mixes = F.linear(_flat(head, streams), head.hc_fn.float())
    return torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + head.eps


class StreamsWatch:
    """What :func:`watch_streams` yields: the latest forward's record; :meth:`trace` makes a DepthTrace."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, name: str | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.base = _base(model)
        self.n_layers = len(self.base.layers)
        self.name = name or f"hf-{getattr(getattr(model, 'config', None), 'model_type', type(model).__name__)}"
        self.reset()

    def reset(self) -> None:
        """Forget the last forward (done when the model is called)."""
        self.tokens = self.logits = self.embed = None
        self.reads: list[dict[str, torch.Tensor]] = []  # per read: streams, pre, post, comb, read
        self.outputs: list[torch.Tensor] = []
        self.head: dict[str, torch.Tensor] | None = None
        self.grads: dict[tuple[str, int], torch.Tensor] = {}
        self.error: str | None = None

    # -- hooks -------------------------------------------------------------------------------
    def _grad(self, kind: str, index: int, t: torch.Tensor) -> None:
        if t.requires_grad:
            t.register_hook(lambda g: self.grads.__setitem__((kind, index), g.detach().float().norm(dim=-1).cpu()))

    def on_input(self, _module, args, kwargs) -> None:
        self.reset()
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens = ids.detach().cpu() if isinstance(ids, torch.Tensor) else None

    def on_output(self, _module, _args, _kwargs, output) -> None:
        logits = getattr(output, "logits", None)
        self.logits = logits.detach() if isinstance(logits, torch.Tensor) else None

    def on_embed(self, _module, _args, output) -> None:
        self.embed = output.detach()
        self._grad("out", 0, output)

    def on_hc(self, label: str):
        def hook(module, args, output) -> None:
            streams = args[0]
            post, comb, read = output
            with torch.no_grad():
                pre, post2, comb2 = hc_weights(module, streams)
            if self.error is None and not (torch.equal(post, post2) and torch.equal(comb, comb2)):
                self.error = (f"{label}: the post/comb recomputed from the module's parameters differ from the ones it "
                              "returned: its formula is not DeepSeek-V4's (transformers 5.25), so its reads cannot be followed")
            self.reads.append({"streams": streams.detach(), "pre": pre.detach(), "post": post.detach(),
                               "comb": comb.detach(), "read": read.detach(), "label": label})
            self._grad("in", len(self.reads) - 1, read)
        return hook

    def on_sublayer(self, pick):
        def hook(_module, _args, output) -> None:
            y = pick(output)
            self.outputs.append(y.detach())
            self._grad("out", len(self.outputs), y)
        return hook

    def on_head(self, module, args, output) -> None:
        with torch.no_grad():
            pre = head_weights(module, args[0])
        self.head = {"streams": args[0].detach(), "pre": pre.detach(), "read": output.detach()}
        self._grad("in", 2 * self.n_layers, output)

    # -- results -----------------------------------------------------------------------------
    def _checked(self) -> None:
        if self.error is not None:
            raise WatchError(self.error)
        L = 2 * self.n_layers
        if self.embed is None or self.head is None:
            raise WatchError("nothing was recorded: run the model on input_ids inside the watch context")
        if len(self.reads) != L or len(self.outputs) != L:
            raise WatchError(f"the forward made {len(self.reads)} hyper-connection reads and {len(self.outputs)} sublayer "
                             f"outputs; this model has {L} sublayers (a partial forward?)")

    def coefficients(self) -> torch.Tensor:
        """Every read's effective coefficients [B, P, L+1, L+1] over (embedding, sublayer outputs), float64."""
        self._checked()
        steps = [StreamWeights(r["pre"].double(), r["comb"].double().transpose(-1, -2), r["post"].double()) for r in self.reads]
        return hyper_read_coefficients(steps, final=self.head["pre"].double())

    def sources(self) -> torch.Tensor:
        """[B, P, L+1, d]: the embedding, then every sublayer output (float64)."""
        self._checked()
        return torch.stack([self.embed.double(), *(y.double() for y in self.outputs)], dim=-2)

    def read_inputs(self) -> torch.Tensor:
        """[B, P, L+1, d]: what every read gave its sublayer's norm, then the final collapse (float64)."""
        self._checked()
        return torch.stack([*(r["read"].double() for r in self.reads), self.head["read"].double()], dim=-2)

    def native(self) -> dict[str, torch.Tensor]:
        """The model's own weights: ``pre`` [B, P, L+1, n] (the last is hc_head's), ``post`` [B, P, L, n],
        ``comb`` [B, P, L, n, n], and each comb's Sinkhorn errors [B, P, L] (max |row/column sum - 1|)."""
        self._checked()
        comb = torch.stack([r["comb"].float() for r in self.reads], dim=2)
        return {
            "pre": torch.stack([*(r["pre"].float() for r in self.reads), self.head["pre"].float()], dim=2),
            "post": torch.stack([r["post"].float() for r in self.reads], dim=2),
            "comb": comb,
            "sinkhorn_row_error": (comb.double().sum(-1) - 1).abs().amax(-1).float(),
            "sinkhorn_col_error": (comb.double().sum(-2) - 1).abs().amax(-1).float(),
        }

    def reconstruction_error(self) -> float:
        """max over reads and tokens of |sum_i c_i v_i - read| / rms(read)."""
        coef, V, reads = self.coefficients(), self.sources(), self.read_inputs()
        rebuilt = torch.einsum("bprs,bpsd->bprd", coef, V)
        scale = reads.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
        return float(((rebuilt - reads).abs() / scale).max())

    def trace(self):
        """The latest forward (and backward, if one ran) as a :class:`~attnres_probe.DepthTrace` on the
        common axis (residual ``hyper``, mHC), its coefficients as depth weights, the native weights kept."""
        from .watch_hc import coefficient_trace

        coef = self.coefficients()
        cfg = getattr(self.model, "config", None)
        n = int(self.reads[0]["pre"].shape[-1])
        config = {"residual": "hyper", "n_layers": self.n_layers, "n_streams": n, "mhc": True, "hc_dynamic": True,
                  "hc_dynamic_input": "flat", "sinkhorn_iters": int(self.base.layers[0].attn_hc.hc_sinkhorn_iters),
                  "family": "deepseek_v4", "model_type": getattr(cfg, "model_type", None)}
        tokens = self.tokens
        tok = self.tokenizer
        str_tokens = None
        if tok is not None and hasattr(tok, "decode") and tokens is not None:
            str_tokens = [[str(tok.decode([int(t)])) for t in row] for row in tokens.tolist()]
        L = 2 * self.n_layers
        grad_in = grad_out = None
        if self.grads:
            B, P = coef.shape[:2]
            nan = torch.full((B, P), float("nan"))
            grad_in = torch.stack([self.grads.get(("in", r), nan) for r in range(L + 1)], dim=-1)
            grad_out = torch.stack([self.grads.get(("out", j), nan) for j in range(L + 1)], dim=-1)
        meta = {
            "model_class": type(self.model).__name__,
            "source": "transformers hyper-connections (DeepSeek-V4 mHC), watched (watch)",
            "n_params": int(sum(p.numel() for p in self.model.parameters())),
            "call_names": [r["label"] for r in self.reads],
            "reconstruction_error": self.reconstruction_error(),
            "native": {
                "pre": "read weights over the streams, sigmoid + eps [batch, pos, read, stream] (the final read: hc_head's)",
                "post": "write weights of each sublayer's output into the streams, 2 sigmoid [batch, pos, sublayer, stream]",
                "comb": "Sinkhorn-projected stream mixing [batch, pos, sublayer, from stream, to stream]",
                "sinkhorn_row_error": "max |row sum - 1| of comb [batch, pos, sublayer]",
                "sinkhorn_col_error": "max |column sum - 1| of comb [batch, pos, sublayer]",
            },
        }
        native = {k: v.cpu().numpy() for k, v in self.native().items()}
        return coefficient_trace(coef, self.sources(), self.read_inputs(), tokens=tokens, logits=self.logits, name=self.name,
                                 str_tokens=str_tokens, config=config, meta=meta, grad_in=grad_in, grad_out=grad_out,
                                 native=native)


@contextlib.contextmanager
def watch_streams(model: nn.Module, tokenizer: Any = None, name: str | None = None) -> Iterator[StreamsWatch]:
    """Record a live DeepSeek-V4-style hyper-connection model while the context is open (forward hooks
    only; removed on exit, also on error). Yields a :class:`StreamsWatch`; after a forward (and
    optionally a backward) call ``session.trace()``.

    Raises:
        WatchError: the model does not follow the contract (the message names what is missing).
    """
    missing = check_stream_model(model)
    if missing:
        raise WatchError(f"{type(model).__name__} does not follow DeepSeek-V4's hyper-connection contract; it lacks "
                         f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    session = StreamsWatch(model, tokenizer, name)
    base = session.base
    handles = [
        model.register_forward_pre_hook(session.on_input, with_kwargs=True),
        model.register_forward_hook(session.on_output, with_kwargs=True),
        base.embed_tokens.register_forward_hook(session.on_embed),
        base.hc_head.register_forward_hook(session.on_head),
    ]
    try:
        for i, layer in enumerate(base.layers):
            handles += [
                layer.attn_hc.register_forward_hook(session.on_hc(f"layers.{i}.attn_hc")),
                layer.self_attn.register_forward_hook(session.on_sublayer(lambda o: o[0] if isinstance(o, tuple) else o)),
                layer.ffn_hc.register_forward_hook(session.on_hc(f"layers.{i}.ffn_hc")),
                layer.mlp.register_forward_hook(session.on_sublayer(lambda o: o[0] if isinstance(o, tuple) else o)),
            ]
        yield session
    finally:
        for h in handles:
            h.remove()
