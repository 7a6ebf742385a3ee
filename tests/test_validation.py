"""Bad planning input fails early with an error naming the table or field and the fix.

Two layers are pinned: ``validate_inputs`` itself, and what a user of ``SparseLiftPlanner`` sees
(``plan_with_result`` calls ``validate_inputs`` right after extracting the tables). Without that
call the planner accepted most of these inputs silently or crashed later (``test_planner_refuses_*``).
"""

import warnings

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_sparselift import SparseLiftPlanner, SparseLiftPlannerError
from torchrec_sparselift.semantics.reference_workloads import dcnv2, production
from torchrec_sparselift.semantics.tables import TableSpec, extract_tables
from torchrec_sparselift.semantics.workload import declare
from torchrec_sparselift.validation import validate_inputs

warnings.filterwarnings("ignore", category=FutureWarning)
GiB = 1024**3
META = torch.device("meta")


def _topo(world_size=2, device="cuda", local=2, hbm=80 * GiB, ddr=256 * GiB):
    return Topology(world_size=world_size, local_world_size=local, compute_device=device,
                    hbm_cap=hbm, ddr_cap=ddr)


def _ebc(*tables):
    """tables: (name, rows, dim, feature_names)."""
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=list(fs))
                for n, r, d, fs in tables],
        device=META,
    )


def _planner(topology=None, batch_size=64, constraints=None, workload=None):
    return SparseLiftPlanner(topology=topology or _topo(), batch_size=batch_size,
                             constraints=constraints, workload=workload, debug=False,
                             time_budget_s=2)


def _plan(module, **kw):
    return _planner(**kw).plan_with_result(module, get_default_sharders())


def _validate(module, topology=None, batch_size=64, constraints=None, stats=None):
    topology = topology or _topo()
    handles = extract_tables(module, get_default_sharders(), topology.compute_device, batch_size,
                             constraints, stats)
    validate_inputs(handles, topology, batch_size, constraints, stats)


# -- valid input passes ---------------------------------------------------------------------------
@pytest.mark.parametrize("workload", [dcnv2(), production(60, seed=7)], ids=["dcnv2", "production60"])
def test_reference_workloads_pass_validation(workload):
    _validate(workload.module(), _topo(16, local=8), workload.per_rank_batch(16), workload.constraints())


def test_validate_accepts_table_specs_and_handles_alike():
    m = _ebc(("t", 100, 8, ["f"]))
    handles = extract_tables(m, get_default_sharders(), "cuda", 64)
    assert validate_inputs(handles, _topo(), 64) is None
    assert validate_inputs([h.spec for h in handles], _topo(), 64) is None


# -- table shapes ---------------------------------------------------------------------------------
def test_zero_rows_are_refused_naming_the_table():
    cfg = EmbeddingBagConfig(name="empty", embedding_dim=8, num_embeddings=10, feature_names=["f"])
    cfg.num_embeddings = 0  # TorchRec's config refuses 0 at construction, not after
    m = EmbeddingBagCollection(tables=[cfg], device=META)
    assert m.embedding_bags["empty"].weight.shape[0] == 0
    with pytest.raises(ValueError, match="'empty'.*num_embeddings must be positive"):
        _plan(m)
    with pytest.raises(ValueError, match="'empty'"):
        _planner().plan_execution(m, get_default_sharders())


def test_zero_dim_is_refused_naming_the_table():
    m = _ebc(("flat", 100, 0, ["f"]))  # TorchRec builds this without complaint
    with pytest.raises(ValueError, match="'flat'.*embedding_dim must be positive"):
        _plan(m)


@pytest.mark.parametrize("field,value", [("num_embeddings", -5), ("embedding_dim", -4)])
def test_negative_shapes_are_refused_by_table_spec(field, value):
    kw = dict(module_path="m", name="neg", num_embeddings=10, embedding_dim=8, feature_names=("f",),
              pooling_factor=1.0, is_pooled=True, elem_bytes=4, sharding_types=("table_wise",),
              compute_kernels=(("table_wise", ("fused",)),))
    kw[field] = value
    with pytest.raises(ValueError, match=f"'m.neg'.*{field} must be positive"):
        TableSpec(**kw)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_dim_not_multiple_of_4_is_refused_for_fused_kernels(device):
    # FBGEMM's TBE asserts dim % 4 == 0 on CUDA and on CPU; the planner would pick row_wise/fused.
    m = _ebc(("odd", 10**7, 6, ["f"]))
    with pytest.raises(ValueError, match=r"'odd'.*embedding_dim 6.*multiple of 4.*pad it to 8"):
        _validate(m, _topo(4, device=device))


