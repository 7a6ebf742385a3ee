"""One DLRM training run over :class:`~torchrec_sparselift.dlrm.options.TrainOptions`: join the
process group, plan (SparseLift's execution plan applied with ``runtime.lift``, or TorchRec's plan
with ``TrainPipelineSparseDist``), resume from a checkpoint, train the timed steps, and report
the measured step time against the prediction.

:func:`run` is what ``examples/dlrm/train.py`` calls; each step of it is a function of its own
(:func:`init_distributed`, :func:`prepare`, :func:`plan_and_shard`, :func:`resume`,
:func:`run_batches`, :func:`train`, :func:`result_record`, :func:`attribute`,
:func:`write_result`).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import signal
import socket
import sys
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import attrs
import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from tqdm import tqdm

from torchrec_sparselift import evaluate_sharding_plan, lift, observe
from torchrec_sparselift.atomic import write_json
from torchrec_sparselift.calibration.attribution import compare, format_comparison, predicted_for_plan, save_attribution
from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.dlrm.checkpoint import (
    CheckpointError,
    claim_checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from torchrec_sparselift.dlrm.data import PrefetchedBatches, criteo_batches, synthetic_batches
from torchrec_sparselift.dlrm.model import (
    ArchSpec,
    arch_spec,
    build_model,
    check_hardware,
    dense_optimizer_class,
    embedding_bags,
    execution_plan_prediction,
    format_plan_summary,
    hardware_choice,
    hardware_name,
    make_planner,
    plan_summary,
    planner_constraints,
    shard_model,
    topology_for,
)
from torchrec_sparselift.dlrm.options import TrainOptions, UsageError, model_kind, rewrite_overrides
from torchrec_sparselift.dlrm.tables import TableSpec, check_uniform_dim, load_constraints_file
from torchrec_sparselift.measure.attribution import attribute_steps
from torchrec_sparselift.measure.guard import MeasuredGuard, guarded_execution_plan
from torchrec_sparselift.measure.link import LinkRatesError, measure_link_rates
from torchrec_sparselift.measure.probe import pin_rank_to_core
from torchrec_sparselift.runtime.batch_split import NotPerSample, per_sample_violation
from torchrec_sparselift.runtime.liveness import (
    CollectiveFailure,
    StepHeartbeat,
    collective_failure,
    is_collective_failure,
)
from torchrec_sparselift.runtime.timing import StepTimer

__all__ = [
    "SimulatedFailure",
    "Cluster",
    "Setup",
    "Sharded",
    "TrainResult",
    "PREBUILT_BATCHES",
    "OBSERVED_BATCHES",
    "ATTRIBUTION_WARMUP",
    "check_planning_input",
    "init_distributed",
    "observed_workload",
    "checkpoint_config",
    "prepare",
    "plan_and_shard",
    "resume",
    "run_batches",
    "train_loop",
    "train",
    "lost_ranks_named",
    "result_record",
    "attribute_run",
    "attribute",
    "write_result",
    "run",
]

#: Batches the run builds ahead of the timed steps (then refills in one go between two steps).
PREBUILT_BATCHES = 256
#: Batches ``observed_workload`` reads to measure the ids' statistics (before training, not timed).
OBSERVED_BATCHES = 8
#: Steps ``--attribute`` runs before it times and profiles (pipeline refill after the training loop).
ATTRIBUTION_WARMUP = 2


class SimulatedFailure(RuntimeError):
    """``--fail-at-step`` was reached: the run stops as if it had crashed."""


def fail_now(how: str, step: int) -> None:
    """``--fail-at-step`` with ``--fail-how``: raise :class:`SimulatedFailure`, or kill this process
    (SIGKILL: the kernel closes its connections), or stop it (SIGSTOP: its connections stay open and
    silent, as when its host or link is gone; whoever runs the test kills it afterwards)."""
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
    raise SimulatedFailure(f"--fail-at-step {step}: stopping as if the run had crashed after step {step}")


def check_planning_input(options: TrainOptions, tables: Sequence[TableSpec]) -> None:
    """``--check`` with ``--planner sparselift``: the validation planning runs (tables,
    constraints, batch size, topology; every problem at once), on the tables' shapes alone (a
    meta-device model, no process group). Raises UsageError with what planning would say."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
    if (options.batch_split or 1) > 1:  # the batch split's refusal, as the run's pipeline makes it
        model = build_model(tables, model_kind(options), arch_spec(options.arch, check_uniform_dim(tables)))
        why = per_sample_violation(model, options.per_sample)
        if why is not None:
            raise _per_sample_refusal(NotPerSample(why), options)
    specs = load_constraints_file(options.constraints, tables) if options.constraints else []
    ebc = embedding_bags(tables)
    try:
        planner = make_planner(
            "sparselift", world_size, ranks_per_host(world_size=world_size), "cuda" if use_cuda else "cpu",
            options.batch_size, planner_constraints(tables, specs, one_hot=bool(options.criteo_dir)),
            allow_lossy_comm=options.allow_lossy_comm, allow_staleness=options.allow_staleness,
            per_sample=options.per_sample, **options.two_d_options())
        planner.request(ebc, get_default_sharders())
    except ValueError as e:
        raise UsageError(f"planning would refuse this input: {e}") from None
    except Exception as e:  # noqa: BLE001 - a PlannerError (e.g. the tables exceed the cluster)
        if type(e).__name__ not in ("SparseLiftPlannerError", "PlannerError"):
            raise
        raise UsageError(f"planning would refuse this input: {e}") from None


