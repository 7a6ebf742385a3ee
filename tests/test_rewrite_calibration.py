"""The sparse-path rewrites' machine constants: ``HardwareProfile.chunk_overhead_s`` (one more batch
chunk's fixed cost) and ``dedup_id_s`` (seconds per id of the id-deduplication kernels).

The fields validate and round-trip (profile JSON, the profile store) and stay out of a profile's
record and digests while they are None; the fits recover known slopes from synthetic timings; the
measuring functions run in a quick mode.
"""

from __future__ import annotations

import json
import math

import attrs
import pytest

from torchrec_sparselift.calibration.store import MachineFingerprint, ProfileStore, base_profile
from torchrec_sparselift.cost.hardware import PRESETS, HardwareProfile, with_slower_compute
from torchrec_sparselift.errors import FileFormatError
from torchrec_sparselift.files import canonical_digest

FIELDS = ("chunk_overhead_s", "dedup_id_s")


def _fp() -> MachineFingerprint:
    return MachineFingerprint(device="cpu", processor="test cpu", cores=2, devices=0, backend="gloo", ranks=2,
                              torch="2.x", fbgemm_gpu="1.x", torchrec="1.x")


@pytest.mark.parametrize("name", FIELDS)
def test_the_fields_are_none_by_default_and_take_non_negative_finite_seconds(name):
    assert getattr(PRESETS["h100"], name) is None
    assert getattr(base_profile("cpu"), name) is None
    for ok in (0, 0.0, 3e-9, 1.5e-3):
        assert getattr(attrs.evolve(PRESETS["h100"], **{name: ok}), name) == ok
    for bad in (-1e-9, float("nan"), float("inf"), True, "1e-3"):
        with pytest.raises(ValueError, match=rf"HardwareProfile.{name} must be None \(not calibrated\) or a "
                                             "non-negative finite number"):
            attrs.evolve(PRESETS["h100"], **{name: bad})


def test_an_uncalibrated_profile_has_the_record_and_digest_it_had_without_the_fields():
    for prof in (*PRESETS.values(), base_profile("cpu")):
        d = prof.to_dict()
        assert not set(FIELDS) & set(d)
        full = attrs.asdict(prof)
        assert d == {k: v for k, v in full.items() if k not in FIELDS}
    prof = attrs.evolve(PRESETS["h100"], chunk_overhead_s=2e-4, dedup_id_s=None)
    assert prof.to_dict()["chunk_overhead_s"] == 2e-4 and "dedup_id_s" not in prof.to_dict()
    assert canonical_digest(prof.to_dict()) != canonical_digest(PRESETS["h100"].to_dict())


@pytest.mark.parametrize("values", [(None, None), (2.5e-4, None), (None, 4e-9), (0.0, 0.0), (1e-3, 7.5e-9)])
def test_the_fields_round_trip_through_a_profile_file_and_the_store(tmp_path, values):
    prof = attrs.evolve(base_profile("cpu"), chunk_overhead_s=values[0], dedup_id_s=values[1])
    path = tmp_path / "p.json"
    prof.save(str(path))
    assert HardwareProfile.load(str(path)) == prof
    store = ProfileStore(str(tmp_path / "store"))
    stored = store.load(store.save(prof, _fp()))
    assert stored.profile == prof
    assert HardwareProfile.from_dict(prof.to_dict()) == prof


def test_an_old_profile_without_the_fields_loads_with_none_and_a_bad_value_is_named(tmp_path):
    path = tmp_path / "p.json"
    base_profile("cpu").save(str(path))
    data = json.loads(path.read_text())
    assert not set(FIELDS) & set(data)
    assert HardwareProfile.load(str(path)).chunk_overhead_s is None
    for name in FIELDS:
        for bad, says in ((-1.0, "non-negative"), ("fast", "float"), (float("nan"), "")):
            path.write_text(json.dumps({**data, name: bad}))
            with pytest.raises(FileFormatError, match=rf"p.json.*{name}"):
                HardwareProfile.load(str(path))
        path.write_text(json.dumps({**data, name: None}))
        assert getattr(HardwareProfile.load(str(path)), name) is None


def test_slower_compute_scales_the_calibrated_fields_and_keeps_none():
    prof = attrs.evolve(PRESETS["cpu-gloo"], chunk_overhead_s=1e-3, dedup_id_s=None)
    slow = with_slower_compute(prof, 2.0)
    assert slow.chunk_overhead_s == pytest.approx(2e-3) and slow.dedup_id_s is None
    assert math.isclose(with_slower_compute(attrs.evolve(prof, dedup_id_s=5e-9), 0.5).dedup_id_s, 2.5e-9)
