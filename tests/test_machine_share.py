"""Ranks sharing one machine's cores: the planner leaves out the pipelines whose overlap needs a
core per rank (``overlaps_between_hosts``) when more ranks share a machine than it has cores."""

from __future__ import annotations

import os
import warnings

from launcher import run_ranks

# (the machine share the planner is told, the pipelines passed) per case
CASES = {"more_ranks_than_cores": ((4, 2), None), "enough_cores": ((2, 2), None),
         "list_passed": ((4, 2), ["overlap", "sparse_dist"])}


def _plan_cases(rank: int, world: int):
    import torch.distributed as dist
    from torchrec.distributed.planner import Topology

    import torchrec_sparselift.planner as planner_module
    import torchrec_sparselift.runtime.machine as machine
    from torchrec_sparselift import SparseLiftPlanner
    from torchrec_sparselift.measure.probe import ProbeTable, ProbeWorkload, probe_model

    out = {"measured": machine.machine_share()}
    w = ProbeWorkload("tiny", (ProbeTable("t0", 200, 8, ("f0",)), ProbeTable("t1", 100, 8, ("f1",))),
                      batch_size=16)
    # one rank per host: the ranks span hosts, where the overlap pipelines are offered on CPU
    topo = Topology(world_size=world, local_world_size=1, compute_device="cpu")
    for name, (share, pipelines) in CASES.items():
        planner_module.machine_share = lambda pg=None, share=share: share  # what the planner calls
        planner = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, pipelines=pipelines, time_budget_s=1.0,
                                    debug=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ep = planner.collective_plan_execution(probe_model(w), pg=dist.group.WORLD)
        out[name] = {"pipelines": list(planner.last_request.pipelines), "chosen": ep.optimizations.pipeline,
                     "warnings": [str(c.message) for c in caught if "share a machine" in str(c.message)]}
    # one planner reused: planned where ranks outnumber the cores, then where they do not
    planner = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, time_budget_s=1.0, debug=False)
    reused = []
    for share in ((4, 2), (2, 2)):
        planner_module.machine_share = lambda pg=None, share=share: share
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planner.collective_plan_execution(probe_model(w), pg=dist.group.WORLD)
        reused.append(list(planner.last_request.pipelines))
    out["reused"] = reused
    # a link measurement passed in carries the machine share: no all-gather, its numbers
    from types import SimpleNamespace

    planner_module.machine_share = lambda pg=None: (2, 2)
    planner = SparseLiftPlanner(topology=topo, batch_size=w.batch_size, time_budget_s=1.0, debug=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner.collective_plan_execution(probe_model(w), pg=dist.group.WORLD,
                                          link=SimpleNamespace(machine_ranks=4, machine_cores=2))
    out["from_link"] = list(planner.last_request.pipelines)
    return out


def test_the_overlap_pipelines_need_a_core_per_rank():
    results = run_ranks(_plan_cases, 2, timeout_s=240)
    # the measurement: both ranks on this machine, its cores
    assert results[0]["measured"] == results[1]["measured"] == (2, os.cpu_count())
    # more ranks than cores: overlap left out on every rank, one warning (rank 0)
    for r in results:
        more = r["more_ranks_than_cores"]
        assert "overlap" not in more["pipelines"] and "sparse_dist" in more["pipelines"], more
        # TorchRec's fused only issues the output all-to-all early: no core of its own, kept
        assert "fused" in more["pipelines"] and "overlap_stale" not in more["pipelines"], more
        assert more["chosen"] != "overlap"
    warned = results[0]["more_ranks_than_cores"]["warnings"]
    assert len(warned) == 1 and results[1]["more_ranks_than_cores"]["warnings"] == []
    assert "4 ranks share a machine with 2 CPU cores" in warned[0] and "overlap" in warned[0]
    assert "pipelines=" in warned[0]
    # enough cores, or a pipeline list the user passed: kept as it was
    assert "overlap" in results[0]["enough_cores"]["pipelines"] and results[0]["enough_cores"]["warnings"] == []
    assert results[0]["list_passed"]["pipelines"] == ["overlap", "sparse_dist"]
    assert results[0]["list_passed"]["warnings"] == []
    # a planner reused on a machine with cores to spare offers the overlap pipelines again
    crowded, roomy = results[0]["reused"]
    assert "overlap" not in crowded and "overlap" in roomy
    assert roomy == results[0]["enough_cores"]["pipelines"]
    # the link record's machine share decides when a link is passed (the all-gather said 2 on 2)
    assert results[0]["from_link"] == crowded
