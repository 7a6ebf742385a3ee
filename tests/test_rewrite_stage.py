"""The rewrite stage of the decision (plan.rewrites): batch split, narrow ids and dedup chosen by
price after the search, their saving in the plan's prediction, every refusal's reason recorded, the
never-slower rule judging them, and the plan with them serialized and explained."""

from __future__ import annotations

import json
import logging
import warnings

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.models.dlrm import DLRM

from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.cost.batch_split import split_step_s
from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.explain import format_rewrites
from torchrec_sparselift.plan.baseline import REWRITE_TERM, TermErrors, TermTimes, rewrite_error, with_rewrite_term
from torchrec_sparselift.plan.execution_plan import ExecutionPlan
from torchrec_sparselift.plan.planning import execution_plan
from torchrec_sparselift.plan.rewrites import REWRITES, RewriteChoice, rewrite_names

warnings.filterwarnings("ignore")
logging.getLogger("torchrec").setLevel(logging.ERROR)

H100 = PRESETS["h100"]
TABLES = 6


def _profile(bw_div: float = 1.0, dense_div: float = 1.0, chunk_overhead_s=2e-5, dedup_id_s=1e-9):
    """The h100 preset with its links ``bw_div`` times slower and its dense compute ``dense_div``
    times slower, calibrated with the two rewrite constants (None: not calibrated)."""
    p = H100
    return attrs.evolve(
        p, intra_host_bw=p.intra_host_bw / bw_div, inter_host_bw=p.inter_host_bw / bw_div,
        dense_flops=p.dense_flops / dense_div, dense_mem_bw=p.rate("dense_mem_bw") / dense_div,
        interaction_flops=p.rate("interaction_flops") / dense_div, chunk_overhead_s=chunk_overhead_s,
        dedup_id_s=dedup_id_s)


COMM_HEAVY = dict(bw_div=50, dense_div=15)  # output all-to-all ~ the dense work: the split hides it


def _model(extra: torch.nn.Module = None, t0_rows: int = 200_000) -> DLRM:
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=t0_rows if i == 0 else 200_000,
                                 feature_names=[f"f{i}"]) for i in range(TABLES)]
    m = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
             dense_in_features=13, dense_arch_layer_sizes=[512, 256, 64], over_arch_layer_sizes=[512, 256, 1])
    if extra is not None:
        m.dense_arch.model.add_module("extra", extra)
    return m


def _plan(hardware, model=None, hbm_gib: int = 80, **kw):
    kw.setdefault("pipelines", ["overlap"])
    kw.setdefault("constraints", {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(TABLES)})
    topo = Topology(world_size=8, local_world_size=8, compute_device="cuda", hbm_cap=hbm_gib << 30)
    planner = SparseLiftPlanner(topology=topo, batch_size=2048, hardware=hardware, debug=False, time_budget_s=2,
                                solver="heuristic", **kw)
    res = planner.plan_with_result(model if model is not None else _model(), get_default_sharders())
    return planner, res


def _notes(res) -> str:
    return " | ".join(res.rewrites.notes)


def test_the_stage_splits_a_comm_heavy_plan_and_prices_the_plan_with_the_split():
    planner, res = _plan(_profile(**COMM_HEAVY))
    r = res.rewrites
    assert res.search.pipeline == "overlap" and r.batch_split > 1
    # the chosen plan's step is the split step on the phases with the input all-to-all shortened
    assert r.step_s == pytest.approx(split_step_s(r.terms, r.batch_split), rel=1e-9)
    assert r.step_s < r.step_without_s and res.step_time_s == pytest.approx(r.step_s)
    assert r.split_saved_s > 0 and r.id_dtype == "int32" and r.wire_bytes_after < r.wire_bytes_before
    o = res.optimizations()
    assert (o.batch_split, o.id_dtype, o.per_sample) == (r.batch_split, "int32", True)
    # the prediction carries it, and its per-rank breakdown reads the rewritten step
    pred = res.prediction()
    assert pred.step_time_s == pytest.approx(r.step_s)
    assert max(x.exposed_comm_s for x in pred.per_rank) <= max(
        x.exposed_comm_s for x in attrs.evolve(res, rewrites=None).prediction().per_rank)


