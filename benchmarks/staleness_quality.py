"""Model quality of the stale overlap schedule (``overlap_stale``) against the exact one
(``overlap``): held-out loss after the same training, per seed.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m benchmarks.staleness_quality \\
        --steps 300 --seeds 0,1,2 --out runs/staleness_quality.json

Each seed trains the DLRM model (:mod:`torchrec_sparselift.dlrm`: DCNv2 tables at ``--scale``, dim
``--embedding-dim``, DCN ``small``; fused row-wise AdaGrad tables, dense AdaGrad) from the same
initial weights on the same synthetic batches (Zipf ids with a planted label signal,
``torchrec_sparselift.dlrm.data.synthetic_batches``), once per kind, with TorchRec's plan of every
table table-wise (the plan :mod:`benchmarks.overlap` times, :func:`benchmarks.overlap.table_wise_dcn`). After ``--steps`` steps (the stale kind's last
embedding update flushed) it scores ``--eval`` held-out batches per rank (the generator's batches
after the trained ones: same planted model, never trained on) with the model's BCE loss, averaged over ranks. Reported: each kind's held-out loss per
seed, the stale-minus-exact difference per seed, its mean and maximum (target: at most +0.0005).
``--start-batch N`` runs the stale kind's first N steps exactly (its ``start_batch``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks.harness import exit_now, start_worker, stop_worker, write_report
from benchmarks.overlap import table_wise_dcn
from torchrec_sparselift.dlrm.data import synthetic_batches
from torchrec_sparselift.dlrm.model import build_model, shard_model
from torchrec_sparselift.runtime.pipelines import make_train_pipeline
from torchrec_sparselift.vocabulary import pipeline
EXACT, STALE = "overlap", "overlap_stale"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--kinds", default=f"{EXACT},{STALE}", help="the first is the reference")
    p.add_argument("--eval", type=int, default=16, help="held-out batches per rank")
    p.add_argument("--scale", type=float, default=0.0005)
    p.add_argument("--embedding-dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="sparse tables (row-wise AdaGrad)")
    p.add_argument("--dense-lr", type=float, default=0.005)
    p.add_argument("--start-batch", type=int, default=0,
                   help="exact warm-up steps of the stale kinds before they go stale (their start_batch)")
    p.add_argument("--reference", metavar="RESULT.json",
                   help="take the first kind's held-out losses from this earlier result (same steps, seeds, "
                        "data, model and learning rates; the exact kind is deterministic) instead of training it")
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.steps < 1 or not args.seeds or len(args.kinds) < 2:
        p.error("need --steps >= 1, one seed or more and two kinds or more")
    args.reference_losses = None
    if args.reference:
        with open(args.reference) as f:
            ref = json.load(f)
        same = ("steps", "seeds", "eval", "scale", "embedding_dim", "batch_size", "lr", "dense_lr")
        differ = [k for k in same if ref["config"].get(k) != getattr(args, k)]
        if differ or args.kinds[0] not in ref["heldout_loss"]:
            p.error(f"--reference {args.reference}: differs in {differ} or lacks {args.kinds[0]!r}; rerun both kinds")
        args.reference_losses = {int(s): v for s, v in ref["heldout_loss"][args.kinds[0]].items()}
    return args


def _pipeline(kind: str, dmp: Any, opt: Any, device: Any, start_batch: int) -> Any:
    # semi_sync: TorchRec's default waits 900 steps
    options = {"start_batch": start_batch} if pipeline(kind).stale else None
    return make_train_pipeline(kind, dmp, opt, device, options=options)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    me = start_worker()
    rank, world, pg, device = me.rank, me.world_size, me.pg, me.device
    tables, arch, plan = table_wise_dcn(args.embedding_dim, args.scale, "small", args.batch_size, world, world, pg)

    heldout: Dict[str, Dict[int, float]] = {k: {} for k in args.kinds}
    train_loss: Dict[str, Dict[int, float]] = {k: {} for k in args.kinds}
    t_start = time.perf_counter()
    for seed in args.seeds:
        # held out: the batches after the trained ones (same planted model, never trained on)
        evals = list(synthetic_batches(tables, args.batch_size, seed, rank, args.steps + args.eval, start=args.steps))
        for kind in args.kinds:
            if kind == args.kinds[0] and args.reference_losses is not None:
                heldout[kind][seed] = args.reference_losses[seed]
                train_loss[kind][seed] = float("nan")
                continue
            torch.manual_seed(seed)
            dmp, opt = shard_model(build_model(tables, "dcn", arch), plan, device, args.lr, "adagrad", args.dense_lr)
            pipe = _pipeline(kind, dmp, opt, device, args.start_batch)
            it = synthetic_batches(tables, args.batch_size, seed, rank, args.steps)
            losses = []
            while True:
                try:
                    losses.append(float(pipe.progress(it)[0]))
                except StopIteration:  # the stale kind applies its last embedding update here
                    break
            pipe.detach()  # the model's own forwards again
            dmp.eval()
            total = torch.zeros(2)
            with torch.no_grad():
                for b in evals:
                    loss, _ = dmp(b)
                    total += torch.tensor([float(loss) * len(b.labels), len(b.labels)])
            dist.all_reduce(total, group=pg)
            heldout[kind][seed] = float(total[0] / total[1])
            last = torch.tensor([statistics.mean(losses[-20:])])
            dist.all_reduce(last, group=pg)
            train_loss[kind][seed] = float(last) / world
            if rank == 0:
                print(f"[quality] seed {seed} {kind:14s} steps {len(losses)} train loss (last 20) "
                      f"{train_loss[kind][seed]:.5f} held-out loss {heldout[kind][seed]:.5f}", flush=True)
    if rank == 0:
        ref = args.kinds[0]
        result: Dict[str, Any] = {
            "world_size": world,
            "config": {k: getattr(args, k) for k in ("steps", "seeds", "eval", "scale", "embedding_dim",
                                                      "batch_size", "lr", "dense_lr", "start_batch")},
            "heldout_loss": heldout,
            "train_loss_last20": train_loss,
            "wall_s": time.perf_counter() - t_start,
            "diff_vs_" + ref: {},
        }
        for kind in args.kinds[1:]:
            diffs = [heldout[kind][s] - heldout[ref][s] for s in args.seeds]
            result["diff_vs_" + ref][kind] = {"per_seed": diffs, "mean": statistics.mean(diffs), "max": max(diffs)}
            print(f"[quality] {kind} - {ref} held-out loss per seed: "
                  + ", ".join(f"{d:+.5f}" for d in diffs)
                  + f"; mean {statistics.mean(diffs):+.5f}, max {max(diffs):+.5f} (target <= +0.0005)", flush=True)
        if args.out:
            write_report(args.out, result)
    stop_worker()
    return 0


if __name__ == "__main__":
    exit_now(main)
