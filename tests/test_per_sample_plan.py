"""A plan that splits the batch carries the dense model's per-sample declaration: ``lift`` hands it
to the batch-split pipeline, so a model the user declared per-sample to the planner trains as
planned without declaring it again (2 gloo ranks), and a plan without it is refused as before."""

from __future__ import annotations

from typing import Any, Dict

import attrs
import pytest
import torch
from launcher import run_ranks
from test_batch_split import WORLD, _batches, _model, _sharded

from torchrec_sparselift.plan.execution_plan import Optimizations
from torchrec_sparselift.runtime.model_parallel import resolve_settings


class _Halved(torch.nn.Module):
    """Per-sample, but a module the per-sample check does not know."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x


@attrs.frozen
class _Plan:  # the two attributes the runtime reads of an execution plan
    sharding_plan: Any
    optimizations: Optimizations


def _declared_model() -> torch.nn.Module:
    model = _model()
    model.model.dense_arch.model = torch.nn.Sequential(_Halved(), model.model.dense_arch.model)
    return model


def _run(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from torchrec_sparselift.runtime import lift

    dmp, _opt = _sharded("table_wise")
    out: Dict[str, Any] = {}
    for declared in (True, False):
        plan = _Plan(dmp.plan, Optimizations(pipeline="overlap", batch_split=2, per_sample=declared))
        try:
            lifted = lift(_declared_model(), plan, device=torch.device("cpu"),
                          embedding_optimizer=(RowWiseAdagrad, {"lr": 0.1}),
                          dense_optimizer_factory=lambda params: torch.optim.Adagrad(params, lr=0.05))
            it = iter(_batches(rank, 3))
            losses = [float(lifted.pipeline.progress(it)[0]) for _ in range(3)]
            out[declared] = (type(lifted.pipeline).__name__, losses)
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            out[declared] = (type(e).__name__, str(e))
    return out


def test_a_plan_that_splits_carries_the_per_sample_declaration_to_the_pipeline():
    for rank, r in enumerate(run_ranks(_run, WORLD, timeout_s=300)):
        cls, losses = r[True]
        assert cls == "TrainPipelineBatchSplit" and len(losses) == 3, (rank, r[True])
        kind, message = r[False]
        assert kind == "NotPerSample" and "_Halved" in message, (rank, r[False])


def test_the_declaration_needs_a_split_and_follows_the_chunks():
    with pytest.raises(ValueError, match="batch_split=1 splits nothing"):
        Optimizations(pipeline="overlap", per_sample=True)
    plan = _Plan(None, Optimizations(pipeline="overlap", batch_split=4, per_sample=True))
    plan = attrs.evolve(plan, sharding_plan=__import__("torchrec").distributed.types.ShardingPlan({}))
    assert resolve_settings(plan)[1].per_sample
    assert not resolve_settings(plan, batch_split=1)[1].per_sample
    assert not resolve_settings(plan, pipeline="sparse_dist")[1].per_sample  # the chunks it split are gone


def test_torchrecs_dcn_model_is_per_sample_without_a_declaration():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM_DCN, DLRMTrain

    from torchrec_sparselift.semantics.per_sample import per_sample_violation

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10,
                                                            feature_names=[f"f{i}"]) for i in range(3)],
                                 device=torch.device("meta"))
    model = DLRMTrain(DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8, 8],
                               over_arch_layer_sizes=[8, 1], dcn_num_layers=2, dcn_low_rank_dim=4))
    assert per_sample_violation(model) is None  # its LowRankCrossNet keeps its weights in ParameterLists
    model.model.over_arch.add_module("norm", torch.nn.BatchNorm1d(1))
    assert "BatchNorm1d" in per_sample_violation(model, declared=True)
