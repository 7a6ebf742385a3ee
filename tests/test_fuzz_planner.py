"""Fuzzed planning: hypothesis draws table sets, constraints, topologies and batch sizes.

Whatever it draws, ``SparseLiftPlanner`` either returns a plan or raises a documented error
(``PlannerError`` or ``ValueError``, with a message). Every returned plan

* places every table exactly once, every shard on a rank that exists;
* keeps every rank within its reserved memory (device memory on GPU, DDR on CPU; host memory too);
* uses only sharding types and compute kernels the table's constraints allow;
* is identical when the same input is planned again by a fresh planner;

and ``validate_inputs`` never refuses an input the planner could plan.

The default run is bounded (25 derandomized examples, mostly small worlds). The long run
(up to 1024 simulated GPUs, ``SPARSELIFT_FUZZ_EXAMPLES`` examples, default 300, random seed)::

    pytest -m slow tests/test_fuzz_planner.py
    SPARSELIFT_FUZZ_EXAMPLES=2000 pytest -m slow tests/test_fuzz_planner.py

Draws also cover the solver ("auto", "heuristic", "milp"), lossy communication, staleness and 2D
sharding groups. A plan whose search a wall-clock limit cut short is exempt from the identity
check (see ``time_limited``); SPARSELIFT_FUZZ_STRICT_DETERMINISM=1 checks it too.
"""

import os
import warnings
from typing import Dict, Optional, Tuple

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.cost.model import DEV_MEM, HOST_MEM
from torchrec_sparselift.semantics.workload import declare
from torchrec_sparselift.validation import validate_inputs

warnings.filterwarnings("ignore")
MiB, GiB, TiB = 1024**2, 1024**3, 1024**4

TYPES = {
    "cuda": ["data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise"],
    "cpu": ["data_parallel", "table_wise", "column_wise", "row_wise", "table_row_wise"],
}
KERNELS = {"cuda": ["dense", "fused", "fused_uvm", "fused_uvm_caching"], "cpu": ["dense", "fused"]}
SLOW_EXAMPLES = int(os.environ.get("SPARSELIFT_FUZZ_EXAMPLES", "300"))
STRICT_DETERMINISM = os.environ.get("SPARSELIFT_FUZZ_STRICT_DETERMINISM") == "1"


@attrs.frozen
class Case:
    """One drawn planning input (printed by hypothesis when a property fails)."""

    device: str
    world_size: int
    local_world_size: int
    hbm: int
    ddr: int
    batch_size: int
    tables: Tuple[Tuple[str, int, int, float], ...]  # name, rows, dim, pooling factor
    constraints: Tuple[Tuple[str, Optional[Tuple[str, ...]], Optional[Tuple[str, ...]], Optional[int]], ...]
    stats: Optional[Tuple[Tuple[str, float], ...]]
    solver: str = "auto"
    lossy_comm: bool = False
    staleness: bool = False
    group: object = None  # sharding_group_size: None (1D), "auto" or a divisor of world_size

    def module(self) -> EmbeddingBagCollection:
        return EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
                    for n, r, d, _ in self.tables],
            device=torch.device("meta"),
        )

    def topology(self) -> Topology:
        return Topology(world_size=self.world_size, local_world_size=self.local_world_size,
                        compute_device=self.device, hbm_cap=self.hbm, ddr_cap=self.ddr)

    def parameter_constraints(self) -> Dict[str, ParameterConstraints]:
        pfs = {n: pf for n, _, _, pf in self.tables}
        out = {n: ParameterConstraints(pooling_factors=[pfs[n]]) for n in pfs}
        for name, types, kernels, min_partition in self.constraints:
            out[name] = ParameterConstraints(
                sharding_types=list(types) if types else None,
                compute_kernels=list(kernels) if kernels else None,
                min_partition=min_partition, pooling_factors=[pfs[name]],
            )
        return out

    def workload(self):
        return declare({f"f_{n}": pf for n, pf in self.stats}) if self.stats else None

    def planner(self) -> SparseLiftPlanner:
        return SparseLiftPlanner(topology=self.topology(), batch_size=self.batch_size,
                                 constraints=self.parameter_constraints(), workload=self.workload(),
                                 debug=False, time_budget_s=2, solver=self.solver,
                                 allow_lossy_comm=self.lossy_comm, allow_staleness=self.staleness,
                                 sharding_group_size=self.group)


def log_int(lo: int, hi: int):
    """Integers in [lo, hi], roughly log-uniform (tiny and huge values both show up)."""
    return st.floats(np.log10(lo), np.log10(hi)).map(lambda x: int(min(hi, max(lo, round(10**x)))))


