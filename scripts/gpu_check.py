"""GPU checks of the runtime on NCCL: ``overlap`` against TorchRec's pipelines, batch split against
the unsplit ``overlap`` pipeline, and ids on the wire against the unrewritten input all-to-all.

Every rank trains the same DLRM (TorchRec's ``DLRMTrain``; tables table-wise, row-wise and
column-wise on the ``fused`` kernel) from the same start, one run per setting, each pipeline built
through ``make_train_pipeline`` as the runtime builds a plan's (the CUDA path: side streams and
events), and prints ms/step of each (CUDA-synchronized wall clock over the timed steps, slowest
rank).

* ``overlap``: the pipelines of ``--kinds`` (default ``base,sparse_dist,overlap``); fails unless
  ``overlap``'s losses equal ``base``'s (the reference) step by step (``--rtol``).
* ``batch-split``: ``overlap`` unsplit (the reference) and split in k chunks for every k of
  ``--chunks``; fails unless every split run's losses equal the reference's step by step
  (``--rtol``) and its final weights (dense and embedding tables) equal the reference's
  (``--weights-rtol``).
* ``wire-ids``: ``sparse_dist``, unrewritten (``int64``, the reference), and with the input
  all-to-all rewritten by ``apply_wire_ids`` on the sharded model before training (ids skewed
  over ``--id-rows`` hot rows spread evenly across each table, the cube of a uniform draw, so a
  batch repeats ids and every row-wise block receives some): ``int32`` ids and lengths; ``dedup``, every feature deduplicated at int32 (the lookup on
  the rebuilt ids); ``dedup_unique``, the same with the distinct-row lookup
  (``unique_rows=True``). Fails unless every rewritten run's losses (``--rtol``) and final
  weights (``--weights-rtol``) equal the reference's, and, counted by ``CommCounter`` on one
  forward of each run, the int32 input all-to-all moves exactly half the reference's bytes
  (int32 only) and both dedup runs move fewer than int32 (with one rank nothing leaves it: the
  bytes are 0 and that part is reported as not checked).

One process per GPU (``--world``, default: the visible GPUs, at most 2). With one GPU the
collectives are a rank's own copies: the run checks exactness and the stream/event code path,
not the hiding. Writes ``--out`` (JSON) when given. Exits 2 without a CUDA device (nothing run),
1 when a check fails, 0 when every check passes. ``--device cpu`` runs the same worker on CPU
ranks joined by gloo (``--world``, default 2), for debugging the check where no GPU is lent: it
checks the CPU path, not the CUDA one. Run from the repository root with the package importable
(``scripts/gpu_check.sh`` sets that up on a device machine)::

    python scripts/gpu_check.py overlap --out out/gpu-overlap.json
    python scripts/gpu_check.py batch-split --chunks 2,4,8 --out out/gpu-batch-split.json
    python scripts/gpu_check.py wire-ids --out out/gpu-wire-ids.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TABLES = ("t0", "t1", "t2", "t3")
FEATURES = tuple(f"f{i}" for i in range(len(TABLES)))
#: exit status when no CUDA device is visible (nothing was checked)
NO_CUDA = 2
#: the check's reference run and what the checked runs must be built as
OVERLAP_CLASS = "TrainPipelineOverlap"
SPLIT_CLASS = "TrainPipelineBatchSplit"
SPARSE_DIST_CLASS = "TrainPipelineSparseDist"
CHECKS = ("overlap", "batch-split", "wire-ids")
#: wire-ids: label -> (id dtype, dedup every feature, lookup on the distinct rows), the reference first
WIRE_RUNS = {"int64": ("int64", False, False), "int32": ("int32", False, False),
             "dedup": ("int32", True, False), "dedup_unique": ("int32", True, True)}
WIRE_REFERENCE = "int64"


def _model(rows: int, dim: int, dense_in: int) -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t, embedding_dim=dim, num_embeddings=rows, feature_names=[f])
                for t, f in zip(TABLES, FEATURES)],
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
        if args.check == "wire-ids":  # skewed over id_rows hot rows spread across the table (every
            # row-wise block gets ids): the low ones repeat within a batch, so dedup has duplicates
            hot = min(args.id_rows, args.rows)
            ids = (torch.rand(int(lengths.sum()), generator=g) ** 3 * hot).long() * (args.rows // hot)
        else:
            ids = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=ids, lengths=lengths)
        dense = torch.randn(args.batch, args.dense_in, generator=g)
        labels = (dense[:, 0] + 0.5 * dense[:, 1] > 0).float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels).to(device))
    return out


def _sharded(args: argparse.Namespace, world: int, device: torch.device, state: Dict[str, Any] = None,  # type: ignore[assignment]
             wire: Tuple[str, bool, bool] = ("int64", False, False)):
    """The sharded DLRM and its optimizer, from ``state`` when given; ``wire``: (id dtype, dedup
    every feature, lookup on the distinct rows), applied to the DMP by ``apply_wire_ids``."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, get_default_sharders, row_wise, table_wise,
    )  # fmt: skip
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from torchrec_sparselift.runtime.wire_ids import apply_wire_ids

    torch.manual_seed(3)
    model = _model(args.rows, args.dim, args.dense_in)
    ebc = model.model.sparse_arch.embedding_bag_collection
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=0, compute_kernel="fused"), "t1": table_wise(rank=world - 1, compute_kernel="fused"),
         "t2": row_wise(compute_kernel="fused"), "t3": column_wise(ranks=list(range(world)), compute_kernel="fused")},
        world_size=world, local_size=world, device_type=device.type,
    )})  # fmt: skip
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    dmp = DistributedModelParallel(module=model, device=device, plan=plan, sharders=get_default_sharders())
    if state is not None:
        dmp.load_state_dict(state)
    id_dtype, dedup, unique_rows = wire
    # the input dists are built at the first forward: apply_wire_ids wraps them then
    apply_wire_ids(dmp, id_dtype, FEATURES if dedup else (), unique_rows=unique_rows)
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _input_bytes(dmp: torch.nn.Module, batch: Any) -> Dict[str, Any]:
    """This rank's input all-to-all bytes (sent + received, ``CommCounter``) and their dtypes on
    one forward of ``batch`` (no backward: nothing is updated)."""
    from torchrec_sparselift.runtime.comm_counter import CommCounter

    with CommCounter(dmp) as counter, torch.no_grad():
        dmp(batch)
    dtypes = sorted({c.dtype for c in counter.calls if c.kind == "input_dist"})
    return {"bytes": counter.link_bytes().get("input_dist", 0), "dtypes": dtypes}


