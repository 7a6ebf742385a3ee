"""Does a two-level all-to-all pay across the testbed's hosts? The flat ``all_to_all_single`` against
two two-level schemes (``torchrec_sparselift.cost.two_level``), measured and priced.

* ``flat``: one ``all_to_all_single`` over every rank;
* ``rail``: an all-to-all within each host that regroups the blocks by the destination's local
  index, then an all-to-all among the ranks of one local index (one per host): a rank sends ``H - 1``
  messages across hosts instead of ``(H - 1) L``;
* ``leader``: each host gathers its ranks' buffers on its first rank, the leaders run an all-to-all
  (one message per host pair), each leader scatters what arrived.

Each scheme's result is checked against ``all_to_all_single``'s, element for element, at every size
before anything is timed. Then interleaved rounds (every scheme at every size once per round, the
order rotated each round), each a fresh send buffer, one untimed call, then ``--calls`` calls, each
after a barrier; a call's time is the slowest rank's, a round's the median call. Printed per size:
each scheme's median over rounds, the paired ratio two-level / flat (median over rounds of the
round's ratio), the same ratio of ``rail``'s cross-host stage timed alone (``rail_cross``), and
the price's ratio (``two_level.price``) from what the same job measures of its own link first:
the intra-host and the inter-host rate (4 MiB per pair), the latency of a call and of a message
(one-element all-to-alls within a host, across hosts, over all ranks) and the regrouping copy's
seconds per byte.

Run on the testbed (2 hosts x 2 ranks, 1 Gbit/s per host link)::

    OMP_NUM_THREADS=1 python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 2 \\
        --rate 1gbit -- -m benchmarks.two_level --out runs/two_level_1gbit.json

Options: ``--sizes`` (bytes per rank pair, comma-separated; default 4 KiB to 4 MiB), ``--rounds``
(default 5), ``--calls`` (default 5), ``--link-per-rank`` (price a link per rank instead of the
testbed's one link per host), ``--out`` (JSON report), ``--check-only`` (the exactness check alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks.harness import exit_now, interleaved_rounds, paired_ratio, spread, start_worker, stop_worker, write_report
from torchrec_sparselift.cost import two_level

KIB = 1 << 10
MIB = 1 << 20
DEFAULT_SIZES = (4 * KIB, 32 * KIB, 256 * KIB, MIB, 4 * MIB)
SCHEMES = two_level.SCHEMES
ELEM = 4  # float32


class Groups:
    """This rank's place: ``hosts`` x ``local`` ranks, its host's group and its local index's group
    (one rank per host); every rank creates every group (``new_group`` is collective)."""

    def __init__(self, world: int, local: int) -> None:
        if local < 1 or world % local:
            raise ValueError(f"two_level: {world} ranks do not split into hosts of {local} ranks")
        self.world, self.local, self.hosts = world, local, world // local
        self.rank = dist.get_rank()
        self.host, self.index = divmod(self.rank, local)
        self.intra = self.cross = None
        for h in range(self.hosts):
            g = dist.new_group(list(range(h * local, (h + 1) * local)))
            if h == self.host:
                self.intra = g
        for i in range(local):
            g = dist.new_group(list(range(i, world, local)))
            if i == self.index:
                self.cross = g
        self.leader = self.host * local


def flat(x: torch.Tensor, g: Groups) -> torch.Tensor:
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    return y


def rail(x: torch.Tensor, g: Groups) -> torch.Tensor:
    """``x``: this rank's send buffer, blocks in destination-rank order (``[H, L, n]``)."""
    H, L = g.hosts, g.local
    n = x.numel() // (H * L)
    a = x.view(H, L, n).transpose(0, 1).contiguous()  # [dst index, dst host, n]
    y1 = torch.empty_like(a)
    dist.all_to_all_single(y1, a, group=g.intra)  # [src index, dst host, n]: what my index gets from my host
    b = y1.transpose(0, 1).contiguous()  # [dst host, src index, n]
    y2 = torch.empty_like(b)
    dist.all_to_all_single(y2, b, group=g.cross)  # [src host, src index, n]: source-rank order
    return y2.view(-1)


def leader(x: torch.Tensor, g: Groups) -> torch.Tensor:
    H, L = g.hosts, g.local
    n = x.numel() // (H * L)
    y = torch.empty_like(x)
    if g.rank != g.leader:
        dist.gather(x, None, dst=g.leader, group=g.intra)
        dist.scatter(y, None, src=g.leader, group=g.intra)
        return y
    got = [torch.empty_like(x) for _ in range(L)]
    dist.gather(x, got, dst=g.leader, group=g.intra)
    a = torch.stack(got).view(L, H, L, n).permute(1, 0, 2, 3).contiguous()  # [dst host, src index, dst index, n]
    b = torch.empty_like(a)
    dist.all_to_all_single(b, a, group=g.cross)  # [src host, src index, dst index, n]
    out = list(b.permute(2, 0, 1, 3).contiguous().view(L, -1).unbind(0))  # per dst index, source-rank order
    dist.scatter(y, out, src=g.leader, group=g.intra)
    return y


