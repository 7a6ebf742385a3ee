"""The package's vocabulary, declared once: sharding types, compute kernels, train pipelines,
communication precisions.

Every layer reads these names from here, so adding a pipeline kind or a precision is one entry in
this file plus what its meaning needs elsewhere (the step composition of a pipeline in
:mod:`torchrec_sparselift.cost.pipelines`, its cost terms in the cost model); the tests in
``tests/test_vocabulary.py`` fail until every registry entry has its counterpart in each layer.

- **Sharding types** are TorchRec's ``ShardingType`` values; the groups below say what the code
  does with them (which split columns, which split rows, which the CPU runtime adds, which are
  offered only when a constraint asks).
- **Compute kernels** are TorchRec's ``EmbeddingComputeKernel`` values, with the groups the cost
  model and the checks use.
- **Pipelines**: :data:`PIPELINE_REGISTRY` holds one :class:`Pipeline` per train-pipeline kind
  (its TorchRec class, whether it trains on stale embeddings, which tables it can train, what it
  fuses, whether it runs the 2D replica sync), in the planner's order of preference on equal step
  times.
- **Communication precisions**: :data:`COMM_PRECISION_REGISTRY` holds one :class:`CommPrecision`
  per TorchRec qcomm codec the planner may choose (bytes per element, lossy or not, opt-in,
  whether it runs on gloo as named).
- **2D strategies**: :data:`STRATEGY_2D_REGISTRY` holds one :class:`Strategy2D` per
  ``DMPCollection`` sharding strategy the planner may choose (how replicas are kept in step).

This module is a base module like :mod:`~torchrec_sparselift.errors`: it imports nothing of the
package (and neither torch nor TorchRec), so every layer, the command line and the examples may
use it.
"""

from __future__ import annotations

import enum
from typing import Dict, Optional, Tuple

import attrs

__all__ = [
    # sharding types
    "DATA_PARALLEL",
    "TABLE_WISE",
    "COLUMN_WISE",
    "ROW_WISE",
    "TABLE_ROW_WISE",
    "TABLE_COLUMN_WISE",
    "GRID_SHARD",
    "SHARDING_TYPES",
    "COLUMN_SPLIT_TYPES",
    "ROW_SPLIT_TYPES",
    "HOST_ROW_SPLIT_TYPES",
    "PLACED_FREELY_TYPES",
    "ON_EVERY_RANK_TYPES",
    "OPT_IN_SHARDING_TYPES",
    "CPU_EXTRA_SHARDING_TYPES",
    "CPU_RUNTIME_SHARDING_TYPES",
    # compute kernels
    "COMPUTE_KERNELS",
    "FUSED_KERNELS",
    "UVM_KERNELS",
    "KEY_VALUE_KERNELS",
    "MODELED_KERNELS",
    # pipelines
    "BASE",
    "SPARSE_DIST",
    "FUSED",
    "PREFETCH",
    "OVERLAP",
    "SEMI_SYNC",
    "OVERLAP_STALE",
    "Pipeline",
    "PipelineConflict",
    "PIPELINE_REGISTRY",
    "PIPELINES",
    "SYNC_PIPELINES",
    "STALE_PIPELINES",
    "PIPELINES_2D",
    "pipeline",
    "has_side_streams",
    # communication precisions
    "FP32",
    "FP16",
    "BF16",
    "FP8",
    "CommPrecision",
    "COMM_PRECISION_REGISTRY",
    "COMM_PRECISIONS",
    "COMM_PRECISION_BYTES",
    "LOSSY_COMM_PRECISIONS",
    "comm_precision",
    "comm_precision_pairs",
    # planner choices
    "SOLVERS",
    "COST_MODELS",
    "LAYOUTS_2D",
    "LAYOUT_2D_CHOICES",
    # 2D strategies
    "Strategy2D",
    "STRATEGY_2D_REGISTRY",
    "STRATEGIES_2D",
    "STRATEGY_2D_CHOICES",
    "strategy_2d",
]

# -- sharding types ---------------------------------------------------------------------------

DATA_PARALLEL = "data_parallel"
TABLE_WISE = "table_wise"
COLUMN_WISE = "column_wise"
ROW_WISE = "row_wise"
TABLE_ROW_WISE = "table_row_wise"
TABLE_COLUMN_WISE = "table_column_wise"
GRID_SHARD = "grid_shard"

