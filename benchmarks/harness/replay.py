"""The communication part of a step, measured: one step's collectives counted on the real model,
then sent again alone on the link (no compute beside them).

::

    calls, allreduce = count_step_collectives(lifted, batches)   # a counted steady step
    comm_s = replay_collectives(calls, allreduce, pg, reps=5)     # those bytes alone, slowest rank

Every counted call (``runtime.comm_counter.CollectiveCall``: the input, output and gradient
all-to-alls and reduce-scatters) is replayed as one blocking ``all_to_all_single`` of uint8
buffers carrying the bytes the call sent, this rank's share split evenly over the
other ranks; DDP's all-reduce as one fp32 ``all_reduce`` of its bytes. The calls run one after
the other in the order the step issued them. A reduce-scatter moves its bytes as an all-to-all
here (the same bytes on the link, not gloo's reduce-scatter algorithm); the replay's time is
the slowest rank's median over ``reps``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchrec_sparselift.runtime.comm_counter import CollectiveCall, CommCounter

__all__ = ["count_step_collectives", "ddp_bytes", "peer_splits", "replay_collectives"]

#: the counted step: after this many untimed steps (the pipelines' fill and first-call setup)
COUNT_AFTER_STEPS = 2


def ddp_bytes(model: nn.Module) -> int:
    """Bytes DDP all-reduces per step in ``model``: the gradients of every parameter that a
    ``DistributedDataParallel`` inside it trains (not the ones it ignores: TorchRec's sharded
    tables, which differ per rank)."""
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, DistributedDataParallel)
               for name, p in m.module.named_parameters()
               if p.requires_grad and name not in getattr(m, "parameters_to_ignore", ()))


def count_step_collectives(lifted: Any, batches: Iterator[Any],
                           after: int = COUNT_AFTER_STEPS) -> Tuple[List[CollectiveCall], int]:
    """The collectives of one steady step of ``lifted`` (``runtime.Lifted``: model and pipeline) on
    ``batches`` (``after`` steps run uncounted first), and the bytes DDP all-reduces per step
    (:func:`ddp_bytes`: from the model, since the pipelines that hold the all-reduce back own its
    communication hook, which a counter cannot share)."""
    for _ in range(after):
        lifted.pipeline.progress(batches)
    with CommCounter() as counter:
        lifted.pipeline.progress(batches)
    calls = [c for c in counter.calls if c.sent_bytes or c.recv_bytes]
    return calls, ddp_bytes(lifted.model)


def peer_splits(sent: Sequence[int], rank: int) -> Tuple[List[int], List[int]]:
    """(input splits, output splits) in bytes of ``rank``'s all-to-all replaying one call, from
    every rank's bytes sent in it (``sent[r]``): rank r sends ``sent[r] // (W-1)`` to each other
    rank (the remainder to the first of them) and nothing to itself."""
    W = len(sent)

    def share(src: int, dst: int) -> int:
        if src == dst or W == 1:
            return 0
        total = int(sent[src])
        others = [q for q in range(W) if q != src]
        base, extra = divmod(total, W - 1)
        return base + (extra if dst == others[0] else 0)

    return [share(rank, q) for q in range(W)], [share(q, rank) for q in range(W)]


def replay_collectives(calls: Sequence[CollectiveCall], allreduce_bytes: int, pg: Any, reps: int = 5) -> float:
    """Seconds the counted collectives take alone on the link: the slowest rank's median over
    ``reps`` sequential replays (every rank replays the same number of calls: a step's collectives
    match across ranks). ``pg``: a group no pipeline has collectives in flight on (a pipeline's
    step returns with the next batch's input all-to-all issued on the model's group)."""
    W, rank = dist.get_world_size(pg), dist.get_rank(pg)
    n = torch.tensor([len(calls)], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
    dist.all_gather(counts, n, group=pg)
    if len({int(c) for c in counts}) != 1:
        raise RuntimeError(f"replay_collectives: the ranks counted different numbers of collectives "
                           f"({[int(c) for c in counts]}); the counted step is not one step on every rank")
    mine = torch.tensor([c.sent_bytes for c in calls] or [0], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(W)]
    dist.all_gather(every, mine, group=pg)
    plans = [peer_splits([int(every[r][i]) for r in range(W)], rank) for i in range(len(calls))]
    buffers = [(torch.zeros(sum(out), dtype=torch.uint8), torch.zeros(sum(inp), dtype=torch.uint8), inp, out)
               for inp, out in plans]
    grad = torch.zeros(max(allreduce_bytes // 4, 0), dtype=torch.float32)
    times: List[float] = []
    for _ in range(reps + 1):  # the first replay warms the buffers and gloo's pairs up, untimed
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        for recv, send, inp, out in buffers:
            dist.all_to_all_single(recv, send, output_split_sizes=out, input_split_sizes=inp, group=pg)
        if grad.numel():
            dist.all_reduce(grad, group=pg)
        mine_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(mine_s, op=dist.ReduceOp.MAX, group=pg)
        times.append(float(mine_s))
    return statistics.median(times[1:])
