"""Link rates as values: the collective rates a job sees, comparing two of them, and correcting a
profile's link terms by the difference.

:class:`LinkRates` is what :func:`torchrec_sparselift.measure.link.measure_link_rates` measures on
every rank of a process group (intra-host, inter-host and all-reduce bandwidth and per-call
latency, with their measured spread, and whether a host's ranks share one inter-host link); the
step calibration stores it with the profile it fits.
:func:`links_differ` says where two of them differ beyond their spread; :func:`correct_link_terms`
moves a profile's link terms by the difference between the link it was calibrated on and the one
measured now. Everything here is pure (no torch, no process group; the cost model's profile
fields are imported where a correction needs them, so reading link rates needs no torch).
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.hardware import COMPUTE_RATE_FIELDS, COMPUTE_TIME_FIELDS, with_slower_compute
from torchrec_sparselift.cost.step_terms import link_terms

__all__ = [
    "LinkRates",
    "LinkRatesError",
    "LinkCorrection",
    "links_differ",
    "differing_terms",
    "correct_link_terms",
    "corrected_bandwidth",
    "with_link_facts",
    "with_link_latency",
    "replica_rate_differs",
    "SHARED_LINK_MARGIN",
    "fit_latency_bandwidth",
    "fit_family",
    "relative_spread",
    "host_groups",
    "BANDWIDTH_FLOOR",
    "LATENCY_FLOOR",
    "LATENCY_FLOOR_S",
]

# links_differ's noise allowances (see its docstring)
BANDWIDTH_FLOOR = 0.25
#: The most a measured spread widens a bandwidth's allowance: a noisy measurement (per-repetition
#: fits scattered by a busy machine) must not hide a link several times slower.
BANDWIDTH_CEILING = 1.0
#: On one host the loopback's rates follow the machine's load (back-to-back measurements on a busy
#: 2-core machine differed by up to 2x in bandwidth and 5x in per-call latency): only a bandwidth
#: more than this many times apart (a shaped loopback: another network) is a difference there.
ONE_HOST_BANDWIDTH_RATIO = 3.0
LATENCY_FLOOR = 1.0
#: Ranks per core are counted, not timed: any change beyond rounding is a difference.
RANKS_PER_CORE_TOLERANCE = 0.01
LATENCY_FLOOR_S = 100e-6
#: :attr:`LinkRates.host_link_shared`: a host's link counts as shared when one rank sending alone
#: reaches at least ``1 + SHARED_LINK_MARGIN * (ranks_per_host - 1)`` times the rate of each with
#: all sending (halfway between 1x, a link per rank, and ``ranks_per_host`` x, one link for all).
SHARED_LINK_MARGIN = 0.5

_TERMS = (
    # (field, label, kind)
    ("intra_bw", "intra-host all-to-all bandwidth", "bw"),
    ("intra_latency_s", "intra-host all-to-all latency", "latency"),
    ("inter_bw", "inter-host all-to-all bandwidth", "bw"),
    ("inter_latency_s", "inter-host all-to-all latency", "latency"),
    ("allreduce_bw", "all-reduce bandwidth", "bw"),
    ("allreduce_latency_s", "all-reduce latency", "latency"),
)


#: LinkRates fields a record may lack (measured since a later version): they read as None.
_OPTIONAL_FIELDS = ("machine_ranks", "machine_cores", "inter_oneway_bw", "inter_solo_bw", "replica_intra_bw",
                    "replica_inter_bw")


class LinkRatesError(ValueError):
    """Link rates that cannot be measured, fitted or read; the message says what to change."""


def _number_problem(name: str, value: Any, *, positive: bool, optional: bool) -> Optional[str]:
    if value is None:
        return None if optional else f"{name}=None: give a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r}: give a number"
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        return f"{name}={value!r}: give a finite number {'> 0' if positive else '>= 0'}"
    return None


@attrs.frozen
class LinkRates:
    """Collective rates measured by every rank of a job, in bytes/s and seconds.

    Attributes:
        intra_bw / intra_latency_s: per-rank ``all_to_all_single`` bandwidth and per-call latency
            among the ranks of one host; ``None`` when every host runs one rank.
        inter_bw / inter_latency_s: the same among ranks on different hosts (one per host, all
            local indices at once); ``None`` on one host.
        spread: the measured relative spread of the repetitions: the largest, over the
            bandwidths, of the interquartile range of the per-repetition fits over their median.
        latency_spread_s: the same for the latencies, in seconds (the largest interquartile
            range of the per-repetition latency fits): per-call latencies on a busy CPU host
            wander by scheduling hiccups that a relative spread would overstate.
        allreduce_bw / allreduce_latency_s: bus bandwidth and per-call latency of an
            ``all_reduce`` over the whole world.
        hosts / ranks_per_host: the grouping the measurement saw.
        machine_ranks / machine_cores: the most ranks of the job on one machine and that
            machine's CPU cores (``runtime.machine.machine_share``; emulated hosts on one machine
            count as one machine), so :attr:`ranks_per_core` says how many ranks each core served;
            both None in a record written before they were measured.
        inter_oneway_bw / inter_solo_bw: the inter-host bandwidth of one-way traffic, in bytes
            a sending rank sends per second: every rank of the first host sends to its
            counterparts (same local index) on the other hosts, all at once / only local index 0
            sends, the host's other ranks idle. Their ratio decides :attr:`host_link_shared`.
            None on one host, with one rank per host, and in a record written before they were
            measured (both or neither).
        replica_intra_bw / replica_inter_bw: bus bandwidth (the all-reduce equation's) of
            ``allreduce_coalesced`` over several tensors, what ``DMPCollection``'s replica sync
            calls, among the ranks of each host / among the ranks with the same local index on
            every host, every group at once (as a 2D plan's replica groups sync). On gloo it
            copies the tensors into one buffer and back: within a host it ran at about half a
            plain all-reduce's rate (2 emulated hosts x 2 ranks on 2 cores, docs/benchmarks.md).
            None where there is no such group (one rank per host / one host) and in a record
            written before they were measured.
    """

    intra_bw: Optional[float]
    intra_latency_s: Optional[float]
    inter_bw: Optional[float]
    inter_latency_s: Optional[float]
    spread: float
    allreduce_bw: float
    allreduce_latency_s: float
    latency_spread_s: float
    hosts: int
    ranks_per_host: int
    machine_ranks: Optional[int] = None
    machine_cores: Optional[int] = None
    inter_oneway_bw: Optional[float] = None
    inter_solo_bw: Optional[float] = None
    replica_intra_bw: Optional[float] = None
    replica_inter_bw: Optional[float] = None

    def __attrs_post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise LinkRatesError("invalid LinkRates: " + "; ".join(problems))

    def problems(self) -> List[str]:
        out = []
        for name, value in (("hosts", self.hosts), ("ranks_per_host", self.ranks_per_host)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(f"{name}={value!r}: give an integer >= 1")
        if (self.machine_ranks is None) != (self.machine_cores is None):
            out.append(f"machine_ranks={self.machine_ranks!r}, machine_cores={self.machine_cores!r}: "
                       "give both or neither")
        for name in ("machine_ranks", "machine_cores"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                out.append(f"{name}={value!r}: give an integer >= 1 (or None: not measured)")
        if not out and self.hosts * self.ranks_per_host < 2:
            out.append("hosts=1, ranks_per_host=1: a link needs 2 or more ranks")
        for name, positive, optional in (
            ("intra_bw", True, True), ("intra_latency_s", False, True),
            ("inter_bw", True, True), ("inter_latency_s", False, True),
            ("spread", False, False), ("allreduce_bw", True, False), ("allreduce_latency_s", False, False),
            ("latency_spread_s", False, False), ("inter_oneway_bw", True, True), ("inter_solo_bw", True, True),
            ("replica_intra_bw", True, True), ("replica_inter_bw", True, True),
        ):  # fmt: skip
            p = _number_problem(name, getattr(self, name), positive=positive, optional=optional)
            if p:
                out.append(p)
        if not out:
            for prefix, present, why in (
                ("intra", self.ranks_per_host > 1, f"ranks_per_host={self.ranks_per_host}"),
                ("inter", self.hosts > 1, f"hosts={self.hosts}"),
            ):
                bw, lat = getattr(self, f"{prefix}_bw"), getattr(self, f"{prefix}_latency_s")
                if present and (bw is None or lat is None):
                    out.append(f"{prefix}_bw and {prefix}_latency_s are needed with {why}")
                if not present and (bw is not None or lat is not None):
                    out.append(f"{prefix}_bw and {prefix}_latency_s must be None with {why} (nothing to measure)")
            solo = (self.inter_oneway_bw, self.inter_solo_bw)
            if (solo[0] is None) != (solo[1] is None):
                out.append(f"inter_oneway_bw={solo[0]!r}, inter_solo_bw={solo[1]!r}: give both or neither")
            elif solo[0] is not None and (self.hosts == 1 or self.ranks_per_host == 1):
                out.append(f"inter_oneway_bw and inter_solo_bw must be None with hosts={self.hosts}, "
                           f"ranks_per_host={self.ranks_per_host} (whether a host's ranks share a link is "
                           "measured with several hosts of several ranks)")
        return out

    @property
    def host_link_shared(self) -> Optional[bool]:
        """Whether a host's ranks share one inter-host link: None when not measured (one host,
        one rank per host, or a record without ``inter_oneway_bw`` / ``inter_solo_bw``).

        With ``r = ranks_per_host`` ranks of a host sending to the other hosts at once, each sends
        at ``inter_oneway_bw``. On a link per rank (a NIC per GPU) one rank alone sends at about
        the same rate; on one link per host (one NIC for the host, the testbed's veth) one rank
        alone gets the whole link, about ``r`` times as much. The rule puts the line halfway:
        shared when ``inter_solo_bw >= inter_oneway_bw * (1 + SHARED_LINK_MARGIN * (r - 1))``
        (1.5x for 2 ranks per host, 2.5x for 4), far from either case's ratio, so the
        measurement's noise (a spread of 10-20% on a busy machine) does not flip it.

        Both rates are one-way: an exchange both ways between two ranks can stop short of the
        link (on the testbed's 1 Gbit/s per-host links one pair's ``all_to_all_single`` reached
        about half the rate each way, and a rank alone ran as fast as each of two ranks at
        once), so comparing exchanges would find a shared link unshared."""
        if self.hosts < 2 or self.ranks_per_host < 2 or self.inter_oneway_bw is None or self.inter_solo_bw is None:
            return None
        margin = 1 + SHARED_LINK_MARGIN * (self.ranks_per_host - 1)
        return bool(self.inter_solo_bw >= self.inter_oneway_bw * margin)

    @property
    def host_link(self) -> str:
        """``"shared by the host's 2 ranks (one rank sending alone 1.98x the rate of each with
        all)"``, ``"one per rank (...)"`` or ``"sharing not measured"``."""
        shared = self.host_link_shared
        if shared is None:
            return "sharing not measured"
        ratio = f"one rank sending alone {self.inter_solo_bw / self.inter_oneway_bw:.2f}x the rate of each with all"
        if shared:
            return f"shared by the host's {self.ranks_per_host} ranks ({ratio})"
        return f"one per rank ({ratio})"

    @property
    def ranks_per_core(self) -> Optional[float]:
        """Ranks each of the machine's cores serves, at least 1 (a rank computes on one core);
        None when the machine share was not measured."""
        if self.machine_ranks is None or self.machine_cores is None:
            return None
        return max(1.0, self.machine_ranks / self.machine_cores)

    @property
    def machine(self) -> str:
        """``"4 ranks on 2 cores"``, or ``"ranks per core not measured"``."""
        if self.machine_ranks is None:
            return "ranks per core not measured"
        return f"{self.machine_ranks} rank{'s' if self.machine_ranks != 1 else ''} on {self.machine_cores} " \
               f"core{'s' if self.machine_cores != 1 else ''}"

    @property
    def topology(self) -> str:
        h, r = self.hosts, self.ranks_per_host
        return f"{h} host{'s' if h != 1 else ''} x {r} rank{'s' if r != 1 else ''}"

    def describe(self) -> str:
        """A few lines for a log: each term in bytes/s and bit/s, latencies in microseconds."""
        lines = [f"link rates on {self.topology}, {self.machine} (spread: bandwidths {self.spread:.0%}, "
                 f"latencies {self.latency_spread_s * 1e6:.0f} us):"]
        for prefix, label in (("intra", "intra-host all-to-all"), ("inter", "inter-host all-to-all"),
                              ("allreduce", "all-reduce (world)")):
            bw = getattr(self, f"{prefix}_bw")
            if bw is None:
                lines.append(f"  {label:<22} not measured")
            else:
                lat = getattr(self, f"{prefix}_latency_s")
                lines.append(f"  {label:<22} {_fmt_bw(bw)}, latency {lat * 1e6:.0f} us")
        for prefix, label in (("replica_intra", "replica sync, a host"), ("replica_inter", "replica sync, hosts")):
            bw = getattr(self, f"{prefix}_bw")
            if bw is not None:
                lines.append(f"  {label:<22} {_fmt_bw(bw)} (allreduce_coalesced, every group at once)")
        if self.inter_solo_bw is not None:
            lines.insert(3, f"  {'inter-host one-way':<22} {_fmt_bw(self.inter_oneway_bw)} each of the host's ranks, "
                            f"{_fmt_bw(self.inter_solo_bw)} one alone: host link {self.host_link}")
        return "\n".join(lines)

    # -- serialization --------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LinkRates":
        if not isinstance(data, Mapping):
            raise LinkRatesError(f"LinkRates data must be a JSON object, got {type(data).__name__}")
        known = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(data) - set(known))
        missing = [k for k in known if k not in data and k not in _OPTIONAL_FIELDS]
        problems = []
        if unknown:
            problems.append(f"unknown fields {unknown}")
        if missing:
            problems.append(f"missing fields {missing}")
        if problems:
            raise LinkRatesError(
                "cannot read LinkRates: " + "; ".join(problems) + f"; the fields are {known} "
                "(measure again with torchrec_sparselift.measure.link to write a current record)"
            )
        return cls(**{k: data[k] for k in known if k in data})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LinkRates":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise LinkRatesError(f"LinkRates JSON is malformed: {e}") from e
        return cls.from_dict(data)


