"""The one measurement routine (measure.probe.measure_plan): per-step slowest rank, pinning restored."""

import os
import statistics

import pytest

from launcher import run_ranks


def _measure(rank, world_size):
    import torch.distributed as dist

    from torchrec_sparselift.measure import probe
    from torchrec_sparselift.measure.steps import forced_plan, probe_topology

    w = probe.ProbeWorkload("t", probe._tables("t", [(200, 8, 1, 1.0), (100, 8, 2, 2.0)]), dense=(16,),
                            over=(16, 1), batch_size=32)
    plan, _ = forced_plan(probe.probe_model(w), w.tables, "table_wise", probe_topology(world_size, "cpu"), w.batch_size,
                          dist.group.WORLD)
    batches = probe.prebuilt_batches(w, 3, seed=0, rank=rank)
    before = os.sched_getaffinity(0)
    during = []

    def pipeline(dmp, opt, device):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        during.append(os.sched_getaffinity(0))
        return TrainPipelineSparseDist(dmp, opt, device, execute_all_batches=True)

    m = probe.measure_plan("t", lambda: probe.probe_model(w), plan, batches, steps=4, warmup=2, pg=dist.group.WORLD,
                           pipeline_factory=pipeline, pin=True, attribute=2)
    from torchrec_sparselift.calibration.attribution import measured_groups

    groups = measured_groups(m.attribution, m.median_s)
    return dict(before=before, during=during[0], after=os.sched_getaffinity(0), m=m,
                att=m.attribution.to_dict(), groups=groups)


def test_measure_plan_times_the_slowest_rank_per_step_and_restores_the_affinity():
    a, b = run_ranks(_measure, 2, timeout_s=240)
    for r, res in enumerate((a, b)):
        m = res["m"]
        assert len(m.durations_s) == 6 and len(m.cpu_durations_s) == 6 and m.steps == 4
        assert m.median_s == statistics.median(m.durations_s[2:])
        assert res["after"] == res["before"]  # pinned only during the run
        cpus, k = sorted(res["before"]), len(res["before"]) // 2
        if k >= 1:
            assert res["during"] == set(cpus[r * k:(r + 1) * k])  # local rank -> its own slice of the cores
    assert a["m"].durations_s == b["m"].durations_s  # every rank reports the per-step maximum
    # attribute=2: two more steps under the profiler after the timed ones, every rank's kinds
    for res in (a, b):
        att = res["att"]
        assert [r["rank"] for r in att["ranks"]] == [0, 1] and all(r["steps"] == 2 for r in att["ranks"])
        assert all(r["kinds_ms"]["lookup"] > 0 and r["kinds_ms"]["dense_fwd"] > 0 for r in att["ranks"])
        # the fit groups of the attribution partition the (unprofiled) timed step
        assert sum(res["groups"].values()) == pytest.approx(res["m"].median_s)
        assert res["groups"]["sparse"] > 0 and res["groups"]["comm"] > 0 and res["groups"]["dense"] > 0


def test_pooling_constraints_give_each_table_its_pooling_factor_and_nothing_else():
    from torchrec_sparselift.measure.probe import ProbeTable, pooling_constraints

    tables = (ProbeTable("a", 100, 8, ("f1", "f2"), 2.0), ProbeTable("b", 50, 8, ("f3",), 3.5))
    cons = pooling_constraints(tables)
    assert cons["a"].pooling_factors == [2.0, 2.0] and cons["b"].pooling_factors == [3.5]
    assert cons["a"].sharding_types is None and cons["a"].compute_kernels is None
