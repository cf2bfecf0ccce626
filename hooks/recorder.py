"""Recorder: attaches to a model's hook points and keeps reductions only, never activations.

Per token and read it keeps the depth weights and logits (on the common source axis), the
contribution share of every source, the RMS of the mixed input and, when a backward pass runs,
the norm of the gradient at the mixed input; per source it keeps the RMS of every sublayer
output and, with a backward pass, the norm of the gradient at it (through every read of it).
AttnRes mixers hand over their contribution shares through ``hook_contrib`` (they
have the sources at hand; the Numba kernels compute the shares in the mixing pass itself), so
the recorder keeps no source of an AttnRes model. For a PreNorm model it keeps every
sublayer output until the forward ends (the model drops them, and the share of a source at a
later read needs the source itself), then gets all shares from one Gram matrix.

Hooks are removed on exit, also when the forward raises; a hook never raises on NaN/Inf
(those are recorded and flagged on the trace). Any other failure inside a hook is kept and
raised after the forward as :class:`RecorderError` with the hook's name.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from attnres_probe.axis import COEFFICIENT_RULES
from attnres_probe.hooks.spec import ModelSpec

__all__ = ["Recorder", "RecorderError"]


class RecorderError(RuntimeError):
    """A recorder hook failed (the message names the hook point)."""


class Recorder:
    """Context manager that records one forward (and optional backward) of ``model``.

    Args:
        model: a hooked model (``hook_dict`` with the names in ``spec``).
        spec: the model's :class:`ModelSpec`.
        contributions: compute contribution shares (one dot product per visible source
            and read).
        gradients: register gradient hooks on the mixed inputs (needs grad enabled).
        this_thread: record only the forward passes run by the thread that creates the
            recorder (default): hook points are shared by everyone who runs the model, so
            another thread's forward neither writes into this recording nor fails it.

    After the forward (and backward), :meth:`arrays` returns the recorded tensors.
    """

    def __init__(
        self, model: Any, spec: ModelSpec, contributions: bool = True, gradients: bool = False, this_thread: bool = True
    ):
        self.model = model
        self._owner = threading.get_ident() if this_thread else None
        self.spec = spec
        self.contributions = contributions
        self.gradients = gradients
        self.counts = spec.axis.counts  # sources each read sees
        self._handles: list[tuple[Any, Any]] = []
        self._error: tuple[str, BaseException] | None = None
        self._arrays: dict[str, torch.Tensor] | None = None
        # shares from the sources' Gram matrix once the last read is known (PreNorm; Hyper-Connections and
        # DenseFormer, whose reads are linear in the sources with the recorded coefficients): one batched
        # product instead of a dot product per source and read (what the mixers' share hooks would do)
        self._gram = bool(contributions) and spec.residual in COEFFICIENT_RULES
        self._native: dict[str, dict[int, torch.Tensor]] = {}
        self._reset_stream()

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Recorder:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def attach(self) -> None:
        hd = self.model.hook_dict
        spec = self.spec
        plan: list[tuple[str, Any]] = [("hook_embed", self._on_embed)]
        if spec.pos_embed:
            plan.append(("hook_pos_embed", self._on_pos_embed))
        for r, name in enumerate(spec.read_hooks):
            if name is not None:
                plan.append((name, self._make(self._on_read, r)))
        for l, name in enumerate(spec.output_hooks):
            plan.append((name, self._make(self._on_output, l)))
        if spec.weight_hooks:
            for r, name in enumerate(spec.weight_hooks):
                plan.append((name, self._make(self._on_weights, r)))
        if spec.logit_hooks:
            for r, name in enumerate(spec.logit_hooks):
                plan.append((name, self._make(self._on_logits, r)))
        for key, names in spec.native_hooks.items():
            for r, name in enumerate(names):
                if name is not None:
                    plan.append((name, self._make(self._native_into(key), r)))
        if self.contributions and spec.contrib_hooks and not self._gram:
            for r, name in enumerate(spec.contrib_hooks):
                plan.append((name, self._make(self._on_contrib, r)))
        try:
            for name, fn in plan:
                hp = hd[name]
                self._handles.append((hp, hp.add_hook(self._guard(name, fn), dir="fwd")))
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        """Remove every hook this recorder added (other hooks stay)."""
        for hp, handle in self._handles:
            handle.hook.remove()
            if handle in hp.fwd_hooks:
                hp.fwd_hooks.remove(handle)
        self._handles.clear()
        self._reset_stream()

    def _reset_stream(self) -> None:
        self._tok: torch.Tensor | None = None
        self._sources: list[torch.Tensor] = []  # PreNorm with contributions: every source
        self._final_sum: torch.Tensor | None = None

    def raise_if_failed(self) -> None:
        if self._error is not None:
            name, exc = self._error
            self._error = None
            raise RecorderError(f"recording at hook {name!r} failed: {type(exc).__name__}: {exc}") from exc

    # -- hook plumbing -------------------------------------------------------------------
    @staticmethod
    def _make(fn, index: int):
        return lambda x: fn(index, x)

    def _guard(self, name: str, fn):
        owner = self._owner

        def hook(x: torch.Tensor, hook: Any = None) -> None:
            if self._error is not None or (owner is not None and threading.get_ident() != owner):
                return None
            try:
                with torch.no_grad():
                    fn(x)
            except Exception as exc:  # kept and raised after the forward, never inside the model
                self._error = (name, exc)
            return None

        return hook

    # -- storage -------------------------------------------------------------------------
    def _alloc(self, x: torch.Tensor) -> None:
        B, P = x.shape[:2]
        R, S = self.spec.n_sublayers + 1, len(self.spec.source_labels)
        L = self.spec.n_sublayers
        kw = dict(device=x.device, dtype=torch.float32)
        nan = float("nan")
        self._arrays = {
            "depth_weights": torch.full((B, P, R, S), nan, **kw),
            "logits": torch.full((B, P, R, S), nan, **kw),
            "contrib": torch.full((B, P, R, S), nan, **kw),
            "rms_in": torch.full((B, P, R), nan, **kw),
            "grad_in": torch.full((B, P, R), nan, **kw),
            "rms_out": torch.full((B, P, L + 1), nan, **kw),
            "grad_out": torch.full((B, P, L + 1), nan, **kw),
        }

    def arrays(self) -> dict[str, torch.Tensor]:
        """The recorded tensors (see :class:`~attnres_probe.DepthTrace` for shapes)."""
        self.raise_if_failed()
        if self._arrays is None:
            raise RecorderError("nothing was recorded: the model never reached hook_embed")
        return self._arrays

    # -- hooks ---------------------------------------------------------------------------
    def _on_embed(self, x: torch.Tensor) -> None:
        self._reset_stream()
        self._native = {}
        self._alloc(x)
        self._tok = x
        self._grad_norm_into("grad_out", 0, x)  # source 0 is tok (+ pos): the same gradient
        if not self.spec.pos_embed:  # rotary positions: the token embedding is source 0
            self._on_source0(x)

    def _on_pos_embed(self, x: torch.Tensor) -> None:
        self._on_source0(self._tok + x if self._tok is not None else x)

    def _on_source0(self, v0: torch.Tensor) -> None:
        self._tok = None
        self._sources = [v0]
        self._final_sum = v0 if self.spec.read_hooks[-1] is None else None
        self._arrays["rms_out"][:, :, 0] = _rms(v0)

    def _on_weights(self, r: int, w: torch.Tensor) -> None:
        k = self.counts[r]
        self._arrays["depth_weights"][:, :, r, :k] = w[..., :k].float()
        if self._gram and r == self.spec.n_sublayers and len(self._sources) == k:
            self._gram_contributions()  # the final read's coefficients: every source and weight is known

    def _native_into(self, key: str):
        def store(r: int, t: torch.Tensor) -> None:
            self._native.setdefault(key, {})[r] = t.detach().float().clone()
        return store

    def native_arrays(self) -> dict[str, torch.Tensor]:
        """The rule's own weights per name, [batch, pos, reads, width] with NaN past each read's sources
        (reads without them are NaN rows); empty when the rule keeps none."""
        self.raise_if_failed()
        out = {}
        for key, per_read in self._native.items():
            R = len(self.spec.native_hooks[key])
            first = next(iter(per_read.values()))
            width = max(t.shape[-1] for t in per_read.values())
            arr = torch.full((*first.shape[:2], R, width), float("nan"), device=first.device)
            for r, t in per_read.items():
                arr[:, :, r, : t.shape[-1]] = t
            out[key] = arr
        return out

    def _on_logits(self, r: int, z: torch.Tensor) -> None:
        k = self.counts[r]
        self._arrays["logits"][:, :, r, :k] = z[..., :k].float()

    def _on_contrib(self, r: int, c: torch.Tensor) -> None:
        k = self.counts[r]
        self._arrays["contrib"][:, :, r, :k] = c[..., :k].float()

    def _on_read(self, r: int, h: torch.Tensor) -> None:
        self._read(r, h)
        self._grad_norm_into("grad_in", r, h)

    def _grad_norm_into(self, name: str, index: int, x: torch.Tensor) -> None:
        """In the backward, store the norm of dLoss/dx per token into ``name[:, :, index]``."""
        if not (self.gradients and x.requires_grad):
            return
        out = self._arrays[name]

        def store_grad_norm(g: torch.Tensor) -> None:
            out[:, :, index] = g.detach().float().norm(dim=-1)

        x.register_hook(store_grad_norm)

    def _read(self, r: int, h: torch.Tensor) -> None:
        a = self._arrays
        k = self.counts[r]
        a["rms_in"][:, :, r] = _rms(h)
        if self.spec.residual != "prenorm":
            return  # AttnRes: the mixers hand over their shares (hook_contrib)
        a["depth_weights"][:, :, r, :k] = 1.0
        if self.contributions and r == self.spec.n_sublayers:
            self._gram_contributions()  # every source is known once the final read is reached

    def _gram_contributions(self) -> None:
        """Contribution shares of every read at once, from the sources' Gram matrix (PreNorm,
        Hyper-Connections, DenseFormer: reads linear in the sources).

        With h_r = sum_j a_rj v_j (a the read's coefficients: 1 where source j is visible to a
        PreNorm read, the recorded coefficients c otherwise) and G_ij = <v_i, v_j>,
        <a_ri v_i, h_r> = a_ri (G a_r)_i and |h_r|^2 = a_r' G a_r. One batched matrix product per
        chunk of tokens replaces (L+1)(L+2)/2 separate dot products over the model width (about
        twice as fast at d=256, 25 sources). In float32: with signed coefficients (HC, DenseFormer)
        G a_r can cancel, and a share's error is then up to about d u32 (sum_j |c_j| |v_j|)^2 / |h|^2
        (tests/test_rule_models.py bounds it).
        """
        a = self._arrays
        W = a["depth_weights"]
        B, P, R, S = W.shape
        flat = [v.reshape(B * P, -1) for v in self._sources]
        d = flat[0].shape[-1]
        w = W.view(B * P, R, S)
        coef = torch.nan_to_num(w, nan=0.0)
        avail = ~torch.isnan(w)
        out = a["contrib"].view(B * P, R, S)
        dtype = torch.float32
        chunk = max(64, (1 << 19) // (S * d))  # ~2 MB of stacked sources at a time (a recording keeps to 2x its arrays)
        for start in range(0, B * P, chunk):
            rows = slice(start, start + chunk)
            V = torch.stack([f[rows].to(dtype) for f in flat], dim=1)  # (m, S, d)
            G = torch.bmm(V, V.transpose(1, 2))  # (m, S, S)
            c = coef[rows].to(dtype)
            num = c * torch.bmm(c, G)  # (m, R, S)
            share = num / num.sum(-1, keepdim=True)
            out[rows] = torch.where(avail[rows], share, torch.full_like(share, float("nan")))

    def _on_output(self, l: int, v: torch.Tensor) -> None:
        self._arrays["rms_out"][:, :, l + 1] = _rms(v)
        self._grad_norm_into("grad_out", l + 1, v)
        spec = self.spec
        if self._gram:  # sources are kept only for the contribution shares
            self._sources.append(v)
        if spec.residual != "prenorm":
            return
        if self._final_sum is not None:
            self._final_sum = self._final_sum + v
            if l == spec.n_sublayers - 1:  # no final-read hook: the PreNorm final read is the sum
                self._read(spec.n_sublayers, self._final_sum)
                self._final_sum = None

    def finish(self) -> None:
        """Drop the references to sources once the forward is over."""
        self._reset_stream()
        self.raise_if_failed()


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Plain RMS magnitude over the last axis, sqrt(mean(x^2)), in float32."""
    xf = x.float()
    return torch.linalg.vecdot(xf, xf).div_(x.shape[-1]).sqrt_()
