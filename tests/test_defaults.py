"""One set of defaults: the planner, its request, the command line and the example agree."""

from __future__ import annotations

import inspect

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_sparselift import SparseLiftPlanner, defaults
from torchrec_sparselift.plan import PlanRequest
from torchrec_sparselift.plan.request import describe_reservation


def _planner_request(**kw) -> PlanRequest:
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"])], device=torch.device("meta"))
    planner = SparseLiftPlanner(topology=Topology(world_size=2, compute_device="cpu"), debug=False, **kw)
    return planner.request(ebc, get_default_sharders())


def test_the_planner_plans_with_the_defaults_module():
    req = _planner_request()
    assert req.time_budget_s == defaults.TIME_BUDGET_S
    assert req.batch_size == defaults.BATCH_SIZE
    assert describe_reservation(req.storage_reservation)["_percentage"] == defaults.STORAGE_RESERVATION_PERCENTAGE
    assert req.solver == defaults.SOLVER and req.layout_2d == defaults.LAYOUT_2D
    init = inspect.signature(SparseLiftPlanner.__init__).parameters
    assert init["heuristical_storage_reservation_percentage"].default == defaults.STORAGE_RESERVATION_PERCENTAGE
    assert init["drift_tolerance"].default == defaults.DRIFT_TOLERANCE


def test_the_request_defaults_are_the_planners():
    fields = {f.name: f.default for f in PlanRequest.__attrs_attrs__}
    assert fields["time_budget_s"] == defaults.TIME_BUDGET_S
    assert fields["solver"] == defaults.SOLVER
    assert fields["layout_2d"] == defaults.LAYOUT_2D


def test_the_2d_defaults():
    from torchrec_sparselift.cost.two_d import DEFAULT_MAX_SYNC_INTERVAL, PARITY_EVIDENCE, choose_sync_interval

    assert DEFAULT_MAX_SYNC_INTERVAL == defaults.MAX_SYNC_INTERVAL
    assert defaults.MAX_SYNC_INTERVAL == max(PARITY_EVIDENCE)  # the largest interval measured at parity
    assert inspect.signature(choose_sync_interval).parameters["max_overhead"].default == defaults.SYNC_OVERHEAD


def _cli_plan_args():
    from torchrec_sparselift.cli import build_parser

    return build_parser().parse_args(["plan", "--workload", "dlrm-small"])


def test_the_cli_time_budget_is_the_planners():
    assert _cli_plan_args().time_budget == defaults.TIME_BUDGET_S


def test_the_cli_batch_size_is_the_planners():
    from torchrec_sparselift import cli

    assert _cli_plan_args().batch_size is None  # then the planner's (or the workload's) batch size
    assert cli.DEFAULT_BATCH_SIZE == defaults.BATCH_SIZE


def test_ranks_per_host():
    topo = Topology(world_size=4, local_world_size=2, compute_device="cpu")
    assert defaults.ranks_per_host(topo) == 2
    assert defaults.ranks_per_host(environ={"LOCAL_WORLD_SIZE": "3"}, world_size=6) == 3
    assert defaults.ranks_per_host(environ={}, world_size=6) == 6
    assert defaults.ranks_per_host(environ={}) == 1
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='0'"):
        defaults.ranks_per_host(environ={"LOCAL_WORLD_SIZE": "0"})
