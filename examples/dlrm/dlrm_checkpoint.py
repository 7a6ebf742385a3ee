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
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Mapping, Optional

import attrs
import torch.distributed as dist

__all__ = ["CHECKPOINT_SCHEMA", "CheckpointError", "CheckpointInfo", "latest_checkpoint", "save_checkpoint", "load_checkpoint"]

CHECKPOINT_SCHEMA = "dlrm_example.checkpoint/1"
LATEST = "latest.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from; the message says what to change."""


@attrs.frozen
class CheckpointInfo:
    """What ``latest.json`` records: completed steps, the DCP directory, the run's config."""

    step: int
    path: str
    config: Dict[str, Any]


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
        with open(marker, encoding="utf-8") as f:
            data = json.load(f)
        info = CheckpointInfo(step=int(data["step"]), path=str(data["path"]), config=dict(data["config"]))
        if data.get("schema") != CHECKPOINT_SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {CHECKPOINT_SCHEMA!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker} is unreadable ({e}); remove {directory!r} or use another --checkpoint-dir") from e
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
    import torch.distributed.checkpoint as dcp

    path = _step_dir(directory, step)
    dcp.save(_state(model, optimizer), checkpoint_id=path)
    dist.barrier()  # every rank's shards are on disk before the marker names them
    if dist.get_rank() == 0:
        tmp = os.path.join(directory, LATEST + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"schema": CHECKPOINT_SCHEMA, "step": step, "path": os.path.basename(path), "config": dict(config)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, LATEST))
        for name in os.listdir(directory):
            if name.startswith("step_") and name != os.path.basename(path):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    dist.barrier()
    return path


def load_checkpoint(directory: str, info: CheckpointInfo, model: Any, optimizer: Any) -> None:
    """Collective: load ``info``'s state into ``model`` and ``optimizer`` (built exactly as when
    it was saved; DCP reshards if the plan placed shards elsewhere)."""
    import torch.distributed.checkpoint as dcp

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(directory, info.path))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
