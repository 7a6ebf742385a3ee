"""Measure real training steps of given sharding plans (the probing half of step calibration).

:func:`probe_model` builds a small TorchRec DLRM / DLRM-DCN (``DLRMTrain``) on the meta device;
:func:`prebuilt_batches` makes each run's distinct synthetic batches *before* timing (power-law ids,
random bag lengths around the pooling factor), so the data source is not in the timed step, as
with a DataLoader that prefetches; :func:`measure_plan` shards the model under a plan the way the
DLRM example does (fused row-wise AdaGrad in backward for sharded tables, dense AdaGrad for the rest
and for data-parallel tables, ``TrainPipelineSparseDist``), runs ``warmup + steps`` steps and returns
the slowest rank's median steady-state step. Every rank of ``pg`` must call it with the same plan.

:data:`PROBE_WORKLOADS` are the probe models of the step calibration
(:mod:`torchrec_sparselift.measure.steps`; they
differ in table count, features per table, widths and dense part, so per-table, per-feature and
bandwidth terms separate); :func:`probe_constraints` forces one sharding type per table for the
probe plans.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np
import torch
import torch.distributed as dist

from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.measure.attribution import attribute_steps
from torchrec_sparselift.runtime.model_parallel import build_optimizer
from torchrec_sparselift.runtime.timing import StepTimer
from torchrec_sparselift.semantics.workload import observe
from torchrec_sparselift.vocabulary import COLUMN_WISE, DATA_PARALLEL, ROW_WISE, TABLE_WISE

__all__ = [
    "ProbeTable",
    "ProbeWorkload",
    "PROBE_WORKLOADS",
    "PLAN_KINDS",
    "probe_model",
    "prebuilt_batches",
    "probe_constraints",
    "pooling_constraints",
    "shard_for_training",
    "measure_plan",
    "Measurement",
    "DEFAULT_TIMING",
    "pin_rank_to_core",
    "restore_affinity",
]

NUM_DENSE = 13


@attrs.frozen
class ProbeTable:
    name: str
    rows: int
    dim: int
    features: Tuple[str, ...]
    pooling_factor: float = 1.0


@attrs.frozen
class ProbeWorkload:
    """Tables, model kind ("dlrm" or "dcn"), dense layer sizes and per-rank batch size."""

    name: str
    tables: Tuple[ProbeTable, ...]
    model: str = "dlrm"
    dense: Tuple[int, ...] = (64,)
    over: Tuple[int, ...] = (128, 64, 1)
    dcn_layers: int = 2
    dcn_rank: int = 32
    batch_size: int = 256
    #: plan kinds this probe model does not run (:func:`ProbeWorkload.kinds`)
    skip_kinds: Tuple[str, ...] = ()

    @property
    def dim(self) -> int:
        return self.tables[0].dim

    def kinds(self, kinds: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
        """The plan kinds of ``kinds`` (default :data:`PLAN_KINDS`) this probe model runs."""
        return tuple(k for k in (kinds or PLAN_KINDS) if k not in self.skip_kinds)


def _tables(prefix: str, spec: Sequence[Tuple[int, int, int, float]]) -> Tuple[ProbeTable, ...]:
    """``(rows, dim, features, pooling)`` rows -> tables ``prefix_i`` with features ``prefix_i_f``."""
    out = []
    for i, (rows, dim, nf, pf) in enumerate(spec):
        out.append(ProbeTable(f"{prefix}{i}", rows, dim,
                              tuple(f"{prefix}{i}_f{j}" for j in range(nf)), pf))
    return tuple(out)


#: The probe models: few wide tables (DCN), many small tables, shared multi-feature tables, many
#: wide tables (DCN), a few large tables.
PROBE_WORKLOADS: Tuple[ProbeWorkload, ...] = (
    ProbeWorkload("probe_wide", _tables("w", [(40000, 128, 1, 4.0), (8000, 128, 1, 1.0), (2000, 128, 1, 2.0),
                                              (500, 128, 1, 1.0)]),
                  model="dcn", dense=(64, 128), batch_size=256),
    ProbeWorkload("probe_many", _tables("m", [(300 + 97 * i, 64, 1, 1.0) for i in range(16)]),
                  model="dlrm", dense=(64,), batch_size=256),
    ProbeWorkload("probe_shared", _tables("s", [(20000, 64, 3, 2.0), (5000, 64, 2, 4.0), (1000, 64, 2, 1.0)]),
                  model="dcn", dense=(64,), batch_size=512),
    # many wide tables: the dense part and the per-table / per-feature work at DLRM-like counts
    ProbeWorkload("probe_deep", _tables("d", [(100 + 400 * i, 128, 1, 1.0 + (i % 3)) for i in range(20)]),
                  model="dcn", dense=(64,), batch_size=256),
    # tables far beyond the cache (0.5-51 MB at 2,000-200,000 rows): the per-id cost of lookups in
    # large tables (cold_row_s) apart from the row bytes, which the other probes' tables (up to
    # 20 MB, most under 4 MB) cannot tell apart
    ProbeWorkload("probe_large", _tables("l", [(200000, 64, 1, 2.0), (100000, 64, 1, 1.0), (40000, 64, 1, 2.0),
                                               (2000, 64, 1, 1.0)]),
                  model="dlrm", dense=(64,), batch_size=512,
                  # all data-parallel: 1.4 s a step (its 87 MB replicas' all-reduce and optimizer),
                  # a sixth of the calibration for terms the other probes' replicas already fit
                  skip_kinds=(DATA_PARALLEL,)),
)

#: Probe plan kinds: one sharding type for every table, or by size (mixed; dp_small: the smaller half
#: of the tables data-parallel, the rest table-wise). ``dp_small`` spans the direction the others
#: miss: table-wise table count (per-table / per-feature work) varies while the collectives stay
#: those of one table-wise group, and data-parallel table count varies apart from data-parallel
#: bytes (small replicas), so per-table, per-collective and data-parallel costs separate (the
#: held-out ``kaggle`` plan that made 20 small tables data-parallel is of this shape).
#: ``two_groups`` varies the collectives at a fixed table count: every other table (by rows) is
#: column-wise in one full-width shard (the same shard, bytes and lookups as table-wise), so the
#: plan has the shards of all-table-wise but two sharding groups, i.e. twice the input/output/grad
#: all-to-alls: per-collective cost separates from per-table and per-step cost.
PLAN_KINDS = (TABLE_WISE, ROW_WISE, DATA_PARALLEL, COLUMN_WISE, "mixed", "dp_small", "two_groups")


def probe_model(w: ProbeWorkload):
    """``DLRMTrain`` of ``w`` (DLRM or DLRM_DCN) with its EmbeddingBagCollection on meta."""
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                                  feature_names=list(t.features)) for t in w.tables]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    common = dict(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                  dense_arch_layer_sizes=list(w.dense) + [w.dim], over_arch_layer_sizes=list(w.over))
    if w.model == "dcn":
        return DLRMTrain(DLRM_DCN(**common, dcn_num_layers=w.dcn_layers, dcn_low_rank_dim=w.dcn_rank))
    return DLRMTrain(DLRM(**common))


@functools.lru_cache(maxsize=64)
def probe_stats(w: ProbeWorkload, alpha: float = 1.05, n: int = 8, seed: int = 0) -> Any:
    """The :class:`~torchrec_sparselift.semantics.workload.WorkloadStats` of ``w``'s ids
    (:func:`~torchrec_sparselift.semantics.workload.observe` of rank 0's :func:`prebuilt_batches`:
    the same value on every rank, so ranks plan and price alike)."""
    return observe(prebuilt_batches(w, n, seed=seed, rank=0, alpha=alpha), max_batches=n)


def prebuilt_batches(w: ProbeWorkload, n: int, seed: int, rank: int, alpha: float = 1.05) -> List[Any]:
    """``n`` distinct batches for ``rank`` (built now, outside any timed step): per feature, bag
    lengths uniform in ``[1, 2 pf - 1]`` (mean ``pf``) and power-law ids."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng([seed, rank, 0x5EED])
    B = w.batch_size
    keys = [f for t in w.tables for f in t.features]
    out = []
    for _ in range(n):
        lengths, values = [], []
        for t in w.tables:
            hi = max(1, int(round(2 * t.pooling_factor - 1)))
            for _f in t.features:
                ln = rng.integers(1, hi + 1, size=B) if hi > 1 else np.ones(B, dtype=np.int64)
                u = rng.random(int(ln.sum()))
                k = np.floor(np.power(t.rows + 1.0, u)).astype(np.int64) - 1  # ~ power law 1/k
                if alpha != 1.0:
                    e = 1.0 - alpha
                    k = np.floor(((np.power(t.rows + 1.0, e) - 1.0) * u + 1.0) ** (1.0 / e)).astype(np.int64) - 1
                ids = (np.clip(k, 0, t.rows - 1) * 2147483647 + 12345) % t.rows
                lengths.append(ln)
                values.append(ids)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)))
        out.append(Batch(dense_features=torch.from_numpy(rng.standard_normal((B, NUM_DENSE)).astype(np.float32)),
                         sparse_features=kjt,
                         labels=torch.from_numpy((rng.random(B) < 0.3).astype(np.float32))))
    return out


