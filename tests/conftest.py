"""Shared fixtures. Multi-process tests start their ranks with ``tests/launcher.py``."""

from __future__ import annotations

import time

import pytest


class FakeClock:
    """A clock that moves only when told: ``advance(s)``, or ``time.sleep(s)`` while installed."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.slept: list = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """``time.perf_counter``, ``time.monotonic`` and ``time.sleep`` on a :class:`FakeClock` for
    the test: timed code sees exactly the durations the test sets, whatever the machine's load."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(time, "monotonic", clock)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    return clock