def _train(kind: str, chunks: int, dmp, opt, batches, device, warmup: int) -> Tuple[List[float], float, str]:  # type: ignore[no-untyped-def]
    from torchrec_sparselift.runtime.pipelines import make_train_pipeline

    pipe = make_train_pipeline(kind, dmp, opt, device, batch_split=chunks)
    it = iter(batches)
    losses: List[float] = []
    start = 0.0
    for step in range(len(batches)):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        losses.append(float(pipe.progress(it)[0].detach().float().cpu()))
    _sync(device)
    return losses, 1e3 * (time.perf_counter() - start) / max(len(batches) - warmup, 1), type(pipe).__name__


def runs_of(args: argparse.Namespace) -> List[Tuple[str, str, int]]:
    """(label, pipeline kind, chunks) of every run the check trains, the reference first."""
    if args.check == "overlap":
        return [(k, k, 1) for k in ["base"] + [k for k in args.kinds if k != "base"]]
    if args.check == "wire-ids":
        return [(label, "sparse_dist", 1) for label in [WIRE_REFERENCE] + args.runs]
    return [(f"k={k}", "overlap", k) for k in [1] + args.chunks]


def run_rank(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """One rank's runs of the check, in a process group already joined: every run from the same
    start weights on the same batches; ``{"rank", "runs": {label: {"losses", "ms_per_step",
    "class"[, "input_bytes"]}}, "weights": {label: ...}}`` (wire-ids counts ``input_bytes``)."""
    batches = _batches(rank, args, device)
    first, _ = _sharded(args, world, device)
    start = copy.deepcopy(dict(first.state_dict()))
    del first
    out: Dict[str, Any] = {"rank": rank, "runs": {}, "weights": {}}
    for label, kind, chunks in runs_of(args):
        wire = WIRE_RUNS[label] if args.check == "wire-ids" else WIRE_RUNS[WIRE_REFERENCE]
        dmp, opt = _sharded(args, world, device, copy.deepcopy(start), wire)
        counted = _input_bytes(dmp, batches[0]) if args.check == "wire-ids" else None
        losses, ms, cls = _train(kind, chunks, dmp, opt, batches, device, args.warmup)
        out["runs"][label] = {"losses": losses, "ms_per_step": ms, "class": cls}
        if counted is not None:
            out["runs"][label]["input_bytes"] = counted
        out["weights"][label] = _local_weights(dmp)
        del dmp, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q.put(run_rank(rank, world, args, device))
    except BaseException as exc:  # report, then let the parent fail the run
        q.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


def _worst(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def _worst_weights(ref: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor]) -> float:
    """The largest difference of any tensor's elements relative to that tensor's largest reference
    element (a near-zero element's own size would read summation-order rounding as a large error)."""
    return max((float((other[n] - v).abs().max() / v.abs().max().clamp_min(1e-12)) for n, v in ref.items()
                if v.numel()), default=0.0)


def check(results: List[Dict[str, Any]], checked: List[Tuple[str, str]], rtol: float,
          weights_rtol: float = None) -> List[str]:  # type: ignore[assignment]
    """Lines of the verdict, one per rank and checked run (``(label, class it must be built as)``)
    against the first run (``results[...]["runs"]``' first label, the reference); a line starting
    with ``FAILED`` for every check that fails. ``weights_rtol`` None: losses only."""
    lines = []
    for r in results:
        ref_label = next(iter(r["runs"]))
        ref = r["runs"][ref_label]["losses"]
        for label, cls in checked:
            run = r["runs"][label]
            worst = _worst(ref, run["losses"])
            ok = worst <= rtol and run["class"] == cls
            text = f"losses worst relative difference {worst:.2e} (rtol {rtol:g})"
            if weights_rtol is not None:
                wworst = _worst_weights(r["weights"][ref_label], r["weights"][label])
                ok &= wworst <= weights_rtol
                text += f", weights {wworst:.2e} (rtol {weights_rtol:g})"
            lines.append(f"{'ok' if ok else 'FAILED'}: rank {r['rank']} {label} vs {ref_label} ({run['class']}): {text}")
    return lines


def check_bytes(results: List[Dict[str, Any]]) -> List[str]:
    """Lines of the wire-ids byte verdict, one per rank, from each run's ``input_bytes`` (this
    rank's input all-to-all bytes on one forward, ``CommCounter``): ``FAILED`` unless the
    reference sends int64 ids only, ``int32`` sends int32 only and exactly half the reference's
    bytes, and every dedup run sends fewer bytes than ``int32``. A rank whose reference moved no
    byte (one rank: its own chunk never leaves it) gets a ``not checked`` line."""
    lines = []
    for r in results:
        counted = {label: run["input_bytes"] for label, run in r["runs"].items()}
        text = ", ".join(f"{label} {c['bytes']} B ({'/'.join(d.replace('torch.', '') for d in c['dtypes'])})"
                         for label, c in counted.items())
        ref, narrow = counted[WIRE_REFERENCE], counted.get("int32")
        if ref["bytes"] == 0:
            lines.append(f"not checked: rank {r['rank']} input all-to-all bytes: {text} (one rank: nothing "
                         "leaves it; the byte check needs 2 GPUs)")
            continue
        why = []
        if ref["dtypes"] != ["torch.int64"]:
            why.append("int64 must send int64 only")
        if narrow is not None:
            if narrow["dtypes"] != ["torch.int32"]:
                why.append("int32 must send int32 only")
            if 2 * narrow["bytes"] != ref["bytes"]:
                why.append(f"int32 must send half of int64's {ref['bytes']} B")
            why += [f"{label} must send fewer than int32's {narrow['bytes']} B" for label, c in counted.items()
                    if WIRE_RUNS[label][1] and not c["bytes"] < narrow["bytes"]]
        lines.append(f"{'FAILED' if why else 'ok'}: rank {r['rank']} input all-to-all bytes: {text}"
                     + (f": {'; '.join(why)}" if why else ""))
    return lines


def verdict(args: argparse.Namespace, results: List[Dict[str, Any]]) -> List[str]:
    """Every verdict line of ``args.check`` on the ranks' ``results`` (:func:`run_rank`'s)."""
    if args.check == "overlap":
        return check(results, [("overlap", OVERLAP_CLASS)], args.rtol)
    if args.check == "wire-ids":
        checked = [(label, SPARSE_DIST_CLASS) for label in args.runs]
        return check(results, checked, args.rtol, args.weights_rtol) + check_bytes(results)
    return check(results, [(f"k={k}", SPLIT_CLASS) for k in args.chunks], args.rtol, args.weights_rtol)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=CHECKS)
    p.add_argument("--world", type=int, default=0, help="ranks (one GPU each); 0: visible GPUs, at most 2 "
                   "(--device cpu: 2)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: NCCL, one rank per GPU; "
                   "cpu: gloo CPU ranks, to debug the check where no GPU is lent")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: 60 overlap, 50 batch-split "
                   "and wire-ids)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=2048, help="per-rank batch")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dense-in", type=int, default=13)
    p.add_argument("--kinds", default="base,sparse_dist,overlap", help="overlap: the pipelines to run")
    p.add_argument("--chunks", default="2,4", help="batch-split: the k to check, comma-separated, each in 2..16")
    p.add_argument("--rtol", type=float, default=1e-4, help="loss tolerance (GPU kernels may sum in another "
                   "order between runs, and a chunk's rows in another order than the batch's)")
    p.add_argument("--weights-rtol", type=float, default=1e-2, help="batch-split, wire-ids: final weights' "
                   "tolerance (each tensor's largest difference over its largest element; 50 steps of Adagrad amplify "
                   "summation-order differences)")
    p.add_argument("--runs", default=",".join(k for k in WIRE_RUNS if k != WIRE_REFERENCE),
                   help="wire-ids: the rewritten runs to check against int64, comma-separated")
    p.add_argument("--id-rows", type=int, default=4096, help="wire-ids: ids fall on N rows spread evenly "
                   "across each table, skewed toward the first, so a batch repeats ids")
    p.add_argument("--out", default="")
    return p