def test_dim_not_multiple_of_4_is_fine_when_constrained_to_dense():
    m = _ebc(("odd", 10**7, 6, ["f"]))
    cons = {"odd": ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["dense"])}
    _validate(m, _topo(4), constraints=cons)
    ps = _plan(m, topology=_topo(4), constraints=cons).sharding_plan.plan[""]["odd"]
    assert (ps.sharding_type, ps.compute_kernel) == ("data_parallel", "dense")


def test_planner_refuses_dim_not_multiple_of_4():
    with pytest.raises(ValueError, match="'odd'.*multiple of 4"):
        _plan(_ebc(("odd", 10**7, 6, ["f"])), topology=_topo(4))


# -- features -------------------------------------------------------------------------------------
def test_feature_in_two_tables_of_one_module_is_refused():
    m = _ebc(("a", 100, 8, ["shared", "x"]), ("b", 100, 8, ["shared"]))
    with pytest.raises(ValueError, match=r"feature 'shared' is looked up by tables \['a', 'b'\]"):
        _validate(m)


def test_same_feature_in_two_modules_is_allowed():
    bags = _ebc(("a", 100, 8, ["shared"]))
    seq = EmbeddingCollection(
        tables=[EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=100, feature_names=["shared"])],
        device=META,
    )
    _validate(torch.nn.ModuleDict({"bags": bags, "seq": seq}))


def test_planner_refuses_feature_in_two_tables():
    with pytest.raises(ValueError, match="'shared'"):
        _plan(_ebc(("a", 100, 8, ["shared"]), ("b", 100, 8, ["shared"])))


def test_statistics_for_unknown_features_are_refused():
    m = _ebc(("t", 100, 8, ["f"]))
    _validate(m, stats=declare(f=2.0))
    with pytest.raises(ValueError, match=r"features no table looks up: \['ghost'\]"):
        _validate(m, stats=declare(f=2.0, ghost=3.0))


def test_planner_refuses_statistics_for_unknown_features():
    with pytest.raises(ValueError, match="'ghost'"):
        _plan(_ebc(("t", 100, 8, ["f"])), workload=declare(f=2.0, ghost=3.0))


# -- batch size and topology ----------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [0, -8])
def test_non_positive_batch_size_is_refused(batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        _planner(batch_size=batch_size)
    with pytest.raises(ValueError, match="batch_size"):
        validate_inputs([], _topo(), batch_size)


def test_world_size_not_multiple_of_local_world_size_is_refused():
    topo = _topo(6, local=4)
    with pytest.raises(ValueError, match="world_size 6 is not a multiple of local_world_size 4"):
        _planner(topology=topo)
    with pytest.raises(ValueError, match="world_size 6 is not a multiple of local_world_size 4"):
        validate_inputs([], topo, 64)


def test_empty_world_is_refused():
    with pytest.raises(ValueError, match="world_size must be a positive"):
        validate_inputs([], _topo(0, local=1), 64)


def test_planner_refuses_empty_world():
    # Without validation: IndexError deep inside the search.
    with pytest.raises(ValueError, match="world_size must be a positive"):
        _plan(_ebc(("t", 100, 8, ["f"])), topology=_topo(0, local=1))


# -- constraints ----------------------------------------------------------------------------------
def test_constraints_naming_unknown_tables_are_refused():
    m = _ebc(("t", 100, 8, ["f"]))
    cons = {"nope": ParameterConstraints()}
    with pytest.raises(ValueError, match="'nope'"):
        _plan(m, constraints=cons)
    handles = extract_tables(m, get_default_sharders(), "cuda", 64)
    with pytest.raises(ValueError, match=r"tables the model does not have: \['nope'\]"):
        validate_inputs(handles, _topo(), 64, cons)


def test_sharding_types_excluding_all_the_device_runs_are_refused():
    # The CPU runtime cannot run table_column_wise: nothing is left for the table.
    cons = {"t": ParameterConstraints(sharding_types=["table_column_wise"])}
    with pytest.raises(ValueError, match=r"table 't'.*sharding_types=\['table_column_wise'\].*allow one"):
        _plan(_ebc(("t", 100, 8, ["f"])), topology=_topo(device="cpu"), constraints=cons)


def test_compute_kernels_invalid_for_the_sharding_types_are_refused():
    # 'dense' is the data-parallel kernel; table-wise tables need a fused one.
    cons = {"t": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["dense"])}
    with pytest.raises(ValueError, match=r"table 't': no compute kernel is left"):
        _plan(_ebc(("t", 100, 8, ["f"])), constraints=cons)


