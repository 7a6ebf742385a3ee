"""A directory of execution plans, reused across runs and safe under concurrent processes.

File layout: ``<directory>/plan-<fingerprint.cache_key()>.json`` (one file per planning input),
plus ``.lock`` files next to them for :meth:`PlanCache.get_or_plan`.

Guarantees:

- **Atomic writes**: a plan is written to a temporary file in the same directory, flushed and
  fsynced, then ``os.replace``-d over the target (:func:`torchrec_sparselift.atomic.write_bytes`).
  Readers see the old file or the new one, never a partial one, whatever other processes do. Plan
  files get the mode the umask gives new files (``0o666 & ~umask``).
- **Never a crash, never a wrong plan**: :meth:`PlanCache.load` returns ``None`` for a missing,
  unreadable, corrupt, truncated, other-schema or mismatching file, for statistics that
  drifted beyond tolerance, or (given the asking :class:`~torchrec_sparselift.plan.PlanRequest`)
  for a plan the request refuses: a pipeline, precision or 2D layout it does not allow, another
  world size, a missing table (:meth:`PlanRequest.refuses`), or a table whose sharding type or
  kernel its constraints and sharders forbid, whose shards do not tile its rows and columns, or
  that sits on ranks outside the topology (:func:`~torchrec_sparselift.plan.loader.stored_plan_problem`).
  The file is read strictly (:mod:`torchrec_sparselift.files`: not UTF-8, invalid JSON, duplicate
  keys, a field of the wrong type, each named). It logs exactly one line saying why
  (``re-planning: ...``). A hit logs one line too (``reusing cached execution plan ...``).
- **One planner at a time** (POSIX): :meth:`PlanCache.get_or_plan` holds an exclusive ``fcntl``
  lock per cache key while it plans, so concurrent processes wait and then reuse the winner's
  plan. A waiter logs one line naming the holder's pid, and waits at most the request's planning
  budget (``PlanRequest.time_budget_s``; ``lock_timeout_s`` without a request, or when smaller);
  then it logs a warning and plans on its own, as if there were no cache: a TorchRec planner is
  expected to return a plan within its budget, and another job sharing the cache directory is no
  reason to fail. Its plan is stored too (atomically; either plan is valid). Never a hang.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Callable, Iterator, Optional, Tuple

from torchrec_sparselift.atomic import flock_until, lock_holder, write_bytes
from torchrec_sparselift.errors import FileFormatError
from torchrec_sparselift.files import decode_utf8, parse_json
from torchrec_sparselift.plan.execution_plan import ExecutionPlan, Fingerprint
from torchrec_sparselift.plan.loader import stored_plan_problem
from torchrec_sparselift.plan.request import PlanRequest
from torchrec_sparselift.semantics.workload import WorkloadStats

try:  # POSIX only; without it get_or_plan still works, just without cross-process exclusion.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["PlanCache", "logger"]

logger = logging.getLogger("torchrec_sparselift.plan.cache")


class PlanCache:
    """Execution plans on disk, keyed by :meth:`Fingerprint.cache_key`.

    Args:
        directory: created if missing. Share it between runs (and ranks/hosts on a shared
            filesystem that supports ``os.replace`` atomically, e.g. local disk or NFSv4).
        lock_timeout_s: the longest :meth:`get_or_plan` waits for another process planning the
            same inputs before planning itself; with a ``request`` it waits at most the
            request's ``time_budget_s``.
    """

    def __init__(self, directory: "os.PathLike[str] | str", lock_timeout_s: float = 900.0) -> None:
        self.directory = os.fspath(directory)
        if not (isinstance(lock_timeout_s, (int, float)) and lock_timeout_s >= 0):
            raise ValueError(f"PlanCache(lock_timeout_s=...) must be a number >= 0, got {lock_timeout_s!r}")
        self.lock_timeout_s = float(lock_timeout_s)
        os.makedirs(self.directory, exist_ok=True)

    def __repr__(self) -> str:
        return f"PlanCache({self.directory!r})"

    def path_for(self, fingerprint: Fingerprint) -> str:
        """Where the plan for ``fingerprint`` lives (whether or not it exists)."""
        return os.path.join(self.directory, f"plan-{fingerprint.cache_key()}.json")

    # ------------------------------------------------------------------------------------------
    # reading
    # ------------------------------------------------------------------------------------------

    def _lookup(
        self, fingerprint: Fingerprint, stats: Optional[WorkloadStats], drift_tolerance: float,
        request: Optional[PlanRequest] = None,
    ) -> Tuple[Optional[ExecutionPlan], str, int]:
        """(plan or None, reason / hit description, log level). Never raises for file problems."""
        path = self.path_for(fingerprint)
        name = os.path.basename(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None, f"re-planning: no cached plan {name} in {self.directory}", logging.INFO
        except OSError as e:
            return None, f"re-planning: cannot read cached plan {path}: {e}", logging.WARNING
        try:
            plan = ExecutionPlan.from_dict(parse_json(decode_utf8(raw, what=""), what=""))
        except FileFormatError as e:  # PlanFormatError too; the cache re-plans, so no "to fix"
            why = str(e).split("; to fix:")[0]
            why = why if why.startswith("is ") else f"is unusable: {why}"
            return None, f"re-planning: cached plan {path} {why}", logging.WARNING
        except Exception as e:  # noqa: BLE001 - anything in a file must not crash training
            return None, f"re-planning: cached plan {path} is unusable: {type(e).__name__}: {e}", logging.WARNING

        stored = plan.fingerprint
        why = stored.mismatch(fingerprint)
        if why is not None:
            return None, f"re-planning: cached plan {name} does not match: {why}", logging.INFO
        refused = None if request is None else (request.refuses(plan) or stored_plan_problem(request, plan))
        if refused is not None:
            return None, f"re-planning: cached plan {name} does not fit this request: {refused}", logging.WARNING
        if stored.stats_digest == fingerprint.stats_digest:
            return plan, f"reusing cached execution plan {path}: {plan.summary()}", logging.INFO
        if plan.stats is None:
            return None, (
                f"re-planning: cached plan {name} has no statistics and this run has statistics"
            ), logging.INFO
        if fingerprint.stats_digest is None:
            return None, (
                f"re-planning: cached plan {name} was planned with statistics and this run has none"
            ), logging.INFO
        if stats is None:
            return None, (
                f"re-planning: workload statistics changed since cached plan {name} (pass stats= to "
                "reuse plans within the drift tolerance)"
            ), logging.INFO
        drift = plan.stats.drift(stats)
        if math.isinf(drift):
            return None, (
                f"re-planning: workload statistics of cached plan {name} cover other features"
            ), logging.INFO
        if drift > drift_tolerance:
            return None, (
                f"re-planning: workload statistics drifted by {drift:.1%} "
                f"(tolerance {drift_tolerance:.1%}) since cached plan {name}"
            ), logging.INFO
        return plan, (
            f"reusing cached execution plan {path} (statistics drift {drift:.1%} within "
            f"{drift_tolerance:.1%}): {plan.summary()}"
        ), logging.INFO

    @staticmethod
    def _check_args(fingerprint: Fingerprint, stats: Optional[WorkloadStats], drift_tolerance: float,
                    request: Optional[PlanRequest] = None) -> None:
        if not isinstance(fingerprint, Fingerprint):
            raise TypeError(f"fingerprint must be a Fingerprint, got {type(fingerprint).__name__}")
        if request is not None and not isinstance(request, PlanRequest):
            raise TypeError(f"request must be a PlanRequest, got {type(request).__name__}")
        if not (isinstance(drift_tolerance, (int, float)) and drift_tolerance >= 0):
            raise ValueError(f"drift_tolerance must be a number >= 0, got {drift_tolerance!r}")
        if stats is not None and stats.digest() != fingerprint.stats_digest:
            raise ValueError(
                "stats do not match fingerprint.stats_digest: build the fingerprint with "
                "fingerprint_inputs(..., stats=stats) for the same statistics"
            )

    def load(
        self,
        fingerprint: Fingerprint,
        stats: Optional[WorkloadStats] = None,
        drift_tolerance: float = 0.2,
        request: Optional[PlanRequest] = None,
    ) -> Optional[ExecutionPlan]:
        """The cached plan for ``fingerprint``, or ``None`` (after one log line saying why).

        A plan is reused when its fingerprint equals ``fingerprint`` in everything but the
        statistics, its statistics are identical or (given ``stats``) drifted by at most
        ``drift_tolerance`` (see :meth:`WorkloadStats.drift`), and ``request`` (if given) does not
        refuse it (:meth:`PlanRequest.refuses`). Never raises for file problems.
        """
        self._check_args(fingerprint, stats, drift_tolerance, request)
        plan, message, level = self._lookup(fingerprint, stats, drift_tolerance, request)
        logger.log(level, message)
        return plan

    # ------------------------------------------------------------------------------------------
    # writing
    # ------------------------------------------------------------------------------------------

    def store(self, plan: ExecutionPlan) -> str:
        """Write ``plan`` atomically (temp file, fsync, ``os.replace``); return its path.

        Raises ``OSError`` if the directory is not writable (callers decide whether that matters).
        """
        if not isinstance(plan, ExecutionPlan):
            raise TypeError(f"PlanCache.store needs an ExecutionPlan, got {type(plan).__name__}")
        data = plan.to_json(indent=1).encode("utf-8")
        path = self.path_for(plan.fingerprint)
        write_bytes(path, data, prefix=".tmp-", suffix=".json", fsync=True)
        logger.debug("stored execution plan %s", path)
        return path

    # ------------------------------------------------------------------------------------------
    # load or plan, one planner at a time
    # ------------------------------------------------------------------------------------------

    def _lock_path(self, fingerprint: Fingerprint) -> str:
        return self.path_for(fingerprint)[: -len(".json")] + ".lock"

    @contextlib.contextmanager
    def _exclusive(self, fingerprint: Fingerprint, wait_s: float) -> Iterator[bool]:
        """Hold the per-key lock; yields False (unlocked) after waiting ``wait_s`` or without fcntl.

        The holder writes its pid into the lock file so that a waiter can name it. Waiting logs
        one line when it starts and one when it gives up."""
        if fcntl is None:
            yield False
            return
        lock_path = self._lock_path(fingerprint)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            def waiting() -> None:
                logger.info("plan cache: another process (%s) is planning the same inputs into %s; waiting "
                            "up to %.1f s for its plan", lock_holder(fd), lock_path, wait_s)

            try:
                held = flock_until(fd, time.monotonic() + wait_s, on_wait=waiting)
            except OSError as e:
                logger.warning("plan cache lock %s unavailable (%s); planning without it", lock_path, e)
                yield False
                return
            if not held:
                logger.warning("plan cache: %s still holds %s after %.1f s; planning without waiting further "
                               "(the plan is still stored)", lock_holder(fd), lock_path, wait_s)
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def get_or_plan(
        self,
        fingerprint: Fingerprint,
        plan_fn: Callable[[], ExecutionPlan],
        stats: Optional[WorkloadStats] = None,
        drift_tolerance: float = 0.2,
        request: Optional[PlanRequest] = None,
    ) -> Tuple[ExecutionPlan, bool]:
        """Return ``(plan, hit)``: the cached plan (``hit=True``, ``plan_fn`` not called) or a
        fresh one from ``plan_fn()`` stored for next time (``hit=False``).

        Logs exactly one line for the decision (``reusing ...`` or ``re-planning: ...``). While one
        process plans, others asking for the same key wait on a lock and then reuse its plan.
        ``plan_fn`` must return a plan whose fingerprint equals ``fingerprint``. A failure to write
        the cache is logged as a warning and the fresh plan is still returned. With ``request``, a
        stored plan the request refuses (:meth:`PlanRequest.refuses`,
        :func:`~torchrec_sparselift.plan.loader.stored_plan_problem`) is re-planned too.

        Waiting for another process's lock is bounded by ``request.time_budget_s`` (and
        ``lock_timeout_s``): one log line when the wait starts (naming the holder's pid), one
        warning if it ends unanswered; then this process plans without the lock (never an error:
        planning must not fail because another job shares the cache).
        """
        self._check_args(fingerprint, stats, drift_tolerance, request)
        plan, message, level = self._lookup(fingerprint, stats, drift_tolerance, request)
        if plan is not None:
            logger.log(level, message)
            return plan, True
        # Miss: decide again under the lock and log only that decision.
        wait_s = self.lock_timeout_s if request is None else min(self.lock_timeout_s, request.time_budget_s)
        with self._exclusive(fingerprint, wait_s):
            # Someone else may have planned while we waited for the lock.
            again, message2, level2 = self._lookup(fingerprint, stats, drift_tolerance, request)
            if again is not None:
                logger.log(level2, message2 + " (planned by another process)")
                return again, True
            logger.log(level2, message2)
            fresh = plan_fn()
            if not isinstance(fresh, ExecutionPlan):
                raise TypeError(f"plan_fn must return an ExecutionPlan, got {type(fresh).__name__}")
            if fresh.fingerprint != fingerprint:
                raise ValueError(
                    "plan_fn returned a plan for another fingerprint "
                    f"({fingerprint.mismatch(fresh.fingerprint) or 'statistics differ'}); build it "
                    "with the fingerprint passed to get_or_plan"
                )
            try:
                self.store(fresh)
            except OSError as e:
                logger.warning("could not store execution plan in %s: %s", self.directory, e)
            return fresh, False


