"""Shared fixtures. Multi-process tests start their ranks with ``tests/launcher.py``."""

from __future__ import annotations

import os
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


_EXAMPLE_TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "dlrm",
                              "train.py")


@pytest.fixture
def dlrm_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path):
    """``run(argv, **env) -> (exit code, stderr)``: the DLRM example's ``main`` in this process,
    as ``python examples/dlrm/train.py ARGV`` would run it (no stored profiles; ``env`` set, RANK
    unset), without a new interpreter per call. What ``main`` changes in the process's logging is
    put back. One subprocess test per error family keeps the command line's exit path covered."""
    import importlib.util
    import logging
    import sys

    mod = sys.modules.get("dlrm_train_example")
    if mod is None:
        spec = importlib.util.spec_from_file_location("dlrm_train_example", _EXAMPLE_TRAIN)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dlrm_train_example"] = mod
        spec.loader.exec_module(mod)
    names = ["", "torch.fx._symbolic_trace", "torchrec", "torchrec_sparselift"]

    def run(argv, **env):
        monkeypatch.setenv("TORCHREC_SPARSELIFT_PROFILE_DIR", str(tmp_path / "no-profiles"))
        monkeypatch.delenv("RANK", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))
        levels = {n: logging.getLogger(n).level for n in names}
        capsys.readouterr()
        try:
            code = mod.main(list(argv))
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)
        return code, capsys.readouterr().err

    return run