def test_min_partition_wider_than_a_column_wise_only_table_is_refused():
    m = _ebc(("t", 100, 16, ["f"]))
    cons = {"t": ParameterConstraints(sharding_types=["column_wise"], min_partition=32)}
    with pytest.raises(ValueError, match=r"'t'.*min_partition 32 is wider than the table.*at most 8"):
        _validate(m, constraints=cons)
    # with table_wise also allowed there is no contradiction: the table simply stays whole
    ok = {"t": ParameterConstraints(sharding_types=["column_wise", "table_wise"], min_partition=32)}
    _validate(m, constraints=ok)


def test_planner_refuses_min_partition_wider_than_column_wise_only_table():
    cons = {"t": ParameterConstraints(sharding_types=["column_wise"], min_partition=32)}
    with pytest.raises(ValueError, match="min_partition"):
        _plan(_ebc(("t", 100, 16, ["f"])), constraints=cons)


@pytest.mark.parametrize("field,value,bad", [
    ("sharding_types", ["rowwise", "table_wise"], "unknown sharding type 'rowwise'"),
    ("compute_kernels", ["fused", "fusd"], "unknown compute kernel 'fusd'"),
    ("pooling_factors", [3.0, -1.0], "pooling_factors must be finite numbers >= 0"),
    ("batch_sizes", [0], "batch_sizes must be positive"),
    ("min_partition", 0, "min_partition must be a positive int"),
])
def test_malformed_constraint_fields_are_refused(field, value, bad):
    m = _ebc(("t", 100, 16, ["f", "g"]))
    cons = {"t": ParameterConstraints(**{field: value})}
    with pytest.raises(ValueError, match=f"table 't': {bad}"):
        validate_inputs(extract_tables(m, get_default_sharders(), "cuda", 64), _topo(), 64, cons)


def test_planner_refuses_misspelt_sharding_type():
    # Without validation the typo was dropped silently and the table planned table_wise.
    cons = {"t": ParameterConstraints(sharding_types=["rowwise", "table_wise"])}
    with pytest.raises(ValueError, match="'rowwise'"):
        _plan(_ebc(("t", 100, 16, ["f"])), constraints=cons)


def test_every_problem_is_listed_in_one_error():
    m = _ebc(("a", 100, 8, ["shared"]), ("b", 100, 8, ["shared"]), ("c", 100, 6, ["h"]))
    with pytest.raises(ValueError) as e:
        _validate(m, stats=declare(ghost=1.0))
    msg = str(e.value)
    assert msg.startswith("3 problems")
    assert "'shared'" in msg and "'c'" in msg and "'ghost'" in msg


# -- memory ---------------------------------------------------------------------------------------
def test_table_too_big_for_any_rank_names_the_table():
    m = _ebc(("huge", 10**9, 128, ["f"]), ("small", 100, 16, ["g"]))
    cons = {"huge": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])}
    _validate(m, _topo(2, hbm=8 * GiB, ddr=1024 * GiB), constraints=cons)  # fits the cluster in total
    with pytest.raises(PlannerError, match=r"huge \(1000000000 x 128\).*GiB"):
        _plan(m, topology=_topo(2, hbm=8 * GiB), constraints=cons)


def test_tables_exceeding_the_whole_cluster_are_refused_before_search():
    m = _ebc(*[(f"t{i}", 2**21, 128, [f"f{i}"]) for i in range(8)])  # 8 x 1 GiB of weights
    topo = _topo(2, device="cpu", ddr=2 * GiB)  # 4 GiB in all
    with pytest.raises(SparseLiftPlannerError, match=r"need 8.00 GiB.*has 4.00 GiB") as e:
        _validate(m, topo)
    assert e.value.kind == "insufficient_storage"
    with pytest.raises(PlannerError) as e:  # from validation (before it: from the search)
        _plan(m, topology=topo)
    assert "GiB" in str(e.value) and any(f"t{i}" in str(e.value) for i in range(8))


