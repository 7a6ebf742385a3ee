"""Memory safety: what one shard really pins per rank, against SparseLift's and TorchRec's estimates.

    python -m benchmarks.memory_safety --rows 200000 --dim 64 --batch-size 2048 --pooling 16 \\
        --out memory.json

For every sharding type the CPU runtime executes (table-wise, column-wise, row-wise,
table-row-wise with the fused kernel; data-parallel with the dense kernel), 2 gloo ranks shard
one ``EmbeddingBagCollection`` table with ``DistributedModelParallel`` (row-wise AdaGrad fused
into the backward for sharded tables, ``torch.optim.Adagrad`` for the data-parallel one) and
measure, per rank:

* ``weights``: bytes of the rank's local shards of the table (``state_dict`` local shards);
* ``optimizer``: bytes of the rank's optimizer state (fused optimizer ``state_dict`` local
  shards, or the dense optimizer's state);
* ``step``: the peak of memory allocated during one training step (the input KJT, the
  input/output all-to-alls, lookups, gradients, the optimizer update), read from
  ``torch.profiler``'s memory events (``Total Allocated``) after two warm-up steps.

``measured`` = weights + optimizer + step, on the rank that holds the most; ``shard`` = measured
minus the rank's own batch I/O (its input KJT, its pooled output and that output's gradient,
which every rank pays for every table wherever the table lives, and which TorchRec and
SparseLift leave to the storage reservation). SparseLift's estimate is
:func:`torchrec_sparselift.semantics.graph.shard_memory` summed over the shards the rank holds;
TorchRec's is ``EmbeddingStorageEstimator``'s ``Storage`` (DDR on CPU) summed the same way. A
ratio (estimate / shard) below 1 means the estimate is short of what the shard really pins.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness import exit_now, write_report

__all__ = ["main", "CASES"]

WORLD = 2
#: (sharding type, compute kernel) measured on CPU
CASES: Tuple[Tuple[str, str], ...] = (
    ("table_wise", "fused"),
    ("column_wise", "fused"),
    ("row_wise", "fused"),
    ("table_row_wise", "fused"),
    ("data_parallel", "dense"),
)


def _module(args: argparse.Namespace, device: str = "cpu") -> Any:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=args.dim, num_embeddings=args.rows,
                                   feature_names=["f"])],
        device=torch.device(device),
    )


def _batch(rank: int, step: int, args: argparse.Namespace) -> Any:
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(7919 * rank + step)
    lengths = torch.full((args.batch_size,), args.pooling, dtype=torch.int64)
    ids = torch.randint(0, args.rows, (args.batch_size * args.pooling,), generator=g)
    return KeyedJaggedTensor(keys=["f"], values=ids, lengths=lengths)


class _AllTypesSharder:
    """An EBC sharder that offers every sharding type on CPU (TorchRec's offers row-wise and
    table-row-wise only for CUDA, although the CPU runtime runs them)."""

    def __new__(cls, **kw: Any) -> Any:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        class Sharder(EmbeddingBagCollectionSharder):
            def sharding_types(self, compute_device_type: str) -> List[str]:
                return ["table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel"]

        return Sharder(**kw)


def _local_bytes(t: Any) -> int:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(t, ShardedTensor):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in t.local_shards())
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return 0


def _peak_step_bytes(step_fn: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    return int(max([0] + totals))


def _worker(rank: int, port: int, case: Tuple[str, str], args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    st, _kernel = case
    ebc = _module(args, "meta")
    if st != "data_parallel":
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01})
    sharder = _AllTypesSharder()
    spec = {"table_wise": lambda: table_wise(rank=0), "column_wise": lambda: column_wise(ranks=[0, 1]),
            "row_wise": lambda: row_wise(), "table_row_wise": lambda: table_row_wise(host_index=0),
            "data_parallel": lambda: data_parallel()}[st]()
    mplan = construct_module_sharding_plan(ebc, per_param_sharding={"t": spec}, local_size=WORLD,
                                           world_size=WORLD, device_type="cpu", sharder=sharder)
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=ShardingPlan({"": mplan}),
                                   sharders=[sharder], init_data_parallel=True)
    dense_opt = None
    if st == "data_parallel":
        dense_opt = torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.01)

    def step(i: int) -> None:
        kjt = _batch(rank, i, args)
        loss = dmp(kjt).values().sum()
        loss.backward()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad(set_to_none=True)

    for i in range(2):
        step(i)
    dist.barrier()
    peak = _peak_step_bytes(lambda: step(2))
    weights = sum(_local_bytes(t) for k, t in dmp.state_dict().items() if k.endswith("weight"))
    if dense_opt is not None:
        opt = sum(_local_bytes(v) for s in dense_opt.state.values() for v in s.values())
    else:
        opt = sum(_local_bytes(v) for s in dmp.fused_optimizer.state_dict()["state"].values()
                  for v in (s.values() if isinstance(s, dict) else [s]))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"weights": weights, "optimizer": opt, "step": peak}, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(case: Tuple[str, str], args: argparse.Namespace) -> List[Dict[str, int]]:
    """Per-rank measured bytes for one (sharding type, kernel) case."""
    with tempfile.TemporaryDirectory(prefix="memsafety_") as out:
        mp.start_processes(_worker, args=(_free_port(), case, args, out), nprocs=WORLD,
                           start_method="spawn", join=True)
        ranks = []
        for r in range(WORLD):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return ranks


def _ranks_of(st: str) -> List[List[int]]:
    """Shard index -> rank, for the placements the measurement uses."""
    return {"table_wise": [0], "column_wise": [0, 1], "row_wise": [0, 1], "table_row_wise": [0, 1],
            "data_parallel": [0, 1]}[st]


def sparselift_estimate(case: Tuple[str, str], args: argparse.Namespace) -> List[float]:
    from torchrec.distributed.planner.types import ParameterConstraints

    from torchrec_sparselift.semantics.graph import candidate_for, shard_memory
    from torchrec_sparselift.semantics.tables import extract_tables

    st, kernel = case
    cons = {"t": ParameterConstraints(sharding_types=[st], pooling_factors=[float(args.pooling)])}
    (h,) = extract_tables(_module(args, "meta"), [_AllTypesSharder()], "cpu", args.batch_size, cons)
    cand = candidate_for(0, h.spec, st, kernel, WORLD, WORLD, 2 if st == "column_wise" else 1)
    dev, host = shard_memory(h.spec, cand, WORLD)
    per_rank = [0.0] * WORLD
    for r in _ranks_of(st)[: cand.num_shards]:
        per_rank[r] += dev + host
    return per_rank


def torchrec_estimate(case: Tuple[str, str], args: argparse.Namespace) -> List[float]:
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    st, kernel = case
    topo = Topology(world_size=WORLD, local_world_size=WORLD, compute_device="cpu")
    cons = {"t": ParameterConstraints(sharding_types=[st], compute_kernels=[kernel],
                                      pooling_factors=[float(args.pooling)],
                                      min_partition=args.dim // 2)}
    ebc = _module(args, "meta")
    if st != "data_parallel":
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01})
    enum = EmbeddingEnumerator(topology=topo, batch_size=args.batch_size, constraints=cons,
                               estimator=[EmbeddingStorageEstimator(topo, cons)])
    (opt,) = [o for o in enum.enumerate(ebc, [_AllTypesSharder()])
              if o.sharding_type == st and o.compute_kernel == kernel]
    per_rank = [0.0] * WORLD
    for shard, r in zip(opt.shards, _ranks_of(st)):
        per_rank[r] += shard.storage.ddr + shard.storage.hbm
    return per_rank


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2048, help="per rank")
    ap.add_argument("--pooling", type=int, default=16, help="ids per sample")
    ap.add_argument("--cases", default=",".join(st for st, _ in CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    wanted = args.cases.split(",")
    records = []
    mib = 2**20
    # what every rank pays for its own batch, wherever the table lives: the input KJT (int64
    # ids and lengths) and the pooled output with its gradient; a storage reservation's share
    own_io = args.batch_size * (args.pooling * 8 + 8 + 2 * args.dim * 4)
    print(f"{'sharding/kernel':<22} {'weights':>8} {'optim':>8} {'step':>7} {'measured':>8} "
          f"{'shard':>7} {'sparselift':>10} {'ratio':>5} {'torchrec':>8} {'ratio':>5}   "
          f"(MiB, worst rank; shard = measured - own batch I/O {own_io / mib:.2f} MiB)")
    for case in CASES:
        if case[0] not in wanted:
            continue
        ranks = measure(case, args)
        ours = sparselift_estimate(case, args)
        theirs = torchrec_estimate(case, args)
        totals = [r["weights"] + r["optimizer"] + r["step"] for r in ranks]
        w = max(range(WORLD), key=lambda i: totals[i])
        shard = totals[w] - own_io
        rec = {"sharding_type": case[0], "compute_kernel": case[1], "rank": w, **ranks[w],
               "measured": totals[w], "own_batch_io": own_io, "shard": shard,
               "sparselift": ours[w], "torchrec": theirs[w],
               "per_rank": ranks, "sparselift_per_rank": ours, "torchrec_per_rank": theirs}
        records.append(rec)
        print(f"{case[0] + '/' + case[1]:<22} {ranks[w]['weights'] / mib:8.2f} "
              f"{ranks[w]['optimizer'] / mib:8.2f} {ranks[w]['step'] / mib:7.2f} {totals[w] / mib:8.2f} "
              f"{shard / mib:7.2f} {ours[w] / mib:10.2f} {ours[w] / shard:5.2f} {theirs[w] / mib:8.2f} "
              f"{theirs[w] / shard:5.2f}", flush=True)
    if args.out:
        write_report(args.out, {"args": vars(args), "records": records})
    return 0


if __name__ == "__main__":
    exit_now(main)
