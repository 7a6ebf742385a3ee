"""Microbenchmarks that measure the rates a :class:`~torchrec_sparselift.cost.hardware.HardwareProfile` holds.

Each benchmark runs on the machine at hand and returns plain immutable records
(:mod:`torchrec_sparselift.calibration.records`); fitting them to the cost model's equations is
:mod:`torchrec_sparselift.calibration.kernel_fit`'s job. Nothing here
imports torchrec: the embedding kernel is fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen``
(the kernel TorchRec's fused tables run, on CPU with ``EmbeddingLocation.HOST`` /
``ComputeDevice.CPU``, exactly as ``BatchedFusedEmbeddingBag`` builds it) when ``fbgemm_gpu``
imports, and ``torch.nn.functional.embedding_bag`` plus a row-wise AdaGrad update otherwise.

Timing: warm-up calls, then ``trials`` timed runs of ``inner`` back-to-back calls each (``inner``
chosen so one run lasts about ``target_trial_s``), synchronizing the device before and after each
run; a record holds the median seconds per call. Back-to-back calls measure what a training step
pays per call on a busy device stream, not an idle device's launch latency.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import attrs
import torch

from torchrec_sparselift.calibration.nnls import nonnegative_least_squares
from torchrec_sparselift.calibration.records import (
    ChunkRecord,
    CollectiveRecord,
    CopyRecord,
    DedupRecord,
    DenseRecord,
    HostTermRecord,
    LookupRecord,
    positive_int,
    positive_seconds,
)
from torchrec_sparselift.calibration.rewrite_fit import fit_chunk_overhead, fit_dedup_id_s
from torchrec_sparselift.cost.wire_ids import inverse_bytes
from torchrec_sparselift.semantics.dense import ACTIVATION_BYTES, dlrm_interaction

__all__ = [
    "SweepConfig",
    "fbgemm_available",
    "time_per_call",
    "fastest_over_passes",
    "bench_lookups",
    "bench_collectives",
    "bench_dense",
    "bench_host_to_device",
    "bench_host_terms",
    "bench_a2a_byte_s",
    "RewriteSweep",
    "bench_chunk_steps",
    "bench_dedup_kernels",
    "bench_rewrite_constants",
]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@attrs.frozen(kw_only=True)
class SweepConfig:
    """What to measure. ``quick()`` and ``full()`` give the standard sweeps for a device."""

    dims: Tuple[int, ...] = attrs.field(converter=tuple)
    rows: Tuple[int, ...] = attrs.field(converter=tuple)
    poolings: Tuple[int, ...] = attrs.field(converter=tuple)
    batch_sizes: Tuple[int, ...] = attrs.field(converter=tuple)
    max_table_bytes: int = attrs.field(validator=positive_int)
    message_bytes: Tuple[int, ...] = attrs.field(converter=tuple)
    matmul_shapes: Tuple[Tuple[int, int, int], ...] = attrs.field(
        converter=lambda v: tuple(tuple(s) for s in v)
    )
    dense_dtypes: Tuple[str, ...] = attrs.field(converter=tuple)
    copy_bytes: Tuple[int, ...] = attrs.field(default=(), converter=tuple)
    warmup: int = attrs.field(default=2, validator=positive_int)
    trials: int = attrs.field(default=5, validator=positive_int)
    target_trial_s: float = attrs.field(default=0.01, validator=positive_seconds)

    def __attrs_post_init__(self) -> None:
        for name in ("dims", "rows", "poolings", "batch_sizes", "message_bytes"):
            values = getattr(self, name)
            if not all(isinstance(v, int) and v >= 1 for v in values):
                raise ValueError(f"SweepConfig.{name} must hold ints >= 1, got {values!r}")
        if not self.dims or not self.rows or not self.poolings or not self.batch_sizes:
            raise ValueError("SweepConfig needs at least one dim, row count, pooling factor and batch size")
        bad = [d for d in self.dense_dtypes if d not in _DTYPES]
        if bad:
            raise ValueError(f"SweepConfig.dense_dtypes {bad} unknown; use {sorted(_DTYPES)}")

    def tables(self) -> List[Tuple[int, int]]:
        """(rows, dim) pairs to build, skipping tables above ``max_table_bytes`` (fp32).

        In a fixed shuffled order, so that a sweep cut short by a time budget still spans
        small and large tables.
        """
        pairs = [(r, d) for r in self.rows for d in self.dims if r * d * 4 <= self.max_table_bytes]
        random.Random(0).shuffle(pairs)
        return pairs

    @classmethod
    def quick(cls, device: str) -> "SweepConfig":
        if device == "cuda":
            return cls(
                dims=(16, 64, 256), rows=(1000, 1_000_000), poolings=(1, 16, 64),
                batch_sizes=(512, 8192), max_table_bytes=2 << 30,
                message_bytes=(1 << 10, 64 << 10, 1 << 20, 16 << 20),
                matmul_shapes=((4096, 4096, 4096), (8192, 1024, 1024)),
                dense_dtypes=("fp32", "bf16"), copy_bytes=(1 << 20, 64 << 20),
                warmup=3, trials=5, target_trial_s=0.002,
            )
        return cls(
            dims=(16, 128), rows=(1000, 100_000), poolings=(1, 16),
            batch_sizes=(256,), max_table_bytes=64 << 20,
            message_bytes=(1 << 10, 64 << 10, 1 << 20),
            matmul_shapes=((256, 256, 256), (512, 512, 256)),
            dense_dtypes=("fp32",), warmup=2, trials=5, target_trial_s=0.003,
        )

    @classmethod
    def full(cls, device: str) -> "SweepConfig":
        if device == "cuda":
            return cls(
                dims=(8, 16, 32, 64, 128, 256), rows=(1000, 10_000, 100_000, 1_000_000, 4_000_000),
                poolings=(1, 4, 16, 64), batch_sizes=(512, 4096, 32768), max_table_bytes=4 << 30,
                message_bytes=tuple(1 << s for s in range(10, 25, 2)),
                matmul_shapes=(
                    (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                    (8192, 1024, 1024), (32768, 512, 512), (65536, 1024, 512),
                ),
                dense_dtypes=("fp32", "bf16"),
                copy_bytes=(1 << 20, 16 << 20, 256 << 20, 1 << 30),
                warmup=5, trials=7, target_trial_s=0.005,
            )
        return cls(
            dims=(8, 16, 32, 64, 128, 256), rows=(1000, 10_000, 100_000, 1_000_000),
            poolings=(1, 4, 16, 64), batch_sizes=(128, 1024), max_table_bytes=256 << 20,
            message_bytes=tuple(1 << s for s in range(10, 25, 2)),
            matmul_shapes=((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 512, 512)),
            dense_dtypes=("fp32",), warmup=2, trials=5, target_trial_s=0.01,
        )


# -- timing -------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup: int = 2,
    trials: int = 5,
    target_trial_s: float = 0.01,
    max_inner: int = 200,
    stat: str = "median",
) -> float:
    """Median (``stat="min"``: fastest) seconds per call of ``fn`` over ``trials`` timed runs of
    back-to-back calls.

    Runs ``warmup`` untimed calls first; the device is synchronized around every timed run.
    """
    if stat not in ("median", "min"):
        raise ValueError(f"time_per_call: stat must be 'median' or 'min', got {stat!r}")
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(max_inner, int(math.ceil(target_trial_s / once))))
    samples = []
    for _ in range(trials):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / inner)
    return float(min(samples) if stat == "min" else statistics.median(samples))


def fastest_over_passes(cases: Sequence[Callable[[], float]], passes: int) -> List[float]:
    """Each case's fastest time over ``passes`` interleaved sweeps (every case once, then again).

    The host microbenchmarks give the step fit *floors* (work measured alone, which a real step
    cannot do faster). A transient disturbance of a shared machine only ever slows a measurement,
    so within one reading each case keeps its fastest observation; sweeping all cases once per
    pass spreads each case's samples over the whole reading, so a short slow stretch cannot lift
    one case (and a slope between cases) alone. Readings a minute apart are averaged instead
    (:meth:`HostTermRecord.mean_of`)."""
    if passes < 1:
        raise ValueError(f"fastest_over_passes: passes must be >= 1, got {passes}")
    best = [math.inf] * len(cases)
    for _ in range(passes):
        for i, case in enumerate(cases):
            best[i] = min(best[i], float(case()))
    return best


# -- embedding lookups --------------------------------------------------------------------------


def fbgemm_available() -> bool:
    """True when fbgemm_gpu's training TBE imports (CPU wheel or CUDA wheel)."""
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception:  # ImportError, or a broken native library
        return False
    return True


