"""The vocabulary is declared once and every layer has what each entry needs.

A pipeline added to the registry without its step composition, its TorchRec class or its 2D
property, a precision without a byte size, or a sharding type or kernel TorchRec does not know
fails here, naming the entry.
"""

from __future__ import annotations

import ast
import inspect
import os

import pytest
import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.fbgemm_qcomm_codec import CommType
from torchrec.distributed.types import ShardingType

from torchrec_sparselift import vocabulary as v
from torchrec_sparselift.cost import pipelines as cost_pipelines
from torchrec_sparselift.runtime import cpu_compat
from torchrec_sparselift.runtime import pipelines as runtime_pipelines

PACKAGE_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "torchrec_sparselift")


# -- sharding types and kernels ---------------------------------------------------------------

def test_sharding_types_are_torchrecs():
    assert v.SHARDING_TYPES == tuple(s.value for s in ShardingType)


def test_sharding_type_groups_are_subsets_of_the_full_list():
    groups = {name: getattr(v, name) for name in v.__all__ if name.endswith("_TYPES") and name != "SHARDING_TYPES"}
    assert len(groups) >= 8, sorted(groups)
    for name, group in groups.items():
        assert group and set(group) <= set(v.SHARDING_TYPES), name
        assert len(set(group)) == len(group), f"{name} repeats a type"


def test_placement_groups_partition_the_sharding_types():
    groups = (v.PLACED_FREELY_TYPES, v.ON_EVERY_RANK_TYPES, v.HOST_ROW_SPLIT_TYPES)
    together = [t for g in groups for t in g]
    assert sorted(together) == sorted(v.SHARDING_TYPES)


def test_column_and_row_split_types_are_disjoint():
    assert not set(v.COLUMN_SPLIT_TYPES) & set(v.ROW_SPLIT_TYPES) - {v.GRID_SHARD}
    assert set(v.HOST_ROW_SPLIT_TYPES) <= set(v.ROW_SPLIT_TYPES)
    assert set(v.CPU_RUNTIME_SHARDING_TYPES) == set(v.SHARDING_TYPES) - {v.TABLE_COLUMN_WISE, v.GRID_SHARD}


def test_compute_kernels_are_torchrecs_and_groups_are_subsets():
    assert v.COMPUTE_KERNELS == tuple(k.value for k in EmbeddingComputeKernel)
    for name in ("FUSED_KERNELS", "UVM_KERNELS", "KEY_VALUE_KERNELS", "MODELED_KERNELS"):
        assert set(getattr(v, name)) <= set(v.COMPUTE_KERNELS), name
    assert set(v.UVM_KERNELS) <= set(v.FUSED_KERNELS)


def test_the_old_names_are_the_vocabulary():
    from torchrec_sparselift import validation
    from torchrec_sparselift.search import problem, torchrec_objective
    from torchrec_sparselift.semantics import layout, table_file, tables

    assert table_file.SHARDING_TYPES is v.SHARDING_TYPES
    assert table_file.COMPUTE_KERNELS is v.COMPUTE_KERNELS
    assert validation.KNOWN_SHARDING_TYPES is v.SHARDING_TYPES
    assert validation.KNOWN_COMPUTE_KERNELS is v.COMPUTE_KERNELS
    assert validation.FUSED_KERNELS is v.FUSED_KERNELS
    assert tables.CPU_RUNTIME_SHARDING_TYPES is v.CPU_RUNTIME_SHARDING_TYPES
    assert tables.KEY_VALUE_KERNELS is v.KEY_VALUE_KERNELS
    assert problem.SUPPORTED_KERNELS is v.MODELED_KERNELS
    assert torchrec_objective.UVM_KERNELS is v.UVM_KERNELS
    assert layout.LAYOUTS is v.LAYOUTS_2D


# -- pipelines --------------------------------------------------------------------------------

def test_every_registry_pipeline_has_a_step_composition_in_the_cost_model():
    assert tuple(k.name for k in cost_pipelines.PIPELINE_KINDS) == v.PIPELINES
    for p in v.PIPELINE_REGISTRY:
        kind = cost_pipelines.pipeline_kind(p.name)
        assert kind.properties is p
        assert (kind.stale, kind.dense_kernel, kind.fused_input_splits) == (p.stale, p.dense_kernel, p.fused_input_splits)
        assert cost_pipelines.paths(kind.step), p.name  # a composition with at least one path


