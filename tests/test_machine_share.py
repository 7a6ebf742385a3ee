"""Ranks sharing one machine's cores: the planner leaves out the pipelines whose overlap needs a
core per rank (``overlaps_between_hosts``) when more ranks share a machine than it has cores."""

from __future__ import annotations

import os
import warnings

from launcher import run_ranks


def _plan(rank: int, world: int, share, pipelines):
    import torch.distributed as dist
    from torchrec.distributed.planner import Topology

    import torchrec_sparselift.runtime.machine as machine
    from torchrec_sparselift import SparseLiftPlanner
    from torchrec_sparselift.measure.probe import ProbeTable, ProbeWorkload, probe_model

    out = {"measured": machine.machine_share()}
    if share is not None:
        machine.machine_share = lambda pg=None: share  # the planner imports it at call time
    w = ProbeWorkload("tiny", (ProbeTable("t0", 200, 8, ("f0",)), ProbeTable("t1", 100, 8, ("f1",))),
                      batch_size=16)
    # one rank per host: the ranks span hosts, where the overlap pipelines are offered on CPU
    topo = Topology(world_size=world, local_world_size=1, compute_device="cpu")
    planner = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, pipelines=pipelines, time_budget_s=1.0,
                                debug=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ep = planner.collective_plan_execution(probe_model(w), pg=dist.group.WORLD)
    out["pipelines"] = list(planner._pipelines)
    out["chosen"] = ep.optimizations.pipeline
    out["warnings"] = [str(c.message) for c in caught if "share a machine" in str(c.message)]
    return out


def test_machine_share_counts_the_ranks_on_this_machine():
    results = run_ranks(_plan, 2, None, None, timeout_s=180)
    assert results[0]["measured"] == results[1]["measured"] == (2, os.cpu_count())
    assert "overlap" in results[0]["pipelines"] or results[0]["measured"][0] > results[0]["measured"][1]


def test_more_ranks_than_cores_leaves_out_the_overlap_pipelines_with_one_warning():
    results = run_ranks(_plan, 2, (4, 2), None, timeout_s=180)
    for r in results:
        assert "overlap" not in r["pipelines"] and "sparse_dist" in r["pipelines"], r
        assert r["chosen"] != "overlap"
    assert len(results[0]["warnings"]) == 1 and results[1]["warnings"] == []
    msg = results[0]["warnings"][0]
    assert "4 ranks share a machine with 2 CPU cores" in msg and "overlap" in msg and "pipelines=" in msg


def test_enough_cores_or_a_pipeline_list_the_user_passed_keeps_overlap():
    enough = run_ranks(_plan, 2, (2, 2), None, timeout_s=180)
    assert "overlap" in enough[0]["pipelines"] and enough[0]["warnings"] == []
    chosen = run_ranks(_plan, 2, (4, 2), ["overlap", "sparse_dist"], timeout_s=180)
    assert chosen[0]["pipelines"] == ["overlap", "sparse_dist"] and chosen[0]["warnings"] == []