def _fmt_bw(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bytes_per_s / 1e6:.4g} MB/s ({bits / scale:.4g} {unit})"
    return f"{bytes_per_s:.4g} B/s ({bits:.4g} bit/s)"


def _fmt_term(kind: str, value: float) -> str:
    return _fmt_bw(value) if kind == "bw" else f"{value * 1e6:.0f} us"


# ---------------------------------------------------------------- pure parts


def fit_latency_bandwidth(bytes_moved: Sequence[float], seconds: Sequence[float]) -> Tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of ``t = latency + bytes_moved / bw``, by least squares on
    relative residuals (every size counts the same), the latency clamped at zero.

    Raises :class:`LinkRatesError` with fewer than two distinct sizes, a time that is not
    positive, or times that do not grow with size."""
    x = np.asarray(bytes_moved, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if x.shape != t.shape or x.ndim != 1:
        raise LinkRatesError(f"give one time per size: {x.shape} sizes, {t.shape} times")
    if len(np.unique(x)) < 2:
        raise LinkRatesError(f"measured at {len(np.unique(x))} message size(s); measure two or more")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise LinkRatesError(f"times must be positive and finite, got {t.tolist()}")
    a = np.stack([1.0 / t, x / t], axis=1)
    (lat, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if lat < 0:
        lat = 0.0
        per_byte = float(np.dot(x / t, np.ones_like(t)) / np.dot(x / t, x / t))
    if per_byte <= 0:
        raise LinkRatesError(
            f"times {[f'{s * 1e3:.3g} ms' for s in t]} do not grow with message size "
            f"{[int(b) for b in x]} B: measure larger messages (raise target_call_s) or on a quieter machine"
        )
    return float(lat), float(1.0 / per_byte)


def relative_spread(values: Sequence[float]) -> float:
    """Interquartile range over median: 0 for one value; robust to one outlier in five."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return 0.0
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return float((q3 - q1) / med) if med > 0 else float("inf")


