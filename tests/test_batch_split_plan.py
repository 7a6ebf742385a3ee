"""The execution plan's batch split (Optimizations.batch_split): validated, serialized and read
back equal, and read by the runtime wrapper (resolve_settings, make_train_pipeline)."""

from __future__ import annotations

import json

import pytest
import torch

from test_execution_plan import _constructed_plan, _execution_plan
from torchrec_sparselift.plan.execution_plan import ExecutionPlan, Optimizations
from torchrec_sparselift.runtime.model_parallel import RuntimeSettings, resolve_settings
from torchrec_sparselift.runtime.pipelines import make_train_pipeline


def test_batch_split_round_trips_through_json():
    plan = _execution_plan(_constructed_plan(), pipeline="overlap", batch_split=4)
    data = json.loads(plan.to_json())
    assert data["optimizations"]["batch_split"] == 4
    back = ExecutionPlan.from_json(plan.to_json())
    assert back == plan and back.optimizations.batch_split == 4
    assert "batch split 4" in back.summary()


def test_a_plan_stored_without_batch_split_reads_as_unsplit():
    data = json.loads(_execution_plan(_constructed_plan(), pipeline="overlap").to_json())
    del data["optimizations"]["batch_split"]
    back = ExecutionPlan.from_dict(data)
    assert back.optimizations.batch_split == 1 and "batch split" not in back.summary()


@pytest.mark.parametrize("kwargs, message", [
    ({"pipeline": "overlap", "batch_split": 0}, "batch_split must be an int >= 1"),
    ({"pipeline": "overlap", "batch_split": 17}, "at most 16 chunks"),
    ({"pipeline": "overlap", "batch_split": True}, "batch_split must be an int"),
    ({"pipeline": "sparse_dist", "batch_split": 2}, "choose pipeline='overlap' or batch_split=1"),
])
def test_optimizations_refuse_a_bad_batch_split_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Optimizations(**kwargs)


def test_the_runtime_reads_the_plan_s_batch_split():
    plan = _execution_plan(_constructed_plan(), pipeline="overlap", batch_split=4)
    _, settings = resolve_settings(plan)
    assert settings.batch_split == 4 and settings.pipeline == "overlap"
    assert "batch split 4" in RuntimeSettings(pipeline="overlap", batch_split=4).label()
    _, settings = resolve_settings(plan, batch_split=2)
    assert settings.batch_split == 2 and settings.predicted_step_s is None  # another configuration
    # a pipeline keyword that replaces overlap drops the chunks that split it
    _, settings = resolve_settings(plan, pipeline="sparse_dist")
    assert settings.batch_split == 1 and settings.pipeline == "sparse_dist"
    with pytest.raises(ValueError, match="choose pipeline 'overlap' or batch_split=1"):
        resolve_settings(plan, pipeline="sparse_dist", batch_split=2)
    _, settings = resolve_settings(plan.sharding_plan, pipeline="overlap", batch_split=3)
    assert settings.batch_split == 3


def test_make_train_pipeline_refuses_a_batch_split_of_another_kind():
    with pytest.raises(ValueError, match="splits the 'overlap' pipeline's all-to-alls"):
        make_train_pipeline("sparse_dist", torch.nn.Linear(1, 1), None, torch.device("cpu"), batch_split=2)


def test_a_per_sample_declaration_is_dropped_where_the_plan_splits_nothing(monkeypatch):
    import torchrec_sparselift.runtime.pipelines as pipelines

    built = {}

    class Recorder:
        def __init__(self, model, optimizer, device, **kwargs):  # type: ignore[no-untyped-def]
            built.update(kwargs)

    monkeypatch.setattr(pipelines, "pipeline_class", lambda kind, device: Recorder)
    make_train_pipeline("overlap", torch.nn.Linear(1, 1), None, torch.device("cpu"),
                        options={"per_sample": True, "chain_chunks": False, "other": 1}, batch_split=1)
    assert built == {"other": 1}
