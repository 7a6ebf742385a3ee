"""Every public argument of ``SparseLiftPlanner`` is checked for type and shape before planning.

Wrong types and shapes give one ``ValueError`` (or a TorchRec ``PlannerError`` when the input is
well formed but cannot fit) listing every problem, each naming the argument and the fix; nothing
from inside (``KeyError``, ``IndexError``, ``AttributeError``, ``TypeError``, attrs'
``NotAnAttrsClassError``) reaches the user. The property tests at the end draw arbitrary values
for each argument and hold the planner to that.
"""

import math
import warnings

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_sparselift import SparseLiftPlanner, SparseLiftPlannerError
from torchrec_sparselift.semantics.workload import declare
from torchrec_sparselift.validation import callback_problem

from launcher import run_ranks

warnings.filterwarnings("ignore")
GiB = 1024**3


def _topo(world_size=2, device="cuda", **kw):
    kw.setdefault("hbm_cap", 80 * GiB)
    kw.setdefault("ddr_cap", 256 * GiB)
    return Topology(world_size=world_size, local_world_size=world_size, compute_device=device, **kw)


def _ebc(features=(("f0",), ("f1",))):
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=1000,
                                   feature_names=list(fs)) for i, fs in enumerate(features)],
        device=torch.device("meta"),
    )


def _plan(module=None, **kw):
    kw.setdefault("topology", _topo())
    kw.setdefault("batch_size", 64)
    kw.setdefault("time_budget_s", 1)
    planner = SparseLiftPlanner(debug=False, **kw)
    return planner.plan_with_result(module or _ebc(), get_default_sharders())


def _refused(**kw):
    with pytest.raises(ValueError) as e:
        _plan(**kw)
    assert not isinstance(e.value, attrs.exceptions.NotAnAttrsClassError)
    return str(e.value)


# -- one clear error per wrong argument ---------------------------------------------------------
@pytest.mark.parametrize("kw,words", [
    (dict(constraints=[ParameterConstraints()]), ["constraints must be a dict", "got list"]),
    (dict(constraints={"t0": {"sharding_types": ["table_wise"]}}),
     ["constraints['t0'] must be a ParameterConstraints", "got dict"]),
    (dict(constraints={"t0": ParameterConstraints(sharding_types="table_wise")}),
     ["sharding_types must be a list", "sharding_types=['table_wise']"]),
    (dict(constraints={"t0": ParameterConstraints(compute_kernels="fused")}),
     ["compute_kernels must be a list", "compute_kernels=['fused']"]),
    (dict(constraints={"t0": ParameterConstraints(pooling_factors=2.0)}), ["pooling_factors must be a list"]),
    (dict(pipelines=[]), ["pipelines is empty", "pipelines=['fused']"]),
    (dict(pipelines="fused"), ["pipelines must be a list", "got str"]),
    (dict(pipelines=["bogus"]), ["unknown pipeline 'bogus'", "choose from"]),
    (dict(hardware={"name": "x"}), ["hardware must be a HardwareProfile", "HardwareProfile.from_dict"]),
    (dict(hardware=3), ["hardware must be a HardwareProfile", "got int"]),
    (dict(workload={"f0": 3.0}), ["workload must be WorkloadStats", "declare("]),
    (dict(workload=[1.0]), ["workload must be WorkloadStats", "got list"]),
    (dict(callbacks=lambda options: options), ["callbacks must be a list of functions"]),
    (dict(callbacks=[3]), ["callbacks[0] must be a function"]),
    (dict(stats=3), ["stats must be a TorchRec Stats"]),
    (dict(storage_reservation=0.2), ["storage_reservation must be a TorchRec StorageReservation"]),
    (dict(cache_dir=3), ["cache_dir must be a directory path"]),
    (dict(allow_lossy_comm="no"), ["allow_lossy_comm must be True or False"]),
    (dict(layout_2d=["auto"]), ["layout_2d must be one of"]),
    (dict(cost_model=None), ["cost_model must be one of"]),
    (dict(topology={"world_size": 2}), ["topology must be a torchrec Topology", "Topology(world_size="]),
    (dict(topology=_topo(hbm_cap=float("nan"))), ["topology hbm_cap must be a finite number", "nan"]),
    (dict(topology=_topo(ddr_cap=float("inf"))), ["topology ddr_cap must be a finite number", "inf"]),
    (dict(topology=_topo(hbm_cap=-5)), ["topology hbm_cap", "got -5"]),
    (dict(topology=_topo(intra_host_bw=float("nan"))), ["topology intra_host_bw must be a finite number"]),
], ids=lambda v: "" if isinstance(v, list) else ",".join(v))
def test_a_wrong_argument_gets_one_error_naming_it_and_the_fix(kw, words):
    message = _refused(**kw)
    for w in words:
        assert w in message, message