RUN: Dict[str, Callable[[torch.Tensor, Groups], torch.Tensor]] = {"flat": flat, "rail": rail, "leader": leader}


def rail_cross(x: torch.Tensor, g: Groups) -> torch.Tensor:
    """``rail``'s cross-host stage alone (``L`` blocks to each other host's rank of this local index):
    what of ``rail`` is the cross-host exchange, timed beside the whole (not an all-to-all of ``x``)."""
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, group=g.cross)
    return y


#: parts of a scheme, timed beside the schemes
PARTS: Dict[str, Callable[[torch.Tensor, Groups], torch.Tensor]] = {"rail_cross": rail_cross}
TIMED = {**RUN, **PARTS}


def send_buffer(rank: int, world: int, n: int) -> torch.Tensor:
    """Distinct values per (sender, receiver, element), exact in float32."""
    base = torch.arange(n, dtype=torch.float32) % 4096
    return torch.cat([base + 4096.0 * (rank * world + q) for q in range(world)])


def check(g: Groups, n: int) -> None:
    """Every scheme returns exactly what ``all_to_all_single`` returns (raises naming the scheme)."""
    x = send_buffer(g.rank, g.world, n)
    want = flat(x, g)
    for name, fn in RUN.items():
        got = fn(x.clone(), g)
        if not torch.equal(got, want):
            bad = int((got != want).nonzero()[0].item()) if got.shape == want.shape else -1
            raise AssertionError(f"two_level: {name} differs from all_to_all_single on rank {g.rank} "
                                 f"({n} elements per pair; first differing element {bad})")


def timed_calls(fn: Callable[[], object], calls: int) -> List[float]:
    """``calls`` calls of ``fn``, each after a barrier; each call's seconds on the slowest rank."""
    fn()
    out = []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    t = torch.tensor(out, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure_link(g: Groups, calls: int, shared: bool) -> two_level.A2APrices:
    """The price's inputs measured on this job's ranks (medians of slowest-rank calls): the latencies
    from one-element all-to-alls (``t_world - t_intra = (H-1) L m_inter``, ``t_cross = call + (H-1)
    m_inter``, ``t_intra = call + (L-1) m_intra``; each clamped at 0), the rates from 4 MiB per pair
    less those latencies, the copy from one regrouping of a 4 MiB-per-pair buffer."""
    H, L, W = g.hosts, g.local, g.world

    def a2a(group, size: int, n: int) -> Callable[[], object]:
        x = torch.zeros(size * n)
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x, group=group)

    med = lambda fn, k=calls: statistics.median(timed_calls(fn, k))
    small = max(15, 3 * calls)  # the latencies are differences of small times: more calls
    t_intra = med(a2a(g.intra, L, 1), small)
    t_cross = med(a2a(g.cross, H, 1), small)
    t_world = med(a2a(None, W, 1), small)
    m_inter = max(0.0, (t_world - t_intra) / ((H - 1) * L))
    call = max(0.0, t_cross - (H - 1) * m_inter)
    m_intra = max(0.0, (t_intra - call) / (L - 1)) if L > 1 else 0.0
    big = 4 * MIB // ELEM
    intra_bw = (L - 1) * big * ELEM / max(1e-9, med(a2a(g.intra, L, big)) - call - (L - 1) * m_intra) if L > 1 else float("inf")
    inter_bw = (H - 1) * big * ELEM / max(1e-9, med(a2a(g.cross, H, big)) - call - (H - 1) * m_inter)
    x = torch.zeros(W * big)
    copy_s = med(lambda: x.view(H, L, -1).transpose(0, 1).contiguous()) / (W * big * ELEM)
    return two_level.A2APrices(intra_bw=intra_bw if L > 1 else inter_bw, inter_bw=inter_bw, call_s=call,
                               intra_message_s=m_intra, inter_message_s=m_inter, copy_byte_s=copy_s,
                               host_link_shared=shared)


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.two_level", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                    help="bytes each rank sends to each other rank, comma-separated (multiples of 4)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--link-per-rank", action="store_true",
                    help="price a link per rank (default: one link per host, as the testbed has)")
    ap.add_argument("--out", default=None, help="write a JSON report here")
    ap.add_argument("--check-only", action="store_true", help="the exactness check alone")
    args = ap.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        ap.error(f"--sizes: {args.sizes!r} is not a comma-separated list of byte counts")
    if not args.sizes or any(s < ELEM or s % ELEM for s in args.sizes):
        ap.error(f"--sizes: every size must be a positive multiple of {ELEM} bytes, got {args.sizes}")
    if args.rounds < 1 or args.calls < 1:
        ap.error("--rounds and --calls must be >= 1")
    return args