def test_uvm_table_too_big_for_host_memory_reports_the_host_shortfall():
    # 4.77 GiB of weights in UVM (host memory) on ranks with 4 GiB DDR: the message said
    # "needs 0.00 GiB, a rank has 3.40 GiB (short by -3.40 GiB)".
    m = _ebc(("t0", 10**7, 128, ["f"]))
    cons = {"t0": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm"])}
    with pytest.raises(PlannerError) as e:
        _plan(m, topology=_topo(2, hbm=4 * GiB, ddr=4 * GiB), constraints=cons)
    msg = str(e.value)
    assert "t0" in msg and "short by -" not in msg and ("host" in msg or "DDR" in msg)


def test_small_memory_shortfalls_are_printed_in_readable_units():
    m = _ebc(("t", 1000, 16, ["f"]))  # 62.50 KiB of weights
    with pytest.raises(SparseLiftPlannerError, match=r"need 62.50 KiB but the whole cluster has 16.00 KiB"):
        _validate(m, _topo(2, device="cpu", ddr=8 * 1024))


def test_sharding_group_that_splits_a_host_unevenly_is_refused_naming_the_field():
    # 24 ranks, 8 per host: groups of 12 span one and a half hosts. Planning failed later with
    # "world_size 12 must be a multiple of local_world_size 8" (a world size the user never gave).
    with pytest.raises(ValueError, match="sharding_group_size"):
        SparseLiftPlanner(topology=_topo(24, local=8), batch_size=64, sharding_group_size=12, debug=False)


# -- every problem at once, before any value is built ---------------------------------------------
def test_problems_a_table_spec_would_raise_on_are_listed_with_the_rest():
    # A zero-row table and a negative pooling factor used to raise from TableSpec before
    # validate_inputs ran, hiding every other problem.
    m = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="empty", embedding_dim=8, num_embeddings=0, feature_names=["e"],
                                   weight_init_min=-0.1, weight_init_max=0.1)]
        + [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=100, feature_names=[f])
           for n, f in (("a", "shared"), ("b", "shared"), ("c", "c"))],
        device=META,
    )
    cons = {"c": ParameterConstraints(pooling_factors=[-2.0], sharding_types=["table_wise", "diagonal"])}
    with pytest.raises(ValueError) as e:
        _plan(m, constraints=cons, workload=declare(ghost=1.0))
    msg = str(e.value)
    assert msg.startswith("5 problems with the planning input")
    for says in ("'empty': num_embeddings must be positive, got 0", "'shared' is looked up by tables",
                 "pooling_factors must be finite numbers >= 0", "unknown sharding type 'diagonal'",
                 "features no table looks up: ['ghost']"):
        assert says in msg, says
    assert "constraints name tables" not in msg  # 'c' is a table, though it could not be built


def test_table_spec_refuses_what_validation_refuses_with_the_same_words():
    kw = dict(module_path="m", name="t", num_embeddings=10, embedding_dim=8, feature_names=("f",),
              pooling_factor=-1.0, is_pooled=True, elem_bytes=4, sharding_types=("table_wise",),
              compute_kernels=(("table_wise", ("fused",)),))
    with pytest.raises(ValueError, match=r"'m.t': pooling factor must be >= 0"):
        TableSpec(**kw)


def test_planner_arguments_are_checked_all_at_once():
    with pytest.raises(ValueError) as e:
        SparseLiftPlanner(topology=_topo(), batch_size=0, time_budget_s=-1, solver="fast",
                          sync_interval=0, drift_tolerance=-0.5, pipelines=["warp"])
    msg = str(e.value)
    assert msg.startswith("6 problems with SparseLiftPlanner's arguments")
    for says in ("batch_size must be a whole number >= 1, got 0", "time_budget_s must be a number > 0",
                 "solver must be", "sync_interval must be", "drift_tolerance must be", "unknown pipeline 'warp'"):
        assert says in msg, says


@pytest.mark.parametrize("kw", [dict(batch_size="512"), dict(time_budget_s="8"), dict(timeout_seconds=-3)])
def test_non_numeric_and_negative_planner_sizes_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SparseLiftPlanner(topology=_topo(), **kw)


def test_the_same_problem_of_many_tables_is_listed_once_naming_the_tables():
    m = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=6, num_embeddings=100, feature_names=[f"f{i}"])
                for i in range(5)]
        + [EmbeddingBagConfig(name="odd", embedding_dim=10, num_embeddings=100, feature_names=["g"])],
        device=META,
    )
    with pytest.raises(ValueError) as e:
        _plan(m, topology=_topo(device="cpu"))
    msg = str(e.value)
    assert msg.startswith("2 problems with the planning input"), msg
    assert "tables 't0', 't1', 't2' and 2 more (5 tables): embedding_dim 6 is not a multiple of 4" in msg, msg
    assert "table 'odd': embedding_dim 10 is not a multiple of 4" in msg and msg.count("\n") == 2, msg


def test_one_table_problem_keeps_its_own_words():
    from torchrec_sparselift.validation import group_table_problems

    problems = ["table 'a': rows bad", "batch_size bad", "table 'b': rows bad", "table 'c': dim bad"]
    assert group_table_problems(problems) == ["tables 'a', 'b' (2 tables): rows bad", "batch_size bad",
                                              "table 'c': dim bad"]
    assert group_table_problems(problems[1:2]) == ["batch_size bad"]