def fit_family(bytes_moved: Sequence[float], times: np.ndarray) -> Tuple[float, float, float, float]:
    """``(latency_s, bytes_per_s, spread, latency_spread_s)`` from ``times[repetition, call]``
    (``bytes_moved[call]``; a size may repeat): the fit of the median time of each call, the
    relative spread of the bandwidths fitted per repetition and the interquartile range of the
    latencies fitted per repetition."""
    times = np.asarray(times, dtype=float)
    lat, bw = fit_latency_bandwidth(bytes_moved, np.median(times, axis=0))
    per_rep, failed = [], 0
    for row in times:
        try:
            per_rep.append(fit_latency_bandwidth(bytes_moved, row))
        except LinkRatesError:
            failed += 1
    spread = relative_spread([b for _, b in per_rep])
    if failed:  # a repetition whose times did not grow with size: call the noise at least 100%
        spread = max(spread, 1.0)
    lats = [la for la, _ in per_rep]
    latency_spread = float(np.subtract(*np.percentile(lats, [75, 25]))) if len(lats) > 1 else 0.0
    return lat, bw, spread, latency_spread


def links_differ(stored: LinkRates, measured: LinkRates, **allowances: float) -> List[str]:
    """Human-readable differences between a stored and a freshly measured :class:`LinkRates`;
    empty when they agree within noise.

    A bandwidth differs when the larger is more than ``1 + max(min(max(stored.spread, measured.spread),
    BANDWIDTH_CEILING), floor)`` times the smaller (a noisy measurement
    widens the allowance at most to 2x). A latency differs when the larger is more than ``1 +
    latency_floor`` times the smaller and the two are also further apart than ``max(
    latency_floor_s, stored.latency_spread_s + measured.latency_spread_s)`` (per-call latencies
    of gloo on a busy machine wander by scheduling hiccups). A term measured in one
    and absent in the other (one host vs several, one rank per host vs several) is a difference,
    and so is another grouping of ranks into hosts. ``allowances``: :func:`differing_terms`'
    ``floor``, ``latency_floor`` and ``latency_floor_s``."""
    return [msg for _term, msg in differing_terms(stored, measured, **allowances)]