@st.composite
def cases(draw, max_hosts: int = 4, max_tables: int = 20) -> Case:
    device = draw(st.sampled_from(["cuda", "cuda", "cuda", "cpu"]))
    local = draw(st.sampled_from([1, 2, 4, 8]))
    hosts = draw(st.integers(1, max_hosts))
    world = local * hosts
    n = draw(st.integers(1, max_tables))
    tables = tuple(
        (f"t{i}", draw(log_int(1, 10**9)), 4 * draw(st.integers(1, 128)),
         draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 200.0)))
        for i in range(n)
    )
    constrained = draw(st.lists(st.sampled_from([t[0] for t in tables]), unique=True, max_size=min(n, 8)))
    cons = []
    for name in constrained:
        types = draw(st.none() | st.lists(st.sampled_from(TYPES[device]), min_size=1, unique=True).map(tuple))
        kernels = draw(st.sampled_from([None, None, None])
                       | st.lists(st.sampled_from(KERNELS[device]), min_size=1, unique=True).map(tuple))
        min_partition = draw(st.none() | st.sampled_from([4, 8, 16, 32, 64]))
        cons.append((name, types, kernels, min_partition))
    stats = None
    if draw(st.booleans()):
        named = draw(st.lists(st.sampled_from([t[0] for t in tables]), unique=True, min_size=1, max_size=n))
        stats = tuple((nm, draw(st.floats(0.0, 100.0))) for nm in sorted(named))
    # memory per rank relative to the tables' weights spread evenly: 1/10x (hopeless) to 300x
    even = sum(r * d * 4 for _, r, d, _ in tables) / world
    hbm = int(np.clip(even * 10 ** draw(st.floats(-1.0, 2.5)), MiB, 4 * TiB))
    ddr = int(np.clip(hbm * 10 ** draw(st.floats(-1.0, 1.5)), 16 * MiB, 16 * TiB))
    # group sizes the planner accepts: divisors of the world that hold whole hosts or fit in one
    divisors = [g for g in range(1, world + 1)
                if world % g == 0 and (g == world or g % local == 0 or local % g == 0)]
    # 2D grouping: "auto" needs at least 2 ranks (see test_auto_sharding_group_on_one_rank_plans_1d)
    group = draw(st.sampled_from([None, None, None, None, *(["auto"] if world > 1 else []), *divisors]))
    return Case(
        device=device, world_size=world, local_world_size=local, hbm=hbm, ddr=ddr,
        batch_size=draw(log_int(1, 65536)), tables=tables, constraints=tuple(cons), stats=stats,
        solver=draw(st.sampled_from(["auto", "auto", "heuristic", "milp"])),
        lossy_comm=draw(st.booleans()), staleness=draw(st.booleans()), group=group,
    )


def check_case(case: Case) -> Optional[str]:
    """Plan ``case`` twice and check every property; returns the plan's text (None: refused)."""
    module = case.module()
    planner = case.planner()
    try:
        result = planner.plan_with_result(module, get_default_sharders())
    except (PlannerError, ValueError) as e:
        msg = str(e)
        assert msg.strip(), f"{type(e).__name__} without a message"
        assert "internal error" not in msg, msg
        return None

    topo = case.topology()
    W = case.world_size
    names = [t[0] for t in case.tables]
    cons = case.parameter_constraints()

    # every table exactly once, every shard on a rank that exists (in its sharding group for 2D)
    if result.sharding_group_size:
        W = result.sharding_group_size
        assert case.group is not None and case.world_size % W == 0
    plan = result.sharding_plan.plan
    assert list(plan) == [""]
    assert sorted(plan[""]) == sorted(names)
    assert sorted(o.name for o in result.sharding_options) == sorted(names)
    for opt in result.sharding_options:
        assert opt.shards, opt.name
        for s in opt.shards:
            assert s.rank is not None and 0 <= s.rank < W, (opt.name, s.rank)
        ps = plan[""][opt.name]
        assert ps.sharding_type == opt.sharding_type and ps.compute_kernel == opt.compute_kernel
        assert all(0 <= r < W for r in ps.ranks)
        # constraints respected
        c = cons[opt.name]
        if c.sharding_types:
            assert opt.sharding_type in c.sharding_types, (opt.name, opt.sharding_type, c.sharding_types)
        if c.compute_kernels:
            assert opt.compute_kernel in c.compute_kernels, (opt.name, opt.compute_kernel, c.compute_kernels)
        if case.device == "cpu":
            assert opt.compute_kernel in KERNELS["cpu"]

    # memory: per rank within the reserved capacity the planner was given, which is within the topology's
    prob, search = result.problem, result.search
    assert search.status != "memory_violation", search.status
    raw_dev = np.array([d.storage.ddr if case.device == "cpu" else d.storage.hbm
                        for d in topo.devices[:W]], float)
    assert np.all(prob.device_cap <= raw_dev + 1)
    loads = search.rank_loads
    assert np.all(loads[:, DEV_MEM] <= prob.device_cap * (1 + 1e-9) + 1), (loads[:, DEV_MEM], prob.device_cap)
    assert np.all(loads[:, HOST_MEM] <= prob.host_cap * (1 + 1e-9) + 1), (loads[:, HOST_MEM], prob.host_cap)
    if not case.lossy_comm:
        assert (search.fwd_precision, search.bwd_precision) == ("fp32", "fp32")
    if not case.staleness:
        assert search.pipeline != "semi_sync"
    used_dev = np.zeros(W)
    used_host = np.zeros(W)
    for opt in result.sharding_options:
        for s in opt.shards:
            used_dev[s.rank] += s.storage.ddr if case.device == "cpu" else s.storage.hbm
            used_host[s.rank] += 0 if case.device == "cpu" else s.storage.ddr
    assert np.all(used_dev <= prob.device_cap + 1 * len(names)), (used_dev, prob.device_cap)
    if case.device != "cpu":
        assert np.all(used_host <= prob.host_cap + 1 * len(names)), (used_host, prob.host_cap)

    # validation never refuses what the planner can plan
    validate_inputs(result.handles, topo, case.batch_size, cons, case.workload())

    # identical when repeated (see time_limited: a search cut by a wall-clock limit may differ)
    again = case.planner().plan_with_result(case.module(), get_default_sharders())
    text = str(result.sharding_plan)
    if STRICT_DETERMINISM or not (time_limited(result) or time_limited(again)):
        assert str(again.sharding_plan) == text
        assert (again.search.pipeline, again.search.fwd_precision) == (search.pipeline, search.fwd_precision)
    return text


