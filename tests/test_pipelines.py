"""The pipeline descriptions (cost/pipelines.py): the step total, the LP composition rows and the
explain timeline all come from them and agree for every pipeline kind on random loads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.model import (
    BWD,
    FWD,
    IN_INTER,
    IN_INTRA,
    K,
    OUT_INTER,
    OUT_INTRA,
    PRECISION_BYTES,
    UVM,
    CostContext,
    DenseWork,
    rank_times,
    step_time,
    step_total_batch,
)
from torchrec_sparselift.cost.pipelines import (
    COMPUTE_PHASES,
    LINK_PHASES,
    PHASE_NAMES,
    PIPELINE_KINDS,
    PIPELINES,
    STALE_PIPELINES,
    SYNC_PIPELINES,
    Par,
    Seq,
    effective_pipeline,
    evaluate,
    paths,
    pipeline_kind,
    terms,
)
from torchrec_sparselift.explain import critical_path, step_timeline, timeline_end
from torchrec_sparselift.search.lp import composition_rows, term_entries


def _phases_in(node):
    if isinstance(node, str):
        return [node]
    if isinstance(node, Seq):
        return [p for part in node.parts for p in _phases_in(part)]
    assert isinstance(node, Par)
    return [p for lane in node.lanes for p in _phases_in(lane.body)]


def test_every_kind_runs_every_phase_exactly_once():
    for kind in PIPELINE_KINDS:
        assert sorted(_phases_in(kind.step)) == sorted(PHASE_NAMES), kind.name


def test_one_order_of_names_everywhere():
    from torchrec_sparselift.plan.execution_plan import PIPELINES as PLAN_PIPELINES
    from torchrec_sparselift.runtime.pipelines import _CLASSES, EXACT_PIPELINE_KINDS, PIPELINE_KINDS as RT

    assert PLAN_PIPELINES == RT == PIPELINES
    assert set(_CLASSES) == set(PIPELINES)  # every kind has a TorchRec train pipeline
    assert EXACT_PIPELINE_KINDS == SYNC_PIPELINES and STALE_PIPELINES == ("semi_sync",)
    with pytest.raises(ValueError, match="choose one of"):
        pipeline_kind("async")


def _ctx(profile, world, batch, param_bytes, flops):
    return CostContext(profile=profile, world_size=world, local_world_size=min(world, profile.local_world_size),
                       batch_size=batch, dense=DenseWork(param_bytes=param_bytes, fwd_flops_per_sample=flops))


def _lp_total_ms(pipeline, colmax, allreduce_bytes, groups, ctx, fwd, bwd):
    """The smallest ``total`` the LP's composition rows allow at the point where every load
    variable holds this plan's value (an integral point of the LP)."""
    p = ctx.profile
    ms = 1e3
    z = {c: i for i, c in enumerate((FWD, BWD, UVM))}
    iy_in, iy_out, ia, ilat, itot, iany = 3, 4, 5, 6, 7, 8
    val = np.zeros(9)
    val[z[FWD]], val[z[BWD]], val[z[UVM]] = ms * colmax[FWD], ms * colmax[BWD], ms * colmax[UVM]
    val[iy_in] = ms * max(colmax[IN_INTRA] / p.intra_host_bw, colmax[IN_INTER] / p.inter_host_bw)
    val[iy_out] = ms * max(colmax[OUT_INTRA] / p.intra_host_bw, colmax[OUT_INTER] / p.inter_host_bw)
    ph = step_time(colmax, allreduce_bytes, groups, ctx, pipeline, fwd, bwd).phases
    hidden = ph["dense_bwd"] if getattr(p, "supports_overlap", True) else 0.0
    val[ia] = ms * max(0.0, ph["allreduce"] - hidden)
    latency = ms * p.collective_latency_s if ctx.world_size > 1 else 0.0
    val[ilat] = latency * groups
    val[iany] = 1.0 if groups else 0.0
    forms = term_entries(z, iy_in, iy_out, ia, PRECISION_BYTES[fwd] / 4, PRECISION_BYTES[bwd] / 4,
                         ms * ph["dense_fwd"], ms * ph["dense_bwd"], ilat=ilat, iany=iany, latency=latency,
                         fused_splits=pipeline_kind(pipeline).fused_input_splits)
    rows = composition_rows(pipeline, forms, itot, p.supports_overlap)
    # each row: sum(entries) - total <= rhs  <=>  total >= sum(entries without total) - rhs
    return max(sum(v * val[j] for j, v in ent if j != itot) - rhs for ent, rhs in rows)


