"""Train TorchRec's DLRM / DLRM-DCN with embedding tables sharded by a chosen planner.

    torchrun --standalone --nproc_per_node 2 examples/dlrm/train.py \
        --planner sparselift --tables dcnv2 --scale 0.001 --steps 100 --out result.json

CPU + gloo by default, CUDA + NCCL when GPUs are present (``--device auto``). Run without torchrun
it trains on one rank. The model is built on the meta device and planned collectively (every
rank gets the same plan). ``--planner sparselift``: an ``ExecutionPlan`` from
``collective_plan_execution``, reused from ``--plan-cache`` when the inputs match, applied with
``torchrec_sparselift.runtime.lift`` (DMP + the planned comm codecs + the planned train
pipeline); the measured steady-state step time is set against the plan's prediction.
``--planner torchrec``: ``EmbeddingShardingPlanner``, ``DistributedModelParallel`` and
``TrainPipelineSparseDist``. Sharded tables use fused row-wise AdaGrad (applied in backward);
dense parameters, including any data-parallel tables, use ``--dense-optimizer``.
``--checkpoint-dir`` saves model and optimizer state with torch.distributed.checkpoint every
``--checkpoint-every`` steps and resumes from it (``torchrec_sparselift.dlrm.checkpoint``).

Output: the plan summary, a progress bar with the loss (rank 0), steady-state steps/s with
warm-up excluded, measured vs predicted step time; rank 0 writes ``--out`` as JSON. On failure it
exits non-zero with one line saying what went wrong (``--debug`` for the full traceback).

This file is the command line only: flags -> ``TrainOptions`` -> ``torchrec_sparselift.dlrm.run.run``
(the model, the data, the checkpoints and the training run are the library
``torchrec_sparselift.dlrm``, which benchmarks and tests import).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence

import attrs

from torchrec_sparselift.dlrm.logs import quiet_logs
from torchrec_sparselift.dlrm.options import (
    ARCHS,
    DEDUP_ALL,
    DEDUP_NONE,
    DENSE_OPTIMIZERS,
    DEVICES,
    FAIL_HOWS,
    ID_DTYPES,
    MODELS,
    PLANNERS,
    REPLICA_MERGES,
    TABLE_PRESETS,
    TrainOptions,
    UsageError,
    resolve_tables,
    rewrite_overrides,
)
from torchrec_sparselift.dlrm.tables import TableSetError, load_constraints_file
from torchrec_sparselift.vocabulary import PIPELINES, STALE_PIPELINES, STRATEGY_2D_CHOICES

EXIT_USAGE = 2  # bad flags, table file or data directory
EXIT_FAILURE = 1  # anything that failed while planning or training

#: every flag's default is the options value's
D = {f.name: f.default for f in attrs.fields(TrainOptions)}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see --help)")


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainOptions:
    """The command line as a validated TrainOptions; raises UsageError saying which flag to change."""
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--planner", choices=PLANNERS, default=D["planner"])
    p.add_argument("--tables", choices=TABLE_PRESETS, default=D["tables"], help="table preset")
    p.add_argument(
        "--table-file", help="table file as for `sparselift plan --tables` (JSON/YAML list of {name, rows, dim, "
        "features?, pooling_factor?, sharding_types?, compute_kernels?, min_partition?}); overrides --tables"
    )
    p.add_argument(
        "--constraints",
        metavar="FILE.json",
        help="force planner choices: {table: {sharding_types: [...], compute_kernels: [...], min_partition: N}}",
    )
    p.add_argument("--scale", type=float, default=D["scale"], help="multiply table rows by this (0, 1]")
    p.add_argument("--embedding-dim", type=int, help="override every table's dim (preset default: dcnv2 128, kaggle 64)")
    p.add_argument("--model", choices=MODELS, default=D["model"], help="auto: dcn for dcnv2, else dlrm")
    p.add_argument("--arch", choices=ARCHS, default=D["arch"], help="dense layer sizes")
    p.add_argument("--batch-size", type=int, default=D["batch_size"], help="samples per rank per step")
    p.add_argument("--steps", type=int, default=D["steps"])
    p.add_argument("--warmup-steps", type=int, default=D["warmup_steps"], help="steps left out of steps/s")
    p.add_argument("--lr", type=float, default=D["lr"], help="learning rate of the sharded tables (row-wise AdaGrad)")
    p.add_argument("--dense-lr", type=float, default=D["dense_lr"], help="learning rate of the dense part")
    p.add_argument("--dense-optimizer", choices=DENSE_OPTIMIZERS, default=D["dense_optimizer"])
    p.add_argument("--seed", type=int, default=D["seed"])
    p.add_argument("--zipf-alpha", type=float, default=D["zipf_alpha"], help="power-law exponent of id popularity")
    p.add_argument("--signal", type=float, default=D["signal"], help="strength of the planted label signal")
    p.add_argument("--criteo-dir", help="train on Criteo day_<i>_{dense,sparse,labels}.npy files instead")
    p.add_argument("--device", choices=DEVICES, default=D["device"])
    p.add_argument(
        "--hardware",
        default=D["hardware"],
        metavar="NAME|PROFILE.json",
        help="sparselift cost-model hardware: a preset (h100, h200, a100, cpu-gloo) or a calibrated profile; "
        "auto: profiles/cpu-2core-gloo.json on CPU, else the preset for the topology",
    )
    p.add_argument(
        "--plan-cache",
        default=D["plan_cache"],
        metavar="DIR",
        help="sparselift: reuse the execution plan stored here when the inputs match (else plan and store)",
    )
    p.add_argument("--no-plan-cache", action="store_true", help="always plan; store nothing")
    p.add_argument(
        "--pipeline",
        choices=PIPELINES,
        help="sparselift: train with this pipeline instead of the planned one (the prediction then no longer applies)",
    )
    p.add_argument("--allow-lossy-comm", action="store_true", help="sparselift may plan fp16/bf16 communication")
    p.add_argument("--allow-staleness", action="store_true",
                   help="sparselift may plan a pipeline that trains on one-step-stale embeddings (" +
                   ", ".join(STALE_PIPELINES) + "; docs/overlap.md); --pipeline needs it to force one")
    # ---- sparse-path rewrites (runtime.lift's batch_split / id_dtype / dedup_features; default: the plan's)
    p.add_argument("--batch-split", type=int, metavar="K",
                   help="sparselift: split the embeddings' output and gradient all-to-alls into K chunks (1..16; 1: "
                   "none), each chunk's dense work beside the next chunk's transfer, exact; needs --pipeline overlap "
                   "(1D); default: the plan's choice (docs/overlap.md section 10)")
    p.add_argument("--per-sample", action="store_true",
                   help="declare the dense model per-sample (every sample's output depends on that sample alone, "
                   "the loss a mean over the batch) for a batch split, to the planner and the pipeline (both of the "
                   "example's models pass the per-sample rule without it)")
    p.add_argument("--id-dtype", choices=ID_DTYPES,
                   help="sparselift: ids and lengths in the input all-to-all at this width (int32 needs every table "
                   "within int32 rows; 1D); default: the plan's choice (docs/wire_ids.md)")
    p.add_argument("--dedup", metavar=f"FEATURES|{DEDUP_ALL}|{DEDUP_NONE}",
                   help="sparselift: deduplicate the ids of these features (comma-separated; all: every feature; "
                   "none: no feature) before the input all-to-all, exact (1D); default: the plan's choice "
                   "(docs/wire_ids.md)")
    # ---- 2D sparse parallelism (SparseLiftPlanner(sharding_group_size=...), runtime.lift builds DMPCollection)
    p.add_argument("--sharding-group-size", metavar="auto|N", help="sparselift: plan 2D sparse parallelism: tables "
                   "sharded over groups of N ranks, the groups replicated (auto: the planner picks N, 1D included); "
                   "default: 1D")
    p.add_argument("--2d-strategy", dest="strategy_2d", choices=STRATEGY_2D_CHOICES, default=D["strategy_2d"],
                   help="with --sharding-group-size: how replicas stay in step (default: periodic sync; "
                   "fully_sharded: reduce-scatter + all-gather of the weights every step, CUDA only; auto: priced)")
    p.add_argument("--sync-interval", type=int, metavar="N", help="with --sharding-group-size: pin the replica sync "
                   "interval (steps; default: the planner's choice, at most 2)")
    p.add_argument("--replica-merge", choices=REPLICA_MERGES, default=D["replica_merge"],
                   help="with --sharding-group-size and the default 2D strategy: how replicas merge at each sync "
                   "(average: TorchRec's DMPCollection; momentum_scaled: the momentum-scaled row-wise AdaGrad "
                   "merge, which reproduces 1D when syncing every step; docs/optimizer.md)")
    p.add_argument("--measured-guard", type=int, default=D["measured_guard"], metavar="N",
                   help="sparselift: before training, measure SparseLift's best N candidate plans and TorchRec's "
                   "plan for a few steps each and keep the fastest (0: off); the result is cached with the plan")
    p.add_argument("--guard-steps", type=int, default=D["guard_steps"], metavar="S", help="timed steps per measured-guard trial")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save sharded model + optimizer state here; resume from it")
    p.add_argument("--checkpoint-every", type=int, default=D["checkpoint_every"], metavar="N", help="checkpoint after every N steps")
    p.add_argument("--fail-at-step", type=int, metavar="K",
                   help="testing: exit non-zero after step K (and its checkpoint, if K is a multiple of "
                   "--checkpoint-every); only on torchrun's first attempt, so --max-restarts resumes")
    p.add_argument("--fail-how", choices=FAIL_HOWS, default=D["fail_how"],
                   help="testing, with --fail-at-step: raise an error (default), kill the rank (SIGKILL) or hang it "
                   "(SIGSTOP: its connections stay open, as when its host or link is gone)")
    p.add_argument("--fail-rank", type=int, default=None, metavar="R",
                   help="testing, with --fail-at-step: only rank R fails (default: every rank)")
    p.add_argument("--collective-timeout", type=float, default=D["collective_timeout"], metavar="S",
                   help="seconds a collective waits for a lost rank or link before the job stops with an error "
                   "naming the rank (the process group's timeout; default %(default)g s)")
    p.add_argument("--out", help="write the JSON result here (rank 0)")
    p.add_argument("--attribute", type=int, default=D["attribute"], metavar="N",
                   help="after training, profile N more steps (torch.profiler) and print where the step time goes "
                   "per sparse-path node kind next to the model's prediction; costs 2 + 2N extra steps (they "
                   "train too)")
    p.add_argument(
        "--attribution-out",
        metavar="FILE.json",
        help="with --attribute: write the attribution here (rank 0; default: next to --out) for "
        "`sparselift explain PLAN --attribution FILE`",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-pin", action="store_true", help="CPU: do not pin each rank to its own core (the step "
                   "calibration and the measured guard measure pinned ranks)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on failure")
    p.add_argument("--check", action="store_true", help="only validate the flags and tables, then exit (no torch)")
    return TrainOptions(**vars(p.parse_args(argv)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: returns the process exit code (0 ok, 2 usage error, 1 failure)."""
    rank = int(os.environ.get("RANK", "0"))
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    if not debug:
        quiet_logs()
    try:
        options = parse_args(argv)
        tables: List = resolve_tables(options)
        if options.constraints:
            load_constraints_file(options.constraints, tables)  # a bad file fails here, before torch
        rewrite_overrides(options, tables)  # --id-dtype int32 over the tables' rows, --dedup's features
        if options.planner == "torchrec" and options.check:
            return 0  # nothing else to check, and no torch to import
        # torch and TorchRec load here: --help, a bad flag and a bad file above answer without them
        from torchrec_sparselift.dlrm import run as dlrm_run
        from torchrec_sparselift.dlrm.model import check_hardware

        if options.planner == "sparselift" and options.hardware != "auto":
            check_hardware(options.hardware)
        if options.check:
            dlrm_run.check_planning_input(options, tables)
            return 0
        dlrm_run.run(options, tables)
        return 0
    except (UsageError, TableSetError) as e:
        if debug:
            raise
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops the other ranks as soon as one exits: give rank 0 time to say why
            time.sleep(3.0)
        return EXIT_USAGE
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - one clear line instead of a traceback; torch's
        # CheckpointException is a BaseException
        if debug:
            raise
        checkpoint = sys.modules.get("torchrec_sparselift.dlrm.checkpoint")  # loaded with the run
        what = checkpoint.describe_checkpoint_exception(e) if checkpoint else f"{type(e).__name__}: {e}"
        print(
            f"error [rank {rank}]: {what} (rerun with --debug for the traceback)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILURE
    finally:
        if "torch.distributed" in sys.modules:  # never import torch just to clean up
            try:
                from torchrec_sparselift.runtime.process_group import close_process_group

                close_process_group()
            except Exception:  # noqa: BLE001
                pass


if __name__ == "__main__":
    code = main()
    # Everything is written (results atomically) and the process group is destroyed. Skip the
    # interpreter's teardown: torch/gloo's C++ threads can abort there ("terminate called without
    # an active exception", exit -6) after a run that completed, which torchrun reports as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
