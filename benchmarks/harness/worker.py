"""One benchmark rank's setup and exit: the process group (gloo on CPU by default), one intra-op
thread, a seed, quiet logs, optionally the rank pinned to its own core; and the exit that skips
the interpreter's teardown after a torchrun worker's results are written."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from torchrec_sparselift.defaults import ranks_per_host
from torchrec_sparselift.dlrm.run import Cluster
from torchrec_sparselift.measure.probe import pin_rank_to_core

__all__ = ["quiet", "start_worker", "stop_worker", "worker", "exit_now", "names_arg"]


def quiet() -> None:
    """Errors only from the root logger and torch.fx's tracer; no Python warnings (a benchmark's
    output is its measurements)."""
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def start_worker(backend: str = "gloo", threads: Optional[int] = 1, seed: Optional[int] = None,
                 pin: bool = False, quiet_logs: bool = True, **init: Any) -> Cluster:
    """Join the process group torchrun set up (``init``: more ``init_process_group`` keywords, e.g.
    ``rank``, ``world_size``, ``store`` for a spawned rank); ``threads`` intra-op threads (None:
    torch's default); ``seed`` for torch's generator; ``pin``: this rank on its own core (CPU, as the
    step calibration and the DLRM example run). The device is CPU for gloo, this rank's GPU for nccl.
    Returns this rank of the group (``rank``, ``world_size``, ``pg``, ``device``, ``say``: rank 0 prints)."""
    if quiet_logs:
        quiet()
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group(backend=backend, **init)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if pin and device.type == "cpu":
        pin_rank_to_core(dist.group.WORLD)
    if seed is not None:
        torch.manual_seed(seed)
    return Cluster(rank=rank, world_size=world, local_world_size=ranks_per_host(world_size=world), device=device,
                   backend=backend)


def stop_worker() -> None:
    """Leave the process group (if one was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def worker(**kw: Any) -> Iterator[Cluster]:
    """:func:`start_worker` for the ``with`` block; the process group is left however it ends."""
    w = start_worker(**kw)
    try:
        yield w
    finally:
        stop_worker()


def exit_now(main: Callable[[], int]) -> None:
    """Run ``main()`` and exit with its code without the interpreter's teardown: everything is
    written and the process group destroyed by then, and torch/gloo's C++ threads can abort in the
    teardown ("terminate called without an active exception"), which torchrun reports as a failure."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def names_arg(parser: Any, flag: str, value: str, choices: Sequence[str]) -> List[str]:
    """A comma-separated ``value`` of ``flag`` as a list of names from ``choices``; the parser's
    error (exit 2, naming the flag, the culprits and the choices) for an unknown name or none."""
    names = [n for n in value.split(",") if n]
    bad = [n for n in names if n not in choices]
    if bad or not names:
        parser.error(f"{flag}: unknown {bad or 'none given'}; choose from {','.join(choices)}")
    return names
