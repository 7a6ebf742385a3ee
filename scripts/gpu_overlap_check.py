"""GPU check of the overlap pipeline (runtime/overlap.py) against TorchRec's on NCCL.

Every rank trains the same DLRM (TorchRec's ``DLRMTrain``; tables table-wise, row-wise and
column-wise on the ``fused`` kernel) from the same start under ``base`` (the reference),
``sparse_dist`` and ``overlap`` (built through ``make_train_pipeline``: the CUDA path, side
streams and events), asserts that ``overlap``'s losses equal ``base``'s step by step (``--rtol``)
and prints ms/step of each (CUDA-synchronized wall clock over the timed steps, slowest rank).

One process per GPU (``--world``, default: the visible GPUs, at most 2). With one GPU the
collectives are a rank's own copies: the run checks exactness and the stream/event code path,
not the hiding. Writes ``--out`` (JSON) when given. Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TABLES = ("t0", "t1", "t2", "t3")


def _model(rows: int, dim: int, dense_in: int) -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
                for i, t in enumerate(TABLES)],
        device=torch.device("meta"),
    )
    return DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=dense_in,
                          dense_arch_layer_sizes=[512, 256, dim], over_arch_layer_sizes=[512, 256, 1]))


def _batches(rank: int, n: int, batch: int, rows: int, dense_in: int, device: torch.device) -> List[Any]:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * rank + step)
        lengths = torch.randint(1, 8, (len(TABLES) * batch,), generator=g)
        ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(TABLES))], values=ids,
                                                  lengths=lengths)
        dense = torch.randn(batch, dense_in, generator=g)
        labels = (dense[:, 0] > 0).float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels).to(device))
    return out


def _sharded(args: argparse.Namespace, world: int, device: torch.device, state: Dict[str, Any] = None):  # type: ignore[assignment]
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, get_default_sharders, row_wise, table_wise,
    )  # fmt: skip
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(3)
    model = _model(args.rows, args.dim, args.dense_in)
    ebc = model.model.sparse_arch.embedding_bag_collection
    last = world - 1
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=0, compute_kernel="fused"), "t1": table_wise(rank=last, compute_kernel="fused"),
         "t2": row_wise(compute_kernel="fused"), "t3": column_wise(ranks=list(range(world)), compute_kernel="fused")},
        world_size=world, local_size=world, device_type="cuda",
    )})  # fmt: skip
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    dmp = DistributedModelParallel(module=model, device=device, plan=plan, sharders=get_default_sharders())
    if state is not None:
        dmp.load_state_dict(state)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = CombinedOptimizer([dmp.fused_optimizer,
                             KeyedOptimizerWrapper(dense, lambda params: torch.optim.Adagrad(params, lr=0.02))])
    return dmp, opt


def _train(kind: str, dmp, opt, batches, device, warmup: int):  # type: ignore[no-untyped-def]
    from torchrec_sparselift.runtime.pipelines import make_train_pipeline

    pipe = make_train_pipeline(kind, dmp, opt, device)
    it = iter(batches)
    losses: List[float] = []
    start = 0.0
    for step in range(len(batches)):
        if step == warmup:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
        loss = pipe.progress(it)[0]
        losses.append(float(loss.detach().float().cpu()))
    torch.cuda.synchronize(device)
    timed = len(batches) - warmup
    return losses, 1e3 * (time.perf_counter() - start) / max(timed, 1), type(pipe).__name__


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        batches = _batches(rank, args.steps, args.batch, args.rows, args.dense_in, device)
        first, _ = _sharded(args, world, device)
        start = copy.deepcopy(dict(first.state_dict()))
        out: Dict[str, Any] = {"rank": rank}
        for kind in args.kinds:
            dmp, opt = _sharded(args, world, device, copy.deepcopy(start))
            losses, ms, cls = _train(kind, dmp, opt, batches, device, args.warmup)
            out[kind] = {"losses": losses, "ms_per_step": ms, "class": cls}
            del dmp, opt
            torch.cuda.empty_cache()
        q.put(out)
    except BaseException as exc:  # report, then let the parent fail the run
        q.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=0, help="ranks (one GPU each); 0: visible GPUs, at most 2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=2048, help="per-rank batch")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dense-in", type=int, default=13)
    p.add_argument("--kinds", default="base,sparse_dist,overlap")
    p.add_argument("--rtol", type=float, default=1e-4, help="overlap vs base loss tolerance (GPU kernels "
                   "may reorder float sums between runs)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if "base" not in args.kinds or "overlap" not in args.kinds:
        p.error("--kinds must include base (the reference) and overlap")
    if not torch.cuda.is_available():
        print("no CUDA device visible: this check needs a GPU", file=sys.stderr)
        return 2
    world = args.world or min(2, torch.cuda.device_count())
    if world > torch.cuda.device_count():
        p.error(f"--world {world} needs {world} GPUs; {torch.cuda.device_count()} visible (NCCL runs one rank per GPU)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, world, args, port, q)) for r in range(world)]
    for pr in procs:
        pr.start()
    results = [q.get(timeout=1800) for _ in procs]
    for pr in procs:
        pr.join()
    errors = [r for r in results if "error" in r]
    if errors:
        for r in errors:
            print(f"rank {r['rank']}: {r['error']}", file=sys.stderr)
        return 1
    results.sort(key=lambda r: r["rank"])
    ok = True
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, world {world}, NCCL, "
          f"batch {args.batch}/rank, dim {args.dim}, {args.steps} steps ({args.warmup} warm-up)")
    for kind in args.kinds:
        ms = max(r[kind]["ms_per_step"] for r in results)
        print(f"  {kind:<12} {ms:8.3f} ms/step  ({results[0][kind]['class']})")
    for r in results:
        base, ov = r["base"]["losses"], r["overlap"]["losses"]
        worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base, ov))
        equal = worst <= args.rtol
        ok &= equal and r["overlap"]["class"] == "TrainPipelineOverlap"
        print(f"  rank {r['rank']}: overlap vs base losses, worst relative difference {worst:.2e} "
              f"({'equal' if equal else 'DIFFERENT'} at rtol {args.rtol:g}); last loss {ov[-1]:.5f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"world": world, "args": vars(args), "results": results, "ok": ok}, f, indent=1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
