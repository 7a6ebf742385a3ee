"""The stale overlap pipeline (runtime/stale.py, kind ``overlap_stale``) on 2 gloo ranks: exactly
one step of embedding staleness (its losses equal TorchRec's ``TrainPipelineSemiSync`` stale from
the first step, whose lookup of batch i+1 also reads the weights before step i's update, and differ
from the exact ``TrainPipelineBase``), it trains, it really reorders (the next batch's output
all-to-all in flight during the dense backward, the gradient all-to-all during the next dense
forward, the dense all-reduce in chunks during the dense backward, with the same arithmetic), and
it is offered only with ``allow_staleness``."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch

from launcher import run_ranks
from test_overlap import WORLD, _batches, _sharded
from training_helpers import local_values

STEPS = 24


def _train(dmp, opt, make, batches, traced=False):  # type: ignore[no-untyped-def]
    from torchrec_sparselift.runtime.overlap import CommTimeline

    pipe = make(dmp, opt, torch.device("cpu"))
    it = iter(batches)
    timeline = CommTimeline()
    if traced:
        timeline.install(dmp, pipe)
    losses = []
    for _ in range(len(batches)):
        timeline.mark("step_start")
        losses.append(float(pipe.progress(it)[0]))
        timeline.mark("step_end")
    with pytest.raises(StopIteration):  # flushes the last step's embedding update
        pipe.progress(it)
    timeline.uninstall()
    return losses, [(what, kind) for _t, what, kind, _c in timeline.events] if traced else []


def _run(rank: int, world: int) -> Dict[str, Any]:
    import warnings

    from torchrec.distributed.train_pipeline import TrainPipelineBase

    from torchrec_sparselift.runtime.pipelines import make_train_pipeline

    warnings.filterwarnings("ignore")
    batches = _batches(rank, STEPS)
    ref_dmp, ref_opt = _sharded()
    start = copy.deepcopy(dict(ref_dmp.state_dict()))
    out: Dict[str, Any] = {"class": []}

    def stale(dmp, opt, device):  # type: ignore[no-untyped-def]
        pipe = make_train_pipeline("overlap_stale", dmp, opt, device, options={"early_allreduce": True})
        out["class"].append(type(pipe).__name__)
        return pipe

    out["semi_sync"], _ = _train(ref_dmp, ref_opt, lambda d, o, dev: make_train_pipeline(
        "semi_sync", d, o, dev, options={"start_batch": 0}), batches)
    st_dmp, st_opt = _sharded(copy.deepcopy(start))
    from torchrec_sparselift.runtime import stale as stale_module

    # the early all-reduce in chunks of 16 floats: many chunks, each issued during the backward
    stale_module.EARLY_ALLREDUCE_CHUNK_BYTES = 64
    out["stale"], out["trace"] = _train(st_dmp, st_opt, stale, batches, traced=True)
    base_dmp, base_opt = _sharded(copy.deepcopy(start))
    out["base"], _ = _train(base_dmp, base_opt, TrainPipelineBase, batches)
    # start_batch: every step before it exact (here all of them)
    warm_dmp, warm_opt = _sharded(copy.deepcopy(start))
    out["warm"], _ = _train(warm_dmp, warm_opt, lambda d, o, dev: make_train_pipeline(
        "overlap_stale", d, o, dev, options={"start_batch": STEPS}), batches)
    for name, dmp in (("semi_sync", ref_dmp), ("stale", st_dmp)):
        out[name + "_weights"] = {k: local_values(v).clone() for k, v in dmp.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_ranks(_run, WORLD, timeout_s=300)


def test_overlap_stale_is_exactly_one_step_stale_like_semi_sync(results):
    for rank, r in enumerate(results):
        assert r["class"] == ["TrainPipelineOverlapStale"]
        torch.testing.assert_close(torch.tensor(r["stale"]), torch.tensor(r["semi_sync"]), rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"rank {rank}: {m}")
        # the first step looks up the initial weights under every pipeline; later ones differ from exact
        assert r["stale"][0] == pytest.approx(r["base"][0], rel=1e-6)
        assert any(abs(a - b) > 1e-6 for a, b in zip(r["stale"][2:], r["base"][2:]))


def test_overlap_stale_runs_exactly_before_start_batch(results):
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["warm"]), torch.tensor(r["base"]), rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"rank {rank}: {m}")
    from torchrec_sparselift.runtime.stale import TrainPipelineOverlapStale

    with pytest.raises(ValueError, match="start_batch must be an int >= 0"):
        TrainPipelineOverlapStale(torch.nn.Linear(1, 1), None, torch.device("cpu"), start_batch=-1)


def test_overlap_stale_final_weights_equal_semi_sync_after_flush(results):
    for rank, r in enumerate(results):
        for k, v in r["semi_sync_weights"].items():
            torch.testing.assert_close(r["stale_weights"][k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"rank {rank} {k}: {m}")


def test_overlap_stale_trains(results):
    for r in results:
        first, last = sum(r["stale"][:6]) / 6, sum(r["stale"][-6:]) / 6
        assert last < first


def _steps(trace):
    steps, cur = [], None
    for what, kind in trace:
        if what == "step_start":
            cur = []
        elif what == "step_end":
            steps.append(cur)
        elif cur is not None:
            cur.append((what, kind))
    return steps[1:-1]


def _pos(step, what, kind=""):
    return next(i for i, e in enumerate(step) if e == (what, kind))


def test_overlap_stale_collectives_in_flight_during_dense_work(results):
    """Per steady step: the previous batch's gradient all-to-all is waited for only after this
    batch's dense forward; the next batch's output all-to-all is issued before the dense backward
    (and not waited for in this step); this batch's gradient all-to-all is issued after the
    dense backward and not waited for in this step."""
    for r in results:
        steps = _steps(r["trace"])
        assert len(steps) >= 10
        for st in steps:
            assert _pos(st, "dense_fwd_end") < _pos(st, "wait_start", "grad_dist") < _pos(st, "issue", "output_dist") \
                < _pos(st, "dense_bwd_start") < _pos(st, "issue", "grad_dist"), st
            issued_out = _pos(st, "issue", "output_dist")
            assert ("wait_start", "output_dist") not in st[issued_out:], st
            # the dense all-reduce starts during the dense backward, in chunks, not as one at its end
            issues = [i for i, e in enumerate(st) if e == ("issue", "allreduce")]
            assert len(issues) > 2 and issues[0] < _pos(st, "dense_bwd_start") < _pos(st, "graph_done"), st
            assert ("wait_start", "grad_dist") not in st[_pos(st, "issue", "grad_dist"):], st


def test_overlap_stale_is_offered_only_with_allow_staleness():
    from torchrec_sparselift import vocabulary as v
    from torchrec_sparselift.runtime import pipelines as runtime_pipelines
    from torchrec_sparselift.runtime.stale import TrainPipelineOverlapStale

    p = v.pipeline("overlap_stale")
    assert p.stale and not p.dense_kernel and not p.syncs_2d_replicas
    assert "overlap_stale" in v.STALE_PIPELINES and "overlap_stale" not in v.SYNC_PIPELINES
    assert runtime_pipelines.pipeline_class("overlap_stale", torch.device("cpu")) is TrainPipelineOverlapStale

    from torchrec_sparselift.validation import planner_option_problems

    kw = dict(topology=None, batch_size=8, timeout_seconds=30, time_budget_s=10, known_pipelines=v.PIPELINES,
              stale_pipelines=v.STALE_PIPELINES, solver="auto", sharding_group_size=None, sync_interval=4,
              drift_tolerance=0.2, reservation_percentage=0.15)
    problems = planner_option_problems(pipelines=["overlap_stale"], allow_staleness=False, **kw)
    assert any("'overlap_stale'" in p and "allow_staleness=True" in p for p in problems), problems
    assert not planner_option_problems(pipelines=["overlap_stale"], allow_staleness=True, **kw)


def test_overlap_stale_refuses_dense_kernel_tables_and_2d():
    from torchrec.distributed.types import ParameterSharding, ShardingPlan

    from torchrec_sparselift.runtime.model_parallel import check_pipeline_supports_plan
    from torchrec_sparselift.runtime.pipelines import make_train_pipeline

    plan = ShardingPlan({"m.ebc": {"t0": ParameterSharding(sharding_type="data_parallel", compute_kernel="dense",
                                                          ranks=[0, 1])}})
    with pytest.raises(ValueError, match=r"'overlap_stale' needs fused embedding kernels.*m\.ebc\.t0"):
        check_pipeline_supports_plan("overlap_stale", plan)
    with pytest.raises(ValueError, match="never syncs 2D replicas"):
        make_train_pipeline("overlap_stale", torch.nn.Linear(1, 1), None, torch.device("cpu"), sync_interval=4)


def test_overlap_stale_step_hides_the_output_and_gradient_all_to_alls():
    """The step model: against sparse_dist (everything after the input_dist in sequence) the stale
    kind hides min(output_dist, dense_bwd) + min(grad_dist, dense_fwd)."""
    from torchrec_sparselift.cost.pipelines import evaluate, pipeline_kind, terms

    ph = dict(input_dist=4.0, lookup=30.0, output_dist=51.0, dense_fwd=80.0, dense_bwd=155.0, grad_dist=54.0,
              backward_update=60.0, allreduce=35.0, step_overhead=10.0)
    for out_d, grad_d in ((51.0, 54.0), (170.0, 120.0), (10.0, 300.0)):
        ph.update(output_dist=out_d, grad_dist=grad_d)
        t = terms(ph, supports_overlap=False)
        sparse = evaluate(pipeline_kind("sparse_dist").step, t)
        stale = evaluate(pipeline_kind("overlap_stale").step, t)
        assert sparse - stale == pytest.approx(min(out_d, ph["dense_bwd"]) + min(grad_d, ph["dense_fwd"]))


def test_planner_picks_overlap_stale_only_with_allow_staleness_where_it_pays():
    """The DLRM example's tables table-wise on two one-rank CPU hosts: exact, the planner keeps a
    kind that overlaps between hosts without staleness (``fused``: with the all-reduce after the
    embedding backward on CPU, ``overlap`` hides no more than it); with ``allow_staleness`` the
    stale kind's shorter step wins; on one host (where CPU gloo overlaps nothing) neither is chosen."""
    import warnings

    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_sparselift.dlrm.model import arch_spec, build_model
    from torchrec_sparselift.dlrm.tables import preset_tables, scale_tables

    from torchrec_sparselift import SparseLiftPlanner

    tables = scale_tables(preset_tables("dcnv2", 64), 0.001)
    cons = {t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables}
    chosen = {}
    for local in (1, 2):
        for stale in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                topo = Topology(world_size=2, local_world_size=local, compute_device="cpu")
            planner = SparseLiftPlanner(topology=topo, batch_size=1024, hardware="cpu-gloo", allow_staleness=stale,
                                        constraints=cons)
            planner.plan(build_model(tables, "dcn", arch_spec("small", 64)), get_default_sharders())
            r = planner.last_result
            chosen[local, stale] = (r.optimizations().pipeline, r.step_time_s)
    assert chosen[1, False][0] in ("fused", "overlap") and chosen[1, True][0] == "overlap_stale"
    assert chosen[1, True][1] < chosen[1, False][1]
    assert chosen[2, False][0] not in ("overlap_stale", "semi_sync") and chosen[2, True][0] != "overlap_stale"


