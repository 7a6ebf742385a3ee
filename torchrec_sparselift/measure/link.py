"""The collective rates a job sees: a quick measurement run by every rank of a process group.

Ranks are grouped into hosts (ranks that share a host name and torchrun node, ``GROUP_RANK``).
These families are timed, each at a few message sizes with several repetitions:

- **intra-host**: ``all_to_all_single`` inside each host's ranks (all hosts at once);
- **inter-host**: ``all_to_all_single`` among the ranks with the same local index on every host
  (all such groups at once, so a host's ranks share its link as they do in a job);
- **inter-host one-way, all and alone** (several hosts of several ranks): in the same groups, an
  ``all_to_all_single`` in which only the first host's member sends (to each other member; they
  send nothing), first in every group at once (``inter_oneway_bw``), then in local index 0's
  group alone (``inter_solo_bw``; the other ranks skip the calls and join every world-level
  barrier and reduction, so all ranks stay in step). One rank alone sending about as fast as
  each of the host's ranks at once means a link per rank; about ``ranks_per_host`` times as
  fast, one link the host's ranks share (``LinkRates.host_link_shared``). One-way, because an
  exchange both ways between two ranks can stop short of the link (on the testbed one pair's
  all-to-all reached about half of a 1 Gbit/s link each way, as fast alone as beside its host's
  other pair). Their sizing starts from the previous family's largest message;
- **all-reduce**: ``all_reduce`` over the whole world (what the dense gradients use);
- **replica sync, within a host and across hosts**: ``allreduce_coalesced`` of
  :data:`COALESCED_TENSORS` tensors (what ``DMPCollection``'s replica sync calls) in the intra-host
  groups and in the inter-host groups above, every group at once (``replica_intra_bw``,
  ``replica_inter_bw``; bandwidths only, their spreads not in ``spread``).

Each family is fitted to the cost model's equations (``bytes`` = one rank's buffer, ``n`` = the
ranks in the group)::

    all_to_all_single   t = latency + (n - 1) / n * bytes / bw      (bw: intra_bw, inter_bw; one-way:
                                                                     inter_oneway_bw, inter_solo_bw)
    all_reduce          t = latency + 2 (n - 1) / n * bytes / allreduce_bw

by least squares on relative residuals, using the median of the repetitions at each size. A
bandwidth is per rank: the bytes each rank sends to others per second while every rank of the
group does the same (a host's ranks crossing one link each get their share of it; one-way: the
bytes a sending rank sends per second, their latencies not kept and their spreads not in
``spread``: they only decide ``host_link_shared``). The largest
message is sized for each family by doubling until one call takes ``target_call_s``, so the
measurement takes a few seconds on a 100 Mbit/s link and on a loopback alike. The default 0.25 s
makes both timed sizes (the largest and a quarter of it) several times a token-bucket shaper's
burst: with 0.05 s the quarter size passed within a 512 KiB burst at line rate, and the fit read
a shared 300 Mbit/s link's all-reduce at 418 Mbit/s where long transfers reach 144-148
(docs/testbed.md).

:func:`measure_link_rates` returns a :class:`LinkRates`, identical on every rank (rank 0's fit,
broadcast). :func:`links_differ` compares two of them beyond their measured spread.

Run under torchrun: ``python -m torchrec_sparselift.measure.link [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np
import torch
import torch.distributed as dist

from torchrec_sparselift.calibration.link import (
    BANDWIDTH_FLOOR,
    LATENCY_FLOOR,
    LATENCY_FLOOR_S,
    LinkRates,
    LinkRatesError,
    fit_family,
    fit_latency_bandwidth,
    host_groups,
    links_differ,
    relative_spread,
)
from torchrec_sparselift.runtime.machine import machine_share
from torchrec_sparselift.runtime.process_group import close_process_group

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

# the rates as values (LinkRates, links_differ, the fits) live in calibration.link, pure; this
# module times the collectives


#: Tensors per ``allreduce_coalesced`` call of the replica-sync families (a 2D plan syncs one per
#: local table or shard; gloo's cost is the copy into one buffer and back, whatever their number).
COALESCED_TENSORS = 8


def host_key() -> str:
    """This process's host: its host name and torchrun node (``GROUP_RANK``), so that emulated
    hosts sharing one machine's name stay apart."""
    return f"{socket.gethostname()}/node{os.environ.get('GROUP_RANK', '')}"