def bandwidth_tolerance(spread: float, one_host: bool, floor: float = BANDWIDTH_FLOOR) -> float:
    """How far apart (``hi / lo - 1``) two measured bandwidths may be and still agree: the
    measured ``spread`` (at most :data:`BANDWIDTH_CEILING`), at least ``floor``; on one host at
    least ``ONE_HOST_BANDWIDTH_RATIO - 1``."""
    tol = max(min(spread, BANDWIDTH_CEILING), floor)
    return max(tol, ONE_HOST_BANDWIDTH_RATIO - 1) if one_host else tol


def differing_terms(
    stored: LinkRates,
    measured: LinkRates,
    *,
    floor: float = BANDWIDTH_FLOOR,
    latency_floor: float = LATENCY_FLOOR,
    latency_floor_s: float = LATENCY_FLOOR_S,
) -> List[Tuple[str, str]]:
    """``(term, message)`` per difference :func:`links_differ` reports; ``term`` is a
    :class:`LinkRates` field name, ``"topology"`` for another grouping of ranks into hosts,
    ``"ranks_per_core"``, or ``"host_link_shared"`` when both measured whether a host's ranks
    share one link and disagree (``inter_oneway_bw`` and ``inter_solo_bw`` themselves are not
    compared: they only decide that).
    When both were measured on one host, only a bandwidth more than
    :data:`ONE_HOST_BANDWIDTH_RATIO` times apart counts (the loopback follows the machine's load)."""
    out = []
    if (stored.hosts, stored.ranks_per_host) != (measured.hosts, measured.ranks_per_host):
        out.append(("topology", f"topology: stored was measured on {stored.topology}, this job runs {measured.topology}"))
    a, b = stored.ranks_per_core, measured.ranks_per_core
    if a is not None and b is not None and abs(b / a - 1) > RANKS_PER_CORE_TOLERANCE:
        out.append(("ranks_per_core", f"ranks per core: stored was measured with {stored.machine} ({a:.3g} per core), "
                                      f"this job runs {measured.machine} ({b:.3g} per core)"))
    a, b = stored.host_link_shared, measured.host_link_shared
    if a is not None and b is not None and a != b:
        out.append(("host_link_shared", f"host link (host_link_shared): stored {stored.host_link}, "
                                        f"measured {measured.host_link}"))
    allowance = max(stored.spread, measured.spread)  # bandwidths only
    one_host = stored.hosts == measured.hosts == 1
    for name, label, kind in _TERMS:
        a, b = getattr(stored, name), getattr(measured, name)
        if a is None and b is None:
            continue
        if a is None or b is None:
            out.append((name, f"{label} ({name}): stored {'not measured' if a is None else _fmt_term(kind, a)}, "
                              f"measured {'not measured' if b is None else _fmt_term(kind, b)}"))
            continue
        lo, hi = min(a, b), max(a, b)
        ratio = f"{b / a:.2f}x" if a > 0 else "from zero"
        if one_host and kind != "bw":
            continue  # loopback latencies on one host: the machine's load
        if kind == "bw":
            tol = bandwidth_tolerance(allowance, one_host, floor)
            if hi / lo - 1 <= tol:
                continue
            allowed = f"noise allowance {tol:.0%}"
        else:
            apart = max(latency_floor_s, stored.latency_spread_s + measured.latency_spread_s)
            if hi - lo <= apart or (lo > 0 and hi / lo - 1 <= latency_floor):
                continue
            allowed = f"noise allowance {apart * 1e6:.0f} us and {latency_floor:.0%}"
        out.append((name, f"{label} ({name}): stored {_fmt_term(kind, a)}, measured {_fmt_term(kind, b)} "
                          f"({ratio}; {allowed})"))
    return out


