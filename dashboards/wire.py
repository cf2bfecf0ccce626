"""The request body Dash's browser code POSTs to ``/_dash-update-component``, built in Python.

Used by the tests, the benchmarks and the load test to call a callback over HTTP exactly as a
browser would, without a browser:

    body = update_payload(app, "token-info.children", {"token.data": {"key": k, "token": 3},
                                                        "kind.value": "weights", "expanded.value": []})
    client.post("/_dash-update-component", json=body)

Only callbacks with plain (non pattern-matching) inputs and outputs are supported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["find_callback", "update_payload"]


def find_callback(app, output: str) -> dict:
    """The dependency entry whose outputs include ``output`` ("id.prop").

    ``app`` is a Dash app, or the list ``GET /_dash-dependencies`` returns (for a remote server).
    """
    deps = app._callback_list if hasattr(app, "_callback_list") else app
    for cb in deps:
        outs = [o for o in cb["output"].strip(".").split("...") if o]
        if output in outs or cb["output"] == output:
            return cb
    raise KeyError(f"no callback of this app outputs {output!r}")


def _split(item: str) -> dict[str, str]:
    cid, _, prop = item.rpartition(".")
    return {"id": cid, "property": prop}


def update_payload(app, output: str, values: dict[str, Any], changed: list[str] | None = None) -> dict:
    """JSON body for ``POST /_dash-update-component`` running the callback that outputs ``output``.

    Args:
        app: the Dash app, or its ``/_dash-dependencies`` list.
        output: one of the callback's outputs, "component-id.property".
        values: "id.prop" -> value for every input and state of that callback (missing ones are None).
        changed: the inputs that triggered it (default: the first input).

    Returns:
        {"output", "outputs", "inputs", "state", "changedPropIds"} as dash-renderer sends it.
    """
    cb = find_callback(app, output)
    multi = cb["output"].startswith("..")
    outs = [_split(o) for o in cb["output"].strip(".").split("...") if o] if multi else _split(cb["output"])

    def items(kind: str) -> list[dict]:
        return [{"id": d["id"], "property": d["property"], "value": values.get(f"{d['id']}.{d['property']}")} for d in cb[kind]]

    inputs = items("inputs")
    return {
        "output": cb["output"],
        "outputs": outs,
        "inputs": inputs,
        "state": items("state"),
        "changedPropIds": changed if changed is not None else [f"{inputs[0]['id']}.{inputs[0]['property']}"],
    }
