"""Per-module 2D configs (``ModuleTwoD``, ``build_2d_model_parallel(submodule_configs=...)``): an
unknown module type name or a value of the wrong type is a ``ValueError`` naming the module type and
listing the valid values, never a ``TypeError`` from inside attrs or TorchRec."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
from torchrec.distributed.types import ShardingPlan

from launcher import run_ranks
from torchrec_sparselift.runtime.two_d import MODULE_TYPES_2D, ModuleTwoD, TwoDConfig, build_2d_model_parallel

EMPTY = ShardingPlan({})


def test_a_module_type_is_a_class_or_a_known_name():
    assert ModuleTwoD("EmbeddingCollection", EMPTY, sharding_group_size=2).module_type is EmbeddingCollection
    assert ModuleTwoD(EmbeddingBagCollection, EMPTY, sharding_group_size=2).module_type is EmbeddingBagCollection
    assert sorted(MODULE_TYPES_2D) == ["EmbeddingBagCollection", "EmbeddingCollection"]


@pytest.mark.parametrize("module_type, says", [
    ("EmbeddingCollections", "unknown module type 'EmbeddingCollections'; valid names: "
                             "['EmbeddingBagCollection', 'EmbeddingCollection']"),
    (3, "module_type must be an nn.Module class or one of ['EmbeddingBagCollection', 'EmbeddingCollection'], got 3"),
    (int, "module_type must be an nn.Module class"),
    (None, "got None (NoneType)"),
])
def test_an_unknown_or_mistyped_module_type_lists_the_valid_names(module_type, says):
    with pytest.raises(ValueError) as e:
        ModuleTwoD(module_type, EMPTY, sharding_group_size=2)
    assert says in str(e.value)


@pytest.mark.parametrize("kw, says", [
    (dict(plan={}), "ModuleTwoD(EmbeddingCollection): plan must be a ShardingPlan"),
    (dict(sharding_group_size="2"), "ModuleTwoD(EmbeddingCollection): sharding_group_size must be an integer >= 1, "
                                    "got '2'"),
    (dict(sharding_group_size=True), "sharding_group_size must be an integer >= 1, got True"),
    (dict(sharding_group_size=0), "sharding_group_size must be an integer >= 1, got 0"),
    (dict(strategy="fully"), "ModuleTwoD(EmbeddingCollection): unknown strategy 'fully'; valid: "),
    (dict(strategy=None), "unknown strategy None; valid: "),
    (dict(layout=1), "unknown layout 1; valid: "),
])
def test_a_value_of_the_wrong_type_names_the_module_and_the_valid_values(kw, says):
    args = {"plan": EMPTY, "sharding_group_size": 2, **kw}
    with pytest.raises(ValueError) as e:
        ModuleTwoD(EmbeddingCollection, **args)
    assert says in str(e.value)
    if "strategy" in kw:
        assert "'default'" in str(e.value) and "'fully_sharded'" in str(e.value)


def test_a_group_size_of_the_wrong_type_is_a_value_error():
    with pytest.raises(ValueError, match="sharding_group_size must be an integer >= 1, got '2'"):
        TwoDConfig(world_size=4, sharding_group_size="2")


def _bad_configs(rank, world_size):
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8,
                                                             feature_names=["f"])], device=torch.device("meta"))
    model = torch.nn.Sequential(ebc)
    out = []
    for configs in ([{"module": "EmbeddingBagCollection"}],
                    [ModuleTwoD(EmbeddingCollection, EMPTY, sharding_group_size=1)],
                    [ModuleTwoD(EmbeddingBagCollection, EMPTY, sharding_group_size=1)] * 2,
                    [ModuleTwoD(EmbeddingBagCollection, EMPTY, sharding_group_size=3)]):
        try:
            build_2d_model_parallel(model, EMPTY, 1, torch.distributed.group.WORLD, torch.device("cpu"),
                                    submodule_configs=configs)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("accepted")
    return out


def test_bad_per_module_configs_of_the_collection_name_the_entry_and_the_fix():
    msgs = run_ranks(_bad_configs, 2, timeout_s=120)[0]
    assert msgs[0].startswith("submodule_configs[0]: takes ModuleTwoD values") and "got dict" in msgs[0]
    assert msgs[1] == ("submodule_configs[0]: the model has no EmbeddingCollection module (its embedding module "
                       "types: ['EmbeddingBagCollection']); configure one of those")
    assert msgs[2] == ("submodule_configs[1]: module type EmbeddingBagCollection is configured twice; "
                       "give each type once")
    assert msgs[3].startswith("submodule_configs[0] (EmbeddingBagCollection): ") and "3" in msgs[3], msgs[3]