def parse(argv: List[str] = None) -> argparse.Namespace:  # type: ignore[assignment]
    p = _parser()
    args = p.parse_args(argv)
    args.steps = args.steps or (60 if args.check == "overlap" else 50)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.check == "overlap" and ("base" not in args.kinds or "overlap" not in args.kinds):
        p.error("--kinds must include base (the reference) and overlap")
    try:
        args.chunks = sorted({int(c) for c in args.chunks.split(",") if c})
    except ValueError:
        p.error(f"--chunks must be integers separated by commas, got {args.chunks!r}")
    if args.check == "batch-split" and (not args.chunks or any(not 2 <= k <= 16 for k in args.chunks)):
        p.error(f"--chunks must name k in 2..16, got {args.chunks}")
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in args.runs if r not in WIRE_RUNS or r == WIRE_REFERENCE]
    if args.check == "wire-ids" and (unknown or not args.runs):
        p.error(f"--runs must name some of {', '.join(k for k in WIRE_RUNS if k != WIRE_REFERENCE)}, "
                f"got {unknown or args.runs}")
    if args.id_rows < 1:
        p.error(f"--id-rows must be at least 1, got {args.id_rows}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): the timed steps come after it")
    return args


def _spawn(worker: Callable[..., None], world: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, world, args, port, q)) for r in range(world)]
    for pr in procs:
        pr.start()
    results = [q.get(timeout=1800) for _ in procs]
    for pr in procs:
        pr.join()
    return sorted(results, key=lambda r: r["rank"])


