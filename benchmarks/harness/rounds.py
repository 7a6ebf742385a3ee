"""Interleaved rounds and the timed loop.

Interleaved rounds: every run once per round, the order rotated by one each round, so no run
always goes first or last (a position in the round measured up to ~5% apart for identical plans
on this machine) and a slow stretch of the machine hits every run alike. The timed loop: a
barrier (every rank starts together), then each step inside ``StepTimer.step()``; the statistics
are the slowest rank's (a synchronous step is as slow as its slowest participant)."""

from __future__ import annotations

import gc
from typing import Any, Callable, Iterator, List, Optional, Sequence, TypeVar

import torch.distributed as dist

from torchrec_sparselift.runtime.timing import StepTimer

__all__ = ["rotated", "interleaved_rounds", "timed_steps", "Cycle"]

T = TypeVar("T")


def rotated(items: Sequence[T], round_index: int) -> List[T]:
    """``items`` starting at ``round_index`` modulo their number (round 0: as given)."""
    if not items:
        return []
    k = round_index % len(items)
    return list(items[k:]) + list(items[:k])


def interleaved_rounds(items: Sequence[T], measure: Callable[[T, int], None], rounds: int,
                       more: Optional[Callable[[int], bool]] = None,
                       after_round: Optional[Callable[[int], None]] = None) -> int:
    """Call ``measure(item, round)`` for every item, ``rounds`` rounds, each round's order rotated
    (:func:`rotated`); then more rounds while ``more(rounds done)`` says so. ``after_round(rounds
    done)`` after each round (progress lines). Returns the rounds run."""
    done = 0
    while done < rounds or (more is not None and more(done)):
        for item in rotated(items, done):
            measure(item, done)
        done += 1
        if after_round is not None:
            after_round(done)
    return done


def timed_steps(step: Callable[[], Any], steps: int, pg: Any, device: Any, warmup: int = 0,
                untimed: int = 0, period: int = 1, plan: Optional[str] = None, collect: bool = False,
                on_step: Optional[Callable[[Any], None]] = None) -> StepTimer:
    """``untimed`` calls of ``step()`` (outside the timer), a barrier over ``pg``, then ``warmup +
    steps`` calls each timed by one :class:`StepTimer` (its first ``warmup`` steps left out of its
    statistics; ``period``: a step of a 2D plan is timed over whole sync intervals). ``collect``:
    a garbage collection before the barrier. ``on_step(step's return value)`` after each timed step,
    outside the timed region. Returns the timer: ``timer.record(pg, log=False)`` is the slowest
    rank's statistics, ``timer.slowest_rank_durations_s(pg)`` every step's (collectives: every rank
    calls them)."""
    for _ in range(untimed):
        step()
    timer = StepTimer(device, warmup_steps=warmup, plan=plan, period=period)
    if collect:
        gc.collect()
    dist.barrier(group=pg)
    for _ in range(warmup + steps):
        with timer.step():
            out = step()
        if on_step is not None:
            on_step(out)
    return timer


class Cycle:
    """``batches`` cycled for ever (a kept model's pipeline prefetches from it across rounds)."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches, self.i = batches, 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b
