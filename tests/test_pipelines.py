"""The pipeline descriptions (cost/pipelines.py): the step total, the LP composition rows and the
explain timeline all come from them and agree for every pipeline kind on random loads."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_sparselift.cost.terms import layout as load_layout
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
    PHASE_PARTS,
    PIPELINE_KINDS,
    PIPELINES,
    STALE_PIPELINES,
    SYNC_PIPELINES,
    Par,
    Seq,
    effective_pipeline,
    step_factor,
    evaluate,
    paths,
    pipeline_kind,
    terms,
)
from torchrec_sparselift.explain import critical_path, step_timeline, timeline_end
from torchrec_sparselift.search.lp import composition_rows, term_entries
from torchrec_sparselift.search.equation import column_scale, lossy_coefficients, lossy_per_z


def _phases_in(node):
    if isinstance(node, str):
        return [node]
    if isinstance(node, Seq):
        return [p for part in node.parts for p in _phases_in(part)]
    assert isinstance(node, Par)
    return [p for lane in node.lanes for p in _phases_in(lane.body)]


def test_every_kind_runs_every_phase_exactly_once():
    """... a split phase (PHASE_PARTS) as itself or as all of its parts; also as each kind runs
    across hosts on hardware without overlap."""
    across = [effective_pipeline(k.name, supports_overlap=False, spans_hosts=True) for k in PIPELINE_KINDS]
    for kind in list(PIPELINE_KINDS) + across:
        ran = _phases_in(kind.step)
        expect = [p for p in PHASE_NAMES if p not in {q for qs in PHASE_PARTS.values() for q in qs}]
        for whole, parts in PHASE_PARTS.items():
            if any(q in ran for q in parts):
                expect = [p for p in expect if p != whole] + list(parts)
        assert sorted(ran) == sorted(expect), kind.name
    assert set(_phases_in(pipeline_kind("overlap").step)) >= {"dense_fwd_indep", "dense_bwd_indep"}


def test_one_order_of_names_everywhere():
    from torchrec_sparselift.plan.execution_plan import PIPELINES as PLAN_PIPELINES
    from torchrec_sparselift.runtime.pipelines import _CLASSES

    assert PLAN_PIPELINES == PIPELINES
    assert list(_CLASSES) == list(PIPELINES)  # every kind has a TorchRec train pipeline, in one order
    assert STALE_PIPELINES == ("semi_sync", "overlap_stale")
    with pytest.raises(ValueError, match="choose one of"):
        pipeline_kind("async")


def _ctx(profile, world, batch, param_bytes, flops, indep=0.0):
    return CostContext(profile=profile, world_size=world, local_world_size=min(world, profile.local_world_size),
                       batch_size=batch, dense=DenseWork(param_bytes=param_bytes, fwd_flops_per_sample=flops,
                                                         indep_fwd_flops_per_sample=indep * flops))


def _lp_total_ms(pipeline, colmax, allreduce_bytes, groups, ctx, fwd, bwd):
    """The smallest ``total`` the LP's composition rows allow at the point where every load
    variable holds this plan's value (an integral point of the LP)."""
    p = ctx.profile
    ms = 1e3
    lay = load_layout()
    z = {c: i for i, c in enumerate(lay.compute + lay.link)}  # every compute and link column's maximum
    nz = len(z)
    iy_in, iy_out, ia, ilat, itot, iany = nz, nz + 1, nz + 2, nz + 3, nz + 4, nz + 5
    val = np.zeros(nz + 6)
    col_scale = column_scale(p)
    for c, i in z.items():
        val[i] = col_scale[c] * colmax[c]
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
                         fused_splits=pipeline_kind(pipeline).fused_input_splits,
                         lossy=lossy_coefficients(lossy_per_z(p), fwd, bwd))
    for part in (q for qs in PHASE_PARTS.values() for q in qs):  # the split dense phases: constants
        forms[part] = ([], ms * ph[part])
    rows = composition_rows(pipeline, forms, itot, p.supports_overlap, ctx.num_hosts > 1,
                            step_factor(p, pipeline, ctx.num_hosts > 1))
    # each row: sum(entries) - total <= rhs  <=>  total >= sum(entries without total) - rhs
    return max(sum(v * val[j] for j, v in ent if j != itot) - rhs for ent, rhs in rows)


_loads = st.lists(st.floats(0.0, 1.0), min_size=K, max_size=K)
#: the presets, and the CPU one with measured pipeline step factors (HardwareProfile.pipeline_factors)
_PROFILES = {**PRESETS, "cpu-factors": attrs.evolve(PRESETS["cpu-gloo"], pipeline_factors=(
    ("base", 1.05), ("fused", 0.9), ("prefetch", 1.02), ("overlap", 0.97))),
             # and a measured codec cost and host share of the all-to-all (what lossy phases do not shrink)
             "cpu-codec": attrs.evolve(PRESETS["cpu-gloo"], codec_byte_s=3e-10, a2a_host_byte_s=2e-10)}


