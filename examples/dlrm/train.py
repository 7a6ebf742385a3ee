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
``--checkpoint-every`` steps and resumes from it (see dlrm_checkpoint.py).

Output: the plan summary, a progress bar with the loss (rank 0), steady-state steps/s with
warm-up excluded, measured vs predicted step time; rank 0 writes ``--out`` as JSON. On failure it
exits non-zero with one line saying what went wrong (``--debug`` for the full traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import sys
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import attrs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dlrm_tables import (  # noqa: E402
    ConstraintSpec,
    TableSetError,
    TableSpec,
    check_uniform_dim,
    load_constraints_file,
    load_table_file,
    preset_tables,
    scale_tables,
)
from torchrec_sparselift.defaults import STRATEGY_2D as DEFAULT_STRATEGY_2D  # noqa: E402
from torchrec_sparselift.defaults import ranks_per_host  # noqa: E402
from torchrec_sparselift.vocabulary import (  # noqa: E402
    COMPUTE_KERNELS, PIPELINES, SHARDING_TYPES, STALE_PIPELINES, STRATEGY_2D_CHOICES,
)

__all__ = [
    "UsageError",
    "SimulatedFailure",
    "ArchSpec",
    "TrainResult",
    "parse_args",
    "resolve_tables",
    "planner_constraints",
    "hardware_choice",
    "check_hardware",
    "make_planner",
    "checkpoint_config",
    "train_loop",
    "run",
    "main",
]

EXIT_USAGE = 2  # bad flags, table file or data directory
EXIT_FAILURE = 1  # anything that failed while planning or training


class UsageError(ValueError):
    """The command line asks for something the example cannot do; the message says what to change."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see --help)")


@attrs.frozen
class ArchSpec:
    """Dense layer sizes of the model: ``dense`` ends at the embedding dim, ``over`` at 1."""

    dense: List[int]
    over: List[int]
    dcn_layers: int
    dcn_rank: int


def arch_spec(name: str, dim: int) -> ArchSpec:
    """``mlperf``: the MLPerf DLRM-DCNv2 sizes (DESIGN.md section 3); ``small``: a CPU-sized net."""
    if name == "mlperf":
        return ArchSpec(dense=[512, 256, dim], over=[1024, 1024, 512, 256, 1], dcn_layers=3, dcn_rank=512)
    if name == "small":
        return ArchSpec(dense=[64, dim], over=[128, 64, 1], dcn_layers=2, dcn_rank=32)
    raise UsageError(f"unknown --arch {name!r}: use mlperf or small")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The parsed and checked command line; raises UsageError saying which flag to change."""
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--planner", choices=["sparselift", "torchrec"], default="sparselift")
    p.add_argument("--tables", choices=["dcnv2", "kaggle"], default="dcnv2", help="table preset")
    p.add_argument(
        "--table-file", help="table file as for `sparselift plan --tables` (JSON/YAML list of {name, rows, dim, "
        "features?, pooling_factor?, sharding_types?, compute_kernels?, min_partition?}); overrides --tables"
    )
    p.add_argument(
        "--constraints",
        metavar="FILE.json",
        help="force planner choices: {table: {sharding_types: [...], compute_kernels: [...], min_partition: N}}",
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiply table rows by this (0, 1]")
    p.add_argument("--embedding-dim", type=int, help="override every table's dim (preset default: dcnv2 128, kaggle 64)")
    p.add_argument("--model", choices=["auto", "dcn", "dlrm"], default="auto", help="auto: dcn for dcnv2, else dlrm")
    p.add_argument("--arch", choices=["mlperf", "small"], default="small", help="dense layer sizes")
    p.add_argument("--batch-size", type=int, default=256, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of steps/s")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of the sharded tables (row-wise AdaGrad)")
    p.add_argument("--dense-lr", type=float, default=0.005, help="learning rate of the dense part")
    p.add_argument("--dense-optimizer", choices=["adagrad", "sgd"], default="adagrad")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf-alpha", type=float, default=1.05, help="power-law exponent of id popularity")
    p.add_argument("--signal", type=float, default=3.0, help="strength of the planted label signal")
    p.add_argument("--criteo-dir", help="train on Criteo day_<i>_{dense,sparse,labels}.npy files instead")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--hardware",
        default="auto",
        metavar="NAME|PROFILE.json",
        help="sparselift cost-model hardware: a preset (h100, h200, a100, cpu-gloo) or a calibrated profile; "
        "auto: profiles/cpu-2core-gloo.json on CPU, else the preset for the topology",
    )
    p.add_argument(
        "--plan-cache",
        default=".sparselift_cache",
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
    # ---- 2D sparse parallelism (SparseLiftPlanner(sharding_group_size=...), runtime.lift builds DMPCollection)
    p.add_argument("--sharding-group-size", metavar="auto|N", help="sparselift: plan 2D sparse parallelism: tables "
                   "sharded over groups of N ranks, the groups replicated (auto: the planner picks N, 1D included); "
                   "default: 1D")
    p.add_argument("--2d-strategy", dest="strategy_2d", choices=STRATEGY_2D_CHOICES, default=DEFAULT_STRATEGY_2D,
                   help="with --sharding-group-size: how replicas stay in step (default: periodic sync; "
                   "fully_sharded: reduce-scatter + all-gather of the weights every step, CUDA only; auto: priced)")
    p.add_argument("--sync-interval", type=int, metavar="N", help="with --sharding-group-size: pin the replica sync "
                   "interval (steps; default: the planner's choice, at most 2)")
    p.add_argument("--replica-merge", choices=("average", "momentum_scaled"), default="average",
                   help="with --sharding-group-size and the default 2D strategy: how replicas merge at each sync "
                   "(average: TorchRec's DMPCollection; momentum_scaled: the momentum-scaled row-wise AdaGrad "
                   "merge, which reproduces 1D when syncing every step; docs/optimizer.md)")
    p.add_argument(
        "--measured-guard",
        type=int,
        default=0,
        metavar="N",
        help="sparselift: before training, measure SparseLift's best N candidate plans and TorchRec's plan for a "
        "few steps each and keep the fastest (0: off); the result is cached with the plan",
    )
    p.add_argument("--guard-steps", type=int, default=16, metavar="S", help="timed steps per measured-guard trial")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save sharded model + optimizer state here; resume from it")
    p.add_argument("--checkpoint-every", type=int, default=100, metavar="N", help="checkpoint after every N steps")
    p.add_argument(
        "--fail-at-step",
        type=int,
        metavar="K",
        help="testing: exit non-zero after step K (and its checkpoint, if K is a multiple of --checkpoint-every); "
        "only on torchrun's first attempt, so --max-restarts resumes",
    )
    p.add_argument("--out", help="write the JSON result here (rank 0)")
    p.add_argument(
        "--attribute",
        type=int,
        default=0,
        metavar="N",
        help="after training, profile N more steps (torch.profiler) and print where the step time goes per "
        "sparse-path node kind next to the model's prediction; costs 2 + 2N extra steps (they train too)",
    )
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
    args = p.parse_args(argv)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if not 0 <= args.warmup_steps < args.steps:
        raise UsageError(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps} with --steps {args.steps}")
    if args.embedding_dim is not None and args.embedding_dim < 1:
        raise UsageError(f"--embedding-dim must be >= 1, got {args.embedding_dim}")
    if not (args.lr > 0 and args.dense_lr > 0):
        raise UsageError("--lr and --dense-lr must be > 0")
    if args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    if args.fail_at_step is not None and not 1 <= args.fail_at_step <= args.steps:
        raise UsageError(f"--fail-at-step must be in [1, --steps], got {args.fail_at_step}")
    if args.pipeline is not None and args.planner != "sparselift":
        raise UsageError("--pipeline applies to --planner sparselift (--planner torchrec trains with sparse_dist)")
    if args.pipeline in STALE_PIPELINES and not args.allow_staleness:
        raise UsageError(f"--pipeline {args.pipeline} trains on one-step-stale embeddings; add --allow-staleness")
    if args.allow_staleness and args.planner != "sparselift":
        raise UsageError("--allow-staleness applies to --planner sparselift (--planner torchrec trains with sparse_dist)")
    if args.allow_staleness and args.measured_guard:
        raise UsageError("--allow-staleness does not combine with --measured-guard (the guard measures exact plans "
                         "only); force a stale pipeline with --pipeline, or leave out one of the two")
    if args.zipf_alpha <= 0:
        raise UsageError(f"--zipf-alpha must be > 0, got {args.zipf_alpha}")
    if args.attribute < 0:
        raise UsageError(f"--attribute must be >= 0 steps, got {args.attribute}")
    if args.measured_guard < 0 or args.guard_steps < 1:
        raise UsageError("--measured-guard must be >= 0 and --guard-steps >= 1")
    if args.measured_guard and args.planner != "sparselift":
        raise UsageError("--measured-guard applies to --planner sparselift (it measures TorchRec's plan too)")
    check_2d_args(args)
    return args


def check_2d_args(args: argparse.Namespace) -> None:
    """The 2D flags: ``--sharding-group-size`` becomes None, "auto" or an int; the others need it."""
    g = args.sharding_group_size
    if g is not None and g != "auto":
        try:
            g = int(g)
        except ValueError:
            g = 0
        if g < 1:
            raise UsageError(f"--sharding-group-size must be auto or a number of ranks >= 1, got {args.sharding_group_size!r}")
    args.sharding_group_size = g
    if args.sync_interval is not None and args.sync_interval < 1:
        raise UsageError(f"--sync-interval must be >= 1 step, got {args.sync_interval}")
    if g is None:
        for flag, value, default in (("--2d-strategy", args.strategy_2d, DEFAULT_STRATEGY_2D),
                                     ("--sync-interval", args.sync_interval, None),
                                     ("--replica-merge", args.replica_merge, "average")):
            if value != default:
                raise UsageError(f"{flag} needs --sharding-group-size auto|N (2D); without it the plan is 1D")
        return
    if args.planner != "sparselift":
        raise UsageError("--sharding-group-size plans 2D with --planner sparselift (TorchRec's planner has no 2D)")
    if args.sync_interval is not None and args.strategy_2d == "fully_sharded":
        raise UsageError("--sync-interval does not apply to --2d-strategy fully_sharded (it syncs every step)")
    if args.replica_merge != "average" and args.strategy_2d == "fully_sharded":
        raise UsageError("--replica-merge applies to the periodic sync (--2d-strategy default), not fully_sharded")
    for flag, value in (("--measured-guard", args.measured_guard), ("--checkpoint-dir", args.checkpoint_dir),
                        ("--attribute", args.attribute)):
        if value:
            raise UsageError(f"{flag} is not supported with --sharding-group-size (2D) in this example; drop one")


def resolve_tables(args: argparse.Namespace) -> List[TableSpec]:
    """The tables the run trains: preset or file, then ``--embedding-dim`` and ``--scale``."""
    if args.table_file:
        tables = load_table_file(args.table_file)
        if args.embedding_dim is not None:
            tables = [attrs.evolve(t, dim=args.embedding_dim) for t in tables]
    else:
        tables = preset_tables(args.tables, args.embedding_dim)
    tables = scale_tables(tables, args.scale)
    check_uniform_dim(tables)
    return tables


def check_planning_input(args: argparse.Namespace, tables: Sequence[TableSpec]) -> None:
    """``--check`` with ``--planner sparselift``: the validation planning runs (tables,
    constraints, batch size, topology; every problem at once), on the tables' shapes alone (a
    meta-device model, no process group). Raises UsageError with what planning would say."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.distributed.sharding_plan import get_default_sharders

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    specs = load_constraints_file(args.constraints, tables) if args.constraints else []
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.features))
        for t in tables], device=torch.device("meta"))
    try:
        planner = make_planner(
            "sparselift", world_size, ranks_per_host(world_size=world_size), "cuda" if use_cuda else "cpu",
            args.batch_size, planner_constraints(tables, specs, one_hot=bool(args.criteo_dir)),
            allow_lossy_comm=args.allow_lossy_comm, allow_staleness=args.allow_staleness, **two_d_options(args))
        planner.request(ebc, get_default_sharders())
    except ValueError as e:
        raise UsageError(f"planning would refuse this input: {e}") from None
    except Exception as e:  # noqa: BLE001 - a PlannerError (e.g. the tables exceed the cluster)
        if type(e).__name__ not in ("SparseLiftPlannerError", "PlannerError"):
            raise
        raise UsageError(f"planning would refuse this input: {e}") from None


# ---------------------------------------------------------------- distributed setup (side effects)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_flag: str):
    """Join (or, outside torchrun, create a 1-rank) process group; returns (rank, world_size,
    local_world_size, device, backend)."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = ranks_per_host(world_size=world_size)
    use_cuda = device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is visible: use --device cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        dist.init_process_group(backend=backend)
    else:
        # torchrun --max-restarts: the restarted workers meet in the agent's store, which still
        # holds the failed attempt's gloo addresses (measured: "connectFullMesh failed ...
        # Connection refused"); give this attempt its own key space.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=not agent_store and rank == 0,
            multi_tenant=not agent_store,
        )
        prefixed = dist.PrefixStore(f"/dlrm_example/attempt_{attempt}", store)
        dist.init_process_group(backend=backend, store=prefixed, rank=rank, world_size=world_size)
    return rank, world_size, local_world_size, device, backend


# ---------------------------------------------------------------- model, plan, sharding


def build_model(tables: Sequence[TableSpec], model_kind: str, arch: ArchSpec):
    """DLRMTrain(DLRM or DLRM_DCN) with its EmbeddingBagCollection on the meta device."""
    import torch
    from torchrec.datasets.criteo import INT_FEATURE_COUNT
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.features))
        for t in tables
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=INT_FEATURE_COUNT,
        dense_arch_layer_sizes=arch.dense,
        over_arch_layer_sizes=arch.over,
    )
    if model_kind == "dcn":
        dlrm = DLRM_DCN(**common, dcn_num_layers=arch.dcn_layers, dcn_low_rank_dim=arch.dcn_rank)
    else:
        dlrm = DLRM(**common)
    return DLRMTrain(dlrm)


