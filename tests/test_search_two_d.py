"""The 2D search (search/two_d.py) and the replica-sync bytes (cost/two_d.py), on their own: which
group sizes and layouts are tried, how the budget is split, which try wins, what a group sees."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from torchrec.distributed.planner.types import PlannerError, Topology

from torchrec_sparselift.cost.hardware import PRESETS
from torchrec_sparselift.cost.two_d import (
    DEFAULT_MAX_SYNC_INTERVAL,
    amortised_sync,
    group_sizes,
    replica_sync_bytes,
    replica_sync_s,
)
from torchrec_sparselift.errors import SparseLiftPlannerError
from torchrec_sparselift.search.two_d import (
    group_setting,
    group_topology,
    group_tries,
    search_groups,
    sync_pipelines,
)
from torchrec_sparselift.semantics.layout import Layout2D

GiB = 1 << 30


@attrs.frozen
class _Plan:
    step_time_s: float
    sharding_group_size: object
    layout_2d: object


class _Solver:
    """A solve_group that prices each (group, layout) from a table (5 s if not in it) and records
    every call."""

    def __init__(self, world, steps, refuse=()):
        self.world, self.steps, self.refuse, self.calls = world, steps, set(refuse), []

    def __call__(self, g, layout, budget):
        self.calls.append((g, layout.kind if layout else "1d", budget))
        if g in self.refuse:
            raise PlannerError(f"tables do not fit in {g} ranks\nsecond line")
        step = self.steps.get((g, layout.kind if layout else "1d"), 5.0)
        return _Plan(step, g if g < self.world else None, layout)


def test_auto_tries_every_group_size_and_both_layouts_on_several_hosts():
    tries, refused = group_tries(16, 8, "auto", "auto")
    assert [(g, lay.kind if lay else "1d") for g, lay in tries] == [
        (g, kind) for g in group_sizes(16, 8) if g < 16 for kind in ("contiguous", "strided")] + [(16, "1d")]
    assert refused == ()
    one_host, _ = group_tries(8, 8, 4, "auto")
    assert [lay.kind for _, lay in one_host] == ["strided"]  # on one host the layouts coincide


def test_a_group_size_no_layout_allows_is_a_named_refusal():
    tries, refused = group_tries(16, 8, 3, "auto")
    assert tries == () and len(refused) == 1 and refused[0].startswith("group size 3: ")


def test_budget_is_split_a_third_for_1d_a_third_over_the_2d_tries_and_the_rest_polishes():
    steps = {(8, "contiguous"): 3.0, (8, "strided"): 2.0, (16, "1d"): 2.5}
    solver = _Solver(16, steps)
    clock = iter([10.0 + 4.0]).__next__  # 4 s spent when the polish starts
    choice = search_groups(16, 8, 8, "auto", 12.0, 10.0, solver, clock=clock)
    assert solver.calls == [(8, "contiguous", 2.0), (8, "strided", 2.0), (8, "strided", 8.0)]
    assert choice.best.step_time_s == 2.0 and choice.best.layout_2d.kind == "strided"
    assert choice.alternatives_2d == ((8, 2.0),)
    assert choice.alternatives_layout == ((8, "contiguous", 3.0), (8, "strided", 2.0))


def test_1d_wins_ties_and_a_slower_polish_is_not_kept():
    steps = {(8, "contiguous"): 2.0, (8, "strided"): 2.0, (16, "1d"): 2.0}
    solver = _Solver(16, steps)
    choice = search_groups(16, 8, "auto", "auto", 9.0, 0.0, solver, clock=lambda: 100.0)
    assert choice.best.sharding_group_size is None  # the larger group on equal steps
    assert solver.calls[-1] == (16, "1d", 0.5)  # the budget is spent: the polish gets the floor
    assert dict(choice.alternatives_2d)[16] == 2.0

    class Slower(_Solver):
        def __call__(self, g, layout, budget):
            plan = super().__call__(g, layout, budget)
            return attrs.evolve(plan, step_time_s=9.0) if len(self.calls) > 3 else plan

    kept = search_groups(16, 8, 8, "auto", 9.0, 0.0, Slower(16, steps), clock=lambda: 0.0)
    assert kept.best.step_time_s == 2.0


def test_no_group_fitting_lists_every_group_sizes_reason():
    solver = _Solver(16, {}, refuse={2, 4, 8, 16})
    with pytest.raises(SparseLiftPlannerError, match="no sharding-group size fits") as e:
        search_groups(16, 8, "auto", "strided", 6.0, 0.0, solver)
    msg = str(e.value)
    for g in group_sizes(16, 8):
        assert f"group size {g}: tables do not fit in {g} ranks" in msg
    assert "second line" not in msg and e.value.kind == "insufficient_storage"


def test_a_group_sees_its_own_ranks_per_host_and_the_same_devices():
    topo = Topology(world_size=16, local_world_size=8, compute_device="cuda", hbm_cap=80 * GiB, ddr_cap=256 * GiB)
    layout, local, gtopo = group_setting(topo, 8, None, "auto")
    assert layout == Layout2D(16, 8, 8, "strided") and local == layout.group_ranks_per_host
    assert gtopo.world_size == 8 and gtopo.local_world_size == local
    assert gtopo.devices[0].storage == topo.devices[0].storage
    assert group_setting(topo, 16, None, "contiguous") == (None, 8, topo)
    cpu = Topology(world_size=4, local_world_size=4, compute_device="cpu", ddr_cap=8 * GiB)
    assert group_topology(cpu, 2).local_world_size == 2 and group_topology(cpu, 2).devices[0].storage.ddr == 8 * GiB


def test_2d_needs_a_pipeline_that_runs_the_sync_and_says_which():
    assert sync_pipelines(("base", "sparse_dist", "semi_sync")) == ("sparse_dist", "semi_sync")
    with pytest.raises(ValueError, match="allow sparse_dist"):
        sync_pipelines(("base", "fused"))


def test_replica_sync_bytes_are_the_fullest_ranks_weights_and_row_state():
    shards = [(100, 8, 4, (0, 1)), (50, 16, 2, (1,)), (10, 4, 4, (3,))]
    per_rank = [100 * 8 * 4 + 400, 100 * 8 * 4 + 400 + 50 * 16 * 2 + 200, 0, 10 * 4 * 4 + 40]
    assert replica_sync_bytes(shards, 4) == max(per_rank)
    lay = Layout2D(16, 8, 4, "strided")
    one = replica_sync_s(replica_sync_bytes(shards, 4), lay, PRESETS["h100"])
    assert one > 0
    assert amortised_sync(1.0, one, sync_interval=4) == (4, one / 4)
    interval, per_step = amortised_sync(1e-3, 1.0)
    assert interval == DEFAULT_MAX_SYNC_INTERVAL and per_step == pytest.approx(1.0 / interval)
    assert np.isclose(amortised_sync(1e-3, 1e-6)[1], 1e-6)


def test_a_2d_plans_dense_allreduce_spans_the_world_not_its_group():
    from torchrec_sparselift.cost.model import CostContext, DenseWork, _allreduce_s
    from torchrec_sparselift.search.equation import fixed_terms

    p = PRESETS["cpu-2core-gloo"] if "cpu-2core-gloo" in PRESETS else next(iter(PRESETS.values()))
    dense = DenseWork(param_bytes=8e6)
    group = CostContext(profile=p, world_size=2, local_world_size=1, batch_size=64, dense=dense)
    world = attrs.evolve(group, allreduce_world_size=4)  # DMPCollection's DDP: the global group
    assert world.allreduce_s_per_byte() == pytest.approx(2 * 3 / 4 / p.allreduce_bw)
    assert _allreduce_s(8e6, world) == pytest.approx(p.collective_latency_s + 8e6 * 1.5 / p.allreduce_bw)
    assert _allreduce_s(8e6, world) > _allreduce_s(8e6, group)
    # the solvers' step equation reads the same rate
    assert fixed_terms(world).allreduce_per_byte == pytest.approx(1e3 * world.allreduce_s_per_byte())
    with pytest.raises(ValueError, match="allreduce_world_size"):
        attrs.evolve(group, allreduce_world_size=1)