def time_limited(result) -> bool:
    """Whether a wall-clock limit cut the search (MILP, LP or local search).

    Such plans depend on machine load, so two runs of one input can differ (planner issue
    reported with ``test_time_limited_plans_are_reproducible``); the fuzzer then checks every
    property but identity, unless SPARSELIFT_FUZZ_STRICT_DETERMINISM=1.
    """
    s = result.search
    return "time_limit" in s.solver or s.status == "time_limit"


FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)
SLOW = settings(max_examples=SLOW_EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)


@FAST
@given(cases(max_hosts=4, max_tables=20))
def test_fuzzed_inputs_plan_validly_or_raise_documented_errors(case):
    check_case(case)


@FAST
@given(cases(max_hosts=2, max_tables=60).map(lambda c: attrs.evolve(c, hbm=64 * MiB, ddr=256 * MiB)))
def test_fuzzed_many_tables_in_little_memory_plan_validly_or_raise_documented_errors(case):
    check_case(case)


@pytest.mark.slow
@SLOW
@given(cases(max_hosts=128, max_tables=60))
def test_fuzzed_inputs_up_to_1024_ranks_slow(case):
    check_case(case)


def test_check_case_sees_both_outcomes():
    """Neither branch of ``check_case`` is vacuous: a roomy case plans, an impossible one is refused."""
    roomy = Case(device="cuda", world_size=4, local_world_size=2, hbm=64 * GiB, ddr=256 * GiB,
                 batch_size=256, tables=(("a", 10**5, 64, 3.0), ("b", 10**6, 128, 20.0)),
                 constraints=(("b", ("row_wise", "column_wise"), None, None),), stats=(("a", 2.0),))
    text = check_case(roomy)
    assert text is not None and ("row_wise" in text or "column_wise" in text)
    impossible = attrs.evolve(roomy, hbm=MiB, ddr=16 * MiB, tables=(("big", 10**9, 512, 1.0),),
                              constraints=(), stats=None)
    assert check_case(impossible) is None


# Found by this fuzzer: HiGHS stops at its wall-clock limit with one of several equally good
# incumbents, so the same input planned repeatedly (in one process) yields different rank
# placements depending on load (about 3 runs in 10 on a loaded 2-core machine). Harmless under
# collective_plan (rank 0 plans and broadcasts), wrong for plan() called on every rank.
TIME_LIMITED_CASE = Case(
    device="cuda", world_size=4, local_world_size=2, hbm=1586134291, ddr=16178603616, batch_size=33,
    tables=(("t0", 36846, 432, 1.0), ("t1", 173, 452, 1.0), ("t2", 97339, 292, 80.92967466840587),
            ("t3", 1, 332, 0.0), ("t4", 136798, 128, 1.0), ("t5", 172905, 180, 0.0), ("t6", 1, 452, 1.0)),
    constraints=(("t5", ("data_parallel", "column_wise"), None, None), ("t2", None, None, 16),
                 ("t0", None, None, 16), ("t1", None, ("fused_uvm", "dense"), 4),
                 ("t4", ("column_wise", "data_parallel", "table_row_wise", "table_wise", "row_wise"),
                  None, 8)),
    stats=None,
)


def test_time_limited_plans_are_reproducible():
    plans = {str(TIME_LIMITED_CASE.planner().plan_with_result(TIME_LIMITED_CASE.module(),
                                                                get_default_sharders()).sharding_plan)
             for _ in range(6)}
    assert len(plans) == 1


def test_auto_sharding_group_on_one_rank_plans_1d():
    one = Case(device="cuda", world_size=1, local_world_size=1, hbm=8 * GiB, ddr=64 * GiB, batch_size=64,
               tables=(("a", 1000, 16, 1.0),), constraints=(), stats=None, group="auto")
    assert check_case(one) is not None
