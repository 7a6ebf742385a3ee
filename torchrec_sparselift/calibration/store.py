"""Machine fingerprints and the store of calibrated profiles keyed by them.

A hardware profile fitted from real steps (:mod:`torchrec_sparselift.cost.step_fit`) holds rates
of one machine: its CPU or GPU, how many cores or devices, the collective backend, how many ranks
share it, and the software that runs the step (torch, fbgemm_gpu, torchrec). A
:class:`MachineFingerprint` names exactly that; :class:`ProfileStore` keeps one profile per
fingerprint (one JSON file each, named by the fingerprint's digest) and :meth:`ProfileStore.lookup`
returns the matching one, or the closest one together with the fields that differ (the caller warns
with them), or nothing.

Default store: ``$TORCHREC_SPARSELIFT_PROFILE_DIR`` if set, else
``~/.cache/torchrec_sparselift/profiles``. Nothing here imports torch unless asked for the
current machine's GPU (:func:`current_fingerprint` with ``device="cuda"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import Any, Dict, List, Mapping, Optional, Tuple

import attrs

from torchrec_sparselift.atomic import write_json
from torchrec_sparselift.cost.hardware import HardwareProfile

__all__ = [
    "MachineFingerprint",
    "ProfileStore",
    "StoredProfile",
    "current_fingerprint",
    "default_store_dir",
    "PROFILE_STORE_ENV",
]

PROFILE_STORE_ENV = "TORCHREC_SPARSELIFT_PROFILE_DIR"
STORED_SCHEMA = "sparselift.stored_profile/1"


def default_store_dir() -> str:
    """``$TORCHREC_SPARSELIFT_PROFILE_DIR`` or ``~/.cache/torchrec_sparselift/profiles``."""
    env = os.environ.get(PROFILE_STORE_ENV)
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "torchrec_sparselift", "profiles")


@attrs.frozen(kw_only=True)
class MachineFingerprint:
    """What a calibrated profile is valid for.

    ``device``: "cpu" or "cuda"; ``processor``: CPU model (CPU runs) or GPU model (CUDA runs);
    ``cores``: usable CPU cores; ``devices``: visible GPUs (0 on CPU); ``backend``: gloo or nccl;
    ``ranks``: processes per host the profile was measured with (ranks share the cores);
    versions of torch, fbgemm_gpu and torchrec ("none" when not installed).
    """

    device: str
    processor: str
    cores: int
    devices: int
    backend: str
    ranks: int
    torch: str
    fbgemm_gpu: str
    torchrec: str

    def to_dict(self) -> Dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MachineFingerprint":
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def digest(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: "MachineFingerprint") -> List[str]:
        """``"field: mine vs other"`` for each field that differs (empty: same machine)."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {a[k]} vs {b[k]}" for k in a if a[k] != b[k]]

    def describe(self) -> str:
        hw = f"{self.devices}x {self.processor}" if self.device == "cuda" else f"{self.processor}, {self.cores} cores"
        return (f"{hw}, {self.backend} x{self.ranks} ranks, torch {self.torch}, fbgemm_gpu {self.fbgemm_gpu}, "
                f"torchrec {self.torchrec}")


def _dist_version(name: str) -> str:
    from importlib import metadata

    for candidate in (name, name.replace("_", "-"), name + "-cpu", name.replace("_", "-") + "-cpu"):
        try:
            return metadata.version(candidate)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


_CORES_BEFORE_PINNING: Optional[int] = None


def note_affinity_before_pinning(cpus: Any) -> None:
    """Called by the runtime right before it pins this process to a slice of the cores (one core
    per rank while measuring, or for a whole training run): the fingerprint keeps describing the
    cores the process could use, not the slice it was pinned to. Only the first call counts."""
    global _CORES_BEFORE_PINNING
    if _CORES_BEFORE_PINNING is None:
        _CORES_BEFORE_PINNING = max(1, len(cpus))


def _cores() -> int:
    if _CORES_BEFORE_PINNING is not None:
        return _CORES_BEFORE_PINNING
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def current_fingerprint(device: str = "cpu", ranks: int = 1, backend: Optional[str] = None) -> MachineFingerprint:
    """The fingerprint of this machine for runs on ``device`` with ``ranks`` processes per host."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    processor, devices = _cpu_model(), 0
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
        processor, devices = torch.cuda.get_device_name(0), torch.cuda.device_count()
    return MachineFingerprint(
        device=device,
        processor=processor,
        cores=_cores(),
        devices=devices,
        backend=backend or ("nccl" if device == "cuda" else "gloo"),
        ranks=int(ranks),
        torch=_dist_version("torch"),
        fbgemm_gpu=_dist_version("fbgemm_gpu"),
        torchrec=_dist_version("torchrec"),
    )


@attrs.frozen
class StoredProfile:
    """A profile, the machine it was fitted on, and how (free-form JSON ``info``)."""

    profile: HardwareProfile
    fingerprint: MachineFingerprint
    path: str
    info: Dict[str, Any] = attrs.field(factory=dict)


# how much a differing field counts when picking the closest profile from another machine
_WEIGHTS = dict(device=100, backend=50, ranks=20, processor=10, devices=10, cores=5, torchrec=2,
                fbgemm_gpu=2, torch=1)


class ProfileStore:
    """Profiles keyed by machine fingerprint, one JSON file per fingerprint under ``root``."""

    def __init__(self, root: Optional[str] = None) -> None:
        self.root = root or default_store_dir()

    def path_for(self, fp: MachineFingerprint) -> str:
        return os.path.join(self.root, f"{fp.device}-{fp.digest()}.json")

    def save(self, profile: HardwareProfile, fp: MachineFingerprint, info: Optional[Mapping[str, Any]] = None) -> str:
        """Store ``profile`` for ``fp`` (replacing an older one); returns the file's path."""
        os.makedirs(self.root, exist_ok=True)
        path = self.path_for(fp)
        payload = {"schema": STORED_SCHEMA, "fingerprint": fp.to_dict(), "profile": profile.to_dict(),
                   "info": dict(info or {})}
        write_json(path, payload, prefix=".profile-", sort_keys=True)
        return path

    def load(self, path: str) -> StoredProfile:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("schema") != STORED_SCHEMA:
            raise ValueError(f"{path} is not a stored sparselift profile (schema {STORED_SCHEMA})")
        return StoredProfile(profile=HardwareProfile.from_dict(data["profile"]),
                             fingerprint=MachineFingerprint.from_dict(data["fingerprint"]),
                             path=path, info=dict(data.get("info") or {}))

    def all(self) -> List[StoredProfile]:
        """Every readable stored profile (unreadable files are skipped)."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in sorted(os.listdir(self.root)):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                out.append(self.load(os.path.join(self.root, name)))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def lookup(self, fp: MachineFingerprint) -> Tuple[Optional[StoredProfile], List[str]]:
        """``(stored, differences)``: the profile for ``fp`` with no differences; else the closest
        stored profile of the same device kind and the fields that differ; else ``(None, [])``."""
        exact = self.path_for(fp)
        if os.path.isfile(exact):
            try:
                s = self.load(exact)
                if s.fingerprint == fp:
                    return s, []
            except (OSError, ValueError, KeyError, TypeError):
                pass
        best, best_score, best_diff = None, None, []
        for s in self.all():
            if s.fingerprint.device != fp.device:
                continue
            diff = fp.differences(s.fingerprint)
            score = sum(_WEIGHTS.get(d.split(":", 1)[0], 1) for d in diff)
            if best_score is None or score < best_score:
                best, best_score, best_diff = s, score, diff
        return best, best_diff