def test_the_stage_prices_a_chunk_by_the_features_it_carries():
    _, res = _plan(_profile(**COMM_HEAVY))
    cheap = res.rewrites
    assert cheap.terms.features == TABLES and cheap.terms.chunk_feature_s == 0.0  # None: priced as 0
    _, res = _plan(attrs.evolve(_profile(**COMM_HEAVY), chunk_feature_s=2e-4))
    wide = res.rewrites
    assert wide.terms.features == TABLES and wide.terms.chunk_dense_s == pytest.approx(2e-5 + TABLES * 2e-4)
    # a costlier chunk: never more chunks, never a shorter predicted step
    assert wide.batch_split <= cheap.batch_split and wide.step_s >= cheap.step_s
    if wide.batch_split > 1:
        assert wide.step_s == pytest.approx(split_step_s(wide.terms, wide.batch_split), rel=1e-9)
    _, res = _plan(attrs.evolve(_profile(**COMM_HEAVY), chunk_feature_s=0.05))
    assert res.rewrites.batch_split == 1 and "batch split: no k in 2.." in _notes(res)


def test_the_stage_does_not_split_a_compute_bound_plan_and_says_why():
    _, res = _plan(_profile())
    assert res.rewrites.batch_split == 1
    assert "batch split: no k in 2.." in _notes(res)
    assert res.rewrites.id_dtype == "int32"  # narrow ids cost nothing: chosen whenever they fit


def test_a_batchnorm_module_is_refused_with_the_culprit_even_when_declared_per_sample():
    for declared in (False, True):
        _, res = _plan(_profile(**COMM_HEAVY), _model(torch.nn.BatchNorm1d(64)), per_sample=declared)
        assert res.rewrites.batch_split == 1
        assert "dense_arch.model.extra (BatchNorm1d)" in _notes(res)


class _MixesSamples(torch.nn.Module):
    def forward(self, x):  # in-batch: every sample sees the batch's mean
        return x - x.mean(dim=0, keepdim=True)


def test_an_unknown_module_needs_the_users_declaration():
    _, res = _plan(_profile(**COMM_HEAVY), _model(_MixesSamples()))
    assert res.rewrites.batch_split == 1 and "_MixesSamples" in _notes(res) and "per_sample=True" in _notes(res)
    _, res = _plan(_profile(**COMM_HEAVY), _model(_MixesSamples()), per_sample=True)
    assert res.rewrites.batch_split > 1
    assert res.optimizations().per_sample  # the runtime's pipeline takes the declaration from the plan


def test_each_reason_a_rewrite_is_not_chosen_is_recorded():
    _, res = _plan(_profile(**COMM_HEAVY, chunk_overhead_s=None, dedup_id_s=None))
    notes = _notes(res)
    assert "no chunk_overhead_s" in notes and "no dedup_id_s" in notes and "sparselift calibrate steps" in notes
    _, res = _plan(_profile(**COMM_HEAVY), pipelines=["sparse_dist"])
    assert "the pipeline is 'sparse_dist'" in _notes(res) and res.rewrites.batch_split == 1
    _, res = _plan(_profile(**COMM_HEAVY), _model(t0_rows=2**31 + 8), hbm_gib=160, constraints={
        "t0": ParameterConstraints(sharding_types=["row_wise"])})
    assert res.rewrites.id_dtype == "int64" and "t0 (2147483656 rows)" in _notes(res)
    _, res = _plan(_profile(**COMM_HEAVY))
    assert "no observed distinct-id ratio" in _notes(res)


def test_no_rewrites_gives_the_plan_without_them():
    _, plain = _plan(_profile(**COMM_HEAVY), rewrites=())
    _, full = _plan(_profile(**COMM_HEAVY))
    assert plain.rewrites is None
    o = plain.optimizations()
    assert (o.batch_split, o.id_dtype, o.dedup_features) == (1, "int64", ())
    assert plain.step_time_s == plain.search.step.total_s == full.search.step.total_s
    assert plain.search.assignment == full.search.assignment  # the stage never moves a table
    _, only = _plan(_profile(**COMM_HEAVY), rewrites=["id_dtype"])
    assert only.rewrites.batch_split == 1 and only.rewrites.id_dtype == "int32"


def test_rewrites_are_checked_by_name():
    assert rewrite_names(None) == REWRITES and rewrite_names([]) == ()
    assert rewrite_names(["dedup", "batch_split"]) == ("batch_split", "dedup")
    with pytest.raises(ValueError, match=r"unknown rewrite\(s\) \['dedupe'\].*batch_split, id_dtype, dedup"):
        _plan(_profile(), rewrites=["dedupe"])
    with pytest.raises(ValueError, match="got the string 'dedup'"):
        _plan(_profile(), rewrites="dedup")