def planner_constraints(
    tables: Sequence[TableSpec], specs: Sequence[ConstraintSpec], one_hot: bool = False
) -> Dict[str, Any]:
    """TorchRec ``ParameterConstraints`` per table: every table's pooling factor (1 when
    ``one_hot``, e.g. Criteo files), plus what ``specs`` force. Raises UsageError for a sharding
    type or compute kernel TorchRec does not know."""
    from torchrec.distributed.planner.types import ParameterConstraints

    known_types = list(SHARDING_TYPES)
    known_kernels = list(COMPUTE_KERNELS)
    by_table = {s.table: s for s in specs}
    out = {}
    for t in tables:
        # --constraints overrides what the table file says about the table
        spec = by_table.get(t.name) or ConstraintSpec(
            table=t.name, sharding_types=t.sharding_types, compute_kernels=t.compute_kernels,
            min_partition=t.min_partition)
        for value in spec.sharding_types or ():
            if value not in known_types:
                raise UsageError(f"--constraints: table {t.name!r}: unknown sharding type {value!r}; use one of {known_types}")
        for value in spec.compute_kernels or ():
            if value not in known_kernels:
                raise UsageError(f"--constraints: table {t.name!r}: unknown compute kernel {value!r}; use one of {known_kernels}")
        out[t.name] = ParameterConstraints(
            sharding_types=list(spec.sharding_types) if spec.sharding_types else None,
            compute_kernels=list(spec.compute_kernels) if spec.compute_kernels else None,
            min_partition=spec.min_partition,
            pooling_factors=[1.0 if one_hot else float(b) for b in t.bag_sizes()],
        )
    return out


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Hardware profile measured on the 2-core CPU machine this example is developed on (docs/calibration.md).
CPU_PROFILE = os.path.join(REPO_ROOT, "profiles", "cpu-2core-gloo.json")