def main(argv: List[str] = None) -> int:  # type: ignore[assignment]
    args = parse(argv)
    if args.device == "cpu":
        world = args.world or 2
        results = _spawn(_worker, world, args)
        return _report(args, world, results, "CPU, gloo")
    if not torch.cuda.is_available():
        print(f"gpu_check {args.check}: no CUDA device visible, nothing checked: run it where a GPU is lent "
              "(the CPU/gloo exactness tests are tests/test_overlap.py, tests/test_batch_split.py and "
              "tests/test_wire_ids.py; --device cpu runs this check's worker on gloo CPU ranks)",
              file=sys.stderr)
        return NO_CUDA
    world = args.world or min(2, torch.cuda.device_count())
    if world > torch.cuda.device_count():
        _parser().error(f"--world {world} needs {world} GPUs; {torch.cuda.device_count()} visible "
                        "(NCCL runs one rank per GPU)")
    return _report(args, world, _spawn(_worker, world, args), f"{torch.cuda.get_device_name(0)}, NCCL")


def _report(args: argparse.Namespace, world: int, results: List[Dict[str, Any]], where: str) -> int:
    """Print the ranks' timings and the verdict, write ``--out``; the exit status."""
    errors = [r for r in results if "error" in r]
    for r in errors:
        print(f"rank {r['rank']}: {r['error']}", file=sys.stderr)
    if errors:
        return 1
    print(f"torch {torch.__version__}, {where}, world {world}, batch {args.batch}/rank, "
          f"dim {args.dim}, {args.steps} steps ({args.warmup} warm-up)")
    for label, _kind, _chunks in runs_of(args):
        ms = max(r["runs"][label]["ms_per_step"] for r in results)
        print(f"  {label:<12} {ms:8.3f} ms/step  ({results[0]['runs'][label]['class']})")
    lines = verdict(args, results)
    print("\n".join("  " + line for line in lines))
    ok = not any(line.startswith("FAILED") for line in lines)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"check": args.check, "world": world, "args": vars(args), "ok": ok, "lines": lines,
                       "runs": [{"rank": r["rank"], "runs": r["runs"]} for r in results]}, f, indent=1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