def host_groups(keys: Sequence[str]) -> List[List[int]]:
    """Ranks grouped by host key, hosts in order of their first rank. Raises
    :class:`LinkRatesError` when hosts run different numbers of ranks."""
    hosts: Dict[str, List[int]] = {}
    for rank, key in enumerate(keys):
        hosts.setdefault(key, []).append(rank)
    groups = list(hosts.values())
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        detail = ", ".join(f"{k}: ranks {v}" for k, v in hosts.items())
        raise LinkRatesError(
            f"hosts run different numbers of ranks ({detail}); the cost model assumes the same "
            "number on every host (local_world_size): start the same --nproc_per_node on each"
        )
    return groups




# ---------------------------------------------------------------- correcting a profile's link terms



def _stored_term(stored: LinkRates, name: str) -> Optional[float]:
    """The stored value a measured term is compared with. An all-to-all term the stored link
    lacks (calibrated on one host, run on several, or the reverse) takes the stored link's other
    all-to-all term: the calibration's probes ran all their all-to-all traffic over that one, and
    its step fit set ``intra_host_bw`` and ``inter_host_bw`` alike from it."""
    v = getattr(stored, name)
    if v is not None:
        return v
    other = {"intra_bw": "inter_bw", "inter_bw": "intra_bw",
             "intra_latency_s": "inter_latency_s", "inter_latency_s": "intra_latency_s"}.get(name)
    return getattr(stored, other) if other else None