def test_the_rule_judges_the_rewrites_as_a_term_of_the_plan():
    errors = TermErrors({"1/a2a_bw": 0.2}, 0.1, "test")
    assert rewrite_error(errors) == pytest.approx(0.2)
    assert rewrite_error(TermErrors({REWRITE_TERM: 0.05, "1/a2a_bw": 0.2}, 0.1)) == pytest.approx(0.05)
    times, errs = with_rewrite_term(TermTimes(10.0, {"fixed": 10.0}), 2.0, errors)
    assert times.total_s == 8.0 and times.terms[REWRITE_TERM] == 2.0 and errs.of(REWRITE_TERM) == pytest.approx(0.2)
    assert with_rewrite_term(TermTimes(10.0, {}), 0.0, errors) == (TermTimes(10.0, {}), errors)
    # a saving the rule trusts is kept on the plan the rule hands back; one within its error is not
    # (every table is forced table-wise: TorchRec's sharding is priced as SparseLift's, so the gain
    # over TorchRec's plan is the rewrites' alone)
    _, res = _plan(_profile(**COMM_HEAVY), never_slower=True)
    d = res.never_slower
    assert d.applied and d.leave and res.rewrites.batch_split > 1
    assert [t.term for t in d.differing] == [REWRITE_TERM] and d.gain_s == pytest.approx(res.rewrites.saving_s)
    _, res = _plan(_profile(**COMM_HEAVY), never_slower=True, model_errors=TermErrors({REWRITE_TERM: 1.0}, 0.3, "t"))
    d = res.never_slower
    assert d.applied and not d.leave and d.gain_s <= d.margin_s
    assert res.rewrites.batch_split == 1 and "the never-slower rule" in _notes(res)
    assert res.step_time_s == res.search.step.total_s


def test_a_plan_with_rewrites_round_trips_and_explain_shows_each_chunk():
    planner, res = _plan(_profile(**COMM_HEAVY))
    ep = execution_plan(planner.last_request, res)
    back = ExecutionPlan.from_json(ep.to_json())
    assert back == ep and back.optimizations.batch_split == res.rewrites.batch_split
    assert back.prediction.step_time_s == pytest.approx(res.rewrites.step_s)
    stored = RewriteChoice.from_dict(json.loads(ep.to_json())["planner_info"]["rewrites"])
    assert stored == res.rewrites and stored.schedule() == res.rewrites.schedule()
    lines = format_rewrites(back.planner_info)
    assert lines[0].startswith(f"rewrites: batch split {res.rewrites.batch_split}")
    assert sum(line.strip().startswith("chunk ") for line in lines) == res.rewrites.batch_split
    assert any("KiB saved" in line for line in lines) and any("forward waits" in line for line in lines)
    assert format_rewrites({}) == []


@settings(max_examples=12, deadline=None)
@given(bw_div=st.floats(1, 300), dense_div=st.floats(1, 100), overhead=st.floats(0, 1e-3),
       pipeline=st.sampled_from(["overlap", "overlap", "sparse_dist", "base"]))
def test_the_stage_never_worsens_the_prediction_nor_beats_the_bound(bw_div, dense_div, overhead, pipeline):
    _, res = _plan(_profile(bw_div=bw_div, dense_div=dense_div, chunk_overhead_s=overhead), pipelines=[pipeline])
    r = res.rewrites
    assert r.step_s <= r.step_without_s * (1 + 1e-12)
    if r.terms is not None:
        assert r.step_s >= max(r.terms.compute_s, r.terms.comm_s) * (1 - 1e-9)


def test_a_cached_plan_with_rewrites_comes_back_with_them(tmp_path):
    first, _ = _plan(_profile(**COMM_HEAVY), cache_dir=str(tmp_path))
    ep = first.plan_execution(_model(), get_default_sharders())
    assert first.last_cache_hit is False and ep.optimizations.batch_split > 1
    back = first.plan_execution(_model(), get_default_sharders())
    assert first.last_cache_hit is True and back == ep and back.planner_info["rewrites"] == ep.planner_info["rewrites"]
    other, _ = _plan(_profile(**COMM_HEAVY), cache_dir=str(tmp_path), rewrites=())
    plain = other.plan_execution(_model(), get_default_sharders())
    assert other.last_cache_hit is False  # another request: the rewrites allowed are in the fingerprint
    assert plain.optimizations.batch_split == 1 and plain.optimizations.id_dtype == "int64"
    assert "rewrites" not in plain.planner_info and plain.prediction.step_time_s > ep.prediction.step_time_s


