"""trace.weights() and trace.to_frame() give the numbers the pages show, for every rule (issue #50)."""

from __future__ import annotations

import numpy as np
import pytest

from attnres_probe import Probe
from attnres_probe.demo import load_demo
from attnres_probe.demo_recipe import DEMO_NAMES
from attnres_probe.figures import cell_values

TEXT = "ROMEO: But soft, what light"


@pytest.fixture(scope="module", params=DEMO_NAMES)
def trace(request):
    model, tok = load_demo(request.param)
    return Probe(model, tokenizer=tok, name=request.param).run(TEXT)


def test_weights_are_the_pages_normalised_weights(trace):
    page = cell_values(trace, expanded=False)[0]["weights"]  # what every heatmap draws
    for token in (0, 5, len(TEXT) - 1):
        ours = trace.weights(token=token).to_numpy()
        np.testing.assert_allclose(ours, page[0, token], rtol=1e-6, atol=1e-7, equal_nan=True)
        rows = np.nansum(ours, axis=1)
        assert np.allclose(rows[np.isfinite(ours).any(1)], 1.0, atol=1e-5)  # every read sums to one, every rule
    mean = trace.weights().to_numpy()
    np.testing.assert_allclose(mean, np.nanmean(np.where(trace.mask[..., None, None], page, np.nan), axis=(0, 1)),
                               rtol=1e-5, atol=1e-6, equal_nan=True)


def test_raw_coefficients_stay_available(trace):
    raw = trace.coefficients(token=4).to_numpy()
    np.testing.assert_array_equal(raw, trace.depth_weights[0, 4])
    np.testing.assert_array_equal(trace.weights(token=4, normalised=False).to_numpy(), raw)
    if trace.residual == "prenorm":
        assert np.nanmax(raw) == 1.0 and np.nanmin(raw) == 1.0  # PreNorm's coefficients are all one
        np.testing.assert_allclose(trace.weights(token=4).to_numpy()[3, :4], 0.25)  # and its weights 1/k


def test_to_frame_has_both_columns(trace):
    df = trace.to_frame()
    assert {"weight", "coefficient"} <= set(df.columns)
    row = df[(df.pos == 2) & (df.read_index == 2)].sort_values("source_index")
    k = len(row)
    np.testing.assert_allclose(row["weight"].to_numpy(), trace.weights(token=2).to_numpy()[2, :k], rtol=1e-6)
    np.testing.assert_allclose(row["coefficient"].to_numpy(), trace.depth_weights[0, 2, 2, :k])
