"""The planner facade: TorchRec's ``stats`` argument is honoured, and the names that moved out of
planner.py are still importable from it and from the package."""

import os
import warnings

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import Stats
from torchrec.distributed.sharding_plan import get_default_sharders

import torchrec_sparselift
from torchrec_sparselift import SparseLiftPlanner
from torchrec_sparselift.plan import PlanCache, PlanRequest

warnings.filterwarnings("ignore", category=FutureWarning)


def _ebc():
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=10_000,
                                   feature_names=[f"f{i}"]) for i in range(3)],
        device=torch.device("meta"),
    )


class Recorder(Stats):
    def __init__(self):
        self.calls = []

    def log(self, **kw):
        self.calls.append(kw)


def _planner(**kw):
    return SparseLiftPlanner(topology=Topology(world_size=4, local_world_size=4, compute_device="cuda"),
                             batch_size=64, debug=False, time_budget_s=1, **kw)


def test_stats_get_the_final_plan_as_embedding_sharding_planner_gives_it():
    one, two = Recorder(), Recorder()
    planner = _planner(stats=[one, two])
    plan = planner.plan(_ebc(), get_default_sharders())
    for rec in (one, two):
        assert len(rec.calls) == 1
        call = rec.calls[0]
        assert call["sharding_plan"] is plan
        assert {o.name for o in call["best_plan"]} == {"t0", "t1", "t2"}
        assert call["batch_size"] == 64 and call["topology"].world_size == 4
    # a single Stats object and TorchRec's own EmbeddingStats work too
    single = Recorder()
    _planner(stats=single).plan(_ebc(), get_default_sharders())
    assert len(single.calls) == 1
    _planner(stats=EmbeddingStats()).plan(_ebc(), get_default_sharders())


def test_moved_names_are_importable_from_the_facade_and_the_package():
    from torchrec_sparselift import planner
    from torchrec_sparselift.cost.report import rank_breakdown
    from torchrec_sparselift.plan.evaluate import evaluate_sharding_plan
    from torchrec_sparselift.plan.result import PlanResult
    from torchrec_sparselift.semantics.dense import dense_work

    assert planner.rank_breakdown is rank_breakdown
    assert planner.evaluate_sharding_plan is evaluate_sharding_plan is torchrec_sparselift.evaluate_sharding_plan
    assert planner.PlanResult is PlanResult is torchrec_sparselift.PlanResult
    assert planner.dense_work is dense_work
    from torchrec_sparselift.errors import SparseLiftPlannerError
    from torchrec_sparselift.search.errors import SparseLiftPlannerError as old_home

    assert old_home is SparseLiftPlannerError is torchrec_sparselift.SparseLiftPlannerError


def test_one_plan_builds_exactly_one_request_and_every_consumer_reads_it(tmp_path, monkeypatch):
    built = []
    real_init = PlanRequest.__init__

    def counting_init(self, **kw):
        real_init(self, **kw)
        built.append(self)

    monkeypatch.setattr(PlanRequest, "__init__", counting_init)
    _planner().plan(_ebc(), get_default_sharders())
    assert len(built) == 1
    for hit in (False, True):  # with a cache: planned and stored, then loaded
        built.clear()
        planner = _planner(cache_dir=str(tmp_path))
        planner.plan(_ebc(), get_default_sharders())
        assert len(built) == 1 and planner.last_cache_hit is hit
        ep = planner.last_execution_plan  # keyed by, and carrying, the request's fingerprint
        assert ep.fingerprint == built[0].fingerprint(versions=ep.fingerprint.versions)
        assert os.path.exists(PlanCache(tmp_path).path_for(built[0].fingerprint()))


def test_feature_processors_on_cuda_leave_fused_out_of_the_pipelines_chosen_among():
    """A FeatureProcessedEmbeddingBagCollection on CUDA: TorchRec's ``fused`` would look up before
    the dense optimizer updates the processor's weights, so the plan chooses among the others; on
    CPU, or without feature processors, ``fused`` stays."""
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    def model(fp: bool) -> torch.nn.Module:
        m = torch.nn.Module()
        m.ebc = _ebc()
        if fp:
            m.fp = FeatureProcessedEmbeddingBagCollection(
                EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="w", embedding_dim=64, num_embeddings=1000,
                                                                  feature_names=["w_f"])],
                                       is_weighted=True, device=torch.device("meta")),
                PositionWeightedModuleCollection({"w_f": 10}))
        return m

    sharders = get_default_sharders()
    assert "fused" in _planner().request(model(False), sharders).pipelines
    req = _planner().request(model(True), sharders)
    assert "fused" not in req.pipelines and "sparse_dist" in req.pipelines
    res = _planner().plan_with_result(model(True), sharders)
    assert res.search.pipeline != "fused"
    cpu = SparseLiftPlanner(topology=Topology(world_size=2, local_world_size=2, compute_device="cpu"),
                            batch_size=64, debug=False, time_budget_s=1)
    assert "fused" in cpu.request(model(True), sharders).pipelines
    with warnings.catch_warnings(record=True) as caught:  # asked for by name: a warning says why it is left out
        warnings.simplefilter("always")
        asked = _planner(pipelines=["sparse_dist", "fused"]).request(model(True), sharders)
    assert asked.pipelines == ("sparse_dist",)
    assert any("fused" in str(w.message) and "fp" in str(w.message) for w in caught)
