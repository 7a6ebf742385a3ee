"""No internal exception type reaches the user from any public loader, and each error names the file.

For every file the package reads from a user (a stored profile, an execution plan, stored plan
inputs, a table file, a constraints file, calibration records, workload statistics, the DLRM
example's checkpoint marker): random bytes, a valid file cut short at any byte, a field of a valid
file given a value of another JSON type, and a field removed, each raise only the loader's
documented error (``FileFormatError`` / ``PlanFormatError``, ``CliError`` for plan inputs,
``CheckpointError`` for a checkpoint), in one line that names the file (a checkpoint: its
directory), never a raw
``KeyError``, ``TypeError``, ``AttributeError``, ``IndexError``, ``UnicodeDecodeError`` or
``json.JSONDecodeError``. The plan cache (the loader of stored execution plans) never raises for a
damaged file, nor for a damaged sharding plan checked against the request it would serve
(``plan.loader.stored_plan_problem``): it re-plans, naming the file. ``tests/test_loaders.py`` has the arbitrary-value
mutations; this file adds truncation, type swaps per field, and the file name in every message.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_loaders import _inputs_doc, _plan_doc, _records_doc, _stored_doc
from torchrec_sparselift.calibration.kernel_fit import load_records
from torchrec_sparselift.calibration.store import ProfileStore
from torchrec_sparselift.dlrm.checkpoint import CHECKPOINT_SCHEMA, LATEST, CheckpointError, latest_checkpoint
from torchrec_sparselift.errors import CliError, FileFormatError, PlanFormatError
from torchrec_sparselift.files import Fields, load_json
from torchrec_sparselift.plan import ExecutionPlan, PlanInputs
from torchrec_sparselift.plan.cache import PlanCache
from torchrec_sparselift.plan.stored_inputs import load_table_file
from torchrec_sparselift.semantics.workload import FeatureStats, WorkloadStats

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))

# One value of each JSON type: a field given another type than its own.
OTHER_TYPES = [None, True, 0, -1, 2**70, 1.5, float("nan"), float("inf"), "", "x", [], [1], {}, {"a": 1}]

CONFIG = {"batch_size": 8, "seed": 1}


def _stats_doc():
    return WorkloadStats((FeatureStats(feature="f0", pooling_factor=2.0, batch_size=64.0, pooling_p95=3.0,
                                       pooling_p99=4.0, pooling_max=5.0, unique_ratio=0.5, hot_row_skew=0.1,
                                       num_batches=4, unique_growth=0.9),
                          FeatureStats(feature="f1", pooling_factor=1.0))).to_dict()


def _tables_doc():
    return [{"name": "t0", "rows": 1000, "dim": 16, "features": ["f0"], "pooling_factor": 2.0},
            {"name": "t1", "rows": 50, "dim": 16}]


def _constraints_doc():
    return [{"name": "t0", "pooling_factor": 3.0, "sharding_types": ["row_wise"]}]


def _checkpoint_doc():
    return {"schema": CHECKPOINT_SCHEMA, "step": 4, "path": "step_00000004", "config": dict(CONFIG)}


def _read_stored(path):
    return ProfileStore(os.path.dirname(path)).load(path)


def _read_inputs(path):
    return PlanInputs.from_dict(load_json(path, "plan inputs"), file=path)


def _read_stats(path):
    return WorkloadStats.from_dict(Fields(load_json(path, "workload statistics", top=dict), file=path,
                                          what="workload statistics"))


def _read_checkpoint(path):
    directory = os.path.dirname(path)
    os.makedirs(os.path.join(directory, "step_00000004"), exist_ok=True)
    return latest_checkpoint(directory, CONFIG)


def _read_plan(path):
    with open(path, "rb") as f:
        raw = f.read()
    ExecutionPlan.from_json(raw, path=path)  # bytes or the file: the same errors
    return ExecutionPlan.load(path)


# name: (file name, valid document maker (tmp_path -> doc), reader, documented errors)
LOADERS = {
    "stored_profile": ("profile.json", _stored_doc, _read_stored, (FileFormatError,)),
    "execution_plan": ("plan.json", lambda _t: _plan_doc(), _read_plan, (PlanFormatError,)),
    "plan_inputs": ("inputs.json", lambda _t: _inputs_doc(), _read_inputs, (CliError, FileFormatError)),
    "table_file": ("tables.json", lambda _t: _tables_doc(), load_table_file, (CliError,)),
    "constraints_file": ("constraints.json", lambda _t: _constraints_doc(),
                         lambda p: load_table_file(p, constraint_only=True), (CliError,)),
    "calibration_records": ("records.json", lambda _t: _records_doc(), load_records, (FileFormatError,)),
    "workload_stats": ("stats.json", lambda _t: _stats_doc(), _read_stats, (FileFormatError,)),
    "checkpoint": (LATEST, lambda _t: _checkpoint_doc(), _read_checkpoint, (CheckpointError,)),
}

_VALID = {}


def _valid(name, tmp_path_factory):
    if name not in _VALID:
        _VALID[name] = LOADERS[name][1](tmp_path_factory.mktemp(f"valid_{name}"))
    return copy.deepcopy(_VALID[name])


def _leaves(doc, at=()):
    """Every (path, value) of ``doc``, containers included."""
    out = [(at, doc)]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _leaves(v, at + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _leaves(v, at + (i,))
    return out


def _set(doc, at, value, remove=False):
    if not at:
        return value
    node = doc
    for k in at[:-1]:
        node = node[k]
    if remove and isinstance(node, dict):
        del node[at[-1]]
    else:
        node[at[-1]] = value
    return doc


def _expect_documented_error(name, tmp_path, raw):
    """Read ``raw`` as loader ``name``'s file: it succeeds or raises the documented error, in
    one line naming the file."""
    file_name, _make, read, errors = LOADERS[name]
    directory = str(tmp_path)
    path = os.path.join(directory, file_name)
    with open(path, "wb") as f:
        f.write(raw)
    try:
        read(path)
    except errors as e:
        msg = str(e)
        culprit = directory if name == "checkpoint" else path  # a checkpoint is its directory
        assert culprit in msg, f"{name}: the error does not name {culprit}: {msg}"
        assert "\n" not in msg, msg
        return e
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{name}: {type(e).__name__} reached the user: {e}")
    return None


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_each_valid_file_reads(tmp_path_factory, name):
    doc = _valid(name, tmp_path_factory)
    assert _expect_documented_error(name, tmp_path_factory.mktemp(name), json.dumps(doc).encode()) is None


@pytest.mark.parametrize("name", sorted(LOADERS))
@FUZZ
@given(raw=st.binary(max_size=48) | st.sampled_from([b"", b"\x00", b"[]", b"{}", b"3", b'"x"', b"\xef\xbb\xbf{}",
                                                     b"{\"schema\": 1}"]))
def test_random_bytes_raise_only_the_documented_error_naming_the_file(tmp_path_factory, name, raw):
    e = _expect_documented_error(name, tmp_path_factory.mktemp(name), raw)
    assert e is not None or raw.strip() in (b"[]", b"{}")  # an empty list of records may be a valid file


@pytest.mark.parametrize("name", sorted(LOADERS))
@FUZZ
@given(data=st.data())
def test_a_truncated_file_raises_only_the_documented_error_naming_the_file(tmp_path_factory, name, data):
    raw = json.dumps(_valid(name, tmp_path_factory)).encode()
    cut = data.draw(st.integers(0, len(raw) - 1))
    assert _expect_documented_error(name, tmp_path_factory.mktemp(name), raw[:cut]) is not None


@pytest.mark.parametrize("name", sorted(LOADERS))
@FUZZ
@given(data=st.data())
def test_a_field_of_another_type_or_missing_raises_only_the_documented_error(tmp_path_factory, name, data):
    doc = _valid(name, tmp_path_factory)
    at, value = data.draw(st.sampled_from(_leaves(doc)))
    remove = bool(at) and data.draw(st.booleans())
    other = data.draw(st.sampled_from([v for v in OTHER_TYPES if type(v) is not type(value)]))
    doc = _set(doc, at, other, remove=remove)
    _expect_documented_error(name, tmp_path_factory.mktemp(name), json.dumps(doc).encode())


@FUZZ
@given(data=st.data())
def test_the_plan_cache_replans_for_a_damaged_plan_naming_it(tmp_path_factory, data):
    raw = json.dumps(_valid("execution_plan", tmp_path_factory)).encode()
    plan = ExecutionPlan.from_json(raw)
    cache = PlanCache(str(tmp_path_factory.mktemp("cache")))
    path = cache.path_for(plan.fingerprint)
    how = data.draw(st.sampled_from(["truncate", "bytes", "field"]))
    if how == "truncate":
        damaged = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif how == "bytes":
        damaged = data.draw(st.binary(max_size=48))
    else:
        doc = json.loads(raw)
        at, value = data.draw(st.sampled_from(_leaves(doc)[1:]))
        doc = _set(doc, at, data.draw(st.sampled_from([v for v in OTHER_TYPES if type(v) is not type(value)])),
                   remove=data.draw(st.booleans()))
        damaged = json.dumps(doc).encode()
    with open(path, "wb") as f:
        f.write(damaged)
    found, why, _level = cache._lookup(plan.fingerprint, None, 0.2)  # load() logs the same line
    if found is None:
        assert os.path.basename(path) in why and "\n" not in why, why


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A plan in a cache, with the request it was made for (a small model, the heuristic search)."""
    from test_plan_cache import _small_model, _small_planner
    from torchrec.distributed.sharding_plan import get_default_sharders

    directory = tmp_path_factory.mktemp("planned")
    model = _small_model()
    planner = _small_planner(directory)
    plan = planner.plan_execution(model, get_default_sharders())
    path = PlanCache(str(directory)).path_for(plan.fingerprint)
    with open(path, "rb") as f:
        raw = f.read()
    return plan, planner.request(model, get_default_sharders()), raw


@FUZZ
@given(data=st.data())
def test_the_plan_cache_checks_a_damaged_sharding_plan_against_the_request_without_raising(
        tmp_path_factory, planned, data):
    plan, request, raw = planned
    doc = json.loads(raw)
    at, value = data.draw(st.sampled_from(_leaves(doc["sharding_plan"])[1:]))
    doc["sharding_plan"] = _set(doc["sharding_plan"], at, data.draw(st.sampled_from(
        [v for v in OTHER_TYPES if type(v) is not type(value)])), remove=data.draw(st.booleans()))
    cache = PlanCache(str(tmp_path_factory.mktemp("cache")))
    path = cache.path_for(plan.fingerprint)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    found, why, _level = cache._lookup(plan.fingerprint, None, 0.2, request)  # the loader's own checks too
    if found is None:
        assert os.path.basename(path) in why and "\n" not in why, why
