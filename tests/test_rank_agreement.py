"""collective_plan on 2 gloo ranks: ranks that plan different inputs fail loudly, on every rank,
naming the ranks that differ; ranks that plan the same input get the identical plan.

One launch runs every scenario in sequence (about 10-20 s on 2 CPU cores). An error that stays
on one rank would leave the other waiting in a collective: those scenarios run on groups that
time out after HANG_TIMEOUT_S, so a regression shows up as the gloo timeout's error on the
waiting rank (the tests check every rank's error kind and message), not as a hung suite.
"""

import pytest

from launcher import run_ranks

pytestmark = pytest.mark.multiprocess

GiB = 1024**3
HANG_TIMEOUT_S = 60  # guards against a hang only; nothing here is timed


def _scenarios(rank: int, world_size: int):
    """Runs on every rank; returns {scenario: ("plan", str(plan)) | ("error", type, message)}."""
    import warnings

    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    from torchrec_sparselift import SparseLiftPlanner

    warnings.filterwarnings("ignore")

    def model(num_tables):
        return EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=1000 * (i + 1),
                                       feature_names=[f"f{i}"]) for i in range(num_tables)],
            device=torch.device("meta"),
        )

    def topo(ddr=4 * GiB):
        return Topology(world_size=world_size, local_world_size=world_size, compute_device="cpu",
                        ddr_cap=ddr)

    def attempt(module, topology, batch_size, constraints=None):
        planner = SparseLiftPlanner(topology=topology, batch_size=batch_size,
                                    constraints=constraints, debug=False, time_budget_s=2)
        try:
            return ("plan", str(planner.collective_plan(module, pg=dist.GroupMember.WORLD)))
        except Exception as e:  # noqa: BLE001 - the test inspects what every rank raised
            return ("error", type(e).__name__, str(e))

    # Scenarios that hang when an error stays on one rank run last, each on its own group with a
    # timeout, so a hang shows up as a gloo timeout after HANG_TIMEOUT_S instead of 30 min.
    from datetime import timedelta

    groups = [dist.new_group(ranks=list(range(world_size)), backend="gloo",
                             timeout=timedelta(seconds=HANG_TIMEOUT_S)) for _ in range(2)]

    def on_group(module, topology, batch_size, pg):
        planner = SparseLiftPlanner(topology=topology, batch_size=batch_size, debug=False, time_budget_s=2)
        try:
            return ("plan", str(planner.collective_plan(module, pg=pg)))
        except Exception as e:  # noqa: BLE001 - the test inspects what every rank raised
            return ("error", type(e).__name__, str(e))

    out = {}
    out["tables"] = attempt(model(3 if rank == 0 else 4), topo(), 32)
    out["batch_size"] = attempt(model(3), topo(), 32 if rank == 0 else 64)
    out["topology"] = attempt(model(3), topo(4 * GiB if rank == 0 else 8 * GiB), 32)
    cons = {"t0": ParameterConstraints(sharding_types=["row_wise"])} if rank == 1 else None
    out["constraints"] = attempt(model(3), topo(), 32, cons)
    out["same"] = attempt(model(3), topo(), 32)
    out["same_again"] = attempt(model(3), topo(), 32)  # the group still works after the errors
    # same input on every rank, but no plan fits: rank 0 raises while planning
    out["same_unplannable"] = on_group(model(3), topo(ddr=64 * 1024), 32, groups[0])
    # rank 1's input is malformed (a table with 0 rows): its fingerprint raises before the check
    bad = model(3)
    if rank == 1:
        cfg = EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=10, feature_names=["f2"])
        cfg.num_embeddings = 0
        bad = EmbeddingBagCollection(tables=[*model(2).embedding_bag_configs(), cfg],
                                     device=torch.device("meta"))
    out["one_rank_malformed"] = on_group(bad, topo(), 32, groups[1])
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_scenarios, 2, timeout_s=300)


@pytest.mark.parametrize("scenario", ["tables", "batch_size", "topology", "constraints"])
def test_ranks_with_different_inputs_all_raise_naming_the_ranks(results, scenario):
    for rank in (0, 1):
        outcome = results[rank][scenario]
        assert outcome[0] == "error", f"rank {rank} planned despite different inputs: {outcome}"
        _, kind, message = outcome
        assert kind == "SparseLiftPlannerError"
        assert "ranks [1] differ from ranks [0]" in message


def test_ranks_with_the_same_input_get_the_identical_plan(results):
    plans = [results[rank]["same"] for rank in (0, 1)]
    assert all(p[0] == "plan" for p in plans), plans
    assert plans[0][1] == plans[1][1]
    assert "t0" in plans[0][1] and "t2" in plans[0][1]
    assert results[0]["same_again"] == results[0]["same"] == results[1]["same_again"]


def test_a_planning_error_on_rank_0_is_raised_on_every_rank(results):
    # rank 1 gets rank 0's error, not the gloo timeout it would get waiting for a plan
    for rank in (0, 1):
        outcome = results[rank]["same_unplannable"]
        assert outcome[0] == "error" and outcome[1] == "SparseLiftPlannerError", (rank, outcome)
        assert "the whole cluster has 128.00 KiB" in outcome[2], (rank, outcome)


def test_malformed_input_on_one_rank_fails_every_rank_promptly(results):
    # rank 0 gets rank 1's error, not the gloo timeout it would get waiting for rank 1's input
    assert results[1]["one_rank_malformed"][:2] == ("error", "ValueError")
    outcome = results[0]["one_rank_malformed"]
    assert outcome[:2] == ("error", "ValueError"), outcome
    assert outcome[2].startswith("rank(s) [1] have invalid planning input: "), outcome
