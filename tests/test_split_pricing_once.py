"""SplitMovePrice builds one phase table per priced batch and prices as the two-table formula."""

import sys
from pathlib import Path

import numpy as np
import pytest

from torchrec_sparselift.cost.batch_split import BATCH_SPLIT_PIPELINE, SplitTermsBatch
from torchrec_sparselift.cost import batch_split, model
from torchrec_sparselift.cost.model import step_total_batch
from torchrec_sparselift.search import split_pricing
from torchrec_sparselift.search.split_pricing import SplitMovePrice, split_price_rows

sys.path.insert(0, str(Path(__file__).parent))
from test_split_moves import _ctx  # noqa: E402


def _two_table_price(price, rows, ar, groups):
    """The price with the unsplit step and the split terms each on its own phase table."""
    step = step_total_batch(rows, ar, groups, price.ctx, BATCH_SPLIT_PIPELINE, price.fwd_precision,
                            price.bwd_precision)
    if price.k == 1:
        return step
    terms = SplitTermsBatch.from_cost_model(np.maximum(rows, 0.0), max(0.0, ar), groups, price.ctx,
                                            chunk_overhead_s=price.chunk_overhead_s,
                                            fwd_precision=price.fwd_precision, bwd_precision=price.bwd_precision)
    return split_price_rows(step, terms, price.k)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("residue", [False, True])
def test_one_phase_table_per_batch_and_the_two_table_price(monkeypatch, k, residue):
    ctx = _ctx(W=4, L=2)
    rng = np.random.default_rng(k)
    rows = rng.uniform(0.0, 1e7, size=(6, 4 * 8))
    if residue:
        rows[2, 3] = -1e-20
    price = SplitMovePrice(ctx, k, 2e-6, "fp32", "fp32")
    want = _two_table_price(price, rows, 3e8, 2)
    calls = []
    real = model.phase_table
    for mod in (model, batch_split, split_pricing):  # every name the builder is reached under
        monkeypatch.setattr(mod, "phase_table", lambda *a, **kw: calls.append(1) or real(*a, **kw), raising=False)
    got = price(rows, 3e8, 2)
    assert np.array_equal(got, want)
    assert len(calls) == (2 if residue and k > 1 else 1)