def test_every_registry_pipeline_has_a_runtime_constructor():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for p in v.PIPELINE_REGISTRY:
        on_gpu = runtime_pipelines.pipeline_class(p.name, cuda)
        assert on_gpu.__name__ == p.torchrec_class, p.name
        on_cpu = runtime_pipelines.pipeline_class(p.name, cpu)
        assert issubclass(on_cpu, on_gpu)
        # side-stream pipelines run through their CPU adaptation, the others as TorchRec ships them
        assert (on_cpu is not on_gpu) == p.side_streams, p.name
        assert cpu_compat.needs_cpu_streams(on_gpu, cpu) == p.side_streams, p.name


def test_the_2d_pipelines_are_the_ones_whose_constructor_takes_the_sync_interval():
    for p in v.PIPELINE_REGISTRY:
        cls = runtime_pipelines.pipeline_class(p.name, torch.device("cuda"))
        takes = "dmp_collection_sync_interval_batches" in inspect.signature(cls.__init__).parameters
        assert takes == p.syncs_2d_replicas, p.name
    assert runtime_pipelines._SYNC_INTERVAL_KINDS == v.PIPELINES_2D


def test_pipeline_name_lists_are_the_registry():
    from torchrec_sparselift.cost.two_d import SYNC_PIPELINES_2D
    from torchrec_sparselift.plan import PIPELINES as PLAN_PIPELINES

    assert PLAN_PIPELINES == cost_pipelines.PIPELINES == v.PIPELINES
    assert tuple(runtime_pipelines._CLASSES) == v.PIPELINES
    assert cost_pipelines.SYNC_PIPELINES == v.SYNC_PIPELINES
    assert SYNC_PIPELINES_2D == v.PIPELINES_2D
    assert set(v.SYNC_PIPELINES) | set(v.STALE_PIPELINES) == set(v.PIPELINES)
    assert all(v.pipeline(n).exact for n in v.SYNC_PIPELINES)


def test_the_overlap_kind_is_exact_and_built_from_the_package():
    from torchrec_sparselift.runtime.overlap import TrainPipelineOverlap

    p = v.pipeline("overlap")
    assert p.exact and p.dense_kernel and p.fused_input_splits and not p.syncs_2d_replicas
    assert "overlap" in v.SYNC_PIPELINES and "overlap" not in v.STALE_PIPELINES
    for device in ("cpu", "cuda"):
        assert runtime_pipelines.pipeline_class("overlap", torch.device(device)) is TrainPipelineOverlap
    # across hosts on CPU gloo the package's own pipelines overlap, and TorchRec's fused, which
    # issues the output all-to-all before the forward (sparse_dist measured no gain there); only
    # the package's need a core per rank for it
    assert [q.name for q in v.PIPELINE_REGISTRY if q.overlaps_between_hosts] == ["fused", "overlap", "overlap_stale"]
    assert [q.name for q in v.PIPELINE_REGISTRY if q.needs_spare_cores] == ["overlap", "overlap_stale"]


def test_an_unknown_pipeline_names_the_choices():
    try:
        v.pipeline("overlapped")
    except ValueError as e:
        assert "'overlapped'" in str(e) and "sparse_dist" in str(e) and "overlap" in str(e)
    else:
        raise AssertionError("vocabulary.pipeline accepted an unknown name")


