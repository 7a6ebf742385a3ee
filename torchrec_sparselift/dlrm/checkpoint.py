"""Checkpoint and resume for the DLRM example, with ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint directory::

    DIR/step_00000008/      DCP files: every rank's shards of the model and optimizer state
    DIR/latest.json         {"schema", "step", "path", "config"}: written last, atomically, by rank 0

A checkpoint is taken after step ``step`` (1-based count of completed steps). It holds the
sharded model state (``model.state_dict()``: sharded tables as ShardedTensors, dense and
data-parallel weights replicated) and the optimizer state (the fused embedding optimizer's
sharded row-wise AdaGrad state plus the dense optimizer's, through TorchRec's
``KeyedOptimizer.state_dict()``). The data position needs no state of its own: the synthetic
batches are a function of (seed, rank, step), so ``step`` says where to continue.

``latest.json`` is replaced only after every rank finished writing, so a crash while saving
leaves the previous checkpoint in force; older step directories are then removed.

One run at a time: :func:`claim_checkpoint_dir` takes a non-blocking ``fcntl.flock`` on
``DIR/.lock`` (rank 0, for the whole run; the lock ends with the process, however it ends) and
writes its pid there. A second run on the same directory stops at once with "checkpoint
directory DIR is in use by another run (pid N)" instead of deleting the first run's step
directories. A checkpoint that DCP cannot save or load (torch raises ``CheckpointException``, a
``BaseException`` carrying every rank's traceback) becomes a one-line :class:`CheckpointError`
naming the checkpoint, the first failing rank and its error.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import time
from typing import Any, Callable, Dict, Mapping, Optional

import attrs
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_sparselift.atomic import write_json
from torchrec_sparselift.files import FileFormatError, Fields, load_json

__all__ = ["CHECKPOINT_SCHEMA", "CheckpointError", "CheckpointInfo", "CheckpointDirLock", "claim_checkpoint_dir",
           "describe_checkpoint_exception", "latest_checkpoint", "save_checkpoint", "load_checkpoint"]

CHECKPOINT_SCHEMA = "dlrm_example.checkpoint/1"
LATEST = "latest.json"
LOCK = ".lock"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from; the message says what to change."""


@attrs.frozen
class CheckpointInfo:
    """What ``latest.json`` records: completed steps, the DCP directory, the run's config."""

    step: int
    path: str
    config: Dict[str, Any]


#: seconds a run waits for a checkpoint directory's lock before refusing it: a run restarted right
#: after its crashed predecessor finds the lock held while that process is still being torn down
LOCK_WAIT_S = 10.0


class CheckpointDirLock:
    """An exclusive ``flock`` on ``DIR/.lock`` holding the owner's pid; released by :meth:`release`
    or when the process ends. ``wait_s``: how long to retry a held lock before refusing it."""

    def __init__(self, directory: str, wait_s: float = 0.0) -> None:
        self._fd: Optional[int] = None
        self.directory = directory
        self.path = os.path.join(directory, LOCK)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:  # a full disk, a read-only or missing mount: named, with the fix
            raise CheckpointError(f"cannot use checkpoint directory {directory} ({e.strerror}); free space there, "
                                  "fix its permissions, or give this run another --checkpoint-dir") from None
        deadline = time.monotonic() + max(wait_s, 0.0)
        failed: Optional[OSError] = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                held = e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
                if not held or time.monotonic() >= deadline:
                    failed = e
                    break
                time.sleep(0.2)
        if failed is not None:
            holder = _read_pid(fd)
            os.close(fd)
            if failed.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise CheckpointError(
                    f"checkpoint directory {directory} is in use by another run (pid {holder}); wait for it to "
                    "finish or give this run another --checkpoint-dir"
                ) from None
            raise CheckpointError(f"cannot lock checkpoint directory {directory} ({failed.strerror}); use another "
                                  "--checkpoint-dir") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)
            raise CheckpointError(f"cannot use checkpoint directory {directory} ({e.strerror}); free space there, "
                                  "fix its permissions, or give this run another --checkpoint-dir") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    __del__ = release

    def __enter__(self) -> "CheckpointDirLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_pid(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return pid if pid.isdigit() else "unknown"


