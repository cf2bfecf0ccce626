"""AttnRes over cumulative residual states: the rule of the Qwen3-AttnRes family.

Read from ``modeling_attnres.py`` of gouzigouzi/attention-residuals-reproduction (commit 7fa43ed;
the file is unchanged since the public weights were trained). With v_0 the embedding, v_{j+1} the
output of sublayer j and P_k = v_0 + ... + v_k the plain running sum (the model's stream, which no
read replaces and no block boundary resets):

- read r (before sublayer r) mixes its own sources, **cumulative states**: the states kept so far
  and then the running sum P_r itself. ``mode="full"`` keeps the state after every sublayer
  (sources P_0, P_1, ..., P_r, P_r); ``mode="block"`` keeps it after the MLP of every
  ``layers_per_block``-th layer (sources P_0, P_{2S}, P_{4S}, ..., P_r). The duplicates are
  upstream's: a state just kept is also the running sum.
- scores z_n = q . (g * V_n / rms(V_n)) (rms with eps ``norm_eps``, the gain g per read), plus a
  learned recency bias b on the last source (the running sum); w = softmax(z); h = sum_n w_n V_n.
- a gate mixes the read with the running sum: ``gate="bias"`` x = h; ``"sigmoid_scalar"``
  x = (1 - sigmoid(a)) P_r + sigmoid(a) h; ``"learnable_alpha"`` x = (1 - alpha) P_r + alpha h.
  (Upstream's per-dimension ``sigmoid_vector`` gate has no scalar coefficients and is refused by
  the loader.) x goes through the sublayer's pre-norm.
- no final depth read: the final norm reads P_L.

**Effective coefficients.** Source n is P_{k_n}, so h = sum_i t_i v_i with t_i = sum_{n: k_n >= i} w_n
(the weight of every source that contains v_i; t_0 = 1), and the gated read is
x = sum_i c_i v_i with c_i = t_i (bias) or 1 - g (1 - t_i) (g = sigmoid(a) or alpha). ``hook_weights``
shows c on the common axis ``[embed, L0.attn, L0.mlp, ...]`` (the final read's are all one); the
rule's own weights and scores are ``hook_native_weights`` / ``hook_native_logits`` [batch, pos,
n_native] (n_native = the read's own sources), which a trace keeps as ``trace.native``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from attnres_probe.hook_checks import CheckedHookPoint
from attnres_probe.layers import CoefficientRead, RMSNorm

__all__ = ["CumulativeRead", "forward", "kept_after", "make_final", "make_read", "native_sources"]

def kept_after(options: dict[str, Any], sublayer: int) -> bool:
    """Whether the state after ``sublayer`` is kept as a source of the later reads."""
    if options["mode"] == "full":
        return True
    return sublayer % 2 == 1 and (sublayer // 2 + 1) % options["layers_per_block"] == 0


def native_sources(options: dict[str, Any], n_sublayers: int) -> list[list[int]]:
    """Per read (the L sublayer reads), the index k of every source P_k, in the read's order."""
    kept, out = [0], []
    for r in range(n_sublayers):
        out.append([*kept, r])
        if kept_after(options, r):
            kept.append(r + 1)
    return out