def test_every_wrong_argument_is_listed_at_once():
    message = _refused(constraints=[1], pipelines=[], hardware={}, workload={}, callbacks=[None],
                       allow_fp8=1, batch_size=-1)
    assert message.startswith("7 problems with SparseLiftPlanner's arguments"), message
    for w in ("constraints", "pipelines", "hardware", "workload", "callbacks[0]", "allow_fp8", "batch_size"):
        assert w in message


def test_a_string_of_sharding_types_is_one_problem_not_one_per_letter():
    message = _refused(constraints={"t0": ParameterConstraints(sharding_types="table_wise")})
    assert message.startswith("invalid SparseLiftPlanner's arguments:"), message
    assert "unknown sharding type" not in message


def test_documented_arguments_still_plan():
    res = _plan(constraints={"t0": ParameterConstraints(sharding_types=("table_wise",))},
                hardware="h100", workload=declare(f0=2.0, f1=1.0), pipelines=("fused",),
                callbacks=[lambda options: options])
    assert {o.name for o in res.sharding_options} == {"t0", "t1"}


# -- callbacks -----------------------------------------------------------------------------------
def named_none(options):
    return None


def drop_last(options):
    return options[:-1]


def twice(options):
    return options + options[:1]


@pytest.mark.parametrize("callback,words", [
    (named_none, ["callback named_none returned NoneType"]),
    (drop_last, ["callback drop_last dropped tables ['t1']"]),
    (twice, ["callback twice listed tables twice ['t0']"]),
])
def test_a_callback_that_breaks_the_options_is_named(callback, words):
    message = _refused(callbacks=[callback])
    assert "internal error" not in message
    for w in words + ["must return the list of ShardingOptions"]:
        assert w in message, message


def test_callback_problem_is_none_for_a_callback_that_keeps_every_table():
    options = _plan().sharding_options
    assert callback_problem(drop_last, options, list(reversed(options))) is None


# -- pooling factors against features -----------------------------------------------------------
def test_more_pooling_factors_than_features_are_refused_naming_table_features_and_counts():
    message = _refused(constraints={"t0": ParameterConstraints(pooling_factors=[1.0, 2.0, 3.0])})
    assert "table 't0'" in message
    assert "3 pooling_factors [1.0, 2.0, 3.0] for 1 feature(s) ['f0']" in message


def test_one_pooling_factor_per_feature_or_one_for_all_still_plans():
    model = _ebc((("a", "b"), ("c",)))
    for pfs in ([1.0], [1.0, 2.0]):
        _plan(model, constraints={"t0": ParameterConstraints(pooling_factors=pfs)})


# -- buffers that cannot fit ---------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("kw", [dict(batch_size=10**12),
                                dict(constraints={"t0": ParameterConstraints(pooling_factors=[1e12])})],
                         ids=["batch", "pooling"])
def test_absurd_batch_or_pooling_names_the_input_output_buffers(device, kw):
    kw.setdefault("batch_size", 64)
    with pytest.raises(SparseLiftPlannerError) as e:
        _plan(topology=_topo(device=device), **kw)
    message = str(e.value)
    assert e.value.error_type.name == "INSUFFICIENT_STORAGE"
    assert "input/output buffers" in message and "lower batch_size" in message, message
    assert "allow row-wise" not in message


def test_buffers_that_leave_no_memory_after_the_reservation_are_named():
    # fits once on a rank, but the storage reservation's copies of the input leave nothing
    with pytest.raises(PlannerError) as e:
        _plan(topology=_topo(device="cpu"), batch_size=10**9)
    message = str(e.value)
    assert "input/output buffers of one step leave no memory for the tables" in message, message
    assert "allow row-wise" not in message


# -- topology against the process group ---------------------------------------------------------
def _plan_on_group(rank, world_size, topology_size):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    planner = SparseLiftPlanner(topology=_topo(world_size=topology_size, device="cpu"),
                                batch_size=8, debug=False, time_budget_s=1)
    try:
        planner.collective_plan(_ebc(), get_default_sharders(), dist.GroupMember.WORLD)
        return ("plan",)
    except ValueError as e:
        return ("error", str(e))


def test_a_topology_for_more_ranks_than_the_process_group_is_refused_naming_both_sizes():
    (out,) = run_ranks(_plan_on_group, 1, 2)
    assert out[0] == "error", out
    assert "world_size 2 but the process group has 1 ranks" in out[1]
    assert "Topology(world_size=1" in out[1]


# -- property tests: arbitrary values, one documented error or a plan ----------------------------
INTERNAL = (KeyError, IndexError, AttributeError, TypeError, attrs.exceptions.NotAnAttrsClassError)

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**15), 10**15),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
)
_values = st.one_of(
    _scalars,
    st.lists(_scalars, max_size=3),
    st.dictionaries(st.text(max_size=4), _scalars, max_size=2),
    st.sampled_from([[], {}, (), "", "fused", "table_wise", "h100", object()]),
)

