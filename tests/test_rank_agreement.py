"""collective_plan on 2 gloo ranks: ranks that plan different inputs fail loudly, on every rank,
naming the ranks that differ; ranks that plan the same input get the identical plan.

One spawn runs every scenario in sequence (about 10-20 s on 2 CPU cores).
"""

import pytest

from conftest import spawn

GiB = 1024**3


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

    out = {}
    out["tables"] = attempt(model(3 if rank == 0 else 4), topo(), 32)
    out["batch_size"] = attempt(model(3), topo(), 32 if rank == 0 else 64)
    out["topology"] = attempt(model(3), topo(4 * GiB if rank == 0 else 8 * GiB), 32)
    cons = {"t0": ParameterConstraints(sharding_types=["row_wise"])} if rank == 1 else None
    out["constraints"] = attempt(model(3), topo(), 32, cons)
    out["same"] = attempt(model(3), topo(), 32)
    out["same_again"] = attempt(model(3), topo(), 32)  # the group still works after the errors
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_scenarios, 2, timeout_s=120)


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