def test_the_pipeline_rule_is_monotone_and_can_conflict_says_whether_anything_conflicts():
    """``Pipeline.conflict``: setting a condition (a dense-kernel table, side streams, a feature
    processor) never removes a conflict, so ``can_conflict`` (every condition of a plan and a model
    set) is True exactly where some plan or model conflicts; the reasons are the enum's."""
    import itertools

    seen = set()
    for p in v.PIPELINE_REGISTRY:
        for streams in (False, True):
            combos = {(d, f): p.conflict(d, streams, f) for d, f in itertools.product((False, True), repeat=2)}
            for (d, f), why in combos.items():
                assert why is None or isinstance(why, v.PipelineConflict), (p.name, why)
                for d2, f2 in itertools.product((d, True), (f, True)):  # more conditions set
                    assert why is None or combos[(d2, f2)] is not None, (p.name, streams, d, f, d2, f2)
            assert p.can_conflict(streams) == any(w is not None for w in combos.values()), (p.name, streams)
            seen.update(w for w in combos.values() if w is not None)
        assert p.can_conflict(True) or not p.can_conflict(False)  # side streams add conflicts only
    assert seen == set(v.PipelineConflict)  # every reason is reachable
    assert not v.pipeline("sparse_dist").can_conflict(True) and v.pipeline("fused").can_conflict(True)
    assert not v.pipeline("fused").can_conflict(False) and v.pipeline("semi_sync").can_conflict(False)


# -- communication precisions -----------------------------------------------------------------

def test_every_precision_has_a_byte_size_and_is_a_torchrec_codec():
    codecs = {c.value for c in CommType}
    for p in v.COMM_PRECISION_REGISTRY:
        assert p.name in codecs, p.name
        assert v.COMM_PRECISION_BYTES[p.name] == p.bytes and p.bytes in (1, 2, 4), p.name
        assert p.lossy == (p.bytes < 4), p.name  # narrower than fp32 loses precision
    assert set(v.LOSSY_COMM_PRECISIONS) == set(v.COMM_PRECISIONS) - {"fp32"}


def test_the_cost_model_prices_each_precision_at_its_byte_size():
    from torchrec_sparselift.cost.model import PRECISION_BYTES

    assert dict(PRECISION_BYTES) == v.COMM_PRECISION_BYTES


def test_precision_pairs_respect_the_guards():
    exact = v.comm_precision_pairs()
    assert exact == (("fp32", "fp32"),)
    lossy = v.comm_precision_pairs(allow_lossy_comm=True)
    fp8 = v.comm_precision_pairs(allow_lossy_comm=True, allow_fp8=True)
    assert v.comm_precision_pairs(allow_fp8=True) == exact  # fp8 needs lossy comms allowed too
    assert lossy[: len(exact)] == exact and fp8[: len(lossy)] == lossy
    for pairs, lossy_ok, fp8_ok in ((exact, False, False), (lossy, True, False), (fp8, True, True)):
        for pair in pairs:
            for name in pair:
                p = v.comm_precision(name)
                assert lossy_ok or not p.lossy, (pairs, name)
                assert fp8_ok or not p.opt_in, (pairs, name)
    assert any("fp8" in pair for pair in fp8)


def test_the_runtime_refuses_precisions_that_do_not_run_on_cpu():
    from torchrec_sparselift.runtime.model_parallel import comm_codecs_registry

    for p in v.COMM_PRECISION_REGISTRY:
        if p.runs_on_cpu:
            continue
        try:
            comm_codecs_registry(p.name, "fp32", torch.device("cpu"))
        except ValueError as e:
            assert p.name in str(e) and "CPU" in str(e)
        else:
            raise AssertionError(f"{p.name} was accepted on CPU")


# -- the modules are a base --------------------------------------------------------------------

def test_vocabulary_and_defaults_import_nothing_of_the_package_nor_torch():
    for name in ("vocabulary", "defaults"):
        path = os.path.join(PACKAGE_DIR, name + ".py")
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add("." if node.level else (node.module or "").split(".")[0])
        assert not imported & {"torchrec_sparselift", ".", "torch", "torchrec", "numpy"}, (name, imported)


def test_every_2d_strategy_is_a_torchrec_sharding_strategy_and_cpu_refusals_say_why():
    from torchrec.distributed.types import ShardingStrategy

    assert v.STRATEGY_2D_CHOICES == ("auto",) + v.STRATEGIES_2D
    for s in v.STRATEGY_2D_REGISTRY:
        assert ShardingStrategy[s.torchrec_name]
        assert s.runs_on_cpu == (not s.not_on_cpu)
    assert v.strategy_2d("default").periodic_sync and v.strategy_2d("default").runs_on_cpu
    with pytest.raises(ValueError, match="fully_sharded"):
        v.strategy_2d("fully")
