"""Hook-point names of TransformerLens-style models from elsewhere (docs/design.md, "Hook points").

Our own models' hook names are read from their module tree (``HookPoint.name``, set by
``setup()``); these functions name the hook points a foreign PreNorm model must expose.
"""

from __future__ import annotations

__all__ = [
    "EMBED_HOOKS",
    "REQUIRED_TL_HOOKS",
    "mixed_input_hook_names",
    "output_hook_names",
]

EMBED_HOOKS = ("hook_embed", "hook_pos_embed")
FINAL_READ_HOOK = "hook_resid_final"


def mixed_input_hook_names(n_layers: int, final: str | None = FINAL_READ_HOOK) -> list[str]:
    """The mixed input of every read: resid_pre / resid_mid per block, then the final read."""
    names = [f"blocks.{i}.hook_resid_{kind}" for i in range(n_layers) for kind in ("pre", "mid")]
    return [*names, final] if final else names


def output_hook_names(n_layers: int) -> list[str]:
    """Every sublayer output (source v_{l+1}): attn_out, mlp_out per block."""
    return [f"blocks.{i}.hook_{kind}_out" for i in range(n_layers) for kind in ("attn", "mlp")]


def REQUIRED_TL_HOOKS(n_layers: int) -> list[str]:  # noqa: N802 - reads like a constant table
    """Hooks a foreign TransformerLens-style PreNorm model must expose for the recorder."""
    per_block = [
        f"blocks.{i}.hook_{k}" for i in range(n_layers) for k in ("resid_pre", "attn_out", "resid_mid", "mlp_out")
    ]
    return [*EMBED_HOOKS, *per_block]
