"""Hyper-Connections (HC, arXiv 2409.19606) and manifold-constrained HC (mHC, arXiv 2512.24880).

The residual stream is widened to ``n`` streams, a state ``X`` of shape ``[batch, pos, n, d]``.
One :class:`HyperConnection` wraps one sublayer (an attention or an MLP) with three per-token
matrices, in mHC's notation (docs/depth_rules.md)::

    read:  h  = H_pre X                  h [batch, pos, d],   H_pre  [n]     (1 x n)
    write: X' = H_res X + H_post^T y     y the sublayer's output, H_res [n, n], H_post [n] (1 x n)

so ``h = sum_s H_pre[s] X_s`` and ``X'_t = sum_s H_res[t, s] X_s + H_post[t] y``. The model starts
from ``n`` copies of the embedding (:func:`expand_streams`) and its final read, the input of the
final norm and unembedding, is the sum of the streams (:func:`reduce_streams`).

Variants (``dynamic``, ``mhc``):

- **static HC** (SHC in the HC paper): ``H_pre = b_pre``, ``H_res = b_res``, ``H_post = b_post``,
  learned, the same for every token.
- **dynamic HC** (DHC, the HC paper's eq. 10-13): the state is normed per stream,
  ``Xn_s = RMSNorm(X_s)`` (the paper uses a LayerNorm, the package an RMSNorm), and
  ``H_pre[s] = b_pre[s] + s_a tanh(Xn_s . w_pre)``, ``H_res[t, s] = b_res[t, s] + s_a
  tanh(Xn_s . W_res[:, t])``, ``H_post[s] = b_post[s] + s_b tanh(Xn_s . w_post)``: the weight on
  stream s is a function of stream s. ``s_a`` (shared by H_pre and H_res) and ``s_b`` are learned
  scalars, 0.01 at init; the projections are zero at init, so a fresh dynamic HC is its static one.
- **mHC**: the same pre-activations with their own scales ``a_pre, a_res, a_post`` (0.01 at init)
  and no tanh, then ``H_pre = sigmoid(.)``, ``H_post = 2 sigmoid(.)`` (non-negative) and
  ``H_res = Sinkhorn(.)``, doubly stochastic up to the Sinkhorn tolerance (:func:`sinkhorn`).
  With ``dynamic_input="flat"`` (the mHC paper's form, the default for mHC) the state is normed as
  one vector of n*d numbers, ``x = RMSNorm(vec X)``, and every entry of every matrix is a
  projection of all of it: ``H~_pre = a_pre (x phi_pre) + b_pre`` and so on, ``phi_res`` giving
  the n*n entries of ``H~_res`` row by row. ``dynamic_input="stream"`` is the HC paper's per-stream
  form above, which is what the ``hyper-connections`` package's mHC class computes.

Initialisation (the HC paper's, as the package implements it, Algorithm 2 of its appendix):
``b_pre = e_{k mod n}`` (k = ``layer_index``, the sublayer's index), ``b_res = I``,
``b_post = 1``, projections 0, scales 0.01. For HC this makes every stream the PreNorm running
sum and every read the PreNorm read. For mHC the same values are logits, as in the package:
``H_pre = sigmoid(e_k)``, ``H_post = 2 sigmoid(1)`` and ``H_res = Sinkhorn(exp(I))``; the mHC
paper's own initial values are not reproduced here (docs/depth_rules.md).

Conventions of the ``hyper-connections`` package (0.4.11), for :func:`package_to_ours` and the
parity tests (tests/test_depth_rules.py); line numbers are of its ``hyper_connections.py`` (HC)
and ``manifold_constrained_hyper_connections.py`` (mHC):

- Its state is ``[(batch * n), pos, d]``, streams folded into the batch, batch-major
  (``'(b s) ... d'``, HC 282 and 335); :func:`to_package_layout`/:func:`from_package_layout`
  convert. Its expand repeats the embedding n times (HC 59) and its reduce sums the streams
  (HC 61), as here.
- It keeps one ``static_alpha`` of shape [n, 1 + n] (HC 229-232): column 0 is ``b_pre`` and
  columns 1.. are the residual mixing indexed [source s, target t] (the HC paper's ``A_r``, with
  ``H' = A_r^T H``, HC 315): ``b_res = static_alpha[:, 1:].T`` here. ``dynamic_alpha_fn``
  [d, 1 + n] (mHC: [proposals, d, 1 + n], proposals = 1) splits the same way; ``static_beta`` [n]
  and ``dynamic_beta_fn`` [d] are ``b_post`` and ``w_post``.
- Its norm (HC 86-93) is ``F.normalize(x) * sqrt(d) * (gamma + 1)`` with ``gamma`` zero at init:
  our RMSNorm's gain is ``gamma + 1`` and our ``norm_eps`` must be 0 to match it (it clamps the
  norm at 1e-12 instead of adding an eps).
- HC scales: ``dynamic_alpha_scale`` (s_a, for H_pre and H_res, HC 235 and 290-291) and
  ``dynamic_beta_scale`` (s_b, HC 247); mHC: ``pre_branch_scale``, ``residual_scale``,
  ``h_post_scale`` (mHC 277-290), each of shape [1] or [].
- mHC's Sinkhorn (mHC 49-61) subtracts the (detached) maximum over sources, exponentiates, then
  alternates 20 times: normalise over the source index, then over the target index (each an L1
  normalisation clamped at 1e-12). In our [t, s] orientation: rows, then columns; after the last
  step the columns of H_res sum to one to rounding and the rows to the Sinkhorn tolerance.
- mHC computes the weights and the mixing in float32 whatever the input dtype (mHC 359-432):
  a float64 run of the package's mHC is a float32 computation. This module computes the weights
  in the promoted type of the input and float32, so a float64 run is float64 throughout.
- Not supported here: ``num_fracs > 1`` (Frac-Connections), ``num_input_views > 1``,
  ``num_dynamic_alpha_proposals > 1``, ``channel_first``, dropout, a ``residual_transform``,
  ``add_branch_out_to_residual=False`` and the learned ``StreamEmbed`` expansion (it adds a
  constant per stream, which is not a combination of the sources; the bookkeeping below would
  need it as a source of its own).

Effective depth weights (:func:`hyper_read_coefficients`): every read is a linear combination
of the embedding and the earlier sublayers' outputs, with per-token coefficients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

import attnres_probe.kernels as kernels  # the top-level kernels/ folder (pyproject's package-dir map)

__all__ = [
    "HyperConnection",
    "HyperStep",
    "StreamWeights",
    "expand_streams",
    "from_package_layout",
    "hyper_read_coefficients",
    "package_to_ours",
    "reduce_streams",
    "sinkhorn",
    "to_package_layout",
]


class StreamWeights(NamedTuple):
    """One sublayer's mixing matrices, per token (leading dims broadcast to [batch, pos]).

    ``pre`` [..., n]: h = sum_s pre[s] X_s. ``res`` [..., n, n] indexed [target t, source s] and
    ``post`` [..., n]: X'_t = sum_s res[t, s] X_s + post[t] y.
    """

    pre: torch.Tensor
    res: torch.Tensor
    post: torch.Tensor


class HyperStep(NamedTuple):
    """What :meth:`HyperConnection.forward` returns: the new state, the sublayer's input and
    output, and the weights used."""

    state: torch.Tensor
    read: torch.Tensor
    output: torch.Tensor
    weights: StreamWeights


def expand_streams(x: torch.Tensor, n_streams: int) -> torch.Tensor:
    """[..., d] -> [..., n, d]: n copies of ``x`` (the embedding enters every stream)."""
    return x.unsqueeze(-2).repeat_interleave(n_streams, dim=-2)


def reduce_streams(state: torch.Tensor) -> torch.Tensor:
    """[..., n, d] -> [..., d]: the sum of the streams (the final read)."""
    return state.sum(-2)


def to_package_layout(state: torch.Tensor) -> torch.Tensor:
    """[batch, pos, n, d] -> the package's [(batch * n), pos, d], batch-major."""
    b, p, n, d = state.shape
    return state.permute(0, 2, 1, 3).reshape(b * n, p, d)


