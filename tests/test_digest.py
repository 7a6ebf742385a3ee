"""One canonical digest (``files.canonical_digest``) keys everything the package stores, and its
values are the ones stored plans, profiles and guard caches were written under."""

from __future__ import annotations

import ast
import collections
import enum
import os

import attrs

from torchrec_sparselift.calibration.store import MachineFingerprint
from torchrec_sparselift.files import canonical_digest, canonical_form
from torchrec_sparselift.measure.guard import MeasuredGuard, guard_cache_path
from torchrec_sparselift.semantics.workload import FeatureStats, WorkloadStats

PACKAGE_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "torchrec_sparselift")


class Color(enum.Enum):
    RED = 1


@attrs.frozen
class Pair:
    a: int
    b: float


Point = collections.namedtuple("Point", "x y")


def _mixed() -> dict:
    return {"b": (1, 2.5, "x"), "a": {3, 1, 2}, 7: None, "inf": float("inf"), "nan": float("nan"),
            "enum": Color.RED, "attrs": Pair(1, 0.1), "nt": Point(1, [2, 3]), "flag": True,
            "nested": {"z": [frozenset({"q", "p"})], "y": -0.0}}


def _machine(**kw) -> MachineFingerprint:
    return MachineFingerprint(device="cpu", processor="Intel Xeon", cores=2, devices=0, backend="gloo",
                              ranks=2, torch="2.13.0", fbgemm_gpu="1.8.0", torchrec="1.8.0", **kw)


class _Fingerprint:
    def digest(self) -> str:
        return "ab" * 32


def test_the_digests_are_the_ones_stored_files_are_keyed_by():
    """The hex digests of known inputs, as every version of the package has computed them (plan
    fingerprints and the plan cache, workload statistics, the machine a profile was fitted on, the
    measured guard's cache file)."""
    assert canonical_digest(_mixed()) == "d8005b5aa956a4cab79084fd387d1455e80bc6f26041c87207400b982452e9d1"
    assert _machine().digest() == "e0f6738232f37326"
    assert _machine(hosts=3).digest() == "1ea7e78e36409610"
    stats = WorkloadStats([FeatureStats(feature="f2", pooling_factor=3.0, batch_size=512.0),
                           FeatureStats(feature="f1", pooling_factor=1.25)])
    assert stats.digest() == "40e59738f529256221543b4d5bb520779f2b3f44ddec43ccdc1aa839da59e3fd"
    assert guard_cache_path("/c", _Fingerprint(), MeasuredGuard(candidates=4, steps=8)) == \
        "/c/guarded-c3552afa2f2da7072247.json"


def test_the_digest_does_not_depend_on_order_and_tells_values_apart():
    a = {"x": [1, 2], "y": {"p": 1.5, "q": {2, 1}}}
    b = {"y": {"q": {1, 2}, "p": 1.5}, "x": [1, 2]}
    assert canonical_digest(a) == canonical_digest(b)
    assert canonical_digest(a) != canonical_digest({**a, "x": [2, 1]})
    assert canonical_digest(a, chars=16) == canonical_digest(a)[:16]
    assert canonical_digest(a, spaced=True) != canonical_digest(a)
    assert canonical_form(Pair(1, 0.5)) == {"__type__": "Pair", "a": 1, "b": 0.5}


def test_only_files_hashes():
    """Every digest goes through ``files.canonical_digest``: no other module imports hashlib."""
    hashing = []
    for dirpath, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            with open(path) as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if "hashlib" in names:
                    hashing.append(os.path.relpath(path, PACKAGE_DIR))
    assert hashing == ["files.py"], hashing