def hardware_choice(flag: str, device_type: str, ranks: int = 1, say: Callable[[str], None] = print,
                    cores: Optional[int] = None, link: Any = None):
    """What ``--hardware`` hands the planner: a preset name or profile path; for ``auto``, this
    machine's profile fitted from real steps (``sparselift`` step calibration, stored per machine
    fingerprint in ~/.cache/torchrec_sparselift/profiles) as a HardwareProfile; without one, the
    closest stored profile or the committed CPU profile, with a line naming what differs; on GPU
    None (the planner picks a preset from the topology). ``cores``: the cores this process could use
    before pinning its ranks (the machine's fingerprint). ``link``: the ``LinkRates`` this job
    measured (``auto`` on CPU): compared with the link the stored profile was calibrated on; where
    they differ beyond the measured spread, a warning names each term and the profile's link terms
    are corrected (``calibration.term_error.profile_on_link``, as the planner's ``hardware="auto"``).

    Returns ``(hardware, model_errors)``: ``model_errors`` is the never-slower rule's error per term
    for a corrected profile (the stored step fit's, the corrected link terms' at least the link
    measurement's spread), None otherwise (the planner finds a stored profile's own)."""
    if flag != "auto":
        return flag, None
    if device_type == "cpu":
        try:
            from torchrec_sparselift.calibration.store import auto_profile_link
            from torchrec_sparselift.calibration.term_error import profile_on_link
        except ImportError:
            return (CPU_PROFILE if os.path.isfile(CPU_PROFILE) else None), None
        profile, where, stored = auto_profile_link("cpu", ranks, warn=lambda m: say(f"[dlrm] warning: {m}"),
                                                   cores=cores, hosts=link.hosts if link is not None else 1)
        if link is None:
            return profile, None
        on = profile_on_link(profile, stored, link, where)
        if on.note is not None:
            say(f"[dlrm] warning: sparselift: {on.note}")
        return on.profile, (on.errors if on.corrected and on.errors.measured else None)
    return None, None