def run(args: argparse.Namespace, g: Groups) -> Dict[str, object]:
    for size in args.sizes:
        check(g, size // ELEM)
    if args.check_only:
        return {"checked_sizes": args.sizes}
    prices = measure_link(g, args.calls, shared=not args.link_per_rank)
    runs: Dict[tuple, List[float]] = {(s, k): [] for s in args.sizes for k in TIMED}

    def measure(item: tuple, _round: int) -> None:
        size, scheme = item
        x = send_buffer(g.rank, g.world, size // ELEM)
        runs[item].append(statistics.median(timed_calls(lambda: TIMED[scheme](x, g), args.calls)))

    interleaved_rounds(list(runs), measure, args.rounds)
    rows = []
    for size in args.sizes:
        shape = two_level.A2AShape(g.hosts, g.local, float(size))
        priced = {k: two_level.price(shape, prices, k).seconds for k in SCHEMES}
        row = dict(pair_bytes=size, measured_s={k: statistics.median(runs[(size, k)]) for k in TIMED},
                   spread={k: spread(runs[(size, k)]) for k in TIMED}, priced_s=priced, rounds=
                   {k: runs[(size, k)] for k in TIMED})
        row["ratio"] = {k: paired_ratio(runs[(size, k)], runs[(size, "flat")]) for k in (*two_level.TWO_LEVEL_SCHEMES, *PARTS)}
        row["priced_ratio"] = {k: priced[k] / priced["flat"] for k in two_level.TWO_LEVEL_SCHEMES}
        rows.append(row)
    return {"hosts": g.hosts, "ranks_per_host": g.local, "rounds": args.rounds, "calls": args.calls,
            "prices": {k: getattr(prices, k) for k in ("intra_bw", "inter_bw", "call_s", "intra_message_s",
                                                        "inter_message_s", "copy_byte_s", "host_link_shared")},
            "rows": rows}


def report(out: Dict[str, object]) -> None:
    p = out["prices"]
    print(f"two_level: {out['hosts']} hosts x {out['ranks_per_host']} ranks, {out['rounds']} rounds x "
          f"{out['calls']} calls; measured link: intra {p['intra_bw'] / 1e6:.0f} MB/s, inter {p['inter_bw'] / 1e6:.1f} "
          f"MB/s per rank, call {p['call_s'] * 1e6:.0f} us, message {p['intra_message_s'] * 1e6:.0f} us intra / "
          f"{p['inter_message_s'] * 1e6:.0f} us inter, copy {p['copy_byte_s'] * 1e9:.2f} ns/B, "
          f"link {'shared by a host' if p['host_link_shared'] else 'per rank'}")
    print(f"{'bytes/pair':>10} {'flat ms':>9} {'rail ms':>9} {'leader ms':>9}  {'rail/flat':>9} {'priced':>7}"
          f"  {'leader/flat':>11} {'priced':>7}  {'rail cross stage/flat':>21}  {'spread flat/rail/leader':>24}")
    for r in out["rows"]:
        m, q, pr, sp = r["measured_s"], r["ratio"], r["priced_ratio"], r["spread"]
        print(f"{r['pair_bytes']:>10} {m['flat'] * 1e3:>9.2f} {m['rail'] * 1e3:>9.2f} {m['leader'] * 1e3:>9.2f}  "
              f"{q['rail']:>9.2f} {pr['rail']:>7.2f}  {q['leader']:>11.2f} {pr['leader']:>7.2f}  {q['rail_cross']:>21.2f}  "
              f"{sp['flat']:>7.0%} {sp['rail']:>7.0%} {sp['leader']:>7.0%}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    w = start_worker()
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", w.world_size))
        g = Groups(w.world_size, local)
        if g.hosts < 2 or g.local < 2:
            print(f"two_level: needs 2+ hosts of 2+ ranks (got {g.hosts} x {g.local}); run it on the testbed",
                  file=sys.stderr)
            return 2
        out = run(args, g)
        if g.rank == 0:
            if args.check_only:
                print(f"two_level: rail and leader equal all_to_all_single at {args.sizes} bytes per pair")
            else:
                report(out)
                if args.out:
                    write_report(args.out, out)
    finally:
        stop_worker()
    return 0


if __name__ == "__main__":
    exit_now(main)
