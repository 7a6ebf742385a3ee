"""close_process_group: the one way entry points close their process group (runtime.process_group)."""

from __future__ import annotations

import pytest

from launcher import run_ranks


def _close_twice(rank: int, world: int):
    import time

    import torch.distributed as dist

    from torchrec_sparselift.runtime.process_group import SETTLE_S, close_process_group

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = [None] * world
    dist.all_gather_object(out, rank)  # the collective whose tensors gloo's workers drop late
    start = time.perf_counter()
    close_process_group()
    waited = time.perf_counter() - start
    closed = not dist.is_initialized()
    close_process_group()  # nothing left to close: a no-op, no error
    return out, closed, waited >= SETTLE_S


@pytest.mark.multiprocess
def test_close_process_group_destroys_the_group_then_lets_the_workers_settle():
    for rank_result in run_ranks(_close_twice, 2, backend=None, timeout_s=120):
        gathered, closed, settled = rank_result
        assert gathered == [0, 1] and closed and settled