#: Every sharding type (TorchRec's ``ShardingType`` values, in its order).
SHARDING_TYPES: Tuple[str, ...] = (
    DATA_PARALLEL, TABLE_WISE, COLUMN_WISE, ROW_WISE, TABLE_ROW_WISE, TABLE_COLUMN_WISE, GRID_SHARD,
)
#: Types that split a table by columns (``column_splits`` shards of ``dim / splits`` columns).
COLUMN_SPLIT_TYPES: Tuple[str, ...] = (COLUMN_WISE, TABLE_COLUMN_WISE)
#: Types that split a table by rows (TorchRec refuses them for position-weighted modules).
ROW_SPLIT_TYPES: Tuple[str, ...] = (ROW_WISE, TABLE_ROW_WISE, GRID_SHARD)
#: Row-splitting types whose shards cover the ranks of one host.
HOST_ROW_SPLIT_TYPES: Tuple[str, ...] = (TABLE_ROW_WISE, GRID_SHARD)
#: Types whose shards the search may put on any rank (one rank holds each whole shard's rows).
PLACED_FREELY_TYPES: Tuple[str, ...] = (TABLE_WISE, COLUMN_WISE, TABLE_COLUMN_WISE)
#: Types with one shard (or replica) on every rank.
ON_EVERY_RANK_TYPES: Tuple[str, ...] = (ROW_WISE, DATA_PARALLEL)
#: Types the planner offers only when a table's constraints name them (as TorchRec does).
OPT_IN_SHARDING_TYPES: Tuple[str, ...] = (GRID_SHARD,)
#: Types the CPU/gloo runtime executes correctly although TorchRec's sharders offer them only for
#: CUDA (measured, TORCHREC_NOTES.md).
CPU_EXTRA_SHARDING_TYPES: Tuple[str, ...] = (ROW_WISE, TABLE_ROW_WISE)
#: Every type the CPU/gloo runtime executes.
CPU_RUNTIME_SHARDING_TYPES: Tuple[str, ...] = (DATA_PARALLEL, TABLE_WISE, COLUMN_WISE) + CPU_EXTRA_SHARDING_TYPES

# -- compute kernels --------------------------------------------------------------------------

#: Every compute kernel (TorchRec's ``EmbeddingComputeKernel`` values, in its order).
COMPUTE_KERNELS: Tuple[str, ...] = (
    "dense", "fused", "fused_uvm", "fused_uvm_caching", "quant", "quant_uvm", "quant_uvm_caching",
    "key_value", "customized_kernel", "ssd_virtual_table", "dram_virtual_table",
    "dram_ssd_virtual_table", "fused_triton",
)
#: Kernels backed by FBGEMM's training TBE (embedding dims must be a multiple of 4).
FUSED_KERNELS: Tuple[str, ...] = ("fused", "fused_uvm", "fused_uvm_caching")
#: Kernels whose weights live in host memory reached through unified virtual memory.
UVM_KERNELS: Tuple[str, ...] = ("fused_uvm", "fused_uvm_caching")
#: Key-value (virtual-table) kernels: rows live in a DRAM or SSD key-value store that holds only
#: the ids a job inserts, in front of an HBM (L1) cache and, for SSD, a DRAM (L2) cache. TorchRec's
#: enumerator offers them only when a table's ``ParameterConstraints.compute_kernels`` names them.
KEY_VALUE_KERNELS: Tuple[str, ...] = ("key_value", "ssd_virtual_table", "dram_virtual_table", "dram_ssd_virtual_table")
#: Kernels whose sparse path the cost model describes (the search skips the others, saying so).
MODELED_KERNELS: Tuple[str, ...] = ("fused", "dense", "fused_uvm", "fused_uvm_caching", "dram_virtual_table",
                                    "ssd_virtual_table")

# -- train pipelines --------------------------------------------------------------------------

#: Pipeline kind names (the registry below describes each; ``FUSED`` is the pipeline, not the
#: ``fused`` compute kernel).
BASE = "base"
SPARSE_DIST = "sparse_dist"
FUSED = "fused"
PREFETCH = "prefetch"
OVERLAP = "overlap"
SEMI_SYNC = "semi_sync"
OVERLAP_STALE = "overlap_stale"


