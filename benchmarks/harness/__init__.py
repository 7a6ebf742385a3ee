"""What every benchmark of this repository shares.

- :mod:`.worker`: one rank's setup (process group, threads, seeds, quiet logs, core pinning) and
  the exit of a torchrun worker.
- :mod:`.rounds`: interleaved rounds (every run once per round, the order rotated each round, so
  machine drift hits every run alike) and the timed loop (a barrier, then
  :class:`~torchrec_sparselift.runtime.timing.StepTimer` around each step; the slowest rank's
  statistics).
- :mod:`.stats`: spreads, paired ratios, geometric means.
- :mod:`.report`: the one JSON report writer (command line, date, git commit, machine, results).
"""

from benchmarks.harness.report import machine, report_header, write_report
from benchmarks.harness.rounds import Cycle, interleaved_rounds, rotated, timed_steps
from benchmarks.harness.stats import geomean, median_step, paired_ratio, spread
from benchmarks.harness.worker import exit_now, names_arg, quiet, start_worker, stop_worker, worker

__all__ = ["machine", "report_header", "write_report", "Cycle", "interleaved_rounds", "rotated", "timed_steps",
           "geomean", "median_step", "paired_ratio", "spread", "exit_now", "names_arg", "quiet",
           "start_worker", "stop_worker", "worker"]
