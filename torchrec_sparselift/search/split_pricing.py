"""The search's price of the batch split (``cost.batch_split``) on a plan and on the moves.

A plan under the ``overlap`` pipeline, where the problem allows the split
(``PlanningProblem.split_overhead_s`` not None), is priced at k chunks as its unsplit step less
what k chunks win on the split schedule, never above the unsplit step and never below the split's
floor (``search.equation.SPLIT_FLOOR_PATHS``, the paths the bound's rows take):

    price_k = min(step, max(step - (split_step(1) - split_step(k)), floor))

:func:`split_price` takes k from ``cost.batch_split.choose_chunks`` (the best k: what the search
compares pipelines and final candidates on), :func:`split_price_at` at a given k, and
:class:`SplitMovePrice` at a FIXED k over many rows of column maxima at once (one numpy pass,
``cost.batch_split.split_step_batch``): the local search's moves price with it
(:func:`move_pricing`), so a move that only helps the split step (more output traffic the chunks
hide, less all-reduce) is taken. That pass runs once the moves priced at the unsplit step have
converged (``search.place.local_search``); its k is the incumbent plan's best k, chosen when the
pass starts and chosen again after every round that applies a move.
"""

from __future__ import annotations

from typing import Optional, Tuple

import attrs
import numpy as np

from torchrec_sparselift.cost.batch_split import (
    BATCH_SPLIT_PIPELINE, MAX_CHUNKS, SplitTerms, SplitTermsBatch, choose_chunks, split_step_batch, split_step_s,
)
from torchrec_sparselift.cost.evaluator import PlanEvaluator
from torchrec_sparselift.cost.model import CostContext, phase_table, step_total_of_table
from torchrec_sparselift.search.equation import SPLIT_FLOOR_PATHS, split_floor_s
from torchrec_sparselift.search.problem import PlanningProblem

__all__ = ["split_terms", "split_price", "split_price_at", "split_floor_terms", "split_price_rows",
           "SplitMovePrice", "move_pricing"]


def split_terms(ev: PlanEvaluator, chunk_overhead_s: float, chunk_feature_s: float = 0.0,
                features: int = 0) -> SplitTerms:
    """The batch-split terms of ``ev``'s plan (its loads under the ``overlap`` kind and its comm
    precisions): ``SplitTerms.from_cost_model``, the one construction the search and the rewrite
    stage price the split on. One more chunk's dense cost: ``chunk_overhead_s + chunk_feature_s *
    features`` (the search passes that sum as ``chunk_overhead_s``)."""
    # (the incremental loads may hold a rounding residue below 0 where a table left: -1e-20 s)
    return SplitTerms.from_cost_model(np.maximum(ev.colmax(), 0.0), max(0.0, ev.allreduce_bytes), ev.comm_groups, ev.ctx,
                                      chunk_overhead_s=chunk_overhead_s, chunk_feature_s=chunk_feature_s,
                                      features=features, fwd_precision=ev.fwd_precision,
                                      bwd_precision=ev.bwd_precision)


def split_price_at(step_s: float, terms: SplitTerms, k: int) -> float:
    """The step of a plan whose unsplit ``overlap`` step is priced ``step_s`` (the pipeline's
    composition with its measured step factor) split into ``k`` chunks: ``step_s`` less what k
    chunks win on the split schedule (``split_step_s(terms, 1) - split_step_s(terms, k)``), never
    above ``step_s`` and never below the largest path of ``search.equation.SPLIT_FLOOR_PATHS`` on
    ``terms`` (what the bound's rows take, so the bound stays below this price at every k).
    ``step_s`` itself at k = 1."""
    if k == 1:
        return float(step_s)
    saved = max(0.0, split_step_s(terms, 1) - split_step_s(terms, k))
    return float(min(step_s, max(step_s - saved, split_floor_terms(terms))))


def split_price(step_s: float, terms: SplitTerms, batch_size: Optional[int] = None) -> Tuple[int, float]:
    """``(k, step)``: the chunk count ``cost.batch_split.choose_chunks`` picks for ``terms`` and
    :func:`split_price_at` at that k. ``(1, step_s)`` where no k > 1 wins."""
    k = choose_chunks(terms, batch_size)
    return k, split_price_at(step_s, terms, k)


