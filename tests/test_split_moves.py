"""The local search's moves price the batch split (search.split_pricing): the vectorized split step
(cost.batch_split.split_step_batch) equals the scalar one row by row, a move's vectorized price
equals the scalar price of the plan after the move at the same k, and on a problem where a move
helps only the split step the split-aware local search reaches a lower split price than moves
priced unsplit do."""

import sys
import warnings
from pathlib import Path
from unittest import mock

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_sparselift.cost.batch_split import (
    MAX_CHUNKS, SplitTerms, SplitTermsBatch, split_step_batch, split_step_s,
)
from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import CostContext, DenseWork
from torchrec_sparselift.search import place
from torchrec_sparselift.search.place import best_placement, local_search
from torchrec_sparselift.search.problem import build_problem
from torchrec_sparselift.search.solve import new_evaluator, priced_split
from torchrec_sparselift.search.split_pricing import (
    SplitMovePrice, move_pricing, split_price_at, split_price_rows, split_terms,
)

sys.path.insert(0, str(Path(__file__).parent))
from search_helpers import _placements, split_terms_st, table_spec  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)



@settings(max_examples=400, deadline=None)
@given(st.lists(split_terms_st(), min_size=1, max_size=6), st.integers(1, MAX_CHUNKS), st.booleans())
def test_the_vectorized_split_step_is_the_scalar_one_row_by_row(rows, k, chained):
    got = split_step_batch(SplitTermsBatch.from_terms(rows), k, chained)
    assert got.shape == (len(rows),)
    for i, t in enumerate(rows):
        assert got[i] == pytest.approx(split_step_s(t, k, chained), rel=1e-12, abs=1e-15)


@settings(max_examples=200, deadline=None)
@given(st.lists(split_terms_st(), min_size=1, max_size=4), st.integers(1, MAX_CHUNKS),
       st.floats(0.0, 0.5, allow_nan=False))
def test_the_vectorized_split_price_is_the_scalar_one_row_by_row(rows, k, extra):
    """The price at a fixed k (the unsplit step less what k chunks win, between the floor and the
    unsplit step) on arrays equals search.split_pricing.split_price_at per row."""
    steps = np.array([split_step_s(t, 1) + extra for t in rows])
    got = split_price_rows(steps, SplitTermsBatch.from_terms(rows), k)
    for i, t in enumerate(rows):
        assert got[i] == pytest.approx(split_price_at(float(steps[i]), t, k), rel=1e-12, abs=1e-15)