def pooling_constraints(tables: Sequence[Any]) -> Dict[str, Any]:
    """Each table's pooling factor as TorchRec's ``ParameterConstraints`` (nothing else
    constrained): what both planners get for a probe workload."""
    from torchrec.distributed.planner.types import ParameterConstraints

    return {t.name: ParameterConstraints(pooling_factors=[float(t.pooling_factor)] * len(t.features))
            for t in tables}


def probe_constraints(tables: Sequence[Any], kind: str, big_rows: Optional[int] = None,
                      column_dim: Optional[int] = None) -> Dict[str, Any]:
    """TorchRec ``ParameterConstraints`` forcing plan ``kind`` on ``tables`` (objects with
    ``name``, ``rows``, ``dim``, ``features``, ``pooling_factor``): one sharding type for all,
    or ``mixed`` (the largest table row-wise, tables below 1000 rows data-parallel, the rest
    table-wise), or ``dp_small`` (the ``len(tables) // 2`` tables with the fewest rows
    data-parallel, the rest table-wise), or ``two_groups`` (every other table by rows column-wise
    in one full-width shard, the rest table-wise). Column-wise splits into shards of
    ``column_dim`` (default: half the width)."""
    from torchrec.distributed.planner.types import ParameterConstraints

    if kind not in PLAN_KINDS + ("column_wise_big",):
        raise ValueError(f"unknown probe plan kind {kind!r}; use one of {PLAN_KINDS}")
    largest = max(tables, key=lambda t: t.rows).rows
    big = big_rows if big_rows is not None else largest
    by_rows = sorted(tables, key=lambda t: (t.rows, t.name))
    small = {t.name for t in by_rows[: len(tables) // 2]}
    second = {t.name for t in by_rows[1::2]}
    out = {}
    for t in tables:
        if kind == "dp_small":
            st = DATA_PARALLEL if t.name in small else TABLE_WISE
        elif kind == "two_groups":
            st = COLUMN_WISE if t.name in second else TABLE_WISE
        elif kind == "mixed":
            st = ROW_WISE if t.rows >= largest else (DATA_PARALLEL if t.rows < 1000 else TABLE_WISE)
        elif kind == "column_wise_big":
            st = COLUMN_WISE if t.rows >= big else TABLE_WISE
        else:
            st = kind
        kw: Dict[str, Any] = dict(sharding_types=[st], compute_kernels=["dense" if st == DATA_PARALLEL else "fused"],
                                  pooling_factors=[float(t.pooling_factor)] * len(t.features))
        if st == COLUMN_WISE:
            kw["min_partition"] = t.dim if kind == "two_groups" else (column_dim or max(4, t.dim // 2))
        out[t.name] = ParameterConstraints(**kw)
    return out


def shard_for_training(model, plan, device, lr: float = 0.05, dense_lr: float = 0.005,
                       dense_optimizer_factory: Optional[Callable[[Any], Any]] = None):
    """``(DistributedModelParallel, optimizer)`` of a DLRM (``model.model.sparse_arch``) under
    ``plan`` with TorchRec's own wrapper, as the probes and the DLRM example's TorchRec path build
    them: row-wise AdaGrad (``lr``) on every table (in backward; data-parallel tables after their
    all-reduce, as :func:`~torchrec_sparselift.runtime.build_optimizer` does), on the dense part
    ``dense_optimizer_factory(params)`` (None: AdaGrad at ``dense_lr``)."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": lr})
    dmp = DistributedModelParallel(module=model, device=device, plan=plan, sharders=get_default_sharders())
    dense = dense_optimizer_factory or (lambda params: torch.optim.Adagrad(params, lr=dense_lr))
    return dmp, build_optimizer(dmp, dense, (RowWiseAdagrad, {"lr": lr}))


@attrs.frozen
class Measurement:
    """One timed run: the median and mean steady-state step (seconds) of the per-step slowest
    rank, and every step's slowest-rank duration including the warm-up (``durations_s``)."""

    label: str
    median_s: float
    mean_s: float
    steps: int
    wall_s: float
    durations_s: Tuple[float, ...] = ()
    cpu_durations_s: Tuple[float, ...] = ()
    #: :class:`~torchrec_sparselift.calibration.attribution.StepAttribution` of the profiled steps run
    #: after the timed ones (``measure_plan(..., attribute=N)``), else None
    attribution: Any = attrs.field(default=None, eq=False)


#: The harness's defaults (see docs/calibration.md, "Measurement repeatability").
DEFAULT_TIMING: Dict[str, Any] = dict(warmup=5, steps=20, pin=True, gc_off=False)


def _set_affinity(cpus: Any) -> Any:
    """Set the CPU affinity of every thread of this process (Linux ``sched_setaffinity`` applies
    to one thread; gloo's threads exist already); returns the previous affinity."""
    import os

    old = os.sched_getaffinity(0)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return old


def _rank_cores(pg: Any) -> Optional[Any]:
    """This rank's share of the usable cores: the ``local rank``-th of ``local world size`` equal
    slices (one core each for 2 ranks on 2 cores); None when there are fewer cores than local
    ranks, a single rank (nothing to separate) or no way to pin."""
    import os

    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank(pg) if pg is not None else 0))
    local_ws = ranks_per_host(world_size=dist.get_world_size(pg) if pg is not None else None)
    if local_ws < 2 or local_ws > len(cpus):
        return None
    k = len(cpus) // local_ws
    return set(cpus[local * k:(local + 1) * k])


def pin_rank_to_core(pg: Any = None) -> Optional[Any]:
    """Pin every thread of this rank to its own slice of the usable cores (:func:`_rank_cores`;
    as :func:`measure_plan` does by default); returns the previous affinity (for
    :func:`restore_affinity`), or None when nothing was changed (one local rank, fewer usable
    cores than local ranks, or no way to pin). A process pinned for a whole run fingerprints the
    machine with the cores it could use before (``current_fingerprint(..., cores=...)``)."""
    cores = _rank_cores(pg)
    return _set_affinity(cores) if cores is not None else None


def restore_affinity(previous: Optional[Any]) -> None:
    """Undo :func:`pin_rank_to_core` (None: nothing to undo)."""
    if previous is not None:
        _set_affinity(previous)


def measure_plan(
    label: str,
    model_factory: Callable[[], Any],
    plan: Any,
    batches: Sequence[Any],
    steps: Optional[int] = None,
    warmup: Optional[int] = None,
    pg: Any = None,
    device: Optional[torch.device] = None,
    pipeline_factory: Optional[Callable[[Any, Any, torch.device], Any]] = None,
    pin: Optional[bool] = None,
    gc_off: Optional[bool] = None,
    attribute: int = 0,
) -> Measurement:
    """Shard a fresh ``model_factory()`` under ``plan``, run ``warmup + steps`` steps over
    ``batches`` (cycled if shorter) and return the steady-state step time of the per-step slowest
    rank. ``pipeline_factory(dmp, optimizer, device)`` replaces TorchRec's ``TrainPipelineSparseDist``.
    ``pin``: each rank runs on its own core(s) during the run (CPU, several local ranks); ``gc_off``: Python's garbage
    collector is paused during the timed steps (a collection runs before them). ``None`` takes
    :data:`DEFAULT_TIMING`. ``attribute``: after the timed steps, run that many more steps under
    ``torch.profiler`` and attribute them by sparse-path node kind
    (:func:`~torchrec_sparselift.measure.attribution.attribute_steps`, every rank's); the timed steps
    are never profiled, so ``median_s`` is the same measurement with or without it."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    steps = DEFAULT_TIMING["steps"] if steps is None else steps
    warmup = DEFAULT_TIMING["warmup"] if warmup is None else warmup
    pin = DEFAULT_TIMING["pin"] if pin is None else pin
    gc_off = DEFAULT_TIMING["gc_off"] if gc_off is None else gc_off
    t_start = time.perf_counter()
    device = device or torch.device("cpu")
    old_aff = pin_rank_to_core(pg) if pin and device.type == "cpu" else None
    try:
        dmp, opt = shard_for_training(model_factory(), plan, device)
        if pipeline_factory is not None:
            pipeline = pipeline_factory(dmp, opt, device)
        else:
            pipeline = TrainPipelineSparseDist(dmp, opt, device, execute_all_batches=True)
        total = warmup + steps
        # the pipeline prefetches up to two batches ahead: give it two spare ones
        feed = [batches[i % len(batches)] for i in range(total + max(0, attribute) + 2)]
        it = iter(feed)
        gc.collect()
        if pg is not None:
            dist.barrier(group=pg)
        timer = StepTimer(device, warmup_steps=warmup)
        gc_was = gc.isenabled()
        try:
            for i in range(total):
                if i == warmup and gc_off:
                    gc.disable()
                with timer.step():
                    pipeline.progress(it)
        finally:
            if gc_was:
                gc.enable()
        durations, cpu = timer.slowest_rank_durations_s(pg), timer.slowest_rank_cpu_durations_s(pg)
        steady = durations[warmup:]
        med, mean = statistics.median(steady), statistics.fmean(steady)
        att = None
        if attribute > 0:
            att = attribute_steps(pipeline, it, steps=attribute, warmup_steps=0, pg=pg, label=label,
                                  device=device, measure_unprofiled=False)
        del pipeline, dmp, opt, it, feed
        gc.collect()
    finally:
        restore_affinity(old_aff)
    return Measurement(label=label, median_s=med, mean_s=mean, steps=len(steady),
                       wall_s=time.perf_counter() - t_start, durations_s=tuple(durations),
                       cpu_durations_s=tuple(cpu), attribution=att)


def summarize(measurements: Sequence[Measurement]) -> Mapping[str, float]:
    """label -> median over repeated measurements of that label (seconds)."""
    by: Dict[str, List[float]] = {}
    for m in measurements:
        by.setdefault(m.label, []).append(m.median_s)
    return {k: statistics.median(v) for k, v in by.items()}