class _TbeTable:
    """One fbgemm TBE table with fused EXACT_ROWWISE_ADAGRAD, built as TorchRec builds fused tables."""

    kernel = "fbgemm_tbe"

    def __init__(self, rows: int, dim: int, device: torch.device) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        if device.type == "cuda":
            spec = (rows, dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
        else:
            spec = (rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
        self.module = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[spec],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.01,
            pooling_mode=PoolingMode.SUM,
            device=device,
        )

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.module(indices, offsets)

    def forward_backward(self, indices: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> None:
        self.module(indices, offsets).backward(grad)  # the update is fused into backward


class _TorchTable:
    """``F.embedding_bag`` (sum) with a sparse gradient and a row-wise AdaGrad update.

    The same work TBE's fused backward does (gradient per touched row, one accumulator per row,
    read-modify-write of the touched rows), in stock PyTorch ops.
    """

    kernel = "torch_embedding_bag"

    def __init__(self, rows: int, dim: int, device: torch.device) -> None:
        self.weight = torch.empty(rows, dim, device=device).uniform_(-0.01, 0.01).requires_grad_(True)
        self.state = torch.zeros(rows, device=device)
        self.lr = 0.01

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.nn.functional.embedding_bag(
                indices, self.weight, offsets, mode="sum", include_last_offset=True
            )

    def forward_backward(self, indices: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> None:
        out = torch.nn.functional.embedding_bag(
            indices, self.weight, offsets, mode="sum", sparse=True, include_last_offset=True
        )
        out.backward(grad)
        g = self.weight.grad.coalesce()
        self.weight.grad = None
        rows = g.indices()[0]
        values = g.values()
        with torch.no_grad():
            self.state.index_add_(0, rows, values.pow(2).mean(dim=1))
            scale = self.state.index_select(0, rows).add(1e-8).rsqrt().mul_(-self.lr)
            self.weight.index_add_(0, rows, values * scale.unsqueeze(1))


def _make_table(kernel: str, rows: int, dim: int, device: torch.device) -> Any:
    return _TbeTable(rows, dim, device) if kernel == "fbgemm_tbe" else _TorchTable(rows, dim, device)


def resolve_kernel(kernel: str) -> str:
    """Map ``"auto"|"fbgemm"|"torch"`` to a record kernel name; ``auto`` prefers fbgemm."""
    if kernel == "auto":
        return "fbgemm_tbe" if fbgemm_available() else "torch_embedding_bag"
    if kernel in ("fbgemm", "fbgemm_tbe"):
        if not fbgemm_available():
            raise RuntimeError("kernel 'fbgemm' requested but fbgemm_gpu does not import; use 'torch' or 'auto'")
        return "fbgemm_tbe"
    if kernel in ("torch", "torch_embedding_bag"):
        return "torch_embedding_bag"
    raise ValueError(f"unknown lookup kernel {kernel!r}; use 'auto', 'fbgemm' or 'torch'")


def bench_lookups(
    config: SweepConfig,
    device: torch.device,
    *,
    kernel: str = "auto",
    barrier: Optional[Callable[[], None]] = None,
    progress: Optional[Callable[[str], None]] = None,
    seed: int = 0,
    deadline: Optional[float] = None,
) -> List[LookupRecord]:
    """Time forward and forward+backward(+row-wise AdaGrad) lookups over the sweep.

    Ids are uniform over the table's rows. ``barrier`` (if given) runs before every point so that
    ranks benchmarking together contend for memory as they would in training. With a
    ``deadline`` (a ``time.monotonic()`` value) no new table starts after it; ranks sharing a
    barrier must pass the same sweep and agree on stopping (pass ``deadline`` only when alone).
    """
    name = resolve_kernel(kernel)
    gen = torch.Generator().manual_seed(seed)
    records: List[LookupRecord] = []
    tables = config.tables()
    for t_i, (rows, dim) in enumerate(tables):
        if deadline is not None and time.monotonic() > deadline and records:
            if progress:
                progress(f"lookups: time budget spent, stopping after {t_i} of {len(tables)} tables")
            break
        if progress:
            progress(f"lookups: table {t_i + 1}/{len(tables)} rows={rows} dim={dim} ({name})")
        table = _make_table(name, rows, dim, device)
        for batch in config.batch_sizes:
            for pooling in config.poolings:
                n = batch * pooling
                indices = torch.randint(0, rows, (n,), generator=gen, dtype=torch.int64).to(device)
                offsets = torch.arange(0, n + 1, pooling, dtype=torch.int64).to(device)
                grad = torch.ones(batch, dim, device=device)
                for phase in ("fwd", "fwd_bwd"):
                    if barrier:
                        barrier()
                    if phase == "fwd":
                        fn = lambda: table.forward(indices, offsets)  # noqa: E731
                    else:
                        fn = lambda: table.forward_backward(indices, offsets, grad)  # noqa: E731
                    seconds = time_per_call(
                        fn, device, warmup=config.warmup, trials=config.trials,
                        target_trial_s=config.target_trial_s,
                    )
                    records.append(
                        LookupRecord(
                            kernel=name, device=device.type, phase=phase, rows=rows, dim=dim,
                            batch_size=batch, pooling=pooling, elem_bytes=4, seconds=seconds,
                        )
                    )
        del table
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


# -- collectives --------------------------------------------------------------------------------


def bench_collectives(
    config: SweepConfig,
    pg: Any,
    device: torch.device,
    *,
    progress: Optional[Callable[[str], None]] = None,
) -> List[CollectiveRecord]:
    """Time ``all_to_all_single`` and ``all_reduce`` on ``pg`` over ``config.message_bytes``.

    Every rank must call this with the same config. Each call is preceded by a barrier; a
    record's time is the median over calls of the slowest rank's time. Returns [] on one rank.
    """
    import torch.distributed as dist

    world = dist.get_world_size(pg)
    if world < 2:
        return []
    backend = str(dist.get_backend(pg))
    records: List[CollectiveRecord] = []
    for op in ("all_to_all", "all_reduce"):
        for size in config.message_bytes:
            numel = max(world, (size // 4) // world * world)  # fp32, divisible by the world size
            nbytes = numel * 4
            x = torch.ones(numel, dtype=torch.float32, device=device)
            y = torch.empty_like(x)
            if progress:
                progress(f"collectives: {op} {nbytes} bytes/rank on {world} ranks ({backend})")

            def call() -> None:
                if op == "all_to_all":
                    dist.all_to_all_single(y, x, group=pg)
                else:
                    dist.all_reduce(x, group=pg)

            for _ in range(config.warmup):
                call()
            samples = []
            for _ in range(max(config.trials, 9)):  # single calls: more samples for the median
                dist.barrier(group=pg)
                _sync(device)
                t0 = time.perf_counter()
                call()
                _sync(device)
                samples.append(time.perf_counter() - t0)
            worst = torch.tensor(samples, dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pg)
            seconds = float(statistics.median(worst.cpu().tolist()))
            records.append(
                CollectiveRecord(op=op, backend=backend, world_size=world, bytes=nbytes, seconds=seconds)
            )
    return records


# -- dense and copies ---------------------------------------------------------------------------


def bench_dense(
    config: SweepConfig,
    device: torch.device,
    *,
    progress: Optional[Callable[[str], None]] = None,
) -> List[DenseRecord]:
    """Time ``(m, k) @ (k, n)`` matmuls for every shape and dtype in the sweep."""
    records = []
    for dtype in config.dense_dtypes:
        for m, n, k in config.matmul_shapes:
            if progress:
                progress(f"dense: {dtype} matmul {m}x{k} @ {k}x{n}")
            a = torch.randn(m, k, device=device).to(_DTYPES[dtype])
            b = torch.randn(k, n, device=device).to(_DTYPES[dtype])
            seconds = time_per_call(
                lambda: torch.matmul(a, b), device, warmup=config.warmup, trials=config.trials,
                target_trial_s=config.target_trial_s,
            )
            records.append(DenseRecord(device=device.type, dtype=dtype, m=m, n=n, k=k, seconds=seconds))
    return records


def bench_host_to_device(
    config: SweepConfig,
    device: torch.device,
    *,
    progress: Optional[Callable[[str], None]] = None,
) -> List[CopyRecord]:
    """Time pinned host-to-device copies (CUDA only; [] otherwise)."""
    if device.type != "cuda":
        return []
    records = []
    for size in config.copy_bytes:
        if progress:
            progress(f"copies: h2d {size} bytes (pinned)")
        host = torch.empty(size, dtype=torch.uint8).pin_memory()
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        seconds = time_per_call(
            lambda: dev.copy_(host, non_blocking=True), device, warmup=config.warmup,
            trials=config.trials, target_trial_s=config.target_trial_s,
        )
        records.append(CopyRecord(direction="h2d", bytes=size, seconds=seconds))
    return records


# -- host work the step fit cannot separate -----------------------------------------------------


def _table_optimizer() -> type:
    """The optimizer that steps data-parallel tables in the probes and the DLRM example: TorchRec's
    row-wise AdaGrad (``runtime.build_optimizer``); AdaGrad where TorchRec is not installed."""
    try:
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    except ImportError:
        return torch.optim.Adagrad
    return RowWiseAdagrad


def _table_optimizer_step_s(shapes: List[Tuple[int, int]], device: torch.device, trials: int) -> float:
    params = [torch.nn.Parameter(torch.randn(*sh, device=device)) for sh in shapes]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = _table_optimizer()(params, lr=0.01)
    return time_per_call(opt.step, device, warmup=2, trials=trials, target_trial_s=0.01, max_inner=50, stat="min")


def _bucketize_s(ids: int, device: torch.device, trials: int) -> float:
    features, batch = 4, max(1, ids // 4)
    lengths = torch.ones(features * batch, dtype=torch.int32, device=device)
    indices = torch.randint(0, 100_000, (features * batch,), dtype=torch.int64, device=device)
    block_sizes = torch.full((features,), 50_000, dtype=torch.int64, device=device)
    op = torch.ops.fbgemm.block_bucketize_sparse_features
    return time_per_call(lambda: op(lengths, indices, False, False, block_sizes, 2), device, warmup=2,
                         trials=trials, target_trial_s=0.01, max_inner=200, stat="min")


#: ``(batch, features, dim)`` of :func:`bench_dense_terms`: interaction FLOPs per activation byte
#: from 0.6 to 11 across them, so the two rates separate (with the first five alone, 1.2-3.4, the
#: least squares gave every FLOP's cost to the bytes: 0 per FLOP on this VM, 4.3e-11 s with all).
DENSE_SHAPES: Tuple[Tuple[int, int, int], ...] = ((256, 4, 128), (256, 8, 64), (256, 32, 16), (256, 48, 8),
                                                  (512, 16, 64), (256, 2, 8), (512, 2, 32), (256, 64, 128),
                                                  (128, 128, 64))


def _dlrm_dense_s(batch: int, features: int, dim: int, device: torch.device, trials: int) -> float:
    """Seconds per forward + backward of what a DLRM step does between the pooled embeddings and
    its MLPs: split the pooled ``(B, F D)`` values per feature and concatenate them (TorchRec's
    ``SparseArch`` after ``KeyedTensor.to_dict``), then ``InteractionArch``."""
    from torchrec.models.dlrm import InteractionArch

    inter = InteractionArch(num_sparse_features=features).to(device)
    pooled = torch.randn(batch, features * dim, device=device, requires_grad=True)
    dense = torch.randn(batch, dim, device=device, requires_grad=True)

    def step() -> None:
        parts = torch.split(pooled, dim, dim=1)
        sparse = torch.cat(parts, dim=1).reshape(batch, features, dim)
        inter(dense, sparse).sum().backward()

    return time_per_call(step, device, warmup=2, trials=trials, target_trial_s=0.02, max_inner=50, stat="min")


def bench_dense_terms(device: Optional[torch.device] = None, trials: int = 5,
                      shapes: Tuple[Tuple[int, int, int], ...] = DENSE_SHAPES, passes: int = 1) -> Tuple[float, float]:
    """``(seconds per activation byte, seconds per interaction FLOP)`` of the dense part's
    parameter-free work, forward + backward, on ``device``: :func:`_dlrm_dense_s` at ``shapes``,
    non-negative least squares against the quantities the model counts for it
    (:func:`~torchrec_sparselift.semantics.dense.dlrm_interaction` plus the pooled ``F D``), with a
    constant per call, each shape's time the fastest over ``passes`` sweeps
    (:func:`fastest_over_passes`). ``(0, 0)`` without torchrec."""
    try:
        import torchrec.models.dlrm  # noqa: F401
    except ImportError:
        return 0.0, 0.0
    device = device or torch.device("cpu")
    rows = []
    for b, f, d in shapes:
        flops, elems = dlrm_interaction(f, d)
        rows.append([b * ACTIVATION_BYTES * (elems + f * d), b * flops, 1.0])
    secs = fastest_over_passes([functools.partial(_dlrm_dense_s, b, f, d, device, trials) for b, f, d in shapes],
                               passes)
    x = nonnegative_least_squares(rows, secs)
    return float(x[0]), float(x[1])


#: ``(batch, layer widths)`` of :func:`bench_dense_flops`: MLP stacks whose products dominate
#: their activations, from 0.5 to ~20 ms per step on one core, so the slope is the FLOP rate.
MLP_SHAPES: Tuple[Tuple[int, Tuple[int, ...]], ...] = ((256, (128, 128, 128, 128)), (512, (256, 256, 256)),
                                                     (256, (512, 512, 512)), (512, (1024, 1024)))


def _mlp_s(batch: int, widths: Tuple[int, ...], device: torch.device, trials: int) -> float:
    """Seconds per forward + backward of an ``nn.Linear`` + ReLU stack over ``widths``."""
    layers: List[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(batch, widths[0], device=device)
    return time_per_call(lambda: mlp(x).sum().backward(), device, warmup=2, trials=trials,
                         target_trial_s=0.02, max_inner=50, stat="min")


def bench_dense_flops(device: Optional[torch.device] = None, trials: int = 5,
                      shapes: Tuple[Tuple[int, Tuple[int, ...]], ...] = MLP_SHAPES, passes: int = 1) -> float:
    """Seconds per FLOP of the dense layers' products, forward + backward, on ``device``:
    :func:`_mlp_s` at ``shapes``, non-negative least squares on ``[3 x forward FLOPs, 1]`` (the
    model prices the forward's ``2 x weights x batch`` FLOPs and a backward of twice them,
    :func:`~torchrec_sparselift.cost.model.dense_fwd_s`), so it is ``1 / dense_flops`` at the
    rate these near-square products reach; a model's smaller or skinnier layers run slower. Each
    shape's time is the fastest over ``passes`` sweeps (:func:`fastest_over_passes`)."""
    device = device or torch.device("cpu")
    rows = []
    for b, widths in shapes:
        weights = sum(a * c + c for a, c in zip(widths[:-1], widths[1:]))
        rows.append([3.0 * 2.0 * weights * b, 1.0])
    secs = fastest_over_passes([functools.partial(_mlp_s, b, widths, device, trials) for b, widths in shapes], passes)
    return float(nonnegative_least_squares(rows, secs)[0])


#: ``(rows, ids)`` of :func:`bench_tbe_backward`, uniform ids over one dim-64 table: distinct rows
#: from ~all ids (large tables) to ~none (ids >> rows), so per-id and per-row costs separate.
TBE_BACKWARD_SHAPES: Tuple[Tuple[int, int], ...] = ((1000, 16384), (4000, 4096), (20000, 16384),
                                                   (300000, 4096), (300000, 16384), (2000, 1024))


def _tbe_backward_s(rows: int, ids: int, device: torch.device, trials: int, dim: int = 64,
                    passes: int = 1) -> Tuple[float, int]:
    """(seconds of the backward + fused update alone, distinct ids) for ``ids`` uniform ids in bags
    of 4 over one ``rows x dim`` table: forward + backward minus forward, each the fastest over
    ``passes`` alternating measurements."""
    table = _TbeTable(rows, dim, device)
    g = torch.Generator().manual_seed(rows * 7 + ids)
    indices = torch.randint(0, rows, (ids,), generator=g, dtype=torch.int64).to(device)
    offsets = torch.arange(0, ids + 1, 4, dtype=torch.int64, device=device)
    grad = torch.ones(offsets.numel() - 1, dim, device=device)

    def fwd() -> None:
        with torch.no_grad():
            table.forward(indices, offsets)

    t_fb, t_f = fastest_over_passes([
        lambda: time_per_call(lambda: table.forward_backward(indices, offsets, grad), device, warmup=2,
                              trials=trials, target_trial_s=0.01, max_inner=20, stat="min"),
        lambda: time_per_call(fwd, device, warmup=2, trials=trials, target_trial_s=0.01, max_inner=50, stat="min"),
    ], passes)
    return max(0.0, t_fb - t_f), int(torch.unique(indices).numel())


def bench_tbe_backward(device: Optional[torch.device] = None, trials: int = 5,
                       shapes: Tuple[Tuple[int, int], ...] = TBE_BACKWARD_SHAPES, passes: int = 1) -> Tuple[float, float]:
    """``(seconds per distinct row, seconds per id)`` of fbgemm's TBE backward with the fused
    row-wise AdaGrad update, as TorchRec's fused kernels run it: :func:`_tbe_backward_s` at
    ``shapes``, non-negative least squares on ``[distinct rows, ids, 1]``. ``(0, 0)`` without
    fbgemm."""
    if not fbgemm_available():
        return 0.0, 0.0
    device = device or torch.device("cpu")
    rows, secs = [], []
    for r, n in shapes:
        t, d = _tbe_backward_s(r, n, device, trials, passes=passes)
        rows.append([float(d), float(n), 1.0])
        secs.append(t)
    x = nonnegative_least_squares(rows, secs)
    return float(x[0]), float(x[1])


def _codec_s(numel: int, device: torch.device, trials: int) -> float:
    """Seconds of one encode + decode of an fp32 tensor of ``numel`` elements by TorchRec's fp16
    quantized-comm codec (what the pooled embeddings' all-to-all runs around the wire with
    ``fwd``/``bwd`` comm precision fp16; TorchRec replaces bf16 by fp16 on gloo)."""
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs

    codec = get_qcomm_codecs(QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16)).forward
    x = torch.randn(max(1, numel // 64), 64, device=device)
    return time_per_call(lambda: codec.decode(codec.encode(x)), device, warmup=2, trials=trials,
                         target_trial_s=0.01, max_inner=50, stat="min")


#: fp32 elements of :func:`bench_codec_byte_s`'s small and large tensors (16 KiB and 8 MiB)
CODEC_SIZES: Tuple[int, int] = (4096, 2 * 1024 * 1024)


def bench_codec_byte_s(device: Optional[torch.device] = None, trials: int = 5, passes: int = 2) -> float:
    """:attr:`HostTermRecord.codec_byte_s`: the fp16 codec's seconds per fp32 byte of a link
    phase's payload as the graph counts it (sent plus received by a rank): half the slope of one
    tensor's encode + decode between a small and a large tensor (a rank encodes what it sends and
    decodes what it receives). 0 when TorchRec's codecs cannot be built here."""
    device = device or torch.device("cpu")
    try:
        from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs  # noqa: F401
    except Exception:  # noqa: BLE001  (an environment without TorchRec's qcomm: no codec cost measured)
        return 0.0
    lo, hi = CODEC_SIZES
    t_hi, t_lo = fastest_over_passes([functools.partial(_codec_s, n, device, trials) for n in (hi, lo)], passes)
    return max(0.0, (t_hi - t_lo) / (4 * (hi - lo))) / 2.0


# -- the sparse-path rewrites' constants ---------------------------------------------------------


@attrs.frozen(kw_only=True)
class RewriteSweep:
    """What :func:`bench_rewrite_constants` measures. ``batch_size``: the total batch of the
    chunked dense steps, split into each of ``chunks`` (fitted) and ``held_out_chunks`` (predicted);
    ``dedup_ids`` x ``unique_ratios``: the dedup kernels' fitted cases, ``held_out_dedup``:
    ``(ids, ratio)`` cases predicted; ``passes``: interleaved sweeps, each case its fastest
    (:func:`fastest_over_passes`); ``trials`` / ``target_trial_s``: :func:`time_per_call`'s."""

    batch_size: int = attrs.field(default=256, validator=positive_int)
    chunks: Tuple[int, ...] = attrs.field(default=(1, 2, 4, 8), converter=tuple)
    held_out_chunks: Tuple[int, ...] = attrs.field(default=(16,), converter=tuple)
    dedup_ids: Tuple[int, ...] = attrs.field(default=(1024, 4096, 16384), converter=tuple)
    unique_ratios: Tuple[float, ...] = attrs.field(default=(0.1, 0.5, 0.9), converter=tuple)
    held_out_dedup: Tuple[Tuple[int, float], ...] = attrs.field(default=((8192, 0.3),),
                                                                converter=lambda v: tuple(tuple(p) for p in v))
    passes: int = attrs.field(default=6, validator=positive_int)
    trials: int = attrs.field(default=3, validator=positive_int)
    target_trial_s: float = attrs.field(default=0.002, validator=positive_seconds)

    def __attrs_post_init__(self) -> None:
        for k in self.chunks + self.held_out_chunks:
            if not (isinstance(k, int) and 1 <= k <= self.batch_size):
                raise ValueError(f"RewriteSweep: chunk count {k!r} must be an int in 1..batch_size ({self.batch_size})")
        if len(set(self.chunks)) < 2 or len(set(self.dedup_ids)) < 2:
            raise ValueError("RewriteSweep: the fits need at least two chunk counts and two id counts")
        for n, r in [(n, r) for n in self.dedup_ids for r in self.unique_ratios] + list(self.held_out_dedup):
            if not (isinstance(n, int) and n >= 2 and 0 < r <= 1):
                raise ValueError(f"RewriteSweep: dedup case ({n!r} ids, ratio {r!r}): ids must be an int >= 2 and "
                                 "the ratio in (0, 1]")

    @classmethod
    def quick(cls) -> "RewriteSweep":
        """A sweep of about a second (tests, ``calibrate kernels --quick``)."""
        return cls(batch_size=64, chunks=(1, 2, 4), held_out_chunks=(8,), dedup_ids=(1024, 4096),
                   unique_ratios=(0.2, 0.8), held_out_dedup=((2048, 0.5),), passes=2, trials=2,
                   target_trial_s=0.001)


#: The dense model of :func:`bench_chunk_steps`: DLRM's shape at the DLRM example's ``small``
#: arch (``dlrm.model.arch_spec``) over 26 features of dim 64 and 13 dense inputs.
CHUNK_MODEL = dict(dense_in=13, features=26, dim=64, bottom=(64, 64), top=(128, 64, 1))


class _DlrmDense(torch.nn.Module):
    """DLRM's dense part in plain torch: a bottom MLP over the dense inputs, the pairwise dot
    interaction of its output with the pooled embeddings (upper triangle, as TorchRec's
    ``InteractionArch``), a top MLP to one logit."""

    def __init__(self, dense_in: int, features: int, dim: int, bottom: Sequence[int], top: Sequence[int]) -> None:
        super().__init__()

        def mlp(widths: Sequence[int], last_relu: bool) -> torch.nn.Sequential:
            layers: List[torch.nn.Module] = []
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
                layers.append(torch.nn.Linear(a, b))
                if last_relu or i + 2 < len(widths):
                    layers.append(torch.nn.ReLU())
            return torch.nn.Sequential(*layers)

        if bottom[-1] != dim:
            raise ValueError(f"the bottom MLP must end at the embedding dim {dim}, got {list(bottom)}")
        self.features, self.dim = features, dim
        self.bottom = mlp([dense_in, *bottom], last_relu=True)
        pairs = (features + 1) * features // 2
        self.top = mlp([dim + pairs, *top], last_relu=False)
        rows, cols = torch.triu_indices(features + 1, features + 1, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        t = torch.cat([x.unsqueeze(1), pooled.view(-1, self.features, self.dim)], dim=1)
        inter = torch.bmm(t, t.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def _chunked_step(model: torch.nn.Module, dense: torch.Tensor, pooled: torch.Tensor, labels: torch.Tensor,
                  chunks: int) -> torch.Tensor:
    """One step of the batch-split pipeline's dense work in ``chunks`` chunks: each chunk's inputs
    sliced, its forward, the chunk losses weighted by their size, one backward, the logits merged."""
    batch = dense.shape[0]
    sizes = [batch // chunks + (1 if j < batch % chunks else 0) for j in range(chunks)]
    loss = dense.new_zeros(())
    logits = []
    for d, p, y in zip(dense.split(sizes), pooled.split(sizes), labels.split(sizes)):
        out = model(d, p)
        loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(out, y) * (y.shape[0] / batch)
        logits.append(out)
    loss.backward()
    return torch.cat(logits).detach()


def bench_chunk_steps(sweep: RewriteSweep, device: Optional[torch.device] = None, seed: int = 0) -> List[ChunkRecord]:
    """A :class:`ChunkRecord` per chunk count of ``sweep``: one forward + backward of
    :data:`CHUNK_MODEL` over ``sweep.batch_size`` samples in k chunks (:func:`_chunked_step`; the
    pooled embeddings a leaf that takes its gradient, as the sharded module's output does), each
    the fastest over ``sweep.passes`` interleaved sweeps."""
    device = device or torch.device("cpu")
    torch.manual_seed(seed)
    cfg = CHUNK_MODEL
    model = _DlrmDense(cfg["dense_in"], cfg["features"], cfg["dim"], cfg["bottom"], cfg["top"]).to(device)
    b = sweep.batch_size
    dense = torch.randn(b, cfg["dense_in"], device=device)
    pooled = torch.randn(b, cfg["features"] * cfg["dim"], device=device, requires_grad=True)
    labels = torch.randint(0, 2, (b,), device=device).float()

    def case(k: int) -> float:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            pooled.grad = None
            _chunked_step(model, dense, pooled, labels, k)

        return time_per_call(step, device, warmup=2, trials=sweep.trials, target_trial_s=sweep.target_trial_s,
                             max_inner=50, stat="min")

    ks = list(sweep.chunks) + [k for k in sweep.held_out_chunks if k not in sweep.chunks]
    secs = fastest_over_passes([functools.partial(case, k) for k in ks], sweep.passes)
    return [ChunkRecord(batch_size=b, chunks=k, seconds=t, held_out=k not in sweep.chunks) for k, t in zip(ks, secs)]


_INVERSE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _dedup_ids(n: int, ratio: float, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """``n`` int64 ids of which ``max(1, round(ratio n))`` are distinct (each at least once), shuffled."""
    distinct = max(1, min(n, round(ratio * n)))
    values = torch.randperm(50 * n, generator=gen)[:distinct]
    ids = torch.cat([values, values[torch.randint(0, distinct, (n - distinct,), generator=gen)]])
    return ids[torch.randperm(n, generator=gen)].to(device)


def _dedup_round_trip(sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """The dedup kernels of one feature as ``runtime.wire_ids`` runs them, for ids arriving from
    ``sources``: per source the sender's ``torch.unique`` with its inverse and the inverse cast
    to the narrowest width; on the receiver the inverse widened, the ids rebuilt
    (``unique[inverse]``) and the sources' distinct ids merged (``torch.unique`` of their
    concatenation, the inverse mapped through it). Returns the rebuilt ids."""
    sent = []
    for ids in sources:
        u, inv = torch.unique(ids, sorted=True, return_inverse=True)
        sent.append((u, inv.to(_INVERSE_DTYPES[inverse_bytes(u.numel())])))
    rebuilt, distinct, inverses, base = [], [], [], 0
    for u, inv in sent:
        wide = inv.long()
        rebuilt.append(u[wide])
        distinct.append(u)
        inverses.append(wide + base)
        base += int(u.numel())
    _merged, back = torch.unique(torch.cat(distinct), sorted=True, return_inverse=True)
    back[torch.cat(inverses)]
    return torch.cat(rebuilt)


def bench_dedup_kernels(sweep: RewriteSweep, device: Optional[torch.device] = None, seed: int = 0) -> List[DedupRecord]:
    """A :class:`DedupRecord` per ``(ids, unique ratio)`` case of ``sweep`` (and each held-out
    case): :func:`_dedup_round_trip` of the ids in two sources' halves (a feature of a rank's batch
    from 2 ranks), each the fastest over ``sweep.passes`` interleaved sweeps."""
    device = device or torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    cases = [(n, r, False) for n in sweep.dedup_ids for r in sweep.unique_ratios]
    cases += [(int(n), float(r), True) for n, r in sweep.held_out_dedup]
    inputs = []
    for n, r, _h in cases:
        ids = _dedup_ids(n, r, device, gen)
        inputs.append((ids[: n // 2], ids[n // 2:]))

    def case(sources: Tuple[torch.Tensor, torch.Tensor]) -> float:
        return time_per_call(lambda: _dedup_round_trip(sources), device, warmup=2, trials=sweep.trials,
                             target_trial_s=sweep.target_trial_s, max_inner=200, stat="min")

    secs = fastest_over_passes([functools.partial(case, x) for x in inputs], sweep.passes)
    return [DedupRecord(ids=n, unique_ratio=r, seconds=t, held_out=h) for (n, r, h), t in zip(cases, secs)]


def bench_rewrite_constants(device: Optional[torch.device] = None, sweep: Optional[RewriteSweep] = None
                            ) -> Tuple[List[ChunkRecord], List[DedupRecord]]:
    """The records of both rewrite constants (:func:`bench_chunk_steps`, :func:`bench_dedup_kernels`;
    a few seconds on one CPU core at the default sweep); the fits are
    :func:`~torchrec_sparselift.calibration.rewrite_fit.fit_chunk_overhead` and
    :func:`~torchrec_sparselift.calibration.rewrite_fit.fit_dedup_id_s`."""
    sweep = sweep or RewriteSweep()
    return bench_chunk_steps(sweep, device), bench_dedup_kernels(sweep, device)


#: The rewrites' sweep of :func:`bench_host_terms` (the step calibration reads it twice and takes
#: the mean): the fitted cases of :class:`RewriteSweep`, four passes, nothing held out (the
#: held-out check is ``calibrate kernels``'), ~1 s per reading on an idle core.
HOST_REWRITE_SWEEP = RewriteSweep(held_out_chunks=(), held_out_dedup=(), passes=4)


def bench_host_terms(device: Optional[torch.device] = None, trials: int = 5, passes: int = 2) -> HostTermRecord:
    """Measure :class:`HostTermRecord` on ``device`` (CPU by default; a few seconds). Each cost is
    the slope between a small and a large case, so fixed per-call costs (the Python call,
    kernel dispatch) do not leak into it; every case's time is its fastest over ``passes``
    interleaved sweeps (:func:`fastest_over_passes`: these are the step fit's floors)."""
    device = device or torch.device("cpu")
    small_n, small = 64, (16, 64)          # many tiny tensors: the per-tensor cost
    big = (16384, 64)                      # one 4 MiB tensor: the per-byte cost
    t_small, t_one_small, t_big = fastest_over_passes(
        [functools.partial(_table_optimizer_step_s, shapes, device, trials) for shapes in ([small] * small_n, [small], [big])],
        passes)
    per_tensor = max(0.0, (t_small - t_one_small) / (small_n - 1))
    big_bytes = big[0] * big[1] * 4
    small_bytes = small[0] * small[1] * 4
    per_byte = max(0.0, (t_big - t_one_small) / max(big_bytes - small_bytes, 1))
    if fbgemm_available() and hasattr(torch.ops.fbgemm, "block_bucketize_sparse_features"):
        lo, hi = 4096, 65536
        t_hi, t_lo = fastest_over_passes([functools.partial(_bucketize_s, n, device, trials) for n in (hi, lo)], passes)
        per_id = max(0.0, (t_hi - t_lo) / (hi - lo))
    else:
        per_id = 0.0
    act_byte_s, inter_flop_s = bench_dense_terms(device, trials, passes=passes)
    row_s, bwd_id_s = bench_tbe_backward(device, trials, passes=passes)
    chunk_records, dedup_records = bench_rewrite_constants(device, HOST_REWRITE_SWEEP)
    return HostTermRecord(chunk_overhead_s=fit_chunk_overhead(chunk_records).slope,
                          dedup_id_s=fit_dedup_id_s(dedup_records).slope,
                          optimizer_tensor_s=per_tensor, optimizer_byte_s=per_byte, bucketize_id_s=per_id,
                          dense_act_byte_s=act_byte_s, interaction_flop_s=inter_flop_s,
                          tbe_row_s=row_s, tbe_bwd_id_s=bwd_id_s,
                          dense_flop_s=bench_dense_flops(device, trials, passes=passes),
                          codec_byte_s=bench_codec_byte_s(device, trials, passes=passes))


def bench_a2a_byte_s(pg: Any, device: Optional[torch.device] = None, trials: int = 15) -> float:
    """``all_to_all_single``'s cost per byte a rank sends or receives on ``pg`` (the quantity the
    sparse-path graph counts on a rank's link): the least-squares slope over per-rank buffers of
    0.25-8 MiB, each timed as the fastest of ``trials`` barrier-separated calls of the slowest rank
    (a loaded 2-core machine only ever adds to a call; the median wandered 3x between runs).
    Every rank of ``pg`` must call it; 0.0 on one rank."""
    import torch.distributed as dist

    device = device or torch.device("cpu")
    world = dist.get_world_size(pg)
    if world < 2:
        return 0.0
    xs, ys = [], []
    for nbytes in (256 * 1024, 1024 * 1024, 4 * 1024 * 1024, 8 * 1024 * 1024):
        numel = max(world, (nbytes // 4) // world * world)
        x = torch.ones(numel, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        for _ in range(2):
            dist.all_to_all_single(y, x, group=pg)
        samples = []
        for _ in range(trials):
            dist.barrier(group=pg)
            _sync(device)
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x, group=pg)
            _sync(device)
            samples.append(time.perf_counter() - t0)
        worst = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pg)
        xs.append(2.0 * numel * 4 * (world - 1) / world)  # sent to the others + received from them
        ys.append(float(min(worst.tolist())))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    return max(0.0, slope)
