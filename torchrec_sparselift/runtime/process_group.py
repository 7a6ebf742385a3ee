"""Closing a script's process group without an abort at exit.

A gloo worker thread drops the tensors of a collective a moment after the caller's ``wait``
returns, and dropping a tensor that Python also referenced takes the GIL. When the script ends in
that moment the interpreter is already finalizing, the worker thread is stopped while it waits for
the GIL, and the process aborts with "terminate called without an active exception" (SIGABRT,
core dumps show ``ProcessGroupGloo::runLoop`` in the aborting thread) although its work is done.
:func:`close_process_group` destroys the group and then yields the GIL for a moment, so the
workers finish first. Every entry point that owns a process group closes it with this.
"""

from __future__ import annotations

import time
from typing import Any, Optional

__all__ = ["SETTLE_S", "close_process_group"]

SETTLE_S = 0.05
"""Seconds the GIL is left free after the group is destroyed (gloo's workers need microseconds;
this is far above that and far below anything a user notices at the end of a job)."""


def close_process_group(group: Optional[Any] = None) -> None:
    """Destroy ``group`` (default: the default group and every other one, as
    ``torch.distributed.destroy_process_group`` does) if one is initialized, then sleep
    :data:`SETTLE_S` so gloo's worker threads release the last collective's tensors before the
    interpreter finalizes."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group(group)
    time.sleep(SETTLE_S)
