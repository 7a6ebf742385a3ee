"""Step time of the unsplit overlap pipeline (k = 1) beside batch split k (2 gloo ranks or more,
run under torchrun or the emulated-host testbed): a side-by-side, indicative on a shared machine.

Every rank builds TorchRec's DLRM (``--tables`` tables, table-wise on the ``fused`` kernel, dim
``--dim``, ``--batch`` samples per rank) afresh for every k of ``--ks`` and every round (the order of
the k rotating per round), trains ``--warmup`` steps, then times ``--steps`` steps (the slowest
rank's mean). Then, once per k, it traces ``--steps`` steps with ``runtime.overlap.CommTimeline``
and prints rank 0's mean exposed (waited) output and gradient all-to-all per step. ::

    python -m torchrec_sparselift.measure.testbed --hosts 2 --ranks-per-host 1 --rate 300mbit --shared -- \\
        scripts/batch_split_speed.py --ks 1,2,4 --rounds 5 --out speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = 20_000
DENSE_IN = 13


def _build(args: argparse.Namespace, world: int):  # type: ignore[no-untyped-def]
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    tables = [f"t{i}" for i in range(args.tables)]
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t, embedding_dim=args.dim, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i, t in enumerate(tables)], device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN,
                           dense_arch_layer_sizes=[128, args.dim], over_arch_layer_sizes=[512, 256, 1]))
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {t: table_wise(rank=i % world, compute_kernel="fused") for i, t in enumerate(tables)},
        world_size=world, local_size=world, device_type="cpu")})
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan,
                                   sharders=get_default_sharders())
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(
        dense, lambda params: torch.optim.Adagrad(params, lr=0.02))])


def _batches(args: argparse.Namespace, rank: int, n: int) -> List[Any]:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * rank + step)
        lengths = torch.randint(1, 6, (args.tables * args.batch,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(args.tables)], lengths=lengths,
            values=torch.randint(0, ROWS, (int(lengths.sum()),), generator=g))
        dense = torch.randn(args.batch, DENSE_IN, generator=g)
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=(dense[:, 0] > 0).float()))
    return out


def main() -> int:
    from torchrec_sparselift.runtime.overlap import CommTimeline, timeline_attribution
    from torchrec_sparselift.runtime.pipelines import make_train_pipeline

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="1,2,4", help="chunk counts, comma-separated (1: the unsplit overlap pipeline)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=1024, help="samples per rank")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--out", default="")
    args = p.parse_args()
    ks = [int(k) for k in args.ks.split(",") if k]
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    steps: Dict[int, List[float]] = {k: [] for k in ks}
    for r in range(args.rounds):
        for k in ks[r % len(ks):] + ks[: r % len(ks)]:
            dmp, opt = _build(args, world)
            pipe = make_train_pipeline("overlap", dmp, opt, device, batch_split=k)
            it = iter(_batches(args, rank, args.steps + args.warmup + 2))
            for _ in range(args.warmup):
                pipe.progress(it)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                pipe.progress(it)
            ms = torch.tensor([1e3 * (time.perf_counter() - start) / args.steps])
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            steps[k].append(float(ms))
    exposed: Dict[int, Dict[str, float]] = {}
    for k in ks:
        dmp, opt = _build(args, world)
        pipe = make_train_pipeline("overlap", dmp, opt, device, batch_split=k)
        it = iter(_batches(args, rank, args.steps + args.warmup + 2))
        for _ in range(args.warmup):
            pipe.progress(it)
        timeline = CommTimeline().install(dmp, pipe)
        for _ in range(args.steps):
            timeline.mark("step_start")
            pipe.progress(it)
            timeline.mark("step_end")
        timeline.uninstall()
        att = timeline_attribution(timeline.events)
        exposed[k] = {key: 1e3 * sum(a[key] for a in att) / len(att)
                      for key in ("step", "output_dist_exposed", "grad_dist_exposed")}
    if rank == 0:
        for k in ks:
            ratio = [round(x / y, 3) for x, y in zip(steps[k], steps[ks[0]])]
            print(f"k={k}: ms/step per round {[round(x, 1) for x in steps[k]]}, median {statistics.median(steps[k]):.1f}; "
                  f"per round / k={ks[0]}: {ratio}; traced: " + ", ".join(f"{n} {v:.1f}" for n, v in exposed[k].items()))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "ms_per_step": steps, "traced_ms": exposed}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