def from_package_layout(state: torch.Tensor, n_streams: int) -> torch.Tensor:
    """The package's [(batch * n), pos, d] -> [batch, pos, n, d]."""
    bn, p, d = state.shape
    return state.reshape(bn // n_streams, n_streams, p, d).permute(0, 2, 1, 3)


def sinkhorn(logits: torch.Tensor, iters: int = 20, backend: str | None = None) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``exp(logits)`` [..., n, n] (indexed [t, s]) towards the
    doubly stochastic matrices: ``iters`` rounds of normalising the rows, then the columns
    (:func:`attnres_probe.kernels.sinkhorn`: a Numba kernel on the CPU, the PyTorch reference
    elsewhere or with ``backend="torch"``).

    The maximum over each row is subtracted first (detached; it cancels in the first row
    normalisation). After the last round every column sums to one to rounding; the rows sum to
    one within ``exp(delta) - 1``, ``delta = tau^(2 iters - 1) d_H(b_1, 1)`` with ``tau`` the
    Birkhoff contraction ratio of ``exp(logits)`` (tests/test_depth_rules.py computes it).
    """
    return kernels.sinkhorn(logits, iters, backend=backend)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class HyperConnection(nn.Module):
    """One sublayer's hyper-connection: read ``h = H_pre X``, write ``X' = H_res X + H_post^T y``.

    Args:
        d_model: width d of each stream.
        n_streams: n.
        layer_index: the sublayer's index k; ``b_pre`` starts as the one-hot of ``k mod n``.
        dynamic: per-token weights from the state (DHC); else static (SHC).
        mhc: the manifold-constrained form (sigmoid H_pre, 2 sigmoid H_post, Sinkhorn H_res).
        dynamic_input: ``"stream"`` (each stream's weights from that stream, the HC paper and
            the package) or ``"flat"`` (every weight from the whole normed state, the mHC paper).
            Default: ``"flat"`` for mHC, ``"stream"`` for HC.
        tanh: HC only: the tanh on the dynamic terms (the HC paper and the package's default).
        sinkhorn_iters: mHC's Sinkhorn rounds (20 in the paper and the package).
        norm_eps: the eps of the dynamic weights' RMSNorm (0 reproduces the package's norm).
        scale_init: initial value of the dynamic terms' scales (0.01, as the package).

    The weights are computed in the promoted type of the state and float32 and returned in it;
    the read and write are computed in that type and returned in the state's dtype.
    """

    def __init__(
        self,
        d_model: int,
        n_streams: int,
        layer_index: int,
        dynamic: bool = False,
        mhc: bool = False,
        *,
        dynamic_input: str | None = None,
        tanh: bool = True,
        sinkhorn_iters: int = 20,
        norm_eps: float = 1e-6,
        scale_init: float = 1e-2,
    ):
        super().__init__()
        if n_streams < 1 or d_model < 1:
            raise ValueError(f"n_streams and d_model must be positive; got {n_streams}, {d_model}")
        if dynamic_input is None:
            dynamic_input = "flat" if mhc else "stream"
        if dynamic_input not in ("stream", "flat"):
            raise ValueError(f"dynamic_input is {dynamic_input!r}; accepted values are 'stream', 'flat'")
        if sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be at least 1; got {sinkhorn_iters}")
        self.d_model, self.n_streams, self.layer_index = d_model, n_streams, layer_index
        self.dynamic, self.mhc, self.dynamic_input = bool(dynamic), bool(mhc), dynamic_input
        self.tanh = bool(tanh) and not mhc
        self.sinkhorn_iters, self.norm_eps = sinkhorn_iters, norm_eps
        n, d = n_streams, d_model
        pre = torch.zeros(n)
        pre[layer_index % n] = 1.0
        self.pre_bias = nn.Parameter(pre)
        self.res_bias = nn.Parameter(torch.eye(n))  # [t, s]
        self.post_bias = nn.Parameter(torch.ones(n))
        if self.dynamic:
            width = d if dynamic_input == "stream" else n * d
            self.norm_weight = nn.Parameter(torch.ones(width))
            if dynamic_input == "stream":
                self.pre_proj = nn.Parameter(torch.zeros(d))  # Xn_s . w_pre
                self.res_proj = nn.Parameter(torch.zeros(d, n))  # Xn_s . W_res[:, t] -> H_res[t, s]
                self.post_proj = nn.Parameter(torch.zeros(d))
            else:
                self.pre_proj = nn.Parameter(torch.zeros(n * d, n))
                self.res_proj = nn.Parameter(torch.zeros(n * d, n, n))  # x . phi[:, t, s] -> H_res[t, s]
                self.post_proj = nn.Parameter(torch.zeros(n * d, n))
            if self.mhc:
                self.pre_scale = nn.Parameter(torch.tensor(scale_init))
                self.res_scale = nn.Parameter(torch.tensor(scale_init))
                self.post_scale = nn.Parameter(torch.tensor(scale_init))
            else:
                self.alpha_scale = nn.Parameter(torch.tensor(scale_init))  # s_a: H_pre and H_res
                self.beta_scale = nn.Parameter(torch.tensor(scale_init))  # s_b: H_post

    def extra_repr(self) -> str:
        kind = ("mHC" if self.mhc else "HC") + (f", dynamic ({self.dynamic_input})" if self.dynamic else ", static")
        return f"d_model={self.d_model}, n_streams={self.n_streams}, layer_index={self.layer_index}, {kind}"

    # -- the weights ---------------------------------------------------------------------
    def _dynamic_terms(self, state: torch.Tensor, dtype: torch.dtype):
        """(pre [..., n], res [..., n(t), n(s)], post [..., n]) before scales and biases."""
        n = self.n_streams
        x = state.to(dtype)
        if self.dynamic_input == "stream":
            xn = _rms_norm(x, self.norm_weight.to(dtype), self.norm_eps)  # [..., s, d]
            pre = xn @ self.pre_proj.to(dtype)  # [..., s]
            res = (xn @ self.res_proj.to(dtype)).transpose(-1, -2)  # [..., s, t] -> [..., t, s]
            post = xn @ self.post_proj.to(dtype)
        else:
            xf = _rms_norm(x.flatten(-2), self.norm_weight.to(dtype), self.norm_eps)  # [..., n*d]
            pre = xf @ self.pre_proj.to(dtype)
            res = (xf @ self.res_proj.to(dtype).flatten(1)).unflatten(-1, (n, n))
            post = xf @ self.post_proj.to(dtype)
        return pre, res, post

    def weights(self, state: torch.Tensor, backend: str | None = None) -> StreamWeights:
        """The mixing matrices for a state [batch, pos, n, d]: [batch, pos, n], [.., n, n], [.., n].
        ``backend``: of mHC's Sinkhorn (:func:`sinkhorn`)."""
        self._check(state)
        dtype = torch.promote_types(state.dtype, torch.float32)
        lead = state.shape[:-2]
        pre_b, res_b, post_b = (p.to(dtype) for p in (self.pre_bias, self.res_bias, self.post_bias))
        if self.dynamic:
            pre_d, res_d, post_d = self._dynamic_terms(state, dtype)
            if self.mhc:
                pre = pre_d * self.pre_scale.to(dtype) + pre_b
                res = res_d * self.res_scale.to(dtype) + res_b
                post = post_d * self.post_scale.to(dtype) + post_b
            else:
                act = torch.tanh if self.tanh else (lambda t: t)
                pre = act(pre_d) * self.alpha_scale.to(dtype) + pre_b
                res = act(res_d) * self.alpha_scale.to(dtype) + res_b
                post = act(post_d) * self.beta_scale.to(dtype) + post_b
        else:
            pre, res, post = pre_b, res_b, post_b
        if self.mhc:
            pre = torch.sigmoid(pre)
            res = sinkhorn(res, self.sinkhorn_iters, backend)
            post = torch.sigmoid(post) * 2
        n = self.n_streams
        return StreamWeights(pre.expand(*lead, n), res.expand(*lead, n, n), post.expand(*lead, n))

    # -- read and write ------------------------------------------------------------------
    def read(self, state: torch.Tensor, weights: StreamWeights | None = None) -> tuple[torch.Tensor, StreamWeights]:
        """(h = H_pre X [batch, pos, d], the weights), computing the weights unless given."""
        if weights is None:
            weights = self.weights(state)
        w = weights.pre
        h = torch.einsum("...s,...sd->...d", w, state.to(w.dtype))
        return h.to(state.dtype), weights

    def write(self, state: torch.Tensor, output: torch.Tensor, weights: StreamWeights) -> torch.Tensor:
        """X' = H_res X + H_post^T y: [batch, pos, n, d] from the state and the output y [batch, pos, d]."""
        res, post = weights.res, weights.post
        mixed = torch.einsum("...ts,...sd->...td", res, state.to(res.dtype))
        new = mixed + post.unsqueeze(-1) * output.to(res.dtype).unsqueeze(-2)
        return new.to(state.dtype)

    def forward(self, state: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor]) -> HyperStep:
        """Read, run ``branch`` (the sublayer) on the read, write its output back."""
        h, w = self.read(state)
        y = branch(h)
        return HyperStep(self.write(state, y, w), h, y, w)

    def _check(self, state: torch.Tensor) -> None:
        if state.dim() < 2 or state.shape[-2:] != (self.n_streams, self.d_model):
            raise ValueError(
                f"state must be [..., n_streams={self.n_streams}, d_model={self.d_model}]; got {tuple(state.shape)}"
            )