def split_floor_terms(terms: SplitTerms) -> float:
    """``search.equation.split_floor_s`` on split terms: the least step any k reaches."""
    return split_floor_s({name: getattr(terms, name + "_s") for path in SPLIT_FLOOR_PATHS for name in path})


def _floor_rows(terms: SplitTermsBatch) -> np.ndarray:
    """:func:`split_floor_terms` of every row (the paths summed in their order)."""
    best = None
    for path in SPLIT_FLOOR_PATHS:
        total = 0.0
        for name in path:
            total = total + getattr(terms, name + "_s")
        best = total if best is None else np.maximum(best, total)
    return np.asarray(best, dtype=float)


def split_price_rows(step_s: np.ndarray, terms: SplitTermsBatch, k: int) -> np.ndarray:
    """:func:`split_price_at` of every row: ``step_s[i]`` (the unsplit steps) with row i of
    ``terms``, all at ``k`` chunks."""
    step = np.asarray(step_s, dtype=float)
    if k == 1:
        return step
    saved = np.maximum(0.0, split_step_batch(terms, 1) - split_step_batch(terms, k))
    return np.minimum(step, np.maximum(step - saved, _floor_rows(terms)))


def _chunks(instance: object, attribute: "attrs.Attribute[int]", value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHUNKS:
        raise ValueError(f"SplitMovePrice.k must be an int in 1..{MAX_CHUNKS}, got {value!r}")


def _time(instance: object, attribute: "attrs.Attribute[float]", value: float) -> None:
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"SplitMovePrice.{attribute.name} must be a finite time >= 0 in seconds, got {value!r}")


@attrs.frozen
class SplitMovePrice:
    """The moves' objective under the split ``overlap`` pipeline at a fixed ``k``: for rows of
    column maxima (peers' share included; ``PlanEvaluator.row_price``'s signature), each row's
    :func:`split_price_at` at ``k``, with its terms as :func:`split_terms` builds them (one more
    chunk's dense cost ``chunk_overhead_s``) and its unsplit step ``cost.model.step_total_batch``.
    One ``cost.model.phase_table`` per call gives both the unsplit step and the split terms
    (``SplitTermsBatch.from_overlap_table``); a second one, on the loads clamped at 0, only where a
    load or the all-reduce holds a rounding residue below 0."""

    ctx: CostContext
    k: int = attrs.field(validator=_chunks)
    chunk_overhead_s: float = attrs.field(converter=float, validator=_time)
    fwd_precision: str
    bwd_precision: str

    def __call__(self, colmax_rows: np.ndarray, allreduce_bytes: float, groups: int) -> np.ndarray:
        rows = np.atleast_2d(np.asarray(colmax_rows, dtype=float))
        ctx, pipe = self.ctx, BATCH_SPLIT_PIPELINE
        table = phase_table(rows, allreduce_bytes, groups, ctx, self.fwd_precision, self.bwd_precision, pipe)
        step = step_total_of_table(table, ctx, pipe)
        if self.k == 1:
            return step
        clamped, ar = np.maximum(rows, 0.0), max(0.0, allreduce_bytes)
        if ar != allreduce_bytes or np.any(clamped != rows):  # a rounding residue below 0: its own table
            table = phase_table(clamped, ar, groups, ctx, self.fwd_precision, self.bwd_precision, pipe)
        terms = SplitTermsBatch.from_overlap_table(table, groups, ctx, chunk_overhead_s=self.chunk_overhead_s)
        return split_price_rows(step, terms, self.k)


def move_pricing(ev: PlanEvaluator, prob: PlanningProblem) -> Optional[SplitMovePrice]:
    """What ``ev``'s moves price under (``PlanEvaluator.row_price``): the split at the best k of
    ``ev``'s plan (``choose_chunks`` on :func:`split_terms`) where ``prob`` allows the split and
    ``ev``'s pipeline is ``overlap``; None (the pipeline's step) otherwise."""
    if prob.split_overhead_s is None or ev.pipeline != BATCH_SPLIT_PIPELINE:
        return None
    k = choose_chunks(split_terms(ev, prob.split_overhead_s), prob.ctx.batch_size)
    return SplitMovePrice(ev.ctx, k, prob.split_overhead_s, ev.fwd_precision, ev.bwd_precision)
