"""The step under batch-split pipelining: k chunks of the output and gradient all-to-alls against
the dense work of the other chunks (pure functions of a step's phase times).

The schedule (``runtime.batch_split.TrainPipelineBatchSplit``; docs/overlap.md section 10), per rank,
times from the lookup's end:

* **forward**: the lookups run once; the k chunks' output collectives are issued at once and the
  link carries them one after the other, chunk j arriving at ``a_j = (j + 1) * o`` with
  ``o = latency + (output_dist - latency) / k`` (the cost model's ``output_dist`` holds one call's
  latency and the transfer; a chunk pays the latency again and a k-th of the transfer). Chained
  (the runtime's ``chain_chunks`` order) chunk j+1 leaves when chunk j is read:
  ``a_{j+1} = max(r_j, a_j) + o`` with ``r_j`` the time chunk j's forward asks for it. Chunk j's
  dense forward runs its independent part (DLRM's bottom MLP, ``dense_fwd_indep / k``), waits for
  ``a_j``, then runs the rest (``dense_fwd_rest / k``); every chunk after the first pays
  ``chunk_dense = chunk_overhead + chunk_feature * features`` (its dense calls' fixed cost: kernel
  launches, the framework's per-call work, and per feature of the split module the cut of its
  keyed embeddings into per-feature tensors and their gradients' merge).
* **backward** (one autograd pass, the last chunk first): chunk c's dense backward down to its
  embeddings' gradient (``dense_bwd_rest / k``), the gradient collective of chunk c issued
  (``g = latency + (grad_dist - latency) / k`` on the link, after the previous chunk's), chunk c's
  independent backward (``dense_bwd_indep / k``), then chunk c-1's. Chained, chunk c's request
  node was created after chunk c-1's wait, so the autograd engine runs it (it waits for chunk c's
  gradient) after chunk c-1's dependent backward and before chunk c-1's gradient is issued: each
  gradient leaves when the previous one has arrived, and the main thread waits for it.
* **end**: the TBE backward with its fused update runs once when the dense backward is done and
  every chunk's gradient has arrived; the dense all-reduce runs beside it (as under ``overlap``),
  or after it on hardware without overlap (``SplitTerms.allreduce_after_update``: CPU gloo, where
  the ``overlap`` kind across hosts pays it after the embedding backward,
  ``cost.pipelines._allreduce_after_update``).

With k = 1 this is the ``overlap`` kind's composition (``cost.pipelines._STEPS["overlap"]``; with
``allreduce_after_update``, ``backward_update + allreduce`` in place of their maximum)::

    step = max(input_dist, uvm_fetch + lookup + max(output_dist, dense_fwd_indep) + dense_fwd_rest
               + dense_bwd_rest + max(grad_dist, dense_bwd_indep) + max(backward_update, allreduce)
               + step_overhead)

and for every k the step is at least ``max(compute, communication)`` (the compute runs on one
flow, the chunks on one link) and at most the unsplit step plus ``k`` times the per-chunk cost
(``2 * latency + chunk_dense``); ``tests/test_batch_split_cost.py`` checks the three.
:func:`choose_chunks` picks k in 1..16 by price (the smallest on ties).

:class:`SplitTermsBatch` holds the terms of many rows at once (one rank's loads per row, as
``cost.model.phase_table`` prices them) and :func:`split_step_batch` is :func:`split_step_s` at one
k over every row in one numpy pass (the search's moves price candidate placements with it;
``tests/test_split_moves.py`` checks it equals :func:`split_step_s` row by row).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.model import CostContext, collective_calls, phase_table, phase_times
from torchrec_sparselift.cost.pipelines import PHASE_NAMES
from torchrec_sparselift.cost.pipelines import terms as _exposed_terms

__all__ = [
    "MAX_CHUNKS",
    "BATCH_SPLIT_PIPELINE",
    "SplitTerms",
    "chunk_dense_s",
    "chunk_link_latency_s",
    "chunk_latency_within",
    "pooled_features",
    "ChunkTimes",
    "SplitSchedule",
    "split_schedule",
    "split_step_s",
    "SplitTermsBatch",
    "split_step_batch",
    "unsplit_step_s",
    "choose_chunks",
]

#: the most chunks the runtime splits a step into (``runtime.batch_split.MAX_CHUNKS``)
MAX_CHUNKS = 16
#: the pipeline kind whose step batch split chunks (k = 1 is that kind's step)
BATCH_SPLIT_PIPELINE = "overlap"


def _seconds(instance: object, attribute: "attrs.Attribute[float]", value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite time >= 0 in seconds, "
                         f"got {value!r}")


def _count(instance: object, attribute: "attrs.Attribute[int]", value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be an int >= 0, got {value!r}")


def chunk_dense_s(profile: Any, features: int) -> Optional[float]:
    """One more batch chunk's dense cost on ``profile`` for split modules of ``features``
    features: ``chunk_overhead_s + chunk_feature_s * features`` (``chunk_feature_s`` None prices
    as 0); None where ``chunk_overhead_s`` is not calibrated."""
    if isinstance(features, bool) or not isinstance(features, int) or features < 0:
        raise ValueError(f"batch split: features must be an int >= 0, got {features!r}")
    overhead = getattr(profile, "chunk_overhead_s", None)
    if overhead is None:
        return None
    return float(overhead) + float(getattr(profile, "chunk_feature_s", None) or 0.0) * features


def chunk_link_latency_s(profile: Any, world_size: int, comm_groups: int) -> float:
    """What one chunk's output (or gradient) collectives add to the link beyond their bytes: the
    link's own latency per call (``profile.link_latency_s``, at most ``collective_latency_s``; all
    of ``collective_latency_s`` where it is not measured) times the calls (one per sharding group
    that sends, ``cost.model.collective_calls``); 0 on one rank. The rest of a call's fitted
    latency is work on the rank's own thread, which the step calibration measures in the
    per-chunk price (``chunk_overhead_s``: the measured per-chunk slope less the model's)."""
    if world_size <= 1:
        return 0.0
    lat = float(profile.collective_latency_s)
    link = getattr(profile, "link_latency_s", None)
    if link is not None:
        lat = min(lat, float(link))
    return lat * collective_calls("output_dist", comm_groups)


def chunk_latency_within(profile: Any, world_size: int, comm_groups: int, output_dist_s: Any,
                         grad_dist_s: Any) -> Any:
    """:func:`chunk_link_latency_s`, at most the unsplit output and gradient collectives' times (a
    float or, given arrays, one value per row): one chunk's ``SplitTerms.chunk_latency_s``."""
    return np.minimum(np.minimum(chunk_link_latency_s(profile, world_size, comm_groups), output_dist_s), grad_dist_s)


def pooled_features(handles: Any) -> int:
    """The features of the pooled tables among ``handles`` (``TableHandle``s): what a batch chunk
    cuts per feature (``chunk_feature_s``)."""
    return sum(len(h.spec.feature_names) for h in handles if h.spec.is_pooled)


def _s() -> float:
    return attrs.field(default=0.0, validator=_seconds, converter=float)  # type: ignore[no-any-return]


@attrs.frozen(kw_only=True)
class SplitTerms:
    """One rank's phase times of a step (seconds, the cost model's phases: ``cost.pipelines.PHASES``)
    and the per-chunk costs.

    ``chunk_latency_s``: the fixed part of one chunk's output (and of one chunk's gradient)
    collective: ``collective_latency_s`` times the sharding groups whose outputs travel (one
    collective each), so at most ``output_dist_s`` and ``grad_dist_s``. ``chunk_overhead_s``: the
    dense forward and backward's fixed cost per extra chunk (their calls' kernel launches and
    framework work, independent of the chunk's size), ``chunk_feature_s`` what it adds per feature
    of the split modules, ``features`` their feature count: one more chunk's dense cost is
    :attr:`chunk_dense_s` (``HardwareProfile.chunk_overhead_s`` / ``chunk_feature_s``).
    ``allreduce_s`` is the all-reduce's part that ``dense_bwd`` does not hide
    (``cost.pipelines.terms``: ``allreduce'``); ``allreduce_after_update``: it runs after the
    embedding backward instead of beside it (hardware without overlap: ``supports_overlap``
    False)."""

    input_dist_s: float = _s()
    uvm_fetch_s: float = _s()
    lookup_s: float = _s()
    output_dist_s: float = _s()
    dense_fwd_indep_s: float = _s()
    dense_fwd_rest_s: float = _s()
    dense_bwd_rest_s: float = _s()
    dense_bwd_indep_s: float = _s()
    grad_dist_s: float = _s()
    backward_update_s: float = _s()
    allreduce_s: float = _s()
    step_overhead_s: float = _s()
    chunk_latency_s: float = _s()
    chunk_overhead_s: float = _s()
    chunk_feature_s: float = _s()
    features: int = attrs.field(default=0, validator=_count)
    allreduce_after_update: bool = attrs.field(default=False, converter=bool)

    def __attrs_post_init__(self) -> None:
        for name in ("output_dist_s", "grad_dist_s"):
            if self.chunk_latency_s > getattr(self, name) and getattr(self, name) > 0:
                raise ValueError(
                    f"SplitTerms.chunk_latency_s={self.chunk_latency_s} exceeds {name}={getattr(self, name)}: the "
                    "collective's time includes its latency once; give the per-call latency times the "
                    "sharding groups that send")

    @classmethod
    def from_phases(cls, phases: Mapping[str, float], *, chunk_latency_s: float, chunk_overhead_s: float,
                    chunk_feature_s: float = 0.0, features: int = 0,
                    supports_overlap: bool = True) -> "SplitTerms":
        """From a rank's phase times (``cost.model.phase_times``: names of ``cost.pipelines.PHASES``;
        the dense parts ``dense_*_indep`` / ``dense_*_rest``, or the wholes ``dense_fwd`` /
        ``dense_bwd`` read as all dependent; the all-reduce as ``cost.pipelines.terms`` exposes it
        under ``supports_overlap``, and after the embedding backward without it). ``KeyError`` naming
        a missing phase."""
        def get(name: str) -> float:
            if name not in phases:
                raise KeyError(f"batch split terms need phase {name!r}; the phases given are {sorted(phases)}")
            return float(phases[name])

        def part(whole: str, indep: str, rest: str) -> Tuple[float, float]:
            if indep in phases and rest in phases:
                return get(indep), get(rest)
            return 0.0, get(whole)

        fi, fr = part("dense_fwd", "dense_fwd_indep", "dense_fwd_rest")
        bi, br = part("dense_bwd", "dense_bwd_indep", "dense_bwd_rest")
        return cls(
            input_dist_s=get("input_dist"), uvm_fetch_s=phases.get("uvm_fetch", 0.0), lookup_s=get("lookup"),
            output_dist_s=get("output_dist"), dense_fwd_indep_s=fi, dense_fwd_rest_s=fr, dense_bwd_rest_s=br,
            dense_bwd_indep_s=bi, grad_dist_s=get("grad_dist"), backward_update_s=get("backward_update"),
            allreduce_s=float(_exposed_terms({"allreduce": get("allreduce"), "dense_bwd": get("dense_bwd")},
                                             supports_overlap)["allreduce"]),
            step_overhead_s=phases.get("step_overhead", 0.0),
            chunk_latency_s=chunk_latency_s, chunk_overhead_s=chunk_overhead_s, chunk_feature_s=chunk_feature_s,
            features=features, allreduce_after_update=not supports_overlap,
        )

    @classmethod
    def from_cost_model(cls, colmax: Any, allreduce_bytes: float, comm_groups: int, ctx: CostContext, *,
                        chunk_overhead_s: float, chunk_feature_s: float = 0.0, features: int = 0,
                        fwd_precision: str = "fp32", bwd_precision: str = "fp32") -> "SplitTerms":
        """The terms of one rank's loads (``colmax``, as ``cost.model.phase_times`` takes them) under
        the ``overlap`` kind: its phase times, and what one chunk's collectives add to the link
        (:func:`chunk_link_latency_s`)."""
        phases = phase_times(colmax, allreduce_bytes, comm_groups, ctx, fwd_precision, bwd_precision,
                             BATCH_SPLIT_PIPELINE)
        per_chunk = float(chunk_latency_within(ctx.profile, ctx.world_size, comm_groups, phases["output_dist"],
                                               phases["grad_dist"]))
        return cls.from_phases(phases, chunk_latency_s=per_chunk, chunk_overhead_s=chunk_overhead_s,
                               chunk_feature_s=chunk_feature_s, features=features,
                               supports_overlap=ctx.profile.supports_overlap)

    @property
    def compute_s(self) -> float:
        """The compute part: what one flow runs whatever the overlap (the unsplit dense work)."""
        return (self.uvm_fetch_s + self.lookup_s + self.dense_fwd_indep_s + self.dense_fwd_rest_s
                + self.dense_bwd_rest_s + self.dense_bwd_indep_s + self.backward_update_s + self.step_overhead_s)

    @property
    def comm_s(self) -> float:
        """The communication part: the output and gradient collectives, unsplit, on one link."""
        return self.output_dist_s + self.grad_dist_s

    @property
    def chunk_dense_s(self) -> float:
        """One more chunk's dense cost: ``chunk_overhead_s + chunk_feature_s * features``."""
        return self.chunk_overhead_s + self.chunk_feature_s * self.features

    @property
    def per_chunk_s(self) -> float:
        """What one more chunk costs at most: its two collectives' latency and its dense cost."""
        return 2 * self.chunk_latency_s + self.chunk_dense_s


@attrs.frozen
class ChunkTimes:
    """One chunk's times (seconds from the step's start): its embeddings' arrival, its forward's
    wait for them (exposed output transfer), its gradient collective's issue and arrival."""

    arrival_s: float
    fwd_wait_s: float
    grad_issue_s: float
    grad_arrival_s: float


@attrs.frozen
class SplitSchedule:
    """The schedule of one step under k chunks: per chunk (:class:`ChunkTimes`, chunk order), the
    dense backward's compute end (its waits for gradients left out), when the embedding backward
    starts (every gradient in), the step, and the main thread's waits for gradients in total."""

    chunks: Tuple[ChunkTimes, ...]
    dense_end_s: float
    emb_bwd_start_s: float
    step_s: float
    grad_wait_s: float = 0.0
    terms: Optional[SplitTerms] = attrs.field(default=None, eq=False, repr=False)

    @property
    def exposed_output_s(self) -> float:
        """The forward's waits for its chunks' embeddings, in total."""
        return sum(c.fwd_wait_s for c in self.chunks)

    @property
    def exposed_grad_s(self) -> float:
        """The main thread's waits for the chunks' gradients (chained: between chunks too)."""
        return self.grad_wait_s

    def describe(self) -> Tuple[str, ...]:
        """One line per chunk (ms from the step's start: what the link hides and what the step
        waits for), then the gradients' exposed wait and the step, then what one more chunk
        costs (its collectives' latency and its dense cost, per feature of the split modules)."""
        lines = tuple(
            f"chunk {j}: embeddings in at {c.arrival_s * 1e3:.2f} ms, forward waits {c.fwd_wait_s * 1e3:.2f} ms; "
            f"gradient out at {c.grad_issue_s * 1e3:.2f} ms, in at {c.grad_arrival_s * 1e3:.2f} ms"
            for j, c in enumerate(self.chunks))
        lines += (f"gradients exposed {self.exposed_grad_s * 1e3:.2f} ms after the dense backward; "
                  f"step {self.step_s * 1e3:.2f} ms",)
        t = self.terms
        if t is not None:
            lines += (f"each extra chunk: {t.per_chunk_s * 1e3:.3f} ms (collective latency 2 x "
                      f"{t.chunk_latency_s * 1e3:.3f} ms, dense {t.chunk_overhead_s * 1e3:.3f} ms + "
                      f"{t.chunk_feature_s * 1e6:.1f} us x {t.features} features)",)
        return lines


def split_schedule(terms: SplitTerms, k: int, chained: bool = False) -> SplitSchedule:
    """The step of ``terms`` split into ``k`` chunks (module docstring); k = 1 is the unsplit step.
    ``chained``: chunk j+1's collective is issued when chunk j's embeddings are read (the runtime's
    ``chain_chunks``), not with the others before the forward (its default, on CPU over a
    one-thread gloo group so the chunks travel one at a time, as on NCCL)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_CHUNKS:
        raise ValueError(f"batch split: k must be an int in 1..{MAX_CHUNKS}, got {k!r}")
    t = terms
    lat = t.chunk_latency_s
    per_out = min(lat, t.output_dist_s) + max(0.0, t.output_dist_s - lat) / k
    per_grad = min(lat, t.grad_dist_s) + max(0.0, t.grad_dist_s - lat) / k
    start = t.uvm_fetch_s + t.lookup_s
    arrivals = [start + (j + 1) * per_out for j in range(k)]
    fwd = start
    waits = []
    for j in range(k):
        ready = fwd + t.dense_fwd_indep_s / k + (t.chunk_dense_s if j else 0.0)
        waits.append(max(0.0, arrivals[j] - ready))
        if chained and j + 1 < k:  # chunk j+1 leaves when chunk j is read
            arrivals[j + 1] = max(ready, arrivals[j]) + per_out
        fwd = max(ready, arrivals[j]) + t.dense_fwd_rest_s / k
    clock, link, grad_wait = fwd, -math.inf, 0.0
    issue, arrive = [0.0] * k, [0.0] * k
    if not chained:
        for c in reversed(range(k)):  # the autograd pass runs the last chunk first
            clock += t.dense_bwd_rest_s / k
            issue[c] = clock
            link = max(link, clock) + per_grad
            arrive[c] = link
            clock += t.dense_bwd_indep_s / k
        emb = max(clock, link)
        grad_wait = emb - clock
    else:  # chunk c's request node waits for its gradient before chunk c-1's is issued
        clock += t.dense_bwd_rest_s / k
        for c in reversed(range(k)):
            issue[c] = clock
            arrive[c] = clock + per_grad
            clock += t.dense_bwd_indep_s / k + (t.dense_bwd_rest_s / k if c else 0.0)
            grad_wait += max(0.0, arrive[c] - clock)
            clock = max(clock, arrive[c])
        emb = clock
    step = max(t.input_dist_s, emb + _tail(t) + t.step_overhead_s)
    chunks = tuple(ChunkTimes(arrivals[j], waits[j], issue[j], arrive[j]) for j in range(k))
    return SplitSchedule(chunks=chunks, dense_end_s=emb - grad_wait, emb_bwd_start_s=emb, step_s=step,
                         grad_wait_s=grad_wait, terms=terms)


def _tail(t: Any) -> Any:
    """The embedding backward and the dense all-reduce at the step's end: side by side, or one
    after the other (``allreduce_after_update``); floats or arrays."""
    if t.allreduce_after_update:
        return t.backward_update_s + t.allreduce_s
    return np.maximum(t.backward_update_s, t.allreduce_s)


def split_step_s(terms: SplitTerms, k: int, chained: bool = False) -> float:
    """The step's seconds under ``k`` chunks (``chained``: :func:`split_schedule`)."""
    return split_schedule(terms, k, chained).step_s


def unsplit_step_s(terms: SplitTerms) -> float:
    """The ``overlap`` kind's step (its composition, written out): the batch-split step at k = 1."""
    t = terms
    return max(t.input_dist_s,
               t.uvm_fetch_s + t.lookup_s + max(t.output_dist_s, t.dense_fwd_indep_s) + t.dense_fwd_rest_s
               + t.dense_bwd_rest_s + max(t.grad_dist_s, t.dense_bwd_indep_s)
               + _tail(t) + t.step_overhead_s)


def choose_chunks(terms: SplitTerms, batch_size: Optional[int] = None, max_chunks: int = MAX_CHUNKS,
                  chained: bool = False) -> int:
    """The k in 1..``max_chunks`` (at most ``batch_size``, the samples per rank) whose step is the
    shortest; the smallest such k on ties, so a split that wins nothing is not taken.
    ``chained``: the runtime's ``chain_chunks`` order (:func:`split_schedule`)."""
    top = min(max_chunks, MAX_CHUNKS, batch_size if batch_size is not None else MAX_CHUNKS)
    if top < 1:
        raise ValueError(f"batch split: no k to choose from (max_chunks={max_chunks}, batch_size={batch_size})")
    best_k, best = 1, split_step_s(terms, 1)
    for k in range(2, top + 1):
        step = split_step_s(terms, k, chained)
        if step < best:
            best_k, best = k, step
    return best_k


def _rows(instance: object, attribute: "attrs.Attribute[np.ndarray]", value: np.ndarray) -> None:
    if value.ndim != 1 or not np.all(np.isfinite(value)) or np.any(value < 0):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a 1-D array of finite times >= 0 "
                         f"in seconds (one per row), got {value!r}")


