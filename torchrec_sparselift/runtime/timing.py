"""Steady-state step time, measured and set against the plan's prediction.

::

    timer = StepTimer(device, warmup_steps=5, predicted_s=plan.prediction.step_time_s, plan=plan.summary())
    for _ in range(steps):
        with timer.step():
            pipeline.progress(batches)
    record = timer.record(pg=pg)        # logs measured/predicted; slowest rank when pg is given
    save_records("steps.json", [record])

A step is timed by the wall clock between step boundaries; on CUDA each boundary first
synchronizes the device, so a step's time includes the kernels it queued. The first
``warmup_steps`` steps (pipeline fill, allocator and kernel warm-up) are left out. Inside a step,
``timer.stage(name)`` times a part of a hand-written loop (forward, backward, optimizer): with CUDA
events on GPU (no synchronization inside the step), with the wall clock on CPU.

A 2D plan with periodic replica sync pays the sync on one step in ``sync_interval``: the median
step would leave it out (at interval 4, three steps in four are sync-free). With ``period`` (the
sync interval; :meth:`Lifted.step_timer` sets it) the steady step is the median over consecutive
windows of ``period`` steps of their mean, each window holding one sync
(:func:`steady_step_s`). A train pipeline's
internal stages are interleaved across batches and are not separable this way; time its
``progress()`` as one step.

:class:`StepRecord` is the export: plan description, predicted and measured seconds, plus spread
and stage means; plain JSON for the calibration and ``explain`` code.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import attrs
import torch
import torch.distributed as dist

from torchrec_sparselift.atomic import write_json
from torchrec_sparselift.files import Fields, load_json, read_attrs
__all__ = [
    "StepRecord",
    "StepStats",
    "StepTimer",
    "step_stats",
    "steady_step_s",
    "save_records",
    "load_records",
]

logger = logging.getLogger(__name__)

RECORD_SCHEMA = "sparselift.step_records/1"


@attrs.frozen(kw_only=True)
class StepStats:
    """Summary of steady-state step durations (seconds)."""

    steps: int
    median_s: float
    mean_s: float
    min_s: float
    max_s: float
    stdev_s: float


def steady_step_s(durations_s: Sequence[float], period: int = 1) -> float:
    """The steady step of ``durations_s`` (seconds, in order, non-empty): their median for
    ``period`` 1; else the median of the means of consecutive windows of ``period`` steps (a step
    in ``period`` pays a periodic cost, the 2D replica sync: each whole window holds one),
    leftover steps after the last whole window left out. Fewer steps than ``period``: their mean
    (the caller should time at least one window)."""
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ValueError(f"period must be a positive number of steps, got {period!r}")
    values = [float(d) for d in durations_s]
    if not values:
        raise ValueError("no steady-state steps to summarise: run more steps than warmup_steps")
    if period == 1:
        return statistics.median(values)
    windows = [statistics.fmean(values[i:i + period]) for i in range(0, len(values) - period + 1, period)]
    return statistics.median(windows) if windows else statistics.fmean(values)


def step_stats(durations_s: Sequence[float], period: int = 1) -> StepStats:
    """Median (:func:`steady_step_s` over windows of ``period`` steps), mean, extremes and sample
    standard deviation of ``durations_s`` (non-empty)."""
    if not durations_s:
        raise ValueError("no steady-state steps to summarise: run more steps than warmup_steps")
    values = [float(d) for d in durations_s]
    return StepStats(
        steps=len(values),
        median_s=steady_step_s(values, period),
        mean_s=statistics.fmean(values),
        min_s=min(values),
        max_s=max(values),
        stdev_s=statistics.stdev(values) if len(values) > 1 else 0.0,
    )


def _stages(value: Any) -> Tuple[Tuple[str, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple((str(k), float(v)) for k, v in items)


@attrs.frozen(kw_only=True)
class StepRecord:
    """One measurement: a plan's predicted vs measured steady-state step time.

    ``measured_s`` is the median steady-state step (the slowest rank's when recorded with a
    process group); ``stages`` the mean seconds per named stage per step.
    """

    plan: str
    predicted_s: Optional[float]
    measured_s: float = attrs.field()
    mean_s: float
    stdev_s: float
    steps: int
    warmup_steps: int
    device: str
    world_size: int = 1
    stages: Tuple[Tuple[str, float], ...] = attrs.field(default=(), converter=_stages)

    @measured_s.validator
    def _positive(self, attribute: "attrs.Attribute[float]", value: float) -> None:
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"StepRecord.measured_s must be a finite time >= 0 s, got {value!r}")

    @property
    def ratio(self) -> Optional[float]:
        """measured / predicted (>1: slower than predicted); None without a positive prediction."""
        if not self.predicted_s:
            return None
        return self.measured_s / self.predicted_s

    def summary(self) -> str:
        """One log line."""
        pred = "no prediction" if self.predicted_s is None else f"predicted {self.predicted_s * 1e3:.3f} ms"
        ratio = "" if self.ratio is None else f", measured/predicted {self.ratio:.2f}"
        return (
            f"{self.plan or 'plan'}: measured {self.measured_s * 1e3:.3f} ms/step "
            f"(median of {self.steps}, +-{self.stdev_s * 1e3:.3f} ms) vs {pred}{ratio} on {self.device} x{self.world_size}"
        )

    def to_dict(self) -> Dict[str, Any]:
        d = attrs.asdict(self)
        d["stages"] = dict(self.stages)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> "StepRecord":
        """The record :meth:`to_dict` wrote (a dict, or a file's reader: :func:`~torchrec_sparselift.files.read_attrs`)."""
        return read_attrs(cls, data, kinds={"plan": str, "predicted_s": float, "measured_s": float, "mean_s": float,
                                            "stdev_s": float, "steps": int, "warmup_steps": int, "device": str,
                                            "world_size": int})


class StepTimer:
    """Times training steps; see the module docstring.

    ``device``: where the step runs (CUDA is synchronized at step boundaries).
    ``warmup_steps``: leading steps excluded from every statistic.
    ``predicted_s`` / ``plan``: the prediction to compare with and its label.
    ``period``: steps per periodic cost (a 2D plan's sync interval): the measured step is the
    median of window means (:func:`steady_step_s`).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        warmup_steps: int = 5,
        predicted_s: Optional[float] = None,
        plan: str = "",
        period: int = 1,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if predicted_s is not None and not predicted_s >= 0:
            raise ValueError(f"predicted_s must be None or >= 0 seconds, got {predicted_s}")
        self.device = torch.device(device)
        self.warmup_steps = warmup_steps
        self.predicted_s = predicted_s
        self.plan = plan
        steady_step_s([0.0], period)  # checks period
        self.period = period
        self._durations: List[float] = []
        self._cpu_durations: List[float] = []
        self._stage_totals: Dict[str, float] = {}
        self._pending_events: List[Tuple[str, Any, Any]] = []
        self._in_step = False

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    @property
    def steps_timed(self) -> int:
        """All steps timed so far, warm-up included."""
        return len(self._durations)

    @property
    def steady_durations_s(self) -> List[float]:
        """Durations of the steps after warm-up, in order."""
        return list(self._durations[self.warmup_steps :])

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one step (not reentrant). A step that raises (e.g. StopIteration) is not recorded."""
        if self._in_step:
            raise RuntimeError("StepTimer.step() is already open: steps do not nest")
        self._in_step = True
        self._pending_events = []
        try:
            self._sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            yield
            self._sync()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        finally:
            self._in_step = False
        warm = len(self._durations) >= self.warmup_steps
        self._durations.append(elapsed)
        self._cpu_durations.append(cpu)
        for name, begin, end in self._pending_events:
            if warm:
                self._stage_totals[name] = self._stage_totals.get(name, 0.0) + begin.elapsed_time(end) / 1e3
        self._pending_events = []

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a named part of the open step (CUDA events on GPU, wall clock on CPU)."""
        if not self._in_step:
            raise RuntimeError("StepTimer.stage() must be used inside StepTimer.step()")
        warm = len(self._durations) >= self.warmup_steps
        if self._cuda:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self._pending_events.append((name, begin, end))
            return
        start = time.perf_counter()
        yield
        if warm:
            self._stage_totals[name] = self._stage_totals.get(name, 0.0) + time.perf_counter() - start

    def time_pipeline(self, pipeline: Any, dataloader_iter: Iterator[Any], steps: int) -> int:
        """Run up to ``steps`` ``pipeline.progress`` calls, each timed as a step; returns steps run."""
        done = 0
        for _ in range(steps):
            try:
                with self.step():
                    pipeline.progress(dataloader_iter)
            except StopIteration:
                break
            done += 1
        return done

    def _max_over_ranks(self, values: Sequence[float], pg: dist.ProcessGroup) -> List[float]:
        """Element-wise maximum of ``values`` over the ranks of ``pg`` (every rank calls it)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        if dist.get_backend(pg) == "nccl":
            t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        return [float(x) for x in t.cpu()]

    def slowest_rank_cpu_durations_s(self, pg: Optional[dist.ProcessGroup] = None) -> List[float]:
        """The process CPU seconds of every step timed so far (warm-up included, in order), the
        largest over the ranks of ``pg`` (this rank's own without ``pg``; every rank must call it):
        with the wall-clock durations they tell waiting from computing."""
        return self._max_over_ranks(self._cpu_durations, pg) if pg is not None else list(self._cpu_durations)

    def slowest_rank_durations_s(self, pg: Optional[dist.ProcessGroup] = None) -> List[float]:
        """Every step timed so far, warm-up included, in order, as long as its slowest rank of
        ``pg`` took (this rank's own without ``pg``; every rank of ``pg`` must call this, having
        timed as many steps)."""
        return self._max_over_ranks(self._durations, pg) if pg is not None else list(self._durations)

    def record(self, pg: Optional[dist.ProcessGroup] = None, log: bool = True) -> StepRecord:
        """The steady-state measurement, logged (INFO) with its measured/predicted ratio unless
        ``log`` is False (a benchmark that records every run of every round).

        With ``pg``, every rank of ``pg`` must call this; all get the slowest rank's median and mean
        (a synchronous step is as slow as its slowest participant) and ``world_size`` is pg's size.
        """
        stats = step_stats(self.steady_durations_s, self.period)
        median, mean, world = stats.median_s, stats.mean_s, 1
        if pg is not None:
            median, mean = self._max_over_ranks([median, mean], pg)
            world = dist.get_world_size(pg)
        stages = {k: v / stats.steps for k, v in sorted(self._stage_totals.items())}
        rec = StepRecord(
            plan=self.plan,
            predicted_s=self.predicted_s,
            measured_s=median,
            mean_s=mean,
            stdev_s=stats.stdev_s,
            steps=stats.steps,
            warmup_steps=self.warmup_steps,
            device=str(self.device.type),
            world_size=world,
            stages=stages,
        )
        if log:
            logger.info("sparselift step time: %s", rec.summary())
        return rec


def save_records(path: str, records: Sequence[StepRecord]) -> None:
    """Write ``records`` as versioned JSON, atomically (a reader never sees a partial file)."""
    payload = {"schema": RECORD_SCHEMA, "records": [r.to_dict() for r in records]}
    write_json(path, payload, prefix=".steps-", sort_keys=True)


def load_records(path: str) -> List[StepRecord]:
    """Read records written by :func:`save_records`;
    :class:`~torchrec_sparselift.errors.FileFormatError` (a ``ValueError``) naming the file and the
    field (``records[2]``) for another schema or anything unreadable or malformed."""
    f = Fields(load_json(path, "step records", top=dict), file=path, what="step records")
    schema = f.data.get("schema")
    if schema != RECORD_SCHEMA:
        raise f.fail("schema", f"is {schema!r}, not {RECORD_SCHEMA!r}: not a step records file",
                     "write one with torchrec_sparselift.runtime.timing.save_records")
    return [StepRecord.from_dict(r) for r in f.objs("records")]