def test_explain_prices_a_stored_plan_again_with_its_rewrites():
    from torchrec_sparselift.explain import reprice_plan

    planner, res = _plan(_profile(**COMM_HEAVY))
    ep = execution_plan(planner.last_request, res)
    topo = Topology(world_size=8, local_world_size=8, compute_device="cuda", hbm_cap=80 << 30)
    cons = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(TABLES)}
    repriced = reprice_plan(ep, planner, _model(), cons, topo, 2048, planner.profile(), top=2)
    again = repriced.evaluated.rewrites
    assert (again.batch_split, again.id_dtype) == (res.rewrites.batch_split, res.rewrites.id_dtype)
    assert repriced.evaluated.rewritten_step_s == pytest.approx(ep.prediction.step_time_s, rel=1e-9)


def test_dedup_is_chosen_per_feature_where_the_observed_ratio_pays_and_shortens_the_step():
    from torchrec_sparselift.semantics.workload import FeatureStats, WorkloadStats

    # f0, f1 repeat their ids (5% distinct), the others do not; 20 ids per sample
    stats = WorkloadStats(features=[FeatureStats(feature=f"f{i}", pooling_factor=20.0, unique_ratio=0.05 if i < 2 else 1.0)
                                    for i in range(TABLES)])
    fast = _profile(**COMM_HEAVY, dedup_id_s=1e-11)  # at 140 MB/s a 4-byte id costs 29 ns on the link
    _, res = _plan(fast, workload=stats, pipelines=["base"])
    r = res.rewrites
    assert r.dedup_features == ("f0", "f1") and r.id_dtype == "int32"
    assert r.input_dist_saved_s > 0 and r.step_s < r.step_without_s  # base waits for the input all-to-all
    assert res.optimizations().dedup_features == ("f0", "f1")
    _, slow = _plan(_profile(**COMM_HEAVY, dedup_id_s=1e-3), workload=stats, pipelines=["base"])
    assert slow.rewrites.dedup_features == () and "no feature's distinct ids are few enough" in _notes(slow)
    _, off = _plan(fast, workload=stats, pipelines=["base"], rewrites=["id_dtype"])
    assert off.rewrites.dedup_features == () and off.rewrites.step_s > r.step_s


def test_a_2d_plan_records_why_it_has_no_rewrites():
    topo = Topology(world_size=8, local_world_size=4, compute_device="cuda")
    planner = SparseLiftPlanner(topology=topo, batch_size=512, hardware=_profile(**COMM_HEAVY), debug=False,
                                time_budget_s=2, solver="heuristic", sharding_group_size=4)
    res = planner.plan_with_result(_model(), get_default_sharders())
    assert res.sharding_group_size == 4 and "a 2D plan" in _notes(res)
    o = res.optimizations()
    assert (o.batch_split, o.id_dtype, o.dedup_features) == (1, "int64", ())
    assert res.step_time_s == res.search.step.total_s + res.sync_s


def test_forced_rewrites_are_priced_as_the_stage_prices_its_choice_and_a_forced_split_may_cost():
    from torchrec_sparselift.plan.rewrites import price_rewrites

    planner, res = _plan(_profile(**COMM_HEAVY))
    r, req = res.rewrites, planner.last_request
    assert r.batch_split > 1
    forced = price_rewrites(req, res, batch_split=r.batch_split, id_dtype=r.id_dtype)
    assert forced == pytest.approx(r.step_s, rel=1e-9)  # the choice, forced, is its own price
    assert price_rewrites(req, res) == pytest.approx(r.step_without_s, rel=1e-9)  # nothing forced
    assert price_rewrites(req, res, id_dtype="int32") <= r.step_without_s  # overlap hides the input dist
    base_planner, base = _plan(_profile(**COMM_HEAVY), pipelines=["base"])  # base waits for it
    assert price_rewrites(base_planner.last_request, base, id_dtype="int32") < base.rewrites.step_without_s
    with pytest.raises(ValueError, match="chunks the 'overlap' pipeline"):
        price_rewrites(base_planner.last_request, base, batch_split=2)
    # a chunk dearer than the transfer it hides: the forced split is slower than no split
    dear_planner, dear = _plan(_profile(**COMM_HEAVY, chunk_overhead_s=0.05))
    assert dear.rewrites.batch_split == 1
    slow = price_rewrites(dear_planner.last_request, dear, batch_split=8)
    assert slow > dear.rewrites.step_without_s
    with pytest.raises(ValueError, match="no chunk_overhead_s"):
        uncal_planner, uncal = _plan(_profile(**COMM_HEAVY, chunk_overhead_s=None))
        price_rewrites(uncal_planner.last_request, uncal, batch_split=2)
    with pytest.raises(ValueError, match="not model-parallel features"):
        price_rewrites(req, res, dedup_features=["nope"])
