"""Every file reader of the package goes through the strict loader (torchrec_sparselift/files.py).

For each one: arbitrary bytes, and arbitrary JSON values put in any field of a valid file (or a
field removed), give only its documented error (``FileFormatError``, ``PlanFormatError``, and
``CliError`` / ``TableSetError`` where a command reports it), never ``KeyError``, ``IndexError``,
``AttributeError``, ``TypeError``, ``UnicodeDecodeError`` or ``json.JSONDecodeError``. Also: a
corrupt stored profile of this machine is named with its fix, one of another machine is skipped
with one warning, and the profile store's lock keeps every record that two processes add at once.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher import run_ranks
from torchrec_sparselift.calibration.store import MachineFingerprint, ProfileStore
from torchrec_sparselift.cost.hardware import PRESETS, HardwareProfile
from torchrec_sparselift.errors import CliError, FileFormatError, PlanFormatError

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "dlrm")

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def _fp(**kw) -> MachineFingerprint:
    base = dict(device="cpu", processor="test cpu", cores=2, devices=0, backend="gloo", ranks=2, torch="2.x",
                fbgemm_gpu="1.x", torchrec="1.x")
    return MachineFingerprint(**{**base, **kw})


def _mutate(data, draw):
    """``data`` with one field (at any depth) replaced by an arbitrary JSON value or removed."""
    data = copy.deepcopy(data)
    node, key = None, None
    cur = data
    while isinstance(cur, (dict, list)) and cur and draw(st.booleans()):
        keys = list(cur) if isinstance(cur, dict) else list(range(len(cur)))
        node, key = cur, draw(st.sampled_from(keys))
        cur = cur[key]
    if node is None:
        return draw(JSON_VALUES)
    if isinstance(node, dict) and draw(st.booleans()):
        del node[key]
    else:
        node[key] = draw(JSON_VALUES)
    return data


def _check_mutations(tmp_path, name, valid, read, errors, data_strategy):
    """``read(path)`` on a mutated ``valid`` document raises only ``errors`` (or succeeds)."""
    path = str(tmp_path / name)
    doc = _mutate(valid, data_strategy.draw)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    try:
        read(path)
    except errors as e:
        assert "\n" not in str(e), str(e)


def _check_bytes(tmp_path, name, raw, read, errors):
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(raw)
    with pytest.raises(errors):
        read(path)


# -- documents -------------------------------------------------------------------------------


def _hardware_doc():
    return {"schema": "sparselift.hardware_profile/1", **PRESETS["cpu-gloo"].to_dict()}


def _stored_doc(tmp_path):
    store = ProfileStore(str(tmp_path / "valid"))
    path = store.save(PRESETS["cpu-gloo"], _fp(), info={"fit": {"values": {"step_overhead_s": 1e-3}}, "fit_records": [
        {"label": "a", "quantities": {"step_overhead_s": 1.0}, "fixed_s": 0.001, "measured_s": 0.002}]})
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _records_doc():
    from torchrec_sparselift.calibration.records import CollectiveRecord, LookupRecord, MicrobenchRecords

    recs = MicrobenchRecords(
        lookups=[LookupRecord(kernel="fbgemm_tbe", device="cpu", phase="fwd", rows=1000, dim=16, batch_size=64,
                              pooling=4, seconds=1e-4)],
        collectives=[CollectiveRecord(op="all_to_all", backend="gloo", world_size=2, bytes=4096, seconds=1e-4)])
    return recs.to_dict()


def _attribution_doc():
    from torchrec_sparselift.calibration.attribution import KINDS, RankAttribution, StepAttribution

    kinds = {k: 1.0 for k in KINDS}
    att = StepAttribution(ranks=[RankAttribution(rank=r, steps=3, step_ms=float(len(KINDS)), kinds_ms=kinds)
                                 for r in range(2)], label="p", pipeline="base", device="cpu")
    return att.to_dict()


def _step_records_doc():
    from torchrec_sparselift.runtime.timing import RECORD_SCHEMA, StepRecord

    rec = StepRecord(plan="p", predicted_s=0.01, measured_s=0.012, mean_s=0.012, stdev_s=0.001, steps=8,
                     warmup_steps=2, device="cpu", world_size=2, stages={"fwd": 0.004})
    return {"schema": RECORD_SCHEMA, "records": [rec.to_dict()]}


def _plan_doc():
    from test_execution_plan import _every_field_plan, _execution_plan

    return json.loads(_execution_plan(_every_field_plan()).to_json())


def _inputs_doc():
    from torchrec_sparselift.plan import PlanInputs, TopologySpec
    from torchrec_sparselift.plan.stored_inputs import parse_table_entries

    inputs = PlanInputs(topology=TopologySpec("cpu-gloo", 2, hbm_gib=4.0),
                        tables=parse_table_entries([{"name": "t0", "rows": 100, "dim": 8}], "t"),
                        constraints=parse_table_entries([{"name": "t0", "pooling_factor": 3}], "c", True),
                        batch_size=64, time_budget_s=3.0, sharding_group_size="auto", max_sync_interval=8)
    return json.loads(json.dumps(inputs.to_dict()))


# -- the readers -----------------------------------------------------------------------------


def _read_hardware(path):
    return HardwareProfile.load(path)


def _read_stored(path):
    return ProfileStore(os.path.dirname(path)).load(path)


def _read_records(path):
    from torchrec_sparselift.calibration.kernel_fit import load_records

    return load_records(path)


def _read_attribution(path):
    from torchrec_sparselift.calibration.attribution import load_attribution

    return load_attribution(path)


def _read_step_records(path):
    from torchrec_sparselift.runtime.timing import load_records

    return load_records(path)


def _read_plan(path):
    from torchrec_sparselift.plan import ExecutionPlan

    with open(path, "rb") as f:
        raw = f.read()
    ExecutionPlan.from_json(raw)  # bytes or text: the same errors
    return ExecutionPlan.load(path)


def _read_inputs(path):
    from torchrec_sparselift.files import load_json
    from torchrec_sparselift.plan import PlanInputs

    return PlanInputs.from_dict(load_json(path), file=path)


def _read_constraints(path):
    from torchrec_sparselift.dlrm.tables import load_constraints_file, preset_tables

    return load_constraints_file(path, preset_tables("kaggle"))


def _table_set_error():
    from torchrec_sparselift.dlrm.tables import TableSetError

    return TableSetError


READERS = {
    "hardware": (_hardware_doc, _read_hardware, FileFormatError),
    "stored": (None, _read_stored, FileFormatError),
    "records": (_records_doc, _read_records, FileFormatError),
    "attribution": (_attribution_doc, _read_attribution, FileFormatError),
    "step_records": (_step_records_doc, _read_step_records, FileFormatError),
    "plan": (_plan_doc, _read_plan, PlanFormatError),
    "inputs": (_inputs_doc, _read_inputs, (CliError, FileFormatError)),
    "constraints": (lambda: {"t_cat_0": {"sharding_types": ["row_wise"], "min_partition": 4}}, _read_constraints,
                    None),
}


def _doc(name, tmp_path):
    make = READERS[name][0]
    return _stored_doc(tmp_path) if make is None else make()


def _errors(name):
    err = READERS[name][2]
    return _table_set_error() if err is None else err


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_valid_document_reads_back(tmp_path, name):
    path = str(tmp_path / f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_doc(name, tmp_path), f)
    READERS[name][1](path)


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_duplicate_key_is_refused_naming_it(tmp_path, name):
    doc = _doc(name, tmp_path)
    key = sorted(doc)[0]
    text = json.dumps(doc)
    text = text[:-1] + f", {json.dumps(key)}: {json.dumps(doc[key])}}}"
    path = str(tmp_path / f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    with pytest.raises(_errors(name), match=f"duplicate key {key!r}"):
        READERS[name][1](path)


@pytest.mark.parametrize("name", sorted(READERS))
@PROPERTY
@given(raw=st.binary(max_size=64) | st.sampled_from([b"", b"{", b"[1]", b"\xff\xfe{}", b'{"a": 1, "a": 2}', b"null",
                                                     b'{"schema": NaN}']))
def test_arbitrary_bytes_give_only_the_documented_error(tmp_path_factory, name, raw):
    tmp_path = tmp_path_factory.mktemp(name)
    _check_bytes(tmp_path, f"{name}.json", raw, READERS[name][1], _errors(name))


@pytest.mark.parametrize("name", sorted(READERS))
@PROPERTY
@given(data=st.data())
def test_arbitrary_values_in_any_field_give_only_the_documented_error(tmp_path_factory, name, data):
    tmp_path = tmp_path_factory.mktemp(name)
    _check_mutations(tmp_path, f"{name}.json", _doc(name, tmp_path), READERS[name][1], _errors(name), data)


def test_truncated_nan_and_mistyped_profiles_name_the_file_and_the_field(tmp_path):
    path = str(tmp_path / "p.json")
    doc = _hardware_doc()
    for change, says in [
        (lambda d: d.update(hbm_bw=float("nan")), "p.json: hbm_bw: must be a finite number, got nan"),
        (lambda d: d.update(local_world_size="8"), "p.json: local_world_size: must be an integer"),
        (lambda d: d.pop("name"), "p.json: name: is missing"),
        (lambda d: d.update(colour=1), "p.json: unknown key(s) ['colour']"),
        (lambda d: d.update(cache_hit_rate=1.5), "cache_hit_rate must be within [0, 1]"),
    ]:
        d = copy.deepcopy(doc)
        change(d)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(d, f)
        with pytest.raises(FileFormatError, match="hardware profile .*") as e:
            HardwareProfile.load(path)
        assert says in str(e.value)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc)[:40])
    with pytest.raises(FileFormatError, match=r"p\.json: is not valid JSON"):
        HardwareProfile.load(path)


# -- the profile store -----------------------------------------------------------------------


def test_a_corrupt_profile_of_this_machine_is_named_with_its_fix(tmp_path):
    store = ProfileStore(str(tmp_path))
    path = store.save(PRESETS["cpu-gloo"], _fp())
    with open(path, "r+b") as f:
        f.truncate(50)
    with pytest.raises(FileFormatError) as e:
        store.lookup(_fp())
    msg = str(e.value)
    assert "this machine's calibrated profile is unusable" in msg and path in msg
    assert f"delete {path}" in msg and "calibrate steps" in msg and "\n" not in msg
    assert e.value.path == path


def test_a_corrupt_profile_of_another_machine_is_skipped_with_one_warning(tmp_path):
    store = ProfileStore(str(tmp_path))
    other = store.save(PRESETS["cpu-gloo"], _fp(cores=8))
    broken = store.save(PRESETS["cpu-gloo"], _fp(cores=16))
    with open(broken, "w", encoding="utf-8") as f:
        f.write('{"schema": "sparselift.stored_profile/1", "fingerprint": 3}')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found, diff = store.lookup(_fp())
    assert found is not None and found.path == other and diff == ["cores: 2 vs 8"]
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and broken in msgs[0] and "fingerprint" in msgs[0], msgs


# -- the profile store's lock ----------------------------------------------------------------


def _add_records(rank, world_size, root, n):
    """Add ``n`` guard records, one call each, to the stored profile of the test machine."""
    from torchrec_sparselift.calibration import feedback
    from torchrec_sparselift.calibration.step_fit import FitRecord

    feedback.current_fingerprint = lambda device, ranks, **kw: _fp()
    topo = SimpleNamespace(compute_device="cpu", local_world_size=2)
    store = ProfileStore(root)
    for i in range(n):
        rec = FitRecord(label=f"guard/r{rank}-{i}", quantities={"step_overhead_s": 1.0}, fixed_s=0.01,
                        measured_s=0.02 + 1e-4 * i)
        assert feedback.add_feedback([rec], PRESETS["cpu-gloo"], topo, store=store) is not None
    return n


def test_two_processes_adding_records_at_once_keep_every_record(tmp_path):
    from torchrec_sparselift.calibration.step_fit import STEP_MODEL_VERSION

    store = ProfileStore(str(tmp_path))
    prof = attrs.evolve(PRESETS["cpu-gloo"], name="fitted")
    store.save(prof, _fp(), info={"fit": {"values": {"step_overhead_s": 1e-3}}, "fit_records": [],
                                  "model_version": STEP_MODEL_VERSION})
    assert run_ranks(_add_records, 2, str(tmp_path), 8, backend=None, timeout_s=300) == [8, 8]
    info = store.lookup(_fp())[0].step_fit
    labels = sorted(r.label for r in info.fit_records)
    assert labels == sorted(f"guard/r{r}-{i}" for r in range(2) for i in range(8))
    assert info.feedback_records == 16


def test_a_held_profile_lock_is_waited_for_a_bounded_time_and_names_its_holder(tmp_path):
    store = ProfileStore(str(tmp_path))
    lock = store.lock_path(_fp())
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({lock!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
         "print('held', flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            with store.locked(_fp(), timeout_s=0.5):
                pass
        assert time.monotonic() - start < 5
        assert f"pid {holder.pid}" in str(e.value) and lock in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    with store.locked(_fp(), timeout_s=5):  # released with its process
        with store.locked(_fp(), timeout_s=0.1):  # re-entrant in one process
            pass


def test_a_profile_missing_a_core_field_is_refused_naming_it_not_given_a_gpu_default(tmp_path):
    import json

    from torchrec_sparselift.calibration.store import base_profile
    from torchrec_sparselift.cost.hardware import PROFILE_CORE_FIELDS, HardwareProfile
    from torchrec_sparselift.errors import FileFormatError

    path = tmp_path / "p.json"
    base_profile("cpu").save(str(path))
    full = json.loads(path.read_text())
    for name in sorted(PROFILE_CORE_FIELDS):
        data = dict(full)
        del data[name]
        path.write_text(json.dumps(data))
        with pytest.raises(FileFormatError, match=rf"p.json: {name}: is missing"):
            HardwareProfile.load(str(path))
    data = {k: v for k, v in full.items() if k != "table_overhead_s"}  # a later term: its default
    path.write_text(json.dumps(data))
    assert HardwareProfile.load(str(path)).table_overhead_s == attrs.fields(HardwareProfile).table_overhead_s.default