class CumulativeRead(CoefficientRead):
    """One read: the softmax over cumulative states with a recency bias, then the gate.

    Parameters: ``query`` [d_model] (zero at init: uniform), ``norm.weight`` [d_model] (the key gain),
    ``bias`` [] (the recency bias), and ``gate_logit`` [] (``sigmoid_scalar``) or ``alpha`` []
    (``learnable_alpha``). Hooks: ``hook_native_logits``, ``hook_native_weights`` [batch, pos,
    n_native] (a hook that returns changed ones is an intervention: the read is rebuilt from them),
    ``hook_weights`` / ``hook_contrib`` [batch, pos, n_sources] on the common axis (coefficients,
    computed while hooked; :class:`~attnres_probe.layers.CoefficientRead`).
    """

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.eps = cfg.norm_eps
        self.gate = cfg.rule_options["gate"]
        self.query = nn.Parameter(torch.zeros(cfg.d_model))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # only .weight is used: the key gain
        self.bias = nn.Parameter(torch.zeros(()))
        if self.gate == "sigmoid_scalar":
            self.gate_logit = nn.Parameter(torch.zeros(()))
        elif self.gate == "learnable_alpha":
            self.alpha = nn.Parameter(torch.ones(()))  # 1: the read alone (upstream starts at 0, PreNorm)
        self.hook_native_logits = CheckedHookPoint()  # [batch, pos, n_native] scores over the read's own sources
        self.hook_native_weights = CheckedHookPoint()  # [batch, pos, n_native] their softmax

    def gate_value(self) -> torch.Tensor | None:
        """g of x = (1 - g) P + g h, or None for ``gate="bias"`` (x = h)."""
        if self.gate == "sigmoid_scalar":
            return torch.sigmoid(self.gate_logit)
        if self.gate == "learnable_alpha":
            return self.alpha
        return None

    def forward(self, states: Sequence[torch.Tensor], index: Sequence[int], running: torch.Tensor,
                sources: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """The gated read from ``states`` (P_{k_n}, the running sum last; ``index`` their k_n) and the
        running sum; ``sources`` (v_0..v_r on the common axis) when the coefficients are hooked."""
        V = torch.stack(list(states), dim=-2)  # (B, P, n, d)
        dtype = torch.promote_types(V.dtype, torch.float32)
        Vf = V.to(dtype)
        keys = Vf * torch.rsqrt(Vf.pow(2).mean(-1, keepdim=True) + self.eps)
        z = torch.einsum("bpnd,d->bpn", keys, (self.query * self.norm.weight).to(dtype))
        z = torch.cat([z[..., :-1], z[..., -1:] + self.bias.to(dtype)], dim=-1)
        version = z._version
        z_h = self.hook_native_logits(z)
        if z_h is not z or z._version != version:
            z = z_h
        w = torch.softmax(z, dim=-1)
        version = w._version
        w_h = self.hook_native_weights(w)
        w = w_h
        h = torch.einsum("bpn,bpnd->bpd", w.to(dtype), Vf).to(V.dtype)
        g = self.gate_value()
        x = h if g is None else (1 - g).to(V.dtype) * running + g.to(V.dtype) * h
        if sources is None:
            return x
        r = len(sources) - 1
        member = (torch.arange(r + 1, device=V.device) <= torch.as_tensor(list(index), device=V.device)[:, None]).to(dtype)
        t = w.to(dtype) @ member  # (B, P, r+1): the weight of every source holding v_i
        c = t if g is None else 1 - g.to(dtype) * (1 - t)
        return self.observe(sources, x, self.on_axis(c, 0.0))


def native_source_labels(cfg: Any) -> list[list[str]]:
    """Per read, its own sources: "P0", "P4", ..., and the running sum "P_r (running)"; the final read
    (the running sum itself) has none."""
    per = native_sources(cfg.rule_options, cfg.n_sublayers)
    return [[*(f"P{k}" for k in ks[:-1]), f"P{ks[-1]} (running)"] for ks in per] + [[]]


def make_read(cfg: Any, sublayer: int) -> CumulativeRead:
    return CumulativeRead(cfg)


def make_final(cfg: Any) -> CoefficientRead:
    """The final read is the running sum (coefficients all one): shown as coefficients while hooked."""
    return CoefficientRead(cfg)


def forward(model: Any, v0: torch.Tensor) -> torch.Tensor:
    """The model's forward under this rule, from the embedding to the final read (before ln_final)."""
    options = model.cfg.rule_options
    reads = model.mixers
    track = any(r.hooked for r in reads)
    running, states, index = v0, [v0], [0]
    sources = [v0]
    for l, block, which in model._sublayers():
        x = reads[l]([*states, running], [*index, l], running, sources if track else None)
        y = block.sublayer(which, x)
        running = running + y
        if track:
            sources.append(y)
        if kept_after(options, l):
            states.append(running)
            index.append(l + 1)
    if track:
        B, P = v0.shape[:2]
        ones = torch.ones(B, P, len(sources), dtype=torch.promote_types(v0.dtype, torch.float32), device=v0.device)
        running = reads[-1].observe(sources, running, ones)
    return running
