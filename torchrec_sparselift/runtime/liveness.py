"""Which rank failed when a collective fails: each rank's last finished step in the job's store.

A lost rank shows to the others only as a collective that fails: at once where its connections
close (a killed process: gloo's "Connection reset by peer [address]"), after the process group's
timeout where they do not (a host or link gone, a hung process: "Timed out waiting ...ms"). Neither
message names the rank. :class:`StepHeartbeat` records each rank's last finished step in the
rendezvous store the process group was built on (one small ``set`` per step). After a failure each
surviving rank says so in the store (:meth:`StepHeartbeat.alive`), waits a few seconds for the
others to say so too, and :func:`collective_failure` names the ranks that did not (the lost ones)
with their last finished step, or the store itself where it cannot be reached (its host is gone).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Dict, List, Optional

import attrs
import torch.distributed as dist

__all__ = ["StepHeartbeat", "CollectiveFailure", "is_collective_failure", "collective_failure"]

#: Messages of a collective that lost a peer (gloo, NCCL, the c10d store).
_LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Timed out waiting|timed out|timeout caused pair closure|"
                        r"Broken pipe|NCCL communicator was aborted|Socket Timeout|Connection refused|"
                        r"No route to host|Network is unreachable", re.IGNORECASE)


class CollectiveFailure(RuntimeError):
    """A collective failed because a rank, its host or its link was lost (the message names which)."""


def is_collective_failure(exc: BaseException) -> bool:
    """``exc`` is a collective (or the job's store) failing because a peer was lost."""
    return isinstance(exc, RuntimeError) and bool(_LOST_PEER.search(str(exc)))


@attrs.define
class StepHeartbeat:
    """Rank ``rank``'s last finished step, kept under ``prefix`` in ``store`` (the process group's)."""

    store: Any
    rank: int
    world_size: int
    prefix: str = "sparselift/last_step"
    last_beat_s: Optional[float] = None  # time.monotonic() of this rank's last beat

    @classmethod
    def of_default_group(cls) -> "StepHeartbeat":
        """The heartbeat of this rank in the default process group's store."""
        store = dist.distributed_c10d._get_default_store()
        return cls(store=store, rank=dist.get_rank(), world_size=dist.get_world_size())

    def beat(self, step: int) -> None:
        """Record that this rank finished ``step``."""
        self.store.set(f"{self.prefix}/{self.rank}", str(int(step)))
        self.last_beat_s = time.monotonic()

    def last_steps(self) -> Dict[int, Optional[int]]:
        """Each rank's last recorded step (None: none yet). Raises the store's error when the
        store cannot be reached."""
        return {r: self._read(f"{self.prefix}/{r}") for r in range(self.world_size)}

    def alive(self, grace_s: float = 5.0) -> List[int]:
        """After a failure: say this rank is alive, wait up to ``grace_s`` for every rank to say
        so, and return the ranks that did (the others are the lost ones)."""
        self.store.set(f"{self.prefix}/alive/{self.rank}", "1")
        deadline = time.monotonic() + grace_s
        while True:
            alive = [r for r in range(self.world_size) if self.store.check([f"{self.prefix}/alive/{r}"])]
            if len(alive) == self.world_size or time.monotonic() >= deadline:
                return alive
            time.sleep(0.1)

    def _read(self, key: str) -> Optional[int]:
        return int(self.store.get(key).decode()) if self.store.check([key]) else None


def collective_failure(exc: BaseException, heartbeat: StepHeartbeat, timeout_s: float,
                       grace_s: float = 5.0) -> Optional[str]:
    """One message naming what was lost when ``exc`` is a lost-peer failure
    (:func:`is_collective_failure`), else None: the ranks that do not say they are alive within
    ``grace_s`` (:meth:`StepHeartbeat.alive`), with their last finished step, or the store's host
    where the store cannot be read. ``timeout_s``: the process group's, for the message."""
    if not is_collective_failure(exc):
        return None
    first = " ".join(str(exc).split())[:300]
    since = (f", {time.monotonic() - heartbeat.last_beat_s:.1f} s after this rank's last finished step"
             if heartbeat.last_beat_s is not None else "")
    how = ("its connections closed (a process killed)" if re.search("by peer|Broken pipe", first, re.I)
           else f"no answer within the collective timeout of {timeout_s:g} s (a host, a link or a process gone)")
    # the roll call in a thread of its own: a store whose host is cut off can block a call far
    # longer than any timeout (TCP retrying a send), so it gets grace_s + 5 s and is then given up
    box: Dict[str, Any] = {}

    def roll_call() -> None:
        try:
            box["alive"] = heartbeat.alive(grace_s)
            box["steps"] = heartbeat.last_steps()
        except Exception as e:  # noqa: BLE001 - the store's own host may be the one lost
            box["error"] = e

    caller = threading.Thread(target=roll_call, name="sparselift-roll-call", daemon=True)
    caller.start()
    caller.join(grace_s + 5.0)
    if "steps" not in box:
        e = box.get("error")
        said = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}" if e is not None else "no answer"
        return (f"rank {heartbeat.rank}: a collective failed{since}, {how}, and the job's store cannot be reached "
                f"either ({said}): the host of the rendezvous store (rank 0's) is gone or cut off from this rank. "
                f"gloo said: {first}")
    alive, steps = box["alive"], box["steps"]
    lost = [r for r in range(heartbeat.world_size) if r not in alive]
    if lost:
        lead = "lost " + ", ".join(f"rank {r} (last finished step {steps[r]})" for r in lost)
    else:
        lead = "every rank is still alive (a link that dropped and came back too late?)"
    return (f"rank {heartbeat.rank}: a collective failed{since}, {how}: {lead}; this rank finished step "
            f"{steps.get(heartbeat.rank)}. Resume from the last checkpoint (--checkpoint-dir; torchrun "
            f"--max-restarts N restarts by itself). gloo said: {first}")