def test_split_terms_batch_refuses_bad_rows():
    with pytest.raises(ValueError, match="one value per row"):
        SplitTermsBatch(**{**_zero_fields(), "lookup_s": [1.0, 2.0], "input_dist_s": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match="output_dist_s must be a 1-D array of finite times >= 0"):
        SplitTermsBatch(**{**_zero_fields(), "output_dist_s": [-1.0]})
    with pytest.raises(ValueError, match="chunk_latency_s exceeds output_dist_s in row"):
        SplitTermsBatch(**{**_zero_fields(), "output_dist_s": [1.0, 0.5], "grad_dist_s": [2.0, 2.0],
                           "chunk_latency_s": [0.1, 0.9]})
    with pytest.raises(ValueError, match="k must be an int in 1..16"):
        split_step_batch(SplitTermsBatch(**_zero_fields()), 17)


def _zero_fields():
    return {a.name: [0.0] for a in attrs.fields(SplitTermsBatch)}


# -- problems -------------------------------------------------------------------------------------

def _ctx(W=2, L=2, bw_div=1.0, param_bytes=1e8, flops=1e8):
    prof = attrs.evolve(PRESETS["h100"], lookup_overhead_s=0.0)
    prof = attrs.evolve(prof, intra_host_bw=prof.intra_host_bw / bw_div, inter_host_bw=prof.inter_host_bw / bw_div)
    return CostContext(profile=prof, world_size=W, local_world_size=L, batch_size=512,
                       dense=DenseWork(param_bytes=param_bytes, fwd_flops_per_sample=flops))


def _problem(ctx, specs, split=2e-6):
    cap = np.full(ctx.world_size, 1e12)
    return build_problem(specs, ctx, cap, cap.copy(), pipelines=("sparse_dist", "overlap"), split_overhead_s=split)


def _random_problem(seed, W=4, L=2, split=2e-6):
    rng = np.random.default_rng(seed)
    specs = [table_spec(i, int(rng.integers(300, 10**5)), int(rng.choice([64, 128, 256])), float(rng.uniform(1, 20)))
             for i in range(int(rng.integers(3, 6)))]
    return _problem(_ctx(W, L, bw_div=float(rng.choice([1.0, 10.0])), param_bytes=float(rng.choice([1e7, 1e8])),
                         flops=float(rng.choice([3e7, 1e8, 3e8]))), specs, split)


def _random_plan(ev, prob, rng):
    for t in range(prob.num_tables):
        c = int(rng.choice(prob.candidates[t]))
        opts = _placements(prob, c)
        ev.assign(t, c, opts[int(rng.integers(len(opts)))])


@pytest.mark.parametrize("seed", [0, 3, 4, 9, 10])
def test_a_move_s_vectorized_price_is_the_scalar_price_of_the_plan_after_it(seed):
    """With the moves priced at the split (the incumbent's k), PlanEvaluator.move_objective and
    best_placement's objective equal the scalar split price at that k of the plan once the move
    is applied (search.split_pricing.split_price_at on its split terms)."""
    prob = _random_problem(seed)
    rng = np.random.default_rng(seed)
    ev = new_evaluator(prob, "overlap")
    split_moves = 0
    for _ in range(3):
        _random_plan(ev, prob, rng)
        price = move_pricing(ev, prob)
        assert isinstance(price, SplitMovePrice)
        ev.row_price = price
        k = price.k
        for t in range(prob.num_tables):
            here = ev.assignment[t]
            for c in prob.candidates[t]:
                for rk in _placements(prob, c)[:4]:
                    moved = ev.move_objective(t, c, rk)
                    ev.assign(t, c, rk)
                    scalar = split_price_at(ev.step_time().total_s, split_terms(ev, prob.split_overhead_s), k)
                    assert moved == pytest.approx(scalar, rel=1e-9, abs=1e-15)
                    split_moves += scalar < ev.step_time().total_s * (1 - 1e-9)
                ev.unassign(t)
                got = best_placement(ev, prob, t, c)
                if got is not None:
                    ev.assign(t, c, got[0])
                    scalar = split_price_at(ev.step_time().total_s, split_terms(ev, prob.split_overhead_s), k)
                    assert got[1] == pytest.approx(scalar, rel=1e-9, abs=1e-15)
                ev.assign(t, *here)
        ev.row_price = None
    if seed != 0:  # (drawn where some plans split, k > 1: their moves' split price is below the step)
        assert split_moves > 0


def test_moves_price_the_pipeline_s_step_where_the_split_does_not_apply():
    """No split allowed, or a pipeline other than overlap: no row price, so the moves' objective
    is the pipeline's step (cost.model.step_total_batch), as without the split; the local search
    leaves the evaluator's row price as it found it."""
    prob = _random_problem(0)
    ev = new_evaluator(prob, "sparse_dist")
    _random_plan(ev, prob, np.random.default_rng(0))
    assert move_pricing(ev, prob) is None
    no_split = _random_problem(0, split=None)
    ev2 = new_evaluator(no_split, "overlap")
    _random_plan(ev2, no_split, np.random.default_rng(0))
    assert move_pricing(ev2, no_split) is None
    ev3 = new_evaluator(prob, "overlap")
    _random_plan(ev3, prob, np.random.default_rng(0))
    local_search(ev3, prob, deadline=1e18)
    assert ev3.row_price is None


# -- a move that helps only the split step -------------------------------------------------------

def _mixed_problem():
    """Six 1000 x 256 tables, table-wise or data-parallel, on 2 ranks with a dense part whose
    all-reduce (100 MB) exceeds its backward: a data-parallel table adds exposed all-reduce, a
    table-wise one output and gradient traffic. Unsplit, the traffic is exposed and a third
    table-wise table costs more than it saves; split into chunks, the dense work of the other
    chunks hides it, so every table-wise table lowers the step."""
    specs = [table_spec(i, 1000, 256, 5.0, ("table_wise", "data_parallel")) for i in range(6)]
    return _problem(_ctx(), specs)


def _two_table_wise(ev, prob):
    for t in range(prob.num_tables):
        st = "table_wise" if t < 2 else "data_parallel"
        c = next(c for c in prob.candidates[t] if prob.cands[c].sharding_type == st)
        ev.assign(t, c, (t % prob.ctx.world_size,) if st == "table_wise" else tuple(range(prob.cands[c].num_shards)))


def test_the_split_aware_local_search_takes_a_move_only_the_split_step_rewards():
    prob = _mixed_problem()
    start = new_evaluator(prob, "overlap")
    _two_table_wise(start, prob)
    k0, price0 = priced_split(start, prob)
    assert k0 > 1  # the incumbent's split: what the moves price at

    unsplit = new_evaluator(prob, "overlap")
    _two_table_wise(unsplit, prob)
    with _unsplit_moves():
        local_search(unsplit, prob, deadline=1e18)
    split = new_evaluator(prob, "overlap")
    _two_table_wise(split, prob)
    moves, cut = local_search(split, prob, deadline=1e18)
    assert not cut and moves > 0

    _, price_unsplit = priced_split(unsplit, prob)
    k, price_split = priced_split(split, prob)
    assert price_unsplit == pytest.approx(price0, rel=1e-12)  # unsplit, no move helps
    assert price_split < price_unsplit * (1 - 0.01), (price_split, price_unsplit)
    types = {prob.cands[c].sharding_type for c, _ in split.assignment.values()}
    assert types == {"table_wise"} and k > 1
    # the first step on the way: a third table-wise table raises the unsplit step, lowers the split's
    tw = next(c for c in prob.candidates[2] if prob.cands[c].sharding_type == "table_wise")
    step0 = start.objective()
    assert start.move_objective(2, tw, (0,)) > step0
    start.row_price = move_pricing(start, prob)
    assert start.row_price.k == k0 and start.objective() == pytest.approx(price0, rel=1e-12)
    assert start.move_objective(2, tw, (0,)) < price0


def _unsplit_moves():
    return mock.patch.object(place, "move_pricing", lambda ev, prob: None)  # every move priced at k = 1


@pytest.mark.parametrize("seed", range(8))
def test_the_split_aware_local_search_never_ends_above_the_unsplit_priced_one(seed):
    """The moves priced at the split run after the moves priced at the pipeline's step have
    converged, so the pass ends at or below the split price the unsplit-priced pass ends at (and
    at or below the one it started at)."""
    prob = _random_problem(seed)
    plans = []
    for split in (True, False):
        ev = new_evaluator(prob, "overlap")
        _random_plan(ev, prob, np.random.default_rng(seed))
        before = priced_split(ev, prob)[1]
        if split:
            local_search(ev, prob, deadline=1e18)
        else:
            with _unsplit_moves():
                local_search(ev, prob, deadline=1e18)
        plans.append(priced_split(ev, prob)[1])
        assert plans[-1] <= before * (1 + 1e-12)
    assert plans[0] <= plans[1] * (1 + 1e-12)