#: the planner's arguments, with the words an error about each must use
ARGUMENTS = {
    "topology": ("topology",), "batch_size": ("batch_size",), "constraints": ("constraints",),
    "hardware": ("hardware",), "workload": ("workload",), "pipelines": ("pipeline",),
    "callbacks": ("callback",), "stats": ("stats",), "storage_reservation": ("storage_reservation",),
    "timeout_seconds": ("timeout_seconds",), "time_budget_s": ("time_budget_s",),
    "solver": ("solver",), "sharding_group_size": ("sharding_group_size",),
    "sync_interval": ("sync_interval",), "max_sync_interval": ("max_sync_interval",),
    "layout_2d": ("layout_2d",), "cost_model": ("cost_model",), "allow_lossy_comm": ("allow_lossy_comm",),
    "allow_fp8": ("allow_fp8",), "allow_staleness": ("allow_staleness",),
    "drift_tolerance": ("drift_tolerance",),
    "heuristical_storage_reservation_percentage": ("heuristical_storage_reservation_percentage",),
    "estimator": ("estimator",),
}
CONSTRAINT_FIELDS = ("sharding_types", "compute_kernels", "pooling_factors", "batch_sizes", "min_partition")
TOPOLOGY_FIELDS = ("hbm_cap", "ddr_cap", "intra_host_bw", "inter_host_bw")


def _outcome(kw, words):
    """Plan with ``kw``; a plan, or a documented error naming one of ``words``."""
    try:
        _plan(**kw)
    except INTERNAL as e:
        raise AssertionError(f"internal {type(e).__name__} escaped for {kw!r}: {e}") from e
    except (ValueError, PlannerError) as e:
        message = str(e)
        assert any(w in message for w in words), f"{kw!r}: {message}"


_PROPERTY = settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


@_PROPERTY
@given(name=st.sampled_from(sorted(ARGUMENTS)), value=_values)
def test_any_value_of_any_argument_plans_or_names_the_argument(name, value):
    if name == "hardware" and isinstance(value, str):
        value = value.replace("/", "").replace(".", "")  # a path would be read from disk
    _outcome({name: value}, ARGUMENTS[name])


@_PROPERTY
@given(field=st.sampled_from(CONSTRAINT_FIELDS), value=_values)
def test_any_constraint_field_plans_or_names_the_field(field, value):
    _outcome({"constraints": {"t0": ParameterConstraints(**{field: value})}},
             (field, "pooling factor", "batch size", "sharding type", "kernel", "min_partition"))


@_PROPERTY
@given(field=st.sampled_from(TOPOLOGY_FIELDS), value=_values)
def test_any_topology_capacity_plans_or_names_the_field(field, value):
    try:
        topology = _topo(**{field: value})
    except Exception:  # noqa: BLE001 - TorchRec's own constructor refused it: not our input
        return
    cap = field.replace("_cap", "")
    _outcome({"topology": topology}, (field, cap, "storage", "memory"))


def test_property_values_include_the_reported_cases():
    # what a new user tried: each is in the strategies above
    for kw in (dict(constraints=[ParameterConstraints()]), dict(pipelines=[]), dict(hardware={}),
               dict(workload={}), dict(topology=_topo(hbm_cap=math.nan))):
        with pytest.raises(ValueError):
            _plan(**kw)


# -- evaluate_sharding_plan ----------------------------------------------------------------------
def test_evaluate_sharding_plan_checks_its_arguments_at_once():
    from torchrec_sparselift import evaluate_sharding_plan

    plan = _plan().sharding_plan
    with pytest.raises(ValueError) as e:
        evaluate_sharding_plan(_ebc(), plan, _topo(), -1, constraints=[1], hardware={}, workload={},
                               pipeline="nope", fwd_precision="fp7")
    message = str(e.value)
    assert message.startswith("6 problems with evaluate_sharding_plan's arguments"), message
    for w in ("constraints", "hardware", "workload", "pipeline", "fwd_precision", "batch_size"):
        assert w in message
    with pytest.raises(ValueError, match="plan must be a torchrec ShardingPlan, got dict"):
        evaluate_sharding_plan(_ebc(), {}, _topo(), 64)
    ev = evaluate_sharding_plan(_ebc(), plan, _topo(), 64, hardware="h100", workload=declare(f0=1.0, f1=1.0))
    assert ev.search.step.total_s > 0


def test_validate_inputs_reads_a_string_of_sharding_types_as_one_problem():
    from torchrec_sparselift.semantics.tables import extract_tables
    from torchrec_sparselift.validation import validate_inputs

    constraints = {"t0": ParameterConstraints(sharding_types="row_wise", compute_kernels="fused")}
    handles = extract_tables(_ebc(), get_default_sharders(), "cuda", 64, None, None)
    with pytest.raises(ValueError) as e:
        validate_inputs(handles, _topo(), 64, constraints)
    message = str(e.value)
    assert message.startswith("2 problems with the planning input"), message
    assert "sharding_types must be a list, got str 'row_wise'" in message
    assert "compute_kernels must be a list, got str 'fused'" in message
