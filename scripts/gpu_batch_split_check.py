"""GPU check of batch-split pipelining (runtime/batch_split.py) on NCCL: exact against the unsplit
overlap pipeline, and its CUDA path (side stream, events) run.

Every rank trains the same DLRM (TorchRec's ``DLRMTrain``; tables table-wise, row-wise and
column-wise on the ``fused`` kernel) from the same start under ``overlap`` (the unsplit reference)
and under ``overlap`` with ``batch_split`` k for every k of ``--chunks`` (built through
``make_train_pipeline``, as the runtime builds a plan's pipeline), fails unless every split run's
losses equal the reference's step by step (``--rtol``) and its final weights (dense and embedding
tables) equal the reference's (``--weights-rtol``), and prints ms/step of each
(CUDA-synchronized wall clock over the timed steps, slowest rank).

One process per GPU (``--world``, default: the visible GPUs, at most 2). With one GPU the
collectives are a rank's own copies: the run checks exactness and the stream/event code path,
not the hiding. Writes ``--out`` (JSON) when given. Exits 2 without a CUDA device (nothing run),
1 when a check fails, 0 when every check passes::

    python scripts/gpu_batch_split_check.py --chunks 2,4,8 --out out/gpu-batch-split.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TABLES = ("t0", "t1", "t2", "t3")
#: exit status when no CUDA device is visible (nothing was checked)
NO_CUDA = 2


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


def _batches(rank: int, args: argparse.Namespace, device: torch.device) -> List[Any]:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        lengths = torch.randint(1, 8, (len(TABLES) * args.batch,), generator=g)
        ids = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(TABLES))], values=ids,
                                                  lengths=lengths)
        dense = torch.randn(args.batch, args.dense_in, generator=g)
        labels = (dense[:, 0] + 0.5 * dense[:, 1] > 0).float()
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
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=0, compute_kernel="fused"), "t1": table_wise(rank=world - 1, compute_kernel="fused"),
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


def _local_weights(dmp: torch.nn.Module) -> Dict[str, torch.Tensor]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for name, value in dmp.state_dict().items():
        if isinstance(value, ShardedTensor):
            shards = value.local_shards()
            out[name] = torch.cat([s.tensor.flatten() for s in shards]).cpu() if shards else torch.zeros(0)
        elif hasattr(value, "to_local"):
            out[name] = value.to_local().flatten().cpu()
        else:
            out[name] = value.detach().flatten().cpu()
    return out


def _train(chunks: int, dmp, opt, batches, device, warmup: int) -> Tuple[List[float], float, str]:  # type: ignore[no-untyped-def]
    from torchrec_sparselift.runtime.pipelines import make_train_pipeline

    pipe = make_train_pipeline("overlap", dmp, opt, device, batch_split=chunks)
    it = iter(batches)
    losses: List[float] = []
    start = 0.0
    for step in range(len(batches)):
        if step == warmup:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
        losses.append(float(pipe.progress(it)[0].detach().float().cpu()))
    torch.cuda.synchronize(device)
    return losses, 1e3 * (time.perf_counter() - start) / max(len(batches) - warmup, 1), type(pipe).__name__


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        batches = _batches(rank, args, device)
        first, _ = _sharded(args, world, device)
        start = copy.deepcopy(dict(first.state_dict()))
        out: Dict[str, Any] = {"rank": rank, "runs": {}}
        for k in [1] + args.chunks:
            dmp, opt = _sharded(args, world, device, copy.deepcopy(start))
            losses, ms, cls = _train(k, dmp, opt, batches, device, args.warmup)
            out["runs"][k] = {"losses": losses, "ms_per_step": ms, "class": cls}
            out.setdefault("weights", {})[k] = _local_weights(dmp)
            del dmp, opt
            torch.cuda.empty_cache()
        q.put(out)
    except BaseException as exc:  # report, then let the parent fail the run
        q.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


def _worst(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def check(results: List[Dict[str, Any]], chunks: List[int], rtol: float, weights_rtol: float) -> List[str]:
    """Lines of the verdict; a line starting with ``FAILED`` for every check that fails."""
    lines = []
    for r in results:
        ref, ref_w = r["runs"][1]["losses"], r["weights"][1]
        for k in chunks:
            run = r["runs"][k]
            worst = _worst(ref, run["losses"])
            wworst = max((float(((r["weights"][k][n] - v).abs() / v.abs().clamp_min(1e-6)).max())
                          for n, v in ref_w.items() if v.numel()), default=0.0)
            ok = (worst <= rtol and wworst <= weights_rtol and run["class"] == "TrainPipelineBatchSplit")
            lines.append(f"{'ok' if ok else 'FAILED'}: rank {r['rank']} k={k} ({run['class']}): losses worst "
                         f"relative difference {worst:.2e} (rtol {rtol:g}), weights {wworst:.2e} "
                         f"(rtol {weights_rtol:g})")
    return lines


def main(argv: List[str] = None) -> int:  # type: ignore[assignment]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=0, help="ranks (one GPU each); 0: visible GPUs, at most 2")
    p.add_argument("--chunks", default="2,4", help="the k to check, comma-separated, each in 2..16")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=2048, help="per-rank batch")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dense-in", type=int, default=13)
    p.add_argument("--rtol", type=float, default=1e-4, help="split vs unsplit loss tolerance (GPU kernels "
                   "sum a chunk's rows in another order than the batch's)")
    p.add_argument("--weights-rtol", type=float, default=1e-2, help="final weights' tolerance (relative, "
                   "elementwise; 50 steps of Adagrad amplify summation-order differences)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    try:
        args.chunks = sorted({int(c) for c in args.chunks.split(",") if c})
    except ValueError:
        p.error(f"--chunks must be integers separated by commas, got {args.chunks!r}")
    if not args.chunks or any(not 2 <= k <= 16 for k in args.chunks):
        p.error(f"--chunks must name k in 2..16, got {args.chunks}")
    if not torch.cuda.is_available():
        print("gpu_batch_split_check: no CUDA device visible, nothing checked: run it where a GPU is lent "
              "(the CPU/gloo exactness test is tests/test_batch_split.py)", file=sys.stderr)
        return NO_CUDA
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
    for r in errors:
        print(f"rank {r['rank']}: {r['error']}", file=sys.stderr)
    if errors:
        return 1
    results.sort(key=lambda r: r["rank"])
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, world {world}, NCCL, batch {args.batch}/rank, "
          f"dim {args.dim}, {args.steps} steps ({args.warmup} warm-up)")
    for k in [1] + args.chunks:
        ms = max(r["runs"][k]["ms_per_step"] for r in results)
        print(f"  k={k:<3} {ms:8.3f} ms/step  ({results[0]['runs'][k]['class']})")
    lines = check(results, args.chunks, args.rtol, args.weights_rtol)
    print("\n".join("  " + line for line in lines))
    ok = not any(line.startswith("FAILED") for line in lines)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"world": world, "args": vars(args), "ok": ok, "lines": lines,
                       "runs": [{"rank": r["rank"], "runs": r["runs"]} for r in results]}, f, indent=1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