# ---------------------------------------------------------------- measurement (side effects)


class _Family:
    """One timed family: the op, this rank's group (``None``: this rank only waits) and the
    factor from a rank's buffer bytes to the bytes the equation counts.

    ``op``: ``"all_to_all"`` (every member sends ``1/n`` of its buffer to each other member),
    ``"one_way"`` (an ``all_to_all_single`` in which only the member of group rank ``src`` sends:
    ``1/n`` of its buffer to each other member, who send nothing), ``"all_reduce"`` or
    ``"all_reduce_coalesced"`` (the buffer as :data:`COALESCED_TENSORS` tensors in one call)."""

    def __init__(self, name: str, op: str, group: Any, group_size: int, src: Optional[int] = None) -> None:
        self.name, self.op, self.group, self.n, self.src = name, op, group, group_size, src
        self.sender = group is not None and src is not None and dist.get_rank(group) == src
        per = (group_size - 1) / group_size
        self.factor = 2 * per if op.startswith("all_reduce") else per


def _buffers(family: _Family, numel: int, device: Any) -> Tuple[Any, Any, Optional[List[int]], Optional[List[int]]]:
    """``(input, output, input_splits, output_splits)`` of one call (splits None: even)."""
    def buf(k: int, fill: bool = False) -> Any:
        return (torch.ones if fill else torch.empty)(k, dtype=torch.float32, device=device)

    if family.op != "one_way":
        return buf(numel, fill=True), buf(numel), None, None
    chunk, n, src = numel // family.n, family.n, family.src
    if family.sender:
        return (buf(chunk * (n - 1), fill=True), buf(0), [0 if i == src else chunk for i in range(n)], [0] * n)
    return buf(0), buf(chunk), [0] * n, [chunk if i == src else 0 for i in range(n)]


def _timed_call(family: _Family, numel: int, device: Any, buffers: Dict[int, Any]) -> float:
    if numel not in buffers:
        buffers[numel] = _buffers(family, numel, device)
    inp, out, in_splits, out_splits = buffers[numel]
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    if family.group is not None:
        if family.op == "all_reduce":
            dist.all_reduce(inp, group=family.group)
        elif family.op == "all_reduce_coalesced":
            family.group.allreduce_coalesced(list(inp.chunk(COALESCED_TENSORS))).wait()
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=family.group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _world_max(values: Sequence[float], device: Any) -> np.ndarray:
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().numpy()