# ---------------------------------------------------------------- distributed setup (side effects)


@attrs.frozen
class Cluster:
    """The process group this run joined: this rank, the ranks, the device and backend."""

    rank: int
    world_size: int
    local_world_size: int
    device: Any
    backend: str

    @property
    def pg(self) -> Any:
        return dist.GroupMember.WORLD

    def say(self, *a: Any, **k: Any) -> None:
        """``print`` (flushed) on rank 0, nothing elsewhere."""
        if self.rank == 0:
            print(*a, flush=True, **k)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_flag: str, timeout_s: float = 120.0) -> Cluster:
    """Join (or, outside torchrun, create a 1-rank) process group whose collectives wait at most
    ``timeout_s`` for a lost rank or link (``--collective-timeout``)."""
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
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
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
        dist.init_process_group(backend=backend, store=prefixed, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return Cluster(rank=rank, world_size=world_size, local_world_size=local_world_size, device=device,
                   backend=backend)


def measured_link(options: TrainOptions, cluster: Cluster) -> Any:
    """The ``LinkRates`` of this job (every rank, before pinning, as the calibration measures it)
    where ``--hardware auto`` plans on a stored CPU profile over more than one rank; else None."""
    if not (options.planner == "sparselift" and options.hardware == "auto" and cluster.device.type == "cpu"
            and cluster.world_size > 1):
        return None
    try:
        return measure_link_rates()
    except LinkRatesError as e:  # raised on every rank alike
        print(f"[dlrm] warning: the link could not be measured ({e}); the stored profile is used as is")
        return None


def observed_workload(options: TrainOptions, tables: Sequence[Any], world_size: int) -> Any:
    """``observe()`` of rank 0's first ``OBSERVED_BATCHES`` batches (the same statistics on every
    rank): pooling factors and how often ids repeat, which price the embedding backward."""
    if options.criteo_dir:
        src = criteo_batches(options.criteo_dir, tables, options.batch_size, 0, world_size, OBSERVED_BATCHES, 0)
    else:
        src = synthetic_batches(tables, options.batch_size, options.seed, 0, OBSERVED_BATCHES, options.zipf_alpha,
                                options.signal)
    return observe(itertools.islice(src, OBSERVED_BATCHES), max_batches=OBSERVED_BATCHES)


def checkpoint_config(options: TrainOptions, tables: Sequence[TableSpec], world_size: int) -> Dict[str, Any]:
    """What a checkpoint must match to be resumed by this run (``--steps`` may grow)."""
    keys = (
        "planner", "model", "arch", "batch_size", "lr", "dense_lr", "dense_optimizer", "seed",
        "zipf_alpha", "signal", "criteo_dir",
    )  # fmt: skip
    return dict(
        {k: getattr(options, k) for k in keys},
        world_size=world_size,
        tables=[[t.name, t.rows, t.dim, list(t.features), list(t.bag_sizes())] for t in tables],
    )


# ---------------------------------------------------------------- model, plan, sharding


@attrs.frozen
class Setup:
    """What planning takes: the tables and model, the constraints, the hardware and the workload."""

    tables: List[TableSpec]
    model_kind: str
    arch: ArchSpec
    model: Any
    constraints: Dict[str, Any]
    hardware: Any
    model_errors: Any
    workload: Any
    planner: Any
    cores: Optional[int]
    dir_lock: Any  # held for the whole run: one run per checkpoint directory

    def fresh_model(self) -> Any:
        """A new meta-device model like ``model`` (the guard's trials, the attribution's re-pricing)."""
        return build_model(self.tables, self.model_kind, self.arch)

    def hardware_profile(self) -> Any:
        """``hardware`` as a HardwareProfile (a preset or profile name is loaded)."""
        return self.hardware if not isinstance(self.hardware, str) else check_hardware(self.hardware)


def prepare(options: TrainOptions, tables: List[TableSpec], cluster: Cluster) -> Setup:
    """Measure the link, pin the ranks, seed, build the model and the planner (rank 0 says what)."""
    say = cluster.say
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    link = measured_link(options, cluster)
    if cluster.device.type == "cpu" and not options.no_pin:
        pin_rank_to_core(cluster.pg)  # as the calibration's probes and the guard's trials run
    torch.manual_seed(options.seed)
    kind = model_kind(options)
    dim = check_uniform_dim(tables)
    arch = arch_spec(options.arch, dim)
    model = build_model(tables, kind, arch)
    say(
        f"[dlrm] {cluster.world_size} rank(s), {cluster.backend} on {cluster.device.type}; model {kind} "
        f"({options.arch}); {len(tables)} tables, {sum(t.rows for t in tables):,} rows, dim {dim}; "
        f"batch {options.batch_size}/rank; planner {options.planner}"
    )
    try:  # one run per checkpoint directory: a second one stops here, before planning
        dir_lock = claim_checkpoint_dir(options.checkpoint_dir) if options.checkpoint_dir else None
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    specs = load_constraints_file(options.constraints, tables) if options.constraints else []
    constraints = planner_constraints(tables, specs, one_hot=bool(options.criteo_dir))
    hardware, model_errors = hardware_choice(options.hardware, cluster.device.type, cluster.local_world_size, say,
                                             cores=cores, link=link)
    workload = observed_workload(options, tables, cluster.world_size) if options.planner == "sparselift" else None
    if workload is not None:
        ratios = [fs.unique_ratio for fs in workload.values() if fs.unique_ratio is not None]
        spread = f"; distinct ids per batch {min(ratios):.2f}-{max(ratios):.2f} of ids" if ratios else ""
        say(f"[dlrm] workload: observed {OBSERVED_BATCHES} batches of {len(workload)} features{spread}; "
            "SparseLiftPlanner(workload=...) prices with them")
    planner = make_planner(
        options.planner, cluster.world_size, cluster.local_world_size, cluster.device.type, options.batch_size,
        constraints, hardware=hardware, cache_dir=options.cache_dir, allow_lossy_comm=options.allow_lossy_comm,
        allow_staleness=options.allow_staleness, workload=workload, model_errors=model_errors,
        per_sample=options.per_sample, **options.two_d_options(),
    )  # fmt: skip
    return Setup(tables=list(tables), model_kind=kind, arch=arch, model=model, constraints=constraints,
                 hardware=hardware, model_errors=model_errors, workload=workload, planner=planner, cores=cores,
                 dir_lock=dir_lock)


@attrs.frozen
class Sharded:
    """What trains: the plan, the sharded model, its pipeline and optimizer, and what it predicts."""

    plan: Any
    dmp: Any
    pipeline: Any
    optimizer: Any
    planning_s: float
    reused: Optional[bool]
    prediction: Optional[Dict[str, Any]]
    pipeline_kind: str
    comm: str
    predicted_s: Optional[float]
    timer_label: str
    timer_period: int
    two_d_record: Optional[Dict[str, Any]]  # the 2D settings applied (None: 1D)
    guard_result: Any
    plan_cache: Optional[str]  # where the plan was stored or reused from (None: the guard's own entry, or none)
    #: the sparse-path rewrites in effect (:func:`rewrites_record`; empty for --planner torchrec)
    rewrites: Dict[str, Any] = attrs.field(factory=dict)


def rewrites_record(settings: Any, options: TrainOptions) -> Dict[str, Any]:
    """The sparse-path rewrites the run applies (the plan's, or the flags' where given), as the
    result records them."""
    return dict(batch_split=settings.batch_split, id_dtype=settings.id_dtype,
                dedup_features=list(settings.dedup_features),
                per_sample=options.per_sample or settings.per_sample,  # --per-sample or the plan's
                forced=sorted(k for k, v in (("batch_split", options.batch_split), ("id_dtype", options.id_dtype),
                                             ("dedup_features", options.dedup)) if v is not None))


def describe_rewrites(rewrites: Dict[str, Any]) -> str:
    """The rewrites in one phrase for the log: ``batch split 4, ids int32, dedup 26 features``."""
    if not rewrites:
        return "none"
    dedup = rewrites["dedup_features"]
    parts = [f"batch split {rewrites['batch_split']}" if rewrites["batch_split"] > 1 else "no batch split",
             f"ids {rewrites['id_dtype']}",
             "no dedup" if not dedup else (f"dedup {','.join(dedup)}" if len(dedup) <= 4
                                          else f"dedup {len(dedup)} features")]
    forced = rewrites["forced"]
    if not forced:
        return ", ".join(parts) + " (the plan's)"
    rest = "" if len(forced) == 3 else "; the rest the plan's"  # batch_split, id_dtype, dedup_features
    return ", ".join(parts) + f" (forced: {', '.join(forced)}{rest})"


def _per_sample_refusal(e: NotPerSample, options: TrainOptions) -> UsageError:
    """The batch split's per-sample refusal in the example's flags."""
    why = str(e).replace("(per_sample=True)", "(--per-sample)").replace("keep batch_split=1", "use --batch-split 1")
    origin = "" if options.batch_split is not None else " (the execution plan chose the batch split)"
    return UsageError(f"{why}{origin}")


def _guard_trial_batches(options: TrainOptions, tables: Sequence[TableSpec], cluster: Cluster) -> List[Any]:
    """The measured guard's trials train on pre-built batches of the run's own data (built here, not timed)."""
    if options.criteo_dir:
        return list(itertools.islice(criteo_batches(
            options.criteo_dir, tables, options.batch_size, cluster.rank, cluster.world_size, 8, 0), 8))
    return list(itertools.islice(synthetic_batches(
        tables, options.batch_size, options.seed + 7919, cluster.rank, 8, options.zipf_alpha, options.signal), 8))


def _guarded_plan(options: TrainOptions, setup: Setup, cluster: Cluster, sharders: Any) -> Tuple[Any, Any, bool]:
    """``--measured-guard N``: the fastest of SparseLift's best N plans and TorchRec's, measured."""
    say = cluster.say
    guard = MeasuredGuard(candidates=options.measured_guard, steps=options.guard_steps)
    trial_batches = _guard_trial_batches(options, setup.tables, cluster)
    say(f"[dlrm] measured guard: SparseLift's best {guard.candidates} plan(s) and TorchRec's, "
        f"{guard.warmup}+{guard.steps} steps each, {guard.rounds} interleaved rounds")
    ep, guard_result, guard_reused = guarded_execution_plan(
        setup.fresh_model, cluster.pg, cluster.device, trial_batches,
        topology=topology_for(cluster.world_size, cluster.local_world_size, cluster.device.type),
        batch_size=options.batch_size, constraints=setup.constraints,
        hardware=setup.hardware_profile(), guard=guard, cache_dir=options.cache_dir,
        allow_lossy_comm=options.allow_lossy_comm, sharders=sharders, log=say, workload=setup.workload,
        cores=setup.cores)
    say(f"[dlrm] measured guard ({'cached, not re-measured' if guard_reused else 'measured now'}):")
    say(guard_result.format())
    return ep, guard_result, guard_reused


def _two_d_record(options: TrainOptions, dmp: Any, settings: Any, cluster: Cluster) -> Dict[str, Any]:
    """The 2D settings applied, as the result records them; rank 0 says them."""
    merged = "momentum_scaled" if getattr(dmp, "replica_sync", None) is not None else "average"
    periodic = settings.strategy_2d == "default"
    cluster.say(f"[dlrm] 2D: groups of {settings.sharding_group_size} ranks x "
                f"{cluster.world_size // settings.sharding_group_size} replicas, strategy {settings.strategy_2d}"
                + (f", replica sync ({merged}) every {settings.sync_interval} steps" if periodic else "")
                + (f", layout {settings.layout_2d.kind}" if settings.layout_2d is not None else ""))
    return dict(sharding_group_size=settings.sharding_group_size, strategy=settings.strategy_2d,
                replica_merge=merged if periodic else None,
                sync_interval=settings.sync_interval if periodic else None,
                layout=settings.layout_2d.kind if settings.layout_2d is not None else None)


def _sparselift_sharded(options: TrainOptions, setup: Setup, cluster: Cluster) -> Sharded:
    """SparseLift's execution plan (guarded, cached or planned now) applied with ``runtime.lift``."""
    sharders = get_default_sharders()
    pg = cluster.pg
    t0 = time.perf_counter()
    reused: Optional[bool] = None
    guard_result = None
    cache_dir = options.cache_dir
    if options.measured_guard:
        ep, guard_result, reused = _guarded_plan(options, setup, cluster, sharders)
        cache_dir = None  # the guarded plan has its own cache entry
    else:
        ep = setup.planner.collective_plan_execution(setup.model, sharders, pg)
    planning_s = time.perf_counter() - t0
    if cache_dir:
        flag = [setup.planner.last_cache_hit]  # known on rank 0, which planned
        dist.broadcast_object_list(flag, src=0, group=pg)
        reused = bool(flag[0])
    group = ep.optimizations.sharding_group_size
    merge = ({"replica_sync": "auto"} if options.replica_merge == "momentum_scaled" and group is not None
             and group < cluster.world_size else {})  # the 2D plan's replicas merge by the momentum-scaled rule
    opt_cls = dense_optimizer_class(options.dense_optimizer)
    try:
        lifted = lift(
            setup.model, ep, pg=pg, device=cluster.device, pipeline=options.pipeline,  # sharders rebuilt with the planned codecs
            embedding_optimizer=(RowWiseAdagrad, {"lr": options.lr}),
            dense_optimizer_factory=lambda params: opt_cls(params, lr=options.dense_lr),
            pipeline_options={"per_sample": True} if options.per_sample else None,  # dropped without a split
            **rewrite_overrides(options, setup.tables), **merge,
        )  # fmt: skip
    except NotPerSample as e:
        raise _per_sample_refusal(e, options) from None
    settings = lifted.settings
    two_d = _two_d_record(options, lifted.model, settings, cluster) if settings.is_2d else None
    return Sharded(
        plan=ep.sharding_plan, dmp=lifted.model, pipeline=lifted.pipeline, optimizer=lifted.optimizer,
        planning_s=planning_s, reused=reused,
        prediction=execution_plan_prediction(ep, settings), pipeline_kind=settings.pipeline,
        comm=f"{settings.fwd_comm_precision}/{settings.bwd_comm_precision}", predicted_s=settings.predicted_step_s,
        timer_label=settings.label(), timer_period=lifted.sync_period,  # a 2D step is timed over whole sync intervals
        two_d_record=two_d, guard_result=guard_result, plan_cache=cache_dir,
        rewrites=rewrites_record(settings, options))


def _torchrec_sharded(options: TrainOptions, setup: Setup, cluster: Cluster) -> Sharded:
    """TorchRec's plan, DistributedModelParallel and TrainPipelineSparseDist."""
    t0 = time.perf_counter()
    plan = setup.planner.collective_plan(setup.model, get_default_sharders(), cluster.pg)
    planning_s = time.perf_counter() - t0
    dmp, optimizer = shard_model(setup.model, plan, cluster.device, options.lr, options.dense_optimizer,
                                 options.dense_lr)
    pipeline = TrainPipelineSparseDist(dmp, optimizer, cluster.device, execute_all_batches=True)
    return Sharded(plan=plan, dmp=dmp, pipeline=pipeline, optimizer=optimizer, planning_s=planning_s, reused=None,
                   prediction=None, pipeline_kind="sparse_dist", comm="fp32/fp32", predicted_s=None,
                   timer_label="torchrec", timer_period=1, two_d_record=None, guard_result=None,
                   plan_cache=None)


def plan_and_shard(options: TrainOptions, setup: Setup, cluster: Cluster) -> Sharded:
    """Plan with the chosen planner and shard the model under the plan; rank 0 prints the plan."""
    sharded = (_sparselift_sharded if options.planner == "sparselift" else _torchrec_sharded)(options, setup, cluster)
    say = cluster.say
    if sharded.reused:
        say(f"[dlrm] plan: reused cached execution plan from {options.plan_cache} (solver not run; "
            f"{sharded.planning_s:.2f} s)")
    else:
        where = f"; stored in {sharded.plan_cache}" if sharded.plan_cache else ""
        say(f"[dlrm] plan: planned in {sharded.planning_s:.2f} s ({options.planner}{where})")
    say(format_plan_summary(plan_summary(sharded.plan), setup.tables))
    prediction = sharded.prediction
    if prediction is not None:
        overrides = ([f"--pipeline {options.pipeline}"] if options.pipeline else []) + [
            f"--{k.replace('_features', '').replace('_', '-')}" for k in sharded.rewrites.get("forced", ())]
        note = "" if prediction["applies"] else f"; not what runs: {' '.join(overrides)} override(s) it"
        say(
            f"[dlrm] SparseLift predicts {prediction['step_time_ms']:.2f} ms/step (lower bound "
            f"{prediction['lower_bound_ms']:.2f} ms) on {prediction['hardware']} with pipeline "
            f"{prediction['pipeline']}, comm {prediction['comm_precision']}{note}"
        )
    rewrites = f", rewrites: {describe_rewrites(sharded.rewrites)}" if sharded.rewrites else ""
    say(f"[dlrm] training with pipeline {sharded.pipeline_kind}, comm {sharded.comm}{rewrites}")
    return sharded


# ---------------------------------------------------------------- resume, data, the training loop


def resume(options: TrainOptions, config: Dict[str, Any], sharded: Sharded, cluster: Cluster) -> Optional[int]:
    """Load the latest checkpoint of ``--checkpoint-dir`` that matches ``config`` into the sharded
    model and optimizer; returns the step it was taken after (None: nothing to resume)."""
    if not options.checkpoint_dir:
        return None
    os.makedirs(options.checkpoint_dir, exist_ok=True)
    try:
        info = latest_checkpoint(options.checkpoint_dir, config)
    except CheckpointError as e:
        raise UsageError(str(e)) from e
    if info is None:
        return None
    if info.step >= options.steps:
        raise UsageError(
            f"the checkpoint in {options.checkpoint_dir} is at step {info.step}, not before --steps "
            f"{options.steps}: raise --steps to train further"
        )
    try:
        load_checkpoint(options.checkpoint_dir, info, sharded.dmp, sharded.optimizer)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    cluster.say(f"[dlrm] resumed from the checkpoint after step {info.step} in {options.checkpoint_dir}")
    return info.step


def run_batches(options: TrainOptions, tables: Sequence[TableSpec], cluster: Cluster,
                first_step: int) -> PrefetchedBatches:
    """This rank's batches from step ``first_step + 1`` on (the pipeline prefetches from the
    iterator, so it starts at the first step to run; ``--attribute``'s extra steps included).

    Batches are built outside the timed steps, as a DataLoader's workers would hand them over: up
    to PREBUILT_BATCHES ahead, refilled in one go between two steps when nearly used up (a 200-step
    run builds all of its batches before the first step; building one batch between every two
    steps slowed the steps down by ~5%: docs/calibration.md)."""
    last_batch = options.steps + (ATTRIBUTION_WARMUP + 2 * options.attribute + 2 if options.attribute else 0)
    if options.criteo_dir:
        batches = criteo_batches(options.criteo_dir, tables, options.batch_size, cluster.rank, cluster.world_size,
                                 last_batch, first_step)
    else:
        batches = synthetic_batches(tables, options.batch_size, options.seed, cluster.rank, last_batch,
                                    options.zipf_alpha, options.signal, start=first_step)
    return PrefetchedBatches(batches, depth=PREBUILT_BATCHES, refill_below=3)


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
    losses = []
    for step in range(first_step + 1, steps + 1):
        with timer.step():
            loss, _logits, _labels = pipeline.progress(batches)
        losses.append(loss.detach())
        if after_step is not None:
            after_step(step, losses[-1])
    values = [float(x) for x in torch.stack(losses).float().cpu()] if losses else []
    return TrainResult(first_step=first_step, losses=values)


def _flush(pipeline: Any) -> None:
    """overlap_stale: apply the pending embedding update (before a checkpoint, after the last step)."""
    if hasattr(pipeline, "flush"):
        pipeline.flush()


def train(options: TrainOptions, sharded: Sharded, batches: PrefetchedBatches, first_step: int,
          config: Dict[str, Any], cluster: Cluster,
          heartbeat: Optional[StepHeartbeat] = None) -> Tuple[TrainResult, StepTimer, List[int]]:
    """The timed steps after ``first_step``, with the progress bar, the checkpoints and
    ``--fail-at-step``; returns the losses, the step timer and the steps checkpointed.
    ``heartbeat``: where each finished step is recorded (default: the default group's)."""
    to_run = options.steps - first_step
    warmup = min(options.warmup_steps, to_run - 1)
    timer = StepTimer(cluster.device, warmup_steps=warmup, predicted_s=sharded.predicted_s, plan=sharded.timer_label,
                      period=sharded.timer_period)
    bar = None
    if cluster.rank == 0 and not options.no_progress:
        bar = tqdm(total=options.steps, initial=first_step, desc="train", unit="step", file=sys.stdout,
                   mininterval=1.0, ascii=True)
    saved: List[int] = []
    # Under ``torchrun --max-restarts`` the restarted workers get the same flags: only the first
    # attempt simulates the crash, so the restart resumes and finishes.
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    def after_step(step: int, loss) -> None:
        batches.top_up()
        if bar is not None:
            bar.update(1)
            if step % 5 == 0 or step == options.steps:
                bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
        if options.checkpoint_dir and step % options.checkpoint_every == 0:
            _flush(sharded.pipeline)  # apply the step's pending embedding update first
            save_checkpoint(options.checkpoint_dir, step, sharded.dmp, sharded.optimizer, config)
            saved.append(step)
        heartbeat.beat(step)
        if step == options.fail_at_step and first_attempt and options.fail_rank in (None, cluster.rank):
            fail_now(options.fail_how, step)

    heartbeat = heartbeat or StepHeartbeat.of_default_group()
    try:
        result = train_loop(sharded.pipeline, batches, first_step, options.steps, timer, after_step)
    except Exception as e:
        lost = collective_failure(e, heartbeat, options.collective_timeout)
        if lost is None:
            raise
        raise CollectiveFailure(lost) from e
    finally:
        if bar is not None:
            bar.close()
    _flush(sharded.pipeline)  # the last step's embedding update
    if options.checkpoint_dir and (not saved or saved[-1] != options.steps):
        save_checkpoint(options.checkpoint_dir, options.steps, sharded.dmp, sharded.optimizer, config)  # the final state
        saved.append(options.steps)
    return result, timer, saved


# ---------------------------------------------------------------- the result


def result_record(options: TrainOptions, setup: Setup, sharded: Sharded, cluster: Cluster, result: TrainResult,
                  timer: StepTimer, saved: List[int], resumed_from: Optional[int]) -> Dict[str, Any]:
    """The run's JSON result (the same on every rank: collective), and rank 0's summary lines."""
    say, pg, world_size = cluster.say, cluster.pg, cluster.world_size
    first_step = result.first_step
    losses = torch.tensor(result.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    losses /= world_size
    record = timer.record(pg=pg)  # slowest rank's median step
    per_step_s = timer.slowest_rank_durations_s(pg)  # warm-up included: how the run went over time
    elapsed = torch.tensor([sum(timer.steady_durations_s)], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    warmup = timer.warmup_steps
    measured = options.steps - first_step - warmup
    steps_per_s = measured / elapsed.item() if elapsed.item() > 0 else float("inf")
    loss_list = [float(x) for x in losses]
    k = max(1, len(loss_list) // 10)
    predicted_s = sharded.predicted_s
    out = dict(
        planner=options.planner,
        world_size=world_size,
        backend=cluster.backend,
        device=cluster.device.type,
        model=setup.model_kind,
        arch=attrs.asdict(setup.arch),
        tables=[attrs.asdict(t) for t in setup.tables],
        batch_size_per_rank=options.batch_size,
        global_batch_size=options.batch_size * world_size,
        hardware=hardware_name(setup.hardware),
        plan_cache=sharded.plan_cache,
        plan_reused=sharded.reused,
        planning_time_s=sharded.planning_s,
        plan=plan_summary(sharded.plan),
        prediction=sharded.prediction,
        measured_guard=sharded.guard_result.to_dict() if sharded.guard_result is not None else None,
        pipeline=sharded.pipeline_kind,
        comm_precision=sharded.comm,
        rewrites=sharded.rewrites or None,
        two_d=sharded.two_d_record,
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
        steps=options.steps,
        warmup_steps=warmup,
        steps_per_s=steps_per_s,
        step_time_ms=1000.0 / steps_per_s,
        samples_per_s=steps_per_s * options.batch_size * world_size,
        versions=dict(torch=torch.__version__, torchrec=getattr(torchrec, "__version__", "unknown")),
        args=attrs.asdict(options),
    )
    span = f"steps {first_step + 1}-{options.steps}" if first_step else f"{len(loss_list)} steps"
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
        say(f"[dlrm] checkpoints after step(s) {saved} in {options.checkpoint_dir}")
    return out


def attribute_run(
    pipeline, batches, steps: int, pg, device, plan, model_factory: Callable, world_size: int,
    local_world_size: int, batch_size: int, constraints, hardware, pipeline_kind: str, fwd: str, bwd: str,
    label: str,
):
    """Profile ``steps`` more steps of ``pipeline`` (after ATTRIBUTION_WARMUP, and as many timed without
    the profiler) and set each sparse-path node kind's measured ms (slowest rank) next to what the
    cost model predicts for ``plan`` (re-priced on a fresh meta model). Returns (StepAttribution,
    predicted seconds per kind, the printed table)."""
    att = attribute_steps(pipeline, batches, steps=steps, warmup_steps=ATTRIBUTION_WARMUP, pg=pg, label=label,
                          pipeline=pipeline_kind, device=device)
    topology = topology_for(world_size, local_world_size, device.type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        evaluated = evaluate_sharding_plan(model_factory(), plan, topology, batch_size, constraints, hardware=hardware,
                                           pipeline=pipeline_kind, fwd_precision=fwd, bwd_precision=bwd)
    predicted = predicted_for_plan(evaluated)
    text = ("[dlrm] where the step time goes, measured (torch.profiler, exclusive time per sparse-path node "
            "kind) vs predicted:\n" + format_comparison(compare(att, predicted), att))
    return att, predicted, text


def attribute(options: TrainOptions, setup: Setup, sharded: Sharded, batches: Any, cluster: Cluster,
              out: Dict[str, Any]) -> None:
    """``--attribute N``: profile N more steps, add the attribution to ``out``, and (rank 0) write
    it where ``--attribution-out`` (or ``--out``) says."""
    fwd_p, bwd_p = sharded.comm.split("/")
    att, predicted, att_text = attribute_run(
        sharded.pipeline, batches, options.attribute, cluster.pg, cluster.device, sharded.plan, setup.fresh_model,
        cluster.world_size, cluster.local_world_size, options.batch_size, setup.constraints,
        setup.hardware_profile(), sharded.pipeline_kind, fwd_p, bwd_p, sharded.timer_label,
    )  # fmt: skip
    out["attribution"] = att.to_dict()
    out["attribution_predicted_ms"] = {k: v * 1e3 for k, v in predicted.items()}
    cluster.say(att_text)
    att_path = options.attribution_out or (os.path.splitext(options.out)[0] + ".attribution.json" if options.out
                                           else None)
    if cluster.rank == 0 and att_path:
        os.makedirs(os.path.dirname(os.path.abspath(att_path)), exist_ok=True)
        save_attribution(att_path, att)
        cluster.say(f"[dlrm] wrote the attribution to {att_path} (sparselift explain PLAN --attribution {att_path})")


def write_result(path: str, out: Dict[str, Any]) -> None:
    """``--out``: the result as JSON, written atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, out, indent=1)


@contextlib.contextmanager
def lost_ranks_named(heartbeat: StepHeartbeat, timeout_s: float) -> Iterator[None]:
    """A collective of the block (after the train loop too: the final checkpoint, the result's
    reductions, the last barrier) that fails because a rank was lost ends as one
    :class:`CollectiveFailure` naming it, as in the loop (a failure already named passes as is)."""
    try:
        yield
    except CollectiveFailure:
        raise
    except Exception as e:
        cause: Optional[BaseException] = e
        while cause is not None and not is_collective_failure(cause):  # e.g. a CheckpointError over gloo's
            cause = cause.__cause__ or cause.__context__
        lost = None if cause is None else collective_failure(cause, heartbeat, timeout_s)
        if lost is None:
            raise
        raise CollectiveFailure(lost) from e


def run(options: TrainOptions, tables: List[TableSpec]) -> Dict[str, Any]:
    """Plan, shard and train per ``options``; returns the JSON result (the same on every rank)."""
    cluster = init_distributed(options.device, options.collective_timeout)
    setup = prepare(options, tables, cluster)
    sharded = plan_and_shard(options, setup, cluster)
    config = checkpoint_config(options, tables, cluster.world_size)
    resumed_from = resume(options, config, sharded, cluster)
    first_step = resumed_from or 0
    batches = run_batches(options, tables, cluster, first_step)
    heartbeat = StepHeartbeat.of_default_group()
    with lost_ranks_named(heartbeat, options.collective_timeout):
        result, timer, saved = train(options, sharded, batches, first_step, config, cluster, heartbeat)
        out = result_record(options, setup, sharded, cluster, result, timer, saved, resumed_from)
        if options.attribute:
            attribute(options, setup, sharded, batches, cluster, out)
        if not all(math.isfinite(x) for x in out["losses"]):
            raise RuntimeError("training diverged: a loss is not finite (lower --lr)")
        if cluster.rank == 0 and options.out:
            write_result(options.out, out)
            cluster.say(f"[dlrm] wrote {options.out}")
        dist.barrier()
    return out