@settings(max_examples=60, deadline=None)
@given(
    loads=_loads,
    scale=st.sampled_from([1e-5, 1e-3, 1e-2]),
    allreduce=st.floats(0.0, 1e8),
    groups=st.integers(0, 4),
    profile=st.sampled_from(["h100", "cpu-gloo", "cpu-factors", "cpu-codec"]),
    world=st.sampled_from([1, 2, 8, 16]),
    batch=st.integers(1, 8192),
    dense=st.tuples(st.floats(0.0, 1e9), st.floats(0.0, 1e8), st.floats(0.0, 1.0)),
    prec=st.sampled_from([("fp32", "fp32"), ("fp16", "bf16"), ("fp8", "bf16")]),
)
def test_step_total_lp_rows_and_timeline_agree_for_every_pipeline(loads, scale, allreduce, groups, profile,
                                                                  world, batch, dense, prec):
    prof = _PROFILES[profile]
    ctx = _ctx(prof, world, batch, *dense)
    colmax = np.asarray(loads) * scale
    colmax[[IN_INTRA, IN_INTER, OUT_INTRA, OUT_INTER]] *= 1e10  # bytes columns
    for pl in PIPELINES:
        st_ = step_time(colmax, allreduce, groups, ctx, pl, *prec)
        total = st_.total_s
        # the step total: scalar, batched, and the description evaluated on the phases
        assert step_total_batch(colmax[None, :], allreduce, groups, ctx, pl, *prec)[0] == pytest.approx(
            total, rel=1e-12, abs=1e-18)
        kind = effective_pipeline(pl, prof.supports_overlap, ctx.num_hosts > 1)
        vals = terms(st_.phases, prof.supports_overlap)
        assert max(sum(vals[t] for t in path) for path in paths(kind.step)) == pytest.approx(
            evaluate(kind.step, vals), rel=1e-12, abs=1e-18)
        # the LP composition at this integral point
        assert _lp_total_ms(pl, colmax, allreduce, groups, ctx, *prec) / 1e3 == pytest.approx(
            total, rel=1e-9, abs=1e-15)
        # the explain timeline: the composition, which the pipeline's measured factor scales
        factor = step_factor(prof, pl, ctx.num_hosts > 1)
        segs = step_timeline(st_.phases, pl, prof.supports_overlap, ctx.num_hosts > 1)
        crit = critical_path(segs)
        assert timeline_end(segs) * factor == pytest.approx(total, rel=1e-9, abs=1e-15)
        assert sum(s.duration_s for s in crit) * factor == pytest.approx(total, rel=1e-9, abs=1e-15)
        # the summary numbers
        assert st_.compute_s == pytest.approx(sum(st_.phases[k] for k in COMPUTE_PHASES), rel=1e-12)
        serial = evaluate(pipeline_kind("base").step, vals)
        assert total / factor <= serial * (1 + 1e-12)
        assert st_.overlapped_s == pytest.approx(max(0.0, serial - total), rel=1e-9, abs=1e-15)


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


def _overlap_case(profile, world, local, allreduce):
    prof = PRESETS[profile]
    ctx = CostContext(profile=prof, world_size=world, local_world_size=local, batch_size=1024,
                      dense=DenseWork(param_bytes=2e6, fwd_flops_per_sample=2e6, indep_fwd_flops_per_sample=5e5))
    colmax = np.zeros(K)
    colmax[[FWD, BWD]] = 2e-3, 5e-3
    colmax[[OUT_INTRA, OUT_INTER, IN_INTRA, IN_INTER]] = 4e6, 4e6, 1e6, 1e6
    return ctx, {pl: step_time(colmax, allreduce, 2, ctx, pl) for pl in PIPELINES}


def test_overlap_hides_its_dependency_bound_where_the_hardware_overlaps():
    ctx, st_ = _overlap_case("h100", 16, 8, 1e9)
    ph = st_["overlap"].phases
    assert ph["dense_fwd_indep"] > 0 and ph["dense_fwd_indep"] + ph["dense_fwd_rest"] == pytest.approx(ph["dense_fwd"])
    assert ph["dense_bwd_indep"] + ph["dense_bwd_rest"] == pytest.approx(ph["dense_bwd"])
    vals = terms(ph)
    bound = (min(ph["output_dist"], ph["dense_fwd_indep"]) + min(ph["grad_dist"], ph["dense_bwd_indep"])
             + min(ph["backward_update"], vals["allreduce"]))
    assert bound > 0  # input_dist is hidden in both; sparse_dist runs the rest in sequence
    assert st_["sparse_dist"].total_s - st_["overlap"].total_s == pytest.approx(bound, rel=1e-9)