class PipelineConflict(str, enum.Enum):
    """Why a pipeline kind cannot train a plan exactly (:meth:`Pipeline.conflict`).

    * ``DENSE_KERNEL``: a kind without :attr:`Pipeline.dense_kernel` (the stale ones) and a
      dense-kernel table;
    * ``DENSE_BEFORE_STEP``: :attr:`Pipeline.lookup_before_dense_step` on a device with side
      streams and a dense-kernel table (its next lookup reads the weights before the dense step);
    * ``FEATURE_PROCESSORS``: the same with a feature processor's weights."""

    DENSE_KERNEL = "dense_kernel"
    DENSE_BEFORE_STEP = "dense_before_step"
    FEATURE_PROCESSORS = "feature_processors"


@attrs.frozen
class Pipeline:
    """One train-pipeline kind.

    Attributes:
        name: the name plans, requests and the command line use.
        torchrec_class: the train pipeline class the runtime builds for it: TorchRec's
            (``torchrec.distributed.train_pipeline``) or the package's own
            (``TrainPipelineOverlap``, :mod:`torchrec_sparselift.runtime.overlap`;
            ``TrainPipelineOverlapStale``, :mod:`torchrec_sparselift.runtime.stale`).
        stale: it trains on one-step-stale embeddings (offered only with ``allow_staleness``);
            the others compute exactly what a plain forward/backward/step loop computes.
        dense_kernel: it can train tables on the ``dense`` compute kernel (every data-parallel
            table uses it).
        fused_input_splits: it fuses the input distribution's splits exchanges of all sharding
            groups into one call per step (``TrainPipelineSparseDist`` and its subclasses do;
            ``TrainPipelineBase`` runs each group's own).
        syncs_2d_replicas: its constructor takes ``dmp_collection_sync_interval_batches``, so it
            runs the 2D replica sync (a 2D plan needs one of these).
        side_streams: it runs work on side device streams; on CPU the runtime uses its
            adaptation in :mod:`torchrec_sparselift.runtime.cpu_compat`.
        overlaps_between_hosts: its overlap is real on hardware the cost model otherwise prices
            without overlap (``HardwareProfile.supports_overlap`` False, CPU gloo) when the ranks
            span hosts: it issues a collective asynchronously (gloo's threads) and computes
            beside it, and a transfer between hosts waits on the link rather than on the rank's
            cores (measured, docs/overlap.md: the package's kinds, and TorchRec's ``fused``, which
            issues the output all-to-all before the forward; ``sparse_dist`` waits for each
            collective right after issuing it on CPU and gains nothing there). What it overlaps
            there: ``cost.pipelines.effective_pipeline``.
        needs_spare_cores: its overlap also runs the package's own work beside the rank's compute
            (the gradient all-to-all beside the bottom MLP's backward, the all-reduce beside the
            embedding backward), which needs a core per rank: with 4 ranks on 2 cores ``overlap``
            ran 93 ms/step where ``sparse_dist`` ran 63 (``fused`` 0.92-1.02x ``sparse_dist``'s step
            there, geomean 0.96), so the planner leaves it out where more ranks share a machine
            than it has cores.
        lookup_before_dense_step: on a device with streams (CUDA) it starts the next batch's
            embedding lookup on a side stream that does not wait for this batch's dense optimizer
            step, so it is exact only where every weight the lookup reads updates inside the fused
            backward (TorchRec's ``TrainPipelineFusedSparseDist``: "this assumption is not true if
            there is feature processor(s)"). A table on the ``dense`` kernel (every data-parallel
            one) and a feature processor's weights are updated by the dense optimizer, so on such a
            device the planner does not offer it for plans with either and the runtime refuses the
            pair (``cost.pipelines.trainable_pipelines``, ``runtime.check_pipeline_supports_plan``).
            On CPU the side stream is the step's own order and the kind is exact.
        doc: one line on what it overlaps.
    """

    name: str
    torchrec_class: str
    stale: bool = False
    dense_kernel: bool = True
    fused_input_splits: bool = True
    syncs_2d_replicas: bool = False
    side_streams: bool = False
    overlaps_between_hosts: bool = False
    needs_spare_cores: bool = False
    lookup_before_dense_step: bool = False
    doc: str = ""

    @property
    def exact(self) -> bool:
        """Per-step results equal a plain forward/backward/optimizer-step loop."""
        return not self.stale

    def conflict(self, dense_kernel: bool, side_streams: bool = False,
                 feature_processors: bool = False) -> Optional["PipelineConflict"]:
        """Why this kind cannot train a plan exactly (a :class:`PipelineConflict`), or None where
        it can: the one rule the search, the planner (``cost.pipelines.trainable_pipelines``: they
        filter) and the runtime (``runtime.check_pipeline_supports_plan``: it refuses, naming the
        tables or modules) apply. ``dense_kernel``: the plan has a table on the ``dense`` kernel
        (every data-parallel one); ``side_streams``: the device runs side streams
        (:func:`has_side_streams`); ``feature_processors``: the model holds a feature processor.
        The rule is monotone: setting a condition never removes a conflict."""
        if dense_kernel and not self.dense_kernel:
            return PipelineConflict.DENSE_KERNEL
        if side_streams and self.lookup_before_dense_step:
            if dense_kernel:
                return PipelineConflict.DENSE_BEFORE_STEP
            if feature_processors:
                return PipelineConflict.FEATURE_PROCESSORS
        return None

    def can_conflict(self, side_streams: bool = False) -> bool:
        """Whether some plan or model conflicts with this kind on a device with (or without) side
        streams: :meth:`conflict` with every condition of a plan and a model set (the rule is
        monotone). False: the kind trains every plan exactly there, nothing needs checking."""
        return self.conflict(True, side_streams, True) is not None