def corrected_bandwidth(profile_bw: float, stored_bw: float, measured_bw: float) -> float:
    """A profile bandwidth moved by the change of the link under it:
    ``1 / new = 1 / profile_bw + (1 / measured_bw - 1 / stored_bw)`` (the profile's seconds per
    byte keep what the step fit added on top of the link's); ``measured_bw`` outright when that
    is not positive (the link got faster by more than the profile's per-byte time)."""
    for name, v in (("profile_bw", profile_bw), ("stored_bw", stored_bw), ("measured_bw", measured_bw)):
        if not (v > 0 and math.isfinite(v)):
            raise LinkRatesError(f"corrected_bandwidth: {name}={v!r}: give a positive finite bandwidth")
    per_byte = 1.0 / profile_bw + (1.0 / measured_bw - 1.0 / stored_bw)
    return 1.0 / per_byte if per_byte > 0 else float(measured_bw)


@attrs.frozen
class LinkCorrection:
    """What :func:`correct_link_terms` did: the corrected ``profile``, the ``differences``
    (:func:`links_differ`'s lines; empty: the profile was returned unchanged), the profile
    fields it moved as ``(field, old, new)`` (numbers; ``host_link_shared`` as 0.0 / 1.0) and the
    factor it slowed the compute terms by."""

    profile: Any
    differences: Tuple[str, ...]
    changed: Tuple[Tuple[str, float, float], ...]
    compute_factor: float = 1.0

    @property
    def differs(self) -> bool:
        return bool(self.differences)

    def describe(self, where: str = "the stored profile") -> str:
        """One warning: each differing term with both values, then each corrected field (the
        compute terms a share of the cores moved as one factor)."""
        def fmt(field: str, v: float) -> str:
            if field == "host_link_shared":
                return str(bool(v))
            if field.endswith("_factor"):
                return f"{v:.3g}"
            return _fmt_term("latency" if field.endswith("_s") else "bw", v)

        compute = set(COMPUTE_RATE_FIELDS + COMPUTE_TIME_FIELDS)
        link = [(f, a, b) for f, a, b in self.changed if f not in compute]
        moved = [f"{f} {fmt(f, a)} -> {fmt(f, b)}" for f, a, b in link]
        if self.compute_factor != 1.0:
            slowed = ", ".join(f for f, _a, _b in self.changed if f in compute)
            moved.append(f"compute terms ({slowed}) {self.compute_factor:.3g}x slower")
        return (f"the link or machine this job runs on differs from the one {where} was calibrated on beyond "
                f"the measured spread: {'; '.join(self.differences)}. Terms corrected in memory from this job's "
                f"measurement: {'; '.join(moved) or 'no profile term maps to the difference'}. Calibrate under "
                "this link for predictions fitted to it")


