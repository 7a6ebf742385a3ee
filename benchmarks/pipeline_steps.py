"""Measure steady-state step time of a small DLRM under each train-pipeline kind.

    python -m benchmarks.pipeline_steps --world-size 2 --steps 30 --warmup 5 \\
        --kinds base,sparse_dist,fused,prefetch,semi_sync --comm fp32,fp16 --out steps.json

Spawns ``--world-size`` ranks (gloo on CPU, NCCL with one GPU per rank when CUDA is available),
shards a DLRM (``--tables`` tables of ``--rows`` x ``--dim``, table-wise round-robin, fused
kernel) with :func:`~torchrec_sparselift.runtime.lift`, and times ``pipeline.progress`` with
:class:`~torchrec_sparselift.runtime.StepTimer` (median over steady steps, slowest rank). Prints
one line per (kind, comm precision) and, with ``--out``, saves the records as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main"]


def _batches(rank: int, n: int, args: argparse.Namespace, device: torch.device) -> list:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f"f{i}" for i in range(args.tables)]
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(100_003 * rank + step)
        lengths = torch.randint(0, 2 * args.pooling + 1, (args.tables * args.batch_size,), generator=g)
        ids = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=lengths)
        batch = Batch(
            dense_features=torch.randn(args.batch_size, 13, generator=g),
            sparse_features=kjt,
            labels=(torch.rand(args.batch_size, generator=g) < 0.5).float(),
        )
        # host batches, as a dataloader yields them: the pipelines copy them to the device
        out.append(batch.pin_memory() if device.type == "cuda" else batch)
    return out


def _model_and_plan(args: argparse.Namespace, world: int, device_type: str):  # type: ignore[no-untyped-def]
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(DLRM(ebc, dense_in_features=13, dense_arch_layer_sizes=[64, args.dim],
                           over_arch_layer_sizes=[64, 1]))
    ebc_plan = construct_module_sharding_plan(
        ebc,
        {f"t{i}": table_wise(rank=i % world, compute_kernel="fused") for i in range(args.tables)},
        world_size=world,
        local_size=world,
        device_type=device_type,
    )
    return model, ShardingPlan({"model.sparse_arch.embedding_bag_collection": ebc_plan})


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, outdir: str) -> None:
    from torchrec_sparselift.runtime import StepTimer, lift, save_records

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    batches = _batches(rank, args.steps, args, device)
    records = []
    for comm in args.comm:
        for kind in args.kinds:
            torch.manual_seed(0)
            model, plan = _model_and_plan(args, world, device.type)
            lifted = lift(model, plan, device=device, pipeline=kind, fwd_comm_precision=comm, bwd_comm_precision=comm,
                          embedding_optimizer=(torch.optim.SGD, {"lr": 0.01}),
                          dense_optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01),
                          pipeline_options={"start_batch": 0} if kind == "semi_sync" else None)
            timer = StepTimer(device, warmup_steps=args.warmup, plan=f"dlrm {args.tables}x{args.rows}x{args.dim} "
                              f"B={args.batch_size} pipeline={kind} comm={comm}")
            timer.time_pipeline(lifted.pipeline, iter(batches), steps=args.steps)
            rec = timer.record(pg=dist.group.WORLD)
            records.append(rec)
            if rank == 0:
                print(f"{kind:12s} comm={comm:5s} median {rec.measured_s * 1e3:8.2f} ms  mean {rec.mean_s * 1e3:8.2f} ms"
                      f"  stdev {rec.stdev_s * 1e3:6.2f} ms  ({rec.steps} steps, {device.type} x{world})", flush=True)
    if rank == 0:
        save_records(os.path.join(outdir, "records.json"), records)
    dist.destroy_process_group()


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="steps per kind, warm-up included")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--kinds", default="base,sparse_dist,fused,prefetch,semi_sync")
    p.add_argument("--comm", default="fp32", help="comma list of comm precisions (fwd = bwd)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--pooling", type=int, default=4, help="mean ids per sample and table")
    p.add_argument("--batch-size", type=int, default=512, help="per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    p.add_argument("--out", default=None, help="save the StepRecords here (JSON)")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.comm = [c for c in args.comm.split(",") if c]
    return args


def main(argv: Sequence[str] = ()) -> int:
    args = _parse(list(argv) or sys.argv[1:])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(args.world_size, port, args, outdir), nprocs=args.world_size, join=True)
        if args.out:
            shutil.copyfile(os.path.join(outdir, "records.json"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