#: Every pipeline kind, in the planner's order of preference on equal step times.
PIPELINE_REGISTRY: Tuple[Pipeline, ...] = (
    Pipeline(BASE, "TrainPipelineBase", fused_input_splits=False,
             doc="host-to-device copy of batch i+1 overlaps step i"),
    Pipeline(SPARSE_DIST, "TrainPipelineSparseDist", syncs_2d_replicas=True,
             doc="+ input_dist (ids/lengths all-to-all) of batch i+1"),
    Pipeline(FUSED, "TrainPipelineFusedSparseDist", side_streams=True, overlaps_between_hosts=True,
             lookup_before_dense_step=True,
             doc="+ embedding backward/optimizer overlapping the dense all-reduce; lookup and output "
                 "all-to-all issued before the forward"),
    Pipeline(PREFETCH, "PrefetchTrainPipelineSparseDist", side_streams=True,
             doc="+ cache prefetch (UVM caching kernels) of batch i+1"),
    Pipeline(OVERLAP, "TrainPipelineOverlap", overlaps_between_hosts=True, needs_spare_cores=True,
             doc="+ output/gradient all-to-alls beside the dense work independent of the embeddings, "
                 "the dense all-reduce beside the embedding backward (the package's own pipeline)"),
    Pipeline(SEMI_SYNC, "TrainPipelineSemiSync", stale=True, dense_kernel=False, syncs_2d_replicas=True,
             side_streams=True, doc="+ lookup of batch i+1 before step i's embedding update (one step stale)"),
    Pipeline(OVERLAP_STALE, "TrainPipelineOverlapStale", stale=True, dense_kernel=False,
             overlaps_between_hosts=True, needs_spare_cores=True,
             doc="+ lookup and output all-to-all of batch i+1 beside step i's dense backward, step i's "
                 "gradient all-to-all beside step i+1's dense forward (one step stale; the package's own)"),
)
_PIPELINE_BY_NAME: Dict[str, Pipeline] = {p.name: p for p in PIPELINE_REGISTRY}
#: Pipeline names, one order used everywhere.
PIPELINES: Tuple[str, ...] = tuple(p.name for p in PIPELINE_REGISTRY)
#: Pipelines that train on up-to-date embeddings (the planner's default set).
SYNC_PIPELINES: Tuple[str, ...] = tuple(p.name for p in PIPELINE_REGISTRY if not p.stale)
#: Pipelines that train on stale embeddings (only with ``allow_staleness``).
STALE_PIPELINES: Tuple[str, ...] = tuple(p.name for p in PIPELINE_REGISTRY if p.stale)
#: Pipelines through which TorchRec runs ``DMPCollection``'s replica sync (a 2D plan uses one).
PIPELINES_2D: Tuple[str, ...] = tuple(p.name for p in PIPELINE_REGISTRY if p.syncs_2d_replicas)