def _a() -> np.ndarray:
    return attrs.field(validator=_rows, converter=lambda v: np.atleast_1d(np.asarray(v, dtype=float)))  # type: ignore[no-any-return]


@attrs.frozen(kw_only=True, eq=False)
class SplitTermsBatch:
    """The :class:`SplitTerms` of many rows at once: each field an array with one value per row
    (seconds; a field of one value stands for every row), with one more chunk's dense cost given
    as ``chunk_dense_s`` (:attr:`SplitTerms.chunk_dense_s`). Built from a phase table
    (:meth:`from_phase_table`), a cost model's loads (:meth:`from_cost_model`) or scalar terms
    (:meth:`from_terms`); :func:`split_step_batch` prices it."""

    input_dist_s: np.ndarray = _a()
    uvm_fetch_s: np.ndarray = _a()
    lookup_s: np.ndarray = _a()
    output_dist_s: np.ndarray = _a()
    dense_fwd_indep_s: np.ndarray = _a()
    dense_fwd_rest_s: np.ndarray = _a()
    dense_bwd_rest_s: np.ndarray = _a()
    dense_bwd_indep_s: np.ndarray = _a()
    grad_dist_s: np.ndarray = _a()
    backward_update_s: np.ndarray = _a()
    allreduce_s: np.ndarray = _a()
    step_overhead_s: np.ndarray = _a()
    chunk_latency_s: np.ndarray = _a()
    chunk_dense_s: np.ndarray = _a()
    #: the all-reduce after the embedding backward, for every row (:attr:`SplitTerms.allreduce_after_update`)
    allreduce_after_update: bool = attrs.field(default=False, converter=bool)

    def __attrs_post_init__(self) -> None:
        sizes = {len(getattr(self, n)) for n in _ROW_FIELDS} - {1}
        if len(sizes) > 1:
            raise ValueError(f"SplitTermsBatch: every field needs one value per row (or one for all rows), "
                             f"got lengths {sorted(sizes)}")
        for name in ("output_dist_s", "grad_dist_s"):
            whole = getattr(self, name)
            bad = (self.chunk_latency_s > whole) & (whole > 0)
            if np.any(bad):
                raise ValueError(
                    f"SplitTermsBatch.chunk_latency_s exceeds {name} in row(s) {np.nonzero(bad)[0].tolist()[:5]}: "
                    "the collective's time includes its latency once; give the per-call latency times the "
                    "sharding groups that send")

    @property
    def rows(self) -> int:
        """The number of rows (1 where every field holds one value)."""
        return max(len(getattr(self, n)) for n in _ROW_FIELDS)

    @classmethod
    def from_terms(cls, terms: Sequence[SplitTerms]) -> "SplitTermsBatch":
        """One row per :class:`SplitTerms` of ``terms`` (in order)."""
        if not terms:
            raise ValueError("SplitTermsBatch.from_terms: give at least one SplitTerms")
        after = {bool(t.allreduce_after_update) for t in terms}
        if len(after) > 1:
            raise ValueError("SplitTermsBatch.from_terms: the terms disagree on allreduce_after_update; "
                             "batch terms of one hardware profile")
        return cls(**{n: [getattr(t, n) for t in terms] for n in _ROW_FIELDS}, allreduce_after_update=after.pop())

    @classmethod
    def from_phase_table(cls, table: np.ndarray, *, chunk_latency_s: Any, chunk_dense_s: Any,
                         supports_overlap: bool = True) -> "SplitTermsBatch":
        """From a phase table (rows x ``cost.pipelines.PHASE_NAMES`` seconds, as
        ``cost.model.phase_table`` returns): row i is ``SplitTerms.from_phases`` of row i's phases."""
        tab = np.atleast_2d(np.asarray(table, dtype=float))
        if tab.shape[1] != len(PHASE_NAMES):
            raise ValueError(f"SplitTermsBatch.from_phase_table: the table needs {len(PHASE_NAMES)} columns "
                             f"(cost.pipelines.PHASE_NAMES), got {tab.shape[1]}")
        col = {name: tab[:, i] for i, name in enumerate(PHASE_NAMES)}
        zero = np.zeros(tab.shape[0])

        def part(whole: str, indep: str, rest: str) -> Tuple[np.ndarray, np.ndarray]:
            if indep in col and rest in col:
                return col[indep], col[rest]
            return zero, col[whole]

        fi, fr = part("dense_fwd", "dense_fwd_indep", "dense_fwd_rest")
        bi, br = part("dense_bwd", "dense_bwd_indep", "dense_bwd_rest")
        return cls(
            input_dist_s=col["input_dist"], uvm_fetch_s=col.get("uvm_fetch", zero), lookup_s=col["lookup"],
            output_dist_s=col["output_dist"], dense_fwd_indep_s=fi, dense_fwd_rest_s=fr, dense_bwd_rest_s=br,
            dense_bwd_indep_s=bi, grad_dist_s=col["grad_dist"], backward_update_s=col["backward_update"],
            allreduce_s=_exposed_terms({"allreduce": col["allreduce"], "dense_bwd": col["dense_bwd"]},
                                       supports_overlap)["allreduce"],
            step_overhead_s=col.get("step_overhead", zero), chunk_latency_s=chunk_latency_s,
            chunk_dense_s=chunk_dense_s, allreduce_after_update=not supports_overlap,
        )

    @classmethod
    def from_cost_model(cls, colmax_rows: np.ndarray, allreduce_bytes: float, comm_groups: int, ctx: CostContext, *,
                        chunk_overhead_s: float, chunk_feature_s: float = 0.0, features: int = 0,
                        fwd_precision: str = "fp32", bwd_precision: str = "fp32") -> "SplitTermsBatch":
        """Row i is ``SplitTerms.from_cost_model(colmax_rows[i], ...)``: the ``overlap`` kind's
        phases of each row of loads (one ``cost.model.phase_table`` call) and what one chunk's
        collectives add to the link (:func:`chunk_link_latency_s`)."""
        tab = phase_table(np.atleast_2d(np.asarray(colmax_rows, dtype=float)), allreduce_bytes, comm_groups, ctx,
                          fwd_precision, bwd_precision, BATCH_SPLIT_PIPELINE)
        return cls.from_overlap_table(tab, comm_groups, ctx, chunk_overhead_s=chunk_overhead_s,
                                      chunk_feature_s=chunk_feature_s, features=features)

    @classmethod
    def from_overlap_table(cls, tab: np.ndarray, comm_groups: int, ctx: CostContext, *, chunk_overhead_s: float,
                           chunk_feature_s: float = 0.0, features: int = 0) -> "SplitTermsBatch":
        """:meth:`from_cost_model` on an ``overlap`` phase table already built (``cost.model.phase_table``
        under ``BATCH_SPLIT_PIPELINE``): what one chunk's collectives add to the link
        (:func:`chunk_link_latency_s`) and :meth:`from_phase_table`."""
        tab = np.atleast_2d(np.asarray(tab, dtype=float))
        per_chunk = chunk_latency_within(ctx.profile, ctx.world_size, comm_groups,
                                         tab[:, PHASE_NAMES.index("output_dist")], tab[:, PHASE_NAMES.index("grad_dist")])
        dense = float(chunk_overhead_s) + float(chunk_feature_s) * features
        return cls.from_phase_table(tab, chunk_latency_s=per_chunk, chunk_dense_s=dense,
                                    supports_overlap=ctx.profile.supports_overlap)