def _numel(nbytes: float, group_size: int) -> int:
    """Float32 elements for about ``nbytes``: a multiple of 64 per destination rank."""
    quantum = 64 * group_size
    return max(quantum, int(nbytes / 4) // quantum * quantum)


def _time_family(
    family: _Family, device: Any, repetitions: int, target_call_s: float, min_bytes: int, max_bytes: int,
    start_bytes: int = 0,
) -> Tuple[List[int], np.ndarray]:
    """Each call's size (bytes per rank buffer) and ``times[repetition, call]``, the slowest
    rank's time of each call (all ranks agree: the values come from an all-reduce; a rank outside
    ``family.group`` skips the calls and times about zero). ``start_bytes``: the first size tried
    for the largest message (e.g. another family's largest), when above the default start."""
    buffers: Dict[int, Any] = {}
    # size the largest message: grow until one call takes target_call_s (this also warms up
    # connections and drains a token-bucket shaper's burst)
    numel = _numel(min(max(min_bytes * 16, 64 * 1024, start_bytes), max_bytes), family.n)
    cap = _numel(max_bytes, family.n)
    while True:
        t = float(_world_max([_timed_call(family, numel, device, buffers)], device)[0])
        if t >= target_call_s or numel >= cap:
            break
        grow = min(8.0, max(2.0, target_call_s / max(t, 1e-6)))
        numel = min(cap, _numel(numel * 4 * grow, family.n))
        buffers.clear()
    small, mid = _numel(min_bytes, family.n), _numel(numel * 4 * 0.25, family.n)
    # the latency-bound size three times per repetition (cheap; outvotes scheduling hiccups); the
    # largest first, so that a token-bucket shaper's burst, drained by it, does not carry the next
    calls = sorted({mid, numel} - {small}, reverse=True) + [small] * 3
    _timed_call(family, numel, device, buffers)
    local = np.zeros((repetitions, len(calls)))
    for i in range(repetitions):
        for j, s in enumerate(calls):  # sizes interleaved: drift hits all alike
            local[i, j] = _timed_call(family, s, device, buffers)
    times = _world_max(local.ravel().tolist(), device).reshape(local.shape)
    return [s * 4 for s in calls], times


class _FitFailed(LinkRatesError):
    """The timings did not fit latency + bytes / bandwidth (raised on every rank alike)."""


def measure_link_rates(
    *,
    repetitions: int = 5,
    target_call_s: float = 0.25,
    min_bytes: int = 4096,
    max_bytes: int = 32 << 20,
    attempts: int = 3,
    max_spread: float = 0.10,
) -> LinkRates:
    """Measure the job's intra-host, inter-host and all-reduce rates (and, on several hosts of
    several ranks, whether a host's ranks share one link: ``inter_oneway_bw``, ``inter_solo_bw``); call it on
    every rank of an initialized process group (gloo or NCCL). Returns the same
    :class:`LinkRates` on every rank. Takes a few seconds: about ``repetitions x 1.3 x
    target_call_s`` per family plus the sizing calls and the creation of the subgroups.

    Up to ``attempts`` measurements in all (every rank alike, on rank 0's fit):

    * a busy machine's timings that do not grow with the message size: measured again with calls
      twice as long; :class:`LinkRatesError` after the last attempt;
    * a bandwidth spread above ``max_spread`` (the repetitions disagree, e.g. a machine busy for a
      moment: on the testbed's shared 1 Gbit/s link one job read 43.7 MB/s with an 18% spread
      where quiet ones read 55-61 MB/s within 2%): measured again, and the measurement with the
      smallest spread is returned. Not on one host: a loopback's CPU-bound rates spread 15-45%
      however often they are taken, and a comparison there counts only bandwidths several times
      apart (``calibration.link.ONE_HOST_BANDWIDTH_RATIO``), so one measurement is kept.

    The one-way rates that decide ``host_link_shared`` are measured in the first attempt that
    fits and kept with whichever attempt is returned (they repeat within a few percent where the
    exchanges spread 20-40%: 1.96-2.01x apart in three attempts on the testbed's 2 x 2 ranks)."""
    n = max(int(attempts), 1)
    best: Optional[LinkRates] = None
    sharing: Optional[Dict[str, Any]] = None
    call_s = target_call_s
    for attempt in range(n):
        try:
            rates = _measure_once(repetitions, call_s, min_bytes, max_bytes, sharing=sharing is None)
            if rates.inter_solo_bw is not None:
                sharing = {"inter_oneway_bw": rates.inter_oneway_bw, "inter_solo_bw": rates.inter_solo_bw}
            elif sharing is not None:
                rates = attrs.evolve(rates, **sharing)
        except _FitFailed:
            if attempt >= n - 1:
                if best is not None:
                    return best
                raise
            call_s *= 2
            continue
        if best is None or rates.spread < best.spread:
            best = rates
        if best.spread <= max_spread or best.hosts == 1:
            break
    assert best is not None
    return best


def _measure_once(repetitions: int, target_call_s: float, min_bytes: int, max_bytes: int,
                  sharing: bool = True) -> LinkRates:
    """One measurement of every family; ``sharing``: also the one-way families (several hosts of
    several ranks). The same on every rank (rank 0's fit, broadcast); raises on every rank alike."""
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
        replica: List[_Family] = []
        if per_host > 1:
            mine = None
            for ranks in hosts:  # every rank creates every group, in the same order
                g = dist.new_group(ranks)
                created.append(g)
                if rank in ranks:
                    mine = g
            families.append(_Family("intra", "all_to_all", mine, per_host))
            replica.append(_Family("replica_intra", "all_reduce_coalesced", mine, per_host))
        if len(hosts) > 1:
            mine = solo = src = None
            for j in range(per_host):
                ranks = [h[j] for h in hosts]
                g = dist.new_group(ranks)
                created.append(g)
                if rank in ranks:
                    mine, src = g, dist.get_group_rank(g, hosts[0][j])  # host 0's member sends one way
                    solo = g if j == 0 else None
            families.append(_Family("inter", "all_to_all", mine, len(hosts)))
            replica.append(_Family("replica_inter", "all_reduce_coalesced", mine, len(hosts)))
            if per_host > 1 and sharing:
                # host 0's ranks send one way, all at once, then local index 0's alone (the other
                # ranks skip the calls, group None, and join every world-level barrier and max)
                families.append(_Family("inter_oneway", "one_way", mine, len(hosts), src))
                families.append(_Family("inter_solo", "one_way", solo, len(hosts), src))
        families.append(_Family("allreduce", "all_reduce", dist.group.WORLD, world))
        families.extend(replica)

        machine_ranks, machine_cores = machine_share()
        fields: Dict[str, Any] = {"hosts": len(hosts), "ranks_per_host": per_host,
                                  "machine_ranks": machine_ranks, "machine_cores": machine_cores,
                                  "intra_bw": None, "intra_latency_s": None,
                                  "inter_bw": None, "inter_latency_s": None,
                                  "inter_oneway_bw": None, "inter_solo_bw": None,
                                  "replica_intra_bw": None, "replica_inter_bw": None}
        timed: List[Tuple[_Family, Tuple[List[int], np.ndarray]]] = []
        for fam in families:
            # the one-way families' sizing starts from the previous family's largest message
            start = max(timed[-1][1][0]) if fam.op == "one_way" else 0
            timed.append((fam, _time_family(fam, device, repetitions, target_call_s, min_bytes, max_bytes, start)))
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
                if fam.op in ("one_way", "all_reduce_coalesced"):  # one term each: their bandwidth alone
                    fields[f"{fam.name}_bw"] = bw
                    continue
                fields[f"{fam.name}_bw"], fields[f"{fam.name}_latency_s"] = bw, lat
                spreads.append(spread)
                latency_spreads.append(latency_spread)
            where = ""
            rates = LinkRates(spread=max(spreads), latency_spread_s=max(latency_spreads), **fields)
            payload[0] = {"rates": rates.to_dict()}
        except LinkRatesError as e:
            payload[0] = {"error": f"{e}{where}", "fit": bool(where)}
    dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise (_FitFailed if payload[0]["fit"] else LinkRatesError)(payload[0]["error"])
    return LinkRates.from_dict(payload[0]["rates"])


# ---------------------------------------------------------------- command line


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchrec_sparselift.measure.link",
        description="Measure the collective rates this job sees (run under torchrun; rank 0 prints).",
    )
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--target-call-ms", type=float, default=250.0, help="duration of the largest call")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the LinkRates here")
    p.add_argument("--backend", default="gloo")
    args = p.parse_args(argv)

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
        close_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
