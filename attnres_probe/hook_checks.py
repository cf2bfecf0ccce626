"""Non-finite outputs under hooks: which hook point went first.

A hook that edits routing or activations can turn a forward's logits or loss into NaN or inf
without a word (a row of weights divided by a zero sum, say). :func:`warn_if_non_finite` is what
:meth:`AttnResTransformer.forward <attnres_probe.AttnResTransformer.forward>` calls when hooks
are attached: if the output is not finite it runs the forward once more, under ``no_grad``, with
a finiteness check appended at every hook point (after the user's hooks, so it sees what they
returned), and warns once, naming the first hook point, in forward order, whose value was not
finite and whether hooks were attached there. The user's hooks run again in that second
forward; a forward whose output is finite costs one ``isfinite`` reduction and nothing more.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformer_lens.hook_points import HookPoint

__all__ = ["CheckedHookPoint", "HookReturnError", "NonFiniteWarning", "first_non_finite_hook", "hooks_attached",
           "warn_if_non_finite"]


class HookReturnError(ValueError):
    """A hook returned a value its hook point cannot use (the message names the point and the shapes)."""


class CheckedHookPoint(HookPoint):
    """TransformerLens's ``HookPoint`` whose hooks' return values are checked where they are returned: a
    hook may return None (it only looked) or a tensor of exactly the shape, dtype and device it received;
    anything else is refused in one line naming the hook point, what it received and what it returned,
    instead of a broadcast, an ignored value or an error deep inside torch."""

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(x, *args, **kwargs)
        if out is x or not isinstance(x, torch.Tensor):
            return out
        if not isinstance(out, torch.Tensor):
            raise HookReturnError(f"a hook at {self.name} returned {type(out).__name__}; it must return None or a tensor "
                                  f"like the one it received: {list(x.shape)} {x.dtype} on {x.device}")
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise HookReturnError(f"a hook at {self.name} returned {list(out.shape)} {out.dtype} on {out.device}; it received "
                                  f"{list(x.shape)} {x.dtype} on {x.device} and must return the same shape, dtype and device "
                                  "(or None)")
        return out


# hook points whose values hold -inf by convention (TransformerLens's masked scores): only NaN and +inf count there
SCORE_HOOKS = ("hook_logits", "hook_attn_scores")


class NonFiniteWarning(RuntimeWarning):
    """A forward with hooks attached gave non-finite logits or loss."""


def hooks_attached(model: Any) -> list[str]:
    """Names of the hook points of ``model`` that have forward hooks now."""
    return [name for name, hp in model.hook_dict.items() if hp._forward_hooks]


def first_non_finite_hook(model: Any, tokens: torch.Tensor, detail: dict | None = None) -> str | None:
    """The first hook point, in forward order, whose value (after its hooks) is not finite in
    a forward of ``tokens`` under the hooks attached now; None if every one is finite. ``detail``,
    if given, receives the share of non-finite entries there (``"share"``)."""
    found: list[str] = []
    handles = []

    def check(name: str):
        scores = name.endswith(SCORE_HOOKS)  # -inf marks what a read or a query cannot see: not an error

        def hook(module: Any, args: Any, output: Any) -> None:
            if not found and isinstance(output, torch.Tensor) and output.is_floating_point():
                bad = (torch.isnan(output) | torch.isposinf(output)) if scores else ~torch.isfinite(output)
                if bool(bad.any()):
                    found.append(name)
                    if detail is not None:
                        detail["share"] = float(bad.float().mean())

        return hook

    try:
        for name, hp in model.hook_dict.items():
            handles.append(hp.register_forward_hook(check(name)))
        with torch.no_grad():
            model._checking_finite = True
            try:
                model(tokens, return_type=None)
            finally:
                model._checking_finite = False
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def warn_if_non_finite(model: Any, tokens: torch.Tensor, outputs: dict[str, torch.Tensor]) -> None:
    """Warn once (:class:`NonFiniteWarning`) if any of ``outputs`` ({what: tensor}) is not
    finite, naming the hook point that first produced a non-finite value. Call only while hooks
    are attached (:func:`hooks_attached`)."""
    bad = [what for what, t in outputs.items() if t is not None and not bool(torch.isfinite(t.detach()).all())]
    if not bad or getattr(model, "_checking_finite", False):
        return
    hooked = set(hooks_attached(model))
    detail: dict = {}
    first = first_non_finite_hook(model, tokens, detail)
    if first is None:
        where = ("no hook point held a non-finite value when the forward was run again (the hooks may not "
                 "be deterministic); the non-finite values arose after the last hook point")
    else:
        where = (f"the first hook point with a non-finite value is {first!r} "
                 + ("(hooks are attached there)" if first in hooked else "(no hook is attached there: look at the hooks before it)")
                 + f", {detail.get('share', 0.0):.0%} of its entries")
        where += _cause(model, first, first in hooked)
    warnings.warn(
        f"the forward's {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not finite with hooks attached at "
        f"{len(hooked)} hook point(s); {where}",
        NonFiniteWarning,
        stacklevel=_user_stacklevel(),
    )


def _cause(model: Any, name: str, hooked: bool) -> str:
    """A likely cause, for the depth-routing hooks: what the read sees and what a renormalisation does there."""
    if not (hooked and name.endswith(("hook_weights", "hook_logits"))):
        return ""
    mixer = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None
    k = getattr(mixer, "visible", None)
    sees = (f"This read sees {k} source{'s' if k != 1 else ''} (columns 0..{k - 1}; the others are 0 in hook_weights, "
            "-inf in hook_logits). " if k else "")
    if name.endswith("hook_weights"):
        return (f". {sees}The hook returned non-finite weights: a row whose weights it set to sum to 0 gives 0/0 when "
                "divided by its sum (weights are used as given, so a hook need not renormalise)")
    return f". {sees}The hook returned NaN or +inf logits (-inf is allowed: that source gets weight 0)"


def _user_stacklevel() -> int:
    """The stack level of the first frame outside this package, torch and transformer_lens (the user's line)."""
    import os
    import sys

    skip = tuple(os.path.dirname(m.__file__) for m in (sys.modules["torch"], sys.modules["transformer_lens"])
                 if getattr(m, "__file__", None))
    skip += (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)  # the repository: attnres_probe and its folders
    level, frame = 1, sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(skip) or os.sep + "tests" + os.sep in path:
            return level
        frame, level = frame.f_back, level + 1
    return 2