def correct_link_terms(profile: Any, stored: LinkRates, measured: LinkRates, **tolerances: float) -> LinkCorrection:
    """``profile`` (a :class:`~torchrec_sparselift.cost.hardware.HardwareProfile` calibrated on
    the link ``stored``) with its link terms moved to the link ``measured`` now, where the two
    differ beyond their spread (:func:`differing_terms`; ``tolerances``: its keyword arguments).

    Each flagged bandwidth the job uses (``intra_bw`` -> ``intra_host_bw``, ``inter_bw`` ->
    ``inter_host_bw``, ``allreduce_bw`` -> ``allreduce_bw``) by :func:`corrected_bandwidth`, the
    measured rates first put in the profile's byte count (the table
    :data:`~torchrec_sparselift.cost.step_terms.LINK_TERMS` says which rate moves which field); a
    slower inter-host link on several hosts sets ``inter_reduce_scatter_factor`` (the factor of
    the reduce-scatter bytes that cross hosts) below ``reduce_scatter_factor`` so that the link's
    added seconds count once per byte on the wire (the factor's own seconds per byte stay;
    ``reduce_scatter_factor`` keeps pricing the intra-host bytes, whose link did not slow);
    ``collective_latency_s`` shifted by ``measured - stored`` of the flagged all-to-all latency
    (inter-host first, then intra-host: the one the job's all-to-alls wait on), not below zero, and
    ``link_latency_s`` (where the profile has one, :func:`with_link_latency`) set to the measured;
    a flagged all-reduce latency alone does not move it (the step fit prices mostly all-to-all
    calls with it, and a shaped link's all-reduce latency fits near zero). Where more (or fewer)
    ranks share each core than in the calibration (``ranks_per_core``, both measured), every
    compute term is slowed by ``measured.ranks_per_core / stored.ranks_per_core``
    (:func:`~torchrec_sparselift.cost.hardware.with_slower_compute`: a rank computes on one core,
    and ranks that outnumber the cores take turns). Where ``measured`` knows whether a host's
    ranks share one link (:attr:`LinkRates.host_link_shared`) and the profile's
    ``host_link_shared`` says otherwise, the profile takes the measured value, whatever the stored
    link says (a profile calibrated on one host, or before sharing was measured, used on hosts
    whose ranks share a link); when no other term differs this is a difference of its own. Terms
    within the spread are left as the step fit set them; a corrected profile's name gets
    ``+link``."""
    flagged = differing_terms(stored, measured, **tolerances)
    shared = measured.host_link_shared
    if shared is not None and bool(profile.host_link_shared) != shared and not flagged:
        flagged = [("host_link_shared", f"host link (host_link_shared): the profile prices "
                                        f"{'one link shared by a host' if profile.host_link_shared else 'a link per rank'}, "
                                        f"this job measured {measured.host_link}")]
    if not flagged:
        return LinkCorrection(profile=profile, differences=(), changed=())
    names = {t for t, _ in flagged}
    changes: Dict[str, Any] = {}
    factor = 1.0
    if "ranks_per_core" in names:
        factor = float(measured.ranks_per_core) / float(stored.ranks_per_core)
        slower = with_slower_compute(profile, factor)
        changes.update({f: getattr(slower, f) for f in COMPUTE_RATE_FIELDS + COMPUTE_TIME_FIELDS
                        if getattr(slower, f) is not None and getattr(slower, f) != getattr(profile, f)})
    for row in link_terms("bandwidth"):
        m, s = getattr(measured, row.measured), _stored_term(stored, row.measured)
        if row.measured in names and m is not None and s is not None:
            k = row.profile_bytes_per_measured
            changes[row.field] = corrected_bandwidth(getattr(profile, row.field), k * s, k * m)
    if "inter_host_bw" in changes and measured.hosts > 1:
        # a reduce-scatter's link byte counts reduce_scatter_factor all-to-all bytes: what the step
        # fit found on the calibration box (gloo's reduce-scatter does its reduction on the CPU).
        # The link's added time is per byte on the wire, once: keep the factor's seconds per byte
        # at the old rate and add the new link's per byte, f' = 1 + (f - 1) * new / old (the
        # job's traffic that crosses hosts is priced at the inter-host rate, cost.hardware.a2a_bw)
        old_bw, new_bw = float(profile.inter_host_bw), changes["inter_host_bw"]
        f = profile.rs_factor(inter_host=True)
        if new_bw < old_bw and f > 1.0:
            changes["inter_reduce_scatter_factor"] = 1.0 + (f - 1.0) * new_bw / old_bw
    for row in link_terms("latency"):
        m, s = getattr(measured, row.measured), _stored_term(stored, row.measured)
        if row.measured in names and m is not None and s is not None:
            changes[row.field] = max(0.0, getattr(profile, row.field) + (m - s))
            if getattr(profile, "link_latency_s", None) is not None:  # the link's own part: the job's
                changes["link_latency_s"] = float(m)
            break
    if shared is not None and bool(profile.host_link_shared) != shared:
        changes["host_link_shared"] = shared
    changed = tuple((f, float(profile.rs_factor(True) if f == "inter_reduce_scatter_factor" else getattr(profile, f)),
                     float(v)) for f, v in changes.items())
    return LinkCorrection(profile=attrs.evolve(profile, name=f"{profile.name}+link", **changes) if changes else profile,
                          differences=tuple(msg for _t, msg in flagged), changed=changed, compute_factor=factor)