# -- effective depth weights --------------------------------------------------------------
def hyper_read_coefficients(
    steps: Sequence[StreamWeights],
    final: torch.Tensor | None = None,
    initial: torch.Tensor | None = None,
    return_streams: bool = False,
):
    """Every read's coefficients over the sources, for one forward through L hyper-connections.

    The state after sublayer l is ``X = C S`` per token, with S the sources so far (row 0 the
    embedding, row j the output of sublayer j-1) and C [n, S] the coefficients, so::

        C_0 = initial (default: a column of ones, the embedding copied into every stream)
        read l:  a_l = H_pre^(l) C_l                     (coefficients of h_l)
        C_{l+1} = H_res^(l) C_l + H_post^(l)^T e_{l+1}   (e_{l+1}: the new source's one-hot)
        final:   a_L = final C_L                          (default ones: the sum of the streams)

    Args:
        steps: the L sublayers' :class:`StreamWeights`, in order (each broadcastable to a common
            leading shape, e.g. [batch, pos]).
        final: [..., n] weights of the final read over the streams (default ones).
        initial: [..., n] how the embedding enters the streams (default ones).
        return_streams: also return every state's coefficients [..., L+1, n, L+1].

    Returns:
        [..., L+1 reads, L+1 sources], 0 for sources a read cannot see (column j > read r), on
        the common source axis ``[embed, L0.attn, L0.mlp, ...]`` when the sublayers alternate
        attention and MLP; and the state coefficients if asked.
    """
    if not steps:
        raise ValueError("at least one sublayer's weights are needed")
    n = steps[0].pre.shape[-1]
    dtype = steps[0].pre.dtype
    for w in steps[1:]:
        dtype = torch.promote_types(dtype, w.pre.dtype)
    lead = torch.broadcast_shapes(*(t.shape[:-1] for w in steps for t in (w.pre, w.post)),
                                  *(w.res.shape[:-2] for w in steps))
    L = len(steps)
    S = L + 1
    device = steps[0].pre.device
    ones = torch.ones(n, dtype=dtype, device=device)
    init = ones if initial is None else initial.to(dtype)
    fin = ones if final is None else final.to(dtype)
    C = torch.zeros(*lead, n, S, dtype=dtype, device=device)
    C[..., :, 0] = init
    reads, states = [], [C]
    for l, w in enumerate(steps):
        reads.append(torch.einsum("...s,...sj->...j", w.pre.to(dtype), C))
        C = torch.einsum("...ts,...sj->...tj", w.res.to(dtype), C)
        C[..., :, l + 1] = C[..., :, l + 1] + w.post.to(dtype)
        states.append(C)
    reads.append(torch.einsum("...s,...sj->...j", fin.expand(*lead, n), C))
    out = torch.stack(reads, dim=-2)
    if return_streams:
        return out, torch.stack(states, dim=-3)
    return out