def test_on_cpu_gloo_overlap_pays_only_between_hosts():
    """docs/overlap.md: one box (loopback, compute-bound) measured 0.99x of sparse_dist; two
    emulated hosts sharing a link hid part of the all-to-alls (the all-reduce runs after the
    embedding backward there). TorchRec's kinds
    stay priced as base on CPU either way."""
    _, one_box = _overlap_case("cpu-gloo", 2, 2, 1e8)
    # every kind priced as base (base itself pays unfused splits exchanges)
    assert len({st_.total_s for pl, st_ in one_box.items() if pl != "base"}) == 1
    assert one_box["overlap"].total_s >= one_box["sparse_dist"].total_s  # never preferred on one box
    _, hosts = _overlap_case("cpu-gloo", 2, 1, 1e8)
    others = {pl: st_.total_s for pl, st_ in hosts.items() if pl not in ("overlap", "overlap_stale", "base", "fused")}
    assert len(set(others.values())) == 1 and hosts["overlap"].total_s < min(others.values())
    assert hosts["overlap_stale"].total_s < min(others.values())  # the package's stale kind too
    assert one_box["overlap_stale"].total_s >= one_box["sparse_dist"].total_s
    ph = hosts["overlap"].phases  # no hiding under the dense backward on CPU: the all-reduce runs in full,
    # after the embedding backward (a rank's one core runs gloo's all-reduce and the TBE backward in turn)
    expect = (ph["uvm_fetch"] + ph["lookup"] + max(ph["output_dist"], ph["dense_fwd_indep"]) + ph["dense_fwd_rest"]
              + ph["dense_bwd_rest"] + max(ph["grad_dist"], ph["dense_bwd_indep"])
              + ph["backward_update"] + ph["allreduce"] + ph["step_overhead"])
    assert ph["backward_update"] > 0 and ph["allreduce"] > 0
    # the next batch's ids all-to-all shares the link with the output all-to-all it is issued
    # beside: across hosts on CPU it is in the step's flow, not hidden in a lane of its own
    assert ph["input_dist"] > 0
    assert hosts["overlap"].total_s == pytest.approx(ph["input_dist"] + expect, rel=1e-12)


def test_on_cpu_gloo_fused_issues_the_output_all_to_all_before_the_forward_across_hosts():
    """TrainPipelineFusedSparseDist runs the lookup and issues the output all-to-all before the
    next batch's input_dist and the bottom MLP forward; across hosts that all-to-all crosses the
    link while they run (docs/overlap.md section 9). On one box it is priced as sparse_dist."""
    _, one_box = _overlap_case("cpu-gloo", 2, 2, 1e8)
    assert one_box["fused"].total_s == one_box["sparse_dist"].total_s
    _, hosts = _overlap_case("cpu-gloo", 2, 1, 1e8)
    ph = hosts["fused"].phases
    hidden = min(ph["output_dist"], ph["input_dist"] + ph["dense_fwd_indep"])
    assert hidden > 0
    assert hosts["sparse_dist"].total_s - hosts["fused"].total_s == pytest.approx(hidden, rel=1e-9)
    kind = effective_pipeline("fused", supports_overlap=False, spans_hosts=True)
    assert kind is not pipeline_kind("fused") and kind.name == "fused"
    # where the hardware overlaps, fused keeps its own composition (embedding backward || all-reduce)
    assert effective_pipeline("fused", supports_overlap=True, spans_hosts=True) is pipeline_kind("fused")


def test_only_the_packages_overlap_kinds_need_a_core_per_rank():
    from torchrec_sparselift.vocabulary import PIPELINE_REGISTRY

    needs = {p.name for p in PIPELINE_REGISTRY if p.needs_spare_cores}
    assert needs == {"overlap", "overlap_stale"}
    assert all(p.overlaps_between_hosts for p in PIPELINE_REGISTRY if p.needs_spare_cores)
    assert {p.name for p in PIPELINE_REGISTRY if p.overlaps_between_hosts} == needs | {"fused"}


def test_the_timeline_shows_overlap_hiding_communication():
    from torchrec_sparselift.explain import comm_exposure, format_timeline

    ctx, st_ = _overlap_case("h100", 16, 8, 1e9)
    ph = st_["overlap"].phases
    base = comm_exposure(step_timeline(ph, "base"))
    assert all(h == 0.0 for k, (h, _) in base.items() if k != "allreduce")  # only DDP's all-reduce hides there
    assert base["allreduce"][0] == pytest.approx(min(ph["allreduce"], ph["dense_bwd"]), rel=1e-9)
    segs = step_timeline(ph, "overlap")
    comm = comm_exposure(segs)
    h, e = comm["output_dist"]
    assert h == pytest.approx(min(ph["output_dist"], ph["dense_fwd_indep"]), rel=1e-9)
    assert h + e == pytest.approx(ph["output_dist"], rel=1e-9)
    h, e = comm["grad_dist"]
    assert h == pytest.approx(min(ph["grad_dist"], ph["dense_bwd_indep"]), rel=1e-9)
    assert comm["input_dist"][1] == pytest.approx(0.0, abs=1e-15)  # the next batch's, behind the step
    assert "hidden behind compute / exposed" in format_timeline(segs, st_["overlap"].total_s)
