"""The collective rates a job sees: a quick measurement run by every rank of a process group.

Ranks are grouped into hosts (ranks that share a host name and torchrun node, ``GROUP_RANK``).
Three families are timed, each at a few message sizes with several repetitions:

- **intra-host**: ``all_to_all_single`` inside each host's ranks (all hosts at once);
- **inter-host**: ``all_to_all_single`` among the ranks with the same local index on every host
  (all such groups at once, so a host's ranks share its link as they do in a job);
- **all-reduce**: ``all_reduce`` over the whole world (what the dense gradients use).

Each family is fitted to the cost model's equations (``bytes`` = one rank's buffer, ``n`` = the
ranks in the group)::

    all_to_all_single   t = latency + (n - 1) / n * bytes / bw      (bw: intra_bw, inter_bw)
    all_reduce          t = latency + 2 (n - 1) / n * bytes / allreduce_bw

by least squares on relative residuals, using the median of the repetitions at each size. A
bandwidth is per rank: the bytes each rank sends to others per second while every rank of the
group does the same (a host's ranks crossing one link each get their share of it). The largest
message is sized for each family by doubling until one call takes ``target_call_s``, so the
measurement takes a few seconds on a 100 Mbit/s link and on a loopback alike.

:func:`measure_link_rates` returns a :class:`LinkRates`, identical on every rank (rank 0's fit,
broadcast). :func:`links_differ` compares two of them beyond their measured spread.

Run under torchrun: ``python -m torchrec_sparselift.measure.link [--json PATH]``. Importing the
module does not import torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

__all__ = [
    "LinkRates",
    "LinkRatesError",
    "measure_link_rates",
    "links_differ",
    "fit_latency_bandwidth",
    "relative_spread",
    "host_groups",
    "host_key",
    "BANDWIDTH_FLOOR",
    "LATENCY_FLOOR",
    "LATENCY_FLOOR_S",
]

# links_differ's noise allowances (see its docstring)
BANDWIDTH_FLOOR = 0.25
LATENCY_FLOOR = 1.0
LATENCY_FLOOR_S = 100e-6

_TERMS = (
    # (field, label, kind)
    ("intra_bw", "intra-host all-to-all bandwidth", "bw"),
    ("intra_latency_s", "intra-host all-to-all latency", "latency"),
    ("inter_bw", "inter-host all-to-all bandwidth", "bw"),
    ("inter_latency_s", "inter-host all-to-all latency", "latency"),
    ("allreduce_bw", "all-reduce bandwidth", "bw"),
    ("allreduce_latency_s", "all-reduce latency", "latency"),
)


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

    def __attrs_post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise LinkRatesError("invalid LinkRates: " + "; ".join(problems))

    def problems(self) -> List[str]:
        out = []
        for name, value in (("hosts", self.hosts), ("ranks_per_host", self.ranks_per_host)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(f"{name}={value!r}: give an integer >= 1")
        if not out and self.hosts * self.ranks_per_host < 2:
            out.append("hosts=1, ranks_per_host=1: a link needs 2 or more ranks")
        for name, positive, optional in (
            ("intra_bw", True, True), ("intra_latency_s", False, True),
            ("inter_bw", True, True), ("inter_latency_s", False, True),
            ("spread", False, False), ("allreduce_bw", True, False), ("allreduce_latency_s", False, False),
            ("latency_spread_s", False, False),
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
        return out

    @property
    def topology(self) -> str:
        h, r = self.hosts, self.ranks_per_host
        return f"{h} host{'s' if h != 1 else ''} x {r} rank{'s' if r != 1 else ''}"

    def describe(self) -> str:
        """A few lines for a log: each term in bytes/s and bit/s, latencies in microseconds."""
        lines = [f"link rates on {self.topology} (spread: bandwidths {self.spread:.0%}, "
                 f"latencies {self.latency_spread_s * 1e6:.0f} us):"]
        for prefix, label in (("intra", "intra-host all-to-all"), ("inter", "inter-host all-to-all"),
                              ("allreduce", "all-reduce (world)")):
            bw = getattr(self, f"{prefix}_bw")
            if bw is None:
                lines.append(f"  {label:<22} not measured")
            else:
                lat = getattr(self, f"{prefix}_latency_s")
                lines.append(f"  {label:<22} {_fmt_bw(bw)}, latency {lat * 1e6:.0f} us")
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
        missing = [k for k in known if k not in data]
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
        return cls(**{k: data[k] for k in known})

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


def links_differ(
    stored: LinkRates,
    measured: LinkRates,
    *,
    floor: float = BANDWIDTH_FLOOR,
    latency_floor: float = LATENCY_FLOOR,
    latency_floor_s: float = LATENCY_FLOOR_S,
) -> List[str]:
    """Human-readable differences between a stored and a freshly measured :class:`LinkRates`;
    empty when they agree within noise.

    A bandwidth differs when the larger is more than ``1 + max(stored.spread, measured.spread,
    floor)`` times the smaller. A latency differs when the larger is more than ``1 +
    latency_floor`` times the smaller and the two are also further apart than ``max(
    latency_floor_s, stored.latency_spread_s + measured.latency_spread_s)`` (per-call latencies
    of gloo on a busy machine wander by scheduling hiccups). A term measured in one
    and absent in the other (one host vs several, one rank per host vs several) is a difference,
    and so is another grouping of ranks into hosts."""
    out = []
    if (stored.hosts, stored.ranks_per_host) != (measured.hosts, measured.ranks_per_host):
        out.append(f"topology: stored was measured on {stored.topology}, this job runs {measured.topology}")
    allowance = max(stored.spread, measured.spread)  # bandwidths only
    for name, label, kind in _TERMS:
        a, b = getattr(stored, name), getattr(measured, name)
        if a is None and b is None:
            continue
        if a is None or b is None:
            out.append(
                f"{label} ({name}): stored {'not measured' if a is None else _fmt_term(kind, a)}, "
                f"measured {'not measured' if b is None else _fmt_term(kind, b)}"
            )
            continue
        lo, hi = min(a, b), max(a, b)
        ratio = f"{b / a:.2f}x" if a > 0 else "from zero"
        if kind == "bw":
            tol = max(allowance, floor)
            if hi / lo - 1 <= tol:
                continue
            allowed = f"noise allowance {tol:.0%}"
        else:
            apart = max(latency_floor_s, stored.latency_spread_s + measured.latency_spread_s)
            if hi - lo <= apart or (lo > 0 and hi / lo - 1 <= latency_floor):
                continue
            allowed = f"noise allowance {apart * 1e6:.0f} us and {latency_floor:.0%}"
        out.append(f"{label} ({name}): stored {_fmt_term(kind, a)}, measured {_fmt_term(kind, b)} ({ratio}; {allowed})")
    return out


def host_key() -> str:
    """This process's host: its host name and torchrun node (``GROUP_RANK``), so that emulated
    hosts sharing one machine's name stay apart."""
    return f"{socket.gethostname()}/node{os.environ.get('GROUP_RANK', '')}"


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