def split_step_batch(terms: SplitTermsBatch, k: int, chained: bool = False) -> np.ndarray:
    """:func:`split_step_s` of every row of ``terms`` under ``k`` chunks (one value per row): the
    schedule of :func:`split_schedule` step by step on arrays, in its order of operations."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_CHUNKS:
        raise ValueError(f"batch split: k must be an int in 1..{MAX_CHUNKS}, got {k!r}")
    t = terms
    lat = t.chunk_latency_s
    per_out = np.minimum(lat, t.output_dist_s) + np.maximum(0.0, t.output_dist_s - lat) / k
    per_grad = np.minimum(lat, t.grad_dist_s) + np.maximum(0.0, t.grad_dist_s - lat) / k
    start = t.uvm_fetch_s + t.lookup_s
    fi, fr = t.dense_fwd_indep_s / k, t.dense_fwd_rest_s / k
    br, bi = t.dense_bwd_rest_s / k, t.dense_bwd_indep_s / k
    fwd = start
    arrival = start + 1 * per_out
    for j in range(k):
        ready = fwd + fi + (t.chunk_dense_s if j else 0.0)
        if not chained and j:
            arrival = start + (j + 1) * per_out
        got = np.maximum(ready, arrival)
        if chained and j + 1 < k:  # chunk j+1 leaves when chunk j is read
            arrival = got + per_out
        fwd = got + fr
    clock = fwd
    if not chained:
        link = np.full_like(clock, -np.inf)
        for _ in range(k):  # the autograd pass runs the last chunk first
            clock = clock + br
            link = np.maximum(link, clock) + per_grad
            clock = clock + bi
        emb = np.maximum(clock, link)
    else:  # chunk c's request node waits for its gradient before chunk c-1's is issued
        clock = clock + br
        for c in reversed(range(k)):
            arrive = clock + per_grad
            clock = clock + (bi + br if c else bi)
            clock = np.maximum(clock, arrive)
        emb = clock
    return np.maximum(t.input_dist_s, emb + _tail(t) + t.step_overhead_s)


#: The per-row (array) fields of :class:`SplitTermsBatch`.
_ROW_FIELDS: Tuple[str, ...] = tuple(a.name for a in attrs.fields(SplitTermsBatch) if a.name != "allreduce_after_update")