def hardware_name(hardware: Any) -> Optional[str]:
    """A JSON-able name for what :func:`hardware_choice` returned."""
    return hardware if hardware is None or isinstance(hardware, str) else getattr(hardware, "name", str(hardware))


def check_hardware(name: str):
    """The HardwareProfile ``--hardware name`` names (preset or profile JSON); UsageError if none.
    Needs no torch."""
    try:
        from torchrec_sparselift.cost.hardware import get_profile
    except ImportError as e:
        raise UsageError(f"--hardware needs torchrec_sparselift ({e}); install it (bash scripts/setup.sh)") from e
    try:
        return get_profile(name)
    except (ValueError, OSError) as e:
        raise UsageError(f"--hardware {name}: {e}") from e


def make_planner(
    name: str,
    world_size: int,
    local_world_size: int,
    compute_device: str,
    batch_size: int,
    constraints: Optional[Dict[str, Any]] = None,
    *,
    hardware: Optional[str] = None,
    cache_dir: Optional[str] = None,
    allow_lossy_comm: bool = False,
    allow_staleness: bool = False,
    workload: Any = None,
    sharding_group_size: Any = None,
    strategy_2d: str = DEFAULT_STRATEGY_2D,
    sync_interval: Optional[int] = None,
    model_errors: Any = None,
):
    """The planner ``name`` built with EmbeddingShardingPlanner's arguments (the one-word swap);
    SparseLift also gets ``hardware`` (preset name or profile JSON), ``cache_dir`` (execution
    plan reuse), ``allow_lossy_comm``, ``allow_staleness``, ``workload`` (the ids' ``WorkloadStats``)
    and ``model_errors`` (the never-slower rule's errors of a link-corrected profile)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Topology(...) warns that TopologyFactory is preferred
        topology = Topology(world_size=world_size, local_world_size=local_world_size, compute_device=compute_device)
    if name == "torchrec":
        return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    try:
        from torchrec_sparselift import SparseLiftPlanner
    except ImportError as e:
        raise UsageError(
            f"--planner sparselift: SparseLiftPlanner is not importable ({e}); install the package "
            "(bash scripts/setup.sh) or use --planner torchrec"
        ) from e
    profile = check_hardware(hardware) if isinstance(hardware, str) else hardware
    return SparseLiftPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        hardware=profile,
        cache_dir=cache_dir,
        allow_lossy_comm=allow_lossy_comm,
        allow_staleness=allow_staleness,
        workload=workload,
        sharding_group_size=sharding_group_size,
        strategy_2d=strategy_2d,
        sync_interval=sync_interval,
        model_errors=model_errors,
    )


def two_d_options(args: argparse.Namespace) -> Dict[str, Any]:
    """``make_planner``'s 2D keywords from the command line (empty for 1D)."""
    if args.sharding_group_size is None:
        return {}
    return dict(sharding_group_size=args.sharding_group_size, strategy_2d=args.strategy_2d,
                sync_interval=args.sync_interval)


def observed_workload(args: argparse.Namespace, tables: Sequence[Any], world_size: int) -> Any:
    """``observe()`` of rank 0's first ``OBSERVED_BATCHES`` batches (the same statistics on every
    rank): pooling factors and how often ids repeat, which price the embedding backward."""
    import itertools

    from dlrm_data import criteo_batches, synthetic_batches
    from torchrec_sparselift import observe

    if args.criteo_dir:
        src = criteo_batches(args.criteo_dir, tables, args.batch_size, 0, world_size, OBSERVED_BATCHES, 0)
    else:
        src = synthetic_batches(tables, args.batch_size, args.seed, 0, OBSERVED_BATCHES, args.zipf_alpha, args.signal)
    return observe(itertools.islice(src, OBSERVED_BATCHES), max_batches=OBSERVED_BATCHES)


def plan_summary(plan) -> List[Dict[str, Any]]:
    """One row per table of ``plan``: module, table, sharding type, compute kernel, ranks."""
    rows = []
    for module_path, module_plan in sorted(plan.plan.items()):
        for table, ps in sorted(module_plan.items()):
            rows.append(
                dict(
                    module=module_path,
                    table=table,
                    sharding_type=ps.sharding_type,
                    compute_kernel=ps.compute_kernel,
                    ranks=sorted(set(ps.ranks)) if ps.ranks is not None else [],
                )
            )
    return rows


def execution_plan_prediction(ep, settings) -> Dict[str, Any]:
    """What the execution plan ``ep`` predicts, and whether it applies to what runs: it does not
    when an override (``--pipeline``) changed the plan's choice (``settings.predicted_step_s``
    is then None)."""
    o, p = ep.optimizations, ep.prediction
    return dict(
        step_time_ms=p.step_time_s * 1e3,
        lower_bound_ms=p.lower_bound_s * 1e3,
        pipeline=o.pipeline,
        comm_precision=f"{o.fwd_comm_precision}/{o.bwd_comm_precision}",
        solver=ep.planner_info.get("solver"),
        hardware=ep.planner_info.get("hardware"),
        applies=settings.predicted_step_s is not None,
        summary=ep.summary(),
    )