def claim_checkpoint_dir(directory: str) -> Optional[CheckpointDirLock]:
    """Collective: rank 0 locks ``directory`` for this run (creating it), and every rank raises
    the same CheckpointError when another run holds it. Returns rank 0's lock (None elsewhere);
    keep it for the whole run."""
    lock, problem = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            lock = CheckpointDirLock(directory, wait_s=LOCK_WAIT_S)
        except CheckpointError as e:
            problem = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise CheckpointError(problem)
    return lock


def describe_checkpoint_exception(e: BaseException) -> str:
    """One line for torch's ``CheckpointException`` (one traceback per failed rank): the failed
    ranks and the first one's error; other exceptions as ``Type: message`` on one line."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        first = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        more = f" (ranks {sorted(failures)} failed)" if len(failures) > 1 else ""
        return f"rank {rank}: {_exception_line(first)}"[:400] + more
    return _exception_line(e)


def _exception_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else f"{type(e).__name__} (no message)"


def _dcp(call: Callable[[], Any], what: str, fix: str) -> None:
    try:
        call()
    except (CheckpointException, Exception) as e:  # noqa: BLE001 - torch's is a BaseException
        raise CheckpointError(f"{what}: {describe_checkpoint_exception(e)}; {fix}") from None


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def latest_checkpoint(directory: str, config: Mapping[str, Any]) -> Optional[CheckpointInfo]:
    """The checkpoint ``directory`` holds, or None when it holds none (missing directory or no
    ``latest.json``). Raises CheckpointError when the checkpoint is unreadable or was written
    by a run whose ``config`` differs (resuming it could not reproduce this run)."""
    marker = os.path.join(directory, LATEST)
    if not os.path.isfile(marker):
        return None
    try:
        f = Fields(load_json(marker, what="checkpoint marker", top=dict), file=marker, what="checkpoint marker")
        f.req("schema", str, choices=[CHECKPOINT_SCHEMA])
        info = CheckpointInfo(step=f.req("step", int, lo=1), path=f.req("path", str, nonempty=True),
                              config=f.req("config", dict))
    except FileFormatError as e:
        raise CheckpointError(f"the checkpoint in {directory} is unreadable: {e} (or remove {directory!r}, or "
                              "use another --checkpoint-dir)") from None
    if not os.path.isdir(os.path.join(directory, info.path)):
        raise CheckpointError(f"{marker} points at {info.path!r}, which is missing; remove {directory!r} to start over")
    want = json.loads(json.dumps(dict(config)))  # the same JSON round trip as the stored copy
    differ = sorted(k for k in set(want) | set(info.config) if want.get(k) != info.config.get(k))
    if differ:
        detail = ", ".join(f"{k}: {info.config.get(k)!r} -> {want.get(k)!r}" for k in differ[:4])
        raise CheckpointError(
            f"the checkpoint in {directory!r} was written by a different run ({detail}); "
            "use the same flags to resume, or another --checkpoint-dir to start over"
        )
    return info


def _state(model: Any, optimizer: Any) -> Dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def save_checkpoint(directory: str, step: int, model: Any, optimizer: Any, config: Mapping[str, Any]) -> str:
    """Collective (every rank calls it): save model and optimizer state after ``step`` completed
    steps, then (rank 0) point ``latest.json`` at it and remove older step directories.
    Returns the step directory."""
    path = _step_dir(directory, step)
    _dcp(lambda: dcp.save(_state(model, optimizer), checkpoint_id=path), f"cannot save checkpoint {path}",
         f"check free space and permissions of {directory}")
    dist.barrier()  # every rank's shards are on disk before the marker names them
    if dist.get_rank() == 0:
        marker = {"schema": CHECKPOINT_SCHEMA, "step": step, "path": os.path.basename(path), "config": dict(config)}
        write_json(os.path.join(directory, LATEST), marker, fsync=True)
        for name in os.listdir(directory):
            if name.startswith("step_") and name != os.path.basename(path):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    dist.barrier()
    return path


def load_checkpoint(directory: str, info: CheckpointInfo, model: Any, optimizer: Any) -> None:
    """Collective: load ``info``'s state into ``model`` and ``optimizer`` (built exactly as when
    it was saved; DCP reshards if the plan placed shards elsewhere). A damaged checkpoint raises
    CheckpointError on one line."""
    state = _state(model, optimizer)
    path = os.path.join(directory, info.path)
    _dcp(lambda: dcp.load(state, checkpoint_id=path), f"the checkpoint {path} cannot be loaded",
         f"it is damaged or incomplete: restore it, or remove {directory} (or use another --checkpoint-dir) "
         "to start over")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