_loads = st.lists(st.floats(0.0, 1.0), min_size=K, max_size=K)


@settings(max_examples=60, deadline=None)
@given(
    loads=_loads,
    scale=st.sampled_from([1e-5, 1e-3, 1e-2]),
    allreduce=st.floats(0.0, 1e8),
    groups=st.integers(0, 4),
    profile=st.sampled_from(["h100", "cpu-gloo"]),
    world=st.sampled_from([1, 2, 8, 16]),
    batch=st.integers(1, 8192),
    dense=st.tuples(st.floats(0.0, 1e9), st.floats(0.0, 1e8)),
    prec=st.sampled_from([("fp32", "fp32"), ("fp16", "bf16"), ("fp8", "bf16")]),
)
def test_step_total_lp_rows_and_timeline_agree_for_every_pipeline(loads, scale, allreduce, groups, profile,
                                                                  world, batch, dense, prec):
    prof = PRESETS[profile]
    ctx = _ctx(prof, world, batch, *dense)
    colmax = np.asarray(loads) * scale
    colmax[[IN_INTRA, IN_INTER, OUT_INTRA, OUT_INTER]] *= 1e10  # bytes columns
    for pl in PIPELINES:
        st_ = step_time(colmax, allreduce, groups, ctx, pl, *prec)
        total = st_.total_s
        # the step total: scalar, batched, and the description evaluated on the phases
        assert step_total_batch(colmax[None, :], allreduce, groups, ctx, pl, *prec)[0] == pytest.approx(
            total, rel=1e-12, abs=1e-18)
        kind = effective_pipeline(pl, prof.supports_overlap)
        vals = terms(st_.phases, prof.supports_overlap)
        assert max(sum(vals[t] for t in path) for path in paths(kind.step)) == pytest.approx(
            evaluate(kind.step, vals), rel=1e-12, abs=1e-18)
        # the LP composition at this integral point
        assert _lp_total_ms(pl, colmax, allreduce, groups, ctx, *prec) / 1e3 == pytest.approx(
            total, rel=1e-9, abs=1e-15)
        # the explain timeline
        segs = step_timeline(st_.phases, pl, prof.supports_overlap)
        crit = critical_path(segs)
        assert timeline_end(segs) == pytest.approx(total, rel=1e-9, abs=1e-15)
        assert sum(s.duration_s for s in crit) == pytest.approx(total, rel=1e-9, abs=1e-15)
        # the summary numbers
        assert st_.compute_s == pytest.approx(sum(st_.phases[k] for k in COMPUTE_PHASES), rel=1e-12)
        serial = evaluate(pipeline_kind("base").step, vals)
        assert total <= serial * (1 + 1e-12)
        assert st_.overlapped_s == pytest.approx(serial - total, rel=1e-9, abs=1e-15)


def test_rank_times_split_each_ranks_phases_into_compute_and_link():
    prof = PRESETS["h100"]
    ctx = _ctx(prof, 8, 1024, 1e8, 1e6)
    rng = np.random.default_rng(3)
    loads = rng.uniform(0, 1e-3, (8, K))
    loads[:, [IN_INTRA, IN_INTER, OUT_INTRA, OUT_INTER]] *= 1e10
    compute, comm = rank_times(loads, ctx, "fp16", "fp32")
    for r in range(8):
        ph = step_time(loads[r], 0.0, 0, ctx, "base", "fp16", "fp32").phases
        assert compute[r] == pytest.approx(sum(ph[k] for k in COMPUTE_PHASES), rel=1e-12)
        assert comm[r] == pytest.approx(sum(ph[k] for k in LINK_PHASES), rel=1e-12)
