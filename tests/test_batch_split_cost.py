"""The batch-split step terms (cost/batch_split.py): k = 1 is the unsplit (overlap) step, every k's
step lies between max(compute, communication) and the unsplit step plus k per-chunk costs, and k is
chosen by price."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sys
from pathlib import Path

from torchrec_sparselift.cost import pipelines
from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.batch_split import (
    MAX_CHUNKS,
    SplitTerms,
    SplitTermsBatch,
    chunk_dense_s,
    chunk_link_latency_s,
    choose_chunks,
    split_schedule,
    split_step_batch,
    split_step_s,
    unsplit_step_s,
)

sys.path.insert(0, str(Path(__file__).parent))
from search_helpers import split_terms_st as terms  # noqa: E402

_EPS = 1e-12


@settings(max_examples=300, deadline=None)
@given(terms())
def test_one_chunk_is_the_unsplit_step(t):
    assert split_step_s(t, 1) == pytest.approx(unsplit_step_s(t), rel=1e-12, abs=_EPS)
    assert split_step_s(t, 1, chained=True) == pytest.approx(unsplit_step_s(t), rel=1e-12, abs=_EPS)


def _phases_of(t):
    return {"input_dist": t.input_dist_s, "uvm_fetch": t.uvm_fetch_s, "lookup": t.lookup_s,
            "output_dist": t.output_dist_s, "dense_fwd": t.dense_fwd_indep_s + t.dense_fwd_rest_s,
            "dense_bwd": t.dense_bwd_rest_s + t.dense_bwd_indep_s, "grad_dist": t.grad_dist_s,
            "backward_update": t.backward_update_s, "allreduce": t.allreduce_s,
            "dense_fwd_indep": t.dense_fwd_indep_s, "dense_fwd_rest": t.dense_fwd_rest_s,
            "dense_bwd_rest": t.dense_bwd_rest_s, "dense_bwd_indep": t.dense_bwd_indep_s,
            "step_overhead": t.step_overhead_s}


@settings(max_examples=300, deadline=None)
@given(terms())
def test_without_overlap_the_unsplit_step_is_the_overlap_kind_across_hosts_all_reduce_after_the_update(t):
    """CPU gloo across hosts: the split's k = 1 is the composition the step equation prices for
    ``overlap`` there, which pays the all-reduce after the embedding backward (not beside it)."""
    phases = _phases_of(t)
    cpu = SplitTerms.from_phases(phases, chunk_latency_s=t.chunk_latency_s, chunk_overhead_s=t.chunk_overhead_s,
                                 chunk_feature_s=t.chunk_feature_s, features=t.features, supports_overlap=False)
    assert cpu.allreduce_after_update and cpu.allreduce_s == pytest.approx(t.allreduce_s)  # nothing hides it
    kind = pipelines.effective_pipeline("overlap", supports_overlap=False, spans_hosts=True)
    composed = pipelines.evaluate(kind.step, pipelines.terms(phases, supports_overlap=False))
    # (that composition runs the next batch's input_dist in the step's flow, ahead of the rest)
    rest = unsplit_step_s(attrs.evolve(cpu, input_dist_s=0.0))
    assert t.input_dist_s + rest == pytest.approx(float(composed), rel=1e-9, abs=_EPS)
    assert split_step_s(cpu, 1) == pytest.approx(unsplit_step_s(cpu), rel=1e-12, abs=_EPS)
    # after the update costs the smaller of the two more than beside it, at every k
    beside = attrs.evolve(cpu, allreduce_after_update=False)
    for k in (1, 2, 5):
        assert split_step_s(cpu, k) >= split_step_s(beside, k) - _EPS
    tail = min(t.backward_update_s, t.allreduce_s)
    if split_step_s(beside, 1) > t.input_dist_s + tail:  # input_dist not the longest path
        assert split_step_s(cpu, 1) == pytest.approx(split_step_s(beside, 1) + tail, rel=1e-9, abs=1e-9)
    batch = SplitTermsBatch.from_terms([cpu, cpu])
    assert batch.allreduce_after_update
    assert split_step_batch(batch, 3)[1] == pytest.approx(split_step_s(cpu, 3), rel=1e-12, abs=_EPS)
    with pytest.raises(ValueError, match="allreduce_after_update"):
        SplitTermsBatch.from_terms([cpu, beside])


@settings(max_examples=300, deadline=None)
@given(terms())
def test_the_unsplit_step_is_the_overlap_kind_s_composition(t):
    phases = _phases_of(t)
    from_phases = SplitTerms.from_phases(phases, chunk_latency_s=t.chunk_latency_s,
                                         chunk_overhead_s=t.chunk_overhead_s, chunk_feature_s=t.chunk_feature_s,
                                         features=t.features)
    composed = pipelines.evaluate(pipelines.pipeline_kind("overlap").step, pipelines.terms(phases))
    assert unsplit_step_s(from_phases) == pytest.approx(float(composed), rel=1e-9, abs=_EPS)
    # the all-reduce is what the dense backward leaves exposed; the rest is read as given
    assert from_phases.allreduce_s == pytest.approx(max(0.0, t.allreduce_s - phases["dense_bwd"]), abs=_EPS)
    assert attrs.evolve(from_phases, allreduce_s=t.allreduce_s) == t


@settings(max_examples=300, deadline=None)
@given(terms(), st.integers(1, MAX_CHUNKS), st.booleans())
def test_the_step_is_never_below_max_of_compute_and_communication(t, k, chained):
    assert split_step_s(t, k, chained) >= max(t.compute_s, t.comm_s) - _EPS


@settings(max_examples=500, deadline=None)
@given(terms(), st.integers(1, MAX_CHUNKS), st.booleans())
def test_the_step_is_never_above_the_unsplit_step_plus_k_per_chunk_costs(t, k, chained):
    assert split_step_s(t, k, chained) <= unsplit_step_s(t) + k * t.per_chunk_s + _EPS


@settings(max_examples=300, deadline=None)
@given(terms(), st.integers(1, MAX_CHUNKS))
def test_chaining_never_brings_a_chunk_earlier(t, k):
    upfront, chained = split_schedule(t, k), split_schedule(t, k, chained=True)
    assert chained.step_s >= upfront.step_s - _EPS
    assert all(c.arrival_s >= u.arrival_s - _EPS for c, u in zip(chained.chunks, upfront.chunks))
    assert split_step_s(t, 1, chained=True) == split_step_s(t, 1)


@settings(max_examples=200, deadline=None)
@given(terms(), st.integers(1, 64))
def test_choose_chunks_picks_the_cheapest_k(t, batch):
    k = choose_chunks(t, batch_size=batch)
    top = min(batch, MAX_CHUNKS)
    assert 1 <= k <= top
    steps = [split_step_s(t, j) for j in range(1, top + 1)]
    assert steps[k - 1] == min(steps)
    assert all(s > steps[k - 1] for s in steps[: k - 1])  # the smallest k among the cheapest


def _dlrm_like(latency: float, overhead: float) -> SplitTerms:
    """docs/overlap.md section 1's step (ms -> s): the output all-to-all 31 ms, the gradient 47 ms,
    ~235 ms of dense work that depends on the embeddings, 1-2 ms of bottom MLP."""
    return SplitTerms(input_dist_s=0.01, lookup_s=0.030, output_dist_s=0.031, dense_fwd_indep_s=0.001,
                      dense_fwd_rest_s=0.080, dense_bwd_rest_s=0.155, dense_bwd_indep_s=0.002,
                      grad_dist_s=0.047, backward_update_s=0.047, allreduce_s=0.038, step_overhead_s=0.003,
                      chunk_latency_s=latency, chunk_overhead_s=overhead)


def test_a_comm_bound_dlrm_step_splits_and_a_costly_chunk_does_not():
    t = _dlrm_like(latency=0.001, overhead=0.001)
    k = choose_chunks(t, batch_size=1024)
    assert k > 1
    sched = split_schedule(t, k)
    whole = split_schedule(t, 1)
    assert sched.step_s < whole.step_s
    assert sched.exposed_output_s < whole.exposed_output_s and sched.exposed_grad_s < whole.exposed_grad_s
    # hidden: the first chunk's transfer stays exposed, so the step stays above compute + its share
    assert sched.step_s >= t.compute_s + (k - 1) * t.chunk_overhead_s
    assert choose_chunks(_dlrm_like(latency=0.001, overhead=0.2), batch_size=1024) == 1
    assert choose_chunks(t, batch_size=1) == 1
    # chained (chain_chunks): the dense forward per chunk outlasts a chunk's transfer, so it splits too
    assert choose_chunks(t, batch_size=1024, chained=True) > 1


@pytest.mark.parametrize("chained", [False, True])
def test_chunks_arrive_in_order_and_gradients_leave_last_chunk_first(chained):
    t = _dlrm_like(latency=0.001, overhead=0.001)
    sched = split_schedule(t, 4, chained)
    arrivals = [c.arrival_s for c in sched.chunks]
    issues = [c.grad_issue_s for c in sched.chunks]
    assert arrivals == sorted(arrivals) and issues == sorted(issues, reverse=True)
    assert sched.emb_bwd_start_s >= max(c.grad_arrival_s for c in sched.chunks)
    if chained:  # each gradient leaves once the one before it has arrived
        assert all(sched.chunks[c - 1].grad_issue_s >= sched.chunks[c].grad_arrival_s for c in range(1, 4))


def test_bad_terms_are_refused_with_the_culprit():
    with pytest.raises(ValueError, match="lookup_s must be a finite time"):
        SplitTerms(lookup_s=-1.0)
    with pytest.raises(ValueError, match="chunk_latency_s=0.5 exceeds output_dist_s"):
        SplitTerms(output_dist_s=0.1, grad_dist_s=1.0, chunk_latency_s=0.5)
    with pytest.raises(ValueError, match="k must be an int in 1..16"):
        split_step_s(SplitTerms(), 17)
    with pytest.raises(KeyError, match="'grad_dist'"):
        SplitTerms.from_phases({"input_dist": 0, "lookup": 0, "output_dist": 0, "dense_fwd": 0, "dense_bwd": 0},
                               chunk_latency_s=0.0, chunk_overhead_s=0.0)


def test_the_schedule_describes_each_chunk():
    t = _dlrm_like(latency=0.001, overhead=0.001)
    sched = split_schedule(t, 2)
    lines = sched.describe()
    assert len(lines) == 4 and lines[0].startswith("chunk 0: embeddings in at ")
    assert f"step {sched.step_s * 1e3:.2f} ms" in lines[-2]
    assert lines[-1].startswith(f"each extra chunk: {t.per_chunk_s * 1e3:.3f} ms")
    assert f"forward waits {sched.chunks[1].fwd_wait_s * 1e3:.2f} ms" in lines[1]


def test_terms_from_the_cost_model_charge_one_latency_per_sending_group_per_chunk():
    import numpy as np

    from torchrec_sparselift.cost.hardware import PRESETS
    from torchrec_sparselift.cost.model import CostContext, DenseWork, collective_calls, phase_times
    from torchrec_sparselift.cost.terms import layout

    ctx = CostContext(profile=PRESETS["h100"], world_size=4, local_world_size=4, batch_size=512,
                      dense=DenseWork(1e9, 1e6))
    colmax = np.linspace(1e5, 4e6, len(layout().columns))
    t = SplitTerms.from_cost_model(colmax, 1e6, 2, ctx, chunk_overhead_s=2e-5)
    phases = phase_times(colmax, 1e6, 2, ctx, pipeline="overlap")
    assert t.output_dist_s == pytest.approx(phases["output_dist"]) and t.lookup_s == pytest.approx(phases["lookup"])
    assert t.chunk_latency_s == pytest.approx(ctx.profile.collective_latency_s * collective_calls("output_dist", 2))
    assert 0 < t.chunk_latency_s < t.output_dist_s
    composed = pipelines.evaluate(pipelines.pipeline_kind("overlap").step, pipelines.terms(phases))
    assert split_step_s(t, 1) == pytest.approx(float(composed), rel=1e-9)
    one_rank = attrs.evolve(ctx, world_size=1, local_world_size=1)
    assert SplitTerms.from_cost_model(colmax, 1e6, 2, one_rank, chunk_overhead_s=0.0).chunk_latency_s == 0.0
    # the link's own latency measured: a chunk puts that much per sending group on the link
    on_link = attrs.evolve(ctx, profile=attrs.evolve(ctx.profile, link_latency_s=ctx.profile.collective_latency_s / 4))
    t_link = SplitTerms.from_cost_model(colmax, 1e6, 2, on_link, chunk_overhead_s=2e-5)
    assert t_link.chunk_latency_s == pytest.approx(t.chunk_latency_s / 4)
    assert split_step_s(t_link, 1) == split_step_s(t, 1)  # the unsplit step is the same
    batch = SplitTermsBatch.from_cost_model(colmax[None, :], 1e6, 2, on_link, chunk_overhead_s=2e-5)
    assert float(batch.chunk_latency_s[0]) == pytest.approx(t_link.chunk_latency_s)


def test_an_extra_chunk_puts_the_links_own_latency_on_the_link_and_at_most_the_fitted_one():
    p = attrs.evolve(PRESETS["h100"], collective_latency_s=6e-4)
    assert chunk_link_latency_s(p, 2, 1) == pytest.approx(6e-4)  # not measured: all of the fitted latency
    measured = attrs.evolve(p, link_latency_s=2e-4)
    assert chunk_link_latency_s(measured, 2, 1) == pytest.approx(2e-4)
    assert chunk_link_latency_s(measured, 8, 3) == pytest.approx(3 * chunk_link_latency_s(measured, 8, 1))
    assert chunk_link_latency_s(attrs.evolve(p, link_latency_s=9e-4), 2, 1) == pytest.approx(6e-4)
    assert chunk_link_latency_s(measured, 1, 2) == 0.0
    # on a link-bound step the chunks' latency is what a large k pays on the link: less of it, a
    # cheaper split at every k > 1 and the same unsplit step
    comm_bound = SplitTerms(input_dist_s=0.01, lookup_s=0.005, output_dist_s=0.2, dense_fwd_indep_s=0.001,
                            dense_fwd_rest_s=0.02, dense_bwd_rest_s=0.04, dense_bwd_indep_s=0.002, grad_dist_s=0.2,
                            backward_update_s=0.005, allreduce_s=0.001, step_overhead_s=0.001,
                            chunk_latency_s=6e-4, chunk_overhead_s=1e-3)
    link_only = attrs.evolve(comm_bound, chunk_latency_s=2e-4)
    assert split_step_s(link_only, 1) == split_step_s(comm_bound, 1)
    for k in (2, 4, 8, 16):
        assert split_step_s(link_only, k) < split_step_s(comm_bound, k)


@settings(max_examples=300, deadline=None)
@given(terms(), st.integers(1, MAX_CHUNKS), st.integers(0, 100), st.booleans())
def test_the_split_step_grows_with_the_features_a_chunk_carries(t, k, more, chained):
    wider = attrs.evolve(t, features=t.features + more)
    assert wider.chunk_dense_s >= t.chunk_dense_s
    assert split_step_s(wider, k, chained) >= split_step_s(t, k, chained) - _EPS
    assert split_step_s(wider, 1) == split_step_s(t, 1)  # one chunk pays no chunk cost


def test_one_more_chunk_costs_its_fixed_part_and_its_part_per_feature():
    prof = attrs.evolve(PRESETS["cpu-gloo"], chunk_overhead_s=1e-3, chunk_feature_s=4e-5)
    assert chunk_dense_s(prof, 0) == pytest.approx(1e-3) and chunk_dense_s(prof, 60) == pytest.approx(3.4e-3)
    assert chunk_dense_s(attrs.evolve(prof, chunk_feature_s=None), 60) == pytest.approx(1e-3)
    assert chunk_dense_s(attrs.evolve(prof, chunk_overhead_s=None), 60) is None
    with pytest.raises(ValueError, match="features must be an int >= 0"):
        chunk_dense_s(prof, -1)
    t = _dlrm_like(latency=1e-4, overhead=1e-3)
    wide = attrs.evolve(t, chunk_feature_s=4e-5, features=60)
    assert wide.per_chunk_s == pytest.approx(2e-4 + 3.4e-3)
    assert split_step_s(wide, 4) - split_step_s(t, 4) == pytest.approx(3 * 60 * 4e-5, rel=1e-6)
    assert "dense 1.000 ms + 40.0 us x 60 features" in split_schedule(wide, 4).describe()[-1]
    with pytest.raises(ValueError, match="features must be an int >= 0"):
        attrs.evolve(t, features=-2)
    # a stored SplitTerms without the per-feature fields prices as before
    old = {k: v for k, v in attrs.asdict(t).items() if k not in ("chunk_feature_s", "features")}
    assert SplitTerms(**old) == t