def with_link_facts(profile: Any, link: Optional[LinkRates]) -> Any:
    """``profile`` with what ``link`` measured directly of the job's network: ``host_link_shared``
    (:attr:`LinkRates.host_link_shared`) and the replica sync's rates (``replica_intra_bw``,
    ``replica_inter_bw``: the collective a 2D plan's replica sync calls, timed as it runs, so
    they are taken as measured, not corrected, where the profile has none or the measurement
    differs beyond its noise, :func:`replica_rate_differs`); ``profile`` itself when the link is
    None or measured none of them (one host of one rank, an older record) or they agree. The step
    calibration stores its fitted profile through this, and a stored profile moved to a job's
    link (:func:`~torchrec_sparselift.calibration.term_error.profile_on_link`) takes the job's."""
    if link is None:
        return profile
    changes: Dict[str, Any] = {}
    shared = link.host_link_shared
    if shared is not None and bool(profile.host_link_shared) != shared:
        changes["host_link_shared"] = shared
    for row in link_terms("taken"):
        v = getattr(link, row.measured)
        if v is not None and replica_rate_differs(getattr(profile, row.field), v, link):
            changes[row.field] = float(v)
    return attrs.evolve(profile, **changes) if changes else profile


def with_link_latency(profile: Any, link: Optional[LinkRates]) -> Any:
    """``profile`` with ``link_latency_s``, the link's own latency per collective call, as ``link``
    measured it: the inter-host all-to-all latency on several hosts, else the intra-host one. The
    step calibration stores its profile through this; a stored profile moved to another link has
    it moved by :func:`correct_link_terms` where the latencies differ beyond their noise (a plan
    cache keyed on the profile stays valid from one job to the next on the same link). ``profile``
    itself where ``link`` is None or measured no all-to-all latency (one rank)."""
    if link is None:
        return profile
    # the rows that move collective_latency_s, in the order correct_link_terms reads them
    latency = next((getattr(link, row.measured) for row in link_terms("latency")
                    if getattr(link, row.measured) is not None), None)
    if latency is None:
        return profile
    return attrs.evolve(profile, link_latency_s=float(latency))


def replica_rate_differs(current: Optional[float], measured: float, link: LinkRates) -> bool:
    """Whether a replica sync rate ``measured`` on ``link`` replaces the profile's ``current``:
    always where it has none; else beyond the noise :func:`links_differ` allows a bandwidth
    (:func:`bandwidth_tolerance`), so a profile (and the plans cached for it) stays the same from
    one job to the next on the same link."""
    if current is None:
        return True
    return max(current, measured) / min(current, measured) - 1.0 > bandwidth_tolerance(link.spread, link.hosts == 1)