def pipeline(name: str) -> Pipeline:
    """The :class:`Pipeline` called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _PIPELINE_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown pipeline {name!r}; choose one of {PIPELINES}") from None


def has_side_streams(device_type: str) -> bool:
    """Whether a device of ``device_type`` (TorchRec's ``compute_device``, ``torch.device.type``)
    runs the pipelines' side streams concurrently (CUDA, MTIA); on CPU they are the step's own
    order (``Pipeline.lookup_before_dense_step``)."""
    return device_type != "cpu"


# -- communication precisions -----------------------------------------------------------------

#: Comm precision names (TorchRec's qcomm ``CommType`` values, lower case).
FP32 = "fp32"
FP16 = "fp16"
BF16 = "bf16"
FP8 = "fp8"


@attrs.frozen
class CommPrecision:
    """A precision of the pooled embeddings' all-to-all / reduce-scatter (a TorchRec qcomm
    codec, ``CommType``): bytes per element on the wire, whether it loses accuracy (planned only
    with ``allow_lossy_comm``), whether it needs its own opt-in (``allow_fp8``), and how it runs
    on CPU/gloo: ``gloo_fails`` says why it does not run there at all (the runtime refuses it on
    CPU), ``gloo_runs_as`` names the precision TorchRec substitutes for it there. The planner
    offers on gloo only precisions that run as themselves (:func:`comm_precision_pairs` with
    ``compute_device="cpu"``).

    Measured with TorchRec 1.8.0, 2 gloo ranks, one forward and backward of table-wise (pooled
    all-to-all) and row-wise (reduce-scatter) tables against fp32 (docs/benchmarks.md, "Comm
    precisions on gloo"): fp16 runs both ways (relative error forward 4.5e-4, gradient 2.9e-4);
    TorchRec's codec registry replaces bf16 with fp16 on CPU in both directions (identical results
    to fp16); bf16 codecs built directly run both ways too (forward 2.6e-3, gradient 2.5e-3: the
    broken bf16 backward reported in TorchRec #538 does not reproduce), but the runtime installs
    TorchRec's registry; fp8 fails in the all-to-all both ways, and on the reduce-scatter the
    registry falls back to fp16 while a forced fp8 codec returns wrong values (forward 103%,
    gradient 71% relative error). ``benchmarks/gloo_comm_precisions.py`` measures it."""

    name: str
    bytes: int
    lossy: bool
    opt_in: str = ""
    gloo_fails: str = ""
    gloo_runs_as: str = ""

    @property
    def runs_on_cpu(self) -> bool:
        """The runtime accepts it on CPU (it may run as ``gloo_runs_as`` there)."""
        return not self.gloo_fails

    def runs_as_itself_on(self, compute_device: str) -> bool:
        """It runs on ``compute_device`` as the precision it names."""
        return compute_device != "cpu" or not (self.gloo_fails or self.gloo_runs_as)


COMM_PRECISION_REGISTRY: Tuple[CommPrecision, ...] = (
    CommPrecision(FP32, 4, lossy=False),
    CommPrecision(FP16, 2, lossy=True),
    CommPrecision(BF16, 2, lossy=True, gloo_runs_as=FP16),
    CommPrecision(FP8, 1, lossy=True, opt_in="allow_fp8",
                  gloo_fails="TorchRec's fp8 codec fails inside the gloo all-to-all (\"Tensor 'input' must have "
                             "2 dimension(s). Found 1\", forward and backward); on the reduce-scatter it "
                             "returns wrong values"),
)
_PRECISION_BY_NAME: Dict[str, CommPrecision] = {p.name: p for p in COMM_PRECISION_REGISTRY}
#: Comm precisions a plan may choose.
COMM_PRECISIONS: Tuple[str, ...] = tuple(p.name for p in COMM_PRECISION_REGISTRY)
#: Bytes per element on the wire, per precision.
COMM_PRECISION_BYTES: Dict[str, int] = {p.name: p.bytes for p in COMM_PRECISION_REGISTRY}
#: Precisions planned only with ``allow_lossy_comm``.
LOSSY_COMM_PRECISIONS: Tuple[str, ...] = tuple(p.name for p in COMM_PRECISION_REGISTRY if p.lossy)

_EXACT_PAIRS: Tuple[Tuple[str, str], ...] = ((FP32, FP32),)
_LOSSY_PAIRS: Tuple[Tuple[str, str], ...] = ((FP16, FP16), (BF16, BF16), (FP16, BF16))
_FP8_PAIRS: Tuple[Tuple[str, str], ...] = ((FP8, BF16),)


def comm_precision(name: str) -> CommPrecision:
    """The :class:`CommPrecision` called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _PRECISION_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown comm precision {name!r}; choose one of {COMM_PRECISIONS}") from None


def comm_precision_pairs(allow_lossy_comm: bool = False, allow_fp8: bool = False,
                         compute_device: str = "cuda") -> Tuple[Tuple[str, str], ...]:
    """The (forward, backward) precision pairs the planner tries, in its order: fp32 both ways;
    with ``allow_lossy_comm`` also the fp16/bf16 ones; with ``allow_fp8`` too, fp8 forward with bf16
    backward. On ``compute_device="cpu"`` (gloo) only pairs whose precisions run as themselves
    there (:meth:`CommPrecision.runs_as_itself_on`): fp32 and fp16."""
    pairs = _EXACT_PAIRS
    if allow_lossy_comm:
        pairs += _LOSSY_PAIRS
        if allow_fp8:
            pairs += _FP8_PAIRS
    return tuple(pair for pair in pairs
                 if all(_PRECISION_BY_NAME[n].runs_as_itself_on(compute_device) for n in pair))


# -- planner choices --------------------------------------------------------------------------

#: Search strategies (``SparseLiftPlanner(solver=...)``).
SOLVERS: Tuple[str, ...] = ("auto", "heuristic", "milp")
#: Cost models the planner can rank plans by (``SparseLiftPlanner(cost_model=...)``).
COST_MODELS: Tuple[str, ...] = ("sparselift", "torchrec")
#: 2D rank layouts: contiguous sharding groups or TorchRec's strided default.
LAYOUTS_2D: Tuple[str, ...] = ("contiguous", "strided")
#: What ``layout_2d=`` / ``--layout-2d`` accept: a layout, or ``auto`` (price both on several hosts).
LAYOUT_2D_CHOICES: Tuple[str, ...] = ("auto",) + LAYOUTS_2D


# -- 2D strategies ----------------------------------------------------------------------------


@attrs.frozen
class Strategy2D:
    """How a 2D plan keeps its replicas in step: one TorchRec ``ShardingStrategy`` of ``DMPCollection``.

    Attributes:
        name: the name plans, requests and the command line use.
        torchrec_name: the ``torchrec.distributed.types.ShardingStrategy`` member it builds.
        periodic_sync: replicas drift and are merged (weights and optimizer state) by
            ``DMPCollection.sync()`` every ``sync_interval`` steps; the interval is a quality choice
            (bounded by ``max_sync_interval``). Otherwise the weights are averaged inside every step
            and there is no interval.
        not_on_cpu: why TorchRec's implementation does not run on CPU/gloo ("" where it does).
        doc: one line on what it communicates.
    """

    name: str
    torchrec_name: str
    periodic_sync: bool
    not_on_cpu: str = ""
    doc: str = ""

    @property
    def runs_on_cpu(self) -> bool:
        return not self.not_on_cpu


STRATEGY_2D_REGISTRY: Tuple[Strategy2D, ...] = (
    Strategy2D("default", "DEFAULT", periodic_sync=True,
               doc="all-reduce (average) of weights and row-wise optimizer state over each replica "
                   "group every sync_interval steps"),
    Strategy2D("fully_sharded", "FULLY_SHARDED", periodic_sync=False,
               not_on_cpu=("TorchRec 1.8.0 and 1.9.2 build FULLY_SHARDED tables as "
                           "ShardedBatchedFusedEmbedding(Bag), whose constructor creates a torch.cuda.Stream "
                           "('torch.cuda.Stream requires CUDA support' on 4 gloo ranks) and whose forward "
                           "records CUDA events"),
               doc="every step: reduce-scatter (average) of the weights over the replica group after "
                   "the lookup, all-gather before the embedding backward; between them each rank "
                   "holds 1/R of its shards' weights; optimizer state stays per replica"),
)
_STRATEGY_BY_NAME: Dict[str, Strategy2D] = {s.name: s for s in STRATEGY_2D_REGISTRY}
#: 2D strategy names, in the planner's order of preference on equal step times.
STRATEGIES_2D: Tuple[str, ...] = tuple(s.name for s in STRATEGY_2D_REGISTRY)
#: What ``strategy_2d=`` / ``--2d-strategy`` accept: a strategy, or ``auto`` (price each one the
#: device runs).
STRATEGY_2D_CHOICES: Tuple[str, ...] = ("auto",) + STRATEGIES_2D


def strategy_2d(name: str) -> Strategy2D:
    """The :class:`Strategy2D` called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _STRATEGY_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown 2D strategy {name!r}; choose one of {STRATEGY_2D_CHOICES}") from None
