"""Small builders shared by the tests."""

from __future__ import annotations

import os
import shutil

import torch

from attnres_probe import AttnResTransformer, ModelConfig


def tiny_config(residual: str = "full", **kw) -> ModelConfig:
    base = dict(d_model=32, n_layers=2, n_heads=2, n_ctx=24, residual=residual, seed=1)
    if residual == "block" and "block_boundaries" not in kw:
        kw.setdefault("block_size", 2)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(residual: str = "full", randomize_queries: bool = True, **kw) -> AttnResTransformer:
    """A small model; AttnRes queries and gains randomised so routing is not uniform."""
    model = AttnResTransformer(tiny_config(residual, **kw))
    if randomize_queries:
        randomize_routing(model)
    return model.eval()


def randomize_routing(model: AttnResTransformer, seed: int = 123) -> AttnResTransformer:
    """Routing that is not uniform, as in a trained model: AttnRes queries and key gains;
    Hyper-Connections' and DenseFormer's parameters shifted from their (PreNorm-like) init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.mixers:
            if hasattr(m, "query"):
                m.query.copy_(torch.randn(m.query.shape, generator=g) * 0.5)
                m.norm.weight.copy_(1 + 0.3 * torch.randn(m.query.shape, generator=g))
        for name, p in model.named_parameters():
            if ".hc." in name or name.startswith("dwa."):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def sample_tokens(n: int = 12, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, n), generator=g)


def sources_of_reads(model: AttnResTransformer, cache) -> list[list[torch.Tensor]]:
    """For every read, the list of source tensors it sees, rebuilt from the cache's sublayer outputs."""
    outs = {"embed": cache["hook_embed"] + cache["hook_pos_embed"]}
    for i in range(model.cfg.n_layers):
        outs[f"L{i}.attn"] = cache[f"blocks.{i}.hook_attn_out"]
        outs[f"L{i}.mlp"] = cache[f"blocks.{i}.hook_mlp_out"]
    return [
        [sum(outs[m] for m in members) for members in model.source_members(r)] for r in range(model.cfg.n_reads)
    ]


def mixed_input_names(model: AttnResTransformer) -> list[str]:
    names = []
    for i in range(model.cfg.n_layers):
        names += [f"blocks.{i}.hook_resid_pre", f"blocks.{i}.hook_resid_mid"]
    return [*names, "hook_resid_final"]


def weight_hook_names(model: AttnResTransformer) -> list[str]:
    names = []
    for i in range(model.cfg.n_layers):
        names += [f"blocks.{i}.attn_res.hook_weights", f"blocks.{i}.mlp_res.hook_weights"]
    return [*names, "out_res.hook_weights"]


# Chromium flags every browser test uses: no sandbox (tests run as root), nothing on the
# network (this machine's network is closed), no first-run work.
CHROME_FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)

CHROMIUM = os.environ.get("ATTNRES_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("ATTNRES_CHROMEDRIVER", "/usr/bin/chromedriver")
# the bounding boxes of an element set (a CSS selector), as plain objects, for execute_script
BOXES = """
return Array.from(document.querySelectorAll(arguments[0]), (e) => {
  const r = e.getBoundingClientRect();
  return {x0: r.left, x1: r.right, y0: r.top, y1: r.bottom, text: e.textContent};
}).filter((b) => b.x1 > b.x0);
"""


def headless_chromium(window: str | None = "1400,1000", browser_log: bool = False):
    """A headless Chromium WebDriver with :data:`CHROME_FLAGS`; skips the test where Chromium or
    ChromeDriver is missing. The caller quits it."""
    import pytest

    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip("needs Chromium and ChromeDriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", *([f"--window-size={window}"] if window else []), *CHROME_FLAGS):
        opts.add_argument(flag)
    if browser_log:
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


# -- routing edits through hook_weights (matched-quantity tests) -------------------------------
def route(model, fn):
    """Attach ``fn(w, k) -> new weights`` at every read's hook_weights (the read sees its first k
    columns, ``mixer.visible``; the others are 0, TransformerLens's masking)."""
    for mixer in model.mixers:
        mixer.hook_weights.add_hook(lambda w, hook, k=mixer.visible: fn(w, k))
    return model


def visible_columns(w: torch.Tensor, k: int) -> torch.Tensor:
    """[n_src] bool: the first k columns of a read's row."""
    return torch.arange(w.shape[-1], device=w.device) < k


def uniform_routing(w: torch.Tensor, k: int) -> torch.Tensor:
    """Equal weights over the k sources a read sees."""
    return torch.where(visible_columns(w, k), 1.0 / k, 0.0).to(w.dtype).expand_as(w)


def local_routing(w: torch.Tensor, k: int) -> torch.Tensor:
    """0.9 on the most recent source a read sees, the rest spread evenly."""
    cols = torch.arange(w.shape[-1], device=w.device)
    row = torch.where(cols == k - 1, 0.9, 0.1 / max(k - 1, 1))
    return torch.where(cols < k, row, 0.0).to(w.dtype).expand_as(w)


def find_components(node, pred) -> list:
    """Every Dash component under ``node`` for which ``pred`` holds, in document order."""
    out = []

    def walk(n):
        if isinstance(n, (list, tuple)):
            for x in n:
                walk(x)
            return
        if pred(n):
            out.append(n)
        if hasattr(n, "children"):
            walk(n.children)

    walk(node)
    return out


# -- one headless Chromium for the file:// page tests (the `chromium` fixture, tests/conftest.py) --
DEFAULT_WINDOW = "780,580"  # the window Chromium opens headless without --window-size


class SharedChromium:
    """A :func:`headless_chromium` (browser log: ALL) that the page tests of a session share:
    starting and quitting Chromium for each test takes seconds. :meth:`open` hands it to a test on
    a blank page, at that test's window size, with the log of earlier pages read and dropped; a
    driver that stopped answering is replaced."""

    def __init__(self):
        self.driver = None

    def open(self, window: str | None = "1400,1000"):
        from selenium.common.exceptions import WebDriverException

        if self.driver is not None:
            try:
                self.driver.get("about:blank")
            except WebDriverException:
                self.quit()
        if self.driver is None:
            self.driver = headless_chromium(window="1400,1000", browser_log=True)
            self.driver.get("about:blank")
        width, height = (int(v) for v in (window or DEFAULT_WINDOW).split(","))
        self.driver.set_window_size(width, height)
        self.driver.get_log("browser")
        return self.driver

    def leave(self) -> None:
        """After a test: off its page (its scripts stop)."""
        from selenium.common.exceptions import WebDriverException

        if self.driver is not None:
            try:
                self.driver.get("about:blank")
            except WebDriverException:
                self.quit()

    def quit(self) -> None:
        if self.driver is not None:
            try:
                self.driver.quit()
            except Exception:  # noqa: BLE001  (a driver that is gone already)
                pass
            self.driver = None


def model_bound_g(model) -> float:
    """G = (L+1)(sqrt(d) + S) of docs/design.md's model bound C u G, with S the most sources a read sees (L+1)."""
    import math

    cfg = model.cfg
    return cfg.n_reads * (math.sqrt(cfg.d_model) + cfg.n_reads)


def read_hook_names(model) -> list[str]:
    """The mixed-input hook of every read, in forward order (attention, MLP per block, then the final read)."""
    n = model.cfg.n_layers
    return [f"blocks.{i}.hook_resid_{w}" for i in range(n) for w in ("pre", "mid")] + ["hook_resid_final"]
