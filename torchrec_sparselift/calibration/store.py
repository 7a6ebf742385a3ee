"""Machine fingerprints, the store of calibrated profiles keyed by them, and ``hardware="auto"``.

A hardware profile fitted from real steps (:mod:`torchrec_sparselift.calibration.step_fit`) holds rates
of one machine: its CPU or GPU, how many cores or devices, the collective backend, how many ranks
share it, and the software that runs the step (torch, fbgemm_gpu, torchrec). A
:class:`MachineFingerprint` names exactly that; :class:`ProfileStore` keeps one profile per
fingerprint (one JSON file each, named by the fingerprint's digest) and :meth:`ProfileStore.lookup`
returns the matching one, or the closest one together with the fields that differ (the caller warns
with them), or nothing.

Default store: ``$TORCHREC_SPARSELIFT_PROFILE_DIR`` if set, else
``~/.cache/torchrec_sparselift/profiles``. :func:`auto_profile` is what ``hardware="auto"``
resolves to: it only reads the store (this machine's profile, else the closest stored one, else
:func:`base_profile`) and warns, with the command that calibrates, when the answer is not this
machine's own up-to-date profile (:func:`stored_profile_problems`). The base CPU profile ships with
the package (``calibration/data/cpu-2core-gloo.json``). Nothing here imports torch unless asked for
the current machine's GPU (:func:`current_fingerprint` with ``device="cuda"``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

import attrs

from torchrec_sparselift.atomic import flock_until, lock_holder, write_json
from torchrec_sparselift.calibration.link import LinkRates, LinkRatesError
from torchrec_sparselift.calibration.step_fit import STEP_MODEL_VERSION, StepFitInfo, with_a2a_host_split
from torchrec_sparselift.cost.hardware import HardwareProfile, get_profile
from torchrec_sparselift.cost.step_terms import CPU_STEP_TERMS
from torchrec_sparselift.errors import FileFormatError
from torchrec_sparselift.files import Fields, canonical_digest, load_json, parse_json, read_attrs, record_reader

__all__ = [
    "MachineFingerprint",
    "ProfileStore",
    "StoredProfile",
    "current_fingerprint",
    "default_store_dir",
    "PROFILE_STORE_ENV",
    "BASE_CPU_PROFILE",
    "base_profile",
    "base_profile_text",
    "auto_profile",
    "auto_profile_link",
    "with_base_terms",
    "stored_profile_problems",
    "disturbed_spread",
    "drift_spread",
    "MAX_DRIFT_SPREAD",
    "calibrate_command",
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
    ``hosts``: hosts the job ran on (torchrun nodes; a profile calibrated across a network is not
    the one-host profile); versions of torch, fbgemm_gpu and torchrec ("none" when not installed).
    A one-host fingerprint's digest leaves ``hosts`` out, so profiles stored before it was a field
    keep their file names.
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
    hosts: int = 1

    def to_dict(self) -> Dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "MachineFingerprint":
        """The fingerprint :meth:`to_dict` wrote (a dict, or a file's reader): every field of its
        type, ``hosts`` 1 where absent (one-host profiles), unknown keys ignored."""
        f = record_reader(cls, data)
        for a in attrs.fields(cls):
            if a.type == "int" and f.has(a.name):
                f.req(a.name, int, lo=0)
        return read_attrs(cls, f, ignore_unknown=True, kinds={a.name: str for a in attrs.fields(cls) if a.type == "str"})

    def digest(self) -> str:
        d = self.to_dict()
        if d["hosts"] == 1:
            del d["hosts"]
        return canonical_digest(d, chars=16, spaced=True)

    def differences(self, other: "MachineFingerprint") -> List[str]:
        """``"field: mine vs other"`` for each field that differs (empty: same machine)."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {a[k]} vs {b[k]}" for k in a if a[k] != b[k]]

    def describe(self) -> str:
        hw = f"{self.devices}x {self.processor}" if self.device == "cuda" else f"{self.processor}, {self.cores} cores"
        hosts = f" on {self.hosts} hosts" if self.hosts != 1 else ""
        return (f"{hw}, {self.backend} x{self.ranks} ranks{hosts}, torch {self.torch}, fbgemm_gpu {self.fbgemm_gpu}, "
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


def usable_cores() -> int:
    """The cores this process may run on now (its affinity; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def current_fingerprint(device: str = "cpu", ranks: int = 1, backend: Optional[str] = None,
                        cores: Optional[int] = None, hosts: int = 1) -> MachineFingerprint:
    """The fingerprint of this machine for runs on ``device`` with ``ranks`` processes per host
    on ``hosts`` hosts.

    ``cores``: the cores the run may use (default :func:`usable_cores`). A process that pinned its
    ranks to a slice of the cores passes what it could use before pinning (the DLRM example does),
    so that it finds the profile its calibration stored."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if hosts < 1:
        raise ValueError(f"hosts must be >= 1, got {hosts}")
    processor, devices = _cpu_model(), 0
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
        processor, devices = torch.cuda.get_device_name(0), torch.cuda.device_count()
    return MachineFingerprint(
        device=device,
        processor=processor,
        cores=int(cores) if cores is not None else usable_cores(),
        devices=devices,
        backend=backend or ("nccl" if device == "cuda" else "gloo"),
        ranks=int(ranks),
        torch=_dist_version("torch"),
        fbgemm_gpu=_dist_version("fbgemm_gpu"),
        torchrec=_dist_version("torchrec"),
        hosts=int(hosts),
    )


@attrs.frozen
class StoredProfile:
    """A profile, the machine it was fitted on, and how (its stored JSON ``info``; a step fit's is
    read as :attr:`step_fit`)."""

    profile: HardwareProfile
    fingerprint: MachineFingerprint
    path: str
    info: Dict[str, Any] = attrs.field(factory=dict)

    @property
    def step_fit(self) -> StepFitInfo:
        return StepFitInfo.from_dict(self.info)

    @property
    def link(self) -> Optional[LinkRates]:
        """The link rates measured when the profile was calibrated (its ``info["link"]``); None for
        a profile stored without one (its link is unknown: nothing to compare a job's link with).
        A one-host record without the machine share (written before it was measured) takes its
        ranks per host on the fingerprint's cores."""
        data = self.info.get("link")
        if data is None:
            return None
        try:
            link = LinkRates.from_dict(data)
        except (LinkRatesError, TypeError) as e:
            raise LinkRatesError(f"{self.path}: its link record cannot be read ({e}); calibrate again") from e
        if link.machine_ranks is None and link.hosts == 1:
            # a record from before the machine share was measured: on one host every rank ran on
            # the fingerprinted machine
            link = attrs.evolve(link, machine_ranks=link.ranks_per_host, machine_cores=self.fingerprint.cores)
        return link


#: Longest wait (seconds) for another process's lock on a stored profile.
LOCK_TIMEOUT_S = 60.0

# lock files this process holds (re-entrant locking), by path
_HELD: Dict[str, int] = {}




# how much a differing field counts when picking the closest profile from another machine
_WEIGHTS = dict(device=100, backend=50, ranks=20, hosts=20, processor=10, devices=10, cores=5, torchrec=2,
                fbgemm_gpu=2, torch=1)


class ProfileStore:
    """Profiles keyed by machine fingerprint, one JSON file per fingerprint under ``root``."""

    def __init__(self, root: Optional[str] = None) -> None:
        self.root = root or default_store_dir()

    def path_for(self, fp: MachineFingerprint) -> str:
        return os.path.join(self.root, f"{fp.device}-{fp.digest()}.json")

    def save(self, profile: HardwareProfile, fp: MachineFingerprint,
             info: "Optional[Mapping[str, Any] | StepFitInfo]" = None, link: Optional[LinkRates] = None) -> str:
        """Store ``profile`` for ``fp`` (replacing an older one) with ``info`` (a
        :class:`~torchrec_sparselift.calibration.step_fit.StepFitInfo` or plain JSON values) and
        ``link``, the link rates measured with it (kept as ``info["link"]``; :attr:`StoredProfile.link`);
        returns the file's path."""
        os.makedirs(self.root, exist_ok=True)
        path = self.path_for(fp)
        if isinstance(info, StepFitInfo):
            info = info.to_dict()
        if link is not None:
            info = {**dict(info or {}), "link": link.to_dict()}
        payload = {"schema": STORED_SCHEMA, "fingerprint": fp.to_dict(), "profile": profile.to_dict(),
                   "info": dict(info or {})}
        with self.locked(fp):
            write_json(path, payload, prefix=".profile-", sort_keys=True)
        return path

    def lock_path(self, fp: MachineFingerprint) -> str:
        """The lock file beside ``fp``'s profile (``.<device>-<digest>.lock``)."""
        return os.path.join(self.root, f".{fp.device}-{fp.digest()}.lock")

    @contextlib.contextmanager
    def locked(self, fp: MachineFingerprint, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
        """Hold the exclusive lock on ``fp``'s stored profile (an ``fcntl.flock`` on
        :meth:`lock_path`), so that a read-refit-rewrite of it (:func:`~torchrec_sparselift.calibration.
        feedback.add_feedback`) is not interleaved with another process's. Re-entrant within one
        process. Waits at most ``timeout_s`` for another process, then raises ``TimeoutError``
        naming the lock file and the holder's pid. Without ``fcntl`` (non-POSIX) nothing is locked."""
        lock = self.lock_path(fp)
        if fcntl is None or _HELD.get(lock):
            _HELD[lock] = _HELD.get(lock, 0) + 1
            try:
                yield
            finally:
                _HELD[lock] -= 1
            return
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if not flock_until(fd, time.monotonic() + timeout_s, first_delay_s=0.005, max_delay_s=0.2):
                raise TimeoutError(
                    f"the stored profile {self.path_for(fp)} is locked by another process "
                    f"({lock_holder(fd)}, lock file {lock}) for more than {timeout_s:g} s; wait for it "
                    "to finish (a calibration or a measured guard adding its records), or stop it"
                )
            _HELD[lock] = 1
            try:
                yield
            finally:
                _HELD.pop(lock, None)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def load(self, path: str) -> StoredProfile:
        """The stored profile in ``path``; :class:`~torchrec_sparselift.errors.FileFormatError`
        naming the file and the field when it is unreadable or malformed."""
        f = Fields(load_json(path, "stored profile", top=dict), file=path, what="stored profile")
        schema = f.data.get("schema")
        if schema != STORED_SCHEMA:
            raise f.fail("schema", f"is {schema!r}, not {STORED_SCHEMA!r}: not a stored sparselift profile",
                         "remove the file from the profile store")
        fingerprint = MachineFingerprint.from_dict(f.obj("fingerprint"))
        profile = HardwareProfile.from_fields(f.obj("profile"))
        info = f.opt("info", dict, {})
        StepFitInfo.from_dict(f.obj("info", required=False))  # what .step_fit reads later
        if info.get("link") is not None:  # what .link reads later: a damaged record makes the profile unusable
            try:
                LinkRates.from_dict(info["link"])
            except (LinkRatesError, TypeError, ValueError) as e:
                raise f.child(info, "info").fail("link", f"cannot be read ({e})",
                                                 "delete the file and calibrate this machine again") from None
        return StoredProfile(profile=profile, fingerprint=fingerprint, path=path, info=dict(info))

    def all(self) -> List[StoredProfile]:
        """Every readable stored profile; an unreadable or malformed file is skipped with a warning
        naming it."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in sorted(os.listdir(self.root)):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                out.append(self.load(os.path.join(self.root, name)))
            except FileFormatError as e:
                warnings.warn(f"sparselift: skipping an unusable stored profile: {e}", stacklevel=2)
        return out

    def lookup(self, fp: MachineFingerprint) -> Tuple[Optional[StoredProfile], List[str]]:
        """``(stored, differences)``: the profile for ``fp`` with no differences; else the closest
        stored profile of the same device kind and the fields that differ; else ``(None, [])``.

        This machine's own stored profile, when unreadable or malformed, is a
        :class:`~torchrec_sparselift.errors.FileFormatError` naming the file and the fix (delete
        it and calibrate again), never silently replaced by another machine's profile."""
        exact = self.path_for(fp)
        if os.path.isfile(exact):
            try:
                s = self.load(exact)
            except FileFormatError as e:
                why = str(e).split("; to fix:")[0]
                raise FileFormatError(
                    f"this machine's calibrated profile is unusable: {why}; to fix: delete {exact} and calibrate "
                    f"again with `{calibrate_command(fp.ranks)}`", path=exact) from None
            if s.fingerprint == fp:
                return s, []
        best, best_score, best_diff = None, None, []
        for s in self.all():
            if s.fingerprint.device != fp.device:
                continue
            diff = fp.differences(s.fingerprint)
            score = sum(_WEIGHTS.get(d.split(":", 1)[0], 1) for d in diff)
            if best_score is None or score < best_score:
                best, best_score, best_diff = s, score, diff
        return best, best_diff


# -- the base profile and hardware="auto" ---------------------------------------------------------

#: The base CPU profile (kernel microbenchmarks of a 2-core machine, gloo x2) shipped as package data.
BASE_CPU_PROFILE = "cpu-2core-gloo.json"


def base_profile_text() -> str:
    """The shipped base CPU profile's JSON text (read through ``importlib.resources``, so it is
    found in a wheel install as in a checkout)."""
    from importlib import resources

    return resources.files("torchrec_sparselift.calibration").joinpath("data", BASE_CPU_PROFILE).read_text(
        encoding="utf-8")


def base_profile(device: str) -> HardwareProfile:
    """The profile a calibration starts from and ``hardware="auto"`` falls back to: the shipped
    CPU microbenchmark profile on CPU, the ``h100`` preset on CUDA."""
    if device == "cpu":
        name = f"package data calibration/data/{BASE_CPU_PROFILE}"
        data = parse_json(base_profile_text(), what="base profile", path=name)
        return HardwareProfile.from_fields(Fields(data, file=name, what="base profile"))
    return get_profile("h100")


def calibrate_command(ranks: int) -> str:
    """The command that calibrates this machine for ``ranks`` processes per host."""
    return f"torchrun --standalone --nproc_per_node {ranks} -m torchrec_sparselift calibrate steps"


#: Largest spread (slowest / fastest) of the reference plan's drift across one calibration's probe
#: workloads before the calibration warns and its profile counts as disturbed. Measured over seven
#: calibrations: 1.02-1.26x with probe fits of 7.7-9.1%; 1.49x and 2.10x with probe fits of 14.3%
#: and 22.8%, whose benchmark runs had held-out MAPEs of 18.0% and 24.9%.
MAX_DRIFT_SPREAD = 1.3


def drift_spread(drifts: Any) -> float:
    """``max / min`` of per-workload drifts; 1.0 for fewer than two."""
    ds = [float(d) for d in drifts if d > 0]
    return max(ds) / min(ds) if len(ds) > 1 else 1.0


def disturbed_spread(info: StepFitInfo) -> Optional[float]:
    """The drift spread a stored profile's calibration recorded when it is above
    :data:`MAX_DRIFT_SPREAD`, else None."""
    spread = info.drift_spread
    return float(spread) if spread is not None and float(spread) > MAX_DRIFT_SPREAD else None


def stored_profile_problems(info: StepFitInfo) -> List[str]:
    """Why a stored profile of this machine should be calibrated again (empty: it is fine), each as
    a phrase after "the profile ...": fitted by an older cost model (its missing terms, or another
    :data:`~torchrec_sparselift.calibration.step_fit.STEP_MODEL_VERSION`), or calibrated on a machine
    whose speed moved (:func:`disturbed_spread`). ``sparselift calibrate check`` fails on them and
    :func:`auto_profile` warns with them."""
    out = []
    missing = info.missing_terms()
    if missing:
        out.append(f"was fitted before the cost model had {', '.join(missing)} (they take the base profile's values)")
    if info.before_codec():
        out.append("was calibrated before the lossy comms' codec was measured (codec_byte_s: plans with "
                   "fp16/bf16 comms are priced with the base profile's)")
    if info.before_rewrites():
        out.append("was calibrated before the sparse-path rewrites' constants were measured (chunk_overhead_s, "
                   "dedup_id_s: the planner neither splits the batch nor deduplicates ids with it)")
    version = info.fitted_model_version()
    if version is not None and version != STEP_MODEL_VERSION:
        out.append(f"was fitted under cost-model structure {version} (this code prices structure "
                   f"{STEP_MODEL_VERSION}: its terms multiply other quantities now)")
    spread = disturbed_spread(info)
    if spread is not None:
        out.append(f"was calibrated while the machine's speed moved {spread:.2f}x between probe workloads "
                   "(calibrate on a quieter machine)")
    return out


def auto_profile(device: str, ranks: int, store: Optional[ProfileStore] = None,
                 warn: Callable[[str], None] = lambda m: warnings.warn(m, stacklevel=3),
                 cores: Optional[int] = None, hosts: int = 1) -> Tuple[HardwareProfile, str]:
    """``(profile, where)`` for ``hardware="auto"``: this machine's stored profile; else the
    closest stored one (``warn`` names the differing fingerprint fields); else the base profile
    (``warn`` says how to calibrate). Only reads the store. ``cores``: see :func:`current_fingerprint`."""
    profile, where, _link = auto_profile_link(device, ranks, store, warn, cores, hosts)
    return profile, where


def with_base_terms(profile: HardwareProfile, info: StepFitInfo, base: HardwareProfile) -> HardwareProfile:
    """``profile`` with every step term its fit lacks (:meth:`StepFitInfo.missing_terms`: fitted by an
    older cost model, so the stored file has no value of its own for it) set to ``base``'s value,
    the prior a calibration would have started that term from (e.g. ``cold_row_s`` of the package's
    kernel profile), instead of the field's class default. A step-fitted profile calibrated before
    the lossy comms' terms existed (host terms without ``codec_byte_s``) takes ``base``'s codec and
    the all-to-all's host share its fit and host terms give
    (:func:`~torchrec_sparselift.calibration.step_fit.with_a2a_host_split`)."""
    missing = set(info.missing_terms())
    fields = {f: getattr(base, f) for t in CPU_STEP_TERMS if t.name in missing for f in t.fields}
    out = attrs.evolve(profile, **fields) if fields else profile
    if info.before_codec():
        out = with_a2a_host_split(attrs.evolve(out, codec_byte_s=base.codec_byte_s), info.host_terms)
    return out


def auto_profile_link(device: str, ranks: int, store: Optional[ProfileStore] = None,
                      warn: Callable[[str], None] = lambda m: warnings.warn(m, stacklevel=3),
                      cores: Optional[int] = None,
                      hosts: int = 1) -> Tuple[HardwareProfile, str, Optional[LinkRates]]:
    """:func:`auto_profile` and the link the profile was calibrated on (None: the base profile, or
    a stored profile without a link record). A caller with a process group measures the job's
    link and corrects the profile with :func:`~torchrec_sparselift.calibration.link.correct_link_terms`."""
    store = store or ProfileStore()
    fp = current_fingerprint(device, ranks, cores=cores, hosts=hosts)
    found, diff = store.lookup(fp)
    how = f"calibrate this machine with `{calibrate_command(ranks)}`"
    if found is not None:
        if not diff:
            for problem in stored_profile_problems(found.step_fit):
                warn(f"sparselift: this machine's profile {found.path} {problem}: predictions may be off; {how}")
        else:
            warn(f"sparselift: no calibrated profile for this machine; using {found.path} from another machine "
                 f"(differs in {'; '.join(diff)}): predictions may be off; {how}")
        return with_base_terms(found.profile, found.step_fit, base_profile(device)), found.path, found.link
    base = base_profile(device)
    warn(f"sparselift: no calibrated profile for this machine in {store.root}; using {base.name}: "
         f"predictions may be off; {how}")
    return base, base.name, None