# ---------------------------------------------------------------- measurement (side effects)


class _Family:
    """One timed family: the op, this rank's group (``None``: this rank only waits) and the
    factor from a rank's buffer bytes to the bytes the equation counts."""

    def __init__(self, name: str, op: str, group: Any, group_size: int) -> None:
        self.name, self.op, self.group, self.n = name, op, group, group_size
        per = (group_size - 1) / group_size
        self.factor = per if op == "all_to_all" else 2 * per


def _timed_call(family: _Family, numel: int, device: Any, buffers: Dict[int, Any]) -> float:
    import torch
    import torch.distributed as dist

    if numel not in buffers:
        buffers[numel] = (torch.ones(numel, dtype=torch.float32, device=device),
                          torch.empty(numel, dtype=torch.float32, device=device))
    inp, out = buffers[numel]
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    if family.group is not None:
        if family.op == "all_to_all":
            dist.all_to_all_single(out, inp, group=family.group)
        else:
            dist.all_reduce(inp, group=family.group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _world_max(values: Sequence[float], device: Any) -> np.ndarray:
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().numpy()


def _numel(nbytes: float, group_size: int) -> int:
    """Float32 elements for about ``nbytes``: a multiple of 64 per destination rank."""
    quantum = 64 * group_size
    return max(quantum, int(nbytes / 4) // quantum * quantum)


def _time_family(
    family: _Family, device: Any, repetitions: int, target_call_s: float, min_bytes: int, max_bytes: int
) -> Tuple[List[int], np.ndarray]:
    """Each call's size (bytes per rank buffer) and ``times[repetition, call]``, the slowest
    rank's time of each call (all ranks agree: the values come from an all-reduce)."""
    buffers: Dict[int, Any] = {}
    # size the largest message: grow until one call takes target_call_s (this also warms up
    # connections and drains a token-bucket shaper's burst)
    numel = _numel(max(min_bytes * 16, 64 * 1024), family.n)
    cap = _numel(max_bytes, family.n)
    while True:
        t = float(_world_max([_timed_call(family, numel, device, buffers)], device)[0])
        if t >= target_call_s or numel >= cap:
            break
        grow = min(8.0, max(2.0, target_call_s / max(t, 1e-6)))
        numel = min(cap, _numel(numel * 4 * grow, family.n))
        buffers.clear()
    small, mid = _numel(min_bytes, family.n), _numel(numel * 4 * 0.25, family.n)
    # the latency-bound size three times per repetition (cheap; outvotes scheduling hiccups)
    calls = [small] * 3 + sorted({mid, numel} - {small})
    _timed_call(family, numel, device, buffers)
    local = np.zeros((repetitions, len(calls)))
    for i in range(repetitions):
        for j, s in enumerate(calls):  # sizes interleaved: drift hits all alike
            local[i, j] = _timed_call(family, s, device, buffers)
    times = _world_max(local.ravel().tolist(), device).reshape(local.shape)
    return [s * 4 for s in calls], times


def measure_link_rates(
    *,
    repetitions: int = 5,
    target_call_s: float = 0.05,
    min_bytes: int = 4096,
    max_bytes: int = 32 << 20,
) -> LinkRates:
    """Measure the job's intra-host, inter-host and all-reduce rates; call it on every rank of
    an initialized process group (gloo or NCCL). Returns the same :class:`LinkRates` on every
    rank. Takes a few seconds: about ``repetitions x 1.3 x target_call_s`` per family plus the
    sizing calls and the creation of the subgroups."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise LinkRatesError(
            "measure_link_rates needs an initialized process group: call "
            "torch.distributed.init_process_group() first (e.g. under torchrun)"
        )
    if repetitions < 1 or target_call_s <= 0 or not 0 < min_bytes < max_bytes:
        raise LinkRatesError(
            f"repetitions={repetitions}, target_call_s={target_call_s}, min_bytes={min_bytes}, "
            f"max_bytes={max_bytes}: give repetitions >= 1, target_call_s > 0, 0 < min_bytes < max_bytes"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise LinkRatesError("a process group of one rank has no link to measure: run 2 or more ranks")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    keys: List[Any] = [None] * world
    dist.all_gather_object(keys, host_key())
    hosts = host_groups(keys)
    per_host = len(hosts[0])
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    if lws is not None and int(lws) != per_host:
        raise LinkRatesError(
            f"LOCAL_WORLD_SIZE={lws} but {per_host} ranks share host {keys[rank]!r} "
            f"(host keys: {sorted(set(keys))}); set LOCAL_WORLD_SIZE to the ranks per host"
        )

    created = []
    families = []
    try:
        if per_host > 1:
            mine = None
            for ranks in hosts:  # every rank creates every group, in the same order
                g = dist.new_group(ranks)
                created.append(g)
                if rank in ranks:
                    mine = g
            families.append(_Family("intra", "all_to_all", mine, per_host))
        if len(hosts) > 1:
            mine = None
            for j in range(per_host):
                ranks = [h[j] for h in hosts]
                g = dist.new_group(ranks)
                created.append(g)
                if rank in ranks:
                    mine = g
            families.append(_Family("inter", "all_to_all", mine, len(hosts)))
        families.append(_Family("allreduce", "all_reduce", dist.group.WORLD, world))

        fields: Dict[str, Any] = {"hosts": len(hosts), "ranks_per_host": per_host,
                                  "intra_bw": None, "intra_latency_s": None,
                                  "inter_bw": None, "inter_latency_s": None}
        timed = [(fam, _time_family(fam, device, repetitions, target_call_s, min_bytes, max_bytes))
                 for fam in families]
    finally:
        for g in created:
            dist.destroy_process_group(g)

    payload: List[Any] = [None]
    if rank == 0:  # fit here, then broadcast the rates or the error: no rank waits for nothing
        try:
            spreads, latency_spreads, where = [], [], ""
            for fam, (sizes, times) in timed:
                where = f" (family {fam.name})"
                lat, bw, spread, latency_spread = fit_family([s * fam.factor for s in sizes], times)
                fields[f"{fam.name}_bw"], fields[f"{fam.name}_latency_s"] = bw, lat
                spreads.append(spread)
                latency_spreads.append(latency_spread)
            where = ""
            rates = LinkRates(spread=max(spreads), latency_spread_s=max(latency_spreads), **fields)
            payload[0] = {"rates": rates.to_dict()}
        except LinkRatesError as e:
            payload[0] = {"error": f"{e}{where}"}
    dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise LinkRatesError(payload[0]["error"])
    return LinkRates.from_dict(payload[0]["rates"])


# ---------------------------------------------------------------- command line


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchrec_sparselift.measure.link",
        description="Measure the collective rates this job sees (run under torchrun; rank 0 prints).",
    )
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--target-call-ms", type=float, default=50.0, help="duration of the largest call")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the LinkRates here")
    p.add_argument("--backend", default="gloo")
    args = p.parse_args(argv)

    import torch.distributed as dist

    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc_per_node 2 -m torchrec_sparselift.measure.link", file=sys.stderr)
        return 2
    dist.init_process_group(args.backend)
    try:
        t0 = time.perf_counter()
        rates = measure_link_rates(repetitions=args.repetitions, target_call_s=args.target_call_ms / 1e3)
        elapsed = time.perf_counter() - t0
        if dist.get_rank() == 0:
            print(rates.describe())
            print(f"measured in {elapsed:.2f} s")
            print(repr(rates))
            if args.json:
                with open(args.json, "w") as f:
                    f.write(rates.to_json() + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