# -- the package's parameters --------------------------------------------------------------
def package_to_ours(
    state: Mapping[str, torch.Tensor], n_streams: int, mhc: bool, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Our parameters from the ``hyper-connections`` package's (``HyperConnections`` or
    ``ManifoldConstrainedHyperConnections`` with num_fracs = num_input_views = proposals = 1).

    ``state``: the package module's ``named_parameters()`` (or their gradients, with
    ``grads=True``: then the norm gain is not shifted by one). Keys it lacks (a static module
    has no projections) are left out; load with ``module.load_state_dict(..., strict=False)``
    after checking that only the missing dynamic keys differ, or use the result directly.
    """
    n = n_streams
    out: dict[str, torch.Tensor] = {}
    static = state["static_alpha"]
    if static.shape != (n, 1 + n):
        raise ValueError(f"static_alpha is {tuple(static.shape)}; only num_fracs = num_input_views = 1 are supported")
    out["pre_bias"] = static[:, 0]
    out["res_bias"] = static[:, 1:].transpose(0, 1)  # [s, t] -> [t, s]
    out["post_bias"] = state["static_beta"]
    if "norm.gamma" in state:
        out["norm_weight"] = state["norm.gamma"] if grads else state["norm.gamma"] + 1
    if "dynamic_alpha_fn" in state:
        fn = state["dynamic_alpha_fn"]
        if mhc:
            if fn.shape[0] != 1:
                raise ValueError("num_dynamic_alpha_proposals > 1 is not supported")
            fn = fn[0]
        out["pre_proj"] = fn[:, 0]
        out["res_proj"] = fn[:, 1:]  # [d, t]: Xn_s . fn[:, 1 + t] -> H_res[t, s]
    if "dynamic_beta_fn" in state:
        out["post_proj"] = state["dynamic_beta_fn"]
    names = (
        {"pre_branch_scale": "pre_scale", "residual_scale": "res_scale", "h_post_scale": "post_scale"}
        if mhc
        else {"dynamic_alpha_scale": "alpha_scale", "dynamic_beta_scale": "beta_scale"}
    )
    for theirs, ours in names.items():
        if theirs in state:
            out[ours] = state[theirs].reshape(())
    return out