def format_plan_summary(rows: Sequence[Dict[str, Any]], tables: Sequence[TableSpec]) -> str:
    """The plan as a table, one line per embedding table in the order of ``tables``."""
    size = {t.name: (t.rows, t.dim) for t in tables}
    order = {t.name: i for i, t in enumerate(tables)}
    lines = [f"{'table':<14}{'rows':>10}{'dim':>5}  {'sharding':<16}{'kernel':<14}ranks"]
    for r in sorted(rows, key=lambda r: (order.get(r["table"], len(order)), r["table"])):
        rows_, dim = size.get(r["table"], ("?", "?"))
        ranks = ",".join(map(str, r["ranks"])) if r["ranks"] else "all"
        lines.append(f"{r['table']:<14}{rows_:>10}{dim:>5}  {r['sharding_type']:<16}{r['compute_kernel']:<14}{ranks}")
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["sharding_type"]] = counts.get(r["sharding_type"], 0) + 1
    lines.append("sharding types: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


def shard_model(model, plan, device, lr: float, dense_optimizer: str, dense_lr: float):
    """DistributedModelParallel(model) under ``plan`` plus one optimizer over everything trainable:
    row-wise AdaGrad for every table (fused in backward; data-parallel tables, which lose the
    in-backward marker when sharded, after their all-reduce, as ``lift`` does), ``dense_optimizer``
    for the rest (``measure.probe.shard_for_training``, as the calibration's probes shard)."""
    import torch

    from torchrec_sparselift.measure.probe import shard_for_training

    opt_cls = torch.optim.Adagrad if dense_optimizer == "adagrad" else torch.optim.SGD
    return shard_for_training(model, plan, device, lr=lr,
                              dense_optimizer_factory=lambda params: opt_cls(params, lr=dense_lr))


# ---------------------------------------------------------------- runtime attribution

#: steps --attribute runs before it times and profiles (pipeline refill after the training loop)
ATTRIBUTION_WARMUP = 2


def attribute_run(
    pipeline, batches, steps: int, pg, device, plan, model_factory: Callable, world_size: int,
    local_world_size: int, batch_size: int, constraints, hardware, pipeline_kind: str, fwd: str, bwd: str,
    label: str,
):
    """Profile ``steps`` more steps of ``pipeline`` (after ATTRIBUTION_WARMUP, and as many timed without
    the profiler) and set each sparse-path node kind's measured ms (slowest rank) next to what the
    cost model predicts for ``plan`` (re-priced on a fresh meta model). Returns (StepAttribution,
    predicted seconds per kind, the printed table)."""
    from torchrec.distributed.planner import Topology

    from torchrec_sparselift import evaluate_sharding_plan
    from torchrec_sparselift.calibration.attribution import compare, format_comparison, predicted_for_plan
    from torchrec_sparselift.measure.attribution import attribute_steps

    att = attribute_steps(pipeline, batches, steps=steps, warmup_steps=ATTRIBUTION_WARMUP, pg=pg, label=label,
                          pipeline=pipeline_kind, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topology = Topology(world_size=world_size, local_world_size=local_world_size, compute_device=device.type)
        evaluated = evaluate_sharding_plan(model_factory(), plan, topology, batch_size, constraints, hardware=hardware,
                                           pipeline=pipeline_kind, fwd_precision=fwd, bwd_precision=bwd)
    predicted = predicted_for_plan(evaluated)
    text = ("[dlrm] where the step time goes, measured (torch.profiler, exclusive time per sparse-path node "
            "kind) vs predicted:\n" + format_comparison(compare(att, predicted), att))
    return att, predicted, text


# ---------------------------------------------------------------- the training loop

#: Batches the example builds ahead of the timed steps (then refills in one go between two steps).
PREBUILT_BATCHES = 256
#: Batches ``observed_workload`` reads to measure the ids' statistics (before training, not timed).
OBSERVED_BATCHES = 8


class SimulatedFailure(RuntimeError):
    """``--fail-at-step`` was reached: the run stops as if it had crashed."""


@attrs.frozen
class TrainResult:
    """Per-step losses (this rank) of steps ``first_step + 1 .. first_step + len(losses)``
    (1-based step numbers)."""

    first_step: int
    losses: List[float]


def train_loop(
    pipeline, batches: Iterator, first_step: int, steps: int, timer, after_step: Optional[Callable] = None
) -> TrainResult:
    """Run steps ``first_step + 1 .. steps`` (1-based) as ``pipeline.progress(batches)``, each
    timed by ``timer.step()``; ``after_step(step, loss)`` (``loss`` a 0-d tensor) is called after
    each step, outside the timed region (progress bar, checkpoint, simulated crash). Losses are
    read from the device only at the end. ``batches`` must start at step ``first_step + 1``'s
    batch: a pipeline prefetches from it, so it cannot be advanced here."""
    import torch

    losses = []
    for step in range(first_step + 1, steps + 1):
        with timer.step():
            loss, _logits, _labels = pipeline.progress(batches)
        losses.append(loss.detach())
        if after_step is not None:
            after_step(step, losses[-1])
    values = [float(x) for x in torch.stack(losses).float().cpu()] if losses else []
    return TrainResult(first_step=first_step, losses=values)


# ---------------------------------------------------------------- main


def _quiet_logs() -> None:
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # TorchRec also logs notices on the root logger
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torchrec_sparselift").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def checkpoint_config(args: argparse.Namespace, tables: Sequence[TableSpec], world_size: int) -> Dict[str, Any]:
    """What a checkpoint must match to be resumed by this run (``--steps`` may grow)."""
    keys = (
        "planner", "model", "arch", "batch_size", "lr", "dense_lr", "dense_optimizer", "seed",
        "zipf_alpha", "signal", "criteo_dir",
    )  # fmt: skip
    return dict(
        {k: getattr(args, k) for k in keys},
        world_size=world_size,
        tables=[[t.name, t.rows, t.dim, list(t.features), list(t.bag_sizes())] for t in tables],
    )


def run(args: argparse.Namespace, tables: List[TableSpec]) -> Dict[str, Any]:
    """Plan, shard and train per ``args``; returns the JSON result (the same on every rank)."""
    import torch
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.sharding_plan import get_default_sharders

    from dlrm_checkpoint import CheckpointError, claim_checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
    from dlrm_data import PrefetchedBatches, criteo_batches, synthetic_batches

    rank, world_size, local_world_size, device, backend = init_distributed(args.device)
    pg = dist.GroupMember.WORLD
    usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    link = None
    if args.planner == "sparselift" and args.hardware == "auto" and device.type == "cpu" and world_size > 1:
        from torchrec_sparselift.measure.link import LinkRatesError, measure_link_rates

        try:
            link = measure_link_rates()  # every rank, before pinning (as the calibration measures it)
        except LinkRatesError as e:  # raised on every rank alike
            print(f"[dlrm] warning: the link could not be measured ({e}); the stored profile is used as is")
    if device.type == "cpu" and not args.no_pin:
        from torchrec_sparselift.measure.probe import pin_rank_to_core

        pin_rank_to_core(pg)  # as the calibration's probes and the guard's trials run
    torch.manual_seed(args.seed)
    say = print if rank == 0 else (lambda *a, **k: None)
    model_kind = args.model if args.model != "auto" else ("dcn" if args.tables == "dcnv2" and not args.table_file else "dlrm")
    dim = check_uniform_dim(tables)
    arch = arch_spec(args.arch, dim)
    model = build_model(tables, model_kind, arch)
    say(
        f"[dlrm] {world_size} rank(s), {backend} on {device.type}; model {model_kind} ({args.arch}); "
        f"{len(tables)} tables, {sum(t.rows for t in tables):,} rows, dim {dim}; "
        f"batch {args.batch_size}/rank; planner {args.planner}"
    )
    try:  # one run per checkpoint directory: a second one stops here, before planning
        dir_lock = claim_checkpoint_dir(args.checkpoint_dir) if args.checkpoint_dir else None  # noqa: F841 - held
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    specs = load_constraints_file(args.constraints, tables) if args.constraints else []
    constraints = planner_constraints(tables, specs, one_hot=bool(args.criteo_dir))
    cache_dir = None if (args.no_plan_cache or args.planner != "sparselift") else args.plan_cache
    hardware, model_errors = hardware_choice(args.hardware, device.type, local_world_size, say, cores=usable_cores,
                                             link=link)
    workload = observed_workload(args, tables, world_size) if args.planner == "sparselift" else None
    if workload is not None:
        ratios = [fs.unique_ratio for fs in workload.values() if fs.unique_ratio is not None]
        spread = f"; distinct ids per batch {min(ratios):.2f}-{max(ratios):.2f} of ids" if ratios else ""
        say(f"[dlrm] workload: observed {OBSERVED_BATCHES} batches of {len(workload)} features{spread}; "
            "SparseLiftPlanner(workload=...) prices with them")
    planner = make_planner(
        args.planner, world_size, local_world_size, device.type, args.batch_size, constraints,
        hardware=hardware, cache_dir=cache_dir, allow_lossy_comm=args.allow_lossy_comm,
        allow_staleness=args.allow_staleness, workload=workload, model_errors=model_errors, **two_d_options(args),
    )  # fmt: skip
    sharders = get_default_sharders()
    opt_cls = torch.optim.Adagrad if args.dense_optimizer == "adagrad" else torch.optim.SGD
    t0 = time.perf_counter()
    reused: Optional[bool] = None
    two_d_record: Optional[Dict[str, Any]] = None  # 2D settings applied (None: 1D)
    if args.planner == "sparselift":
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
        from torchrec_sparselift.runtime import lift

        guard_result = None
        if args.measured_guard:
            import itertools

            from torchrec_sparselift.measure.guard import MeasuredGuard, guarded_execution_plan

            guard = MeasuredGuard(candidates=args.measured_guard, steps=args.guard_steps)
            # the trials train on pre-built batches of the run's own data (not timed: built here)
            if args.criteo_dir:
                trial_batches = list(itertools.islice(
                    criteo_batches(args.criteo_dir, tables, args.batch_size, rank, world_size, 8, 0), 8))
            else:
                trial_batches = list(itertools.islice(synthetic_batches(
                    tables, args.batch_size, args.seed + 7919, rank, 8, args.zipf_alpha, args.signal), 8))
            say(f"[dlrm] measured guard: SparseLift's best {guard.candidates} plan(s) and TorchRec's, "
                f"{guard.warmup}+{guard.steps} steps each, {guard.rounds} interleaved rounds")
            ep, guard_result, guard_reused = guarded_execution_plan(
                lambda: build_model(tables, model_kind, arch), pg, device, trial_batches,
                topology=planner._topology, batch_size=args.batch_size, constraints=constraints,
                hardware=hardware if not isinstance(hardware, str) else check_hardware(hardware),
                guard=guard, cache_dir=cache_dir, allow_lossy_comm=args.allow_lossy_comm, sharders=sharders,
                log=say, workload=workload, cores=usable_cores)
            say(f"[dlrm] measured guard ({'cached, not re-measured' if guard_reused else 'measured now'}):")
            say(guard_result.format())
            cache_dir, reused = None, guard_reused  # the guarded plan has its own cache entry
        else:
            ep = planner.collective_plan_execution(model, sharders, pg)
        planning_s = time.perf_counter() - t0
        if cache_dir:
            flag = [planner.last_cache_hit]  # known on rank 0, which planned
            dist.broadcast_object_list(flag, src=0, group=pg)
            reused = bool(flag[0])
        plan = ep.sharding_plan
        group = ep.optimizations.sharding_group_size
        merge = ({"replica_sync": "auto"} if args.replica_merge == "momentum_scaled" and group is not None
                 and group < world_size else {})  # the 2D plan's replicas merge by the momentum-scaled rule
        lifted = lift(
            model, ep, pg=pg, device=device, pipeline=args.pipeline,  # sharders rebuilt with the planned codecs
            embedding_optimizer=(RowWiseAdagrad, {"lr": args.lr}),
            dense_optimizer_factory=lambda params: opt_cls(params, lr=args.dense_lr), **merge,
        )  # fmt: skip
        dmp, pipeline, optimizer = lifted.model, lifted.pipeline, lifted.optimizer
        settings = lifted.settings
        prediction = execution_plan_prediction(ep, settings)
        if settings.is_2d:
            merged = "momentum_scaled" if getattr(dmp, "replica_sync", None) is not None else "average"
            two_d_record = dict(sharding_group_size=settings.sharding_group_size, strategy=settings.strategy_2d,
                                replica_merge=merged if settings.strategy_2d == "default" else None,
                                sync_interval=settings.sync_interval if settings.strategy_2d == "default" else None,
                                layout=settings.layout_2d.kind if settings.layout_2d is not None else None)
            say(f"[dlrm] 2D: groups of {settings.sharding_group_size} ranks x "
                f"{world_size // settings.sharding_group_size} replicas, strategy {settings.strategy_2d}"
                + (f", replica sync ({merged}) every {settings.sync_interval} steps" if settings.strategy_2d == "default"
                   else "")
                + (f", layout {settings.layout_2d.kind}" if settings.layout_2d is not None else ""))
        pipeline_kind, comm = settings.pipeline, f"{settings.fwd_comm_precision}/{settings.bwd_comm_precision}"
        predicted_s, timer_label = settings.predicted_step_s, settings.label()
        timer_period = lifted.sync_period  # a 2D step is timed over whole sync intervals
    else:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        plan = planner.collective_plan(model, sharders, pg)
        planning_s = time.perf_counter() - t0
        dmp, optimizer = shard_model(model, plan, device, args.lr, args.dense_optimizer, args.dense_lr)
        pipeline = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
        prediction, pipeline_kind, comm, predicted_s, timer_label = None, "sparse_dist", "fp32/fp32", None, "torchrec"
        timer_period = 1
    summary = plan_summary(plan)
    if reused:
        say(f"[dlrm] plan: reused cached execution plan from {args.plan_cache} (solver not run; {planning_s:.2f} s)")
    else:
        where = f"; stored in {cache_dir}" if cache_dir else ""
        say(f"[dlrm] plan: planned in {planning_s:.2f} s ({args.planner}{where})")
    say(format_plan_summary(summary, tables))
    if prediction is not None:
        note = "" if prediction["applies"] else f"; not what runs: --pipeline {args.pipeline} overrides it"
        say(
            f"[dlrm] SparseLift predicts {prediction['step_time_ms']:.2f} ms/step (lower bound "
            f"{prediction['lower_bound_ms']:.2f} ms) on {prediction['hardware']} with pipeline "
            f"{prediction['pipeline']}, comm {prediction['comm_precision']}{note}"
        )
    say(f"[dlrm] training with pipeline {pipeline_kind}, comm {comm}")

    # ---- resume
    config = checkpoint_config(args, tables, world_size)
    first_step, resumed_from = 0, None
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        try:
            info = latest_checkpoint(args.checkpoint_dir, config)
        except CheckpointError as e:
            raise UsageError(str(e)) from e
        if info is not None:
            if info.step >= args.steps:
                raise UsageError(
                    f"the checkpoint in {args.checkpoint_dir} is at step {info.step}, not before --steps "
                    f"{args.steps}: raise --steps to train further"
                )
            try:
                load_checkpoint(args.checkpoint_dir, info, dmp, optimizer)
            except CheckpointError as e:
                raise UsageError(str(e)) from None
            first_step = resumed_from = info.step
            say(f"[dlrm] resumed from the checkpoint after step {info.step} in {args.checkpoint_dir}")
    # The pipeline prefetches from this iterator, so it starts at the first step to run.
    # --attribute profiles more steps after training: the iterator holds their batches too
    last_batch = args.steps + (ATTRIBUTION_WARMUP + 2 * args.attribute + 2 if args.attribute else 0)
    if args.criteo_dir:
        batches = criteo_batches(args.criteo_dir, tables, args.batch_size, rank, world_size, last_batch, first_step)
    else:
        batches = synthetic_batches(
            tables, args.batch_size, args.seed, rank, last_batch, args.zipf_alpha, args.signal, start=first_step
        )
    # Batches are built outside the timed steps, as a DataLoader's workers would hand them over:
    # up to PREBUILT_BATCHES ahead, refilled in one go between two steps when nearly used up (a
    # 200-step run builds all of its batches before the first step; building one batch between
    # every two steps slowed the steps down by ~5%: docs/calibration.md).
    batches = PrefetchedBatches(batches, depth=PREBUILT_BATCHES, refill_below=3)
    to_run = args.steps - first_step
    warmup = min(args.warmup_steps, to_run - 1)

    from torchrec_sparselift.runtime.timing import StepTimer

    timer = StepTimer(device, warmup_steps=warmup, predicted_s=predicted_s, plan=timer_label, period=timer_period)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(
            total=args.steps, initial=first_step, desc="train", unit="step", file=sys.stdout, mininterval=1.0, ascii=True
        )
    saved: List[int] = []
    # Under ``torchrun --max-restarts`` the restarted workers get the same flags: only the first
    # attempt simulates the crash, so the restart resumes and finishes.
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    def after_step(step: int, loss) -> None:
        batches.top_up()
        if bar is not None:
            bar.update(1)
            if step % 5 == 0 or step == args.steps:
                bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
        if args.checkpoint_dir and step % args.checkpoint_every == 0:
            if hasattr(pipeline, "flush"):  # overlap_stale: apply the step's pending embedding update first
                pipeline.flush()
            save_checkpoint(args.checkpoint_dir, step, dmp, optimizer, config)
            saved.append(step)
        if step == args.fail_at_step and first_attempt:
            raise SimulatedFailure(f"--fail-at-step {step}: stopping as if the run had crashed after step {step}")

    try:
        result = train_loop(pipeline, batches, first_step, args.steps, timer, after_step)
    finally:
        if bar is not None:
            bar.close()
    if hasattr(pipeline, "flush"):  # overlap_stale: the last step's embedding update
        pipeline.flush()
    if args.checkpoint_dir and (not saved or saved[-1] != args.steps):
        save_checkpoint(args.checkpoint_dir, args.steps, dmp, optimizer, config)  # the final state
        saved.append(args.steps)

    losses = torch.tensor(result.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    losses /= world_size
    record = timer.record(pg=pg)  # slowest rank's median step
    per_step_s = timer.slowest_rank_durations_s(pg)  # warm-up included: how the run went over time
    elapsed = torch.tensor([sum(timer.steady_durations_s)], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    measured = to_run - warmup
    steps_per_s = measured / elapsed.item() if elapsed.item() > 0 else float("inf")
    loss_list = [float(x) for x in losses]
    k = max(1, len(loss_list) // 10)
    out = dict(
        planner=args.planner,
        world_size=world_size,
        backend=backend,
        device=device.type,
        model=model_kind,
        arch=attrs.asdict(arch),
        tables=[attrs.asdict(t) for t in tables],
        batch_size_per_rank=args.batch_size,
        global_batch_size=args.batch_size * world_size,
        hardware=hardware_name(hardware),
        plan_cache=cache_dir,
        plan_reused=reused,
        planning_time_s=planning_s,
        plan=summary,
        prediction=prediction,
        measured_guard=guard_result.to_dict() if args.planner == "sparselift" and guard_result is not None else None,
        pipeline=pipeline_kind,
        comm_precision=comm,
        two_d=two_d_record,
        predicted_step_time_ms=None if predicted_s is None else predicted_s * 1e3,
        measured_step_time_ms=record.measured_s * 1e3,
        measured_over_predicted=record.ratio,
        step_record=record.to_dict(),
        step_times_ms=[round(x * 1e3, 3) for x in per_step_s],
        first_step=first_step + 1,
        resumed_from_step=resumed_from,
        checkpoints_saved=saved,
        losses=loss_list,
        loss_first=sum(loss_list[:k]) / k,
        loss_last=sum(loss_list[-k:]) / k,
        steps=args.steps,
        warmup_steps=warmup,
        steps_per_s=steps_per_s,
        step_time_ms=1000.0 / steps_per_s,
        samples_per_s=steps_per_s * args.batch_size * world_size,
        versions=dict(torch=torch.__version__, torchrec=getattr(torchrec, "__version__", "unknown")),
        args=vars(args),
    )
    span = f"steps {first_step + 1}-{args.steps}" if first_step else f"{len(loss_list)} steps"
    say(
        f"[dlrm] loss {out['loss_first']:.4f} -> {out['loss_last']:.4f} (mean of first/last {k} of {span}); "
        f"steady state {steps_per_s:.2f} steps/s, {out['step_time_ms']:.1f} ms/step, "
        f"{out['samples_per_s']:.0f} samples/s ({measured} steps after {warmup} warm-up)"
    )
    if predicted_s is not None:
        say(
            f"[dlrm] step time: measured {record.measured_s * 1e3:.2f} ms (median, slowest rank) vs predicted "
            f"{predicted_s * 1e3:.2f} ms: measured/predicted {record.ratio:.2f}"
        )
    else:
        say(f"[dlrm] step time: measured {record.measured_s * 1e3:.2f} ms (median, slowest rank); no prediction applies")
    if saved:
        say(f"[dlrm] checkpoints after step(s) {saved} in {args.checkpoint_dir}")
    if args.attribute:
        fwd_p, bwd_p = comm.split("/")
        att, predicted, att_text = attribute_run(
            pipeline, batches, args.attribute, pg, device, plan, lambda: build_model(tables, model_kind, arch),
            world_size, local_world_size, args.batch_size, constraints,
            hardware if not isinstance(hardware, str) else check_hardware(hardware),
            pipeline_kind, fwd_p, bwd_p, timer_label,
        )  # fmt: skip
        out["attribution"] = att.to_dict()
        out["attribution_predicted_ms"] = {k: v * 1e3 for k, v in predicted.items()}
        say(att_text)
        att_path = args.attribution_out or (os.path.splitext(args.out)[0] + ".attribution.json" if args.out else None)
        if rank == 0 and att_path:
            from torchrec_sparselift.calibration.attribution import save_attribution

            os.makedirs(os.path.dirname(os.path.abspath(att_path)), exist_ok=True)
            save_attribution(att_path, att)
            say(f"[dlrm] wrote the attribution to {att_path} (sparselift explain PLAN --attribution {att_path})")
    if not all(math.isfinite(x) for x in loss_list):
        raise RuntimeError("training diverged: a loss is not finite (lower --lr)")
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.out)
        say(f"[dlrm] wrote {args.out}")
    dist.barrier()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: returns the process exit code (0 ok, 2 usage error, 1 failure)."""
    rank = int(os.environ.get("RANK", "0"))
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    if not debug:
        _quiet_logs()
    try:
        args = parse_args(argv)
        tables = resolve_tables(args)
        if args.constraints:
            load_constraints_file(args.constraints, tables)  # a bad file fails here, before torch
        if args.planner == "sparselift" and args.hardware != "auto":
            check_hardware(args.hardware)
        if args.check:
            if args.planner == "sparselift":
                check_planning_input(args, tables)
            return 0
        run(args, tables)
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
        checkpoint = sys.modules.get("dlrm_checkpoint")  # loaded whenever DCP ran; never import torch here
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