def test_the_timeline_shows_overlap_stale_hiding_both_all_to_alls():
    from torchrec_sparselift.explain import comm_exposure, format_timeline, step_timeline

    ph = dict(input_dist=0.004, lookup=0.030, output_dist=0.051, dense_fwd=0.080, dense_bwd=0.155,
              grad_dist=0.054, backward_update=0.060, allreduce=0.035, step_overhead=0.010)
    segs = step_timeline(ph, "overlap_stale", supports_overlap=False, spans_hosts=True)
    comm = comm_exposure(segs)
    assert comm["output_dist"][0] == pytest.approx(min(ph["output_dist"], ph["dense_bwd"]), rel=1e-9)
    assert comm["grad_dist"][0] == pytest.approx(min(ph["grad_dist"], ph["dense_fwd"]), rel=1e-9)
    assert comm["allreduce"] == pytest.approx((0.0, ph["allreduce"]), abs=1e-12)  # CPU: in full
    assert "previous batch" in format_timeline(segs, 0.370)
    # on one CPU host (no overlap) it is priced as base: nothing hidden
    assert all(h == 0.0 for h, _ in comm_exposure(step_timeline(ph, "overlap_stale", False, False)).values())


@pytest.mark.parametrize("argv, message", [
    (["--pipeline", "overlap_stale"], "--pipeline overlap_stale trains on one-step-stale embeddings; add --allow-staleness"),
    (["--pipeline", "semi_sync"], "add --allow-staleness"),
    (["--allow-staleness", "--planner", "torchrec"], "--allow-staleness applies to --planner sparselift"),
    (["--allow-staleness", "--measured-guard", "2"], "does not combine with --measured-guard"),
])
def test_the_example_refuses_staleness_it_was_not_allowed(argv, message, dlrm_main):
    from torchrec_sparselift.dlrm.options import TrainOptions

    code, err = dlrm_main([*argv, "--check"])
    assert code == 2 and message in err, err
    assert TrainOptions(allow_staleness=True, pipeline="overlap_stale").allow_staleness
