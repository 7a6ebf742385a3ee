"""A tiny job for the emulated-host testbed (run under torchrun by tests/test_testbed.py).

Every rank all-reduces a tensor filled with ``rank + 1`` over gloo and checks the sum; it also
checks that torchrun placed it on the emulated host it runs in. Prints one ``OK`` line per rank.
"""

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = int(os.environ["SPARSELIFT_TESTBED_HOST"])
    if int(os.environ["GROUP_RANK"]) != host:
        print(f"rank {rank}: torchrun node {os.environ['GROUP_RANK']} runs in host {host}", file=sys.stderr)
        return 1
    x = torch.full((int(sys.argv[1]) if len(sys.argv) > 1 else 1024,), float(rank + 1))
    dist.all_reduce(x)
    want = world * (world + 1) / 2
    dist.destroy_process_group()
    if not bool((x == want).all()):
        print(f"rank {rank}: all_reduce gave {x[0].item()}, want {want}", file=sys.stderr)
        return 1
    print(f"OK rank {rank} of {world} on host {host} via {os.environ['GLOO_SOCKET_IFNAME']}: sum {x[0].item():g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
