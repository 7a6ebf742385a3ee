"""Does a host's inter-host link carry its ranks' bytes together? One all-to-all pattern three ways.

On 2 hosts x 2 ranks (ranks 0, 1 on host 0; 2, 3 on host 1), host 0's ranks send to host 1's:

* ``one_rank``: rank 0 alone sends 2 MiB to each of ranks 2 and 3;
* ``split``: ranks 0 and 1 each send 1 MiB to each of ranks 2 and 3 (the same bytes per host);
* ``both_full``: ranks 0 and 1 each send 2 MiB to each (twice the bytes per host).

Equal ``one_rank`` and ``split`` times (and ``both_full`` twice them) mean the host's ranks share one
link: what crosses it is the host's bytes however they are spread (``HardwareProfile.host_link_shared``,
docs/cost_model.md). Run on the testbed::

    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 2 --rate 1gbit -- \\
        -m benchmarks.host_link_share

Prints each pattern's seconds per all-to-all (slowest rank, 6 calls after 2 warm-ups), 3 interleaved
repetitions.
"""

import time

import torch
import torch.distributed as dist

MIB = 1 << 20
PATTERNS = {  # pattern -> {sending rank: bytes to each of ranks 2 and 3}
    "one_rank": {0: 2 * MIB},
    "split": {0: MIB, 1: MIB},
    "both_full": {0: 2 * MIB, 1: 2 * MIB},
}


def timed(send_bytes, rank: int, world: int, calls: int = 6) -> float:
    send = [int(b // 4) for b in send_bytes]
    table = [None] * world
    dist.all_gather_object(table, send)
    recv = [table[s][rank] for s in range(world)]
    x, y = torch.ones(sum(send)), torch.empty(sum(recv))
    for _ in range(2):
        dist.all_to_all_single(y, x, recv, send)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_to_all_single(y, x, recv, send)
    dist.barrier()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit(f"host_link_share: run 2 hosts x 2 ranks (4 ranks), got {world}")
    out = {name: [] for name in PATTERNS}
    for _ in range(3):
        for name, senders in PATTERNS.items():
            sizes = [0] * world
            for dst in (2, 3):
                sizes[dst] = senders.get(rank, 0)
            out[name].append(timed(sizes, rank, world))
    if rank == 0:
        for name, secs in out.items():
            print(f"{name:10s} " + " ".join(f"{s * 1e3:.1f} ms" for s in secs), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
